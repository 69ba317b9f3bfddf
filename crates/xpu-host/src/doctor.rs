//! Host readiness checks: `xpu doctor`. Each check is PASS, WARN or FAIL with what was found
//! and a one-line fix; a FAIL makes the run fail.
//!
//! The checks virt-host-validate(1) also makes carry its titles and decide on the same facts
//! with the same verdicts, so the two agree on any host (libvirt's
//! `tools/virt-host-validate-{qemu,common}.c`):
//!
//! - hardware virtualization: a `vmx` or `svm` flag in `/proc/cpuinfo` (FAIL without), made
//!   only where the CPU has a `flags` line (x86);
//! - `/dev/kvm` exists and is readable and writable (FAIL), `/dev/vhost-net` exists (WARN),
//!   `/dev/net/tun` exists (FAIL);
//! - cgroup controllers as [`crate::cgroups`] finds them (WARN for QEMU's six; a
//!   container-host wants them, so FAIL there, as virt-host-validate's LXC checks do);
//! - device assignment IOMMU support: with `vmx`, an ACPI DMAR table; with `svm`, an IVRS
//!   table; with neither, virt-host-validate says "unknown" (WARN) — xpu says the same unless
//!   one of the tables is there, which a guest with a virtual IOMMU and no nested
//!   virtualization (a TPU VM) has, and then passes;
//! - IOMMU enabled by the kernel: `/sys/kernel/iommu_groups` not empty (WARN).
//!
//! The rest is xpu's: kernel parameters of the profile, VFIO modules, conflicting drivers
//! blacklisted, per accelerator the driver the profile wants, IOMMU group viability and the
//! `/dev/vfio` node, memlock and nofile limits (effective and configured), huge pages, THP,
//! NVIDIA/AMD driver and nodes.
//!
//! Devices come from the [`Inventory`]; the other host facts are read here under the [`Root`],
//! each with [`Root::read_bounded`]: a file that is not a regular file (a FIFO, a link to a
//! device) or is too large is a warning naming it and reads as empty.

use std::collections::BTreeSet;

use serde::Serialize;
use xpu_core::accel::{DeviceKind, VENDOR_AMD, VENDOR_HABANA, VENDOR_NVIDIA};
use xpu_core::{Inventory, PciDevice};

use crate::cgroups;
use crate::limits::{self, Item, Limit, LimitsConfig, LimitsError, SoftHard, Subject};
use crate::profile::{CpuVendor, Profile, cmdline_has};
use crate::provision::NOFILE_WANTED;
use crate::root::{ReadError, TEXT_MAX};
use crate::vfio::{VFIO_DRIVER, VIABLE_DRIVERS, group_blockers};
use crate::{Root, devnode};

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Warn,
    Fail,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }
}

/// One check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier (`kvm.hw-virt`, `device.0000:25:00.0.driver`).
    pub id: String,
    /// The table prefix (`KVM`, `IOMMU`, `DEVICE`...).
    pub area: &'static str,
    /// What is checked, phrased to follow "Checking " as virt-host-validate phrases it.
    pub check: String,
    pub status: Status,
    /// What was found.
    pub detail: Option<String>,
    /// One line that fixes a WARN or FAIL.
    pub fix: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub pass: usize,
    pub warn: usize,
    pub fail: usize,
}

/// Everything `xpu doctor` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub profile: String,
    pub checks: Vec<Check>,
    pub summary: Summary,
    /// Problems met while reading the host (discovery, limits files) that are not checks.
    pub warnings: Vec<String>,
}

