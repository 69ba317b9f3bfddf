//! The scheduler: a queue of jobs in front of the cluster state and a placement policy, driven
//! by the caller's clock. The daemon calls [`Scheduler::submit`], [`Scheduler::schedule`] at
//! its own pace and [`Scheduler::finish`] when work ends; the simulator does the same with
//! simulated time. Nothing here sleeps or reads a clock.
//!
//! Queue orders: FIFO, priority with aging, shortest-job-first (on the job's duration hint),
//! EASY backfill (the first job that cannot start gets a reservation at the earliest time the
//! running jobs' expected ends free enough room; later jobs may start only where they cannot
//! delay it), and fair share across queues by dominant resource share (DRF). Preemption, when
//! enabled, evicts lower-priority jobs, lowest priority first and, among equals, those that lose
//! the least work, and only as many as needed. Gangs (and TPU slices) are placed all at once or
//! not at all, so no partial reservation is ever held while another gang waits: gangs cannot
//! deadlock. Flex-start pools ([`crate::pool`]) provision capacity for a job that nothing else
//! can hold.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, ClusterError, NodeId, NodeSpec, NodeStatus};
use crate::placement::{Demand, PlaceCtx, Placement, Placer, Policy, Unschedulable};
use crate::pods::{PodIndex, PodTerms};
use crate::policy::{PolicyKind, TaskMix};
use crate::pool::{FlexPool, PoolReport, PoolState, SlotState};
use crate::request::{ExpandedGroup, Job, RequestError, Time, expand};

/// Index of a job in its scheduler, in submission order.
pub type JobId = u32;

/// Queue orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum QueuePolicy {
    /// Submission order; the head blocks the rest.
    #[default]
    Fifo,
    /// Highest priority first, plus `aging_per_hour` points per hour of waiting; the head blocks.
    Priority,
    /// Shortest duration hint first (simulation: hints are the true durations).
    Sjf,
    /// Priority order with EASY backfill.
    Backfill,
    /// Dominant resource fairness across queues; within a queue, priority order.
    Fair,
}

impl std::str::FromStr for QueuePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fifo" => Ok(Self::Fifo),
            "priority" => Ok(Self::Priority),
            "sjf" => Ok(Self::Sjf),
            "backfill" => Ok(Self::Backfill),
            "fair" => Ok(Self::Fair),
            _ => {
                Err(format!("unknown queue {s:?}; expected fifo, priority, sjf, backfill or fair"))
            }
        }
    }
}

/// How the scheduler behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    #[serde(default)]
    pub queue: QueuePolicy,
    /// Placement policy (xpu's own by default).
    #[serde(default = "default_policy")]
    pub policy: PolicyKind,
    /// Evict lower-priority jobs when a higher-priority one cannot start.
    #[serde(default)]
    pub preemption: bool,
    /// Priority points a waiting job gains per hour (priority, backfill and fair orders).
    #[serde(default)]
    pub aging_per_hour: f64,
    /// Fair-share weight per queue name; queues not listed weigh 1.
    #[serde(default)]
    pub queue_weights: BTreeMap<String, f64>,
    /// Queued jobs one backfill pass considers (Slurm's `bf_max_job_test`).
    #[serde(default = "default_depth")]
    pub backfill_depth: usize,
    #[serde(default)]
    pub pools: Vec<FlexPool>,
    /// Seeds tie-breaking.
    #[serde(default)]
    pub seed: u64,
    /// Fair queue only: a job that cannot start holds back only the later jobs of its queue
    /// that ask for the same device kind (jobs asking for no device form a lane of their own),
    /// instead of the whole queue. A GPU job waiting for GPUs then never blocks the CPU-only or
    /// TPU jobs queued behind it, and later GPU jobs still cannot overtake it. Off by default;
    /// the daemon turns it on.
    #[serde(default)]
    pub lanes: bool,
    /// A job is failed as never fitting only when one of its groups can never fit an empty
    /// cluster on its own: a gang whole, any other group one task at a time. Without it (the
    /// default, as a simulator finishing whole jobs needs), every task of the job must fit at
    /// once. For callers that end tasks one by one ([`Scheduler::finish_task`],
    /// [`Scheduler::requeue_task`]), so a job may have more tasks than fit at once.
    #[serde(default)]
    pub fit_per_task: bool,
    /// Fair queue only: a job that cannot start holds back nothing; the jobs queued behind it
    /// are tried in turn (kube-scheduler's behaviour, and Kueue's `BestEffortFIFO`). Small jobs
    /// then fill what a large one is waiting for, so the large one can wait indefinitely;
    /// without it (`lanes`, or neither), the first job that cannot start blocks its lane.
    /// Takes precedence over `lanes`.
    #[serde(default)]
    pub best_effort: bool,
    /// Fair queue only: every queued job is tried in turn, as with `best_effort`, but a job
    /// that cannot start reserves the nodes it would take as they free up (placed on the
    /// cluster as if every device were free, preferring the nodes with the most free now), and
    /// the jobs after it are placed only on other nodes: the cluster fills around the waiting
    /// job without delaying it (backfill without run-time estimates). Only the first such job
    /// in fair-share order reserves ([`MAX_RESERVATIONS`], EASY backfill's one reservation:
    /// more, replayed on the Philly trace, held so much of the cluster idle that every job
    /// waited longer); a job whose inter-pod constraints bear on its placement reserves nothing
    /// (freed capacity would not change where it may go).
    /// Takes precedence over `best_effort` and `lanes`.
    #[serde(default)]
    pub reserve: bool,
}

/// Jobs that reserve nodes in one pass of the `reserve` queueing (see
/// [`SchedulerConfig::reserve`]).
pub const MAX_RESERVATIONS: usize = 1;

fn default_policy() -> PolicyKind {
    PolicyKind::Xpu
}

fn default_depth() -> usize {
    500
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            queue: QueuePolicy::Fifo,
            policy: PolicyKind::Xpu,
            preemption: false,
            aging_per_hour: 0.0,
            queue_weights: BTreeMap::new(),
            backfill_depth: default_depth(),
            pools: Vec::new(),
            seed: 0,
            lanes: false,
            fit_per_task: false,
            best_effort: false,
            reserve: false,
        }
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    Queued,
    /// Waiting for flex-start capacity it has been promised.
    Provisioning,
    Running,
    Finished,
    /// Can never fit this cluster.
    Failed,
    Cancelled,
    /// Stopped at its maximum run duration.
    Stopped,
}

impl JobStatus {
    pub fn is_done(self) -> bool {
        matches!(self, Self::Finished | Self::Failed | Self::Cancelled | Self::Stopped)
    }
}

/// A task of a job: group index and index within the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskRef {
    pub group: u32,
    pub index: u32,
}

/// A task and where it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskStart {
    pub task: TaskRef,
    pub placement: Placement,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The job's or its flex-start pool's maximum run duration passed.
    MaxRunDuration,
}

/// What the caller must do after [`Scheduler::schedule`], in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum Decision {
    /// Start these tasks (for a gang, all of its tasks).
    Start { job: JobId, tasks: Vec<TaskStart> },
    /// Stop this job's tasks; it went back to the queue to make room for `by`.
    Preempt { job: JobId, by: JobId, tasks: Vec<TaskStart> },
    /// Stop this job for good.
    Stop { job: JobId, reason: StopReason, tasks: Vec<TaskStart> },
    /// The job can never run on this cluster.
    Fail { job: JobId, error: Unschedulable },
    /// Bring up these flex-start nodes for the job; they are ready at `ready_at`.
    Provision { job: JobId, pool: String, nodes: Vec<NodeId>, ready_at: Time },
    /// Give this idle flex-start node back.
    Release { pool: String, node: NodeId },
}

/// What went wrong calling the scheduler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("job {0} does not exist")]
    NoSuchJob(JobId),
    #[error("job {job} is {status:?}, so it cannot be {action}")]
    WrongState { job: JobId, status: JobStatus, action: &'static str },
    #[error("job {job} has no task {task:?}")]
    NoSuchTask { job: JobId, task: TaskRef },
    #[error("job {job} task {task:?} cannot be adopted: {reason}")]
    Adopt { job: JobId, task: TaskRef, reason: String },
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// A read-only view of one job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobView<'a> {
    pub id: JobId,
    pub job: &'a Job,
    pub status: JobStatus,
    pub submitted: Time,
    /// When the current (or last) run started.
    pub started: Option<Time>,
    /// When it first started (before any preemption).
    pub first_started: Option<Time>,
    pub finished: Option<Time>,
    pub restarts: u32,
    pub tasks: Vec<TaskStart>,
}

