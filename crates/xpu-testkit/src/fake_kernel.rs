//! A fake of the kernel's PCI driver core, acting on a fixture tree, for testing code that
//! binds and unbinds drivers through [`xpu_core::kernel::Kernel`].
//!
//! It models what the real kernel does in reaction to each write
//! (Documentation/ABI/testing/sysfs-bus-pci):
//! - `driver_override`: stores the name; an empty write clears it (reads back as `(null)`);
//! - `drivers/<d>/unbind`: fails (`ENODEV`) unless the device is bound to `<d>`; removes the
//!   device's `driver` link and the driver's back-link; the last device of a group leaving
//!   `vfio-pci` removes `/dev/vfio/<group>`;
//! - `drivers_probe`: a bound device stays as it is; an unbound one binds to its
//!   `driver_override` when that driver is loaded (`sys/bus/pci/drivers/<d>` exists), otherwise
//!   to nothing (the fake knows no id tables); binding to `vfio-pci` creates `/dev/vfio/<group>`
//!   (mode 0600, as the kernel creates it);
//! - `modprobe vfio-pci`: creates `sys/bus/pci/drivers/vfio-pci`, `sys/module/vfio_pci` (and
//!   `vfio` with its container node `/dev/vfio/vfio`) and the `/proc/modules` line.
//!
//! Every operation is recorded in order ([`FakeKernel::ops`]); [`FakeKernel::fail_at`] makes the
//! Nth operation fail without effect, for rollback tests.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use xpu_core::PciAddress;
use xpu_core::kernel::{Kernel, KernelError, KernelOp, module_name};

/// The fake kernel. Holds the fixture root it acts on.
#[derive(Debug)]
pub struct FakeKernel {
    root: PathBuf,
    ops: Vec<KernelOp>,
    fail_at: Option<usize>,
}

impl FakeKernel {
    pub fn new(root: &Path) -> Self {
        Self { root: root.to_path_buf(), ops: Vec::new(), fail_at: None }
    }

    /// Makes the `n`th operation (1-based, counting from now on) fail without effect.
    pub fn fail_at(mut self, n: usize) -> Self {
        self.fail_at = Some(self.ops.len() + n);
        self
    }

    /// Every operation attempted, in order (the failed one included).
    pub fn ops(&self) -> &[KernelOp] {
        &self.ops
    }

