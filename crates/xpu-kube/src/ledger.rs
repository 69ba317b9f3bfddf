//! What bound pods hold, kept current from the pod watch's events instead of summed again from
//! every pod on every cycle.
//!
//! A [`Ledger`] is fed each event of the pod watch (`Apply`, `Delete`, and a relist's `Init`,
//! `InitApply`, `InitDone`) *before* the watch cache stores it, so a cycle never sees a pod
//! bound in the cache that the ledger does not count. Per pod it keeps what the pod holds where
//! (its requests converted once per change), per node the sums and a generation that moves on
//! every change (kube-scheduler's cache keeps one per node for the same reason), and per
//! namespace and queue label what queues are charged. A cycle then reads per node what is in
//! use, not per pod: at 15,000 nodes and 50,000 bound pods the sums are what the cycle spent
//! its time on. Sums are kept in 128 bits so that taking a pod back is exact; they are read
//! saturated to 64 bits, as a rebuild sums them.
//!
//! The cycle stays a function of its snapshot: [`crate::cycle::Snapshot::ledger`] is optional,
//! and `cluster_of` with a ledger builds exactly what it builds from the pods alone
//! (`ledger::tests::the_ledger_equals_a_rebuild_after_every_event`). A relist swaps in a ledger
//! made from the new list at `InitDone`, as the watch cache swaps its store; a restart needs
//! only the API server.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::pod::{Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use xpu_sched::TaskSpec;

use crate::convert::SHARE_RESOURCE;
use crate::convert::{self, Unsupported, Usage};
use crate::cycle::{PodKey, terminal};
use crate::queues::Amounts;
use crate::share;

/// The scheduler of a pod that names none.
const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// Amounts that can be taken back exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Sum {
    cpu: u128,
    mem: u128,
    pods: u64,
    devices: BTreeMap<&'static str, (u128, u64)>,
}

impl Sum {
    fn add(&mut self, u: &Usage) {
        self.cpu += u128::from(u.cpu_milli);
        self.mem += u128::from(u.memory_mib);
        self.pods += 1;
        for (&res, &n) in &u.devices {
            let e = self.devices.entry(res).or_default();
            e.0 += u128::from(n);
            e.1 += 1;
        }
    }

    fn sub(&mut self, u: &Usage) {
        self.cpu -= u128::from(u.cpu_milli);
        self.mem -= u128::from(u.memory_mib);
        self.pods -= 1;
        for (&res, &n) in &u.devices {
            if let Some(e) = self.devices.get_mut(res) {
                e.0 -= u128::from(n);
                e.1 -= 1;
                if e.1 == 0 {
                    self.devices.remove(res);
                }
            }
        }
    }
}

