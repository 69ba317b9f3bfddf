//! The scheduler's promises, each on a small cluster: gangs are all or nothing and never
//! deadlock, TPU slices land on one slice's hosts, backfill never delays the head job,
//! preemption takes the lowest priority (and least work) first, flex-start pools provision,
//! stop jobs at the maximum run duration and release idle capacity.

#![allow(clippy::unwrap_used)]

use xpu_core::DeviceKind;
use xpu_sched::cluster::{Cluster, DeviceSpec, NodeSpec};
use xpu_sched::pool::FlexPool;
use xpu_sched::request::{GKE_TPU_ACCELERATOR, GKE_TPU_TOPOLOGY, Job, TaskGroup, TaskSpec};
use xpu_sched::scheduler::{
    Decision, JobId, JobStatus, QueuePolicy, Scheduler, SchedulerConfig, StopReason,
};

fn gpu_nodes(n: usize, gpus: usize) -> Cluster {
    Cluster::from_specs((0..n).map(|i| {
        NodeSpec::new(format!("n{i}"), 64_000, 512_000).devices(gpus, DeviceKind::Gpu, "A100")
    }))
    .unwrap()
}

fn cfg(queue: QueuePolicy) -> SchedulerConfig {
    SchedulerConfig { queue, ..SchedulerConfig::default() }
}

fn gpus(name: &str, n: u16) -> Job {
    Job::single(name, TaskGroup::new(1, TaskSpec::gpus(1000, 1000, n)))
}

fn started(ds: &[Decision]) -> Vec<JobId> {
    ds.iter()
        .filter_map(|d| if let Decision::Start { job, .. } = d { Some(*job) } else { None })
        .collect()
}

#[test]
fn gangs_are_all_or_nothing_and_hold_nothing_while_waiting() {
    // 4 nodes of 8 GPUs. A non-gang job holds 2 nodes; a gang of 3 full nodes cannot fit.
    let mut s = Scheduler::new(gpu_nodes(4, 8), cfg(QueuePolicy::Fifo)).unwrap();
    let hog =
        s.submit(Job::single("hog", TaskGroup::new(2, TaskSpec::gpus(1000, 1000, 8))), 0).unwrap();
    assert_eq!(started(&s.schedule(0)), vec![hog]);
    let gang = s
        .submit(Job::single("gang", TaskGroup::new(3, TaskSpec::gpus(1000, 1000, 8)).gang()), 1)
        .unwrap();
    assert!(started(&s.schedule(1)).is_empty());
    // Nothing of the gang is placed: the two free nodes are still entirely free.
    assert_eq!(s.job(gang).unwrap().status, JobStatus::Queued);
    assert!(s.job(gang).unwrap().tasks.is_empty());
    assert_eq!(s.cluster().used().device(DeviceKind::Gpu), 16_000);
    s.audit().unwrap();
    // Once the hog leaves, the gang starts whole: three tasks on three nodes.
    s.finish(hog, 5).unwrap();
    let ds = s.schedule(5);
    let Decision::Start { job, tasks } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!((*job, tasks.len()), (gang, 3));
    let mut nodes: Vec<u32> = tasks.iter().map(|t| t.placement.node).collect();
    nodes.dedup();
    assert_eq!(nodes.len(), 3);
    s.audit().unwrap();
}

