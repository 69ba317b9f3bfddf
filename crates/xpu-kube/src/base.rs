//! The cluster a scheduling cycle places on, kept from one cycle to the next.
//!
//! Building `xpu-sched`'s cluster from the watch caches costs what the cluster holds (every
//! node, with what its pods use taken), whatever waits: at 15,000 nodes that was most of a
//! cycle. The cycle's [`crate::cycle::Memo`] keeps the cluster the last cycle built ([`Base`])
//! with what each node was built from: the node object's converted view (the same `Arc` while
//! its `resourceVersion` stands), the ledger's generation for the pods bound there, and what
//! the pods the ledger does not count (assumed, or held for a preemptor) add there. A cycle
//! compares each node's inputs with those and builds again, in place
//! ([`Cluster::replace_node`]), only the nodes that differ. It then lends the cluster to its
//! scheduler and gets it back ([`give_back`]): the nodes the scheduler changed (what it placed)
//! are built again by the next cycle, and nodes it added for itself (flex-start slots) are
//! dropped. The scheduler's empty copy of the cluster (for "can never fit" checks) is kept the
//! same way.
//!
//! The whole cluster is built again when the node set changes (a node added or removed, or one
//! that could not be built turning good or bad), when a cycle-wide choice changes (nodes
//! labelled by name for pods with DRA claims; device resources kept apart), and every
//! [`MAX_AGE`] cycles (each cycle interns its pods' selectors into the cluster), and when the
//! node shapes interned reach twice the nodes (a node built again with other capacity interns
//! a shape, and none is dropped). A cycle that
//! ends before giving the cluster back leaves none, and a what-if (preemption) never takes it.
//! The kept cluster equals a fresh build after every event
//! (`ledger::tests::the_ledger_equals_a_rebuild_after_every_event` compares them node by node,
//! and the plans made on each).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use xpu_sched::cluster::ClusterError;
use xpu_sched::placement::{DeviceShare, Placement};
use xpu_sched::{Cluster, NodeId, NodeSpec, NodeStatus};

use crate::convert::{self, NODE_NAME};
use crate::cycle::{OFFERS, Snapshot, Used};
use crate::ledger::Book;
use crate::share;

/// Cycles a kept cluster serves before it is built whole again.
pub(crate) const MAX_AGE: u32 = 1000;

type View = Arc<Result<convert::NodeView, String>>;

/// Choices a cycle makes for every node alike.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Flags {
    /// Nodes carry their name as a label (a waiting pod has DRA claims).
    pub by_name: bool,
    /// Nodes are labelled with the device resources they offer (more than one is offered).
    pub separate: bool,
    pub offered: BTreeSet<&'static str>,
}

/// What the pods on each node hold: the ledger's books, and what the cycle counted besides.
pub(crate) struct Books<'a> {
    pub ledger: Option<&'a Book>,
    pub extra: &'a HashMap<String, Used>,
}

impl Books<'_> {
    fn generation(&self, node: &str) -> u64 {
        self.ledger.map_or(0, |b| b.generation(node))
    }

    fn used(&self, node: &str) -> Used {
        let mut u = self.ledger.and_then(|b| b.node(node)).map(|b| b.used()).unwrap_or_default();
        if let Some(x) = self.extra.get(node) {
            u.merge(x);
        }
        u
    }
}

/// The cluster the last cycle built, and what each of its nodes was built from.
#[derive(Debug)]
pub(crate) struct Base {
    /// `None` while a cycle has it.
    cluster: Option<Cluster>,
    /// The scheduler's empty copy of it, when one was made and came back with nothing held.
    empty: Option<Cluster>,
    /// Every node object, in name order.
    nodes: Vec<Kept>,
    /// Per node id, its index in `nodes`.
    index: Vec<usize>,
    flags: Flags,
    /// The nodes left out, with why, as the whole build found them.
    bad_nodes: Vec<(String, String)>,
    /// Cycles since the whole build.
    age: u32,
}

