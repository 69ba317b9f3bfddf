//! Accelerator discovery from sysfs: `ROOT/sys/bus/pci/devices/*` into an [`Inventory`].
//!
//! Per function it reads the ids and class files, the `driver` and `iommu_group` links, NUMA
//! node, SR-IOV counts and `physfn`, PCIe link attributes and the device nodes that belong to it
//! (`/dev/nvidiaN` through `/proc/driver/nvidia/gpus/<bus>/information`, `/dev/accelN`,
//! `/dev/dri/*`, `/dev/vfio/<group>`), then names and kernel modules from `pci.ids` and
//! `modules.alias`.
//!
//! A host is never perfect: a file that is missing, unreadable or not what the kernel would
//! write makes that one field `null` and adds a warning naming the file; it never aborts the
//! listing. Only a root that does not exist is an error. Every file is read with
//! [`Root::read_bounded`]: a root is untrusted, and an attribute that is a FIFO, a link to a
//! device or larger than a page is refused (a warning) rather than read.
//!
//! Cost is kept low for the default view: the cheap attributes (ids, class, IOMMU group) are read
//! for every function to find the accelerators and their group peers, and the rest only for the
//! functions that will be shown.
//!
//! [`discover_nodes`] is the narrow read for callers that only hand devices over (the container
//! runtime shim and hook, which run on every container start): the accelerators of the kinds
//! asked for, each with its driver, IOMMU group, UUID and device nodes, and of the host only the
//! NVIDIA driver version and the control nodes. A function of another vendor costs one read of
//! its `vendor` attribute; kernel modules, names, `/proc/cpuinfo` and the rest are not read.

use std::collections::{BTreeSet, HashSet};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags};

use xpu_core::accel::{self, DeviceKind, VENDOR_AMD, VENDOR_NVIDIA};
use xpu_core::inventory::{HostInfo, Inventory, Link, PciDevice, SriovType};
use xpu_core::pci::{PciAddress, parse_sysfs_hex};

use crate::modalias::{self, ModuleAliases};
use crate::pciids::{self, PciNames};
use crate::root::{ATTR_MAX, ReadError, TEXT_MAX};
use crate::{Root, devnode};

/// Which functions to describe fully.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Accelerators and every function that shares an IOMMU group with one.
    #[default]
    Accelerators,
    /// Every PCI function.
    All,
}

#[derive(Debug, Clone, Default)]
pub struct DiscoverOptions {
    pub scope: Scope,
    /// Use this `pci.ids` instead of searching the root and the host.
    pub pci_ids: Option<PathBuf>,
    /// Skip the name lookups (for callers that only need ids).
    pub skip_names: bool,
}

/// An accelerator a narrow read wants: its PCI vendor (any when `None`) and its kind.
pub type Wanted = (Option<u16>, DeviceKind);

/// How much of each kept function, and of the host, to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Detail {
    /// Everything `xpu discover` shows.
    Full,
    /// What handing the device to a container needs: driver, IOMMU group, UUID, device nodes.
    Nodes,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoverError {
    #[error(transparent)]
    Root(#[from] crate::RootError),
}

/// Where PCI functions are listed.
pub const PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// Control nodes shared by all devices of a vendor, reported in [`HostInfo::control_nodes`].
pub const CONTROL_NODES: [&str; 6] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
    "/dev/kfd",
    "/dev/vfio/vfio",
];

/// Reads the host under `root`.
pub fn discover(root: &Root, opts: &DiscoverOptions) -> Result<Inventory, DiscoverError> {
    read(root, opts, None, Detail::Full)
}

/// The narrow read (see the module documentation): the accelerators matching one of `only`
/// (every accelerator when `None`; none when empty, for a caller that needs only the host's
/// control nodes), in address order. Within a kind and vendor the devices and their order are
/// those [`discover`] finds, so per-kind indices agree. Group peers are not included; of
/// [`HostInfo`] only `nvidia_driver_version` and `control_nodes` are filled in, and fields the
/// read skips (ids of the subsystem, NUMA node, SR-IOV, link, kernel modules, names) are `null`.
pub fn discover_nodes(root: &Root, only: Option<&[Wanted]>) -> Result<Inventory, DiscoverError> {
    let accelerators = [
        (None, DeviceKind::Gpu),
        (None, DeviceKind::Tpu),
        (None, DeviceKind::Npu),
        (None, DeviceKind::Nvswitch),
    ];
    read(root, &DiscoverOptions::default(), Some(only.unwrap_or(&accelerators)), Detail::Nodes)
}

