//! Trace replay over time: jobs arrive at their submit time, run for their recorded duration
//! once the [`Scheduler`] starts them, and leave; the report gives job completion time (JCT)
//! and queueing delay (mean, p50, p95, p99), GPU utilisation and makespan.
//!
//! The simulator is the scheduler's clock: it jumps from event to event (arrivals, completions,
//! the scheduler's own wake-ups for flex-start pools), calls [`Scheduler::schedule`] once per
//! event time after applying every completion and arrival of that instant, and turns the
//! decisions back into completion events. Duration hints are the true durations, as is usual
//! for shortest-job-first and backfill studies.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::Serialize;

use crate::cluster::ClusterError;
use crate::policy::{PolicyKind, TaskMix};
use crate::pool::PoolReport;
use crate::request::{Job, TaskGroup, TaskSpec, Time};
use crate::scheduler::{Decision, JobStatus, QueuePolicy, SchedError, Scheduler, SchedulerConfig};
use crate::sim::spec::{self, PoolSpec};
use crate::trace::{MAX_TIME, OpenbPod, PhillyJob};

/// One job to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayJob {
    pub name: String,
    pub submit: Time,
    pub duration: Time,
    pub job: Job,
}

/// Philly jobs: `n` GPUs on one node when `n` fits a node, otherwise a gang of full nodes (and
/// one smaller task for the remainder). Philly records no CPU or memory, so tasks ask for none.
pub fn from_philly(jobs: &[PhillyJob], gpus_per_node: u16) -> Vec<ReplayJob> {
    let per = u32::from(gpus_per_node.max(1));
    jobs.iter()
        .map(|j| {
            let mut groups = Vec::new();
            if j.gpus <= per {
                groups.push(TaskGroup::new(1, TaskSpec::gpus(0, 0, j.gpus as u16)));
            } else {
                groups.push(TaskGroup::new(j.gpus / per, TaskSpec::gpus(0, 0, per as u16)).gang());
                if j.gpus % per != 0 {
                    groups.push(
                        TaskGroup::new(1, TaskSpec::gpus(0, 0, (j.gpus % per) as u16)).gang(),
                    );
                }
            }
            let name = format!("philly-{}", j.line);
            let mut job = Job::single(name.clone(), groups.remove(0))
                .duration_hint(j.duration)
                .queue(j.cluster.clone());
            job.groups.extend(groups);
            ReplayJob { name, submit: j.submit, duration: j.duration, job }
        })
        .collect()
}

/// OpenB pods with creation and deletion times: one task each (CPU, memory, whole GPUs or a
/// share, allowed models). Pods without both times are skipped and counted.
pub fn from_openb(pods: &[OpenbPod]) -> (Vec<ReplayJob>, usize) {
    let mut skipped = 0;
    let mut out = Vec::new();
    for p in pods {
        let (Some(c), Some(d)) = (p.creation_time, p.deletion_time) else {
            skipped += 1;
            continue;
        };
        let start = p.scheduled_time.unwrap_or(c).max(c);
        let mut task = match (p.num_gpu, p.gpu_milli) {
            (0, _) => TaskSpec::cpu(p.cpu_milli, p.memory_mib),
            (1, m) if m < 1000 => TaskSpec::gpu_share(p.cpu_milli, p.memory_mib, m),
            (n, _) => TaskSpec::gpus(p.cpu_milli, p.memory_mib, n),
        };
        task.models = p.gpu_spec.clone();
        let duration = d.saturating_sub(start).max(1);
        let job = Job::single(p.name.clone(), TaskGroup::new(1, task)).duration_hint(duration);
        out.push(ReplayJob { name: p.name.clone(), submit: c, duration, job });
    }
    (out, skipped)
}

/// Mean and percentiles of a set of durations, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
}

impl Stats {
    pub fn of(mut v: Vec<u64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_unstable();
        // Nearest-rank percentiles.
        let pct =
            |p: f64| v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1] as f64;
        Self {
            mean: v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64,
            p50: pct(50.0),
            p95: pct(95.0),
            p99: pct(99.0),
        }
    }
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    pub policy: PolicyKind,
    pub queue: QueuePolicy,
    pub jobs: usize,
    pub finished: usize,
    /// Jobs that can never fit the cluster.
    pub failed: usize,
    /// Jobs stopped at their maximum run duration.
    pub stopped: usize,
    pub preemptions: usize,
    /// Submit to finish, finished jobs.
    pub jct: Stats,
    /// Submit to first start, started jobs.
    pub queueing: Stats,
    /// Submit to first start, started jobs asking for a whole node's worth of devices (8) or
    /// more: what a queueing policy that fills the cluster may cost the large jobs.
    pub queueing_large: Stats,
    /// Device-time held by running tasks ÷ (device capacity × makespan), percent.
    pub gpu_utilization: f64,
    /// First submit to last completion, seconds.
    pub makespan: Time,
    pub pools: Vec<PoolReport>,
}