    /// The operations in their shell form.
    pub fn log(&self) -> Vec<String> {
        self.ops.iter().map(ToString::to_string).collect()
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    fn dev(&self, a: &PciAddress) -> PathBuf {
        self.p(&format!("sys/bus/pci/devices/{a}"))
    }

    fn bound_driver(&self, a: &PciAddress) -> Option<String> {
        fs::read_link(self.dev(a).join("driver"))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    fn group(&self, a: &PciAddress) -> Option<String> {
        fs::read_link(self.dev(a).join("iommu_group"))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    /// The real directory of the device (`sys/devices/...`), which links are made relative to.
    fn real_dev(&self, a: &PciAddress) -> Result<PathBuf, String> {
        fs::canonicalize(self.dev(a)).map_err(|_| format!("no such device {a} (ENODEV)"))
    }

    fn rel_from(from_dir: &Path, to: &Path) -> PathBuf {
        // Both are canonical absolute paths; walk up to the common prefix.
        let f: Vec<_> = from_dir.components().collect();
        let t: Vec<_> = to.components().collect();
        let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
        let mut rel = PathBuf::new();
        for _ in common..f.len() {
            rel.push("..");
        }
        for c in &t[common..] {
            rel.push(c);
        }
        rel
    }

    fn override_of(&self, a: &PciAddress) -> Option<String> {
        let s = fs::read_to_string(self.dev(a).join("driver_override")).ok()?;
        let s = s.trim();
        (!s.is_empty() && s != "(null)").then(|| s.to_owned())
    }

    fn vfio_node(&self, group: &str) -> PathBuf {
        self.p(&format!("dev/vfio/{group}"))
    }

    fn do_op(&mut self, op: &KernelOp) -> Result<(), String> {
        match op {
            KernelOp::DriverOverride { device, driver } => {
                let path = self.dev(device).join("driver_override");
                if !path.exists() {
                    return Err(format!("no such device {device} (ENODEV)"));
                }
                let shown = driver.clone().unwrap_or_else(|| "(null)".to_owned());
                fs::write(path, format!("{shown}\n")).map_err(|e| e.to_string())
            }
            KernelOp::Unbind { device, driver } => {
                if self.bound_driver(device).as_deref() != Some(driver.as_str()) {
                    return Err(format!("{device} is not bound to {driver} (ENODEV)"));
                }
                let real = self.real_dev(device)?;
                fs::remove_file(real.join("driver")).map_err(|e| e.to_string())?;
                let _ = fs::remove_file(self.p(&format!("sys/bus/pci/drivers/{driver}/{device}")));
                if driver == "vfio-pci"
                    && let Some(g) = self.group(device)
                    && !self.group_has_vfio(&g)
                {
                    let _ = fs::remove_file(self.vfio_node(&g));
                }
                Ok(())
            }
            KernelOp::Probe { device } => {
                let real = self.real_dev(device)?;
                if self.bound_driver(device).is_some() {
                    return Ok(());
                }
                let Some(drv) = self.override_of(device) else { return Ok(()) };
                let drv_dir = self.p(&format!("sys/bus/pci/drivers/{drv}"));
                if !drv_dir.is_dir() {
                    // No such driver loaded: the device stays unbound, as on a real kernel.
                    return Ok(());
                }
                let drv_real = fs::canonicalize(&drv_dir).map_err(|e| e.to_string())?;
                symlink(Self::rel_from(&real, &drv_real), real.join("driver"))
                    .map_err(|e| e.to_string())?;
                symlink(Self::rel_from(&drv_real, &real), drv_real.join(device.to_string()))
                    .map_err(|e| e.to_string())?;
                if drv == "vfio-pci"
                    && let Some(g) = self.group(device)
                {
                    let node = self.vfio_node(&g);
                    if !node.exists() {
                        fs::create_dir_all(node.parent().unwrap_or(&self.root))
                            .map_err(|e| e.to_string())?;
                        self.make_group_node(&node, &g)?;
                    }
                }
                Ok(())
            }
            KernelOp::Modprobe { module } => {
                let m = module_name(module);
                fs::create_dir_all(self.p(&format!("sys/module/{m}")))
                    .map_err(|e| e.to_string())?;
                if m == "vfio_pci" {
                    // vfio-pci pulls in vfio, which creates the container node.
                    fs::create_dir_all(self.p("sys/module/vfio")).map_err(|e| e.to_string())?;
                    let container = self.p("dev/vfio/vfio");
                    if !container.exists() {
                        fs::create_dir_all(self.p("dev/vfio")).map_err(|e| e.to_string())?;
                        fs::write(&container, "").map_err(|e| e.to_string())?;
                        fs::set_permissions(&container, fs::Permissions::from_mode(0o666))
                            .map_err(|e| e.to_string())?;
                    }
                    let d = self.p("sys/bus/pci/drivers/vfio-pci");
                    fs::create_dir_all(&d).map_err(|e| e.to_string())?;
                    for f in ["bind", "unbind", "new_id", "remove_id"] {
                        fs::write(d.join(f), "").map_err(|e| e.to_string())?;
                    }
                }
                let modules = self.p("proc/modules");
                let mut text = fs::read_to_string(&modules).unwrap_or_default();
                if !text.lines().any(|l| l.split_whitespace().next() == Some(m.as_str())) {
                    text.push_str(&format!("{m} 16384 0 - Live 0x0000000000000000\n"));
                    fs::write(&modules, text).map_err(|e| e.to_string())?;
                }
                Ok(())
            }
        }
    }

    /// The group's node as the fixture makes its nodes: a character device (major
    /// [`crate::sysfs::MAJOR_VFIO_GROUP`], minor the group) where the fixture's
    /// `/dev/vfio/vfio` is one (built with `char_devices`, as root), else a plain file.
    fn make_group_node(&self, node: &Path, group: &str) -> Result<(), String> {
        let chars = fs::symlink_metadata(self.p("dev/vfio/vfio"))
            .is_ok_and(|m| m.file_type().is_char_device());
        match group.parse::<u32>() {
            Ok(minor) if chars => rustix::fs::mknodat(
                rustix::fs::CWD,
                node,
                rustix::fs::FileType::CharacterDevice,
                rustix::fs::Mode::from_raw_mode(0o600),
                rustix::fs::makedev(crate::sysfs::MAJOR_VFIO_GROUP, minor),
            )
            .map_err(|e| format!("mknod {}: {e}", node.display()))?,
            _ => fs::write(node, "").map_err(|e| e.to_string())?,
        }
        fs::set_permissions(node, fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())
    }

    fn group_has_vfio(&self, group: &str) -> bool {
        let dir = self.p(&format!("sys/kernel/iommu_groups/{group}/devices"));
        fs::read_dir(dir)
            .map(|entries| {
                entries.flatten().any(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .parse::<PciAddress>()
                        .is_ok_and(|a| self.bound_driver(&a).as_deref() == Some("vfio-pci"))
                })
            })
            .unwrap_or(false)
    }
}

impl Kernel for FakeKernel {
    fn apply(&mut self, op: &KernelOp) -> Result<(), KernelError> {
        self.ops.push(op.clone());
        if self.fail_at == Some(self.ops.len()) {
            return Err(KernelError::new(op, "injected failure (EIO)"));
        }
        self.do_op(op).map_err(|reason| KernelError::new(op, reason))
    }
}

/// One entry of a [`snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Dir,
    /// Content and permission bits.
    File(Vec<u8>, u32),
    Link(PathBuf),
}

/// Every path under `root` (relative), with file contents, modes and link targets: two equal
/// snapshots mean the trees are the same in everything a test can observe.
pub fn snapshot(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            let Ok(meta) = fs::symlink_metadata(&path) else { continue };
            if meta.file_type().is_symlink() {
                out.insert(rel, Node::Link(fs::read_link(&path).unwrap_or_default()));
            } else if meta.is_dir() {
                out.insert(rel, Node::Dir);
                stack.push(path);
            } else if meta.file_type().is_char_device() || meta.file_type().is_block_device() {
                // A node is its numbers: reading one would open a device of this host.
                let n = format!(
                    "{}:{}",
                    rustix::fs::major(meta.rdev()),
                    rustix::fs::minor(meta.rdev())
                );
                out.insert(rel, Node::File(n.into_bytes(), meta.permissions().mode() & 0o7777));
            } else {
                let content = fs::read(&path).unwrap_or_default();
                out.insert(rel, Node::File(content, meta.permissions().mode() & 0o7777));
            }
        }
    }
    out
}
