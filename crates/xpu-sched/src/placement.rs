//! Placement: which node (and which devices on it) one task goes to, and, when none will do,
//! why not, counted per filter the way kube-scheduler reports it
//! (`0/1213 nodes are available: 800 Insufficient gpu, ...`).
//!
//! The [`Placer`] runs the filters, asks a [`Policy`] to score every distinct node state that
//! passes, and breaks ties uniformly at random over *nodes* (kube-scheduler's `selectHost`
//! reservoir sampling), so a policy behaves the same whether a state is shared by one node or a
//! thousand. Scores of a (state, task shape) pair are memoised: states are immutable values, so a
//! score never goes stale. For the same reason whether a task shape fits a state never changes:
//! a policy that breaks ties by node order (xpu's, FGD's) scans only the states each task shape
//! was found to fit, looking at each new state once ([`Placer`]'s fitting lists), and makes the
//! same choice as a scan of every node (a test holds it to one). Within a node, devices are
//! chosen NVLink/NUMA-aware: a multi-device task stays inside one interconnect domain and NUMA
//! node when it can.

use std::fmt;

use serde::Serialize;
use xpu_core::DeviceKind;

pub use crate::assignment::{DeviceShare, Placement};
use crate::cluster::{
    ANY_MODEL, Cluster, ClusterError, MILLI, ModelMask, Node, NodeId, NodeStatus,
};
use crate::hash::FxHashMap;
use crate::rng::Rng;

/// The resources one task asks for, in the scheduler's compact form (models and selector are
/// interned ids of one [`Cluster`]). Build it with [`crate::request::TaskSpec::demand`] or
/// directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Demand {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// Kind of device asked for (ignored when `count == 0`).
    pub kind: DeviceKind,
    /// Number of devices: 0 (none), 1 for a fraction, or a whole count.
    pub count: u16,
    /// Per device, milli-units: 1000 for whole devices, less for a share of one.
    pub milli: u16,
    /// Allowed models (a mask over the cluster's model ids).
    pub models: ModelMask,
    /// Interned node selector ([`Cluster::selector_id`]); 0 matches every node.
    pub selector: u32,
    /// The selector's tolerations alone, interned, to tell a taint from a label that does
    /// not match when `selector` fails (0: no tolerations).
    pub taints: u32,
}

impl Demand {
    /// CPU and memory only.
    pub fn cpu(cpu_milli: u64, memory_mib: u64) -> Self {
        Self {
            cpu_milli,
            memory_mib,
            kind: DeviceKind::Gpu,
            count: 0,
            milli: 0,
            models: ANY_MODEL,
            selector: 0,
            taints: 0,
        }
    }

    /// `count` whole devices of `kind`.
    pub fn whole(cpu_milli: u64, memory_mib: u64, kind: DeviceKind, count: u16) -> Self {
        Self {
            kind,
            count,
            milli: if count == 0 { 0 } else { MILLI },
            ..Self::cpu(cpu_milli, memory_mib)
        }
    }

    /// A `milli`/1000 share of one device of `kind`.
    pub fn share(cpu_milli: u64, memory_mib: u64, kind: DeviceKind, milli: u16) -> Self {
        Self { kind, count: 1, milli, ..Self::cpu(cpu_milli, memory_mib) }
    }

    pub fn with_models(mut self, models: ModelMask) -> Self {
        self.models = models;
        self
    }

    pub fn with_selector(mut self, selector: u32) -> Self {
        self.selector = selector;
        self
    }

    /// Device milli-units asked for in all.
    pub fn device_milli(&self) -> u64 {
        u64::from(self.count) * u64::from(self.milli)
    }

    /// A fraction of one device.
    pub fn is_shared(&self) -> bool {
        self.count == 1 && self.milli < MILLI
    }

    pub(crate) fn tag(&self) -> u8 {
        crate::cluster::affinity_tag(self.count, self.milli)
    }
}

/// Per-node extra constraints of one placement call.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlaceCtx<'a> {
    /// Job token allowed onto nodes reserved for it (0: none).
    pub token: u32,
    /// Only nodes of this slice (pool id + 1); 0 = anywhere.
    pub slice: u32,
    /// Nodes that must not be used (backfill keeps the head job's reservation free).
    pub exclude: Option<&'a [bool]>,
    /// Ignore node status and reservations (what-if placement on capacity that is not up yet).
    pub any_status: bool,
    /// Inter-pod constraints of this task: nodes it may not use, and preference scores that
    /// rank before the policy's ([`crate::pods`]).
    pub pods: Option<&'a crate::pods::PodMask>,
}

/// Why one node could not take a task. Order is the filter order; a node counts under the
/// first filter it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    NotReady,
    Provisioning,
    ScaledToZero,
    Cordoned,
    ReservedForOther,
    ReservedForHead,
    Taint,
    Selector,
    OtherSlice,
    NoSuchDevice,
    InsufficientCpu,
    InsufficientMemory,
    InsufficientDevices,
    TopologySpread,
    SpreadLabel,
    PodAffinity,
    PodAntiAffinity,
    ExistingAntiAffinity,
}

impl Reason {
    pub const ALL: [Reason; 18] = [
        Reason::NotReady,
        Reason::Provisioning,
        Reason::ScaledToZero,
        Reason::Cordoned,
        Reason::ReservedForOther,
        Reason::ReservedForHead,
        Reason::Taint,
        Reason::Selector,
        Reason::OtherSlice,
        Reason::NoSuchDevice,
        Reason::InsufficientCpu,
        Reason::InsufficientMemory,
        Reason::InsufficientDevices,
        Reason::TopologySpread,
        Reason::SpreadLabel,
        Reason::PodAffinity,
        Reason::PodAntiAffinity,
        Reason::ExistingAntiAffinity,
    ];

