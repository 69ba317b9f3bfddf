//! The engine's state machine, driven by a fake clock: the paths the end-to-end tests take
//! with real processes, SQLite and runc (`crates/xpu/tests/serve*.rs`), here with none of
//! them. [`Sim`] plays the driver: it answers each spawn with a pid (or the start failure the
//! launch carries), runs a scheduling pass after each input and reads the view, as
//! [`super::super::Engine::run`] does.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::node::{add_fakes, node_from_inventory, parse_fake};

/// 2023-11-14, so wall-clock times are plausible.
const WALL0: i64 = 1_700_000_000_000;
const GRACE: Duration = Duration::from_secs(1);
const BACKOFF: Duration = Duration::from_secs(10);

struct Sim {
    m: Machine,
    now: Now,
    next_job: i64,
    next_pid: i32,
    /// Every effect so far, in order.
    log: Vec<Effect>,
    /// The view after the last pass.
    view: View,
}

fn node(devices: &[&str]) -> Node {
    let mut inv = xpu_core::Inventory::default();
    let fakes: Vec<_> = devices.iter().map(|d| parse_fake(d).unwrap()).collect();
    add_fakes(&mut inv, &fakes);
    let labels = [("pool".to_owned(), "a".to_owned())];
    node_from_inventory(&inv, &labels, 8000, 16384)
}

fn config(devices: &[&str]) -> Config {
    Config {
        node: node(devices),
        data_dir: PathBuf::from("/var/lib/xpu"),
        grace: GRACE,
        restart_backoff: BACKOFF,
        runtime: vec!["/usr/bin/xpu".into(), "runtime".into()],
        mps: None,
    }
}

fn short(extra: &str) -> String {
    format!("command: [sh, -c, 'exit 0']\n{extra}")
}

impl Sim {
    fn new(devices: &[&str]) -> Sim {
        Sim::with(config(devices))
    }

    fn with(config: Config) -> Sim {
        let mut s = Sim {
            m: Machine::new(config).unwrap(),
            now: Now { mono: Duration::ZERO, wall_ms: WALL0 },
            next_job: 1,
            next_pid: 1000,
            log: Vec::new(),
            view: View::default(),
        };
        s.input(Input::Recovered(Box::default()));
        s
    }

    /// One input, then what the driver does: each spawn answered with its pid (or its start
    /// failure), a pass, the view.
    fn input(&mut self, input: Input) {
        let mut queue = VecDeque::from([input]);
        while let Some(i) = queue.pop_front() {
            let pass = !matches!(i, Input::Pass { .. });
            for e in self.m.step(self.now, i) {
                if let Effect::Spawn { row, launch } = &e {
                    let (job, idx, attempt) = (row.job_id, row.idx as u32, row.attempt as u32);
                    queue.push_back(Input::Msg(match launch {
                        Ok(_) => {
                            self.next_pid += 1;
                            Msg::Started { job, idx, attempt, pid: self.next_pid }
                        }
                        Err(error) => Msg::StartFailed { job, idx, attempt, error: error.clone() },
                    }));
                }
                self.log.push(e);
            }
            if pass && queue.is_empty() {
                queue.push_back(Input::Pass { unhealthy: None });
            }
        }
        if let Some(v) = self.m.view(self.now) {
            self.view = v;
        }
    }

    fn row(&mut self, manifest: &str) -> (JobRow, JobSpec) {
        let spec = xpu_core::job::parse(manifest).unwrap().spec;
        let id = self.next_job;
        self.next_job += 1;
        let row = JobRow {
            id,
            key: None,
            name: spec.name.clone(),
            queue: spec.queue.clone(),
            priority: i64::from(spec.priority),
            state: JobState::Queued,
            spec: serde_json::to_string(&spec).unwrap(),
            submitted_at_ms: self.now.wall_ms,
            started_at_ms: None,
            finished_at_ms: None,
            failures: 0,
            cancel_requested: false,
            message: None,
            owner: None,
        };
        (row, spec)
    }

    fn submit(&mut self, manifest: &str) -> i64 {
        let (row, spec) = self.row(manifest);
        let id = row.id;
        self.input(Input::Msg(Msg::Submitted { row, spec: Box::new(spec) }));
        id
    }

    /// Time passes; the driver ticks.
    fn advance(&mut self, d: Duration) {
        self.now.mono += d;
        self.now.wall_ms += d.as_millis() as i64;
        self.input(Input::Tick);
    }

    fn exit(&mut self, job: i64, idx: u32, attempt: u32, code: i32) {
        self.input(Input::Msg(Msg::Exited { job, idx, attempt, code: Some(code) }));
    }

    fn cancel(&mut self, job: i64) {
        self.input(Input::Msg(Msg::Cancel(job)));
    }

    /// Running tasks of a job: (index, attempt, pid, devices).
    fn tasks(&self, job: i64) -> Vec<(u32, u32, Option<i32>, Vec<u32>)> {
        let Some(r) = self.view.running.iter().find(|r| r.id == job) else { return Vec::new() };
        r.tasks.iter().map(|t| (t.index, t.attempt, t.pid, t.devices.clone())).collect()
    }

