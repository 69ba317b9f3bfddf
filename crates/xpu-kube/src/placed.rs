//! The inter-pod index of the pods already placed, kept from one cycle to the next.
//!
//! Pod affinity, anti-affinity and spread count the bound pods by node ([`PodIndex`]). Built
//! afresh, a cycle read every bound pod's terms: at 50,000 bound pods, a tenth of a cycle with
//! anti-affinity. [`Kept`] holds the index and what each pod was entered from (its
//! `resourceVersion` and node); a cycle enters only the pods written since the last one, takes
//! out the pods gone, and lends its scheduler a copy (the scheduler adds what it places to the
//! copy and undoes trials there; the kept index never sees them).
//!
//! A pod's terms depend on the namespaces' labels (a term's `namespaceSelector`) and on its
//! PodGroup's topology, and the index names nodes by id: when any of these changes (a
//! namespace relabelled, a PodGroup made, a node added or removed), the index is built again
//! whole. A what-if (`hold_out`) never uses it. The kept index equals a fresh one after every
//! event (`cycle::tests::the_kept_pod_index_equals_a_fresh_one_after_every_event`).

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use xpu_sched::hash::FxHashMap;
use xpu_sched::pods::{PodIndex, PodTerms};
use xpu_sched::{Cluster, NodeId};

use crate::cycle::{Snapshot, bound_node, placed_terms, terminal};

/// The index and what each pod in it was entered from.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// What the terms and node ids depend on besides the pods ([`inputs`]).
    inputs: u64,
    index: PodIndex,
    /// By uid (the API server's, so a fast hash).
    pods: FxHashMap<String, Entry>,
    /// Updates so far; an entry not seen by the last is of a pod gone.
    round: u64,
}

#[derive(Debug)]
struct Entry {
    /// `None`: entered again on every update.
    version: Option<String>,
    node: NodeId,
    /// The node's name: a pod still there is matched without a lookup of the name.
    node_name: String,
    terms: Arc<PodTerms>,
    seen: u64,
}

/// A fingerprint of the cluster's node names in id order, the namespaces' labels and the
/// PodGroups' topologies.
fn inputs(snap: &Snapshot<'_>, cluster: &Cluster) -> u64 {
    let one = |x: &dyn Fn(&mut std::hash::DefaultHasher)| {
        let mut h = std::hash::DefaultHasher::new();
        x(&mut h);
        h.finish()
    };
    let nodes = one(&|h| {
        for n in cluster.nodes() {
            n.name.hash(h);
        }
    });
    // Maps: summed, so that their order does not count.
    let namespaces =
        snap.namespace_labels.iter().map(|e| one(&|h| e.hash(h))).fold(0u64, u64::wrapping_add);
    let groups = snap
        .pod_groups
        .into_iter()
        .flatten()
        .map(|(k, g)| one(&|h| (k, &g.topology).hash(h)))
        .fold(0u64, u64::wrapping_add);
    one(&|h| (nodes, namespaces, groups, snap.pod_groups.is_some()).hash(h))
}

impl Kept {
    /// Brings the index up to the pods of `snap` on `cluster`'s nodes and returns a copy.
    pub(crate) fn update(&mut self, snap: &Snapshot<'_>, cluster: &Cluster) -> PodIndex {
        debug_assert!(snap.hold_out.is_none(), "a what-if records its pods afresh");
        let inputs = inputs(snap, cluster);
        if inputs != self.inputs {
            *self = Kept { inputs, ..Kept::default() };
            self.index.index_labels();
        }
        self.round += 1;
        let round = self.round;
        // Pods without a uid are not kept: they are entered in the copy only.
        let mut loose = Vec::new();
        for p in snap.pods.iter().filter(|p| !terminal(p)) {
            let Some(node) = bound_node(p, snap.assumed) else { continue };
            let version = p.metadata.resource_version.as_deref();
            let uid = p.metadata.uid.as_deref();
            if let Some(e) = uid.and_then(|u| self.pods.get_mut(u))
                && e.node_name == node
                && version.is_some()
                && e.version.as_deref() == version
            {
                e.seen = round;
                continue;
            }
            let Some(id) = cluster.node_id(node) else { continue };
            let Some(uid) = uid else {
                loose.extend(placed_terms(snap, p).map(|t| (id, t)));
                continue;
            };
            let terms = placed_terms(snap, p);
            match (self.pods.get_mut(uid), terms) {
                // Written, but to the same terms where it was (bound after being assumed).
                (Some(e), Some(t)) if e.node == id && *e.terms == *t => {
                    e.version = version.map(str::to_owned);
                    e.seen = round;
                }
                (_, terms) => {
                    if let Some(old) = self.pods.remove(uid) {
                        self.index.remove(old.node, &old.terms);
                    }
                    if let Some(t) = terms {
                        self.index.add(id, t.clone());
                        let e = Entry {
                            version: version.map(str::to_owned),
                            node: id,
                            node_name: node.to_owned(),
                            terms: t,
                            seen: round,
                        };
                        self.pods.insert(uid.to_owned(), e);
                    }
                }
            }
        }
        let index = &mut self.index;
        self.pods.retain(|_, e| {
            if e.seen != round {
                index.remove(e.node, &e.terms);
            }
            e.seen == round
        });
        let mut copy = self.index.clone();
        for (id, t) in loose {
            copy.add(id, t);
        }
        copy
    }
}