    fn text(self, kind: DeviceKind) -> String {
        match self {
            Reason::NotReady => "node(s) were not ready".into(),
            Reason::Provisioning => "node(s) were still being provisioned".into(),
            Reason::ScaledToZero => "node(s) were scaled to zero".into(),
            Reason::Cordoned => "node(s) were unschedulable".into(),
            Reason::ReservedForOther => "node(s) were reserved for another job".into(),
            Reason::ReservedForHead => "node(s) were held for the queue head".into(),
            Reason::Taint => "node(s) had untolerated taint(s)".into(),
            Reason::Selector => "node(s) didn't match Pod's node affinity/selector".into(),
            Reason::OtherSlice => "node(s) were outside the slice of the rest of the gang".into(),
            Reason::NoSuchDevice => format!("node(s) had no {kind} of an allowed model"),
            Reason::InsufficientCpu => "Insufficient cpu".into(),
            Reason::InsufficientMemory => "Insufficient memory".into(),
            Reason::InsufficientDevices => format!("Insufficient {kind}"),
            Reason::TopologySpread => "node(s) didn't match pod topology spread constraints".into(),
            Reason::SpreadLabel => {
                "node(s) didn't match pod topology spread constraints (missing required label)"
                    .into()
            }
            Reason::PodAffinity => "node(s) didn't match pod affinity rules".into(),
            Reason::PodAntiAffinity => "node(s) didn't match pod anti-affinity rules".into(),
            Reason::ExistingAntiAffinity => {
                "node(s) didn't satisfy existing pods anti-affinity rules".into()
            }
        }
    }
}

/// Why a task fits nowhere: how many nodes failed each filter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FitReport {
    pub nodes: usize,
    pub kind: DeviceKind,
    /// `(reason, node count)`, largest count first.
    pub reasons: Vec<(Reason, usize)>,
}

impl FitReport {
    pub fn count(&self, r: Reason) -> usize {
        self.reasons.iter().find(|(x, _)| *x == r).map_or(0, |&(_, n)| n)
    }
}

impl fmt::Display for FitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0/{} nodes are available", self.nodes)?;
        // In kube-scheduler's order: the "count reason" strings sorted.
        let mut parts: Vec<String> =
            self.reasons.iter().map(|(r, n)| format!("{n} {}", r.text(self.kind))).collect();
        parts.sort();
        for (i, p) in parts.iter().enumerate() {
            f.write_str(if i == 0 { ": " } else { ", " })?;
            f.write_str(p)?;
        }
        Ok(())
    }
}

/// A task group that could not be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("{}", self.describe())]
pub struct Unschedulable {
    /// Index of the first task that found no node.
    pub task: usize,
    /// Tasks in the group (all or nothing when more than one).
    pub of: usize,
    pub report: FitReport,
}

impl Unschedulable {
    fn describe(&self) -> String {
        if self.of > 1 {
            format!(
                "gang of {} tasks does not fit at once (task {} found no node): {}",
                self.of,
                self.task + 1,
                self.report
            )
        } else {
            self.report.to_string()
        }
    }
}

/// How equally scored nodes are told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TieBreak {
    /// The node with the lowest rank ([`Cluster::shuffle_ranks`]) wins: equal nodes fill one
    /// after another in a fixed order, which packs work the score does not separate.
    #[default]
    NodeOrder,
    /// Uniformly at random over nodes (kube-scheduler's `selectHost`).
    Uniform,
}

/// A placement policy: scores the nodes a task fits on, and picks devices inside the winner.
///
/// `score` must depend only on the node's free state (what [`Cluster`] puts in a state class:
/// free CPU, memory, device capacities and the affinity tags of running tasks) and the demand,
/// because scores are memoised per state class. Higher wins; equal scores tie and are broken
/// uniformly at random over nodes.
pub trait Policy: Send {
    /// The name `--policy` takes.
    fn name(&self) -> &'static str;

    fn score(&mut self, cluster: &Cluster, node: &Node, d: &Demand) -> f64;

    /// Device indices for `d` on `node` (which fits); each gets `d.milli`. The default is
    /// [`pick_devices`], NVLink/NUMA-aware best fit.
    fn devices(
        &mut self,
        cluster: &Cluster,
        node: &Node,
        d: &Demand,
        rng: &mut Rng,
        out: &mut Vec<u16>,
    ) {
        let _ = (cluster, rng);
        pick_devices(node, d, out);
    }

    /// How ties between equally scored nodes are broken.
    fn tie_break(&self) -> TieBreak {
        TieBreak::NodeOrder
    }

    /// Changes whenever the same (state, demand) may score differently than before, so memoised
    /// scores are dropped (a policy that learns its task mix bumps it).
    fn epoch(&self) -> u64 {
        0
    }
}

/// Whether device `dev` of `node` is of the kind and model `d` asks for.
#[inline]
pub(crate) fn device_matches(node: &Node, dev: usize, d: &Demand) -> bool {
    let x = &node.devices[dev];
    x.kind == d.kind && (d.models >> x.model_id) & 1 == 1
}

