//! Kubernetes objects to scheduler terms: a Node to an [`xpu_sched::NodeSpec`], a Pod to what
//! it asks for ([`PodAsk`]) and which gang it belongs to. Pure functions; no I/O.
//!
//! What a pod asks for follows kube-scheduler's rules: the effective request is the larger of
//! the sum over containers and the largest init container (sidecars, `restartPolicy: Always`,
//! add to both), plus `spec.overhead`; extended resources are whole counts. A constraint xpu does
//! not implement is reported by its field path ([`Unsupported`]) so the pod can say which.

use std::collections::BTreeMap;

use crate::node::Node;
use crate::pod::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use xpu_core::DeviceKind;
use xpu_sched::constraints::{Effect, Operator, Requirement, Taint, Toleration};
use xpu_sched::request::{GKE_TPU_ACCELERATOR, GKE_TPU_TOPOLOGY};
use xpu_sched::{DeviceAsk, DeviceSpec, NodeSpec, TaskSpec};

/// Extended resources xpu schedules, with the device kind each stands for.
pub const DEVICE_RESOURCES: [(&str, DeviceKind); 4] = [
    ("nvidia.com/gpu", DeviceKind::Gpu),
    ("amd.com/gpu", DeviceKind::Gpu),
    ("google.com/tpu", DeviceKind::Tpu),
    (SHARE_RESOURCE, DeviceKind::Gpu),
];

/// GPU sharing: a pod asks for thousandths of one GPU (`xpu.dev/gpu-milli: 500` is half of
/// one), or for whole GPUs in multiples of 1000 (`2000` is two). A node offers
/// `1000 × GPUs` of it (xpu's device plugin with `--share`); its GPUs are numbered 0.. in PCI
/// address order, which is how the scheduler names the one it chose (see [`crate::share`]).
pub use xpu_integrations::deviceplugin::SHARE_RESOURCE;
/// Units of [`SHARE_RESOURCE`] in one GPU (the device plugin's units per GPU).
pub const MILLI_PER_GPU: u64 = xpu_integrations::deviceplugin::SHARE_UNITS as u64;

/// Internal node label (never a real one: `~` is not allowed in label keys) holding the
/// node's name, for `matchFields` on `metadata.name` and for keeping a pod to the nodes its
/// DRA claims can be allocated on. The cycle sets it only when a waiting pod needs it (a label
/// unique to each node gives every node a shape of its own in xpu-sched).
pub const NODE_NAME: &str = "xpu.dev~node";

/// LeaderWorkerSet's pod labels and annotations (its published API): the set's name, the
/// group's index and key (shared by the leader and workers of one group), the pod's index in
/// its group (the leader is 0), and the group's size.
pub const LWS_NAME: &str = "leaderworkerset.sigs.k8s.io/name";
pub const LWS_GROUP_INDEX: &str = "leaderworkerset.sigs.k8s.io/group-index";
pub const LWS_GROUP_KEY: &str = "leaderworkerset.sigs.k8s.io/group-key";
pub const LWS_WORKER_INDEX: &str = "leaderworkerset.sigs.k8s.io/worker-index";
pub const LWS_SIZE: &str = "leaderworkerset.sigs.k8s.io/size";

/// Label (or annotation) naming a gang of pods that start together or not at all.
pub const GANG_LABEL: &str = "xpu.dev/gang";
/// Label (or annotation) with the number of pods in the gang.
pub const GANG_SIZE: &str = "xpu.dev/gang-size";
/// Label choosing one of the fair-share queues the pod's namespace owns ([`crate::queues`]).
pub const QUEUE_LABEL: &str = "xpu.dev/queue";
/// GKE's node-pool label: nodes of one pool form one TPU slice.
pub const GKE_NODEPOOL: &str = "cloud.google.com/gke-nodepool";
/// Product labels device plugins and GPU feature discovery put on nodes.
const MODEL_LABELS: [&str; 3] =
    ["nvidia.com/gpu.product", "amd.com/gpu.product-name", "xpu.dev/gpu.product"];
/// The Indexed Job's completion index (annotation, and label since 1.28).
pub const COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";

