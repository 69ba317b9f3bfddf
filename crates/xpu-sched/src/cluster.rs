//! Cluster state: nodes with labels, pool, CPU (milli), memory (MiB) and devices, each device
//! with its kind, model, NUMA node, interconnect domain and free capacity in milli-units
//! (1000 = one whole device, so GPU sharing is first-class).
//!
//! Nodes are grouped into *state classes*: nodes whose static shape (capacity, labels, pool,
//! devices) and free state are identical land in one class, so a policy scores each distinct
//! state once per decision instead of once per node (a 10,000-node cluster of identical idle
//! machines is one class). Classes are keyed by plain integers and fixed-size arrays; nothing in
//! here allocates on the placement path.
//!
//! This module owns bookkeeping and its invariants only (no over-commit, ever); choosing where a
//! task goes is [`crate::placement`]'s job; what it decided is an [`crate::assignment`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use xpu_core::DeviceKind;

use crate::assignment::Placement;
use crate::constraints::{Requirement, Taint, Toleration};
use crate::hash::FxHashMap;

/// Index of a node in its [`Cluster`].
pub type NodeId = u32;

/// Whole device, in milli-units.
pub const MILLI: u16 = 1000;

/// Most accelerator devices one node may carry (an HGX-2 has 16 GPUs; 8 MI250X are 16 GCDs).
pub const MAX_DEVICES: usize = 32;

/// Most distinct device models one cluster may hold (models are a 64-bit mask in requests).
pub const MAX_MODELS: usize = 64;

/// A set of device models, as a bit mask over the cluster's model ids.
pub type ModelMask = u64;

/// Every model.
pub const ANY_MODEL: ModelMask = u64::MAX;

/// Whether a node can take work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum NodeStatus {
    #[default]
    Ready,
    /// A flex-start node that has been asked for and is not up yet.
    Provisioning,
    /// A flex-start slot with no machine behind it (scaled to zero).
    Off,
    /// Up, but takes no new work (`kubectl cordon`).
    Cordoned,
}

/// One device as described by whoever builds the cluster (a config file, an inventory).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// A stable name the caller understands: a PCI address, a UUID, `gpu3`.
    pub id: String,
    pub kind: DeviceKind,
    /// Product or model name (`A100-SXM4-80GB`, `V100M32`, `TPU-v5p`).
    pub model: String,
    pub numa_node: Option<u32>,
    /// Devices with the same domain on one node share a fast interconnect (NVLink/NVSwitch
    /// island, xGMI hive, TPU ICI).
    pub interconnect_domain: Option<String>,
}

impl DeviceSpec {
    pub fn new(id: impl Into<String>, kind: DeviceKind, model: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            kind,
            model: model.into(),
            numa_node: None,
            interconnect_domain: None,
        }
    }

    pub fn numa(mut self, numa: u32) -> Self {
        self.numa_node = Some(numa);
        self
    }

    pub fn domain(mut self, domain: impl Into<String>) -> Self {
        self.interconnect_domain = Some(domain.into());
        self
    }
}

/// One node as described by whoever builds the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Node pool; multi-task groups that ask to stay in one slice (TPU slices) use it.
    #[serde(default)]
    pub pool: Option<String>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
    /// Kubernetes taints; a task lands here only if it tolerates each `NoSchedule` and
    /// `NoExecute` one.
    #[serde(default)]
    pub taints: Vec<Taint>,
}

impl NodeSpec {
    pub fn new(name: impl Into<String>, cpu_milli: u64, memory_mib: u64) -> Self {
        Self {
            name: name.into(),
            labels: BTreeMap::new(),
            pool: None,
            cpu_milli,
            memory_mib,
            devices: Vec::new(),
            taints: Vec::new(),
        }
    }

    pub fn taint(mut self, t: Taint) -> Self {
        self.taints.push(t);
        self
    }

    pub fn label(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }

    pub fn pool(mut self, pool: impl Into<String>) -> Self {
        self.pool = Some(pool.into());
        self
    }

    pub fn device(mut self, d: DeviceSpec) -> Self {
        self.devices.push(d);
        self
    }

    /// `n` identical devices named `{kind}{i}`, all on NUMA node 0 and no shared domain.
    pub fn devices(mut self, n: usize, kind: DeviceKind, model: &str) -> Self {
        for i in 0..n {
            self.devices.push(DeviceSpec::new(format!("{kind}{i}"), kind, model));
        }
        self
    }
}

/// What went wrong changing the cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    #[error("node {0:?} is defined twice; give every node a unique name")]
    DuplicateNode(String),
    #[error(
        "node {node:?} has {count} devices; the scheduler supports up to {MAX_DEVICES} per node"
    )]
    TooManyDevices { node: String, count: usize },
    #[error(
        "the cluster has more than {MAX_MODELS} device models (adding {0:?}); merge model names"
    )]
    TooManyModels(String),
    #[error("node id {0} does not exist")]
    NoSuchNode(NodeId),
    #[error("node id {id} is {has:?}, not {given:?}; a node is replaced only by one of its name")]
    Renamed { id: NodeId, has: String, given: String },
    #[error("placement on node {node:?} would over-commit {what}; this is a scheduler bug")]
    Overcommit { node: String, what: String },
    #[error(
        "releasing {what} on node {node:?} exceeds what was allocated; this is a scheduler bug"
    )]
    OverRelease { node: String, what: String },
}

/// One device slot on a node: its static description and its free capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub id: String,
    pub kind: DeviceKind,
    pub model: String,
    pub numa_node: Option<u32>,
    pub interconnect_domain: Option<String>,
    pub(crate) model_id: u8,
    /// 0 = none; otherwise an id shared by devices of one node with the same domain.
    pub(crate) domain_id: u16,
    pub(crate) free: u16,
}

impl Device {
    /// Free capacity in milli-units (1000 = idle).
    pub fn free_milli(&self) -> u16 {
        self.free
    }

    /// The cluster's id of this device's model (bit `id` of a [`ModelMask`]).
    pub fn model_id(&self) -> u8 {
        self.model_id
    }
}