/// Runs the filters for one node; `Ok` when the task fits.
#[inline]
pub(crate) fn check(
    cluster: &Cluster,
    node: &Node,
    d: &Demand,
    ctx: &PlaceCtx<'_>,
) -> Result<(), Reason> {
    if !ctx.any_status {
        match node.status {
            NodeStatus::Ready => {}
            NodeStatus::Provisioning => return Err(Reason::Provisioning),
            NodeStatus::Off => return Err(Reason::ScaledToZero),
            NodeStatus::Cordoned => return Err(Reason::Cordoned),
        }
        if node.reserved != 0 && node.reserved != ctx.token {
            return Err(Reason::ReservedForOther);
        }
    }
    let shape = cluster.shape_of(node);
    if !shape.selector_ok.get(d.selector as usize).copied().unwrap_or(false) {
        // Taints first, as kube-scheduler's filters run.
        if !shape.selector_ok.get(d.taints as usize).copied().unwrap_or(true) {
            return Err(Reason::Taint);
        }
        return Err(Reason::Selector);
    }
    if ctx.slice != 0 && shape.slice != ctx.slice {
        return Err(Reason::OtherSlice);
    }
    if d.count > 0 && !(0..node.devices.len()).any(|i| device_matches(node, i, d)) {
        // A node with none of the kind lacks the resource (kube-scheduler's `Insufficient`);
        // one with some, none of an allowed model, is told so.
        let some = node.devices.iter().any(|x| x.kind == d.kind);
        return Err(if some && d.models != ANY_MODEL {
            Reason::NoSuchDevice
        } else {
            Reason::InsufficientDevices
        });
    }
    if node.cpu_free < d.cpu_milli {
        return Err(Reason::InsufficientCpu);
    }
    if node.mem_free < d.memory_mib {
        return Err(Reason::InsufficientMemory);
    }
    if d.count > 0 {
        let mut n = 0u16;
        for (i, x) in node.devices.iter().enumerate() {
            if x.free >= d.milli && device_matches(node, i, d) {
                n += 1;
            }
        }
        if n < d.count {
            return Err(Reason::InsufficientDevices);
        }
    }
    Ok(())
}

/// The filters on a whole state class at once, from its key alone (no node is touched): for
/// symmetric shapes the devices' free capacities are sorted largest first, so `count` devices
/// with `milli` free exist exactly when the `count`-th largest has. `None` when the shape is
/// not symmetric and the per-node check must decide.
#[inline]
fn class_fits(
    cluster: &Cluster,
    key: &crate::cluster::ClassKey,
    d: &Demand,
    ctx: &PlaceCtx<'_>,
) -> Option<bool> {
    if !ctx.any_status
        && (key.status != NodeStatus::Ready || (key.reserved != 0 && key.reserved != ctx.token))
    {
        return Some(false);
    }
    if key.cpu_free < d.cpu_milli || key.mem_free < d.memory_mib {
        return Some(false);
    }
    let shape = &cluster.shapes[key.shape as usize];
    if !shape.selector_ok.get(d.selector as usize).copied().unwrap_or(false) {
        return Some(false);
    }
    if ctx.slice != 0 && shape.slice != ctx.slice {
        return Some(false);
    }
    if d.count == 0 {
        return Some(true);
    }
    let (kind, model) = shape.sym?;
    if kind != d.kind
        || (d.models >> model) & 1 == 0
        || usize::from(d.count) > usize::from(key.ndev)
    {
        return Some(false);
    }
    Some(key.dev_free[usize::from(d.count) - 1] >= d.milli)
}

/// The single device a policy chose for a share (`chosen`), else the default choice
/// [`pick_devices`].
pub fn chosen_or_picked(chosen: Option<usize>, node: &Node, d: &Demand, out: &mut Vec<u16>) {
    match chosen {
        Some(i) => {
            out.clear();
            out.push(i as u16);
        }
        None => pick_devices(node, d, out),
    }
}

/// NVLink/NUMA-aware device choice.
///
/// A share of one device goes to the matching device with the least free capacity that still
/// fits (best fit; lowest index on ties), keeping whole devices whole. Whole devices come from
/// the smallest (domain, NUMA) group that can hold them all, then the smallest domain, so a
/// 2-GPU task does not split a free 8-GPU NVSwitch island when a 2-GPU gap exists; only when no
/// domain can hold the task are devices taken from the largest domains first. Within a group,
/// lower indices go first.
pub fn pick_devices(node: &Node, d: &Demand, out: &mut Vec<u16>) {
    out.clear();
    if d.count == 0 {
        return;
    }
    let fits = |i: usize| node.devices[i].free >= d.milli && device_matches(node, i, d);
    if d.is_shared() {
        let mut best: Option<usize> = None;
        for i in 0..node.devices.len() {
            if fits(i) && best.is_none_or(|b| node.devices[i].free < node.devices[b].free) {
                best = Some(i);
            }
        }
        if let Some(b) = best {
            out.push(b as u16);
        }
        return;
    }
    let want = usize::from(d.count);
    let cands: Vec<usize> = (0..node.devices.len()).filter(|&i| fits(i)).collect();
    if cands.len() < want {
        return;
    }
    let numa = |i: usize| u64::from(node.devices[i].numa_node.unwrap_or(u32::MAX));
    let dom = |i: usize| u64::from(node.devices[i].domain_id);
    // Group by (domain, NUMA node) first, then by domain alone.
    let dom_numa = |i: usize| (dom(i) << 32) | numa(i);
    let keys: [&dyn Fn(usize) -> u64; 2] = [&dom_numa, &dom];
    for key in keys {
        let size = |i: usize| cands.iter().filter(|&&j| key(j) == key(i)).count();
        // Smallest group that holds the task; the first such group by index on ties.
        let mut best: Option<(usize, usize)> = None;
        for &i in &cands {
            let n = size(i);
            if n >= want && best.is_none_or(|(bn, _)| n < bn) {
                best = Some((n, i));
            }
        }
        if let Some((_, seed)) = best {
            out.extend(
                cands.iter().filter(|&&j| key(j) == key(seed)).take(want).map(|&j| j as u16),
            );
            return;
        }
    }
    // No domain holds it: take whole domains, largest first.
    let size = |i: usize| cands.iter().filter(|&&j| dom(j) == dom(i)).count();
    let mut order = cands.clone();
    order.sort_by_key(|&i| (std::cmp::Reverse(size(i)), dom(i), i));
    out.extend(order.into_iter().take(want).map(|j| j as u16));
}

