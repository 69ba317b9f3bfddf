//! The host [`Inventory`]: what `xpu discover` found, in the stable JSON shape documented in
//! `docs/discover.md`. Everything downstream (CDI, the scheduler, the device plugin, nova config)
//! consumes this and never reads sysfs itself.
//!
//! Every field that comes from the host is optional: a missing or garbled sysfs file makes that
//! one field `null` (with a warning), never the whole listing fail.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::accel::DeviceKind;
use crate::pci::{PciAddress, hex};

/// Everything discovered on one host.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    /// PCI functions, sorted by address.
    pub devices: Vec<PciDevice>,
    #[serde(default)]
    pub host: HostInfo,
    /// Problems met while reading the host; each names the file and what was wrong.
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// Host-wide facts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub hostname: Option<String>,
    pub kernel_release: Option<String>,
    /// `intel` or `amd` (from `/proc/cpuinfo`), which picks the IOMMU kernel parameter.
    pub cpu_vendor: Option<String>,
    /// Number of IOMMU groups under `/sys/kernel/iommu_groups` (0: IOMMU off or absent).
    #[serde(default)]
    pub iommu_groups: u32,
    /// From `/proc/driver/nvidia/version`.
    pub nvidia_driver_version: Option<String>,
    /// Shared control nodes present on the host: `/dev/nvidiactl`, `/dev/nvidia-uvm`,
    /// `/dev/nvidia-uvm-tools`, `/dev/nvidia-modeset`, `/dev/kfd`, `/dev/vfio/vfio`.
    #[serde(default)]
    pub control_nodes: Vec<DevNode>,
}

/// Whether `path` is an NVIDIA GPU node (`/dev/nvidia0`), not a control node.
pub fn is_nvidia_gpu_node(path: &str) -> bool {
    path.strip_prefix("/dev/nvidia")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// One PCI function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PciDevice {
    pub address: PciAddress,
    #[serde(default, with = "hex::u16_4")]
    pub vendor_id: Option<u16>,
    #[serde(default, with = "hex::u16_4")]
    pub device_id: Option<u16>,
    #[serde(default, with = "hex::u16_4")]
    pub subsystem_vendor_id: Option<u16>,
    #[serde(default, with = "hex::u16_4")]
    pub subsystem_device_id: Option<u16>,
    /// Base class and subclass, as `lspci -nn` prints it: `0302`.
    #[serde(default, with = "hex::u16_4")]
    pub class: Option<u16>,
    #[serde(default, with = "hex::u8_2")]
    pub prog_if: Option<u8>,
    #[serde(default, with = "hex::u8_2")]
    pub revision: Option<u8>,
    pub class_name: Option<String>,
    pub vendor_name: Option<String>,
    pub device_name: Option<String>,
    pub kind: DeviceKind,
    /// Product from the generation table (`A100-SXM4-40GB`), when known.
    pub product: Option<String>,
    pub generation: Option<String>,
    pub driver: Option<String>,
    /// Modules whose aliases match the device's modalias; `null` when `modules.alias` is absent.
    pub kernel_modules: Option<Vec<String>>,
    pub iommu_group: Option<u32>,
    pub numa_node: Option<u32>,
    #[serde(default)]
    pub sriov: Sriov,
    #[serde(default)]
    pub link: Link,
    /// NVIDIA GPU UUID (`GPU-...`) from `/proc/driver/nvidia/gpus/<bus>/information`.
    pub uuid: Option<String>,
    /// Devices with the same domain share a fast interconnect (NVLink through NVSwitch, TPU ICI).
    pub interconnect_domain: Option<String>,
    pub dev_nodes: Vec<DevNode>,
    /// An AMD Instinct GPU's compute and memory partitioning, where amdgpu reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitioning: Option<Partitioning>,
}

/// How amdgpu partitions an AMD Instinct GPU (MI300 series and later): its compute partition
/// mode (`current_compute_partition`: `SPX`, `DPX`, `TPX`, `QPX`, `CPX`), its memory partition
/// mode (`current_memory_partition`: `NPS1`, `NPS2`, `NPS4`...), what each accepts, and the
/// logical GPUs the modes make (one per KFD topology node of the GPU).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partitioning {
    pub compute: String,
    pub memory: Option<String>,
    #[serde(default)]
    pub available_compute: Vec<String>,
    #[serde(default)]
    pub available_memory: Vec<String>,
    /// In render node order; one in `SPX` (the whole GPU).
    #[serde(default)]
    pub partitions: Vec<Partition>,
}

