//! This node's devices as `resource.k8s.io/v1` ResourceSlices (pure: inventory in, objects
//! out), and the publisher that keeps them current in the API server.
//!
//! One pool per node, named after the node. Every GPU, TPU chip and NPU of the inventory is a
//! device named `<kind>-<pci address>` (`gpu-0000-07-00-0`: a DNS label, stable across reboots).
//! Attributes without a domain are in the driver's domain (`xpu.dev/numaNode` in CEL and in
//! `matchAttribute`), as the API defines; `resource.kubernetes.io/pcieRoot` is the standard
//! one. A pool larger than [`MAX_DEVICES_PER_SLICE`] is split over several slices, all carrying
//! the pool's generation and slice count, as the API asks of a multi-slice pool.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourcePool, ResourceSlice,
    ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams};
use tracing::{info, warn};
use xpu_core::{DeviceKind, Inventory, PciDevice};
use xpu_host::Root;

use super::DRIVER;

/// `resource.k8s.io/v1` `ResourceSliceMaxDevices`.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// The limit when a device of the slice has taints or consumes counters.
pub const MAX_PARTITIONABLE_PER_SLICE: usize = 64;
/// Counter sets one slice may hold (a slice holds devices or counter sets, never both).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// The standard attribute naming the PCIe root complex (KEP 4381 "standard attributes").
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// Field manager of the driver's server-side applies.
const MANAGER: &str = "xpu-dra-driver";

/// The device name of an inventory device, or `None` when it is not published (NVSwitches,
/// other functions).
pub fn device_name(d: &PciDevice) -> Option<String> {
    let kind = match d.kind {
        DeviceKind::Gpu => "gpu",
        DeviceKind::Tpu => "tpu",
        DeviceKind::Npu => "npu",
        DeviceKind::Nvswitch | DeviceKind::Other => return None,
    };
    Some(format!("{kind}-{}", d.address.dns_label()))
}

/// The inventory device a published device name stands for (a MIG device's name,
/// `<gpu>-mig-<profile>-<start>`, and an AMD partition's, `<gpu>-xcp-<i>`, stand for their GPU).
pub fn by_name<'a>(inv: &'a Inventory, name: &str) -> Option<&'a PciDevice> {
    let whole = super::mig::parse_device_name(name)
        .map(|(gpu, _, _)| gpu)
        .or_else(|| parse_partition_name(name).map(|(gpu, _)| gpu))
        .unwrap_or(name);
    inv.devices.iter().find(|d| device_name(d).as_deref() == Some(whole))
}

/// An AMD GPU partition's device name: `gpu-0000-0c-00-0-xcp-3`.
pub fn partition_name(gpu: &str, index: u32) -> String {
    format!("{gpu}-xcp-{index}")
}

/// `gpu-0000-0c-00-0-xcp-3` → (`gpu-0000-0c-00-0`, 3).
pub fn parse_partition_name(name: &str) -> Option<(&str, u32)> {
    let (gpu, i) = name.rsplit_once("-xcp-")?;
    if i.is_empty() || !i.bytes().all(|b| b.is_ascii_digit()) || i.len() > 3 {
        return None;
    }
    Some((gpu, i.parse().ok()?))
}

/// `device`, the published GPU `d`, as the partitions amdgpu made of it when it is in a mode of
/// more than one (`CPX`: eight on an MI300X): each `<gpu>-xcp-<i>` with the GPU's attributes
/// and `computePartition`, `memoryPartition`, `partition` (its index) and `xcc` (its dies), its
/// own memory as KFD reports it (else the GPU's divided evenly), and never passthrough-capable
/// (a partition is not a PCI function). Otherwise the GPU alone.
pub fn partitions(device: Device, d: &PciDevice) -> Vec<Device> {
    let Some(p) = d.partitioning.as_ref().filter(|p| p.partitions.len() > 1) else {
        return vec![device];
    };
    let n = p.partitions.len() as u64;
    // The model's memory (what the whole GPU publishes), divided evenly.
    let even = d
        .vendor_id
        .zip(d.device_id)
        .and_then(|(v, id)| xpu_core::accel::lookup(v, id))
        .filter(|f| f.memory_gib > 0)
        .map(|f| (u64::from(f.memory_gib) << 30) / n);
    p.partitions
        .iter()
        .map(|x| {
            let mut dev = device.clone();
            dev.name = partition_name(&device.name, x.index);
            let a = dev.attributes.get_or_insert_with(BTreeMap::new);
            a.insert("computePartition".to_owned(), string(p.compute.clone()));
            if let Some(m) = &p.memory {
                a.insert("memoryPartition".to_owned(), string(m.clone()));
            }
            a.insert("partition".to_owned(), int(x.index));
            if let Some(xcc) = x.xcc {
                a.insert("xcc".to_owned(), int(xcc));
            }
            a.insert(
                "passthroughCapable".to_owned(),
                DeviceAttribute { bool: Some(false), ..Default::default() },
            );
            if let Some(bytes) = x.memory_bytes.or(even) {
                let value = if bytes % (1 << 30) == 0 {
                    format!("{}Gi", bytes >> 30)
                } else {
                    format!("{}Mi", bytes >> 20)
                };
                dev.capacity = Some(BTreeMap::from([(
                    "memory".to_owned(),
                    DeviceCapacity { value: Quantity(value), ..Default::default() },
                )]));
            }
            dev
        })
        .collect()
}