    fn pid(&self, job: i64, idx: u32) -> i32 {
        self.tasks(job).iter().find(|t| t.0 == idx).and_then(|t| t.2).unwrap()
    }

    /// The job's last recorded state and message.
    fn state(&self, job: i64) -> Option<(JobState, Option<String>)> {
        self.log.iter().rev().find_map(|e| match e {
            Effect::Write(Write::SetJob { id, state, message, .. }) if *id == job => {
                Some((*state, message.clone()))
            }
            _ => None,
        })
    }

    fn failures(&self, job: i64) -> i64 {
        self.log
            .iter()
            .rev()
            .find_map(|e| match e {
                Effect::Write(Write::SetJob { id, failures, .. }) if *id == job => Some(*failures),
                _ => None,
            })
            .unwrap_or(0)
    }

    fn events(&self, job: Option<i64>) -> Vec<(String, String)> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Effect::Write(Write::Event { job_id, kind, message, .. }) if *job_id == job => {
                    Some((kind.clone(), message.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Task rows written for a job, in order.
    fn rows(&self, job: i64) -> Vec<&TaskRow> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Effect::Write(Write::Task(r)) if r.job_id == job => Some(r),
                _ => None,
            })
            .collect()
    }

    fn spawns(&self, job: i64) -> Vec<(&TaskRow, &Result<Box<Launch>, String>)> {
        self.log
            .iter()
            .filter_map(|e| match e {
                Effect::Spawn { row, launch } if row.job_id == job => Some((row, launch)),
                _ => None,
            })
            .collect()
    }

    /// Signals sent since effect `from`: (pid, signal, to the whole group).
    fn signals(&self, from: usize) -> Vec<(i32, Sig, bool)> {
        self.log[from..]
            .iter()
            .filter_map(|e| match e {
                Effect::Signal { pid, sig, group } => Some((*pid, *sig, *group)),
                _ => None,
            })
            .collect()
    }
}

fn is(state: JobState) -> impl Fn(Option<(JobState, Option<String>)>) -> bool {
    move |s| s.is_some_and(|(s, _)| s == state)
}

fn message(s: &Sim, job: i64) -> String {
    s.state(job).and_then(|(_, m)| m).unwrap_or_default()
}

#[test]
fn a_job_runs_on_free_devices_succeeds_and_is_forgotten() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let id = s.submit(&short("gpus: 1\n"));
    let t = s.tasks(id);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].3, [0], "the first free GPU");
    assert_eq!(s.state(id), Some((JobState::Running, None)));
    // The row is recorded as starting before the process exists, with what it is told.
    let spawns = s.spawns(id);
    assert_eq!(spawns[0].0.state, TaskState::Starting);
    let launch = spawns[0].1.as_ref().unwrap();
    assert!(launch.env.contains(&("CUDA_VISIBLE_DEVICES".into(), "0".into())), "{launch:?}");
    assert!(launch.env.contains(&("XPU_JOB_ID".into(), id.to_string())));
    assert_eq!(launch.dir, PathBuf::from(format!("/var/lib/xpu/tasks/{id}/0-0")));
    assert!(s.log.iter().any(|e| matches!(e, Effect::Metric(Metric::QueueWait(w)) if *w == 0.0)));
    s.advance(Duration::from_secs(3));
    s.exit(id, 0, 0, 0);
    let (state, msg) = s.state(id).unwrap();
    assert_eq!(state, JobState::Succeeded);
    assert_eq!(msg.as_deref(), Some("1 of 1 completions succeeded"));
    let last = s.rows(id).last().copied().unwrap().clone();
    assert_eq!((last.state, last.exit_code), (TaskState::Succeeded, Some(0)));
    assert_eq!(last.finished_at_ms, Some(WALL0 + 3000));
    assert!(!s.m.knows(id));
    assert_eq!(s.m.live_jobs(), 0, "the scheduler forgets an ended job");
    assert!(s.view.running.is_empty() && s.view.holders.iter().all(Vec::is_empty));
}

#[test]
fn a_job_waits_for_busy_devices_with_the_schedulers_reason_then_runs() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let a = s.submit(&short("gpus: 1\n"));
    let b = s.submit(&short("gpus: 1\n"));
    let c = s.submit(&short("gpus: 1\n"));
    assert_eq!(s.tasks(a)[0].3, [0]);
    assert_eq!(s.tasks(b)[0].3, [1]);
    assert!(s.tasks(c).is_empty());
    assert_eq!(s.view.queued.len(), 1);
    assert_eq!(s.view.queued[0].id, c);
    assert_eq!(s.view.queued[0].reason, "0/1 nodes are available: 1 Insufficient gpu");
    s.exit(b, 0, 0, 0);
    assert_eq!(s.tasks(c)[0].3, [1], "on the GPU b freed");
    assert!(s.view.queued.is_empty());
}