/// One logical GPU of a partitioned AMD GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    /// 0.. in render node order; 0 is the function's own render node.
    pub index: u32,
    /// Its `/dev/dri/renderD<N>`.
    pub render_node: DevNode,
    /// Accelerator complex dies (XCDs) in it (KFD's `num_xcc`).
    pub xcc: Option<u32>,
    /// Its memory (KFD's first memory bank, `size_in_bytes`).
    pub memory_bytes: Option<u64>,
}

impl PciDevice {
    /// A device with only its address known; discovery fills in the rest.
    pub fn new(address: PciAddress) -> Self {
        Self {
            address,
            vendor_id: None,
            device_id: None,
            subsystem_vendor_id: None,
            subsystem_device_id: None,
            class: None,
            prog_if: None,
            revision: None,
            class_name: None,
            vendor_name: None,
            device_name: None,
            kind: DeviceKind::Other,
            product: None,
            generation: None,
            driver: None,
            kernel_modules: None,
            iommu_group: None,
            numa_node: None,
            sriov: Sriov::default(),
            link: Link::default(),
            uuid: None,
            interconnect_domain: None,
            dev_nodes: Vec::new(),
            partitioning: None,
        }
    }

    /// The minor of its `/dev/nvidiaN` node (the NVIDIA driver's GPU minor), when it has one.
    pub fn nvidia_minor(&self) -> Option<u32> {
        self.dev_nodes.iter().find(|n| is_nvidia_gpu_node(&n.path)).and_then(|n| n.minor)
    }

    /// The 24-bit class code, when both halves are known.
    pub fn class_code(&self) -> Option<u32> {
        Some((u32::from(self.class?) << 8) | u32::from(self.prog_if?))
    }

    /// PCI bridges (base class 06) do not take part in IOMMU group viability: the kernel's VFIO
    /// documentation exempts them, as do libvirt and Nova.
    pub fn is_bridge(&self) -> bool {
        self.class.is_some_and(|c| c >> 8 == 0x06) && self.kind != DeviceKind::Nvswitch
    }

    /// `vvvv:dddd` as `lspci -n` prints it.
    pub fn ids(&self) -> String {
        fn h(v: Option<u16>) -> String {
            v.map_or_else(|| "????".to_owned(), |v| format!("{v:04x}"))
        }
        format!("{}:{}", h(self.vendor_id), h(self.device_id))
    }
}

/// SR-IOV role, named as Nova's `device_type` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum SriovType {
    #[serde(rename = "type-PCI")]
    #[default]
    Pci,
    #[serde(rename = "type-PF")]
    Pf,
    #[serde(rename = "type-VF")]
    Vf,
}

impl SriovType {
    pub fn as_str(self) -> &'static str {
        match self {
            SriovType::Pci => "type-PCI",
            SriovType::Pf => "type-PF",
            SriovType::Vf => "type-VF",
        }
    }
}

impl std::fmt::Display for SriovType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SriovType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "type-PCI" => Ok(SriovType::Pci),
            "type-PF" => Ok(SriovType::Pf),
            "type-VF" => Ok(SriovType::Vf),
            _ => Err(format!("unknown device_type {s:?}; expected type-PCI, type-PF or type-VF")),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sriov {
    #[serde(rename = "type")]
    pub kind: SriovType,
    pub total_vfs: Option<u32>,
    pub num_vfs: Option<u32>,
    /// The parent PF of a VF.
    pub physfn: Option<PciAddress>,
}

/// PCIe link state: the current (negotiated) speed/width, and the maximum the device supports,
/// so a GPU that trained at x8 or Gen3 stands out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    /// `16.0 GT/s`
    pub speed: Option<String>,
    pub width: Option<u32>,
    pub max_speed: Option<String>,
    pub max_width: Option<u32>,
}

/// The kind of a device node, as `stat` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NodeType {
    #[serde(rename = "c")]
    Char,
    #[serde(rename = "b")]
    Block,
}

