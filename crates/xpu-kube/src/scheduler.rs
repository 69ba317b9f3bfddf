//! `xpu k8s scheduler`: the driver around [`crate::cycle`]. It keeps watch caches of Nodes,
//! Pods, Jobs, Namespaces and the admin's queue mapping ([`crate::queues`]), runs a cycle
//! whenever something changed, binds through the `pods/binding` subresource (as
//! kube-scheduler, Volcano and KAI do), tells waiting pods why (`PodScheduled=False`, reason
//! `Unschedulable`, and a `FailedScheduling` Event, rate-limited per pod, written off the loop
//! by [`crate::status`]), and counts what it does for `/metrics`.
//!
//! A pod it bound stays *assumed* on its node until the watch shows the binding (or the bind
//! fails), so the next cycle neither places it twice nor gives its capacity away. Only the
//! leader ([`crate::leader`]) runs cycles; followers keep warm caches.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::node::Node;
use crate::pod::Pod;
use futures_util::StreamExt;
use k8s_openapi::api::batch::v1::Job as KubeJob;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, ObjectReference, PodTemplate};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::{Mutex, Notify, Semaphore};
use tracing::{debug, error, info, warn};
use xpu_sched::{QueuePolicy, SchedulerConfig};

use crate::cycle::{self, Bind, PodKey, Snapshot};
use crate::flex::{self, ProvisioningRequest};
use crate::metrics::Metrics;
use crate::queues::Queues;
use crate::status::Writer;
use k8s_openapi::api::scheduling::v1beta1::PodGroup;

/// How the scheduler runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Pods whose `spec.schedulerName` is this are ours.
    pub scheduler_name: String,
    pub policy: xpu_sched::PolicyKind,
    /// Binds in flight at once.
    pub bind_concurrency: usize,
    /// Shortest time between two status updates (and Events) for one waiting pod.
    pub status_interval: Duration,
    /// Events across all pods per second, at most.
    pub events_per_second: u32,
    /// Signs GPU-share choices ([`crate::share`]); without it, share pods wait and are told so.
    pub share_key: Option<Arc<crate::share::ShareKey>>,
    /// A pod that cannot be placed holds back nothing (kube-scheduler's order), instead of
    /// the later pods of its queue asking for the same device kind.
    pub best_effort: bool,
    /// A pod that cannot be placed reserves the nodes it will get as they free up; later pods
    /// go to other nodes ([`xpu_sched::SchedulerConfig::reserve`]). Takes precedence over
    /// `best_effort`.
    pub reserve: bool,
    /// Seeds the placement policy's tie-breaking.
    pub seed: u64,
    /// Evict lower-priority pods (through the Eviction API, so PodDisruptionBudgets hold) for
    /// a pod that fits no other way.
    pub preemption: bool,
    /// Flex-start: the wait before asking again after a ProvisioningRequest ended, doubled per
    /// attempt up to [`PROVISIONING_BACKOFF_MAX`].
    pub provisioning_backoff: Duration,
    /// The ConfigMap (namespace, name) that maps namespaces to queues ([`crate::queues`]).
    pub queue_config: (String, String),
    /// Benchmarks only: bind every waiting pod to the next Ready node in turn, deciding nothing
    /// ([`cycle::null_plan`]), to measure what the API server allows any scheduler.
    pub null_binder: bool,
}

/// The longest wait between two ProvisioningRequests for one gang.
pub const PROVISIONING_BACKOFF_MAX: Duration = Duration::from_secs(900);

impl Default for Options {
    fn default() -> Self {
        Self {
            scheduler_name: "xpu".into(),
            policy: xpu_sched::PolicyKind::Xpu,
            bind_concurrency: 32,
            status_interval: Duration::from_secs(10),
            events_per_second: 20,
            share_key: None,
            best_effort: false,
            reserve: true,
            seed: 0,
            preemption: true,
            provisioning_backoff: Duration::from_secs(30),
            queue_config: ("xpu-system".into(), "xpu-queues".into()),
            null_binder: false,
        }
    }
}

/// The watch caches.
#[derive(Clone)]
pub struct Caches {
    pub nodes: Store<Node>,
    pub pods: Store<Pod>,
    /// What bound pods hold, fed by the pod watch before its cache stores each event.
    pub ledger: Arc<crate::ledger::Ledger>,
    pub jobs: Store<KubeJob>,
    /// Namespaces, for their labels (queues may select namespaces by label).
    pub namespaces: Store<Namespace>,
    /// The admin's queue mapping: the one ConfigMap [`Options::queue_config`] names.
    pub queue_config: Store<ConfigMap>,
    /// Dynamic Resource Allocation (`resource.k8s.io/v1`).
    pub slices: Store<ResourceSlice>,
    pub classes: Store<DeviceClass>,
    pub claims: Store<ResourceClaim>,
    /// ProvisioningRequests, once the API server is found to serve them (probed until it does).
    pub provisioning: Arc<std::sync::OnceLock<Store<ProvisioningRequest>>>,
    /// PodGroups (`scheduling.k8s.io/v1beta1`, behind the `GenericWorkload` gate), likewise.
    pub pod_groups: Arc<std::sync::OnceLock<Store<PodGroup>>>,
    /// DeviceTaintRules (`resource.k8s.io/v1`), likewise.
    pub taint_rules:
        Arc<std::sync::OnceLock<Store<k8s_openapi::api::resource::v1::DeviceTaintRule>>>,
}

