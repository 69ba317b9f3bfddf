//! The job engine as a state machine: given the time and an [`Input`], it changes its state
//! and returns the [`Effect`]s to carry out. It reads no clock, opens no file or socket and
//! starts no process; the driver ([`super::Engine`]) does all of that, and tells it what came
//! of it as further inputs (a task started, exited, or could not start).
//!
//! What it holds: the active jobs in memory, each queued in `xpu-sched` (the node is a one-node
//! cluster), the tasks the scheduler placed, in-place restarts waiting out their back-off, and
//! jobs ending (their tasks being stopped, SIGTERM then SIGKILL). A job that ends is drained:
//! its devices stay held until its last process has exited, so nothing new lands on a device
//! still in use during the grace period.
//!
//! Its clocks are the driver's [`Now`]: the monotonic part times kills, restarts and the
//! scheduler (whole seconds); the wall-clock part is what the store records and what
//! `activeDeadlineSeconds` counts from (the job's recorded first start, so a daemon restart does
//! not reset it).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use xpu_core::job::{JobSpec, RestartPolicy};
use xpu_core::{DeviceKind, PciAddress};
use xpu_sched::scheduler::{Decision, JobId, QueuePolicy, SchedError, Scheduler, SchedulerConfig};
use xpu_sched::{Cluster, NodeSpec, TaskRef};

use super::Msg;
use super::env::{downward_files, task_argv, task_env, why_never};
use crate::container::{self, ContainerLaunch};
use crate::executor::{self, Launch, Sig};
use crate::node::Node;
use crate::store::{JobRow, JobState, TaskRow, TaskState, Write};
use crate::view::{Holder, QUEUE_VIEW, QueuedView, RunningView, TaskView, View};

/// The time an input happens at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Since the engine started (monotonic).
    pub mono: Duration,
    /// Milliseconds since the Unix epoch.
    pub wall_ms: i64,
}

impl Now {
    /// The scheduler's clock: whole seconds since the engine started.
    fn secs(self) -> u64 {
        self.mono.as_secs()
    }
}

/// What the machine is told.
#[derive(Debug)]
pub enum Input {
    /// From the API or from a task's watcher.
    Msg(Msg),
    /// A job read from the store (submitted or cancelled through another daemon).
    Loaded(Box<StoredJob>),
    /// This daemon became the leader: what the store and the process table hold.
    Recovered(Box<Recovery>),
    /// Another daemon holds the leadership now: everything in memory is dropped (running
    /// tasks go on; the new leader re-adopts them).
    LeadershipLost,
    /// Deadlines and SIGKILL escalation.
    Tick,
    /// A scheduling pass: devices telemetry reports unhealthy first (by PCI address, with the
    /// reason; `None` without telemetry), then restarts and the scheduler's decisions.
    Pass { unhealthy: Option<BTreeMap<PciAddress, String>> },
}

/// What the driver read at a takeover.
#[derive(Debug, Default)]
pub struct Recovery {
    pub jobs: Vec<RecoveredJob>,
    /// Every task the store records as starting or running, in any job.
    pub tasks: Vec<FoundTask>,
}

/// A job read from the store.
#[derive(Debug)]
pub struct StoredJob {
    pub row: JobRow,
    /// The error when the stored spec cannot be read.
    pub spec: Result<JobSpec, String>,
    /// Cancellation was requested.
    pub cancel: bool,
}

/// One active job at a takeover.
#[derive(Debug)]
pub struct RecoveredJob {
    pub row: JobRow,
    pub spec: Result<JobSpec, String>,
    /// All its tasks, ended ones too: which indices succeeded, which attempt comes next.
    pub history: Vec<TaskRow>,
    pub cancel: bool,
}

/// A task recorded as running, and what became of its supervisor.
#[derive(Debug)]
pub struct FoundTask {
    pub row: TaskRow,
    /// Its supervisor's pid, from the store or the task directory.
    pub pid: Option<i32>,
    /// Whether that pid is still this task's supervisor.
    pub alive: bool,
    /// The exit status the supervisor recorded, for one that is gone.
    pub exit: Option<i32>,
}

/// What the driver carries out.
#[derive(Debug)]
pub enum Effect {
    /// A store write, queued in order (events, job and task rows).
    Write(Write),
    /// Record `row` durably, then start the task (or report `launch`'s error as a failed
    /// start), then report [`Msg::Started`] and [`Msg::Exited`].
    Spawn {
        row: TaskRow,
        launch: Result<Box<Launch>, String>,
    },
    /// A signal to a task's supervisor, or to its whole process group.
    Signal {
        pid: i32,
        sig: Sig,
        group: bool,
    },
    /// The container runtime on a task's containers: `kill KILL`, `delete -f`.
    Runtime {
        container: ContainerLaunch,
        args: &'static [&'static str],
    },
    /// A task's memory volume, unmounted lazily if it is still a mount point.
    Unmount(PathBuf),
    /// Watch a re-adopted supervisor (not the daemon's child) until it is gone, then report
    /// the exit status it recorded in `dir`.
    Watch {
        job: i64,
        idx: u32,
        attempt: u32,
        /// The GPU (UUID) whose MPS daemon the task is a client of: counted again, and let go
        /// of when the task ends.
        mps_gpu: Option<String>,
        pid: i32,
        dir: PathBuf,
    },
    Metric(Metric),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Metric {
    TaskStarted,
    TaskFailed,
    /// Seconds a job waited from submission to its first start.
    QueueWait(f64),
}

/// What the machine needs to know of the daemon.
#[derive(Debug, Clone)]
pub struct Config {
    pub node: Node,
    pub data_dir: PathBuf,
    /// Time between SIGTERM and SIGKILL when stopping a task.
    pub grace: Duration,
    /// The first in-place restart back-off (doubled per restart).
    pub restart_backoff: Duration,
    /// The runtime shim containerised tasks run through.
    pub runtime: Vec<OsString>,
    /// Where the MPS daemons' directories are (`xpu serve --mps-dir`): a task with a share of
    /// an NVIDIA GPU is then a client of that GPU's daemon, limited to its share.
    pub mps: Option<PathBuf>,
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
    kill_at: Option<Duration>,
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
    /// The kubelet's crash-loop back-off: not started again before this (monotonic).
    not_before: Duration,
}

