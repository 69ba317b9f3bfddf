//! Test fixtures for xpu.
//!
//! A [`HostSpec`] describes a host declaratively (its PCI functions, drivers, IOMMU groups, NUMA
//! nodes, device nodes, driver version); [`HostSpec::build`] lays it out in a temporary
//! directory exactly as the kernel does (`sys/bus/pci/devices/<addr>` links into
//! `sys/devices/...`, `driver` and `iommu_group` links, binary `config` space that
//! `lspci -O sysfs.path=...` can read, `/proc/driver/nvidia`, `/dev` nodes). The named hosts in
//! [`hosts`] are the real machine types the project is tested against.
//!
//! Device nodes are empty regular files unless the fixture is built with
//! [`BuildOptions::char_devices`], which makes real character devices with `mknod` (needs root).
//!
//! [`fake_kernel::FakeKernel`] models the kernel's reaction to driver binding writes on a built
//! tree; [`readiness::Readiness`] adds host-readiness state (ACPI tables, limits, grub, cgroups).

#![allow(clippy::unwrap_used)]

pub mod bundle;
pub mod cluster;
pub mod driver;
pub mod fake_kernel;
pub mod hosts;
pub mod kube;
pub mod kubelet;
pub mod lspci;
pub mod mps;
pub mod readiness;
pub mod sysfs;
pub mod traps;

pub use sysfs::{BuildOptions, Fixture};

/// Whether the tests run as root (the effective uid is 0): what `mknod`, runc and becoming
/// another user need.
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

use xpu_core::PciAddress;

/// A host to build.
#[derive(Debug, Clone)]
pub struct HostSpec {
    pub name: String,
    pub hostname: String,
    pub kernel_release: String,
    /// `GenuineIntel` or `AuthenticAMD`.
    pub cpu_vendor: String,
    /// CPU flags written to `/proc/cpuinfo` (`vmx` or `svm` among them for KVM hosts).
    pub cpu_flags: Vec<String>,
    pub devices: Vec<DevSpec>,
    /// Writes `/proc/driver/nvidia/version` when set.
    pub nvidia_driver: Option<String>,
    /// Modules listed in `/proc/modules` and `/sys/module`.
    pub loaded_modules: Vec<String>,
    /// `lib/modules/<release>/modules.alias` content.
    pub modules_alias: Option<String>,
    /// Control nodes under `/dev` (`/dev/nvidiactl`...), with their major/minor.
    pub control_nodes: Vec<NodeSpec>,
    /// Kernel command line (`/proc/cmdline`).
    pub cmdline: String,
    /// The `nvidia-caps` character major: when set, `/proc/devices` lists it and
    /// `/proc/driver/nvidia-caps/mig-minors` lists the MIG capability minors, as the NVIDIA
    /// driver writes them on a MIG-capable host.
    pub nvidia_caps: Option<u32>,
}

/// A `/dev` node to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub path: String,
    pub major: u32,
    pub minor: u32,
    pub mode: u32,
}

impl NodeSpec {
    pub fn new(path: impl Into<String>, major: u32, minor: u32) -> Self {
        Self { path: path.into(), major, minor, mode: 0o666 }
    }
}

/// One PCI function.
#[derive(Debug, Clone)]
pub struct DevSpec {
    pub address: PciAddress,
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: u16,
    pub subsystem_device: u16,
    /// 24-bit class code (`0x030200`).
    pub class: u32,
    pub revision: u8,
    pub driver: Option<String>,
    pub iommu_group: Option<u32>,
    /// -1 when the platform has no NUMA information, as the kernel writes it.
    pub numa_node: i32,
    pub sriov_totalvfs: Option<u32>,
    pub sriov_numvfs: Option<u32>,
    pub physfn: Option<PciAddress>,
    /// (`16.0 GT/s PCIe`, 16)
    pub link: Option<(String, u32)>,
    /// NVIDIA `Device Minor` (→ `/dev/nvidiaN`) and UUID.
    pub nvidia_minor: Option<u32>,
    pub uuid: Option<String>,
    /// `/dev/accelN`
    pub accel_minor: Option<u32>,
    /// `/dev/dri/cardN` and `/dev/dri/renderD(128+N)`
    pub drm_minor: Option<u32>,
    /// AMD XGMI hive id.
    pub xgmi_hive: Option<String>,
    /// The display controller the firmware booted on: its `boot_vga` reads `1` (the fixtures
    /// write no `boot_vga` for other functions; xpu reads a missing one as `0`).
    pub boot_vga: bool,
    /// An AMD Instinct GPU's partitioning ([`Partitions`]).
    pub partitions: Option<Partitions>,
}

/// amdgpu's partition files on a GPU and the KFD topology nodes of its partitions: `count`
/// partitions (render nodes `renderD(128+drm_minor+i)`), each of `xcc` dies and `memory_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitions {
    pub compute: String,
    pub memory: String,
    pub available_compute: String,
    pub available_memory: String,
    pub count: u32,
    pub xcc: u32,
    pub memory_bytes: u64,
}

