//! Preparing one claim, as a decision (pure): a `ResourceClaim` read from the API server, this
//! node's inventory and the CDI specs `xpu cdi generate` would write go in; the claim's own CDI
//! spec and the device ids the kubelet passes to the runtime come out, or an error that names
//! the claim and the cause. Writing the spec and the checkpoint is the plugin's business.
//!
//! The per-claim spec (CDI `SPEC.md`): kind `k8s.xpu.dev/claim`, one device per allocated
//! device named `<claim uid>-<device name>` with that device's nodes, and as the spec's own
//! `containerEdits` what the devices' kinds share (control nodes, driver files, environment),
//! exactly as the host-wide spec of that kind has them.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde::{Deserialize, Serialize};
use xpu_container::cdi::{self, CdiKind, ContainerEdits, Spec};
use xpu_core::mig::Model;
use xpu_core::{Inventory, PciAddress, PciDevice};
use xpu_telemetry::mig::MigGpu;

use super::{DRIVER, mig, slices};

/// The CDI kind of per-claim specs.
pub const CLAIM_CDI_KIND: &str = "k8s.xpu.dev/claim";
/// `apiVersion` of the opaque configuration this driver reads.
pub const CONFIG_API_VERSION: &str = "xpu.dev/v1";
pub const CONFIG_KIND: &str = "DeviceConfig";
/// The VFIO container node every VM's group is opened through.
const VFIO_CONTAINER: &str = "/dev/vfio/vfio";
/// Opaque parameters larger than this are refused (the API server allows 10 KiB).
const MAX_CONFIG_BYTES: usize = 10 * 1024;

/// How the claim's devices are handed to the workload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Through the vendor driver's device nodes (the device must not be on `vfio-pci`).
    #[default]
    Container,
    /// Whole device through VFIO, for a VM: a device on its vendor driver is moved to `vfio-pci`
    /// with its IOMMU group first ([`super::rebind`]).
    Passthrough,
}

/// `xpu.dev/v1` `DeviceConfig`: what a user sets per claim (or an admin per DeviceClass).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceConfig {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub mode: Mode,
}

/// One prepared device, as the kubelet's `Device` message has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_ids: Vec<String>,
}

/// A claim's preparation: the spec to write and what to answer.
#[derive(Debug, Clone)]
pub struct Plan {
    pub spec: Spec,
    pub devices: Vec<PreparedDevice>,
    /// MIG instances to make before the spec is written: each adds its capability nodes to
    /// its device in `spec`.
    pub mig: Vec<MigPart>,
}

/// A MIG device of the claim: the instance to make (profile at a placement on a GPU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigPart {
    /// The allocated device's name.
    pub device: String,
    /// Its index in the plan's `spec.devices`.
    pub spec_device: usize,
    pub gpu: PciAddress,
    /// The minor of the GPU's `/dev/nvidiaN` (the `gpuN` of the capabilities).
    pub gpu_minor: u32,
    pub profile: &'static str,
    pub start: u8,
}

/// A device of the claim given part of a GPU (consumed capacity under the whole): the claim
/// is a client of the GPU's MPS daemon, limited to that part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsPart {
    /// The allocated device's name.
    pub device: String,
    /// The GPU's UUID: whose daemon.
    pub gpu: String,
    pub limits: xpu_host::mps::Limits,
}

/// Why a claim cannot be prepared. Each names what is wrong; the plugin prefixes the claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error(
        "has UID {found}, the kubelet asked for {wanted}; the claim was deleted and made again"
    )]
    Uid { wanted: String, found: String },
    #[error("is not allocated")]
    NotAllocated,
    #[error("has no device allocated by driver {DRIVER} (allocated by: {others})")]
    OtherDriver { others: String },
    #[error("device {device} is allocated from pool {pool}, not this node's pool {node}")]
    OtherNode { device: String, pool: String, node: String },
    #[error(
        "device {device} does not exist on this node (gone, or never published by this driver)"
    )]
    UnknownDevice { device: String },
    #[error("device {device} ({address}) has no usable device nodes; check `xpu cdi generate`")]
    NoNodes { device: String, address: String },
    #[error("{field}: {reason}")]
    Config { field: String, reason: String },
    #[error("MIG device {device}: {reason}")]
    Mig { device: String, reason: String },
    #[error("GPU partition {device}: {reason}")]
    Partition { device: String, reason: String },
    #[error("device {device} is shared ({consumed}): {reason}")]
    Shared { device: String, consumed: String, reason: String },
    #[error(
        "device {device} is bound to {driver}, but mode {mode} needs {wanted}; use the {class} DeviceClass or set mode"
    )]
    Mode { device: String, driver: String, mode: String, wanted: String, class: String },
}

/// The claim's `status.allocation.devices`, when it is allocated.
fn allocated(
    claim: &ResourceClaim,
) -> Option<&k8s_openapi::api::resource::v1::DeviceAllocationResult> {
    claim.status.as_ref()?.allocation.as_ref()?.devices.as_ref()
}

