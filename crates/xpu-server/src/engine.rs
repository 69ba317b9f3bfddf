//! The scheduling loop: holds the active jobs in memory, queues them in `xpu-sched` (the node
//! is a one-node cluster), starts the tasks the scheduler places through the
//! [`crate::executor`], and applies what happens next (success, failure with
//! `restartPolicy`/`backoffLimit`, `activeDeadlineSeconds`, cancel).
//!
//! The scheduler decides *when* and *where*: jobs wait in their queue until devices are free
//! (whole or a share of one), gangs start together, priorities order each queue and queues
//! share the node fairly (dominant resource fairness), with per-kind lanes so a job waiting for
//! GPUs never holds back CPU-only work (`SchedulerConfig::lanes`). Its clock is the loop's:
//! whole seconds since this loop started. A job's scheduler tasks are its *slots*
//! ([`xpu_sched::manifest`]): the loop hands each placed slot the lowest completion index still
//! to run, and when that task ends either re-queues the slot for the next index (or a retry
//! under `restartPolicy: Never`), keeps it for an in-place restart (`OnFailure`), or finishes it.
//! A job that ends is drained: its devices stay held until its last process has exited, so
//! nothing new lands on a device still in use during the SIGTERM grace period.
//!
//! One task owns all of this state; everything else talks to it through messages, so there are
//! no locks around job state. The store is the source of truth: on becoming leader the loop
//! rebuilds itself from the store, re-adopting tasks whose supervisor is still alive (onto the
//! devices they hold, with `Scheduler::adopt`) and failing (then retrying per policy) those
//! that are gone. It also polls the store every tick, which is how it learns of jobs submitted
//! and cancelled through other daemons sharing a PostgreSQL store.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use xpu_core::DeviceKind;
use xpu_core::job::{CompletionMode, JobSpec, RestartPolicy};
use xpu_sched::scheduler::{Decision, JobId, QueuePolicy, SchedError, Scheduler, SchedulerConfig};
use xpu_sched::{Cluster, NodeSpec, TaskRef};

use crate::Shared;
pub use crate::view::{Holder, QUEUE_VIEW, QueuedView, RunningView, TaskView, View};
use crate::container::{self, ContainerLaunch};
use crate::executor::{self, Launch, Sig};
use crate::store::{JobRow, JobState, TaskRow, TaskState, Write, now_ms};

/// Messages to the loop.
#[derive(Debug)]
pub enum Msg {
    /// A job this daemon accepted (already durable).
    Submitted {
        row: JobRow,
        spec: Box<JobSpec>,
    },
    /// Cancellation was recorded for this job.
    Cancel(i64),
    Started {
        job: i64,
        idx: u32,
        attempt: u32,
        pid: i32,
    },
    /// A task attempt ended; `code` is `None` when its status could not be learned.
    Exited {
        job: i64,
        idx: u32,
        attempt: u32,
        code: Option<i32>,
    },
    /// A start failed before the process existed.
    StartFailed {
        job: i64,
        idx: u32,
        attempt: u32,
        error: String,
    },
}

/// Where one completion index is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idx {
    /// Waits for a slot.
    Pending,
    /// Running, starting, or waiting to restart in place.
    Active,
    Done,
}

#[derive(Debug)]
struct Task {
    idx: u32,
    /// The scheduler task (slot) whose placement it runs on; `None` for a task found dead at
    /// recovery, which never held anything in this scheduler.
    slot: Option<u32>,
    attempt: u32,
    devices: Vec<u32>,
    pid: Option<i32>,
    dir: PathBuf,
    started_ms: i64,
    /// When the next SIGKILL goes out (SIGTERM has been sent), and how many went out.
    kill_at: Option<Instant>,
    kills: u8,
    container: Option<ContainerLaunch>,
}

impl Task {
    /// A task found in the store at start-up, on the devices it recorded; it holds no slot in
    /// this scheduler until the job is registered.
    fn recovered(t: &TaskRow, pid: Option<i32>, container: Option<ContainerLaunch>) -> Task {
        Task {
            idx: t.idx as u32,
            slot: None,
            attempt: t.attempt as u32,
            devices: t.devices.clone(),
            pid,
            dir: PathBuf::from(&t.dir),
            started_ms: t.started_at_ms,
            kill_at: None,
            kills: 0,
            container,
        }
    }
}

/// An index waiting to restart in place (`OnFailure`, `Always`) on its slot's devices.
#[derive(Debug)]
struct Restart {
    idx: u32,
    slot: u32,
    devices: Vec<u32>,
    /// The kubelet's crash-loop back-off: not started again before this.
    not_before: Instant,
}

/// Longest wait before an in-place restart, and how long a task must run for its back-off to
/// start again from the first step: the kubelet's 5 minutes and twice that.
const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(300);
const BACKOFF_RESET_MS: i64 = 600_000;

#[derive(Debug)]
struct Job {
    id: i64,
    name: String,
    queue: String,
    priority: i64,
    spec: JobSpec,
    state: JobState,
    failures: i64,
    submitted_ms: i64,
    started_ms: Option<i64>,
    /// Per completion index.
    idx: Vec<Idx>,
    /// Indices in [`Idx::Pending`], and the lowest that may be.
    pending: u32,
    cursor: u32,
    /// Per completion index: the next attempt number.
    next_attempt: Vec<u32>,
    /// Active attempts.
    tasks: Vec<Task>,
    restarts: Vec<Restart>,
    /// Per completion index: in-place restarts since its back-off was last reset.
    crash_loops: BTreeMap<u32, u32>,
    /// Set once the job reached a terminal state; the tasks are being stopped.
    ending: Option<(JobState, String)>,
    /// Why the last start failed, shown while it waits again.
    reason: String,
    /// Its id in the scheduler.
    sched: Option<JobId>,
    /// Slots queued in the scheduler and not placed yet.
    waiting_slots: u32,
    /// Thousandths of each device a task holds.
    milli: u16,
}

impl Job {
    fn from_row(row: &JobRow, spec: JobSpec) -> Job {
        let n = spec.completions as usize;
        let milli = spec.container.resources.devices.first().and_then(|d| d.milli).unwrap_or(1000);
        Job {
            id: row.id,
            name: row.name.clone(),
            queue: row.queue.clone(),
            priority: row.priority,
            state: row.state,
            failures: row.failures,
            submitted_ms: row.submitted_at_ms,
            started_ms: row.started_at_ms,
            idx: vec![Idx::Pending; n],
            pending: n as u32,
            cursor: 0,
            next_attempt: vec![0; n],
            tasks: Vec::new(),
            restarts: Vec::new(),
            crash_loops: BTreeMap::new(),
            ending: None,
            reason: String::new(),
            sched: None,
            waiting_slots: 0,
            milli,
            spec,
        }
    }

    fn set(&mut self, i: u32, to: Idx) {
        let Some(s) = self.idx.get_mut(i as usize) else { return };
        if *s == Idx::Pending {
            self.pending -= 1;
        }
        if to == Idx::Pending {
            self.pending += 1;
            self.cursor = self.cursor.min(i);
        }
        *s = to;
    }

    /// The lowest pending index, now active.
    fn take_pending(&mut self) -> Option<u32> {
        if self.pending == 0 {
            return None;
        }
        let start = self.cursor as usize;
        let i = start + self.idx[start..].iter().position(|s| *s == Idx::Pending)?;
        self.cursor = i as u32 + 1;
        self.set(i as u32, Idx::Active);
        Some(i as u32)
    }

    fn all_done(&self) -> bool {
        self.idx.iter().all(|s| *s == Idx::Done)
    }
}

pub struct Engine {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Msg>,
    tx: mpsc::UnboundedSender<Msg>,
    jobs: BTreeMap<i64, Job>,
    sched: Scheduler,
    /// Scheduler job id to job id.
    by_sched: HashMap<JobId, i64>,
    /// Scheduler device index to node device id, and back.
    dev_ids: Vec<Option<u32>>,
    sched_idx: Vec<Option<u16>>,
    /// Devices telemetry reports unhealthy (node device id), each held in the scheduler by a
    /// placeholder job pinned to it so nothing new is placed there ([`Engine::apply_health`]).
    health_holds: BTreeMap<u32, JobId>,
    /// Unhealthy devices whose hold the scheduler refused, said once each.
    hold_refused: std::collections::BTreeSet<u32>,
    /// Broken scheduler invariants already logged.
    broken_reported: u64,
    t0: Instant,
    history: VecDeque<(i64, u32)>,
    leader: bool,
    dirty: bool,
}