/// Starts the watches; `changed` is notified on every event. Returns once every cache has its
/// first full list. `queue_config` is the ConfigMap (namespace, name) of the queue mapping.
pub async fn watch(
    client: &Client,
    changed: Arc<Notify>,
    queue_config: &(String, String),
) -> Caches {
    let ledger = Arc::new(crate::ledger::Ledger::default());
    let feed = ledger.clone();
    let caches = Caches {
        ledger,
        nodes: spawn(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            trim_node,
        ),
        pods: spawn_fed(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            trim_pod,
            move |ev| feed.feed(ev),
        ),
        jobs: spawn(
            Api::<KubeJob>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            trim_job,
        ),
        namespaces: spawn(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            trim_namespace,
        ),
        queue_config: spawn(
            Api::<ConfigMap>::namespaced(client.clone(), &queue_config.0),
            watcher::Config::default().fields(&format!("metadata.name={}", queue_config.1)),
            changed.clone(),
            |c| c.metadata.managed_fields = None,
        ),
        slices: spawn(
            Api::<ResourceSlice>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            |s| s.metadata.managed_fields = None,
        ),
        classes: spawn(
            Api::<DeviceClass>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            |c| c.metadata.managed_fields = None,
        ),
        claims: spawn(
            Api::<ResourceClaim>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
            |c| c.metadata.managed_fields = None,
        ),
        provisioning: Arc::default(),
        pod_groups: Arc::default(),
        taint_rules: Arc::default(),
    };
    // The ProvisioningRequest API is a CRD the cluster autoscaler brings, PodGroups are
    // behind a feature gate: each is looked for now and every half minute until it is there,
    // then watched like the rest.
    let probed = [
        watch_when_served(
            Api::<ProvisioningRequest>::all(client.clone()),
            caches.provisioning.clone(),
            changed.clone(),
            trim_request,
            "watching ProvisioningRequests (autoscaling.x-k8s.io/v1) for flex-start",
            "no ProvisioningRequest API: flex-start pods are placed on the nodes there are, and no capacity is asked for",
        ),
        watch_when_served(
            Api::<PodGroup>::all(client.clone()),
            caches.pod_groups.clone(),
            changed.clone(),
            |g| g.metadata.managed_fields = None,
            "watching PodGroups (scheduling.k8s.io/v1beta1): pods naming a gang PodGroup bind together",
            "no PodGroup API (scheduling.k8s.io/v1beta1, GenericWorkload gate)",
        ),
        watch_when_served(
            Api::<k8s_openapi::api::resource::v1::DeviceTaintRule>::all(client.clone()),
            caches.taint_rules.clone(),
            changed.clone(),
            |r| r.metadata.managed_fields = None,
            "watching DeviceTaintRules (resource.k8s.io/v1)",
            "no DeviceTaintRule API (resource.k8s.io/v1): only the slices' own device taints apply",
        ),
    ];
    for p in probed {
        p.notified().await;
    }
    for (what, r) in [
        ("nodes", caches.nodes.wait_until_ready().await),
        ("pods", caches.pods.wait_until_ready().await),
        ("jobs", caches.jobs.wait_until_ready().await),
        ("namespaces", caches.namespaces.wait_until_ready().await),
        ("the queue mapping", caches.queue_config.wait_until_ready().await),
        ("resourceslices", caches.slices.wait_until_ready().await),
        ("deviceclasses", caches.classes.wait_until_ready().await),
        ("resourceclaims", caches.claims.wait_until_ready().await),
    ] {
        if r.is_err() {
            warn!(what, "watch cache closed before its first list");
        }
    }
    caches
}

/// What a watch cache can hold.
trait Watched:
    kube::Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// Watches `api` into a store; `changed` is notified on every event.
fn spawn<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
    changed: Arc<Notify>,
    trim: fn(&mut K),
) -> Store<K> {
    spawn_fed(api, config, changed, trim, |_| {})
}

/// [`spawn`], with `feed` given each event (trimmed) before the store takes it.
fn spawn_fed<K: Watched>(
    api: Api<K>,
    config: watcher::Config,
    changed: Arc<Notify>,
    trim: fn(&mut K),
    feed: impl Fn(&watcher::Event<K>) + Send + 'static,
) -> Store<K> {
    let (reader, writer) = reflector::store();
    let events = watcher(api, config).modify(trim).inspect(move |ev| {
        if let Ok(ev) = ev {
            feed(ev);
        }
    });
    let stream = reflector::reflector(writer, events.default_backoff());
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Err(e) = ev {
                warn!(error = %e, "watch failed; retrying with backoff");
            }
            changed.notify_one();
        }
    });
    reader
}