#[test]
fn shares_of_one_gpu_run_together_and_a_third_waits_for_a_share() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let half = short("gpus: 1\ngpuMilli: 500\n");
    let a = s.submit(&half);
    let b = s.submit(&half);
    let c = s.submit(&half);
    assert_eq!((s.tasks(a)[0].3.clone(), s.tasks(b)[0].3.clone()), (vec![0], vec![0]));
    assert!(s.tasks(c).is_empty());
    assert_eq!(s.view.holders[0].iter().map(|h| h.milli).sum::<u16>(), 1000);
    let env = &s.spawns(a)[0].1.as_ref().unwrap().env;
    assert!(env.contains(&("XPU_GPU_MILLI".into(), "500".into())), "{env:?}");
    s.exit(a, 0, 0, 0);
    assert_eq!(s.tasks(c)[0].3, [0]);
}

#[test]
fn priority_orders_a_queue_and_fair_share_orders_queues() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let hold = s.submit(&short("gpus: 2\nqueue: ops\n"));
    let low = s.submit(&short("gpus: 1\nqueue: a\n"));
    let high = s.submit(&short("gpus: 1\nqueue: a\npriority: 5\n"));
    let b = s.submit(&short("gpus: 1\nqueue: b\n"));
    let order: Vec<i64> = s.view.queued.iter().map(|q| q.id).collect();
    assert_eq!(order, [high, low, b], "queue order: priority, then submission");
    s.exit(hold, 0, 0, 0);
    // a's high-priority job first, then b's (b holds nothing, a already half the GPUs), ahead
    // of a's older low-priority job.
    assert_eq!((s.tasks(high).len(), s.tasks(b).len(), s.tasks(low).len()), (1, 1, 0));
    assert_eq!(s.view.queued.iter().map(|q| q.id).collect::<Vec<_>>(), [low]);
}

#[test]
fn on_failure_restarts_in_place_on_the_same_devices_with_the_kubelets_backoff() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let id = s.submit(&short("gpus: 1\nrestartPolicy: OnFailure\nbackoffLimit: 2\n"));
    let devices = s.tasks(id)[0].3.clone();
    s.advance(Duration::from_secs(1));
    s.exit(id, 0, 0, 1);
    assert!(s.tasks(id).is_empty(), "waits out its back-off");
    assert_eq!(s.view.holders[devices[0] as usize][0].job, id, "and keeps its devices");
    let ev = s.events(Some(id));
    assert_eq!(ev.last().unwrap().0, "task-failed");
    assert_eq!(
        ev.last().unwrap().1,
        "task 0 attempt 0 failed: exit status 1; restarting in place in 10 s (1 of 2 retries used)"
    );
    // Another job cannot take the held GPU meanwhile.
    let other = s.submit(&short("gpus: 2\n"));
    assert!(s.tasks(other).is_empty());
    s.advance(Duration::from_secs(9));
    assert!(s.tasks(id).is_empty());
    s.advance(Duration::from_secs(1));
    assert_eq!(s.tasks(id), [(0, 1, Some(s.pid(id, 0)), devices.clone())]);
    // The second restart waits twice as long.
    s.exit(id, 0, 1, 1);
    s.advance(Duration::from_secs(19));
    assert!(s.tasks(id).is_empty());
    s.advance(Duration::from_secs(1));
    assert_eq!(s.tasks(id)[0].1, 2);
    assert_eq!(s.tasks(id)[0].3, devices, "OnFailure keeps the devices");
    s.exit(id, 0, 2, 0);
    assert!(is(JobState::Succeeded)(s.state(id)));
    assert_eq!(s.failures(id), 2);
    assert_eq!(s.tasks(other).len(), 1, "the GPUs are free once it ended");
}

#[test]
fn a_restart_back_off_starts_again_after_a_ten_minute_run_and_stops_at_five_minutes() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let id = s.submit(&short("restartPolicy: OnFailure\nbackoffLimit: 100\n"));
    let mut waits = Vec::new();
    for (attempt, run) in (0..).zip([1, 1, 1, 1, 1, 1, 700, 1]) {
        s.advance(Duration::from_secs(run));
        s.exit(id, 0, attempt, 1);
        let mut waited = 0;
        while s.tasks(id).is_empty() {
            s.advance(Duration::from_secs(1));
            waited += 1;
        }
        waits.push(waited);
    }
    assert_eq!(waits, [10, 20, 40, 80, 160, 300, 10, 20]);
}

#[test]
fn never_retries_as_a_new_attempt_until_the_backoff_limit() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let id = s.submit(&short("restartPolicy: Never\nbackoffLimit: 1\n"));
    s.exit(id, 0, 0, 7);
    let t = s.tasks(id);
    assert_eq!((t[0].0, t[0].1), (0, 1), "retried at once, as a new attempt");
    assert!(s.events(Some(id)).iter().any(|(_, m)| m.ends_with("retrying (1 of 1 retries used)")));
    s.exit(id, 0, 1, 7);
    let (state, msg) = s.state(id).unwrap();
    assert_eq!(state, JobState::Failed);
    assert_eq!(
        msg.unwrap(),
        "task 0 attempt 1 failed: exit status 7; backoffLimit 1 reached (BackoffLimitExceeded)"
    );
    assert_eq!(s.failures(id), 2);
    assert_eq!(s.rows(id).iter().filter(|r| r.state == TaskState::Failed).count(), 2);
}