/// `f64` with a total order, for queue keys.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key(f64);
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Key {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

type QKey = (Key, u64, JobId);

#[derive(Debug, Clone)]
struct TaskSlot {
    task: TaskRef,
    group: usize,
    placement: Option<Placement>,
    done: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    job: Job,
    groups: Vec<ExpandedGroup>,
    tasks: Vec<TaskSlot>,
    status: JobStatus,
    submitted: Time,
    seq: u64,
    queue: usize,
    key: Option<QKey>,
    started: Option<Time>,
    first_started: Option<Time>,
    finished: Option<Time>,
    deadline: Option<Time>,
    restarts: u32,
    never_fits: Option<Unschedulable>,
    /// What the unplaced tasks ask for in all (see [`may_fit`]).
    need: [u64; 7],
    /// Flex-start nodes held for it while they come up, and when they were asked for.
    reserved: Vec<NodeId>,
    provision_asked: Option<Time>,
    /// Device kinds its tasks ask for (bit per kind index), or [`CPU_LANE`] for none: the
    /// lane it waits in when [`SchedulerConfig::lanes`] is on.
    lane: u8,
}

/// Invariants found broken: a cluster mutation that cannot fail did (releasing what a
/// placement holds, undoing a trial, setting a known node's status). Debug builds stop there;
/// release builds count them, keep the last, and go on: the caller reports them
/// ([`Scheduler::broken_invariants`]).
#[derive(Debug, Default)]
struct Invariants {
    broken: u64,
    last: Option<String>,
}

impl Invariants {
    /// Whether `r` is `Ok`; an `Err` is recorded as a broken invariant while doing `what`.
    fn check<E: std::fmt::Display>(&mut self, r: Result<(), E>, what: &str) -> bool {
        match r {
            Ok(()) => true,
            Err(e) => {
                debug_assert!(false, "broken invariant while {what}: {e}");
                self.broken += 1;
                self.last = Some(format!("{what}: {e}"));
                false
            }
        }
    }
}

/// The jobs a scheduler knows, by id. Ids count up from 0 and are never reused; a job
/// [`Scheduler::forget`] dropped is gone, so memory follows the jobs not yet forgotten.
#[derive(Default)]
struct Jobs {
    live: crate::hash::FxHashMap<JobId, Entry>,
    next: JobId,
}

impl Jobs {
    fn get(&self, id: usize) -> Option<&Entry> {
        self.live.get(&JobId::try_from(id).ok()?)
    }

    /// Ids handed out so far (forgotten ones included).
    fn len(&self) -> usize {
        self.next as usize
    }

    fn push(&mut self, e: Entry) {
        self.live.insert(self.next, e);
        self.next += 1;
    }

    /// The live jobs, in no particular order.
    fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.live.values()
    }

    fn remove(&mut self, id: JobId) -> Option<Entry> {
        let e = self.live.remove(&id);
        // Keep the table sized to the live jobs after a burst has ended.
        if self.live.capacity() > 64 && self.live.len() < self.live.capacity() / 4 {
            self.live.shrink_to(self.live.len() * 2);
        }
        e
    }
}

/// Indexing is for ids known to be live (a caller checked with `get` first): a missing one is
/// a bug in this module, as an out-of-range index was when jobs were a `Vec`.
impl std::ops::Index<usize> for Jobs {
    type Output = Entry;
    fn index(&self, id: usize) -> &Entry {
        #[allow(clippy::expect_used)]
        self.get(id).expect("a live job id")
    }
}

impl std::ops::IndexMut<usize> for Jobs {
    fn index_mut(&mut self, id: usize) -> &mut Entry {
        #[allow(clippy::expect_used)]
        JobId::try_from(id).ok().and_then(|id| self.live.get_mut(&id)).expect("a live job id")
    }
}

/// The lane of jobs that ask for no device.
const CPU_LANE: u8 = 1 << 5;

fn lane_of(groups: &[ExpandedGroup]) -> u8 {
    let mut m = 0u8;
    for g in groups.iter().filter(|g| g.demand.count > 0) {
        m |= 1 << crate::cluster::kind_index(g.demand.kind);
    }
    if m == 0 { CPU_LANE } else { m }
}

impl Entry {
    fn token(id: JobId) -> u32 {
        id + 1
    }
    fn running_tasks(&self) -> impl Iterator<Item = &TaskSlot> {
        self.tasks.iter().filter(|t| t.placement.is_some() && !t.done)
    }
    fn has_unplaced(&self) -> bool {
        self.tasks.iter().any(|t| t.placement.is_none() && !t.done)
    }
    fn usage(&self) -> [u64; 3] {
        let mut u = [0u64; 3];
        for t in self.running_tasks() {
            if let Some(p) = &t.placement {
                u[0] += p.cpu_milli;
                u[1] += p.memory_mib;
                u[2] += p.device_milli();
            }
        }
        u
    }
}

/// The scheduler. See the crate docs for a walk-through.
pub struct Scheduler {
    cluster: Cluster,
    placer: Placer,
    /// Plans on copies of the cluster (never-fits checks, backfill shadows, preemption) with
    /// best fit, so the real placer's score memo stays with the real cluster.
    planner: Placer,
    config: SchedulerConfig,
    jobs: Jobs,
    invariants: Invariants,
    queue: BTreeSet<QKey>,
    by_queue: Vec<BTreeSet<QKey>>,
    /// Per queue, per lane: the queued jobs (kept only with [`SchedulerConfig::lanes`]).
    by_lane: Vec<BTreeMap<u8, BTreeSet<QKey>>>,
    queue_names: Vec<String>,
    queue_usage: Vec<[u64; 3]>,
    running: BTreeSet<JobId>,
    /// Jobs waiting for flex-start nodes.
    provisioning: BTreeSet<JobId>,
    /// Queued jobs that can never fit (failed by the next pass).
    doomed: BTreeSet<JobId>,
    deadlines: BTreeSet<(Time, JobId)>,
    pools: Vec<PoolState>,
    /// Node id to (pool, slot) for flex-start nodes.
    flex_slot: Vec<Option<(usize, usize)>>,
    /// Empty copy of the cluster (flex slots up) to tell "not now" from "never".
    empty: Option<Cluster>,
    seq: u64,
    now: Time,
    /// Head job and shadow time of the last backfill reservation.
    reservation: Option<(JobId, Time)>,
    /// Pods placed (bound before, and tasks placed since) for inter-pod constraints.
    pods: PodIndex,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("nodes", &self.cluster.len())
            .field("jobs", &self.jobs.len())
            .field("queued", &self.queue.len())
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// A scheduler over `cluster` with the configured policy (FGD and xpu start with an empty
    /// task mix and learn it from submitted jobs; see [`Scheduler::set_task_mix`]).
    pub fn new(cluster: Cluster, config: SchedulerConfig) -> Result<Self, SchedError> {
        let policy = config.policy.build(&TaskMix::default());
        Self::with_policy(cluster, config, policy)
    }

    /// A scheduler with a policy of the caller's own.
    pub fn with_policy(
        mut cluster: Cluster,
        config: SchedulerConfig,
        policy: Box<dyn Policy>,
    ) -> Result<Self, SchedError> {
        let mut flex_slot = vec![None; cluster.len()];
        let mut pools = Vec::new();
        for (pi, pool) in config.pools.iter().enumerate() {
            let mut st = PoolState::default();
            for i in 0..pool.max_nodes {
                let id = cluster.add_node_with_status(pool.slot(i), NodeStatus::Off)?;
                flex_slot.push(Some((pi, st.slots.len())));
                st.slots.push(SlotState { node: id, ..SlotState::default() });
            }
            pools.push(st);
        }
        let mut placer = Placer::new(policy, config.seed);
        placer.set_explain(false);
        let mut planner = Placer::new(Box::new(crate::policy::BestFit), config.seed);
        planner.set_explain(false);
        Ok(Self {
            cluster,
            placer,
            planner,
            config,
            jobs: Jobs::default(),
            invariants: Invariants::default(),
            queue: BTreeSet::new(),
            by_queue: Vec::new(),
            by_lane: Vec::new(),
            queue_names: Vec::new(),
            queue_usage: Vec::new(),
            running: BTreeSet::new(),
            provisioning: BTreeSet::new(),
            doomed: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            pools,
            flex_slot,
            empty: None,
            seq: 0,
            now: 0,
            reservation: None,
            pods: PodIndex::new(),
        })
    }

    /// Gives the scheduler the empty copy of its cluster that never-fits checks and
    /// reservations place on (every node as its cluster has it, Ready, every device free),
    /// kept by a caller from an earlier scheduler's [`Scheduler::into_parts`] instead of
    /// building it anew. Ignored unless it has exactly the cluster's nodes, by name.
    pub fn set_empty(&mut self, empty: Cluster) {
        let same = empty.len() == self.cluster.len()
            && empty.nodes().iter().zip(self.cluster.nodes()).all(|(a, b)| a.name == b.name);
        if same {
            self.empty = Some(empty);
        }
    }

    /// The cluster, with what this scheduler's jobs hold still held, and the empty copy if
    /// one was built: for a caller that keeps them for the next scheduler (see
    /// [`Cluster::track_touched`] for learning what changed).
    pub fn into_parts(self) -> (Cluster, Option<Cluster>) {
        (self.cluster, self.empty)
    }

    /// Records a pod already on node `node` (bound before this scheduler's run) for the
    /// inter-pod constraints of the tasks placed after it.
    pub fn place_pod(&mut self, node: NodeId, terms: Arc<PodTerms>) {
        self.pods.add(node, terms);
    }

