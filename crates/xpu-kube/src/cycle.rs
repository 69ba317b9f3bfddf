//! One scheduling cycle, as a pure function: the API server's objects in, decisions out
//! (which pod binds to which node, why each other pod waits, which nodes are skipped). No I/O
//! and no clock: [`crate::scheduler`] feeds it the watch caches and carries the decisions out.
//!
//! The cycle makes [`xpu_sched::Scheduler`] state from the objects every time: nodes with what
//! every bound pod (of any scheduler, and the pods this scheduler bound but has not yet seen
//! bound, the *assumed* ones) already uses subtracted, then the pods waiting for this
//! scheduler, grouped into gangs, submitted in creation order. Pods are keyed by uid in one map,
//! so none is counted twice, and a restart needs nothing but the API server's state. What is
//! costly to make again and rarely changes is kept by the driver between cycles and checked
//! against the objects each time: converted objects ([`Memo`]), what bound pods hold
//! ([`crate::ledger`]) and the cluster itself ([`crate::base`]); with or without them a cycle
//! decides the same.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::node::Node;
use crate::pod::Pod;
use xpu_sched::policy::TaskMix;
use xpu_sched::request::{GKE_TPU_ACCELERATOR, GKE_TPU_TOPOLOGY};
use xpu_sched::{Cluster, Decision, Job, NodeStatus, Scheduler, SchedulerConfig, TaskGroup};

use crate::affinity;
use crate::convert::{self, GangRef, PodAsk, SHARE_RESOURCE};
use crate::flex::{self, ProvisioningRequest};
use crate::queues::{Amounts, Queues};
use crate::share;

/// Internal node label (never a real one: `~` is not allowed in label keys) saying which device
/// resource a node offers, so that when a cluster offers GPUs both whole (`nvidia.com/gpu`)
/// and as shares, a pod only lands on the kind of GPU it asked for.
pub(crate) const OFFERS: &str = "xpu.dev~offers/";

use crate::convert::NODE_NAME;

/// A pod by name and uid.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodKey {
    pub fn of(p: &Pod) -> Option<Self> {
        Some(Self {
            namespace: p.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            name: p.metadata.name.clone()?,
            uid: p.metadata.uid.clone()?,
        })
    }
}

impl std::fmt::Display for PodKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A pod to bind, and where.
#[derive(Debug, Clone, PartialEq)]
pub struct Bind {
    pub pod: PodKey,
    pub node: String,
    /// The gang it starts with (all its members are in the same plan).
    pub gang: Option<String>,
    /// For a [`SHARE_RESOURCE`] pod: the GPU indices chosen on the node, and what it asks.
    pub share: Option<(Vec<u16>, u64)>,
    /// The pod's ResourceClaims to write before it binds: allocated in this cycle, or
    /// allocated before and to be reserved for it.
    pub claims: Vec<ClaimWrite>,
}

/// A claim allocation to take back: the claim's identity and the pod that may hold it (the
/// allocation is taken back only while nobody else does).
#[derive(Debug, Clone, PartialEq)]
pub struct Deallocate {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub pod_uid: String,
    pub why: String,
}

/// A ResourceClaim to allocate and reserve for a pod before binding it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimWrite {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// `status.allocation` to write, when allocated in this cycle; `None`: allocated already,
    /// only reserved for the pod.
    pub allocation: Option<serde_json::Value>,
    /// The devices, for the scheduler's books until the watch shows the allocation.
    pub devices: Option<xpu_sched::dra::Allocation>,
    /// A claim the scheduler makes for the pod's extended resources backed by DRA: created,
    /// then allocated and reserved like the others.
    pub create: Option<Arc<ExtendedClaim>>,
    /// The claim as the watch cache holds it: written on its `resourceVersion` without reading
    /// it again (a conflict reads it and tries once more).
    pub cached: Option<Arc<k8s_openapi::api::resource::v1::ResourceClaim>>,
}

/// The special ResourceClaim kube-scheduler makes for a pod's plain extended-resource requests
/// that a DeviceClass's `extendedResourceName` (or the implicit
/// `deviceclass.resource.kubernetes.io/<class>`) serves from DRA devices: one request per
/// container and resource (`container-<i>-request-<n>`), owned by the pod, marked by
/// [`EXTENDED_CLAIM`], and named in the pod's `status.extendedResourceClaimStatus`.
#[derive(Debug, Clone, PartialEq)]
pub struct ExtendedClaim {
    /// The ResourceClaim to create (metadata with `generateName`, owner and finalizer; spec).
    pub object: serde_json::Value,
    /// `status.extendedResourceClaimStatus.requestMappings` for the pod.
    pub mappings: serde_json::Value,
}

/// The annotation marking a pod's extended-resource claim.
pub const EXTENDED_CLAIM: &str = "resource.kubernetes.io/extended-resource-claim";
/// The implicit extended resource name of every DeviceClass: this prefix and the class name.
pub const IMPLICIT_EXTENDED: &str = "deviceclass.resource.kubernetes.io/";
/// Uids of claims still to create are this and the pod's uid.
pub const EXTENDED_UID: &str = "extended:";

/// ResourceSlices by the node they serve: a node's own slices, and those that serve several
/// nodes (a node selector, all nodes, per-device placement), so that a node's allocation reads
/// only its own and the shared ones.
#[derive(Default)]
pub struct SliceIndex<'a> {
    by_node: HashMap<&'a str, Vec<&'a xpu_sched::dra::Slice>>,
    shared: Vec<&'a xpu_sched::dra::Slice>,
}

impl<'a> SliceIndex<'a> {
    pub fn new(slices: impl IntoIterator<Item = &'a xpu_sched::dra::Slice>) -> Self {
        let mut out = Self::default();
        for s in slices {
            match &s.scope {
                xpu_sched::dra::NodeScope::Node(n)
                    if s.devices.iter().all(|d| d.scope.is_none()) =>
                {
                    out.by_node.entry(n.as_str()).or_default().push(s);
                }
                _ => out.shared.push(s),
            }
        }
        out
    }

    fn for_node(&self, node: &str) -> Vec<&'a xpu_sched::dra::Slice> {
        let own = self.by_node.get(node).map(Vec::as_slice).unwrap_or_default();
        self.shared.iter().chain(own).copied().collect()
    }
}

/// What the cycle knows of Dynamic Resource Allocation.
#[derive(Clone, Copy)]
pub struct Dra<'a> {
    pub slices: &'a SliceIndex<'a>,
    pub classes: &'a HashMap<String, xpu_sched::dra::Class>,
    /// DeviceClass objects (their `config` goes into allocations).
    pub class_objects: &'a HashMap<String, k8s_openapi::api::resource::v1::DeviceClass>,
    /// ResourceClaims by (namespace, name).
    pub claims: &'a HashMap<(String, String), Arc<k8s_openapi::api::resource::v1::ResourceClaim>>,
    pub compiled: &'a crate::claims::Compiled,
    /// Devices allocated in the cluster (and by this scheduler, not yet seen by the watch).
    pub in_use: &'a xpu_sched::dra::InUse,
    /// Claims (by uid) this scheduler allocated whose write the watch has not shown yet.
    pub in_flight: &'a std::collections::HashSet<String>,
    /// Extended resources DRA devices serve, with the class serving each
    /// ([`extended_resources`]).
    pub extended: &'a HashMap<String, String>,
}

/// The extended resource names DeviceClasses serve from DRA devices (each class's
/// `extendedResourceName` and its implicit [`IMPLICIT_EXTENDED`] name), with the class, leaving
/// out those a node advertises in its allocatable (a device plugin serves them there). Once per
/// cycle.
pub fn extended_resources(
    nodes: &[Arc<Node>],
    classes: &HashMap<String, k8s_openapi::api::resource::v1::DeviceClass>,
) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for (name, c) in classes {
        out.insert(format!("{IMPLICIT_EXTENDED}{name}"), name.clone());
        if let Some(r) = c.spec.as_ref().and_then(|s| s.extended_resource_name.as_deref()) {
            out.insert(r.to_owned(), name.clone());
        }
    }
    for n in nodes {
        if let Some(a) = n.status.as_ref().and_then(|s| s.allocatable.as_ref()) {
            out.retain(|r, _| !a.contains_key(r));
        }
    }
    out
}

/// What one cycle decided.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Plan {
    /// Gang members are adjacent.
    pub binds: Vec<Bind>,
    /// Pods that stay pending, with the reason (only those `explain` asked for).
    pub waiting: Vec<(PodKey, String)>,
    /// Nodes left out of scheduling, with the field that is wrong.
    pub bad_nodes: Vec<(String, String)>,
    /// Pods waiting for this scheduler when the cycle began.
    pub pending: usize,
    /// Lower-priority pods to evict, and where the pods they make room for go.
    pub preemptions: Vec<crate::preempt::Preemption>,
    /// Flex-start capacity to ask for: one ProvisioningRequest per gang that does not fit.
    pub provisions: Vec<flex::Provision>,
    /// An invariant of xpu-sched broke while planning (a bug): the last one, to log.
    pub broken_invariant: Option<String>,
    /// Bound pods whose requests xpu cannot read, each counted as using its whole node, with
    /// the warning to give.
    pub unreadable: Vec<(PodKey, String)>,
    /// Claims whose binding failed (a failure condition, or the timeout): their allocation is
    /// to be taken back, so the next cycle allocates them again.
    pub deallocate: Vec<Deallocate>,
    /// Units keep what they submitted (set while planning when preemption is on).
    preemption_on: bool,
}

/// The inputs of a cycle.
#[derive(Clone)]
pub struct Snapshot<'a> {
    /// Pods with this `spec.schedulerName` are ours.
    pub scheduler_name: &'a str,
    pub nodes: &'a [Arc<Node>],
    pub pods: &'a [Arc<Pod>],
    /// The pods of `pods` whose `spec.nodeName` is empty (waiting or assumed), when the driver
    /// has them from a pass of its own: a cycle's passes over the pods that skip those the
    /// watch shows bound (waiting pods, and with a ledger what bound pods hold) read only
    /// these, so they cost what waits, not what runs. `None`: they filter `pods`.
    pub unbound: Option<&'a [Arc<Pod>]>,
    /// Job uid → (completions, parallelism, Indexed).
    pub jobs: &'a HashMap<String, (i32, i32, bool)>,
    /// Pods this scheduler bound whose binding the watch has not shown yet: uid → node.
    pub assumed: &'a HashMap<String, String>,
    /// The GPUs chosen for assumed [`SHARE_RESOURCE`] pods: uid → indices.
    pub assumed_gpus: &'a HashMap<String, Vec<u16>>,
    /// Whether GPU shares can be placed (the scheduler has the key to sign its choices).
    pub shares: bool,
    /// Evict lower-priority pods for a pod that fits no other way.
    pub preemption: bool,
    /// Pods not to evict (a PodDisruptionBudget refused them lately), by uid.
    pub excluded: &'a std::collections::HashSet<String>,
    /// The wall clock, Unix seconds (how long victims have run).
    pub unix_now: i64,
    /// Bound pods to leave out of what nodes hold (preemption's what-if), by uid.
    pub hold_out: Option<&'a std::collections::HashSet<&'a str>>,
    /// The cluster's ProvisioningRequests; `None` when it does not serve the API (flex-start
    /// pods are then placed on the nodes there are, and told no capacity is asked for).
    pub provisioning: Option<&'a [Arc<ProvisioningRequest>]>,
    /// Seconds before asking again after a request ended: first wait, and the most.
    pub provisioning_backoff: (u64, u64),
    /// The admin's mapping of namespaces to queues, with quotas.
    pub queues: &'a Queues,
    /// Namespace labels by name (queues may select namespaces by label).
    pub namespace_labels: &'a HashMap<String, BTreeMap<String, String>>,
    /// Dynamic Resource Allocation: slices, classes, claims. `None`: pods with claims wait.
    pub dra: Option<Dra<'a>>,
    /// PodGroups (`scheduling.k8s.io/v1beta1`); `None` when the cluster does not serve them.
    pub pod_groups: Option<&'a convert::PodGroups>,
    /// What earlier cycles converted, kept by the driver ([`Memo`]); `None`: convert all.
    pub memo: Option<&'a Memo>,
    /// What bound pods hold, kept from the pod watch's events ([`crate::ledger`]); `None`:
    /// summed from `pods`. Not read for a what-if (`hold_out`).
    pub ledger: Option<&'a crate::ledger::Ledger>,
}

/// What a cycle converts from objects that rarely change, kept across cycles by the driver: a
/// node's view and a bound pod's usage, keyed by the node's name or the pod's uid with the
/// object's `resourceVersion` (the API server changes it on every write), so that a cycle
/// parses only the objects written since the one before. An object without a
/// `resourceVersion` is converted every time. [`Memo::sweep`], once per cycle, drops the
/// entries of objects the cycle did not see (deleted, ended). A cycle decides the same with a
/// memo as without (`cycle::tests::a_memo_changes_no_decision_over_random_events`).
#[derive(Debug, Default)]
pub struct Memo {
    inner: std::sync::Mutex<MemoInner>,
}

type NodeEntry = (String, u64, Arc<Result<convert::NodeView, String>>);
type UsageEntry = (String, u64, Arc<Result<convert::Usage, convert::Unsupported>>);
type AskEntry = (String, u64, Arc<Result<PodAsk, convert::Unsupported>>);

#[derive(Debug, Default)]
struct MemoInner {
    /// The cycle count; an entry records the last cycle that looked it up.
    cycle: u64,
    nodes: HashMap<String, NodeEntry>,
    pods: HashMap<String, UsageEntry>,
    /// Bound pods of this scheduler as tasks, for the task mix FGD and xpu measure against.
    asks: HashMap<String, AskEntry>,
    converted: u64,
    /// The cluster the last cycle built, for the next to patch.
    base: Option<crate::base::Base>,
    built: crate::base::BuildStats,
    /// The inter-pod index of the placed pods (see [`crate::placed`]).
    placed: crate::placed::Kept,
}

impl Memo {
    /// Ends a cycle: forgets what it did not look up.
    pub fn sweep(&self) {
        let mut m = self.lock();
        let c = m.cycle;
        m.nodes.retain(|_, e| e.1 == c);
        m.pods.retain(|_, e| e.1 == c);
        m.asks.retain(|_, e| e.1 == c);
        m.cycle += 1;
    }

    /// Entries held: (nodes, pods); and objects converted since the memo was made.
    pub fn stats(&self) -> (usize, usize, u64) {
        let m = self.lock();
        (m.nodes.len(), m.pods.len(), m.converted)
    }

    /// How the cycles' clusters were built since the memo was made (see [`crate::base`]).
    pub fn build_stats(&self) -> crate::base::BuildStats {
        self.lock().built
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoInner> {
        // The memo holds only derived values: one a panicking cycle left half-written is still
        // a correct conversion of the object it is keyed by.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl MemoInner {
    fn node(&mut self, n: &Node) -> Arc<Result<convert::NodeView, String>> {
        let (name, version) = (n.metadata.name.as_deref(), n.metadata.resource_version.as_deref());
        memoized(&mut self.nodes, self.cycle, &mut self.converted, name, version, || {
            convert::node(n)
        })
    }

    fn ask(&mut self, p: &Pod) -> Arc<Result<PodAsk, convert::Unsupported>> {
        let (uid, version) = (p.metadata.uid.as_deref(), p.metadata.resource_version.as_deref());
        memoized(&mut self.asks, self.cycle, &mut self.converted, uid, version, || convert::pod(p))
    }

    fn usage(&mut self, p: &Pod) -> Arc<Result<convert::Usage, convert::Unsupported>> {
        let (uid, version) = (p.metadata.uid.as_deref(), p.metadata.resource_version.as_deref());
        memoized(&mut self.pods, self.cycle, &mut self.converted, uid, version, || {
            convert::usage(p)
        })
    }
}

/// One pass's hold on the memo, or none: without a memo every object is converted.
struct Held<'m>(Option<std::sync::MutexGuard<'m, MemoInner>>);

impl Held<'_> {
    fn of<'m>(snap: &Snapshot<'m>) -> Held<'m> {
        Held(snap.memo.map(Memo::lock))
    }

    fn node(&mut self, n: &Node) -> Arc<Result<convert::NodeView, String>> {
        self.0.as_deref_mut().map_or_else(|| Arc::new(convert::node(n)), |m| m.node(n))
    }

    fn ask(&mut self, p: &Pod) -> Arc<Result<PodAsk, convert::Unsupported>> {
        self.0.as_deref_mut().map_or_else(|| Arc::new(convert::pod(p)), |m| m.ask(p))
    }

    fn usage(&mut self, p: &Pod) -> Arc<Result<convert::Usage, convert::Unsupported>> {
        self.0.as_deref_mut().map_or_else(|| Arc::new(convert::usage(p)), |m| m.usage(p))
    }

    /// The cluster an earlier cycle built and gave back, taken for this one.
    fn take_base(&mut self) -> Option<crate::base::Base> {
        self.0.as_deref_mut()?.base.take()
    }

    fn stats(&mut self) -> Option<&mut crate::base::BuildStats> {
        self.0.as_deref_mut().map(|m| &mut m.built)
    }

    fn put_base(&mut self, base: crate::base::Base) {
        if let Some(m) = self.0.as_deref_mut() {
            m.base = Some(base);
        }
    }
}

impl Memo {
    /// Runs `f` on the kept cluster, if one is kept (see [`crate::base`]).
    pub(crate) fn with_base<T>(&self, f: impl FnOnce(&mut crate::base::Base) -> T) -> Option<T> {
        self.lock().base.as_mut().map(f)
    }

    /// Forgets the kept cluster: the next cycle builds it whole.
    pub(crate) fn drop_base(&self) {
        self.lock().base = None;
    }
}

/// The entry of `key` at `version` in `map`, marked seen in `cycle`; converted by `make` (and
/// counted) when missing or of another version. Without a key or version, converted each time.
fn memoized<T>(
    map: &mut HashMap<String, (String, u64, Arc<T>)>,
    cycle: u64,
    converted: &mut u64,
    key: Option<&str>,
    version: Option<&str>,
    make: impl FnOnce() -> T,
) -> Arc<T> {
    let (Some(key), Some(version)) = (key, version) else { return Arc::new(make()) };
    if let Some(e) = map.get_mut(key).filter(|e| e.0 == version) {
        e.1 = cycle;
        return e.2.clone();
    }
    *converted += 1;
    let v = Arc::new(make());
    map.insert(key.to_owned(), (version.to_owned(), cycle, v.clone()));
    v
}

impl<'a> Snapshot<'a> {
    /// A snapshot with every option at its default: no shares, no preemption.
    pub fn new(
        scheduler_name: &'a str,
        nodes: &'a [Arc<Node>],
        pods: &'a [Arc<Pod>],
        jobs: &'a HashMap<String, (i32, i32, bool)>,
        assumed: &'a HashMap<String, String>,
    ) -> Self {
        static NO_GPUS: std::sync::LazyLock<HashMap<String, Vec<u16>>> =
            std::sync::LazyLock::new(HashMap::new);
        static NONE: std::sync::LazyLock<std::collections::HashSet<String>> =
            std::sync::LazyLock::new(Default::default);
        static NO_QUEUES: std::sync::LazyLock<Queues> = std::sync::LazyLock::new(Queues::default);
        static NO_LABELS: std::sync::LazyLock<HashMap<String, BTreeMap<String, String>>> =
            std::sync::LazyLock::new(HashMap::new);
        Self {
            scheduler_name,
            nodes,
            pods,
            unbound: None,
            jobs,
            assumed,
            assumed_gpus: &NO_GPUS,
            shares: false,
            preemption: false,
            excluded: &NONE,
            unix_now: 0,
            hold_out: None,
            provisioning: None,
            provisioning_backoff: (30, 900),
            queues: &NO_QUEUES,
            namespace_labels: &NO_LABELS,
            dra: None,
            pod_groups: None,
            memo: None,
            ledger: None,
        }
    }