/// A configuration and the requests it applies to (`None`: all of the claim's).
type Scoped = (Option<Vec<String>>, DeviceConfig);

/// The configuration that applies to each request, from `status.allocation.devices.config`
/// (class configs come before claim configs there, so a later entry wins).
fn configs(claim: &ResourceClaim) -> Result<Vec<Scoped>, ClaimError> {
    let Some(cfgs) = allocated(claim).and_then(|d| d.config.as_ref()) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (i, c) in cfgs.iter().enumerate() {
        let Some(o) = c.opaque.as_ref().filter(|o| o.driver == DRIVER) else { continue };
        let field = format!("status.allocation.devices.config[{i}].opaque.parameters");
        let raw = &o.parameters.0;
        if serde_json::to_vec(raw).map_or(true, |b| b.len() > MAX_CONFIG_BYTES) {
            return Err(ClaimError::Config {
                field,
                reason: format!("larger than {MAX_CONFIG_BYTES} bytes"),
            });
        }
        let parsed: DeviceConfig = serde_json::from_value(raw.clone()).map_err(|e| ClaimError::Config {
            field: field.clone(),
            reason: format!("{e} (expected apiVersion {CONFIG_API_VERSION}, kind {CONFIG_KIND}, mode container|passthrough)"),
        })?;
        if parsed.api_version != CONFIG_API_VERSION {
            return Err(ClaimError::Config {
                field: format!("{field}.apiVersion"),
                reason: format!("{:?} is not {CONFIG_API_VERSION}", parsed.api_version),
            });
        }
        if parsed.kind != CONFIG_KIND {
            return Err(ClaimError::Config {
                field: format!("{field}.kind"),
                reason: format!("{:?} is not {CONFIG_KIND}", parsed.kind),
            });
        }
        out.push((c.requests.clone().filter(|r| !r.is_empty()), parsed));
    }
    Ok(out)
}

fn mode_for(configs: &[Scoped], request: &str) -> Mode {
    // `request` may be `parent/subrequest`; a config naming the parent applies too.
    let parent = request.split('/').next().unwrap_or(request);
    configs
        .iter()
        .rev()
        .find(|(reqs, _)| {
            reqs.as_ref().is_none_or(|r| r.iter().any(|x| x == request || x == parent))
        })
        .map(|(_, c)| c.mode)
        .unwrap_or_default()
}

fn merge(into: &mut ContainerEdits, from: &ContainerEdits) {
    for e in &from.env {
        if !into.env.contains(e) {
            into.env.push(e.clone());
        }
    }
    for n in &from.device_nodes {
        if !into.device_nodes.contains(n) {
            into.device_nodes.push(n.clone());
        }
    }
    for m in &from.mounts {
        if !into.mounts.contains(m) {
            into.mounts.push(m.clone());
        }
    }
}

/// The file name of a claim's spec in the CDI directory.
pub fn spec_file(uid: &str) -> String {
    format!("xpu.dev-claim_{uid}.json")
}

/// The instance a MIG device (`<gpu>-mig-<profile>-<start>`) of GPU `d` stands for, checked
/// against the GPU's MIG state as NVML reports it (`mig`) and NVIDIA's tables.
fn mig_part(
    device: &str,
    d: &PciDevice,
    profile: &str,
    start: u8,
    mig: &[MigGpu],
) -> Result<MigPart, ClaimError> {
    let err = |reason: String| ClaimError::Mig { device: device.to_owned(), reason };
    let g = mig
        .iter()
        .find(|g| g.address == d.address)
        .ok_or_else(|| err(format!("NVML reports no MIG state for the GPU at {}", d.address)))?;
    if !g.enabled {
        return Err(err(format!(
            "MIG mode is off on the GPU at {} (the admin turns it on: nvidia-smi -i {} -mig 1)",
            d.address, d.address
        )));
    }
    let model = Model::of(&g.product).map_err(|e| err(e.to_string()))?;
    let p = model.profile_by_label(profile).ok_or_else(|| {
        let names: Vec<&str> = model.profiles.iter().map(|p| p.name).collect();
        err(format!("{} offers no profile {profile} (it has {})", g.product, names.join(", ")))
    })?;
    if !p.starts.contains(&start) {
        return Err(err(format!(
            "{} is never placed at memory slice {start} (placements: {:?})",
            p.name, p.starts
        )));
    }
    let gpu_minor = d
        .nvidia_minor()
        .ok_or_else(|| err(format!("the GPU at {} has no /dev/nvidiaN node", d.address)))?;
    Ok(MigPart {
        device: device.to_owned(),
        spec_device: 0,
        gpu: d.address,
        gpu_minor,
        profile: p.name,
        start,
    })
}