/// Watches `api` into `slot` once the API server serves it, probing now and every half minute
/// until it does. The returned notify fires after the first probe.
fn watch_when_served<K: Watched>(
    api: Api<K>,
    slot: Arc<std::sync::OnceLock<Store<K>>>,
    changed: Arc<Notify>,
    trim: fn(&mut K),
    served: &'static str,
    missing: &'static str,
) -> Arc<Notify> {
    let probed = Arc::new(Notify::new());
    let first_probe = probed.clone();
    tokio::spawn(async move {
        let mut said = String::new();
        loop {
            match api.list(&ListParams::default().limit(1)).await {
                Ok(_) => {
                    let store = spawn(api, watcher::Config::default(), changed.clone(), trim);
                    if store.wait_until_ready().await.is_ok() {
                        info!("{served}");
                        // Only this task sets it.
                        let _ = slot.set(store);
                    }
                    first_probe.notify_one();
                    changed.notify_one();
                    return;
                }
                Err(e) => {
                    let why = match &e {
                        kube::Error::Api(s) if s.code == 404 => "not served".to_owned(),
                        other => other.to_string(),
                    };
                    if why != said {
                        info!(reason = %why, "{missing}");
                        said = why;
                    }
                }
            }
            first_probe.notify_one();
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
    });
    probed
}

// The caches keep only what a cycle reads: Pods and Nodes are decoded into xpu's own types
// (`crate::pod`, `crate::node`), and of what those keep, managed fields and annotations no
// cycle reads are dropped here.
fn trim_node(n: &mut Node) {
    n.metadata.managed_fields = None;
    n.metadata.annotations = None;
    // Ready only: the one condition a cycle reads (a kubelet posts five, with messages).
    if let Some(c) = n.status.as_mut().and_then(|s| s.conditions.as_mut()) {
        c.retain(|c| c.type_ == "Ready");
    }
}

fn trim_pod(p: &mut Pod) {
    p.metadata.managed_fields = None;
    if let Some(a) = p.metadata.annotations.as_mut() {
        a.retain(|k, _| {
            k == crate::convert::COMPLETION_INDEX
                || k == crate::convert::GANG_LABEL
                || k == crate::convert::GANG_SIZE
                || k == crate::share::GPUS_ANNOTATION
                || k == flex::CONSUME
                || k == flex::ATTEMPT
        });
    }
    if let Some(s) = p.status.as_mut() {
        // PodScheduled only: what a new leader reads to leave an unchanged reason unwritten.
        if let Some(c) = s.conditions.as_mut() {
            c.retain(|c| c.type_ == "PodScheduled");
        }
    }
}

fn trim_namespace(n: &mut Namespace) {
    n.metadata.managed_fields = None;
    n.metadata.annotations = None;
    n.spec = None;
    n.status = None;
}

fn trim_request(r: &mut ProvisioningRequest) {
    r.metadata.managed_fields = None;
    r.metadata.annotations = None;
}

fn trim_job(j: &mut KubeJob) {
    j.metadata.managed_fields = None;
    j.metadata.annotations = None;
    j.status = None;
    if let Some(s) = j.spec.as_mut() {
        s.template = Default::default();
    }
}

/// Per-pod memory of what was last said, for rate limiting.
#[derive(Default)]
struct Said {
    at: HashMap<String, (Instant, String)>,
}

/// Runs cycles until `stop` resolves. Call only while leading.
pub async fn run(
    client: Client,
    caches: Caches,
    changed: Arc<Notify>,
    opts: Options,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()>,
) {
    let config = SchedulerConfig {
        queue: QueuePolicy::Fair,
        policy: opts.policy,
        lanes: true,
        fit_per_task: true,
        best_effort: opts.best_effort,
        reserve: opts.reserve,
        seed: opts.seed,
        ..SchedulerConfig::default()
    };
    let assumed: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    // GPU choices of assumed share pods, forgotten with them.
    let mut assumed_gpus: HashMap<String, Vec<u16>> = HashMap::new();
    // Victims an eviction or a PodDisruptionBudget refused, not chosen again for a while.
    let mut refused: HashMap<String, Instant> = HashMap::new();
    // ProvisioningRequests made lately, by namespace/name: not made again while the watch
    // catches up with them.
    let mut asked: HashMap<String, Instant> = HashMap::new();
    let binds = Arc::new(Semaphore::new(opts.bind_concurrency.max(1)));
    let mut said = Said::default();
    let mut warned_nodes: HashMap<String, String> = HashMap::new();
    let mut warned_pods: HashMap<String, String> = HashMap::new();
    // PodGroups: the condition last written, by (namespace, name).
    let mut group_said: HashMap<(String, String), (bool, String)> = HashMap::new();
    let mut mapping = Mapping::default();
    let writer = Writer::start(client.clone(), metrics.clone());
    // DRA: selectors compiled once; claims this scheduler allocated that the watch has not
    // shown allocated yet (uid → devices), counted as in use meanwhile.
    let compiled = crate::claims::Compiled::default();
    let assumed_claims: Arc<Mutex<HashMap<String, xpu_sched::dra::Allocation>>> = Arc::default();
    // Nodes and bound pods converted in earlier cycles, by resourceVersion.
    let memo = cycle::Memo::default();
    // Every claim, and what the allocated ones hold, kept from cycle to cycle.
    let mut claim_book = crate::claims::ClaimBook::default();
    // The null binder's next node.
    let mut null_cursor = 0usize;
    // Claims whose allocation was taken back lately, by uid.
    let mut dealloc_sent: HashMap<String, Instant> = HashMap::new();
    // ResourceSlices as converted, by name with the resourceVersion converted: a slice is
    // converted (and a bad one warned about) once per change, not every cycle.
    let mut slices: HashMap<String, (String, Result<Arc<xpu_sched::dra::Slice>, String>)> =
        HashMap::new();
    let started = Instant::now();
    let mut stop = std::pin::pin!(stop);
    let mut events = EventBudget::new(opts.events_per_second);
    loop {
        tokio::select! {
            () = &mut stop => break,
            () = changed.notified() => {}
            // Waiting pods are looked at again now and then even when nothing changed.
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
        // Let a burst of watch events land before planning.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let pass = Instant::now();

        let nodes = caches.nodes.state();
        let pods = caches.pods.state();
        let jobs: HashMap<String, (i32, i32, bool)> = caches
            .jobs
            .state()
            .iter()
            .filter_map(|j| {
                let s = j.spec.as_ref()?;
                Some((
                    j.metadata.uid.clone()?,
                    (
                        s.completions.unwrap_or(1),
                        s.parallelism.unwrap_or(1),
                        s.completion_mode.as_deref() == Some("Indexed"),
                    ),
                ))
            })
            .collect();
        // The pods the watch shows unbound (waiting, or bound by this scheduler and not yet
        // seen so): one pass over every pod, reading only `spec.nodeName`, so that the
        // cycle's own passes read these few instead of every pod of the cluster.
        let unbound: Vec<Arc<Pod>> = pods
            .iter()
            .filter(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()).is_none_or(str::is_empty)
            })
            .cloned()
            .collect();
        let assumed_now = {
            let mut a = assumed.lock().await;
            // Forget what the watch now shows bound, or gone: kept are the assumed pods the
            // watch still shows unbound.
            if !a.is_empty() {
                let still: std::collections::HashSet<&str> =
                    unbound.iter().filter_map(|p| p.metadata.uid.as_deref()).collect();
                a.retain(|uid, _| still.contains(uid.as_str()));
            }
            a.clone()
        };
        assumed_gpus.retain(|uid, _| assumed_now.contains_key(uid));
        refused.retain(|_, at| at.elapsed() < REFUSED_FOR);
        let excluded: std::collections::HashSet<String> = refused.keys().cloned().collect();
        let requests = caches.provisioning.get().map(Store::state);
        asked.retain(|_, at| at.elapsed() < ASKED_FOR);
        let queues = mapping.current(&caches.queue_config, &opts.queue_config, &writer, &opts);
        let namespace_labels: HashMap<String, std::collections::BTreeMap<String, String>> = caches
            .namespaces
            .state()
            .iter()
            .filter_map(|n| Some((n.metadata.name.clone()?, n.metadata.labels.clone()?)))
            .collect();
        // DRA state, from the caches.
        compiled.next_cycle();
        claim_book.update(&caches.claims.state());
        // What claims being written hold, counted in for this cycle and out after it.
        let writing: Vec<xpu_sched::dra::Allocation> = {
            let mut a = assumed_claims.lock().await;
            // Forget what the watch now shows allocated, or gone; a claim made for a pod's
            // extended resources, once the watch shows the pod bound (it was made first).
            a.retain(|uid, _| match uid.strip_prefix(cycle::EXTENDED_UID) {
                Some(pod) => assumed_now.contains_key(pod),
                None => claim_book.allocated(uid) == Some(false),
            });
            a.values().cloned().collect()
        };
        for alloc in &writing {
            claim_book.hold(alloc);
        }
        let mut current = HashMap::with_capacity(slices.len());
        for sl in caches.slices.state() {
            let name = sl.metadata.name.clone().unwrap_or_default();
            let version = sl.metadata.resource_version.clone().unwrap_or_default();
            let entry = match slices.remove(&name) {
                Some(e) if e.0 == version => e,
                _ => {
                    let converted = crate::claims::slice(&sl).map(Arc::new);
                    if let Err(e) = &converted {
                        warn!(slice = %name, reason = %e, "ResourceSlice left out");
                    }
                    (version, converted)
                }
            };
            current.insert(name, entry);
        }
        slices = current;
        // In name order: the devices of a pool of several slices keep one order every cycle.
        let mut names: Vec<&String> = slices.keys().collect();
        names.sort_unstable();
        let dra_slices: Vec<Arc<xpu_sched::dra::Slice>> =
            names.iter().filter_map(|n| slices[*n].1.as_ref().ok().cloned()).collect();
        // DeviceTaintRules taint the devices they select, as the slices' own taints do.
        let rules = caches.taint_rules.get().map(Store::state).unwrap_or_default();
        let dra_slices = crate::claims::with_taint_rules(dra_slices, &rules);
        let class_objects: HashMap<String, DeviceClass> = caches
            .classes
            .state()
            .iter()
            .filter_map(|c| Some((c.metadata.name.clone()?, c.as_ref().clone())))
            .collect();
        // A class whose selectors do not compile is left out: claims naming it wait, told so.
        let dra_classes: HashMap<String, xpu_sched::dra::Class> = class_objects
            .values()
            .filter_map(|c| crate::claims::class(c, &compiled).ok().map(|x| (x.name.clone(), x)))
            .collect();
        let slice_index = cycle::SliceIndex::new(dra_slices.iter().map(|s| s.as_ref()));
        let in_flight: std::collections::HashSet<String> =
            assumed_claims.lock().await.keys().cloned().collect();
        let extended = cycle::extended_resources(&nodes, &class_objects);
        let dra = cycle::Dra {
            extended: &extended,
            in_flight: &in_flight,
            slices: &slice_index,
            classes: &dra_classes,
            class_objects: &class_objects,
            claims: claim_book.claims(),
            compiled: &compiled,
            in_use: claim_book.in_use(),
        };
        let group_objects = caches.pod_groups.get().map(Store::state);
        let pod_groups: Option<crate::convert::PodGroups> = group_objects.as_ref().map(|gs| {
            gs.iter()
                .filter_map(|g| {
                    let key = (g.metadata.namespace.clone()?, g.metadata.name.clone()?);
                    Some((key, crate::convert::group_policy(g).ok()?))
                })
                .collect()
        });
        let snap = Snapshot {
            dra: Some(dra),
            pod_groups: pod_groups.as_ref(),
            queues: &queues,
            namespace_labels: &namespace_labels,
            provisioning: requests.as_deref(),
            provisioning_backoff: (
                opts.provisioning_backoff.as_secs(),
                PROVISIONING_BACKOFF_MAX.as_secs().max(opts.provisioning_backoff.as_secs()),
            ),
            assumed_gpus: &assumed_gpus,
            shares: opts.share_key.is_some(),
            preemption: opts.preemption,
            excluded: &excluded,
            unix_now: k8s_openapi::jiff::Timestamp::now().as_second(),
            memo: Some(&memo),
            ledger: Some(&caches.ledger),
            unbound: Some(&unbound),
            ..Snapshot::new(&opts.scheduler_name, &nodes, &pods, &jobs, &assumed_now)
        };
        let now = started.elapsed().as_secs();
        let t0 = Instant::now();
        let interval = opts.status_interval;
        let mut explain =
            |uid: &str| said.at.get(uid).is_none_or(|(at, _)| at.elapsed() >= interval);
        let plan = if opts.null_binder {
            cycle::null_plan(&snap, &mut null_cursor)
        } else {
            cycle::plan(&snap, &config, now, &mut explain)
        };
        metrics.plan_seconds.observe(t0.elapsed().as_secs_f64());
        for alloc in &writing {
            claim_book.let_go(alloc);
        }
        memo.sweep();
        let built = memo.build_stats();
        metrics.cluster_builds_whole.store(built.whole, Ordering::Relaxed);
        metrics.cluster_builds_patched.store(built.patched, Ordering::Relaxed);
        metrics.cluster_nodes_built.store(built.nodes, Ordering::Relaxed);
        metrics
            .pending
            .store(plan.pending.saturating_sub(plan.binds.len()) as u64, Ordering::Relaxed);
        debug!(
            pending = plan.pending,
            binds = plan.binds.len(),
            plan_ms = t0.elapsed().as_millis() as u64,
            since_pass_ms = pass.elapsed().as_millis() as u64,
            waiting = plan.waiting.len(),
            "cycle"
        );

        if let Some(last) = &plan.broken_invariant {
            error!(last = %last, "scheduler: an invariant broke while planning (a bug: please report it with this log)");
        }
        for (node, why) in &plan.bad_nodes {
            if warned_nodes.get(node) != Some(why) {
                warn!(node = %node, reason = %why, "node skipped");
                metrics.nodes_skipped.fetch_add(1, Ordering::Relaxed);
                if events.take() {
                    writer.event(event_for_node(node, why, &opts.scheduler_name));
                }
                warned_nodes.insert(node.clone(), why.clone());
            }
        }
        warned_nodes.retain(|n, _| plan.bad_nodes.iter().any(|(b, _)| b == n));
        for (pod, why) in &plan.unreadable {
            if warned_pods.get(&pod.uid) != Some(why) {
                warn!(pod = %pod, reason = %why, "a bound pod's requests cannot be read");
                if events.take() {
                    let msg = format!("xpu scheduler: this pod's requests cannot be read; {why}");
                    writer.event(event_for_pod(
                        pod,
                        "XpuRequestsUnreadable",
                        &msg,
                        &opts.scheduler_name,
                    ));
                }
                warned_pods.insert(pod.uid.clone(), why.clone());
            }
        }
        warned_pods.retain(|uid, _| plan.unreadable.iter().any(|(p, _)| p.uid == *uid));

        // PodGroups: `PodGroupInitiallyScheduled` as their pods bind or wait.
        if let Some(groups) = &group_objects {
            group_status(&client, groups, &pods, &plan, &mut group_said);
        }

        // Assume first, then bind in the background.
        {
            let mut a = assumed.lock().await;
            let mut ac = assumed_claims.lock().await;
            for b in &plan.binds {
                a.insert(b.pod.uid.clone(), b.node.clone());
                if let Some((gpus, _)) = &b.share {
                    assumed_gpus.insert(b.pod.uid.clone(), gpus.clone());
                }
                for w in &b.claims {
                    if let Some(d) = &w.devices {
                        ac.insert(w.uid.clone(), d.clone());
                    }
                }
            }
        }
        // Pods with claims bind in batches (a gang together): every claim of the batch is
        // allocated and reserved first, and released again if any write fails.
        let (with_claims, plain): (Vec<Bind>, Vec<Bind>) =
            plan.binds.into_iter().partition(|b| !b.claims.is_empty());
        let mut batches: Vec<Vec<Bind>> = Vec::new();
        for b in with_claims {
            match batches.iter_mut().find(|x| b.gang.is_some() && x[0].gang == b.gang) {
                Some(x) => x.push(b),
                None => batches.push(vec![b]),
            }
        }
        for batch in batches {
            for b in &batch {
                said.at.remove(&b.pod.uid);
            }
            let (client, assumed, metrics, changed, ac, binds) = (
                client.clone(),
                assumed.clone(),
                metrics.clone(),
                changed.clone(),
                assumed_claims.clone(),
                binds.clone(),
            );
            let key = opts.share_key.clone();
            tokio::spawn(async move {
                // Waited for in the task, not the loop (see the plain binds below).
                let _permit = bind_permit(binds).await;
                let t = Instant::now();
                let written = reserve_claims(&client, &batch).await;
                metrics.claims_seconds.observe(t.elapsed().as_secs_f64());
                let ok = match written {
                    Ok(()) => true,
                    Err(e) => {
                        warn!(pods = batch.len(), first = %batch[0].pod, error = %e, "ResourceClaims not written; the pods go back to the queue");
                        false
                    }
                };
                // Devices with binding conditions: the claims are written and reserved, and the
                // pods wait (no longer assumed) until the driver sets the conditions; a later
                // cycle binds them then, or takes the allocation back if the binding failed.
                let conditional = batch.iter().flat_map(|b| &b.claims).any(|w| {
                    w.devices
                        .as_ref()
                        .is_some_and(|a| a.devices.iter().any(|d| !d.binding_conditions.is_empty()))
                });
                if ok && conditional {
                    for b in &batch {
                        info!(pod = %b.pod, node = %b.node, "claims allocated; waiting for their devices' binding conditions");
                        assumed.lock().await.remove(&b.pod.uid);
                    }
                    changed.notify_one();
                    return;
                }
                for b in &batch {
                    let bound = ok && {
                        let t = Instant::now();
                        let r = bind(&client, b, key.as_deref()).await;
                        metrics.bind_seconds.observe(t.elapsed().as_secs_f64());
                        r.is_ok()
                    };
                    if bound {
                        metrics.attempts_scheduled.fetch_add(1, Ordering::Relaxed);
                        info!(pod = %b.pod, node = %b.node, gang = b.gang.as_deref().unwrap_or(""), claims = b.claims.len(), "bound");
                    } else {
                        if ok {
                            metrics.bind_errors.fetch_add(1, Ordering::Relaxed);
                            warn!(pod = %b.pod, node = %b.node, "bind failed; the pod goes back to the queue");
                        }
                        assumed.lock().await.remove(&b.pod.uid);
                        let mut a = ac.lock().await;
                        for w in &b.claims {
                            a.remove(&w.uid);
                        }
                    }
                }
                changed.notify_one();
            });
        }
        for b in plain {
            said.at.remove(&b.pod.uid);
            // Creation time, for the scheduling-latency histogram: one cache lookup per bind.
            let created = caches
                .pods
                .get(&ObjectRef::new(&b.pod.name).within(&b.pod.namespace))
                .and_then(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0));
            let (client, assumed, metrics, changed, binds) =
                (client.clone(), assumed.clone(), metrics.clone(), changed.clone(), binds.clone());
            let key = opts.share_key.clone();
            tokio::spawn(async move {
                let _permit = bind_permit(binds).await;
                let t = Instant::now();
                let r = bind(&client, &b, key.as_deref()).await;
                metrics.bind_seconds.observe(t.elapsed().as_secs_f64());
                match r {
                    Ok(()) => {
                        metrics.attempts_scheduled.fetch_add(1, Ordering::Relaxed);
                        if let Some(t) = created {
                            let ms = k8s_openapi::jiff::Timestamp::now().as_millisecond()
                                - t.as_millisecond();
                            metrics.e2e_seconds.observe(ms.max(0) as f64 / 1e3);
                        }
                        info!(pod = %b.pod, node = %b.node, gang = b.gang.as_deref().unwrap_or(""), "bound");
                    }
                    Err(e) => {
                        metrics.bind_errors.fetch_add(1, Ordering::Relaxed);
                        warn!(pod = %b.pod, node = %b.node, error = %e, "bind failed; the pod goes back to the queue");
                        assumed.lock().await.remove(&b.pod.uid);
                        changed.notify_one();
                    }
                }
            });
        }

        // Allocations whose binding failed are taken back (once per claim per minute at most:
        // the watch shows the change before the next try).
        dealloc_sent.retain(|_, at: &mut Instant| at.elapsed() < Duration::from_secs(60));
        for d in &plan.deallocate {
            if dealloc_sent.contains_key(&d.uid) {
                continue;
            }
            dealloc_sent.insert(d.uid.clone(), Instant::now());
            let (client, d) = (client.clone(), d.clone());
            tokio::spawn(async move {
                match deallocate(&client, &d).await {
                    Ok(()) => {
                        info!(claim = %format!("{}/{}", d.namespace, d.name), reason = %d.why, "allocation taken back")
                    }
                    Err(e) => {
                        warn!(claim = %format!("{}/{}", d.namespace, d.name), error = %e, "could not take back an allocation whose binding failed")
                    }
                }
            });
        }
        for p in &plan.preemptions {
            match preempt(&client, &caches, p, &opts.scheduler_name, &mut events).await {
                Ok(()) => {
                    metrics.preemptions.fetch_add(1, Ordering::Relaxed);
                }
                Err(Refusal { victims, why }) => {
                    warn!(reason = %why, "preemption not made");
                    for uid in victims {
                        refused.insert(uid, Instant::now());
                    }
                    for (pod, _) in &p.nominate {
                        let msg = format!("preemption: {why}; looking for other victims");
                        writer.unschedulable(pod.clone(), msg, None);
                    }
                    changed.notify_one();
                }
            }
        }

        for p in &plan.provisions {
            let key = format!("{}/{}", p.namespace, p.name());
            if asked.contains_key(&key) {
                continue;
            }
            asked.insert(key.clone(), Instant::now());
            match provision(&client, p).await {
                Ok(()) => {
                    metrics.provisioning_requests.fetch_add(1, Ordering::Relaxed);
                    info!(request = %key, attempt = p.attempt, pods = p.pods.len(), replaces = p.retire.as_deref().unwrap_or(""), "asked for flex-start capacity");
                }
                Err(e) => {
                    warn!(request = %key, error = %e, "could not ask for flex-start capacity; trying again next cycle");
                    asked.remove(&key);
                }
            }
        }

        // Reasons are handed to the writer, never awaited here: binding does not wait for
        // them. A reason the pod already shows (a restart, a new leader) is not written again.
        for (pod, msg) in plan.waiting {
            metrics.attempts_unschedulable.fetch_add(1, Ordering::Relaxed);
            if said.at.get(&pod.uid).is_some_and(|(_, m)| *m == msg) {
                said.at.insert(pod.uid.clone(), (Instant::now(), msg));
                continue;
            }
            let shown = caches
                .pods
                .get(&ObjectRef::new(&pod.name).within(&pod.namespace))
                .is_some_and(|p| crate::status::already_says(&p, &msg));
            if !shown {
                let event = events
                    .take()
                    .then(|| event_for_pod(&pod, "FailedScheduling", &msg, &opts.scheduler_name));
                if !writer.unschedulable(pod.clone(), msg.clone(), event) {
                    // The writer is full: said on a later cycle.
                    continue;
                }
                debug!(pod = %pod, reason = %msg, "unschedulable");
            }
            said.at.insert(pod.uid.clone(), (Instant::now(), msg));
        }
        // Forget pods that are gone.
        if said.at.len() > 4 * pods.len().max(1024) {
            let live: std::collections::HashSet<&str> =
                pods.iter().filter_map(|p| p.metadata.uid.as_deref()).collect();
            said.at.retain(|u, _| live.contains(u.as_str()));
        }
        metrics.cycle_seconds.observe(pass.elapsed().as_secs_f64());
    }
}

