//! What a daemon needs from the scheduler beyond the simulator: lanes in the fair queue (a job
//! waiting for GPUs does not hold back CPU-only work behind it), adopting running tasks after a
//! restart, re-queueing one task while the job runs on, draining a job whose tasks take time to
//! stop, and explaining why a queued job waits.

#![allow(clippy::unwrap_used)]

use xpu_core::DeviceKind;
use xpu_sched::cluster::{Cluster, NodeSpec};
use xpu_sched::request::{Job, TaskGroup, TaskSpec};
use xpu_sched::scheduler::{Decision, JobId, JobStatus, QueuePolicy, Scheduler, SchedulerConfig};
use xpu_sched::{NodeId, TaskRef};

fn node(gpus: usize) -> Cluster {
    Cluster::from_specs([NodeSpec::new("host", 8_000, 65_536).devices(
        gpus,
        DeviceKind::Gpu,
        "A100",
    )])
    .unwrap()
}

fn fair(lanes: bool) -> SchedulerConfig {
    SchedulerConfig {
        queue: QueuePolicy::Fair,
        lanes,
        fit_per_task: true,
        ..SchedulerConfig::default()
    }
}

fn gpus(name: &str, n: u16) -> Job {
    Job::single(name, TaskGroup::new(1, TaskSpec::gpus(0, 0, n)))
}

fn cpu(name: &str) -> Job {
    Job::single(name, TaskGroup::new(1, TaskSpec::cpu(100, 100)))
}

fn started(ds: &[Decision]) -> Vec<JobId> {
    ds.iter()
        .filter_map(|d| if let Decision::Start { job, .. } = d { Some(*job) } else { None })
        .collect()
}

fn task(i: u32) -> TaskRef {
    TaskRef { group: 0, index: i }
}

#[test]
fn lanes_let_cpu_work_pass_a_job_waiting_for_gpus() {
    for lanes in [false, true] {
        let mut s = Scheduler::new(node(2), fair(lanes)).unwrap();
        let hog = s.submit(gpus("hog", 2), 0).unwrap();
        let waits = s.submit(gpus("waits", 1), 0).unwrap();
        let later_gpu = s.submit(gpus("later", 1), 0).unwrap();
        let cpu_job = s.submit(cpu("cpu"), 0).unwrap();
        let got = started(&s.schedule(1));
        if lanes {
            // The CPU job goes; the later GPU job still may not overtake the waiting one.
            assert_eq!(got, vec![hog, cpu_job]);
        } else {
            assert_eq!(got, vec![hog], "without lanes the queue's head blocks everything");
        }
        s.finish(hog, 2).unwrap();
        let got = started(&s.schedule(2));
        assert_eq!(&got[..2], &[waits, later_gpu]);
        s.audit().unwrap();
    }
}

#[test]
fn fair_share_across_queues_and_priority_inside_one() {
    let mut s = Scheduler::new(node(2), fair(true)).unwrap();
    // Queue a submits three jobs, then queue b one. With two GPUs, a's first job and then b's
    // job start: b's share (0) is below a's (half the GPUs) although a's jobs are older.
    let a1 = s.submit(gpus("a1", 1).queue("a"), 0).unwrap();
    let a_low = s.submit(gpus("a-low", 1).queue("a"), 1).unwrap();
    let a_high = s.submit(gpus("a-high", 1).queue("a").priority(10), 2).unwrap();
    let b1 = s.submit(gpus("b1", 1).queue("b"), 3).unwrap();
    let got = started(&s.schedule(3));
    assert_eq!(got, vec![a_high, b1], "a's highest priority first, then b's fair share");
    s.finish(b1, 4).unwrap();
    assert_eq!(started(&s.schedule(4)), vec![a1], "then a's jobs in submission order");
    s.finish(a1, 5).unwrap();
    assert_eq!(started(&s.schedule(5)), vec![a_low]);
    s.audit().unwrap();
}

#[test]
fn adopted_tasks_hold_their_devices_and_the_rest_queues() {
    let mut s = Scheduler::new(node(4), fair(true)).unwrap();
    // A job of 3 slots with 2 GPUs each; slots 0 and 1 were running on devices 0,1 and 2,3.
    let job = Job::single("train", TaskGroup::new(3, TaskSpec::gpus(0, 0, 2)));
    let running: Vec<(TaskRef, NodeId, Vec<u16>)> =
        vec![(task(0), 0, vec![0, 1]), (task(1), 0, vec![2, 3])];
    let id = s.adopt(job, &running, 100).unwrap();
    let v = s.job(id).unwrap();
    assert_eq!(v.status, JobStatus::Running);
    assert_eq!(v.tasks.len(), 2);
    assert_eq!(s.cluster().used().device(DeviceKind::Gpu), 4000);
    // The third slot waits for room, and says why.
    assert!(started(&s.schedule(100)).is_empty());
    assert_eq!(s.explain(id).unwrap().to_string(), "0/1 nodes are available: 1 Insufficient gpu");
    s.finish_task(id, task(0), 101).unwrap();
    let ds = s.schedule(101);
    let Decision::Start { job, tasks } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!((*job, tasks[0].task), (id, task(2)));
    s.audit().unwrap();

    // Claiming a busy device, a missing task or the wrong count changes nothing.
    let used = s.cluster().used().device(DeviceKind::Gpu);
    let other = Job::single("x", TaskGroup::new(2, TaskSpec::gpus(0, 0, 1)));
    let e = s.adopt(other.clone(), &[(task(0), 0, vec![2])], 102).unwrap_err();
    assert!(e.to_string().contains("over-commit"), "{e}");
    let e = s.adopt(other.clone(), &[(task(5), 0, vec![0])], 102).unwrap_err();
    assert!(e.to_string().contains("has no task"), "{e}");
    let e = s.adopt(other, &[(task(0), 0, vec![0, 1])], 102).unwrap_err();
    assert!(e.to_string().contains("asks for 1 devices, 2 given"), "{e}");
    assert_eq!(s.cluster().used().device(DeviceKind::Gpu), used);
    s.audit().unwrap();
}