fn read(
    root: &Root,
    opts: &DiscoverOptions,
    only: Option<&[Wanted]>,
    detail: Detail,
) -> Result<Inventory, DiscoverError> {
    if !root.is_host() {
        // Re-validate: a root can vanish between parsing and use.
        Root::new(root.base())?;
    }
    let mut w = Warnings::default();
    let dir = root.path(PCI_DEVICES);
    let mut devices = Vec::new();
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                match name.parse::<PciAddress>() {
                    Ok(addr) => {
                        devices.extend(read_basic(dir.join(&*name), addr, &mut w, root, only));
                    }
                    Err(_) => {
                        w.push(format!("{}/{name}: not a PCI address; ignored", root.display(&dir)))
                    }
                }
            }
        }
        Err(e) => w.push(format!("{}: {e}; no PCI devices listed", root.display(&dir))),
    }
    devices.sort_by_key(|d| d.address);

    let keep: Vec<bool> = match opts.scope {
        // A narrow read kept only what it wants.
        _ if only.is_some() => vec![true; devices.len()],
        Scope::All => vec![true; devices.len()],
        Scope::Accelerators => {
            let groups: BTreeSet<u32> = devices
                .iter()
                .filter(|d| d.kind.is_accelerator())
                .filter_map(|d| d.iommu_group)
                .collect();
            devices
                .iter()
                .map(|d| {
                    d.kind.is_accelerator() || d.iommu_group.is_some_and(|g| groups.contains(&g))
                })
                .collect()
        }
    };
    let mut keep = keep.into_iter();
    devices.retain(|_| keep.next().unwrap_or(false));

    let host = read_host(root, detail, &mut w);
    let release = host.kernel_release.as_deref().filter(|_| detail == Detail::Full);
    let aliases = release.and_then(|rel| {
        let path = modalias::find_noting(root, rel, &mut w.0)?;
        match ModuleAliases::load(&path) {
            Ok(a) => Some(a),
            Err(e) => {
                w.push(format!("{}: {e}; kernel modules not listed", root.display(&path)));
                None
            }
        }
    });
    for d in &mut devices {
        let dev = Dev::open(root, dir.join(d.address.to_string()));
        read_details(root, &dev, d, aliases.as_ref(), detail, &mut w);
    }
    if detail == Detail::Full && !opts.skip_names && !devices.is_empty() {
        add_names(root, opts, &mut devices, &mut w);
    }
    assign_interconnect_domains(&mut devices);
    partition::read(root, &mut devices, &mut w);

    Ok(Inventory { devices, host, warnings: w.0 })
}

mod partition;

#[derive(Default)]
struct Warnings(Vec<String>);

impl Warnings {
    fn push(&mut self, msg: String) {
        self.0.push(msg);
    }
}

/// What reading one sysfs attribute gave.
pub(crate) enum Attr {
    Missing,
    Value(String),
    /// Unreadable, or refused by the bounded reader (a FIFO, a device, more than a page).
    Unreadable(ReadError),
}

impl From<Result<Vec<u8>, ReadError>> for Attr {
    fn from(r: Result<Vec<u8>, ReadError>) -> Attr {
        match r {
            Ok(bytes) => Attr::Value(String::from_utf8_lossy(&bytes).trim().to_owned()),
            Err(ReadError::Missing) => Attr::Missing,
            Err(e) => Attr::Unreadable(e),
        }
    }
}

/// A sysfs attribute or small `/proc` file (a page at most) at real path `path` under `root`.
pub(crate) fn read_attr(root: &Root, path: &Path) -> Attr {
    root.read_bounded(path, ATTR_MAX).into()
}

/// A function's sysfs directory: its path (for messages and directory listings) and, when it
/// opens, a descriptor its attributes are opened from, so that the kernel walks the long path
/// under the root (and the `devices/<address>` symlink) once per function instead of once per
/// attribute.
struct Dev<'r> {
    root: &'r Root,
    path: PathBuf,
    fd: Option<OwnedFd>,
}

