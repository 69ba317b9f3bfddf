//! The scheduling loop: holds the active jobs in memory, queues them in `xpu-sched` (the node
//! is a one-node cluster), starts the tasks the scheduler places through the
//! [`crate::executor`], and applies what happens next (success, failure with
//! `restartPolicy`/`backoffLimit`, `activeDeadlineSeconds`, cancel).
//!
//! The scheduler decides *when* and *where*: jobs wait in their queue until devices are free
//! (whole or a share of one), gangs start together, priorities order each queue and queues
//! share the node fairly (dominant resource fairness), with per-kind lanes so a job waiting for
//! GPUs never holds back CPU-only work (`SchedulerConfig::lanes`). A job's scheduler tasks are
//! its *slots* ([`xpu_sched::manifest`]): the loop hands each placed slot the lowest completion
//! index still to run, and when that task ends either re-queues the slot for the next index (or
//! a retry under `restartPolicy: Never`), keeps it for an in-place restart (`OnFailure`), or
//! finishes it.
//!
//! Two halves:
//! - [`machine`]: all of that as a synchronous state machine. Given the time and an input (a
//!   submission, a cancel, a task's start or exit, a tick, a takeover), it returns effects
//!   (spawn, signal, runtime call, store write, metric). No clock, process, file or socket;
//!   its unit tests drive it with a fake clock.
//! - [`Engine`] (here): the thin async driver. It reads the clock, holds the leadership, reads
//!   the store at a takeover and on each tick, carries out the effects, and turns what comes
//!   of them (a process started or exited) into the next inputs.
//!
//! One task owns all of this state; everything else talks to it through messages, so there are
//! no locks around job state. The store is the source of truth: on becoming leader the loop
//! rebuilds itself from the store, re-adopting tasks whose supervisor is still alive (onto the
//! devices they hold, with `Scheduler::adopt`) and failing (then retrying per policy) those
//! that are gone. It also polls the store every tick, which is how it learns of jobs submitted
//! and cancelled through other daemons sharing a PostgreSQL store.

mod env;
pub(crate) use env::too_big_for_host;
pub mod machine;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use xpu_core::job::JobSpec;

pub use self::machine::scheduler_for;
use self::machine::{
    Config, Effect, FoundTask, Input, Machine, Metric, Now, RecoveredJob, Recovery, StoredJob,
};
use crate::Shared;
use crate::container;
use crate::executor::{self, Launch};
use crate::store::{JobRow, StoreError, TaskRow, Write, now_ms};
use xpu_sched::scheduler::SchedError;

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

/// How often the loop polls the store and checks deadlines.
const TICK: Duration = Duration::from_millis(250);

/// The driver: see the module documentation.
pub struct Engine {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Msg>,
    tx: mpsc::UnboundedSender<Msg>,
    machine: Machine,
    t0: Instant,
    leader: bool,
}

impl Engine {
    pub fn new(
        shared: Arc<Shared>,
        rx: mpsc::UnboundedReceiver<Msg>,
        tx: mpsc::UnboundedSender<Msg>,
    ) -> Result<Engine, SchedError> {
        let machine = Machine::new(Config {
            node: shared.node.clone(),
            data_dir: shared.data_dir.clone(),
            grace: shared.grace,
            restart_backoff: shared.restart_backoff,
            runtime: shared.runtime.clone(),
            mps: shared.mps.as_ref().map(|d| d.dir().to_owned()),
        })?;
        Ok(Engine { shared, rx, tx, machine, t0: Instant::now(), leader: false })
    }

    fn now(&self) -> Now {
        Now { mono: self.t0.elapsed(), wall_ms: now_ms() }
    }

    /// Gives the machine one input and carries out what it returns.
    fn step(&mut self, input: Input) {
        let effects = self.machine.step(self.now(), input);
        for e in effects {
            self.apply(e);
        }
    }

