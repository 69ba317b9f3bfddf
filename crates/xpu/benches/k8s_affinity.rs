//! scheduler_perf's inter-pod shapes on real control planes, kube-scheduler of the same release
//! and `xpu k8s scheduler` side by side in one run, each on a fresh plane:
//! - `anti`: `SchedulingPodAntiAffinity` style, every pod anti-affine to the others on the
//!   hostname (one per node);
//! - `affinity`: `SchedulingPodAffinity` style, every pod affine to the others in a zone (the
//!   first chooses the zone);
//! - `spread`: topology spread, `maxSkew: 1` over zones with `DoNotSchedule`;
//! - `gang`: `podgroup/gangscheduling`, PodGroups (`scheduling.k8s.io/v1beta1`) of 3 pods with
//!   `gang.minCount: 3` (both schedulers with `GenericWorkload` on).
//!
//! Prints pods bound per second (first create to last bind, as a watch sees it), p50/p99
//! create-to-bound latency and each scheduler's peak RSS.
//!
//!   cargo bench -p xpu --bench k8s_affinity
//!   XPU_BENCH_NODES=500 XPU_BENCH_PODS=400 (defaults; scheduler_perf runs 5000 nodes)
//!   XPU_BENCH_SCHEDULERS=kube,xpu XPU_BENCH_SHAPES=anti,affinity,spread,gang
//!
//! kube-scheduler runs with `clientConnection.qps/burst` 5000, as scheduler_perf sets it.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

mod k8s_bench;

use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::scheduling::v1beta1::PodGroup;
use kube::api::{Api, PostParams};
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};

use k8s_bench::{create_all, env_num, peak_rss_mib};

const ZONES: usize = 4;
const GANG: usize = 3;

fn node(i: usize) -> Node {
    let name = format!("node-{i:05}");
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": {
            "kubernetes.io/hostname": name,
            "topology.kubernetes.io/zone": format!("zone-{}", i % ZONES) } },
        "status": {
            "capacity": { "cpu": "64", "memory": "512Gi", "pods": "110" },
            "allocatable": { "cpu": "64", "memory": "512Gi", "pods": "110" },
            "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady",
                             "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z" }],
        },
    }))
    .unwrap()
}

fn pod(shape: &str, i: usize, scheduler: &str) -> Pod {
    let sel = json!({ "matchLabels": { "color": "green" } });
    let mut spec = json!({
        "schedulerName": scheduler,
        "tolerations": [{ "key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule" }],
        "containers": [{ "name": "c", "image": "pause",
                         "resources": { "requests": { "cpu": "100m", "memory": "200Mi" } } }],
    });
    match shape {
        "anti" => {
            spec["affinity"] = json!({ "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
                { "labelSelector": sel, "topologyKey": "kubernetes.io/hostname" } ] } });
        }
        "affinity" => {
            spec["affinity"] = json!({ "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
                { "labelSelector": sel, "topologyKey": "topology.kubernetes.io/zone" } ] } });
        }
        "spread" => {
            spec["topologySpreadConstraints"] = json!([{ "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule", "labelSelector": sel }]);
        }
        "gang" => spec["schedulingGroup"] = json!({ "podGroupName": format!("g-{:05}", i / GANG) }),
        _ => panic!("unknown shape {shape}"),
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": format!("p-{i:05}"), "labels": { "color": "green" } },
        "spec": spec,
    }))
    .unwrap()
}

fn group(i: usize) -> PodGroup {
    serde_json::from_value(json!({
        "metadata": { "name": format!("g-{i:05}") },
        "spec": { "schedulingPolicy": { "gang": { "minCount": GANG } } },
    }))
    .unwrap()
}

struct Figures {
    pods_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    rss_mib: f64,
}

const GATES: &str = "GenericWorkload=true,TopologyAwareWorkloadScheduling=true";