impl<'r> Dev<'r> {
    fn open(root: &'r Root, path: PathBuf) -> Dev<'r> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::open(&path, flags, Mode::empty()).ok();
        Dev { root, path, fd }
    }

    fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// File `name` of the function, at most `limit` bytes (see [`Root::read_bounded`]).
    fn read(&self, name: &str, limit: u64) -> Result<Vec<u8>, ReadError> {
        match &self.fd {
            Some(fd) => self.root.read_bounded_at(fd, name, limit),
            None => self.root.read_bounded(&self.join(name), limit),
        }
    }

    /// Attribute `name`, as [`read_attr`] reads it.
    fn attr(&self, name: &str) -> Attr {
        self.read(name, ATTR_MAX).into()
    }

    /// The target of link `name`.
    fn read_link(&self, name: &str) -> Option<PathBuf> {
        match &self.fd {
            Some(fd) => rustix::fs::readlinkat(fd, name, Vec::new())
                .ok()
                .map(|t| PathBuf::from(std::ffi::OsString::from_vec(t.into_bytes()))),
            None => std::fs::read_link(self.join(name)).ok(),
        }
    }

    /// Whether `name` exists; `follow`: and, when it is a link, its target does too.
    fn exists(&self, name: &str, follow: bool) -> bool {
        match &self.fd {
            Some(fd) => {
                let flags = if follow { AtFlags::empty() } else { AtFlags::SYMLINK_NOFOLLOW };
                rustix::fs::statat(fd, name, flags).is_ok()
            }
            None if follow => std::fs::metadata(self.join(name)).is_ok(),
            None => std::fs::symlink_metadata(self.join(name)).is_ok(),
        }
    }
}

/// A hex attribute (`0x10de`). `required` attributes warn when missing; all warn when garbled.
fn hex_attr(root: &Root, dev: &Dev, name: &str, required: bool, w: &mut Warnings) -> Option<u32> {
    let path = dev.join(name);
    match dev.attr(name) {
        Attr::Value(s) => {
            let v = parse_sysfs_hex(&s);
            if v.is_none() {
                w.push(format!(
                    "{}: not a hex value ({s:?}); field left null",
                    root.display(&path)
                ));
            }
            v
        }
        Attr::Missing if !required => None,
        Attr::Missing => {
            w.push(format!("{}: missing; field left null", root.display(&path)));
            None
        }
        Attr::Unreadable(e) => {
            w.push(format!("{}: {e}; field left null", root.display(&path)));
            None
        }
    }
}

/// A decimal attribute; garbage warns, a missing file is silent (optional by nature).
fn dec_attr<T: std::str::FromStr>(
    root: &Root,
    dev: &Dev,
    name: &str,
    w: &mut Warnings,
) -> Option<T> {
    let path = dev.join(name);
    match dev.attr(name) {
        Attr::Value(s) => {
            let v = s.parse().ok();
            if v.is_none() {
                w.push(format!("{}: not a number ({s:?}); field left null", root.display(&path)));
            }
            v
        }
        Attr::Missing => None,
        Attr::Unreadable(e) => {
            w.push(format!("{}: {e}; field left null", root.display(&path)));
            None
        }
    }
}