    /// The pods that may be waiting or assumed: [`Self::unbound`] when given, else every pod.
    /// Callers still filter; this only leaves out pods the watch shows bound.
    pub(crate) fn maybe_unbound(&self) -> &'a [Arc<Pod>] {
        self.unbound.unwrap_or(self.pods)
    }
}

pub(crate) fn terminal(p: &Pod) -> bool {
    matches!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

/// The node a pod is on, from the object or from what this scheduler assumed.
pub(crate) fn bound_node<'a>(p: &'a Pod, assumed: &'a HashMap<String, String>) -> Option<&'a str> {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
        .or_else(|| p.metadata.uid.as_ref().and_then(|u| assumed.get(u)).map(String::as_str))
}

/// Whether the pod waits for the scheduler named `name`.
pub fn waits_for(p: &Pod, name: &str, assumed: &HashMap<String, String>) -> bool {
    let Some(spec) = p.spec.as_ref() else { return false };
    // Most pods of a large cluster are bound: that is looked at first.
    spec.node_name.as_deref().is_none_or(str::is_empty)
        && spec.scheduler_name.as_deref().unwrap_or("default-scheduler") == name
        && bound_node(p, assumed).is_none()
        && !terminal(p)
        && p.metadata.deletion_timestamp.is_none()
        && spec.scheduling_gates.as_ref().is_none_or(Vec::is_empty)
}

/// What the pods bound to a node use.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Used {
    pub(crate) cpu: u64,
    pub(crate) mem: u64,
    pub(crate) pods: u64,
    pub(crate) dev: BTreeMap<&'static str, u64>,
    /// [`SHARE_RESOURCE`] pods by uid: what each asks and the GPUs recorded for it.
    pub(crate) shares: BTreeMap<String, (u64, Option<Vec<u16>>)>,
    /// A pod on the node whose requests xpu cannot read: the node counts as full.
    pub(crate) unreadable: bool,
}

impl Used {
    /// Adds what another count holds (pods the ledger does not count, to its sums).
    pub(crate) fn merge(&mut self, o: &Used) {
        self.cpu = self.cpu.saturating_add(o.cpu);
        self.mem = self.mem.saturating_add(o.mem);
        self.pods += o.pods;
        for (&res, &n) in &o.dev {
            let e = self.dev.entry(res).or_default();
            *e = e.saturating_add(n);
        }
        for (uid, v) in &o.shares {
            self.shares.insert(uid.clone(), v.clone());
        }
        self.unreadable |= o.unreadable;
    }

    /// Adds what a pod holds, its `usage` (a GPU share on `gpus`, when recorded). A pod whose
    /// requests do not parse or overflow when summed is counted as holding the whole node,
    /// never as nothing: `Err` says why, for a warning.
    pub(crate) fn add(
        &mut self,
        uid: &str,
        usage: &Result<convert::Usage, convert::Unsupported>,
        gpus: Option<Vec<u16>>,
    ) -> Result<(), convert::Unsupported> {
        self.pods += 1;
        let r = match usage {
            Ok(r) => r,
            Err(e) => {
                self.unreadable = true;
                return Err(e.clone());
            }
        };
        self.cpu = self.cpu.saturating_add(r.cpu_milli);
        self.mem = self.mem.saturating_add(r.memory_mib);
        for (&res, &n) in &r.devices {
            if res == SHARE_RESOURCE {
                self.shares.insert(uid.to_owned(), (n, gpus.clone()));
            } else {
                let e = self.dev.entry(res).or_default();
                *e = e.saturating_add(n);
            }
        }
        Ok(())
    }
}

/// Keeps a pod to nodes offering the device resource it asks for (see [`OFFERS`]).
fn keep_to_offer(ask: &mut PodAsk) {
    keep_task_to_offer(&mut ask.task, ask.resources.device_resource);
}

/// Keeps a task asking for `resource` to nodes offering it.
fn keep_task_to_offer(task: &mut xpu_sched::TaskSpec, resource: Option<&'static str>) {
    if let Some(res) = resource {
        task.node_selector.insert(format!("{OFFERS}{res}"), "true".into());
    }
}

/// Pending members of one gang: (completion index, pod, ask).
type Members = Vec<(u32, PodKey, PodAsk)>;

/// A unit submitted to xpu-sched: one pod, or the pending members of a gang.
struct Unit {
    pods: Vec<PodKey>,
    gang: Option<String>,
    job: Option<u32>,
    /// The extended resource its pods ask for, for messages.
    resource: Option<&'static str>,
    /// What each pod asks of [`SHARE_RESOURCE`] (0: not a share pod).
    share_ask: u64,
    /// What was submitted, for preemption's what-if (only when preemption is on).
    spec: Option<Job>,
    /// Flex-start: the request to make if it does not start, and what to add to its message.
    flex: Option<flex::Provision>,
    note: String,
    /// Its queue, and what its pods hold together once bound (for the queue's quota).
    queue: String,
    amounts: Amounts,
    /// Where each task group's pods start in `pods` (groups are in job order).
    offsets: Vec<usize>,
}

impl Unit {
    /// The pod task `t` of the unit's job stands for.
    fn pod(&self, t: xpu_sched::TaskRef) -> Option<&PodKey> {
        let at = self.offsets.get(t.group as usize).copied().unwrap_or(0);
        self.pods.get(at + t.index as usize)
    }
}

/// A pending pod's ResourceClaims.
#[derive(Clone)]
struct PodClaims {
    /// Allocated already: reserved for the pod when it binds.
    allocated: Vec<Arc<k8s_openapi::api::resource::v1::ResourceClaim>>,
    /// To allocate on the node the pod is placed on.
    pending: Vec<(Arc<k8s_openapi::api::resource::v1::ResourceClaim>, xpu_sched::dra::Claim)>,
    /// The claim to make for the pod's extended resources backed by DRA (its stand-in is the
    /// last of `pending`).
    extended: Option<Arc<ExtendedClaim>>,
}

/// The pod's plain extended-resource requests that DeviceClasses serve from DRA devices, as
/// kube-scheduler does: only resources no node advertises in its allocatable (a device
/// plugin's), one request per container and resource. Returns the stand-in claim (uid
/// [`EXTENDED_UID`] + the pod's), what to create, and the resources it serves.
fn extended_claim(
    dra: &Dra<'_>,
    p: &Pod,
) -> Option<(Arc<k8s_openapi::api::resource::v1::ResourceClaim>, Arc<ExtendedClaim>, Vec<String>)> {
    if dra.extended.is_empty() {
        return None;
    }
    let spec = p.spec.as_ref()?;
    let mut requests = Vec::new();
    let mut mappings = Vec::new();
    let mut served = Vec::new();
    for (i, c) in spec.containers.iter().enumerate() {
        let mut n = 0;
        for (res, q) in container_asks(c) {
            let Some(class) = dra.extended.get(res.as_str()) else { continue };
            let count: u64 = q.0.parse().ok()?;
            if count == 0 {
                continue;
            }
            let name = format!("container-{i}-request-{n}");
            n += 1;
            requests.push(serde_json::json!({ "name": name,
                "exactly": { "deviceClassName": class, "allocationMode": "ExactCount", "count": count } }));
            mappings.push(serde_json::json!({ "containerName": c.name, "requestName": name, "resourceName": res }));
            if !served.contains(res) {
                served.push(res.clone());
            }
        }
    }
    if requests.is_empty() {
        return None;
    }
    let ns = p.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let pod = p.metadata.name.clone()?;
    let uid = p.metadata.uid.clone()?;
    let object = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "generateName": format!("{pod}-extended-resources-"), "namespace": ns,
            "annotations": { EXTENDED_CLAIM: "true" },
            "finalizers": [crate::scheduler::CLAIM_FINALIZER],
            "ownerReferences": [{ "apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid, "controller": true }] },
        "spec": { "devices": { "requests": requests } },
    });
    let mut standin: k8s_openapi::api::resource::v1::ResourceClaim =
        serde_json::from_value(object.clone()).ok()?;
    standin.metadata.uid = Some(format!("{EXTENDED_UID}{uid}"));
    standin.metadata.finalizers = None;
    let ext = ExtendedClaim { object, mappings: serde_json::Value::Array(mappings) };
    Some((Arc::new(standin), Arc::new(ext), served))
}

/// What a container asks for, limits first, then requests (a request wins for a name in both).
fn container_asks(
    c: &crate::pod::Container,
) -> BTreeMap<&String, &k8s_openapi::apimachinery::pkg::api::resource::Quantity> {
    let r = c.resources.as_ref();
    r.and_then(|r| r.limits.as_ref())
        .into_iter()
        .flatten()
        .chain(r.and_then(|r| r.requests.as_ref()).into_iter().flatten())
        .collect()
}

/// The resources [`extended_claim`] would serve for `p`, without building its claim (a cycle
/// asks this of every waiting pod, more than once): `None` when it would make none.
fn extended_served(dra: &Dra<'_>, p: &Pod) -> Option<Vec<String>> {
    if dra.extended.is_empty() {
        return None;
    }
    let spec = p.spec.as_ref()?;
    let mut served: Vec<String> = Vec::new();
    for c in &spec.containers {
        for (res, q) in container_asks(c) {
            if !dra.extended.contains_key(res.as_str()) {
                continue;
            }
            let count: u64 = q.0.parse().ok()?;
            if count > 0 && !served.contains(res) {
                served.push(res.clone());
            }
        }
    }
    p.metadata.name.as_ref()?;
    p.metadata.uid.as_ref()?;
    (!served.is_empty()).then_some(served)
}

/// The nodes a pod's claims fit (each with the devices it would have left free), and the claims.
type Fits = (Vec<(String, usize)>, PodClaims);

/// Devices one pod's claims may try over all nodes in one cycle (each node's search is bounded
/// on its own too), so that a tenant's costly claims cost a cycle a bounded time.
const POD_DRA_STEPS: u64 = 500_000;

/// The most pods one ResourceClaim may be reserved for (the API's limit).
const MAX_RESERVED: usize = 256;

/// A pending pod's claims and the nodes they can be allocated on, or why the pod waits.
/// `Ok(None)`: the pod has no claims.
/// The nodes found for claims of one shape in this cycle: the pending claims' specs (and the
/// nodes left out) → the nodes they fit with the devices each would keep free. Pods made from
/// one template (or asking one extended resource alike) ask the same, and the cluster's
/// allocations are the same for all of them until the cycle places one, so each shape is
/// searched on every node once, not once per pod.
type ShapeFits = HashMap<(Vec<String>, Option<Vec<String>>), Vec<(String, usize)>>;

fn dra_nodes(
    snap: &Snapshot<'_>,
    p: &Pod,
    excluded: Option<&Vec<String>>,
    shapes: &mut ShapeFits,
    releases: &mut Vec<Deallocate>,
) -> Result<Option<Fits>, String> {
    let names = crate::claims::pod_claims(p)?;
    let extended = snap.dra.as_ref().and_then(|d| extended_claim(d, p));
    if names.is_empty() && extended.is_none() {
        return Ok(None);
    }
    let Some(dra) = snap.dra else {
        return Err(
            "spec.resourceClaims: this scheduler does not see the resource.k8s.io/v1 API".into()
        );
    };
    let ns = p.metadata.namespace.as_deref().unwrap_or("default");
    let uid = p.metadata.uid.as_deref().unwrap_or("");
    let mut claims = PodClaims { allocated: Vec::new(), pending: Vec::new(), extended: None };
    let mut nodes: Vec<(&str, &BTreeMap<String, String>)> = Vec::new();
    static NO_LABELS: std::sync::LazyLock<BTreeMap<String, String>> =
        std::sync::LazyLock::new(BTreeMap::new);
    // The pod's own node constraints first, as kube-scheduler filters node affinity and taints
    // before DRA: a node the pod may not go to is never the one its claims are kept to.
    let own = convert::pod(p).ok().map(|a| a.task);
    let admits = |n: &Node, name: &str, labels: &BTreeMap<String, String>| {
        let Some(t) = &own else { return true };
        if !t.node_selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            return false;
        }
        if !t.affinity.is_empty() {
            let mut with_name = labels.clone();
            with_name.insert(NODE_NAME.into(), name.to_owned());
            if !xpu_sched::constraints::affinity_matches(&t.affinity, &with_name) {
                return false;
            }
        }
        let taints: Vec<xpu_sched::constraints::Taint> = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|x| {
                Some(xpu_sched::constraints::Taint {
                    key: x.key.clone(),
                    value: x.value.clone().unwrap_or_default(),
                    effect: x.effect.parse().ok()?,
                })
            })
            .collect();
        xpu_sched::constraints::tolerated(&taints, &t.tolerations)
    };
    for n in snap.nodes {
        if let Some(name) = n.metadata.name.as_deref()
            && !excluded.is_some_and(|x| x.iter().any(|e| e == name))
        {
            let labels = n.metadata.labels.as_ref().unwrap_or(&NO_LABELS);
            if admits(n, name, labels) {
                nodes.push((name, labels));
            }
        }
    }
    for name in names {
        let Some(c) = dra.claims.get(&(ns.to_owned(), name.clone())) else {
            return Err(format!("waiting for ResourceClaim {ns}/{name}: it does not exist"));
        };
        if c.metadata.deletion_timestamp.is_some() {
            return Err(format!("ResourceClaim {ns}/{name} is being deleted"));
        }
        let status = c.status.as_ref();
        let reserved = status.and_then(|s| s.reserved_for.as_ref());
        match status.and_then(|s| s.allocation.as_ref()) {
            Some(a) => {
                let mine = reserved.is_some_and(|r| r.iter().any(|r| r.uid == uid));
                if !mine && reserved.is_some_and(|r| r.len() >= MAX_RESERVED) {
                    return Err(format!(
                        "ResourceClaim {ns}/{name} is reserved for {MAX_RESERVED} pods already, the most it may be"
                    ));
                }
                // A device waiting for its driver (binding conditions) holds the pod back; one
                // whose binding failed is taken back and allocated again.
                match crate::claims::binding_state(c, snap.unix_now) {
                    crate::claims::Binding::Ready => {}
                    crate::claims::Binding::Waiting(why) => {
                        return Err(format!("ResourceClaim {ns}/{name}: {why}"));
                    }
                    crate::claims::Binding::Failed(why) => {
                        let others = reserved.is_some_and(|r| r.iter().any(|r| r.uid != uid));
                        if !others {
                            releases.push(Deallocate {
                                namespace: ns.to_owned(),
                                name: name.clone(),
                                uid: c.metadata.uid.clone().unwrap_or_default(),
                                pod_uid: uid.to_owned(),
                                why: why.clone(),
                            });
                        }
                        return Err(format!(
                            "ResourceClaim {ns}/{name}: {why}; its allocation is taken back to be made again"
                        ));
                    }
                }
                // The pod goes where the claim's devices are.
                if let Some(sel) = &a.node_selector {
                    let terms = crate::claims::node_terms(sel).map_err(|e| {
                        format!("ResourceClaim {ns}/{name}: status.allocation.nodeSelector: {e}")
                    })?;
                    nodes.retain(|(n, l)| terms.iter().any(|t| t.matches(n, l)));
                }
                claims.allocated.push(c.clone());
            }
            None if c.metadata.uid.as_ref().is_some_and(|u| dra.in_flight.contains(u)) => {
                return Err(format!(
                    "waiting for ResourceClaim {ns}/{name}: its allocation for another pod is being written"
                ));
            }
            None => {
                let claim = crate::claims::claim(c, dra.compiled)?;
                claims.pending.push((c.clone(), claim));
            }
        }
    }
    if let Some((standin, ext, _)) = extended {
        let claim = crate::claims::claim(&standin, dra.compiled)?;
        claims.pending.push((standin, claim));
        claims.extended = Some(ext);
    }
    if claims.pending.is_empty() {
        let names: Vec<(String, usize)> = nodes.iter().map(|(n, _)| ((*n).to_owned(), 0)).collect();
        if names.is_empty() {
            return Err("its allocated ResourceClaims are on no node that exists".into());
        }
        return Ok(Some((names, claims)));
    }
    // Claims already allocated narrow the nodes: a pod with none shares its shape with the
    // pods whose pending claims (an extended-resource claim's stand-in among them) ask the same.
    let shape = claims
        .allocated
        .is_empty()
        .then(|| {
            let mut specs: Vec<String> = claims
                .pending
                .iter()
                .map(|(c, _)| serde_json::to_string(&c.spec).ok())
                .collect::<Option<_>>()?;
            // The nodes also depend on where the pod itself may go.
            if let Some(t) = &own {
                specs.push(format!("{:?}|{:?}|{:?}", t.node_selector, t.affinity, t.tolerations));
            }
            Some((specs, excluded.cloned()))
        })
        .flatten();
    if let Some(found) = shape.as_ref().and_then(|k| shapes.get(k)) {
        return Ok(Some((found.clone(), claims)));
    }
    let wanted: Vec<xpu_sched::dra::Claim> =
        claims.pending.iter().map(|(_, c)| c.clone()).collect();
    let mut feasible = Vec::new();
    // Why nodes fail, with how many fail so and the first of them.
    let mut reasons: BTreeMap<String, (usize, &str)> = BTreeMap::new();
    // A pod's claims are tried on every node, each search bounded; so is the whole.
    let mut spent = 0u64;
    let per_node = xpu_sched::dra::Limits::default();
    for (tried, (node, labels)) in nodes.iter().enumerate() {
        if spent >= POD_DRA_STEPS {
            let msg = format!(
                "gave up after trying {spent} devices on {tried} of the {} nodes; the claims' requests and constraints are too costly to search",
                nodes.len()
            );
            reasons.insert(msg, (nodes.len() - tried, node));
            break;
        }
        let limits =
            xpu_sched::dra::Limits { steps: per_node.steps.min(POD_DRA_STEPS - spent), ..per_node };
        let got = xpu_sched::dra::allocate_counted(
            &wanted,
            dra.classes,
            &dra.slices.for_node(node),
            dra.in_use,
            node,
            labels,
            limits,
            &mut spent,
        );
        match got {
            Ok(allocs) => {
                // Devices the node would have left free after this pod's claims.
                let taken: usize = allocs.iter().map(|a| a.devices.len()).sum();
                let free = free_devices(&dra, node, labels).saturating_sub(taken);
                feasible.push(((*node).to_owned(), free));
            }
            // A failing selector or a missing class fails the same on every node.
            Err(
                e
                @ (xpu_sched::dra::Unfit::Selector { .. } | xpu_sched::dra::Unfit::NoClass { .. }),
            ) => return Err(e.to_string()),
            Err(e) => reasons.entry(e.to_string()).or_insert((0, node)).0 += 1,
        }
    }
    if feasible.is_empty() {
        let mut said: Vec<(usize, String)> = reasons
            .into_iter()
            .map(|(why, (n, first))| (n, format!("{n} like node {first}: {why}")))
            .collect();
        said.sort_by_key(|s| std::cmp::Reverse(s.0));
        let shown: Vec<String> = said.into_iter().take(3).map(|(_, s)| s).collect();
        return Err(format!(
            "0/{} nodes can allocate the pod's ResourceClaims ({})",
            nodes.len(),
            if shown.is_empty() { "no nodes".to_owned() } else { shown.join("; ") }
        ));
    }
    if let Some(k) = shape {
        shapes.insert(k, feasible.clone());
    }
    Ok(Some((feasible, claims)))
}