fn start(which: &str, cp: &ControlPlane, gang: bool) -> std::process::Child {
    if which != "kube" || !gang {
        return k8s_bench::start_scheduler(which, cp, &[] as &[OsString]);
    }
    // kube-scheduler with the gang plugin's gates.
    let dir = cp.dir();
    let log = std::fs::File::create(dir.join("bench-kube.log")).unwrap();
    let cfg = dir.join("bench-scheduler.yaml");
    std::fs::write(
        &cfg,
        format!(
            "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
             clientConnection:\n  kubeconfig: {}\n  qps: 5000\n  burst: 5000\n\
             leaderElection:\n  leaderElect: false\n",
            cp.admin_kubeconfig().display()
        ),
    )
    .unwrap();
    let bin = xpu_testkit::kube::bin_dir().unwrap().join("kube-scheduler");
    std::process::Command::new(bin)
        .arg(format!("--config={}", cfg.display()))
        .args(["--secure-port=0", "--v=0", &format!("--feature-gates={GATES}")])
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

async fn bench(which: &str, shape: &str, nodes: usize, pods: usize) -> Figures {
    let gang = shape == "gang";
    let mut opts = ControlPlaneOptions::default();
    if gang {
        opts = opts
            .apiserver_flag(format!("--feature-gates={GATES}"))
            .apiserver_flag("--runtime-config=scheduling.k8s.io/v1beta1=true");
    }
    let cp = ControlPlane::start(opts).await.unwrap_or_else(|e| panic!("control plane: {e}"));
    let client = cp.admin_client();
    create_all(&Api::<Node>::all(client.clone()), nodes, 32, node).await;
    if gang {
        create_all(&Api::<PodGroup>::namespaced(client.clone(), "default"), pods / GANG, 32, group)
            .await;
    }
    let (seen, watch) = k8s_bench::watch_binds(&client);
    let mut child = start(which, &cp, gang);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sched = if which == "kube" { "default-scheduler" } else { "xpu" };
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let created: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let t0 = Instant::now();
    let pp = PostParams::default();
    let mut s = futures_util::stream::iter((0..pods).map(|i| {
        let (api, pp, created) = (&api, &pp, created.clone());
        let p = pod(shape, i, sched);
        async move {
            let sent = Instant::now();
            api.create(pp, &p).await.unwrap();
            created.lock().unwrap().insert(p.metadata.name.clone().unwrap(), sent);
        }
    }))
    .buffer_unordered(32);
    while s.next().await.is_some() {}
    let limit = Instant::now() + Duration::from_secs(900);
    loop {
        let done = seen.lock().unwrap().len();
        if done >= pods {
            break;
        }
        assert!(
            Instant::now() < limit,
            "{which} {shape}: only {done}/{pods} pods bound after 15 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_mib = peak_rss_mib(child.id());
    k8s_bench::stop(&mut child);
    watch.abort();
    let seen = seen.lock().unwrap();
    let created = created.lock().unwrap();
    let last = seen.values().max().copied().unwrap_or(t0);
    let mut lat: Vec<f64> = created
        .iter()
        .filter_map(|(n, c)| Some(seen.get(n)?.saturating_duration_since(*c).as_secs_f64() * 1e3))
        .collect();
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(f64::NAN)
    };
    Figures {
        pods_per_s: pods as f64 / last.duration_since(t0).as_secs_f64(),
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        rss_mib,
    }
}

fn main() {
    let nodes = env_num("XPU_BENCH_NODES", 500);
    let pods = env_num("XPU_BENCH_PODS", 402);
    let which = std::env::var("XPU_BENCH_SCHEDULERS").unwrap_or_else(|_| "kube,xpu".into());
    let shapes =
        std::env::var("XPU_BENCH_SHAPES").unwrap_or_else(|_| "anti,affinity,spread,gang".into());
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "k8s inter-pod bench: {nodes} nodes in {ZONES} zones, {pods} pods per shape; load before: {}",
        load.trim()
    );
    println!(
        "{:<16} {:<9} {:>9} {:>10} {:>10} {:>10}",
        "scheduler", "shape", "pods/s", "p50 ms", "p99 ms", "peak MiB"
    );
    let mut rates: HashMap<(String, String), f64> = HashMap::new();
    for shape in shapes.split(',') {
        for w in which.split(',') {
            let f = rt.block_on(bench(w, shape, nodes, pods));
            let label = if w == "kube" { "kube-scheduler" } else { "xpu" };
            println!(
                "{label:<16} {shape:<9} {:>9.1} {:>10.1} {:>10.1} {:>10.1}",
                f.pods_per_s, f.p50_ms, f.p99_ms, f.rss_mib
            );
            rates.insert((w.to_owned(), shape.to_owned()), f.pods_per_s);
        }
        if let (Some(x), Some(k)) = (
            rates.get(&("xpu".into(), shape.to_owned())),
            rates.get(&("kube".into(), shape.to_owned())),
        ) {
            println!("xpu / kube-scheduler pods/s, {shape}: {:.2}x", x / k);
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
}