fn string(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute { string: Some(s.into()), ..Default::default() }
}

fn int(i: u32) -> DeviceAttribute {
    DeviceAttribute { int: Some(i64::from(i)), ..Default::default() }
}

/// The PCIe root complex (`pci0000:00`) the device hangs below, from where its sysfs directory
/// really is (`/sys/devices/pci0000:00/0000:00:01.0/0000:07:00.0`).
pub fn pcie_root(root: &Root, d: &PciDevice) -> Option<String> {
    let real =
        std::fs::canonicalize(root.path(format!("sys/bus/pci/devices/{}", d.address))).ok()?;
    real.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci") && c.contains(':'))
        .map(str::to_owned)
}

/// One device as the slice publishes it.
pub fn device(root: &Root, d: &PciDevice) -> Option<Device> {
    let name = device_name(d)?;
    let facts = match (d.vendor_id, d.device_id) {
        (Some(v), Some(i)) => xpu_core::accel::lookup(v, i),
        _ => None,
    };
    let mut a = BTreeMap::new();
    a.insert("kind".to_owned(), string(d.kind.as_str()));
    if let Some(v) =
        facts.map(|f| f.vendor.to_owned()).or_else(|| d.vendor_id.map(|v| format!("{v:04x}")))
    {
        a.insert("vendor".to_owned(), string(v));
    }
    if let Some(p) = d.product.clone().or_else(|| facts.map(|f| f.product.to_owned())) {
        a.insert("model".to_owned(), string(p));
    }
    if let Some(g) = d.generation.clone().or_else(|| facts.map(|f| f.generation.to_owned())) {
        a.insert("generation".to_owned(), string(g));
    }
    if let Some(u) = &d.uuid {
        a.insert("uuid".to_owned(), string(u.clone()));
    }
    a.insert("pciBusID".to_owned(), string(d.address.to_string()));
    if let Some(r) = pcie_root(root, d) {
        a.insert(PCIE_ROOT.to_owned(), string(r));
    }
    if let Some(n) = d.numa_node {
        a.insert("numaNode".to_owned(), int(n));
    }
    if let Some(g) = d.iommu_group {
        a.insert("iommuGroup".to_owned(), int(g));
    }
    if let Some(drv) = &d.driver {
        a.insert("driver".to_owned(), string(drv.clone()));
    }
    if let Some(dom) = &d.interconnect_domain {
        a.insert("interconnectDomain".to_owned(), string(dom.clone()));
    }
    a.insert(
        "passthrough".to_owned(),
        DeviceAttribute {
            bool: Some(d.driver.as_deref() == Some("vfio-pci")),
            ..Default::default()
        },
    );
    let capacity = facts.filter(|f| f.memory_gib > 0).map(|f| {
        BTreeMap::from([(
            "memory".to_owned(),
            DeviceCapacity { value: Quantity(format!("{}Gi", f.memory_gib)), ..Default::default() },
        )])
    });
    Some(Device { name, attributes: Some(a), capacity, ..Default::default() })
}

/// Every published device of the inventory, in address order.
/// Each also says whether it can be passed through (`passthroughCapable`: on `vfio-pci`
/// already, or movable there with its IOMMU group on prepare, [`super::rebind`]). Devices kept
/// for Nova ([`xpu_host::vm_devices`]) are left out; a list that cannot be read leaves every
/// device out (logged), rather than offer one Nova may hold.
pub fn devices(root: &Root, inv: &Inventory) -> Vec<Device> {
    let kept = match xpu_host::vm_devices::read(root, xpu_host::vm_devices::VM_DEVICES) {
        Ok(k) => k.unwrap_or_default(),
        Err(e) => {
            warn!(error = %e, "publishing no device until the list of devices kept for VMs reads");
            return Vec::new();
        }
    };
    inv.devices
        .iter()
        .filter(|d| !kept.contains(&d.address))
        .filter_map(|d| {
            let mut dev = device(root, d)?;
            let capable = super::rebind::capable(root, inv, d);
            if let Some(a) = dev.attributes.as_mut() {
                a.insert(
                    "passthroughCapable".to_owned(),
                    DeviceAttribute { bool: Some(capable), ..Default::default() },
                );
            }
            Some(partitions(dev, d))
        })
        .flatten()
        .collect()
}