/// The devices of `claim` asked for in `passthrough` mode that are not on `vfio-pci` yet: the
/// plugin moves them (with their IOMMU groups, [`super::rebind`]) before [`plan`]. Devices this
/// node does not have are left to [`plan`] to name.
pub fn to_move(claim: &ResourceClaim, inv: &Inventory) -> Result<Vec<PciAddress>, ClaimError> {
    let Some(results) = allocated(claim).and_then(|d| d.results.as_ref()) else {
        return Ok(Vec::new());
    };
    let configs = configs(claim)?;
    let mut out = Vec::new();
    for r in results.iter().filter(|r| r.driver == DRIVER) {
        if mode_for(&configs, &r.request) != Mode::Passthrough {
            continue;
        }
        // A MIG device or an AMD partition is never passed through: [`plan`] refuses it.
        if mig::parse_device_name(&r.device).is_some()
            || slices::parse_partition_name(&r.device).is_some()
        {
            continue;
        }
        let Some(d) = slices::by_name(inv, &r.device) else { continue };
        if d.driver.as_deref() != Some("vfio-pci") && !out.contains(&d.address) {
            out.push(d.address);
        }
    }
    Ok(out)
}

/// Decides what preparing `claim` (asked for as `uid`) on `node` means; `mig` is NVML's view
/// of the GPUs' MIG state (empty without MIG control).
pub fn plan(
    claim: &ResourceClaim,
    uid: &str,
    node: &str,
    inv: &Inventory,
    host_specs: &[Spec],
    mig: &[MigGpu],
) -> Result<Plan, ClaimError> {
    let found = claim.metadata.uid.clone().unwrap_or_default();
    if found != uid {
        return Err(ClaimError::Uid { wanted: uid.to_owned(), found });
    }
    let results =
        allocated(claim).and_then(|d| d.results.as_ref()).ok_or(ClaimError::NotAllocated)?;
    let ours: Vec<_> = results.iter().filter(|r| r.driver == DRIVER).collect();
    if ours.is_empty() {
        let mut others: Vec<&str> = results.iter().map(|r| r.driver.as_str()).collect();
        others.dedup();
        return Err(ClaimError::OtherDriver { others: others.join(", ") });
    }
    let configs = configs(claim)?;

    // Device name -> (inventory index, CDI kind, CDI index name).
    let names = cdi::device_names(inv);
    let mut by_device: BTreeMap<String, PreparedDevice> = BTreeMap::new();
    let mut devices = Vec::new();
    let mut common = ContainerEdits::default();
    let mut kinds_done: Vec<CdiKind> = Vec::new();
    let mut parts = Vec::new();
    for r in &ours {
        if r.pool != node {
            return Err(ClaimError::OtherNode {
                device: r.device.clone(),
                pool: r.pool.clone(),
                node: node.to_owned(),
            });
        }
        // A MIG device is its GPU's nodes and the instance's capabilities.
        let partition = mig::parse_device_name(&r.device);
        let Some(d) = slices::by_name(inv, &r.device) else {
            return Err(ClaimError::UnknownDevice { device: r.device.clone() });
        };
        let part = partition
            .map(|(_, profile, start)| mig_part(&r.device, d, profile, start, mig))
            .transpose()?;
        let mode = mode_for(&configs, &r.request);
        // An AMD partition's render node; refused before the driver check, the cause being the
        // partition, not the driver.
        let xcp_node = slices::parse_partition_name(&r.device)
            .map(|(_, i)| partition_node(&r.device, d, i, mode))
            .transpose()?;
        let on_vfio = d.driver.as_deref() == Some("vfio-pci");
        if (mode == Mode::Passthrough) != on_vfio {
            let (mode_s, wanted, class) = match mode {
                Mode::Passthrough => ("passthrough", "vfio-pci", "gpu.xpu.dev"),
                Mode::Container => ("container", "its vendor driver", "passthrough.xpu.dev"),
            };
            return Err(ClaimError::Mode {
                device: r.device.clone(),
                driver: d.driver.clone().unwrap_or_else(|| "no driver".to_owned()),
                mode: mode_s.to_owned(),
                wanted: wanted.to_owned(),
                class: class.to_owned(),
            });
        }
        if let Some(p) = by_device.get_mut(&r.device) {
            // The same device for several requests (admin access): one CDI device.
            p.requests.push(r.request.clone());
            continue;
        }
        let no_nodes =
            || ClaimError::NoNodes { device: r.device.clone(), address: d.address.to_string() };
        let kind = CdiKind::of(d).ok_or_else(no_nodes)?;
        let index = names
            .iter()
            .find(|n| {
                n.kind == kind
                    && n.address == Some(d.address)
                    && n.name.bytes().all(|b| b.is_ascii_digit())
            })
            .ok_or_else(no_nodes)?;
        let host = host_specs.iter().find(|s| s.kind == kind.as_str()).ok_or_else(no_nodes)?;
        let mut edits = host
            .devices
            .iter()
            .find(|x| x.name == index.name)
            .map(|x| x.container_edits.clone())
            .ok_or_else(no_nodes)?;
        // An AMD partition is its own render node, never its GPU's others.
        if let Some(node) = xcp_node {
            edits.device_nodes = vec![node];
        }
        // What the kind's devices share (control nodes, driver files, environment) is for
        // its vendor driver; a device passed through gets its group's nodes alone.
        // The kind's shared edits hold `/dev/vfio/vfio` when any of its devices is on vfio-pci:
        // a VM's alone, as a device on its vendor driver never needs it.
        let is_vfio_container = |n: &cdi::DeviceNode| n.path == VFIO_CONTAINER;
        match mode {
            Mode::Container if !kinds_done.contains(&kind) => {
                let mut shared = host.container_edits.clone();
                shared.device_nodes.retain(|n| !is_vfio_container(n));
                merge(&mut common, &shared);
                kinds_done.push(kind);
            }
            Mode::Container => {}
            Mode::Passthrough => {
                let nodes = &host.container_edits.device_nodes;
                let vfio = nodes.iter().filter(|n| is_vfio_container(n)).cloned().collect();
                merge(&mut common, &ContainerEdits { device_nodes: vfio, ..Default::default() })
            }
        }
        let cdi_name = format!("{uid}-{}", r.device);
        if let Some(part) = part {
            parts.push(MigPart { spec_device: devices.len(), ..part });
        }
        devices.push(cdi::Device { name: cdi_name.clone(), container_edits: edits });
        by_device.insert(
            r.device.clone(),
            PreparedDevice {
                requests: vec![r.request.clone()],
                pool: r.pool.clone(),
                device: r.device.clone(),
                cdi_ids: vec![format!("{CLAIM_CDI_KIND}={cdi_name}")],
            },
        );
    }
    let spec = Spec {
        cdi_version: cdi::CDI_VERSION.to_owned(),
        kind: CLAIM_CDI_KIND.to_owned(),
        devices,
        container_edits: common,
    };
    Ok(Plan { spec, devices: by_device.into_values().collect(), mig: parts })
}