/// How long a pod may wait for its ResourceClaims to be made before it is told so.
const CLAIMS_MADE_GRACE_SECS: i64 = 30;

/// Whether a claim of the pod is not made yet: one from a template the pod's status does not
/// name yet, or a named one the cache does not hold.
fn claims_not_made(snap: &Snapshot<'_>, p: &Pod) -> bool {
    let Some(dra) = snap.dra.as_ref() else { return false };
    let ns = p.metadata.namespace.as_deref().unwrap_or("default");
    match crate::claims::pod_claims(p) {
        Err(_) => true,
        Ok(names) => names.iter().any(|n| !dra.claims.contains_key(&(ns.to_owned(), n.clone()))),
    }
}

/// Whether the pod was created less than [`CLAIMS_MADE_GRACE_SECS`] ago.
fn young(snap: &Snapshot<'_>, p: &Pod) -> bool {
    p.metadata
        .creation_timestamp
        .as_ref()
        .is_some_and(|t| snap.unix_now.saturating_sub(t.0.as_second()) < CLAIMS_MADE_GRACE_SECS)
}

/// How many later pods with claims [`choose_nodes`] looks ahead at.
const LOOKAHEAD: usize = 32;

/// xpu's edge over devices across nodes: of the nodes a pod's claims fit (with the devices
/// each would have left free), those to keep it to. Among the nodes with room for its CPU and
/// memory: first those where it takes the devices of no later pod (of the next
/// [`LOOKAHEAD`]) that has no other node, then those left with the fewest free devices (best
/// fit), so nodes with many free devices stay whole for the larger claims that follow.
fn choose_nodes(
    dra: &Dra<'_>,
    me: &PodClaims,
    feasible: &[(String, usize)],
    room: &dyn Fn(&str) -> bool,
    later: &[(&PodClaims, &[(String, usize)])],
    labels_of: &dyn Fn(&str) -> BTreeMap<String, String>,
) -> Vec<String> {
    let cands: Vec<&(String, usize)> = feasible.iter().filter(|(n, _)| room(n)).collect();
    if cands.is_empty() || me.pending.is_empty() {
        return feasible.iter().map(|(n, _)| n.clone()).collect();
    }
    let claims = |pc: &PodClaims| -> Vec<xpu_sched::dra::Claim> {
        pc.pending.iter().map(|(_, c)| c.clone()).collect()
    };
    let alloc = |wanted: &[xpu_sched::dra::Claim], node: &str, in_use: &xpu_sched::dra::InUse| {
        xpu_sched::dra::allocate(
            wanted,
            dra.classes,
            &dra.slices.for_node(node),
            in_use,
            node,
            &labels_of(node),
            Default::default(),
        )
    };
    let mine = claims(me);
    // Later pods whose claims fit one node only, one of the candidates.
    let critical: Vec<(Vec<xpu_sched::dra::Claim>, &str)> = later
        .iter()
        .filter(|(pc, f)| !pc.pending.is_empty() && f.len() == 1)
        .filter(|(_, f)| cands.iter().any(|(n, _)| *n == f[0].0))
        .map(|(pc, f)| (claims(pc), f[0].0.as_str()))
        .collect();
    let loss = |node: &str| -> usize {
        let at_node: Vec<&Vec<xpu_sched::dra::Claim>> =
            critical.iter().filter(|(_, n)| *n == node).map(|(c, _)| c).collect();
        if at_node.is_empty() {
            return 0;
        }
        let Ok(taken) = alloc(&mine, node, dra.in_use) else { return 0 };
        let mut after = dra.in_use.clone();
        for a in &taken {
            after.add(a);
        }
        at_node.iter().filter(|c| alloc(c, node, &after).is_err()).count()
    };
    let scored: Vec<(usize, usize, &String)> =
        cands.iter().map(|(n, free)| (loss(n), *free, n)).collect();
    let best = scored.iter().map(|(l, f, _)| (*l, *f)).min();
    scored
        .into_iter()
        .filter(|(l, f, _)| Some((*l, *f)) == best)
        .map(|(_, _, n)| n.clone())
        .collect()
}

/// How a simulation orders the nodes a pod's claims fit.
#[derive(Clone, Copy)]
enum Strategy {
    /// The node left with the fewest free devices first.
    BestFit,
    /// The node left with the most free devices first.
    Spread,
    /// Node name order.
    First,
    /// A shuffled order, from this seed: greedy choices can miss what a different one finds,
    /// so a few random restarts are tried beside the rules.
    Random(u64),
}

/// Random restarts [`simulate`] tries beside its rules, for batches of at most
/// [`RESTART_BATCH`] pods (larger batches try the rules alone).
const RESTARTS: u64 = 8;
/// Devices one cycle's simulation may try over all its strategies.
const SIMULATION_STEPS: u64 = 2_000_000;
const RESTART_BATCH: usize = 64;

/// A waiting pod with claims, for [`simulate`]: uid, claims, the nodes they fit (with the
/// devices each would leave free), and its CPU and memory.
struct SimPod<'a> {
    uid: &'a str,
    /// Its claims to allocate, with their uids (a claim shared with an earlier pod is
    /// allocated once, and the later pod goes where it is).
    claims: Vec<(String, xpu_sched::dra::Claim)>,
    fits: &'a [(String, usize)],
    cpu_milli: u64,
    memory_mib: u64,
}

/// xpu's edge over devices across nodes: the waiting pods with claims are placed in queue
/// order, in a simulation, once per [`Strategy`], each pod on the first node (in the
/// strategy's order) that its claims, CPU and memory still fit after the pods before it; the
/// strategy that places the most wins (best fit on ties). Returns the winner's node per pod.
/// Each pod costs one allocation per node tried, so a batch costs about what placing it does.
fn simulate(
    dra: &Dra<'_>,
    pods: &[SimPod<'_>],
    room: &dyn Fn(&str) -> Option<(u64, u64)>,
    labels_of: &dyn Fn(&str) -> BTreeMap<String, String>,
) -> HashMap<String, String> {
    let mut best: Option<(usize, HashMap<String, String>)> = None;
    let restarts = if pods.len() <= RESTART_BATCH { RESTARTS } else { 0 };
    let strategies = [Strategy::BestFit, Strategy::Spread, Strategy::First]
        .into_iter()
        .chain((1..=restarts).map(Strategy::Random));
    // Devices tried over all strategies: past the cap, the best placement so far stands.
    let mut spent = 0u64;
    for strategy in strategies {
        if spent >= SIMULATION_STEPS {
            break;
        }
        let mut rng = xpu_sched::rng::Rng::new(match strategy {
            Strategy::Random(seed) => seed,
            _ => 0,
        });
        let mut in_use = dra.in_use.clone();
        let mut taken_at: HashMap<&str, usize> = HashMap::new();
        let mut cpu: HashMap<&str, (u64, u64)> = HashMap::new();
        let mut chosen = HashMap::new();
        // Claims allocated in this simulation: uid → node.
        let mut claimed: HashMap<&str, &str> = HashMap::new();
        for p in pods {
            let pinned: BTreeSet<&str> =
                p.claims.iter().filter_map(|(u, _)| claimed.get(u.as_str()).copied()).collect();
            if pinned.len() > 1 {
                continue;
            }
            let todo: Vec<xpu_sched::dra::Claim> = p
                .claims
                .iter()
                .filter(|(u, _)| !claimed.contains_key(u.as_str()))
                .map(|(_, c)| c.clone())
                .collect();
            let mut order: Vec<(&str, usize)> = p
                .fits
                .iter()
                .map(|(n, left)| {
                    // Devices pods placed before it in this simulation took there.
                    let taken = taken_at.get(n.as_str()).copied().unwrap_or(0);
                    (n.as_str(), left.saturating_sub(taken))
                })
                .collect();
            match strategy {
                Strategy::BestFit => order.sort_by_key(|(n, f)| (*f, *n)),
                Strategy::Spread => order.sort_by_key(|(n, f)| (std::cmp::Reverse(*f), *n)),
                Strategy::First => order.sort_by_key(|(n, _)| *n),
                Strategy::Random(_) => rng.shuffle(&mut order),
            }
            for (node, _) in order {
                if pinned.first().is_some_and(|n| *n != node) {
                    continue;
                }
                let Some(have) = cpu.get(node).copied().or_else(|| room(node)) else { continue };
                if have.0 < p.cpu_milli || have.1 < p.memory_mib {
                    continue;
                }
                // A simulation step is a guess: it searches less than a real allocation.
                let limits = xpu_sched::dra::Limits { steps: 5_000, ..Default::default() };
                let got = xpu_sched::dra::allocate_counted(
                    &todo,
                    dra.classes,
                    &dra.slices.for_node(node),
                    &in_use,
                    node,
                    &labels_of(node),
                    limits,
                    &mut spent,
                );
                let Ok(allocs) = got else { continue };
                let n: usize = allocs.iter().map(|a| a.devices.len()).sum();
                for a in &allocs {
                    in_use.add(a);
                }
                *taken_at.entry(node).or_default() += n;
                cpu.insert(node, (have.0 - p.cpu_milli, have.1 - p.memory_mib));
                chosen.insert(p.uid.to_owned(), node.to_owned());
                for (u, _) in &p.claims {
                    claimed.entry(u.as_str()).or_insert(node);
                }
                break;
            }
        }
        if best.as_ref().is_none_or(|(n, _)| chosen.len() > *n) {
            best = Some((chosen.len(), chosen));
        }
    }
    best.map(|(_, c)| c).unwrap_or_default()
}

/// Devices of `node`'s pools not allocated in the cluster.
fn free_devices(dra: &Dra<'_>, node: &str, labels: &BTreeMap<String, String>) -> usize {
    let mut n = 0;
    for s in dra.slices.for_node(node) {
        for d in &s.devices {
            if !d.scope.as_ref().unwrap_or(&s.scope).admits(node, labels) {
                continue;
            }
            let id = xpu_sched::dra::DeviceId {
                driver: s.driver.clone(),
                pool: s.pool.clone(),
                device: d.name.clone(),
            };
            if !dra.in_use.devices.contains(&id) && !dra.in_use.capacity.contains_key(&id) {
                n += 1;
            }
        }
    }
    n
}

/// Keeps a task to the nodes in `names` (ANDed with its own node affinity).
fn keep_to_nodes(task: &mut xpu_sched::TaskSpec, names: Vec<String>) {
    use xpu_sched::constraints::{Operator, Requirement};
    let req = Requirement { key: NODE_NAME.into(), operator: Operator::In, values: names };
    if task.affinity.is_empty() {
        task.affinity.push(vec![req]);
    } else {
        for term in &mut task.affinity {
            term.push(req.clone());
        }
    }
}

/// Allocates `pc`'s pending claims on `node` (with what this cycle allocated before in
/// `in_use`); the writes to make before the pod binds, or why it cannot.
fn allocate_on(
    dra: &Dra<'_>,
    pod_uid: &str,
    pc: &PodClaims,
    node: &str,
    labels: &BTreeMap<String, String>,
    in_use: &xpu_sched::dra::InUse,
) -> Result<Vec<ClaimWrite>, String> {
    let key = |c: &k8s_openapi::api::resource::v1::ResourceClaim| {
        (
            c.metadata.namespace.clone().unwrap_or_default(),
            c.metadata.name.clone().unwrap_or_default(),
            c.metadata.uid.clone().unwrap_or_default(),
        )
    };
    let mut out = Vec::new();
    for c in &pc.allocated {
        let mine = c
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| r.iter().any(|r| r.uid == pod_uid));
        if !mine {
            let (namespace, name, uid) = key(c);
            out.push(ClaimWrite {
                namespace,
                name,
                uid,
                allocation: None,
                devices: None,
                create: None,
                cached: Some(c.clone()),
            });
        }
    }
    if pc.pending.is_empty() {
        return Ok(out);
    }
    let wanted: Vec<xpu_sched::dra::Claim> = pc.pending.iter().map(|(_, c)| c.clone()).collect();
    let allocs = xpu_sched::dra::allocate(
        &wanted,
        dra.classes,
        &dra.slices.for_node(node),
        in_use,
        node,
        labels,
        Default::default(),
    )
    .map_err(|e| format!("node {node}: {e}"))?;
    for ((c, _), a) in pc.pending.iter().zip(allocs) {
        let (namespace, name, uid) = key(c);
        let json = crate::claims::allocation_json(&a, c, dra.class_objects, node);
        let create = pc.extended.clone().filter(|_| uid.starts_with(EXTENDED_UID));
        let cached = create.is_none().then(|| c.clone());
        out.push(ClaimWrite {
            namespace,
            name,
            uid,
            allocation: Some(json),
            devices: Some(a),
            create,
            cached,
        });
    }
    Ok(out)
}

/// What flex-start says about a unit before it is submitted.
enum FlexGate {
    /// Place it; if it does not start, ask for capacity (`Some`) and add the note to its reason.
    Place(Option<flex::Provision>, String),
    /// It holds nothing this cycle (its request is not provisioned): the reason for its pods,
    /// and a request to make (a first one again, or the next attempt). The reason is given
    /// every cycle, not rate-limited: it is cheap, it changes only with the request (the driver
    /// writes only a changed reason), and a Failed request is news to report at once.
    Hold(String, Option<flex::Provision>),
}

/// The flex-start gate for a unit whose pods (`members`, first is the template) ask like
/// `ask`; `base` names its requests and `count` is how many pods they are for.
fn flex_gate(
    snap: &Snapshot<'_>,
    requests: &Requests<'_>,
    ask: &PodAsk,
    members: &[&Pod],
    base: &str,
    count: u32,
) -> FlexGate {
    let none = FlexGate::Place(None, String::new());
    let Some(&first) = members.first() else { return none };
    if !flex::aimed(&ask.task.node_selector) {
        return none;
    }
    if snap.provisioning.is_none() {
        return FlexGate::Place(
            None,
            "; no flex-start capacity is asked for: the cluster does not serve ProvisioningRequests (autoscaling.x-k8s.io/v1); install the cluster autoscaler with them enabled, or `xpu k8s crd | kubectl apply -f -` for another provisioner".into(),
        );
    };
    let ns = first.metadata.namespace.as_deref().unwrap_or("default");
    let note = |k: &str| first.metadata.annotations.as_ref().and_then(|a| a.get(k));
    let Some(name) = note(flex::CONSUME) else {
        let p = flex::provision(first, members, flex::request_name(base, 1), count, 1, None);
        return FlexGate::Place(Some(p), String::new());
    };
    // xpu remakes or replaces only a request it would have named itself for this unit's
    // attempt: a pod's annotations cannot steer it to create or delete anything else.
    let attempt = note(flex::ATTEMPT)
        .and_then(|a| a.parse::<u32>().ok())
        .filter(|a| *a > 0 && *name == flex::request_name(base, *a));
    let Some(&r) = requests.get(&(ns, name.as_str())) else {
        return match attempt {
            // Ours: just made (the watch has not shown it yet) or deleted since; made again.
            Some(a) => FlexGate::Hold(
                format!(
                    "waiting for ProvisioningRequest {ns}/{name} ({}) to be Provisioned",
                    flex::CLASS
                ),
                Some(flex::provision(first, members, name.clone(), count, a, None)),
            ),
            None => FlexGate::Hold(
                format!(
                    "waiting for ProvisioningRequest {ns}/{name}, named by the pods' {} annotation; it does not exist",
                    flex::CONSUME
                ),
                None,
            ),
        };
    };
    match flex::state(r) {
        flex::State::Provisioned => FlexGate::Place(
            None,
            format!(
                "; its ProvisioningRequest {ns}/{name} is Provisioned: waiting for the new nodes"
            ),
        ),
        flex::State::Waiting(c) => FlexGate::Hold(
            format!(
                "waiting for ProvisioningRequest {ns}/{name} ({}) to be Provisioned{}",
                r.spec.provisioning_class_name,
                c.map(|c| format!("; now {}", flex::describe(c))).unwrap_or_default()
            ),
            None,
        ),
        flex::State::Ended(c) => {
            let Some(a) = attempt else {
                return FlexGate::Hold(
                    format!(
                        "ProvisioningRequest {ns}/{name} ended, {}; it is not one xpu made for these pods (by {}), so point {} at a new one",
                        flex::describe(c),
                        flex::ATTEMPT,
                        flex::CONSUME
                    ),
                    None,
                );
            };
            let (first_wait, most) = snap.provisioning_backoff;
            let at = c.last_transition_time.0.as_second()
                + i64::try_from(flex::backoff(a, first_wait, most)).unwrap_or(i64::MAX);
            if snap.unix_now < at {
                return FlexGate::Hold(
                    format!(
                        "ProvisioningRequest {ns}/{name} ended, {}; asking again at {} (attempt {})",
                        flex::describe(c),
                        k8s_openapi::jiff::Timestamp::from_second(at)
                            .map_or_else(|_| format!("{at} s"), |t| t.to_string()),
                        a.saturating_add(1)
                    ),
                    None,
                );
            }
            let next = flex::request_name(base, a.saturating_add(1));
            FlexGate::Hold(
                format!(
                    "ProvisioningRequest {ns}/{name} ended, {}; asked again as {ns}/{next}",
                    flex::describe(c)
                ),
                Some(flex::provision(
                    first,
                    members,
                    next,
                    count,
                    a.saturating_add(1),
                    Some(name.clone()),
                )),
            )
        }
    }
}

/// For a unit that did not start: what to add to its reason, after moving the flex-start
/// request it would need into the plan.
fn unplaced(unit: &mut Unit, out: &mut Plan) -> String {
    let mut note = std::mem::take(&mut unit.note);
    if let Some(p) = unit.flex.take() {
        note.push_str(&format!(
            "; asked for flex-start capacity: ProvisioningRequest {}/{} ({}) for {} pods",
            p.namespace,
            p.name(),
            flex::CLASS,
            p.request.spec.pod_sets.first().map_or(0, |s| s.count)
        ));
        out.provisions.push(p);
    }
    note
}

/// The cluster's ProvisioningRequests by (namespace, name), indexed once per cycle.
type Requests<'a> = HashMap<(&'a str, &'a str), &'a ProvisioningRequest>;

/// The name a unit's requests start from: its Job's, its gang's, or the pod's.
fn flex_base(p: &Pod, gang: Option<&str>) -> String {
    match (convert::job_owner(p), gang) {
        (Some(j), _) => j.name.clone(),
        (None, Some(g)) => g.rsplit('/').next().unwrap_or(g).to_owned(),
        (None, None) => p.metadata.name.clone().unwrap_or_default(),
    }
}