/// Scores nodes with a [`Policy`] and picks one, remembering scores per (state, demand).
pub struct Placer {
    policy: Box<dyn Policy>,
    rng: Rng,
    demands: FxHashMap<Demand, u32>,
    /// Scores by `[demand id][class id]`; NaN where not computed yet.
    memo: Vec<Vec<f64>>,
    memo_epoch: (u64, u64, u64),
    /// The classes each (demand, context) fits, for policies that break ties by node order:
    /// valid for the same `memo_epoch` as `memo`.
    fitting: FxHashMap<FitKey, Fitting>,
    scratch: Vec<u16>,
    explain: bool,
}

/// A demand (its id) and the parts of a [`PlaceCtx`] that decide whether a class fits, but
/// the job token: `(demand, slice, any_status)`. Tokens differ from job to job, so a class held
/// for one is listed as if the token matched and marked [`HELD`]; the scan checks the token.
type FitKey = (u32, u32, bool);

/// The classes a demand fits, by score. A class is a node state that never changes (its key),
/// so whether a demand fits it, and its score, never change either; what changes is which
/// classes have members and their lowest rank. The list holds every fitting class with
/// members, best score first (and some that have since lost theirs, dropped when met), kept
/// current from the cluster's log of classes that gained a first member
/// ([`Cluster::activated`]). A placement then reads only the best scores until one has a
/// member, and catches up on the classes that came alive since it last asked.
#[derive(Debug, Default)]
struct Fitting {
    /// The log position read up to; `None` before the first read (the list is then built
    /// from the classes with members).
    read: Option<u64>,
    /// (score, class id), highest score first.
    by_score: Vec<(f64, u32)>,
    /// Per class id: [`LISTED`], [`NEVER_FITS`] or 0 (neither yet).
    state: Vec<u8>,
}

/// Most task shapes a placer keeps fitting lists for at once.
const FITTING_MAX: usize = 1024;

/// Marks a class id in [`Fitting::by_score`] held for a job token (only that job may use it).
const HELD: u32 = 1 << 31;

/// A class in [`Fitting::by_score`].
const LISTED: u8 = 1;
/// A class the demand does not fit.
const NEVER_FITS: u8 = 2;

impl fmt::Debug for Placer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Placer").field("policy", &self.policy.name()).finish_non_exhaustive()
    }
}

impl Placer {
    /// `seed` drives tie-breaks (and the Random policy), so runs repeat exactly.
    pub fn new(policy: Box<dyn Policy>, seed: u64) -> Self {
        Self {
            policy,
            rng: Rng::new(seed),
            demands: FxHashMap::default(),
            memo: Vec::new(),
            memo_epoch: (0, 0, 0),
            fitting: FxHashMap::default(),
            scratch: Vec::new(),
            explain: true,
        }
    }

    /// Whether a failed placement counts the reasons per node (on by default). Callers that
    /// retry often and drop the reason (a scheduler scanning a long queue) turn it off; the
    /// report then has no reasons.
    pub fn set_explain(&mut self, explain: bool) {
        self.explain = explain;
    }

    pub fn policy(&self) -> &dyn Policy {
        self.policy.as_ref()
    }

    pub fn policy_mut(&mut self) -> &mut dyn Policy {
        self.policy.as_mut()
    }

    pub fn rng(&mut self) -> &mut Rng {
        &mut self.rng
    }

    fn demand_id(&mut self, d: &Demand) -> u32 {
        let n = self.demands.len() as u32;
        *self.demands.entry(*d).or_insert(n)
    }