    /// Starts from `index` as the pods already placed (a caller's copy of an index it keeps
    /// across schedulers; its node ids must be this cluster's), instead of pod by pod.
    pub fn set_pods(&mut self, index: PodIndex) {
        self.pods = index;
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Replaces the placement policy's task mix (FGD and xpu measure fragmentation against it).
    pub fn set_task_mix(&mut self, mix: &TaskMix) {
        let policy = self.config.policy.build(mix);
        let seed = self.config.seed;
        self.placer = Placer::new(policy, seed);
        self.placer.set_explain(false);
    }

    /// The compact demand of a task spec, interned in this scheduler's cluster (for building a
    /// [`TaskMix`] from a workload).
    pub fn demand(&mut self, spec: &crate::request::TaskSpec) -> Result<Demand, RequestError> {
        spec.demand(&mut self.cluster)
    }

    /// Counts work that runs outside this scheduler's books (pods another cycle or another
    /// scheduler placed) on `queue`'s fair-share account, so the fair queue orders queues by
    /// all they hold, not only by what this scheduler started. Sums saturate.
    pub fn charge_queue(
        &mut self,
        queue: &str,
        cpu_milli: u64,
        memory_mib: u64,
        device_milli: u64,
    ) {
        let q = self.queue_index(queue);
        let u = &mut self.queue_usage[q];
        u[0] = u[0].saturating_add(cpu_milli);
        u[1] = u[1].saturating_add(memory_mib);
        u[2] = u[2].saturating_add(device_milli);
    }

    /// The index of queue `name` (`default` when empty), registered on first use.
    fn queue_index(&mut self, name: &str) -> usize {
        let qname = if name.is_empty() { "default" } else { name };
        match self.queue_names.iter().position(|q| q == qname) {
            Some(q) => q,
            None => {
                self.queue_names.push(qname.to_owned());
                self.by_queue.push(BTreeSet::new());
                self.by_lane.push(BTreeMap::new());
                self.queue_usage.push([0; 3]);
                self.queue_names.len() - 1
            }
        }
    }

    /// Adds a node (a host that joined). Its name must be new.
    pub fn add_node(&mut self, spec: NodeSpec) -> Result<NodeId, SchedError> {
        let id = self.cluster.add_node(spec)?;
        self.flex_slot.push(None);
        self.empty = None;
        Ok(id)
    }

    /// Marks a node ready or cordoned (running work is not touched).
    pub fn set_node_status(&mut self, node: NodeId, status: NodeStatus) -> Result<(), SchedError> {
        Ok(self.cluster.set_status(node, status)?)
    }

    /// The job and what it holds.
    pub fn job(&self, id: JobId) -> Option<JobView<'_>> {
        let e = self.jobs.get(id as usize)?;
        Some(JobView {
            id,
            job: &e.job,
            status: e.status,
            submitted: e.submitted,
            started: e.started,
            first_started: e.first_started,
            finished: e.finished,
            restarts: e.restarts,
            tasks: e
                .running_tasks()
                .filter_map(|t| {
                    t.placement.clone().map(|p| TaskStart { task: t.task, placement: p })
                })
                .collect(),
        })
    }

    /// Jobs submitted so far, forgotten ones included.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// How many invariants were found broken (0 unless there is a bug), and the last one.
    /// A daemon should report a rise: placements may no longer add up.
    pub fn broken_invariants(&self) -> (u64, Option<&str>) {
        (self.invariants.broken, self.invariants.last.as_deref())
    }

    /// Jobs held in memory: submitted and not forgotten.
    pub fn live_jobs(&self) -> usize {
        self.jobs.live.len()
    }

    /// Drops an ended job (finished, failed, cancelled or stopped). Its id is never reused;
    /// calls naming it afterwards answer [`SchedError::NoSuchJob`]. A long-running caller
    /// forgets each job once it has acted on its end, so memory is bounded by the live jobs.
    pub fn forget(&mut self, id: JobId) -> Result<(), SchedError> {
        let e = self.jobs.get(id as usize).ok_or(SchedError::NoSuchJob(id))?;
        if !e.status.is_done() {
            return Err(SchedError::WrongState { job: id, status: e.status, action: "forgotten" });
        }
        if let Some(d) = e.deadline {
            self.deadlines.remove(&(d, id));
        }
        self.doomed.remove(&id);
        self.provisioning.remove(&id);
        self.running.remove(&id);
        if self.reservation.is_some_and(|(j, _)| j == id) {
            self.reservation = None;
        }
        self.jobs.remove(id);
        Ok(())
    }

