//! The accelerators of a mixed node kept for the VMs OpenStack Nova starts: one list that both
//! sides read, so Nova and Kubernetes never hand out the same device.
//!
//! `/etc/xpu/vm-devices` (under the root): one PCI address per line (`0000:07:00.0`, or the
//! short `07:00.0`), `#` starting a comment, blank lines ignored. `xpu openstack nova-config`
//! renders `[pci]` for exactly these devices; the device plugin and the DRA driver leave them
//! out of what they offer (and the DRA driver never moves one to `vfio-pci` for a claim). No
//! file: the node is not mixed, and each side offers every accelerator it manages, as before.
//!
//! A file that cannot be read or parsed is an error naming the line; the agents then offer
//! nothing rather than risk offering a device Nova may hold.

use std::collections::BTreeSet;

use xpu_core::PciAddress;

use crate::Root;

/// Where the list lives, as a host path.
pub const VM_DEVICES: &str = "/etc/xpu/vm-devices";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmDevicesError {
    #[error("{path}: {reason}; fix the file or remove it")]
    Read { path: String, reason: String },
    #[error(
        "{path}:{line}: {text:?} is not a PCI address (dddd:bb:dd.f, as `xpu discover` prints it); fix the line or remove it"
    )]
    Line { path: String, line: usize, text: String },
}

/// The devices `path` (a host path under `root`; [`VM_DEVICES`] normally) lists, or `None`
/// when there is no such file.
pub fn read(root: &Root, path: &str) -> Result<Option<BTreeSet<PciAddress>>, VmDevicesError> {
    let file = root
        .read_file(path)
        .map_err(|e| VmDevicesError::Read { path: path.to_owned(), reason: e.to_string() })?;
    let Some(file) = file else { return Ok(None) };
    let text = String::from_utf8(file.bytes).map_err(|_| VmDevicesError::Read {
        path: path.to_owned(),
        reason: "not UTF-8 text".to_owned(),
    })?;
    parse(path, &text).map(Some)
}

/// Parses the list's text (`path` names it in errors).
pub fn parse(path: &str, text: &str) -> Result<BTreeSet<PciAddress>, VmDevicesError> {
    let mut out = BTreeSet::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let address = line.parse::<PciAddress>().map_err(|_| VmDevicesError::Line {
            path: path.to_owned(),
            line: i + 1,
            text: xpu_core::nova::excerpt(line),
        })?;
        out.insert(address);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_comments_and_blank_lines() {
        let text = "# kept for Nova\n0000:07:00.0\n\n  0f:00.0   # short form\n0000:07:00.0\n";
        let set = parse("f", text).unwrap();
        let want: BTreeSet<PciAddress> =
            ["0000:07:00.0", "0000:0f:00.0"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(set, want);
    }

    #[test]
    fn a_bad_line_is_named_with_its_number() {
        let e = parse("/etc/xpu/vm-devices", "0000:07:00.0\ngpu0\n").unwrap_err().to_string();
        assert!(e.starts_with("/etc/xpu/vm-devices:2: \"gpu0\" is not a PCI address"), "{e}");
        let long = "x".repeat(10_000);
        let e = parse("f", &long).unwrap_err().to_string();
        assert!(e.len() < 400, "the line is quoted in part: {}", e.len());
    }

    #[test]
    fn no_file_is_none_and_a_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::new(dir.path()).unwrap();
        assert_eq!(read(&root, VM_DEVICES).unwrap(), None);
        std::fs::create_dir_all(dir.path().join("etc/xpu")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("etc/xpu/vm-devices")).unwrap();
        let e = read(&root, VM_DEVICES).unwrap_err().to_string();
        assert!(e.starts_with("/etc/xpu/vm-devices"), "{e}");
        std::fs::remove_file(dir.path().join("etc/xpu/vm-devices")).unwrap();
        std::fs::write(dir.path().join("etc/xpu/vm-devices"), "07:00.0\n").unwrap();
        assert_eq!(read(&root, VM_DEVICES).unwrap().unwrap().len(), 1);
    }
}
