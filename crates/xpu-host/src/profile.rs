//! Host profiles: what a host is being prepared for, and what each one wants from the kernel,
//! the drivers and the limits. `xpu doctor` checks these facts, `xpu host render|apply` writes
//! them; both read them from here so they cannot drift apart.
//!
//! - `vfio-host`: a hypervisor that passes accelerators through to VMs (the OpenStack seed):
//!   IOMMU on, `vfio-pci` owning the accelerators, memory lockable for DMA mappings.
//! - `tpu-vm`: a Cloud TPU VM image (the custom-image seed): TPU chips on `vfio-pci` with
//!   `/dev/vfio/N` open to all users, `idle=poll`, `intel_iommu=on,sm_on`, THP always.
//! - `container-host`: accelerators on their vendor drivers, handed to containers (CDI, the
//!   device plugin): cgroup controllers and vendor device nodes.
//! - `all` (doctor only): every host-wide check of the three; per device, whatever the device is
//!   set up for (on `vfio-pci`: passthrough checks; on a vendor driver: container checks).

use std::fmt;
use std::str::FromStr;

/// What the host is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Profile {
    VfioHost,
    TpuVm,
    ContainerHost,
    All,
}

/// The profile name is not one of the four.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown profile {0:?}; expected vfio-host, tpu-vm, container-host or all")]
pub struct UnknownProfile(pub String);

impl Profile {
    pub const ALL: [Profile; 4] =
        [Profile::VfioHost, Profile::TpuVm, Profile::ContainerHost, Profile::All];

    pub fn as_str(self) -> &'static str {
        match self {
            Profile::VfioHost => "vfio-host",
            Profile::TpuVm => "tpu-vm",
            Profile::ContainerHost => "container-host",
            Profile::All => "all",
        }
    }

    /// Whether `self` includes the checks of `p` (`all` includes every profile).
    pub fn covers(self, p: Profile) -> bool {
        self == p || self == Profile::All
    }

    /// Profiles whose accelerators are handed to a guest through `vfio-pci`.
    pub fn wants_vfio(self) -> bool {
        matches!(self, Profile::VfioHost | Profile::TpuVm | Profile::All)
    }

    /// Kernel command-line parameters the profile needs on a CPU of `vendor` (`intel`/`amd`).
    ///
    /// - vfio-host, Intel: `intel_iommu=on iommu=pt` (VT-d is off unless asked for on many
    ///   kernels; `pt` keeps host-owned devices on identity mappings).
    /// - vfio-host, AMD: `iommu=pt`. The AMD IOMMU driver is enabled by default when the firmware
    ///   has an IVRS table; `amd_iommu=` accepts no `on` value (kernel-parameters.txt lists
    ///   `fullflush`, `off`, `force_enable`, `force_isolation`...), so xpu does not write one.
    /// - tpu-vm (custom-image seed): `idle=poll`, `intel_iommu=on,sm_on` (TPU7x and v5p need
    ///   scalable mode), `transparent_hugepage=always`; AMD hosts get the two that are not VT-d.
    /// - container-host: none.
    pub fn kernel_params(self, vendor: CpuVendor) -> Vec<&'static str> {
        let intel = vendor == CpuVendor::Intel;
        match self {
            Profile::VfioHost if intel => vec!["intel_iommu=on", "iommu=pt"],
            Profile::VfioHost => vec!["iommu=pt"],
            Profile::TpuVm if intel => {
                vec!["idle=poll", "intel_iommu=on,sm_on", "transparent_hugepage=always"]
            }
            Profile::TpuVm => vec!["idle=poll", "transparent_hugepage=always"],
            Profile::ContainerHost => vec![],
            Profile::All => {
                let mut v = Profile::VfioHost.kernel_params(vendor);
                for p in Profile::TpuVm.kernel_params(vendor) {
                    // tpu-vm's `intel_iommu=on,sm_on` covers vfio-host's `intel_iommu=on`.
                    let key = param_key(p);
                    if let Some(i) = v.iter().position(|q| param_key(q) == key) {
                        v[i] = p;
                    } else {
                        v.push(p);
                    }
                }
                v
            }
        }
    }

    /// The mode `/dev/vfio/<group>` must have, when the profile cares: the TPU runtime runs as
    /// an ordinary user, so the custom-image seed opens the nodes to everyone (0666). On a
    /// vfio-host, libvirt gives each node to its QEMU process itself; the kernel's 0600 is right.
    pub fn vfio_node_mode(self) -> Option<u32> {
        match self {
            Profile::TpuVm => Some(0o666),
            _ => None,
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Profile {
    type Err = UnknownProfile;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| UnknownProfile(s.to_owned()))
    }
}

/// The CPU vendor, which picks the IOMMU kernel parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuVendor {
    Intel,
    Amd,
}

impl CpuVendor {
    /// From the inventory's `host.cpu_vendor` (`intel`, `amd`).
    pub fn from_inventory(v: Option<&str>) -> Option<Self> {
        match v {
            Some("intel") => Some(CpuVendor::Intel),
            Some("amd") => Some(CpuVendor::Amd),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CpuVendor::Intel => "intel",
            CpuVendor::Amd => "amd",
        }
    }
}

