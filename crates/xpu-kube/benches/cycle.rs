//! Where a scheduling cycle's time goes, with no API server: `cycle::plan` over a cluster of
//! `XPU_BENCH_NODES` GPU nodes (5,000) holding `XPU_BENCH_BOUND` bound pods (50,000), with no
//! pod waiting (the cost of building the cycle's state alone) and with `XPU_BENCH_PENDING`
//! (100) one-GPU pods waiting, three ways: every object converted and summed (`rebuilt`), with
//! the memo of converted objects (`memo`), and with the memo and the ledger the pod watch
//! keeps (`ledger`, what `xpu k8s scheduler` runs). Prints milliseconds per cycle (median of
//! `XPU_BENCH_RUNS`, 5) and the process's peak RSS. `XPU_BENCH_PENDING_GPUS=0` makes the
//! waiting pods CPU pods, which every node can take; `XPU_BENCH_MIXED=1` uses the nodes and
//! pods of the API server bench (`cargo bench -p xpu --bench k8s_scheduler`): a quarter of the
//! nodes with GPUs, a quarter with GPU shares, and waiting CPU, GPU and share pods in turn.
//! `XPU_BENCH_ROUNDS=N` then runs N cycles in a row, each binding what it placed before the
//! next (what a running scheduler's cycles see: nodes filled unevenly, cycle after cycle). `XPU_BENCH_MEMO_ONLY=1` runs only the
//! cycles with the ledger (for a profile of them). `XPU_BENCH_ANTI=1` makes each waiting pod
//! anti-affine on the hostname to the pods of its app (every pod carries one of 100 `app`
//! labels), so that each cycle also records where every bound pod is.
//!
//!   cargo bench -p xpu-kube --bench cycle

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use xpu_kube::cycle::{self, Snapshot};
use xpu_kube::node::Node;
use xpu_kube::pod::Pod;
use xpu_sched::SchedulerConfig;

fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn node(i: usize) -> Arc<Node> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": { "name": format!("node-{i:05}"), "resourceVersion": "1",
                          "labels": { "topology.kubernetes.io/zone": format!("z{}", i % 4),
                                      "kubernetes.io/hostname": format!("node-{i:05}") } },
            "status": { "allocatable": { "cpu": "128", "memory": "1024Gi", "pods": "110",
                                         "nvidia.com/gpu": "8" },
                        "conditions": [{ "type": "Ready", "status": "True" }] }
        }))
        .unwrap(),
    )
}

fn pod(i: usize, node: Option<String>, gpus: u32) -> Arc<Pod> {
    let gpus = gpus.to_string();
    let requests = json!({ "cpu": "1", "memory": "1Gi", "nvidia.com/gpu": gpus });
    pod_asking(i, node, requests, json!({ "nvidia.com/gpu": gpus }))
}

/// Pod `i`, bound to `node` or waiting, with one container asking `requests` and `limits`.
fn pod_asking(
    i: usize,
    node: Option<String>,
    requests: serde_json::Value,
    limits: serde_json::Value,
) -> Arc<Pod> {
    let mut v = json!({
        "metadata": { "name": format!("pod-{i:06}"), "namespace": "default",
                      "uid": format!("uid-{i}"), "resourceVersion": "1",
                      "creationTimestamp": "2026-11-28T00:00:00Z",
                      "labels": { "app": format!("app-{}", i % 100) } },
        "spec": { "schedulerName": "xpu", "nodeName": node,
            "containers": [{ "name": "c", "image": "x",
                             "resources": { "requests": requests, "limits": limits } }] },
        "status": { "phase": if node.is_some() { "Running" } else { "Pending" } }
    });
    // `XPU_BENCH_ANTI=1`: each waiting pod is anti-affine, on the hostname, to the pods of its
    // app (so every cycle also records where every bound pod is).
    if node.is_none() && std::env::var_os("XPU_BENCH_ANTI").is_some() {
        v["spec"]["affinity"] = json!({ "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": { "matchLabels": { "app": format!("app-{}", i % 100) } },
                "topologyKey": "kubernetes.io/hostname" }] } });
    }
    Arc::new(serde_json::from_value(v).unwrap())
}