/// Replay options.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub policy: PolicyKind,
    pub queue: QueuePolicy,
    pub preemption: bool,
    pub seed: u64,
    /// Fair queue only: how a job that cannot start treats the jobs behind it (see
    /// [`SchedulerConfig::lanes`], [`SchedulerConfig::best_effort`],
    /// [`SchedulerConfig::reserve`]).
    pub lanes: bool,
    pub best_effort: bool,
    pub reserve: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            policy: PolicyKind::Xpu,
            queue: QueuePolicy::Fifo,
            preemption: false,
            seed: 42,
            lanes: false,
            best_effort: false,
            reserve: false,
        }
    }
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Sched(#[from] SchedError),
    #[error("the trace has no jobs to replay")]
    Empty,
    #[error(
        "job {name}: submit time {submit} s or duration {duration} s is beyond {MAX_TIME} s, which the replay cannot reach; fix the trace"
    )]
    TimeOutOfRange { name: String, submit: Time, duration: Time },
}

/// Replays `jobs` (any order) on the cluster of `pools`. `progress(done, total)` is called as
/// jobs complete.
pub fn replay(
    pools: &[PoolSpec],
    jobs: &[ReplayJob],
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayReport, ReplayError> {
    if jobs.is_empty() {
        return Err(ReplayError::Empty);
    }
    // The event loop below takes `Time::MAX` for "no more events"; a job at or near it would
    // never be submitted or finished, and the report would not say so.
    if let Some(j) = jobs.iter().find(|j| j.submit > MAX_TIME || j.duration > MAX_TIME) {
        return Err(ReplayError::TimeOutOfRange {
            name: j.name.clone(),
            submit: j.submit,
            duration: j.duration,
        });
    }
    let (cluster, flex) = spec::build(pools)?;
    let config = SchedulerConfig {
        queue: opts.queue,
        policy: opts.policy,
        preemption: opts.preemption,
        pools: flex,
        seed: opts.seed,
        lanes: opts.lanes,
        best_effort: opts.best_effort,
        reserve: opts.reserve,
        ..SchedulerConfig::default()
    };
    let mut sched = Scheduler::new(cluster, config)?;
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| (jobs[i].submit, i));
    if opts.policy.needs_mix() {
        // The typical mix FGD and xpu measure fragmentation against: the trace's task shapes.
        let mut demands = Vec::new();
        for j in jobs {
            for g in &j.job.groups {
                if let Ok(d) = sched.demand(&g.task) {
                    demands.extend(std::iter::repeat_n(d, g.count.max(1) as usize));
                }
            }
        }
        sched.set_task_mix(&TaskMix::from_demands(&demands, 0.95));
    }
    let capacity: u64 =
        pools.iter().map(|p| u64::from(p.nodes) * u64::from(p.devices) * 1000).sum();
    let t0 = jobs[order[0]].submit;
    // Scheduler job id -> trace index, current run generation and start.
    let mut trace_of: Vec<usize> = Vec::with_capacity(jobs.len());
    let mut generation: Vec<u32> = Vec::with_capacity(jobs.len());
    let mut run_start: Vec<Option<(Time, u64)>> = Vec::with_capacity(jobs.len());
    let mut ends: BinaryHeap<Reverse<(Time, u32, u32)>> = BinaryHeap::new();
    let mut busy: u128 = 0;
    let mut next = 0usize;
    let mut done = 0usize;
    let mut preemptions = 0usize;
    let mut last = t0;
    loop {
        let mut t = Time::MAX;
        if let Some(&i) = order.get(next) {
            t = t.min(jobs[i].submit);
        }
        if let Some(Reverse((e, _, _))) = ends.peek() {
            t = t.min(*e);
        }
        if let Some(w) = sched.next_wakeup() {
            t = t.min(w);
        }
        if t == Time::MAX {
            break;
        }
        while let Some(&Reverse((e, id, g))) = ends.peek() {
            if e != t {
                break;
            }
            ends.pop();
            if generation[id as usize] == g {
                if let Some((s, milli)) = run_start[id as usize].take() {
                    busy += u128::from(t - s) * u128::from(milli);
                }
                sched.finish(id, t)?;
                done += 1;
                last = t;
            }
        }
        while let Some(&i) = order.get(next) {
            if jobs[i].submit != t {
                break;
            }
            let id = sched.submit(jobs[i].job.clone(), t)?;
            debug_assert_eq!(id as usize, trace_of.len());
            trace_of.push(i);
            generation.push(0);
            run_start.push(None);
            next += 1;
        }
        for d in sched.schedule(t) {
            match d {
                Decision::Start { job, tasks } => {
                    let milli: u64 = tasks.iter().map(|s| s.placement.device_milli()).sum();
                    let slot = &mut run_start[job as usize];
                    match slot {
                        Some((_, m)) => *m += milli,
                        None => {
                            *slot = Some((t, milli));
                            let g = generation[job as usize];
                            ends.push(Reverse((
                                t.saturating_add(jobs[trace_of[job as usize]].duration),
                                job,
                                g,
                            )));
                        }
                    }
                }
                Decision::Preempt { job, .. } | Decision::Stop { job, .. } => {
                    generation[job as usize] += 1;
                    if let Some((s, milli)) = run_start[job as usize].take() {
                        busy += u128::from(t - s) * u128::from(milli);
                    }
                    if matches!(d, Decision::Preempt { .. }) {
                        preemptions += 1;
                    } else {
                        done += 1;
                        last = last.max(t);
                    }
                }
                Decision::Fail { .. } => done += 1,
                Decision::Provision { .. } | Decision::Release { .. } => {}
            }
        }
        progress(done, jobs.len());
    }
    let mut jct = Vec::new();
    let mut queueing = Vec::new();
    let mut queueing_large = Vec::new();
    let (mut finished, mut failed, mut stopped) = (0, 0, 0);
    for id in 0..sched.jobs() as u32 {
        let Some(v) = sched.job(id) else { continue };
        if let Some(s) = v.first_started {
            queueing.push(s - v.submitted);
            let devices: u64 =
                trace_of.get(id as usize).and_then(|&i| jobs.get(i)).map_or(0, |j| {
                    j.job
                        .groups
                        .iter()
                        .map(|g| match g.task.devices {
                            crate::request::DeviceAsk::Whole(n) => {
                                u64::from(g.count) * u64::from(n)
                            }
                            _ => 0,
                        })
                        .sum()
                });
            if devices >= 8 {
                queueing_large.push(s - v.submitted);
            }
        }
        match v.status {
            JobStatus::Finished => {
                finished += 1;
                if let Some(f) = v.finished {
                    jct.push(f - v.submitted);
                }
            }
            JobStatus::Failed => failed += 1,
            JobStatus::Stopped => stopped += 1,
            _ => {}
        }
    }
    let makespan = last.saturating_sub(t0);
    let gpu_utilization = if capacity == 0 || makespan == 0 {
        0.0
    } else {
        100.0 * busy as f64 / (capacity as f64 * makespan as f64)
    };
    Ok(ReplayReport {
        policy: opts.policy,
        queue: opts.queue,
        jobs: jobs.len(),
        finished,
        failed,
        stopped,
        preemptions,
        jct: Stats::of(jct),
        queueing: Stats::of(queueing),
        queueing_large: Stats::of(queueing_large),
        gpu_utilization,
        makespan,
        pools: sched.pool_reports(last),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn philly(submit: u64, duration: u64, gpus: u32) -> PhillyJob {
        PhillyJob { line: submit as usize, submit, duration, gpus, cluster: "vc".into() }
    }

    #[test]
    fn stats_use_nearest_rank_percentiles() {
        let s = Stats::of((1..=100).collect());
        assert_eq!((s.p50, s.p95, s.p99), (50.0, 95.0, 99.0));
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert_eq!(Stats::of(vec![]), Stats::default());
    }

    #[test]
    fn a_tiny_replay_adds_up() {
        // One 8-GPU node. Job 0 (8 GPUs, 100 s) at t=0; job 1 (4 GPUs, 10 s) at t=5 waits for it.
        let pools = spec::parse_cluster("pool=a:nodes=1:gpus=8").unwrap();
        let jobs = from_philly(&[philly(0, 100, 8), philly(5, 10, 4), philly(6, 1, 16)], 8);
        assert_eq!(jobs[2].job.groups[0].count, 2, "16 GPUs on 8-GPU nodes is a gang of two");
        let mut calls = 0;
        let r = replay(&pools, &jobs, &ReplayOptions::default(), &mut |_, _| calls += 1).unwrap();
        assert!(calls > 0);
        assert_eq!(
            (r.jobs, r.finished, r.failed),
            (3, 2, 1),
            "the 16-GPU job can never fit one node"
        );
        assert_eq!(r.makespan, 110);
        assert_eq!(r.jct.p99, 105.0, "job 1: submitted at 5, ran 100..110");
        assert_eq!(r.queueing.p99, 95.0);
        // 8 GPUs × 100 s + 4 GPUs × 10 s over 8 GPUs × 110 s.
        assert!((r.gpu_utilization - 100.0 * 840.0 / 880.0).abs() < 1e-9, "{}", r.gpu_utilization);
    }

    #[test]
    fn a_job_at_the_end_of_time_is_an_error_not_silently_dropped() {
        let pools = spec::parse_cluster("pool=a:nodes=1:gpus=8").unwrap();
        let mut jobs = from_philly(&[philly(0, 10, 1), philly(1, 10, 1)], 8);
        jobs[1].submit = u64::MAX;
        let e = replay(&pools, &jobs, &ReplayOptions::default(), &mut |_, _| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            "job philly-1: submit time 18446744073709551615 s or duration 10 s is beyond 1000000000000000 s, which the replay cannot reach; fix the trace"
        );
        jobs[1].submit = MAX_TIME;
        let r = replay(&pools, &jobs, &ReplayOptions::default(), &mut |_, _| {}).unwrap();
        assert_eq!((r.jobs, r.finished), (2, 2), "the latest time a trace may use is replayed");
    }
}