/// Runs one cycle. `explain(uid)` says whether a waiting pod's reason is wanted this time (the
/// caller rate-limits status updates); `now` is seconds on the caller's clock.
pub fn plan(
    snap: &Snapshot<'_>,
    config: &SchedulerConfig,
    now: u64,
    explain: &mut dyn FnMut(&str) -> bool,
) -> Plan {
    // xpu-sched places a pod with DRA claims on one of the nodes its claims fit alone; pods
    // placed earlier in the same cycle may take those devices. Such a pod is planned again
    // without that node (a few rounds at most), so that it goes where its claims still fit
    // before later pods take the devices there.
    let mut excluded: DraExcluded = HashMap::new();
    let mut round = 0;
    loop {
        let (mut plan, conflicts) = plan_once(snap, config, now, explain, &excluded);
        round += 1;
        if conflicts.is_empty() || round == 3 {
            keep_extended_within_allocatable(snap, &mut plan, explain);
            return plan;
        }
        for (uid, node) in conflicts {
            excluded.entry(uid).or_default().push(node);
        }
    }
}

/// Drops the binds that would take a node past its allocatable of an extended resource xpu does
/// not place as devices (each pod was kept to nodes where it fits alone; pods of one cycle may
/// together not fit), in bind order, with every other member of a dropped gang: those pods wait
/// and are planned again next cycle, when the binds before them are counted.
fn keep_extended_within_allocatable(
    snap: &Snapshot<'_>,
    plan: &mut Plan,
    explain: &mut dyn FnMut(&str) -> bool,
) {
    let no_dra = HashMap::new();
    let dra_backed = snap.dra.as_ref().map_or(&no_dra, |d| d.extended);
    let waiting: HashMap<&str, &Arc<Pod>> =
        snap.maybe_unbound().iter().filter_map(|p| Some((p.metadata.uid.as_deref()?, p))).collect();
    let asks: Vec<BTreeMap<String, u64>> = plan
        .binds
        .iter()
        .map(|b| {
            waiting
                .get(b.pod.uid.as_str())
                .map(|p| crate::extended::requests(p, dra_backed))
                .unwrap_or_default()
        })
        .collect();
    if asks.iter().all(BTreeMap::is_empty) {
        return;
    }
    let mut used = crate::extended::used(snap.pods, dra_backed, snap.hold_out, snap.assumed);
    let nodes: HashMap<&str, &Arc<Node>> =
        snap.nodes.iter().filter_map(|n| Some((n.metadata.name.as_deref()?, n))).collect();
    let allocatable = |node: &str, k: &str| -> u64 {
        nodes
            .get(node)
            .and_then(|n| n.status.as_ref()?.allocatable.as_ref()?.get(k))
            .and_then(|q| convert::quantity(&q.0, 1.0))
            .unwrap_or(0)
    };
    let mut dropped: Vec<(usize, String)> = Vec::new();
    let mut dropped_gangs: Vec<String> = Vec::new();
    for (i, (b, want)) in plan.binds.iter().zip(&asks).enumerate() {
        if want.is_empty() {
            continue;
        }
        let held = used.entry(b.node.clone()).or_default();
        let short = want.iter().find(|(k, v)| {
            held.get(*k).copied().unwrap_or(0).saturating_add(**v) > allocatable(&b.node, k)
        });
        match short {
            Some((k, v)) => {
                let why = format!(
                    "{v} {k} no longer free on {} after this cycle's earlier placements; placed again next cycle",
                    b.node
                );
                dropped.push((i, why));
                if let Some(g) = &b.gang {
                    dropped_gangs.push(g.clone());
                }
            }
            None => {
                for (k, v) in want {
                    let x = held.entry(k.clone()).or_default();
                    *x = x.saturating_add(*v);
                }
            }
        }
    }
    if dropped.is_empty() {
        return;
    }
    let mut why: HashMap<usize, String> = dropped.into_iter().collect();
    let binds = std::mem::take(&mut plan.binds);
    for (i, b) in binds.into_iter().enumerate() {
        let gang_dropped = b.gang.as_ref().is_some_and(|g| dropped_gangs.contains(g));
        let reason = why.remove(&i).or_else(|| {
            gang_dropped.then(|| {
                "another pod of its gang no longer fits an extended resource after this cycle's earlier placements; placed again next cycle".to_owned()
            })
        });
        match reason {
            Some(r) => {
                if explain(&b.pod.uid) {
                    plan.waiting.push((b.pod, r));
                }
            }
            None => plan.binds.push(b),
        }
    }
}

/// The null binder of the throughput benches: every waiting pod to the next Ready node in turn
/// (nodes in name order, `cursor` kept by the caller across cycles), deciding nothing: no fit, no
/// gangs. Run through the same watch, queue and binding client as [`plan`], its rate is the API
/// server's ceiling for any scheduler on the same control plane. A pod with ResourceClaims
/// waits until they exist, then goes to the next node in turn with free devices enough, its
/// claims given that node's first free devices (no selector, constraint or capacity looked
/// at): the same writes any DRA scheduler makes (the claim's status, then the binding).
pub fn null_plan(snap: &Snapshot<'_>, cursor: &mut usize) -> Plan {
    let mut out = Plan::default();
    let mut ready: Vec<&str> = snap
        .nodes
        .iter()
        .filter(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    ready.sort_unstable();
    let mut pending: Vec<&Arc<Pod>> = snap
        .maybe_unbound()
        .iter()
        .filter(|p| waits_for(p, snap.scheduler_name, snap.assumed))
        .collect();
    out.pending = pending.len();
    if ready.is_empty() {
        return out;
    }
    pending.sort_by(|a, b| {
        let ka = (&a.metadata.creation_timestamp, &a.metadata.namespace, &a.metadata.name);
        let kb = (&b.metadata.creation_timestamp, &b.metadata.namespace, &b.metadata.name);
        ka.partial_cmp(&kb).unwrap_or(std::cmp::Ordering::Equal)
    });
    let mut taken = snap.dra.map(|d| d.in_use.clone()).unwrap_or_default();
    for p in pending {
        let Some(pod) = PodKey::of(p) else { continue };
        // A claim still to be made from its template: the pod waits.
        let Ok(names) = crate::claims::pod_claims(p) else { continue };
        // Extended resources backed by DRA: a claim made for the pod, with xpu's own writes
        // (the claim, its allocation, the pod's extendedResourceClaimStatus, the binding).
        if names.is_empty()
            && let Some(dra) = snap.dra
            && let Some((standin, ext, _)) = extended_claim(&dra, p)
        {
            for _ in 0..ready.len() {
                *cursor = (*cursor + 1) % ready.len();
                let node = ready[*cursor];
                if let Some(mut claims) = null_claims(&dra, &[&standin], &pod.uid, node, &mut taken)
                {
                    for w in &mut claims {
                        w.create = Some(ext.clone());
                        w.cached = None;
                    }
                    let node = node.to_owned();
                    out.binds.push(Bind { pod, node, gang: None, share: None, claims });
                    break;
                }
            }
            continue;
        }
        if names.is_empty() {
            *cursor = (*cursor + 1) % ready.len();
            let node = ready[*cursor].to_owned();
            out.binds.push(Bind { pod, node, gang: None, share: None, claims: Vec::new() });
            continue;
        }
        let Some(dra) = snap.dra else { continue };
        let Some(found) = names
            .iter()
            .map(|n| dra.claims.get(&(pod.namespace.clone(), n.clone())))
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        for _ in 0..ready.len() {
            *cursor = (*cursor + 1) % ready.len();
            let node = ready[*cursor];
            if let Some(claims) = null_claims(&dra, &found, &pod.uid, node, &mut taken) {
                let node = node.to_owned();
                out.binds.push(Bind { pod, node, gang: None, share: None, claims });
                break;
            }
        }
    }
    out
}

/// The null binder's claim writes for a pod's `claims` on `node`: each claim not allocated
/// gets the node's first devices not `taken` (as many as its requests count; a request for
/// all devices gets one), each allocated one is reserved; `None` when the node has too few.
fn null_claims(
    dra: &Dra<'_>,
    claims: &[&Arc<k8s_openapi::api::resource::v1::ResourceClaim>],
    pod_uid: &str,
    node: &str,
    taken: &mut xpu_sched::dra::InUse,
) -> Option<Vec<ClaimWrite>> {
    let slices = dra.slices.for_node(node);
    let mut free = slices.iter().flat_map(|s| {
        s.devices.iter().map(|d| xpu_sched::dra::DeviceId {
            driver: s.driver.clone(),
            pool: s.pool.clone(),
            device: d.name.clone(),
        })
    });
    let mut out = Vec::new();
    for c in claims {
        let write = |allocation, devices| ClaimWrite {
            namespace: c.metadata.namespace.clone().unwrap_or_default(),
            name: c.metadata.name.clone().unwrap_or_default(),
            uid: c.metadata.uid.clone().unwrap_or_default(),
            allocation,
            devices,
            create: None,
            cached: Some((*c).clone()),
        };
        let status = c.status.as_ref();
        if status.is_some_and(|s| s.allocation.is_some()) {
            let reserved = status
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| r.iter().any(|r| r.uid == pod_uid));
            if !reserved {
                out.push(write(None, None));
            }
            continue;
        }
        let claim = crate::claims::claim(c, dra.compiled).ok()?;
        let mut devices = Vec::new();
        for r in &claim.requests {
            let (sub, exact) = r.alternatives.first()?;
            let n = match exact.mode {
                xpu_sched::dra::Mode::Count(n) => n,
                xpu_sched::dra::Mode::All => 1,
            };
            let request = match sub {
                Some(sub) => format!("{}/{sub}", r.name),
                None => r.name.clone(),
            };
            for _ in 0..n {
                let id = free.by_ref().find(|id| !taken.devices.contains(id))?;
                devices.push(xpu_sched::dra::Allocated {
                    request: request.clone(),
                    id,
                    admin_access: false,
                    consumed: None,
                    binding_conditions: Vec::new(),
                    binding_failure_conditions: Vec::new(),
                    whole_group: false,
                });
            }
        }
        let a = xpu_sched::dra::Allocation { devices };
        let json = crate::claims::allocation_json(&a, c, dra.class_objects, node);
        out.push(write(Some(json), Some(a)));
    }
    // Only once every claim of the pod has its devices.
    for a in out.iter().filter_map(|w| w.devices.as_ref()) {
        taken.add(a);
    }
    Some(out)
}

/// Records every bound (or assumed) pod, but those `snap.hold_out` leaves out, where it is, for
/// the inter-pod constraints of the pods placed after it.
pub(crate) fn record_placed(snap: &Snapshot<'_>, sched: &mut Scheduler) {
    if let (Some(memo), None) = (snap.memo, snap.hold_out) {
        let index = memo.lock().placed.update(snap, sched.cluster());
        sched.set_pods(index);
        return;
    }
    for p in snap.pods.iter().filter(|p| !terminal(p)) {
        let Some(node) = bound_node(p, snap.assumed) else { continue };
        if snap.hold_out.is_some_and(|h| p.metadata.uid.as_deref().is_some_and(|u| h.contains(u))) {
            continue;
        }
        let Some(id) = sched.cluster().node_id(node) else { continue };
        if let Some(t) = placed_terms(snap, p) {
            sched.place_pod(id, t);
        }
    }
}

/// What a bound pod is to the pods placed after it (labels, anti-affinity, preferences).
pub(crate) fn placed_terms(snap: &Snapshot<'_>, p: &Pod) -> Option<Arc<xpu_sched::pods::PodTerms>> {
    let mut t = affinity::terms(p, snap.namespace_labels, false, false).ok()?;
    with_group(snap, p, &mut t, false);
    Some(Arc::new(t))
}

/// Internal pod label (never a real one: `~` is not allowed in label keys) naming the PodGroup
/// a pod belongs to, for the group's topology constraint.
const POD_GROUP: &str = "xpu.dev~pod-group";

/// The PodGroup a pod belongs to, when the group has a topology constraint: (name, key).
fn group_topology<'a>(snap: &Snapshot<'a>, p: &'a Pod) -> Option<(&'a str, &'a str)> {
    let name = convert::pod_group_name(p)?;
    let ns = p.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let g = snap.pod_groups?.get(&(ns, name.to_owned()))?;
    Some((name, g.topology.as_deref()?))
}

/// A PodGroup's topology constraint as inter-pod terms: every pod of the group carries
/// [`POD_GROUP`], and a pending one has affinity to the group's pods on the key (the first
/// chooses the domain, the rest follow; a gang tries each domain in turn).
fn with_group(snap: &Snapshot<'_>, p: &Pod, t: &mut xpu_sched::pods::PodTerms, pending: bool) {
    use xpu_sched::pods::{LabelOp, LabelReq, LabelSelector, Namespaces, PodMatcher, Term};
    let Some((name, key)) = group_topology(snap, p) else { return };
    t.labels.insert(POD_GROUP.into(), name.into());
    if pending {
        t.affinity.push(Term {
            pods: PodMatcher {
                selector: LabelSelector {
                    nothing: false,
                    reqs: vec![LabelReq {
                        key: POD_GROUP.into(),
                        op: LabelOp::In,
                        values: vec![name.into()],
                    }],
                },
                namespaces: Namespaces::Only(vec![t.namespace.clone()]),
            },
            topology_key: key.into(),
        });
    }
}

/// Per pod uid, nodes an earlier round found its claims no longer fit in this cycle.
type DraExcluded = HashMap<String, Vec<String>>;

