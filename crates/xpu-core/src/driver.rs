//! Driver files: the user-space half of an accelerator driver (libraries, tools, ICD files, the
//! persistence daemon's socket) that a container needs next to the device nodes, found on the
//! host by `xpu-host::driver_files` and bind-mounted read-only by the CDI generator and the OCI
//! shim in `xpu-container`.
//!
//! NVIDIA splits its files by *driver capability*, the values of `NVIDIA_DRIVER_CAPABILITIES`
//! (<https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/docker-specialized.html>):
//! a container asking for `utility` gets `nvidia-smi` and NVML, one asking for `compute` gets
//! CUDA, and so on. AMD (ROCm) and Google (libtpu) ship their user space inside the container
//! image, so for them the host contributes device nodes only.
//!
//! This module holds the types and their parsing; it does no I/O.

use serde::{Deserialize, Serialize};

/// Whose driver a file belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverVendor {
    Nvidia,
    Amd,
    Google,
}

/// An NVIDIA driver capability, named as `NVIDIA_DRIVER_CAPABILITIES` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Capability {
    /// CUDA and OpenCL.
    Compute,
    /// 32-bit builds of the libraries, for 32-bit applications.
    Compat32,
    /// The X11 display driver.
    Display,
    /// OpenGL, Vulkan, EGL.
    Graphics,
    /// NVIDIA NGX (DLSS).
    Ngx,
    /// `nvidia-smi` and NVML.
    Utility,
    /// The video codec SDK (NVENC, NVDEC).
    Video,
}

impl Capability {
    pub const ALL: [Capability; 7] = [
        Capability::Compute,
        Capability::Compat32,
        Capability::Display,
        Capability::Graphics,
        Capability::Ngx,
        Capability::Utility,
        Capability::Video,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Compute => "compute",
            Capability::Compat32 => "compat32",
            Capability::Display => "display",
            Capability::Graphics => "graphics",
            Capability::Ngx => "ngx",
            Capability::Utility => "utility",
            Capability::Video => "video",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Capability {
    type Err = CapabilityError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| CapabilityError { value: s.to_owned() })
    }
}

/// A capability name that NVIDIA does not define.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown driver capability {value:?}; expected all or a comma-separated list of compute, compat32, display, graphics, ngx, utility, video"
)]
pub struct CapabilityError {
    pub value: String,
}

/// A set of capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Capabilities(u8);

impl Capabilities {
    pub const NONE: Capabilities = Capabilities(0);

    pub fn all() -> Self {
        Capability::ALL.into_iter().collect()
    }

    pub fn contains(self, c: Capability) -> bool {
        self.0 & c.bit() != 0
    }

    pub fn insert(&mut self, c: Capability) {
        self.0 |= c.bit();
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = Capability> {
        Capability::ALL.into_iter().filter(move |c| self.contains(*c))
    }

    /// `all`, or a comma-separated list (`utility,compute`); blanks around names are ignored
    /// and an empty list is the empty set. An unknown name is an error naming it.
    pub fn parse(list: &str) -> Result<Self, CapabilityError> {
        let mut set = Capabilities::NONE;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "all" {
                return Ok(Self::all());
            }
            set.insert(name.parse()?);
        }
        Ok(set)
    }
}

impl FromIterator<Capability> for Capabilities {
    fn from_iter<I: IntoIterator<Item = Capability>>(iter: I) -> Self {
        let mut set = Capabilities::NONE;
        for c in iter {
            set.insert(c);
        }
        set
    }
}

impl std::fmt::Display for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.iter().map(Capability::as_str).collect();
        f.write_str(&names.join(","))
    }
}

/// What a driver file is, which decides where it goes in the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    /// A shared library, mounted at its host path and at each of its soname links.
    Library,
    /// A tool (`nvidia-smi`), mounted at `/usr/bin/<name>`.
    Binary,
    /// A loader configuration file (Vulkan/EGL/OpenCL ICD), mounted at its host path.
    Config,
    /// A daemon's socket (`nvidia-persistenced`), mounted at its host path.
    Socket,
}

/// One file to mount into a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverFile {
    pub vendor: DriverVendor,
    pub capability: Capability,
    pub kind: FileKind,
    /// The file on the host, symlinks resolved, as seen from inside the host (never prefixed
    /// with `--root`).
    pub path: String,
    /// Where the container sees it: the same file bind-mounted at each path (a library's own
    /// path and its soname links `libcuda.so.1`, a tool's `/usr/bin/<name>`).
    pub container_paths: Vec<String>,
}

/// The driver files found on a host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverFiles {
    /// The NVIDIA driver version the libraries were matched against (`535.104.05`).
    pub nvidia_driver_version: Option<String>,
    pub files: Vec<DriverFile>,
    /// Problems met while searching; each names the file or directory.
    #[serde(default)]
    pub warnings: Vec<String>,
}

impl DriverFiles {
    /// The files of `vendor` that belong to any of `caps`.
    pub fn select(
        &self,
        vendor: DriverVendor,
        caps: Capabilities,
    ) -> impl Iterator<Item = &DriverFile> {
        self.files.iter().filter(move |f| f.vendor == vendor && caps.contains(f.capability))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_capability_lists() {
        let c = Capabilities::parse("utility, compute").unwrap();
        assert!(c.contains(Capability::Utility) && c.contains(Capability::Compute));
        assert!(!c.contains(Capability::Video));
        assert_eq!(c.to_string(), "compute,utility");
        assert_eq!(Capabilities::parse("compute,all").unwrap(), Capabilities::all());
        assert!(Capabilities::parse("").unwrap().is_empty());
        let e = Capabilities::parse("compute,gpu").unwrap_err();
        assert_eq!(e.value, "gpu");
        assert!(e.to_string().contains("unknown driver capability \"gpu\""));
    }
}
