//! Settings of the shim and the hook: `/etc/xpu/runtime.toml`, or the file named by
//! `XPU_RUNTIME_CONFIG` (so tests and users can point them at a fixture host).
//!
//! ```toml
//! root = "/"                              # host root for discovery and driver files
//! runtime = "runc"                        # the real OCI runtime: a path, or a name in $PATH
//! log_file = "/var/log/xpu-runtime.log"   # optional: one line per create
//! default_capabilities = "utility,compute" # when NVIDIA_DRIVER_CAPABILITIES is unset
//! cuda_version = "12.2"                   # optional: the CUDA driver version for NVIDIA_REQUIRE_*
//! cdi_dirs = ["/etc/cdi", "/var/run/cdi"] # where `xpu cdi generate` left a host snapshot;
//!                                         # [] always discovers
//! ```
//!
//! A missing `/etc/xpu/runtime.toml` means the defaults; a missing file named by
//! `XPU_RUNTIME_CONFIG` is an error (someone asked for it). Unknown keys are errors naming them.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use xpu_core::driver::Capabilities;

use crate::nvml::Version;

pub const DEFAULT_PATH: &str = "/etc/xpu/runtime.toml";
pub const ENV_VAR: &str = "XPU_RUNTIME_CONFIG";

/// The settings, with defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    pub root: PathBuf,
    pub runtime: String,
    pub log_file: Option<PathBuf>,
    pub default_capabilities: Capabilities,
    pub cuda_version: Option<Version>,
    /// Directories searched, in order, for the host snapshot `xpu cdi generate` writes beside
    /// its specs ([`crate::snapshot`]); empty: always discover.
    pub cdi_dirs: Vec<PathBuf>,
    /// Where the settings came from (for messages); `None` for built-in defaults.
    pub source: Option<PathBuf>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/"),
            runtime: "runc".to_owned(),
            log_file: None,
            default_capabilities: Capabilities::parse("utility,compute").unwrap_or_default(),
            cuda_version: None,
            cdi_dirs: crate::snapshot::DEFAULT_DIRS.iter().map(PathBuf::from).collect(),
            source: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    root: Option<PathBuf>,
    runtime: Option<String>,
    log_file: Option<PathBuf>,
    default_capabilities: Option<String>,
    cuda_version: Option<String>,
    cdi_dirs: Option<Vec<PathBuf>>,
}

/// Why the settings cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("runtime config {} (from {ENV_VAR}) cannot be read; fix the path or unset {ENV_VAR}", path.display())]
    Missing { path: PathBuf, source: std::io::Error },
    #[error("runtime config {} cannot be read", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("runtime config {}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

impl RuntimeConfig {
    /// From `$XPU_RUNTIME_CONFIG` when set, else `/etc/xpu/runtime.toml` when it exists, else
    /// the defaults.
    pub fn load_default() -> Result<Self, ConfigError> {
        match std::env::var_os(ENV_VAR) {
            Some(p) if !p.is_empty() => {
                let path = PathBuf::from(p);
                match std::fs::read_to_string(&path) {
                    Ok(text) => Self::parse(&text, &path),
                    Err(source) => Err(ConfigError::Missing { path, source }),
                }
            }
            _ => Self::load_optional(Path::new(DEFAULT_PATH)),
        }
    }