    pub async fn run(mut self) {
        let mut leadership = self.shared.leadership();
        loop {
            if !self.leader {
                if leadership.acquire().await {
                    self.leader = true;
                    self.shared.leader.store(true, Ordering::Relaxed);
                    let m = format!("{} is now scheduling", self.shared.node.name);
                    self.apply(Effect::Write(Write::Event {
                        at_ms: now_ms(),
                        job_id: None,
                        kind: "leader".to_owned(),
                        message: m,
                    }));
                    let recovery = self.recovery().await;
                    self.step(Input::Recovered(Box::new(recovery)));
                } else {
                    // Followers drop local notifications: the leader learns from the store.
                    while self.rx.try_recv().is_ok() {}
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
            // Wake for the scheduler's own next event (none without flex-start pools) or the
            // tick, whichever is first. Kills and in-place restarts are due on a tick (looking
            // for the earliest across every job each time would cost a pass over 50,000
            // queued jobs per message).
            let wait = self.machine.next_wakeup(self.now()).map_or(TICK, |w| w.min(TICK));
            let msg = tokio::time::timeout(wait, self.rx.recv()).await;
            match msg {
                Ok(Some(m)) => {
                    self.step(Input::Msg(m));
                    while let Ok(m) = self.rx.try_recv() {
                        self.step(Input::Msg(m));
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
                        self.step(Input::LeadershipLost);
                        continue;
                    }
                    self.poll().await;
                    self.step(Input::Tick);
                }
            }
            let unhealthy = self.shared.telemetry.as_ref().map(|t| t.unhealthy());
            let ran = self.machine.is_dirty();
            let t0 = Instant::now();
            self.step(Input::Pass { unhealthy });
            if ran {
                self.shared.metrics.sched_pass.observe(t0.elapsed().as_secs_f64());
            }
            let live = self.machine.live_jobs() as u64;
            self.shared.metrics.scheduler_jobs.store(live, Ordering::Relaxed);
            if let Some(view) = self.machine.view(self.now())
                && let Ok(mut v) = self.shared.view.write()
            {
                *v = view;
            }
        }
    }

    /// What the store and the process table hold at a takeover. A store read that fails is
    /// retried (said at warn level) until one succeeds: adopting from half a picture could
    /// start a second copy of a task that still runs.
    async fn recovery(&mut self) -> Recovery {
        loop {
            match read_recovery(&self.shared).await {
                Ok(r) => return r,
                Err((what, e)) => {
                    tracing::warn!(error = %e, "recovery: reading {what} failed; trying again in 1 s");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
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
            if !self.machine.knows(a.id) {
                match self.shared.store.job(a.id).await {
                    Ok(Some(row)) => {
                        let spec = parse_spec(&row);
                        let job = StoredJob { row, spec, cancel: a.cancel_requested };
                        self.step(Input::Loaded(Box::new(job)));
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(job_id = a.id, error = %e, "reading a job from the store failed");
                    }
                }
            } else if a.cancel_requested && !self.machine.is_ending(a.id) {
                self.step(Input::Msg(Msg::Cancel(a.id)));
            }
        }
    }

    /// Carries out one effect.
    fn apply(&self, e: Effect) {
        match e {
            Effect::Write(w) => self.shared.store.write_later(w),
            Effect::Spawn { row, launch } => {
                spawn(self.shared.clone(), self.tx.clone(), row, launch)
            }
            Effect::Signal { pid, sig, group: true } => executor::signal_group(pid, sig),
            Effect::Signal { pid, sig, group: false } => executor::signal_task(pid, sig),
            Effect::Runtime { container, args } => {
                tokio::spawn(async move { container::runtime_call(&container, args).await });
            }
            Effect::Unmount(dir) => unmount(dir),
            Effect::Watch { job, idx, attempt, mps_gpu, pid, dir } => {
                let mps = mps_gpu.and_then(|g| self.shared.mps.clone().map(|d| (d, g)));
                watch_adopted(self.tx.clone(), job, idx, attempt, pid, dir, mps);
            }
            Effect::Metric(m) => {
                let metrics = &self.shared.metrics;
                match m {
                    Metric::TaskStarted => {
                        metrics.tasks_started.fetch_add(1, Ordering::Relaxed);
                    }
                    Metric::TaskFailed => {
                        metrics.tasks_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    Metric::QueueWait(s) => metrics.queue_wait.observe(s),
                }
            }
        }
    }
}

/// Reads what [`Engine::recovery`] gives the machine.
async fn read_recovery(shared: &Shared) -> Result<Recovery, (&'static str, StoreError)> {
    let store = &shared.store;
    let active = store.active().await.map_err(|e| ("the active jobs", e))?;
    let mut jobs = Vec::with_capacity(active.len());
    for a in &active {
        let Some(row) = store.job(a.id).await.map_err(|e| ("a job", e))? else { continue };
        let history = store.tasks(a.id).await.map_err(|e| ("a job's tasks", e))?;
        let spec = parse_spec(&row);
        jobs.push(RecoveredJob { row, spec, history, cancel: a.cancel_requested });
    }
    let tasks = store.active_tasks().await.map_err(|e| ("the running tasks", e))?;
    let tasks = tasks.into_iter().map(inspect).collect();
    Ok(Recovery { jobs, tasks })
}

/// A job's stored spec, or why it cannot be read.
fn parse_spec(row: &JobRow) -> Result<JobSpec, String> {
    serde_json::from_str::<JobSpec>(&row.spec).map_err(|e| e.to_string())
}

/// What became of a task recorded as running: its supervisor's pid (from the store, else its
/// directory), whether that process is still its supervisor, and the status it recorded.
fn inspect(row: TaskRow) -> FoundTask {
    let dir = PathBuf::from(&row.dir);
    let pid = row.pid.map(|p| p as i32).or_else(|| executor::recorded_pid(&dir));
    let alive = pid.is_some_and(|p| executor::is_our_supervisor(p, &dir));
    let exit = if alive { None } else { executor::recorded_exit(&dir) };
    FoundTask { row, pid, alive, exit }
}

/// Records a task durably, then starts it, and reports what comes of it to the loop.
fn spawn(
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<Msg>,
    row: TaskRow,
    launch: Result<Box<Launch>, String>,
) {
    let (job, idx, attempt) = (row.job_id, row.idx as u32, row.attempt as u32);
    // Each send fails only when the engine is gone (the daemon stopping): nobody to tell.
    let failed = move |tx: &mpsc::UnboundedSender<Msg>, error: String| {
        let _ = tx.send(Msg::StartFailed { job, idx, attempt, error });
    };
    tokio::spawn(async move {
        // Durable before the process exists, so a crash in between is seen at restart.
        if let Err(e) = shared.store.write(Write::Task(row.clone())).await {
            return failed(&tx, e.to_string());
        }
        let launch = match launch {
            Ok(l) => l,
            Err(error) => return failed(&tx, error),
        };
        // Off the async threads: a start reads files the job names (a bundle's config.json),
        // and however those are bounded, a slow disk must not stall the API. A share's MPS
        // daemon is started (again, if it died) first: a client that finds none runs unlimited.
        let mps = shared.mps.clone();
        let started = tokio::task::spawn_blocking(move || {
            if let Err(e) = mps_acquire(mps.as_deref(), &launch) {
                return (launch, Err(e));
            }
            let r = executor::spawn(&launch).map_err(|e| e.to_string());
            if r.is_err() {
                mps_release(mps.as_deref(), &launch);
            }
            (launch, r)
        })
        .await;
        let (launch, mut spawned) = match started {
            Ok((launch, Ok(s))) => (launch, s),
            Ok((_, Err(e))) => return failed(&tx, e),
            Err(e) => return failed(&tx, format!("starting the task: {e}")),
        };
        if let Some(aside) = &spawned.moved_aside {
            shared.store.write_later(Write::Event {
                at_ms: now_ms(),
                job_id: Some(job),
                kind: "stale-dir".to_owned(),
                message: format!(
                    "task directory {} was left by an earlier store; moved to {}",
                    launch.dir.display(),
                    aside.display()
                ),
            });
        }
        // See `failed`.
        let _ = tx.send(Msg::Started { job, idx, attempt, pid: spawned.pid });
        shared.store.write_later(Write::Task(TaskRow {
            state: crate::store::TaskState::Running,
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
        if launch.mps_gpu.is_some() {
            let mps = shared.mps.clone();
            // mps_release logs its own outcome; only a panic in it is left to say.
            let r = tokio::task::spawn_blocking(move || mps_release(mps.as_deref(), &launch)).await;
            if let Err(e) = r {
                tracing::warn!(job, error = %e, "MPS client not let go");
            }
        }
        // See `failed`.
        let _ = tx.send(Msg::Exited { job, idx, attempt, code });
    });
}

/// Starts (or finds running) the MPS daemon of the task's GPU, counting the task as a client.
fn mps_acquire(mps: Option<&xpu_host::mps::Daemons>, launch: &Launch) -> Result<(), String> {
    let (Some(d), Some(gpu)) = (mps, &launch.mps_gpu) else { return Ok(()) };
    match d.acquire(gpu) {
        Ok(true) => {
            tracing::info!(gpu = %gpu, pipe = %d.pipe_dir(gpu).display(), "MPS control daemon started");
            Ok(())
        }
        Ok(false) => Ok(()),
        Err(e) => Err(format!("MPS for GPU {gpu}: {e}")),
    }
}

/// The task no longer runs: its GPU's MPS daemon stops with its last client.
fn mps_release(mps: Option<&xpu_host::mps::Daemons>, launch: &Launch) {
    if let (Some(d), Some(gpu)) = (mps, &launch.mps_gpu) {
        let_go(d, gpu);
    }
}

/// One client of `gpu`'s MPS daemon ended: the daemon stops with its last (logged either way).
fn let_go(d: &xpu_host::mps::Daemons, gpu: &str) {
    match d.release(gpu) {
        Ok(true) => tracing::info!(gpu = %gpu, "MPS control daemon stopped: its last client ended"),
        Ok(false) => {}
        Err(e) => tracing::warn!(gpu = %gpu, error = %e, "MPS control daemon not stopped"),
    }
}

/// Unmounts a task's memory volume, lazily, if it is still a mount point: usually the task's
/// script did it already (a directory on the same device as its parent is not a mount point).
fn unmount(dir: PathBuf) {
    if !executor::is_mount_point(&dir) {
        return;
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
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "could not run umount"),
        }
    });
}

/// Watches a re-adopted supervisor (not our child, so it cannot be waited for) until it is
/// gone, then reports the status it recorded. A share task is counted again as a client of its
/// GPU's MPS daemon (`mps`: started again if it died while the daemon was down), so a share
/// task ending meanwhile never stops the daemon under it; it lets go when it ends.
fn watch_adopted(
    tx: mpsc::UnboundedSender<Msg>,
    job: i64,
    idx: u32,
    attempt: u32,
    pid: i32,
    dir: PathBuf,
    mps: Option<(Arc<xpu_host::mps::Daemons>, String)>,
) {
    tokio::spawn(async move {
        if let Some((d, gpu)) = &mps {
            let (d, gpu) = (d.clone(), gpu.clone());
            let r = tokio::task::spawn_blocking(move || d.acquire(&gpu)).await;
            match r {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(job, error = %e, "MPS daemon of a re-adopted task not started")
                }
                Err(e) => tracing::warn!(job, error = %e, "MPS client not counted again"),
            }
        }
        while executor::is_our_supervisor(pid, Path::new(&dir)) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if let Some((d, gpu)) = mps {
            let r = tokio::task::spawn_blocking(move || let_go(&d, &gpu)).await;
            if let Err(e) = r {
                tracing::warn!(job, error = %e, "MPS client not let go");
            }
        }
        let code = executor::recorded_exit(&dir);
        // Fails only when the engine is gone (the daemon stopping): nobody to tell.
        let _ = tx.send(Msg::Exited { job, idx, attempt, code });
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::metrics::Metrics;
    use crate::node::{add_fakes, node_from_inventory, parse_fake};
    use crate::store::{JobState, NewJob, Outcome, Store};
    use crate::view::View;
    use std::sync::RwLock;
    use std::sync::atomic::AtomicBool;

    async fn shared(dir: &Path, tx: mpsc::UnboundedSender<Msg>) -> Arc<Shared> {
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
            user_tokens: Vec::new(),
            me: crate::daemon_user(),
            followers: Arc::default(),
            started_ms: 0,
            grace: Duration::from_secs(1),
            restart_backoff: Duration::ZERO,
            runtime: vec!["xpu".into(), "runtime".into()],
            db_url: url,
            telemetry: None,
            mps: None,
            root: xpu_host::Root::host(),
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
            owner: crate::daemon_user(),
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