/// Parses a Kubernetes quantity (`500m`, `2`, `16Gi`, `1e3`, `1.5G`) into its value times
/// `scale` (1000 for milli-CPU), rounded up. `None` when malformed or negative.
pub fn quantity(q: &str, scale: f64) -> Option<u64> {
    let q = q.trim();
    let split =
        q.find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E').unwrap_or(q.len());
    // `1e3` is an exponent; `1E` (exa) is a suffix: an `e`/`E` followed by digits is part of the number.
    let (num, suffix) = if split == q.len() {
        match q.rfind(['e', 'E']) {
            Some(i)
                if q[i + 1..].chars().all(|c| c.is_ascii_digit() || c == '-' || c == '+')
                    && i + 1 < q.len() =>
            {
                (q, "")
            }
            Some(i) if i + 1 == q.len() => (&q[..i], &q[i..]),
            _ => (q, ""),
        }
    } else {
        (&q[..split], &q[split..])
    };
    let mult: f64 = match suffix {
        "" => 1.0,
        "n" => 1e-9,
        "u" => 1e-6,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        _ => return None,
    };
    let v: f64 = num.parse().ok()?;
    if !v.is_finite() || v < 0.0 {
        return None;
    }
    let x = (v * mult * scale).ceil();
    (x <= u64::MAX as f64).then_some(x as u64)
}

fn q(map: Option<&BTreeMap<String, Quantity>>, key: &str, scale: f64) -> Result<u64, String> {
    q_of(map.and_then(|m| m.get(key)), key, scale)
}

/// [`q`] of a value looked up already.
fn q_of(v: Option<&Quantity>, key: &str, scale: f64) -> Result<u64, String> {
    match v {
        None => Ok(0),
        Some(v) => {
            quantity(&v.0, scale).ok_or_else(|| format!("{key}: {:?} is not a quantity", v.0))
        }
    }
}

const MIB: f64 = 1.0 / (1024.0 * 1024.0);

/// A node as the scheduler sees it, or why it is skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeView {
    pub spec: NodeSpec,
    /// Ready, schedulable and not tainted out of everything.
    pub ready: bool,
    /// `pods` allocatable.
    pub max_pods: u64,
}

/// Converts a Node. `Err` names the field that is wrong; the caller skips the node, warns and
/// records an Event.
pub fn node(n: &Node) -> Result<NodeView, String> {
    let name = n.metadata.name.clone().ok_or("metadata.name is missing")?;
    let labels: BTreeMap<String, String> = n.metadata.labels.clone().unwrap_or_default();
    let status = n.status.as_ref();
    let alloc = status.and_then(|s| s.allocatable.as_ref().or(s.capacity.as_ref()));
    let cpu = q(alloc, "cpu", 1000.0).map_err(|e| format!("status.allocatable.{e}"))?;
    // Allocatable memory rounds down: never promise a byte the node does not have.
    let mem_bytes = q(alloc, "memory", 1.0).map_err(|e| format!("status.allocatable.{e}"))?;
    let memory_mib = (mem_bytes as f64 * MIB).floor() as u64;
    let max_pods = match alloc.and_then(|a| a.get("pods")) {
        None => 110,
        Some(p) => quantity(&p.0, 1.0)
            .ok_or_else(|| format!("status.allocatable.pods: {:?} is not a quantity", p.0))?,
    };
    let mut spec = NodeSpec::new(name, cpu, memory_mib);
    if let (Some(acc), Some(topo)) = (labels.get(GKE_TPU_ACCELERATOR), labels.get(GKE_TPU_TOPOLOGY))
    {
        xpu_core::tpu::slice(acc, topo).map_err(|e| {
            format!("metadata.labels[{GKE_TPU_TOPOLOGY}]: {topo:?} with {GKE_TPU_ACCELERATOR}={acc:?}: {e}")
        })?;
    } else if let Some(topo) = labels.get(GKE_TPU_TOPOLOGY)
        && !topo.split('x').all(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!(
            "metadata.labels[{GKE_TPU_TOPOLOGY}]: {topo:?} is not a topology like 2x2x2"
        ));
    }
    for (res, kind) in DEVICE_RESOURCES {
        let mut count = q(alloc, res, 1.0).map_err(|e| format!("status.allocatable.{e}"))?;
        if res == SHARE_RESOURCE {
            // GPUs are numbered over every GPU the plugin advertises (capacity counts the
            // unhealthy ones, which allocatable leaves out), so an index names the same GPU on
            // both sides.
            let cap = status.and_then(|s| s.capacity.as_ref());
            let all = q(cap, res, 1.0).map_err(|e| format!("status.capacity.{e}"))?;
            count = all.max(count) / MILLI_PER_GPU;
        }
        if count as usize > xpu_sched::cluster::MAX_DEVICES {
            return Err(format!(
                "status.allocatable.{res}: {count} devices; xpu schedules at most {} per node",
                xpu_sched::cluster::MAX_DEVICES
            ));
        }
        let model = match kind {
            DeviceKind::Tpu => {
                labels.get(GKE_TPU_ACCELERATOR).cloned().unwrap_or_else(|| "tpu".into())
            }
            _ => MODEL_LABELS
                .iter()
                .find_map(|l| labels.get(*l))
                .cloned()
                .unwrap_or_else(|| res.split('.').next().unwrap_or(res).to_owned()),
        };
        for i in 0..count {
            spec = spec.device(DeviceSpec::new(format!("{res}/{i}"), kind, model.clone()));
        }
    }
    if let Some(pool) = labels.get(GKE_NODEPOOL) {
        spec = spec.pool(pool.clone());
    }
    for t in n.spec.as_ref().and_then(|s| s.taints.as_ref()).into_iter().flatten() {
        let effect =
            t.effect.parse::<Effect>().map_err(|e| format!("spec.taints[{}]: {e}", t.key))?;
        spec = spec.taint(Taint {
            key: t.key.clone(),
            value: t.value.clone().unwrap_or_default(),
            effect,
        });
    }
    spec.labels = labels;
    let unschedulable = n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    let ready_cond = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    Ok(NodeView { spec, ready: ready_cond && !unschedulable, max_pods })
}