fn sat(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// A bound pod's record: what it holds, where.
#[derive(Debug)]
struct Entry {
    node: String,
    usage: Result<Usage, Unsupported>,
    /// The GPUs its share annotation records.
    gpus: Option<Vec<u16>>,
    /// Namespace and queue label: what decides the queue charged (one allocation per pair,
    /// shared with [`Book::charges`]).
    charge: Arc<(String, Option<String>)>,
    /// Its priority, when it is being deleted.
    terminating: Option<i32>,
    /// The fields [`convert::gang`] reads, for a pod that may be in a gang. Boxed, as is `key`:
    /// most pods have neither, and the map holds one entry per bound pod of the cluster (a
    /// `Pod` inline made each entry about a kilobyte).
    gang: Option<Box<Pod>>,
    /// Kept only for a pod whose requests cannot be read, to name it.
    key: Option<Box<PodKey>>,
    /// Its scheduler and task, as counted in [`Book::mix`] (shared with it).
    mix: Option<Arc<(String, String)>>,
}

/// What the pods bound to one node hold.
#[derive(Debug, Default)]
pub(crate) struct NodeBook {
    /// Moves on every change to what the node's pods hold.
    pub(crate) generation: u64,
    sum: Sum,
    pods: u64,
    shares: BTreeMap<String, (u64, Option<Vec<u16>>)>,
    unreadable: u32,
    terminating: BTreeMap<i32, u32>,
}

impl NodeBook {
    /// What the node's pods use, as a rebuild sums it.
    pub(crate) fn used(&self) -> crate::cycle::Used {
        crate::cycle::Used {
            cpu: sat(self.sum.cpu),
            mem: sat(self.sum.mem),
            pods: self.pods,
            dev: self
                .sum
                .devices
                .iter()
                .filter(|(res, _)| **res != SHARE_RESOURCE)
                .map(|(res, (n, _))| (*res, sat(*n)))
                .collect(),
            shares: self.shares.clone(),
            unreadable: self.unreadable > 0,
        }
    }

    /// The lowest priority among the node's pods being deleted.
    pub(crate) fn terminating(&self) -> Option<i32> {
        self.terminating.keys().next().copied()
    }
}

/// A task bound pods run: the task, the device resource it asks for, and how many pods.
type MixEntry = (TaskSpec, Option<&'static str>, u64);

/// The ledger's state; read by a cycle through [`Ledger::read`].
#[derive(Debug, Default)]
pub struct Book {
    pods: HashMap<String, Entry>,
    nodes: HashMap<String, NodeBook>,
    charges: HashMap<Arc<(String, Option<String>)>, Sum>,
    /// Bound pods as tasks, per scheduler and task (keyed by its `Debug` form): what FGD and
    /// xpu measure fragmentation against, counted once per distinct task.
    mix: HashMap<Arc<(String, String)>, MixEntry>,
    generation: u64,
}

impl Book {
    fn apply(&mut self, p: &Pod) {
        let Some(uid) = p.metadata.uid.as_deref() else { return };
        self.remove(uid);
        let Some(node) =
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()).filter(|n| !n.is_empty())
        else {
            return;
        };
        if terminal(p) {
            return;
        }
        let usage = convert::usage(p);
        // Named only when its requests cannot be read.
        let key = usage.is_err().then(|| PodKey::of(p).map(Box::new)).flatten();
        let mut entry = Entry {
            node: node.to_owned(),
            usage,
            gpus: share::recorded_gpus(p),
            charge: shared(
                &self.charges,
                (
                    p.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                    p.metadata.labels.as_ref().and_then(|l| l.get(convert::QUEUE_LABEL)).cloned(),
                ),
            ),
            terminating: p
                .metadata
                .deletion_timestamp
                .is_some()
                .then(|| p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)),
            gang: convert::may_be_gang(p).then(|| Box::new(gang_part(p))),
            key,
            mix: None,
        };
        if let Ok(ask) = convert::pod(p) {
            let scheduler = p.spec.as_ref().and_then(|s| s.scheduler_name.as_deref());
            let key = shared(
                &self.mix,
                (scheduler.unwrap_or(DEFAULT_SCHEDULER).to_owned(), format!("{:?}", ask.task)),
            );
            let resource = ask.resources.device_resource;
            self.mix.entry(key.clone()).or_insert_with(|| (ask.task, resource, 0)).2 += 1;
            entry.mix = Some(key);
        }
        self.generation += 1;
        let g = self.generation;
        let n = self.nodes.entry(entry.node.clone()).or_default();
        n.generation = g;
        n.pods += 1;
        match &entry.usage {
            Ok(u) => {
                n.sum.add(u);
                if let Some(&ask) = u.devices.get(SHARE_RESOURCE) {
                    n.shares.insert(uid.to_owned(), (ask, entry.gpus.clone()));
                }
                self.charges.entry(entry.charge.clone()).or_default().add(u);
            }
            Err(_) => n.unreadable += 1,
        }
        if let Some(prio) = entry.terminating {
            *n.terminating.entry(prio).or_default() += 1;
        }
        self.pods.insert(uid.to_owned(), entry);
    }

    fn remove(&mut self, uid: &str) {
        let Some(e) = self.pods.remove(uid) else { return };
        if let Some(key) = &e.mix
            && let Some(m) = self.mix.get_mut(key)
        {
            m.2 -= 1;
            if m.2 == 0 {
                self.mix.remove(key);
            }
        }
        self.generation += 1;
        let g = self.generation;
        let Some(n) = self.nodes.get_mut(&e.node) else { return };
        n.generation = g;
        n.pods -= 1;
        match &e.usage {
            Ok(u) => {
                n.sum.sub(u);
                n.shares.remove(uid);
                if let Some(c) = self.charges.get_mut(&e.charge) {
                    c.sub(u);
                    if c.pods == 0 {
                        self.charges.remove(&e.charge);
                    }
                }
            }
            Err(_) => n.unreadable -= 1,
        }
        if let Some(prio) = e.terminating
            && let Some(c) = n.terminating.get_mut(&prio)
        {
            *c -= 1;
            if *c == 0 {
                n.terminating.remove(&prio);
            }
        }
        if n.pods == 0 {
            self.nodes.remove(&e.node);
        }
    }

    /// Whether the ledger counts the pod `uid` as bound.
    pub(crate) fn holds(&self, uid: &str) -> bool {
        self.pods.contains_key(uid)
    }

    /// Nodes with bound pods, and what those hold.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = (&str, &NodeBook)> {
        self.nodes.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// What the pods bound to node `name` hold, if any are.
    pub(crate) fn node(&self, name: &str) -> Option<&NodeBook> {
        self.nodes.get(name)
    }

    /// The generation of what node `name`'s pods hold (0: none bound there yet).
    pub fn generation(&self, name: &str) -> u64 {
        self.nodes.get(name).map_or(0, |n| n.generation)
    }

    /// Bound pods whose requests cannot be read: the pod, its node and why.
    pub(crate) fn unreadable(&self) -> impl Iterator<Item = (&PodKey, &str, &Unsupported)> {
        self.pods.values().filter_map(|e| match (&e.usage, &e.key) {
            (Err(why), Some(k)) => Some((k.as_ref(), e.node.as_str(), why)),
            _ => None,
        })
    }

    /// What the bound pods of each namespace and queue label hold.
    pub(crate) fn charges(&self) -> impl Iterator<Item = ((&str, Option<&str>), Amounts)> {
        self.charges.iter().map(|(key, s)| {
            let (ns, label) = key.as_ref();
            let amounts = Amounts {
                cpu_milli: sat(s.cpu),
                memory_mib: sat(s.mem),
                pods: s.pods,
                devices: s.devices.iter().map(|(r, (n, _))| (*r, sat(*n))).collect(),
            };
            ((ns.as_str(), label.as_deref()), amounts)
        })
    }

    /// Bound pods that may be members of a gang, with their nodes.
    pub(crate) fn gang_pods(&self) -> impl Iterator<Item = (&Pod, &str)> {
        self.pods.values().filter_map(|e| Some((e.gang.as_deref()?, e.node.as_str())))
    }

    /// The tasks of the bound pods of `scheduler`, with the device resource each asks for and
    /// how many pods run it.
    pub(crate) fn mix(
        &self,
        scheduler: &str,
    ) -> impl Iterator<Item = (&TaskSpec, Option<&'static str>, u64)> {
        self.mix.iter().filter(move |(k, _)| k.0 == scheduler).map(|(_, (t, r, n))| (t, *r, *n))
    }

    /// Bound pods counted.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no pod is counted.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }
}