/// Affinity tag of a request, as GPU clustering groups them: no GPU, a shared GPU, or `n` whole
/// GPUs (`n` capped at 14).
pub(crate) fn affinity_tag(count: u16, milli: u16) -> u8 {
    match (count, milli) {
        (0, _) => 0,
        (1, m) if m < MILLI => 1,
        (n, _) => (1 + n.min(14)) as u8,
    }
}

/// A node's labels, shared by the node, its shape and the shape's key (one map per node,
/// whichever of them outlives the others).
pub type Labels = Arc<BTreeMap<String, String>>;

/// A node: static description plus free state.
#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub labels: Labels,
    pub pool: Option<String>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub devices: Vec<Device>,
    pub(crate) status: NodeStatus,
    pub(crate) cpu_free: u64,
    pub(crate) mem_free: u64,
    /// Job token this node is held for (flex-start provisioning), 0 = none.
    pub(crate) reserved: u32,
    /// Running tasks per affinity tag.
    pub(crate) tag_counts: [u16; 16],
    pub(crate) tasks: u32,
    pub(crate) shape: u32,
    pub(crate) class: u32,
    pub(crate) class_pos: u32,
}

impl Node {
    pub fn status(&self) -> NodeStatus {
        self.status
    }
    pub fn cpu_free(&self) -> u64 {
        self.cpu_free
    }
    pub fn memory_free(&self) -> u64 {
        self.mem_free
    }
    /// Tasks running on the node.
    pub fn tasks(&self) -> u32 {
        self.tasks
    }
    /// Bit `t` set when a task of affinity tag `t` runs here (bit 0, no-GPU tasks, is never set).
    pub(crate) fn tag_mask(&self) -> u16 {
        let mut m = 0u16;
        for (t, &c) in self.tag_counts.iter().enumerate().skip(1) {
            if c > 0 {
                m |= 1 << t;
            }
        }
        m
    }
    /// Sum of free milli over devices of `kind`.
    pub fn free_milli(&self, kind: DeviceKind) -> u64 {
        self.devices.iter().filter(|d| d.kind == kind).map(|d| u64::from(d.free)).sum()
    }
    /// Whether nothing runs here.
    pub fn is_idle(&self) -> bool {
        self.tasks == 0
    }
}

/// Static per-device facts a shape compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct DevStatic {
    pub kind: DeviceKind,
    pub model: u8,
    pub numa: u32,
    pub domain: u16,
}

/// Everything about a node that never changes, minus its name. Nodes with equal shapes and equal
/// free state are interchangeable for scoring.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub labels: Labels,
    pub pool: Option<String>,
    pub taints: Vec<Taint>,
    /// All devices interchangeable (same kind, model, NUMA node and domain): class keys sort
    /// free capacities, so permutations of one state share a class.
    pub symmetric: bool,
    /// Per selector id: whether this shape's labels and pool satisfy it.
    pub selector_ok: Vec<bool>,
    /// Pool id + 1 (0 = no pool), the key multi-host slices colocate on.
    pub slice: u32,
    /// For symmetric shapes with devices: their kind and model id (every device the same).
    pub sym: Option<(DeviceKind, u8)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    cpu_milli: u64,
    memory_mib: u64,
    labels: Labels,
    pool: Option<String>,
    taints: Vec<Taint>,
    devs: Vec<DevStatic>,
}

/// A node-label selector with Kubernetes `nodeSelector` semantics (every pair must match), plus
/// an optional pool.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Selector {
    pub labels: Vec<(String, String)>,
    pub pool: Option<String>,
    /// Required node affinity terms (ORed; each term's requirements ANDed); empty: any node.
    pub affinity: Vec<Vec<Requirement>>,
    /// What the task tolerates; a node's filtering taints must all be tolerated.
    pub tolerations: Vec<Toleration>,
}

impl Selector {
    fn matches(
        &self,
        labels: &BTreeMap<String, String>,
        pool: Option<&str>,
        taints: &[Taint],
    ) -> bool {
        if let Some(p) = &self.pool
            && pool != Some(p.as_str())
        {
            return false;
        }
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && crate::constraints::affinity_matches(&self.affinity, labels)
            && crate::constraints::tolerated(taints, &self.tolerations)
    }
}

/// How long [`Cluster::activated`] may grow before it is dropped: four entries per class and
/// some (a few, under test, so that readers falling behind it are exercised).
fn activated_limit(classes: usize) -> usize {
    if cfg!(test) { 16 } else { 4 * classes + 4096 }
}

/// Identifies one distinct node state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClassKey {
    pub shape: u32,
    pub status: NodeStatus,
    pub reserved: u32,
    pub tags: u16,
    pub ndev: u8,
    pub cpu_free: u64,
    pub mem_free: u64,
    /// Free milli per device; sorted largest first when the shape is symmetric.
    pub dev_free: [u16; MAX_DEVICES],
}

#[derive(Debug, Clone)]
pub(crate) struct Class {
    pub key: ClassKey,
    pub members: Vec<NodeId>,
    /// Members by tie-break rank, lowest first.
    pub ranked: BTreeSet<(u32, NodeId)>,
    /// Position in `Cluster::active`, or `u32::MAX` when the class has no members.
    active_pos: u32,
}

/// Cluster-wide totals, per device kind (indexed by `DeviceKind as usize` order of
/// [`DeviceKind::ALL`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub device_milli: [u64; 5],
}

impl Totals {
    pub fn device(&self, kind: DeviceKind) -> u64 {
        self.device_milli[kind_index(kind)]
    }
}

/// The identity of one cluster value, unique in the process. Deliberately not `Clone`: a copy
/// of a cluster is another cluster ([`Cluster::fork`] gives it a fresh identity).
#[derive(Debug)]
pub(crate) struct Uid(pub u64);

impl Uid {
    fn fresh() -> Self {
        Uid(next_uid())
    }
}

impl Default for Uid {
    fn default() -> Self {
        Self::fresh()
    }
}