#[test]
fn a_kubernetes_job_gets_the_default_backoff_limit_of_six() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let job = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: fails}\nspec:\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n      - name: c\n        image: busybox\n        command: [\"false\"]\n";
    let id = s.submit(job);
    for attempt in 0..7 {
        assert_eq!(s.tasks(id)[0].1, attempt);
        s.exit(id, 0, attempt, 1);
    }
    assert!(is(JobState::Failed)(s.state(id)));
    assert_eq!(s.failures(id), 7);
}

#[test]
fn a_pod_restarts_always_even_after_success_and_runs_until_cancelled() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: always}\nspec:\n  containers:\n  - name: c\n    command: [sh, -c, 'sleep 0.05']\n";
    let id = s.submit(pod);
    for attempt in 0..3 {
        s.advance(Duration::from_secs(1));
        s.exit(id, 0, attempt, 0);
        while s.tasks(id).is_empty() {
            s.advance(Duration::from_secs(1));
        }
    }
    assert_eq!(s.state(id).unwrap().0, JobState::Running, "never completes");
    assert_eq!(s.failures(id), 0, "exiting 0 is not a failure");
    assert!(
        s.events(Some(id))
            .iter()
            .any(|(k, m)| k == "task-restarted" && m.contains("restartPolicy Always"))
    );
    s.cancel(id);
    let pid = s.pid(id, 0);
    s.input(Input::Msg(Msg::Exited { job: id, idx: 0, attempt: 3, code: Some(143) }));
    assert!(is(JobState::Cancelled)(s.state(id)));
    assert_eq!(s.rows(id).last().unwrap().state, TaskState::Cancelled);
    assert_eq!(s.rows(id).last().unwrap().pid, Some(i64::from(pid)));
}

#[test]
fn completions_beyond_parallelism_run_each_index_once_two_at_a_time() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let id = s.submit(&short("completions: 5\nparallelism: 2\nindexed: true\n"));
    let mut seen = Vec::new();
    while s.m.knows(id) {
        let t = s.tasks(id);
        assert!(t.len() <= 2, "parallelism 2 exceeded: {t:?}");
        let (idx, attempt) = (t[0].0, t[0].1);
        let spawns = s.spawns(id);
        let launch = spawns.iter().rev().find(|(r, _)| r.idx == i64::from(idx)).unwrap().1;
        let env = &launch.as_ref().unwrap().env;
        assert!(env.contains(&("JOB_COMPLETION_INDEX".into(), idx.to_string())));
        seen.push(idx);
        s.exit(id, idx, attempt, 0);
    }
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2, 3, 4]);
    assert_eq!(message(&s, id), "5 of 5 completions succeeded");
}

#[test]
fn a_gang_starts_whole_or_waits_and_holds_nothing_meanwhile() {
    let mut s = Sim::new(&["nvidia-a100:2", "tpu-v6e:4"]);
    let holder = s.submit(&short("gpus: 1\n"));
    let gang = s.submit(&short("gpus: 1\ncompletions: 2\nparallelism: 2\nindexed: true\n"));
    assert!(s.tasks(gang).is_empty(), "one GPU free: no member starts");
    assert_eq!(s.view.holders.iter().flatten().filter(|h| h.job == gang).count(), 0);
    // Work that fits around it still runs (lanes per device kind).
    let tpu = s.submit(&short("tpus: 4\n"));
    assert_eq!(s.tasks(tpu).len(), 1);
    s.exit(holder, 0, 0, 0);
    let t = s.tasks(gang);
    assert_eq!(t.iter().map(|t| (t.0, t.3.len())).collect::<Vec<_>>(), [(0, 1), (1, 1)]);
    assert_ne!(t[0].3, t[1].3);
}

#[test]
fn cancel_sends_sigterm_then_sigkill_to_the_group_after_the_grace_and_holds_the_devices() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let id = s.submit(&short("gpus: 1\n"));
    let pid = s.pid(id, 0);
    let waiting = s.submit(&short("gpus: 1\n"));
    let mark = s.log.len();
    s.cancel(id);
    assert_eq!(s.signals(mark), [(pid, Sig::TERM, false)]);
    assert_eq!(s.state(id).unwrap(), (JobState::Cancelled, Some("cancelled by request".into())));
    assert!(s.tasks(waiting).is_empty(), "the GPU is held until the task has exited");
    // It ignores SIGTERM: SIGKILL to its whole group after the grace, and again every 5 s.
    let mark = s.log.len();
    s.advance(GRACE - Duration::from_millis(1));
    assert!(s.signals(mark).is_empty());
    s.advance(Duration::from_millis(1));
    assert_eq!(s.signals(mark), [(pid, Sig::KILL, true)]);
    s.advance(Duration::from_secs(5));
    assert_eq!(s.signals(mark).len(), 2);
    s.input(Input::Msg(Msg::Exited { job: id, idx: 0, attempt: 0, code: Some(137) }));
    assert_eq!(s.rows(id).last().unwrap().state, TaskState::Cancelled);
    assert!(!s.m.knows(id));
    assert_eq!(s.tasks(waiting).len(), 1, "the GPU is free once it exited");
    // A second cancel of an ended job changes nothing.
    let mark = s.log.len();
    s.cancel(id);
    assert!(s.log[mark..].iter().all(|e| !matches!(e, Effect::Write(Write::SetJob { .. }))));
}