    /// Chooses a node and devices for one task. Does not change the cluster; pass the result
    /// to [`Cluster::allocate`].
    pub fn place(
        &mut self,
        cluster: &Cluster,
        d: &Demand,
        ctx: &PlaceCtx<'_>,
    ) -> Result<Placement, FitReport> {
        let epoch = (cluster.uid.0, cluster.class_epoch, self.policy.epoch());
        if epoch != self.memo_epoch {
            self.memo.clear();
            self.fitting.clear();
            self.memo_epoch = epoch;
        }
        let did = self.demand_id(d);
        let uniform = self.policy.tie_break() == TieBreak::Uniform;
        let mut best = f64::NEG_INFINITY;
        let mut chosen: Option<NodeId> = None;
        let mut best_rank = u32::MAX;
        let mut weight = 0u64;
        if ctx.exclude.is_some() || ctx.pods.is_some() {
            // Per-node path: exclusions and inter-pod constraints split classes.
            let mut best_pref = i64::MIN;
            for (id, node) in cluster.nodes().iter().enumerate() {
                if ctx.exclude.and_then(|e| e.get(id).copied()).unwrap_or(false)
                    || ctx.pods.is_some_and(|m| m.veto.get(id).is_some_and(Option::is_some))
                    || check(cluster, node, d, ctx).is_err()
                {
                    continue;
                }
                let pref = ctx.pods.and_then(|m| m.pref.get(id).copied()).unwrap_or(0);
                if pref < best_pref {
                    continue;
                }
                let row = memo_row(&mut self.memo, did, cluster.classes.len());
                let mut s = row[node.class as usize];
                if s.is_nan() {
                    s = sanitize(self.policy.score(cluster, node, d));
                    row[node.class as usize] = s;
                }
                let rank = cluster.rank(id as NodeId);
                let take = if pref > best_pref || s > best {
                    weight = 1;
                    true
                } else if s == best {
                    weight += 1;
                    if uniform { self.rng.below(weight) == 0 } else { rank < best_rank }
                } else {
                    false
                };
                if take {
                    best_pref = pref;
                    best = s;
                    best_rank = rank;
                    chosen = Some(id as NodeId);
                }
            }
        } else if !uniform {
            chosen = self.best_fitting(cluster, d, did, ctx);
        } else {
            // Uniform ties over nodes: a class is drawn in proportion to its members.
            let mut chosen_class = u32::MAX;
            let row = memo_row(&mut self.memo, did, cluster.classes.len());
            for (&cid, key) in cluster.active.iter().zip(&cluster.active_keys) {
                let fits = match class_fits(cluster, key, d, ctx) {
                    Some(f) => f,
                    None => {
                        let class = &cluster.classes[cid as usize];
                        check(cluster, &cluster.nodes()[class.members[0] as usize], d, ctx).is_ok()
                    }
                };
                if !fits {
                    continue;
                }
                let mut s = row[cid as usize];
                if s.is_nan() {
                    let class = &cluster.classes[cid as usize];
                    let node = &cluster.nodes()[class.members[0] as usize];
                    s = sanitize(self.policy.score(cluster, node, d));
                    row[cid as usize] = s;
                }
                if s < best {
                    continue;
                }
                let size = cluster.classes[cid as usize].members.len() as u64;
                let take = if s > best {
                    weight = size;
                    true
                } else {
                    weight += size;
                    self.rng.below(weight) < size
                };
                if take {
                    best = s;
                    chosen_class = cid;
                }
            }
            if chosen_class != u32::MAX {
                let class = &cluster.classes[chosen_class as usize];
                chosen = Some(class.members[self.rng.index(class.members.len())]);
            }
        }
        let Some(id) = chosen else {
            if !self.explain {
                return Err(FitReport { nodes: cluster.len(), kind: d.kind, reasons: Vec::new() });
            }
            return Err(self.report(cluster, d, ctx));
        };
        let node = &cluster.nodes()[id as usize];
        let mut devs = std::mem::take(&mut self.scratch);
        self.policy.devices(cluster, node, d, &mut self.rng, &mut devs);
        if devs.len() != usize::from(d.count) {
            // A policy returned the wrong number of devices; fall back to the default choice
            // rather than over- or under-allocate.
            pick_devices(node, d, &mut devs);
        }
        let p = Placement {
            node: id,
            cpu_milli: d.cpu_milli,
            memory_mib: d.memory_mib,
            devices: devs.iter().map(|&i| DeviceShare { index: i, milli: d.milli }).collect(),
            tag: d.tag(),
        };
        self.scratch = devs;
        Ok(p)
    }

    /// The best node for `d` by score, then by rank, from the classes it fits ([`Fitting`]);
    /// the same choice as a scan of every node with node-order ties.
    fn best_fitting(
        &mut self,
        cluster: &Cluster,
        d: &Demand,
        did: u32,
        ctx: &PlaceCtx<'_>,
    ) -> Option<NodeId> {
        let key = (did, ctx.slice, ctx.any_status);
        if self.fitting.len() >= FITTING_MAX && !self.fitting.contains_key(&key) {
            // A long-lived placer meets ever more task shapes: start again rather than grow.
            self.fitting.clear();
        }
        let fit = self.fitting.entry(key).or_default();
        let row = memo_row(&mut self.memo, did, cluster.classes.len());
        let policy = &mut self.policy;
        let log_end = cluster.activated_base + cluster.activated.len() as u64;
        let (fresh, rebuild): (&[u32], bool) = match fit.read {
            Some(read) if read >= cluster.activated_base => {
                (&cluster.activated[(read - cluster.activated_base) as usize..], false)
            }
            _ => {
                fit.by_score.clear();
                fit.state.clear();
                (&cluster.active, true)
            }
        };
        fit.state.resize(cluster.classes.len(), 0);
        for &cid in fresh {
            let c = cid as usize;
            let Some(&first) = cluster.classes[c].members.first() else {
                continue; // no members again; its next first member logs it again
            };
            if fit.state[c] != 0 {
                continue;
            }
            let node = &cluster.nodes()[first as usize];
            let key = &cluster.classes[c].key;
            // Judged as if the job it is held for asked; the scan checks the token.
            let held = !ctx.any_status && key.reserved != 0;
            let as_holder = PlaceCtx { token: key.reserved, ..*ctx };
            let cctx = if held { &as_holder } else { ctx };
            let fits = class_fits(cluster, key, d, cctx)
                .unwrap_or_else(|| check(cluster, node, d, cctx).is_ok());
            if !fits {
                fit.state[c] = NEVER_FITS;
                continue;
            }
            let mut s = row[c];
            if s.is_nan() {
                s = sanitize(policy.score(cluster, node, d));
                row[c] = s;
            }
            fit.state[c] = LISTED;
            let entry = if held { cid | HELD } else { cid };
            if rebuild {
                fit.by_score.push((s, entry));
            } else {
                let at = fit.by_score.partition_point(|&(x, _)| x >= s);
                fit.by_score.insert(at, (s, entry));
            }
        }
        fit.read = Some(log_end);
        if rebuild {
            fit.by_score.sort_by(|a, b| b.0.total_cmp(&a.0));
        }
        // The best score with a member, the lowest rank among its classes; classes met
        // without members leave the list (kept compact in place).
        let ranks = &cluster.min_ranks;
        let mut best: Option<(f64, u32, u32)> = None;
        let mut kept = 0;
        let mut read = 0;
        while read < fit.by_score.len() {
            let (s, entry) = fit.by_score[read];
            if best.is_some_and(|(bs, _, _)| s < bs) {
                break;
            }
            read += 1;
            let cid = entry & !HELD;
            let rank = ranks[cid as usize];
            if rank == u32::MAX {
                fit.state[cid as usize] = 0;
                continue;
            }
            fit.by_score[kept] = (s, entry);
            kept += 1;
            if entry & HELD != 0 && cluster.classes[cid as usize].key.reserved != ctx.token {
                continue; // held for another job
            }
            if best.is_none_or(|(_, br, _)| rank < br) {
                best = Some((s, rank, cid));
            }
        }
        fit.by_score.drain(kept..read);
        let (_, _, cid) = best?;
        cluster.classes[cid as usize].ranked.first().map(|&(_, n)| n)
    }