fn next_uid() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Adds (or, `add` false, takes away) a node's capacity and what it holds to the totals.
fn count(cap: &mut Totals, used: &mut Totals, n: &Node, add: bool) {
    let step = |total: &mut u64, x: u64| {
        *total = if add { total.saturating_add(x) } else { total.saturating_sub(x) }
    };
    step(&mut cap.cpu_milli, n.cpu_milli);
    step(&mut cap.memory_mib, n.memory_mib);
    step(&mut used.cpu_milli, n.cpu_milli - n.cpu_free.min(n.cpu_milli));
    step(&mut used.memory_mib, n.memory_mib - n.mem_free.min(n.memory_mib));
    for d in &n.devices {
        let k = kind_index(d.kind);
        step(&mut cap.device_milli[k], u64::from(MILLI));
        step(&mut used.device_milli[k], u64::from(MILLI - d.free.min(MILLI)));
    }
}

pub(crate) fn kind_index(kind: DeviceKind) -> usize {
    match kind {
        DeviceKind::Gpu => 0,
        DeviceKind::Tpu => 1,
        DeviceKind::Npu => 2,
        DeviceKind::Nvswitch => 3,
        DeviceKind::Other => 4,
    }
}

/// The whole cluster. Not `Clone`: copies are made with [`Cluster::fork`], which says that
/// the copy is a separate cluster (its own identity, so score memos never mix the two).
#[derive(Debug, Default)]
pub struct Cluster {
    nodes: Vec<Node>,
    by_name: FxHashMap<String, NodeId>,
    models: Vec<String>,
    model_ids: FxHashMap<String, u8>,
    pools: Vec<String>,
    pub(crate) shapes: Vec<Shape>,
    shape_ids: FxHashMap<ShapeKey, u32>,
    selectors: Vec<Selector>,
    selector_ids: FxHashMap<Selector, u32>,
    pub(crate) classes: Vec<Class>,
    class_ids: FxHashMap<ClassKey, u32>,
    /// Classes with at least one member.
    pub(crate) active: Vec<u32>,
    /// The keys of `active`'s classes, in the same order: placement scans these, so they are
    /// kept contiguous rather than read through each class.
    pub(crate) active_keys: Vec<ClassKey>,
    /// The lowest rank of each class's members, by class id (`u32::MAX` when it has none):
    /// read for every class a placement scans, so kept apart from the classes themselves.
    pub(crate) min_ranks: Vec<u32>,
    /// Class ids in the order they went from no members to one (made, or taken again): what
    /// a placer's per-demand lists of fitting classes catch up on. Position `activated_base + i`
    /// holds `activated[i]`; the window is dropped when it outgrows the classes, and readers
    /// that fall behind it start again from `active`.
    pub(crate) activated: Vec<u32>,
    pub(crate) activated_base: u64,
    /// Bumped when class ids are renumbered, so score memos keyed by class id are dropped.
    pub(crate) class_epoch: u64,
    capacity: Totals,
    used: Totals,
    /// Identity of this cluster value; [`Cluster::fork`] gives copies a new one so score memos
    /// keyed by class id never mix two clusters.
    pub(crate) uid: Uid,
    /// Tie-break rank of each node: among equally scored nodes the lowest rank wins (see
    /// [`Cluster::shuffle_ranks`]).
    ranks: Vec<u32>,
    /// Nodes whose state changed since [`Cluster::take_touched`], while tracking is on.
    touched: Option<Vec<NodeId>>,
}

impl Cluster {
    pub fn new() -> Self {
        let mut c = Self::default();
        // Selector 0 matches every node.
        c.selectors.push(Selector::default());
        c.selector_ids.insert(Selector::default(), 0);
        c
    }

