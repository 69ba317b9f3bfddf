//! Inter-pod constraints with Kubernetes semantics: required pod affinity and anti-affinity
//! (the incoming pod's terms and, by symmetry, the anti-affinity of pods already placed),
//! topology spread (`DoNotSchedule` filters, `ScheduleAnyway` scores) and preferred terms as
//! scores. Plain data, no Kubernetes types: `xpu-kube` resolves a pod's fields (namespace
//! selectors, `matchLabelKeys`) into [`PodTerms`].
//!
//! [`PodIndex`] is the state: the pods placed so far (bound ones, then each task as it is
//! placed), counted per node for every distinct pod matcher a constraint has asked about, and
//! each node's domain per topology key. A placement asks it for a [`PodMask`] (the nodes a task
//! may not use, with the reason, and a preference score per node); the counts are kept as pods
//! come and go, never recomputed from all pods per candidate node. A matcher asked about for
//! the first time is counted over the pods carrying one of its `In` labels (lists of the pods
//! per label, kept as pods come and go), not over every pod.
//!
//! Semantics follow kube-scheduler's `InterPodAffinity` and `PodTopologySpread` plugins:
//! - affinity: a node passes when it has every term's topology key and, per term, the domain
//!   holds a pod matching *all* the pod's terms; when no pod in the cluster matches them and
//!   the pod matches all its own terms, any node with the keys passes (the first of a group);
//! - anti-affinity: a node fails when, for a term, it has the key and its domain holds a
//!   matching pod; a placed pod's anti-affinity term that matches the incoming pod keeps the
//!   incoming pod out of the placed pod's domain;
//! - spread: pods matching the selector in the pod's namespace are counted on the nodes that
//!   pass the pod's node affinity (and its taints, with `nodeTaintsPolicy: Honor`) and carry
//!   every constraint's key; a node fails when it lacks the key, or when its domain's count,
//!   plus one when the pod matches its own selector, exceeds the smallest domain's by more than
//!   `maxSkew` (the smallest is 0 while there are fewer domains than `minDomains`).

use std::collections::BTreeMap;
use std::hash::RandomState;
use std::sync::Arc;

use crate::cluster::{Cluster, NodeId};
use crate::hash::FxHashMap;
use crate::placement::Reason;

/// A label selector operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelOp {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// One requirement of a label selector (`matchLabels` entries become `In` with one value).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelReq {
    pub key: String,
    pub op: LabelOp,
    pub values: Vec<String>,
}

/// A pod label selector: requirements ANDed. `nothing` is a null selector, which matches no
/// pod; an empty one matches every pod.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LabelSelector {
    pub nothing: bool,
    pub reqs: Vec<LabelReq>,
}

impl LabelSelector {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.nothing
            && self.reqs.iter().all(|r| {
                let v = labels.get(&r.key);
                match r.op {
                    LabelOp::In => v.is_some_and(|v| r.values.contains(v)),
                    LabelOp::NotIn => v.is_none_or(|v| !r.values.contains(v)),
                    LabelOp::Exists => v.is_some(),
                    LabelOp::DoesNotExist => v.is_none(),
                }
            })
    }
}

/// The namespaces a term looks in, resolved (the pod's own when the term names none).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Namespaces {
    All,
    /// Sorted.
    Only(Vec<String>),
}

impl Namespaces {
    pub fn contains(&self, ns: &str) -> bool {
        match self {
            Self::All => true,
            Self::Only(v) => v.binary_search_by(|x| x.as_str().cmp(ns)).is_ok(),
        }
    }
}

/// Which pods a term is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodMatcher {
    pub selector: LabelSelector,
    pub namespaces: Namespaces,
}

impl PodMatcher {
    pub fn matches(&self, p: &PodTerms) -> bool {
        self.namespaces.contains(&p.namespace) && self.selector.matches(&p.labels)
    }
}

/// A pod (anti-)affinity term.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Term {
    pub pods: PodMatcher,
    pub topology_key: String,
}