/// How often the loop polls the store and checks deadlines.
const TICK: Duration = Duration::from_millis(250);
/// Queued jobs whose reason to wait is worked out on each pass (the dashboard shows the head).
const EXPLAINED: usize = 50;

/// The placeholder job that holds one unhealthy device of `kind`, in a queue of its own.
fn health_hold(kind: DeviceKind) -> xpu_sched::Job {
    xpu_sched::Job::single(
        "xpu-health-hold",
        xpu_sched::TaskGroup {
            name: "hold".to_owned(),
            count: 1,
            task: xpu_sched::TaskSpec {
                devices: xpu_sched::DeviceAsk::Whole(1),
                device_kind: Some(kind),
                ..xpu_sched::TaskSpec::default()
            },
            gang: false,
            tpu: None,
        },
    )
    // A queue of its own: an out-of-service device is not charged to any tenant's fair share.
    .queue("xpu.dev/health-hold")
}

/// The scheduler for the daemon's node: fair share across queues, priority inside each, lanes
/// per device kind, and jobs whose tasks end one by one ([`xpu_sched::manifest`]).
pub fn scheduler_for(node: &NodeSpec) -> Result<Scheduler, SchedError> {
    let cluster = Cluster::from_specs([node.clone()])?;
    let config = SchedulerConfig {
        queue: QueuePolicy::Fair,
        lanes: true,
        fit_per_task: true,
        ..SchedulerConfig::default()
    };
    Scheduler::new(cluster, config)
}

impl Engine {
    pub fn new(
        shared: Arc<Shared>,
        rx: mpsc::UnboundedReceiver<Msg>,
        tx: mpsc::UnboundedSender<Msg>,
    ) -> Result<Engine, SchedError> {
        let sched = scheduler_for(&shared.node.sched)?;
        let dev_ids = shared.node.sched_device_ids();
        let mut sched_idx = vec![None; shared.node.devices.len()];
        for (i, id) in dev_ids.iter().enumerate() {
            if let Some(id) = id
                && let Some(s) = sched_idx.get_mut(*id as usize)
            {
                *s = u16::try_from(i).ok();
            }
        }
        Ok(Engine {
            shared,
            rx,
            tx,
            jobs: BTreeMap::new(),
            sched,
            by_sched: HashMap::new(),
            dev_ids,
            sched_idx,
            health_holds: BTreeMap::new(),
            hold_refused: std::collections::BTreeSet::new(),
            broken_reported: 0,
            t0: Instant::now(),
            history: VecDeque::new(),
            leader: false,
            dirty: true,
        })
    }

    /// The scheduler's clock: whole seconds since the loop started.
    fn now_s(&self) -> u64 {
        self.t0.elapsed().as_secs()
    }

    /// Forgets every job the scheduler holds (the caller re-registers what is active).
    fn fresh_scheduler(&mut self) {
        if let Ok(s) = scheduler_for(&self.shared.node.sched) {
            self.sched = s;
        }
        self.by_sched.clear();
        // The placeholders went with the old scheduler; the next pass holds the devices again.
        self.health_holds.clear();
        self.broken_reported = 0;
    }