fn plan_once(
    snap: &Snapshot<'_>,
    config: &SchedulerConfig,
    now: u64,
    explain: &mut dyn FnMut(&str) -> bool,
    excluded: &DraExcluded,
) -> (Plan, Vec<(String, String)>) {
    let mut out = Plan::default();
    let mut conflicts = Vec::new();

    let Built { cluster, empty, bad_nodes, gang_bound, separate, reserved, unreadable, queue_used } =
        cluster_of(snap);
    out.bad_nodes = bad_nodes;
    out.unreadable = unreadable;
    out.preemption_on = snap.preemption;
    let job_shape = |uid: &str| snap.jobs.get(uid).copied();
    let scheduler_name = snap.scheduler_name;

    // Pending pods, oldest first, grouped into units.
    let mut pending: Vec<&Arc<Pod>> = snap
        .maybe_unbound()
        .iter()
        .filter(|p| waits_for(p, scheduler_name, snap.assumed))
        .collect();
    pending.sort_by(|a, b| {
        let ka = (&a.metadata.creation_timestamp, &a.metadata.namespace, &a.metadata.name);
        let kb = (&b.metadata.creation_timestamp, &b.metadata.namespace, &b.metadata.name);
        ka.partial_cmp(&kb).unwrap_or(std::cmp::Ordering::Equal)
    });
    out.pending = pending.len();
    let requests: Requests<'_> = snap
        .provisioning
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let ns = r.metadata.namespace.as_deref().unwrap_or("default");
            Some(((ns, r.metadata.name.as_deref()?), r.as_ref()))
        })
        .collect();
    let pod_of: HashMap<&str, &Pod> =
        pending.iter().filter_map(|p| Some((p.metadata.uid.as_deref()?, p.as_ref()))).collect();

    let mut config = config.clone();
    config.queue_weights.extend(snap.queues.weights());
    let config = &config;
    let mut sched = match Scheduler::new(cluster, config.clone()) {
        Ok(mut s) => {
            if let Some(e) = empty {
                s.set_empty(e);
            }
            s
        }
        Err(e) => {
            for p in &pending {
                if let Some(k) = PodKey::of(p) {
                    out.waiting.push((k, format!("scheduler: {e}")));
                }
            }
            return (out, conflicts);
        }
    };

    // What each queue holds now: its fair-share account and what counts against its quota.
    let mut books = Books { queues: snap.queues, used: queue_used };
    for (queue, held) in &books.used {
        let (cpu, mem, dev) = held.fair_share();
        sched.charge_queue(queue, cpu, mem, dev);
    }

    // Inter-pod constraints: kept when a waiting pod has terms or a bound pod's terms bear on
    // the pods placed after it; then every placed pod is recorded where it is.
    let inter_pod = pending
        .iter()
        .any(|p| affinity::has_terms(p, true) || group_topology(snap, p).is_some())
        || snap.pods.iter().any(|p| {
            !terminal(p) && bound_node(p, snap.assumed).is_some() && affinity::has_terms(p, false)
        });
    if inter_pod {
        record_placed(snap, &mut sched);
    }

    let mut units: Vec<Unit> = Vec::new();
    // DRA: each pending pod's claims, and for gang members the nodes their claims allow.
    let mut pod_claims: HashMap<String, PodClaims> = HashMap::new();
    // Every waiting pod's claims and the nodes they fit, first, so that each pod's choice can
    // look ahead at the pods after it.
    let mut dra_pre: HashMap<String, Result<Option<Fits>, String>> = HashMap::new();
    let mut dra_seq: Vec<String> = Vec::new();
    let mut shapes = ShapeFits::new();
    for p in &pending {
        let Some(uid) = p.metadata.uid.clone() else { continue };
        let r = dra_nodes(snap, p, excluded.get(&uid), &mut shapes, &mut out.deallocate);
        if matches!(r, Ok(Some(_))) {
            dra_seq.push(uid.clone());
        }
        dra_pre.insert(uid, r);
    }
    let dra_seen: HashMap<String, Fits> = dra_pre
        .iter()
        .filter_map(|(u, r)| match r {
            Ok(Some(x)) => Some((u.clone(), x.clone())),
            _ => None,
        })
        .collect();
    // Node labels by name, for the pods with claims (none waiting: not built).
    let node_labels_pre: HashMap<&str, &BTreeMap<String, String>> = snap
        .nodes
        .iter()
        .filter(|_| !dra_seq.is_empty())
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n.metadata.labels.as_ref()?)))
        .collect();
    let labels_of = |n: &str| node_labels_pre.get(n).map(|l| (*l).clone()).unwrap_or_default();
    // The node each waiting pod with claims goes to, from the best of several simulated
    // strategies over the whole batch.
    let simulated: HashMap<String, String> = match snap.dra.as_ref() {
        Some(dra) if dra_seq.len() > 1 => {
            let asks: HashMap<&str, (u64, u64)> = pending
                .iter()
                .filter_map(|p| {
                    let u = convert::usage(p).ok()?;
                    Some((p.metadata.uid.as_deref()?, (u.cpu_milli, u.memory_mib)))
                })
                .collect();
            let sim: Vec<SimPod<'_>> = dra_seq
                .iter()
                .filter_map(|u| {
                    let (fits, pc) = dra_seen.get(u)?;
                    let (cpu_milli, memory_mib) = asks.get(u.as_str()).copied()?;
                    let claims = pc
                        .pending
                        .iter()
                        .map(|(o, c)| (o.metadata.uid.clone().unwrap_or_default(), c.clone()))
                        .collect();
                    Some(SimPod { uid: u, claims, fits, cpu_milli, memory_mib })
                })
                .collect();
            let c = sched.cluster();
            let room = |n: &str| {
                c.node_id(n)
                    .and_then(|id| c.node(id))
                    .filter(|n| n.status() == NodeStatus::Ready)
                    .map(|n| (n.cpu_free(), n.memory_free()))
            };
            simulate(dra, &sim, &room, &labels_of)
        }
        _ => HashMap::new(),
    };
    let mut member_nodes: HashMap<String, Vec<String>> = HashMap::new();
    // What bound pods hold of extended resources xpu does not place as devices, by node;
    // counted once, when a waiting pod first asks for one.
    let mut extended_used: Option<HashMap<String, BTreeMap<String, u64>>> = None;
    let mut gangs: BTreeMap<String, (GangRef, Members)> = BTreeMap::new();
    let mut gang_order: Vec<String> = Vec::new();
    let say = |out: &mut Plan, k: PodKey, msg: String, explain: &mut dyn FnMut(&str) -> bool| {
        if explain(&k.uid) {
            out.waiting.push((k, msg));
        }
    };
    // Tasks, each with how many pods run or wait to run it.
    let mut mix_tasks: Vec<(xpu_sched::TaskSpec, u64)> = Vec::new();
    for p in &pending {
        let Some(key) = PodKey::of(p) else { continue };
        if let Some(node) = reserved.get(&key.uid) {
            let msg = format!(
                "waiting on node {node}, nominated for it, for the lower-priority pods it preempted there to end"
            );
            say(&mut out, key, msg, explain);
            continue;
        }
        let mut ask = match convert::pod(p) {
            Ok(a) => a,
            Err(u) => {
                say(&mut out, key, format!("{u}"), explain);
                continue;
            }
        };
        // An extended resource DRA devices serve (no node advertises it) is the pod's
        // extended-resource claim, not a device-plugin count.
        if let (Some(r), Some(dra)) = (ask.resources.device_resource, snap.dra.as_ref())
            && extended_served(dra, p).is_some_and(|served| served.iter().any(|x| x == r))
        {
            ask.resources.device_resource = None;
            ask.resources.devices = 0;
            ask.task.devices = xpu_sched::DeviceAsk::None;
            ask.task.device_kind = None;
        }
        if inter_pod {
            let plain = ask.resources.devices == 0 && ask.resources.share_milli == 0;
            match affinity::terms(p, snap.namespace_labels, true, plain) {
                Ok(mut t) => {
                    with_group(snap, p, &mut t, true);
                    ask.task.pod = Some(Arc::new(t));
                }
                Err(u) => {
                    say(&mut out, key, format!("{u}"), explain);
                    continue;
                }
            }
        }
        let ns = key.namespace.as_str();
        match snap.queues.resolve(ns, snap.namespace_labels.get(ns), queue_label(p)) {
            Ok(q) => ask.queue = q,
            Err(msg) => {
                say(&mut out, key, msg, explain);
                continue;
            }
        }
        // DRA: the nodes the pod's claims can be allocated on.
        let room = |name: &str| {
            let c = sched.cluster();
            c.node_id(name).and_then(|id| c.node(id)).is_some_and(|n| {
                n.status() == NodeStatus::Ready
                    && n.cpu_free() >= ask.resources.cpu_milli
                    && n.memory_free() >= ask.resources.memory_mib
            })
        };
        let feasible = match dra_pre.remove(&key.uid) {
            None | Some(Ok(None)) => None,
            Some(Ok(Some((nodes, pc)))) => {
                let at = dra_seq.iter().position(|u| *u == key.uid).unwrap_or(dra_seq.len());
                let later: Vec<(&PodClaims, &[(String, usize)])> = dra_seq
                    .iter()
                    .skip(at + 1)
                    .take(LOOKAHEAD)
                    .filter_map(|u| dra_seen.get(u))
                    .map(|(f, pc)| (pc, f.as_slice()))
                    .collect();
                let chosen = match (snap.dra.as_ref(), simulated.get(&key.uid)) {
                    // Claims already allocated pin the pod; the simulation chose among the rest.
                    (Some(_), Some(node)) if !pc.pending.is_empty() => vec![node.clone()],
                    (Some(dra), _) => choose_nodes(dra, &pc, &nodes, &room, &later, &labels_of),
                    (None, _) => nodes.iter().map(|(n, _)| n.clone()).collect(),
                };
                pod_claims.insert(key.uid.clone(), pc);
                Some((chosen, nodes.into_iter().map(|(n, _)| n).collect::<Vec<_>>()))
            }
            Some(Err(msg)) => {
                // A pod whose claims are still being made (kube-controller-manager makes them
                // from templates just after the pod) waits without a status write for a while,
                // as kube-scheduler keeps such pods out of its queue: a write per new pod
                // would cost the API server what the bindings need.
                if !(claims_not_made(snap, p) && young(snap, p)) {
                    say(&mut out, key, msg, explain);
                }
                continue;
            }
        };
        // Extended resources xpu does not place as devices keep the pod to where they fit.
        let no_dra = HashMap::new();
        let dra_backed = snap.dra.as_ref().map_or(&no_dra, |d| d.extended);
        let want = crate::extended::requests(p, dra_backed);
        let feasible = if want.is_empty() {
            feasible
        } else {
            let used = extended_used.get_or_insert_with(|| {
                crate::extended::used(snap.pods, dra_backed, snap.hold_out, snap.assumed)
            });
            match crate::extended::fitting_nodes(&want, snap.nodes, used) {
                Err(msg) => {
                    say(&mut out, key, msg, explain);
                    continue;
                }
                Ok(fit) => {
                    let (chosen, all) = match feasible {
                        None => (fit.clone(), fit),
                        Some((chosen, all)) => {
                            let all: Vec<String> =
                                all.into_iter().filter(|n| fit.contains(n)).collect();
                            let chosen: Vec<String> =
                                chosen.into_iter().filter(|n| fit.contains(n)).collect();
                            (if chosen.is_empty() { all.clone() } else { chosen }, all)
                        }
                    };
                    Some((chosen, all))
                }
            }
        };
        if ask.resources.device_resource == Some(SHARE_RESOURCE) && !snap.shares {
            let msg = format!(
                "{SHARE_RESOURCE} is placed only by a scheduler started with --share-key FILE (the key xpu's device plugins check its GPU choices with)"
            );
            say(&mut out, key, msg, explain);
            continue;
        }
        if separate {
            keep_to_offer(&mut ask);
        }
        if config.policy.needs_mix() {
            mix_tasks.push((ask.task.clone(), 1));
        }
        match convert::gang(p, job_shape, snap.pod_groups) {
            Err(u) => say(&mut out, key, format!("{u}"), explain),
            Ok(Some(g)) => {
                // A gang goes where all its members' claims fit: each member's every node.
                if let Some((_, all)) = feasible {
                    member_nodes.insert(key.uid.clone(), all);
                }
                let e = gangs.entry(g.key.clone()).or_insert_with(|| {
                    gang_order.push(g.key.clone());
                    (g.clone(), Vec::new())
                });
                e.1.push((g.index.unwrap_or(u32::MAX), key, ask));
            }
            Ok(None) => {
                if let Some((nodes, _)) = feasible {
                    keep_to_nodes(&mut ask.task, nodes);
                }
                if let Some((acc, topo)) = &ask.tpu
                    && let Ok(shape) = xpu_core::tpu::slice(acc, topo)
                    && shape.hosts > 1
                {
                    let msg = format!(
                        "nodeSelector {GKE_TPU_TOPOLOGY}={topo} spans {} hosts; run it as an Indexed Job with completions = parallelism = {} (or label the pods {}=NAME, {}={}) so the hosts start together",
                        shape.hosts,
                        shape.hosts,
                        convert::GANG_LABEL,
                        convert::GANG_SIZE,
                        shape.hosts
                    );
                    say(&mut out, key, msg, explain);
                    continue;
                }
                match flex_gate(snap, &requests, &ask, &[p.as_ref()], &flex_base(p, None), 1) {
                    FlexGate::Hold(msg, provision) => {
                        out.provisions.extend(provision);
                        out.waiting.push((key, msg));
                    }
                    FlexGate::Place(provision, note) => {
                        let n = units.len();
                        submit_pod(
                            &mut sched, &mut units, &books, key, &ask, now, &mut out, explain,
                        );
                        if let Some(u) = units.get_mut(n) {
                            (u.flex, u.note) = (provision, note);
                        }
                    }
                }
            }
        }
    }

    for gkey in gang_order {
        let Some((g, mut members)) = gangs.remove(&gkey) else { continue };
        let (bound, bound_node) = gang_bound.get(&gkey).cloned().unwrap_or((0, None));
        // Completion-index order, then name: task i of the gang is the pod of index i.
        members.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
        let mut members: Vec<(PodKey, PodAsk)> =
            members.into_iter().map(|(_, k, a)| (k, a)).collect();
        let need = g.size.saturating_sub(bound) as usize;
        if need == 0 {
            // Replacements for members of a running gang: each on its own.
            for (key, ask) in members {
                submit_pod(&mut sched, &mut units, &books, key, &ask, now, &mut out, explain);
            }
            continue;
        }
        if members.len() < need {
            let msg = format!(
                "waiting for the rest of gang {gkey}: {} of its {} pods can be placed now ({bound} bound; the others do not exist yet, or wait for a reason of their own); xpu binds a gang only when every pod fits",
                members.len(),
                g.size
            );
            for (key, _) in members {
                say(&mut out, key, msg.clone(), explain);
            }
            continue;
        }
        members.truncate(need);
        // Members that ask alike form one group of the job (a LeaderWorkerSet's leader and its
        // workers differ); their own labels may differ (a completion index, say), and a
        // group's are those all its members share.
        let unlabelled = |t: &xpu_sched::TaskSpec| {
            let mut t = t.clone();
            if let Some(p) = t.pod.as_mut() {
                Arc::make_mut(p).labels.clear();
            }
            t
        };
        let mut kinds: Vec<(xpu_sched::TaskSpec, Vec<usize>)> = Vec::new();
        for (i, (_, a)) in members.iter().enumerate() {
            let base = unlabelled(&a.task);
            match kinds.iter_mut().find(|(t, _)| *t == base) {
                Some((_, v)) => v.push(i),
                None => kinds.push((base, vec![i])),
            }
        }
        let first = members[0].1.clone();
        if first.tpu.is_some() && kinds.len() > 1 {
            let other = &members[kinds[1].1[0]].0;
            let msg = format!(
                "pods of TPU gang {gkey} ask for different resources or node constraints ({other} differs from {}); xpu places a TPU slice of identical pods",
                members[0].0
            );
            for (key, _) in members {
                say(&mut out, key, msg.clone(), explain);
            }
            continue;
        }
        let mut groups: Vec<TaskGroup> = Vec::with_capacity(kinds.len());
        let mut order: Vec<usize> = Vec::with_capacity(members.len());
        let mut amounts_all = Amounts::default();
        let mut failed = None;
        for (_, idx) in &kinds {
            let mut ask = members[idx[0]].1.clone();
            if let Some(t) = ask.task.pod.as_mut() {
                Arc::make_mut(t).labels.retain(|k, v| {
                    idx.iter().all(|&i| {
                        members[i].1.task.pod.as_ref().is_some_and(|p| p.labels.get(k) == Some(v))
                    })
                });
            }
            // Every member goes where its own claims can be allocated: its group, where all
            // of the group's can.
            let mut allowed: Option<Vec<String>> = None;
            for &i in idx {
                if let Some(nodes) = member_nodes.get(&members[i].0.uid) {
                    allowed = Some(match allowed {
                        None => nodes.clone(),
                        Some(a) => a.into_iter().filter(|n| nodes.contains(n)).collect(),
                    });
                }
            }
            if let Some(nodes) = allowed {
                keep_to_nodes(&mut ask.task, nodes);
            }
            let group = match &ask.tpu {
                Some((acc, topo)) => {
                    let c = sched.cluster();
                    let pool =
                        bound_node.as_deref().and_then(|n| c.node(c.node_id(n)?)?.pool.clone());
                    tpu_group(acc, topo, &ask, need, g.size, bound, pool)
                }
                None => Ok(TaskGroup::new(idx.len() as u32, ask.task.clone()).gang()),
            };
            match group {
                Ok(group) => groups.push(group),
                Err(msg) => {
                    failed = Some(msg);
                    break;
                }
            }
            amounts_all.add(&amounts(&ask).times(idx.len() as u64));
            order.extend(idx);
        }
        if let Some(msg) = failed {
            for (key, _) in members {
                say(&mut out, key, msg.clone(), explain);
            }
            continue;
        }
        // Flex-start capacity is asked for a whole gang, before any of it runs.
        let (provision, note) = if bound == 0 {
            let pods: Vec<&Pod> =
                members.iter().filter_map(|(k, _)| pod_of.get(k.uid.as_str()).copied()).collect();
            let base = pods.first().map(|p| flex_base(p, Some(&gkey))).unwrap_or_default();
            match flex_gate(snap, &requests, &first, &pods, &base, g.size) {
                FlexGate::Place(p, note) => (p, note),
                FlexGate::Hold(msg, provision) => {
                    out.provisions.extend(provision);
                    for (key, _) in members {
                        out.waiting.push((key, msg.clone()));
                    }
                    continue;
                }
            }
        } else {
            (None, String::new())
        };
        let mut groups = groups.into_iter();
        let Some(group) = groups.next() else { continue };
        let mut job =
            Job::single(gkey.clone(), group).priority(first.priority).queue(first.queue.clone());
        job.groups.extend(groups);
        let offsets: Vec<usize> = kinds
            .iter()
            .scan(0, |at, (_, idx)| {
                let o = *at;
                *at += idx.len();
                Some(o)
            })
            .collect();
        let mut slots: Vec<Option<PodKey>> = members.into_iter().map(|(k, _)| Some(k)).collect();
        let keys = order.iter().filter_map(|&i| slots[i].take()).collect();
        let resource = first.resources.device_resource;
        let ask = share_ask(&first);
        let amounts = amounts_all;
        let n = units.len();
        submit(
            &mut sched,
            &mut units,
            &books,
            job,
            keys,
            Some(gkey),
            resource,
            (ask, amounts),
            now,
            &mut out,
            explain,
        );
        if let Some(u) = units.get_mut(n) {
            (u.flex, u.note, u.offsets) = (provision, note, offsets);
        }
    }

    // FGD and xpu measure fragmentation against the tasks the cluster runs: those waiting and
    // those this scheduler placed.
    if config.policy.needs_mix() {
        let mut demands: Vec<_> =
            mix_tasks.iter().filter_map(|(t, n)| Some((sched.demand(t).ok()?, *n))).collect();
        // A task kept for preemption, or kept to its device resource, is copied.
        let keep = separate || snap.preemption;
        let mut count = |task: &xpu_sched::TaskSpec,
                         resource: Option<&'static str>,
                         n: u64,
                         mix_tasks: &mut Vec<_>| {
            if !keep {
                demands.extend(sched.demand(task).ok().map(|d| (d, n)));
                return;
            }
            let mut task = task.clone();
            if separate {
                keep_task_to_offer(&mut task, resource);
            }
            demands.extend(sched.demand(&task).ok().map(|d| (d, n)));
            mix_tasks.push((task, n));
        };
        let ledger =
            snap.ledger.filter(|_| snap.hold_out.is_none()).map(crate::ledger::Ledger::read);
        if let Some(book) = &ledger {
            for (task, resource, n) in book.mix(scheduler_name) {
                count(task, resource, n, &mut mix_tasks);
            }
        }
        let mut memo = Held::of(snap);
        // With a ledger, pods the watch shows bound are its: only the others are read.
        let pods = if ledger.is_some() { snap.maybe_unbound() } else { snap.pods };
        for p in pods {
            let mine =
                p.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()) == Some(scheduler_name);
            if !mine || terminal(p) || bound_node(p, snap.assumed).is_none() {
                continue;
            }
            // What the ledger counts: bound as the watch shows it, or already seen bound.
            if let Some(book) = &ledger
                && (p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some_and(|n| !n.is_empty())
                    || p.metadata.uid.as_deref().is_some_and(|u| book.holds(u)))
            {
                continue;
            }
            let ask = memo.ask(p);
            let Ok(ask) = ask.as_ref() else { continue };
            count(&ask.task, ask.resources.device_resource, 1, &mut mix_tasks);
        }
        drop(ledger);
        if !demands.is_empty() {
            let each = demands.iter().flat_map(|(d, n)| std::iter::repeat_n(d, *n as usize));
            sched.set_task_mix(&TaskMix::from_demands(each, 0.95));
        }
    }

    let by_job: HashMap<u32, usize> =
        units.iter().enumerate().filter_map(|(i, u)| Some((u.job?, i))).collect();
    // DRA: what this cycle allocates is counted for the pods placed after it.
    let mut cycle_in_use = snap.dra.map(|d| d.in_use.clone()).unwrap_or_default();
    // Claims allocated in this cycle, by uid.
    let mut claimed: std::collections::HashSet<String> = std::collections::HashSet::new();
    // Node labels by name, for the pods with claims (none waiting: not built).
    let node_labels: HashMap<&str, &BTreeMap<String, String>> = snap
        .nodes
        .iter()
        .filter(|_| !pod_claims.is_empty())
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n.metadata.labels.as_ref()?)))
        .collect();
    for d in sched.schedule(now) {
        match d {
            Decision::Start { job, tasks } => {
                let Some(unit) = by_job.get(&job).map(|&i| &mut units[i]) else { continue };
                unit.job = None;
                // Units that each fit their queue's quota alone may not fit it together: in
                // the order xpu-sched started them, a unit that would pass it waits. (It held
                // room in this plan; the next cycle counts the ones bound now.)
                if let Some(why) =
                    books.queues.over_quota(&unit.queue, books.used.get(&unit.queue), &unit.amounts)
                {
                    for k in &unit.pods {
                        if explain(&k.uid) {
                            out.waiting.push((k.clone(), why.clone()));
                        }
                    }
                    continue;
                }
                // Claims are allocated for every pod of the unit before any binds; one that
                // cannot be leaves the whole unit waiting (and allocates nothing).
                let mut writes: Vec<Vec<ClaimWrite>> = Vec::with_capacity(tasks.len());
                let mut trial = cycle_in_use.clone();
                let mut failed = None;
                for t in &tasks {
                    let (Some(pod), Some(node)) =
                        (unit.pod(t.task), sched.cluster().node(t.placement.node))
                    else {
                        writes.push(Vec::new());
                        continue;
                    };
                    let (Some(pc), Some(dra)) = (pod_claims.get(&pod.uid), snap.dra.as_ref())
                    else {
                        writes.push(Vec::new());
                        continue;
                    };
                    static NONE: std::sync::LazyLock<BTreeMap<String, String>> =
                        std::sync::LazyLock::new(BTreeMap::new);
                    let labels = node_labels.get(node.name.as_str()).copied().unwrap_or(&NONE);
                    // A claim shared by pods waiting together is allocated for the first.
                    if let Some((c, _)) = pc
                        .pending
                        .iter()
                        .find(|(c, _)| c.metadata.uid.as_ref().is_some_and(|u| claimed.contains(u)))
                    {
                        failed = Some(format!(
                            "{pod}: ResourceClaim {} is being allocated for another pod",
                            c.metadata.name.as_deref().unwrap_or("")
                        ));
                        break;
                    }
                    match allocate_on(dra, &pod.uid, pc, &node.name, labels, &trial) {
                        Ok(w) => {
                            for a in w.iter().filter_map(|w| w.devices.as_ref()) {
                                trial.add(a);
                            }
                            writes.push(w);
                        }
                        Err(e) => {
                            failed = Some(format!("{pod}: ResourceClaims: {e}"));
                            // Planned again without that node for this pod (for a gang,
                            // the nodes all its members fit shrink with it).
                            conflicts.push((pod.uid.clone(), node.name.clone()));
                            break;
                        }
                    }
                }
                if let Some(why) = failed {
                    let msg = match &unit.gang {
                        Some(g) => format!("gang {g} waits: {why}"),
                        None => why,
                    };
                    for k in &unit.pods {
                        if explain(&k.uid) {
                            out.waiting.push((k.clone(), msg.clone()));
                        }
                    }
                    continue;
                }
                cycle_in_use = trial;
                for w in writes.iter().flatten() {
                    if w.allocation.is_some() {
                        claimed.insert(w.uid.clone());
                    }
                }
                books.used.entry(unit.queue.clone()).or_default().add(&unit.amounts);
                let mut writes = writes.into_iter();
                for t in tasks {
                    let claims = writes.next().unwrap_or_default();
                    let (Some(pod), Some(node)) =
                        (unit.pod(t.task), sched.cluster().node(t.placement.node))
                    else {
                        continue;
                    };
                    let share = (unit.share_ask > 0).then(|| {
                        (t.placement.devices.iter().map(|d| d.index).collect(), unit.share_ask)
                    });
                    out.binds.push(Bind {
                        pod: pod.clone(),
                        node: node.name.clone(),
                        gang: unit.gang.clone(),
                        share,
                        claims,
                    });
                }
            }
            Decision::Fail { job, error } => {
                let Some(unit) = by_job.get(&job).map(|&i| &mut units[i]) else { continue };
                let msg = kube_words(&error.to_string(), unit.resource) + &unplaced(unit, &mut out);
                for k in &unit.pods {
                    if explain(&k.uid) {
                        out.waiting.push((k.clone(), msg.clone()));
                    }
                }
                unit.job = None;
            }
            _ => {}
        }
    }
    for unit in &mut units {
        let Some(job) = unit.job else { continue };
        let note = unplaced(unit, &mut out);
        if !unit.pods.iter().any(|k| explain(&k.uid)) {
            continue;
        }
        let msg = match sched.explain(job) {
            Some(u) => kube_words(&u.to_string(), unit.resource),
            None => "waiting behind earlier pods of its queue (xpu schedules each queue in order, by priority)".into(),
        } + &note;
        for k in &unit.pods {
            out.waiting.push((k.clone(), msg.clone()));
        }
    }
    out.broken_invariant = sched.broken_invariants().1.map(str::to_owned);
    if snap.preemption {
        let waiting: Vec<crate::preempt::Waiting> = units
            .iter()
            .filter(|u| u.job.is_some())
            .filter_map(|u| {
                Some(crate::preempt::Waiting { job: u.spec.clone()?, pods: u.pods.clone() })
            })
            .collect();
        if !waiting.is_empty() {
            let excluded = |uid: &str| snap.excluded.contains(uid);
            out.preemptions =
                crate::preempt::plan(snap, config, &waiting, &out.binds, &excluded, &mix_tasks);
        }
    }
    let (cluster, empty) = sched.into_parts();
    crate::base::give_back(snap, cluster, empty);
    (out, conflicts)
}