/// The k8s scheduler bench's node: a quarter with 8 whole GPUs, a quarter with 8 GPUs offered
/// as shares, the rest CPU only.
fn mixed_node(i: usize) -> Arc<Node> {
    let gpus = if i.is_multiple_of(4) { "8" } else { "0" };
    let shares = if i % 4 == 2 { "8000" } else { "0" };
    Arc::new(
        serde_json::from_value(json!({
            "metadata": { "name": format!("node-{i:05}"), "resourceVersion": "1",
                          "labels": { "topology.kubernetes.io/zone": format!("zone-{}", i % 4),
                                      "kubernetes.io/hostname": format!("node-{i:05}") } },
            "status": { "allocatable": { "cpu": "32", "memory": "256Gi", "pods": "110",
                                         "nvidia.com/gpu": gpus, "xpu.dev/gpu-milli": shares },
                        "conditions": [{ "type": "Ready", "status": "True" }] }
        }))
        .unwrap(),
    )
}

/// The k8s scheduler bench's pods: bound ones ask 10m and 16Mi; waiting ones 100m and 200Mi,
/// and in turn nothing more, a GPU, or a share of one (OpenB's sizes).
fn mixed_pod(i: usize, node: Option<String>) -> Arc<Pod> {
    const SHARES: [u32; 8] = [500, 250, 100, 500, 300, 750, 200, 900];
    let (requests, limits) = match (&node, i % 3) {
        (Some(_), _) => (json!({ "cpu": "10m", "memory": "16Mi" }), json!({})),
        (None, 0) => (json!({ "cpu": "100m", "memory": "200Mi" }), json!({})),
        (None, 1) => (
            json!({ "cpu": "100m", "memory": "200Mi", "nvidia.com/gpu": "1" }),
            json!({ "nvidia.com/gpu": "1" }),
        ),
        (None, _) => {
            let milli = SHARES[i % SHARES.len()].to_string();
            (
                json!({ "cpu": "100m", "memory": "200Mi", "xpu.dev/gpu-milli": milli }),
                json!({ "xpu.dev/gpu-milli": milli }),
            )
        }
    };
    pod_asking(i, node, requests, limits)
}

