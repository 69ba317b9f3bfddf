//! The daemon's node: the accelerators it schedules (from the discovered [`Inventory`], plus
//! fake ones from `--devices` for testing on machines without accelerators), its labels, the
//! same node as an `xpu-sched` [`NodeSpec`], and the per-vendor environment that tells a task
//! which devices it got.

use std::collections::BTreeMap;

use serde::Serialize;
use xpu_core::accel::{ACCELERATORS, Accelerator};
use xpu_core::{DeviceKind, Inventory, PciAddress, PciDevice};
use xpu_sched::NodeSpec;

/// The variables that choose which devices a task uses, and that the daemon alone sets: a
/// job's environment and a bundle's `config.json` lose every one of them, and then the task
/// gets the daemon's values for the devices the scheduler gave it ([`Node::device_env`],
/// [`Node::container_device_env`]), so no job reaches a device held by another.
///
/// - What the `xpu runtime` shim resolves into devices to inject (`xpu_container::request`):
///   `NVIDIA_VISIBLE_DEVICES`, `XPU_VISIBLE_DEVICES`; and `XPU_DEVICES`, which it sets to what it
///   injected. (`NVIDIA_DRIVER_CAPABILITIES` and `NVIDIA_REQUIRE_*` stay the job's: they choose
///   driver files and checks for the GPUs it was given, never a GPU.)
/// - What vendors' runtimes read inside a task: CUDA (`CUDA_VISIBLE_DEVICES`, and
///   `CUDA_DEVICE_ORDER`, which decides what its indices mean), ROCm (`ROCR_VISIBLE_DEVICES`,
///   `HIP_VISIBLE_DEVICES`, `GPU_DEVICE_ORDINAL`; HIP also reads `CUDA_VISIBLE_DEVICES`), libtpu
///   (`TPU_VISIBLE_CHIPS`, `TPU_VISIBLE_DEVICES`), Habana (`HABANA_VISIBLE_DEVICES`,
///   `HABANA_VISIBLE_MODULES`) and oneAPI Level Zero (`ZE_AFFINITY_MASK`).
pub const DEVICE_VARS: [&str; 13] = [
    "NVIDIA_VISIBLE_DEVICES",
    "XPU_VISIBLE_DEVICES",
    "XPU_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "TPU_VISIBLE_CHIPS",
    "TPU_VISIBLE_DEVICES",
    "HABANA_VISIBLE_DEVICES",
    "HABANA_VISIBLE_MODULES",
    "ZE_AFFINITY_MASK",
];

/// The prefix of the OCI annotations that ask for devices by CDI name (`cdi.k8s.io/<key>`, the
/// Container Device Interface's annotation form, which the shim also resolves): the daemon drops
/// them from a bundle's `config.json`.
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// Whether `name` is one of [`DEVICE_VARS`].
pub fn selects_devices(name: &str) -> bool {
    DEVICE_VARS.contains(&name)
}

/// One schedulable device. `id` is its index in [`Node::devices`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Device {
    pub id: u32,
    /// `gpu`, `tpu`, `npu`, `nvswitch` or `other`.
    #[schema(value_type = String)]
    pub kind: DeviceKind,
    /// `nvidia`, `amd`, `google`, `intel`, or the vendor id in hex when unknown.
    pub vendor: String,
    pub product: String,
    pub address: String,
    pub uuid: Option<String>,
    pub numa_node: Option<u32>,
    pub interconnect_domain: Option<String>,
    /// Index among the node's devices of the same vendor and kind, in PCI address order: what
    /// `CUDA_VISIBLE_DEVICES` (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`), `HIP_VISIBLE_DEVICES` and
    /// `TPU_VISIBLE_CHIPS` count.
    pub vendor_index: u32,
    /// The model's memory from xpu's table of accelerators: what an MPS share's memory limit
    /// is a part of. Not part of the API.
    #[serde(skip)]
    pub memory_mib: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Node {
    pub name: String,
    pub hostname: String,
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// The node as the scheduler sees it (`xpu_sched::node_from_inventory`, with these labels);
    /// its device `i` is the device whose PCI address is `sched.devices[i].id`.
    #[serde(skip)]
    pub sched: NodeSpec,
}

#[derive(Debug, thiserror::Error)]
pub enum DevicesError {
    #[error("--devices {0:?} is not NAME:COUNT; use e.g. nvidia-a100:8, amd-mi300x:8 or tpu-v6e:8")]
    Syntax(String),
    #[error(
        "--devices {0:?}: no accelerator in the generation table matches {1:?}; try nvidia-a100, nvidia-h100, amd-mi300x, tpu-v5p, tpu-v6e or intel-gaudi2"
    )]
    Unknown(String, String),
    #[error("--label {0:?} is not KEY=VALUE")]
    Label(String),
}