/// The taint key on a device telemetry reports unhealthy.
pub const UNHEALTHY_TAINT: &str = "xpu.dev/unhealthy";

/// `devices` with those telemetry reports unhealthy (`unhealthy`, by PCI address) tainted
/// `xpu.dev/unhealthy=<reason>:NoSchedule`: schedulers allocate a tainted device to no claim that
/// does not tolerate the taint, the claims holding it keep it (and can see why in the slice),
/// and the taint goes with the next publication after the device recovers. A device that
/// vanished from the host is published as it was last seen (`known`, which this keeps), tainted
/// until it comes back. Devices come out in address order.
pub fn taint_unhealthy(
    devices: Vec<Device>,
    inv: &Inventory,
    unhealthy: &BTreeMap<xpu_core::PciAddress, String>,
    known: &mut BTreeMap<xpu_core::PciAddress, Vec<Device>>,
) -> Vec<Device> {
    // By address, then name: a partitioned GPU is several devices.
    let mut out: BTreeMap<(xpu_core::PciAddress, String), Device> = BTreeMap::new();
    let mut seen: BTreeMap<xpu_core::PciAddress, Vec<Device>> = BTreeMap::new();
    for d in devices {
        if let Some(a) = by_name(inv, &d.name).map(|p| p.address) {
            seen.entry(a).or_default().push(d.clone());
            out.insert((a, d.name.clone()), d);
        }
    }
    for (a, devs) in seen {
        known.insert(a, devs);
    }
    for (a, reason) in unhealthy {
        let mine: Vec<String> =
            out.keys().filter(|(x, _)| x == a).map(|(_, n)| n.clone()).collect();
        if mine.is_empty() {
            for last in known.get(a).into_iter().flatten() {
                out.insert((*a, last.name.clone()), with_taint(last.clone(), reason));
            }
            continue;
        }
        for n in mine {
            if let Some(d) = out.get_mut(&(*a, n)) {
                *d = with_taint(std::mem::take(d), reason);
            }
        }
    }
    out.into_values().collect()
}

fn with_taint(mut d: Device, reason: &str) -> Device {
    d.taints.get_or_insert_with(Vec::new).push(DeviceTaint {
        key: UNHEALTHY_TAINT.to_owned(),
        value: Some(taint_value(reason)),
        effect: "NoSchedule".to_owned(),
        // The API server sets it when the taint first appears.
        time_added: None,
    });
    d
}