/// Fair queue: with `lanes`, a GPU job that cannot start holds back the later GPU jobs of its
/// queue; with `best_effort`, they are placed around it (kube-scheduler's order), and it still
/// starts first once it fits.
#[test]
fn best_effort_places_around_a_job_that_waits_and_strict_lanes_do_not() {
    for best_effort in [false, true] {
        let config = SchedulerConfig {
            queue: QueuePolicy::Fair,
            lanes: true,
            best_effort,
            fit_per_task: true,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(gpu_nodes(1, 4), config).unwrap();
        let hog = s.submit(gpus("hog", 3), 0).unwrap();
        assert_eq!(started(&s.schedule(0)), vec![hog]);
        let big = s.submit(gpus("big", 2), 1).unwrap();
        let small = s.submit(gpus("small", 1), 2).unwrap();
        let ds = started(&s.schedule(2));
        if best_effort {
            assert_eq!(ds, vec![small], "the small job fills the free GPU");
        } else {
            assert!(ds.is_empty(), "strict: the big job holds its lane: {ds:?}");
        }
        s.finish(hog, 3).unwrap();
        let ds = started(&s.schedule(3));
        assert!(ds.starts_with(&[big]), "{ds:?}");
        s.audit().unwrap();
    }
}

/// Fair queue with `reserve`: an 8-GPU job that cannot start reserves the node that frees up
/// first; the 2-GPU jobs after it fill only the other node (best effort would fill both and
/// starve it; strict lanes would leave both idle), and it starts as soon as its node frees.
#[test]
fn reserve_fills_around_a_waiting_job_without_delaying_it() {
    let config = SchedulerConfig {
        queue: QueuePolicy::Fair,
        lanes: true,
        reserve: true,
        fit_per_task: true,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(gpu_nodes(2, 8), config).unwrap();
    let a = s.submit(gpus("a", 4), 0).unwrap();
    let b = s.submit(gpus("b", 6), 0).unwrap();
    assert_eq!(started(&s.schedule(0)).len(), 2);
    let (na, nb) = (node_of(&s, a), node_of(&s, b));
    assert_ne!(na, nb);
    let big = s.submit(gpus("big", 8), 1).unwrap();
    let small: Vec<JobId> =
        (0..4).map(|i| s.submit(gpus(&format!("s{i}"), 2), 2).unwrap()).collect();
    let ds = started(&s.schedule(2));
    // The big job holds a's node (4 GPUs free there, the most); the small ones take b's two
    // free GPUs only.
    assert_eq!(ds, vec![small[0]], "{ds:?}");
    assert_eq!(node_of(&s, small[0]), nb);
    s.finish(a, 3).unwrap();
    let ds = started(&s.schedule(3));
    assert_eq!(ds.first(), Some(&big), "{ds:?}");
    assert_eq!(node_of(&s, big), na);
    s.audit().unwrap();
}

fn node_of(s: &Scheduler, id: JobId) -> u32 {
    s.job(id).unwrap().tasks[0].placement.node
}

#[test]
fn two_gangs_that_cannot_both_fit_do_not_deadlock() {
    // Each gang wants 3 of the 4 nodes; one runs, the other waits with nothing held, then runs.
    let mut s = Scheduler::new(gpu_nodes(4, 8), cfg(QueuePolicy::Fifo)).unwrap();
    let a =
        s.submit(Job::single("a", TaskGroup::new(3, TaskSpec::gpus(0, 0, 8)).gang()), 0).unwrap();
    let b =
        s.submit(Job::single("b", TaskGroup::new(3, TaskSpec::gpus(0, 0, 8)).gang()), 0).unwrap();
    assert_eq!(started(&s.schedule(0)), vec![a]);
    assert_eq!(
        s.cluster().used().device(DeviceKind::Gpu),
        24_000,
        "b holds no partial reservation"
    );
    s.finish(a, 10).unwrap();
    assert_eq!(started(&s.schedule(10)), vec![b]);
}

fn tpu_slice(pool: &str, hosts: usize, acc: &str, topo: &str) -> Vec<NodeSpec> {
    (0..hosts)
        .map(|h| {
            let mut n = NodeSpec::new(format!("{pool}-{h}"), 200_000, 400_000)
                .pool(pool)
                .label(GKE_TPU_ACCELERATOR, acc)
                .label(GKE_TPU_TOPOLOGY, topo);
            for c in 0..4 {
                n = n.device(
                    DeviceSpec::new(format!("chip{c}"), DeviceKind::Tpu, "TPU-v5p").domain("ici"),
                );
            }
            n
        })
        .collect()
}

#[test]
fn tpu_slices_take_every_host_of_one_slice() {
    // Two 4-host v5p 2x2x4 slices; one host of slice a is busy with a single-host job.
    let mut specs = tpu_slice("slice-a", 4, "tpu-v5p-slice", "2x2x4");
    specs.extend(tpu_slice("slice-b", 4, "tpu-v5p-slice", "2x2x4"));
    let c = Cluster::from_specs(specs).unwrap();
    let mut s = Scheduler::new(c, cfg(QueuePolicy::Fifo)).unwrap();
    let small = Job::single(
        "small",
        TaskGroup::new(
            1,
            TaskSpec { device_kind: Some(DeviceKind::Tpu), ..TaskSpec::gpus(0, 0, 1) }
                .select("x", "y"),
        ),
    );
    // A selector nothing matches: the job can never run, and says why.
    let never = s.submit(small, 0).unwrap();
    let ds = s.schedule(0);
    let Decision::Fail { job, error } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!(*job, never);
    assert!(
        error.to_string().contains("8 node(s) didn't match Pod's node affinity/selector"),
        "{error}"
    );

    let one_chip = Job::single(
        "one",
        TaskGroup::new(
            1,
            TaskSpec {
                device_kind: Some(DeviceKind::Tpu),
                pool: Some("slice-a".into()),
                ..TaskSpec::gpus(0, 0, 1)
            },
        ),
    );
    s.submit(one_chip, 1).unwrap();
    s.schedule(1);
    let train = s
        .submit(
            Job::single(
                "train",
                TaskGroup::tpu("tpu-v5p-slice", "2x2x4", TaskSpec::cpu(1000, 1000)),
            ),
            2,
        )
        .unwrap();
    let ds = s.schedule(2);
    let Decision::Start { job, tasks } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!(*job, train);
    assert_eq!(tasks.len(), 4, "2x2x4 = 16 chips = 4 hosts of 4 chips");
    for t in tasks {
        let node = s.cluster().node(t.placement.node).unwrap();
        assert_eq!(node.pool.as_deref(), Some("slice-b"), "all hosts in the one free slice");
        assert_eq!(t.placement.devices.len(), 4);
    }
    // A second 2x2x4 cannot split across the leftovers of two slices.
    let again = s
        .submit(
            Job::single("again", TaskGroup::tpu("tpu-v5p-slice", "2x2x4", TaskSpec::cpu(0, 0))),
            3,
        )
        .unwrap();
    assert!(started(&s.schedule(3)).is_empty());
    assert_eq!(s.job(again).unwrap().status, JobStatus::Queued);
    s.audit().unwrap();
}

#[test]
fn backfill_never_delays_the_head_job() {
    // 2 nodes × 8 GPUs. A runs 8 GPUs until t=100. The head H needs 16 GPUs, so it is reserved
    // for t=100. Short jobs that end by then may jump ahead; a long one may not take H's nodes.
    let run = |queue| {
        let mut s = Scheduler::new(gpu_nodes(2, 8), cfg(queue)).unwrap();
        let a = s.submit(gpus("a", 8).duration_hint(100), 0).unwrap();
        s.schedule(0);
        let h = s
            .submit(
                Job::single("h", TaskGroup::new(2, TaskSpec::gpus(0, 0, 8)).gang())
                    .duration_hint(50),
                1,
            )
            .unwrap();
        let short = s.submit(gpus("short", 4).duration_hint(60), 2).unwrap();
        let long = s.submit(gpus("long", 4).duration_hint(1000), 3).unwrap();
        let mut t = 3;
        let first = started(&s.schedule(t));
        let reserved = s.reservation();
        // Event loop with exact durations.
        let mut ends: Vec<(u64, JobId)> = Vec::new();
        for &j in &first {
            ends.push((t + s.job(j).unwrap().job.duration_hint.unwrap(), j));
        }
        ends.push((100, a));
        let mut starts = std::collections::BTreeMap::new();
        for j in first {
            starts.insert(j, t);
        }
        while let Some(&(te, j)) = ends.iter().min() {
            ends.retain(|&(x, y)| (x, y) != (te, j));
            t = te;
            s.finish(j, t).unwrap();
            for k in started(&s.schedule(t)) {
                starts.insert(k, t);
                ends.push((t + s.job(k).unwrap().job.duration_hint.unwrap(), k));
            }
            s.audit().unwrap();
        }
        (starts[&h], starts[&short], starts[&long], reserved)
    };
    let (h_fifo, short_fifo, _, _) = run(QueuePolicy::Fifo);
    let (h_bf, short_bf, long_bf, res) = run(QueuePolicy::Backfill);
    assert_eq!(h_fifo, 100);
    assert_eq!(h_bf, h_fifo, "backfill did not delay the head");
    assert_eq!(res, Some((1, 100)), "the head (job 1) is reserved for A's end");
    assert!(short_bf < short_fifo, "the short job jumped ahead ({short_bf} < {short_fifo})");
    assert!(long_bf >= h_bf, "the long job would have delayed the head, so it waited");
}

#[test]
fn preemption_takes_the_lowest_priority_then_the_least_work() {
    let config = SchedulerConfig {
        queue: QueuePolicy::Priority,
        preemption: true,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(gpu_nodes(1, 8), config).unwrap();
    let low_old = s.submit(gpus("low-old", 2).priority(1), 0).unwrap();
    s.schedule(0);
    let mid = s.submit(gpus("mid", 2).priority(5), 10).unwrap();
    let low_young = s.submit(gpus("low-young", 2).priority(1), 10).unwrap();
    let other = s.submit(gpus("other", 2).priority(3), 10).unwrap();
    assert_eq!(started(&s.schedule(10)).len(), 3);
    // The node is full. A priority-10 job needing 2 GPUs evicts one job: priority 1, and of
    // the two priority-1 jobs, the one that ran for less time (less work lost).
    let urgent = s.submit(gpus("urgent", 2).priority(10), 100).unwrap();
    let ds = s.schedule(100);
    let preempted: Vec<JobId> = ds
        .iter()
        .filter_map(|d| {
            if let Decision::Preempt { job, by, .. } = d {
                assert_eq!(*by, urgent);
                Some(*job)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(preempted, vec![low_young]);
    assert_eq!(started(&ds), vec![urgent]);
    for j in [low_old, mid, other, urgent] {
        assert_eq!(s.job(j).unwrap().status, JobStatus::Running);
    }
    assert_eq!(s.job(low_young).unwrap().status, JobStatus::Queued);
    assert_eq!(s.job(low_young).unwrap().restarts, 1);
    // A 4-GPU urgent job needs two victims: both priority-1 jobs go before priority 3.
    let big = s.submit(gpus("big", 4).priority(10), 200).unwrap();
    let ds = s.schedule(200);
    let mut preempted: Vec<JobId> = ds
        .iter()
        .filter_map(|d| if let Decision::Preempt { job, .. } = d { Some(*job) } else { None })
        .collect();
    preempted.sort_unstable();
    assert_eq!(
        preempted,
        vec![low_old, other],
        "lowest priorities first: 1 then 3; mid (5) survives"
    );
    assert_eq!(started(&ds), vec![big]);
    s.audit().unwrap();
}

#[test]
fn fair_share_alternates_between_queues_by_dominant_share() {
    let mut s = Scheduler::new(gpu_nodes(1, 8), cfg(QueuePolicy::Fair)).unwrap();
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..8 {
        a.push(s.submit(gpus(&format!("a{i}"), 1).queue("alice"), 0).unwrap());
    }
    for i in 0..8 {
        b.push(s.submit(gpus(&format!("b{i}"), 1).queue("bob"), 0).unwrap());
    }
    let st = started(&s.schedule(0));
    assert_eq!(st.len(), 8);
    let alice = st.iter().filter(|j| a.contains(j)).count();
    assert_eq!(alice, 4, "each queue gets half the GPUs although alice submitted first: {st:?}");
}

#[test]
fn flex_start_provisions_stops_at_max_run_and_releases_idle_nodes() {
    let node = NodeSpec::new("tpu", 200_000, 400_000)
        .label(GKE_TPU_ACCELERATOR, "tpu-v6e-slice")
        .label(GKE_TPU_TOPOLOGY, "4x4")
        .devices(4, DeviceKind::Tpu, "TPU-v6e");
    let mut pool = FlexPool::new("flex", node, 4);
    pool.provisioning_delay = 120;
    pool.idle_release = 600;
    let config = SchedulerConfig { pools: vec![pool], ..SchedulerConfig::default() };
    let mut s = Scheduler::new(Cluster::new(), config).unwrap();
    let job =
        Job::single("train", TaskGroup::tpu("tpu-v6e-slice", "4x4", TaskSpec::cpu(1000, 1000)));
    let id = s.submit(job, 0).unwrap();
    let ds = s.schedule(0);
    let Decision::Provision { job, pool, nodes, ready_at } = &ds[0] else { panic!("{ds:?}") };
    assert_eq!(
        (*job, pool.as_str(), nodes.len(), *ready_at),
        (id, "flex", 4, 120),
        "4x4 = 4 VMs, all at once"
    );
    assert_eq!(s.job(id).unwrap().status, JobStatus::Provisioning);
    assert_eq!(s.next_wakeup(), Some(120));
    assert!(s.schedule(60).is_empty(), "nothing before the nodes are up");
    let ds = s.schedule(120);
    assert_eq!(started(&ds), vec![id]);
    // Seven days later the job is stopped.
    let week = 7 * 24 * 3600;
    assert_eq!(s.next_wakeup(), Some(120 + week));
    let ds = s.schedule(120 + week);
    assert!(
        matches!(&ds[0], Decision::Stop { job, reason: StopReason::MaxRunDuration, tasks } if *job == id && tasks.len() == 4),
        "{ds:?}"
    );
    assert_eq!(s.job(id).unwrap().status, JobStatus::Stopped);
    // Idle for 600 s, the nodes go back.
    assert_eq!(s.next_wakeup(), Some(120 + week + 600));
    let ds = s.schedule(120 + week + 600);
    assert_eq!(ds.iter().filter(|d| matches!(d, Decision::Release { .. })).count(), 4);
    let r = &s.pool_reports(120 + week + 600)[0];
    assert_eq!(r.provisionings, 1);
    assert_eq!(r.stopped_at_max_run, 1);
    assert!((r.node_hours_used - 4.0 * week as f64 / 3600.0).abs() < 1e-6, "{r:?}");
    assert!((r.node_hours_idle - 4.0 * 600.0 / 3600.0).abs() < 1e-6, "{r:?}");
    assert!((r.mean_provisioning_wait - 120.0).abs() < 1e-9);
    s.audit().unwrap();
}

#[test]
fn a_job_shorter_than_the_limit_finishes_and_a_pool_smaller_than_the_gang_is_not_asked() {
    let node = NodeSpec::new("g", 8000, 8000).devices(8, DeviceKind::Gpu, "H100");
    let mut pool = FlexPool::new("flex", node, 2);
    pool.max_run_duration = 3600;
    let config = SchedulerConfig { pools: vec![pool], ..SchedulerConfig::default() };
    let mut s = Scheduler::new(Cluster::new(), config).unwrap();
    // Three 8-GPU hosts at once is more than the pool's max: never provisioned, failed.
    let big =
        s.submit(Job::single("big", TaskGroup::new(3, TaskSpec::gpus(0, 0, 8)).gang()), 0).unwrap();
    let ok = s.submit(gpus("ok", 8), 0).unwrap();
    let ds = s.schedule(0);
    assert!(matches!(&ds[0], Decision::Fail { job, .. } if *job == big), "{ds:?}");
    assert!(
        matches!(&ds[1], Decision::Provision { job, nodes, .. } if *job == ok && nodes.len() == 1),
        "{ds:?}"
    );
    s.schedule(300);
    s.finish(ok, 1000).unwrap();
    assert_eq!(s.job(ok).unwrap().status, JobStatus::Finished);
    s.audit().unwrap();
}

#[test]
fn priority_order_ages_waiting_jobs() {
    // One GPU. Without aging the later priority-5 job goes first; with 10 points per hour, a
    // priority-0 job that waited an hour overtakes a priority-5 job submitted just now.
    for (aging, first) in [(0.0, "new-important"), (10.0, "old-patient")] {
        let config = SchedulerConfig {
            queue: QueuePolicy::Priority,
            aging_per_hour: aging,
            ..SchedulerConfig::default()
        };
        let mut s = Scheduler::new(gpu_nodes(1, 1), config).unwrap();
        let blocker = s.submit(gpus("blocker", 1), 0).unwrap();
        s.schedule(0);
        let old = s.submit(gpus("old-patient", 1), 0).unwrap();
        let new = s.submit(gpus("new-important", 1).priority(5), 3600).unwrap();
        s.finish(blocker, 3600).unwrap();
        let st = started(&s.schedule(3600));
        assert_eq!(st.len(), 1);
        let name = &s.job(st[0]).unwrap().job.name;
        assert_eq!(name, first, "aging {aging}");
        assert!(st[0] == old || st[0] == new);
    }
}

/// A long-running caller forgets jobs as they end: memory follows the live jobs, ids are never
/// reused, and only an ended job can be forgotten.
#[test]
fn ended_jobs_are_forgotten_and_ids_never_come_back() {
    let mut s = Scheduler::new(gpu_nodes(1, 8), cfg(QueuePolicy::Fair)).unwrap();
    let mut last = None;
    for round in 0..1000u64 {
        let a = s.submit(gpus("a", 4), round).unwrap();
        let b = s.submit(gpus("b", 8), round).unwrap();
        assert!(last.is_none_or(|l| a > l), "ids keep counting up");
        assert_eq!(started(&s.schedule(round)), vec![a]);
        assert!(matches!(s.forget(a), Err(xpu_sched::scheduler::SchedError::WrongState { .. })));
        s.finish(a, round).unwrap();
        s.forget(a).unwrap();
        assert!(s.job(a).is_none());
        assert!(matches!(s.finish(a, round), Err(xpu_sched::scheduler::SchedError::NoSuchJob(_))));
        s.cancel(b, round).unwrap();
        s.forget(b).unwrap();
        s.audit().unwrap();
        last = Some(b);
    }
    assert_eq!((s.jobs(), s.live_jobs()), (2000, 0));
    assert_eq!(s.cluster().used().device(DeviceKind::Gpu), 0);
}
