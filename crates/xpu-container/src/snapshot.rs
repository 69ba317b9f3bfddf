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

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xpu_core::driver::{Capabilities, DriverFiles};
use xpu_core::{Inventory, PciDevice};

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
const MAX_BYTES: u64 = 4 << 20;

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
    dirs.iter().find_map(|d| {
        let path = d.join(FILE_NAME);
        let snap = read(&path)?;
        Some((path, snap))
    })
}

fn read(path: &Path) -> Option<HostSnapshot> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    // Sized from the file's length: one read of it rather than a doubling series from 32 bytes.
    // The limit still holds if the file grows meanwhile.
    let len = f.metadata().ok()?.len();
    if len > MAX_BYTES {
        return None;
    }
    let mut bytes = Vec::with_capacity(len as usize + 1);
    f.take(MAX_BYTES + 1).read_to_end(&mut bytes).ok()?;
    if bytes.len() as u64 > MAX_BYTES {
        return None;
    }
    // Checked as UTF-8 once, in bulk, rather than string by string as `from_slice` does.
    let snap: HostSnapshot = serde_json::from_str(std::str::from_utf8(&bytes).ok()?).ok()?;
    (snap.format == FORMAT).then_some(snap)
}