/// The queue mapping as last read: parsed again only when the ConfigMap changes; a mapping
/// that does not parse leaves the last good one in force, and is reported once.
#[derive(Default)]
struct Mapping {
    version: Option<String>,
    queues: Arc<Queues>,
}

impl Mapping {
    fn current(
        &mut self,
        store: &Store<ConfigMap>,
        at: &(String, String),
        writer: &Writer,
        opts: &Options,
    ) -> Arc<Queues> {
        let source = format!("{}/{}", at.0, at.1);
        let cm = store.get(&ObjectRef::new(&at.1).within(&at.0));
        let version = cm.as_ref().map(|c| c.metadata.resource_version.clone().unwrap_or_default());
        if version == self.version {
            return self.queues.clone();
        }
        self.version = version;
        let Some(cm) = cm else {
            if !self.queues.source().is_empty() {
                info!(config = %source, "the queue mapping is gone: each namespace is its own queue again");
            }
            self.queues = Arc::default();
            return self.queues.clone();
        };
        let text = cm.data.as_ref().and_then(|d| d.get(crate::queues::CONFIG_KEY));
        match Queues::parse(text.map_or("", String::as_str), &source) {
            Ok(q) => {
                info!(config = %source, "queue mapping read");
                self.queues = Arc::new(q);
            }
            Err(e) => {
                error!(config = %source, error = %e, "the queue mapping cannot be used; the last good one stays in force");
                let target = ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("ConfigMap".into()),
                    name: Some(at.1.clone()),
                    namespace: Some(at.0.clone()),
                    uid: cm.metadata.uid.clone(),
                    ..ObjectReference::default()
                };
                let msg = format!("{e}; the last good mapping stays in force");
                writer.event(warning(
                    &at.0,
                    &at.1,
                    target,
                    "XpuQueuesInvalid",
                    &msg,
                    &opts.scheduler_name,
                ));
            }
        }
        self.queues.clone()
    }
}

