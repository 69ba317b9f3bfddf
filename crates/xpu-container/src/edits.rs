//! What a container gets for a set of devices: device nodes (with the type, major and minor of
//! the host's real nodes, never guessed), the vendor's shared control nodes, read-only bind
//! mounts of driver files, and environment. The CDI generator ([`crate::cdi`]) writes these as
//! CDI `containerEdits`; the shim ([`crate::oci`]) and the hook ([`crate::hook`]) apply them to a
//! container. Nothing here does I/O.

use std::path::{Path, PathBuf};

use xpu_core::accel::{VENDOR_AMD, VENDOR_NVIDIA};
use xpu_core::driver::{Capabilities, Capability, DriverFiles, DriverVendor};
use xpu_core::inventory::{DevNode, NodeType};
use xpu_core::{DeviceKind, Inventory, PciDevice};

/// Mount options of every driver file: read-only, no set-uid, no device files.
pub const MOUNT_OPTIONS: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

/// A device node to create in the container.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeEdit {
    /// Path in the container, the same as on the host (`/dev/nvidia1`).
    pub path: String,
    pub node_type: NodeType,
    pub major: u32,
    pub minor: u32,
    /// Permission bits of the host's node.
    pub file_mode: Option<u32>,
}

impl NodeEdit {
    /// `c 195:1`, as cgroup v1's `devices.allow` and `ls -l` write it.
    pub fn type_char(&self) -> char {
        match self.node_type {
            NodeType::Char => 'c',
            NodeType::Block => 'b',
        }
    }
}

/// A read-only bind mount of a host file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MountEdit {
    /// The real file to mount (under the host root: `--root` or `root` in runtime.toml).
    pub source: PathBuf,
    pub destination: String,
}

/// Everything to add to one container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Edits {
    pub env: Vec<(String, String)>,
    pub nodes: Vec<NodeEdit>,
    pub mounts: Vec<MountEdit>,
    /// Things the container will miss (a control node the host lacks), for logs.
    pub warnings: Vec<String>,
}

impl Edits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.nodes.is_empty() && self.mounts.is_empty()
    }

    fn push_node(&mut self, n: NodeEdit) {
        if !self.nodes.iter().any(|x| x.path == n.path) {
            self.nodes.push(n);
        }
    }

    fn push_mount(&mut self, m: MountEdit) {
        if !self.mounts.iter().any(|x| x.destination == m.destination) {
            self.mounts.push(m);
        }
    }
}

/// Why edits cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EditError {
    #[error(
        "device node {path} of {owner} is not a character or block device, so its type, major and minor are unknown; load the driver that creates it or rebuild the fixture with real nodes"
    )]
    NodeWithoutNumbers { path: String, owner: String },
    #[error(
        "device {address} has no device nodes (driver: {driver}); bind it to its vendor's driver or to vfio-pci"
    )]
    NoNodes { address: String, driver: String },
}

/// A host node as an edit; a node without numbers is an error naming it and its owner.
pub fn node_edit(n: &DevNode, owner: &str) -> Result<NodeEdit, EditError> {
    match (n.node_type, n.major, n.minor) {
        (Some(t), Some(major), Some(minor)) => {
            Ok(NodeEdit { path: n.path.clone(), node_type: t, major, minor, file_mode: n.mode })
        }
        _ => Err(EditError::NodeWithoutNumbers { path: n.path.clone(), owner: owner.to_owned() }),
    }
}

/// The nodes of one device.
pub fn device_nodes(d: &PciDevice) -> Result<Vec<NodeEdit>, EditError> {
    if d.dev_nodes.is_empty() {
        return Err(EditError::NoNodes {
            address: d.address.to_string(),
            driver: d.driver.clone().unwrap_or_else(|| "none".to_owned()),
        });
    }
    let owner = d.address.to_string();
    d.dev_nodes.iter().map(|n| node_edit(n, &owner)).collect()
}

pub use xpu_core::inventory::is_nvidia_gpu_node;

/// Whether a device hands its NVIDIA driver to the container (it has `/dev/nvidiaN`; a GPU on
/// vfio-pci hands over its VFIO group instead and needs no driver files).
pub fn uses_nvidia_driver(d: &PciDevice) -> bool {
    d.vendor_id == Some(VENDOR_NVIDIA) && d.dev_nodes.iter().any(|n| is_nvidia_gpu_node(&n.path))
}