/// What a pod uses or asks for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resources {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// Whole devices and their extended-resource name (one kind per pod); 1 for a share.
    pub devices: u16,
    pub device_resource: Option<&'static str>,
    /// A share of one GPU, in milli (1..=999), when the pod asks [`SHARE_RESOURCE`] for less
    /// than one; 0 otherwise.
    pub share_milli: u16,
}

/// A constraint xpu does not schedule, by its field path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    pub field: String,
    pub why: String,
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.why)
    }
}

pub(crate) fn unsupported(field: &str, why: &str) -> Unsupported {
    Unsupported { field: field.into(), why: why.into() }
}

#[derive(Default)]
struct Sum {
    cpu: u64,
    mem: u64,
    dev: BTreeMap<&'static str, u64>,
}

fn container_sum(c: &Container, path: &str) -> Result<Sum, Unsupported> {
    let r = c.resources.as_ref();
    // Requests default to limits for the API server, so requests are what counts; a pod whose
    // requests were never defaulted (created before admission) falls back to limits.
    let req = r.and_then(|r| r.requests.as_ref());
    let lim = r.and_then(|r| r.limits.as_ref());
    let pick = |key: &str, scale: f64| -> Result<u64, Unsupported> {
        let from = if req.is_some_and(|m| m.contains_key(key)) { req } else { lim };
        q_of(from.and_then(|m| m.get(key)), key, scale)
            .map_err(|e| unsupported(&format!("{path}.resources"), &e))
    };
    let mut s = Sum { cpu: pick("cpu", 1000.0)?, mem: pick("memory", 1.0)?, ..Sum::default() };
    for (res, _) in DEVICE_RESOURCES {
        let n = pick(res, 1.0)?;
        if n > 0 {
            s.dev.insert(res, n);
        }
    }
    Ok(s)
}