/// The last component of a sysfs link (`driver -> ../../bus/pci/drivers/nvidia`), when the link
/// exists and its target does too. A dangling link warns.
fn link_name(root: &Root, dev: &Dev, name: &str, w: &mut Warnings) -> Option<String> {
    let target = dev.read_link(name)?;
    if !dev.exists(name, true) {
        w.push(format!(
            "{}: dangling link to {}; field left null",
            root.display(&dev.join(name)),
            target.display()
        ));
        return None;
    }
    target.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Ids, class and IOMMU group: enough to classify and to find group peers. `None` when `only`
/// does not want the function; the vendor is read first so that other vendors' functions cost
/// one read.
fn read_basic(
    dev: PathBuf,
    addr: PciAddress,
    w: &mut Warnings,
    root: &Root,
    only: Option<&[Wanted]>,
) -> Option<PciDevice> {
    let dev = &Dev::open(root, dev);
    let mut d = PciDevice::new(addr);
    let id16 = |v: Option<u32>| v.and_then(|v| u16::try_from(v).ok());
    d.vendor_id = id16(hex_attr(root, dev, "vendor", true, w));
    let vendor = d.vendor_id;
    let vendor_ok = |(v, _): &Wanted| v.is_none() || *v == vendor;
    if let Some(only) = only
        && !only.iter().any(vendor_ok)
    {
        return None;
    }
    d.device_id = id16(hex_attr(root, dev, "device", true, w));
    if let Some(class) = hex_attr(root, dev, "class", true, w)
        && class <= 0xff_ffff
    {
        d.class = Some((class >> 8) as u16);
        d.prog_if = Some((class & 0xff) as u8);
    }
    d.kind = accel::classify(d.vendor_id, d.device_id, d.class_code());
    if let Some(only) = only
        && !only.iter().any(|want| vendor_ok(want) && want.1 == d.kind)
    {
        return None;
    }
    d.iommu_group = link_name(root, dev, "iommu_group", w).and_then(|g| {
        let n = g.parse().ok();
        if n.is_none() {
            w.push(format!("{}/iommu_group: group {g:?} is not a number", root.display(&dev.path)));
        }
        n
    });
    Some(d)
}

/// Everything else, for the functions that will be shown.
fn read_details(
    root: &Root,
    dev: &Dev,
    d: &mut PciDevice,
    aliases: Option<&ModuleAliases>,
    detail: Detail,
    w: &mut Warnings,
) {
    if let (Some(v), Some(id)) = (d.vendor_id, d.device_id)
        && let Some(a) = accel::lookup(v, id)
    {
        d.product = Some(a.product.to_owned());
        d.generation = Some(a.generation.to_owned());
    }
    if detail == Detail::Nodes {
        d.driver = link_name(root, dev, "driver", w);
        read_dev_nodes(root, dev, d, w);
        return;
    }

    let id16 = |v: Option<u32>| v.and_then(|v| u16::try_from(v).ok());
    d.subsystem_vendor_id = id16(hex_attr(root, dev, "subsystem_vendor", true, w));
    d.subsystem_device_id = id16(hex_attr(root, dev, "subsystem_device", true, w));
    d.revision = hex_attr(root, dev, "revision", false, w)
        .and_then(|v| u8::try_from(v).ok())
        .or_else(|| revision_from_config(root, dev, w));
    d.driver = link_name(root, dev, "driver", w);

    if let Some(aliases) = aliases {
        let path = dev.join("modalias");
        d.kernel_modules = match dev.attr("modalias") {
            Attr::Value(m) => Some(aliases.modules_for(&m)),
            Attr::Missing => None,
            Attr::Unreadable(e) => {
                w.push(format!("{}: {e}; kernel modules not listed", root.display(&path)));
                None
            }
        };
    }

    d.numa_node = dec_attr::<i64>(root, dev, "numa_node", w).and_then(|n| u32::try_from(n).ok());

    // SR-IOV role as Nova derives it from libvirt: a function with a `physfn` link is a VF; one
    // that can create VFs (`sriov_totalvfs` > 0) is a PF; anything else is a plain PCI device.
    d.sriov.total_vfs = dec_attr(root, dev, "sriov_totalvfs", w);
    d.sriov.num_vfs = dec_attr(root, dev, "sriov_numvfs", w);
    if dev.exists("physfn", false) {
        d.sriov.kind = SriovType::Vf;
        d.sriov.physfn = link_name(root, dev, "physfn", w).and_then(|n| n.parse().ok());
    } else if d.sriov.total_vfs.is_some_and(|n| n > 0) {
        d.sriov.kind = SriovType::Pf;
    }

    d.link = Link {
        speed: link_speed(root, dev, "current_link_speed", w),
        width: dec_attr(root, dev, "current_link_width", w),
        max_speed: link_speed(root, dev, "max_link_speed", w),
        max_width: dec_attr(root, dev, "max_link_width", w),
    };

    if d.vendor_id == Some(VENDOR_AMD) && d.kind == DeviceKind::Gpu {
        d.interconnect_domain = match dev.attr("xgmi_hive_info/xgmi_hive_id") {
            Attr::Value(s) => hive_domain(&s),
            Attr::Missing => None,
            Attr::Unreadable(e) => {
                let path = dev.join("xgmi_hive_info/xgmi_hive_id");
                w.push(format!("{}: {e}; field left null", root.display(&path)));
                None
            }
        };
    }
    read_dev_nodes(root, dev, d, w);
}

/// Revision from config space byte 8, for kernels without the `revision` attribute. Config
/// space is 256 bytes, 4096 with PCIe's extended space.
fn revision_from_config(root: &Root, dev: &Dev, w: &mut Warnings) -> Option<u8> {
    match dev.read("config", ATTR_MAX) {
        Ok(bytes) => bytes.get(8).copied(),
        Err(ReadError::Missing) => None,
        Err(e) => {
            w.push(format!("{}: {e}; field left null", root.display(&dev.join("config"))));
            None
        }
    }
}

/// `16.0 GT/s PCIe` (newer kernels) or `16 GT/s` → `16.0 GT/s`; `Unknown` → null.
fn link_speed(root: &Root, dev: &Dev, name: &str, w: &mut Warnings) -> Option<String> {
    let path = dev.join(name);
    let s = match dev.attr(name) {
        Attr::Value(s) => s,
        Attr::Missing => return None,
        Attr::Unreadable(e) => {
            w.push(format!("{}: {e}; field left null", root.display(&path)));
            return None;
        }
    };
    let num = s.split_whitespace().next()?;
    match num.parse::<f64>() {
        Ok(v) if s.contains("GT/s") => Some(format!("{v:.1} GT/s")),
        _ if s.starts_with("Unknown") => None,
        _ => {
            w.push(format!("{}: unrecognised speed {s:?}; field left null", root.display(&path)));
            None
        }
    }
}

fn read_dev_nodes(root: &Root, dev: &Dev, d: &mut PciDevice, w: &mut Warnings) {
    let mut nodes = Vec::new();

    // NVIDIA: the driver publishes each GPU's minor number and UUID under /proc. A GPU on
    // vfio-pci is not the NVIDIA driver's, whatever /proc still holds (an entry left while the
    // driver lets go of it): it gets no /dev/nvidiaN.
    if d.vendor_id == Some(VENDOR_NVIDIA)
        && d.kind == DeviceKind::Gpu
        && d.driver.as_deref() != Some("vfio-pci")
    {
        let info_path = root.path(format!("/proc/driver/nvidia/gpus/{}/information", d.address));
        let info = match read_attr(root, &info_path) {
            Attr::Value(info) => Some(info),
            Attr::Missing => None,
            Attr::Unreadable(e) => {
                w.push(format!("{}: {e}; UUID and device node unknown", root.display(&info_path)));
                None
            }
        };
        if let Some(info) = info {
            let field = |key: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(key).map(|v| v.trim_start_matches(':').trim()))
                    .map(str::to_owned)
            };
            d.uuid = field("GPU UUID").and_then(|u| {
                if is_gpu_uuid(&u) {
                    return Some(u);
                }
                w.push(format!(
                    "{}: GPU UUID {u:?} is not a UUID the driver writes (GPU- and letters, digits, '-'); field left null",
                    root.display(&info_path)
                ));
                None
            });
            match field("Device Minor").map(|m| m.parse::<u32>()) {
                Some(Ok(minor)) => nodes.push(format!("/dev/nvidia{minor}")),
                Some(Err(_)) => {
                    w.push(format!("{}: Device Minor is not a number", root.display(&info_path)))
                }
                None => {}
            }
        }
    }

    // The kernel accel subsystem (/dev/accelN: TPU v2-v4, Gaudi, NPUs) and DRM (AMD, Intel).
    for (sub, devdir) in [("accel", "/dev"), ("drm", "/dev/dri")] {
        if let Ok(entries) = std::fs::read_dir(dev.join(sub)) {
            let mut names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.starts_with("accel") || n.starts_with("card") || n.starts_with("renderD")
                })
                .collect();
            names.sort();
            nodes.extend(names.into_iter().map(|n| format!("{devdir}/{n}")));
        }
    }

    // VFIO: the group node (a function that is not on vfio-pci does not own it, even when a
    // group peer made it appear), and the per-device cdev of iommufd-era kernels.
    if let Some(g) = d.iommu_group
        && d.driver.as_deref() == Some("vfio-pci")
    {
        nodes.push(format!("/dev/vfio/{g}"));
    }
    if let Ok(entries) = std::fs::read_dir(dev.join("vfio-dev")) {
        for e in entries.flatten() {
            nodes.push(format!("/dev/vfio/devices/{}", e.file_name().to_string_lossy()));
        }
    }

    for path in nodes {
        match devnode::stat(root, &path) {
            Some(n) => d.dev_nodes.push(n),
            None if path.starts_with("/dev/nvidia") || path.starts_with("/dev/vfio/") => w.push(
                format!("{}: {path} does not exist; it is expected for this device", d.address),
            ),
            None => {}
        }
    }
}