    /// Queued jobs in queue order.
    pub fn queued(&self) -> impl Iterator<Item = JobId> + '_ {
        self.queue.iter().map(|k| k.2)
    }

    pub fn running(&self) -> impl Iterator<Item = JobId> + '_ {
        self.running.iter().copied()
    }

    /// The head job of the last backfill reservation and the time it is reserved for.
    pub fn reservation(&self) -> Option<(JobId, Time)> {
        self.reservation
    }

    /// Adds a job to the queue. Fails (changing nothing) if the request is invalid; a valid
    /// job that can never fit this cluster is failed by the next [`Scheduler::schedule`].
    pub fn submit(&mut self, job: Job, now: Time) -> Result<JobId, SchedError> {
        let groups = expand(&job, &mut self.cluster)?;
        let id = self.jobs.len() as JobId;
        let mut tasks = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            for i in 0..g.count {
                tasks.push(TaskSlot {
                    task: TaskRef { group: gi as u32, index: i },
                    group: gi,
                    placement: None,
                    done: false,
                });
            }
        }
        let queue = self.queue_index(&job.queue);
        self.seq += 1;
        let mut e = Entry {
            job,
            groups,
            tasks,
            status: JobStatus::Queued,
            submitted: now,
            seq: self.seq,
            queue,
            key: None,
            started: None,
            first_started: None,
            finished: None,
            deadline: None,
            restarts: 0,
            never_fits: None,
            need: [0; 7],
            reserved: Vec::new(),
            provision_asked: None,
            lane: 0,
        };
        e.lane = lane_of(&e.groups);
        e.need = unplaced_need(&e.groups, &e.tasks, self.config.fit_per_task);
        e.never_fits = self.never_fits(id, &e);
        if e.never_fits.is_some() {
            self.doomed.insert(id);
        }
        self.jobs.push(e);
        self.enqueue(id);
        Ok(id)
    }

    /// The job's groups with their demands interned in the empty copy of the cluster (built
    /// on first use: every node up, every device free).
    fn groups_on_empty(&mut self, e: &Entry) -> Option<Vec<ExpandedGroup>> {
        if self.empty.is_none() {
            let mut empty = Cluster::new();
            for id in 0..self.cluster.len() as NodeId {
                // Same node set, so selector and model ids line up by re-interning below.
                let spec = self.cluster.empty_spec(id)?;
                if empty.add_node(spec).is_err() {
                    return None;
                }
            }
            self.empty = Some(empty);
        }
        let empty = self.empty.as_mut()?;
        // Demands carry ids interned in the live cluster; re-intern against the copy.
        let mut groups = Vec::new();
        for (gi, g) in e.groups.iter().enumerate() {
            let spec = if let Some(t) = &e.job.groups[gi].tpu {
                let mut j = e.job.clone();
                j.groups = vec![crate::request::TaskGroup::tpu(
                    &t.accelerator,
                    &t.topology,
                    e.job.groups[gi].task.clone(),
                )];
                expand(&j, empty).ok()?.pop()?
            } else {
                let mut eg = g.clone();
                eg.demand = e.job.groups[gi].task.demand(empty).ok()?;
                eg
            };
            groups.push(spec);
        }
        Some(groups)
    }

    /// The nodes job `id` would take once they free up (see [`SchedulerConfig::reserve`]),
    /// never those in `held`; `None` when it reserves nothing.
    fn nodes_to_reserve(&mut self, id: JobId, held: Option<&[bool]>) -> Option<Vec<NodeId>> {
        let e = self.jobs.get(id as usize)?.clone();
        if e.groups.iter().any(|g| g.pod.as_ref().is_some_and(|t| self.pods.constrains(t))) {
            return None;
        }
        let groups = self.groups_on_empty(&e)?;
        let veto: Vec<Option<crate::placement::Reason>> = self
            .cluster
            .nodes()
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let h = held.and_then(|h| h.get(i).copied()).unwrap_or(false);
                (h || n.status() != NodeStatus::Ready)
                    .then_some(crate::placement::Reason::ReservedForHead)
            })
            .collect();
        // The nodes with the most free now are the likeliest to free up first.
        let pref: Vec<i64> = self
            .cluster
            .nodes()
            .iter()
            .map(|n| n.devices.iter().map(|d| i64::from(d.free_milli())).sum())
            .collect();
        let mask = crate::pods::PodMask { veto, pref };
        let empty = self.empty.as_mut()?;
        let ctx = PlaceCtx { token: Entry::token(id), pods: Some(&mask), ..PlaceCtx::default() };
        let placed = place_tasks(
            &mut self.invariants,
            &mut self.planner,
            empty,
            &groups,
            &e.tasks,
            &ctx,
            true,
            None,
        )
        .ok()?;
        self.invariants
            .check(empty.undo(placed.iter().map(|(_, p)| p)), "undoing a reservation trial");
        Some(placed.into_iter().map(|(_, p)| p.node).collect())
    }

    /// Places the job on an empty copy of the cluster (flex slots up): an error there means it
    /// can never run.
    fn never_fits(&mut self, id: JobId, e: &Entry) -> Option<Unschedulable> {
        let groups = self.groups_on_empty(e)?;
        let empty = self.empty.as_mut()?;
        let ctx = PlaceCtx { token: Entry::token(id), any_status: true, ..PlaceCtx::default() };
        // The whole job at once; with `fit_per_task`, each group on its own, a gang whole and
        // any other group as one task.
        let trials: Vec<Vec<TaskSlot>> = if self.config.fit_per_task {
            groups
                .iter()
                .enumerate()
                .map(|(gi, g)| {
                    let n = if g.gang || g.colocate { usize::MAX } else { 1 };
                    e.tasks.iter().filter(|t| t.group == gi).take(n).cloned().collect()
                })
                .collect()
        } else {
            vec![e.tasks.clone()]
        };
        self.planner.set_explain(true);
        let mut result = None;
        for tasks in &trials {
            match place_tasks(
                &mut self.invariants,
                &mut self.planner,
                empty,
                &groups,
                tasks,
                &ctx,
                true,
                None,
            ) {
                Ok(ps) => {
                    self.invariants
                        .check(empty.undo(ps.iter().map(|(_, p)| p)), "undoing a never-fits trial");
                }
                Err(u) => {
                    result = Some(u);
                    break;
                }
            }
        }
        self.planner.set_explain(false);
        result
    }

    fn key_for(&self, id: JobId) -> QKey {
        let e = &self.jobs[id as usize];
        let aging = self.config.aging_per_hour / 3600.0;
        let k = match self.config.queue {
            QueuePolicy::Fifo => 0.0,
            QueuePolicy::Sjf => e.job.duration_hint.map_or(f64::INFINITY, |d| d as f64),
            // Effective priority p + a·(now - s) orders like p - a·s at every instant, so the
            // key never needs recomputing.
            QueuePolicy::Priority | QueuePolicy::Backfill | QueuePolicy::Fair => {
                aging * e.submitted as f64 - f64::from(e.job.priority)
            }
        };
        (Key(k), e.seq, id)
    }

    fn enqueue(&mut self, id: JobId) {
        let key = self.key_for(id);
        let e = &mut self.jobs[id as usize];
        e.key = Some(key);
        self.queue.insert(key);
        self.by_queue[e.queue].insert(key);
        if self.config.lanes {
            self.by_lane[e.queue].entry(e.lane).or_default().insert(key);
        }
    }

    fn dequeue(&mut self, id: JobId) {
        let e = &mut self.jobs[id as usize];
        if let Some(k) = e.key.take() {
            self.queue.remove(&k);
            self.by_queue[e.queue].remove(&k);
            if let Some(set) = self.by_lane.get_mut(e.queue).and_then(|l| l.get_mut(&e.lane)) {
                set.remove(&k);
            }
        }
    }

    /// Ends every task of a running job (it finished).
    pub fn finish(&mut self, id: JobId, now: Time) -> Result<(), SchedError> {
        let e = self.jobs.get(id as usize).ok_or(SchedError::NoSuchJob(id))?;
        if e.status != JobStatus::Running {
            return Err(SchedError::WrongState { job: id, status: e.status, action: "finished" });
        }
        self.advance(now);
        self.release_all(id, now);
        self.dequeue(id);
        let e = &mut self.jobs[id as usize];
        for t in &mut e.tasks {
            t.done = true;
        }
        e.status = JobStatus::Finished;
        e.finished = Some(now);
        Ok(())
    }

    /// Ends one task; the job finishes when its last task does.
    pub fn finish_task(&mut self, id: JobId, task: TaskRef, now: Time) -> Result<(), SchedError> {
        let e = self.jobs.get(id as usize).ok_or(SchedError::NoSuchJob(id))?;
        if e.status != JobStatus::Running {
            return Err(SchedError::WrongState { job: id, status: e.status, action: "finished" });
        }
        let Some(ti) =
            e.tasks.iter().position(|t| t.task == task && t.placement.is_some() && !t.done)
        else {
            return Err(SchedError::NoSuchTask { job: id, task });
        };
        self.advance(now);
        if let Some(p) = self.jobs[id as usize].tasks[ti].placement.clone() {
            self.release_placement(id, ti, &p, now);
        }
        let e = &mut self.jobs[id as usize];
        e.tasks[ti].done = true;
        if e.tasks.iter().all(|t| t.done) {
            e.status = JobStatus::Finished;
            e.finished = Some(now);
            if let Some(d) = e.deadline.take() {
                self.deadlines.remove(&(d, id));
            }
            self.running.remove(&id);
        }
        Ok(())
    }

    /// Withdraws a job wherever it is; running tasks are released.
    pub fn cancel(&mut self, id: JobId, now: Time) -> Result<(), SchedError> {
        let e = self.jobs.get(id as usize).ok_or(SchedError::NoSuchJob(id))?;
        if e.status.is_done() {
            return Err(SchedError::WrongState { job: id, status: e.status, action: "cancelled" });
        }
        self.advance(now);
        self.release_all(id, now);
        self.dequeue(id);
        self.unreserve(id, now);
        self.provisioning.remove(&id);
        self.doomed.remove(&id);
        let e = &mut self.jobs[id as usize];
        e.status = JobStatus::Cancelled;
        e.finished = Some(now);
        Ok(())
    }

    /// Rebuilds a job that was already running before the caller restarted (a daemon that
    /// re-adopts the processes it left running): the job is submitted as with
    /// [`Scheduler::submit`], then each `(task, node, device indices)` of `running` is allocated
    /// exactly as given, without asking the policy, each device taking the share the task's
    /// group asks for. The job runs from `now`; its other tasks queue as usual. On an error (no
    /// such task, a task given twice, devices of the wrong number or kind, or more than is
    /// free) nothing stays allocated and the job is left cancelled.
    pub fn adopt(
        &mut self,
        job: Job,
        running: &[(TaskRef, NodeId, Vec<u16>)],
        now: Time,
    ) -> Result<JobId, SchedError> {
        let id = self.submit(job, now)?;
        let mut placed: Vec<(usize, Placement)> = Vec::with_capacity(running.len());
        let mut failure: Option<SchedError> = None;
        for (task, node, devices) in running {
            match self.adoption(id, *task, *node, devices, &placed) {
                Ok(p) => match self.cluster.allocate(&p.1) {
                    Ok(()) => placed.push(p),
                    Err(e) => {
                        failure =
                            Some(SchedError::Adopt { job: id, task: *task, reason: e.to_string() });
                        break;
                    }
                },
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failure {
            let undone = self.cluster.undo(placed.iter().map(|(_, p)| p));
            self.invariants.check(undone, "undoing an adoption");
            let cancelled = self.cancel(id, now);
            self.invariants.check(cancelled, "cancelling a job whose adoption failed");
            return Err(e);
        }
        if !placed.is_empty() {
            // Adopted tasks bear on the inter-pod constraints of what is placed after them.
            let e = &self.jobs[id as usize];
            for (ti, p) in &placed {
                if let Some(t) = e.tasks.get(*ti).and_then(|t| e.groups.get(t.group)?.pod.as_ref())
                {
                    self.pods.add(p.node, t.clone());
                }
            }
            let mut ignored = Vec::new();
            self.record_start(id, placed, now, &mut ignored);
        }
        Ok(id)
    }

    /// The placement of one adopted task, checked against the job and the node.
    fn adoption(
        &self,
        id: JobId,
        task: TaskRef,
        node: NodeId,
        devices: &[u16],
        placed: &[(usize, Placement)],
    ) -> Result<(usize, Placement), SchedError> {
        let e = &self.jobs[id as usize];
        let bad = |reason: String| SchedError::Adopt { job: id, task, reason };
        let ti = e
            .tasks
            .iter()
            .position(|t| t.task == task)
            .ok_or(SchedError::NoSuchTask { job: id, task })?;
        if placed.iter().any(|(i, _)| *i == ti) {
            return Err(bad("it is given twice".into()));
        }
        let d = e.groups[e.tasks[ti].group].demand;
        if devices.len() != usize::from(d.count) {
            return Err(bad(format!("it asks for {} devices, {} given", d.count, devices.len())));
        }
        let n =
            self.cluster.node(node).ok_or(SchedError::Cluster(ClusterError::NoSuchNode(node)))?;
        for &i in devices {
            if usize::from(i) >= n.devices.len()
                || !crate::placement::device_matches(n, usize::from(i), &d)
            {
                return Err(bad(format!(
                    "device {i} of node {:?} is not a {} it may use",
                    n.name, d.kind
                )));
            }
        }
        let p = Placement {
            node,
            cpu_milli: d.cpu_milli,
            memory_mib: d.memory_mib,
            devices: devices
                .iter()
                .map(|&index| crate::placement::DeviceShare { index, milli: d.milli })
                .collect(),
            tag: crate::cluster::affinity_tag(d.count, d.milli),
        };
        Ok((ti, p))
    }

    /// Gives back what one running task holds and queues that task again, keeping the job's
    /// place in its queue, while the job's other tasks run on: a failed task retried on whatever
    /// fits next (Kubernetes makes a new pod under `restartPolicy: Never`), or the next
    /// completion of a job that runs fewer tasks at once than it has completions. The job stays
    /// running.
    pub fn requeue_task(&mut self, id: JobId, task: TaskRef, now: Time) -> Result<(), SchedError> {
        let ti = self.running_task(id, task, "requeued")?;
        self.advance(now);
        if let Some(p) = self.jobs[id as usize].tasks[ti].placement.take() {
            self.release_placement(id, ti, &p, now);
        }
        let e = &mut self.jobs[id as usize];
        e.need = unplaced_need(&e.groups, &e.tasks, self.config.fit_per_task);
        if e.key.is_none() {
            self.enqueue(id);
        }
        Ok(())
    }

    fn running_task(
        &self,
        id: JobId,
        task: TaskRef,
        action: &'static str,
    ) -> Result<usize, SchedError> {
        let e = self.jobs.get(id as usize).ok_or(SchedError::NoSuchJob(id))?;
        if e.status != JobStatus::Running {
            return Err(SchedError::WrongState { job: id, status: e.status, action });
        }
        e.tasks
            .iter()
            .position(|t| t.task == task && t.placement.is_some() && !t.done)
            .ok_or(SchedError::NoSuchTask { job: id, task })
    }

    /// Stops placing a job: it leaves the queue and its unplaced tasks are dropped, while its
    /// running tasks keep what they hold until each is ended with [`Scheduler::finish_task`]
    /// (the job finishes with the last one). For callers whose tasks take a while to stop (a
    /// grace period between SIGTERM and SIGKILL): nothing else is placed on devices still in
    /// use meanwhile. A job with nothing running is cancelled at once.
    pub fn drain(&mut self, id: JobId, now: Time) -> Result<(), SchedError> {
        let e = self.jobs.get(id as usize).ok_or(SchedError::NoSuchJob(id))?;
        if e.status.is_done() {
            return Err(SchedError::WrongState { job: id, status: e.status, action: "drained" });
        }
        if e.running_tasks().next().is_none() {
            return self.cancel(id, now);
        }
        self.advance(now);
        self.dequeue(id);
        self.unreserve(id, now);
        self.provisioning.remove(&id);
        self.doomed.remove(&id);
        let e = &mut self.jobs[id as usize];
        for t in e.tasks.iter_mut().filter(|t| t.placement.is_none()) {
            t.done = true;
        }
        e.need = unplaced_need(&e.groups, &e.tasks, self.config.fit_per_task);
        Ok(())
    }

    /// Why a queued job's unplaced tasks cannot start on the cluster as it is now, counted per
    /// filter the way kube-scheduler reports it (`0/3 nodes are available: 3 Insufficient
    /// gpu`); `None` when they would fit now (the job waits behind others in its queue) or it
    /// has nothing left to place. Changes nothing.
    pub fn explain(&mut self, id: JobId) -> Option<Unschedulable> {
        let e = self.jobs.get(id as usize)?;
        if e.status.is_done() || !e.has_unplaced() {
            return None;
        }
        if let Some(u) = &e.never_fits {
            return Some(u.clone());
        }
        let ctx = PlaceCtx { token: Entry::token(id), ..PlaceCtx::default() };
        self.planner.set_explain(true);
        let placed = place_tasks(
            &mut self.invariants,
            &mut self.planner,
            &mut self.cluster,
            &e.groups,
            &e.tasks,
            &ctx,
            false,
            Some(&mut self.pods),
        );
        self.planner.set_explain(false);
        match placed {
            Ok(ps) => {
                let e = &self.jobs[id as usize];
                unplace(
                    &mut self.invariants,
                    &mut self.cluster,
                    Some(&mut self.pods),
                    &e.groups,
                    &e.tasks,
                    &ps,
                );
                None
            }
            Err(u) => Some(u),
        }
    }

    /// The next time [`Scheduler::schedule`] has something to do without new input: flex
    /// nodes coming up, idle nodes due for release, jobs reaching their maximum run time.
    pub fn next_wakeup(&self) -> Option<Time> {
        let mut t = self.deadlines.first().map(|&(d, _)| d);
        let mut min = |x: Time| t = Some(t.map_or(x, |y| y.min(x)));
        for (pi, pool) in self.pools.iter().enumerate() {
            let idle = self.config.pools[pi].idle_release;
            for s in &pool.slots {
                let Some(n) = self.cluster.node(s.node) else { continue };
                match n.status() {
                    NodeStatus::Provisioning => {
                        if let Some(r) = s.ready_at {
                            min(r);
                        }
                    }
                    NodeStatus::Ready if n.is_idle() && n.reserved == 0 => {
                        if let Some(i) = s.idle_since {
                            min(i + idle);
                        }
                    }
                    _ => {}
                }
            }
        }
        t
    }

    /// Decides what to start, stop, preempt, provision and release at time `now`.
    pub fn schedule(&mut self, now: Time) -> Vec<Decision> {
        self.advance(now);
        let mut out = Vec::new();
        self.flex_ready(now, &mut out);
        self.stop_expired(now, &mut out);
        let never: Vec<JobId> = std::mem::take(&mut self.doomed).into_iter().collect();
        for id in never {
            if self.jobs[id as usize].status != JobStatus::Queued {
                continue;
            }
            self.dequeue(id);
            let e = &mut self.jobs[id as usize];
            e.status = JobStatus::Failed;
            e.finished = Some(now);
            if let Some(error) = e.never_fits.clone() {
                out.push(Decision::Fail { job: id, error });
            }
        }
        match self.config.queue {
            QueuePolicy::Fifo | QueuePolicy::Priority | QueuePolicy::Sjf => {
                self.pass_ordered(now, &mut out)
            }
            QueuePolicy::Backfill => self.pass_backfill(now, &mut out),
            QueuePolicy::Fair => self.pass_fair(now, &mut out),
        }
        self.release_idle(now, &mut out);
        out
    }

    fn advance(&mut self, now: Time) {
        self.now = self.now.max(now);
    }

    /// Strict order: start jobs until one cannot start (nor get capacity, nor preempt).
    fn pass_ordered(&mut self, now: Time, out: &mut Vec<Decision>) {
        while let Some(&(_, _, id)) = self.queue.first() {
            if !self.start_any_way(id, now, None, out) {
                break;
            }
            if self.jobs[id as usize].has_unplaced() && self.jobs[id as usize].key.is_some() {
                break;
            }
        }
    }

    /// Tries, in turn: placing now, provisioning flex capacity, preempting. True if the job
    /// left the queue or started something.
    fn start_any_way(
        &mut self,
        id: JobId,
        now: Time,
        held: Option<&[bool]>,
        out: &mut Vec<Decision>,
    ) -> bool {
        if self.try_start(id, now, held, out) {
            return true;
        }
        if self.try_provision(id, now, out) {
            return true;
        }
        self.config.preemption && self.try_preempt(id, now, out)
    }

    fn pass_backfill(&mut self, now: Time, out: &mut Vec<Decision>) {
        let ids: Vec<JobId> =
            self.queue.iter().take(self.config.backfill_depth).map(|k| k.2).collect();
        let mut reservation: Option<(Time, Vec<bool>)> = None;
        for id in ids {
            if self.jobs[id as usize].key.is_none() {
                continue;
            }
            match &reservation {
                None => {
                    if self.start_any_way(id, now, None, out) {
                        continue;
                    }
                    match self.shadow(id, now) {
                        Some((t, mask)) => {
                            self.reservation = Some((id, t));
                            reservation = Some((t, mask));
                        }
                        // No running job has a known end: nothing can be promised, so nothing
                        // may jump the queue.
                        None => break,
                    }
                }
                Some((shadow, mask)) => {
                    let end =
                        self.jobs[id as usize].job.duration_hint.map(|d| now.saturating_add(d));
                    let exclude =
                        if end.is_some_and(|e| e <= *shadow) { None } else { Some(&mask[..]) };
                    self.try_start(id, now, exclude, out);
                }
            }
        }
    }

    /// The earliest time the running jobs' expected ends leave room for `id`, and the nodes it
    /// would take then.
    fn shadow(&mut self, id: JobId, now: Time) -> Option<(Time, Vec<bool>)> {
        let mut ends: Vec<(Time, JobId)> = self
            .running
            .iter()
            .filter_map(|&r| {
                let e = &self.jobs[r as usize];
                let by_hint = e.started.zip(e.job.duration_hint).map(|(s, d)| s.saturating_add(d));
                by_hint.or(e.deadline).map(|t| (t.max(now), r))
            })
            .collect();
        ends.sort_unstable();
        // Plan on the live cluster and undo every change afterwards: release and allocate are
        // exact inverses, and copying a large cluster per pass costs more than the plan.
        let e = &self.jobs[id as usize];
        let ctx = PlaceCtx { token: Entry::token(id), ..PlaceCtx::default() };
        let mut released: Vec<Placement> = Vec::new();
        let mut result = None;
        let mut i = 0;
        while i < ends.len() {
            let t = ends[i].0;
            while i < ends.len() && ends[i].0 == t {
                for task in self.jobs[ends[i].1 as usize].running_tasks() {
                    if let Some(p) = &task.placement
                        && self.cluster.release(p).is_ok()
                    {
                        released.push(p.clone());
                    }
                }
                i += 1;
            }
            if may_fit(&self.cluster, e)
                && let Ok(ps) = place_tasks(
                    &mut self.invariants,
                    &mut self.planner,
                    &mut self.cluster,
                    &e.groups,
                    &e.tasks,
                    &ctx,
                    true,
                    None,
                )
            {
                let mut mask = vec![false; self.cluster.len()];
                for (_, p) in &ps {
                    mask[p.node as usize] = true;
                }
                let undone = self.cluster.undo(ps.iter().map(|(_, p)| p));
                self.invariants.check(undone, "undoing a backfill shadow trial");
                result = Some((t, mask));
                break;
            }
        }
        for p in &released {
            // These placements held exactly these resources a moment ago.
            let again = self.cluster.allocate(p);
            self.invariants.check(again, "restoring after a backfill shadow");
        }
        result
    }

    fn pass_fair(&mut self, now: Time, out: &mut Vec<Decision>) {
        let cap = self.cluster.capacity();
        let caps = [cap.cpu_milli, cap.memory_mib, cap.device_milli.iter().sum::<u64>()];
        // Per queue: lanes held back by a job that could not start (all of them without
        // `lanes`), and whether the queue has nothing left to try.
        let mut blocked = vec![0u8; self.by_queue.len()];
        let mut exhausted = vec![false; self.by_queue.len()];
        // Best effort: per queue, the last job tried that is still queued.
        let mut cursor: Vec<Option<QKey>> = vec![None; self.by_queue.len()];
        // Reserve: nodes held for jobs that could not start, and how many jobs hold some.
        let reserve = self.config.reserve;
        let mut held: Option<Vec<bool>> = None;
        let mut reservations = 0;
        loop {
            let mut best: Option<(f64, usize)> = None;
            for (q, set) in self.by_queue.iter().enumerate() {
                if exhausted[q] || set.is_empty() {
                    continue;
                }
                let w = self
                    .config
                    .queue_weights
                    .get(&self.queue_names[q])
                    .copied()
                    .unwrap_or(1.0)
                    .max(1e-9);
                let share = (0..3)
                    .map(|r| {
                        if caps[r] == 0 {
                            0.0
                        } else {
                            self.queue_usage[q][r] as f64 / caps[r] as f64
                        }
                    })
                    .fold(0.0, f64::max)
                    / w;
                if best.is_none_or(|(b, _)| share < b) {
                    best = Some((share, q));
                }
            }
            let Some((_, q)) = best else { break };
            let head = if self.config.best_effort || reserve {
                let set = &self.by_queue[q];
                match &cursor[q] {
                    None => set.first(),
                    Some(c) => {
                        set.range((std::ops::Bound::Excluded(c), std::ops::Bound::Unbounded)).next()
                    }
                }
                .map(|k| k.2)
            } else if self.config.lanes {
                // The first job of the queue whose lane is not held back.
                self.by_lane[q]
                    .iter()
                    .filter(|(lane, _)| *lane & blocked[q] == 0)
                    .filter_map(|(_, set)| set.first())
                    .min()
                    .map(|k| k.2)
            } else {
                self.by_queue[q].first().map(|k| k.2)
            };
            let Some(id) = head else {
                exhausted[q] = true;
                continue;
            };
            let started = self.start_any_way(id, now, held.as_deref(), out);
            if !started || self.jobs[id as usize].key.is_some() {
                if reserve
                    && !started
                    && reservations < MAX_RESERVATIONS
                    && let Some(nodes) = self.nodes_to_reserve(id, held.as_deref())
                {
                    let h = held.get_or_insert_with(|| vec![false; self.cluster.len()]);
                    for n in nodes {
                        if let Some(x) = h.get_mut(n as usize) {
                            *x = true;
                        }
                    }
                    reservations += 1;
                }
                if self.config.best_effort || reserve {
                    // Still queued (did not start, or started only in part): try the next.
                    if let Some(k) = self.jobs[id as usize].key {
                        cursor[q] = Some(k);
                    }
                } else if self.config.lanes {
                    blocked[q] |= self.jobs[id as usize].lane;
                } else {
                    exhausted[q] = true;
                }
            }
        }
    }

    /// Places what the job still needs (gang groups all at once). True if anything started.
    fn try_start(
        &mut self,
        id: JobId,
        now: Time,
        exclude: Option<&[bool]>,
        out: &mut Vec<Decision>,
    ) -> bool {
        let e = &self.jobs[id as usize];
        if !e.has_unplaced() || !may_fit(&self.cluster, e) {
            return false;
        }
        let ctx = PlaceCtx { token: Entry::token(id), exclude, ..PlaceCtx::default() };
        let placed = match place_tasks(
            &mut self.invariants,
            &mut self.placer,
            &mut self.cluster,
            &e.groups,
            &e.tasks,
            &ctx,
            false,
            Some(&mut self.pods),
        ) {
            Ok(ps) => ps,
            Err(_) => return false,
        };
        self.record_start(id, placed, now, out);
        true
    }

    fn record_start(
        &mut self,
        id: JobId,
        placed: Vec<(usize, Placement)>,
        now: Time,
        out: &mut Vec<Decision>,
    ) {
        let mut starts = Vec::with_capacity(placed.len());
        let mut on_flex: Option<usize> = None;
        for (ti, p) in placed {
            if let Some(Some((pi, si))) = self.flex_slot.get(p.node as usize).copied() {
                on_flex = Some(pi);
                let s = &mut self.pools[pi].slots[si];
                if s.busy_since.is_none() {
                    s.busy_since = Some(now);
                }
                s.idle_since = None;
            }
            let e = &mut self.jobs[id as usize];
            starts.push(TaskStart { task: e.tasks[ti].task, placement: p.clone() });
            let u = &mut self.queue_usage[e.queue];
            u[0] = u[0].saturating_add(p.cpu_milli);
            u[1] = u[1].saturating_add(p.memory_mib);
            u[2] = u[2].saturating_add(p.device_milli());
            e.tasks[ti].placement = Some(p);
        }
        let e = &mut self.jobs[id as usize];
        if e.status != JobStatus::Running {
            e.status = JobStatus::Running;
            e.started = Some(now);
            e.first_started.get_or_insert(now);
            let mut limit = e.job.max_run_duration;
            if let Some(pi) = on_flex {
                let m = self.config.pools[pi].max_run_duration;
                limit = Some(limit.map_or(m, |l| l.min(m)));
            }
            if let Some(l) = limit {
                let d = now.saturating_add(l);
                e.deadline = Some(d);
                self.deadlines.insert((d, id));
            }
            self.running.insert(id);
        }
        let e = &mut self.jobs[id as usize];
        e.need = unplaced_need(&e.groups, &e.tasks, self.config.fit_per_task);
        if !self.jobs[id as usize].has_unplaced() {
            self.dequeue(id);
        }
        self.unreserve(id, now);
        out.push(Decision::Start { job: id, tasks: starts });
    }

    fn release_placement(&mut self, id: JobId, ti: usize, p: &Placement, now: Time) {
        let released = self.cluster.release(p);
        self.invariants.check(released, "releasing a task's placement");
        let e = &self.jobs[id as usize];
        if let Some(t) = e.tasks.get(ti).and_then(|t| e.groups.get(t.group)?.pod.as_ref()) {
            self.pods.remove(p.node, t);
        }
        let q = self.jobs[id as usize].queue;
        let u = &mut self.queue_usage[q];
        u[0] = u[0].saturating_sub(p.cpu_milli);
        u[1] = u[1].saturating_sub(p.memory_mib);
        u[2] = u[2].saturating_sub(p.device_milli());
        if let Some(Some((pi, si))) = self.flex_slot.get(p.node as usize).copied()
            && self.cluster.node(p.node).is_some_and(|n| n.is_idle())
        {
            let pool = &mut self.pools[pi];
            if let Some(b) = pool.slots[si].busy_since.take() {
                pool.busy_seconds += now.saturating_sub(b);
            }
            pool.slots[si].idle_since = Some(now);
        }
    }

    /// Releases every running task of a job and takes it off the running set.
    fn release_all(&mut self, id: JobId, now: Time) -> Vec<TaskStart> {
        let held: Vec<(usize, Placement)> = self.jobs[id as usize]
            .tasks
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.done)
            .filter_map(|(i, t)| t.placement.clone().map(|p| (i, p)))
            .collect();
        let mut released = Vec::with_capacity(held.len());
        for (ti, p) in held {
            self.release_placement(id, ti, &p, now);
            let e = &mut self.jobs[id as usize];
            released.push(TaskStart { task: e.tasks[ti].task, placement: p });
            e.tasks[ti].placement = None;
        }
        self.running.remove(&id);
        let e = &mut self.jobs[id as usize];
        e.need = unplaced_need(&e.groups, &e.tasks, self.config.fit_per_task);
        if let Some(d) = e.deadline.take() {
            self.deadlines.remove(&(d, id));
        }
        released
    }

    fn stop_expired(&mut self, now: Time, out: &mut Vec<Decision>) {
        while let Some(&(d, id)) = self.deadlines.first() {
            if d > now {
                break;
            }
            let on_flex = self.jobs[id as usize]
                .running_tasks()
                .find_map(|t| t.placement.as_ref().and_then(|p| self.flex_slot[p.node as usize]));
            let tasks = self.release_all(id, d);
            self.dequeue(id);
            if let Some((pi, _)) = on_flex {
                self.pools[pi].stopped += 1;
            }
            let e = &mut self.jobs[id as usize];
            e.status = JobStatus::Stopped;
            e.finished = Some(d);
            out.push(Decision::Stop { job: id, reason: StopReason::MaxRunDuration, tasks });
        }
    }

    /// Asks a flex-start pool for the capacity this job needs, if one can hold all of it.
    fn try_provision(&mut self, id: JobId, now: Time, out: &mut Vec<Decision>) -> bool {
        if self.pools.is_empty() || self.jobs[id as usize].status != JobStatus::Queued {
            return false;
        }
        for pi in 0..self.pools.len() {
            let mut mask = vec![true; self.cluster.len()];
            let mut any_off = false;
            for s in &self.pools[pi].slots {
                if let Some(n) = self.cluster.node(s.node)
                    && n.reserved == 0
                    && matches!(n.status(), NodeStatus::Off | NodeStatus::Ready)
                {
                    mask[s.node as usize] = false;
                    any_off |= n.status() == NodeStatus::Off;
                }
            }
            if !any_off {
                continue;
            }
            let e = &self.jobs[id as usize];
            let ctx = PlaceCtx {
                token: Entry::token(id),
                exclude: Some(&mask),
                any_status: true,
                ..PlaceCtx::default()
            };
            let Ok(ps) = place_tasks(
                &mut self.invariants,
                &mut self.placer,
                &mut self.cluster,
                &e.groups,
                &e.tasks,
                &ctx,
                true,
                None,
            ) else {
                continue;
            };
            let mut nodes: Vec<NodeId> = ps.iter().map(|(_, p)| p.node).collect();
            let undone = self.cluster.undo(ps.iter().map(|(_, p)| p));
            self.invariants.check(undone, "undoing a flex-start trial");
            nodes.sort_unstable();
            nodes.dedup();
            let delay = self.config.pools[pi].provisioning_delay;
            let ready_at = now.saturating_add(delay);
            let mut new_nodes = Vec::new();
            for &n in &nodes {
                if self.cluster.node(n).is_some_and(|x| x.status() == NodeStatus::Off) {
                    let set = self.cluster.set_status(n, NodeStatus::Provisioning);
                    self.invariants.check(set, "marking a flex node provisioning");
                    if let Some(Some((p, si))) = self.flex_slot.get(n as usize).copied() {
                        self.pools[p].slots[si].ready_at = Some(ready_at);
                    }
                    new_nodes.push(n);
                }
                self.cluster.set_reserved(n, Entry::token(id));
            }
            if new_nodes.is_empty() {
                for &n in &nodes {
                    self.cluster.set_reserved(n, 0);
                }
                continue;
            }
            self.pools[pi].waits.push(delay);
            self.dequeue(id);
            self.provisioning.insert(id);
            let e = &mut self.jobs[id as usize];
            e.status = JobStatus::Provisioning;
            e.reserved = nodes;
            e.provision_asked = Some(now);
            out.push(Decision::Provision {
                job: id,
                pool: self.config.pools[pi].name.clone(),
                nodes: new_nodes,
                ready_at,
            });
            return true;
        }
        false
    }

    /// Brings up flex nodes whose time has come and starts the jobs waiting for them.
    fn flex_ready(&mut self, now: Time, out: &mut Vec<Decision>) {
        for pi in 0..self.pools.len() {
            for si in 0..self.pools[pi].slots.len() {
                let s = &self.pools[pi].slots[si];
                if let Some(r) = s.ready_at
                    && r <= now
                {
                    let node = s.node;
                    let s = &mut self.pools[pi].slots[si];
                    s.ready_at = None;
                    s.up_since = Some(r);
                    s.idle_since = Some(r);
                    let set = self.cluster.set_status(node, NodeStatus::Ready);
                    self.invariants.check(set, "marking a flex node ready");
                }
            }
        }
        let waiting: Vec<JobId> = self.provisioning.iter().copied().collect();
        for id in waiting {
            let ready = self.jobs[id as usize]
                .reserved
                .iter()
                .all(|&n| self.cluster.node(n).is_some_and(|x| x.status() == NodeStatus::Ready));
            if !ready {
                continue;
            }
            let mut mask = vec![true; self.cluster.len()];
            for &n in &self.jobs[id as usize].reserved {
                mask[n as usize] = false;
            }
            self.provisioning.remove(&id);
            self.jobs[id as usize].status = JobStatus::Queued;
            if !self.try_start(id, now, Some(&mask), out) && !self.try_start(id, now, None, out) {
                // Should not happen (the nodes were held); queue it again rather than lose it.
                self.unreserve(id, now);
                self.enqueue(id);
            }
        }
    }

    fn unreserve(&mut self, id: JobId, now: Time) {
        let nodes = std::mem::take(&mut self.jobs[id as usize].reserved);
        for n in nodes {
            self.cluster.set_reserved(n, 0);
            if let Some(Some((pi, si))) = self.flex_slot.get(n as usize).copied()
                && self
                    .cluster
                    .node(n)
                    .is_some_and(|x| x.is_idle() && x.status() == NodeStatus::Ready)
            {
                let s = &mut self.pools[pi].slots[si];
                s.idle_since.get_or_insert(now);
            }
        }
    }

    fn release_idle(&mut self, now: Time, out: &mut Vec<Decision>) {
        for pi in 0..self.pools.len() {
            let idle = self.config.pools[pi].idle_release;
            for si in 0..self.pools[pi].slots.len() {
                let s = &self.pools[pi].slots[si];
                let node = s.node;
                let Some(n) = self.cluster.node(node) else { continue };
                if n.status() != NodeStatus::Ready || !n.is_idle() || n.reserved != 0 {
                    continue;
                }
                let Some(since) = s.idle_since else { continue };
                if since + idle > now {
                    continue;
                }
                let at = since + idle;
                let pool = &mut self.pools[pi];
                if let Some(u) = pool.slots[si].up_since.take() {
                    pool.up_seconds += at.saturating_sub(u);
                }
                pool.slots[si].idle_since = None;
                let set = self.cluster.set_status(node, NodeStatus::Off);
                self.invariants.check(set, "turning a flex node off");
                out.push(Decision::Release { pool: self.config.pools[pi].name.clone(), node });
            }
        }
    }

    /// Cost and waits of each flex-start pool up to `now` (nodes still up count until `now`).
    pub fn pool_reports(&self, now: Time) -> Vec<PoolReport> {
        self.pools
            .iter()
            .enumerate()
            .map(|(pi, p)| {
                let mut up = p.up_seconds;
                let mut busy = p.busy_seconds;
                for s in &p.slots {
                    if let Some(u) = s.up_since {
                        up += now.saturating_sub(u);
                    }
                    if let Some(b) = s.busy_since {
                        busy += now.saturating_sub(b);
                    }
                }
                let n = p.waits.len();
                PoolReport {
                    pool: self.config.pools[pi].name.clone(),
                    node_hours_up: up as f64 / 3600.0,
                    node_hours_used: busy as f64 / 3600.0,
                    node_hours_idle: up.saturating_sub(busy) as f64 / 3600.0,
                    provisionings: n as u32,
                    mean_provisioning_wait: if n == 0 {
                        0.0
                    } else {
                        p.waits.iter().sum::<u64>() as f64 / n as f64
                    },
                    max_provisioning_wait: p.waits.iter().copied().max().unwrap_or(0),
                    stopped_at_max_run: p.stopped,
                }
            })
            .collect()
    }

    /// Evicts lower-priority jobs so `id` can start: lowest priority first, then least work
    /// lost (elapsed run time × resources held), then only those actually needed.
    fn try_preempt(&mut self, id: JobId, now: Time, out: &mut Vec<Decision>) -> bool {
        let prio = self.jobs[id as usize].job.priority;
        let mut cands: Vec<(i32, u128, JobId)> = self
            .running
            .iter()
            .filter(|&&r| self.jobs[r as usize].job.priority < prio)
            .map(|&r| {
                let e = &self.jobs[r as usize];
                let u = e.usage();
                let size = u128::from(u[2]) * 1000 + u128::from(u[0]) + 1;
                let lost = u128::from(now.saturating_sub(e.started.unwrap_or(now)) + 1) * size;
                (e.job.priority, lost, r)
            })
            .collect();
        if cands.is_empty() {
            return false;
        }
        cands.sort_unstable();
        let mut scratch = self.cluster.fork();
        let ctx = PlaceCtx { token: Entry::token(id), ..PlaceCtx::default() };
        let release = |c: &mut Cluster, e: &Entry| {
            c.undo(e.running_tasks().filter_map(|t| t.placement.as_ref()))
        };
        let mut victims: Vec<JobId> = Vec::new();
        let mut fits = false;
        for &(_, _, v) in &cands {
            let released = release(&mut scratch, &self.jobs[v as usize]);
            self.invariants.check(released, "releasing a preemption candidate");
            victims.push(v);
            let e = &self.jobs[id as usize];
            if trial_fits(&mut self.invariants, &mut self.planner, &mut scratch, e, &ctx) {
                fits = true;
                break;
            }
        }
        if !fits {
            return false;
        }
        // Spare every victim the job can do without, most expensive first.
        let mut i = victims.len();
        while i > 0 {
            i -= 1;
            let v = victims[i];
            let ve = &self.jobs[v as usize];
            let mut restored = true;
            for t in ve.running_tasks() {
                if let Some(p) = &t.placement {
                    restored &= scratch.allocate(p).is_ok();
                }
            }
            let e = &self.jobs[id as usize];
            let still = restored
                && trial_fits(&mut self.invariants, &mut self.planner, &mut scratch, e, &ctx);
            if still {
                victims.remove(i);
            } else {
                let released = release(&mut scratch, &self.jobs[v as usize]);
                self.invariants.check(released, "releasing a needed victim again");
            }
        }
        for &v in &victims {
            let tasks = self.release_all(v, now);
            let e = &mut self.jobs[v as usize];
            e.status = JobStatus::Queued;
            e.started = None;
            e.restarts += 1;
            self.enqueue(v);
            out.push(Decision::Preempt { job: v, by: id, tasks });
        }
        self.try_start(id, now, None, out)
    }

    /// Checks the books: every held placement adds up to what nodes have free.
    pub fn audit(&self) -> Result<(), String> {
        let held: Vec<&Placement> = self
            .jobs
            .iter()
            .flat_map(|e| e.running_tasks().filter_map(|t| t.placement.as_ref()))
            .collect();
        self.cluster.audit(held)
    }
}