impl FromStr for CpuVendor {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "intel" => Ok(CpuVendor::Intel),
            "amd" => Ok(CpuVendor::Amd),
            _ => Err(format!("unknown CPU vendor {s:?}; expected intel or amd")),
        }
    }
}

/// `intel_iommu=on,sm_on` → `intel_iommu`; `quiet` → `quiet`.
pub fn param_key(p: &str) -> &str {
    p.split_once('=').map_or(p, |(k, _)| k)
}

/// Parameters whose value is a comma-separated list of independent options, so
/// `intel_iommu=on,sm_on` satisfies a wish for `intel_iommu=on` and two wishes merge.
const LIST_PARAMS: [&str; 1] = ["intel_iommu"];

/// Whether a present parameter (`intel_iommu=sm_on,on`) satisfies a wanted one
/// (`intel_iommu=on`). Keys must match; list-valued parameters compare as sets.
pub fn param_satisfies(present: &str, wanted: &str) -> bool {
    if param_key(present) != param_key(wanted) {
        return false;
    }
    let key = param_key(wanted);
    let value = |p: &str| p.split_once('=').map(|(_, v)| v.to_owned());
    match (value(present), value(wanted)) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(have), Some(want)) if LIST_PARAMS.contains(&key) => {
            let have: Vec<&str> = have.split(',').collect();
            want.split(',').all(|w| have.contains(&w))
        }
        (Some(have), Some(want)) => have == want,
    }
}

/// The parameter to write in place of `present` so it satisfies `wanted`: list-valued
/// parameters keep their other options (`intel_iommu=on,igfx_off` + `on,sm_on` →
/// `on,igfx_off,sm_on`); any other value is replaced.
pub fn param_merge(present: &str, wanted: &str) -> String {
    let key = param_key(wanted);
    if LIST_PARAMS.contains(&key)
        && let (Some((_, have)), Some((_, want))) =
            (present.split_once('='), wanted.split_once('='))
    {
        let mut opts: Vec<&str> = have.split(',').filter(|o| !o.is_empty()).collect();
        for w in want.split(',') {
            if !opts.contains(&w) {
                opts.push(w);
            }
        }
        return format!("{key}={}", opts.join(","));
    }
    wanted.to_owned()
}

/// Whether the command line (`/proc/cmdline`) satisfies `wanted`. The kernel lets the last
/// occurrence of a parameter win, so only that one counts.
pub fn cmdline_has(cmdline: &str, wanted: &str) -> bool {
    let key = param_key(wanted);
    cmdline
        .split_whitespace()
        // Everything after `--` is for init, not the kernel.
        .take_while(|t| *t != "--")
        .filter(|t| param_key(t) == key)
        .last()
        .is_some_and(|t| param_satisfies(t, wanted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_is_clear() {
        for p in Profile::ALL {
            assert_eq!(p.as_str().parse::<Profile>().unwrap(), p);
        }
        let e = "gpu-host".parse::<Profile>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown profile \"gpu-host\"; expected vfio-host, tpu-vm, container-host or all"
        );
    }

    #[test]
    fn kernel_params_per_vendor() {
        assert_eq!(
            Profile::VfioHost.kernel_params(CpuVendor::Intel),
            ["intel_iommu=on", "iommu=pt"]
        );
        assert_eq!(Profile::VfioHost.kernel_params(CpuVendor::Amd), ["iommu=pt"]);
        assert_eq!(
            Profile::TpuVm.kernel_params(CpuVendor::Intel),
            ["idle=poll", "intel_iommu=on,sm_on", "transparent_hugepage=always"]
        );
        assert_eq!(
            Profile::All.kernel_params(CpuVendor::Intel),
            ["intel_iommu=on,sm_on", "iommu=pt", "idle=poll", "transparent_hugepage=always"]
        );
    }

    #[test]
    fn list_params_compare_as_sets() {
        assert!(param_satisfies("intel_iommu=sm_on,on", "intel_iommu=on"));
        assert!(param_satisfies("intel_iommu=on,sm_on", "intel_iommu=on,sm_on"));
        assert!(!param_satisfies("intel_iommu=on", "intel_iommu=on,sm_on"));
        assert!(!param_satisfies("transparent_hugepage=madvise", "transparent_hugepage=always"));
        assert!(param_satisfies("idle=poll", "idle=poll"));
        assert!(!param_satisfies("idle", "idle=poll"));
        assert_eq!(
            param_merge("intel_iommu=on,igfx_off", "intel_iommu=on,sm_on"),
            "intel_iommu=on,igfx_off,sm_on"
        );
        assert_eq!(
            param_merge("transparent_hugepage=never", "transparent_hugepage=always"),
            "transparent_hugepage=always"
        );
    }

    #[test]
    fn cmdline_last_occurrence_wins() {
        assert!(cmdline_has("ro intel_iommu=off intel_iommu=on", "intel_iommu=on"));
        assert!(!cmdline_has("ro intel_iommu=on intel_iommu=off", "intel_iommu=on"));
        assert!(!cmdline_has("ro -- idle=poll", "idle=poll"));
    }
}