    pub async fn run(mut self) {
        let mut leadership = self.shared.leadership();
        loop {
            if !self.leader {
                if leadership.acquire().await {
                    self.leader = true;
                    self.shared.leader.store(true, Ordering::Relaxed);
                    self.event(
                        None,
                        "leader",
                        format!("{} is now scheduling", self.shared.node.name),
                    );
                    self.recover().await;
                } else {
                    // Followers drop local notifications: the leader learns from the store.
                    while self.rx.try_recv().is_ok() {}
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
            // Wake for the scheduler's own next event (none without flex-start pools) or the
            // tick, whichever is first.
            let wait = match self.sched.next_wakeup() {
                Some(t) => Duration::from_secs(t.saturating_sub(self.now_s())).min(TICK),
                None => TICK,
            };
            let msg = tokio::time::timeout(wait, self.rx.recv()).await;
            match msg {
                Ok(Some(m)) => {
                    self.handle(m);
                    while let Ok(m) = self.rx.try_recv() {
                        self.handle(m);
                    }
                }
                Ok(None) => return,
                Err(_) => {
                    if !leadership.acquire().await {
                        // Lost the store session that held leadership: stop scheduling. Running
                        // tasks continue; the new leader re-adopts or retries them.
                        tracing::warn!(
                            node = %self.shared.node.name,
                            "lost the store's leadership; no longer scheduling (running tasks go on)"
                        );
                        self.leader = false;
                        self.shared.leader.store(false, Ordering::Relaxed);
                        self.jobs.clear();
                        self.fresh_scheduler();
                        continue;
                    }
                    self.poll().await;
                    self.tick();
                }
            }
            self.apply_health();
            self.schedule();
            self.publish();
        }
    }

    /// Takes devices that telemetry reports unhealthy out of placement, and gives them back
    /// when it reports them healthy. A device busy with a task is left to it (the task's own
    /// errors end it) and held as soon as it is free: before the next placement, since this
    /// runs first in each pass.
    fn apply_health(&mut self) {
        let Some(tel) = self.shared.telemetry.as_ref() else { return };
        let bad = tel.unhealthy();
        let now = self.now_s();
        let shared = self.shared.clone();
        for dev in &shared.node.devices {
            let reason = dev.address.parse().ok().and_then(|a| bad.get(&a));
            match (reason, self.health_holds.get(&dev.id).copied()) {
                (Some(reason), None) => {
                    let Some(si) = self.sched_idx.get(dev.id as usize).copied().flatten() else {
                        continue;
                    };
                    let free = self
                        .sched
                        .cluster()
                        .nodes()
                        .first()
                        .and_then(|n| n.devices.get(usize::from(si)))
                        .is_some_and(|d| d.free_milli() == 1000);
                    if !free {
                        continue;
                    }
                    let hold = health_hold(dev.kind);
                    let task = TaskRef { group: 0, index: 0 };
                    match self.sched.adopt(hold, &[(task, 0, vec![si])], now) {
                        Ok(jid) => {
                            self.health_holds.insert(dev.id, jid);
                            self.event(
                                None,
                                "device-unhealthy",
                                format!(
                                    "device {} is unhealthy ({reason}); no new work is placed on it",
                                    dev.address
                                ),
                            );
                            self.dirty = true;
                        }
                        // The device was free, so this is not expected; the adoption left
                        // nothing allocated, and it is tried again next pass. Said once.
                        Err(e) => {
                            if self.hold_refused.insert(dev.id) {
                                self.event(
                                    None,
                                    "device-unhealthy",
                                    format!(
                                        "device {} is unhealthy ({reason}) but could not be taken out of placement: {e}",
                                        dev.address
                                    ),
                                );
                            }
                        }
                    }
                }
                (None, Some(jid)) => {
                    self.health_holds.remove(&dev.id);
                    self.hold_refused.remove(&dev.id);
                    match self.sched.finish(jid, now) {
                        Ok(()) => self.forget(jid),
                        Err(e) => self.event(
                            None,
                            "device-healthy",
                            format!("releasing the hold on device {}: {e}", dev.address),
                        ),
                    }
                    self.event(
                        None,
                        "device-healthy",
                        format!("device {} is healthy again; it takes work", dev.address),
                    );
                    self.dirty = true;
                }
                (None, None) => {
                    self.hold_refused.remove(&dev.id);
                }
                (Some(_), Some(_)) => {}
            }
        }
    }

    fn event(&self, job: Option<i64>, kind: &str, message: String) {
        self.shared.store.write_later(Write::Event {
            at_ms: now_ms(),
            job_id: job,
            kind: kind.to_owned(),
            message,
        });
    }

    /// Rebuilds the in-memory state and the scheduler from the store after a start or a
    /// takeover.
    async fn recover(&mut self) {
        self.jobs.clear();
        self.fresh_scheduler();
        let shared = self.shared.clone();
        let store = &shared.store;
        let active = match store.active().await {
            Ok(a) => a,
            Err(e) => {
                // Nothing to adopt this time; the next poll reads the store again.
                tracing::warn!(error = %e, "recovery: reading the active jobs failed");
                return;
            }
        };
        for a in &active {
            self.fetch(a.id).await;
        }
        // Succeeded indices and attempt numbers come from each job's full task list.
        let ids: Vec<i64> = self.jobs.keys().copied().collect();
        for &id in &ids {
            if let Ok(all) = store.tasks(id).await
                && let Some(job) = self.jobs.get_mut(&id)
            {
                for t in &all {
                    let i = t.idx as usize;
                    if i < job.idx.len() {
                        job.next_attempt[i] = job.next_attempt[i].max(t.attempt as u32 + 1);
                        if t.state == TaskState::Succeeded {
                            job.set(i as u32, Idx::Done);
                        }
                    }
                }
            }
        }
        let tasks = match store.active_tasks().await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "recovery: reading the running tasks failed");
                return;
            }
        };
        let mut dead: Vec<(TaskRow, Option<i32>)> = Vec::new();
        for t in tasks {
            let dir = PathBuf::from(&t.dir);
            let pid = t.pid.map(|p| p as i32).or_else(|| executor::recorded_pid(&dir));
            let alive = pid.is_some_and(|p| executor::is_our_supervisor(p, &dir));
            let (idx, attempt) = (t.idx as u32, t.attempt as u32);
            let container = self.container_for(t.job_id, idx, attempt);
            let Some(job) = self.jobs.get_mut(&t.job_id) else {
                // The job already ended; a leftover process is stopped.
                if let Some(p) = pid.filter(|_| alive) {
                    executor::signal_group(p, Sig::KILL);
                }
                continue;
            };
            if !alive {
                dead.push((t, pid));
                continue;
            }
            let Some(p) = pid else { continue };
            job.set(idx, Idx::Active);
            job.tasks.push(Task::recovered(&t, pid, container));
            // Recorded as running under its pid (a crash may have come before that).
            self.shared.store.write_later(Write::Task(TaskRow {
                state: TaskState::Running,
                pid: Some(i64::from(p)),
                ..t.clone()
            }));
            self.event(
                Some(t.job_id),
                "adopted",
                format!("task {idx} attempt {attempt} (pid {p}) re-adopted after restart"),
            );
            watch_adopted(self.tx.clone(), t.job_id, idx, attempt, p, dir);
        }
        // Into the scheduler, running tasks on the devices they hold.
        for &id in &ids {
            self.register(id);
        }
        for a in active.iter().filter(|a| a.cancel_requested) {
            self.cancel(a.id);
        }
        // Tasks that did not survive: their recorded exit status when the supervisor wrote
        // one, else failed; then retried per the job's policy.
        for (t, pid) in dead {
            let dir = PathBuf::from(&t.dir);
            let (idx, attempt) = (t.idx as u32, t.attempt as u32);
            let container = self.container_for(t.job_id, idx, attempt);
            let Some(job) = self.jobs.get_mut(&t.job_id) else { continue };
            job.set(idx, Idx::Active);
            job.tasks.push(Task::recovered(&t, pid, container));
            let code = executor::recorded_exit(&dir);
            if code.is_none() {
                self.event(
                    Some(t.job_id),
                    "lost",
                    format!(
                        "task {idx} attempt {attempt} was not running after restart; counted as failed"
                    ),
                );
            }
            self.exited(t.job_id, idx, attempt, code);
        }
        self.dirty = true;
    }

    /// Reads one job from the store into memory (unless already there), not yet scheduled.
    async fn fetch(&mut self, id: i64) -> bool {
        if self.jobs.contains_key(&id) {
            return false;
        }
        let row = match self.shared.store.job(id).await {
            Ok(Some(row)) => row,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(job_id = id, error = %e, "reading a job from the store failed");
                return false;
            }
        };
        if row.state.is_terminal() {
            return false;
        }
        match serde_json::from_str::<JobSpec>(&row.spec) {
            Ok(spec) => {
                self.jobs.insert(id, Job::from_row(&row, spec));
                true
            }
            Err(e) => {
                self.finish_job_now(
                    id,
                    JobState::Failed,
                    format!("stored spec is unreadable: {e}"),
                    0,
                );
                false
            }
        }
    }

    /// Loads one job from the store and queues it.
    async fn load(&mut self, id: i64, cancel: bool) {
        if self.fetch(id).await {
            self.register(id);
            if cancel {
                self.cancel(id);
            }
        }
    }

    /// Picks up jobs and cancellations recorded by other daemons.
    async fn poll(&mut self) {
        let active = match self.shared.store.active().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "poll: reading the active jobs failed");
                return;
            }
        };
        for a in active {
            if !self.jobs.contains_key(&a.id) {
                self.load(a.id, a.cancel_requested).await;
            } else if a.cancel_requested && self.jobs.get(&a.id).is_some_and(|j| j.ending.is_none())
            {
                self.cancel(a.id);
            }
        }
    }

    /// Gives a job to the scheduler: its slots, with the tasks it already runs (and the
    /// in-place restarts it holds devices for) adopted onto their devices.
    fn register(&mut self, id: i64) {
        if let Err(message) = self.try_register(id) {
            self.end_job(id, JobState::Failed, message);
        }
    }

    fn try_register(&mut self, id: i64) -> Result<(), String> {
        let now = self.now_s();
        let shared = self.shared.clone();
        let node = &shared.node;
        let Some(job) = self.jobs.get_mut(&id) else { return Ok(()) };
        let remaining = job.idx.iter().filter(|s| **s != Idx::Done).count() as u32;
        if remaining == 0 && job.tasks.is_empty() && job.restarts.is_empty() {
            // Every index succeeded before a restart, but the job was not yet marked.
            let n = job.spec.completions;
            self.end_job(id, JobState::Succeeded, format!("{n} of {n} completions succeeded"));
            return Ok(());
        }
        let mut sj = xpu_sched::job_from_spec(&job.spec, &|v, k| node.models(v, k))
            .map_err(|e| format!("not schedulable: {e}"))?;
        // Slots: as many as may run at once, and at least what already runs.
        let mut running: Vec<(TaskRef, u32, Vec<u16>)> = Vec::new();
        let mut slot = 0u32;
        let sched_idx = &self.sched_idx;
        let to_sched = |devs: &[u32]| -> Vec<u16> {
            devs.iter().filter_map(|&d| sched_idx.get(d as usize).copied().flatten()).collect()
        };
        for t in &mut job.tasks {
            t.slot = Some(slot);
            running.push((TaskRef { group: 0, index: slot }, 0, to_sched(&t.devices)));
            slot += 1;
        }
        for r in &mut job.restarts {
            r.slot = slot;
            running.push((TaskRef { group: 0, index: slot }, 0, to_sched(&r.devices)));
            slot += 1;
        }
        let adopted = running.len() as u32;
        let count = job.spec.effective_parallelism().min(remaining).max(adopted).max(1);
        let fresh = job.started_ms.is_none() && adopted == 0 && remaining == job.spec.completions;
        sj.groups[0].count = count;
        sj.groups[0].gang = job.spec.is_gang() && fresh;
        let result = if running.is_empty() {
            self.sched.submit(sj.clone(), now)
        } else {
            self.sched.adopt(sj.clone(), &running, now)
        };
        let sid = match result {
            Ok(sid) => sid,
            Err(e) if !running.is_empty() => {
                // Its tasks run on, outside the scheduler's books; what it needs next queues.
                shared.store.write_later(Write::Event {
                    at_ms: now_ms(),
                    job_id: Some(id),
                    kind: "adopt-failed".to_owned(),
                    message: format!(
                        "running tasks could not be placed back on their devices: {e}"
                    ),
                });
                for t in &mut job.tasks {
                    t.slot = None;
                }
                for r in std::mem::take(&mut job.restarts) {
                    job.set(r.idx, Idx::Pending);
                }
                self.sched.submit(sj, now).map_err(|e| format!("not schedulable: {e}"))?
            }
            Err(e) => return Err(format!("not schedulable: {e}")),
        };
        job.sched = Some(sid);
        let held = job.tasks.iter().filter(|t| t.slot.is_some()).count() + job.restarts.len();
        job.waiting_slots = count.saturating_sub(held as u32);
        let ending = job.ending.is_some();
        self.by_sched.insert(sid, id);
        if ending {
            let _ = self.sched.drain(sid, now);
        }
        Ok(())
    }

    /// The container an attempt of a job runs in, when the job names a rootfs or a bundle.
    fn container_for(&self, job_id: i64, idx: u32, attempt: u32) -> Option<ContainerLaunch> {
        let job = self.jobs.get(&job_id)?;
        let c = &job.spec.container;
        let source = match (&c.rootfs, &c.bundle) {
            (Some(r), _) => container::Source::Rootfs(PathBuf::from(r)),
            (None, Some(b)) => container::Source::Bundle(PathBuf::from(b)),
            (None, None) => return None,
        };
        let data = &self.shared.data_dir;
        let id = container::container_id(data, job_id, idx, attempt);
        let steps = (0..job.spec.init_containers.len()).map(|n| format!("{id}-i{n}")).collect();
        Some(ContainerLaunch {
            runtime: self.shared.runtime.clone(),
            state_dir: data.join("runc"),
            id,
            source,
            hostname: self.shared.node.hostname.clone(),
            steps,
        })
    }

    fn handle(&mut self, m: Msg) {
        self.dirty = true;
        match m {
            Msg::Submitted { row, spec } => {
                if let std::collections::btree_map::Entry::Vacant(e) = self.jobs.entry(row.id) {
                    e.insert(Job::from_row(&row, *spec));
                    self.register(row.id);
                }
            }
            Msg::Cancel(id) => self.cancel(id),
            Msg::Started { job, idx, attempt, pid } => {
                if let Some(j) = self.jobs.get_mut(&job)
                    && let Some(t) =
                        j.tasks.iter_mut().find(|t| t.idx == idx && t.attempt == attempt)
                {
                    t.pid = Some(pid);
                    if j.ending.is_some() {
                        executor::signal_task(pid, Sig::TERM);
                        t.kill_at = Some(Instant::now() + self.shared.grace);
                    }
                }
            }
            Msg::Exited { job, idx, attempt, code } => self.exited(job, idx, attempt, code),
            Msg::StartFailed { job, idx, attempt, error } => {
                self.event(Some(job), "start-failed", error.clone());
                self.ended(job, idx, attempt, None, Some(&error));
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.reason = error;
                }
            }
        }
    }

    fn cancel(&mut self, id: i64) {
        let Some(job) = self.jobs.get_mut(&id) else { return };
        if job.ending.is_some() {
            return;
        }
        self.end_job(id, JobState::Cancelled, "cancelled by request".to_owned());
    }

    /// Moves a job to a terminal state: records it, and stops its tasks (SIGTERM now, SIGKILL
    /// after the grace period). The scheduler keeps their devices held until each has exited;
    /// the job leaves memory when its last task has.
    fn end_job(&mut self, id: i64, state: JobState, message: String) {
        let grace = self.shared.grace;
        let now = self.now_s();
        let Some(job) = self.jobs.get_mut(&id) else { return };
        job.ending = Some((state, message.clone()));
        job.state = state;
        let restarts: Vec<Restart> = std::mem::take(&mut job.restarts);
        let failures = job.failures;
        for t in &mut job.tasks {
            if let Some(p) = t.pid {
                executor::signal_task(p, Sig::TERM);
            }
            t.kill_at = Some(Instant::now() + grace);
        }
        if let Some(sid) = job.sched {
            let _ = self.sched.drain(sid, now);
            for r in restarts {
                let _ = self.sched.finish_task(sid, TaskRef { group: 0, index: r.slot }, now);
            }
        }
        self.shared.store.write_later(Write::SetJob {
            id,
            state,
            at_ms: now_ms(),
            failures,
            message: Some(message.clone()),
        });
        self.event(Some(id), state.as_str(), format!("job {id} {state}: {message}"));
        self.reap(id);
    }

    /// Records a terminal state for a job that never had tasks in memory.
    fn finish_job_now(&mut self, id: i64, state: JobState, message: String, failures: i64) {
        self.shared.store.write_later(Write::SetJob {
            id,
            state,
            at_ms: now_ms(),
            failures,
            message: Some(message.clone()),
        });
        self.event(Some(id), state.as_str(), format!("job {id} {state}: {message}"));
    }

    /// Drops an ending job once none of its tasks is left.
    fn reap(&mut self, id: i64) {
        if let Some(job) = self.jobs.get(&id)
            && job.ending.is_some()
            && job.tasks.is_empty()
        {
            let sid = job.sched;
            self.jobs.remove(&id);
            if let Some(sid) = sid {
                self.by_sched.remove(&sid);
                self.forget(sid);
            }
        }
    }

    /// The scheduler drops a job the engine is done with (cancelled first if it still holds
    /// or waits for anything), so its memory follows the live jobs and it never needs rebuilding.
    fn forget(&mut self, sid: JobId) {
        let now = self.now_s();
        if self.sched.job(sid).is_some_and(|j| !j.status.is_done())
            && let Err(e) = self.sched.cancel(sid, now)
        {
            tracing::warn!(sched_job = sid, error = %e, "scheduler: cancelling a reaped job failed");
        }
        if let Err(e) = self.sched.forget(sid) {
            tracing::warn!(sched_job = sid, error = %e, "scheduler: forgetting an ended job failed");
        }
        self.shared.metrics.scheduler_jobs.store(self.sched.live_jobs() as u64, Ordering::Relaxed);
    }

    /// A slot whose task ended: queued again when the job has an index waiting for it (the
    /// next completion, or a retry), otherwise finished.
    fn release_slot(&mut self, id: i64, slot: Option<u32>) {
        let now = self.now_s();
        let Some(slot) = slot else { return };
        let Some(job) = self.jobs.get_mut(&id) else { return };
        let Some(sid) = job.sched else { return };
        let task = TaskRef { group: 0, index: slot };
        if job.ending.is_none() && job.pending > job.waiting_slots {
            if self.sched.requeue_task(sid, task, now).is_ok() {
                job.waiting_slots += 1;
            }
        } else {
            let _ = self.sched.finish_task(sid, task, now);
        }
    }

    fn exited(&mut self, job_id: i64, idx: u32, attempt: u32, code: Option<i32>) {
        self.ended(job_id, idx, attempt, code, None);
    }

    /// A task attempt that ended: with its exit status (`None` when it could not be learned),
    /// or with the error that kept it from starting.
    fn ended(
        &mut self,
        job_id: i64,
        idx: u32,
        attempt: u32,
        code: Option<i32>,
        start_error: Option<&str>,
    ) {
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let Some(pos) = job.tasks.iter().position(|t| t.idx == idx && t.attempt == attempt) else {
            return;
        };
        let task = job.tasks.remove(pos);
        let ok = code == Some(0);
        let state = if job.ending.as_ref().is_some_and(|(s, _)| *s == JobState::Cancelled) {
            TaskState::Cancelled
        } else if ok {
            TaskState::Succeeded
        } else {
            TaskState::Failed
        };
        self.shared.store.write_later(Write::Task(TaskRow {
            job_id,
            idx: i64::from(idx),
            attempt: i64::from(attempt),
            state,
            node: self.shared.node.name.clone(),
            devices: task.devices.clone(),
            pid: task.pid.map(i64::from),
            started_at_ms: task.started_ms,
            finished_at_ms: Some(now_ms()),
            exit_code: code.map(i64::from),
            dir: task.dir.display().to_string(),
        }));
        if let Some(c) = task.container.clone() {
            // `runc run` deletes its container when it exits; one killed with it is not.
            tokio::spawn(async move { container::runtime_call(&c, &["delete", "-f"]).await });
        }
        // A task killed outright (SIGKILL) leaves its memory volumes mounted: unmounted here,
        // lazily, so nothing holds the memory after the task. Usually the task's script did it
        // already; a directory on the same device as its parent is not a mount point.
        for v in job.spec.volumes.iter().filter(|v| v.memory) {
            let dir = task.dir.join("volumes").join(&v.name);
            if !executor::is_mount_point(&dir) {
                continue;
            }
            tokio::spawn(async move {
                let out = tokio::process::Command::new("umount")
                    .arg("-l")
                    .arg(&dir)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .output()
                    .await;
                match out {
                    Ok(o) if o.status.success() => {}
                    Ok(o) => tracing::warn!(
                        dir = %dir.display(),
                        stderr = %String::from_utf8_lossy(&o.stderr).trim(),
                        "could not unmount a memory volume"
                    ),
                    Err(e) => {
                        tracing::warn!(dir = %dir.display(), error = %e, "could not run umount")
                    }
                }
            });
        }
        if job.ending.is_some() {
            self.release_slot(job_id, task.slot);
            self.reap(job_id);
            return;
        }
        let always = job.spec.restart_policy == RestartPolicy::Always;
        if ok && !always {
            job.set(idx, Idx::Done);
            let all = job.all_done();
            let n = job.spec.completions;
            self.release_slot(job_id, task.slot);
            if all {
                self.end_job(
                    job_id,
                    JobState::Succeeded,
                    format!("{n} of {n} completions succeeded"),
                );
            }
            return;
        }
        let msg = match (start_error, code) {
            (_, Some(0)) => format!("task {idx} attempt {attempt} exited with status 0"),
            (Some(e), _) => format!("task {idx} attempt {attempt} could not start: {e}"),
            (None, Some(c)) => format!("task {idx} attempt {attempt} failed: exit status {c}"),
            (None, None) => format!("task {idx} attempt {attempt} failed: lost (no exit status)"),
        };
        if !ok {
            self.shared.metrics.tasks_failed.fetch_add(1, Ordering::Relaxed);
            job.failures += 1;
        }
        let (failures, limit) = (job.failures, i64::from(job.spec.backoff_limit));
        let unbounded = always || job.spec.backoff_limit == u32::MAX;
        let state = job.state;
        // Kubernetes: the Job fails once failures exceed backoffLimit.
        if failures > limit {
            self.event(Some(job_id), "task-failed", msg.clone());
            self.release_slot(job_id, task.slot);
            self.end_job(
                job_id,
                JobState::Failed,
                format!("{msg}; backoffLimit {limit} reached (BackoffLimitExceeded)"),
            );
            return;
        }
        let next = match (job.spec.restart_policy, task.slot) {
            // Restarted in place: keeps its slot, so its devices, after the kubelet's back-off
            // (base, doubled per restart, at most 5 minutes; back to the base once a run lasted
            // 10 minutes).
            (RestartPolicy::OnFailure | RestartPolicy::Always, Some(slot)) => {
                let loops = job.crash_loops.entry(idx).or_insert(0);
                if now_ms() - task.started_ms >= BACKOFF_RESET_MS {
                    *loops = 0;
                }
                let delay = self
                    .shared
                    .restart_backoff
                    .saturating_mul(1u32 << (*loops).min(16))
                    .min(MAX_RESTART_BACKOFF);
                *loops = loops.saturating_add(1);
                job.restarts.push(Restart {
                    idx,
                    slot,
                    devices: task.devices.clone(),
                    not_before: Instant::now() + delay,
                });
                format!("restarting in place in {} s", delay.as_secs_f64())
            }
            // A new attempt, placed anew (Kubernetes makes a new pod).
            _ => {
                job.set(idx, Idx::Pending);
                self.release_slot(job_id, task.slot);
                "retrying".to_owned()
            }
        };
        let (kind, detail) = if ok {
            ("task-restarted", format!("{msg}; {next} (restartPolicy Always)"))
        } else if unbounded {
            ("task-failed", format!("{msg}; {next} ({failures} failures so far)"))
        } else {
            ("task-failed", format!("{msg}; {next} ({failures} of {limit} retries used)"))
        };
        self.event(Some(job_id), kind, detail);
        self.shared.store.write_later(Write::SetJob {
            id: job_id,
            state,
            at_ms: now_ms(),
            failures,
            message: Some(msg),
        });
    }

    /// Deadlines and SIGKILL escalation.
    fn tick(&mut self) {
        let now = Instant::now();
        let now_ms = now_ms();
        let mut expired = Vec::new();
        for job in self.jobs.values_mut() {
            for t in &mut job.tasks {
                if let (Some(at), Some(p)) = (t.kill_at, t.pid)
                    && now >= at
                {
                    // A container's processes are in their own session, out of the group's
                    // reach: runc kills them, and runc exits with them. The group follows
                    // next time if anything is still there.
                    if let Some(c) = t.container.clone() {
                        tokio::spawn(async move {
                            container::runtime_call(&c, &["kill", "KILL"]).await;
                        });
                    }
                    if t.container.is_none() || t.kills > 0 {
                        executor::signal_group(p, Sig::KILL);
                    }
                    t.kills = t.kills.saturating_add(1);
                    t.kill_at = Some(now + Duration::from_secs(5));
                }
            }
            // activeDeadlineSeconds counts from the job's first start, as recorded in the
            // store, so a daemon restart does not reset it.
            if job.ending.is_none()
                && let (Some(d), Some(start)) = (job.spec.active_deadline_seconds, job.started_ms)
                && now_ms - start > (d as i64).saturating_mul(1000)
            {
                expired.push((job.id, d));
            }
        }
        for (id, d) in expired {
            self.end_job(
                id,
                JobState::Failed,
                format!("activeDeadlineSeconds {d} exceeded (DeadlineExceeded)"),
            );
        }
        self.dirty = true;
    }

    /// One scheduling pass: restarts in place, then what the scheduler decides.
    fn schedule(&mut self) {
        if !self.dirty {
            return;
        }
        let t0 = Instant::now();
        // Restarts in place first: they already hold their devices. Those still in their
        // back-off wait; the tick brings the loop back here.
        let due_at = Instant::now();
        let mut restarts: Vec<(i64, Restart)> = Vec::new();
        for j in self.jobs.values_mut() {
            let (due, later): (Vec<Restart>, Vec<Restart>) =
                j.restarts.drain(..).partition(|r| r.not_before <= due_at);
            j.restarts = later;
            restarts.extend(due.into_iter().map(|r| (j.id, r)));
        }
        for (id, r) in restarts {
            self.start(id, r.idx, Some(r.slot), r.devices);
        }
        let now = self.now_s();
        for d in self.sched.schedule(now) {
            match d {
                Decision::Start { job, tasks } => {
                    for t in tasks {
                        let devices: Vec<u32> = t
                            .placement
                            .devices
                            .iter()
                            .filter_map(|s| {
                                self.dev_ids.get(usize::from(s.index)).copied().flatten()
                            })
                            .collect();
                        self.placed(job, t.task, devices);
                    }
                }
                Decision::Fail { job, error } => {
                    if let Some(&id) = self.by_sched.get(&job) {
                        let detail = self.jobs.get(&id).map(|j| why_never(&self.shared, &j.spec));
                        let detail =
                            detail.flatten().map(|d| format!(" ({d})")).unwrap_or_default();
                        self.end_job(
                            id,
                            JobState::Failed,
                            format!("unschedulable on this node: {error}{detail}"),
                        );
                    }
                }
                // Not configured (no preemption, deadlines, or flex-start pools), so not expected;
                // a stop is treated as the end of the job rather than ignored.
                Decision::Preempt { job, .. } | Decision::Stop { job, .. } => {
                    if let Some(&id) = self.by_sched.get(&job) {
                        self.end_job(id, JobState::Failed, "stopped by the scheduler".to_owned());
                    }
                }
                Decision::Provision { .. } | Decision::Release { .. } => {}
            }
        }
        self.shared.metrics.sched_pass.observe(t0.elapsed().as_secs_f64());
        self.shared.metrics.scheduler_jobs.store(self.sched.live_jobs() as u64, Ordering::Relaxed);
        if let (n, Some(last)) = self.sched.broken_invariants()
            && n > self.broken_reported
        {
            tracing::error!(
                count = n,
                last,
                "scheduler: an invariant broke; placements may not add up (a bug: please report it with this log)"
            );
            self.broken_reported = n;
        }
    }

    /// A slot the scheduler placed: it runs the job's lowest pending index.
    fn placed(&mut self, sid: JobId, task: TaskRef, devices: Vec<u32>) {
        let now = self.now_s();
        let Some(&id) = self.by_sched.get(&sid) else {
            let _ = self.sched.finish_task(sid, task, now);
            return;
        };
        let Some(job) = self.jobs.get_mut(&id) else { return };
        job.waiting_slots = job.waiting_slots.saturating_sub(1);
        let idx = if job.ending.is_some() { None } else { job.take_pending() };
        match idx {
            Some(idx) => self.start(id, idx, Some(task.index), devices),
            None => {
                let _ = self.sched.finish_task(sid, task, now);
            }
        }
    }

    /// Starts one attempt on the given devices: records it durably, then spawns it.
    fn start(&mut self, job_id: i64, idx: u32, slot: Option<u32>, devices: Vec<u32>) {
        let shared = self.shared.clone();
        let Some(attempt) =
            self.jobs.get(&job_id).and_then(|j| j.next_attempt.get(idx as usize).copied())
        else {
            return;
        };
        let container = self.container_for(job_id, idx, attempt);
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        job.next_attempt[idx as usize] += 1;
        let now = now_ms();
        if job.started_ms.is_none() {
            job.started_ms = Some(now);
            shared.metrics.queue_wait.observe((now - job.submitted_ms).max(0) as f64 / 1000.0);
        }
        if job.state == JobState::Queued {
            job.state = JobState::Running;
            shared.store.write_later(Write::SetJob {
                id: job_id,
                state: JobState::Running,
                at_ms: now,
                failures: job.failures,
                message: None,
            });
        }
        job.reason.clear();
        let dir = executor::task_dir(&shared.data_dir, job_id, idx, attempt);
        job.tasks.push(Task {
            idx,
            slot,
            attempt,
            devices: devices.clone(),
            pid: None,
            dir: dir.clone(),
            started_ms: now,
            kill_at: None,
            kills: 0,
            container: container.clone(),
        });
        // What the task is told, resolved now; a manifest whose references expand past the
        // kernel's limits fails to start, saying which (after its row is written, as any start).
        let in_container = container.is_some();
        let main = &job.spec.container;
        let prepared = task_env(&shared, job, main, idx, &devices, in_container)
            .and_then(|env| Ok((task_argv(&job.spec, main, &env)?, env)))
            .and_then(|(argv, env)| {
                // Each init container with its own variables and arguments, on the same
                // devices (see `executor::spawn_pod`).
                let init = job
                    .spec
                    .init_containers
                    .iter()
                    .map(|c| {
                        let env = task_env(&shared, job, c, idx, &devices, in_container)
                            .map_err(|e| format!("init container {}: {e}", c.name))?;
                        let argv = task_argv(&job.spec, c, &env)
                            .map_err(|e| format!("init container {}: {e}", c.name))?;
                        Ok(executor::Step {
                            name: c.name.clone(),
                            argv,
                            env,
                            working_dir: c.working_dir.clone(),
                            sidecar: c.sidecar,
                            mounts: c.volume_mounts.clone(),
                        })
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                let files = downward_files(&shared, job, idx, devices.len());
                Ok(Launch {
                    job_id,
                    idx,
                    attempt,
                    argv,
                    env,
                    files,
                    working_dir: main.working_dir.clone(),
                    dir: dir.clone(),
                    container,
                    init,
                    volumes: job.spec.volumes.clone(),
                    mounts: main.volume_mounts.clone(),
                    grace: shared.grace,
                })
            });
        let row = TaskRow {
            job_id,
            idx: i64::from(idx),
            attempt: i64::from(attempt),
            state: TaskState::Starting,
            node: shared.node.name.clone(),
            devices,
            pid: None,
            started_at_ms: now,
            finished_at_ms: None,
            exit_code: None,
            dir: dir.display().to_string(),
        };
        shared.metrics.tasks_started.fetch_add(1, Ordering::Relaxed);
        let tx = self.tx.clone();
        tokio::spawn(async move {
            // Durable before the process exists, so a crash in between is seen at restart.
            if let Err(e) = shared.store.write(Write::Task(row.clone())).await {
                let _ =
                    tx.send(Msg::StartFailed { job: job_id, idx, attempt, error: e.to_string() });
                return;
            }
            let launch = match prepared {
                Ok(l) => l,
                Err(error) => {
                    // Fails only when the engine is gone (the daemon stopping): nobody to tell.
                    let _ = tx.send(Msg::StartFailed { job: job_id, idx, attempt, error });
                    return;
                }
            };
            let mut spawned = match executor::spawn(&launch) {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx.send(Msg::StartFailed {
                        job: job_id,
                        idx,
                        attempt,
                        error: e.to_string(),
                    });
                    return;
                }
            };
            if let Some(aside) = &spawned.moved_aside {
                shared.store.write_later(Write::Event {
                    at_ms: now_ms(),
                    job_id: Some(job_id),
                    kind: "stale-dir".to_owned(),
                    message: format!(
                        "task directory {} was left by an earlier store; moved to {}",
                        launch.dir.display(),
                        aside.display()
                    ),
                });
            }
            let _ = tx.send(Msg::Started { job: job_id, idx, attempt, pid: spawned.pid });
            shared.store.write_later(Write::Task(TaskRow {
                state: TaskState::Running,
                pid: Some(i64::from(spawned.pid)),
                ..row
            }));
            let code = match spawned.child.wait().await {
                Ok(status) => status.code().or_else(|| {
                    use std::os::unix::process::ExitStatusExt;
                    status.signal().map(|s| 128 + s)
                }),
                Err(_) => executor::recorded_exit(&launch.dir),
            };
            let _ = tx.send(Msg::Exited { job: job_id, idx, attempt, code });
        });
    }

    /// Publishes the view the API reads.
    fn publish(&mut self) {
        if !self.dirty {
            return;
        }
        self.dirty = false;
        let now = now_ms();
        let mut holders: Vec<Vec<Holder>> = vec![Vec::new(); self.shared.node.devices.len()];
        for j in self.jobs.values() {
            let held = j
                .tasks
                .iter()
                .map(|t| (t.idx, &t.devices))
                .chain(j.restarts.iter().map(|r| (r.idx, &r.devices)));
            for (task, devices) in held {
                for &d in devices {
                    if let Some(h) = holders.get_mut(d as usize) {
                        h.push(Holder { job: j.id, name: j.name.clone(), task, milli: j.milli });
                    }
                }
            }
        }
        let allocated = holders.iter().filter(|h| !h.is_empty()).count() as u32;
        match self.history.back().copied() {
            Some((_, n)) if n == allocated => {}
            Some((t, _)) if now - t < 1000 => {
                if let Some(b) = self.history.back_mut() {
                    *b = (t, allocated);
                }
            }
            _ => self.history.push_back((now, allocated)),
        }
        while self.history.len() > 2000 {
            self.history.pop_front();
        }
        let order: Vec<JobId> = self.sched.queued().collect();
        let mut queued = Vec::new();
        let mut queued_total = 0;
        for sid in order {
            let Some(&id) = self.by_sched.get(&sid) else { continue };
            let Some(j) = self.jobs.get(&id) else { continue };
            if !j.tasks.is_empty() || j.state != JobState::Queued || j.ending.is_some() {
                continue;
            }
            queued_total += 1;
            if queued.len() >= QUEUE_VIEW {
                continue;
            }
            let reason = if queued.len() < EXPLAINED {
                match self.sched.explain(sid) {
                    Some(u) => u.to_string(),
                    None if !j.reason.is_empty() => j.reason.clone(),
                    None => format!(
                        "waiting behind earlier or higher-priority jobs of queue {} that ask for the same devices",
                        j.queue
                    ),
                }
            } else {
                "queued".to_owned()
            };
            queued.push(QueuedView {
                id,
                name: j.name.clone(),
                queue: j.queue.clone(),
                priority: j.priority,
                submitted_at_ms: j.submitted_ms,
                position: queued.len() + 1,
                reason,
            });
        }
        let running = self
            .jobs
            .values()
            .filter(|j| !j.tasks.is_empty())
            .map(|j| RunningView {
                id: j.id,
                name: j.name.clone(),
                queue: j.queue.clone(),
                started_at_ms: j.started_ms.unwrap_or(now),
                tasks: j
                    .tasks
                    .iter()
                    .map(|t| TaskView {
                        index: t.idx,
                        attempt: t.attempt,
                        pid: t.pid,
                        devices: t.devices.clone(),
                    })
                    .collect(),
            })
            .collect();
        let view = View { holders, queued, queued_total, running, history: self.history.clone() };
        if let Ok(mut v) = self.shared.view.write() {
            *v = view;
        }
    }
}