/// What one node was built from.
#[derive(Debug)]
struct Kept {
    name: String,
    view: View,
    /// The ledger's generation of the node's bound pods (0 without a ledger).
    generation: u64,
    /// What the pods the ledger does not count held there.
    extra: Option<Used>,
    /// Its id in the cluster; `None`: left out.
    id: Option<NodeId>,
    /// False once a scheduler changed it: built again next cycle.
    clean: bool,
}

/// How a cycle's cluster came to be, counted by the memo.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BuildStats {
    /// Cycles that built the whole cluster.
    pub whole: u64,
    /// Cycles that patched the kept one.
    pub patched: u64,
    /// Nodes built, whole builds and patches together.
    pub nodes: u64,
}

/// The cycle's cluster (and the kept empty copy, if any) over `views` (every node object's
/// name and view, in name order), patched from `kept` where it still fits, else built whole.
/// With `keep`, also what to keep for the next cycle. Nodes left out are added to `bad_nodes`.
pub(crate) fn build(
    kept: Option<Base>,
    keep: bool,
    views: &[(&str, View)],
    books: &Books<'_>,
    flags: Flags,
    bad_nodes: &mut Vec<(String, String)>,
    stats: &mut BuildStats,
) -> (Cluster, Option<Cluster>, Option<Base>) {
    let patched = kept.filter(|b| keep && b.fits(views, &flags)).and_then(|mut base| {
        match base.patch(views, books) {
            Ok(built) => Some((base, built)),
            Err(e) => {
                // A node the whole build leaves out (it says why in `bad_nodes`).
                tracing::debug!(error = %e, "kept cluster not patched; building it whole");
                None
            }
        }
    });
    if let Some((mut base, built)) = patched
        && let Some(mut cluster) = base.cluster.take()
    {
        bad_nodes.extend(base.bad_nodes.iter().cloned());
        base.age += 1;
        cluster.take_touched();
        let empty = base.empty.take();
        stats.patched += 1;
        stats.nodes += built;
        return (cluster, empty, Some(base));
    }
    stats.whole += 1;
    stats.nodes += views.len() as u64;
    let mut cluster = Cluster::new();
    let mut nodes = Vec::with_capacity(if keep { views.len() } else { 0 });
    let mut index = Vec::new();
    let mut unbuilt = Vec::new();
    for (name, view) in views {
        let id = match view.as_ref() {
            Err(why) => {
                bad_nodes.push(((*name).to_owned(), why.clone()));
                None
            }
            Ok(v) => {
                let u = books.used(name);
                let (spec, status) = node_spec(v, &u, &flags);
                match cluster.add_node_with_status(spec, status) {
                    Ok(id) => {
                        hold(&mut cluster, id, &u);
                        Some(id)
                    }
                    Err(e) => {
                        unbuilt.push(((*name).to_owned(), e.to_string()));
                        None
                    }
                }
            }
        };
        if keep {
            if id.is_some() {
                index.push(nodes.len());
            }
            nodes.push(Kept {
                name: (*name).to_owned(),
                view: view.clone(),
                generation: books.generation(name),
                extra: books.extra.get(*name).cloned(),
                id,
                clean: true,
            });
        }
    }
    bad_nodes.extend(unbuilt);
    if !keep {
        return (cluster, None, None);
    }
    cluster.track_touched(true);
    cluster.take_touched();
    let base = Base {
        cluster: None,
        empty: None,
        nodes,
        index,
        flags,
        bad_nodes: bad_nodes.clone(),
        age: 0,
    };
    (cluster, None, Some(base))
}

/// Returns the cluster (and the scheduler's empty copy) a cycle placed on to the memo it was
/// taken from; nothing for a what-if or without a memo.
pub(crate) fn give_back(snap: &Snapshot<'_>, cluster: Cluster, empty: Option<Cluster>) {
    let Some(memo) = snap.memo.filter(|_| snap.hold_out.is_none()) else { return };
    if memo.with_base(|b| b.receive(cluster, empty)) == Some(false) {
        // Not an error: the next cycle builds the whole cluster (see `Base::receive`).
        tracing::debug!("kept cluster dropped; the next cycle builds it whole");
        memo.drop_base();
    }
}