/// A topology spread constraint.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Spread {
    pub max_skew: u32,
    /// 0: unset.
    pub min_domains: u32,
    pub topology_key: String,
    /// `DoNotSchedule`; otherwise `ScheduleAnyway` (a score).
    pub hard: bool,
    /// Counted in the pod's own namespace.
    pub selector: LabelSelector,
    /// `nodeTaintsPolicy: Honor`: nodes whose taints the pod does not tolerate are not counted.
    pub honor_taints: bool,
    /// `nodeAffinityPolicy: Honor` (the default): nodes the pod's node affinity and selector
    /// exclude are not counted.
    pub honor_affinity: bool,
}

/// What a pod is to other pods (namespace, labels) and the constraints it carries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct PodTerms {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// Required affinity terms.
    pub affinity: Vec<Term>,
    /// Required anti-affinity terms.
    pub anti_affinity: Vec<Term>,
    /// Preferred terms: weight (negative for anti-affinity) and term.
    pub preferred: Vec<(i32, Term)>,
    pub spread: Vec<Spread>,
}

impl PodTerms {
    /// Whether the pod constrains where it goes (a pod without terms may still be kept out of
    /// nodes by placed pods' anti-affinity).
    pub fn is_empty(&self) -> bool {
        self.affinity.is_empty()
            && self.anti_affinity.is_empty()
            && self.preferred.is_empty()
            && self.spread.is_empty()
    }

    /// The topology key of a required affinity term the pod matches itself: a group of such
    /// pods must share one domain of it (the first one chooses).
    pub fn self_affinity_key(&self) -> Option<&str> {
        self.affinity.iter().find(|t| t.pods.matches(self)).map(|t| t.topology_key.as_str())
    }
}

/// Per node: may a task go there (`None`) or the filter it fails; and its preference score
/// (higher wins before the placement policy's score is looked at).
#[derive(Debug, Clone, Default)]
pub struct PodMask {
    pub veto: Vec<Option<Reason>>,
    pub pref: Vec<i64>,
}

impl PodMask {
    fn open(n: usize) -> Self {
        Self { veto: vec![None; n], pref: vec![0; n] }
    }

    fn deny(&mut self, node: usize, r: Reason) {
        if self.veto[node].is_none() {
            self.veto[node] = Some(r);
        }
    }

    /// Keeps only nodes whose domain of a key is `domain`.
    pub(crate) fn only(&mut self, domains: &[u32], domain: u32) {
        for (i, &d) in domains.iter().enumerate() {
            if d != domain {
                self.deny(i, Reason::PodAffinity);
            }
        }
    }
}

/// A term a placed pod carries that bears on pods placed after it: its required
/// anti-affinity (`weight: None`) or a preferred term.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Owned {
    term: Term,
    weight: Option<i32>,
}

/// Per node counts (sparse).
type Counts = FxHashMap<NodeId, u32>;

/// No domain: the node lacks the key.
pub const NO_DOMAIN: u32 = u32::MAX;

/// The pods placed so far and the counts constraints ask about; see the module docs.
#[derive(Debug, Clone, Default)]
pub struct PodIndex {
    nodes: usize,
    pods: Vec<(NodeId, Arc<PodTerms>)>,
    /// Pods matching every matcher of the key, per node.
    counters: FxHashMap<Vec<PodMatcher>, Counts>,
    /// Placed pods' terms, per node where the pods are.
    owned: FxHashMap<Owned, Counts>,
    /// Per topology key: each node's domain ([`NO_DOMAIN`] without the label).
    domains: FxHashMap<String, Arc<[u32]>>,
    /// Positions in `pods` of the pods carrying each label, by [`label_hash`]: where to look
    /// for the pods a selector with an `In` requirement matches, instead of at every pod (a
    /// cycle with 100 anti-affinity matchers over 50,000 bound pods matched 5 million label
    /// sets). Candidates only: a pod found here is still matched in full. Built on first use,
    /// then kept as pods come and go.
    by_label: Option<FxHashMap<u64, Vec<u32>>>,
    /// Positions in `pods` of the pods on each node: a pod leaves without a scan of every pod.
    by_node: FxHashMap<NodeId, Vec<u32>>,
    /// The keys of [`label_hash`], random per index (and kept by its copies): labels are chosen
    /// by whoever writes a pod, and must not be able to make every label land on one list.
    seed: RandomState,
}