/// The condition kube-scheduler keeps on a PodGroup: True once its pods were first scheduled
/// (and True for good), False with the reason while they wait.
const GROUP_SCHEDULED: &str = "PodGroupInitiallyScheduled";

/// Writes `PodGroupInitiallyScheduled` on the groups whose pods this plan binds (True) or
/// explains (False, `Unschedulable`, with the pods' reason), each change once, off the loop,
/// by server-side apply on the status subresource.
fn group_status(
    client: &Client,
    groups: &[Arc<PodGroup>],
    pods: &[Arc<Pod>],
    plan: &cycle::Plan,
    said: &mut HashMap<(String, String), (bool, String)>,
) {
    if groups.is_empty() {
        said.clear();
        return;
    }
    let by_uid: HashMap<&str, &Pod> =
        pods.iter().filter_map(|p| Some((p.metadata.uid.as_deref()?, p.as_ref()))).collect();
    let group_of = |uid: &str| {
        let p = by_uid.get(uid)?;
        let name = crate::convert::pod_group_name(p)?;
        Some((p.metadata.namespace.clone().unwrap_or_else(|| "default".into()), name.to_owned()))
    };
    let mut now: HashMap<(String, String), (bool, String)> = HashMap::new();
    for b in &plan.binds {
        if let Some(g) = group_of(&b.pod.uid) {
            now.insert(g, (true, format!("pods of the group bound, {} to {}", b.pod.name, b.node)));
        }
    }
    for (k, why) in &plan.waiting {
        if let Some(g) = group_of(&k.uid) {
            now.entry(g).or_insert((false, why.clone()));
        }
    }
    for (key, (ok, msg)) in now {
        let Some(obj) = groups.iter().find(|g| {
            g.metadata.namespace.as_ref() == Some(&key.0)
                && g.metadata.name.as_ref() == Some(&key.1)
        }) else {
            continue;
        };
        let already_true =
            obj.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
                c.iter().any(|c| c.type_ == GROUP_SCHEDULED && c.status == "True")
            });
        if already_true || said.get(&key).is_some_and(|(o, m)| *o || (*o == ok && *m == msg)) {
            continue;
        }
        said.insert(key.clone(), (ok, msg.clone()));
        let status = serde_json::json!({
            "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup",
            "metadata": { "name": key.1, "namespace": key.0 },
            "status": { "conditions": [{
                "type": GROUP_SCHEDULED,
                "status": if ok { "True" } else { "False" },
                "reason": if ok { "Scheduled" } else { "Unschedulable" },
                "message": msg,
                "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string(),
            }] },
        });
        let api: Api<PodGroup> = Api::namespaced(client.clone(), &key.0);
        tokio::spawn(async move {
            let pp = PatchParams::apply("xpu-scheduler").force();
            if let Err(e) = api.patch_status(&key.1, &pp, &Patch::Apply(&status)).await {
                warn!(group = %format!("{}/{}", key.0, key.1), error = %e, "PodGroup status not written");
            }
        });
    }
    said.retain(|(ns, n), _| {
        groups.iter().any(|g| {
            g.metadata.namespace.as_ref() == Some(ns) && g.metadata.name.as_ref() == Some(n)
        })
    });
}