#[test]
fn a_task_cancelled_before_its_process_exists_is_stopped_as_soon_as_it_does() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    // The submission and the cancel reach the machine before the spawn's answer.
    let (row, spec) = s.row(&short("gpus: 1\n"));
    let id = row.id;
    let mut effects = s.m.step(s.now, Input::Msg(Msg::Submitted { row, spec: Box::new(spec) }));
    effects.extend(s.m.step(s.now, Input::Pass { unhealthy: None }));
    assert!(effects.iter().any(|e| matches!(e, Effect::Spawn { .. })));
    let effects = s.m.step(s.now, Input::Msg(Msg::Cancel(id)));
    assert!(!effects.iter().any(|e| matches!(e, Effect::Signal { .. })), "no pid yet");
    let effects =
        s.m.step(s.now, Input::Msg(Msg::Started { job: id, idx: 0, attempt: 0, pid: 77 }));
    assert!(matches!(effects[..], [Effect::Signal { pid: 77, sig: Sig::TERM, group: false }]));
}

#[test]
fn active_deadline_fails_the_job_counting_from_its_recorded_first_start() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let id = s.submit(&short("activeDeadlineSeconds: 2\n"));
    let pid = s.pid(id, 0);
    s.advance(Duration::from_secs(2));
    assert_eq!(s.state(id).unwrap().0, JobState::Running);
    let mark = s.log.len();
    s.advance(Duration::from_millis(1));
    let (state, msg) = s.state(id).unwrap();
    assert_eq!(state, JobState::Failed);
    assert_eq!(msg.unwrap(), "activeDeadlineSeconds 2 exceeded (DeadlineExceeded)");
    assert_eq!(s.signals(mark), [(pid, Sig::TERM, false)]);

    // After a takeover, a job that started 10 s ago with a 5 s deadline fails at once.
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let (mut row, spec) = s.row(&short("activeDeadlineSeconds: 5\n"));
    row.state = JobState::Running;
    row.started_at_ms = Some(WALL0 - 10_000);
    let id = row.id;
    let job = RecoveredJob { row, spec: Ok(spec), history: Vec::new(), cancel: false };
    s.input(Input::Recovered(Box::new(Recovery { jobs: vec![job], tasks: Vec::new() })));
    s.advance(Duration::from_millis(250));
    assert!(message(&s, id).contains("DeadlineExceeded"), "{:?}", s.state(id));
}

#[test]
fn a_job_the_node_can_never_run_fails_naming_the_label_or_resource() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let id = s.submit(&short("nodeSelector: {pool: b}\n"));
    let (state, msg) = s.state(id).unwrap();
    assert_eq!(state, JobState::Failed);
    assert!(msg.unwrap().contains("nodeSelector pool=b does not match the node's pool=a"));
    let id = s.submit(&short("gpus: 3\n"));
    let msg = message(&s, id);
    assert!(msg.starts_with("unschedulable on this node") || msg.starts_with("not schedulable"));
    assert!(msg.contains("the node has 2"), "{msg}");
}

#[test]
fn a_start_that_fails_counts_as_a_failure_with_its_reason() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    // A chain of references that doubles past the kernel's limit fails before any process.
    // The parser refuses such a manifest at submit; a spec stored before it did still reaches
    // the engine, which must fail its start, never build the string.
    let mut env = String::new();
    for i in 0..20 {
        env.push_str(&format!("        - {{name: A{i}, value: x}}\n"));
    }
    let job = format!(
        "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: big}}\nspec:\n  backoffLimit: 0\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n      - name: c\n        image: busybox\n        command: [\"true\"]\n        env:\n{env}"
    );
    let (row, mut spec) = s.row(&job);
    for (i, e) in spec.container.env.iter_mut().enumerate() {
        e.value = if i == 0 { "x".repeat(16) } else { format!("$(A{p})$(A{p})", p = i - 1) };
    }
    let id = row.id;
    s.input(Input::Msg(Msg::Submitted { row, spec: Box::new(spec) }));
    let (state, msg) = s.state(id).unwrap();
    assert_eq!(state, JobState::Failed);
    let msg = msg.unwrap();
    assert!(msg.contains("could not start: env A14: expands to more than 128 KiB"), "{msg}");
    assert!(s.events(Some(id)).iter().any(|(k, _)| k == "start-failed"));
    // And one the driver reports (a store or spawn error) is retried, its reason shown.
    let id = s.submit(&short("gpus: 1\nbackoffLimit: 3\n"));
    let error = "spawning: no such file".to_owned();
    s.input(Input::Msg(Msg::StartFailed { job: id, idx: 0, attempt: 0, error }));
    assert_eq!(s.tasks(id)[0].1, 1, "retried as attempt 1");
    assert!(s.events(Some(id)).iter().any(|(_, m)| m.contains("could not start: spawning")));
}

