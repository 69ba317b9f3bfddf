//! Where a scheduling cycle's time goes, with no API server: `cycle::plan` over a cluster of
//! `XPU_BENCH_NODES` GPU nodes (5,000) holding `XPU_BENCH_BOUND` bound pods (50,000), with no
//! pod waiting (the cost of building the cycle's state alone) and with `XPU_BENCH_PENDING`
//! (100) one-GPU pods waiting, three ways: every object converted and summed (`rebuilt`), with
//! the memo of converted objects (`memo`), and with the memo and the ledger the pod watch
//! keeps (`ledger`, what `xpu k8s scheduler` runs). Prints milliseconds per cycle (median of
//! `XPU_BENCH_RUNS`, 5) and the process's peak RSS. `XPU_BENCH_MEMO_ONLY=1` runs only the
//! cycles with the ledger (for a profile of them).
//!
//!   cargo bench -p xpu-kube --bench cycle

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use serde_json::json;
use xpu_kube::cycle::{self, Snapshot};
use xpu_kube::pod::Pod;
use xpu_sched::SchedulerConfig;

fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn node(i: usize) -> Arc<Node> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": { "name": format!("node-{i:05}"), "resourceVersion": "1",
                          "labels": { "topology.kubernetes.io/zone": format!("z{}", i % 4) } },
            "status": { "allocatable": { "cpu": "128", "memory": "1024Gi", "pods": "110",
                                         "nvidia.com/gpu": "8" },
                        "conditions": [{ "type": "Ready", "status": "True" }] }
        }))
        .unwrap(),
    )
}

fn pod(i: usize, node: Option<String>, gpus: u32) -> Arc<Pod> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": { "name": format!("pod-{i:06}"), "namespace": "default",
                          "uid": format!("uid-{i}"), "resourceVersion": "1",
                          "creationTimestamp": "2026-11-28T00:00:00Z" },
            "spec": { "schedulerName": "xpu", "nodeName": node,
                "containers": [{ "name": "c", "image": "x", "resources": {
                    "requests": { "cpu": "1", "memory": "1Gi", "nvidia.com/gpu": gpus.to_string() },
                    "limits": { "nvidia.com/gpu": gpus.to_string() } } }] },
            "status": { "phase": if node.is_some() { "Running" } else { "Pending" } }
        }))
        .unwrap(),
    )
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
    let nodes: Vec<Arc<Node>> = (0..n).map(node).collect();
    // Bound pods: up to 8 one-GPU pods per node, then CPU-only pods.
    let mut pods: Vec<Arc<Pod>> = (0..bound)
        .map(|i| pod(i, Some(format!("node-{:05}", i % n)), u32::from(i < n * 7)))
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
            pods.extend((0..pending).map(|i| pod(bound + i, None, 1)));
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
}