/// Enters pod `p`, at position `at`, in the lists of its labels.
fn post(seed: &RandomState, index: &mut FxHashMap<u64, Vec<u32>>, p: &PodTerms, at: u32) {
    for (k, v) in &p.labels {
        index.entry(label_hash(seed, k, v)).or_default().push(at);
    }
}

/// Takes position `at` out of the lists of pod `p`'s labels.
fn unpost(seed: &RandomState, index: &mut FxHashMap<u64, Vec<u32>>, p: &PodTerms, at: u32) {
    for (k, v) in &p.labels {
        let h = label_hash(seed, k, v);
        if let Some(list) = index.get_mut(&h) {
            if let Some(j) = list.iter().rposition(|&x| x == at) {
                list.swap_remove(j);
            }
            if list.is_empty() {
                index.remove(&h);
            }
        }
    }
}

/// A keyed hash of one label, `key=value`.
fn label_hash(seed: &RandomState, key: &str, value: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = seed.build_hasher();
    h.write(key.as_bytes());
    h.write_u8(0xff); // never in UTF-8; a collision only costs time: candidates are matched
    h.write(value.as_bytes());
    h.finish()
}

fn bump(c: &mut Counts, node: NodeId, up: bool) {
    if up {
        *c.entry(node).or_default() += 1;
    } else if let Some(n) = c.get_mut(&node) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            c.remove(&node);
        }
    }
}