/// The cluster a cycle places on, and what it learned building it.
pub(crate) struct Built {
    pub cluster: Cluster,
    /// The empty copy of `cluster` kept from an earlier cycle, if any (see
    /// [`Scheduler::set_empty`]).
    pub empty: Option<Cluster>,
    /// Nodes left out, with why.
    pub bad_nodes: Vec<(String, String)>,
    /// Per gang: members bound, and a node one of them is on.
    pub gang_bound: HashMap<String, (u32, Option<String>)>,
    /// The cluster offers more than one device resource: pods are kept to the one they ask.
    pub separate: bool,
    /// Preemptors held on their nominated node while their victims end: uid → node.
    pub reserved: HashMap<String, String>,
    /// Bound pods whose requests xpu cannot read, each counted as using its whole node.
    pub unreadable: Vec<(PodKey, String)>,
    /// What each queue holds bound (a pod whose requests cannot be read charges nothing: its
    /// node counts as full instead).
    pub queue_used: HashMap<String, Amounts>,
}

/// Nodes in name order with what every bound (or assumed, or reserved) pod uses taken. With a
/// [`Memo`] (and not for a what-if), the cluster the last cycle built is patched instead: only
/// the nodes whose object, bound pods or last cycle's placements changed are built again
/// ([`crate::base`]); the result is the same cluster.
pub(crate) fn cluster_of(snap: &Snapshot<'_>) -> Built {
    let mut bad_nodes = Vec::new();
    // What the pods the ledger does not count use, per node (without a ledger: every pod).
    let mut extra: HashMap<String, Used> = HashMap::new();
    let mut gang_bound: HashMap<String, (u32, Option<String>)> = HashMap::new();
    let mut unreadable = Vec::new();
    let mut queue_used: HashMap<String, Amounts> = HashMap::new();
    let job_shape = |uid: &str| snap.jobs.get(uid).copied();
    // Per node, the lowest priority among its pods being deleted (preemption victims, say).
    let mut terminating: HashMap<String, i32> = HashMap::new();
    let mut count_gang = |p: &Pod, node: &str| {
        // A malformed gang label only matters for a pending pod, which is told about it.
        if let Ok(Some(g)) = convert::gang(p, job_shape, snap.pod_groups) {
            let e = gang_bound.entry(g.key).or_insert((0, None));
            e.0 += 1;
            // The least node name: the same whatever order the pods come in.
            if e.1.as_deref().is_none_or(|n| node < n) {
                e.1 = Some(node.to_owned());
            }
        }
    };
    // The ledger counts the pods the watch shows bound; a what-if leaves some out, so it sums.
    let ledger = snap.ledger.filter(|_| snap.hold_out.is_none()).map(crate::ledger::Ledger::read);
    if let Some(book) = &ledger {
        for (node, b) in book.nodes() {
            if let Some(prio) = b.terminating() {
                terminating.insert(node.to_owned(), prio);
            }
        }
        for (key, node, e) in book.unreadable() {
            unreadable.push((key.clone(), format!("counted as using all of node {node}: {e}")));
        }
        let mut queues: HashMap<(&str, Option<&str>), String> = HashMap::new();
        for ((ns, label), amounts) in book.charges() {
            let q = queues.entry((ns, label)).or_insert_with(|| queue_for(snap, ns, label));
            queue_used.entry(q.clone()).or_default().add(&amounts);
        }
        for (p, node) in book.gang_pods() {
            count_gang(p, node);
        }
    }
    let mut memo = Held::of(snap);
    // With a ledger, pods the watch shows bound are its: only the others are read.
    let pods = if ledger.is_some() { snap.maybe_unbound() } else { snap.pods };
    for p in pods {
        if terminal(p) {
            continue;
        }
        let Some(node) = bound_node(p, snap.assumed) else { continue };
        let uid = p.metadata.uid.as_deref().unwrap_or("");
        if let Some(book) = &ledger {
            // Bound as the watch shows it, or assumed but already counted: the ledger sees
            // each event before the cache does.
            let shown =
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_some_and(|n| !n.is_empty());
            if shown || book.holds(uid) {
                continue;
            }
        }
        if snap.hold_out.is_some_and(|h| h.contains(uid)) {
            continue;
        }
        if p.metadata.deletion_timestamp.is_some() {
            let prio = p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
            let e = terminating.entry(node.to_owned()).or_insert(prio);
            *e = (*e).min(prio);
        }
        // A bound pod holds what it asks for, whichever scheduler placed it and whatever xpu
        // itself would refuse to place (two device kinds, DRA claims), on its node and on its
        // queue's account.
        let usage = memo.usage(p);
        if let Ok(u) = usage.as_ref() {
            queue_used.entry(queue_of(snap, p)).or_default().add(&Amounts::of(u));
        }
        let gpus = snap.assumed_gpus.get(uid).cloned().or_else(|| share::recorded_gpus(p));
        if let Err(e) = extra.entry(node.to_owned()).or_default().add(uid, usage.as_ref(), gpus)
            && let Some(key) = PodKey::of(p)
        {
            unreadable.push((key, format!("counted as using all of node {node}: {e}")));
        }
        count_gang(p, node);
    }

    // Nodes in name order (the tie-break order, the same on every replica and restart).
    let mut nodes: Vec<&Arc<Node>> = snap.nodes.iter().collect();
    nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let mut views = Vec::with_capacity(nodes.len());
    let mut offered: BTreeSet<&'static str> = Default::default();
    for n in nodes {
        let view = memo.node(n);
        if let Ok(v) = view.as_ref() {
            for (res, _) in convert::DEVICE_RESOURCES {
                let offers =
                    |id: &str| id.strip_prefix(res).is_some_and(|rest| rest.starts_with('/'));
                if !offered.contains(res) && v.spec.devices.iter().any(|d| offers(&d.id)) {
                    offered.insert(res);
                }
            }
        }
        views.push((n.metadata.name.as_deref().unwrap_or_default(), view));
    }
    // A pod that preempted others keeps its place on its nominated node while they end:
    // counted there as if bound, so nothing else takes the space it evicted for.
    let mut reserved: HashMap<String, String> = HashMap::new();
    for p in snap.maybe_unbound().iter().filter(|p| waits_for(p, snap.scheduler_name, snap.assumed))
    {
        let Some(node) = p.status.as_ref().and_then(|s| s.nominated_node_name.as_deref()) else {
            continue;
        };
        let prio = p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0);
        if terminating.get(node).is_none_or(|m| *m >= prio) {
            continue;
        }
        let uid = p.metadata.uid.as_deref().unwrap_or("");
        if let Err(e) = extra.entry(node.to_owned()).or_default().add(uid, &convert::usage(p), None)
            && let Some(key) = PodKey::of(p)
        {
            unreadable.push((key, format!("counted as using all of node {node}: {e}")));
        }
        reserved.insert(p.metadata.uid.clone().unwrap_or_default(), node.to_owned());
    }
    // Only a cluster that offers more than one device resource needs to keep them apart.
    let separate = offered.len() > 1;
    // Nodes carry their name as a label only when a waiting pod has DRA claims or asks for an
    // extended resource xpu does not place as devices (a label unique to each node gives every
    // node a shape of its own in xpu-sched).
    let no_dra = HashMap::new();
    let dra_backed = snap.dra.as_ref().map_or(&no_dra, |d| d.extended);
    let by_name = snap.maybe_unbound().iter().any(|p| {
        waits_for(p, snap.scheduler_name, snap.assumed)
            && (p.spec.as_ref().is_some_and(|s| {
                s.resource_claims.as_ref().is_some_and(|c| !c.is_empty())
                    || convert::has_match_fields(s)
            }) || snap.dra.as_ref().is_some_and(|d| extended_served(d, p).is_some())
                || !crate::extended::requests(p, dra_backed).is_empty())
    });
    let flags = crate::base::Flags { by_name, separate, offered };
    let books = crate::base::Books { ledger: ledger.as_deref(), extra: &extra };
    // A what-if leaves pods out: it neither takes nor leaves the kept cluster.
    let keep = snap.memo.is_some() && snap.hold_out.is_none();
    let kept = if keep { memo.take_base() } else { None };
    let mut stats = crate::base::BuildStats::default();
    let (cluster, empty, base) =
        crate::base::build(kept, keep, &views, &books, flags, &mut bad_nodes, &mut stats);
    // A what-if's build is not a cycle's: it is not counted.
    if keep && let Some(s) = memo.stats() {
        s.whole += stats.whole;
        s.patched += stats.patched;
        s.nodes += stats.nodes;
    }
    if let Some(base) = base {
        memo.put_base(base);
    }

    // In uid order, whichever way the pods were counted.
    unreadable.sort_by(|a, b| a.0.uid.cmp(&b.0.uid));
    Built { cluster, empty, bad_nodes, gang_bound, separate, reserved, unreadable, queue_used }
}

/// xpu-sched says `Insufficient gpu`; Kubernetes users read resource names.
fn kube_words(msg: &str, resource: Option<&str>) -> String {
    let gpu = resource.unwrap_or("nvidia.com/gpu");
    msg.replace("Insufficient gpu", &format!("Insufficient {gpu}"))
        .replace("Insufficient tpu", "Insufficient google.com/tpu")
}

fn single_group(ask: &PodAsk) -> TaskGroup {
    match &ask.tpu {
        // A single-host slice: one pod, all the host's chips.
        Some((acc, topo)) if xpu_core::tpu::slice(acc, topo).is_ok_and(|s| s.hosts == 1) => {
            TaskGroup::tpu(acc, topo, ask.task.clone())
        }
        _ => TaskGroup::new(1, ask.task.clone()),
    }
}

/// The group for a TPU gang: a whole slice (one pod per host of one node pool), or the members
/// still missing from a slice whose other hosts are bound (same pool).
#[allow(clippy::too_many_arguments)]
fn tpu_group(
    acc: &str,
    topo: &str,
    ask: &PodAsk,
    need: usize,
    size: u32,
    bound: u32,
    bound_pool: Option<String>,
) -> Result<TaskGroup, String> {
    let shape = xpu_core::tpu::slice(acc, topo).map_err(|e| {
        format!("nodeSelector {GKE_TPU_ACCELERATOR}={acc}, {GKE_TPU_TOPOLOGY}={topo}: {e}")
    })?;
    if shape.hosts != size {
        return Err(format!(
            "topology {topo} of {acc} has {} hosts but the gang has {size} pods; make completions and parallelism {}",
            shape.hosts, shape.hosts
        ));
    }
    if ask.resources.devices != shape.chips_per_host as u16 {
        return Err(format!(
            "each host of {acc} {topo} has {} chips; ask for google.com/tpu: {} (the pod asks for {})",
            shape.chips_per_host, shape.chips_per_host, ask.resources.devices
        ));
    }
    if bound == 0 {
        return Ok(TaskGroup::tpu(acc, topo, ask.task.clone()));
    }
    let mut task = ask.task.clone();
    task.pool = bound_pool;
    Ok(TaskGroup::new(need as u32, task).gang())
}

/// One pod on its own.
#[allow(clippy::too_many_arguments)]
fn submit_pod(
    sched: &mut Scheduler,
    units: &mut Vec<Unit>,
    books: &Books<'_>,
    key: PodKey,
    ask: &PodAsk,
    now: u64,
    out: &mut Plan,
    explain: &mut dyn FnMut(&str) -> bool,
) {
    let job = Job::single(key.to_string(), single_group(ask))
        .priority(ask.priority)
        .queue(ask.queue.clone());
    let resource = ask.resources.device_resource;
    let asks = (share_ask(ask), amounts(ask));
    submit(sched, units, books, job, vec![key], None, resource, asks, now, out, explain);
}

/// What one pod asking `ask` holds once bound, in a quota's units.
fn amounts(ask: &PodAsk) -> Amounts {
    let mut devices = BTreeMap::new();
    if let Some(res) = ask.resources.device_resource {
        let n =
            if res == SHARE_RESOURCE { share_ask(ask) } else { u64::from(ask.resources.devices) };
        devices.insert(res, n);
    }
    Amounts {
        cpu_milli: ask.resources.cpu_milli,
        memory_mib: ask.resources.memory_mib,
        pods: 1,
        devices,
    }
}

/// The `xpu.dev/queue` label of a pod.
fn queue_label(p: &Pod) -> Option<&str> {
    p.metadata.labels.as_ref()?.get(convert::QUEUE_LABEL).map(String::as_str)
}

/// The queues, and what each holds (bound, assumed, and started in this cycle).
struct Books<'a> {
    queues: &'a Queues,
    used: HashMap<String, Amounts>,
}

/// The queue a bound (or assumed) pod is charged to: the one its namespace and label give it,
/// or, where the label names a queue the namespace does not own, its namespace's default queue:
/// never another tenant's.
fn queue_of(snap: &Snapshot<'_>, p: &Pod) -> String {
    queue_for(snap, p.metadata.namespace.as_deref().unwrap_or("default"), queue_label(p))
}

/// The queue of a pod of namespace `ns` whose queue label is `label`.
fn queue_for(snap: &Snapshot<'_>, ns: &str, label: Option<&str>) -> String {
    let labels = snap.namespace_labels.get(ns);
    snap.queues.resolve(ns, labels, label).unwrap_or_else(|_| snap.queues.default_for(ns, labels))
}

/// What a pod asks of [`SHARE_RESOURCE`], 0 for any other pod.
fn share_ask(ask: &PodAsk) -> u64 {
    if ask.resources.device_resource != Some(SHARE_RESOURCE) {
        return 0;
    }
    match ask.resources.share_milli {
        0 => u64::from(ask.resources.devices) * convert::MILLI_PER_GPU,
        m => u64::from(m),
    }
}

