//! The host snapshot: what the runtime shim would discover, saved by `xpu cdi generate` next to
//! the CDI specs it writes (`xpu-host.snapshot` in `/var/run/cdi`), so a container start reads
//! one small file instead of walking sysfs and the library directories. This is
//! nvidia-container-toolkit's CDI mode made exact: the specs describe the devices for engines
//! that read CDI, and the snapshot holds the inventory and driver files the specs were made from,
//! so the shim computes a request's edits with the same code either way and the result for a
//! given request is the same (a test compares both paths on every fixture host).
//!
//! A snapshot is used only while it is current. It carries the host key of the moment it was
//! written (`xpu_host::host_key`: the PCI functions present, which of them each accelerator
//! driver and vfio-pci hold, and the NVIDIA driver's version line); the shim computes the key
//! again on every start (one directory listing per driver and one small read) and discovers
//! when it differs, when the snapshot is missing, unreadable or of another format, or when a
//! device node the selection needs is no longer the one recorded. `xpu cdi generate` runs again
//! when devices or drivers change (the packaged `xpu-cdi-generate.service`, started at boot and
//! by the udev rule on driver binds), so the fallback is the exception.
//!
//! The file is not named `*.json`: CDI loaders read every JSON and YAML file of their
//! directories as a spec.
//!
//! Every container start that asks for devices reads it, through the shim or the hook, so it
//! is read with [`crate::fsutil::read_regular`] (one `open` with `O_NONBLOCK` and one `fstat`,
//! as before): something else at its name (a FIFO, which would block every start, a link to a
//! device, a directory, a file over [`MAX_BYTES`]) is passed over with a warning
//! ([`load_noting`]), and the shim discovers.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xpu_core::driver::{Capabilities, DriverFiles};
use xpu_core::{Inventory, PciDevice};

use crate::fsutil::ReadError;
use crate::request::Wanted;

/// The snapshot's file name in a CDI directory.
pub const FILE_NAME: &str = "xpu-host.snapshot";
/// The directories searched by default: CDI's static and dynamic spec directories.
pub const DEFAULT_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
/// Bumped when the layout changes; a snapshot of another format is ignored (discovery is used).
/// Leaving out `null` fields ([`HostSnapshot::to_json`]) did not change it: this reader takes
/// files with and without them, and an older one fails to read the new file and discovers.
pub const FORMAT: u32 = 1;
/// Largest snapshot read: a host with hundreds of devices and every driver file is a few
/// hundred KiB.
pub const MAX_BYTES: u64 = 4 << 20;

/// What the shim needs of the host, as discovered when the snapshot was written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostSnapshot {
    pub format: u32,
    /// `xpu_host::host_key` when it was written.
    pub key: String,
    /// Every accelerator with its device nodes, and the host's control nodes and driver
    /// version (`discover_nodes` with no filter).
    pub inventory: Inventory,
    /// The driver files for every capability; a request takes those of its capabilities.
    pub driver_files: DriverFiles,
}

impl HostSnapshot {
    /// The inventory the shim's narrow discovery returns for `only`: the devices of the wanted
    /// vendors and kinds, in the same (PCI address) order, and the same host facts.
    pub fn inventory_for(&self, only: Option<&[Wanted]>) -> Inventory {
        let wanted = |d: &&PciDevice| {
            only.is_none_or(|only| {
                only.iter().any(|(vendor, kind)| {
                    d.kind == *kind && vendor.is_none_or(|v| d.vendor_id == Some(v))
                })
            })
        };
        // Only the devices taken are copied.
        Inventory {
            devices: self.inventory.devices.iter().filter(wanted).cloned().collect(),
            host: self.inventory.host.clone(),
            warnings: self.inventory.warnings.clone(),
        }
    }

    /// The driver files of `caps`, in the order a search for `caps` finds them.
    pub fn driver_files_for(&self, caps: Capabilities) -> DriverFiles {
        DriverFiles {
            nvidia_driver_version: self.driver_files.nvidia_driver_version.clone(),
            files: self
                .driver_files
                .files
                .iter()
                .filter(|f| caps.contains(f.capability))
                .cloned()
                .collect(),
            warnings: self.driver_files.warnings.clone(),
        }
    }

    /// The file's text: compact JSON without the `null` fields and the empty objects (a link
    /// state nothing is known of), which the types read back as absent. A container start
    /// parses the whole file, and on the fixture hosts this is a third smaller.
    pub fn to_json(&self) -> String {
        // A snapshot is plain data: strings, numbers and lists, which JSON always takes.
        let mut v = serde_json::to_value(self).unwrap_or_default();
        prune(&mut v);
        v.to_string()
    }
}

/// Drops `null` members and members that are empty objects, at every depth.
fn prune(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(m) => m.retain(|_, x| {
            prune(x);
            !x.is_null() && x.as_object().is_none_or(|o| !o.is_empty())
        }),
        Value::Array(a) => a.iter_mut().for_each(prune),
        _ => {}
    }
}