/// Longest wait before an in-place restart, and how long a task must run for its back-off to
/// start again from the first step: the kubelet's 5 minutes and twice that.
const MAX_RESTART_BACKOFF: Duration = Duration::from_secs(300);
const BACKOFF_RESET_MS: i64 = 600_000;
/// Between SIGKILLs to a task that has not exited.
const KILL_AGAIN: Duration = Duration::from_secs(5);
/// Queued jobs whose reason to wait is worked out on each pass (the dashboard shows the head).
const EXPLAINED: usize = 50;

#[derive(Debug)]
pub(super) struct Job {
    pub(super) id: i64,
    pub(super) name: String,
    queue: String,
    priority: i64,
    pub(super) spec: JobSpec,
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
    pub(super) milli: u16,
    /// Who it runs as ([`crate::store::Owner`]); `None`: the daemon's own user.
    pub(super) owner: Option<crate::store::Owner>,
    /// `TPU_WORKER_HOSTNAMES` of an Indexed job, made once for all its tasks.
    pub(super) worker_hostnames: std::sync::OnceLock<String>,
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
            owner: row.owner,
            worker_hostnames: std::sync::OnceLock::new(),
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

/// The engine's state. See the module documentation.
pub struct Machine {
    config: Config,
    jobs: BTreeMap<i64, Job>,
    sched: Scheduler,
    /// Scheduler job id to job id.
    by_sched: HashMap<JobId, i64>,
    /// Scheduler device index to node device id, and back.
    dev_ids: Vec<Option<u32>>,
    sched_idx: Vec<Option<u16>>,
    /// Devices telemetry reports unhealthy (node device id), each held in the scheduler by a
    /// placeholder job pinned to it so nothing new is placed there ([`Machine::apply_health`]).
    health_holds: BTreeMap<u32, JobId>,
    /// Unhealthy devices whose hold the scheduler refused, said once each.
    hold_refused: BTreeSet<u32>,
    /// Jobs kept out of the scheduler because their required pod (anti-)affinity, or a placed
    /// job's, does not allow them on the host yet ([`Machine::affinity_blocks`]), in
    /// submission order; tried again at every pass.
    affinity_held: BTreeSet<i64>,
    /// Broken scheduler invariants already logged.
    broken_reported: u64,
    history: VecDeque<(i64, u32)>,
    /// Something changed since the last pass and view.
    dirty: bool,
    /// Effects of the input being applied.
    out: Vec<Effect>,
}

impl Machine {
    pub fn new(config: Config) -> Result<Machine, SchedError> {
        let sched = scheduler_for(&config.node.sched)?;
        let dev_ids = config.node.sched_device_ids();
        let mut sched_idx = vec![None; config.node.devices.len()];
        for (i, id) in dev_ids.iter().enumerate() {
            if let Some(id) = id
                && let Some(s) = sched_idx.get_mut(*id as usize)
            {
                *s = u16::try_from(i).ok();
            }
        }
        Ok(Machine {
            config,
            jobs: BTreeMap::new(),
            sched,
            by_sched: HashMap::new(),
            dev_ids,
            sched_idx,
            health_holds: BTreeMap::new(),
            hold_refused: BTreeSet::new(),
            affinity_held: BTreeSet::new(),
            broken_reported: 0,
            history: VecDeque::new(),
            dirty: true,
            out: Vec::new(),
        })
    }

    /// Applies one input; returns what to carry out, in order.
    pub fn step(&mut self, now: Now, input: Input) -> Vec<Effect> {
        match input {
            Input::Msg(m) => self.handle(now, m),
            Input::Loaded(job) => {
                let StoredJob { row, spec, cancel } = *job;
                if self.admit(now, &row, spec) {
                    self.register(now, row.id);
                    if cancel {
                        self.cancel(now, row.id);
                    }
                }
            }
            Input::Recovered(r) => self.recover(now, *r),
            Input::LeadershipLost => {
                self.jobs.clear();
                self.fresh_scheduler();
            }
            Input::Tick => self.tick(now),
            Input::Pass { unhealthy } => {
                if let Some(bad) = unhealthy {
                    self.apply_health(now, &bad);
                }
                self.schedule(now);
            }
        }
        std::mem::take(&mut self.out)
    }

    /// Whether a job is in memory (queued, running or ending).
    pub fn knows(&self, id: i64) -> bool {
        self.jobs.contains_key(&id)
    }

    /// Whether a job in memory is ending (so a cancel has nothing left to do).
    pub fn is_ending(&self, id: i64) -> bool {
        self.jobs.get(&id).is_some_and(|j| j.ending.is_some())
    }

    /// Whether the next pass has anything to do.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Jobs the scheduler holds.
    pub fn live_jobs(&self) -> usize {
        self.sched.live_jobs()
    }

    /// How long until the scheduler's own next event (none without flex-start pools).
    pub fn next_wakeup(&self, now: Now) -> Option<Duration> {
        self.sched.next_wakeup().map(|t| Duration::from_secs(t.saturating_sub(now.secs())))
    }

    fn event(&mut self, now: Now, job: Option<i64>, kind: &str, message: String) {
        self.out.push(Effect::Write(Write::Event {
            at_ms: now.wall_ms,
            job_id: job,
            kind: kind.to_owned(),
            message,
        }));
    }

    fn set_job(&mut self, now: Now, id: i64, state: JobState, failures: i64, message: String) {
        self.out.push(Effect::Write(Write::SetJob {
            id,
            state,
            at_ms: now.wall_ms,
            failures,
            message: Some(message),
        }));
    }