    /// Counts, per filter, the nodes that cannot take `d`.
    pub fn report(&self, cluster: &Cluster, d: &Demand, ctx: &PlaceCtx<'_>) -> FitReport {
        let mut counts = [0usize; Reason::ALL.len()];
        let mut count = |r: Reason, n: usize| {
            counts[Reason::ALL.iter().position(|&x| x == r).unwrap_or(0)] += n;
        };
        match ctx.exclude {
            // Nodes of one state class fail the same filter: one check per class.
            None if ctx.pods.is_none() => {
                for &cid in &cluster.active {
                    let class = &cluster.classes[cid as usize];
                    let node = &cluster.nodes()[class.members[0] as usize];
                    if let Err(r) = check(cluster, node, d, ctx) {
                        count(r, class.members.len());
                    }
                }
            }
            exclude => {
                for (id, node) in cluster.nodes().iter().enumerate() {
                    let veto = ctx.pods.and_then(|m| m.veto.get(id).copied().flatten());
                    let r = if exclude.is_some_and(|e| e.get(id).copied().unwrap_or(false)) {
                        Err(Reason::ReservedForHead)
                    } else {
                        check(cluster, node, d, ctx).and(veto.map_or(Ok(()), Err))
                    };
                    if let Err(r) = r {
                        count(r, 1);
                    }
                }
            }
        }
        let mut reasons: Vec<(Reason, usize)> =
            Reason::ALL.iter().copied().zip(counts).filter(|&(_, n)| n > 0).collect();
        reasons.sort_by_key(|&(r, n)| (std::cmp::Reverse(n), r));
        FitReport { nodes: cluster.len(), kind: d.kind, reasons }
    }

    /// Places every task of a group at once or none of them: on success the cluster holds all
    /// placements; on failure it is unchanged. With `colocate`, all tasks land in one slice
    /// (pool) — the one where they score best in total, the smaller slice on ties.
    pub fn place_gang(
        &mut self,
        cluster: &mut Cluster,
        tasks: &[Demand],
        colocate: bool,
        ctx: &PlaceCtx<'_>,
    ) -> Result<Vec<Placement>, Unschedulable> {
        if !colocate || tasks.len() <= 1 || ctx.slice != 0 {
            return self.place_all(cluster, tasks, ctx).map(|(p, _)| p);
        }
        let slices: Vec<u32> = {
            let mut s: Vec<u32> = cluster
                .nodes()
                .iter()
                .enumerate()
                .map(|(i, _)| cluster.slice_of(i as NodeId))
                .filter(|&s| s != 0)
                .collect();
            s.sort_unstable();
            s.dedup();
            s
        };
        let mut best: Option<(f64, usize, u32)> = None;
        let mut first_err: Option<Unschedulable> = None;
        for &slice in &slices {
            let sctx = PlaceCtx { slice, ..*ctx };
            match self.place_all(cluster, tasks, &sctx) {
                Ok((ps, total)) => {
                    for p in ps.iter().rev() {
                        // Roll back the trial; these placements were just made.
                        let _ = cluster.release(p);
                    }
                    let size = cluster
                        .nodes()
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| cluster.slice_of(*i as NodeId) == slice)
                        .count();
                    let better = match best {
                        None => true,
                        Some((bt, bs, _)) => total > bt || (total == bt && size < bs),
                    };
                    if better {
                        best = Some((total, size, slice));
                    }
                }
                Err(e) => {
                    if first_err.as_ref().is_none_or(|f| e.task > f.task) {
                        first_err = Some(e);
                    }
                }
            }
        }
        match best {
            Some((_, _, slice)) => {
                let sctx = PlaceCtx { slice, ..*ctx };
                self.place_all(cluster, tasks, &sctx).map(|(p, _)| p)
            }
            None => Err(first_err.unwrap_or_else(|| Unschedulable {
                task: 0,
                of: tasks.len(),
                report: FitReport {
                    nodes: cluster.len(),
                    kind: tasks[0].kind,
                    reasons: vec![(Reason::OtherSlice, cluster.len())],
                },
            })),
        }
    }

    /// Places tasks one after another, allocating as it goes; rolls everything back on the
    /// first failure. Returns the placements and the sum of their scores.
    fn place_all(
        &mut self,
        cluster: &mut Cluster,
        tasks: &[Demand],
        ctx: &PlaceCtx<'_>,
    ) -> Result<(Vec<Placement>, f64), Unschedulable> {
        let mut done: Vec<Placement> = Vec::with_capacity(tasks.len());
        let mut total = 0.0;
        for (i, d) in tasks.iter().enumerate() {
            let placed = self.place(cluster, d, ctx).and_then(|p| {
                let node = &cluster.nodes()[p.node as usize];
                total += sanitize(self.policy.score(cluster, node, d)).max(-1e12);
                cluster.allocate(&p).map(|()| p).map_err(|e| alloc_bug(cluster, d, &e))
            });
            match placed {
                Ok(p) => done.push(p),
                Err(report) => {
                    for p in done.iter().rev() {
                        let _ = cluster.release(p);
                    }
                    return Err(Unschedulable { task: i, of: tasks.len(), report });
                }
            }
        }
        Ok((done, total))
    }
}