/// What a pod holds on its node: the effective request as kube-scheduler computes it, every
/// device resource counted. `Err` names the field for a quantity that does not parse, and for
/// requests whose sum does not fit 64 bits (the API server stores such quantities: each is
/// valid alone), so that a sum never wraps into a small number.
pub fn usage(p: &Pod) -> Result<Usage, Unsupported> {
    let Some(spec) = p.spec.as_ref() else { return Ok(Usage::default()) };
    let mut total = Sum::default();
    for (i, c) in spec.containers.iter().enumerate() {
        let path = format!("spec.containers[{i}]");
        total.add(&container_sum(c, &path)?, &path)?;
    }
    // Init containers run one after another: the largest counts, plus sidecars started before it.
    let mut sidecars = Sum::default();
    for (i, c) in spec.init_containers.iter().flatten().enumerate() {
        let path = format!("spec.initContainers[{i}]");
        let mut s = container_sum(c, &path)?;
        if c.restart_policy.as_deref() == Some("Always") {
            sidecars.add(&s, &path)?;
            continue;
        }
        s.add(&sidecars, &path)?;
        total.cpu = total.cpu.max(s.cpu);
        total.mem = total.mem.max(s.mem);
        for (k, v) in s.dev {
            let e = total.dev.entry(k).or_default();
            *e = (*e).max(v);
        }
    }
    total.add(&sidecars, "spec.initContainers")?;
    if let Some(o) = spec.overhead.as_ref() {
        let overhead = Sum {
            cpu: q(Some(o), "cpu", 1000.0).map_err(|e| unsupported("spec.overhead", &e))?,
            mem: q(Some(o), "memory", 1.0).map_err(|e| unsupported("spec.overhead", &e))?,
            dev: BTreeMap::new(),
        };
        total.add(&overhead, "spec.overhead")?;
    }
    Ok(Usage {
        cpu_milli: total.cpu,
        memory_mib: (total.mem as f64 * MIB).ceil() as u64,
        devices: total.dev,
    })
}

impl Sum {
    /// Adds `other` (from the field at `path`), refusing a sum that does not fit 64 bits.
    fn add(&mut self, other: &Sum, path: &str) -> Result<(), Unsupported> {
        let over = |what: &str| {
            unsupported(
                &format!("{path}.resources"),
                &format!(
                    "the pod's {what} requests add up to more than xpu can count (2^64 units); ask for less"
                ),
            )
        };
        self.cpu = self.cpu.checked_add(other.cpu).ok_or_else(|| over("cpu"))?;
        self.mem = self.mem.checked_add(other.mem).ok_or_else(|| over("memory"))?;
        for (k, v) in &other.dev {
            let e = self.dev.entry(k).or_default();
            *e = e.checked_add(*v).ok_or_else(|| over(k))?;
        }
        Ok(())
    }
}

/// What a pod uses on its node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Usage {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// Whole devices per extended resource.
    pub devices: BTreeMap<&'static str, u64>,
}

/// What a pending pod asks for, in the form xpu places: one device kind per pod.
pub fn resources(p: &Pod) -> Result<Resources, Unsupported> {
    let u = usage(p)?;
    if u.devices.len() > 1 {
        let names: Vec<&str> = u.devices.keys().copied().collect();
        return Err(unsupported(
            "spec.containers[*].resources",
            &format!(
                "asks for more than one device resource ({}); xpu places one kind per pod",
                names.join(", ")
            ),
        ));
    }
    let (device_resource, mut devices) = match u.devices.into_iter().next() {
        None => (None, 0),
        Some((k, v)) => (Some(k), v),
    };
    let mut share_milli = 0;
    if device_resource == Some(SHARE_RESOURCE) {
        if p.spec.as_ref().is_some_and(|s| share_containers(s) > 1) {
            return Err(unsupported(
                "spec.containers[*].resources",
                &format!(
                    "more than one container asks for {SHARE_RESOURCE}; ask in one container (the GPU share is the pod's)"
                ),
            ));
        }
        if devices < MILLI_PER_GPU {
            share_milli = devices as u16;
            devices = 1;
        } else if devices % MILLI_PER_GPU == 0 {
            devices /= MILLI_PER_GPU;
        } else {
            return Err(unsupported(
                "spec.containers[*].resources",
                &format!(
                    "{SHARE_RESOURCE}: {devices} is neither a share of one GPU (1 to 999) nor whole GPUs (a multiple of {MILLI_PER_GPU}); ask for {} or {}",
                    devices / MILLI_PER_GPU * MILLI_PER_GPU,
                    (devices / MILLI_PER_GPU + 1) * MILLI_PER_GPU
                ),
            ));
        }
    }
    let devices = u16::try_from(devices)
        .ok()
        .filter(|&d| usize::from(d) <= xpu_sched::cluster::MAX_DEVICES)
        .ok_or_else(|| {
            unsupported(
                "spec.containers[*].resources",
                &format!(
                    "{devices} devices in one pod; at most {} fit a node",
                    xpu_sched::cluster::MAX_DEVICES
                ),
            )
        })?;
    Ok(Resources {
        cpu_milli: u.cpu_milli,
        memory_mib: u.memory_mib,
        devices,
        device_resource,
        share_milli,
    })
}