/// A small text file under the root, trimmed; `None` when missing, unreadable or empty.
fn host_text(root: &Root, path: &str) -> Option<String> {
    host_text_noting(root, path, &mut Warnings::default())
}

/// [`host_text`], with a warning when the file is there but cannot be read.
fn host_text_noting(root: &Root, path: &str, w: &mut Warnings) -> Option<String> {
    match read_attr(root, &root.path(path)) {
        Attr::Value(s) if !s.is_empty() => Some(s),
        Attr::Unreadable(e) => {
            w.push(format!("{path}: {e}; not used"));
            None
        }
        _ => None,
    }
}

/// Whether an NVIDIA GPU UUID is what the driver writes (`GPU-` and a UUID's hex digits and
/// dashes; letters and digits are taken): the UUID becomes a CDI device name and a label
/// value, so one from an untrusted tree (`GPU-x",evil="1"} 666`) must not pass.
fn is_gpu_uuid(u: &str) -> bool {
    u.len() <= 64
        && u.strip_prefix("GPU-").is_some_and(|rest| {
            !rest.is_empty()
                && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && rest.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
        })
}

/// Whether a snapshot of the host's accelerators (`xpu cdi generate` writes one beside its CDI
/// specs for the runtime shim) still describes the host: a digest of the PCI functions present
/// (the names in `/sys/bus/pci/devices`), the functions bound to each accelerator driver and to
/// vfio-pci (`/sys/bus/pci/drivers/<driver>`), and the NVIDIA driver's version line
/// (`/proc/driver/nvidia/version`). A device added or removed, bound to another driver, or a
/// driver loaded, unloaded or upgraded changes it. Five directory listings and one small read:
/// a fraction of what discovery reads.
pub fn host_key(root: &Root) -> String {
    const DRIVERS: [&str; 5] = ["nvidia", "amdgpu", "vfio-pci", "habanalabs", "accel"];
    // FNV-1a, 64 bits: stable across builds and runs, which a snapshot written by one binary
    // and read by another needs (std's hasher is seeded per process).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes.iter().chain(b"\n") {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    let mut count = 0usize;
    let list = |dir: &Path, eat: &mut dyn FnMut(&[u8])| {
        // Absent (the driver is not loaded) is a state of its own.
        let mut names = dir_names(dir).unwrap_or_else(|_| vec![b"-".to_vec()]);
        names.sort_unstable();
        eat(dir.as_os_str().as_encoded_bytes());
        for n in &names {
            eat(n);
        }
        names.len()
    };
    count += list(&root.path(PCI_DEVICES), &mut eat);
    for d in DRIVERS {
        list(&root.path(format!("/sys/bus/pci/drivers/{d}")), &mut eat);
    }
    eat(host_text(root, "/proc/driver/nvidia/version").unwrap_or_default().as_bytes());
    format!("{h:016x}-{count}")
}