/// For a job the scheduler found can never run here: what in its manifest the node cannot
/// satisfy, naming the label or resource (the scheduler's report counts filters, not fields).
fn why_never(shared: &Shared, spec: &JobSpec) -> Option<String> {
    let node = &shared.node;
    for (k, v) in &spec.node_selector {
        match node.labels.get(k) {
            Some(have) if have == v => {}
            Some(have) => {
                return Some(format!("nodeSelector {k}={v} does not match the node's {k}={have}"));
            }
            None => return Some(format!("nodeSelector {k}={v}: the node has no label {k}")),
        }
    }
    for req in &spec.container.resources.devices {
        let have = node
            .devices
            .iter()
            .filter(|d| d.kind == req.kind && req.vendor.as_ref().is_none_or(|v| *v == d.vendor))
            .count();
        let per_task = req.count as usize;
        let tasks = if spec.is_gang() { spec.completions as usize } else { 1 };
        if have < per_task * tasks {
            return Some(format!(
                "asks {} {} {}; the node has {have}",
                per_task * tasks,
                req.resource,
                if tasks > 1 { "for the whole gang" } else { "per task" }
            ));
        }
    }
    None
}

/// The environment of one task: the job's own variables, then what xpu sets (which wins). The
/// job's device variables are dropped ([`crate::node::DEVICE_VARS`]): only the daemon says which
/// devices a task has. A container is told which devices to inject instead of host index lists
/// (see [`crate::node::Node::container_device_env`]).
fn task_env(
    shared: &Shared,
    job: &Job,
    c: &xpu_core::job::Container,
    idx: u32,
    devices: &[u32],
    container: bool,
) -> Result<Vec<(String, String)>, String> {
    let spec = &job.spec;
    let pod = pod_identity(job, idx);
    // The container's own variables in order: `valueFrom` resolved from the pod's identity,
    // `$(VAR)` in a value expanded with the variables defined before it (Kubernetes' rules).
    let mut env: Vec<(String, String)> = Vec::new();
    for e in c.env.iter().filter(|e| !crate::node::selects_devices(&e.name)) {
        let value = match &e.from {
            Some(from) => resolve_env_from(shared, spec, c, &pod, from, devices.len()),
            None if spec.source == xpu_core::job::Source::Kubernetes => {
                let lookup =
                    |n: &str| env.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.clone());
                xpu_core::expand::expand(&e.value, &lookup)
                    .map_err(|err| format!("env {}: {err}", e.name))?
            }
            None => e.value.clone(),
        };
        env.push((e.name.clone(), value));
    }
    if container {
        env.extend(shared.node.container_device_env(devices));
    } else {
        env.extend(shared.node.device_env(devices));
    }
    env.push(("XPU_JOB_ID".into(), job.id.to_string()));
    env.push(("XPU_JOB_NAME".into(), job.name.clone()));
    env.push(("XPU_TASK_INDEX".into(), idx.to_string()));
    if job.milli < 1000 && devices.iter().any(|&d| is_gpu(shared, d)) {
        env.push(("XPU_GPU_MILLI".into(), job.milli.to_string()));
    }
    if spec.completion_mode == CompletionMode::Indexed {
        // Kubernetes sets JOB_COMPLETION_INDEX for Indexed Jobs; GKE's TPU webhook sets the TPU
        // worker id to the same index and lists every worker's hostname in index order.
        env.push(("JOB_COMPLETION_INDEX".into(), idx.to_string()));
        env.push(("TPU_WORKER_ID".into(), idx.to_string()));
        let hosts: Vec<String> =
            (0..spec.completions).map(|_| shared.node.hostname.clone()).collect();
        env.push(("TPU_WORKER_HOSTNAMES".into(), hosts.join(",")));
    }
    // Linux refuses an exec whose arguments and environment pass its limit (2 MiB with the
    // default stack); a manifest's references must not make the daemon build more than that.
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if total > MAX_TASK_ENV {
        return Err(format!(
            "the environment expands to {total} bytes, over the {} MiB a process can be given",
            MAX_TASK_ENV >> 20
        ));
    }
    Ok(env)
}