    /// From `path` when it exists, else the defaults.
    pub fn load_optional(path: &Path) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read { path: path.to_owned(), source }),
        }
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid { path: path.to_owned(), message };
        let f: File = toml::from_str(text).map_err(|e| invalid(e.to_string().trim().to_owned()))?;
        let d = Self::default();
        let default_capabilities = match f.default_capabilities {
            None => d.default_capabilities,
            Some(s) => Capabilities::parse(&s)
                .map_err(|e| invalid(format!("default_capabilities: {e}")))?,
        };
        let cuda_version = match f.cuda_version {
            None => None,
            Some(s) => Some(Version::parse(&s).ok_or_else(|| {
                invalid(format!("cuda_version {s:?} is not a version like \"12.2\""))
            })?),
        };
        if let Some(r) = &f.root
            && !r.is_absolute()
        {
            return Err(invalid(format!("root {} must be an absolute path", r.display())));
        }
        if let Some(dir) = f.cdi_dirs.iter().flatten().find(|d| !d.is_absolute()) {
            return Err(invalid(format!("cdi_dirs: {} must be an absolute path", dir.display())));
        }
        Ok(Self {
            cdi_dirs: f.cdi_dirs.unwrap_or(d.cdi_dirs),
            root: f.root.unwrap_or(d.root),
            runtime: f.runtime.filter(|r| !r.is_empty()).unwrap_or(d.runtime),
            log_file: f.log_file,
            default_capabilities,
            cuda_version,
            source: Some(path.to_owned()),
        })
    }

    /// Appends `line` to the log file, if one is configured. Logging never fails a container.
    pub fn log(&self, line: &str) {
        if let Some(path) = &self.log_file {
            append_log(path, line);
        }
    }
}

/// Appends `line` to the log file at `path` as [`RuntimeConfig::log`] does, for a part of the
/// shim that keeps only the log's path.
pub fn append_log(path: &Path, line: &str) {
    use std::io::Write;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // One write, so that lines of concurrent containers do not interleave (`O_APPEND`).
    let entry = format!("{secs} xpu[{}]: {line}\n", std::process::id());
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        // Logging never fails a container.
        let _ = f.write_all(entry.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let c = RuntimeConfig::parse(
            "root = \"/srv/host\"\nruntime = \"/usr/sbin/runc\"\ncuda_version = \"12.2\"\ndefault_capabilities = \"all\"\n",
            Path::new("t.toml"),
        )
        .unwrap();
        assert_eq!(c.root, PathBuf::from("/srv/host"));
        assert_eq!(c.runtime, "/usr/sbin/runc");
        assert_eq!(c.cuda_version, Version::parse("12.2"));
        assert_eq!(c.default_capabilities, Capabilities::all());
        let d = RuntimeConfig::parse("", Path::new("t.toml")).unwrap();
        assert_eq!(d.runtime, "runc");
        assert_eq!(d.default_capabilities.to_string(), "compute,utility");
    }

    /// With several bad values, the first reported is `cuda_version`, then `root`, then
    /// `cdi_dirs`; an empty `runtime` means runc.
    #[test]
    fn problems_are_reported_in_order() {
        let p = Path::new("/etc/xpu/runtime.toml");
        let message = |text: &str| RuntimeConfig::parse(text, p).unwrap_err().to_string();
        assert!(message("root = \"rel\"\ncuda_version = \"x\"\n").contains("cuda_version \"x\""));
        assert!(message("root = \"rel\"\ncdi_dirs = [\"cdi\"]\n").contains("root rel must be"));
        assert!(message("cdi_dirs = [\"/etc/cdi\", \"cdi\"]\n").contains("cdi_dirs: cdi must be"));
        assert_eq!(RuntimeConfig::parse("runtime = \"\"", p).unwrap().runtime, "runc");
        assert_eq!(Version::parse(" 12.2 "), Some(Version(vec![12, 2])));
        assert_eq!(Version::parse("12."), None);
    }

    #[test]
    fn bad_files_name_the_problem() {
        let e = RuntimeConfig::parse("runtim = \"x\"", Path::new("/etc/xpu/runtime.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("runtime config /etc/xpu/runtime.toml:"), "{e}");
        assert!(e.contains("runtim"), "{e}");
        let e = RuntimeConfig::parse("default_capabilities = \"gpu\"", Path::new("r.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown driver capability \"gpu\""), "{e}");
        let e = RuntimeConfig::parse("root = \"rel\"", Path::new("r.toml")).unwrap_err();
        assert!(e.to_string().contains("must be an absolute path"));
    }
}
