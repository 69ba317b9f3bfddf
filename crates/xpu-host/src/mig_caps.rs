//! MIG capability nodes: what a container needs to use one MIG instance. The NVIDIA driver
//! guards each GPU instance and each compute instance with a capability, opened through a
//! character device `/dev/nvidia-caps/nvidia-cap<minor>` of the `nvidia-caps` major
//! (`/proc/devices`); the minor of each capability is listed in
//! `/proc/driver/nvidia-caps/mig-minors` (`gpu<gpu minor>/gi<id>/access <minor>` and
//! `gpu<gpu minor>/gi<id>/ci<id>/access <minor>`). A container given its GPU's `/dev/nvidiaN`
//! and the two nodes of one instance sees that instance and no other.
//!
//! Both files come from the host root (untrusted when it is not `/`): read bounded, parsed
//! strictly, every error naming the file and line.

use std::collections::BTreeMap;

use crate::Root;
use crate::root::ReadError;

pub const PROC_DEVICES: &str = "/proc/devices";
pub const MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";
/// The real file lists 32 GPUs × 15 instances × 9 capabilities (about 110 KB).
const MAX_BYTES: u64 = 1 << 20;

/// Why the MIG capability nodes are not known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigCapsError {
    #[error(
        "{path} {reason}; MIG needs the NVIDIA driver loaded with MIG support (nvidia-caps in /proc/devices)"
    )]
    Read { path: String, reason: String },
    #[error("{path} line {line}: {text:?} is not `<capability> <minor>`")]
    Line { path: String, line: usize, text: String },
    #[error(
        "{PROC_DEVICES} lists no nvidia-caps character major; the NVIDIA driver is not loaded with MIG support"
    )]
    NoMajor,
    #[error("{MIG_MINORS} has no {capability}")]
    NoCapability { capability: String },
}

/// One capability's device node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapNode {
    /// `/dev/nvidia-caps/nvidia-cap<minor>`.
    pub path: String,
    pub major: u32,
    pub minor: u32,
}

/// The `nvidia-caps` major and every capability's minor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigCaps {
    major: u32,
    minors: BTreeMap<String, u32>,
}

impl MigCaps {
    /// Reads both files from `root`.
    pub fn read(root: &Root) -> Result<MigCaps, MigCapsError> {
        let read = |path: &str| {
            root.read_bounded(&root.path(path), MAX_BYTES)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .map_err(|e: ReadError| MigCapsError::Read {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })
        };
        MigCaps::parse(&read(PROC_DEVICES)?, &read(MIG_MINORS)?)
    }

    /// Parses `/proc/devices` and `mig-minors`.
    pub fn parse(devices: &str, mig_minors: &str) -> Result<MigCaps, MigCapsError> {
        let major = devices
            .lines()
            .take_while(|l| !l.starts_with("Block devices"))
            .filter_map(|l| l.trim().split_once(' '))
            .find(|(_, name)| name.trim() == "nvidia-caps")
            .and_then(|(n, _)| n.parse().ok())
            .ok_or(MigCapsError::NoMajor)?;
        let mut minors = BTreeMap::new();
        for (i, l) in mig_minors.lines().enumerate() {
            if l.trim().is_empty() {
                continue;
            }
            let bad =
                || MigCapsError::Line { path: MIG_MINORS.into(), line: i + 1, text: l.into() };
            let (name, minor) = l.trim().split_once(' ').ok_or_else(bad)?;
            let minor: u32 = minor.trim().parse().map_err(|_| bad())?;
            if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad());
            }
            minors.insert(name.to_owned(), minor);
        }
        Ok(MigCaps { major, minors })
    }

    fn node(&self, capability: String) -> Result<CapNode, MigCapsError> {
        let minor =
            *self.minors.get(&capability).ok_or(MigCapsError::NoCapability { capability })?;
        Ok(CapNode {
            path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
            major: self.major,
            minor,
        })
    }

    /// The two nodes of compute instance `ci` of GPU instance `gi` on the GPU whose device
    /// node is `/dev/nvidia<gpu_minor>`: the GPU instance's, then the compute instance's.
    pub fn instance(&self, gpu_minor: u32, gi: u32, ci: u32) -> Result<[CapNode; 2], MigCapsError> {
        Ok([
            self.node(format!("gpu{gpu_minor}/gi{gi}/access"))?,
            self.node(format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"))?,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVICES: &str = "Character devices:\n  1 mem\n195 nvidia-frontend\n507 nvidia-caps\n\nBlock devices:\n  8 sd\n";

    #[test]
    fn an_instance_gets_its_two_nodes() {
        let caps = MigCaps::parse(DEVICES, &xpu_testkit::sysfs::mig_minors()).unwrap();
        let [gi, ci] = caps.instance(0, 1, 0).unwrap();
        assert_eq!(
            (gi.path.as_str(), gi.major, gi.minor),
            ("/dev/nvidia-caps/nvidia-cap12", 507, 12)
        );
        assert_eq!(ci.minor, 13);
        let [gi, _] = caps.instance(3, 2, 0).unwrap();
        assert_eq!(gi.minor, 3 + 3 * 135 + 2 * 9);
    }

    #[test]
    fn bad_files_are_refused_naming_the_line() {
        assert_eq!(
            MigCaps::parse("Character devices:\n195 nvidia\n", ""),
            Err(MigCapsError::NoMajor)
        );
        // A block major of that name does not count.
        assert_eq!(
            MigCaps::parse("Character devices:\n\nBlock devices:\n507 nvidia-caps\n", ""),
            Err(MigCapsError::NoMajor)
        );
        let e = MigCaps::parse(DEVICES, "config 1\ngpu0/gi1/access twelve\n").unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
        let caps = MigCaps::parse(DEVICES, "config 1\n").unwrap();
        let e = caps.instance(0, 1, 0).unwrap_err();
        assert!(e.to_string().contains("gpu0/gi1/access"), "{e}");
    }

    #[test]
    fn read_from_a_root_without_the_driver_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::new(dir.path()).unwrap();
        let e = MigCaps::read(&root).unwrap_err();
        assert!(e.to_string().contains("/proc/devices does not exist"), "{e}");
    }
}