/// How long a ProvisioningRequest just made is not made again (the watch shows it sooner).
const ASKED_FOR: Duration = Duration::from_secs(10);

/// A permit to bind, waited for in the bind's own task rather than in the scheduling loop: the
/// next cycle plans while this one's binds are in flight (their pods are assumed already).
/// Waiting in the loop made it plan again only once the last pod of a batch had a permit, so
/// each batch grew to what arrived while the one before was sent, and every pod waited for its
/// batch. The semaphore hands permits out in the order they were asked for. It is never closed;
/// were it, the bind goes ahead unlimited rather than leave its pod assumed and unbound.
async fn bind_permit(binds: Arc<Semaphore>) -> Option<tokio::sync::OwnedSemaphorePermit> {
    match binds.acquire_owned().await {
        Ok(p) => Some(p),
        Err(e) => {
            warn!(error = %e, "the bind limiter is closed; binding without it");
            None
        }
    }
}

/// Makes one flex-start request: retires the one it replaces, writes the PodTemplate (from the
/// pod as stored, not the trimmed cached copy) and the request, then points the pods at it.
/// Each step takes "already exists" or "already gone" as done, so it can be repeated.
async fn provision(client: &Client, p: &flex::Provision) -> Result<(), kube::Error> {
    let ns = p.namespace.as_str();
    let requests: Api<ProvisioningRequest> = Api::namespaced(client.clone(), ns);
    let templates: Api<PodTemplate> = Api::namespaced(client.clone(), ns);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    if let Some(old) = &p.retire {
        for r in [
            requests.delete(old, &DeleteParams::background()).await.map(|_| ()),
            templates.delete(old, &DeleteParams::background()).await.map(|_| ()),
        ] {
            gone_or_done(r)?;
        }
    }
    let mut template = p.template.clone();
    if let Some(first) = p.pods.first()
        && let Some(mut spec) = pods.get_opt(&first.name).await?.and_then(|p| p.spec)
        && let Some(t) = template.template.as_mut()
    {
        spec.node_name = None;
        t.spec = Some(spec);
    }
    exists_or_done(templates.create(&PostParams::default(), &template).await.map(|_| ()))?;
    exists_or_done(requests.create(&PostParams::default(), &p.request).await.map(|_| ()))?;
    let patch = serde_json::json!({ "metadata": { "annotations": {
        flex::CONSUME: p.name(),
        flex::CLASS_ANNOTATION: flex::CLASS,
        flex::ATTEMPT: p.attempt.to_string(),
    }}});
    for pod in &p.pods {
        gone_or_done(
            pods.patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch)).await.map(|_| ()),
        )?;
    }
    Ok(())
}

fn gone_or_done(r: Result<(), kube::Error>) -> Result<(), kube::Error> {
    match r {
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        other => other,
    }
}

fn exists_or_done(r: Result<(), kube::Error>) -> Result<(), kube::Error> {
    match r {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        other => other,
    }
}

/// How long a victim whose eviction was refused is left out of preemption.
const REFUSED_FOR: Duration = Duration::from_secs(30);

/// Why a preemption was not (fully) made, and the victims not to choose again for a while.
struct Refusal {
    victims: Vec<String>,
    why: String,
}

