//! scheduler_perf's shape on a real control plane: N Node objects, then pods created as fast as
//! the API server takes them (CPU pods, then whole-GPU pods, then for xpu GPU-share pods), scheduled by the real
//! kube-scheduler of the same release and by `xpu k8s scheduler`, each on a fresh plane, side
//! by side in one run. Prints pods bound per second (first create to last bind, per mix), p50/p99
//! of create-to-bound latency as a watch sees it, and each scheduler's peak RSS.
//!
//!   cargo bench -p xpu --bench k8s_scheduler
//!   XPU_BENCH_NODES=5000 XPU_BENCH_PODS=10000 (defaults) XPU_BENCH_SCHEDULERS=null,kube,xpu
//!   XPU_BENCH_BOUND=50000: that many pods already bound (10m CPU each, spread over the nodes)
//!   before the scheduler starts, the 15,000-node shape of issue 44
//!
//! After each mix, xpu's and the null binder's own phase histograms (`/metrics`: cycles, the
//! planning inside them, binds, status writes) are printed: count, mean, and the bucket bound
//! under which 99 % fall, counted from the scheduler's start.
//!
//! `null` is the null binder (`xpu k8s scheduler --null-binder`: xpu's watch, queue and
//! binding client, each pod to the next node in turn, no decision): the API server's ceiling on
//! this machine, which every figure is also given against. Both run with `MALLOC_ARENA_MAX=2`,
//! as `deploy/kubernetes/scheduler.yaml` runs the scheduler.
//!
//! Both schedulers get the same objects and the same client budget: kube-scheduler runs with
//! `clientConnection.qps/burst` 5000 (as scheduler_perf sets it; its default 50 would bind 50
//! pods/s), xpu's client has no limiter. Nodes: every second one has 8 GPUs, whole
//! (`nvidia.com/gpu`, `i % 4 == 0`) or as shares (`xpu.dev/gpu-milli: 8000`, `i % 4 == 2`).
//! kube-scheduler cannot choose a GPU for a share, so the share mix (OpenB's shares: 100 to 900
//! milli) runs for xpu only and compares with kube-scheduler's whole-GPU figure. Pods tolerate the `not-ready` taint admission puts on
//! every new Node (no node lifecycle controller runs: there are no kubelets).
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

mod k8s_bench;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};

use k8s_bench::{create_all, env_num, peak_rss_mib, start_scheduler};

fn node(i: usize) -> Node {
    let gpus = if i.is_multiple_of(4) { "8" } else { "0" };
    let shares = if i % 4 == 2 { "8000" } else { "0" };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": format!("node-{i:05}"), "labels": {
            "kubernetes.io/hostname": format!("node-{i:05}"),
            "topology.kubernetes.io/zone": format!("zone-{}", i % 4) } },
        "status": {
            "capacity": { "cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": gpus, "xpu.dev/gpu-milli": shares },
            "allocatable": { "cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": gpus, "xpu.dev/gpu-milli": shares },
            "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady",
                             "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z" }],
        },
    }))
    .unwrap()
}

fn pod(name: &str, scheduler: &str, gpus: u32, share: u32) -> Pod {
    let limits = if gpus > 0 {
        json!({ "nvidia.com/gpu": gpus.to_string() })
    } else if share > 0 {
        json!({ "xpu.dev/gpu-milli": share.to_string() })
    } else {
        json!({})
    };
    k8s_bench::pod(name, scheduler, json!({}), limits)
}

struct Mix {
    name: &'static str,
    pods: usize,
    gpus: u32,
    /// Shares of one GPU, cycled through pod by pod (empty: none).
    shares: &'static [u32],
}

/// GPU shares as OpenB's default trace has them (its share pods ask 100 to 900 milli).
const SHARES: [u32; 8] = [500, 250, 100, 500, 300, 750, 200, 900];