/// The names in a directory, without `.` and `..`, in the order the kernel lists them. The
/// runtime shim takes the host key on every container start: `getdents64` into a buffer on the
/// stack, where `std::fs::read_dir` goes through libc's `opendir`, whose allocation costs an
/// `mmap` and an `munmap` per directory in the statically linked shim.
fn dir_names(dir: &Path) -> std::io::Result<Vec<Vec<u8>>> {
    let fd =
        rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    let mut entries = rustix::fs::RawDir::new(&fd, &mut buf);
    let mut names = Vec::new();
    while let Some(entry) = entries.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    Ok(names)
}

/// The host's name, from the kernel (`/proc/sys/kernel/hostname`), else `/etc/hostname`.
pub fn hostname(root: &Root) -> Option<String> {
    host_text(root, "/proc/sys/kernel/hostname").or_else(|| host_text(root, "/etc/hostname"))
}

fn read_host(root: &Root, detail: Detail, w: &mut Warnings) -> HostInfo {
    let nvidia_driver_version =
        host_text_noting(root, "/proc/driver/nvidia/version", w).and_then(|v| {
            let found = nvidia_version(&v);
            if found.is_none() {
                w.push("/proc/driver/nvidia/version: no driver version found".to_owned());
            }
            found
        });
    let control_nodes = CONTROL_NODES.iter().filter_map(|p| devnode::stat(root, p)).collect();
    if detail == Detail::Nodes {
        // Not /proc/cpuinfo (milliseconds on a large host) nor the IOMMU group count.
        return HostInfo { nvidia_driver_version, control_nodes, ..HostInfo::default() };
    }
    let cpuinfo = match root.read_bounded(&root.path("/proc/cpuinfo"), TEXT_MAX) {
        Ok(b) => Some(b),
        Err(ReadError::Missing) => None,
        Err(e) => {
            w.push(format!("/proc/cpuinfo: {e}; CPU vendor unknown"));
            None
        }
    };
    let cpu_vendor = cpuinfo.and_then(|b| {
        let s = String::from_utf8_lossy(&b);
        s.lines().find(|l| l.starts_with("vendor_id")).and_then(|l| {
            match l.split(':').nth(1).map(str::trim) {
                Some("GenuineIntel") => Some("intel".to_owned()),
                Some("AuthenticAMD" | "HygonGenuine") => Some("amd".to_owned()),
                Some(other) => Some(other.to_lowercase()),
                None => None,
            }
        })
    });
    let iommu_groups = std::fs::read_dir(root.path("/sys/kernel/iommu_groups"))
        .map(|d| d.flatten().count() as u32)
        .unwrap_or(0);
    let hostname = host_text_noting(root, "/proc/sys/kernel/hostname", w)
        .or_else(|| host_text_noting(root, "/etc/hostname", w));
    HostInfo {
        hostname,
        kernel_release: host_text_noting(root, "/proc/sys/kernel/osrelease", w),
        cpu_vendor,
        iommu_groups,
        nvidia_driver_version,
        control_nodes,
    }
}