/// The render node of partition `index` of the AMD GPU `d`, as discovery found it now: a
/// partition that is gone (the GPU's mode changed under the driver) or asked for passthrough is
/// refused naming it.
fn partition_node(
    device: &str,
    d: &PciDevice,
    index: u32,
    mode: Mode,
) -> Result<cdi::DeviceNode, ClaimError> {
    let err = |reason: String| ClaimError::Partition { device: device.to_owned(), reason };
    if mode == Mode::Passthrough {
        return Err(err(
            "a partition is not a PCI function and cannot be passed through; ask for the whole GPU in SPX mode"
                .into(),
        ));
    }
    let p = d
        .partitioning
        .as_ref()
        .ok_or_else(|| err(format!("the GPU at {} reports no partitioning now", d.address)))?;
    let x = p.partitions.iter().find(|x| x.index == index).ok_or_else(|| {
        err(format!(
            "the GPU at {} is in {} mode with {} partitions now; it was re-published",
            d.address,
            p.compute,
            p.partitions.len()
        ))
    })?;
    let n = &x.render_node;
    match (n.major, n.minor) {
        (Some(major), Some(minor)) => Ok(cdi::DeviceNode {
            path: n.path.clone(),
            node_type: "c".to_owned(),
            major: major.into(),
            minor: minor.into(),
            file_mode: n.mode,
        }),
        _ => Err(err(format!("{} has no device numbers", n.path))),
    }
}

/// How the driver shares a GPU among the claims given part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing<'a> {
    /// Each a client of the GPU's MPS daemon, whose pipe directory is under this one
    /// (`--mps-dir`), limited to its part.
    Mps(&'a std::path::Path),
    /// Each gets the whole GPU, with no limit and no isolation (`--time-slicing`).
    TimeSlicing,
}