/// A health reason as a taint value (a label value: at most 63 of `[A-Za-z0-9._-]`, starting
/// and ending alphanumeric): `xid 79: GPU has fallen off the bus` → `xid-79-GPU-has-fallen-off-the-bus`.
fn taint_value(reason: &str) -> String {
    let mut out = String::new();
    for c in reason.chars() {
        if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
            out.push(c);
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    out.truncate(63);
    out.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned()
}

/// The slice name of part `i` of `node`'s pool.
pub fn slice_name(node: &str, i: usize) -> String {
    format!("{node}-xpu.dev-{i}")
}

/// The pool's slices: `devices` split at the per-slice limit (one empty slice for a node
/// without devices, so the pool's generation still tells the scheduler it is empty).
pub fn slices(
    node: &str,
    devices: &[Device],
    counters: &[CounterSet],
    generation: i64,
) -> Vec<ResourceSlice> {
    // Counter sets first, in slices of their own; then the devices, 64 to a slice when any is
    // partitionable or tainted, else 128.
    let per_slice = if devices.iter().any(|d| d.consumes_counters.is_some() || d.taints.is_some()) {
        MAX_PARTITIONABLE_PER_SLICE
    } else {
        MAX_DEVICES_PER_SLICE
    };
    let mut parts: Vec<(Option<&[CounterSet]>, &[Device])> =
        counters.chunks(MAX_COUNTER_SETS_PER_SLICE).map(|c| (Some(c), &[][..])).collect();
    parts.extend(devices.chunks(per_slice).map(|d| (None, d)));
    if parts.is_empty() {
        parts.push((None, &[]));
    }
    let count = i64::try_from(parts.len()).unwrap_or(i64::MAX);
    parts
        .iter()
        .enumerate()
        .map(|(i, (sets, part))| ResourceSlice {
            metadata: ObjectMeta { name: Some(slice_name(node, i)), ..Default::default() },
            spec: ResourceSliceSpec {
                driver: DRIVER.to_owned(),
                node_name: Some(node.to_owned()),
                pool: ResourcePool {
                    name: node.to_owned(),
                    generation,
                    resource_slice_count: count,
                },
                devices: sets.is_none().then(|| part.to_vec()),
                shared_counters: sets.map(<[CounterSet]>::to_vec),
                ..Default::default()
            },
        })
        .collect()
}

/// The GPUs `mig` reports (none without it, or when it fails: then every GPU is whole, with a
/// warning).
pub fn mig_gpus(
    mig: Option<&dyn xpu_telemetry::mig::MigControl>,
) -> Vec<xpu_telemetry::mig::MigGpu> {
    match mig.map(|m| m.gpus()) {
        None => Vec::new(),
        Some(Ok(g)) => g,
        Some(Err(e)) => {
            warn!(error = %e, "reading MIG state; GPUs published whole");
            Vec::new()
        }
    }
}

/// `devices` with each GPU that NVML reports in MIG mode (`mig`) replaced by its MIG
/// partitions ([`super::mig::partitions`]), and their counter sets. A GPU in MIG mode whose
/// model has no MIG table stays whole, with a warning.
pub fn with_mig(
    devices: Vec<Device>,
    inv: &Inventory,
    mig: &[xpu_telemetry::mig::MigGpu],
) -> (Vec<Device>, Vec<CounterSet>) {
    let mut out = Vec::with_capacity(devices.len());
    let mut sets = Vec::new();
    let name_of: BTreeMap<xpu_core::PciAddress, String> =
        inv.devices.iter().filter_map(|d| Some((d.address, device_name(d)?))).collect();
    for d in devices {
        let gpu = mig.iter().find(|g| g.enabled && name_of.get(&g.address) == Some(&d.name));
        match gpu.map(|g| super::mig::partitions(&d, g)) {
            Some(Ok((set, parts))) => {
                sets.push(set);
                out.extend(parts);
            }
            Some(Err(e)) => {
                warn!(device = %d.name, error = %e, "MIG mode is on but its partitions are unknown; published whole");
                out.push(d);
            }
            None => out.push(d),
        }
    }
    (out, sets)
}

/// The capacity a share of a GPU served through MPS asks for: thread percentage, 1 to 100.
pub const COMPUTE_CAPACITY: &str = "compute";

/// `devices` with each whole NVIDIA GPU on its vendor driver made shareable
/// (`xpu k8s dra-driver --mps-dir` or `--time-slicing`): `allowMultipleAllocations`, besides
/// its `memory` a `compute` capacity of 100 (percent of its threads), and the attribute
/// `sharing` saying how (`mps`: limited to the part; `time-slicing`: no limit, no isolation), so
/// a selector can ask for one. A claim asking for part of both
/// (`capacity.requests: {compute: 25, memory: 36Gi}`) shares the GPU with others; one asking for
/// neither takes the whole of both, alone. MIG partitions and devices on `vfio-pci` stay as they
/// are.
pub fn shareable(mut devices: Vec<Device>, sharing: &str) -> Vec<Device> {
    for d in devices.iter_mut() {
        let attr = |k: &str| d.attributes.as_ref().and_then(|a| a.get(k));
        let is = |k: &str, v: &str| attr(k).and_then(|a| a.string.as_deref()) == Some(v);
        let on_vfio = attr("passthrough").and_then(|a| a.bool) == Some(true);
        if !is("kind", "gpu")
            || !is("vendor", "nvidia")
            || on_vfio
            || attr("uuid").is_none()
            || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
            || d.capacity.as_ref().is_none_or(|c| !c.contains_key("memory"))
        {
            continue;
        }
        d.allow_multiple_allocations = Some(true);
        if let Some(a) = d.attributes.as_mut() {
            a.insert("sharing".to_owned(), string(sharing.to_owned()));
        }
        if let Some(c) = d.capacity.as_mut() {
            c.insert(
                COMPUTE_CAPACITY.to_owned(),
                DeviceCapacity { value: Quantity("100".to_owned()), ..Default::default() },
            );
        }
    }
    devices
}

/// Errors talking to the API server about slices.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("listing the ResourceSlices of node {node}")]
    List {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("applying ResourceSlice {name}")]
    Apply {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("deleting stale ResourceSlice {name}")]
    Delete {
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// Keeps a node's pool in the API server equal to what it was last given.
pub struct Publisher {
    api: Api<ResourceSlice>,
    node: String,
    generation: i64,
    published: Option<(Vec<Device>, Vec<CounterSet>)>,
    /// When the slices were last seen in the API server (see [`SLICES_CHECKED_EVERY`]).
    checked: Option<Instant>,
}

/// How often an unchanged pool is checked to be still in the API server: the kubelet deletes a
/// node's ResourceSlices when it restarts (a driver pod's slices were gone after a kubelet
/// restart, and nothing published them again), and an admin may delete them; either way they
/// are published again within this.
pub const SLICES_CHECKED_EVERY: Duration = Duration::from_secs(5);

impl Publisher {
    /// Starts above the generation of any slice this node's pool already has, so a restarted
    /// driver's slices supersede the old ones.
    pub async fn new(client: kube::Client, node: &str) -> Result<Publisher, PublishError> {
        let api: Api<ResourceSlice> = Api::all(client);
        let lp =
            ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={DRIVER}"));
        let existing = api
            .list(&lp)
            .await
            .map_err(|source| PublishError::List { node: node.to_owned(), source })?;
        let generation = existing.items.iter().map(|s| s.spec.pool.generation).max().unwrap_or(0);
        Ok(Publisher { api, node: node.to_owned(), generation, published: None, checked: None })
    }

    /// The pool's current generation.
    pub fn generation(&self) -> i64 {
        self.generation
    }

    /// Publishes `devices` if they differ from what was published; returns whether it did.
    pub async fn publish(&mut self, devices: Vec<Device>) -> Result<bool, PublishError> {
        self.publish_with(devices, Vec::new()).await
    }

    /// [`Publisher::publish`] with the pool's shared counter sets (MIG partitions).
    pub async fn publish_with(
        &mut self,
        devices: Vec<Device>,
        counters: Vec<CounterSet>,
    ) -> Result<bool, PublishError> {
        if self.published.as_ref().is_some_and(|(d, c)| *d == devices && *c == counters) {
            if self.checked.is_some_and(|t| t.elapsed() < SLICES_CHECKED_EVERY) {
                return Ok(false);
            }
            self.checked = Some(Instant::now());
            let want = slices(&self.node, &devices, &counters, self.generation).len();
            let lp = ListParams::default()
                .fields(&format!("spec.nodeName={},spec.driver={DRIVER}", self.node));
            let there = self
                .api
                .list(&lp)
                .await
                .map_err(|source| PublishError::List { node: self.node.clone(), source })?
                .items
                .iter()
                .filter(|s| s.spec.pool.generation == self.generation)
                .count();
            if there == want {
                return Ok(false);
            }
            warn!(node = %self.node, there, want, "this node's ResourceSlices are gone from the API server; publishing them again");
        }
        let generation = self.generation + 1;
        let want = slices(&self.node, &devices, &counters, generation);
        let pp = PatchParams::apply(MANAGER).force();
        for s in &want {
            let name = s.metadata.name.clone().unwrap_or_default();
            self.api
                .patch(&name, &pp, &Patch::Apply(s))
                .await
                .map_err(|source| PublishError::Apply { name: name.clone(), source })?;
        }
        // Slices of an earlier, larger pool.
        let lp = ListParams::default()
            .fields(&format!("spec.nodeName={},spec.driver={DRIVER}", self.node));
        let existing = self
            .api
            .list(&lp)
            .await
            .map_err(|source| PublishError::List { node: self.node.clone(), source })?;
        for s in existing.items {
            let name = s.metadata.name.clone().unwrap_or_default();
            if !want.iter().any(|w| w.metadata.name.as_deref() == Some(&name)) {
                match self.api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(source) => return Err(PublishError::Delete { name, source }),
                }
            }
        }
        info!(node = %self.node, generation, devices = devices.len(), slices = want.len(), "published ResourceSlices");
        self.generation = generation;
        self.published = Some((devices, counters));
        self.checked = Some(Instant::now());
        Ok(true)
    }
}

/// Re-discovers the host every `interval` and publishes changes until `stop` resolves. A
/// discovery or API error is logged and retried on the next tick.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    mut publisher: Publisher,
    root: Root,
    interval: Duration,
    inventory: tokio::sync::watch::Sender<std::sync::Arc<Inventory>>,
    health: Option<xpu_telemetry::collect::Collector>,
    mig: Option<std::sync::Arc<dyn xpu_telemetry::mig::MigControl>>,
    sharing: Option<&'static str>,
    device_health: tokio::sync::watch::Sender<std::sync::Arc<Vec<super::health::DeviceHealth>>>,
) {
    let opts = xpu_host::DiscoverOptions {
        scope: xpu_host::Scope::Accelerators,
        pci_ids: None,
        skip_names: true,
    };
    // Every device published so far, for one that vanishes (published tainted as last seen).
    let mut known = BTreeMap::new();
    loop {
        let started = Instant::now();
        // Discovery and the devices' attributes read sysfs: on the blocking pool, so the
        // kubelet's NodePrepareResources calls never wait behind them on a worker thread.
        let (r, o) = (root.clone(), opts.clone());
        let read = tokio::task::spawn_blocking(move || {
            xpu_host::discover(&r, &o).map(|inv| {
                let devs = devices(&r, &inv);
                (inv, devs)
            })
        })
        .await;
        let read = match read {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "re-discovering the host");
                tokio::time::sleep(interval).await;
                continue;
            }
        };
        match read {
            Ok((inv, devs)) => {
                let unhealthy = health.as_ref().map(|h| h.unhealthy()).unwrap_or_default();
                let devs = taint_unhealthy(devs, &inv, &unhealthy, &mut known);
                // A GPU whose MIG state changed under the driver is published as it is now.
                let (devs, counters) = with_mig(devs, &inv, &mig_gpus(mig.as_deref()));
                let devs = match sharing {
                    Some(how) => shareable(devs, how),
                    None => devs,
                };
                let now = super::health::of(&devs);
                device_health.send_if_modified(|h| {
                    let changed = **h != now;
                    if changed {
                        *h = std::sync::Arc::new(now);
                    }
                    changed
                });
                // Only the publisher writes; receivers see the inventory the slices came from.
                inventory.send_replace(std::sync::Arc::new(inv));
                match publisher.publish_with(devs, counters).await {
                    Ok(true) => {
                        info!(elapsed_ms = started.elapsed().as_millis() as u64, "slices updated")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        warn!(error = %xpu_core::error::chain_once(&e), "publishing ResourceSlices")
                    }
                }
            }
            Err(e) => warn!(error = %xpu_core::error::chain_once(&e), "re-discovering the host"),
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpu_host::DiscoverOptions;
    use xpu_testkit::hosts;

    fn inv(spec: &xpu_testkit::HostSpec) -> (xpu_testkit::Fixture, Root, Inventory) {
        let fx = spec.build();
        let root = Root::new(fx.root()).unwrap();
        let inv = xpu_host::discover(&root, &DiscoverOptions::default()).unwrap();
        (fx, root, inv)
    }

    /// A partitioned GPU's partitions are tainted together when telemetry reports the GPU, and
    /// published as last seen when the GPU vanishes; names map back to their GPU.
    #[test]
    fn partitions_of_an_unhealthy_gpu_are_all_tainted() {
        let (_fx, root, inv) = inv(&hosts::mi300x_cpx());
        let gpu = inv.accelerators().next().unwrap().address;
        let mut known = BTreeMap::new();
        let why = BTreeMap::from([(gpu, "ras: uncorrectable".to_owned())]);
        let out = taint_unhealthy(devices(&root, &inv), &inv, &why, &mut known);
        assert_eq!(out.len(), 64);
        let tainted: Vec<&str> =
            out.iter().filter(|d| d.taints.is_some()).map(|d| d.name.as_str()).collect();
        assert_eq!(tainted.len(), 8, "{tainted:?}");
        let name = device_name(inv.device(&gpu).unwrap()).unwrap();
        assert!(tainted.iter().all(|t| parse_partition_name(t).map(|p| p.0) == Some(&*name)));
        assert_eq!(by_name(&inv, &partition_name(&name, 7)).map(|d| d.address), Some(gpu));
        assert_eq!(parse_partition_name("gpu-x-xcp-"), None);
        // Gone from the host: its partitions as last seen, tainted.
        let mut after = inv.clone();
        after.devices.retain(|d| d.address != gpu);
        let out = taint_unhealthy(devices(&root, &after), &after, &why, &mut known);
        assert_eq!(out.iter().filter(|d| d.taints.is_some()).count(), 8);
    }

    /// Shareable GPUs say how they are shared; NVSwitches and GPUs on vfio-pci are not made
    /// shareable.
    #[test]
    fn shareable_gpus_take_several_claims_and_say_how() {
        let (_fx, root, host) = inv(&hosts::a100_8x());
        let devs = shareable(devices(&root, &host), "time-slicing");
        let gpus: Vec<&Device> = devs.iter().filter(|d| d.name.starts_with("gpu")).collect();
        assert_eq!(gpus.len(), 8);
        for d in &gpus {
            assert_eq!(d.allow_multiple_allocations, Some(true), "{}", d.name);
            let a = d.attributes.as_ref().unwrap();
            assert_eq!(a["sharing"].string.as_deref(), Some("time-slicing"));
            assert_eq!(d.capacity.as_ref().unwrap()[COMPUTE_CAPACITY].value.0, "100");
        }
        assert!(
            devs.iter()
                .filter(|d| !d.name.starts_with("gpu"))
                .all(|d| d.allow_multiple_allocations.is_none())
        );
        let (_fx2, root2, inv2) = inv(&hosts::a100_8x_vfio());
        let devs = shareable(devices(&root2, &inv2), "mps");
        assert!(devs.iter().all(|d| d.allow_multiple_allocations.is_none()), "on vfio-pci: whole");
    }

    #[test]
    fn a_device_telemetry_calls_unhealthy_is_tainted_until_it_recovers() {
        use xpu_telemetry::Reading;
        use xpu_telemetry::nvml::FakeNvml;
        let (_fx, root, inv) = inv(&hosts::a100_8x());
        let victim = inv.accelerators().nth(2).unwrap().address;
        let nvml =
            FakeNvml::new(inv.accelerators().map(|d| (d.address, Reading::default())).collect());
        let mut sources: Vec<Box<dyn xpu_telemetry::Source>> = vec![Box::new(nvml.clone())];
        let mut book = xpu_telemetry::health::HealthBook::default();
        let mut health = |sources: &mut Vec<Box<dyn xpu_telemetry::Source>>| {
            for s in sources.iter_mut() {
                for (a, r) in s.read(&inv).unwrap().readings {
                    book.observe(a, &r);
                }
            }
            book.unhealthy()
        };
        let tainted = |devs: &[Device]| -> Vec<(String, String)> {
            devs.iter()
                .flat_map(|d| d.taints.iter().flatten().map(move |t| (d.name.clone(), t.clone())))
                .map(|(n, t)| {
                    (n, format!("{}={}:{}", t.key, t.value.unwrap_or_default(), t.effect))
                })
                .collect()
        };
        let mut known = BTreeMap::new();
        let all = taint_unhealthy(devices(&root, &inv), &inv, &health(&mut sources), &mut known);
        assert_eq!((all.len(), tainted(&all)), (8, vec![]));
        nvml.update(|s| s.devices.get_mut(&victim).unwrap().xids.push(79));
        let published =
            taint_unhealthy(devices(&root, &inv), &inv, &health(&mut sources), &mut known);
        let name = device_name(inv.device(&victim).unwrap()).unwrap();
        assert_eq!(published.len(), 8, "still published: its claims keep it");
        assert_eq!(
            tainted(&published),
            [(name, "xpu.dev/unhealthy=xid-79-GPU-has-fallen-off-the-bus:NoSchedule".to_owned())]
        );
        // A reset the source reports clears it.
        nvml.update(|s| s.devices.get_mut(&victim).unwrap().reset = true);
        let healed = taint_unhealthy(devices(&root, &inv), &inv, &health(&mut sources), &mut known);
        assert_eq!(tainted(&healed), vec![]);
        assert_eq!(healed, all, "as before the XID");

        // A device that vanished: published as last seen, tainted, until it comes back.
        let (fx, root, full) = self::inv(&hosts::a100_8x());
        let gone = full.accelerators().nth(5).unwrap();
        let (gone_addr, gone_name) = (gone.address, device_name(gone).unwrap());
        let mut known = BTreeMap::new();
        let before = taint_unhealthy(devices(&root, &full), &full, &BTreeMap::new(), &mut known);
        std::fs::remove_file(fx.device_dir(&gone_addr.to_string())).unwrap();
        let after = xpu_host::discover(&root, &DiscoverOptions::default()).unwrap();
        let why = BTreeMap::from([(gone_addr, "vanished from the PCI bus".to_owned())]);
        let published = taint_unhealthy(devices(&root, &after), &after, &why, &mut known);
        assert_eq!(published.len(), 8);
        assert_eq!(
            tainted(&published),
            [(gone_name, "xpu.dev/unhealthy=vanished-from-the-PCI-bus:NoSchedule".to_owned())]
        );
        let untainted: Vec<Device> =
            published.into_iter().map(|d| Device { taints: None, ..d }).collect();
        assert_eq!(untainted, before, "the same devices, in the same order");
    }

    #[test]
    fn taint_values_are_label_values() {
        for (reason, want) in [
            ("xid 79: GPU has fallen off the bus", "xid-79-GPU-has-fallen-off-the-bus"),
            ("lost", "lost"),
            (": !", ""),
            (&"e".repeat(80), &"e".repeat(63)),
            ("new uncorrectable memory errors (3)", "new-uncorrectable-memory-errors-3"),
        ] {
            assert_eq!(taint_value(reason), want, "{reason}");
        }
    }

    #[test]
    fn a100_host_publishes_eight_gpus_with_topology_attributes() {
        let (_fx, root, inv) = inv(&hosts::a100_8x());
        let devs = devices(&root, &inv);
        assert_eq!(devs.len(), 8, "GPUs only, no NVSwitches");
        let d = &devs[0];
        assert!(d.name.starts_with("gpu-"), "{}", d.name);
        let a = d.attributes.as_ref().unwrap();
        for k in [
            "kind",
            "vendor",
            "model",
            "generation",
            "uuid",
            "pciBusID",
            PCIE_ROOT,
            "numaNode",
            "iommuGroup",
            "driver",
            "interconnectDomain",
            "passthrough",
        ] {
            assert!(a.contains_key(k), "{k} missing: {a:?}");
        }
        assert_eq!(a["kind"].string.as_deref(), Some("gpu"));
        assert_eq!(a["passthrough"].bool, Some(false));
        assert!(d.capacity.as_ref().unwrap()["memory"].value.0.ends_with("Gi"));
    }

    #[test]
    fn devices_on_their_vendor_driver_can_be_passed_through_when_their_group_allows() {
        let (_fx, root, inv) = inv(&hosts::a100_8x());
        let devs = devices(&root, &inv);
        let a = |d: &Device| d.attributes.clone().unwrap();
        assert!(devs.iter().all(|d| a(d)["passthrough"].bool == Some(false)));
        assert!(devs.iter().all(|d| a(d)["passthroughCapable"].bool == Some(true)));
        let mut bare = inv.clone();
        bare.devices.iter_mut().for_each(|d| d.iommu_group = None);
        let devs = devices(&root, &bare);
        assert!(devs.iter().all(|d| a(d)["passthroughCapable"].bool == Some(false)));
    }

    #[test]
    fn devices_kept_for_nova_are_not_published_and_a_bad_list_publishes_none() {
        let (fx, root, inv) = inv(&hosts::a100_8x());
        let all = devices(&root, &inv);
        let addr = |d: &Device| d.attributes.clone().unwrap()["pciBusID"].string.clone().unwrap();
        let list = fx.root().join("etc/xpu/vm-devices");
        std::fs::create_dir_all(list.parent().unwrap()).unwrap();
        std::fs::write(&list, format!("{}\n{}\n", addr(&all[0]), addr(&all[1]))).unwrap();
        let left = devices(&root, &inv);
        assert_eq!(left.len(), all.len() - 2);
        assert!(left.iter().all(|d| addr(d) != addr(&all[0]) && addr(d) != addr(&all[1])));
        std::fs::write(&list, "not-an-address\n").unwrap();
        assert!(devices(&root, &inv).is_empty());
    }

    #[test]
    fn vfio_devices_are_marked_for_passthrough() {
        let (_fx, root, inv) = inv(&hosts::a100_8x_vfio());
        let devs = devices(&root, &inv);
        assert!(
            devs.iter().any(|d| d.attributes.as_ref().unwrap()["passthrough"].bool == Some(true))
        );
    }

    #[test]
    fn large_pools_split_at_the_api_limit_with_one_generation() {
        let dev = |i: usize| Device { name: format!("gpu-{i}"), ..Default::default() };
        let devs: Vec<Device> = (0..300).map(dev).collect();
        let s = slices("n1", &devs, &[], 7);
        assert_eq!(s.len(), 3);
        assert!(s.iter().all(|s| s.spec.pool.resource_slice_count == 3
            && s.spec.pool.generation == 7
            && s.spec.pool.name == "n1"
            && s.spec.devices.as_ref().unwrap().len() <= MAX_DEVICES_PER_SLICE));
        let total: usize = s.iter().map(|s| s.spec.devices.as_ref().unwrap().len()).sum();
        assert_eq!(total, 300);
        assert_eq!(slices("n1", &[], &[], 1).len(), 1, "an empty pool is still published");
    }

    #[test]
    fn mig_gpus_are_published_as_partitions_with_counter_sets_in_slices_of_their_own() {
        use xpu_telemetry::mig::{FakeMig, MigControl};
        let (_fx, root, inv) = inv(&hosts::a100_8x());
        let gpus: Vec<_> = inv.accelerators().map(|d| d.address).collect();
        // Two GPUs in MIG mode, one with an instance made outside xpu.
        let mig = FakeMig::new(
            gpus.iter().enumerate().map(|(i, a)| (*a, "NVIDIA A100-SXM4-40GB", i < 2)),
        );
        mig.create_outside(gpus[1], "7g.40gb", 0).unwrap();
        let (devices, sets) = with_mig(devices(&root, &inv), &inv, &mig.gpus().unwrap());
        assert_eq!(sets.len(), 2);
        // GPU 0: 25 partitions; GPU 1: none (the 7g holds it); six GPUs whole.
        let mig_devices = devices.iter().filter(|d| d.consumes_counters.is_some()).count();
        assert_eq!((mig_devices, devices.len()), (25, 31));
        let whole0 = device_name(inv.device(&gpus[0]).unwrap()).unwrap();
        assert!(!devices.iter().any(|d| d.name == whole0), "a MIG GPU is not offered whole");
        let s = slices("n1", &devices, &sets, 3);
        // One slice of counter sets, then 31 devices at most 64 to a slice.
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].spec.shared_counters.as_ref().unwrap().len(), 2);
        assert!(s[0].spec.devices.is_none());
        assert_eq!(s[1].spec.devices.as_ref().unwrap().len(), 31);
        assert!(s[1].spec.shared_counters.is_none());
        assert!(s.iter().all(|x| x.spec.pool.resource_slice_count == 2));
        let many: Vec<Device> = (0..100).map(|_| devices[0].clone()).collect();
        let s = slices("n1", &many, &sets[..1], 3);
        let sizes: Vec<usize> =
            s.iter().map(|x| x.spec.devices.as_ref().map_or(0, Vec::len)).collect();
        assert_eq!(sizes, [0, 64, 36]);
    }
}
