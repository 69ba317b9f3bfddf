//! Placement throughput of xpu's default policy, single thread:
//!
//! - `openb_1213_nodes`: the OpenB cluster with the OpenB default task stream (inflated to
//!   130 % of GPU capacity, as in `xpu sim openb`), read from `../shared/data` when present;
//! - `synthetic_10000x8`: 10,000 nodes × 8 GPUs with an OpenB-like task mix (shares, 1/2/4/8
//!   GPUs, CPU-only), filled to 130 % of GPU capacity.
//!
//! Each measured iteration places a whole stream on a fresh cluster; throughput is reported in
//! placement decisions (tasks, placed or failed) per second. The bench also prints the memory
//! the 10,000-node state takes (resident-set growth while building it).
//!
//! `cargo bench -p xpu-sched --bench placement`

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use xpu_core::DeviceKind;
use xpu_sched::cluster::{Cluster, NodeSpec};
use xpu_sched::placement::{Demand, PlaceCtx, Placer};
use xpu_sched::policy::{PolicyKind, TaskMix};
use xpu_sched::rng::Rng;
use xpu_sched::sim::openb;

/// Tasks drawn from an OpenB-like mix until their GPU request reaches 130 % of `gpus`.
fn synthetic_stream(gpus: u64, seed: u64) -> Vec<Demand> {
    let mut rng = Rng::new(seed);
    let shares = [100u16, 200, 250, 300, 460, 500, 600, 700];
    let cpus = [2_000u64, 4_000, 6_000, 8_000, 12_000, 16_000];
    let mut out = Vec::new();
    let mut total = 0u64;
    let limit = gpus * 1300;
    loop {
        let cpu = cpus[rng.index(cpus.len())];
        let mem = cpu * 4;
        let r = rng.below(1000);
        let d = match r {
            0..130 => Demand::cpu(cpu * 2, mem * 2),
            130..510 => Demand::share(cpu, mem, DeviceKind::Gpu, shares[rng.index(shares.len())]),
            510..980 => Demand::whole(cpu, mem, DeviceKind::Gpu, 1),
            980..990 => Demand::whole(cpu * 2, mem * 2, DeviceKind::Gpu, 2),
            990..995 => Demand::whole(cpu * 4, mem * 4, DeviceKind::Gpu, 4),
            _ => Demand::whole(cpu * 8, mem * 8, DeviceKind::Gpu, 8),
        };
        if total + d.device_milli() > limit {
            return out;
        }
        total += d.device_milli();
        out.push(d);
    }
}

fn synthetic_cluster(nodes: usize) -> Cluster {
    Cluster::from_specs((0..nodes).map(|i| {
        NodeSpec::new(format!("node-{i:05}"), 96_000, 786_432).devices(8, DeviceKind::Gpu, "A100")
    }))
    .unwrap()
}

/// Places every demand once; returns the elapsed time.
fn place_all(c: &mut Cluster, placer: &mut Placer, ds: &[Demand]) -> Duration {
    let ctx = PlaceCtx::default();
    let start = Instant::now();
    for d in ds {
        if let Ok(p) = placer.place(c, d, &ctx) {
            c.allocate(&p).unwrap();
        }
    }
    start.elapsed()
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("placement");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));

    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/openb");
    if data.join("openb_node_list_gpu_node.csv").is_file() {
        let nodes =
            xpu_sched::trace::read_openb_nodes(&data.join("openb_node_list_gpu_node.csv")).unwrap();
        let pods =
            xpu_sched::trace::read_openb_pods(&data.join("openb_pod_list_default.csv")).unwrap();
        let mut base = openb::cluster(&nodes).unwrap();
        base.shuffle_ranks(openb::rank_seed(42));
        let ds = openb::demands(&mut base, &pods).unwrap();
        let mix = TaskMix::from_demands(&ds, 0.95);
        let order = openb::workload(&pods, base.capacity().device(DeviceKind::Gpu), 42);
        let stream: Vec<Demand> = order.iter().map(|&i| ds[i]).collect();
        g.throughput(Throughput::Elements(stream.len() as u64));
        g.bench_function("openb_1213_nodes", |b| {
            b.iter_custom(|iters| {
                let mut t = Duration::ZERO;
                for _ in 0..iters {
                    let mut cl = base.fork();
                    let mut placer = Placer::new(PolicyKind::Xpu.build(&mix), 42);
                    placer.set_explain(false);
                    t += place_all(&mut cl, &mut placer, &stream);
                }
                t
            })
        });
    } else {
        eprintln!("skipping openb_1213_nodes: no trace data beside the checkout");
    }

    let before = rss_kib();
    let big = synthetic_cluster(10_000);
    let after = rss_kib();
    eprintln!(
        "10,000-node x 8-GPU state: {:.1} MiB resident ({} state classes)",
        after.saturating_sub(before) as f64 / 1024.0,
        big.state_classes()
    );
    let stream = synthetic_stream(80_000, 7);
    let mix = TaskMix::from_demands(&stream, 0.95);
    g.throughput(Throughput::Elements(stream.len() as u64));
    g.bench_function("synthetic_10000x8", |b| {
        b.iter_custom(|iters| {
            let mut t = Duration::ZERO;
            for _ in 0..iters {
                let mut cl = big.fork();
                let mut placer = Placer::new(PolicyKind::Xpu.build(&mix), 7);
                // Decisions only: the reasons for a misfit are computed on demand elsewhere.
                placer.set_explain(false);
                let dt = place_all(&mut cl, &mut placer, &stream);
                t += dt;
                eprintln!(
                    "  {} decisions in {:.2} s = {:.0}/s; {} state classes at the end, {:.1} % of GPUs allocated",
                    stream.len(),
                    dt.as_secs_f64(),
                    stream.len() as f64 / dt.as_secs_f64(),
                    cl.state_classes(),
                    100.0 * cl.used().device(DeviceKind::Gpu) as f64 / cl.capacity().device(DeviceKind::Gpu) as f64
                );
            }
            t
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