impl Report {
    pub fn failed(&self) -> bool {
        self.summary.fail > 0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    #[error(transparent)]
    Limits(#[from] LimitsError),
}

struct Checks {
    list: Vec<Check>,
}

impl Checks {
    fn push(
        &mut self,
        id: impl Into<String>,
        area: &'static str,
        check: impl Into<String>,
        status: Status,
        detail: Option<String>,
        fix: Option<&str>,
    ) {
        let fix = if status == Status::Pass { None } else { fix.map(str::to_owned) };
        self.list.push(Check { id: id.into(), area, check: check.into(), status, detail, fix });
    }

    fn verdict(
        &mut self,
        id: impl Into<String>,
        area: &'static str,
        check: impl Into<String>,
        (ok, level): (bool, Status),
        detail: Option<String>,
        fix: &str,
    ) {
        let status = if ok { Status::Pass } else { level };
        self.push(id, area, check, status, detail, Some(fix));
    }
}

/// The host facts the checks read, gathered once.
struct Facts {
    cpu_flags: Option<BTreeSet<String>>,
    cmdline: String,
    modules: BTreeSet<String>,
}

/// Host file `p`; `None` when it is missing, and with a warning when it cannot be read. A
/// link to `/dev/null` (a masked configuration file) is empty.
fn read(root: &Root, p: &str, w: &mut Vec<String>) -> Option<String> {
    match root.read_bounded(&root.path(p), TEXT_MAX) {
        Ok(b) => Some(String::from_utf8_lossy(&b).into_owned()),
        Err(ReadError::Missing) => None,
        Err(e) if e.is_null_device() => Some(String::new()),
        Err(e) => {
            w.push(format!("{p}: {e}; taken as empty"));
            None
        }
    }
}

fn exists(root: &Root, p: &str) -> bool {
    std::fs::symlink_metadata(root.path(p)).is_ok()
}

impl Facts {
    fn read(root: &Root, w: &mut Vec<String>) -> Facts {
        let cpu_flags = read(root, "/proc/cpuinfo", w).and_then(|t| {
            // virt-host-validate reads the x86 `flags` lines; other architectures have none.
            let mut lines = t.lines().filter(|l| l.starts_with("flags")).peekable();
            lines.peek()?;
            Some(
                lines
                    .filter_map(|l| l.split_once(':'))
                    .flat_map(|(_, v)| v.split_whitespace().map(str::to_owned))
                    .collect(),
            )
        });
        let cmdline = read(root, "/proc/cmdline", w).unwrap_or_default();
        let mut modules: BTreeSet<String> = read(root, "/proc/modules", w)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect();
        // Built-in modules with parameters show only under /sys/module.
        if let Ok(d) = std::fs::read_dir(root.path("/sys/module")) {
            modules.extend(d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()));
        }
        Facts { cpu_flags, cmdline, modules }
    }

    fn has_flag(&self, f: &str) -> bool {
        self.cpu_flags.as_ref().is_some_and(|s| s.contains(f))
    }
}

/// The profiles whose checks run: `all` means vfio-host and container-host, plus tpu-vm when
/// the host has TPUs (so a GPU host is not told to poll idle CPUs).
fn effective_profiles(profile: Profile, inv: &Inventory) -> Vec<Profile> {
    match profile {
        Profile::All => {
            let mut v = vec![Profile::VfioHost, Profile::ContainerHost];
            if inv.of_kind(DeviceKind::Tpu).next().is_some() {
                v.push(Profile::TpuVm);
            }
            v
        }
        p => vec![p],
    }
}

/// Runs the checks of `profile` on the host under `root`, whose devices are `inv`.
pub fn run(root: &Root, inv: &Inventory, profile: Profile) -> Result<Report, DoctorError> {
    let profiles = effective_profiles(profile, inv);
    let has = |p: Profile| profiles.contains(&p);
    let mut warnings = inv.warnings.clone();
    let facts = Facts::read(root, &mut warnings);
    let mut c = Checks { list: Vec::new() };
    let apply_fix = |p: Profile| format!("xpu host apply --profile {p}");
    let main_vfio = if has(Profile::VfioHost) { Profile::VfioHost } else { Profile::TpuVm };

    if has(Profile::VfioHost) {
        kvm_checks(root, &facts, &mut c);
    }
    if has(Profile::VfioHost) || has(Profile::ContainerHost) {
        cgroup_checks(root, &profiles, &mut c, &mut warnings);
    }
    let vfio_wanted = has(Profile::VfioHost) || has(Profile::TpuVm);
    if vfio_wanted {
        iommu_checks(root, inv, &facts, &apply_fix(main_vfio), &mut c);
    }

    // Kernel parameters.
    let vendor = CpuVendor::from_inventory(inv.host.cpu_vendor.as_deref());
    let params_of = |v: CpuVendor| {
        let mut ps: Vec<&str> = Vec::new();
        for p in &profiles {
            for q in p.kernel_params(v) {
                let key = crate::profile::param_key(q);
                match ps.iter().position(|x| crate::profile::param_key(x) == key) {
                    // tpu-vm's intel_iommu=on,sm_on covers vfio-host's intel_iommu=on.
                    Some(i) if q.len() > ps[i].len() => ps[i] = q,
                    Some(_) => {}
                    None => ps.push(q),
                }
            }
        }
        ps
    };
    let params = match vendor {
        Some(v) => params_of(v),
        None if params_of(CpuVendor::Intel) == params_of(CpuVendor::Amd) => {
            params_of(CpuVendor::Intel)
        }
        None => {
            c.push(
                "kernel.cpu-vendor",
                "KERNEL",
                "for the CPU vendor (picks the IOMMU parameters)",
                Status::Warn,
                Some("no GenuineIntel or AuthenticAMD vendor_id in /proc/cpuinfo".to_owned()),
                Some("check /proc/cpuinfo; pass --cpu-vendor to xpu host apply"),
            );
            Vec::new()
        }
    };
    for p in &params {
        let owner = profiles
            .iter()
            .copied()
            .find(|pr| vendor.is_some_and(|v| pr.kernel_params(v).contains(p)))
            .unwrap_or(main_vfio);
        c.verdict(
            format!("kernel.param.{}", crate::profile::param_key(p)),
            "KERNEL",
            format!("for kernel parameter {p}"),
            (cmdline_has(&facts.cmdline, p), Status::Fail),
            Some("not on the running kernel's command line (/proc/cmdline)".to_owned())
                .filter(|_| !cmdline_has(&facts.cmdline, p)),
            &format!("{}, then update-grub and reboot", apply_fix(owner)),
        );
    }

    if vfio_wanted {
        for m in ["vfio", "vfio_iommu_type1", "vfio_pci"] {
            c.verdict(
                format!("vfio.module.{m}"),
                "VFIO",
                format!("if module {m} is loaded"),
                (facts.modules.contains(m), Status::Fail),
                None,
                &format!(
                    "modprobe -a vfio vfio_iommu_type1 vfio_pci; load at boot with {}",
                    apply_fix(main_vfio)
                ),
            );
        }
    }
    if has(Profile::VfioHost) && inv.accelerators().any(|d| d.vendor_id == Some(VENDOR_NVIDIA)) {
        let found = blacklisted(root, &facts.cmdline, "nouveau", &mut warnings);
        c.verdict(
            "vfio.blacklist.nouveau",
            "VFIO",
            "if conflicting driver nouveau is blacklisted",
            (found.is_some(), Status::Warn),
            found.clone().or(Some("no `blacklist nouveau` in modprobe.d".to_owned())),
            &format!(
                "{} (writes /etc/modprobe.d/xpu-blacklist.conf)",
                apply_fix(Profile::VfioHost)
            ),
        );
    }

    device_checks(root, inv, profile, &profiles, &mut c);

    limits_checks(root, &profiles, &mut c, &mut warnings)?;

    if has(Profile::VfioHost) {
        let total = read(root, "/proc/meminfo", &mut warnings).and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("HugePages_Total:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        });
        c.verdict(
            "memory.hugepages",
            "MEMORY",
            "for reserved huge pages",
            (total.is_some_and(|t| t > 0), Status::Warn),
            Some(format!(
                "HugePages_Total: {}",
                total.map_or("unknown".to_owned(), |t| t.to_string())
            )),
            "reserve them at boot: xpu host apply --profile vfio-host --hugepages N",
        );
    }
    if has(Profile::TpuVm) {
        let thp = read(root, "/sys/kernel/mm/transparent_hugepage/enabled", &mut warnings)
            .unwrap_or_default();
        let current = thp
            .split_whitespace()
            .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
            .unwrap_or("unknown")
            .to_owned();
        c.verdict("memory.thp", "MEMORY", "if transparent huge pages are always on", (current == "always", Status::Fail), Some(format!("transparent_hugepage/enabled: {current}")), "echo always > /sys/kernel/mm/transparent_hugepage/enabled; keep it with xpu host apply --profile tpu-vm");
    }

    let mut summary = Summary::default();
    for ch in &c.list {
        match ch.status {
            Status::Pass => summary.pass += 1,
            Status::Warn => summary.warn += 1,
            Status::Fail => summary.fail += 1,
        }
    }
    Ok(Report { profile: profile.to_string(), checks: c.list, summary, warnings })
}

fn kvm_checks(root: &Root, facts: &Facts, c: &mut Checks) {
    if facts.cpu_flags.is_some() {
        let flag = ["vmx", "svm"].into_iter().find(|f| facts.has_flag(f));
        c.verdict("kvm.hw-virt", "KVM", "for hardware virtualization", (flag.is_some(), Status::Fail), Some(match flag {
                Some(f) => format!("CPU flag {f}"),
                None => "no vmx or svm flag in /proc/cpuinfo; only emulated CPUs are available".to_owned(),
            }), "enable VT-x/AMD-V in the firmware (or nested virtualization on the hypervisor of this VM)");
    }
    let kvm = exists(root, "/dev/kvm");
    c.verdict(
        "kvm.dev",
        "KVM",
        "if device /dev/kvm exists",
        (kvm, Status::Fail),
        None,
        "modprobe kvm_intel (or kvm_amd) and enable virtualization in the firmware",
    );
    if kvm {
        use rustix::fs::{Access, access};
        let ok = access(root.path("/dev/kvm"), Access::READ_OK | Access::WRITE_OK).is_ok();
        c.verdict(
            "kvm.dev-access",
            "KVM",
            "if device /dev/kvm is accessible",
            (ok, Status::Fail),
            None,
            "make /dev/kvm readable and writable for this user (add it to the kvm group)",
        );
    }
    c.verdict(
        "kvm.vhost-net",
        "KVM",
        "if device /dev/vhost-net exists",
        (exists(root, "/dev/vhost-net"), Status::Warn),
        None,
        "modprobe vhost_net (faster virtio networking for guests)",
    );
    c.verdict(
        "kvm.tun",
        "KVM",
        "if device /dev/net/tun exists",
        (exists(root, "/dev/net/tun"), Status::Fail),
        None,
        "modprobe tun (guest networking needs it)",
    );
}

fn cgroup_checks(root: &Root, profiles: &[Profile], c: &mut Checks, w: &mut Vec<String>) {
    let cg = cgroups::detect_noting(root, w);
    let container = profiles.contains(&Profile::ContainerHost);
    let vfio = profiles.contains(&Profile::VfioHost);
    // virt-host-validate's order (libvirt's controller enum).
    for ctl in ["cpu", "cpuacct", "cpuset", "memory", "devices", "blkio", "pids"] {
        let level = if container {
            Status::Fail
        } else if vfio && ctl != "pids" {
            Status::Warn
        } else {
            continue;
        };
        c.verdict(format!("cgroup.{ctl}"), "CGROUP", format!("for cgroup '{ctl}' controller support"), (cg.has(ctl), level), Some(format!("cgroup {}", cg.mode.as_str())), &format!("enable the '{ctl}' controller: mount it (cgroup v1) or delegate it in cgroup.subtree_control (v2)"));
    }
}

fn iommu_checks(root: &Root, inv: &Inventory, facts: &Facts, apply_fix: &str, c: &mut Checks) {
    let dmar = exists(root, "/sys/firmware/acpi/tables/DMAR");
    let ivrs = exists(root, "/sys/firmware/acpi/tables/IVRS");
    let (ok, detail) = if facts.has_flag("vmx") {
        (
            dmar,
            if dmar {
                "ACPI DMAR table present"
            } else {
                "no ACPI DMAR table: IOMMU disabled in the firmware or not supported"
            },
        )
    } else if facts.has_flag("svm") {
        (
            ivrs,
            if ivrs {
                "ACPI IVRS table present"
            } else {
                "no ACPI IVRS table: IOMMU disabled in the firmware or not supported"
            },
        )
    } else if dmar || ivrs {
        (
            true,
            if dmar {
                "ACPI DMAR table present (virtual IOMMU)"
            } else {
                "ACPI IVRS table present (virtual IOMMU)"
            },
        )
    } else {
        (
            false,
            "unknown if this platform has IOMMU support (no vmx/svm flag, no ACPI DMAR/IVRS table)",
        )
    };
    c.verdict(
        "iommu.support",
        "IOMMU",
        "for device assignment IOMMU support",
        (ok, Status::Warn),
        Some(detail.to_owned()),
        "enable VT-d (Intel) or AMD-Vi/IOMMU (AMD) in the firmware",
    );
    let groups = inv.host.iommu_groups;
    c.verdict(
        "iommu.enabled",
        "IOMMU",
        "if IOMMU is enabled by kernel",
        (groups > 0, Status::Warn),
        Some(format!("{groups} IOMMU groups")),
        &format!("{apply_fix} (adds the IOMMU kernel parameters), then update-grub and reboot"),
    );
}

/// Where `driver` is blacklisted: a modprobe.d file or the kernel command line.
fn blacklisted(root: &Root, cmdline: &str, driver: &str, w: &mut Vec<String>) -> Option<String> {
    for tok in cmdline.split_whitespace() {
        if let Some(list) = tok
            .strip_prefix("modprobe.blacklist=")
            .or_else(|| tok.strip_prefix("module_blacklist="))
            && list.split(',').any(|m| m == driver)
        {
            return Some(format!("{tok} on the kernel command line"));
        }
    }
    for dir in ["/etc/modprobe.d", "/run/modprobe.d", "/usr/lib/modprobe.d", "/lib/modprobe.d"] {
        let Ok(entries) = std::fs::read_dir(root.path(dir)) else { continue };
        let mut names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".conf"))
            .collect();
        names.sort();
        for n in names {
            let path = format!("{dir}/{n}");
            let Some(text) = read(root, &path, w) else { continue };
            let hit = text.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                matches!(f[..], ["blacklist", m] if m == driver)
                    || matches!(f[..], ["install", m, "/bin/false" | "/bin/true", ..] if m == driver)
            });
            if hit {
                return Some(format!("blacklisted in {path}"));
            }
        }
    }
    None
}