#[test]
fn after_a_restart_live_tasks_are_adopted_on_their_devices_and_dead_ones_retried() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let (mut a, spec_a) = s.row(&short("gpus: 1\n"));
    let (mut b, spec_b) = s.row(&short("gpus: 1\nbackoffLimit: 3\n"));
    let (mut c, spec_c) = s.row(&short("completions: 2\nindexed: true\n"));
    for r in [&mut a, &mut b, &mut c] {
        r.state = JobState::Running;
        r.started_at_ms = Some(WALL0 - 60_000);
    }
    let task = |job: i64, idx: i64, attempt: i64, devices: Vec<u32>, state| TaskRow {
        job_id: job,
        idx,
        attempt,
        state,
        node: "n".into(),
        devices,
        pid: Some(500 + job),
        started_at_ms: WALL0 - 60_000,
        finished_at_ms: None,
        exit_code: None,
        dir: format!("/var/lib/xpu/tasks/{job}/{idx}-{attempt}"),
    };
    let found = |row: TaskRow, alive: bool, exit: Option<i32>| FoundTask {
        pid: row.pid.map(|p| p as i32),
        row,
        alive,
        exit,
    };
    // a runs on GPU 1, alive. b's attempt 2 on GPU 0 is gone without a status. c's index 0
    // succeeded before; its index 1 is gone and recorded exit 0. A leftover process of an
    // ended job 99 is still there.
    let (ida, idb, idc) = (a.id, b.id, c.id);
    let b_before = task(idb, 0, 1, vec![0], TaskState::Failed);
    let c_done = task(idc, 0, 0, vec![], TaskState::Succeeded);
    let jobs = vec![
        RecoveredJob { row: a, spec: Ok(spec_a), history: vec![], cancel: false },
        RecoveredJob { row: b, spec: Ok(spec_b), history: vec![b_before], cancel: false },
        RecoveredJob { row: c, spec: Ok(spec_c), history: vec![c_done], cancel: false },
    ];
    let tasks = vec![
        found(task(ida, 0, 0, vec![1], TaskState::Running), true, None),
        found(task(idb, 0, 2, vec![0], TaskState::Running), false, None),
        found(task(idc, 1, 0, vec![], TaskState::Running), false, Some(0)),
        found(task(99, 0, 0, vec![], TaskState::Running), true, None),
    ];
    let mark = s.log.len();
    s.input(Input::Recovered(Box::new(Recovery { jobs, tasks })));
    // a: adopted, watched, on GPU 1.
    assert_eq!(s.tasks(ida), [(0, 0, Some(500 + ida as i32), vec![1])]);
    assert!(s.log[mark..].iter().any(
        |e| matches!(e, Effect::Watch { job, pid, .. } if *job == ida && *pid == 500 + ida as i32)
    ));
    assert!(s.events(Some(ida)).iter().any(|(k, _)| k == "adopted"));
    // The leftover of the ended job is killed.
    assert!(s.signals(mark).contains(&(599, Sig::KILL, true)));
    // b: lost, counted as failed, retried as attempt 3 on the free GPU 0.
    assert!(s.events(Some(idb)).iter().any(|(k, _)| k == "lost"));
    assert_eq!(s.tasks(idb), [(0, 3, Some(s.pid(idb, 0)), vec![0])]);
    assert_eq!(s.failures(idb), 1);
    // c: both indices done.
    assert!(is(JobState::Succeeded)(s.state(idc)), "{:?}", s.state(idc));
    // A new GPU job waits: both GPUs are held by adopted and retried tasks.
    let d = s.submit(&short("gpus: 1\n"));
    assert!(s.tasks(d).is_empty());
    s.input(Input::Msg(Msg::Exited { job: ida, idx: 0, attempt: 0, code: Some(0) }));
    assert_eq!(s.tasks(d)[0].3, [1]);
}

#[test]
fn a_takeover_marks_cancelled_and_unreadable_jobs_and_a_lost_leadership_forgets_all() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let (a, spec_a) = s.row(&short("gpus: 1\n"));
    let (b, _) = s.row(&short(""));
    let (ida, idb) = (a.id, b.id);
    let jobs = vec![
        RecoveredJob { row: a, spec: Ok(spec_a), history: vec![], cancel: true },
        RecoveredJob {
            row: b,
            spec: Err("expected value at line 1".into()),
            history: vec![],
            cancel: false,
        },
    ];
    s.input(Input::Recovered(Box::new(Recovery { jobs, tasks: vec![] })));
    assert!(is(JobState::Cancelled)(s.state(ida)));
    assert!(s.tasks(ida).is_empty());
    assert_eq!(message(&s, idb), "stored spec is unreadable: expected value at line 1");
    // A job another daemon accepted, loaded by a poll.
    let (row, spec) = s.row(&short("gpus: 1\n"));
    let id = row.id;
    s.input(Input::Loaded(Box::new(StoredJob { row, spec: Ok(spec), cancel: false })));
    assert_eq!(s.tasks(id).len(), 1);
    s.input(Input::LeadershipLost);
    assert!(!s.m.knows(id));
    assert_eq!(s.m.live_jobs(), 0);
}