/// `key` as the map already holds it, or new: pods of one namespace, queue or task share one.
fn shared<K: Eq + std::hash::Hash, V>(map: &HashMap<Arc<K>, V>, key: K) -> Arc<K> {
    map.get_key_value(&key).map_or_else(|| Arc::new(key), |(k, _)| k.clone())
}

/// Only what [`convert::gang`] reads of a pod.
fn gang_part(p: &Pod) -> Pod {
    let m = &p.metadata;
    Pod {
        metadata: ObjectMeta {
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            uid: m.uid.clone(),
            labels: m.labels.clone(),
            annotations: m.annotations.clone(),
            owner_references: m.owner_references.clone(),
            ..ObjectMeta::default()
        },
        spec: p.spec.as_ref().map(|s| PodSpec {
            priority: s.priority,
            scheduling_group: s.scheduling_group.clone(),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// Bound pods' holdings kept from the pod watch; see the module docs.
#[derive(Debug, Default)]
pub struct Ledger {
    book: Mutex<Book>,
    /// The book a relist is filling, swapped in when it is done.
    relist: Mutex<Option<Book>>,
}

impl Ledger {
    /// A pod was added or changed.
    pub fn apply(&self, p: &Pod) {
        self.lock().apply(p);
    }

    /// A pod was deleted.
    pub fn delete(&self, p: &Pod) {
        if let Some(uid) = p.metadata.uid.as_deref() {
            self.lock().remove(uid);
        }
    }

    /// A relist begins: what follows is the whole set, until [`Ledger::init_done`].
    pub fn init(&self) {
        *lock(&self.relist) = Some(Book::default());
    }

    /// A pod of the relist.
    pub fn init_apply(&self, p: &Pod) {
        if let Some(b) = lock(&self.relist).as_mut() {
            b.apply(p);
        }
    }

    /// The relist is whole: its book replaces the old one. Every node's generation moves on.
    pub fn init_done(&self) {
        let Some(mut fresh) = lock(&self.relist).take() else { return };
        let mut book = self.lock();
        let base = book.generation + 1;
        for n in fresh.nodes.values_mut() {
            n.generation += base;
        }
        fresh.generation += base;
        *book = fresh;
    }

    /// Feeds one event of the pod watch.
    pub fn feed(&self, ev: &kube::runtime::watcher::Event<Pod>) {
        use kube::runtime::watcher::Event;
        match ev {
            Event::Apply(p) => self.apply(p),
            Event::Delete(p) => self.delete(p),
            Event::Init => self.init(),
            Event::InitApply(p) => self.init_apply(p),
            Event::InitDone => self.init_done(),
        }
    }

    /// The book, held for a cycle's reading.
    pub fn read(&self) -> MutexGuard<'_, Book> {
        self.lock()
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        lock(&self.book)
    }
}

/// Every change to the book completes under its lock before another starts: a panic cannot
/// leave it half-written, so a poisoned lock still holds a consistent book.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::too_many_lines)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use crate::node::Node;
    use crate::pod::Pod;
    use serde_json::json;
    use xpu_sched::SchedulerConfig;
    use xpu_sched::rng::Rng;

    use super::Ledger;
    use crate::cycle::{Memo, Snapshot, cluster_of, plan};
    use xpu_sched::Cluster;

    fn node(name: &str, gpu: &str, share: bool, cpu: &str, ready: bool, rv: u64) -> Arc<Node> {
        let mut alloc = json!({ "cpu": cpu, "memory": "64Gi", "pods": "12" });
        alloc[if share { "xpu.dev/gpu-milli" } else { "nvidia.com/gpu" }] = json!(gpu);
        Arc::new(
            serde_json::from_value(json!({
                "metadata": { "name": name, "resourceVersion": rv.to_string() },
                "status": { "allocatable": alloc.clone(), "capacity": alloc,
                            "conditions": [{ "type": "Ready",
                                             "status": if ready { "True" } else { "False" } }] }
            }))
            .unwrap(),
        )
    }

    /// A pod with random requests, labels and owners: gangs of every kind, queue labels, GPU
    /// shares with and without recorded GPUs, requests that do not parse.
    fn pod(rng: &mut Rng, i: usize, rv: u64) -> Pod {
        let mut limits = json!({});
        match rng.index(5) {
            0 => limits["nvidia.com/gpu"] = json!(rng.below(3).to_string()),
            1 => limits["xpu.dev/gpu-milli"] = json!(["250", "500", "1000", "2000"][rng.index(4)]),
            2 => limits["nvidia.com/gpu"] = json!("lots"),
            _ => {}
        }
        let mut labels = json!({});
        let mut annotations = json!({});
        if rng.index(3) == 0 {
            labels["xpu.dev/queue"] = json!(["a", "b"][rng.index(2)]);
        }
        match rng.index(6) {
            0 => {
                labels["xpu.dev/gang"] = json!(format!("g{}", rng.index(3)));
                labels["xpu.dev/gang-size"] = json!("2");
            }
            1 => {
                labels["leaderworkerset.sigs.k8s.io/group-key"] =
                    json!(format!("k{}", rng.index(2)));
                annotations["leaderworkerset.sigs.k8s.io/size"] = json!("3");
            }
            _ => {}
        }
        if rng.index(3) == 0 {
            annotations["xpu.dev/gpus"] = json!(["0", "1", "0,1", "7"][rng.index(4)]);
        }
        let owner = (rng.index(4) == 0).then(|| {
            let j = rng.index(2);
            json!([{ "apiVersion": "batch/v1", "kind": "Job", "name": format!("job{j}"),
                     "uid": format!("job-uid-{j}"), "controller": true }])
        });
        let namespace = ["default", "ns2"][rng.index(2)];
        let cpu = ["1", "500m", "2"][rng.index(3)];
        serde_json::from_value(json!({
            "metadata": { "name": format!("p{i}"), "namespace": namespace,
                          "uid": format!("u{i}"), "resourceVersion": rv.to_string(),
                          "labels": labels, "annotations": annotations, "ownerReferences": owner,
                          "creationTimestamp": format!("2026-01-01T00:{:02}:{:02}Z", i / 60 % 60, i % 60) },
            "spec": { "schedulerName": "xpu", "priority": rng.below(3),
                "containers": [{ "name": "c", "resources": {
                    "requests": { "cpu": cpu, "memory": "1Gi" },
                    "limits": limits } }] },
            "status": { "phase": "Pending" }
        }))
        .unwrap()
    }

    /// Everything `cluster_of` decides but the cluster, in a form two builds can be compared
    /// by; and the cluster, with the empty copy kept (to give back).
    fn rendered(snap: &Snapshot<'_>) -> (String, Cluster, Option<Cluster>) {
        let b = cluster_of(snap);
        let mut gangs: Vec<_> = b.gang_bound.iter().collect();
        gangs.sort();
        let mut queues: Vec<_> = b.queue_used.iter().collect();
        queues.sort_by(|a, b| a.0.cmp(b.0));
        let mut reserved: Vec<_> = b.reserved.iter().collect();
        reserved.sort();
        let text = format!(
            "bad {:?}\ngangs {gangs:?}\nqueues {queues:?}\nunreadable {:?}\nreserved {reserved:?}",
            b.bad_nodes, b.unreadable,
        );
        (text, b.cluster, b.empty)
    }

    #[test]
    fn an_entry_stays_small() {
        // One per bound pod of the cluster: 50,000 of these at 1 KB each was 100 MiB.
        assert!(size_of::<super::Entry>() <= 192, "{}", size_of::<super::Entry>());
    }

    /// The incremental state equals a full rebuild after every event: random sequences of pod
    /// events (made, bound, changed, ended, being deleted, deleted; assumed by the scheduler
    /// before the watch shows them bound, or as its last plan bound them; relists) and node
    /// events (changed, added, removed), over many seeds. After every event the cluster a cycle
    /// builds with the ledger, reading only the pods the watch shows unbound
    /// ([`Snapshot::unbound`]), and the kept cluster of the cycles before ([`crate::base`]: free
    /// CPU, memory and every device of every node, statuses, labels, tie-break ranks; gangs
    /// bound, queue charges, unreadable pods) and the plan it makes equal those built from the
    /// pods alone.
    #[test]
    fn the_ledger_equals_a_rebuild_after_every_event() {
        let jobs: HashMap<String, (i32, i32, bool)> =
            [("job-uid-0".to_owned(), (2, 2, true)), ("job-uid-1".to_owned(), (1, 1, false))]
                .into();
        let config = SchedulerConfig::default();
        let mapping = crate::queues::Queues::parse(
            "queues: [{ name: a, namespaces: [default, ns2], quota: { nvidia.com/gpu: 6 } }, \
                      { name: b, namespaces: [ns2] }]",
            "xpu-system/xpu-queues",
        )
        .unwrap();
        let no_queues = crate::queues::Queues::default();
        for seed in 0..40u64 {
            let queues = if seed % 2 == 0 { &mapping } else { &no_queues };
            let mut rng = Rng::new(seed);
            let ledger = Ledger::default();
            let memo = Memo::default();
            let mut rv = 0u64;
            let mut nodes: Vec<Arc<Node>> = (0..4)
                .map(|i| {
                    rv += 1;
                    node(&format!("n{i}"), ["8", "4000"][i % 2], i % 2 == 1, "32", true, rv)
                })
                .collect();
            let mut pods: Vec<Arc<Pod>> = Vec::new();
            let mut assumed: HashMap<String, String> = HashMap::new();
            let mut made = 0usize;
            for step in 0..120 {
                rv += 1;
                let pick = |rng: &mut Rng, n: usize| rng.index(n.max(1));
                match rng.index(12) {
                    0..=2 => {
                        made += 1;
                        let p = pod(&mut rng, made, rv);
                        ledger.apply(&p);
                        pods.push(Arc::new(p));
                    }
                    3 | 4 if !pods.is_empty() => {
                        // Bound, as the watch shows it (by xpu or by another hand).
                        let k = pick(&mut rng, pods.len());
                        let mut p = (*pods[k]).clone();
                        let n = format!("n{}", rng.index(5));
                        p.spec.as_mut().unwrap().node_name = Some(n);
                        p.status.as_mut().unwrap().phase = Some("Running".into());
                        p.metadata.resource_version = Some(rv.to_string());
                        ledger.apply(&p);
                        pods[k] = Arc::new(p);
                    }
                    5 if !pods.is_empty() => {
                        // Assumed: this scheduler bound it; the watch has not shown it yet.
                        let k = pick(&mut rng, pods.len());
                        let uid = pods[k].metadata.uid.clone().unwrap();
                        assumed.insert(uid, format!("n{}", rng.index(4)));
                    }
                    6 if !pods.is_empty() => {
                        let k = pick(&mut rng, pods.len());
                        let mut p = (*pods[k]).clone();
                        match rng.index(3) {
                            0 => {
                                p.status.as_mut().unwrap().phase =
                                    Some(["Succeeded", "Failed", "Running"][rng.index(3)].into());
                            }
                            1 => {
                                p.metadata.deletion_timestamp =
                                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                                    ));
                            }
                            _ => {
                                // Relabelled (queue, gang) while running.
                                let fresh = pod(&mut rng, 0, rv);
                                p.metadata.labels = fresh.metadata.labels;
                                p.metadata.annotations = fresh.metadata.annotations;
                            }
                        }
                        p.metadata.resource_version = Some(rv.to_string());
                        ledger.apply(&p);
                        pods[k] = Arc::new(p);
                    }
                    7 if !pods.is_empty() => {
                        let p = pods.remove(pick(&mut rng, pods.len()));
                        ledger.delete(&p);
                    }
                    8 => {
                        let k = rng.index(nodes.len());
                        let name = nodes[k].metadata.name.clone().unwrap();
                        nodes[k] = node(
                            &name,
                            ["8", "4", "4000", "x"][rng.index(4)],
                            k % 2 == 1,
                            ["32", "8"][rng.index(2)],
                            rng.index(5) > 0,
                            rv,
                        );
                    }
                    10 if nodes.len() > 2 && rng.index(2) == 0 => {
                        nodes.remove(rng.index(nodes.len()));
                    }
                    10 => {
                        let name = format!("n{}", rng.index(7));
                        if nodes.iter().all(|n| n.metadata.name.as_deref() != Some(&name)) {
                            let share = rng.index(2) == 1;
                            nodes.push(node(
                                &name,
                                ["8", "4000"][usize::from(share)],
                                share,
                                "32",
                                true,
                                rv,
                            ));
                        }
                    }
                    9 => {
                        // The watch relists: the whole set again, swapped in at its end.
                        ledger.init();
                        for p in &pods {
                            ledger.init_apply(p);
                        }
                        ledger.init_done();
                    }
                    _ => {}
                }
                // What the scheduler's loop does: forget assumptions the watch now shows.
                assumed.retain(|uid, _| {
                    pods.iter().any(|p| {
                        p.metadata.uid.as_deref() == Some(uid)
                            && p.spec.as_ref().unwrap().node_name.is_none()
                    })
                });
                let rebuilt = Snapshot {
                    queues,
                    preemption: seed % 3 == 0,
                    ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
                };
                // And reads the pods the watch shows unbound, from its own pass.
                let unbound: Vec<_> = pods
                    .iter()
                    .filter(|p| p.spec.as_ref().unwrap().node_name.is_none())
                    .cloned()
                    .collect();
                let kept = Snapshot {
                    ledger: Some(&ledger),
                    memo: Some(&memo),
                    unbound: Some(&unbound),
                    ..rebuilt
                };
                let (text, cluster, empty) = rendered(&kept);
                let (fresh_text, fresh, _) = rendered(&rebuilt);
                assert_eq!(text, fresh_text, "seed {seed}, step {step}: the ledger's books differ");
                if let Err(e) = cluster.same_as(&fresh) {
                    panic!(
                        "seed {seed}, step {step}: the kept cluster differs from a rebuild: {e}"
                    );
                }
                crate::base::give_back(&kept, cluster, empty);
                let planned = plan(&kept, &config, 0, &mut |_| true);
                assert_eq!(
                    planned,
                    plan(&rebuilt, &config, 0, &mut |_| true),
                    "seed {seed}, step {step}: the ledger or the kept cluster changed the plan"
                );
                memo.sweep();
                // The scheduler assumes what it binds until the watch shows it.
                if rng.index(2) == 0 {
                    for b in planned.binds {
                        assumed.insert(b.pod.uid, b.node);
                    }
                }
            }
            let built = memo.build_stats();
            assert!(
                built.patched > built.whole,
                "seed {seed}: the kept cluster served little: {built:?}"
            );
            let bound = pods
                .iter()
                .filter(|p| {
                    !crate::cycle::terminal(p) && p.spec.as_ref().unwrap().node_name.is_some()
                })
                .count();
            assert_eq!(ledger.read().len(), bound, "seed {seed}: the ledger counts pods gone");
        }
    }
}