/// Carries out one preemption: checks every victim's PodDisruptionBudget first (none is evicted
/// unless all may be), nominates the preemptors, then evicts through `pods/eviction`.
async fn preempt(
    client: &Client,
    caches: &Caches,
    p: &crate::preempt::Preemption,
    component: &str,
    events: &mut EventBudget,
) -> Result<(), Refusal> {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    let labels_of = |k: &PodKey| {
        caches
            .pods
            .get(&ObjectRef::new(&k.name).within(&k.namespace))
            .and_then(|p| p.metadata.labels.clone())
            .unwrap_or_default()
    };
    let mut namespaces: Vec<&str> = p.victims.iter().map(|v| v.namespace.as_str()).collect();
    namespaces.sort_unstable();
    namespaces.dedup();
    for ns in namespaces {
        let api: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), ns);
        let pdbs = api.list(&Default::default()).await.map_err(|e| Refusal {
            victims: Vec::new(),
            why: format!("cannot read the PodDisruptionBudgets of namespace {ns}: {e}"),
        })?;
        for pdb in pdbs.items {
            let Some(sel) = pdb.spec.as_ref().and_then(|s| s.selector.as_ref()) else { continue };
            let covered: Vec<&PodKey> = p
                .victims
                .iter()
                .filter(|v| v.namespace == ns && crate::convert::selects(sel, &labels_of(v)))
                .collect();
            if covered.is_empty() {
                continue;
            }
            let allowed = pdb.status.as_ref().and_then(|s| s.disruptions_allowed).unwrap_or(0);
            if covered.len() as i64 > i64::from(allowed) {
                let names: Vec<String> = covered.iter().map(|v| v.to_string()).collect();
                return Err(Refusal {
                    victims: covered.iter().map(|v| v.uid.clone()).collect(),
                    why: format!(
                        "evicting {} would break PodDisruptionBudget {ns}/{} (it allows {allowed} disruption(s) now)",
                        names.join(", "),
                        pdb.metadata.name.as_deref().unwrap_or("")
                    ),
                });
            }
        }
    }
    for (pod, node) in &p.nominate {
        let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
        let patch = serde_json::json!({ "status": { "nominatedNodeName": node } });
        if let Err(e) =
            api.patch_status(&pod.name, &PatchParams::default(), &Patch::Merge(&patch)).await
        {
            warn!(pod = %pod, node = %node, error = %e, "could not nominate the preemptor");
        }
    }
    let by = p.nominate.first().map(|(k, n)| format!("{k} on node {n}")).unwrap_or_default();
    for v in &p.victims {
        let api: Api<k8s_openapi::api::core::v1::Pod> =
            Api::namespaced(client.clone(), &v.namespace);
        match api.evict(&v.name, &kube::api::EvictParams::default()).await {
            Ok(_) => {
                info!(pod = %v, by = %by, "evicted for preemption");
                if events.take() {
                    let msg = format!("Preempted by {by}");
                    let ev = event_for_pod(v, "Preempted", &msg, component);
                    let events_api: Api<Event> = Api::namespaced(client.clone(), &v.namespace);
                    if let Err(e) = events_api.create(&PostParams::default(), &ev).await {
                        debug!(pod = %v, error = %e, "could not record the Preempted Event");
                    }
                }
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(Refusal {
                    victims: vec![v.uid.clone()],
                    why: format!("the API server refused to evict {v}: {e}"),
                });
            }
        }
    }
    Ok(())
}

/// A token bucket for Events, so a thousand waiting pods do not flood the API server.
struct EventBudget {
    per_second: u32,
    tokens: f64,
    at: Instant,
}

impl EventBudget {
    fn new(per_second: u32) -> Self {
        Self { per_second, tokens: f64::from(per_second), at: Instant::now() }
    }

    fn take(&mut self) -> bool {
        let rate = f64::from(self.per_second);
        self.tokens = (self.tokens + self.at.elapsed().as_secs_f64() * rate).min(rate);
        self.at = Instant::now();
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The finalizer kube-scheduler puts on a claim it allocates, so the claim is not deleted
/// while its allocation stands.
pub(crate) const CLAIM_FINALIZER: &str = "resource.kubernetes.io/delete-protection";

/// DRA's binding protocol for a batch of pods (one pod, or a gang): for each claim, the
/// finalizer, then `status.allocation` (when allocated in this cycle) with the pod in
/// `status.reservedFor`, each write on the claim's current `resourceVersion`, so a claim
/// another scheduler allocated meanwhile is a conflict, never a double allocation. Any
/// failure releases what the batch wrote before it is reported.
async fn reserve_claims(client: &Client, batch: &[Bind]) -> Result<(), String> {
    let mut done: Vec<(&cycle::ClaimWrite, &Bind)> = Vec::new();
    for b in batch {
        for w in &b.claims {
            if let Err(e) = reserve_one(client, b, w).await {
                for (w, b) in done.into_iter().rev() {
                    if let Err(e) = release_one(client, b, w).await {
                        warn!(claim = %format!("{}/{}", w.namespace, w.name), error = %e, "could not release a ResourceClaim; it stays reserved until the pod is gone");
                    }
                }
                return Err(format!("ResourceClaim {}/{}: {e}", w.namespace, w.name));
            }
            done.push((w, b));
        }
    }
    Ok(())
}

fn consumer(b: &Bind) -> k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
    k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
        api_group: None,
        resource: "pods".into(),
        name: b.pod.name.clone(),
        uid: b.pod.uid.clone(),
    }
}

async fn reserve_one(client: &Client, b: &Bind, w: &cycle::ClaimWrite) -> Result<(), String> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &w.namespace);
    if let Some(ext) = &w.create {
        return make_extended(client, &api, b, w, ext).await;
    }
    // The cached claim first (no read); on a conflict, the current one, once.
    if let Some(cached) = &w.cached {
        match write_claim(&api, b, w, (**cached).clone()).await {
            Err(ClaimError::Conflict) => {}
            r => return r.map_err(|e| e.to_string()),
        }
    }
    let c = api.get(&w.name).await.map_err(|e| e.to_string())?;
    write_claim(&api, b, w, c).await.map_err(|e| e.to_string())
}

/// Why a claim write failed: a stale `resourceVersion` (read again and retry), or else.
enum ClaimError {
    Conflict,
    Other(String),
}

impl std::fmt::Display for ClaimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Conflict => f.write_str("changed meanwhile (conflict)"),
            Self::Other(why) => f.write_str(why),
        }
    }
}

impl From<kube::Error> for ClaimError {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 409 => Self::Conflict,
            other => Self::Other(other.to_string()),
        }
    }
}

/// Writes `c` (claim `w`, as last read) reserved for the pod, and allocated when `w` allocates.
async fn write_claim(
    api: &Api<ResourceClaim>,
    b: &Bind,
    w: &cycle::ClaimWrite,
    mut c: ResourceClaim,
) -> Result<(), ClaimError> {
    let pp = PostParams::default();
    let refuse = |why: &str| ClaimError::Other(why.into());
    if c.metadata.uid.as_deref() != Some(w.uid.as_str()) {
        return Err(refuse("replaced by another claim of the same name"));
    }
    if let Some(alloc) = &w.allocation {
        if c.status.as_ref().is_some_and(|s| s.allocation.is_some()) {
            return Err(refuse("allocated by someone else meanwhile"));
        }
        let f = c.metadata.finalizers.get_or_insert_default();
        if !f.iter().any(|x| x == CLAIM_FINALIZER) {
            f.push(CLAIM_FINALIZER.into());
            c = api.replace(&w.name, &pp, &c).await?;
        }
        let allocation = serde_json::from_value(alloc.clone())
            .map_err(|e| refuse(&format!("allocation: {e}")))?;
        c.status.get_or_insert_default().allocation = Some(allocation);
    } else if c.status.as_ref().is_none_or(|s| s.allocation.is_none()) {
        return Err(refuse("its allocation is gone"));
    }
    let reserved = c.status.get_or_insert_default().reserved_for.get_or_insert_default();
    if !reserved.iter().any(|r| r.uid == b.pod.uid) {
        reserved.push(consumer(b));
    }
    api.replace_status(&w.name, &pp, &c).await?;
    Ok(())
}