#[test]
fn container_tasks_are_killed_and_deleted_through_the_runtime() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let id = s.submit(&short("gpus: 1\nrootfs: /srv/rootfs\n"));
    let pid = s.pid(id, 0);
    let launch = (**s.spawns(id)[0].1.as_ref().unwrap()).clone();
    let c = launch.container.unwrap();
    assert_eq!(c.state_dir, PathBuf::from("/var/lib/xpu/runc"));
    assert_eq!(c.runtime, ["/usr/bin/xpu", "runtime"]);
    s.cancel(id);
    let mark = s.log.len();
    s.advance(GRACE);
    // runc kills the container first; the group only if it is still there 5 s later.
    let calls = |s: &Sim, from: usize| -> Vec<&'static [&'static str]> {
        s.log[from..]
            .iter()
            .filter_map(|e| match e {
                Effect::Runtime { args, .. } => Some(*args),
                _ => None,
            })
            .collect()
    };
    assert_eq!(calls(&s, mark), [["kill", "KILL"]]);
    assert!(s.signals(mark).is_empty());
    s.advance(Duration::from_secs(5));
    assert_eq!(s.signals(mark), [(pid, Sig::KILL, true)]);
    let mark = s.log.len();
    s.input(Input::Msg(Msg::Exited { job: id, idx: 0, attempt: 0, code: Some(137) }));
    assert_eq!(calls(&s, mark), [["delete", "-f"]]);
}