/// The files of the job's `downwardAPI` volumes for task `idx`: (volume, path, content, mode).
fn downward_files(
    shared: &Shared,
    job: &Job,
    idx: u32,
    devices: usize,
) -> Vec<executor::VolumeFile> {
    use xpu_core::job::{EnvFrom, FieldPath};
    let pod = pod_identity(job, idx);
    // `key="value"` lines, sorted, as the kubelet writes a whole map.
    let map = |m: &BTreeMap<String, String>| -> String {
        m.iter().map(|(k, v)| format!("{k}={v:?}\n")).collect()
    };
    let mut out = Vec::new();
    for v in &job.spec.volumes {
        for f in v.downward_api.iter().flatten() {
            let content = match &f.from {
                EnvFrom::Field(FieldPath::Labels) => map(&pod.labels),
                EnvFrom::Field(FieldPath::Annotations) => map(&pod.annotations),
                from => {
                    resolve_env_from(shared, &job.spec, &job.spec.container, &pod, from, devices)
                }
            };
            out.push(executor::VolumeFile {
                volume: v.name.clone(),
                path: f.path.clone(),
                content,
                mode: f.mode,
            });
        }
    }
    out
}

/// Who a task is, as the downward API tells a pod: its name, uid, labels and annotations as
/// the Job controller sets them.
struct PodIdentity {
    name: String,
    uid: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

fn pod_identity(job: &Job, idx: u32) -> PodIdentity {
    let spec = &job.spec;
    let uid_of = |n: u64| format!("{:08x}-0000-4000-8000-{:012x}", job.id, n);
    let job_uid = uid_of(0);
    let mut labels = spec.pod.labels.clone();
    let mut annotations = spec.pod.annotations.clone();
    if spec.source == xpu_core::job::Source::Kubernetes {
        for (k, v) in [
            ("batch.kubernetes.io/job-name", job.name.clone()),
            ("job-name", job.name.clone()),
            ("batch.kubernetes.io/controller-uid", job_uid.clone()),
            ("controller-uid", job_uid.clone()),
        ] {
            labels.insert(k.to_owned(), v);
        }
    }
    if spec.completion_mode == CompletionMode::Indexed {
        let key = "batch.kubernetes.io/job-completion-index";
        labels.insert(key.to_owned(), idx.to_string());
        annotations.insert(key.to_owned(), idx.to_string());
    }
    PodIdentity {
        name: format!("{}-{}-{idx}", job.name, job.id),
        uid: uid_of(u64::from(idx) + 1),
        labels,
        annotations,
    }
}

/// A `valueFrom` value. Tasks share the host's network (and a container has only loopback), so
/// both IPs are 127.0.0.1. A resource the container does not set reads as the node's capacity,
/// as the kubelet gives a limit that is not set.
fn resolve_env_from(
    shared: &Shared,
    spec: &JobSpec,
    c: &xpu_core::job::Container,
    pod: &PodIdentity,
    from: &xpu_core::job::EnvFrom,
    devices: usize,
) -> String {
    use xpu_core::job::{EnvFrom, FieldPath};
    match from {
        EnvFrom::Field(f) => match f {
            FieldPath::Name => pod.name.clone(),
            FieldPath::Namespace => spec.pod.namespace.clone().unwrap_or_else(|| "default".into()),
            FieldPath::Uid => pod.uid.clone(),
            FieldPath::Label(k) => pod.labels.get(k).cloned().unwrap_or_default(),
            FieldPath::Annotation(k) => pod.annotations.get(k).cloned().unwrap_or_default(),
            FieldPath::NodeName => shared.node.name.clone(),
            FieldPath::ServiceAccountName => {
                spec.pod.service_account.clone().unwrap_or_else(|| "default".into())
            }
            FieldPath::HostIp | FieldPath::PodIp => "127.0.0.1".to_owned(),
            // Whole maps are for volumes (`downward_files`); the parser keeps them out of env.
            FieldPath::Labels | FieldPath::Annotations => String::new(),
        },
        EnvFrom::Resource { resource, divisor } => {
            let r = &c.resources;
            let name = resource.split_once('.').map_or(resource.as_str(), |(_, n)| n);
            let value = match name {
                "cpu" if r.cpu_milli > 0 => r.cpu_milli as f64 / 1000.0,
                "cpu" => shared.node.cpu_milli as f64 / 1000.0,
                "memory" if r.memory_mib > 0 => r.memory_mib as f64 * 1048576.0,
                "memory" => shared.node.memory_mib as f64 * 1048576.0,
                other => {
                    if r.devices.iter().any(|d| d.resource == other) {
                        devices as f64
                    } else {
                        0.0
                    }
                }
            };
            let d = xpu_core::job::quantity(divisor).filter(|d| *d > 0.0).unwrap_or(1.0);
            format!("{}", (value / d).ceil() as u64)
        }
    }
}

/// Most bytes of environment, or of arguments, a task is started with (Linux's default limit
/// for both together is 2 MiB).
const MAX_TASK_ENV: usize = 2 << 20;

/// `$(VAR)` in a Kubernetes manifest's command and args, by Kubernetes' rules, with every
/// variable of the task. xpu's short form runs its command as written (a shell's `$(cmd)`
/// stays a shell's).
fn task_argv(
    spec: &JobSpec,
    c: &xpu_core::job::Container,
    env: &[(String, String)],
) -> Result<Vec<String>, String> {
    if spec.source != xpu_core::job::Source::Kubernetes {
        return Ok(c.argv.clone());
    }
    let lookup = |n: &str| env.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut total = 0;
    let mut argv = Vec::with_capacity(c.argv.len());
    for (i, a) in c.argv.iter().enumerate() {
        let a = xpu_core::expand::expand(a, &lookup).map_err(|e| format!("argument {i}: {e}"))?;
        total += a.len() + 1;
        if total > MAX_TASK_ENV {
            return Err(format!(
                "the arguments expand to over the {} MiB a process can be given",
                MAX_TASK_ENV >> 20
            ));
        }
        argv.push(a);
    }
    Ok(argv)
}

fn is_gpu(shared: &Shared, d: u32) -> bool {
    shared.node.devices.get(d as usize).is_some_and(|x| x.kind == DeviceKind::Gpu)
}

/// Watches a re-adopted supervisor (not our child, so it cannot be waited for) until it is
/// gone, then reports the status it recorded.
fn watch_adopted(
    tx: mpsc::UnboundedSender<Msg>,
    job: i64,
    idx: u32,
    attempt: u32,
    pid: i32,
    dir: PathBuf,
) {
    tokio::spawn(async move {
        while executor::is_our_supervisor(pid, &dir) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let code = executor::recorded_exit(&dir);
        let _ = tx.send(Msg::Exited { job, idx, attempt, code });
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::metrics::Metrics;
    use crate::node::{add_fakes, node_from_inventory, parse_fake};
    use crate::store::{NewJob, Outcome, Store};
    use std::sync::RwLock;
    use std::sync::atomic::AtomicBool;

    async fn shared(dir: &std::path::Path, tx: mpsc::UnboundedSender<Msg>) -> Arc<Shared> {
        let mut inv = xpu_core::Inventory::default();
        add_fakes(&mut inv, &[parse_fake("nvidia-a100:2").unwrap()]);
        let url = format!("sqlite://{}", dir.join("xpu.db").display());
        Arc::new(Shared {
            store: Store::open(&url).await.unwrap(),
            node: node_from_inventory(&inv, &[], 4000, 4096),
            data_dir: dir.to_owned(),
            engine: tx,
            view: RwLock::new(View::default()),
            metrics: Metrics::default(),
            leader: AtomicBool::new(false),
            token: String::new(),
            started_ms: 0,
            grace: Duration::from_secs(1),
            restart_backoff: Duration::ZERO,
            runtime: vec!["xpu".into(), "runtime".into()],
            db_url: url,
            telemetry: None,
        })
    }

    async fn submit(s: &Shared, manifest: &str) -> i64 {
        let spec = xpu_core::job::parse(manifest).unwrap().spec;
        let json = serde_json::to_string(&spec).unwrap();
        let new = NewJob {
            key: None,
            name: spec.name.clone(),
            queue: spec.queue.clone(),
            priority: 0,
            spec: json.clone(),
            at_ms: now_ms(),
        };
        let Outcome::Submitted { id, .. } =
            s.store.write(Write::Submit(new.clone())).await.unwrap()
        else {
            panic!("not submitted")
        };
        let row = s.store.job(id).await.unwrap().unwrap();
        s.engine.send(Msg::Submitted { row, spec: Box::new(spec) }).unwrap();
        id
    }

    async fn until<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(v) = f().await {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn state(s: &Shared, id: i64) -> JobState {
        s.store.job(id).await.unwrap().unwrap().state
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ended_jobs_are_forgotten_and_running_tasks_keep_their_devices() {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let s = shared(tmp.path(), tx.clone()).await;
        let engine = Engine::new(s.clone(), rx, tx).unwrap();
        tokio::spawn(engine.run());
        let gate = tmp.path().join("gate");
        let hold = format!(
            "command: [sh, -c, \"while [ ! -e {} ]; do sleep 0.05; done\"]\ngpus: 1\n",
            gate.display()
        );
        let holder = submit(&s, &hold).await;
        until("the holder to run", async || {
            (state(&s, holder).await == JobState::Running).then_some(())
        })
        .await;
        // Quick jobs come and go; the scheduler forgets each as it ends.
        let mut quick = Vec::new();
        for _ in 0..8 {
            quick.push(submit(&s, "command: [\"true\"]\n").await);
        }
        for id in quick {
            until("a quick job", async || {
                (state(&s, id).await == JobState::Succeeded).then_some(())
            })
            .await;
        }
        assert_eq!(
            until("the scheduler to hold only the holder", async || {
                let n = s.metrics.scheduler_jobs.load(Ordering::Relaxed);
                (n == 1).then_some(n)
            })
            .await,
            1
        );
        // Two GPU jobs: one GPU is still the holder's, so one of them waits.
        let a = submit(&s, &hold).await;
        let b = submit(&s, &hold).await;
        until("one of them to run", async || {
            let (x, y) = (state(&s, a).await, state(&s, b).await);
            (x == JobState::Running || y == JobState::Running).then_some(())
        })
        .await;
        let view = until("the queue to show the other", async || {
            let v = s.view.read().unwrap().clone();
            (v.queued.len() == 1).then_some(v)
        })
        .await;
        assert_eq!(view.queued[0].reason, "0/1 nodes are available: 1 Insufficient gpu");
        assert!(view.holders.iter().any(|h| h.iter().any(|x| x.job == holder)), "{view:?}");
        std::fs::write(&gate, "").unwrap();
        for id in [holder, a, b] {
            until("all to succeed", async || {
                (state(&s, id).await == JobState::Succeeded).then_some(())
            })
            .await;
        }
        until("the scheduler to hold nothing", async || {
            (s.metrics.scheduler_jobs.load(Ordering::Relaxed) == 0).then_some(())
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_work_is_placed_on_a_device_telemetry_calls_unhealthy_until_it_recovers() {
        use xpu_telemetry::Reading;
        use xpu_telemetry::nvml::FakeNvml;
        let tmp = tempfile::tempdir().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let base = shared(tmp.path(), tx.clone()).await;
        let addrs: Vec<xpu_core::PciAddress> =
            base.node.devices.iter().map(|d| d.address.parse().unwrap()).collect();
        let nvml = FakeNvml::new(addrs.iter().map(|a| (*a, Reading::default())).collect());
        let empty = tempfile::tempdir().unwrap();
        let telemetry = xpu_telemetry::collect::Collector::start(
            xpu_host::Root::new(empty.path()).unwrap(),
            Duration::from_millis(50),
            vec![Box::new(nvml.clone())],
        );
        let mut s = Arc::try_unwrap(base).ok().unwrap();
        s.telemetry = Some(telemetry.clone());
        let s = Arc::new(s);
        tokio::spawn(Engine::new(s.clone(), rx, tx).unwrap().run());

        // GPU 0 reports XID 79 (fallen off the bus).
        nvml.update(|st| st.devices.get_mut(&addrs[0]).unwrap().xids.push(79));
        until("telemetry to report it", async || {
            telemetry.unhealthy().contains_key(&addrs[0]).then_some(())
        })
        .await;
        let gate = tmp.path().join("gate");
        let hold = format!(
            "command: [sh, -c, \"while [ ! -e {} ]; do sleep 0.05; done\"]\ngpus: 1\n",
            gate.display()
        );
        let a = submit(&s, &hold).await;
        until("a to run", async || (state(&s, a).await == JobState::Running).then_some(())).await;
        let tasks = s.store.tasks(a).await.unwrap();
        assert_eq!(tasks[0].devices, [1], "placed on the healthy GPU, not on GPU 0");
        // A second one-GPU job waits: GPU 1 is busy and GPU 0 is out.
        let b = submit(&s, &hold).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(state(&s, b).await, JobState::Queued);
        // Reads that succeed are not a recovery; a reset reported by the source is.
        nvml.update(|st| st.devices.get_mut(&addrs[0]).unwrap().reset = true);
        until("b to run on GPU 0", async || {
            (state(&s, b).await == JobState::Running).then_some(())
        })
        .await;
        assert_eq!(s.store.tasks(b).await.unwrap()[0].devices, [0]);
        std::fs::write(&gate, "").unwrap();
        for id in [a, b] {
            until("both to succeed", async || {
                (state(&s, id).await == JobState::Succeeded).then_some(())
            })
            .await;
        }
    }
}