impl DevSpec {
    pub fn new(address: &str, vendor: u16, device: u16, class: u32) -> Self {
        Self {
            address: address.parse().expect("fixture addresses are valid"),
            vendor,
            device,
            subsystem_vendor: vendor,
            subsystem_device: device,
            class,
            revision: 0,
            driver: None,
            iommu_group: None,
            numa_node: -1,
            sriov_totalvfs: None,
            sriov_numvfs: None,
            physfn: None,
            link: None,
            nvidia_minor: None,
            uuid: None,
            accel_minor: None,
            drm_minor: None,
            xgmi_hive: None,
            boot_vga: false,
            partitions: None,
        }
    }

    pub fn subsystem(mut self, vendor: u16, device: u16) -> Self {
        self.subsystem_vendor = vendor;
        self.subsystem_device = device;
        self
    }

    pub fn revision(mut self, rev: u8) -> Self {
        self.revision = rev;
        self
    }

    pub fn driver(mut self, driver: &str) -> Self {
        self.driver = Some(driver.to_owned());
        self
    }

    pub fn group(mut self, group: u32) -> Self {
        self.iommu_group = Some(group);
        self
    }

    pub fn numa(mut self, node: i32) -> Self {
        self.numa_node = node;
        self
    }

    pub fn link(mut self, speed: &str, width: u32) -> Self {
        self.link = Some((speed.to_owned(), width));
        self
    }

    pub fn sriov(mut self, total: u32, num: u32) -> Self {
        self.sriov_totalvfs = Some(total);
        self.sriov_numvfs = Some(num);
        self
    }

    pub fn physfn(mut self, pf: &str) -> Self {
        self.physfn = Some(pf.parse().expect("fixture addresses are valid"));
        self
    }

    pub fn nvidia(mut self, minor: u32, uuid: &str) -> Self {
        self.nvidia_minor = Some(minor);
        self.uuid = Some(uuid.to_owned());
        self
    }

    pub fn accel(mut self, minor: u32) -> Self {
        self.accel_minor = Some(minor);
        self
    }

    pub fn drm(mut self, minor: u32) -> Self {
        self.drm_minor = Some(minor);
        self
    }

    pub fn partitions(mut self, p: Partitions) -> Self {
        self.partitions = Some(p);
        self
    }

    /// The host's boot display (`boot_vga` reads `1`).
    pub fn boot_vga(mut self) -> Self {
        self.boot_vga = true;
        self
    }

    pub fn xgmi(mut self, hive: &str) -> Self {
        self.xgmi_hive = Some(hive.to_owned());
        self
    }

    /// `pci:v000010DEd000020B0sv000010DEsd0000134Fbc03sc02i00`, as the kernel writes it.
    pub fn modalias(&self) -> String {
        format!(
            "pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}",
            self.vendor,
            self.device,
            self.subsystem_vendor,
            self.subsystem_device,
            (self.class >> 16) & 0xff,
            (self.class >> 8) & 0xff,
            self.class & 0xff
        )
    }

    /// 256 bytes of type-0 (or type-1 for PCI-PCI bridges) configuration space consistent with
    /// the id files, so `lspci` reading `config` agrees with xpu reading the attributes.
    pub fn config_space(&self) -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[0..2].copy_from_slice(&self.vendor.to_le_bytes());
        c[2..4].copy_from_slice(&self.device.to_le_bytes());
        c[8] = self.revision;
        c[9] = (self.class & 0xff) as u8;
        c[10] = ((self.class >> 8) & 0xff) as u8;
        c[11] = ((self.class >> 16) & 0xff) as u8;
        let bridge = self.class >> 8 == 0x0604;
        c[0x0e] = u8::from(bridge);
        if !bridge {
            c[0x2c..0x2e].copy_from_slice(&self.subsystem_vendor.to_le_bytes());
            c[0x2e..0x30].copy_from_slice(&self.subsystem_device.to_le_bytes());
        }
        c
    }
}

impl HostSpec {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            hostname: name.to_owned(),
            kernel_release: "6.8.0-xpu-fixture".to_owned(),
            cpu_vendor: "GenuineIntel".to_owned(),
            cpu_flags: ["fpu", "vme", "lm", "vmx", "avx2"].map(str::to_owned).to_vec(),
            devices: Vec::new(),
            nvidia_driver: None,
            loaded_modules: Vec::new(),
            modules_alias: Some(hosts::MODULES_ALIAS.to_owned()),
            control_nodes: Vec::new(),
            cmdline: "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet".to_owned(),
            nvidia_caps: None,
        }
    }

    pub fn device(mut self, d: DevSpec) -> Self {
        self.devices.push(d);
        self
    }

    /// Builds the tree in a new temporary directory with placeholder device nodes.
    pub fn build(&self) -> Fixture {
        self.build_with(&BuildOptions::default())
    }

    pub fn build_with(&self, opts: &BuildOptions) -> Fixture {
        Fixture::build(self, opts)
    }
}