/// How many containers (init containers included) ask for [`SHARE_RESOURCE`].
fn share_containers(spec: &crate::pod::PodSpec) -> usize {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter(|c| {
            c.resources.as_ref().is_some_and(|r| {
                [r.requests.as_ref(), r.limits.as_ref()]
                    .into_iter()
                    .flatten()
                    .any(|m| m.contains_key(SHARE_RESOURCE))
            })
        })
        .count()
}

/// A PodGroup (`scheduling.k8s.io/v1beta1`) as the scheduler uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPolicy {
    /// `gang.minCount`; `None` for the `basic` policy (each pod on its own).
    pub min_count: Option<u32>,
    /// `schedulingConstraints.topology[0].key`: every pod of the group in one domain of it.
    pub topology: Option<String>,
    /// `spec.priority` (admission resolves it from `priorityClassName`); every pod of the
    /// group must have it.
    pub priority: Option<i32>,
}

/// PodGroups by (namespace, name).
pub type PodGroups = std::collections::HashMap<(String, String), GroupPolicy>;

/// Gang keys of PodGroups read `namespace/podgroup:name`.
pub const PODGROUP_KEY: &str = "podgroup:";

/// The PodGroup a pod names in `spec.schedulingGroup.podGroupName`.
pub fn pod_group_name(p: &Pod) -> Option<&str> {
    p.spec.as_ref()?.scheduling_group.as_ref()?.pod_group_name.as_deref().filter(|n| !n.is_empty())
}

/// A PodGroup's policy; `Err` names what xpu cannot use.
pub fn group_policy(
    g: &k8s_openapi::api::scheduling::v1beta1::PodGroup,
) -> Result<GroupPolicy, String> {
    let spec = &g.spec;
    let min_count = match (&spec.scheduling_policy.gang, &spec.scheduling_policy.basic) {
        (Some(gang), _) => Some(
            u32::try_from(gang.min_count).ok().filter(|n| (1..=100_000).contains(n)).ok_or_else(
                || format!("gang.minCount {} is not from 1 to 100000", gang.min_count),
            )?,
        ),
        (None, _) => None,
    };
    let topology = spec
        .scheduling_constraints
        .as_ref()
        .and_then(|c| c.topology.as_ref())
        .and_then(|t| t.first())
        .map(|t| t.key.clone());
    Ok(GroupPolicy { min_count, topology, priority: spec.priority })
}

/// How the pod belongs to a gang.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangRef {
    /// `namespace/name` of the gang (or of its Job).
    pub key: String,
    pub size: u32,
    /// Position in the gang (the completion index when there is one).
    pub index: Option<u32>,
}

/// A pending pod, in scheduler terms.
#[derive(Debug, Clone, PartialEq)]
pub struct PodAsk {
    pub task: TaskSpec,
    pub resources: Resources,
    pub priority: i32,
    pub queue: String,
    /// TPU accelerator and topology, when its node selector names both.
    pub tpu: Option<(String, String)>,
}

fn label_or_annotation<'a>(p: &'a Pod, key: &str) -> Option<&'a String> {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .or_else(|| p.metadata.annotations.as_ref().and_then(|a| a.get(key)))
}

/// The `batch/v1` Job that controls a pod, if one does.
pub fn job_owner(
    p: &Pod,
) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    p.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "Job" && o.api_version == "batch/v1")
}