impl Base {
    /// Whether the cluster can be patched for `views` with `flags`: the same node objects by
    /// name, each left out or not as before, and the same cycle-wide choices.
    fn fits(&self, views: &[(&str, View)], flags: &Flags) -> bool {
        self.cluster.is_some()
            && self.age < MAX_AGE
            && self.flags == *flags
            && self.nodes.len() == views.len()
            && self.nodes.iter().zip(views).all(|(k, (name, view))| {
                k.name == *name
                    && match k.id {
                        Some(_) => view.is_ok(),
                        None => Arc::ptr_eq(&k.view, view),
                    }
            })
    }

    /// Builds again, in place, every node whose inputs changed or that a scheduler changed.
    /// Says how many it built.
    fn patch(&mut self, views: &[(&str, View)], books: &Books<'_>) -> Result<u64, ClusterError> {
        let Base { cluster, empty, nodes, flags, .. } = self;
        let Some(cluster) = cluster.as_mut() else { return Ok(0) };
        let mut built = 0;
        for (k, (name, view)) in nodes.iter_mut().zip(views) {
            let Some(id) = k.id else { continue };
            let generation = books.generation(name);
            let extra = books.extra.get(*name);
            if k.clean
                && Arc::ptr_eq(&k.view, view)
                && k.generation == generation
                && k.extra.as_ref() == extra
            {
                continue;
            }
            let Ok(v) = view.as_ref() else { return Err(ClusterError::NoSuchNode(id)) };
            let u = books.used(name);
            let (spec, status) = node_spec(v, &u, flags);
            cluster.replace_node(id, spec, status)?;
            hold(cluster, id, &u);
            if let Some(e) = empty.as_mut() {
                let spec = cluster.empty_spec(id).ok_or(ClusterError::NoSuchNode(id))?;
                e.replace_node(id, spec, NodeStatus::Ready)?;
            }
            (k.view, k.generation, k.extra, k.clean) =
                (view.clone(), generation, extra.cloned(), true);
            built += 1;
        }
        Ok(built)
    }

    /// Takes back a lent cluster: nodes past the kept ones are dropped, the nodes its
    /// scheduler changed are marked to be built again. False: it is not the cluster lent.
    fn receive(&mut self, mut cluster: Cluster, empty: Option<Cluster>) -> bool {
        let len = self.index.len();
        // Nodes built again leave their old shapes interned: past twice the nodes, the next
        // cycle builds the whole cluster, which holds only the shapes in use.
        if self.cluster.is_some() || cluster.len() < len || cluster.shape_count() > 2 * len + 256 {
            return false;
        }
        cluster.truncate(len);
        let same = self.index.iter().enumerate().all(|(id, &i)| {
            cluster.node(id as NodeId).is_some_and(|n| n.name == self.nodes[i].name)
        });
        if !same {
            return false;
        }
        for id in cluster.take_touched() {
            if let Some(&i) = self.index.get(id as usize) {
                self.nodes[i].clean = false;
            }
        }
        self.empty = empty.filter(|e| e.len() >= len).and_then(|mut e| {
            e.truncate(len);
            e.all_free().then_some(e)
        });
        self.cluster = Some(cluster);
        true
    }
}

/// Node `v` as the cycle's cluster holds it, with what its pods use (`u`) taken from its CPU
/// and memory, labelled as `flags` say, cordoned when it is not ready or holds its most pods.
fn node_spec(v: &convert::NodeView, u: &Used, flags: &Flags) -> (NodeSpec, NodeStatus) {
    let mut spec = v.spec.clone();
    if flags.by_name {
        spec.labels.insert(NODE_NAME.into(), spec.name.clone());
    }
    if flags.separate {
        for res in &flags.offered {
            let prefix = format!("{res}/");
            if spec.devices.iter().any(|d| d.id.starts_with(&prefix)) {
                spec.labels.insert(format!("{OFFERS}{res}"), "true".into());
            }
        }
    }
    if u.unreadable {
        (spec.cpu_milli, spec.memory_mib) = (0, 0);
    }
    spec.cpu_milli = spec.cpu_milli.saturating_sub(u.cpu);
    spec.memory_mib = spec.memory_mib.saturating_sub(u.mem);
    let status =
        if v.ready && u.pods < v.max_pods { NodeStatus::Ready } else { NodeStatus::Cordoned };
    (spec, status)
}