struct Figures {
    pods_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Creates the mix's pods while the scheduler runs; returns once all are bound.
async fn run_mix(
    client: &Client,
    which: &str,
    mix: &Mix,
    seen: &Arc<Mutex<HashMap<String, Instant>>>,
) -> Figures {
    let sched = if which == "kube" { "default-scheduler" } else { "xpu" };
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let t0 = Instant::now();
    let pp = PostParams::default();
    let names: Vec<String> = (0..mix.pods).map(|i| format!("{}-{i:05}", mix.name)).collect();
    let mut s = futures_util::stream::iter(names.iter().map(|n| {
        let (api, pp, created) = (&api, &pp, created.clone());
        let share =
            if mix.shares.is_empty() { 0 } else { mix.shares[n_index(n) % mix.shares.len()] };
        let p = pod(n, sched, mix.gpus, share);
        async move {
            let sent = Instant::now();
            api.create(pp, &p).await.unwrap();
            created.lock().unwrap().insert(p.metadata.name.clone().unwrap(), sent);
        }
    }))
    .buffer_unordered(32);
    while s.next().await.is_some() {}
    let limit = Instant::now() + Duration::from_secs(600);
    loop {
        let done = {
            let seen = seen.lock().unwrap();
            names.iter().filter(|n| seen.contains_key(*n)).count()
        };
        if done == mix.pods {
            break;
        }
        assert!(
            Instant::now() < limit,
            "{which}: only {done}/{} {} pods bound after 10 minutes",
            mix.pods,
            mix.name
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = seen.lock().unwrap();
    let created = created.lock().unwrap();
    let last = names.iter().filter_map(|n| seen.get(n)).max().copied().unwrap_or(t0);
    let mut lat: Vec<f64> = names
        .iter()
        .filter_map(|n| {
            Some(seen.get(n)?.saturating_duration_since(*created.get(n)?).as_secs_f64() * 1e3)
        })
        .collect();
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(f64::NAN)
    };
    Figures {
        pods_per_s: mix.pods as f64 / last.duration_since(t0).as_secs_f64(),
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
    }
}

async fn bench(which: &str, nodes: usize, bound: usize, mixes: &[Mix]) -> (Vec<Figures>, f64) {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap_or_else(|e| panic!("control plane: {e}"));
    let client = cp.admin_client();
    let t = Instant::now();
    create_all(&Api::<Node>::all(client.clone()), nodes, 32, node).await;
    eprintln!("{which}: {nodes} nodes created in {:.1} s", t.elapsed().as_secs_f64());
    k8s_bench::create_bound(&client, which, bound, |i| k8s_bench::bound_pod(i, nodes)).await;
    let (seen, watch) = k8s_bench::watch_binds(&client);
    let key = cp.dir().join("share.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    let metrics = k8s_bench::free_addr();
    let args =
        ["--share-key".into(), key.into(), "--metrics-addr".into(), metrics.to_string().into()];
    let mut child = start_scheduler(which, &cp, &args);
    // Let it sync its caches before the clock starts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut out = Vec::new();
    for m in mixes {
        out.push(run_mix(&client, which, m, &seen).await);
        // Each mix's phases, counted from the scheduler's start (xpu and the null binder).
        let phases = k8s_bench::phases(metrics);
        if !phases.is_empty() {
            eprintln!("{which} after {} pods: {phases}", m.name);
        }
    }
    let rss = peak_rss_mib(child.id());
    k8s_bench::stop(&mut child);
    watch.abort();
    (out, rss)
}

fn n_index(name: &str) -> usize {
    name.rsplit('-').next().and_then(|i| i.parse().ok()).unwrap_or(0)
}

fn main() {
    let nodes = env_num("XPU_BENCH_NODES", 5000);
    let pods = env_num("XPU_BENCH_PODS", 10_000);
    let which = std::env::var("XPU_BENCH_SCHEDULERS").unwrap_or_else(|_| "null,kube,xpu".into());
    let share_pods = env_num("XPU_BENCH_SHARE_PODS", 10_000);
    let bound = env_num("XPU_BENCH_BOUND", 0);
    let mixes = [
        Mix { name: "cpu", pods: pods / 2, gpus: 0, shares: &[] },
        Mix { name: "gpu", pods: pods - pods / 2, gpus: 1, shares: &[] },
        Mix { name: "share", pods: share_pods, gpus: 0, shares: &SHARES },
    ];
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "k8s scheduler bench: {nodes} nodes (a quarter with 8 nvidia.com/gpu, a quarter with 8 GPUs as xpu.dev/gpu-milli), {bound} pods bound before, {pods} pods, then {share_pods} share pods for xpu; load before: {}",
        load.trim()
    );
    println!(
        "{:<16} {:<5} {:>10} {:>10} {:>10} {:>10}",
        "scheduler", "mix", "pods/s", "p50 ms", "p99 ms", "peak MiB"
    );
    let mut rates: HashMap<(String, &str), f64> = HashMap::new();
    for w in which.split(',') {
        // kube-scheduler cannot place GPU shares: it runs the first two mixes.
        let run = if w == "kube" { &mixes[..2] } else { &mixes[..] };
        let (figs, rss) = rt.block_on(bench(w, nodes, bound, run));
        for (m, f) in mixes.iter().zip(&figs) {
            let label = k8s_bench::label(w);
            println!(
                "{label:<16} {:<5} {:>10.0} {:>10.1} {:>10.1} {:>10.1}",
                m.name, f.pods_per_s, f.p50_ms, f.p99_ms, rss
            );
            rates.insert((w.to_owned(), m.name), f.pods_per_s);
        }
    }
    for m in &mixes {
        if let (Some(x), Some(k)) =
            (rates.get(&("xpu".into(), m.name)), rates.get(&("kube".into(), m.name)))
        {
            println!("xpu / kube-scheduler pods/s, {} pods: {:.2}x", m.name, x / k);
        }
    }
    for m in &mixes {
        if let Some(ceiling) = rates.get(&("null".into(), m.name)) {
            for s in ["kube", "xpu"] {
                if let Some(r) = rates.get(&(s.into(), m.name)) {
                    println!(
                        "{} / null binder pods/s, {} pods: {:.2}",
                        k8s_bench::label(s),
                        m.name,
                        r / ceiling
                    );
                }
            }
        }
    }
    if let (Some(x), Some(k)) =
        (rates.get(&("xpu".into(), "share")), rates.get(&("kube".into(), "gpu")))
    {
        println!(
            "xpu share pods/s / kube-scheduler whole-GPU pods/s (kube-scheduler cannot place shares): {:.2}x",
            x / k
        );
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
}