/// The gang a pod belongs to: `xpu.dev/gang` + `xpu.dev/gang-size`, or an Indexed Job whose
/// `parallelism` equals its `completions` (`jobs`: Job uid → (completions, parallelism,
/// indexed)). `Err` for a malformed gang label.
pub fn gang(
    p: &Pod,
    job_shape: impl Fn(&str) -> Option<(i32, i32, bool)>,
    groups: Option<&PodGroups>,
) -> Result<Option<GangRef>, Unsupported> {
    let ns = p.metadata.namespace.as_deref().unwrap_or("default");
    // Kubernetes' own gang API: the PodGroup the pod names.
    if let Some(name) = pod_group_name(p) {
        let Some(g) = groups.and_then(|g| g.get(&(ns.to_owned(), name.to_owned()))) else {
            return Err(unsupported(
                "spec.schedulingGroup.podGroupName",
                &format!("PodGroup {ns}/{name} does not exist (yet): the pod waits for it"),
            ));
        };
        let own = p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        if let Some(gp) = g.priority
            && gp != own
        {
            return Err(unsupported(
                "spec.priority",
                &format!(
                    "all pods in a single pod group should have the same priority as the pod group's priority, got {own} and {gp}"
                ),
            ));
        }
        return Ok(g.min_count.map(|size| GangRef {
            key: format!("{ns}/{PODGROUP_KEY}{name}"),
            size,
            index: None,
        }));
    }
    let index = label_or_annotation(p, COMPLETION_INDEX).and_then(|i| i.parse::<u32>().ok());
    if let Some(name) = label_or_annotation(p, GANG_LABEL) {
        let size = label_or_annotation(p, GANG_SIZE).ok_or_else(|| {
            unsupported(
                &format!("metadata.labels[{GANG_SIZE}]"),
                &format!("missing; a pod of gang {name:?} must say how many pods the gang has"),
            )
        })?;
        let size: u32 =
            size.parse().ok().filter(|n| (1..=100_000).contains(n)).ok_or_else(|| {
                unsupported(
                    &format!("metadata.labels[{GANG_SIZE}]"),
                    &format!("{size:?} is not a number of pods from 1 to 100000"),
                )
            })?;
        return Ok(Some(GangRef { key: format!("{ns}/{name}"), size, index }));
    }
    // A LeaderWorkerSet group: its leader and workers, `size` pods, all or none.
    if let Some(group) = label_or_annotation(p, LWS_GROUP_KEY)
        && let Some(size) = label_or_annotation(p, LWS_SIZE)
    {
        let size: u32 =
            size.parse().ok().filter(|n| (1..=100_000).contains(n)).ok_or_else(|| {
                unsupported(
                    &format!("metadata.annotations[{LWS_SIZE}]"),
                    &format!("{size:?} is not a number of pods from 1 to 100000"),
                )
            })?;
        let name = match (label_or_annotation(p, LWS_NAME), label_or_annotation(p, LWS_GROUP_INDEX))
        {
            (Some(n), Some(i)) => format!("{n}-{i}"),
            _ => group.clone(),
        };
        let index = label_or_annotation(p, LWS_WORKER_INDEX).and_then(|i| i.parse::<u32>().ok());
        if size > 1 {
            return Ok(Some(GangRef { key: format!("{ns}/{name}"), size, index }));
        }
    }
    if let Some(o) = job_owner(p)
        && let Some((completions, parallelism, indexed)) = job_shape(&o.uid)
        && indexed
        && completions == parallelism
        && completions > 1
    {
        return Ok(Some(GangRef {
            key: format!("{ns}/{}", o.name),
            size: completions as u32,
            index,
        }));
    }
    Ok(None)
}

/// Whether [`gang`] could find a gang for this pod (it names a PodGroup, a gang label, a
/// LeaderWorkerSet group, or a Job controls it): what a bound pod's record must keep of it.
pub fn may_be_gang(p: &Pod) -> bool {
    pod_group_name(p).is_some()
        || label_or_annotation(p, GANG_LABEL).is_some()
        || label_or_annotation(p, LWS_GROUP_KEY).is_some()
        || job_owner(p).is_some()
}

/// Whether a pod's required node affinity has `matchFields` (nodes then need their name as a
/// label, [`NODE_NAME`]).
pub fn has_match_fields(spec: &crate::pod::PodSpec) -> bool {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref())
        .is_some_and(|r| {
            r.node_selector_terms
                .iter()
                .any(|t| t.match_fields.as_ref().is_some_and(|f| !f.is_empty()))
        })
}