    /// Forgets every job the scheduler holds (the caller re-registers what is active).
    fn fresh_scheduler(&mut self) {
        if let Ok(s) = scheduler_for(&self.config.node.sched) {
            self.sched = s;
        }
        self.by_sched.clear();
        // The placeholders went with the old scheduler; the next pass holds the devices again.
        self.health_holds.clear();
        self.broken_reported = 0;
        self.dirty = true;
    }

    /// Takes devices that telemetry reports unhealthy out of placement, and gives them back
    /// when it reports them healthy. A device busy with a task is left to it (the task's own
    /// errors end it) and held as soon as it is free: before the next placement, since this
    /// runs first in each pass.
    fn apply_health(&mut self, now: Now, bad: &BTreeMap<PciAddress, String>) {
        let t = now.secs();
        for i in 0..self.config.node.devices.len() {
            let dev = &self.config.node.devices[i];
            let (id, kind, address) = (dev.id, dev.kind, dev.address.clone());
            let reason = address.parse().ok().and_then(|a| bad.get(&a)).cloned();
            match (reason, self.health_holds.get(&id).copied()) {
                (Some(reason), None) => {
                    let Some(si) = self.sched_idx.get(id as usize).copied().flatten() else {
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
                    let task = TaskRef { group: 0, index: 0 };
                    match self.sched.adopt(health_hold(kind), &[(task, 0, vec![si])], t) {
                        Ok(jid) => {
                            self.health_holds.insert(id, jid);
                            let m = format!(
                                "device {address} is unhealthy ({reason}); no new work is placed on it"
                            );
                            self.event(now, None, "device-unhealthy", m);
                            self.dirty = true;
                        }
                        // The device was free, so this is not expected; the adoption left
                        // nothing allocated, and it is tried again next pass. Said once.
                        Err(e) => {
                            if self.hold_refused.insert(id) {
                                let m = format!(
                                    "device {address} is unhealthy ({reason}) but could not be taken out of placement: {e}"
                                );
                                self.event(now, None, "device-unhealthy", m);
                            }
                        }
                    }
                }
                (None, Some(jid)) => {
                    self.health_holds.remove(&id);
                    self.hold_refused.remove(&id);
                    match self.sched.finish(jid, t) {
                        Ok(()) => self.forget(now, jid),
                        Err(e) => {
                            let m = format!("releasing the hold on device {address}: {e}");
                            self.event(now, None, "device-healthy", m);
                        }
                    }
                    let m = format!("device {address} is healthy again; it takes work");
                    self.event(now, None, "device-healthy", m);
                    self.dirty = true;
                }
                (None, None) => {
                    self.hold_refused.remove(&id);
                }
                (Some(_), Some(_)) => {}
            }
        }
    }

    /// Rebuilds the in-memory state and the scheduler from what the store holds after a start
    /// or a takeover: running tasks whose supervisor is alive are re-adopted onto their
    /// devices; those that are gone count with the status they recorded (else as failed) and
    /// are retried per their job's policy.
    fn recover(&mut self, now: Now, r: Recovery) {
        self.jobs.clear();
        self.fresh_scheduler();
        let mut ids = Vec::new();
        let mut cancels = Vec::new();
        for j in r.jobs {
            let id = j.row.id;
            if !self.admit(now, &j.row, j.spec) {
                continue;
            }
            ids.push(id);
            if j.cancel {
                cancels.push(id);
            }
            // Succeeded indices and attempt numbers come from the job's full task list.
            let Some(job) = self.jobs.get_mut(&id) else { continue };
            for t in &j.history {
                let i = t.idx as usize;
                if i < job.idx.len() {
                    job.next_attempt[i] = job.next_attempt[i].max(t.attempt as u32 + 1);
                    if t.state == TaskState::Succeeded {
                        job.set(i as u32, Idx::Done);
                    }
                }
            }
        }
        let mut dead = Vec::new();
        for f in r.tasks {
            let t = &f.row;
            let (idx, attempt) = (t.idx as u32, t.attempt as u32);
            let container = self.container_for(t.job_id, idx, attempt);
            let Some(job) = self.jobs.get_mut(&t.job_id) else {
                // The job already ended; a leftover process is stopped.
                if let Some(pid) = f.pid.filter(|_| f.alive) {
                    self.out.push(Effect::Signal { pid, sig: Sig::KILL, group: true });
                }
                continue;
            };
            // Whatever the history said, the next attempt comes after this one.
            if let Some(n) = job.next_attempt.get_mut(idx as usize) {
                *n = (*n).max(attempt + 1);
            }
            let Some(pid) = f.pid.filter(|_| f.alive) else {
                dead.push(f);
                continue;
            };
            job.set(idx, Idx::Active);
            let in_container = container.is_some();
            let mps = self
                .config
                .mps
                .as_ref()
                .map(|dir| mps_client(&self.config.node, job, &t.devices, dir, in_container));
            let (mps_gpu, mps_error) = match mps {
                None | Some(Ok(None)) => (None, None),
                Some(Ok(Some(m))) => (Some(m.gpu), None),
                Some(Err(e)) => (None, Some(e)),
            };
            job.tasks.push(Task::recovered(t, Some(pid), container));
            // Recorded as running under its pid (a crash may have come before that).
            let row = TaskRow { state: TaskState::Running, pid: Some(i64::from(pid)), ..t.clone() };
            let (job_id, dir) = (t.job_id, PathBuf::from(&t.dir));
            self.out.push(Effect::Write(Write::Task(row)));
            let m = format!("task {idx} attempt {attempt} (pid {pid}) re-adopted after restart");
            self.event(now, Some(job_id), "adopted", m);
            if let Some(e) = mps_error {
                let m =
                    format!("task {idx} is not counted as a client of its GPU's MPS daemon: {e}");
                self.event(now, Some(job_id), "mps", m);
            }
            self.out.push(Effect::Watch { job: job_id, idx, attempt, mps_gpu, pid, dir });
        }
        // Into the scheduler, running tasks on the devices they hold.
        for &id in &ids {
            self.register(now, id);
        }
        for id in cancels {
            self.cancel(now, id);
        }
        // Tasks that did not survive: their recorded exit status when the supervisor wrote
        // one, else failed; then retried per the job's policy.
        for f in dead {
            let t = &f.row;
            let (idx, attempt) = (t.idx as u32, t.attempt as u32);
            let container = self.container_for(t.job_id, idx, attempt);
            let Some(job) = self.jobs.get_mut(&t.job_id) else { continue };
            job.set(idx, Idx::Active);
            job.tasks.push(Task::recovered(t, f.pid, container));
            if f.exit.is_none() {
                let m = format!(
                    "task {idx} attempt {attempt} was not running after restart; counted as failed"
                );
                self.event(now, Some(t.job_id), "lost", m);
            }
            self.ended(now, t.job_id, idx, attempt, f.exit, None);
        }
        self.dirty = true;
    }

    /// Takes one job read from the store into memory (unless already there or ended), not yet
    /// scheduled; a job whose stored spec cannot be read fails.
    fn admit(&mut self, now: Now, row: &JobRow, spec: Result<JobSpec, String>) -> bool {
        if self.jobs.contains_key(&row.id) || row.state.is_terminal() {
            return false;
        }
        self.dirty = true;
        match spec {
            Ok(spec) => {
                self.jobs.insert(row.id, Job::from_row(row, spec));
                true
            }
            Err(e) => {
                let message = format!("stored spec is unreadable: {e}");
                self.finish_job_now(now, row.id, JobState::Failed, message, 0);
                false
            }
        }
    }

    /// Gives a job to the scheduler: its slots, with the tasks it already runs (and the
    /// in-place restarts it holds devices for) adopted onto their devices.
    fn register(&mut self, now: Now, id: i64) {
        if let Err(message) = self.try_register(now, id) {
            self.end_job(now, id, JobState::Failed, message);
        }
    }

    fn try_register(&mut self, now: Now, id: i64) -> Result<(), String> {
        let t = now.secs();
        let Some(job) = self.jobs.get_mut(&id) else { return Ok(()) };
        let remaining = job.idx.iter().filter(|s| **s != Idx::Done).count() as u32;
        if remaining == 0 && job.tasks.is_empty() && job.restarts.is_empty() {
            // Every index succeeded before a restart, but the job was not yet marked.
            let n = job.spec.completions;
            let m = format!("{n} of {n} completions succeeded");
            self.end_job(now, id, JobState::Succeeded, m);
            return Ok(());
        }
        let fresh = job.tasks.is_empty() && job.restarts.is_empty();
        if fresh && let Some(why) = self.affinity_blocks(id) {
            if let Some(job) = self.jobs.get_mut(&id) {
                job.reason = format!("waiting for the host's pods to allow it: {why}");
            }
            self.affinity_held.insert(id);
            return Ok(());
        }
        let node = &self.config.node;
        let Some(job) = self.jobs.get_mut(&id) else { return Ok(()) };
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
        if let Some((field, message)) = super::env::too_big_for_host(&job.spec) {
            return Err(format!("{field}: {message}"));
        }
        if let Some(why) = job.spec.never_fits(&node.name, &node.labels) {
            return Err(format!("never fits this node: {why}"));
        }
        let count = job
            .spec
            .tasks_at_once(&node.labels)
            .min(super::env::MAX_TASKS_ON_HOST)
            .min(remaining)
            .max(adopted)
            .max(1);
        let fresh = job.started_ms.is_none() && adopted == 0 && remaining == job.spec.completions;
        sj.groups[0].count = count;
        sj.groups[0].gang = job.spec.is_gang() && fresh;
        let result = if running.is_empty() {
            self.sched.submit(sj.clone(), t)
        } else {
            self.sched.adopt(sj.clone(), &running, t)
        };
        let sid = match result {
            Ok(sid) => sid,
            Err(e) if !running.is_empty() => {
                // Its tasks run on, outside the scheduler's books; what it needs next queues.
                self.out.push(Effect::Write(Write::Event {
                    at_ms: now.wall_ms,
                    job_id: Some(id),
                    kind: "adopt-failed".to_owned(),
                    message: format!(
                        "running tasks could not be placed back on their devices: {e}"
                    ),
                }));
                for t in &mut job.tasks {
                    t.slot = None;
                }
                for r in std::mem::take(&mut job.restarts) {
                    job.set(r.idx, Idx::Pending);
                }
                self.sched.submit(sj, t).map_err(|e| format!("not schedulable: {e}"))?
            }
            Err(e) => return Err(format!("not schedulable: {e}")),
        };
        job.sched = Some(sid);
        let held = job.tasks.iter().filter(|t| t.slot.is_some()).count() + job.restarts.len();
        job.waiting_slots = count.saturating_sub(held as u32);
        let ending = job.ending.is_some();
        self.by_sched.insert(sid, id);
        if ending {
            self.drain(sid, t);
        }
        Ok(())
    }

    /// Why job `id` may not be placed on the host while the jobs the scheduler holds (running,
    /// or placed any moment) are there: kube-scheduler's inter-pod affinity filter
    /// ([`xpu_core::affinity::pod_fits`]) with the host as the one topology domain, each job
    /// seen as its first task's pod. The job's own tasks are its `tasks_at_once` bound's
    /// business, not this. `None` when it may.
    fn affinity_blocks(&self, id: i64) -> Option<String> {
        use xpu_core::affinity::{PodRef, pod_fits};
        let job = self.jobs.get(&id)?;
        let has_terms = |a: &xpu_core::affinity::Affinity| {
            !a.pod_affinity.is_empty() || !a.pod_anti_affinity.is_empty()
        };
        let incoming_terms = has_terms(&job.spec.affinity);
        // Only what can decide: every placed job when this one has terms, else those whose
        // anti-affinity could keep it out.
        let others: Vec<&Job> = self
            .jobs
            .values()
            .filter(|j| j.id != id && j.sched.is_some() && j.ending.is_none())
            .filter(|j| incoming_terms || !j.spec.affinity.pod_anti_affinity.is_empty())
            .collect();
        if !incoming_terms && others.is_empty() {
            return None;
        }
        let labels_of = |j: &Job| j.spec.pod_labels(0, &super::env::controller_uid(j.id));
        let other_labels: Vec<_> = others.iter().map(|j| labels_of(j)).collect();
        let running: Vec<PodRef<'_>> = others
            .iter()
            .zip(&other_labels)
            .map(|(j, labels)| PodRef {
                namespace: j.spec.pod_namespace(),
                labels,
                affinity: &j.spec.affinity,
            })
            .collect();
        let labels = labels_of(job);
        let incoming = PodRef {
            namespace: job.spec.pod_namespace(),
            labels: &labels,
            affinity: &job.spec.affinity,
        };
        pod_fits(&self.config.node.labels, &incoming, &running).err()
    }

    /// Gives the scheduler each held job that the host's pods now allow, oldest first.
    fn release_affinity_held(&mut self, now: Now) {
        let held: Vec<i64> = self.affinity_held.iter().copied().collect();
        for id in held {
            let gone = self.jobs.get(&id).is_none_or(|j| j.ending.is_some() || j.sched.is_some());
            if gone {
                self.affinity_held.remove(&id);
                continue;
            }
            if self.affinity_blocks(id).is_none() {
                self.affinity_held.remove(&id);
                self.register(now, id);
            }
        }
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
        let data = &self.config.data_dir;
        let id = container::container_id(data, job_id, idx, attempt);
        let steps = (0..job.spec.init_containers.len()).map(|n| format!("{id}-i{n}")).collect();
        Some(ContainerLaunch {
            runtime: self.config.runtime.clone(),
            state_dir: data.join("runc"),
            id,
            source,
            hostname: self.config.node.hostname.clone(),
            steps,
        })
    }

    fn handle(&mut self, now: Now, m: Msg) {
        self.dirty = true;
        match m {
            Msg::Submitted { row, spec } => {
                if self.admit(now, &row, Ok(*spec)) {
                    self.register(now, row.id);
                }
            }
            Msg::Cancel(id) => self.cancel(now, id),
            Msg::Started { job, idx, attempt, pid } => {
                let grace = self.config.grace;
                if let Some(j) = self.jobs.get_mut(&job)
                    && let Some(t) =
                        j.tasks.iter_mut().find(|t| t.idx == idx && t.attempt == attempt)
                {
                    t.pid = Some(pid);
                    if j.ending.is_some() {
                        self.out.push(Effect::Signal { pid, sig: Sig::TERM, group: false });
                        t.kill_at = Some(now.mono + grace);
                    }
                }
            }
            Msg::Exited { job, idx, attempt, code } => {
                self.ended(now, job, idx, attempt, code, None)
            }
            Msg::StartFailed { job, idx, attempt, error } => {
                self.event(now, Some(job), "start-failed", error.clone());
                self.ended(now, job, idx, attempt, None, Some(&error));
                if let Some(j) = self.jobs.get_mut(&job) {
                    j.reason = error;
                }
            }
        }
    }

    fn cancel(&mut self, now: Now, id: i64) {
        if self.jobs.contains_key(&id) && !self.is_ending(id) {
            self.end_job(now, id, JobState::Cancelled, "cancelled by request".to_owned());
        }
    }

    /// Moves a job to a terminal state: records it, and stops its tasks (SIGTERM now, SIGKILL
    /// after the grace period). The scheduler keeps their devices held until each has exited;
    /// the job leaves memory when its last task has.
    fn end_job(&mut self, now: Now, id: i64, state: JobState, message: String) {
        let grace = self.config.grace;
        let t = now.secs();
        let Some(job) = self.jobs.get_mut(&id) else { return };
        job.ending = Some((state, message.clone()));
        job.state = state;
        let restarts: Vec<Restart> = std::mem::take(&mut job.restarts);
        let failures = job.failures;
        for task in &mut job.tasks {
            if let Some(pid) = task.pid {
                self.out.push(Effect::Signal { pid, sig: Sig::TERM, group: false });
            }
            task.kill_at = Some(now.mono + grace);
        }
        if let Some(sid) = job.sched {
            self.drain(sid, t);
            for r in restarts {
                self.finish_task(sid, r.slot, t);
            }
        }
        self.set_job(now, id, state, failures, message.clone());
        self.event(now, Some(id), state.as_str(), format!("job {id} {state}: {message}"));
        self.dirty = true;
        self.reap(now, id);
    }

    /// Records a terminal state for a job that never had tasks in memory.
    fn finish_job_now(&mut self, now: Now, id: i64, state: JobState, message: String, fails: i64) {
        self.set_job(now, id, state, fails, message.clone());
        self.event(now, Some(id), state.as_str(), format!("job {id} {state}: {message}"));
    }

    /// Drops an ending job once none of its tasks is left.
    fn reap(&mut self, now: Now, id: i64) {
        if let Some(job) = self.jobs.get(&id)
            && job.ending.is_some()
            && job.tasks.is_empty()
        {
            let sid = job.sched;
            self.jobs.remove(&id);
            if let Some(sid) = sid {
                self.by_sched.remove(&sid);
                self.forget(now, sid);
            }
        }
    }

    /// The scheduler drops a job the engine is done with (cancelled first if it still holds
    /// or waits for anything), so its memory follows the live jobs and it never needs
    /// rebuilding.
    fn forget(&mut self, now: Now, sid: JobId) {
        if self.sched.job(sid).is_some_and(|j| !j.status.is_done())
            && let Err(e) = self.sched.cancel(sid, now.secs())
        {
            tracing::warn!(sched_job = sid, error = %e, "scheduler: cancelling a reaped job failed");
        }
        if let Err(e) = self.sched.forget(sid) {
            tracing::warn!(sched_job = sid, error = %e, "scheduler: forgetting an ended job failed");
        }
    }

    /// The scheduler stops placing a job's waiting slots; what runs keeps its devices.
    fn drain(&mut self, sid: JobId, t: u64) {
        if let Err(e) = self.sched.drain(sid, t) {
            tracing::warn!(sched_job = sid, error = %e, "scheduler: draining an ending job failed");
        }
    }

    /// A slot is done: its devices go back to the scheduler.
    fn finish_task(&mut self, sid: JobId, slot: u32, t: u64) {
        let task = TaskRef { group: 0, index: slot };
        if let Err(e) = self.sched.finish_task(sid, task, t) {
            tracing::warn!(sched_job = sid, slot, error = %e, "scheduler: finishing a slot failed");
        }
    }

    /// A slot whose task ended: queued again when the job has an index waiting for it (the
    /// next completion, or a retry), otherwise finished.
    fn release_slot(&mut self, now: Now, id: i64, slot: Option<u32>) {
        let t = now.secs();
        let Some(slot) = slot else { return };
        let Some(job) = self.jobs.get_mut(&id) else { return };
        let Some(sid) = job.sched else { return };
        if job.ending.is_none() && job.pending > job.waiting_slots {
            match self.sched.requeue_task(sid, TaskRef { group: 0, index: slot }, t) {
                Ok(()) => job.waiting_slots += 1,
                Err(e) => {
                    tracing::warn!(job_id = id, slot, error = %e, "scheduler: re-queueing a slot failed");
                }
            }
        } else {
            self.finish_task(sid, slot, t);
        }
    }

    /// A task attempt that ended: with its exit status (`None` when it could not be learned),
    /// or with the error that kept it from starting.
    fn ended(
        &mut self,
        now: Now,
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
        self.dirty = true;
        let task = job.tasks.remove(pos);
        let ok = code == Some(0);
        let state = if job.ending.as_ref().is_some_and(|(s, _)| *s == JobState::Cancelled) {
            TaskState::Cancelled
        } else if ok {
            TaskState::Succeeded
        } else {
            TaskState::Failed
        };
        self.out.push(Effect::Write(Write::Task(TaskRow {
            job_id,
            idx: i64::from(idx),
            attempt: i64::from(attempt),
            state,
            node: self.config.node.name.clone(),
            devices: task.devices.clone(),
            pid: task.pid.map(i64::from),
            started_at_ms: task.started_ms,
            finished_at_ms: Some(now.wall_ms),
            exit_code: code.map(i64::from),
            dir: task.dir.display().to_string(),
        })));
        if let Some(c) = task.container.clone() {
            // `runc run` deletes its container when it exits; one killed with it is not.
            self.out.push(Effect::Runtime { container: c, args: &["delete", "-f"] });
        }
        // A task killed outright (SIGKILL) leaves its memory volumes mounted: unmounted, lazily,
        // so nothing holds the memory after the task.
        for v in job.spec.volumes.iter().filter(|v| v.memory) {
            self.out.push(Effect::Unmount(task.dir.join("volumes").join(&v.name)));
        }
        if job.ending.is_some() {
            self.release_slot(now, job_id, task.slot);
            self.reap(now, job_id);
            return;
        }
        let always = job.spec.restart_policy == RestartPolicy::Always;
        if ok && !always {
            job.set(idx, Idx::Done);
            let all = job.all_done();
            let n = job.spec.completions;
            self.release_slot(now, job_id, task.slot);
            if all {
                let m = format!("{n} of {n} completions succeeded");
                self.end_job(now, job_id, JobState::Succeeded, m);
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
            self.out.push(Effect::Metric(Metric::TaskFailed));
            job.failures += 1;
        }
        let (failures, limit) = (job.failures, i64::from(job.spec.backoff_limit));
        let unbounded = always || job.spec.backoff_limit == u32::MAX;
        let state = job.state;
        // Kubernetes: the Job fails once failures exceed backoffLimit.
        if failures > limit {
            self.event(now, Some(job_id), "task-failed", msg.clone());
            self.release_slot(now, job_id, task.slot);
            let m = format!("{msg}; backoffLimit {limit} reached (BackoffLimitExceeded)");
            self.end_job(now, job_id, JobState::Failed, m);
            return;
        }
        let next = match (job.spec.restart_policy, task.slot) {
            // Restarted in place: keeps its slot, so its devices, after the kubelet's back-off
            // (base, doubled per restart, at most 5 minutes; back to the base once a run lasted
            // 10 minutes).
            (RestartPolicy::OnFailure | RestartPolicy::Always, Some(slot)) => {
                let loops = job.crash_loops.entry(idx).or_insert(0);
                if now.wall_ms - task.started_ms >= BACKOFF_RESET_MS {
                    *loops = 0;
                }
                let delay = self
                    .config
                    .restart_backoff
                    .saturating_mul(1u32 << (*loops).min(16))
                    .min(MAX_RESTART_BACKOFF);
                *loops = loops.saturating_add(1);
                job.restarts.push(Restart {
                    idx,
                    slot,
                    devices: task.devices.clone(),
                    not_before: now.mono + delay,
                });
                format!("restarting in place in {} s", delay.as_secs_f64())
            }
            // A new attempt, placed anew (Kubernetes makes a new pod).
            _ => {
                job.set(idx, Idx::Pending);
                self.release_slot(now, job_id, task.slot);
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
        self.event(now, Some(job_id), kind, detail);
        self.set_job(now, job_id, state, failures, msg);
    }

    /// Deadlines and SIGKILL escalation.
    fn tick(&mut self, now: Now) {
        let mut expired = Vec::new();
        for job in self.jobs.values_mut() {
            for t in &mut job.tasks {
                if let (Some(at), Some(pid)) = (t.kill_at, t.pid)
                    && now.mono >= at
                {
                    // A container's processes are in their own session, out of the group's
                    // reach: runc kills them, and runc exits with them. The group follows
                    // next time if anything is still there.
                    if let Some(c) = t.container.clone() {
                        self.out.push(Effect::Runtime { container: c, args: &["kill", "KILL"] });
                    }
                    if t.container.is_none() || t.kills > 0 {
                        self.out.push(Effect::Signal { pid, sig: Sig::KILL, group: true });
                    }
                    t.kills = t.kills.saturating_add(1);
                    t.kill_at = Some(now.mono + KILL_AGAIN);
                }
            }
            // activeDeadlineSeconds counts from the job's first start, as recorded in the
            // store, so a daemon restart does not reset it.
            if job.ending.is_none()
                && let (Some(d), Some(start)) = (job.spec.active_deadline_seconds, job.started_ms)
                && now.wall_ms - start > (d as i64).saturating_mul(1000)
            {
                expired.push((job.id, d));
            }
        }
        for (id, d) in expired {
            let m = format!("activeDeadlineSeconds {d} exceeded (DeadlineExceeded)");
            self.end_job(now, id, JobState::Failed, m);
        }
        self.dirty = true;
    }

    /// One scheduling pass: restarts in place, then what the scheduler decides.
    fn schedule(&mut self, now: Now) {
        if !self.dirty {
            return;
        }
        if !self.affinity_held.is_empty() {
            self.release_affinity_held(now);
        }
        // Restarts in place first: they already hold their devices. Those still in their
        // back-off wait; the tick brings the loop back here.
        let mut restarts: Vec<(i64, Restart)> = Vec::new();
        for j in self.jobs.values_mut() {
            let (due, later): (Vec<Restart>, Vec<Restart>) =
                j.restarts.drain(..).partition(|r| r.not_before <= now.mono);
            j.restarts = later;
            restarts.extend(due.into_iter().map(|r| (j.id, r)));
        }
        for (id, r) in restarts {
            self.start(now, id, r.idx, Some(r.slot), r.devices);
        }
        for d in self.sched.schedule(now.secs()) {
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
                        self.placed(now, job, t.task, devices);
                    }
                }
                Decision::Fail { job, error } => {
                    if let Some(&id) = self.by_sched.get(&job) {
                        let detail =
                            self.jobs.get(&id).and_then(|j| why_never(&self.config.node, &j.spec));
                        let detail = detail.map(|d| format!(" ({d})")).unwrap_or_default();
                        let m = format!("unschedulable on this node: {error}{detail}");
                        self.end_job(now, id, JobState::Failed, m);
                    }
                }
                // Not configured (no preemption, deadlines, or flex-start pools), so not expected;
                // a stop is treated as the end of the job rather than ignored.
                Decision::Preempt { job, .. } | Decision::Stop { job, .. } => {
                    if let Some(&id) = self.by_sched.get(&job) {
                        let m = "stopped by the scheduler".to_owned();
                        self.end_job(now, id, JobState::Failed, m);
                    }
                }
                Decision::Provision { .. } | Decision::Release { .. } => {}
            }
        }
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
    fn placed(&mut self, now: Now, sid: JobId, task: TaskRef, devices: Vec<u32>) {
        let Some(&id) = self.by_sched.get(&sid) else {
            self.finish_task(sid, task.index, now.secs());
            return;
        };
        let Some(job) = self.jobs.get_mut(&id) else { return };
        job.waiting_slots = job.waiting_slots.saturating_sub(1);
        let idx = if job.ending.is_some() { None } else { job.take_pending() };
        match idx {
            Some(idx) => self.start(now, id, idx, Some(task.index), devices),
            None => self.finish_task(sid, task.index, now.secs()),
        }
    }

    /// Starts one attempt on the given devices: the driver records it durably, then spawns it.
    fn start(&mut self, now: Now, job_id: i64, idx: u32, slot: Option<u32>, devices: Vec<u32>) {
        let Some(attempt) =
            self.jobs.get(&job_id).and_then(|j| j.next_attempt.get(idx as usize).copied())
        else {
            return;
        };
        let container = self.container_for(job_id, idx, attempt);
        let config = &self.config;
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        job.next_attempt[idx as usize] += 1;
        let at = now.wall_ms;
        if job.started_ms.is_none() {
            job.started_ms = Some(at);
            let wait = (at - job.submitted_ms).max(0) as f64 / 1000.0;
            self.out.push(Effect::Metric(Metric::QueueWait(wait)));
        }
        if job.state == JobState::Queued {
            job.state = JobState::Running;
            self.out.push(Effect::Write(Write::SetJob {
                id: job_id,
                state: JobState::Running,
                at_ms: at,
                failures: job.failures,
                message: None,
            }));
        }
        job.reason.clear();
        let dir = executor::task_dir(&config.data_dir, job_id, idx, attempt);
        job.tasks.push(Task {
            idx,
            slot,
            attempt,
            devices: devices.clone(),
            pid: None,
            dir: dir.clone(),
            started_ms: at,
            kill_at: None,
            kills: 0,
            container: container.clone(),
        });
        let launch =
            launch(config, job, idx, attempt, &devices, dir.clone(), container).map(Box::new);
        let row = TaskRow {
            job_id,
            idx: i64::from(idx),
            attempt: i64::from(attempt),
            state: TaskState::Starting,
            node: config.node.name.clone(),
            devices,
            pid: None,
            started_at_ms: at,
            finished_at_ms: None,
            exit_code: None,
            dir: dir.display().to_string(),
        };
        self.out.push(Effect::Metric(Metric::TaskStarted));
        self.out.push(Effect::Spawn { row, launch });
        self.dirty = true;
    }

    /// The view the API shows, when something changed since the last one.
    pub fn view(&mut self, now: Now) -> Option<View> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        let mut holders: Vec<Vec<Holder>> = vec![Vec::new(); self.config.node.devices.len()];
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
        let at = now.wall_ms;
        match self.history.back().copied() {
            Some((_, n)) if n == allocated => {}
            Some((t, _)) if at - t < 1000 => {
                if let Some(b) = self.history.back_mut() {
                    *b = (t, allocated);
                }
            }
            _ => self.history.push_back((at, allocated)),
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
        // After the scheduler's queue: the jobs held for the host's pods, each with why.
        for j in self.affinity_held.iter().filter_map(|id| self.jobs.get(id)) {
            queued_total += 1;
            if queued.len() < QUEUE_VIEW {
                queued.push(QueuedView {
                    id: j.id,
                    name: j.name.clone(),
                    queue: j.queue.clone(),
                    priority: j.priority,
                    submitted_at_ms: j.submitted_ms,
                    position: queued.len() + 1,
                    reason: j.reason.clone(),
                });
            }
        }
        let running = self
            .jobs
            .values()
            .filter(|j| !j.tasks.is_empty())
            .map(|j| RunningView {
                id: j.id,
                name: j.name.clone(),
                queue: j.queue.clone(),
                started_at_ms: j.started_ms.unwrap_or(at),
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
        Some(View { holders, queued, queued_total, running, history: self.history.clone() })
    }
}

/// The job's volumes with each `medium: Memory` one sized for this host: a `sizeLimit` above
/// the host's memory becomes the host's memory, as does none (or a zero a spec stored before
/// zero was refused may hold), so the tmpfs never gets `size=0`, the kernel's "no limit".
fn memory_volumes(node: &Node, volumes: &[xpu_core::job::Volume]) -> Vec<xpu_core::job::Volume> {
    volumes
        .iter()
        .map(|v| {
            let mut v = v.clone();
            if v.memory {
                let (size, note) =
                    xpu_core::job::clamp_memory_volume(v.size_limit, node.memory_mib << 20);
                if let Some(note) = note {
                    tracing::info!(volume = %v.name, "{note}");
                }
                v.size_limit = Some(size);
            }
            v
        })
        .collect()
}

/// What one attempt is started with, resolved now: a manifest whose references expand past
/// the kernel's limits fails to start, saying which (after its row is written, as any start).
fn launch(
    config: &Config,
    job: &Job,
    idx: u32,
    attempt: u32,
    devices: &[u32],
    dir: PathBuf,
    container: Option<ContainerLaunch>,
) -> Result<Launch, String> {
    let node = &config.node;
    let in_container = container.is_some();
    let main = &job.spec.container;
    let mps = match &config.mps {
        Some(dir) => mps_client(node, job, devices, dir, in_container)?,
        None => None,
    };
    let with_mps = |mut env: Vec<(String, String)>| {
        if let Some(m) = &mps {
            m.apply(&mut env);
        }
        env
    };
    let env = with_mps(task_env(node, job, main, idx, devices, in_container)?);
    let argv = task_argv(&job.spec, main, &env)?;
    // Each init container with its own variables and arguments, on the same devices (see
    // `executor::spawn_pod`).
    let init = job
        .spec
        .init_containers
        .iter()
        .map(|c| {
            let env = with_mps(
                task_env(node, job, c, idx, devices, in_container)
                    .map_err(|e| format!("init container {}: {e}", c.name))?,
            );
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
    Ok(Launch {
        job_id: job.id,
        idx,
        attempt,
        argv,
        env,
        files: downward_files(node, job, idx, devices.len()),
        working_dir: main.working_dir.clone(),
        dir,
        container,
        init,
        volumes: memory_volumes(node, &job.spec.volumes),
        mounts: main.volume_mounts.clone(),
        grace: config.grace,
        user: job.owner,
        host_mounts: mps.iter().filter_map(|m| m.mount.clone()).collect(),
        mps_gpu: mps.map(|m| m.gpu),
    })
}

/// What makes a task a client of its GPU's MPS daemon.
#[derive(Debug)]
struct MpsClient {
    /// The GPU's UUID: whose daemon it is.
    gpu: String,
    /// Set over the task's own (`CUDA_MPS_*` it set are dropped first).
    env: Vec<(String, String)>,
    /// A container's view of the pipe directory.
    mount: Option<container::Mount>,
}

impl MpsClient {
    fn apply(&self, env: &mut Vec<(String, String)>) {
        let ours = |k: &str| self.env.iter().any(|(o, _)| o == k);
        env.retain(|(k, _)| !xpu_host::mps::is_client_var(k) && !ours(k));
        env.extend(self.env.iter().cloned());
    }
}

/// Where a container finds its GPU's MPS pipe directory (the device plugin's path too).
const CONTAINER_MPS_PIPE_DIR: &str = "/var/run/xpu-mps";

/// The MPS client a task is: a share (`milli` under 1000) of one NVIDIA GPU, limited to that
/// share of its threads and memory. `None` for whole devices and other vendors.
fn mps_client(
    node: &Node,
    job: &Job,
    devices: &[u32],
    dir: &std::path::Path,
    in_container: bool,
) -> Result<Option<MpsClient>, String> {
    if job.milli >= 1000 {
        return Ok(None);
    }
    let gpu = match devices {
        [d] => match node.devices.get(*d as usize) {
            Some(g) if g.vendor == "nvidia" && g.kind == DeviceKind::Gpu => g,
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let uuid = gpu.uuid.clone().ok_or_else(|| {
        format!(
            "GPU {} has no UUID (the NVIDIA driver's /proc/driver/nvidia/gpus/{}/information), so its MPS daemon cannot be named; load the driver, or serve without --mps-dir",
            gpu.address, gpu.address
        )
    })?;
    let pipe = dir.join(&uuid).join("pipe");
    let limits = xpu_host::mps::Limits::of(job.milli, gpu.memory_mib);
    let (mut env, mount) = if in_container {
        let mount = container::Mount {
            source: pipe,
            destination: CONTAINER_MPS_PIPE_DIR.to_owned(),
            read_only: false,
        };
        (limits.env(CONTAINER_MPS_PIPE_DIR), Some(mount))
    } else {
        (limits.env(&pipe.to_string_lossy()), None)
    };
    // The daemon sees only this GPU, and a client counts devices from the daemon's: its GPU is
    // device 0 (a container's runtime names the GPU from NVIDIA_VISIBLE_DEVICES as before).
    if !in_container {
        env.push(("CUDA_VISIBLE_DEVICES".to_owned(), "0".to_owned()));
    }
    env.push(("XPU_SHARING".to_owned(), "mps".to_owned()));
    Ok(Some(MpsClient { gpu: uuid, env, mount }))
}

#[cfg(test)]
mod tests;