/// Submits one unit, unless its queue's quota cannot take it even alone. `asks`: what each
/// pod asks of [`SHARE_RESOURCE`] (0: none), and what the unit holds once bound.
#[allow(clippy::too_many_arguments)]
fn submit(
    sched: &mut Scheduler,
    units: &mut Vec<Unit>,
    books: &Books<'_>,
    job: Job,
    pods: Vec<PodKey>,
    gang: Option<String>,
    resource: Option<&'static str>,
    (share_ask, amounts): (u64, Amounts),
    now: u64,
    out: &mut Plan,
    explain: &mut dyn FnMut(&str) -> bool,
) {
    let queue = job.queue.clone();
    if let Some(why) = books.queues.over_quota(&queue, books.used.get(&queue), &amounts) {
        for k in pods {
            if explain(&k.uid) {
                out.waiting.push((k, why.clone()));
            }
        }
        return;
    }
    let preemption = out.preemption_on;
    let spec = preemption.then(|| job.clone());
    match sched.submit(job, now) {
        Ok(id) => units.push(Unit {
            pods,
            gang,
            job: Some(id),
            resource,
            share_ask,
            spec,
            flex: None,
            note: String::new(),
            queue,
            amounts,
            offsets: vec![0],
        }),
        Err(e) => {
            for k in pods {
                if explain(&k.uid) {
                    out.waiting.push((k, e.to_string()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, pool: &str, topo: &str, ready: bool) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "labels": {
                    "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                    "cloud.google.com/gke-tpu-topology": topo,
                    "cloud.google.com/gke-nodepool": pool,
                    "cloud.google.com/gke-flex-start": "true" } },
                "status": { "allocatable": { "cpu": "32", "memory": "128Gi", "pods": "110", "google.com/tpu": "4" },
                            "conditions": [{ "type": "Ready", "status": if ready { "True" } else { "False" } }] }
            }))
            .unwrap(),
        )
    }

    fn tpu_pod(name: &str, index: u32, job_uid: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": "default", "uid": format!("uid-{name}"),
                    "annotations": { "batch.kubernetes.io/job-completion-index": index.to_string() },
                    "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": "job-1", "uid": job_uid, "controller": true }] },
                "spec": { "schedulerName": "xpu",
                    "nodeSelector": { "cloud.google.com/gke-flex-start": "true",
                        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                        "cloud.google.com/gke-tpu-topology": "2x2x2" },
                    "containers": [{ "name": "c", "resources": { "requests": { "google.com/tpu": "4" }, "limits": { "google.com/tpu": "4" } } }] },
                "status": { "phase": "Pending" }
            }))
            .unwrap(),
        )
    }

    /// A pod bound by another scheduler holds its CPU and every device it asks for, even when
    /// xpu would not place it itself (two device kinds, a DRA claim).
    #[test]
    fn a_bound_pod_xpu_would_refuse_still_holds_what_it_asks() {
        let gpu_node: Arc<Node> = Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": "n" },
                "status": { "allocatable": { "cpu": "4", "memory": "16Gi", "pods": "110",
                                             "nvidia.com/gpu": "2", "amd.com/gpu": "2" },
                            "conditions": [{ "type": "Ready", "status": "True" }] }
            }))
            .unwrap(),
        );
        let bound: Arc<Pod> = Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": "other", "namespace": "default", "uid": "u-other" },
                "spec": { "nodeName": "n", "schedulerName": "default-scheduler",
                    "resourceClaims": [{ "name": "c", "resourceClaimName": "claim" }],
                    "containers": [{ "name": "c", "resources": {
                        "requests": { "cpu": "3", "nvidia.com/gpu": "2", "amd.com/gpu": "1" },
                        "claims": [{ "name": "c" }] } }] },
                "status": { "phase": "Running" }
            }))
            .unwrap(),
        );
        let pending: Arc<Pod> = Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": "mine", "namespace": "default", "uid": "u-mine" },
                "spec": { "schedulerName": "xpu",
                    "containers": [{ "name": "c", "resources": { "requests": { "cpu": "2" } } }] },
                "status": { "phase": "Pending" }
            }))
            .unwrap(),
        );
        let (nodes, pods) = (vec![gpu_node], vec![bound, pending]);
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let snap =
            Snapshot { shares: true, ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed) };
        let plan = plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
        assert!(plan.binds.is_empty(), "only 1 of 4 CPUs is free: {:?}", plan.binds);
        assert!(plan.waiting[0].1.contains("Insufficient cpu"), "{:?}", plan.waiting);
    }

    /// An extended resource xpu does not place as devices (MIG's mixed strategy's
    /// `nvidia.com/mig-1g.18gb`) keeps the pod to nodes whose allocatable less what bound pods
    /// ask for holds it, as kube-scheduler's NodeResourcesFit does; none free: it waits, saying
    /// which.
    #[test]
    fn extended_resources_keep_pods_to_nodes_with_room() {
        let node = |name: &str, mig: &str| -> Arc<Node> {
            Arc::new(
                serde_json::from_value(json!({
                    "metadata": { "name": name },
                    "status": { "allocatable": { "cpu": "16", "memory": "64Gi", "pods": "110",
                                                 "nvidia.com/mig-1g.18gb": mig },
                                "conditions": [{ "type": "Ready", "status": "True" }] }
                }))
                .unwrap(),
            )
        };
        let pod = |name: &str, node: Option<&str>, n: u32| -> Arc<Pod> {
            Arc::new(
                serde_json::from_value(json!({
                    "metadata": { "name": name, "namespace": "default", "uid": format!("u-{name}") },
                    "spec": { "schedulerName": "xpu", "nodeName": node,
                        "containers": [{ "name": "c", "resources": {
                            "limits": { "nvidia.com/mig-1g.18gb": n.to_string() } } }] },
                    "status": { "phase": if node.is_some() { "Running" } else { "Pending" } }
                }))
                .unwrap(),
            )
        };
        // a has 2, one held; b has none; c has 3, all held.
        let nodes = vec![node("a", "2"), node("b", "0"), node("c", "3")];
        let pods = vec![pod("on-a", Some("a"), 1), pod("on-c", Some("c"), 3), pod("new", None, 1)];
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let snap = Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed);
        let p = plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
        let bound: Vec<(&str, &str)> =
            p.binds.iter().map(|b| (b.pod.name.as_str(), b.node.as_str())).collect();
        assert_eq!(bound, [("new", "a")], "{:?}", p.waiting);

        let pods = vec![pod("on-a", Some("a"), 2), pod("on-c", Some("c"), 3), pod("new", None, 1)];
        let snap = Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed);
        let p = plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
        assert!(p.binds.is_empty(), "{:?}", p.binds);
        assert!(
            p.waiting[0].1.contains("0/3 nodes have 1 nvidia.com/mig-1g.18gb free"),
            "{:?}",
            p.waiting
        );
    }

    #[test]
    fn a_multi_host_tpu_job_lands_on_the_hosts_of_one_fitting_slice() {
        let nodes = vec![
            node("wrong-0", "wrong", "2x2x4", true),
            node("wrong-1", "wrong", "2x2x4", true),
            node("half-0", "half", "2x2x2", true),
            node("half-1", "half", "2x2x2", false),
            node("slice-0", "slice", "2x2x2", true),
            node("slice-1", "slice", "2x2x2", true),
        ];
        let pods = vec![tpu_pod("job-1-0", 0, "j"), tpu_pod("job-1-1", 1, "j")];
        let jobs = HashMap::from([("j".to_owned(), (2, 2, true))]);
        let assumed = HashMap::new();
        let snap =
            Snapshot { shares: true, ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed) };
        let plan = plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
        assert!(plan.waiting.is_empty(), "{:?}", plan.waiting);
        let mut on: Vec<&str> = plan.binds.iter().map(|b| b.node.as_str()).collect();
        on.sort_unstable();
        assert_eq!(on, ["slice-0", "slice-1"]);
    }

    /// A TPU gang pod aimed at flex-start, pointed at request `req` (attempt `attempt`).
    fn flex_pod(name: &str, index: u32, req: Option<(&str, u32)>) -> Arc<Pod> {
        let mut p = Arc::unwrap_or_clone(tpu_pod(name, index, "j"));
        if let Some((r, a)) = req {
            let notes = p.metadata.annotations.get_or_insert_default();
            notes.insert(flex::CONSUME.into(), r.into());
            notes.insert(flex::ATTEMPT.into(), a.to_string());
        }
        Arc::new(p)
    }

    fn request(name: &str, conds: &[(&str, i64)]) -> Arc<ProvisioningRequest> {
        let mut r: ProvisioningRequest = serde_json::from_value(json!({
            "apiVersion": "autoscaling.x-k8s.io/v1", "kind": "ProvisioningRequest",
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "provisioningClassName": flex::CLASS,
                      "podSets": [{ "podTemplateRef": { "name": name }, "count": 2 }] }
        }))
        .unwrap();
        let conditions = conds
            .iter()
            .map(|(t, at)| {
                serde_json::from_value(json!({ "type": t, "status": "True", "reason": "R",
                    "message": format!("{t} said"), "lastTransitionTime":
                    k8s_openapi::jiff::Timestamp::from_second(*at).unwrap().to_string() }))
                .unwrap()
            })
            .collect();
        r.status = Some(flex::ProvisioningRequestStatus { conditions, ..Default::default() });
        Arc::new(r)
    }

    /// The flex-start lifecycle of one gang, cycle by cycle: no nodes → one request for both
    /// pods; request pending → the pods hold nothing and say why; provisioned and the nodes
    /// there → both bind; failed → told, asked again after the backoff under a new name.
    #[test]
    fn a_flex_start_gang_asks_once_waits_binds_whole_and_retries_with_backoff() {
        let jobs = HashMap::from([("j".to_owned(), (2, 2, true))]);
        let assumed = HashMap::new();
        let cfg = SchedulerConfig::default();
        let run =
            |nodes: &[Arc<Node>], pods: &[Arc<Pod>], reqs: &[Arc<ProvisioningRequest>], now| {
                let snap = Snapshot {
                    provisioning: Some(reqs),
                    provisioning_backoff: (30, 900),
                    unix_now: now,
                    ..Snapshot::new("xpu", nodes, pods, &jobs, &assumed)
                };
                plan(&snap, &cfg, 0, &mut |_| true)
            };
        // Nothing fits: one request, for the whole gang.
        let fresh = vec![flex_pod("job-1-0", 0, None), flex_pod("job-1-1", 1, None)];
        let p = run(&[], &fresh, &[], 1000);
        assert_eq!(p.provisions.len(), 1, "{:?}", p.waiting);
        let pr = &p.provisions[0];
        assert_eq!((pr.name(), pr.attempt, pr.pods.len()), ("job-1-flex-1", 1, 2));
        assert_eq!(pr.request.spec.pod_sets[0].count, 2);
        assert!(
            p.waiting[0].1.contains(
                "asked for flex-start capacity: ProvisioningRequest default/job-1-flex-1"
            ),
            "{:?}",
            p.waiting
        );

        // Annotated, the request not yet provisioned: nothing submitted, nothing asked again.
        let asked = vec![
            flex_pod("job-1-0", 0, Some(("job-1-flex-1", 1))),
            flex_pod("job-1-1", 1, Some(("job-1-flex-1", 1))),
        ];
        let slice = vec![node("s-0", "s", "2x2x2", true), node("s-1", "s", "2x2x2", true)];
        let p = run(&slice, &asked, &[request("job-1-flex-1", &[("Accepted", 900)])], 1000);
        assert!(p.binds.is_empty() && p.provisions.is_empty(), "{p:?}");
        assert!(
            p.waiting[0].1.contains("to be Provisioned; now Accepted (R): Accepted said"),
            "{:?}",
            p.waiting
        );
        // The watch has not shown the request yet: made again (the driver takes "exists").
        let p = run(&[], &asked, &[], 1000);
        assert_eq!(p.provisions.iter().map(|p| p.name()).collect::<Vec<_>>(), ["job-1-flex-1"]);

        // Provisioned, nodes there: both bind, to the one slice.
        let p = run(&slice, &asked, &[request("job-1-flex-1", &[("Provisioned", 900)])], 1000);
        assert_eq!(p.binds.len(), 2, "{:?}", p.waiting);
        // Provisioned, nodes not there yet: waits, says so, asks nothing.
        let p = run(&[], &asked, &[request("job-1-flex-1", &[("Provisioned", 900)])], 1000);
        assert!(p.provisions.is_empty());
        assert!(
            p.waiting[0].1.contains("is Provisioned: waiting for the new nodes"),
            "{:?}",
            p.waiting
        );

        // Failed at 900: held, told when; after 30 s, attempt 2 replaces it.
        let failed = [request("job-1-flex-1", &[("Failed", 900)])];
        let p = run(&slice, &asked, &failed, 910);
        assert!(p.binds.is_empty() && p.provisions.is_empty(), "a failed request holds nothing");
        assert!(
            p.waiting[0].1.contains(
                "ended, Failed (R): Failed said; asking again at 1970-01-01T00:15:30Z (attempt 2)"
            ),
            "{:?}",
            p.waiting
        );
        let p = run(&[], &asked, &failed, 930);
        let pr = &p.provisions[0];
        assert_eq!(
            (pr.name(), pr.attempt, pr.retire.as_deref()),
            ("job-1-flex-2", 2, Some("job-1-flex-1"))
        );
        // Attempt 2 expired at 2000 waits 60 s.
        let later = vec![
            flex_pod("job-1-0", 0, Some(("job-1-flex-2", 2))),
            flex_pod("job-1-1", 1, Some(("job-1-flex-2", 2))),
        ];
        let expired = [request("job-1-flex-2", &[("Provisioned", 1500), ("BookingExpired", 2000)])];
        assert!(run(&[], &later, &expired, 2059).provisions.is_empty());
        assert_eq!(run(&[], &later, &expired, 2060).provisions[0].name(), "job-1-flex-3");
    }

    /// A pod's annotations cannot make xpu create or delete an object it would not have named
    /// itself: a request named otherwise is only waited on and reported.
    #[test]
    fn pod_annotations_cannot_steer_what_xpu_creates_or_deletes() {
        let jobs = HashMap::from([("j".to_owned(), (2, 2, true))]);
        let assumed = HashMap::new();
        let steered = vec![
            flex_pod("job-1-0", 0, Some(("someone-elses", 1))),
            flex_pod("job-1-1", 1, Some(("someone-elses", 1))),
        ];
        for reqs in [vec![], vec![request("someone-elses", &[("Failed", 0)])]] {
            let snap = Snapshot {
                provisioning: Some(&reqs),
                unix_now: 100_000,
                ..Snapshot::new("xpu", &[], &steered, &jobs, &assumed)
            };
            let p = plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
            assert!(p.provisions.is_empty(), "{:?}", p.provisions);
            assert!(p.binds.is_empty());
        }
    }

    fn gpu_pod(name: &str, prio: i32, node: Option<&str>, start: Option<&str>) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": "default", "uid": format!("u-{name}") },
                "spec": { "schedulerName": "xpu", "priority": prio, "nodeName": node,
                    "containers": [{ "name": "c", "resources": { "limits": { "nvidia.com/gpu": "1" } } }] },
                "status": { "phase": if node.is_some() { "Running" } else { "Pending" }, "startTime": start }
            }))
            .unwrap(),
        )
    }

    /// A high-priority pod that fits nowhere preempts the low-priority pod that has run least,
    /// and is nominated to its node; with that pod excluded (a budget refused it), the other.
    #[test]
    fn preemption_takes_the_least_work_lost_and_respects_exclusions() {
        let n: Arc<Node> = Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": "a" },
                "status": { "allocatable": { "cpu": "8", "memory": "8Gi", "nvidia.com/gpu": "2" },
                            "conditions": [{ "type": "Ready", "status": "True" }] }
            }))
            .unwrap(),
        );
        let nodes = vec![n];
        let pods = vec![
            gpu_pod("old", 100, Some("a"), Some("2026-01-01T00:00:00Z")),
            gpu_pod("young", 100, Some("a"), Some("2026-01-01T00:50:00Z")),
            gpu_pod("high", 1000, None, None),
        ];
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let unix_now = 1_767_229_200; // 2026-01-01T01:00:00Z
        let snap = Snapshot {
            preemption: true,
            unix_now,
            ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
        };
        let config = SchedulerConfig {
            queue: xpu_sched::QueuePolicy::Fair,
            lanes: true,
            fit_per_task: true,
            ..SchedulerConfig::default()
        };
        let plan = plan(&snap, &config, 100, &mut |_| true);
        assert_eq!(plan.preemptions.len(), 1, "{plan:?}");
        let p = &plan.preemptions[0];
        assert_eq!(p.victims.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["young"]);
        assert_eq!(p.nominate[0].0.name, "high");
        assert_eq!(p.nominate[0].1, "a");
        let excluded: std::collections::HashSet<String> = ["u-young".to_owned()].into();
        let snap = Snapshot { excluded: &excluded, ..snap };
        let plan = super::plan(&snap, &config, 100, &mut |_| true);
        assert_eq!(plan.preemptions[0].victims[0].name, "old", "{plan:?}");
    }

    fn share_node(name: &str, res: &str, n: &str) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name },
                "status": { "allocatable": { "cpu": "64", "memory": "64Gi", res: n },
                            "conditions": [{ "type": "Ready", "status": "True" }] }
            }))
            .unwrap(),
        )
    }

    fn share_pod(name: &str, milli: u64, node: Option<&str>, gpus: Option<&str>) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": "default", "uid": format!("u-{name}"),
                              "annotations": gpus.map(|g| json!({ share::GPUS_ANNOTATION: g })) },
                "spec": { "schedulerName": "xpu", "nodeName": node,
                    "containers": [{ "name": "c", "resources": { "limits": { SHARE_RESOURCE: milli.to_string() } } }] },
                "status": { "phase": if node.is_some() { "Running" } else { "Pending" } }
            }))
            .unwrap(),
        )
    }

    /// Per-GPU use comes from the bound pods' recorded choices and the scheduler's own assumed
    /// ones; a share pod never lands on a node that offers its GPUs whole.
    #[test]
    fn shares_follow_recorded_and_assumed_gpus_and_stay_off_whole_gpu_nodes() {
        let nodes = vec![
            share_node("a-whole", "nvidia.com/gpu", "4"),
            share_node("b-share", SHARE_RESOURCE, "2000"),
        ];
        let pods = vec![
            // GPU 0 holds 500 recorded on the pod and 300 only assumed so far.
            share_pod("bound", 500, Some("b-share"), Some("0")),
            share_pod("assumed", 300, None, None),
            share_pod("new", 600, None, None),
        ];
        let jobs = HashMap::new();
        let assumed = HashMap::from([("u-assumed".to_owned(), "b-share".to_owned())]);
        let assumed_gpus = HashMap::from([("u-assumed".to_owned(), vec![0u16])]);
        let snap = Snapshot {
            shares: true,
            assumed_gpus: &assumed_gpus,
            ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
        };
        let plan = plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
        assert!(plan.waiting.is_empty(), "{:?}", plan.waiting);
        let b = &plan.binds[0];
        assert_eq!((b.pod.name.as_str(), b.node.as_str()), ("new", "b-share"));
        assert_eq!(b.share, Some((vec![1], 600)), "GPU 0 has 200 left, so GPU 1");

        // Without the key, share pods wait and are told why.
        let snap = Snapshot { shares: false, ..snap };
        let plan = super::plan(&snap, &SchedulerConfig::default(), 0, &mut |_| true);
        assert!(plan.binds.is_empty());
        assert!(plan.waiting[0].1.contains("--share-key"), "{:?}", plan.waiting);
    }

    /// A pod in `ns` asking `gpus` whole GPUs, bound to `node` or pending, with labels.
    fn tenant_pod(
        ns: &str,
        name: &str,
        gpus: u32,
        node: Option<&str>,
        labels: serde_json::Value,
    ) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "namespace": ns, "uid": format!("u-{ns}-{name}"),
                              "labels": labels,
                              "creationTimestamp": format!("2026-01-01T00:00:{:02}Z", name.len()) },
                "spec": { "schedulerName": "xpu", "nodeName": node,
                    "containers": [{ "name": "c", "resources": {
                        "requests": { "cpu": "100m" },
                        "limits": { "nvidia.com/gpu": gpus.to_string() } } }] },
                "status": { "phase": if node.is_some() { "Running" } else { "Pending" } }
            }))
            .unwrap(),
        )
    }

    fn gpu_node(name: &str, gpus: u32) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name },
                "status": { "allocatable": { "cpu": "32", "memory": "64Gi", "nvidia.com/gpu": gpus.to_string() },
                            "conditions": [{ "type": "Ready", "status": "True" }] }
            }))
            .unwrap(),
        )
    }

    fn fair() -> SchedulerConfig {
        SchedulerConfig {
            queue: xpu_sched::QueuePolicy::Fair,
            lanes: true,
            fit_per_task: true,
            ..SchedulerConfig::default()
        }
    }

    /// A label naming another namespace's queue is refused on the pod, and the pod it would have
    /// held up binds; a bound pod with such a label is charged to its own namespace.
    #[test]
    fn a_tenant_cannot_join_or_charge_another_tenants_queue() {
        let nodes = vec![gpu_node("n", 8)];
        let pods = vec![
            tenant_pod("team-x", "running", 5, Some("n"), json!({})),
            // Asks for 4 of the 3 free GPUs, in team-b's queue by its label.
            tenant_pod("team-a", "big", 4, None, json!({ "xpu.dev/queue": "team-b" })),
            tenant_pod("team-b", "small-one", 1, None, json!({})),
        ];
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let snap = Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed);
        let plan = plan(&snap, &fair(), 0, &mut |_| true);
        assert_eq!(plan.binds.len(), 1, "{plan:?}");
        assert_eq!(plan.binds[0].pod.name, "small-one");
        let (k, why) = &plan.waiting[0];
        assert_eq!(k.name, "big");
        assert!(
            why.contains(
                "metadata.labels[xpu.dev/queue]: namespace team-a may not use queue \"team-b\""
            ),
            "{why}"
        );

        // Bound with a forged label, the usage lands on team-a's own account.
        let forged =
            tenant_pod("team-a", "held", 1, Some("n"), json!({ "xpu.dev/queue": "team-b" }));
        let used = cluster_of(&Snapshot::new("xpu", &nodes, &[forged], &jobs, &assumed)).queue_used;
        assert_eq!(used.keys().collect::<Vec<_>>(), ["namespace/team-a"]);
    }

    /// Fair share counts what each queue already holds bound: with one GPU free, the queue
    /// holding nothing gets it before the queue holding four, whichever pod came first.
    #[test]
    fn fair_share_counts_what_queues_hold_bound() {
        let nodes = vec![gpu_node("n", 5)];
        let pods = vec![
            tenant_pod("team-a", "a-running", 4, Some("n"), json!({})),
            tenant_pod("team-a", "a", 1, None, json!({})),
            tenant_pod("team-b", "b-later", 1, None, json!({})),
        ];
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let snap = Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed);
        let plan = plan(&snap, &fair(), 0, &mut |_| true);
        assert_eq!(plan.binds.iter().map(|b| b.pod.name.as_str()).collect::<Vec<_>>(), ["b-later"]);
    }

    /// A queue's quota holds against what its pods hold bound, and against pods placed in the
    /// same cycle that each fit it alone.
    #[test]
    fn queue_quotas_hold_across_bound_pods_and_within_a_cycle() {
        let mapping = Queues::parse(
            "queues: [{ name: research, namespaces: [team-a, team-b], quota: { nvidia.com/gpu: 3 } }]",
            "xpu-system/xpu-queues",
        )
        .unwrap();
        let nodes = vec![gpu_node("n", 8)];
        let pods = vec![
            tenant_pod("team-a", "running", 1, Some("n"), json!({})),
            tenant_pod("team-a", "two", 2, None, json!({})),
            tenant_pod("team-b", "three", 3, None, json!({})),
            tenant_pod("team-b", "one-b", 1, None, json!({})),
            tenant_pod("team-c", "free", 1, None, json!({})),
        ];
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let snap =
            Snapshot { queues: &mapping, ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed) };
        let plan = plan(&snap, &fair(), 0, &mut |_| true);
        let mut bound: Vec<&str> = plan.binds.iter().map(|b| b.pod.name.as_str()).collect();
        bound.sort_unstable();
        // 1 bound + 2 = 3; `three` never fits the quota; `one-b` fits alone but not after `two`.
        assert_eq!(bound, ["free", "two"], "{:?}", plan.waiting);
        let says = |name: &str| {
            plan.waiting.iter().find(|(k, _)| k.name == name).map(|(_, m)| m.clone()).unwrap()
        };
        assert!(says("three").contains("queue research is at its quota of 3 nvidia.com/gpu: 1 nvidia.com/gpu bound, this asks 3"), "{}", says("three"));
        assert!(
            says("one-b")
                .contains("quota of 3 nvidia.com/gpu: 3 nvidia.com/gpu bound, this asks 1"),
            "{}",
            says("one-b")
        );
    }

    /// A bound pod whose requests overflow is counted as using its whole node, with a warning.
    #[test]
    fn a_bound_pod_with_unreadable_requests_fills_its_node() {
        let nodes = vec![gpu_node("n", 8)];
        let bad: Arc<Pod> = Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": "bad", "namespace": "team-a", "uid": "u-bad" },
                "spec": { "nodeName": "n", "containers": [
                    { "name": "a", "resources": { "requests": { "cpu": "9223372036854775808m" } } },
                    { "name": "b", "resources": { "requests": { "cpu": "9223372036854775808m" } } }] },
                "status": { "phase": "Running" }
            }))
            .unwrap(),
        );
        let pods = vec![bad, tenant_pod("team-b", "p", 1, None, json!({}))];
        let (jobs, assumed) = (HashMap::new(), HashMap::new());
        let snap = Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed);
        let plan = plan(&snap, &fair(), 0, &mut |_| true);
        assert!(plan.binds.is_empty(), "{:?}", plan.binds);
        assert!(plan.waiting[0].1.contains("Insufficient"), "{:?}", plan.waiting);
        assert_eq!(plan.unreadable.len(), 1);
        assert!(
            plan.unreadable[0]
                .1
                .contains("counted as using all of node n: spec.containers[1].resources"),
            "{:?}",
            plan.unreadable
        );
    }

    /// The memo kept across cycles changes no decision: random sequences of node and pod events
    /// (added, changed, bound, ended, deleted; malformed quantities among them), and after every
    /// event a cycle with the memo plans exactly what a cycle converting everything plans; the
    /// memo then holds only live objects.
    #[test]
    fn a_memo_changes_no_decision_over_random_events() {
        let mut rng = xpu_sched::rng::Rng::new(0);
        for seed in 0..12u64 {
            rng = xpu_sched::rng::Rng::new(seed ^ rng.next_u64());
            let memo = Memo::default();
            let mut version = 0u64;
            let next = |v: &mut u64| {
                *v += 1;
                v.to_string()
            };
            let mut nodes: Vec<Arc<Node>> = Vec::new();
            let mut pods: Vec<Arc<Pod>> = Vec::new();
            let mut made = 0usize;
            let node_of = |name: &str,
                           gpus: u64,
                           cpu: &str,
                           ready: bool,
                           rv: String|
             -> Arc<Node> {
                Arc::new(
                    serde_json::from_value(json!({
                        "metadata": { "name": name, "resourceVersion": rv },
                        "status": { "allocatable": { "cpu": cpu, "memory": "64Gi", "pods": "110",
                                                     "nvidia.com/gpu": gpus.to_string() },
                                    "conditions": [{ "type": "Ready",
                                                     "status": if ready { "True" } else { "False" } }] }
                    }))
                    .unwrap(),
                )
            };
            let pod_of = |i: usize,
                          gpus: u64,
                          cpu: &str,
                          node: Option<&str>,
                          phase: &str,
                          rv: String| {
                Arc::new(
                    serde_json::from_value::<Pod>(json!({
                        "metadata": { "name": format!("p{i}"), "namespace": "default",
                                      "uid": format!("u{i}"), "resourceVersion": rv,
                                      "creationTimestamp": format!("2026-01-01T00:{:02}:{:02}Z", i / 60 % 60, i % 60) },
                        "spec": { "schedulerName": "xpu", "nodeName": node,
                            "containers": [{ "name": "c", "resources": {
                                "requests": { "cpu": cpu, "memory": "1Gi" },
                                "limits": { "nvidia.com/gpu": gpus.to_string() } } }] },
                        "status": { "phase": phase }
                    }))
                    .unwrap(),
                )
            };
            let cpus = ["1", "4", "500m", "lots"];
            for _ in 0..60 {
                match rng.index(8) {
                    0 if nodes.len() < 6 => {
                        let name = format!("n{}", rng.index(8));
                        if nodes.iter().all(|n| n.metadata.name.as_deref() != Some(&name)) {
                            let rv = next(&mut version);
                            nodes.push(node_of(
                                &name,
                                rng.below(9),
                                ["32", "8", "x"][rng.index(3)],
                                rng.index(5) > 0,
                                rv,
                            ));
                        }
                    }
                    1 if !nodes.is_empty() => {
                        let k = rng.index(nodes.len());
                        let name = nodes[k].metadata.name.clone().unwrap();
                        let rv = next(&mut version);
                        nodes[k] = node_of(
                            &name,
                            rng.below(9),
                            ["32", "16"][rng.index(2)],
                            rng.index(4) > 0,
                            rv,
                        );
                    }
                    2 if !nodes.is_empty() => {
                        nodes.remove(rng.index(nodes.len()));
                    }
                    3 | 4 => {
                        made += 1;
                        let rv = next(&mut version);
                        pods.push(pod_of(
                            made,
                            rng.below(4),
                            cpus[rng.index(4)],
                            None,
                            "Pending",
                            rv,
                        ));
                    }
                    5 if !pods.is_empty() && !nodes.is_empty() => {
                        // Bound by another hand (or by xpu, as the watch then shows it).
                        let k = rng.index(pods.len());
                        let node = nodes[rng.index(nodes.len())].metadata.name.clone();
                        let mut p = (*pods[k]).clone();
                        if let Some(spec) = p.spec.as_mut() {
                            spec.node_name = node;
                        }
                        p.metadata.resource_version = Some(next(&mut version));
                        pods[k] = Arc::new(p);
                    }
                    6 if !pods.is_empty() => {
                        let k = rng.index(pods.len());
                        let mut p = (*pods[k]).clone();
                        if let Some(st) = p.status.as_mut() {
                            st.phase =
                                Some(["Succeeded", "Failed", "Running"][rng.index(3)].into());
                        }
                        p.metadata.resource_version = Some(next(&mut version));
                        pods[k] = Arc::new(p);
                    }
                    7 if !pods.is_empty() => {
                        pods.remove(rng.index(pods.len()));
                    }
                    _ => {}
                }
                let (jobs, assumed) = (HashMap::new(), HashMap::new());
                let config = SchedulerConfig::default();
                let rebuilt = plan(
                    &Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed),
                    &config,
                    0,
                    &mut |_| true,
                );
                let snap = Snapshot {
                    memo: Some(&memo),
                    ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
                };
                let kept = plan(&snap, &config, 0, &mut |_| true);
                assert_eq!(kept, rebuilt, "seed {seed}: the memo changed the plan");
                memo.sweep();
                let (n, p, _) = memo.stats();
                assert_eq!(n, nodes.len(), "seed {seed}: the memo keeps a node that is gone");
                let live = pods
                    .iter()
                    .filter(|p| {
                        !terminal(p) && p.spec.as_ref().is_some_and(|s| s.node_name.is_some())
                    })
                    .count();
                assert_eq!(p, live, "seed {seed}: the memo keeps pods that ended or are gone");
            }
        }
    }

    /// The cheap check of which extended resources DRA serves for a pod says exactly what
    /// building the pod's claim says, over pods asking served and unserved resources, zero,
    /// malformed and repeated quantities, in one container or several.
    #[test]
    fn extended_served_agrees_with_the_claim_it_stands_for() {
        let slices = SliceIndex::new(std::iter::empty());
        let (classes, class_objects, claims) = (HashMap::new(), HashMap::new(), HashMap::new());
        let compiled = crate::claims::Compiled::default();
        let in_use = xpu_sched::dra::InUse::default();
        let in_flight = std::collections::HashSet::new();
        let extended: HashMap<String, String> = [
            ("example.com/gpu".to_owned(), "xgpu".to_owned()),
            (format!("{IMPLICIT_EXTENDED}xgpu"), "xgpu".to_owned()),
        ]
        .into();
        let dra = Dra {
            slices: &slices,
            classes: &classes,
            class_objects: &class_objects,
            claims: &claims,
            compiled: &compiled,
            in_use: &in_use,
            in_flight: &in_flight,
            extended: &extended,
        };
        let asks =
            ["example.com/gpu", "deviceclass.resource.kubernetes.io/xgpu", "nvidia.com/gpu", "cpu"];
        let amounts = ["1", "0", "2", "x", "-1"];
        let mut rng = xpu_sched::rng::Rng::new(7);
        for i in 0..400 {
            let containers: Vec<serde_json::Value> = (0..1 + rng.index(3))
                .map(|c| {
                    let mut limits = serde_json::Map::new();
                    let mut requests = serde_json::Map::new();
                    for _ in 0..rng.index(3) {
                        let m = if rng.index(2) == 0 { &mut limits } else { &mut requests };
                        m.insert(asks[rng.index(4)].into(), amounts[rng.index(5)].into());
                    }
                    json!({ "name": format!("c{c}"),
                            "resources": { "limits": limits, "requests": requests } })
                })
                .collect();
            let p: Pod = serde_json::from_value(json!({
                "metadata": { "name": format!("p{i}"), "namespace": "ns", "uid": format!("u{i}") },
                "spec": { "containers": containers } }))
            .unwrap();
            let want = extended_claim(&dra, &p).map(|(_, _, served)| served);
            assert_eq!(extended_served(&dra, &p), want, "{:?}", p.spec);
        }
    }

    /// The inter-pod index kept across cycles ([`crate::placed`]) equals one built afresh after
    /// every event of random sequences: nodes added, relabelled and removed; pods with labels,
    /// anti-affinity, affinity and spread (some across namespaces chosen by label) made, bound,
    /// assumed, relabelled, ended and deleted; namespaces relabelled. After each event the
    /// kept index holds the same pods on the same nodes, and a cycle with the memo plans what a
    /// cycle without it plans.
    #[test]
    fn the_kept_pod_index_equals_a_fresh_one_after_every_event() {
        let apps = ["a", "b", "c"];
        for seed in 0..16u64 {
            let mut rng = xpu_sched::rng::Rng::new(seed);
            let memo = Memo::default();
            let mut version = 0u64;
            let mut next = || {
                version += 1;
                version.to_string()
            };
            let node_of = |i: usize, zone: usize, rv: String| -> Arc<Node> {
                Arc::new(
                    serde_json::from_value(json!({
                        "metadata": { "name": format!("n{i}"), "resourceVersion": rv,
                                      "labels": { "kubernetes.io/hostname": format!("n{i}"),
                                                  "zone": format!("z{zone}") } },
                        "status": { "allocatable": { "cpu": "8", "memory": "64Gi", "pods": "110" },
                                    "conditions": [{ "type": "Ready", "status": "True" }] }
                    }))
                    .unwrap(),
                )
            };
            let pod_of = |i: usize, rng: &mut xpu_sched::rng::Rng, rv: String| -> Pod {
                let app = apps[rng.index(3)];
                let other = apps[rng.index(3)];
                let key = ["zone", "kubernetes.io/hostname"][rng.index(2)];
                let term = json!({ "labelSelector": { "matchLabels": { "app": other } },
                                   "topologyKey": key,
                                   "namespaceSelector": if rng.below(3) == 0 {
                                       json!({ "matchLabels": { "team": "x" } }) } else { json!(null) } });
                let affinity = match rng.index(4) {
                    0 => {
                        json!({ "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [term] } })
                    }
                    1 => {
                        json!({ "podAffinity": { "preferredDuringSchedulingIgnoredDuringExecution": [
                        { "weight": 10, "podAffinityTerm": term }] } })
                    }
                    2 => {
                        json!({ "podAntiAffinity": { "preferredDuringSchedulingIgnoredDuringExecution": [
                        { "weight": 5, "podAffinityTerm": term }] } })
                    }
                    _ => json!(null),
                };
                let spread = if rng.below(4) == 0 {
                    json!([{ "maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
                             "labelSelector": { "matchLabels": { "app": app } } }])
                } else {
                    json!(null)
                };
                let ns = ["ns1", "ns2"][rng.index(2)];
                serde_json::from_value::<Pod>(json!({
                    "metadata": { "name": format!("p{i}"), "namespace": ns,
                                  "uid": format!("u{i}"), "resourceVersion": rv,
                                  "labels": { "app": app },
                                  "creationTimestamp": format!("2026-01-01T00:{:02}:{:02}Z", i / 60 % 60, i % 60) },
                    "spec": { "schedulerName": "xpu", "affinity": affinity, "topologySpreadConstraints": spread,
                        "containers": [{ "name": "c", "resources": { "requests": { "cpu": "1", "memory": "1Gi" } } }] },
                    "status": { "phase": "Pending" }
                }))
                .unwrap()
            };
            let mut nodes: Vec<Arc<Node>> = Vec::new();
            let mut pods: Vec<Arc<Pod>> = Vec::new();
            let mut assumed: HashMap<String, String> = HashMap::new();
            let mut namespace_labels: HashMap<String, BTreeMap<String, String>> = HashMap::new();
            let mut made = 0usize;
            for step in 0..80 {
                let node_name = |nodes: &[Arc<Node>], rng: &mut xpu_sched::rng::Rng| {
                    nodes[rng.index(nodes.len())].metadata.name.clone().unwrap()
                };
                match rng.index(10) {
                    0 if nodes.len() < 6 => {
                        let i = rng.index(8);
                        if nodes
                            .iter()
                            .all(|n| n.metadata.name.as_deref() != Some(&format!("n{i}")))
                        {
                            nodes.push(node_of(i, rng.index(3), next()));
                            nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
                        }
                    }
                    1 if !nodes.is_empty() => {
                        let k = rng.index(nodes.len());
                        let i: usize =
                            nodes[k].metadata.name.as_deref().unwrap()[1..].parse().unwrap();
                        nodes[k] = node_of(i, rng.index(3), next());
                    }
                    2 if nodes.len() > 1 && rng.below(2) == 0 => {
                        nodes.remove(rng.index(nodes.len()));
                    }
                    3 | 4 => {
                        made += 1;
                        pods.push(Arc::new(pod_of(made, &mut rng, next())));
                    }
                    5 if !pods.is_empty() && !nodes.is_empty() => {
                        let k = rng.index(pods.len());
                        let node = node_name(&nodes, &mut rng);
                        let uid = pods[k].metadata.uid.clone().unwrap();
                        if rng.below(3) == 0 {
                            assumed.insert(uid, node);
                        } else {
                            assumed.remove(&uid);
                            let mut p = (*pods[k]).clone();
                            if let Some(spec) = p.spec.as_mut() {
                                spec.node_name = Some(node);
                            }
                            p.metadata.resource_version = Some(next());
                            pods[k] = Arc::new(p);
                        }
                    }
                    6 if !pods.is_empty() => {
                        let k = rng.index(pods.len());
                        let mut p = (*pods[k]).clone();
                        if rng.below(2) == 0 {
                            if let Some(st) = p.status.as_mut() {
                                st.phase = Some(["Succeeded", "Running"][rng.index(2)].into());
                            }
                        } else {
                            // Relabelled, or written with nothing of its terms changed.
                            let app = apps[rng.index(3)];
                            if rng.below(2) == 0 {
                                p.metadata.labels = Some([("app".into(), app.into())].into());
                            }
                        }
                        p.metadata.resource_version = Some(next());
                        pods[k] = Arc::new(p);
                    }
                    7 if !pods.is_empty() => {
                        let gone = pods.remove(rng.index(pods.len()));
                        assumed.remove(gone.metadata.uid.as_deref().unwrap());
                    }
                    8 => {
                        let ns = ["ns1", "ns2"][rng.index(2)];
                        let team = ["x", "y"][rng.index(2)];
                        namespace_labels.insert(ns.into(), [("team".into(), team.into())].into());
                    }
                    _ => {}
                }
                let jobs = HashMap::new();
                let fresh_snap = Snapshot {
                    namespace_labels: &namespace_labels,
                    ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
                };
                let memo_snap = Snapshot {
                    memo: Some(&memo),
                    namespace_labels: &namespace_labels,
                    ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
                };
                // The kept index against pods entered afresh, on the same cluster.
                let cluster = cluster_of(&fresh_snap).cluster;
                let kept = memo.lock().placed.update(&memo_snap, &cluster);
                let mut fresh = xpu_sched::pods::PodIndex::new();
                for p in pods.iter().filter(|p| !terminal(p)) {
                    let Some(node) = bound_node(p, &assumed) else { continue };
                    let Some(id) = cluster.node_id(node) else { continue };
                    if let Some(t) = placed_terms(&fresh_snap, p) {
                        fresh.add(id, t);
                    }
                }
                let listed = |x: &xpu_sched::pods::PodIndex| {
                    let mut v: Vec<String> =
                        x.pods().iter().map(|(n, t)| format!("{n} {t:?}")).collect();
                    v.sort_unstable();
                    v
                };
                assert_eq!(listed(&kept), listed(&fresh), "seed {seed} step {step}");
                // And the decisions: a cycle with the memo plans what one without it plans.
                let config = SchedulerConfig::default();
                let without = plan(&fresh_snap, &config, 0, &mut |_| true);
                let with = plan(&memo_snap, &config, 0, &mut |_| true);
                assert_eq!(
                    with, without,
                    "seed {seed} step {step}: the kept index changed the plan"
                );
                memo.sweep();
            }
        }
    }
}