impl PodIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Pods placed (bound, or placed in this run).
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Whether a task with terms `t` is constrained here: by its own terms, or by terms of
    /// placed pods that match it.
    pub fn constrains(&self, t: &PodTerms) -> bool {
        !t.is_empty() || self.owned.keys().any(|o| o.term.pods.matches(t))
    }

    /// Records a pod on `node`.
    pub fn add(&mut self, node: NodeId, pod: Arc<PodTerms>) {
        self.account(node, &pod, true);
        let at = self.pods.len() as u32;
        if let Some(index) = self.by_label.as_mut() {
            post(&self.seed, index, &pod, at);
        }
        self.by_node.entry(node).or_default().push(at);
        self.pods.push((node, pod));
    }

    /// Forgets a pod recorded on `node` (the most recent one equal to `pod`).
    pub fn remove(&mut self, node: NodeId, pod: &PodTerms) {
        let Some(here) = self.by_node.get_mut(&node) else { return };
        let found = here
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, at)| *self.pods[at as usize].1 == *pod)
            .max_by_key(|&(_, at)| at);
        let Some((j, i)) = found else { return };
        here.swap_remove(j);
        if here.is_empty() {
            self.by_node.remove(&node);
        }
        let last = self.pods.len() as u32 - 1;
        let (_, p) = self.pods.swap_remove(i as usize);
        if let Some(index) = self.by_label.as_mut() {
            unpost(&self.seed, index, &p, i);
        }
        if let Some((moved_node, moved)) = self.pods.get(i as usize) {
            // The last pod moves to position `i`.
            if let Some(at) =
                self.by_node.get_mut(moved_node).and_then(|l| l.iter_mut().find(|at| **at == last))
            {
                *at = i;
            }
            if let Some(index) = self.by_label.as_mut() {
                unpost(&self.seed, index, moved, last);
                post(&self.seed, index, moved, i);
            }
        }
        self.account(node, &p, false);
    }

    /// Builds the lists of the pods carrying each label now (else they are built on first use),
    /// for an index kept and copied: each copy then starts with them.
    pub fn index_labels(&mut self) {
        let (pods, seed) = (&self.pods, &self.seed);
        self.by_label.get_or_insert_with(|| {
            let mut index = FxHashMap::default();
            for (i, (_, p)) in pods.iter().enumerate() {
                post(seed, &mut index, p, i as u32);
            }
            index
        });
    }

    /// Every pod recorded, with its node, in no particular order.
    pub fn pods(&self) -> &[(NodeId, Arc<PodTerms>)] {
        &self.pods
    }

    /// The positions of the pods that may match every matcher, when one of them has an `In`
    /// requirement that narrows the pods down (its values' lists, the shortest such).
    fn candidates(&mut self, matchers: &[PodMatcher]) -> Option<Vec<u32>> {
        let ins =
            || matchers.iter().flat_map(|m| m.selector.reqs.iter()).filter(|r| r.op == LabelOp::In);
        ins().next()?;
        self.index_labels();
        let index = self.by_label.as_ref()?;
        let lists = |r: &LabelReq| {
            let seed = &self.seed;
            r.values
                .iter()
                .filter_map(|v| index.get(&label_hash(seed, &r.key, v)))
                .collect::<Vec<_>>()
        };
        let best = ins()
            .map(|r| {
                let l = lists(r);
                (l.iter().map(|x| x.len()).sum::<usize>(), l)
            })
            .min_by_key(|(n, _)| *n)?;
        let mut out: Vec<u32> = best.1.into_iter().flatten().copied().collect();
        // A pod has one value per key, but a selector may name a value twice.
        out.sort_unstable();
        out.dedup();
        Some(out)
    }

    fn account(&mut self, node: NodeId, pod: &PodTerms, up: bool) {
        for (ms, c) in self.counters.iter_mut() {
            if ms.iter().all(|m| m.matches(pod)) {
                bump(c, node, up);
            }
        }
        let owned =
            pod.anti_affinity.iter().map(|t| Owned { term: t.clone(), weight: None }).chain(
                pod.preferred.iter().map(|(w, t)| Owned { term: t.clone(), weight: Some(*w) }),
            );
        for o in owned {
            bump(self.owned.entry(o).or_default(), node, up);
        }
        self.owned.retain(|_, c| !c.is_empty());
    }

    /// Each node's domain of `key`.
    pub fn domains(&mut self, cluster: &Cluster, key: &str) -> Arc<[u32]> {
        if self.nodes != cluster.len() {
            self.domains.clear();
            self.nodes = cluster.len();
        }
        if let Some(d) = self.domains.get(key) {
            return d.clone();
        }
        let mut ids: FxHashMap<&str, u32> = FxHashMap::default();
        let d: Arc<[u32]> = cluster
            .nodes()
            .iter()
            .map(|n| match n.labels.get(key) {
                Some(v) => {
                    let next = ids.len() as u32;
                    *ids.entry(v.as_str()).or_insert(next)
                }
                None => NO_DOMAIN,
            })
            .collect();
        self.domains.insert(key.to_owned(), d.clone());
        d
    }

    fn counts(&mut self, matchers: &[PodMatcher]) -> &Counts {
        if !self.counters.contains_key(matchers) {
            let mut c = Counts::default();
            let mut count = |(n, p): &(NodeId, Arc<PodTerms>)| {
                if matchers.iter().all(|m| m.matches(p)) {
                    bump(&mut c, *n, true);
                }
            };
            match self.candidates(matchers) {
                Some(at) => at.iter().for_each(|&i| count(&self.pods[i as usize])),
                None => self.pods.iter().for_each(count),
            }
            self.counters.insert(matchers.to_vec(), c);
        }
        &self.counters[matchers]
    }

    /// Per domain of `key`: the matching pods on nodes `keep` lets through.
    fn by_domain(
        &mut self,
        cluster: &Cluster,
        matchers: &[PodMatcher],
        key: &str,
        keep: &dyn Fn(NodeId) -> bool,
    ) -> (Arc<[u32]>, FxHashMap<u32, u32>) {
        let doms = self.domains(cluster, key);
        let mut out: FxHashMap<u32, u32> = FxHashMap::default();
        for (&n, &c) in self.counts(matchers) {
            let d = doms.get(n as usize).copied().unwrap_or(NO_DOMAIN);
            if d != NO_DOMAIN && keep(n) {
                *out.entry(d).or_default() += c;
            }
        }
        (doms, out)
    }

    /// Where a pod with terms `t` may go, and how much each node is preferred.
    /// `counted(node, constraint)`: whether the spread constraint counts the node's pods (by its
    /// `nodeAffinityPolicy` and `nodeTaintsPolicy`).
    pub fn mask(
        &mut self,
        cluster: &Cluster,
        t: &PodTerms,
        counted: &dyn Fn(NodeId, &Spread) -> bool,
    ) -> PodMask {
        let n = cluster.len();
        let mut m = PodMask::open(n);
        let all = |_: NodeId| true;

        // Required affinity.
        if !t.affinity.is_empty() {
            let ms: Vec<PodMatcher> = t.affinity.iter().map(|x| x.pods.clone()).collect();
            let any = !self.counts(&ms).is_empty();
            let first = !any && t.affinity.iter().all(|x| x.pods.matches(t));
            for term in &t.affinity {
                let (doms, by) = self.by_domain(cluster, &ms, &term.topology_key, &all);
                for (i, &d) in doms.iter().enumerate() {
                    let ok = d != NO_DOMAIN && (first || by.get(&d).is_some_and(|&c| c > 0));
                    if !ok {
                        m.deny(i, Reason::PodAffinity);
                    }
                }
            }
        }
        // Required anti-affinity, the pod's own.
        for term in &t.anti_affinity {
            let (doms, by) =
                self.by_domain(cluster, std::slice::from_ref(&term.pods), &term.topology_key, &all);
            if by.is_empty() {
                continue;
            }
            for (i, &d) in doms.iter().enumerate() {
                if d != NO_DOMAIN && by.contains_key(&d) {
                    m.deny(i, Reason::PodAntiAffinity);
                }
            }
        }
        // Placed pods' terms that match this pod: anti-affinity (a filter) and preferences.
        let mut aff_raw = vec![0i64; n];
        let bearing: Vec<(Owned, Vec<(NodeId, u32)>)> = self
            .owned
            .iter()
            .filter(|(o, _)| o.term.pods.matches(t))
            .map(|(o, c)| (o.clone(), c.iter().map(|(&k, &v)| (k, v)).collect()))
            .collect();
        for (o, on) in bearing {
            let doms = self.domains(cluster, &o.term.topology_key);
            let mut by: FxHashMap<u32, u32> = FxHashMap::default();
            for (node, c) in on {
                let d = doms.get(node as usize).copied().unwrap_or(NO_DOMAIN);
                if d != NO_DOMAIN {
                    *by.entry(d).or_default() += c;
                }
            }
            for (i, &d) in doms.iter().enumerate() {
                let Some(&c) = by.get(&d) else { continue };
                match o.weight {
                    None => m.deny(i, Reason::ExistingAntiAffinity),
                    Some(w) => aff_raw[i] += i64::from(w) * i64::from(c),
                }
            }
        }
        // Preferred terms of this pod.
        for (w, term) in &t.preferred {
            let (doms, by) =
                self.by_domain(cluster, std::slice::from_ref(&term.pods), &term.topology_key, &all);
            for (i, &d) in doms.iter().enumerate() {
                if let Some(&c) = by.get(&d) {
                    aff_raw[i] += i64::from(*w) * i64::from(c);
                }
            }
        }
        // Topology spread.
        let mut spread_raw = vec![0i64; n];
        let has_soft = t.spread.iter().any(|s| !s.hard);
        if !t.spread.is_empty() {
            let keys: Vec<Arc<[u32]>> =
                t.spread.iter().map(|s| self.domains(cluster, &s.topology_key)).collect();
            let with_keys = |i: usize| keys.iter().all(|d| d[i] != NO_DOMAIN);
            for (s, doms) in t.spread.iter().zip(&keys) {
                let eligible: Vec<bool> =
                    (0..n).map(|i| with_keys(i) && counted(i as NodeId, s)).collect();
                let ms = [PodMatcher {
                    selector: s.selector.clone(),
                    namespaces: Namespaces::Only(vec![t.namespace.clone()]),
                }];
                let keep = |node: NodeId| eligible.get(node as usize).copied().unwrap_or(false);
                let (_, by) = self.by_domain(cluster, &ms, &s.topology_key, &keep);
                let mut domains: FxHashMap<u32, u32> = FxHashMap::default();
                for (i, &d) in doms.iter().enumerate() {
                    if eligible[i] {
                        domains.insert(d, by.get(&d).copied().unwrap_or(0));
                    }
                }
                let mut min = domains.values().copied().min().unwrap_or(0);
                if (domains.len() as u32) < s.min_domains {
                    min = 0;
                }
                let own = u32::from(s.selector.matches(&t.labels));
                for (i, &d) in doms.iter().enumerate() {
                    let here = by.get(&d).copied().unwrap_or(0);
                    if !s.hard {
                        spread_raw[i] += i64::from(here);
                        continue;
                    }
                    if d == NO_DOMAIN {
                        m.deny(i, Reason::SpreadLabel);
                    } else if (here + own).saturating_sub(min) > s.max_skew {
                        m.deny(i, Reason::TopologySpread);
                    }
                }
            }
        }
        // Scores, each 0..=100 over the nodes still allowed, weighted as kube-scheduler
        // weighs its plugins (2 each).
        let mut norm = |raw: &[i64], higher_better: bool| {
            let open = || (0..n).filter(|&i| m.veto[i].is_none()).map(|i| raw[i]);
            let (Some(lo), Some(hi)) = (open().min(), open().max()) else { return };
            if lo == hi {
                return;
            }
            for (pref, &r) in m.pref.iter_mut().zip(raw) {
                let v = if higher_better { r - lo } else { hi - r };
                *pref += 2 * 100 * v / (hi - lo);
            }
        };
        norm(&aff_raw, true);
        if has_soft {
            norm(&spread_raw, false);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::NodeSpec;

    fn sel(k: &str, v: &str) -> LabelSelector {
        LabelSelector {
            nothing: false,
            reqs: vec![LabelReq { key: k.into(), op: LabelOp::In, values: vec![v.into()] }],
        }
    }

    fn pod(app: &str) -> PodTerms {
        PodTerms {
            namespace: "ns".into(),
            labels: [("app".to_owned(), app.to_owned())].into(),
            ..PodTerms::default()
        }
    }

    fn term(app: &str, key: &str) -> Term {
        Term {
            pods: PodMatcher {
                selector: sel("app", app),
                namespaces: Namespaces::Only(vec!["ns".into()]),
            },
            topology_key: key.into(),
        }
    }

    fn cluster() -> Cluster {
        // zone a: n0, n1; zone b: n2, n3; n4 has no zone.
        let zones = ["a", "a", "b", "b", ""];
        Cluster::from_specs(zones.iter().enumerate().map(|(i, z)| {
            let s = NodeSpec::new(format!("n{i}"), 1000, 1000).label("host", format!("n{i}"));
            if z.is_empty() { s } else { s.label("zone", *z) }
        }))
        .unwrap()
    }

    fn open(m: &PodMask) -> Vec<usize> {
        (0..m.veto.len()).filter(|&i| m.veto[i].is_none()).collect()
    }

    #[test]
    fn anti_affinity_and_its_symmetry() {
        let c = cluster();
        let mut idx = PodIndex::new();
        let mut web = pod("web");
        web.anti_affinity.push(term("web", "zone"));
        let web = Arc::new(web);
        let yes = |_: NodeId, _: &Spread| true;
        // Nothing placed: every node.
        assert_eq!(open(&idx.mask(&c, &web, &yes)), vec![0, 1, 2, 3, 4]);
        idx.add(0, web.clone());
        // Zone a is taken; the node without a zone has no domain to clash in.
        assert_eq!(open(&idx.mask(&c, &web, &yes)), vec![2, 3, 4]);
        // A pod with no terms that web's term matches is kept out of zone a too.
        let m = idx.mask(&c, &pod("web"), &yes);
        assert_eq!(open(&m), vec![2, 3, 4]);
        assert_eq!(m.veto[0], Some(Reason::ExistingAntiAffinity));
        assert_eq!(open(&idx.mask(&c, &pod("db"), &yes)), vec![0, 1, 2, 3, 4]);
        idx.remove(0, &web);
        assert_eq!(open(&idx.mask(&c, &web, &yes)), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn affinity_lets_the_first_of_a_group_in_then_follows_it() {
        let c = cluster();
        let mut idx = PodIndex::new();
        let mut w = pod("w");
        w.affinity.push(term("w", "zone"));
        let w = Arc::new(w);
        let yes = |_: NodeId, _: &Spread| true;
        assert_eq!(open(&idx.mask(&c, &w, &yes)), vec![0, 1, 2, 3]);
        idx.add(2, w.clone());
        assert_eq!(open(&idx.mask(&c, &w, &yes)), vec![2, 3]);
        // A pod that does not match its own term waits for a matching pod.
        let mut x = pod("x");
        x.affinity.push(term("y", "zone"));
        assert!(open(&idx.mask(&c, &x, &yes)).is_empty());
    }

    #[test]
    fn spread_keeps_skew_within_max() {
        let c = cluster();
        let mut idx = PodIndex::new();
        let mut p = pod("s");
        p.spread.push(Spread {
            max_skew: 1,
            min_domains: 0,
            topology_key: "zone".into(),
            hard: true,
            selector: sel("app", "s"),
            honor_taints: false,
            honor_affinity: true,
        });
        let p = Arc::new(p);
        let yes = |_: NodeId, _: &Spread| true;
        let m = idx.mask(&c, &p, &yes);
        assert_eq!(open(&m), vec![0, 1, 2, 3]);
        assert_eq!(m.veto[4], Some(Reason::SpreadLabel));
        idx.add(0, p.clone());
        assert_eq!(open(&idx.mask(&c, &p, &yes)), vec![2, 3]);
        idx.add(3, p.clone());
        assert_eq!(open(&idx.mask(&c, &p, &yes)), vec![0, 1, 2, 3]);
        // minDomains 3 with 2 zones: the smallest counts as 0.
        let mut q = (*p).clone();
        q.spread[0].min_domains = 3;
        assert!(open(&idx.mask(&c, &q, &yes)).is_empty());
    }

    /// Counts found through the label lists equal counts over every pod, through adds and
    /// removes (the lists built part way and kept after), for random selectors of every
    /// operator.
    #[test]
    fn counts_through_label_lists_equal_a_scan_of_every_pod() {
        let mut rng = crate::rng::Rng::new(11);
        let keys = ["app", "tier", "zone"];
        let vals = ["a", "b", "c", "d"];
        let req = |rng: &mut crate::rng::Rng| {
            let op =
                [LabelOp::In, LabelOp::NotIn, LabelOp::Exists, LabelOp::DoesNotExist][rng.index(4)];
            let n = 1 + rng.index(3);
            LabelReq {
                key: keys[rng.index(3)].into(),
                op,
                values: (0..n).map(|_| vals[rng.index(4)].to_owned()).collect(),
            }
        };
        for round in 0..30 {
            let mut idx = PodIndex::new();
            let mut live: Vec<(NodeId, Arc<PodTerms>)> = Vec::new();
            for step in 0..300 {
                if rng.below(4) == 0 && !live.is_empty() {
                    let (n, p) = live.swap_remove(rng.index(live.len()));
                    idx.remove(n, &p);
                } else {
                    let mut labels = BTreeMap::new();
                    for k in keys {
                        if rng.below(3) > 0 {
                            labels.insert(k.to_owned(), vals[rng.index(4)].to_owned());
                        }
                    }
                    let ns = ["ns", "other"][rng.index(2)].to_owned();
                    let p = Arc::new(PodTerms { namespace: ns, labels, ..PodTerms::default() });
                    let n = rng.index(20) as NodeId;
                    idx.add(n, p.clone());
                    live.push((n, p));
                }
                // Every position is listed once, under the node its pod is on.
                let mut listed: Vec<u32> = Vec::new();
                for (n, at) in &idx.by_node {
                    assert!(at.iter().all(|&i| idx.pods[i as usize].0 == *n), "step {step}");
                    listed.extend(at);
                }
                listed.sort_unstable();
                assert_eq!(listed, (0..idx.pods.len() as u32).collect::<Vec<_>>(), "step {step}");
                assert_eq!(idx.len(), live.len());
                if step % 7 != 0 {
                    continue;
                }
                let matchers: Vec<PodMatcher> = (0..1 + rng.index(2))
                    .map(|_| PodMatcher {
                        selector: LabelSelector {
                            nothing: false,
                            reqs: (0..rng.index(3)).map(|_| req(&mut rng)).collect(),
                        },
                        namespaces: if rng.below(2) == 0 {
                            Namespaces::All
                        } else {
                            Namespaces::Only(vec!["ns".into()])
                        },
                    })
                    .collect();
                let mut want = Counts::default();
                for (n, p) in &live {
                    if matchers.iter().all(|m| m.matches(p)) {
                        bump(&mut want, *n, true);
                    }
                }
                idx.counters.clear();
                assert_eq!(idx.counts(&matchers), &want, "round {round} step {step}: {matchers:?}");
            }
        }
    }
}