fn label(d: &PciDevice) -> String {
    match d.product.as_deref().or(d.device_name.as_deref()) {
        Some(name) => format!("{} ({name})", d.address),
        None => format!("{} ({})", d.address, d.ids()),
    }
}

/// The host driver a vendor's accelerators run on in a container host.
fn vendor_driver(d: &PciDevice) -> Option<&'static str> {
    match d.vendor_id? {
        VENDOR_NVIDIA => Some("nvidia"),
        VENDOR_AMD => Some("amdgpu"),
        VENDOR_HABANA => Some("habanalabs"),
        _ => None,
    }
}

fn device_checks(
    root: &Root,
    inv: &Inventory,
    profile: Profile,
    profiles: &[Profile],
    c: &mut Checks,
) {
    let accels: Vec<&PciDevice> = inv.accelerators().collect();
    if accels.is_empty() {
        c.push(
            "accel.none",
            "DEVICE",
            "for accelerators",
            Status::Warn,
            Some("no GPU, TPU, NPU or NVSwitch found on the PCI bus".to_owned()),
            Some("check xpu discover --all; the devices may be missing, hidden by the hypervisor or unknown to xpu"),
        );
        return;
    }
    let mut container_gpus: Vec<&PciDevice> = Vec::new();
    for d in accels {
        let on_vfio = d.driver.as_deref().is_some_and(|x| VIABLE_DRIVERS.contains(&x));
        let passthrough = match profile {
            Profile::VfioHost => true,
            Profile::TpuVm => d.kind == DeviceKind::Tpu,
            Profile::ContainerHost => false,
            // Whatever the device is set up for; TPUs have no other driver.
            Profile::All => on_vfio || d.kind == DeviceKind::Tpu,
        };
        if passthrough {
            let mode = if profiles.contains(&Profile::TpuVm) && d.kind == DeviceKind::Tpu {
                Profile::TpuVm.vfio_node_mode()
            } else {
                None
            };
            passthrough_checks(root, inv, d, mode, c);
        } else if d.kind != DeviceKind::Tpu
            && (profile == Profile::ContainerHost || profile == Profile::All)
        {
            container_gpus.push(d);
        }
    }
    for d in &container_gpus {
        let want = vendor_driver(d);
        let ok = match (want, d.driver.as_deref()) {
            (Some(w), Some(have)) => w == have,
            (None, Some(have)) => have != VFIO_DRIVER,
            _ => false,
        };
        let fix = match want {
            Some(w) => format!(
                "install and load the {w} driver (xpu vfio unbind {} if it is on vfio-pci)",
                d.address
            ),
            None => format!("load the vendor driver for {}", d.address),
        };
        c.verdict(
            format!("device.{}.driver", d.address),
            "DEVICE",
            format!("{} is on {}", label(d), want.unwrap_or("its vendor driver")),
            (ok, Status::Fail),
            Some(format!("driver: {}", d.driver.as_deref().unwrap_or("none"))),
            &fix,
        );
        // NVSwitches are driven by the fabric manager through /dev/nvidia-nvswitchN, which
        // discovery does not report; only compute devices need their own node in a container.
        if d.kind == DeviceKind::Nvswitch {
            continue;
        }
        let nodes: Vec<&str> = d
            .dev_nodes
            .iter()
            .map(|n| n.path.as_str())
            .filter(|p| {
                p.starts_with("/dev/nvidia")
                    || p.starts_with("/dev/dri/")
                    || p.starts_with("/dev/accel")
            })
            .collect();
        c.verdict(format!("device.{}.nodes", d.address), "DEVICE", format!("{} device nodes exist", d.address), (!nodes.is_empty(), Status::Fail), Some(if nodes.is_empty() { "no device node".to_owned() } else { nodes.join(", ") }), "load the driver; for NVIDIA run nvidia-modprobe -c=<minor> (or nvidia-smi) to create /dev/nvidiaN");
    }
    let nvidia = container_gpus.iter().any(|d| d.vendor_id == Some(VENDOR_NVIDIA));
    if nvidia {
        let v = inv.host.nvidia_driver_version.clone();
        c.verdict(
            "nvidia.driver",
            "NVIDIA",
            "for the NVIDIA driver version",
            (v.is_some(), Status::Fail),
            Some(v.map_or("no /proc/driver/nvidia/version".to_owned(), |v| format!("driver {v}"))),
            "install the NVIDIA driver (it publishes /proc/driver/nvidia/version)",
        );
        for node in ["/dev/nvidiactl", "/dev/nvidia-uvm"] {
            let ok = inv.host.control_nodes.iter().any(|n| n.path == node)
                || devnode::stat(root, node).is_some();
            c.verdict(format!("nvidia.node.{}", node.trim_start_matches("/dev/")), "NVIDIA", format!("if device {node} exists"), (ok, Status::Fail), None, if node == "/dev/nvidia-uvm" {
                    "modprobe nvidia_uvm (or nvidia-modprobe -u -c=0); load it at boot with xpu host apply --profile container-host"
                } else {
                    "load the nvidia driver (modprobe nvidia) or run nvidia-modprobe"
                });
        }
    }
    if container_gpus.iter().any(|d| d.vendor_id == Some(VENDOR_AMD)) {
        c.verdict(
            "amd.node.kfd",
            "AMD",
            "if device /dev/kfd exists",
            (devnode::stat(root, "/dev/kfd").is_some(), Status::Fail),
            None,
            "modprobe amdgpu (ROCm containers need /dev/kfd)",
        );
    }
}