/// A `/dev` node that belongs to a device. Type, major and minor come from the host's real node
/// (never guessed); they are `null` when the path exists but is not a device node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DevNode {
    /// Path as seen from inside the host (`/dev/nvidia0`), never prefixed with `--root`.
    pub path: String,
    #[serde(rename = "type")]
    pub node_type: Option<NodeType>,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    /// Permission bits (`0o666`), written as an octal string `"0666"`.
    #[serde(default, with = "octal")]
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

mod octal {
    use super::*;
    pub(super) fn serialize<S: Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.collect_str(&format_args!("{v:04o}")),
            None => s.serialize_none(),
        }
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        s.map(|s| u32::from_str_radix(&s, 8).map_err(serde::de::Error::custom)).transpose()
    }
}

impl Inventory {
    pub fn device(&self, address: &PciAddress) -> Option<&PciDevice> {
        self.devices.binary_search_by(|d| d.address.cmp(address)).ok().map(|i| &self.devices[i])
    }

    pub fn accelerators(&self) -> impl Iterator<Item = &PciDevice> {
        self.devices.iter().filter(|d| d.kind.is_accelerator())
    }

    pub fn of_kind(&self, kind: DeviceKind) -> impl Iterator<Item = &PciDevice> {
        self.devices.iter().filter(move |d| d.kind == kind)
    }

    /// All functions in an IOMMU group, in address order.
    pub fn iommu_group(&self, group: u32) -> impl Iterator<Item = &PciDevice> {
        self.devices.iter().filter(move |d| d.iommu_group == Some(group))
    }

    /// The default `xpu discover` view: accelerators plus every device that shares an IOMMU
    /// group with one (the audio function next to a GPU, the bridge above a TPU), because those
    /// decide whether the accelerator can be passed through.
    pub fn accelerators_and_group_peers(&self) -> Inventory {
        let groups: std::collections::BTreeSet<u32> =
            self.accelerators().filter_map(|d| d.iommu_group).collect();
        let devices = self
            .devices
            .iter()
            .filter(|d| {
                d.kind.is_accelerator() || d.iommu_group.is_some_and(|g| groups.contains(&g))
            })
            .cloned()
            .collect();
        Inventory { devices, host: self.host.clone(), warnings: self.warnings.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(addr: &str, group: u32) -> PciDevice {
        let mut d = PciDevice::new(addr.parse().unwrap());
        d.vendor_id = Some(0x10de);
        d.device_id = Some(0x20b0);
        d.class = Some(0x0302);
        d.prog_if = Some(0);
        d.kind = DeviceKind::Gpu;
        d.iommu_group = Some(group);
        d
    }

    #[test]
    fn json_shape_uses_fixed_width_hex_and_nulls() {
        let mut d = gpu("0000:25:00.0", 47);
        d.revision = Some(0xa1);
        d.dev_nodes.push(DevNode {
            path: "/dev/nvidia0".into(),
            node_type: Some(NodeType::Char),
            major: Some(195),
            minor: Some(0),
            mode: Some(0o666),
            uid: Some(0),
            gid: Some(0),
        });
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["address"], "0000:25:00.0");
        assert_eq!(v["vendor_id"], "10de");
        assert_eq!(v["class"], "0302");
        assert_eq!(v["revision"], "a1");
        assert_eq!(v["subsystem_vendor_id"], serde_json::Value::Null);
        assert_eq!(v["kind"], "gpu");
        assert_eq!(v["sriov"]["type"], "type-PCI");
        assert_eq!(v["dev_nodes"][0]["type"], "c");
        assert_eq!(v["dev_nodes"][0]["mode"], "0666");
        let back: PciDevice = serde_json::from_value(v).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn default_view_keeps_group_peers() {
        let mut audio = PciDevice::new("0000:25:00.1".parse().unwrap());
        audio.iommu_group = Some(47);
        let mut nic = PciDevice::new("0000:03:00.0".parse().unwrap());
        nic.iommu_group = Some(3);
        let inv =
            Inventory { devices: vec![nic, gpu("0000:25:00.0", 47), audio], ..Default::default() };
        let view = inv.accelerators_and_group_peers();
        let addrs: Vec<String> = view.devices.iter().map(|d| d.address.to_string()).collect();
        assert_eq!(addrs, ["0000:25:00.0", "0000:25:00.1"]);
    }
}