    /// Releases what `placements` hold, last first: the undo of allocating them in order. Every
    /// one is released even when one fails; the first error is returned (a placement that does
    /// not hold what it says is a broken invariant for the caller to report).
    pub fn undo<'a>(
        &mut self,
        placements: impl IntoIterator<Item = &'a Placement>,
    ) -> Result<(), ClusterError> {
        let all: Vec<&Placement> = placements.into_iter().collect();
        let mut first = Ok(());
        for p in all.into_iter().rev() {
            if let Err(e) = self.release(p)
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }

    /// A copy for what-if planning (preemption, backfill reservations, never-fits checks):
    /// the same state under a new identity, so score memos never mix the two.
    pub fn fork(&self) -> Self {
        Self {
            nodes: self.nodes.clone(),
            by_name: self.by_name.clone(),
            models: self.models.clone(),
            model_ids: self.model_ids.clone(),
            pools: self.pools.clone(),
            shapes: self.shapes.clone(),
            shape_ids: self.shape_ids.clone(),
            selectors: self.selectors.clone(),
            selector_ids: self.selector_ids.clone(),
            classes: self.classes.clone(),
            class_ids: self.class_ids.clone(),
            active: self.active.clone(),
            active_keys: self.active_keys.clone(),
            min_ranks: self.min_ranks.clone(),
            activated: Vec::new(),
            activated_base: 0,
            class_epoch: self.class_epoch,
            capacity: self.capacity,
            used: self.used,
            uid: Uid::fresh(),
            ranks: self.ranks.clone(),
            touched: None,
        }
    }

    /// Starts (or stops) recording which nodes change state: an owner that keeps a cluster
    /// across uses lends it out and, with [`Cluster::take_touched`], learns which nodes to
    /// restore when it comes back.
    pub fn track_touched(&mut self, on: bool) {
        self.touched = on.then(Vec::new);
    }

    /// The nodes whose state changed (allocation, release, status, hold, replacement) since
    /// tracking started or the last call, each once, in id order; empty when not tracking.
    pub fn take_touched(&mut self) -> Vec<NodeId> {
        let Some(t) = self.touched.as_mut() else { return Vec::new() };
        let mut ids = std::mem::take(t);
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Builds a cluster from node specs.
    pub fn from_specs(specs: impl IntoIterator<Item = NodeSpec>) -> Result<Self, ClusterError> {
        let mut c = Self::new();
        for s in specs {
            c.add_node(s)?;
        }
        Ok(c)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id as usize)
    }

    pub fn node_id(&self, name: &str) -> Option<NodeId> {
        self.by_name.get(name).copied()
    }

    /// Capacity of every node, whatever its status.
    pub fn capacity(&self) -> Totals {
        self.capacity
    }

    /// What running tasks hold.
    pub fn used(&self) -> Totals {
        self.used
    }

    /// Node shapes interned (every static description a node has had; a node built again
    /// with other capacity or labels adds one, and none is dropped).
    pub fn shape_count(&self) -> usize {
        self.shapes.len()
    }

    /// Number of distinct node states right now (a measure of how much scoring work a decision
    /// costs).
    pub fn state_classes(&self) -> usize {
        self.active.len()
    }

    /// The id of a model name, interned on first use (requests may name models no node has).
    pub fn model_id(&mut self, model: &str) -> Result<u8, ClusterError> {
        if let Some(&id) = self.model_ids.get(model) {
            return Ok(id);
        }
        if self.models.len() >= MAX_MODELS {
            return Err(ClusterError::TooManyModels(model.to_owned()));
        }
        let id = self.models.len() as u8;
        self.models.push(model.to_owned());
        self.model_ids.insert(model.to_owned(), id);
        Ok(id)
    }

    pub fn model_name(&self, id: u8) -> Option<&str> {
        self.models.get(usize::from(id)).map(String::as_str)
    }

    /// A mask of the given model names (empty list: any model).
    pub fn model_mask<S: AsRef<str>>(&mut self, models: &[S]) -> Result<ModelMask, ClusterError> {
        if models.is_empty() {
            return Ok(ANY_MODEL);
        }
        let mut m = 0;
        for name in models {
            m |= 1u64 << self.model_id(name.as_ref())?;
        }
        Ok(m)
    }

    /// Interns a selector; id 0 is the empty selector.
    pub fn selector_id(&mut self, sel: &Selector) -> u32 {
        let mut sel = sel.clone();
        sel.labels.sort();
        sel.labels.dedup();
        if let Some(&id) = self.selector_ids.get(&sel) {
            return id;
        }
        let id = self.selectors.len() as u32;
        for shape in &mut self.shapes {
            shape.selector_ok.push(sel.matches(
                &shape.labels,
                shape.pool.as_deref(),
                &shape.taints,
            ));
        }
        self.selectors.push(sel.clone());
        self.selector_ids.insert(sel, id);
        id
    }

    /// Whether node `id` passes interned selector `sel`.
    pub fn selects(&self, id: NodeId, sel: u32) -> bool {
        self.node(id).is_some_and(|n| {
            self.shapes[n.shape as usize].selector_ok.get(sel as usize).copied().unwrap_or(false)
        })
    }

    pub(crate) fn shape_of(&self, node: &Node) -> &Shape {
        &self.shapes[node.shape as usize]
    }

    /// Pool id + 1 of a node, 0 when it has none.
    pub fn slice_of(&self, id: NodeId) -> u32 {
        self.node(id).map_or(0, |n| self.shapes[n.shape as usize].slice)
    }

    pub fn pool_name(&self, slice: u32) -> Option<&str> {
        slice.checked_sub(1).and_then(|i| self.pools.get(i as usize)).map(String::as_str)
    }

    /// Adds a node (status Ready, everything free).
    pub fn add_node(&mut self, spec: NodeSpec) -> Result<NodeId, ClusterError> {
        self.add_node_with_status(spec, NodeStatus::Ready)
    }

    pub fn add_node_with_status(
        &mut self,
        spec: NodeSpec,
        status: NodeStatus,
    ) -> Result<NodeId, ClusterError> {
        if self.by_name.contains_key(&spec.name) {
            return Err(ClusterError::DuplicateNode(spec.name));
        }
        let node = self.make_node(spec, status)?;
        let id = self.nodes.len() as NodeId;
        self.ranks.push(id);
        count(&mut self.capacity, &mut self.used, &node, true);
        self.by_name.insert(node.name.clone(), id);
        self.nodes.push(node);
        self.reclass(id);
        Ok(id)
    }

    /// Rebuilds node `id` from `spec` in place, everything free: the same id, tie-break rank
    /// and name, what it holds and its static facts as `spec` gives them. The same cluster
    /// results as building every node anew (`replacing_a_node_equals_building_it_anew`).
    pub fn replace_node(
        &mut self,
        id: NodeId,
        spec: NodeSpec,
        status: NodeStatus,
    ) -> Result<(), ClusterError> {
        let has = &self.nodes.get(id as usize).ok_or(ClusterError::NoSuchNode(id))?.name;
        if *has != spec.name {
            return Err(ClusterError::Renamed { id, has: has.clone(), given: spec.name });
        }
        let mut node = self.make_node(spec, status)?;
        let old = &self.nodes[id as usize];
        (node.class, node.class_pos) = (old.class, old.class_pos);
        count(&mut self.capacity, &mut self.used, &node, true);
        let old = std::mem::replace(&mut self.nodes[id as usize], node);
        count(&mut self.capacity, &mut self.used, &old, false);
        self.reclass(id);
        Ok(())
    }

    /// What an empty copy of the cluster holds for node `id`: its static facts and
    /// capacity, every device free (what never-fits checks place on).
    pub fn empty_spec(&self, id: NodeId) -> Option<NodeSpec> {
        let n = self.node(id)?;
        Some(NodeSpec {
            name: n.name.clone(),
            labels: n.labels.as_ref().clone(),
            pool: n.pool.clone(),
            cpu_milli: n.cpu_milli,
            memory_mib: n.memory_mib,
            devices: n
                .devices
                .iter()
                .map(|d| DeviceSpec {
                    id: d.id.clone(),
                    kind: d.kind,
                    model: d.model.clone(),
                    numa_node: d.numa_node,
                    interconnect_domain: d.interconnect_domain.clone(),
                })
                .collect(),
            taints: self.shape_of(n).taints.clone(),
        })
    }

    /// Whether nothing is held anywhere: every node Ready, idle and wholly free (an empty
    /// copy that can serve again).
    pub fn all_free(&self) -> bool {
        self.nodes.iter().all(|n| {
            n.status == NodeStatus::Ready
                && n.reserved == 0
                && n.tasks == 0
                && n.cpu_free == n.cpu_milli
                && n.mem_free == n.memory_mib
                && n.devices.iter().all(|d| d.free == MILLI)
        })
    }

    /// The first difference between two clusters' nodes, as placement sees them (names,
    /// static facts, free state, status, tie-break ranks, totals); `Ok` when there is none.
    /// Interned ids (shapes, classes, models, selectors) may differ: they name, not decide.
    pub fn same_as(&self, other: &Cluster) -> Result<(), String> {
        if self.nodes.len() != other.nodes.len() {
            return Err(format!("{} nodes against {}", self.nodes.len(), other.nodes.len()));
        }
        for (id, (a, b)) in self.nodes.iter().zip(&other.nodes).enumerate() {
            let facts = |c: &Cluster, n: &Node| {
                let shape = c.shape_of(n);
                format!(
                    "{} {:?} {:?} {:?} cpu {}/{} mem {}/{} {:?} held {} tags {:?} tasks {} rank {:?} devices {:?}",
                    n.name,
                    n.labels,
                    n.pool,
                    shape.taints,
                    n.cpu_free,
                    n.cpu_milli,
                    n.mem_free,
                    n.memory_mib,
                    n.status,
                    n.reserved,
                    n.tag_counts,
                    n.tasks,
                    c.by_name.get(&n.name).map(|&i| c.rank(i)),
                    n.devices
                        .iter()
                        .map(|d| (
                            &d.id,
                            d.kind,
                            &d.model,
                            d.numa_node,
                            &d.interconnect_domain,
                            d.free
                        ))
                        .collect::<Vec<_>>(),
                )
            };
            let (fa, fb) = (facts(self, a), facts(other, b));
            if fa != fb {
                return Err(format!("node {id}: {fa} against {fb}"));
            }
            let (ka, kb) = (self.class_key(a), other.class_key(b));
            if (ka.status, ka.cpu_free, ka.dev_free) != (kb.status, kb.cpu_free, kb.dev_free) {
                return Err(format!("node {id} ({}): class keys differ", a.name));
            }
        }
        let totals = |c: &Cluster| format!("{:?} {:?}", c.capacity, c.used);
        if totals(self) != totals(other) {
            return Err(format!("totals {} against {}", totals(self), totals(other)));
        }
        Ok(())
    }

    /// Drops every node from `len` on (nodes added for one use, such as flex-start slots).
    pub fn truncate(&mut self, len: usize) {
        while self.nodes.len() > len {
            let id = (self.nodes.len() - 1) as NodeId;
            self.unclass(id);
            if let Some(t) = self.touched.as_mut() {
                t.retain(|&n| n != id);
            }
            if let Some(n) = self.nodes.pop() {
                count(&mut self.capacity, &mut self.used, &n, false);
                self.by_name.remove(&n.name);
            }
            self.ranks.pop();
        }
    }

    /// A node built from `spec` (models and shape interned), not yet in any class.
    fn make_node(&mut self, mut spec: NodeSpec, status: NodeStatus) -> Result<Node, ClusterError> {
        if spec.devices.len() > MAX_DEVICES {
            return Err(ClusterError::TooManyDevices {
                node: spec.name,
                count: spec.devices.len(),
            });
        }
        // Interconnect domains numbered in order of first appearance, then the specs' strings
        // moved into the devices (a node is built every cycle: no copy of them is needed).
        let mut domain_ids = Vec::with_capacity(spec.devices.len());
        {
            let mut domain_names: Vec<&str> = Vec::new();
            for d in &spec.devices {
                domain_ids.push(match &d.interconnect_domain {
                    None => 0,
                    Some(name) => match domain_names.iter().position(|n| n == name) {
                        Some(i) => i as u16 + 1,
                        None => {
                            domain_names.push(name);
                            domain_names.len() as u16
                        }
                    },
                });
            }
        }
        let mut devices = Vec::with_capacity(spec.devices.len());
        let mut statics = Vec::with_capacity(spec.devices.len());
        for (d, domain_id) in std::mem::take(&mut spec.devices).into_iter().zip(domain_ids) {
            let model_id = self.model_id(&d.model)?;
            statics.push(DevStatic {
                kind: d.kind,
                model: model_id,
                numa: d.numa_node.unwrap_or(u32::MAX),
                domain: domain_id,
            });
            devices.push(Device {
                id: d.id,
                kind: d.kind,
                model: d.model,
                numa_node: d.numa_node,
                interconnect_domain: d.interconnect_domain,
                model_id,
                domain_id,
                free: MILLI,
            });
        }
        let key = ShapeKey {
            cpu_milli: spec.cpu_milli,
            memory_mib: spec.memory_mib,
            labels: Arc::new(std::mem::take(&mut spec.labels)),
            pool: spec.pool.clone(),
            taints: {
                let mut t = spec.taints.clone();
                t.sort();
                t
            },
            devs: statics,
        };
        let shape = match self.shape_ids.get(&key) {
            Some(&s) => s,
            None => {
                let slice = match &key.pool {
                    None => 0,
                    Some(p) => match self.pools.iter().position(|q| q == p) {
                        Some(i) => i as u32 + 1,
                        None => {
                            self.pools.push(p.clone());
                            self.pools.len() as u32
                        }
                    },
                };
                let symmetric = key.devs.windows(2).all(|w| w[0] == w[1]);
                let selector_ok = self
                    .selectors
                    .iter()
                    .map(|s| s.matches(&key.labels, key.pool.as_deref(), &key.taints))
                    .collect();
                let id = self.shapes.len() as u32;
                let sym =
                    if symmetric { key.devs.first().map(|d| (d.kind, d.model)) } else { None };
                self.shapes.push(Shape {
                    sym,
                    labels: key.labels.clone(),
                    pool: key.pool.clone(),
                    taints: key.taints.clone(),
                    symmetric,
                    selector_ok,
                    slice,
                });
                self.shape_ids.insert(key, id);
                id
            }
        };
        Ok(Node {
            name: spec.name,
            labels: Arc::clone(&self.shapes[shape as usize].labels),
            pool: spec.pool,
            cpu_milli: spec.cpu_milli,
            memory_mib: spec.memory_mib,
            devices,
            status,
            cpu_free: spec.cpu_milli,
            mem_free: spec.memory_mib,
            reserved: 0,
            tag_counts: [0; 16],
            tasks: 0,
            shape,
            class: u32::MAX,
            class_pos: 0,
        })
    }

    /// Gives every node a tie-break rank from a seeded random permutation. Among nodes a policy
    /// scores equally, the lowest rank wins, so equal nodes are filled one after another in a
    /// random but fixed order (the FGD artifact renames nodes with a random permutation prefix
    /// for the same effect); without this, ranks follow the order nodes were added.
    pub fn shuffle_ranks(&mut self, seed: u64) {
        let mut perm: Vec<u32> = (0..self.nodes.len() as u32).collect();
        crate::rng::Rng::new(seed).shuffle(&mut perm);
        self.set_ranks(&perm);
    }

    /// Sets tie-break ranks explicitly (`ranks[node]`); lower wins.
    pub fn set_ranks(&mut self, ranks: &[u32]) {
        for (id, &r) in ranks.iter().enumerate().take(self.nodes.len()) {
            let old = self.ranks[id];
            if old == r {
                continue;
            }
            let cid = self.nodes[id].class as usize;
            let class = &mut self.classes[cid];
            class.ranked.remove(&(old, id as NodeId));
            class.ranked.insert((r, id as NodeId));
            self.min_ranks[cid] = class.ranked.first().map_or(u32::MAX, |&(r, _)| r);
            self.ranks[id] = r;
        }
    }

    /// Tie-break rank of a node.
    pub fn rank(&self, id: NodeId) -> u32 {
        self.ranks.get(id as usize).copied().unwrap_or(u32::MAX)
    }

    pub fn set_status(&mut self, id: NodeId, status: NodeStatus) -> Result<(), ClusterError> {
        let n = self.nodes.get_mut(id as usize).ok_or(ClusterError::NoSuchNode(id))?;
        if n.status != status {
            n.status = status;
            self.reclass(id);
        }
        Ok(())
    }

    /// Holds a node for one job token (0 releases the hold).
    pub(crate) fn set_reserved(&mut self, id: NodeId, token: u32) {
        if let Some(n) = self.nodes.get_mut(id as usize)
            && n.reserved != token
        {
            n.reserved = token;
            self.reclass(id);
        }
    }

    /// Takes the resources of a placement. Fails, changing nothing, if anything would go
    /// negative.
    pub fn allocate(&mut self, p: &Placement) -> Result<(), ClusterError> {
        let n = self.nodes.get_mut(p.node as usize).ok_or(ClusterError::NoSuchNode(p.node))?;
        let over = |what: String| ClusterError::Overcommit { node: n.name.clone(), what };
        if n.cpu_free < p.cpu_milli {
            return Err(over(format!("cpu ({} > {} milli free)", p.cpu_milli, n.cpu_free)));
        }
        if n.mem_free < p.memory_mib {
            return Err(over(format!("memory ({} > {} MiB free)", p.memory_mib, n.mem_free)));
        }
        for (i, s) in p.devices.iter().enumerate() {
            let Some(d) = n.devices.get(usize::from(s.index)) else {
                return Err(over(format!(
                    "device index {} (node has {})",
                    s.index,
                    n.devices.len()
                )));
            };
            if p.devices[..i].iter().any(|o| o.index == s.index) || d.free < s.milli || s.milli == 0
            {
                return Err(over(format!("device {} ({} > {} milli free)", d.id, s.milli, d.free)));
            }
        }
        n.cpu_free -= p.cpu_milli;
        n.mem_free -= p.memory_mib;
        for s in &p.devices {
            let d = &mut n.devices[usize::from(s.index)];
            d.free -= s.milli;
            self.used.device_milli[kind_index(d.kind)] += u64::from(s.milli);
        }
        n.tag_counts[usize::from(p.tag & 15)] += 1;
        n.tasks += 1;
        self.used.cpu_milli = self.used.cpu_milli.saturating_add(p.cpu_milli);
        self.used.memory_mib = self.used.memory_mib.saturating_add(p.memory_mib);
        self.reclass(p.node);
        Ok(())
    }

    /// Gives back the resources of a placement made earlier.
    pub fn release(&mut self, p: &Placement) -> Result<(), ClusterError> {
        let n = self.nodes.get_mut(p.node as usize).ok_or(ClusterError::NoSuchNode(p.node))?;
        let over = |what: String| ClusterError::OverRelease { node: n.name.clone(), what };
        if n.cpu_free + p.cpu_milli > n.cpu_milli {
            return Err(over("cpu".into()));
        }
        if n.mem_free + p.memory_mib > n.memory_mib {
            return Err(over("memory".into()));
        }
        if n.tasks == 0 || n.tag_counts[usize::from(p.tag & 15)] == 0 {
            return Err(over("a task".into()));
        }
        for s in &p.devices {
            match n.devices.get(usize::from(s.index)) {
                Some(d) if d.free + s.milli <= MILLI => {}
                _ => return Err(over(format!("device index {}", s.index))),
            }
        }
        n.cpu_free += p.cpu_milli;
        n.mem_free += p.memory_mib;
        for s in &p.devices {
            let d = &mut n.devices[usize::from(s.index)];
            d.free += s.milli;
            self.used.device_milli[kind_index(d.kind)] -= u64::from(s.milli);
        }
        n.tag_counts[usize::from(p.tag & 15)] -= 1;
        n.tasks -= 1;
        self.used.cpu_milli = self.used.cpu_milli.saturating_sub(p.cpu_milli);
        self.used.memory_mib = self.used.memory_mib.saturating_sub(p.memory_mib);
        self.reclass(p.node);
        Ok(())
    }

    fn class_key(&self, n: &Node) -> ClassKey {
        let shape = &self.shapes[n.shape as usize];
        let mut dev_free = [0u16; MAX_DEVICES];
        for (slot, d) in dev_free.iter_mut().zip(&n.devices) {
            *slot = d.free;
        }
        let ndev = n.devices.len();
        if shape.symmetric {
            dev_free[..ndev].sort_unstable_by(|a, b| b.cmp(a));
        }
        ClassKey {
            shape: n.shape,
            status: n.status,
            reserved: n.reserved,
            tags: n.tag_mask(),
            ndev: ndev as u8,
            cpu_free: n.cpu_free,
            mem_free: n.mem_free,
            dev_free,
        }
    }

    /// Takes a node out of its class (a node just made is in none).
    fn unclass(&mut self, id: NodeId) {
        let old = self.nodes[id as usize].class;
        if old != u32::MAX {
            let pos = self.nodes[id as usize].class_pos as usize;
            let class = &mut self.classes[old as usize];
            class.members.swap_remove(pos);
            class.ranked.remove(&(self.ranks[id as usize], id));
            self.min_ranks[old as usize] = class.ranked.first().map_or(u32::MAX, |&(r, _)| r);
            if let Some(&moved) = class.members.get(pos) {
                self.nodes[moved as usize].class_pos = pos as u32;
            }
            if class.members.is_empty() {
                let ap = class.active_pos as usize;
                class.active_pos = u32::MAX;
                self.active.swap_remove(ap);
                self.active_keys.swap_remove(ap);
                if let Some(&moved) = self.active.get(ap) {
                    self.classes[moved as usize].active_pos = ap as u32;
                }
            }
        }
        self.nodes[id as usize].class = u32::MAX;
    }

    /// Moves a node to the class of its current state.
    fn reclass(&mut self, id: NodeId) {
        if let Some(t) = self.touched.as_mut() {
            t.push(id);
        }
        let key = self.class_key(&self.nodes[id as usize]);
        let old = self.nodes[id as usize].class;
        if old != u32::MAX && self.classes[old as usize].key == key {
            return;
        }
        self.unclass(id);
        let cid = match self.class_ids.get(&key) {
            Some(&c) => c,
            None => {
                if self.classes.len() > 2 * self.active.len() + 256 {
                    self.collect_classes();
                }
                let c = self.classes.len() as u32;
                self.classes.push(Class {
                    key,
                    members: Vec::new(),
                    ranked: BTreeSet::new(),
                    active_pos: u32::MAX,
                });
                self.min_ranks.push(u32::MAX);
                self.class_ids.insert(key, c);
                c
            }
        };
        let nclasses = self.classes.len();
        let class = &mut self.classes[cid as usize];
        if class.members.is_empty() {
            class.active_pos = self.active.len() as u32;
            self.active.push(cid);
            self.active_keys.push(class.key);
            if self.activated.len() > activated_limit(nclasses) {
                self.activated_base += self.activated.len() as u64;
                self.activated.clear();
            }
            self.activated.push(cid);
        }
        class.members.push(id);
        class.ranked.insert((self.ranks[id as usize], id));
        let min = &mut self.min_ranks[cid as usize];
        *min = (*min).min(self.ranks[id as usize]);
        let pos = class.members.len() as u32 - 1;
        let n = &mut self.nodes[id as usize];
        n.class = cid;
        n.class_pos = pos;
    }

    /// Drops classes nobody is in and renumbers the rest (long replays visit many transient
    /// states; this keeps memory bounded).
    fn collect_classes(&mut self) {
        let old = std::mem::take(&mut self.classes);
        let old_ranks = std::mem::take(&mut self.min_ranks);
        self.class_ids.clear();
        self.active.clear();
        self.active_keys.clear();
        for (class, rank) in old.into_iter().zip(old_ranks).filter(|(c, _)| !c.members.is_empty()) {
            let cid = self.classes.len() as u32;
            self.min_ranks.push(rank);
            for &m in &class.members {
                self.nodes[m as usize].class = cid;
            }
            self.class_ids.insert(class.key, cid);
            self.active.push(cid);
            self.active_keys.push(class.key);
            self.classes.push(Class { active_pos: cid, ..class });
        }
        self.activated_base += self.activated.len() as u64;
        self.activated.clear();
        self.class_epoch += 1;
    }

    /// Recomputes every node's free state from scratch given the placements that hold
    /// resources, and says whether the books agree. Tests use it to prove nothing leaks or
    /// over-commits.
    pub fn audit<'a>(
        &self,
        placements: impl IntoIterator<Item = &'a Placement>,
    ) -> Result<(), String> {
        let mut cpu: Vec<u64> = vec![0; self.nodes.len()];
        let mut mem: Vec<u64> = vec![0; self.nodes.len()];
        let mut dev: Vec<Vec<u32>> = self.nodes.iter().map(|n| vec![0; n.devices.len()]).collect();
        for p in placements {
            let i = p.node as usize;
            cpu[i] += p.cpu_milli;
            mem[i] += p.memory_mib;
            for s in &p.devices {
                dev[i][usize::from(s.index)] += u32::from(s.milli);
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if cpu[i] > n.cpu_milli || n.cpu_free != n.cpu_milli - cpu[i] {
                return Err(format!("node {}: cpu books disagree", n.name));
            }
            if mem[i] > n.memory_mib || n.mem_free != n.memory_mib - mem[i] {
                return Err(format!("node {}: memory books disagree", n.name));
            }
            for (j, d) in n.devices.iter().enumerate() {
                if dev[i][j] > u32::from(MILLI) || u32::from(d.free) != u32::from(MILLI) - dev[i][j]
                {
                    return Err(format!("node {}: device {} books disagree", n.name, d.id));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::{DeviceShare, Placement};

    fn gpu_node(name: &str) -> NodeSpec {
        NodeSpec::new(name, 64_000, 262_144).devices(8, DeviceKind::Gpu, "A100")
    }

    /// A random node `name`: one of a few shapes, some labelled, some with a pool.
    fn random_spec(rng: &mut crate::rng::Rng, name: &str) -> NodeSpec {
        let gpus = [0, 2, 4, 8][rng.index(4)];
        let model = ["A100", "H100"][rng.index(2)];
        let mut spec = NodeSpec::new(name, 1000 * (8 + rng.below(8)), 1024 * (16 + rng.below(4)))
            .devices(gpus, DeviceKind::Gpu, model);
        if rng.below(3) == 0 {
            spec = spec.label("zone", format!("z{}", rng.below(3)));
        }
        if rng.below(4) == 0 {
            spec = spec.pool(format!("p{}", rng.below(2)));
        }
        spec
    }

    /// Random placements on node `id` (what its pods hold), allocated in order.
    fn random_holds(rng: &mut crate::rng::Rng, c: &mut Cluster, id: NodeId) -> Vec<Placement> {
        let mut held = Vec::new();
        for _ in 0..rng.below(4) {
            let n = c.node(id).unwrap();
            let devices = (0..n.devices.len() as u16)
                .filter(|&i| n.devices[usize::from(i)].free_milli() >= 500 && rng.below(3) == 0)
                .map(|index| DeviceShare { index, milli: 500 })
                .collect();
            let p = Placement {
                node: id,
                cpu_milli: rng.below(n.cpu_free() / 2 + 1),
                memory_mib: rng.below(n.memory_free() / 2 + 1),
                devices,
                tag: rng.below(3) as u8,
            };
            c.allocate(&p).unwrap();
            held.push(p);
        }
        held
    }

    #[test]
    fn replacing_a_node_equals_building_it_anew() {
        for seed in 0..40 {
            let mut rng = crate::rng::Rng::new(seed);
            let names: Vec<String> = (0..30).map(|i| format!("n{i:02}")).collect();
            let mut specs: Vec<NodeSpec> = names.iter().map(|n| random_spec(&mut rng, n)).collect();
            let mut kept = Cluster::from_specs(specs.clone()).unwrap();
            kept.track_touched(true);
            let mut holds: Vec<Vec<Placement>> =
                (0..30).map(|i| random_holds(&mut rng, &mut kept, i)).collect();
            for round in 0..20 {
                // Some nodes change (spec, status or what they hold); the kept cluster
                // replaces just those; a lent-out use allocates and adds slots on top.
                for _ in 0..rng.below(6) {
                    let i = rng.index(30);
                    if rng.below(2) == 0 {
                        specs[i] = random_spec(&mut rng, &names[i]);
                    }
                    let status =
                        if rng.below(5) == 0 { NodeStatus::Cordoned } else { NodeStatus::Ready };
                    kept.replace_node(i as NodeId, specs[i].clone(), status).unwrap();
                    holds[i] = random_holds(&mut rng, &mut kept, i as NodeId);
                }
                let mut fresh = Cluster::new();
                for (i, spec) in specs.iter().enumerate() {
                    let status = kept.node(i as NodeId).unwrap().status();
                    let id = fresh.add_node_with_status(spec.clone(), status).unwrap();
                    for p in &holds[i] {
                        fresh.allocate(p).unwrap();
                    }
                    assert_eq!(id, i as NodeId);
                }
                kept.same_as(&fresh).unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
                kept.audit(holds.iter().flatten()).unwrap();
                // Lent out: a use adds a slot and places; given back, it is truncated and
                // the nodes it touched are rebuilt (here: their holds put back).
                kept.take_touched();
                let slot = random_spec(&mut rng, "slot");
                let slot = kept.add_node_with_status(slot, NodeStatus::Off).unwrap();
                let on = rng.index(30) as NodeId;
                let extra = random_holds(&mut rng, &mut kept, on);
                kept.set_status(slot, NodeStatus::Ready).unwrap();
                kept.undo(&extra).unwrap();
                let touched = kept.take_touched();
                assert!(extra.iter().all(|p| touched.contains(&p.node)), "{touched:?}");
                kept.truncate(30);
                kept.same_as(&fresh).unwrap_or_else(|e| panic!("seed {seed} after a use: {e}"));
            }
        }
    }

    #[test]
    fn identical_nodes_share_a_class_until_they_differ() {
        let mut c = Cluster::from_specs((0..100).map(|i| gpu_node(&format!("n{i}")))).unwrap();
        assert_eq!(c.state_classes(), 1);
        let p = Placement {
            node: 7,
            cpu_milli: 1000,
            memory_mib: 10,
            devices: vec![DeviceShare { index: 3, milli: 500 }],
            tag: 1,
        };
        c.allocate(&p).unwrap();
        assert_eq!(c.state_classes(), 2);
        // Same free multiset on another device index: same class (devices are symmetric).
        let q =
            Placement { node: 8, devices: vec![DeviceShare { index: 5, milli: 500 }], ..p.clone() };
        c.allocate(&q).unwrap();
        assert_eq!(c.state_classes(), 2);
        c.release(&p).unwrap();
        c.release(&q).unwrap();
        assert_eq!(c.state_classes(), 1);
        c.audit([]).unwrap();
        assert_eq!(c.used(), Totals::default());
    }

    #[test]
    fn over_commit_and_over_release_are_refused() {
        let mut c = Cluster::from_specs([gpu_node("a")]).unwrap();
        let p = Placement {
            node: 0,
            cpu_milli: 1000,
            memory_mib: 10,
            devices: vec![DeviceShare { index: 0, milli: 700 }],
            tag: 1,
        };
        c.allocate(&p).unwrap();
        let e = c.allocate(&p).unwrap_err();
        assert!(matches!(e, ClusterError::Overcommit { .. }), "{e}");
        let dup = Placement {
            devices: vec![
                DeviceShare { index: 1, milli: 200 },
                DeviceShare { index: 1, milli: 200 },
            ],
            ..p.clone()
        };
        assert!(c.allocate(&dup).is_err());
        let too_much_cpu = Placement { cpu_milli: 64_000, devices: vec![], ..p.clone() };
        assert!(c.allocate(&too_much_cpu).is_err());
        c.release(&p).unwrap();
        assert!(matches!(c.release(&p).unwrap_err(), ClusterError::OverRelease { .. }));
        c.audit([]).unwrap();
        assert!(matches!(c.add_node(gpu_node("a")), Err(ClusterError::DuplicateNode(_))));
    }

    #[test]
    fn selectors_follow_node_selector_semantics() {
        let mut c = Cluster::from_specs([
            gpu_node("a").label("zone", "x").label("tier", "gold"),
            gpu_node("b").label("zone", "y"),
        ])
        .unwrap();
        let sel = |pairs: &[(&str, &str)]| Selector {
            labels: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Selector::default()
        };
        let s1 = c.selector_id(&sel(&[("zone", "x")]));
        let s2 = c.selector_id(&sel(&[("zone", "x"), ("tier", "silver")]));
        let shape = |c: &Cluster, n: NodeId| c.shape_of(c.node(n).unwrap()).selector_ok.clone();
        assert_eq!((shape(&c, 0)[s1 as usize], shape(&c, 1)[s1 as usize]), (true, false));
        assert!(!shape(&c, 0)[s2 as usize]);
        assert!(shape(&c, 1)[0], "the empty selector matches everything");
    }
}