fn passthrough_checks(
    root: &Root,
    inv: &Inventory,
    d: &PciDevice,
    mode: Option<u32>,
    c: &mut Checks,
) {
    let a = d.address;
    let driver = d.driver.as_deref();
    c.verdict(
        format!("device.{a}.driver"),
        "DEVICE",
        format!("{} is on vfio-pci", label(d)),
        (driver == Some(VFIO_DRIVER), Status::Fail),
        Some(format!("driver: {}", driver.unwrap_or("none"))),
        &format!("xpu vfio bind {a}"),
    );
    let Some(group) = d.iommu_group else {
        c.push(
            format!("device.{a}.group"),
            "DEVICE",
            format!("{a} IOMMU group is viable"),
            Status::Fail,
            Some("no IOMMU group: the IOMMU is off".to_owned()),
            Some("enable the IOMMU (see the IOMMU checks), then reboot"),
        );
        return;
    };
    let blockers = group_blockers(inv, group);
    let others: Vec<String> = blockers
        .iter()
        .filter(|b| b.address != a)
        .map(|b| format!("{} ({})", b.address, b.driver.as_deref().unwrap_or("no driver")))
        .collect();
    let detail = if blockers.is_empty() {
        format!("group {group}: every endpoint on vfio-pci, pci-stub or no driver")
    } else if others.is_empty() {
        format!("group {group}: this device is on {}", driver.unwrap_or("no driver"))
    } else {
        format!("group {group} also holds {}", others.join(", "))
    };
    let fix = if others.is_empty() {
        format!("xpu vfio bind {a}")
    } else {
        format!("xpu vfio bind {a} --group")
    };
    c.verdict(
        format!("device.{a}.group"),
        "DEVICE",
        format!("{a} IOMMU group {group} is viable"),
        (blockers.is_empty(), Status::Fail),
        Some(detail),
        &fix,
    );
    if driver != Some(VFIO_DRIVER) {
        return;
    }
    let path = format!("/dev/vfio/{group}");
    let node = devnode::stat(root, &path);
    let title = match mode {
        Some(m) => format!("if device {path} exists with mode {m:04o}"),
        None => format!("if device {path} exists"),
    };
    let (ok, detail) = match (&node, mode) {
        (None, _) => (false, "missing".to_owned()),
        (Some(n), Some(m)) => {
            let have = n.mode.unwrap_or(0);
            (have & m == m, format!("mode {have:04o}"))
        }
        (Some(n), None) => (true, format!("mode {:04o}", n.mode.unwrap_or(0))),
    };
    let fix = match mode {
        Some(m) if node.is_some() => format!(
            "chmod {m:04o} {path}; keep it with xpu host apply --profile tpu-vm (udev MODE rule)"
        ),
        _ => format!("modprobe vfio_pci and rebind: xpu vfio unbind {a} && xpu vfio bind {a}"),
    };
    c.verdict(
        format!("device.{a}.vfio-node"),
        "DEVICE",
        title,
        (ok, Status::Fail),
        Some(detail),
        &fix,
    );
}