/// Takes the devices the pods on node `id` hold.
fn hold(cluster: &mut Cluster, id: NodeId, u: &Used) {
    if u.unreadable {
        hold_all(cluster, id);
    } else {
        hold_whole(cluster, id, &u.dev);
        hold_shares(cluster, id, &u.shares);
    }
}

/// Takes every device of node `id`: a pod there holds what xpu cannot count.
fn hold_all(cluster: &mut Cluster, id: NodeId) {
    let Some(node) = cluster.node(id) else { return };
    let devices: Vec<DeviceShare> = node
        .devices
        .iter()
        .enumerate()
        .filter(|(_, d)| d.free_milli() > 0)
        .map(|(i, d)| DeviceShare { index: i as u16, milli: d.free_milli() })
        .collect();
    if devices.is_empty() {
        return;
    }
    let p = Placement { node: id, cpu_milli: 0, memory_mib: 0, devices, tag: 0 };
    // Every device was free to this extent an instant ago; a failure means a bug here.
    if let Err(e) = cluster.allocate(&p) {
        tracing::warn!(node = id, error = %e, "could not hold a node's devices");
    }
}

/// Takes the whole devices bound pods hold on node `id` (the kubelet chose which; the last
/// free ones of each resource stand for them), so the node keeps its capacity: a pod waiting
/// for a device in use is told `Insufficient`, not that it can never fit.
fn hold_whole(cluster: &mut Cluster, id: NodeId, used: &BTreeMap<&'static str, u64>) {
    for (res, count) in used {
        let Some(node) = cluster.node(id) else { return };
        let prefix = format!("{res}/");
        let devices: Vec<DeviceShare> = node
            .devices
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, d)| d.id.starts_with(&prefix) && d.free_milli() == 1000)
            .take(*count as usize)
            .map(|(i, _)| DeviceShare { index: i as u16, milli: 1000 })
            .collect();
        if devices.is_empty() {
            continue;
        }
        let p = Placement { node: id, cpu_milli: 0, memory_mib: 0, devices, tag: 0 };
        // The devices were free an instant ago; a failure means a bug in this loop.
        if let Err(e) = cluster.allocate(&p) {
            tracing::warn!(node = id, error = %e, "could not count a bound pod's devices");
        }
    }
}

/// Takes the GPU shares bound pods hold on node `id`: on the GPUs recorded for each, else (a
/// pod bound without xpu's record, which xpu's device plugin will refuse) on the first GPUs
/// with room, so that the node is never counted emptier than it may be.
fn hold_shares(
    cluster: &mut Cluster,
    id: NodeId,
    shares: &BTreeMap<String, (u64, Option<Vec<u16>>)>,
) {
    for (ask, gpus) in shares.values() {
        let Some((count, milli)) = share::spread(*ask) else { continue };
        let Some(node) = cluster.node(id) else { return };
        let free: Vec<u16> = node.devices.iter().map(|d| d.free_milli()).collect();
        let chosen: Vec<u16> = match gpus {
            Some(g) if g.len() == count && g.iter().all(|&i| usize::from(i) < free.len()) => {
                g.clone()
            }
            _ => (0..free.len() as u16)
                .filter(|&i| free[usize::from(i)] >= milli)
                .take(count)
                .collect(),
        };
        let p = Placement {
            node: id,
            cpu_milli: 0,
            memory_mib: 0,
            devices: chosen
                .iter()
                .map(|&index| DeviceShare { index, milli: milli.min(free[usize::from(index)]) })
                .filter(|d| d.milli > 0)
                .collect(),
            tag: 0,
        };
        // CPU and memory are already subtracted; a GPU over-committed by pods bound elsewhere
        // (two pods claiming one GPU) keeps what fits, and the rest is simply not there.
        if !p.devices.is_empty() && cluster.allocate(&p).is_err() {
            tracing::debug!(node = id, ?p, "a bound pod's GPU share does not fit its record");
        }
    }
}