fn median_ms(runs: usize, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn peak_rss_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() {
    let n = env_num("XPU_BENCH_NODES", 5_000);
    let bound = env_num("XPU_BENCH_BOUND", 50_000);
    let pending = env_num("XPU_BENCH_PENDING", 100);
    let runs = env_num("XPU_BENCH_RUNS", 5).max(1);
    // GPUs each waiting pod asks for (0: CPU pods, which every node can take).
    let pending_gpus = u32::try_from(env_num("XPU_BENCH_PENDING_GPUS", 1)).unwrap_or(1);
    // `XPU_BENCH_MIXED=1`: the nodes and pods of `cargo bench -p xpu --bench k8s_scheduler`.
    let mixed = std::env::var_os("XPU_BENCH_MIXED").is_some();
    let nodes: Vec<Arc<Node>> = (0..n).map(if mixed { mixed_node } else { node }).collect();
    // Bound pods: up to 8 one-GPU pods per node, then CPU-only pods.
    let mut pods: Vec<Arc<Pod>> = (0..bound)
        .map(|i| {
            let at = Some(format!("node-{:05}", i % n));
            if mixed { mixed_pod(i, at) } else { pod(i, at, u32::from(i < n * 7)) }
        })
        .collect();
    let (jobs, assumed) = (HashMap::new(), HashMap::new());
    let config = SchedulerConfig::default();
    let memo = cycle::Memo::default();
    let ledger = xpu_kube::ledger::Ledger::default();
    for p in &pods {
        ledger.apply(p);
    }
    let mut figures = Vec::new();
    let mut binds = 0;
    for waiting in [0, pending] {
        if waiting > 0 {
            pods.extend((0..pending).map(|i| {
                if mixed { mixed_pod(bound + i, None) } else { pod(bound + i, None, pending_gpus) }
            }));
        }
        // `XPU_BENCH_MEMO_ONLY=1`: only the ledger's cycles (for a profile of them).
        let only = std::env::var_os("XPU_BENCH_MEMO_ONLY").is_some();
        for mode in ["rebuilt", "memo", "ledger"] {
            if only && mode != "ledger" {
                continue;
            }
            let with_memo = mode != "rebuilt";
            let snap = Snapshot {
                memo: with_memo.then_some(&memo),
                ledger: (mode == "ledger").then_some(&ledger),
                shares: true,
                ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
            };
            // The memo's first cycle converts everything; the figure is a later one's.
            if with_memo {
                cycle::plan(&snap, &config, 0, &mut |_| false);
                memo.sweep();
            }
            let ms = median_ms(runs, || {
                binds = cycle::plan(&snap, &config, 0, &mut |_| false).binds.len();
                memo.sweep();
            });
            figures.push(format!("{waiting} waiting, {mode}: {ms:.1} ms"));
        }
    }
    println!(
        "cycle: {n} nodes, {bound} bound pods; per cycle (median of {runs}): {}; \
         {binds} of {pending} bound; peak RSS {:.0} MiB",
        figures.join(", "),
        peak_rss_mib()
    );
    // `XPU_BENCH_ROUNDS=N`: N cycles one after another as the scheduler runs them, each with
    // `XPU_BENCH_PENDING` new pods waiting, what the last one placed bound where it put it (its
    // share's GPUs recorded as the binding records them), the ledger fed as the watch feeds it.
    let rounds = env_num("XPU_BENCH_ROUNDS", 0);
    if rounds == 0 {
        return;
    }
    pods.retain(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()));
    let mut next = bound + pending;
    let mut times = Vec::new();
    for _ in 0..rounds {
        pods.extend(
            (next..next + pending)
                .map(|i| if mixed { mixed_pod(i, None) } else { pod(i, None, pending_gpus) }),
        );
        next += pending;
        let snap = Snapshot {
            memo: Some(&memo),
            ledger: Some(&ledger),
            shares: true,
            ..Snapshot::new("xpu", &nodes, &pods, &jobs, &assumed)
        };
        let t = Instant::now();
        let plan = cycle::plan(&snap, &config, 0, &mut |_| false);
        times.push(t.elapsed().as_secs_f64() * 1e3);
        memo.sweep();
        let placed: HashMap<&str, &cycle::Bind> =
            plan.binds.iter().map(|b| (b.pod.name.as_str(), b)).collect();
        for p in &mut pods {
            let Some(b) = p.metadata.name.as_deref().and_then(|n| placed.get(n)) else { continue };
            let mut q = Pod::clone(p);
            q.metadata.resource_version = Some("2".into());
            if let Some((gpus, _)) = &b.share {
                let list: Vec<String> = gpus.iter().map(u16::to_string).collect();
                q.metadata.annotations =
                    Some([(xpu_kube::share::GPUS_ANNOTATION.to_owned(), list.join(","))].into());
            }
            if let Some(s) = q.spec.as_mut() {
                s.node_name = Some(b.node.clone());
            }
            if let Some(s) = q.status.as_mut() {
                s.phase = Some("Running".into());
            }
            ledger.apply(&q);
            *p = Arc::new(q);
        }
    }
    let shown: Vec<String> = times.iter().map(|t| format!("{t:.0}")).collect();
    let built = memo.build_stats();
    println!(
        "{rounds} rounds of {pending} waiting pods, each cycle's ms: {}; clusters built whole {}, patched {}, {} nodes built; {} pods bound; peak RSS {:.0} MiB",
        shown.join(" "),
        built.whole,
        built.patched,
        built.nodes,
        pods.iter().filter(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some())).count(),
        peak_rss_mib()
    );
}