/// Creates the pod's extended-resource claim (as kube-scheduler does: owned by the pod, with
/// the finalizer), writes its allocation with the pod in `reservedFor`, and names it in the
/// pod's `status.extendedResourceClaimStatus`.
async fn make_extended(
    client: &Client,
    api: &Api<ResourceClaim>,
    b: &Bind,
    w: &cycle::ClaimWrite,
    ext: &cycle::ExtendedClaim,
) -> Result<(), String> {
    let pp = PostParams::default();
    let obj: ResourceClaim =
        serde_json::from_value(ext.object.clone()).map_err(|e| e.to_string())?;
    let mut c = api.create(&pp, &obj).await.map_err(|e| e.to_string())?;
    let name = c.metadata.name.clone().unwrap_or_default();
    let result: Result<(), String> = async {
        let alloc = w.allocation.clone().ok_or("no allocation")?;
        let status = c.status.get_or_insert_default();
        status.allocation = Some(serde_json::from_value(alloc).map_err(|e| e.to_string())?);
        status.reserved_for = Some(vec![consumer(b)]);
        api.replace_status(&name, &pp, &c).await.map_err(|e| e.to_string())?;
        let patch = serde_json::json!({ "status": { "extendedResourceClaimStatus": {
            "requestMappings": ext.mappings, "resourceClaimName": name } } });
        Api::<Pod>::namespaced(client.clone(), &b.pod.namespace)
            .patch_status(&b.pod.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }
    .await;
    if result.is_err()
        && let Err(e) = drop_claim(api, &name).await
    {
        warn!(claim = %format!("{}/{name}", w.namespace), error = %e, "could not delete an extended-resource claim made for a pod that did not bind; its devices stay allocated until it is deleted");
    }
    result
}

/// Deletes a claim this scheduler made, its finalizer first (nobody else holds it).
async fn drop_claim(api: &Api<ResourceClaim>, name: &str) -> Result<(), kube::Error> {
    let unfinalize = serde_json::json!({ "metadata": { "finalizers": null } });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&unfinalize)).await?;
    api.delete(name, &Default::default()).await?;
    Ok(())
}

/// Takes the pod out of the claim's `reservedFor`, and the allocation away when this batch
/// made it and nobody else holds the claim. A claim made for the pod's extended resources is
/// deleted.
async fn release_one(client: &Client, b: &Bind, w: &cycle::ClaimWrite) -> Result<(), String> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &w.namespace);
    if w.create.is_some() {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &b.pod.namespace);
        let pod = pods.get(&b.pod.name).await.map_err(|e| e.to_string())?;
        let Some(name) = pod
            .status
            .and_then(|s| s.extended_resource_claim_status)
            .map(|e| e.resource_claim_name)
        else {
            return Ok(());
        };
        return drop_claim(&api, &name).await.map_err(|e| e.to_string());
    }
    let mut c = api.get(&w.name).await.map_err(|e| e.to_string())?;
    let status = c.status.get_or_insert_default();
    if let Some(r) = status.reserved_for.as_mut() {
        r.retain(|r| r.uid != b.pod.uid);
    }
    let unheld = status.reserved_for.as_ref().is_none_or(Vec::is_empty);
    if w.allocation.is_some() && unheld {
        status.allocation = None;
        status.reserved_for = None;
    }
    api.replace_status(&w.name, &PostParams::default(), &c).await.map_err(|e| e.to_string())?;
    Ok(())
}

/// Takes back the allocation of a claim whose binding failed (as kube-scheduler's PostFilter
/// does): allocation, `reservedFor` and the devices' status cleared, on the claim's current
/// version, only while nobody but the pod holds it.
async fn deallocate(client: &Client, d: &cycle::Deallocate) -> Result<(), String> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &d.namespace);
    let mut c = api.get(&d.name).await.map_err(|e| e.to_string())?;
    if c.metadata.uid.as_deref() != Some(d.uid.as_str()) {
        return Ok(());
    }
    let status = c.status.get_or_insert_default();
    let others = status.reserved_for.iter().flatten().any(|r| r.uid != d.pod_uid);
    if others || status.allocation.is_none() {
        return Ok(());
    }
    status.allocation = None;
    status.reserved_for = None;
    status.devices = None;
    api.replace_status(&d.name, &PostParams::default(), &c).await.map_err(|e| e.to_string())?;
    Ok(())
}

/// `POST pods/{name}/binding`. A GPU-share choice goes in the Binding's annotations, which the
/// API server copies onto the pod in the same write that sets `spec.nodeName`.
pub async fn bind(
    client: &Client,
    b: &Bind,
    key: Option<&crate::share::ShareKey>,
) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &b.pod.namespace);
    let mut metadata = serde_json::json!({ "name": b.pod.name, "uid": b.pod.uid });
    if let (Some((gpus, ask)), Some(key)) = (&b.share, key) {
        use crate::share::{GPUS_ANNOTATION, SIGNATURE_ANNOTATION, format_gpus};
        metadata["annotations"] = serde_json::json!({
            GPUS_ANNOTATION: format_gpus(gpus),
            SIGNATURE_ANNOTATION: key.sign(&b.pod.uid, &b.node, gpus, *ask),
        });
    }
    let body = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": metadata,
        "target": { "apiVersion": "v1", "kind": "Node", "name": b.node },
    });
    api.create_subresource::<_, serde_json::Value>(
        "binding",
        &b.pod.name,
        &PostParams::default(),
        &body,
    )
    .await?;
    Ok(())
}

fn event_for_pod(pod: &PodKey, reason: &str, msg: &str, component: &str) -> Event {
    let target = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        uid: Some(pod.uid.clone()),
        ..ObjectReference::default()
    };
    warning(&pod.namespace, &pod.name, target, reason, msg, component)
}

fn event_for_node(node: &str, why: &str, component: &str) -> Event {
    let target = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.into()),
        ..ObjectReference::default()
    };
    let msg = format!("xpu scheduler leaves this node out: {why}");
    warning("default", node, target, "XpuNodeSkipped", &msg, component)
}

/// A `Warning` Event about `target`, its message cut to 1 KiB.
fn warning(
    namespace: &str,
    name: &str,
    target: ObjectReference,
    reason: &str,
    msg: &str,
    component: &str,
) -> Event {
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}.")),
            namespace: Some(namespace.into()),
            ..ObjectMeta::default()
        },
        involved_object: target,
        reason: Some(reason.into()),
        message: Some(msg.chars().take(1024).collect()),
        type_: Some("Warning".into()),
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        reporting_component: Some(component.into()),
        reporting_instance: Some(component.into()),
        action: Some("Scheduling".into()),
        ..Event::default()
    }
}