/// One `--devices NAME:COUNT` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeDevices {
    pub accel: &'static Accelerator,
    pub count: u32,
}

/// Parses `nvidia-a100:8`: the name matches `vendor-product` in the generation table by prefix
/// (case-insensitive), or a TPU generation (`tpu-v6e`, `v5p`).
pub fn parse_fake(arg: &str) -> Result<FakeDevices, DevicesError> {
    let (name, count) = arg.split_once(':').ok_or_else(|| DevicesError::Syntax(arg.to_owned()))?;
    let count: u32 = count
        .parse()
        .ok()
        .filter(|n| (1..=256).contains(n))
        .ok_or_else(|| DevicesError::Syntax(arg.to_owned()))?;
    let want = name.to_ascii_lowercase();
    let tpu_gen = want.strip_prefix("tpu-").unwrap_or(&want);
    let accel = xpu_core::accel::tpu_by_name(tpu_gen)
        .filter(|_| want.starts_with("tpu") || want.starts_with('v'))
        .or_else(|| {
            ACCELERATORS.iter().find(|a| {
                a.kind != DeviceKind::Nvswitch
                    && format!("{}-{}", a.vendor, a.product).to_ascii_lowercase().starts_with(&want)
            })
        })
        .ok_or_else(|| DevicesError::Unknown(arg.to_owned(), name.to_owned()))?;
    Ok(FakeDevices { accel, count })
}

/// Adds fake PCI functions for `--devices` to an inventory (bus `0xf0` upward, so they never
/// collide with real ones), as discovery would report them.
pub fn add_fakes(inv: &mut Inventory, fakes: &[FakeDevices]) {
    let mut bus = 0xf0u8;
    for f in fakes {
        for i in 0..f.count {
            let addr = PciAddress::new(0, bus, (i & 0x1f) as u8, 0);
            let mut d = PciDevice::new(addr);
            d.vendor_id = Some(f.accel.vendor_id);
            d.device_id = Some(f.accel.device_id);
            d.kind = f.accel.kind;
            d.product = Some(f.accel.product.to_owned());
            d.generation = Some(f.accel.generation.to_owned());
            d.driver = Some("fake".to_owned());
            d.numa_node = Some(i * 2 / f.count.max(1));
            d.interconnect_domain = Some(format!("fake-{bus:02x}"));
            inv.devices.push(d);
            if i & 0x1f == 0x1f {
                bus = bus.wrapping_add(1);
            }
        }
        bus = bus.wrapping_add(1);
    }
    inv.devices.sort_by_key(|d| d.address);
}

/// Parses `--label KEY=VALUE`.
pub fn parse_label(arg: &str) -> Result<(String, String), DevicesError> {
    arg.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| DevicesError::Label(arg.to_owned()))
}

fn vendor_name(d: &PciDevice) -> String {
    match d.vendor_id {
        Some(xpu_core::accel::VENDOR_NVIDIA) => "nvidia".to_owned(),
        Some(xpu_core::accel::VENDOR_AMD) => "amd".to_owned(),
        Some(xpu_core::accel::VENDOR_GOOGLE) => "google".to_owned(),
        Some(xpu_core::accel::VENDOR_HABANA | xpu_core::accel::VENDOR_INTEL) => "intel".to_owned(),
        Some(v) => format!("{v:04x}"),
        None => "unknown".to_owned(),
    }
}

/// The single-host TPU topology for a chip count (GKE's `cloud.google.com/gke-tpu-topology`).
fn tpu_topology(dims: u8, chips: usize) -> Option<&'static str> {
    match (dims, chips) {
        (2, 1) => Some("1x1"),
        (2, 4) => Some("2x2"),
        (2, 8) => Some("2x4"),
        (3, 4) => Some("2x2x1"),
        _ => None,
    }
}