/// NVIDIA's shared nodes: `nvidiactl` always, UVM for CUDA, `nvidia-modeset` for display work.
/// `caps` `None` means every capability (CDI specs are not per capability).
fn nvidia_control_paths(caps: Option<Capabilities>) -> Vec<&'static str> {
    let has = |c: Capability| caps.is_none_or(|s| s.contains(c));
    let mut v = vec!["/dev/nvidiactl"];
    if has(Capability::Compute) {
        v.extend(["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]);
    }
    if has(Capability::Display) || has(Capability::Graphics) {
        v.push("/dev/nvidia-modeset");
    }
    v
}

/// The control nodes the devices at `devices` (indices into `inv.devices`) need, from the host's
/// real nodes. `nvidia_driver` adds NVIDIA's even without an NVIDIA device (`none`).
pub fn control_nodes(
    inv: &Inventory,
    devices: &[usize],
    nvidia_driver: bool,
    caps: Option<Capabilities>,
    edits: &mut Edits,
) -> Result<(), EditError> {
    let mut wanted: Vec<&str> = Vec::new();
    let mut nvidia = nvidia_driver;
    for &i in devices {
        let d = &inv.devices[i];
        nvidia |= uses_nvidia_driver(d);
        if d.dev_nodes.iter().any(|n| n.path.starts_with("/dev/vfio/")) {
            wanted.push("/dev/vfio/vfio");
        }
        if d.vendor_id == Some(VENDOR_AMD)
            && d.kind == DeviceKind::Gpu
            && d.dev_nodes.iter().any(|n| n.path.starts_with("/dev/dri/"))
        {
            wanted.push("/dev/kfd");
        }
    }
    if nvidia {
        wanted.extend(nvidia_control_paths(caps));
    }
    for path in wanted {
        match inv.host.control_nodes.iter().find(|n| n.path == path) {
            Some(n) => edits.push_node(node_edit(n, "the host")?),
            None => edits
                .warnings
                .push(format!("control node {path} is missing on the host; not added")),
        }
    }
    Ok(())
}

/// Read-only bind mounts of `vendor`'s driver files for `caps`; sources are real paths under
/// `host_root`.
pub fn driver_mounts(
    files: &DriverFiles,
    vendor: DriverVendor,
    caps: Capabilities,
    host_root: &Path,
    edits: &mut Edits,
) {
    for f in files.select(vendor, caps) {
        let source = host_root.join(f.path.trim_start_matches('/'));
        for dest in &f.container_paths {
            edits.push_mount(MountEdit { source: source.clone(), destination: dest.clone() });
        }
    }
}

/// Which devices a container gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Indices into `Inventory::devices`, in address order, without repeats.
    pub devices: Vec<usize>,
    /// NVIDIA's driver (control nodes, files) without a device: `NVIDIA_VISIBLE_DEVICES=none`.
    pub nvidia_driver: bool,
    /// NVIDIA driver capabilities for the driver files.
    pub capabilities: Capabilities,
}

impl Selection {
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty() && !self.nvidia_driver
    }

    pub fn add(&mut self, i: usize) {
        if let Err(pos) = self.devices.binary_search(&i) {
            self.devices.insert(pos, i);
        }
    }

    /// Whether NVIDIA's user space goes in.
    pub fn wants_nvidia_driver(&self, inv: &Inventory) -> bool {
        self.nvidia_driver || self.devices.iter().any(|&i| uses_nvidia_driver(&inv.devices[i]))
    }
}

/// The edits for a selection: its devices' nodes, their control nodes, and (for NVIDIA) the
/// driver files of the selected capabilities.
pub fn for_selection(
    inv: &Inventory,
    files: Option<&DriverFiles>,
    sel: &Selection,
    host_root: &Path,
) -> Result<Edits, EditError> {
    let mut edits = Edits::default();
    for &i in &sel.devices {
        for n in device_nodes(&inv.devices[i])? {
            edits.push_node(n);
        }
    }
    control_nodes(inv, &sel.devices, sel.nvidia_driver, Some(sel.capabilities), &mut edits)?;
    if sel.wants_nvidia_driver(inv)
        && let Some(files) = files
    {
        driver_mounts(files, DriverVendor::Nvidia, sel.capabilities, host_root, &mut edits);
    }
    Ok(edits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_node_names() {
        assert!(is_nvidia_gpu_node("/dev/nvidia0"));
        assert!(is_nvidia_gpu_node("/dev/nvidia15"));
        assert!(!is_nvidia_gpu_node("/dev/nvidiactl"));
        assert!(!is_nvidia_gpu_node("/dev/nvidia-uvm"));
        assert!(!is_nvidia_gpu_node("/dev/nvidia"));
    }

    #[test]
    fn control_nodes_follow_capabilities() {
        let utility = Capabilities::parse("utility").unwrap();
        assert_eq!(nvidia_control_paths(Some(utility)), ["/dev/nvidiactl"]);
        let compute = Capabilities::parse("utility,compute").unwrap();
        assert_eq!(
            nvidia_control_paths(Some(compute)),
            ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        );
        assert_eq!(nvidia_control_paths(None).len(), 4);
    }

    #[test]
    fn node_without_numbers_is_an_error_naming_it() {
        let n = DevNode {
            path: "/dev/nvidia3".into(),
            node_type: None,
            major: None,
            minor: None,
            mode: Some(0o666),
            uid: Some(0),
            gid: Some(0),
        };
        let e = node_edit(&n, "0000:4d:00.0").unwrap_err();
        assert!(e.to_string().starts_with("device node /dev/nvidia3 of 0000:4d:00.0 is not"));
    }
}
