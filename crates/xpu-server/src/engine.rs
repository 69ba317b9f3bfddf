//! The scheduling loop: holds the active jobs in memory, places their tasks on the node's free
//! devices, starts them through the [`crate::executor`], and applies what happens next
//! (success, failure with `restartPolicy`/`backoffLimit`, `activeDeadlineSeconds`, cancel).
//!
//! One task owns all of this state; everything else talks to it through messages, so there are
//! no locks around job state. The store is the source of truth: on becoming leader the loop
//! rebuilds itself from the store, re-adopting tasks whose supervisor is still alive and
//! failing (then retrying per policy) those that are gone. It also polls the store every tick,
//! which is how it learns of jobs submitted and cancelled through other daemons sharing a
//! PostgreSQL store.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use xpu_core::DeviceKind;
use xpu_core::job::{CompletionMode, JobSpec, RestartPolicy};

use crate::executor::{self, Launch, Sig};
use crate::store::{JobRow, JobState, TaskRow, TaskState, Write, now_ms};
use crate::{Shared, placement};

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

/// What the API shows of the loop's state, replaced after every pass.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct View {
    /// Per device: the task holding it.
    pub holders: Vec<Option<Holder>>,
    pub queued: Vec<QueuedView>,
    pub running: Vec<RunningView>,
    /// (time ms, devices allocated), one sample per change and at most one per second.
    pub history: VecDeque<(i64, u32)>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Holder {
    pub job: i64,
    pub name: String,
    pub task: u32,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct QueuedView {
    pub id: i64,
    pub name: String,
    pub queue: String,
    pub priority: i64,
    pub submitted_at_ms: i64,
    pub position: usize,
    pub reason: String,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct RunningView {
    pub id: i64,
    pub name: String,
    pub queue: String,
    pub started_at_ms: i64,
    pub tasks: Vec<TaskView>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct TaskView {
    pub index: u32,
    pub attempt: u32,
    pub pid: Option<i32>,
    pub devices: Vec<u32>,
}

#[derive(Debug)]
struct Task {
    idx: u32,
    attempt: u32,
    devices: Vec<u32>,
    pid: Option<i32>,
    dir: PathBuf,
    started_ms: i64,
    /// When SIGKILL follows the SIGTERM already sent.
    kill_at: Option<Instant>,
}

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
    /// Per completion index: succeeded.
    done: Vec<bool>,
    /// Per completion index: the next attempt number.
    next_attempt: Vec<u32>,
    /// Active attempts.
    tasks: Vec<Task>,
    /// Indices waiting to restart in place (OnFailure) with these devices.
    restart_in_place: Vec<(u32, Vec<u32>)>,
    /// Set once the job reached a terminal state; the tasks are being stopped.
    ending: Option<(JobState, String)>,
    reason: String,
}

impl Job {
    fn from_row(row: &JobRow, spec: JobSpec) -> Job {
        let n = spec.completions as usize;
        Job {
            id: row.id,
            name: row.name.clone(),
            queue: row.queue.clone(),
            priority: row.priority,
            state: row.state,
            failures: row.failures,
            submitted_ms: row.submitted_at_ms,
            started_ms: row.started_at_ms,
            done: vec![false; n],
            next_attempt: vec![0; n],
            tasks: Vec::new(),
            restart_in_place: Vec::new(),
            ending: None,
            reason: "waiting for the scheduler".to_owned(),
            spec,
        }
    }

    /// Indices neither done nor running nor restarting.
    fn pending(&self) -> Vec<u32> {
        (0..self.spec.completions)
            .filter(|&i| {
                !self.done[i as usize]
                    && !self.tasks.iter().any(|t| t.idx == i)
                    && !self.restart_in_place.iter().any(|(j, _)| *j == i)
            })
            .collect()
    }
}

pub struct Engine {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Msg>,
    tx: mpsc::UnboundedSender<Msg>,
    jobs: BTreeMap<i64, Job>,
    /// Per device: (job, index) holding it.
    held: Vec<Option<(i64, u32)>>,
    history: VecDeque<(i64, u32)>,
    leader: bool,
    dirty: bool,
}

/// How often the loop polls the store and checks deadlines.
const TICK: Duration = Duration::from_millis(250);

impl Engine {
    pub fn new(
        shared: Arc<Shared>,
        rx: mpsc::UnboundedReceiver<Msg>,
        tx: mpsc::UnboundedSender<Msg>,
    ) -> Engine {
        let n = shared.node.devices.len();
        Engine {
            shared,
            rx,
            tx,
            jobs: BTreeMap::new(),
            held: vec![None; n],
            history: VecDeque::new(),
            leader: false,
            dirty: true,
        }
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
            let msg = tokio::time::timeout(TICK, self.rx.recv()).await;
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
                        self.leader = false;
                        self.shared.leader.store(false, Ordering::Relaxed);
                        self.jobs.clear();
                        self.held.iter_mut().for_each(|h| *h = None);
                        continue;
                    }
                    self.poll().await;
                    self.tick();
                }
            }
            self.schedule();
            self.publish();
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

    /// Rebuilds the in-memory state from the store after a start or a takeover.
    async fn recover(&mut self) {
        self.jobs.clear();
        self.held.iter_mut().for_each(|h| *h = None);
        let shared = self.shared.clone();
        let store = &shared.store;
        let active = match store.active().await {
            Ok(a) => a,
            Err(_) => return,
        };
        for a in &active {
            self.load(a.id).await;
        }
        let Ok(tasks) = store.active_tasks().await else { return };
        let mut by_job: HashMap<i64, Vec<TaskRow>> = HashMap::new();
        for t in tasks {
            by_job.entry(t.job_id).or_default().push(t);
        }
        // Succeeded indices of active jobs come from their full task lists.
        let ids: Vec<i64> = self.jobs.keys().copied().collect();
        for id in ids {
            if let Ok(all) = store.tasks(id).await
                && let Some(job) = self.jobs.get_mut(&id)
            {
                for t in &all {
                    let i = t.idx as usize;
                    if i < job.done.len() {
                        job.next_attempt[i] = job.next_attempt[i].max(t.attempt as u32 + 1);
                        if t.state == TaskState::Succeeded {
                            job.done[i] = true;
                        }
                    }
                }
            }
        }
        for (job_id, rows) in by_job {
            for t in rows {
                let dir = PathBuf::from(&t.dir);
                let pid = t.pid.map(|p| p as i32).or_else(|| executor::recorded_pid(&dir));
                let alive = pid.is_some_and(|p| executor::is_our_supervisor(p, &dir));
                let Some(job) = self.jobs.get_mut(&job_id) else {
                    // The job already ended; a leftover process is stopped.
                    if let Some(p) = pid.filter(|_| alive) {
                        executor::signal_group(p, Sig::KILL);
                    }
                    continue;
                };
                let (idx, attempt) = (t.idx as u32, t.attempt as u32);
                for &d in &t.devices {
                    if let Some(h) = self.held.get_mut(d as usize) {
                        *h = Some((job_id, idx));
                    }
                }
                job.tasks.push(Task {
                    idx,
                    attempt,
                    devices: t.devices.clone(),
                    pid,
                    dir: dir.clone(),
                    started_ms: t.started_at_ms,
                    kill_at: None,
                });
                if alive && let Some(p) = pid {
                    // Recorded as running under its pid (a crash may have come before that).
                    self.shared.store.write_later(Write::Task(TaskRow {
                        state: TaskState::Running,
                        pid: Some(i64::from(p)),
                        ..t.clone()
                    }));
                    self.event(
                        Some(job_id),
                        "adopted",
                        format!("task {idx} attempt {attempt} (pid {p}) re-adopted after restart"),
                    );
                    watch_adopted(self.tx.clone(), job_id, idx, attempt, p, dir);
                } else {
                    // Gone: its recorded exit status is used when the supervisor wrote one.
                    let code = executor::recorded_exit(&dir);
                    if code.is_none() {
                        self.event(
                            Some(job_id),
                            "lost",
                            format!("task {idx} attempt {attempt} was not running after restart; counted as failed"),
                        );
                    }
                    let _ = self.tx.send(Msg::Exited { job: job_id, idx, attempt, code });
                }
            }
        }
        self.dirty = true;
    }

    /// Loads one job from the store into memory (unless already there).
    async fn load(&mut self, id: i64) {
        if self.jobs.contains_key(&id) {
            return;
        }
        let Ok(Some(row)) = self.shared.store.job(id).await else { return };
        if row.state.is_terminal() {
            return;
        }
        match serde_json::from_str::<JobSpec>(&row.spec) {
            Ok(spec) => {
                let cancel = row.cancel_requested;
                self.jobs.insert(id, Job::from_row(&row, spec));
                if cancel {
                    self.cancel(id);
                }
            }
            Err(e) => {
                self.finish_job_now(
                    id,
                    JobState::Failed,
                    format!("stored spec is unreadable: {e}"),
                    0,
                );
            }
        }
    }

    /// Picks up jobs and cancellations recorded by other daemons.
    async fn poll(&mut self) {
        let Ok(active) = self.shared.store.active().await else { return };
        for a in active {
            if !self.jobs.contains_key(&a.id) {
                self.load(a.id).await;
            } else if a.cancel_requested && self.jobs.get(&a.id).is_some_and(|j| j.ending.is_none())
            {
                self.cancel(a.id);
            }
        }
    }

    fn handle(&mut self, m: Msg) {
        self.dirty = true;
        match m {
            Msg::Submitted { row, spec } => {
                self.jobs.entry(row.id).or_insert_with(|| Job::from_row(&row, *spec));
            }
            Msg::Cancel(id) => self.cancel(id),
            Msg::Started { job, idx, attempt, pid } => {
                if let Some(j) = self.jobs.get_mut(&job)
                    && let Some(t) =
                        j.tasks.iter_mut().find(|t| t.idx == idx && t.attempt == attempt)
                {
                    t.pid = Some(pid);
                    if j.ending.is_some() {
                        executor::signal_group(pid, Sig::TERM);
                        t.kill_at = Some(Instant::now() + self.shared.grace);
                    }
                }
            }
            Msg::Exited { job, idx, attempt, code } => self.exited(job, idx, attempt, code),
            Msg::StartFailed { job, idx, attempt, error } => {
                self.event(Some(job), "start-failed", error.clone());
                self.exited(job, idx, attempt, None);
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
    /// after the grace period). The job leaves memory when its last task has exited.
    fn end_job(&mut self, id: i64, state: JobState, message: String) {
        let grace = self.shared.grace;
        let Some(job) = self.jobs.get_mut(&id) else { return };
        job.ending = Some((state, message.clone()));
        job.state = state;
        job.restart_in_place.clear();
        let failures = job.failures;
        for t in &mut job.tasks {
            if let Some(p) = t.pid {
                executor::signal_group(p, Sig::TERM);
            }
            t.kill_at = Some(Instant::now() + grace);
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
            self.jobs.remove(&id);
        }
    }

    fn release(&mut self, devices: &[u32]) {
        release(&mut self.held, devices);
    }

    fn exited(&mut self, job_id: i64, idx: u32, attempt: u32, code: Option<i32>) {
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
        if job.ending.is_some() {
            self.release(&task.devices);
            self.reap(job_id);
            return;
        }
        if ok {
            job.done[idx as usize] = true;
            let all = job.done.iter().all(|d| *d);
            let n = job.spec.completions;
            release(&mut self.held, &task.devices);
            if all {
                self.end_job(
                    job_id,
                    JobState::Succeeded,
                    format!("{n} of {n} completions succeeded"),
                );
            }
            return;
        }
        self.shared.metrics.tasks_failed.fetch_add(1, Ordering::Relaxed);
        job.failures += 1;
        let what = match code {
            Some(c) => format!("exit status {c}"),
            None => "lost (no exit status)".to_owned(),
        };
        let msg = format!("task {idx} attempt {attempt} failed: {what}");
        let (failures, limit) = (job.failures, i64::from(job.spec.backoff_limit));
        let policy = job.spec.restart_policy;
        let state = job.state;
        match policy {
            // Restarted in place: keeps its devices.
            RestartPolicy::OnFailure if failures <= limit => {
                job.restart_in_place.push((idx, task.devices.clone()))
            }
            _ => release(&mut self.held, &task.devices),
        }
        // Kubernetes: the Job fails once failures exceed backoffLimit.
        if failures > limit {
            self.event(Some(job_id), "task-failed", msg.clone());
            self.end_job(
                job_id,
                JobState::Failed,
                format!("{msg}; backoffLimit {limit} reached (BackoffLimitExceeded)"),
            );
            return;
        }
        self.event(
            Some(job_id),
            "task-failed",
            format!("{msg}; retrying ({failures} of {limit} retries used)"),
        );
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
                    executor::signal_group(p, Sig::KILL);
                    t.kill_at = Some(now + Duration::from_secs(5));
                }
            }
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

    /// One scheduling pass: restarts in place, then places pending tasks in queue order.
    fn schedule(&mut self) {
        if !self.dirty {
            return;
        }
        let t0 = Instant::now();
        // Restarts in place first: they already hold their devices.
        let restarts: Vec<(i64, u32, Vec<u32>)> = self
            .jobs
            .values_mut()
            .flat_map(|j| {
                let id = j.id;
                j.restart_in_place.drain(..).map(move |(i, d)| (id, i, d))
            })
            .collect();
        for (id, idx, devices) in restarts {
            self.start(id, idx, devices);
        }
        let order = placement::order(self.jobs.values().filter(|j| j.ending.is_none()).map(|j| {
            placement::QueueEntry {
                id: j.id,
                priority: j.priority,
                queue: &j.queue,
                running: j.tasks.len(),
            }
        }));
        let node = &self.shared.node;
        let mut free = placement::Free::new(
            node,
            &self.held,
            self.jobs.values().map(|j| {
                (
                    j.tasks.len() as u64 * j.spec.container.resources.cpu_milli,
                    j.tasks.len() as u64 * j.spec.container.resources.memory_mib,
                )
            }),
        );
        let mut starts: Vec<(i64, u32, Vec<u32>)> = Vec::new();
        let mut fail: Vec<(i64, String)> = Vec::new();
        let mut blocked_kinds: Vec<DeviceKind> = Vec::new();
        let mut done_jobs: Vec<i64> = Vec::new();
        for id in order {
            let Some(job) = self.jobs.get_mut(&id) else { continue };
            let pending = job.pending();
            if pending.is_empty() {
                if job.tasks.is_empty()
                    && job.restart_in_place.is_empty()
                    && job.done.iter().all(|d| *d)
                {
                    // Every index succeeded before a restart, but the job was not yet marked.
                    done_jobs.push(id);
                }
                continue;
            }
            let res = &job.spec.container.resources;
            if let Err(why) = placement::feasible(node, &job.spec) {
                fail.push((id, why));
                continue;
            }
            let kinds: Vec<DeviceKind> = res.devices.iter().map(|d| d.kind).collect();
            // A job that waits for devices holds back later jobs wanting the same kind, so a
            // stream of small jobs cannot starve it.
            if kinds.iter().any(|k| blocked_kinds.contains(k)) {
                job.reason = "behind a higher-priority or earlier job waiting for the same devices"
                    .to_owned();
                continue;
            }
            let room = job.spec.effective_parallelism() as usize
                - job.tasks.len().min(job.spec.effective_parallelism() as usize);
            let want: Vec<u32> = if job.spec.is_gang() {
                if !job.tasks.is_empty() || pending.len() > room {
                    // A gang restarts missing members individually once it has run.
                    pending.into_iter().take(room).collect()
                } else {
                    pending
                }
            } else {
                pending.into_iter().take(room).collect()
            };
            if want.is_empty() {
                continue;
            }
            let gang = job.spec.is_gang() && job.tasks.is_empty();
            let mut trial = free.clone();
            let mut placed = Vec::new();
            for &idx in &want {
                match trial.take(node, res) {
                    Ok(devs) => placed.push((idx, devs)),
                    Err(why) => {
                        job.reason = why;
                        break;
                    }
                }
            }
            if gang && placed.len() < want.len() {
                job.reason = format!(
                    "gang of {} tasks waits until all fit at once: {}",
                    want.len(),
                    job.reason
                );
                blocked_kinds.extend(kinds);
                continue;
            }
            if placed.is_empty() {
                blocked_kinds.extend(kinds);
                continue;
            }
            free = trial;
            for (idx, devs) in placed {
                starts.push((id, idx, devs));
            }
        }
        for id in done_jobs {
            self.end_job(id, JobState::Succeeded, "all completions succeeded".to_owned());
        }
        for (id, why) in fail {
            self.end_job(id, JobState::Failed, format!("unschedulable on this node: {why}"));
        }
        for (id, idx, devs) in starts {
            self.start(id, idx, devs);
        }
        self.shared.metrics.sched_pass.observe(t0.elapsed().as_secs_f64());
    }

    /// Starts one attempt on the given devices: records it durably, then spawns it.
    fn start(&mut self, job_id: i64, idx: u32, devices: Vec<u32>) {
        let shared = self.shared.clone();
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let attempt = job.next_attempt[idx as usize];
        job.next_attempt[idx as usize] += 1;
        let now = now_ms();
        for &d in &devices {
            if let Some(h) = self.held.get_mut(d as usize) {
                *h = Some((job_id, idx));
            }
        }
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
            attempt,
            devices: devices.clone(),
            pid: None,
            dir: dir.clone(),
            started_ms: now,
            kill_at: None,
        });
        let env = task_env(&shared, job, idx, &devices);
        let launch = Launch {
            job_id,
            idx,
            attempt,
            argv: job.spec.container.argv.clone(),
            env,
            working_dir: job.spec.container.working_dir.clone(),
            dir: dir.clone(),
        };
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
        let holders: Vec<Option<Holder>> = self
            .held
            .iter()
            .map(|h| {
                h.and_then(|(job, task)| {
                    self.jobs.get(&job).map(|j| Holder { job, name: j.name.clone(), task })
                })
            })
            .collect();
        let allocated = holders.iter().filter(|h| h.is_some()).count() as u32;
        let last = self.history.back().copied();
        match last {
            Some((t, n)) if n == allocated => {
                let _ = t;
            }
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
        let order = placement::order(self.jobs.values().filter(|j| j.ending.is_none()).map(|j| {
            placement::QueueEntry {
                id: j.id,
                priority: j.priority,
                queue: &j.queue,
                running: j.tasks.len(),
            }
        }));
        let mut queued = Vec::new();
        for id in order {
            if let Some(j) = self.jobs.get(&id)
                && j.tasks.is_empty()
                && j.state == JobState::Queued
            {
                queued.push(QueuedView {
                    id,
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
        let view = View { holders, queued, running, history: self.history.clone() };
        if let Ok(mut v) = self.shared.view.write() {
            *v = view;
        }
    }
}

/// The environment of one task: the job's own variables, then what xpu sets (which wins).
fn task_env(shared: &Shared, job: &Job, idx: u32, devices: &[u32]) -> Vec<(String, String)> {
    let spec = &job.spec;
    let mut env: Vec<(String, String)> =
        spec.container.env.iter().map(|e| (e.name.clone(), e.value.clone())).collect();
    env.extend(shared.node.device_env(devices));
    env.push(("XPU_JOB_ID".into(), job.id.to_string()));
    env.push(("XPU_JOB_NAME".into(), job.name.clone()));
    env.push(("XPU_TASK_INDEX".into(), idx.to_string()));
    if spec.completion_mode == CompletionMode::Indexed {
        // Kubernetes sets JOB_COMPLETION_INDEX for Indexed Jobs; GKE's TPU webhook sets the TPU
        // worker id to the same index and lists every worker's hostname in index order.
        env.push(("JOB_COMPLETION_INDEX".into(), idx.to_string()));
        env.push(("TPU_WORKER_ID".into(), idx.to_string()));
        let hosts: Vec<String> =
            (0..spec.completions).map(|_| shared.node.hostname.clone()).collect();
        env.push(("TPU_WORKER_HOSTNAMES".into(), hosts.join(",")));
    }
    env
}

fn release(held: &mut [Option<(i64, u32)>], devices: &[u32]) {
    for &d in devices {
        if let Some(h) = held.get_mut(d as usize) {
            *h = None;
        }
    }
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