/// The devices of the planned claim given part of a GPU. With [`Sharing::Mps`] each is made a
/// client of its GPU's MPS daemon in `plan`'s spec: the pipe directory bound in,
/// `CUDA_MPS_PIPE_DIRECTORY`, and its thread percentage and pinned memory from the capacity the
/// scheduler allocated (`consumedCapacity`), never from the workload. With
/// [`Sharing::TimeSlicing`] each gets the GPU and `XPU_SHARING=time-slicing`, and no limit. A
/// device given all of a GPU's capacity is the whole GPU.
pub fn mps(
    claim: &ResourceClaim,
    inv: &Inventory,
    plan: &mut Plan,
    sharing: Option<Sharing<'_>>,
) -> Result<Vec<MpsPart>, ClaimError> {
    let Some(results) = allocated(claim).and_then(|d| d.results.as_ref()) else {
        return Ok(Vec::new());
    };
    let mut out: Vec<MpsPart> = Vec::new();
    for r in results.iter().filter(|r| r.driver == DRIVER) {
        let Some(consumed) = r.consumed_capacity.as_ref() else { continue };
        let Some(d) = slices::by_name(inv, &r.device) else { continue };
        let shown: Vec<String> = consumed.iter().map(|(k, q)| format!("{k} {}", q.0)).collect();
        let err = |reason: String| ClaimError::Shared {
            device: r.device.clone(),
            consumed: shown.join(", "),
            reason,
        };
        let whole_mib = match (d.vendor_id, d.device_id) {
            (Some(v), Some(i)) => xpu_core::accel::lookup(v, i),
            _ => None,
        }
        .map(|f| u64::from(f.memory_gib) * 1024);
        let compute = match consumed.get(slices::COMPUTE_CAPACITY) {
            Some(q) => match crate::convert::quantity(&q.0, 1.0) {
                Some(c @ 1..=100) => c,
                _ => {
                    return Err(err(format!(
                        "compute {:?} is not a percentage from 1 to 100",
                        q.0
                    )));
                }
            },
            None => 100,
        };
        let memory_mib = match consumed.get("memory") {
            Some(q) => match crate::convert::quantity(&q.0, 1.0) {
                Some(b) if b >= 1 << 20 => Some(b >> 20),
                _ => return Err(err(format!("memory {:?} is under 1 MiB or unreadable", q.0))),
            },
            None => None,
        };
        if compute == 100 && memory_mib.is_none_or(|m| whole_mib.is_some_and(|w| m >= w)) {
            continue;
        }
        let Some(uuid) = d.uuid.clone() else {
            return Err(err(format!(
                "the GPU at {} has no UUID to name its MPS daemon by",
                d.address
            )));
        };
        let name = format!("{}-{}", claim.metadata.uid.as_deref().unwrap_or_default(), r.device);
        let dir = match sharing {
            Some(Sharing::Mps(dir)) => dir,
            Some(Sharing::TimeSlicing) => {
                if let Some(dev) = plan.spec.devices.iter_mut().find(|x| x.name == name) {
                    dev.container_edits.env.push("XPU_SHARING=time-slicing".to_owned());
                }
                continue;
            }
            None => {
                return Err(err(
                    "this driver shares no GPU (started without --mps-dir or --time-slicing), so the part would be the whole GPU; start it with --mps-dir".to_owned(),
                ));
            }
        };
        if d.driver.as_deref() != Some("nvidia") {
            return Err(err(format!(
                "only a GPU on the nvidia driver is shared through MPS (this one is on {})",
                d.driver.as_deref().unwrap_or("no driver")
            )));
        }
        let limits = xpu_host::mps::Limits {
            thread_percent: compute as u16,
            memory_mib: memory_mib.or(whole_mib),
        };
        let Some(dev) = plan.spec.devices.iter_mut().find(|x| x.name == name) else { continue };
        let edits = &mut dev.container_edits;
        edits.env.retain(|e| !xpu_host::mps::is_client_var(e.split('=').next().unwrap_or(e)));
        edits.env.extend(
            limits
                .env(xpu_integrations::mps::CONTAINER_PIPE_DIR)
                .into_iter()
                .map(|(k, v)| format!("{k}={v}")),
        );
        edits.env.push("XPU_SHARING=mps".to_owned());
        edits.mounts.push(cdi::Mount {
            host_path: dir.join(&uuid).join("pipe").to_string_lossy().into_owned(),
            container_path: xpu_integrations::mps::CONTAINER_PIPE_DIR.to_owned(),
            options: ["rbind", "rw", "nosuid", "nodev"].map(str::to_owned).to_vec(),
        });
        out.push(MpsPart { device: r.device.clone(), gpu: uuid, limits });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use xpu_container::cdi::{CdiKind, GenerateOptions};
    use xpu_host::{DiscoverOptions, Root};
    use xpu_testkit::{BuildOptions, hosts};

    fn host() -> (xpu_testkit::Fixture, Inventory, Vec<Spec>) {
        let fx =
            hosts::a100_8x().build_with(&BuildOptions { char_devices: true, ..Default::default() });
        let root = Root::new(fx.root()).unwrap();
        let inv = xpu_host::discover(&root, &DiscoverOptions::default()).unwrap();
        let files = xpu_host::driver_files::find(&root, inv.host.nvidia_driver_version.as_deref());
        let opts = GenerateOptions {
            kinds: CdiKind::ALL.to_vec(),
            strict: false,
            host_root: root.base().to_owned(),
        };
        let specs = cdi::generate(&inv, &files, &opts).map(|g| g.specs).unwrap_or_default();
        (fx, inv, specs)
    }

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": { "name": "c", "namespace": "ns", "uid": "u1" },
            "spec": {},
            "status": { "allocation": { "devices": { "results": results, "config": config } } },
        }))
        .unwrap()
    }

    fn first_gpus(inv: &Inventory, n: usize) -> Vec<String> {
        inv.devices
            .iter()
            .filter_map(slices::device_name)
            .filter(|d| d.starts_with("gpu"))
            .take(n)
            .collect()
    }

    /// An MI300X host in CPX mode: its GPUs published as eight partitions each, a claim for one
    /// gets its render node and `/dev/kfd`, never the GPU's card or other partitions' nodes.
    #[test]
    fn an_amd_partition_gets_its_own_render_node_only() {
        let fx = hosts::mi300x_cpx()
            .build_with(&BuildOptions { char_devices: true, ..Default::default() });
        let root = Root::new(fx.root()).unwrap();
        let mut inv = xpu_host::discover(&root, &DiscoverOptions::default()).unwrap();
        let opts = GenerateOptions {
            kinds: CdiKind::ALL.to_vec(),
            strict: false,
            host_root: root.base().to_owned(),
        };
        let files = xpu_host::driver_files::find(&root, None);
        let specs = cdi::generate(&inv, &files, &opts).map(|g| g.specs).unwrap_or_default();
        if specs.is_empty() {
            eprintln!("skipping: fixture device nodes need root (mknod)");
            return;
        }
        let published = slices::devices(&root, &inv);
        assert_eq!(published.len(), 64, "8 GPUs × 8 partitions");
        let gpu0 = slices::device_name(inv.accelerators().next().unwrap()).unwrap();
        let name = slices::partition_name(&gpu0, 3);
        let dev = published.iter().find(|d| d.name == name).unwrap();
        let attrs = dev.attributes.as_ref().unwrap();
        assert_eq!(attrs["computePartition"].string.as_deref(), Some("CPX"));
        assert_eq!(attrs["memoryPartition"].string.as_deref(), Some("NPS1"));
        assert_eq!((attrs["partition"].int, attrs["xcc"].int), (Some(3), Some(1)));
        assert_eq!(attrs["passthroughCapable"].bool, Some(false));
        assert_eq!(dev.capacity.as_ref().unwrap()["memory"].value.0, "24Gi");

        let r =
            |dev: &str| json!([{ "request": "r", "driver": DRIVER, "pool": "n1", "device": dev }]);
        let p = plan(&claim(r(&name), json!([])), "u1", "n1", &inv, &specs, &[]).unwrap();
        let nodes: Vec<&str> = p.spec.devices[0]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(nodes, ["/dev/dri/renderD131"]);
        let shared: Vec<&str> =
            p.spec.container_edits.device_nodes.iter().map(|n| n.path.as_str()).collect();
        assert!(shared.contains(&"/dev/kfd"), "{shared:?}");
        assert!(!shared.iter().any(|n| n.starts_with("/dev/dri")), "{shared:?}");

        // Passthrough of a partition, and a partition gone after the mode changed: refused.
        let pt = json!([{ "source": "FromClaim", "opaque": { "driver": DRIVER,
            "parameters": { "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mode": "passthrough" } } }]);
        let e = plan(&claim(r(&name), pt), "u1", "n1", &inv, &specs, &[]).unwrap_err();
        assert!(e.to_string().contains("GPU partition") && e.to_string().contains(&name), "{e}");
        for d in inv.devices.iter_mut() {
            if let Some(p) = d.partitioning.as_mut() {
                p.compute = "DPX".into();
                p.partitions.truncate(2);
            }
        }
        let e = plan(&claim(r(&name), json!([])), "u1", "n1", &inv, &specs, &[]).unwrap_err();
        assert!(e.to_string().contains("DPX mode with 2 partitions"), "{e}");
        assert_eq!(slices::devices(&root, &inv).len(), 16, "re-published as the new mode's");
    }

    #[test]
    fn plans_one_spec_with_a_device_per_allocated_gpu() {
        let (_fx, inv, specs) = host();
        if specs.is_empty() {
            eprintln!("skipping: fixture device nodes need root (mknod)");
            return;
        }
        let gpus = first_gpus(&inv, 2);
        let results: Vec<_> = gpus
            .iter()
            .map(|g| json!({ "request": "gpus", "driver": DRIVER, "pool": "n1", "device": g }))
            .collect();
        let p = plan(&claim(json!(results), json!([])), "u1", "n1", &inv, &specs, &[]).unwrap();
        assert_eq!(p.devices.len(), 2);
        assert_eq!(p.spec.devices.len(), 2);
        assert!(p.devices[0].cdi_ids[0].starts_with("k8s.xpu.dev/claim=u1-gpu-"));
        assert!(p.spec.devices.iter().all(|d| !d.container_edits.device_nodes.is_empty()));
        // The reference implementation loads and validates it, and the ids resolve in it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(spec_file("u1"));
        cdi::write(&path, cdi::to_json(&p.spec).as_bytes()).unwrap();
        let mut s = container_device_interface::spec::read_spec(&path, 0).unwrap();
        s.validate().unwrap();
        assert_eq!(s.get_vendor() + "/" + &s.get_class(), CLAIM_CDI_KIND);
        for d in &p.devices {
            let name = d.cdi_ids[0].split_once('=').unwrap().1;
            assert!(s.get_devices().contains_key(name), "{name}");
        }
    }

    #[test]
    fn bad_input_is_refused_naming_the_cause() {
        let (_fx, inv, specs) = host();
        let g = first_gpus(&inv, 1).remove(0);
        let r = |driver: &str, pool: &str, dev: &str| json!([{ "request": "r", "driver": driver, "pool": pool, "device": dev }]);
        let e =
            plan(&claim(r("gpu.nvidia.com", "n1", &g), json!([])), "u1", "n1", &inv, &specs, &[])
                .unwrap_err();
        assert!(matches!(e, ClaimError::OtherDriver { .. }), "{e}");
        let e = plan(&claim(r(DRIVER, "n2", &g), json!([])), "u1", "n1", &inv, &specs, &[])
            .unwrap_err();
        assert!(e.to_string().contains("pool n2"), "{e}");
        let e = plan(
            &claim(r(DRIVER, "n1", "gpu-0000-99-00-0"), json!([])),
            "u1",
            "n1",
            &inv,
            &specs,
            &[],
        )
        .unwrap_err();
        assert!(e.to_string().contains("gpu-0000-99-00-0"), "{e}");
        let e = plan(&claim(r(DRIVER, "n1", &g), json!([])), "other", "n1", &inv, &specs, &[])
            .unwrap_err();
        assert!(matches!(e, ClaimError::Uid { .. }), "{e}");
        let bad = json!([{ "source": "FromClaim", "opaque": { "driver": DRIVER,
            "parameters": { "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mode": "vm" } } }]);
        let e = plan(&claim(r(DRIVER, "n1", &g), bad), "u1", "n1", &inv, &specs, &[]).unwrap_err();
        assert!(
            e.to_string().contains("config[0].opaque.parameters") && e.to_string().contains("vm"),
            "{e}"
        );
        let bad = json!([{ "source": "FromClaim", "opaque": { "driver": DRIVER,
            "parameters": { "apiVersion": "xpu.dev/v2", "kind": "DeviceConfig" } } }]);
        let e = plan(&claim(r(DRIVER, "n1", &g), bad), "u1", "n1", &inv, &specs, &[]).unwrap_err();
        assert!(e.to_string().contains("parameters.apiVersion"), "{e}");
        let pt = json!([{ "source": "FromClaim", "opaque": { "driver": DRIVER,
            "parameters": { "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mode": "passthrough" } } }]);
        // Passthrough for a GPU on its vendor driver: the plugin moves it first
        // (`super::rebind`); planned without the move, it is refused.
        let c = claim(r(DRIVER, "n1", &g), pt.clone());
        let addr = inv.devices.iter().find(|d| slices::device_name(d).as_deref() == Some(&g));
        assert_eq!(to_move(&c, &inv).unwrap(), vec![addr.unwrap().address]);
        assert!(to_move(&claim(r(DRIVER, "n1", &g), json!([])), &inv).unwrap().is_empty());
        let e = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap_err();
        assert!(matches!(e, ClaimError::Mode { .. }), "{e}");
    }

    #[test]
    fn mig_devices_plan_an_instance_and_refuse_what_no_gpu_offers() {
        use xpu_telemetry::mig::{FakeMig, MigControl};
        let (_fx, inv, specs) = host();
        if specs.is_empty() {
            eprintln!("skipping: fixture device nodes need root (mknod)");
            return;
        }
        let gpus: Vec<&PciDevice> = inv
            .devices
            .iter()
            .filter(|d| {
                d.dev_nodes.iter().any(|n| xpu_container::edits::is_nvidia_gpu_node(&n.path))
            })
            .collect();
        let (g0, g1) = (gpus[0], gpus[1]);
        let fake =
            FakeMig::new([(g0.address, "NVIDIA H200", true), (g1.address, "NVIDIA H200", false)]);
        let state = fake.gpus().unwrap();
        let name0 = slices::device_name(g0).unwrap();
        let one = |device: String| {
            claim(
                json!([{ "request": "mig", "driver": DRIVER, "pool": "n1", "device": device }]),
                json!([]),
            )
        };
        let p =
            plan(&one(mig::device_name(&name0, "3g.71gb", 4)), "u1", "n1", &inv, &specs, &state)
                .unwrap();
        assert_eq!(p.mig.len(), 1);
        let part = &p.mig[0];
        assert_eq!(
            (part.gpu, part.profile, part.start, part.spec_device),
            (g0.address, "3g.71gb", 4, 0)
        );
        let minor = g0
            .dev_nodes
            .iter()
            .find_map(|n| n.minor.filter(|_| xpu_container::edits::is_nvidia_gpu_node(&n.path)));
        assert_eq!(Some(part.gpu_minor), minor);
        // The device's own edits are its GPU's node; the capabilities come when it is made.
        let nodes = &p.spec.devices[0].container_edits.device_nodes;
        assert_eq!(nodes.len(), 1, "{nodes:?}");

        let refused = |device: String, needle: &str| {
            let e = plan(&one(device.clone()), "u1", "n1", &inv, &specs, &state).unwrap_err();
            assert!(
                e.to_string().contains(needle) && e.to_string().contains(&device),
                "{device}: {e}"
            );
        };
        refused(format!("{name0}-mig-5g-99gb-0"), "offers no profile 5g-99gb");
        refused(mig::device_name(&name0, "3g.71gb", 2), "never placed at memory slice 2");
        refused(
            mig::device_name(&slices::device_name(g1).unwrap(), "1g.18gb", 0),
            "MIG mode is off",
        );
        // Without MIG state from NVML, no MIG device is planned.
        let e = plan(&one(mig::device_name(&name0, "1g.18gb", 0)), "u1", "n1", &inv, &specs, &[])
            .unwrap_err();
        assert!(e.to_string().contains("NVML reports no MIG state"), "{e}");
    }

    /// A device given part of a GPU is a client of the GPU's MPS daemon with exactly the
    /// capacity it was allocated; all of it is the whole GPU; what cannot be served is refused
    /// naming the device and why.
    #[test]
    fn a_shared_gpu_is_an_mps_client_limited_to_its_allocated_capacity() {
        let (_fx, inv, specs) = host();
        if specs.is_empty() {
            eprintln!("skipping: fixture device nodes need root (mknod)");
            return;
        }
        let g = first_gpus(&inv, 1).remove(0);
        let uuid = slices::by_name(&inv, &g).unwrap().uuid.clone().unwrap();
        let with = |consumed: serde_json::Value| {
            claim(
                json!([{ "request": "r", "driver": DRIVER, "pool": "n1", "device": g,
                         "shareID": "0b5a1a6e-0000-4000-8000-000000000001", "consumedCapacity": consumed }]),
                json!([]),
            )
        };
        let dir = std::path::Path::new("/run/xpu/mps");
        let c = with(json!({ "compute": "25", "memory": "10Gi" }));
        let mut p = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap();
        let parts = mps(&c, &inv, &mut p, Some(Sharing::Mps(dir))).unwrap();
        assert_eq!(
            parts,
            [MpsPart {
                device: g.clone(),
                gpu: uuid.clone(),
                limits: xpu_host::mps::Limits { thread_percent: 25, memory_mib: Some(10240) },
            }]
        );
        let edits = &p.spec.devices[0].container_edits;
        for e in [
            "CUDA_MPS_PIPE_DIRECTORY=/var/run/xpu-mps",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M",
            "XPU_SHARING=mps",
        ] {
            assert!(edits.env.iter().any(|x| x == e), "{e}: {:?}", edits.env);
        }
        assert_eq!(edits.mounts.last().unwrap().host_path, format!("/run/xpu/mps/{uuid}/pipe"));
        // Only compute asked for: the memory limit is the GPU's (an A100's 40 GiB).
        let c = with(json!({ "compute": "50", "memory": "40Gi" }));
        let mut p = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap();
        assert_eq!(
            mps(&c, &inv, &mut p, Some(Sharing::Mps(dir))).unwrap()[0].limits.memory_mib,
            Some(40960)
        );
        // All of it: the whole GPU, no client, nothing added.
        let c = with(json!({ "compute": "100", "memory": "40Gi" }));
        let mut p = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap();
        let before = p.spec.clone();
        assert!(mps(&c, &inv, &mut p, Some(Sharing::Mps(dir))).unwrap().is_empty());
        assert_eq!(p.spec, before);
        // Refused, naming the device: no MPS on this driver, a compute over 100.
        let c = with(json!({ "compute": "25", "memory": "10Gi" }));
        let mut p = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap();
        let e = mps(&c, &inv, &mut p, None).unwrap_err().to_string();
        assert!(e.contains(&g) && e.contains("--mps-dir"), "{e}");
        // Time-sliced: the whole GPU, said so, no limit and no daemon.
        let mut p = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap();
        assert!(mps(&c, &inv, &mut p, Some(Sharing::TimeSlicing)).unwrap().is_empty());
        let env = &p.spec.devices[0].container_edits.env;
        assert!(env.iter().any(|e| e == "XPU_SHARING=time-slicing"), "{env:?}");
        assert!(!env.iter().any(|e| e.starts_with("CUDA_MPS_")), "{env:?}");
        let c = with(json!({ "compute": "150" }));
        let mut p = plan(&c, "u1", "n1", &inv, &specs, &[]).unwrap();
        let e = mps(&c, &inv, &mut p, Some(Sharing::Mps(dir))).unwrap_err().to_string();
        assert!(e.contains(&g) && e.contains("150"), "{e}");
    }
}