#[test]
fn a_requeued_task_is_placed_again_while_the_job_runs_on() {
    let mut s = Scheduler::new(node(2), fair(true)).unwrap();
    let id = s.submit(Job::single("two", TaskGroup::new(2, TaskSpec::gpus(0, 0, 1))), 0).unwrap();
    assert_eq!(started(&s.schedule(0)), vec![id]);
    let blocked = s.submit(gpus("later", 1), 1).unwrap();
    // Task 1 failed: it goes back to the queue ahead of the later job, which keeps waiting.
    s.requeue_task(id, task(1), 2).unwrap();
    assert_eq!(s.job(id).unwrap().status, JobStatus::Running);
    assert_eq!(s.job(id).unwrap().tasks.len(), 1);
    let ds = s.schedule(2);
    let Decision::Start { job, tasks } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!((*job, tasks.len(), tasks[0].task), (id, 1, task(1)));
    assert_eq!(ds.len(), 1);
    assert_eq!(s.job(blocked).unwrap().status, JobStatus::Queued);
    // A task that is not running cannot be re-queued.
    s.requeue_task(id, task(1), 3).unwrap();
    assert!(s.requeue_task(id, task(1), 3).is_err());
    s.audit().unwrap();
}

#[test]
fn a_draining_job_keeps_its_devices_until_each_task_ends() {
    let mut s = Scheduler::new(node(2), fair(true)).unwrap();
    let id = s.submit(Job::single("gang", TaskGroup::new(2, TaskSpec::gpus(0, 0, 1))), 0).unwrap();
    assert_eq!(started(&s.schedule(0)), vec![id]);
    let next = s.submit(gpus("next", 2), 1).unwrap();
    s.requeue_task(id, task(1), 1).unwrap();
    s.drain(id, 2).unwrap();
    // Task 0 is still stopping: nothing may be placed on its GPU, and task 1 is not placed.
    assert!(started(&s.schedule(2)).is_empty());
    assert_eq!(s.cluster().used().device(DeviceKind::Gpu), 1000);
    s.finish_task(id, task(0), 3).unwrap();
    assert_eq!(s.job(id).unwrap().status, JobStatus::Finished);
    assert_eq!(started(&s.schedule(3)), vec![next]);
    // Draining a job with nothing running cancels it.
    let q = s.submit(gpus("q", 1), 4).unwrap();
    s.drain(q, 4).unwrap();
    assert_eq!(s.job(q).unwrap().status, JobStatus::Cancelled);
    s.audit().unwrap();
}

#[test]
fn explain_names_the_filter_and_is_silent_when_it_would_fit() {
    let mut s = Scheduler::new(node(1), fair(true)).unwrap();
    let a = s.submit(gpus("a", 1), 0).unwrap();
    s.schedule(0);
    let share = Job::single("share", TaskGroup::new(1, TaskSpec::gpu_share(0, 0, 500)));
    let b = s.submit(share, 1).unwrap();
    assert!(started(&s.schedule(1)).is_empty());
    assert_eq!(s.explain(b).unwrap().to_string(), "0/1 nodes are available: 1 Insufficient gpu");
    assert!(s.explain(a).is_none(), "running, nothing to place");
    s.finish(a, 2).unwrap();
    assert!(s.explain(b).is_none(), "fits now");
    assert_eq!(s.cluster().used().device(DeviceKind::Gpu), 0, "explain changes nothing");
    let never = s.submit(gpus("never", 2), 3).unwrap();
    assert!(s.explain(never).unwrap().to_string().contains("Insufficient gpu"));
}

#[test]
fn fit_per_task_runs_more_tasks_than_fit_at_once() {
    // Three 1-GPU tasks on a 2-GPU node: never fits as a whole, fine one task at a time.
    let job = || Job::single("three", TaskGroup::new(3, TaskSpec::gpus(0, 0, 1)));
    let mut strict = Scheduler::new(node(2), fair(true)).unwrap();
    let mut whole = Scheduler::new(
        node(2),
        SchedulerConfig { queue: QueuePolicy::Fair, ..SchedulerConfig::default() },
    )
    .unwrap();
    let w = whole.submit(job(), 0).unwrap();
    assert!(matches!(whole.schedule(0)[0], Decision::Fail { job, .. } if job == w));
    let id = strict.submit(job(), 0).unwrap();
    let ds = strict.schedule(0);
    let Decision::Start { tasks, .. } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!(tasks.len(), 2);
    strict.finish_task(id, tasks[0].task, 1).unwrap();
    let ds = strict.schedule(1);
    let Decision::Start { tasks, .. } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!(tasks[0].task, task(2));
    // A gang bigger than the node still fails at once.
    let gang = strict
        .submit(Job::single("g", TaskGroup::new(3, TaskSpec::gpus(0, 0, 1)).gang()), 2)
        .unwrap();
    assert!(
        strict.schedule(2).iter().any(|d| matches!(d, Decision::Fail { job, .. } if *job == gang))
    );
}