/// `NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ...` → `535.104.05`.
pub fn nvidia_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version"))?;
    line.split_whitespace()
        .find(|tok| {
            let parts: Vec<&str> = tok.split('.').collect();
            parts.len() >= 2
                && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_owned)
}

fn add_names(root: &Root, opts: &DiscoverOptions, devices: &mut [PciDevice], w: &mut Warnings) {
    let path = match &opts.pci_ids {
        Some(p) => Some(p.clone()),
        None => pciids::find_noting(root, &mut w.0),
    };
    let Some(path) = path else {
        w.push("no pci.ids found (install pciutils or hwdata); names left null".to_owned());
        return;
    };
    let wanted: HashSet<(u16, u16)> =
        devices.iter().filter_map(|d| Some((d.vendor_id?, d.device_id?))).collect();
    let names = match PciNames::load(&path, &wanted) {
        Ok(n) => n,
        Err(e) => {
            w.push(format!("{}: {e}; names left null", path.display()));
            return;
        }
    };
    for d in devices {
        if let Some(v) = d.vendor_id {
            d.vendor_name = names.vendor(v).map(str::to_owned);
            if let Some(id) = d.device_id {
                d.device_name = names.device(v, id).map(str::to_owned);
            }
        }
        d.class_name = d.class.and_then(|c| names.class(c)).map(str::to_owned);
    }
}

/// Marks devices that share a fast interconnect.
///
/// - AMD Instinct GPUs publish their XGMI hive id in sysfs; the hive is the domain.
/// - NVIDIA GPUs on a board with NVSwitches are all-to-all NVLink connected (HGX/DGX): one
///   domain per host. Without NVSwitch, sysfs does not show NVLink bridges, so no domain is
///   claimed.
/// - TPU chips of one host share the host's ICI links.
fn assign_interconnect_domains(devices: &mut [PciDevice]) {
    let has_nvswitch = devices.iter().any(|d| d.kind == DeviceKind::Nvswitch);
    for d in devices {
        let domain = match (d.kind, d.vendor_id) {
            (DeviceKind::Gpu, Some(VENDOR_NVIDIA)) if has_nvswitch => "nvswitch-0",
            (DeviceKind::Nvswitch, _) => "nvswitch-0",
            (DeviceKind::Tpu, _) => "ici-0",
            // AMD's hive (read with the details) or nothing.
            _ => continue,
        };
        d.interconnect_domain = Some(domain.to_owned());
    }
}