/// The first snapshot found in `dirs` that reads as one of this [`FORMAT`], with its path.
/// Missing, unreadable, oversized or foreign files are passed over: the caller discovers.
pub fn load(dirs: &[PathBuf]) -> Option<(PathBuf, HostSnapshot)> {
    load_noting(dirs, &mut Vec::new())
}

/// [`load`], with a warning in `warnings` for each file passed over that is there but is not a
/// readable regular file of at most [`MAX_BYTES`] (a FIFO, a link to a device, a directory, a
/// huge file): someone put it there, and every container start pays for it with a discovery.
/// A missing file, or one of another format, is passed over silently.
pub fn load_noting(
    dirs: &[PathBuf],
    warnings: &mut Vec<String>,
) -> Option<(PathBuf, HostSnapshot)> {
    dirs.iter().find_map(|d| {
        let path = d.join(FILE_NAME);
        let snap = read(&path, warnings)?;
        Some((path, snap))
    })
}

fn read(path: &Path, warnings: &mut Vec<String>) -> Option<HostSnapshot> {
    let bytes = match crate::fsutil::read_regular(path, MAX_BYTES) {
        Ok(b) => b,
        Err(ReadError::Missing) => return None,
        Err(e) => {
            warnings.push(format!(
                "host snapshot {}: {e}; not used (the host is discovered instead): remove it and run xpu cdi generate",
                path.display()
            ));
            return None;
        }
    };
    // Checked as UTF-8 once, in bulk, rather than string by string as `from_slice` does.
    let snap: HostSnapshot = serde_json::from_str(std::str::from_utf8(&bytes).ok()?).ok()?;
    (snap.format == FORMAT).then_some(snap)
}

#[cfg(test)]
mod tests {
    use super::*;

    use xpu_testkit::traps::Trap;

    fn snapshot() -> HostSnapshot {
        HostSnapshot {
            format: FORMAT,
            key: "k".to_owned(),
            inventory: Inventory::default(),
            driver_files: DriverFiles::default(),
        }
    }

    /// `load_noting(dirs)` on a thread: the test fails if it blocks (a FIFO without a writer
    /// blocks a plain `open` for ever), rather than hanging.
    fn load_promptly(dirs: Vec<PathBuf>) -> (Option<(PathBuf, HostSnapshot)>, Vec<String>) {
        xpu_testkit::traps::returns("loading the snapshot", move || {
            let mut w = Vec::new();
            let found = load_noting(&dirs, &mut w);
            (found, w)
        })
    }

    /// Issue 12: a FIFO (or a link to a device, a directory, a huge file) where the snapshot
    /// should be is passed over at once with a warning naming it, and the next directory's
    /// snapshot is used.
    #[test]
    fn a_snapshot_that_is_not_a_regular_file_is_passed_over_with_a_warning() {
        let first = tempfile::tempdir().unwrap();
        let second = tempfile::tempdir().unwrap();
        std::fs::write(second.path().join(FILE_NAME), snapshot().to_json()).unwrap();
        let at = first.path().join(FILE_NAME);
        type Plant = fn(&Path);
        let traps: [(Plant, &str); 5] = [
            (|p| Trap::Fifo.plant(p), "is a FIFO, not a regular file"),
            (|p| Trap::DevZero.plant(p), "is a character device, not a regular file"),
            (|p| std::fs::create_dir(p).unwrap(), "is a directory, not a regular file"),
            (|p| Trap::Huge.plant(p), "is too large: more than 4194304 bytes"),
            (
                |p| {
                    let l = std::os::unix::net::UnixListener::bind(p).unwrap();
                    // The socket file stays when the listener is closed.
                    drop(l);
                },
                "is a socket or a device, not a regular file",
            ),
        ];
        for (plant, said) in traps {
            // The last trap left a file or a directory (one of the two fails), the first none.
            let _ = std::fs::remove_file(&at);
            let _ = std::fs::remove_dir(&at);
            plant(&at);
            let dirs = vec![first.path().to_owned(), second.path().to_owned()];
            let (found, warnings) = load_promptly(dirs);
            let (path, snap) = found.expect("the second directory's snapshot");
            assert_eq!((path, snap), (second.path().join(FILE_NAME), snapshot()));
            let [w] = warnings.as_slice() else { panic!("one warning: {warnings:?}") };
            assert!(w.contains(&at.display().to_string()) && w.contains(said), "{said}: {w}");
            // Alone, it is no snapshot at all.
            let (found, warnings) = load_promptly(vec![first.path().to_owned()]);
            assert!(found.is_none() && warnings.len() == 1, "{said}");
        }
        // Missing and foreign files are passed over without a word.
        std::fs::remove_file(&at).unwrap();
        let (found, warnings) = load_promptly(vec![first.path().to_owned()]);
        assert!(found.is_none() && warnings.is_empty());
        std::fs::write(&at, "{\"format\": 0}").unwrap();
        let (found, warnings) = load_promptly(vec![first.path().to_owned()]);
        assert!(found.is_none() && warnings.is_empty());
    }
}