/// A cheap necessary condition for placing the job's unplaced tasks: the cluster has at least
/// that much CPU, memory and device capacity free in all (it spares the placement attempt for
/// the jobs of a long queue that cannot fit anyway).
fn may_fit(cluster: &Cluster, e: &Entry) -> bool {
    let cap = cluster.capacity();
    let used = cluster.used();
    let need = &e.need;
    need[0] <= cap.cpu_milli - used.cpu_milli
        && need[1] <= cap.memory_mib - used.memory_mib
        && (0..5).all(|k| need[2 + k] <= cap.device_milli[k] - used.device_milli[k])
}

/// CPU, memory and per-kind device milli the job's unplaced tasks ask for.
/// With `per_task`, a group that is not a gang counts one task: what must fit for anything of
/// it to start.
fn unplaced_need(groups: &[ExpandedGroup], tasks: &[TaskSlot], per_task: bool) -> [u64; 7] {
    let mut need = [0u64; 7];
    let mut counted = if per_task { vec![false; groups.len()] } else { Vec::new() };
    for t in tasks.iter().filter(|t| t.placement.is_none() && !t.done) {
        let g = &groups[t.group];
        if per_task && !(g.gang || g.colocate) {
            if counted[t.group] {
                continue;
            }
            counted[t.group] = true;
        }
        let d = &g.demand;
        need[0] += d.cpu_milli;
        need[1] += d.memory_mib;
        need[2 + crate::cluster::kind_index(d.kind)] += d.device_milli();
    }
    need
}