fn show(sh: SoftHard) -> String {
    let f = |l: Option<Limit>| l.map_or("unset".to_owned(), |l| l.to_string());
    format!("soft {}, hard {}", f(sh.soft), f(sh.hard))
}

fn limits_checks(
    root: &Root,
    profiles: &[Profile],
    c: &mut Checks,
    warnings: &mut Vec<String>,
) -> Result<(), DoctorError> {
    let strict = profiles.iter().any(|p| p.wants_vfio());
    let level = if strict { Status::Fail } else { Status::Warn };
    let cfg = LimitsConfig::load(root)?;
    warnings.extend(cfg.warnings.iter().cloned());
    let profile_fix = if profiles.contains(&Profile::TpuVm) {
        Profile::TpuVm
    } else if profiles.contains(&Profile::VfioHost) {
        Profile::VfioHost
    } else {
        Profile::ContainerHost
    };
    for (item, want, want_text) in [
        (Item::Memlock, Limit::Unlimited, "unlimited".to_owned()),
        (Item::Nofile, Limit::Value(NOFILE_WANTED), format!(">= {NOFILE_WANTED}")),
    ] {
        let meets = |sh: SoftHard| {
            let ok = |l: Option<Limit>| match (l, want) {
                (Some(l), Limit::Value(n)) => l.at_least(n),
                (Some(l), Limit::Unlimited) => l == Limit::Unlimited,
                (None, _) => false,
            };
            ok(sh.soft) && ok(sh.hard)
        };
        let name = item.conf_name();
        let eff = limits::effective(root, item).unwrap_or_else(|e| {
            // Once for both items.
            let e = e.to_string();
            if !warnings.contains(&e) {
                warnings.push(e);
            }
            None
        });
        c.verdict(format!("limits.{name}.effective"), "LIMITS", format!("for {name} {want_text} in this session"), (eff.is_some_and(meets), Status::Warn), Some(eff.map_or("cannot read /proc/self/limits".to_owned(), |sh| {
                // memlock is in bytes in /proc and KiB in limits.conf; show what /proc says.
                show(sh)
            })), "log in again after fixing limits.conf (pam_limits applies it at login), or raise it with ulimit / LimitMEMLOCK= / LimitNOFILE= for services");
        let root_sh = cfg.resolve(Subject::Root, item);
        let user_sh = cfg.resolve(Subject::AnyUser, item);
        let ok = meets(root_sh) && meets(user_sh);
        c.verdict(
            format!("limits.{name}.config"),
            "LIMITS",
            format!("for {name} {want_text} in limits.conf"),
            (ok, level),
            Some(format!("root: {}; other users (*): {}", show(root_sh), show(user_sh))),
            &format!(
                "xpu host apply --profile {profile_fix} (writes /etc/security/limits.d/90-xpu.conf)"
            ),
        );
    }
    Ok(())
}