/// Builds the node from an inventory. Schedulable devices are GPUs, TPUs and NPUs (NVSwitches
/// are fabric, not something a job asks for), minus SR-IOV physical functions whose virtual
/// functions are enabled (the VFs are the units), the same rule as `xpu_sched`'s.
pub fn node_from_inventory(
    inv: &Inventory,
    extra_labels: &[(String, String)],
    cpu_milli: u64,
    memory_mib: u64,
) -> Node {
    let mut devices = Vec::new();
    let mut counters: BTreeMap<(String, DeviceKind), u32> = BTreeMap::new();
    for d in inv.devices.iter().filter(|d| {
        matches!(d.kind, DeviceKind::Gpu | DeviceKind::Tpu | DeviceKind::Npu)
            && !(d.sriov.kind == xpu_core::SriovType::Pf && d.sriov.num_vfs.is_some_and(|n| n > 0))
    }) {
        let vendor = vendor_name(d);
        let n = counters.entry((vendor.clone(), d.kind)).or_default();
        devices.push(Device {
            id: devices.len() as u32,
            kind: d.kind,
            vendor,
            product: d.product.clone().or_else(|| d.device_name.clone()).unwrap_or_else(|| d.ids()),
            address: d.address.to_string(),
            uuid: d.uuid.clone(),
            numa_node: d.numa_node,
            interconnect_domain: d.interconnect_domain.clone(),
            vendor_index: *n,
            memory_mib: d
                .vendor_id
                .zip(d.device_id)
                .and_then(|(v, id)| xpu_core::accel::lookup(v, id))
                .map(|a| u64::from(a.memory_gib) * 1024),
        });
        *n += 1;
    }
    let mut labels = xpu_core::labels::labels(inv);
    let tpus: Vec<&PciDevice> = inv.of_kind(DeviceKind::Tpu).collect();
    if let Some(first) = tpus.first()
        && let (Some(v), Some(id)) = (first.vendor_id, first.device_id)
        && let Some(facts) = xpu_core::accel::lookup(v, id).and_then(|a| a.tpu)
    {
        labels.insert("cloud.google.com/gke-tpu-accelerator".into(), facts.gke_accelerator.into());
        if let Some(t) = tpu_topology(facts.topology_dims, tpus.len()) {
            labels.insert("cloud.google.com/gke-tpu-topology".into(), t.into());
        }
    }
    let hostname = inv.host.hostname.clone().unwrap_or_else(|| "localhost".to_owned());
    labels.insert("kubernetes.io/hostname".into(), hostname.clone());
    for (k, v) in extra_labels {
        labels.insert(k.clone(), v.clone());
    }
    let mut sched = xpu_sched::node_from_inventory(inv, Some(&hostname), cpu_milli, memory_mib);
    sched.labels = labels.clone();
    Node { name: hostname.clone(), hostname, labels, devices, cpu_milli, memory_mib, sched }
}

impl Node {
    /// Renames the node (`--node-name`).
    pub fn rename(&mut self, name: &str) {
        self.name = name.to_owned();
        self.sched.name = name.to_owned();
    }

    /// For each scheduler device index, the id of the same device in [`Node::devices`].
    pub fn sched_device_ids(&self) -> Vec<Option<u32>> {
        self.sched
            .devices
            .iter()
            .map(|s| self.devices.iter().find(|d| d.address == s.id).map(|d| d.id))
            .collect()
    }

    /// The device models of a vendor and kind on this node, as the scheduler names them.
    pub fn models(&self, vendor: &str, kind: DeviceKind) -> Vec<String> {
        let mut m: Vec<String> = self
            .devices
            .iter()
            .filter(|d| d.vendor == vendor && d.kind == kind)
            .filter_map(|d| self.sched.devices.iter().find(|s| s.id == d.address))
            .map(|s| s.model.clone())
            .collect();
        m.sort();
        m.dedup();
        m
    }

    /// What a containerised task is told (the environment in its `config.json`): the
    /// `xpu runtime` shim reads `NVIDIA_VISIBLE_DEVICES` (host indices, `void` for none) and
    /// `XPU_VISIBLE_DEVICES` (CDI names of AMD GPUs and TPUs) and injects exactly those devices.
    /// The index lists of [`Node::device_env`] are left out: in the container the task's devices
    /// are the only ones, numbered from 0, so a host index there would hide them.
    pub fn container_device_env(&self, held: &[u32]) -> Vec<(String, String)> {
        let mut env = Vec::new();
        let devs: Vec<&Device> =
            held.iter().filter_map(|&i| self.devices.get(i as usize)).collect();
        if self.devices.iter().any(|d| d.vendor == "nvidia" && d.kind == DeviceKind::Gpu) {
            let ids: Vec<String> = devs
                .iter()
                .filter(|d| d.vendor == "nvidia" && d.kind == DeviceKind::Gpu)
                .map(|d| d.vendor_index.to_string())
                .collect();
            let v = if ids.is_empty() { "void".to_owned() } else { ids.join(",") };
            env.push(("NVIDIA_VISIBLE_DEVICES".to_owned(), v));
        }
        // CDI kinds of the other vendors (xpu-container's naming: index in PCI address order).
        let cdi: Vec<String> = devs
            .iter()
            .filter_map(|d| {
                let kind = match (d.vendor.as_str(), d.kind) {
                    ("amd", DeviceKind::Gpu) => "amd.com/gpu",
                    ("google", DeviceKind::Tpu) => "google.com/tpu",
                    _ => return None,
                };
                Some(format!("{kind}={}", d.vendor_index))
            })
            .collect();
        if !cdi.is_empty() {
            env.push(("XPU_VISIBLE_DEVICES".to_owned(), cdi.join(",")));
        }
        env
    }