/// What a pending pod asks for, or the constraint that stops xpu from scheduling it.
pub fn pod(p: &Pod) -> Result<PodAsk, Unsupported> {
    let spec = p.spec.as_ref().ok_or_else(|| unsupported("spec", "missing"))?;
    let resources = resources(p)?;
    let mut task = TaskSpec::cpu(resources.cpu_milli, resources.memory_mib);
    if resources.share_milli > 0 {
        task.devices = DeviceAsk::Fraction(resources.share_milli);
        task.device_kind = Some(DeviceKind::Gpu);
    } else if resources.devices > 0 {
        task.devices = DeviceAsk::Whole(resources.devices);
        task.device_kind = DEVICE_RESOURCES
            .iter()
            .find(|(r, _)| Some(*r) == resources.device_resource)
            .map(|(_, k)| *k);
    }
    task.node_selector = spec.node_selector.clone().unwrap_or_default();
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| n.required_during_scheduling_ignored_during_execution.as_ref());
    if let Some(r) = required {
        for (ti, term) in r.node_selector_terms.iter().enumerate() {
            let path = format!(
                "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{ti}]"
            );
            let mut reqs = Vec::new();
            for (ri, f) in term.match_fields.iter().flatten().enumerate() {
                if f.key != "metadata.name" {
                    return Err(unsupported(
                        &format!("{path}.matchFields[{ri}].key"),
                        &format!("{:?}: the only node field is metadata.name", f.key),
                    ));
                }
                let operator = f.operator.parse::<Operator>().map_err(|why| {
                    unsupported(&format!("{path}.matchFields[{ri}].operator"), &why)
                })?;
                reqs.push(Requirement {
                    key: NODE_NAME.into(),
                    operator,
                    values: f.values.clone().unwrap_or_default(),
                });
            }
            for (ri, e) in term.match_expressions.iter().flatten().enumerate() {
                let operator = e.operator.parse::<Operator>().map_err(|why| {
                    unsupported(&format!("{path}.matchExpressions[{ri}].operator"), &why)
                })?;
                reqs.push(Requirement {
                    key: e.key.clone(),
                    operator,
                    values: e.values.clone().unwrap_or_default(),
                });
            }
            task.affinity.push(reqs);
        }
    }
    for (i, t) in spec.tolerations.iter().flatten().enumerate() {
        let effect = match t.effect.as_deref() {
            None | Some("") => None,
            Some(e) => Some(
                e.parse::<Effect>()
                    .map_err(|why| unsupported(&format!("spec.tolerations[{i}].effect"), &why))?,
            ),
        };
        task.tolerations.push(Toleration {
            key: t.key.clone().filter(|k| !k.is_empty()),
            exists: t.operator.as_deref() == Some("Exists"),
            value: t.value.clone().unwrap_or_default(),
            effect,
        });
    }
    let tpu = match (
        task.node_selector.get(GKE_TPU_ACCELERATOR),
        task.node_selector.get(GKE_TPU_TOPOLOGY),
    ) {
        (Some(a), Some(t)) if resources.device_resource == Some("google.com/tpu") => {
            Some((a.clone(), t.clone()))
        }
        _ => None,
    };
    // The namespace's own queue; the cycle puts the pod in the queue the admin's mapping
    // gives it ([`crate::queues`]), never where its own label alone says.
    let queue = crate::queues::own_queue(p.metadata.namespace.as_deref().unwrap_or("default"));
    Ok(PodAsk { task, resources, priority: spec.priority.unwrap_or(0), queue, tpu })
}