#[test]
fn memory_volumes_are_unmounted_when_a_task_ends() {
    let mut s = Sim::new(&["nvidia-a100:1"]);
    let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: shm}\nspec:\n  restartPolicy: Never\n  volumes:\n  - name: dshm\n    emptyDir: {medium: Memory}\n  containers:\n  - name: c\n    command: [\"true\"]\n    volumeMounts:\n    - {name: dshm, mountPath: /dev/shm}\n";
    let id = s.submit(pod);
    s.exit(id, 0, 0, 0);
    let unmounts: Vec<&PathBuf> = s
        .log
        .iter()
        .filter_map(|e| match e {
            Effect::Unmount(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(unmounts, [&PathBuf::from(format!("/var/lib/xpu/tasks/{id}/0-0/volumes/dshm"))]);
}

#[test]
fn no_work_is_placed_on_an_unhealthy_device_until_it_recovers() {
    let mut s = Sim::new(&["nvidia-a100:2"]);
    let addr: PciAddress = s.m.config.node.devices[0].address.parse().unwrap();
    let bad = BTreeMap::from([(addr, "XID 79".to_owned())]);
    s.input(Input::Pass { unhealthy: Some(bad.clone()) });
    let ev = s.events(None);
    assert_eq!(ev.last().unwrap().0, "device-unhealthy");
    assert!(ev.last().unwrap().1.contains("(XID 79); no new work is placed on it"));
    let a = s.submit(&short("gpus: 1\n"));
    assert_eq!(s.tasks(a)[0].3, [1], "placed on the healthy GPU");
    let b = s.submit(&short("gpus: 1\n"));
    s.input(Input::Pass { unhealthy: Some(bad) });
    assert!(s.tasks(b).is_empty(), "GPU 1 busy, GPU 0 out");
    s.input(Input::Pass { unhealthy: Some(BTreeMap::new()) });
    assert_eq!(s.events(None).last().unwrap().0, "device-healthy");
    assert_eq!(s.tasks(b)[0].3, [0]);
}

#[test]
fn a_task_is_told_its_index_its_pod_and_only_the_devices_it_was_given() {
    let mut s = Sim::new(&["tpu-v6e:8"]);
    let job = r#"apiVersion: batch/v1
kind: Job
metadata: {name: rank}
spec:
  completions: 2
  parallelism: 2
  completionMode: Indexed
  template:
    metadata: {labels: {team: ml}}
    spec:
      restartPolicy: Never
      volumes:
      - name: info
        downwardAPI:
          items:
          - {path: labels, fieldRef: {fieldPath: metadata.labels}}
      initContainers:
      - name: setup
        image: busybox
        command: [sh, -c, "echo $(RANK)"]
        env:
        - {name: RANK, valueFrom: {fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
      containers:
      - name: main
        image: busybox
        command: [sh, -c, "echo $(POD) $(RANK)"]
        env:
        - {name: TPU_VISIBLE_CHIPS, value: "0,1,2,3,4,5,6,7"}
        - {name: POD, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
        - {name: RANK, value: "rank-$(JOB_COMPLETION_INDEX)"}
        resources: {limits: {google.com/tpu: 4}}
"#;
    let id = s.submit(job);
    let spawns = s.spawns(id);
    assert_eq!(spawns.len(), 2, "a gang: both start together");
    let host = s.m.config.node.hostname.clone();
    let mut chips = Vec::new();
    for (i, (_, launch)) in spawns.iter().enumerate() {
        let l = launch.as_ref().unwrap();
        let env = |k: &str| l.env.iter().rev().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(env("JOB_COMPLETION_INDEX"), Some(i.to_string()));
        assert_eq!(env("TPU_WORKER_ID"), Some(i.to_string()));
        assert_eq!(env("TPU_WORKER_HOSTNAMES"), Some(format!("{host},{host}")));
        assert_eq!(env("POD"), Some(format!("rank-{id}-{i}")));
        // The manifest's own device list is dropped: only the daemon says which chips.
        let visible = env("TPU_VISIBLE_CHIPS").unwrap();
        assert_eq!(l.env.iter().filter(|(n, _)| n == "TPU_VISIBLE_CHIPS").count(), 1);
        chips.extend(visible.split(',').map(|c| c.parse::<u32>().unwrap()));
        // `$(VAR)` in the command, by Kubernetes' rules: a variable defined after the one
        // that names it (the Job controller appends JOB_COMPLETION_INDEX) stays as written.
        let main = format!("echo rank-{id}-{i} rank-$(JOB_COMPLETION_INDEX)");
        assert_eq!(l.argv, ["sh", "-c", &main]);
        assert_eq!(l.init[0].argv, ["sh", "-c", &format!("echo {i}")]);
        let labels = &l.files[0].content;
        assert!(labels.contains(&format!("batch.kubernetes.io/job-completion-index=\"{i}\"\n")));
        assert!(labels.contains("team=\"ml\"\n"), "{labels}");
    }
    chips.sort_unstable();
    assert_eq!(chips, (0..8).collect::<Vec<u32>>(), "each index its own four chips");
}

#[test]
fn the_machine_reads_no_clock_and_does_no_io() {
    for (file, src) in
        [("machine.rs", include_str!("../machine.rs")), ("env.rs", include_str!("../env.rs"))]
    {
        for banned in [
            "Instant",
            "SystemTime",
            "now_ms",
            "std::fs",
            "std::net",
            "std::process",
            "tokio",
            "executor::spawn(",
            "executor::signal",
            "executor::recorded",
            "executor::is_",
            "runtime_call",
            ".store",
        ] {
            assert!(
                !src.contains(banned),
                "engine/{file} uses {banned}: that belongs in the driver"
            );
        }
    }
}

/// Required pod anti-affinity (and affinity) between jobs on the one host, as kube-scheduler's
/// inter-pod affinity filter has it: a job the running or placed jobs' terms keep out, or whose
/// own terms they do not meet, waits (shown in the queue with why) and starts once they allow.
#[test]
fn pod_affinity_between_jobs_holds_a_job_until_the_host_allows_it() {
    let mut s = Sim::new(&["nvidia-a100:4"]);
    let job = |name: &str, app: &str, affinity: &str| {
        format!(
            "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  template:\n    metadata: {{labels: {{app: {app}}}}}\n    spec:\n      restartPolicy: Never\n{affinity}      containers: [{{name: c, image: x, command: [\"true\"]}}]\n"
        )
    };
    let apart = |app: &str| {
        format!(
            "      affinity:\n        podAntiAffinity:\n          requiredDuringSchedulingIgnoredDuringExecution:\n          - labelSelector: {{matchLabels: {{app: {app}}}}}\n            topologyKey: kubernetes.io/hostname\n"
        )
    };
    // A job that keeps `db` pods off its host; then a `db` job, which waits for it.
    let web = s.submit(&job("web", "web", &apart("db")));
    assert_eq!(s.tasks(web).len(), 1);
    let db = s.submit(&job("db", "db", ""));
    assert!(s.tasks(db).is_empty(), "the running job's anti-affinity keeps it out");
    let q = s.view.queued.iter().find(|q| q.id == db).unwrap();
    assert!(q.reason.contains("existing pods anti-affinity"), "{}", q.reason);
    // A job whose own anti-affinity selects a running job's pods waits too.
    let cache = s.submit(&job("cache", "cache", &apart("web")));
    assert!(s.tasks(cache).is_empty());
    let q = s.view.queued.iter().find(|q| q.id == cache).unwrap();
    assert!(q.reason.contains("podAntiAffinity"), "{}", q.reason);
    // A job with no terms that no term selects runs beside them.
    let other = s.submit(&job("other", "other", ""));
    assert_eq!(s.tasks(other).len(), 1);
    // When web ends, both start.
    s.exit(web, 0, 0, 0);
    assert_eq!(s.tasks(db).len(), 1, "{:?}", s.view.queued);
    assert_eq!(s.tasks(cache).len(), 1, "{:?}", s.view.queued);
    // Pod affinity: a job that must share the host with `db` pods starts while one runs, and
    // one that must share it with pods nobody runs waits.
    let near = |app: &str| {
        format!(
            "      affinity:\n        podAffinity:\n          requiredDuringSchedulingIgnoredDuringExecution:\n          - labelSelector: {{matchLabels: {{app: {app}}}}}\n            topologyKey: kubernetes.io/hostname\n"
        )
    };
    let with_db = s.submit(&job("with-db", "x", &near("db")));
    assert_eq!(s.tasks(with_db).len(), 1);
    let lonely = s.submit(&job("lonely", "y", &near("nobody")));
    assert!(s.tasks(lonely).is_empty());
    // A held job can be cancelled.
    s.cancel(lonely);
    assert_eq!(s.state(lonely).map(|(st, _)| st), Some(JobState::Cancelled));
    assert!(s.view.queued.iter().all(|q| q.id != lonely));
}
