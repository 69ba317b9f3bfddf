//! Property tests: whatever the cluster, the task stream and the policy, no placement ever
//! over-commits a device, a node's CPU or its memory, and the books always add up — through
//! placements, releases, gangs and the scheduler's queue, preemption and flex-start pools.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use xpu_core::DeviceKind;
use xpu_sched::cluster::{Cluster, DeviceSpec, MILLI, NodeSpec};
use xpu_sched::placement::{Demand, PlaceCtx, Placement, Placer};
use xpu_sched::policy::{PolicyKind, TaskMix};
use xpu_sched::pool::FlexPool;
use xpu_sched::request::{Job, TaskGroup, TaskSpec};
use xpu_sched::scheduler::{Decision, QueuePolicy, Scheduler, SchedulerConfig};

#[derive(Debug, Clone)]
struct NodeShape {
    cpu: u64,
    mem: u64,
    gpus: usize,
    model: u8,
    domains: bool,
}

fn node_shape() -> impl Strategy<Value = NodeShape> {
    (1u64..=64, 1u64..=512, 0usize..=8, 0u8..3, any::<bool>()).prop_map(
        |(c, m, g, model, domains)| NodeShape {
            cpu: c * 1000,
            mem: m * 1024,
            gpus: g,
            model,
            domains,
        },
    )
}

fn build(shapes: &[NodeShape]) -> Cluster {
    Cluster::from_specs(shapes.iter().enumerate().map(|(i, s)| {
        let mut n = NodeSpec::new(format!("n{i}"), s.cpu, s.mem);
        for g in 0..s.gpus {
            let mut d =
                DeviceSpec::new(format!("gpu{g}"), DeviceKind::Gpu, format!("M{}", s.model))
                    .numa((g / 4) as u32);
            if s.domains {
                d = d.domain(format!("nvl{}", g / 4));
            }
            n = n.device(d);
        }
        n
    }))
    .unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    Place { cpu: u64, mem: u64, count: u16, milli: u16, model: Option<u8> },
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..=16, 0u64..=64, 0u16..=4, prop_oneof![Just(1000u16), 1u16..1000], proptest::option::of(0u8..3))
            .prop_map(|(c, m, count, milli, model)| {
                let milli = if count > 1 { 1000 } else { milli };
                Op::Place { cpu: c * 1000, mem: m * 1024, count, milli, model }
            }),
        1 => any::<usize>().prop_map(Op::Release),
    ]
}

fn policy() -> impl Strategy<Value = PolicyKind> {
    prop::sample::select(PolicyKind::ALL.to_vec())
}