/// The XGMI hive an AMD GPU belongs to, from `xgmi_hive_info/xgmi_hive_id` in its sysfs
/// directory `dev`.
pub fn xgmi_hive(dev: &Path) -> Option<String> {
    let bytes = crate::root::read_bounded(&dev.join("xgmi_hive_info/xgmi_hive_id"), ATTR_MAX);
    hive_domain(String::from_utf8_lossy(&bytes.ok()?).trim())
}

/// `7786335925049349010` → `xgmi-7786335925049349010`; `0` (no hive) and garbage → `None`.
fn hive_domain(id: &str) -> Option<String> {
    (!id.is_empty() && id != "0" && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'x'))
        .then(|| format!("xgmi-{id}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dir_names` lists what `std::fs::read_dir` lists, past one buffer of entries, and a
    /// missing directory is an error (the host key's "-").
    #[test]
    fn dir_names_match_read_dir() {
        let dir = tempfile::tempdir().unwrap();
        // 300 names of 40 bytes: several `getdents64` buffers of 4 KiB.
        for i in 0..300 {
            std::fs::write(dir.path().join(format!("{i:040}")), "").unwrap();
        }
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let mut ours = dir_names(dir.path()).unwrap();
        let mut std_names: Vec<Vec<u8>> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_vec())
            .collect();
        ours.sort_unstable();
        std_names.sort_unstable();
        assert_eq!(ours.len(), 301);
        assert_eq!(ours, std_names);
        assert!(dir_names(&dir.path().join("absent")).is_err());
        assert!(dir_names(&dir.path().join("sub").join("..").join("0".repeat(40))).is_err());
    }

    #[test]
    fn nvidia_version_line() {
        let v = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0";
        assert_eq!(nvidia_version(v).as_deref(), Some("535.104.05"));
        assert_eq!(nvidia_version("garbage"), None);
    }

    /// What the narrow read keeps of a device: enough to hand it to a container.
    type NodesView =
        (PciAddress, Option<u16>, DeviceKind, Option<String>, Option<String>, Vec<String>);

    fn nodes_view<'a>(devices: impl Iterator<Item = &'a PciDevice>) -> Vec<NodesView> {
        devices
            .map(|d| {
                let nodes = d.dev_nodes.iter().map(|n| n.path.clone()).collect();
                (d.address, d.vendor_id, d.kind, d.driver.clone(), d.uuid.clone(), nodes)
            })
            .collect()
    }

    #[test]
    fn narrow_read_agrees_with_the_full_one_on_every_fixture() {
        for spec in xpu_testkit::hosts::all() {
            let f = spec.build();
            let root = Root::new(f.root()).unwrap();
            let full = discover(&root, &DiscoverOptions::default()).unwrap();
            let name = &spec.name;
            let narrow = discover_nodes(&root, None).unwrap();
            assert_eq!(
                nodes_view(narrow.devices.iter()),
                nodes_view(full.devices.iter().filter(|d| d.kind.is_accelerator())),
                "{name}"
            );
            assert_eq!(narrow.host.control_nodes, full.host.control_nodes, "{name}");
            assert_eq!(narrow.host.nvidia_driver_version, full.host.nvidia_driver_version);
            assert!(
                narrow.host.cpu_vendor.is_none()
                    && narrow.devices.iter().all(|d| d.numa_node.is_none())
            );

            for want in [
                (Some(VENDOR_NVIDIA), DeviceKind::Gpu),
                (None, DeviceKind::Tpu),
                (Some(VENDOR_AMD), DeviceKind::Gpu),
            ] {
                let some = discover_nodes(&root, Some(&[want])).unwrap();
                let expect = full
                    .devices
                    .iter()
                    .filter(|d| d.kind == want.1 && want.0.is_none_or(|v| d.vendor_id == Some(v)));
                assert_eq!(nodes_view(some.devices.iter()), nodes_view(expect), "{name} {want:?}");
            }
            let none = discover_nodes(&root, Some(&[])).unwrap();
            assert!(none.devices.is_empty(), "{name}");
            assert_eq!(none.host.control_nodes, full.host.control_nodes, "{name}");
        }
    }
}