    /// The environment telling a task which devices it holds. Every vendor family present on
    /// the node gets its variable, empty when the task holds none of its devices, so a task
    /// never sees devices it was not given.
    pub fn device_env(&self, held: &[u32]) -> Vec<(String, String)> {
        let mut env = Vec::new();
        let list = |vendor: &str, kind: DeviceKind| -> Option<String> {
            if !self.devices.iter().any(|d| d.vendor == vendor && d.kind == kind) {
                return None;
            }
            let ids: Vec<String> = held
                .iter()
                .filter_map(|&i| self.devices.get(i as usize))
                .filter(|d| d.vendor == vendor && d.kind == kind)
                .map(|d| d.vendor_index.to_string())
                .collect();
            Some(ids.join(","))
        };
        if let Some(ids) = list("nvidia", DeviceKind::Gpu) {
            // The container toolkit reads `void` as "no GPUs" and an empty value as unset.
            let nv = if ids.is_empty() { "void".to_owned() } else { ids.clone() };
            env.push(("NVIDIA_VISIBLE_DEVICES".to_owned(), nv));
            env.push(("CUDA_DEVICE_ORDER".to_owned(), "PCI_BUS_ID".to_owned()));
            env.push(("CUDA_VISIBLE_DEVICES".to_owned(), ids));
        }
        if let Some(ids) = list("amd", DeviceKind::Gpu) {
            env.push(("HIP_VISIBLE_DEVICES".to_owned(), ids.clone()));
            env.push(("ROCR_VISIBLE_DEVICES".to_owned(), ids));
        }
        if let Some(ids) = list("google", DeviceKind::Tpu) {
            env.push(("TPU_VISIBLE_CHIPS".to_owned(), ids));
        }
        if let Some(ids) = list("intel", DeviceKind::Npu) {
            env.push(("HABANA_VISIBLE_DEVICES".to_owned(), ids));
        }
        env
    }
}

/// This machine's CPU (millicores) and memory (MiB) from `/proc` under the root.
pub fn host_capacity(root: &xpu_host::Root) -> (u64, u64) {
    let cpus = std::fs::read_to_string(root.path("/proc/cpuinfo"))
        .map(|s| s.lines().filter(|l| l.starts_with("processor")).count() as u64)
        .unwrap_or(0);
    let cpus = if cpus == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
    } else {
        cpus
    };
    let mem_kib = std::fs::read_to_string(root.path("/proc/meminfo"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        })
        .unwrap_or(0);
    (cpus * 1000, mem_kib / 1024)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn fake_devices_and_env() {
        assert_eq!(parse_fake("nvidia-a100:8").unwrap().accel.product, "A100-SXM4-40GB");
        assert_eq!(parse_fake("tpu-v6e:8").unwrap().accel.generation, "v6e");
        assert_eq!(parse_fake("amd-mi300x:2").unwrap().accel.product, "MI300X");
        assert!(parse_fake("nvidia-a100").is_err());
        assert!(parse_fake("foo:1").is_err());
        let mut inv = Inventory::default();
        add_fakes(
            &mut inv,
            &[parse_fake("nvidia-a100:4").unwrap(), parse_fake("tpu-v6e:8").unwrap()],
        );
        let node = node_from_inventory(&inv, &[], 8000, 16384);
        assert_eq!(node.devices.len(), 12);
        assert_eq!(node.labels["cloud.google.com/gke-tpu-topology"], "2x4");
        assert_eq!(node.labels["cloud.google.com/gke-tpu-accelerator"], "tpu-v6e-slice");
        assert!(node.device_env(&[]).iter().all(|(k, _)| selects_devices(k)));
        let env = node.device_env(&[1, 3, 5, 6]);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), Some("1,3"));
        assert_eq!(get("TPU_VISIBLE_CHIPS"), Some("1,2"));
        assert_eq!(get("HIP_VISIBLE_DEVICES"), None);
        let none = node.device_env(&[]);
        assert!(none.contains(&("NVIDIA_VISIBLE_DEVICES".to_owned(), "void".to_owned())));
        let c = node.container_device_env(&[1, 3, 5, 6]);
        assert_eq!(
            c,
            [
                ("NVIDIA_VISIBLE_DEVICES".to_owned(), "1,3".to_owned()),
                ("XPU_VISIBLE_DEVICES".to_owned(), "google.com/tpu=1,google.com/tpu=2".to_owned())
            ]
        );
        // The scheduler's node has the same devices, mapped back by address.
        assert_eq!(node.sched.devices.len(), 12);
        let ids = node.sched_device_ids();
        assert!(ids.iter().enumerate().all(|(i, id)| *id == Some(i as u32)), "{ids:?}");
        assert_eq!(node.models("nvidia", DeviceKind::Gpu), ["A100-SXM4-40GB"]);
        assert!(node.models("amd", DeviceKind::Gpu).is_empty());
    }
}