/// Checks every node against the placements held, and that no free value exceeds capacity.
fn assert_books(c: &Cluster, held: &[Placement]) {
    c.audit(held).unwrap();
    for n in c.nodes() {
        assert!(n.cpu_free() <= n.cpu_milli && n.memory_free() <= n.memory_mib);
        for d in &n.devices {
            assert!(d.free_milli() <= MILLI);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn placements_never_over_commit(
        shapes in prop::collection::vec(node_shape(), 1..12),
        ops in prop::collection::vec(op(), 1..120),
        kind in policy(),
        seed in any::<u64>(),
    ) {
        let mut c = build(&shapes);
        c.shuffle_ranks(seed);
        let mut demands = Vec::new();
        for o in &ops {
            if let Op::Place { cpu, mem, count, milli, model } = o {
                let mut d = match (count, milli) {
                    (0, _) => Demand::cpu(*cpu, *mem),
                    (1, m) if *m < MILLI => Demand::share(*cpu, *mem, DeviceKind::Gpu, *m),
                    (n, _) => Demand::whole(*cpu, *mem, DeviceKind::Gpu, *n),
                };
                if let Some(m) = model {
                    d = d.with_models(c.model_mask(&[format!("M{m}")]).unwrap());
                }
                demands.push(d);
            }
        }
        let mix = TaskMix::from_demands(&demands, 0.95);
        let mut placer = Placer::new(kind.build(&mix), seed);
        let mut held: Vec<Placement> = Vec::new();
        let mut next = 0;
        for o in &ops {
            match o {
                Op::Place { .. } => {
                    let d = demands[next];
                    next += 1;
                    match placer.place(&c, &d, &PlaceCtx::default()) {
                        Ok(p) => {
                            // The placement is what was asked for, on devices of the asked kind
                            // and model, each with enough room.
                            prop_assert_eq!(p.devices.len(), usize::from(d.count));
                            let node = c.node(p.node).unwrap();
                            prop_assert!(node.cpu_free() >= d.cpu_milli && node.memory_free() >= d.memory_mib);
                            for s in &p.devices {
                                let dev = &node.devices[usize::from(s.index)];
                                prop_assert!(dev.free_milli() >= s.milli);
                                prop_assert_eq!(s.milli, d.milli);
                            }
                            c.allocate(&p).unwrap();
                            held.push(p);
                        }
                        Err(report) => {
                            // A refusal must be genuine: no node could take it.
                            let fits_somewhere = c.nodes().iter().any(|n| {
                                n.cpu_free() >= d.cpu_milli
                                    && n.memory_free() >= d.memory_mib
                                    && n.devices.iter().filter(|x| {
                                        x.free_milli() >= d.milli && (d.models >> x.model_id()) & 1 == 1
                                    }).count() >= usize::from(d.count)
                            });
                            prop_assert!(!fits_somewhere, "refused although a node fits: {}", report);
                            prop_assert_eq!(report.nodes, c.len());
                        }
                    }
                }
                Op::Release(i) if !held.is_empty() => {
                    let p = held.swap_remove(i % held.len());
                    c.release(&p).unwrap();
                }
                Op::Release(_) => {}
            }
            assert_books(&c, &held);
        }
        for p in held.drain(..) {
            c.release(&p).unwrap();
        }
        assert_books(&c, &[]);
        prop_assert_eq!(c.used().device(DeviceKind::Gpu), 0);
    }

    #[test]
    fn the_scheduler_keeps_its_books(
        shapes in prop::collection::vec(node_shape(), 1..8),
        jobs in prop::collection::vec((0u16..=3, 1u32..=3, any::<bool>(), -2i32..=2, 1u64..=50), 1..40),
        queue in prop::sample::select(vec![QueuePolicy::Fifo, QueuePolicy::Priority, QueuePolicy::Sjf, QueuePolicy::Backfill, QueuePolicy::Fair]),
        preemption in any::<bool>(),
        flex in any::<bool>(),
    ) {
        let c = build(&shapes);
        let pools = if flex {
            vec![FlexPool { provisioning_delay: 5, idle_release: 7, max_run_duration: 40, ..FlexPool::new("flex", NodeSpec::new("f", 16_000, 65_536).devices(4, DeviceKind::Gpu, "M0"), 3) }]
        } else {
            vec![]
        };
        let config = SchedulerConfig { queue, preemption, pools, seed: 1, ..SchedulerConfig::default() };
        let mut s = Scheduler::new(c, config).unwrap();
        let mut running: Vec<(u64, u32)> = Vec::new();
        let mut t = 0u64;
        for (i, (gpus, count, gang, prio, dur)) in jobs.iter().enumerate() {
            let task = if *gpus == 0 { TaskSpec::gpu_share(1000, 1024, 300) } else { TaskSpec::gpus(1000, 1024, *gpus) };
            let mut g = TaskGroup::new(*count, task);
            g.gang = *gang;
            let job = Job::single(format!("j{i}"), g).priority(*prio).duration_hint(*dur).queue(if i % 2 == 0 { "a" } else { "b" });
            s.submit(job, t).unwrap();
            for step in 0..3 {
                t += 1 + step;
                running.sort_unstable();
                while let Some(&(end, id)) = running.first() {
                    if end > t { break; }
                    running.remove(0);
                    let _ = s.finish(id, end.max(t - 1));
                }
                for d in s.schedule(t) {
                    if let Decision::Start { job, .. } = d {
                        let dur = s.job(job).unwrap().job.duration_hint.unwrap();
                        running.push((t + dur, job));
                    }
                }
                let audit = s.audit();
                prop_assert!(audit.is_ok(), "{:?}", audit);
            }
        }
    }
}

/// Every node's free CPU, memory and per-device share, and the totals: what planning must leave
/// exactly as it found.
type Digest = (Vec<(u64, u64, Vec<u16>)>, u64, u64, u64);

fn digest(c: &Cluster) -> Digest {
    let nodes = c
        .nodes()
        .iter()
        .map(|n| {
            (n.cpu_free(), n.memory_free(), n.devices.iter().map(|d| d.free_milli()).collect())
        })
        .collect();
    let u = c.used();
    (nodes, u.cpu_milli, u.memory_mib, u.device(DeviceKind::Gpu))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The undo log planning relies on: placements made one after another (a gang's, a trial's)
    /// and undone with `Cluster::undo` leave the cluster exactly as before, whatever was
    /// already held; a fork is the same state and planning on it leaves the original alone.
    #[test]
    fn undoing_a_trial_restores_the_cluster_exactly(
        shapes in prop::collection::vec(node_shape(), 1..10),
        held_ops in prop::collection::vec(op(), 0..60),
        trial_ops in prop::collection::vec(op(), 1..40),
        kind in policy(),
        seed in any::<u64>(),
    ) {
        let mut c = build(&shapes);
        c.shuffle_ranks(seed);
        let demand = |o: &Op| match o {
            Op::Place { cpu, mem, count, milli, .. } => Some(match (count, milli) {
                (0, _) => Demand::cpu(*cpu, *mem),
                (1, m) if *m < MILLI => Demand::share(*cpu, *mem, DeviceKind::Gpu, *m),
                (n, _) => Demand::whole(*cpu, *mem, DeviceKind::Gpu, *n),
            }),
            Op::Release(_) => None,
        };
        let demands: Vec<Demand> = held_ops.iter().chain(&trial_ops).filter_map(demand).collect();
        let mut placer = Placer::new(kind.build(&TaskMix::from_demands(&demands, 0.95)), seed);
        let mut held = Vec::new();
        for d in held_ops.iter().filter_map(demand) {
            if let Ok(p) = placer.place(&c, &d, &PlaceCtx::default()) {
                c.allocate(&p).unwrap();
                held.push(p);
            }
        }
        let before = digest(&c);
        let fork = c.fork();
        prop_assert_eq!(digest(&fork), before.clone());

        let mut trial = Vec::new();
        for d in trial_ops.iter().filter_map(demand) {
            if let Ok(p) = placer.place(&c, &d, &PlaceCtx::default()) {
                c.allocate(&p).unwrap();
                trial.push(p);
            }
        }
        prop_assert_eq!(digest(&fork), before.clone(), "the fork is its own cluster");
        c.undo(&trial).unwrap();
        prop_assert_eq!(digest(&c), before);
        assert_books(&c, &held);
        // Undoing everything held empties the cluster.
        c.undo(&held).unwrap();
        prop_assert_eq!(c.used().cpu_milli, 0);
        prop_assert_eq!(c.used().device(DeviceKind::Gpu), 0);
    }
}