/// Whether a `LabelSelector` selects `labels` (an empty selector selects everything).
pub fn selects(
    sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    let by_labels = sel.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    let by_exprs = sel.match_expressions.iter().flatten().all(|r| {
        let values = r.values.as_deref().unwrap_or(&[]);
        match r.operator.as_str() {
            "In" => labels.get(&r.key).is_some_and(|v| values.contains(v)),
            "NotIn" => labels.get(&r.key).is_none_or(|v| !values.contains(v)),
            "Exists" => labels.contains_key(&r.key),
            "DoesNotExist" => !labels.contains_key(&r.key),
            _ => false,
        }
    });
    by_labels && by_exprs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_follow_the_api_grammar() {
        assert_eq!(quantity("500m", 1000.0), Some(500));
        assert_eq!(quantity("2", 1000.0), Some(2000));
        assert_eq!(quantity("1.5", 1000.0), Some(1500));
        assert_eq!(quantity("16Gi", 1.0), Some(16 << 30));
        assert_eq!(quantity("1e3", 1.0), Some(1000));
        assert_eq!(quantity("1G", 1.0), Some(1_000_000_000));
        assert_eq!(quantity("2E", 1.0), Some(2_000_000_000_000_000_000));
        assert_eq!(quantity("128974848", 1.0), Some(128_974_848));
        assert_eq!(quantity("1Zi", 1.0), None);
        assert_eq!(quantity("-1", 1.0), None);
        assert_eq!(quantity("abc", 1.0), None);
    }

    fn two_containers(res: &str, a: &str, b: &str) -> Pod {
        let c = |n: &str, q: &str| serde_json::json!({ "name": n, "resources": { "requests": { res: q }, "limits": { res: q } } });
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": "p", "namespace": "default", "uid": "u" },
            "spec": { "containers": [c("a", a), c("b", b)] }
        }))
        .unwrap()
    }

    /// Requests each valid alone that overflow 64 bits when summed are refused naming the
    /// field; they never wrap into a small request (2 CPUs) or into none (a CPU-only pod).
    #[test]
    fn sums_that_overflow_are_refused_not_wrapped() {
        let cpu = two_containers("cpu", "9223372036854775808m", "9223372036854777856m");
        let e = usage(&cpu).unwrap_err();
        assert_eq!(e.field, "spec.containers[1].resources");
        assert!(e.why.contains("cpu requests add up to more than xpu can count"), "{e}");
        assert!(pod(&cpu).is_err());
        let gpus = two_containers("nvidia.com/gpu", "9223372036854775808", "9223372036854775808");
        let e = pod(&gpus).unwrap_err();
        assert!(e.why.contains("nvidia.com/gpu requests add up"), "{e}");
        let mem = two_containers("memory", "8Ei", "8Ei");
        assert!(usage(&mem).unwrap_err().why.contains("memory"));
        // Large but countable: a request, not an error.
        let big = two_containers("cpu", "4611686018427387904m", "1");
        assert_eq!(usage(&big).unwrap().cpu_milli, 4_611_686_018_427_388_904);
    }

    fn share_pod(milli: &str, containers: usize) -> Pod {
        let c = serde_json::json!({ "name": "c", "resources": { "limits": { SHARE_RESOURCE: milli } } });
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": "p", "namespace": "default", "uid": "u" },
            "spec": { "containers": vec![c; containers] }
        }))
        .unwrap()
    }

    #[test]
    fn gpu_shares_are_a_fraction_of_one_gpu_or_whole_gpus() {
        let half = pod(&share_pod("500", 1)).unwrap();
        assert_eq!(half.task.devices, DeviceAsk::Fraction(500));
        assert_eq!(half.resources.share_milli, 500);
        let two = pod(&share_pod("2000", 1)).unwrap();
        assert_eq!(two.task.devices, DeviceAsk::Whole(2));
        let e = pod(&share_pod("1500", 1)).unwrap_err();
        assert!(e.why.contains("ask for 1000 or 2000"), "{e}");
        let e = pod(&share_pod("300", 2)).unwrap_err();
        assert!(e.why.contains("one container"), "{e}");
    }

    #[test]
    fn a_share_node_numbers_every_gpu_it_has() {
        let n: Node = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "n", "labels": { "nvidia.com/gpu.product": "A100" } },
            "status": { "capacity": { "cpu": "8", "memory": "8Gi", SHARE_RESOURCE: "4000" },
                        "allocatable": { "cpu": "8", "memory": "8Gi", SHARE_RESOURCE: "3000" } }
        }))
        .unwrap();
        let v = node(&n).unwrap();
        let ids: Vec<&str> = v.spec.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "xpu.dev/gpu-milli/0",
                "xpu.dev/gpu-milli/1",
                "xpu.dev/gpu-milli/2",
                "xpu.dev/gpu-milli/3"
            ]
        );
        assert!(v.spec.devices.iter().all(|d| d.model == "A100"));
    }
}