/// Places the unplaced tasks of a job on `cluster` (allocating them): gang and colocated groups
/// all at once, other tasks one by one. With `all`, every task must be placed or nothing is.
/// Rolls back everything on failure.
/// Whether all of `e`'s unplaced tasks fit `cluster` now; the trial is undone either way.
fn trial_fits(
    inv: &mut Invariants,
    placer: &mut Placer,
    cluster: &mut Cluster,
    e: &Entry,
    ctx: &PlaceCtx<'_>,
) -> bool {
    match place_tasks(inv, placer, cluster, &e.groups, &e.tasks, ctx, true, None) {
        Ok(ps) => {
            let undone = cluster.undo(ps.iter().map(|(_, p)| p));
            inv.check(undone, "undoing a what-if trial");
            true
        }
        Err(_) => false,
    }
}

#[allow(clippy::too_many_arguments)]
fn place_tasks(
    inv: &mut Invariants,
    placer: &mut Placer,
    cluster: &mut Cluster,
    groups: &[ExpandedGroup],
    tasks: &[TaskSlot],
    ctx: &PlaceCtx<'_>,
    all: bool,
    mut pods: Option<&mut PodIndex>,
) -> Result<Vec<(usize, Placement)>, Unschedulable> {
    let mut done: Vec<(usize, Placement)> = Vec::new();
    let mut first_err: Option<Unschedulable> = None;
    for (gi, g) in groups.iter().enumerate() {
        let idx: Vec<usize> = tasks
            .iter()
            .enumerate()
            .filter(|(_, t)| t.group == gi && t.placement.is_none() && !t.done)
            .map(|(i, _)| i)
            .collect();
        if idx.is_empty() {
            continue;
        }
        let whole = g.gang || g.colocate || all;
        let terms = g.pod.as_ref();
        if let (Some(t), Some(index)) = (terms, pods.as_deref_mut())
            && index.constrains(t)
        {
            match place_with_pods(inv, placer, cluster, index, g, t, idx.len(), ctx, whole) {
                Ok(ps) => done.extend(idx.into_iter().zip(ps)),
                Err(e) if whole => {
                    unplace(inv, cluster, pods.as_deref_mut(), groups, tasks, &done);
                    return Err(e);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
            continue;
        }
        let before = done.len();
        if whole {
            let demands: Vec<Demand> = vec![g.demand; idx.len()];
            match placer.place_gang(cluster, &demands, g.colocate, ctx) {
                Ok(ps) => done.extend(idx.into_iter().zip(ps)),
                Err(e) => {
                    unplace(inv, cluster, pods.as_deref_mut(), groups, tasks, &done);
                    return Err(e);
                }
            }
        } else {
            for i in idx {
                match placer.place(cluster, &g.demand, ctx) {
                    Ok(p) => {
                        // The placer chose from what is free: a refusal is a broken invariant,
                        // and the task stays unplaced (it waits) rather than being lost.
                        if !inv.check(cluster.allocate(&p), "allocating a placement") {
                            break;
                        }
                        done.push((i, p));
                    }
                    Err(report) => {
                        first_err.get_or_insert(Unschedulable { task: 0, of: 1, report });
                        break;
                    }
                }
            }
        }
        if let (Some(t), Some(index)) = (terms, pods.as_deref_mut()) {
            for (_, p) in &done[before..] {
                index.add(p.node, t.clone());
            }
        }
    }
    if done.is_empty() {
        return Err(first_err.unwrap_or_else(|| Unschedulable {
            task: 0,
            of: 0,
            report: crate::placement::FitReport {
                nodes: cluster.len(),
                kind: xpu_core::DeviceKind::Gpu,
                reasons: vec![],
            },
        }));
    }
    Ok(done)
}

/// Undoes placements `place_tasks` made: in the cluster and in the pod index.
fn unplace(
    inv: &mut Invariants,
    cluster: &mut Cluster,
    pods: Option<&mut PodIndex>,
    groups: &[ExpandedGroup],
    tasks: &[TaskSlot],
    done: &[(usize, Placement)],
) {
    inv.check(cluster.undo(done.iter().map(|(_, p)| p)), "rolling back a gang");
    if let Some(index) = pods {
        for (i, p) in done {
            if let Some(t) = tasks.get(*i).and_then(|t| groups.get(t.group)?.pod.as_ref()) {
                index.remove(p.node, t);
            }
        }
    }
}

/// Domains of a gang's self-affinity key tried, at most, when the first placement fails.
const MAX_DOMAIN_TRIALS: usize = 256;

/// Places `n` tasks of group `g` one at a time, each with the inter-pod constraints as the
/// tasks before it left them. `whole`: all or none. A gang that fails as placed freely is tried
/// in each slice (colocated groups must be in one) or in each domain of the key it must share
/// (a term it matches itself), the first that takes it all winning.
#[allow(clippy::too_many_arguments)]
fn place_with_pods(
    inv: &mut Invariants,
    placer: &mut Placer,
    cluster: &mut Cluster,
    index: &mut PodIndex,
    g: &ExpandedGroup,
    t: &Arc<PodTerms>,
    n: usize,
    ctx: &PlaceCtx<'_>,
    whole: bool,
) -> Result<Vec<Placement>, Unschedulable> {
    let attempt = |inv: &mut Invariants,
                   placer: &mut Placer,
                   cluster: &mut Cluster,
                   index: &mut PodIndex,
                   only: Option<(&[u32], u32)>,
                   slice: u32|
     -> Result<Vec<Placement>, Unschedulable> {
        let mut ps: Vec<Placement> = Vec::with_capacity(n);
        for k in 0..n {
            let counted =
                |node: NodeId, s: &crate::pods::Spread| match (s.honor_affinity, s.honor_taints) {
                    (true, true) => cluster.selects(node, g.demand.selector),
                    (true, false) => cluster.selects(node, g.spread_selectors[0]),
                    (false, true) => cluster.selects(node, g.spread_selectors[1]),
                    (false, false) => true,
                };
            let mut m = index.mask(cluster, t, &counted);
            if let Some((doms, d)) = only {
                m.only(doms, d);
            }
            let c = PlaceCtx { pods: Some(&m), slice, ..*ctx };
            // The placer chose from what is free: a refusal is a broken invariant, and the
            // task counts as not placed.
            let placed = placer.place(cluster, &g.demand, &c).and_then(|p| {
                if inv.check(cluster.allocate(&p), "allocating a placement") {
                    Ok(p)
                } else {
                    Err(placer.report(cluster, &g.demand, &c))
                }
            });
            match placed {
                Ok(p) => {
                    index.add(p.node, t.clone());
                    ps.push(p);
                }
                Err(report) if whole || ps.is_empty() => {
                    inv.check(cluster.undo(ps.iter()), "rolling back a gang trial");
                    for p in &ps {
                        index.remove(p.node, t);
                    }
                    return Err(Unschedulable { task: k, of: n, report });
                }
                Err(_) => break,
            }
        }
        Ok(ps)
    };
    if g.colocate && n > 1 && ctx.slice == 0 {
        let mut slices: Vec<u32> =
            (0..cluster.len()).map(|i| cluster.slice_of(i as NodeId)).filter(|&s| s != 0).collect();
        slices.sort_unstable();
        slices.dedup();
        let mut first = None;
        for s in slices {
            match attempt(inv, placer, cluster, index, None, s) {
                Ok(ps) => return Ok(ps),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        return Err(first.unwrap_or_else(|| Unschedulable {
            task: 0,
            of: n,
            report: crate::placement::FitReport {
                nodes: cluster.len(),
                kind: g.demand.kind,
                reasons: vec![(crate::placement::Reason::OtherSlice, cluster.len())],
            },
        }));
    }
    let first = match attempt(inv, placer, cluster, index, None, ctx.slice) {
        Ok(ps) => return Ok(ps),
        Err(e) => e,
    };
    if let (true, Some(key)) = (whole && n > 1, t.self_affinity_key()) {
        let doms = index.domains(cluster, key);
        let mut seen: Vec<u32> =
            doms.iter().copied().filter(|&d| d != crate::pods::NO_DOMAIN).collect();
        seen.sort_unstable();
        seen.dedup();
        for d in seen.into_iter().take(MAX_DOMAIN_TRIALS) {
            if let Ok(ps) = attempt(inv, placer, cluster, index, Some((&doms, d)), ctx.slice) {
                return Ok(ps);
            }
        }
    }
    Err(first)
}