fn alloc_bug(cluster: &Cluster, d: &Demand, e: &ClusterError) -> FitReport {
    // The filters said yes and the books said no: report it as a device shortage rather than
    // crash; the cluster is unchanged.
    debug_assert!(false, "placement passed the filters but allocation failed: {e}");
    FitReport {
        nodes: cluster.len(),
        kind: d.kind,
        reasons: vec![(Reason::InsufficientDevices, cluster.len())],
    }
}

#[inline]
/// The memoised scores of demand `demand`, one per class id (NaN where not computed yet), grown
/// to `classes` entries.
fn memo_row(memo: &mut Vec<Vec<f64>>, demand: u32, classes: usize) -> &mut Vec<f64> {
    let d = demand as usize;
    if memo.len() <= d {
        memo.resize_with(d + 1, Vec::new);
    }
    let row = &mut memo[d];
    if row.len() < classes {
        row.resize(classes, f64::NAN);
    }
    row
}

#[inline]
fn sanitize(s: f64) -> f64 {
    if s.is_nan() { f64::NEG_INFINITY } else { s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{DeviceSpec, NodeSpec};

    struct Zero;
    impl Policy for Zero {
        fn name(&self) -> &'static str {
            "zero"
        }
        fn score(&mut self, _: &Cluster, _: &Node, _: &Demand) -> f64 {
            0.0
        }
        fn tie_break(&self) -> TieBreak {
            TieBreak::Uniform
        }
    }

    /// An HGX-like node: two NVSwitch islands of four GPUs, one per NUMA node.
    fn hgx(name: &str) -> NodeSpec {
        let mut n = NodeSpec::new(name, 96_000, 1 << 20);
        for i in 0..8u32 {
            n = n.device(
                DeviceSpec::new(format!("gpu{i}"), DeviceKind::Gpu, "H100")
                    .numa(i / 4)
                    .domain(format!("nvlink-{}", i / 4)),
            );
        }
        n
    }

    #[test]
    fn multi_gpu_tasks_stay_inside_one_nvlink_domain() {
        let mut c = Cluster::from_specs([hgx("a")]).unwrap();
        let mut p = Placer::new(Box::new(Zero), 1);
        // Take GPU 0 and 5 with shares, leaving 3 free in each island.
        for dev in [0u16, 5] {
            let pl = Placement {
                node: 0,
                cpu_milli: 0,
                memory_mib: 0,
                devices: vec![DeviceShare { index: dev, milli: 100 }],
                tag: 1,
            };
            c.allocate(&pl).unwrap();
        }
        let d = Demand::whole(1000, 1, DeviceKind::Gpu, 3);
        let got = p.place(&c, &d, &PlaceCtx::default()).unwrap();
        let idx: Vec<u16> = got.devices.iter().map(|s| s.index).collect();
        assert_eq!(idx, vec![1, 2, 3], "three GPUs of the first island, not split");
        c.allocate(&got).unwrap();
        // Two GPUs now: the first island is full, the second has 4,6,7 free.
        let got =
            p.place(&c, &Demand::whole(1000, 1, DeviceKind::Gpu, 2), &PlaceCtx::default()).unwrap();
        let idx: Vec<u16> = got.devices.iter().map(|s| s.index).collect();
        assert_eq!(idx, vec![4, 6]);
        // A 2-GPU task on an idle HGX prefers a gap over breaking the bigger island.
        let mut c2 = Cluster::from_specs([hgx("b")]).unwrap();
        for dev in [0u16, 1] {
            c2.allocate(&Placement {
                node: 0,
                cpu_milli: 0,
                memory_mib: 0,
                devices: vec![DeviceShare { index: dev, milli: 1000 }],
                tag: 2,
            })
            .unwrap();
        }
        let got =
            p.place(&c2, &Demand::whole(0, 0, DeviceKind::Gpu, 2), &PlaceCtx::default()).unwrap();
        let idx: Vec<u16> = got.devices.iter().map(|s| s.index).collect();
        assert_eq!(idx, vec![2, 3], "the 2-GPU gap in island 0, keeping island 1 whole");
    }

    #[test]
    fn shares_go_to_the_fullest_device_that_fits() {
        let mut c =
            Cluster::from_specs([NodeSpec::new("a", 8000, 8000).devices(4, DeviceKind::Gpu, "T4")])
                .unwrap();
        for (dev, m) in [(1u16, 300u16), (2, 600)] {
            c.allocate(&Placement {
                node: 0,
                cpu_milli: 0,
                memory_mib: 0,
                devices: vec![DeviceShare { index: dev, milli: m }],
                tag: 1,
            })
            .unwrap();
        }
        let mut p = Placer::new(Box::new(Zero), 1);
        let got =
            p.place(&c, &Demand::share(0, 0, DeviceKind::Gpu, 400), &PlaceCtx::default()).unwrap();
        assert_eq!(got.devices, vec![DeviceShare { index: 2, milli: 400 }]);
        let got =
            p.place(&c, &Demand::share(0, 0, DeviceKind::Gpu, 500), &PlaceCtx::default()).unwrap();
        assert_eq!(got.devices, vec![DeviceShare { index: 1, milli: 500 }]);
    }

    #[test]
    fn fit_report_counts_each_node_under_its_first_failed_filter() {
        let mut specs = Vec::new();
        for i in 0..5 {
            specs.push(NodeSpec::new(format!("small{i}"), 1000, 1000).devices(
                1,
                DeviceKind::Gpu,
                "T4",
            ));
        }
        for i in 0..3 {
            specs.push(NodeSpec::new(format!("cpu{i}"), 64_000, 100_000));
        }
        specs.push(
            NodeSpec::new("big", 64_000, 100_000)
                .devices(8, DeviceKind::Gpu, "A100")
                .label("zone", "b"),
        );
        let mut c = Cluster::from_specs(specs).unwrap();
        let sel = c.selector_id(&crate::cluster::Selector {
            labels: vec![("zone".into(), "a".into())],
            ..Default::default()
        });
        let p = Placer::new(Box::new(Zero), 1);
        let r = p.report(&c, &Demand::whole(8000, 10, DeviceKind::Gpu, 2), &PlaceCtx::default());
        assert_eq!(r.count(Reason::InsufficientCpu), 5);
        assert_eq!(r.count(Reason::NoSuchDevice), 0);
        assert_eq!(r.count(Reason::InsufficientDevices), 3);
        assert_eq!(
            r.to_string(),
            "0/9 nodes are available: 3 Insufficient gpu, 5 Insufficient cpu"
        );
        let r = p.report(
            &c,
            &Demand::whole(8000, 10, DeviceKind::Gpu, 2).with_selector(sel),
            &PlaceCtx::default(),
        );
        assert_eq!(r.count(Reason::Selector), 9);
    }

    #[test]
    fn ties_are_broken_uniformly_over_nodes_not_classes() {
        // 1 node in one state, 9 in another; equal scores: about 10 % should go to the loner.
        let mut c =
            Cluster::from_specs((0..10).map(|i| NodeSpec::new(format!("n{i}"), 4000, 4000)))
                .unwrap();
        c.allocate(&Placement { node: 0, cpu_milli: 1, memory_mib: 0, devices: vec![], tag: 0 })
            .unwrap();
        assert_eq!(c.state_classes(), 2);
        let mut p = Placer::new(Box::new(Zero), 7);
        let mut hits = 0;
        for _ in 0..10_000 {
            if p.place(&c, &Demand::cpu(1, 0), &PlaceCtx::default()).unwrap().node == 0 {
                hits += 1;
            }
        }
        assert!((800..1200).contains(&hits), "{hits}");
    }

    /// The fitting-class scan (node-order ties) picks what a scan of every node would: the
    /// highest score, then the lowest rank. Random clusters of symmetric and mixed-model nodes,
    /// allocations, releases, status changes and holds, under several contexts.
    #[test]
    fn fitting_classes_choose_as_a_scan_of_every_node() {
        use crate::policy::{PolicyKind, TaskMix};
        for seed in 0..40u64 {
            let mut rng = Rng::new(seed);
            let specs = (0..30).map(|i| {
                let mut n = NodeSpec::new(format!("n{i}"), 8000 + 4000 * (i % 3), 64_000);
                let models = if i % 5 == 0 { ["A100", "T4"] } else { ["A100", "A100"] };
                for g in 0..(2 + i % 3 * 2) {
                    n = n.device(DeviceSpec::new(
                        format!("gpu{g}"),
                        DeviceKind::Gpu,
                        models[(g % 2) as usize],
                    ));
                }
                n
            });
            let mut c = Cluster::from_specs(specs).unwrap();
            c.shuffle_ranks(seed);
            let a100 = c.model_mask(&["A100"]).unwrap();
            let demands: Vec<Demand> = (0..12)
                .map(|k| {
                    let cpu = 500 * (1 + rng.below(6));
                    match k % 4 {
                        0 => Demand::cpu(cpu, 1000),
                        1 => Demand::share(
                            cpu,
                            1000,
                            DeviceKind::Gpu,
                            100 * (1 + rng.below(9) as u16),
                        ),
                        2 => Demand::whole(cpu, 1000, DeviceKind::Gpu, 1 + rng.below(3) as u16),
                        _ => Demand::whole(cpu, 1000, DeviceKind::Gpu, 1).with_models(a100),
                    }
                })
                .collect();
            let mix = TaskMix::from_demands(&demands, 0.95);
            let mut p = Placer::new(PolicyKind::Xpu.build(&mix), seed);
            p.set_explain(false);
            let mut reference = PolicyKind::Xpu.build(&mix);
            let mut held: Vec<Placement> = Vec::new();
            for step in 0..400 {
                let d = demands[rng.index(demands.len())];
                let ctx = match step % 7 {
                    0 => PlaceCtx { any_status: true, ..PlaceCtx::default() },
                    1 => PlaceCtx { token: 5, ..PlaceCtx::default() },
                    2 => PlaceCtx { token: 6, ..PlaceCtx::default() },
                    _ => PlaceCtx::default(),
                };
                let mut want: Option<(f64, u32, NodeId)> = None;
                for (id, node) in c.nodes().iter().enumerate() {
                    if check(&c, node, &d, &ctx).is_err() {
                        continue;
                    }
                    let s = sanitize(reference.score(&c, node, &d));
                    let r = c.rank(id as NodeId);
                    if want.is_none_or(|(bs, br, _)| s > bs || (s == bs && r < br)) {
                        want = Some((s, r, id as NodeId));
                    }
                }
                let got = p.place(&c, &d, &ctx).ok();
                assert_eq!(
                    got.as_ref().map(|g| g.node),
                    want.map(|w| w.2),
                    "seed {seed} step {step}"
                );
                match rng.below(10) {
                    0..6 => {
                        if let Some(g) = got {
                            c.allocate(&g).unwrap();
                            held.push(g);
                        }
                    }
                    6..8 if !held.is_empty() => {
                        let g = held.swap_remove(rng.index(held.len()));
                        c.release(&g).unwrap();
                    }
                    8 => {
                        let id = rng.index(c.len()) as NodeId;
                        let st = if rng.below(2) == 0 {
                            NodeStatus::Cordoned
                        } else {
                            NodeStatus::Ready
                        };
                        c.set_status(id, st).unwrap();
                    }
                    _ => {
                        let id = rng.index(c.len()) as NodeId;
                        c.set_reserved(id, [0, 5, 6][rng.index(3)]);
                    }
                }
            }
        }
    }
}
