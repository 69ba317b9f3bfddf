//! What the Kubernetes scheduler benches share: creating objects fast, starting kube-scheduler
//! (client QPS 5000, as scheduler_perf runs it) or `xpu k8s scheduler` on a control plane, and
//! reading a process's peak RSS.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use xpu_testkit::kube::ControlPlane;

pub fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Creates `n` objects made by `make`, `parallel` at a time.
pub async fn create_all<T, F>(api: &Api<T>, n: usize, parallel: usize, make: F)
where
    T: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
    F: Fn(usize) -> T,
{
    let pp = PostParams::default();
    let objs: Vec<T> = (0..n).map(make).collect();
    let mut s = futures_util::stream::iter(objs.iter().map(|o| api.create(&pp, o)))
        .buffer_unordered(parallel);
    while let Some(r) = s.next().await {
        r.unwrap();
    }
}

/// A pod already bound to node `node-{i % nodes}` when created (no scheduler involved): the
/// cluster's running workload, which every cycle of a scheduler must account for.
pub fn bound_pod(i: usize, nodes: usize) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": format!("bound-{i:06}") },
        "spec": {
            "nodeName": format!("node-{:05}", i % nodes),
            "containers": [{ "name": "c", "image": "pause",
                             "resources": { "requests": { "cpu": "10m", "memory": "16Mi" } } }],
        },
    }))
    .unwrap()
}

/// Creates `bound` pods made by `make` (each bound to its node) in the default namespace, and
/// says how long that took.
pub async fn create_bound(client: &Client, which: &str, bound: usize, make: impl Fn(usize) -> Pod) {
    if bound == 0 {
        return;
    }
    let t = Instant::now();
    create_all(&Api::<Pod>::namespaced(client.clone(), "default"), bound, 64, make).await;
    eprintln!("{which}: {bound} bound pods created in {:.1} s", t.elapsed().as_secs_f64());
}

/// The peak resident set of process `pid` (VmHWM), MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Starts `kube` (kube-scheduler), `xpu` (with `xpu_args` after its kubeconfig) or `null`
/// (`xpu k8s scheduler --null-binder`: the same watch, queue and binding client, no decision;
/// the API server's ceiling) on `cp`, logging to `bench-<which>.log` in the plane's directory.
pub fn start_scheduler(which: &str, cp: &ControlPlane, xpu_args: &[OsString]) -> Child {
    start_scheduler_gated(which, cp, xpu_args, "")
}

/// [`start_scheduler`], kube-scheduler with `--feature-gates=GATES` (when not empty).
pub fn start_scheduler_gated(
    which: &str,
    cp: &ControlPlane,
    xpu_args: &[OsString],
    gates: &str,
) -> Child {
    let dir = cp.dir();
    let log = std::fs::File::create(dir.join(format!("bench-{which}.log"))).unwrap();
    match which {
        "kube" => {
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
            let mut cmd = Command::new(bin);
            cmd.arg(format!("--config={}", cfg.display())).args(["--secure-port=0", "--v=0"]);
            if !gates.is_empty() {
                cmd.arg(format!("--feature-gates={gates}"));
            }
            cmd.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap()
        }
        _ => Command::new(env!("CARGO_BIN_EXE_xpu"))
            .args(["k8s", "scheduler", "--kubeconfig"])
            .arg(cp.admin_kubeconfig())
            .args(xpu_args)
            .args(if which == "null" { &["--null-binder"][..] } else { &[] })
            // `XPU_BENCH_LOG`: its RUST_LOG (`xpu_kube::scheduler=debug` logs each cycle).
            .env("RUST_LOG", std::env::var("XPU_BENCH_LOG").unwrap_or_else(|_| "warn".into()))
            // As deploy/kubernetes/scheduler.yaml runs it (`XPU_BENCH_ARENAS=16`: glibc's own
            // limit on 2 cores, 8 per core).
            .env(
                "MALLOC_ARENA_MAX",
                std::env::var("XPU_BENCH_ARENAS").unwrap_or_else(|_| "2".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    }
}

/// Stops a scheduler whose figures are taken: kill fails only if it already exited, and wait
/// reaps it either way.
pub fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// When each pod of namespace `default` was first seen bound, as a watch sees it; abort the
/// task when done.
pub fn watch_binds(
    client: &Client,
) -> (Arc<Mutex<HashMap<String, Instant>>>, tokio::task::JoinHandle<()>) {
    let seen: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let seen2 = seen.clone();
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let watch = tokio::spawn(async move {
        let mut s = std::pin::pin!(watcher(api, watcher::Config::default()).applied_objects());
        while let Some(Ok(p)) = s.next().await {
            if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
                seen2
                    .lock()
                    .unwrap()
                    .entry(p.metadata.name.clone().unwrap())
                    .or_insert_with(Instant::now);
            }
        }
    });
    (seen, watch)
}

/// One scheduler's figures on one workload.
pub struct Figures {
    pub pods_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub rss_mib: f64,
}

/// Creates `pods`, 32 at a time, recording when each create was sent.
async fn create_timed(api: &Api<Pod>, pods: &[Pod], created: &Mutex<HashMap<String, Instant>>) {
    let pp = PostParams::default();
    let mut s = futures_util::stream::iter(pods.iter().map(|p| {
        let pp = &pp;
        async move {
            let sent = Instant::now();
            api.create(pp, p).await.unwrap();
            created.lock().unwrap().insert(p.metadata.name.clone().unwrap(), sent);
        }
    }))
    .buffer_unordered(32);
    while s.next().await.is_some() {}
}

/// Runs scheduler `which` (kube-scheduler with `gates` as its feature gates) on `cp` over the
/// pods `make` builds for the scheduler name it answers to, and measures it. By default the
/// pods are created (32 at a time) while it runs, and the figures run from the first create to
/// the last bind, latency per pod from its create; with `XPU_BENCH_BACKLOG=1` every pod exists
/// before the scheduler starts, and both run from its start (the API server's create rate then
/// bounds neither scheduler). Waits 15 minutes at most for every pod to be seen bound.
pub async fn run(
    cp: &ControlPlane,
    which: &str,
    gates: &str,
    make: impl FnOnce(&str) -> Vec<Pod>,
    what: &str,
) -> Figures {
    let client = cp.admin_client();
    let (seen, watch) = watch_binds(&client);
    let pods = make(if which == "kube" { "default-scheduler" } else { "xpu" });
    let n = pods.len();
    // Only the measured pods count (pods bound before they arrive are seen bound too).
    let names: std::collections::HashSet<String> =
        pods.iter().filter_map(|p| p.metadata.name.clone()).collect();
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let backlog = std::env::var_os("XPU_BENCH_BACKLOG").is_some();
    let created: Mutex<HashMap<String, Instant>> = Mutex::default();
    if backlog {
        create_timed(&api, &pods, &created).await;
    }
    let started = Instant::now();
    // `XPU_BENCH_XPU_ARGS`: extra arguments for xpu (`--bind-concurrency 128`, say).
    let extra: Vec<OsString> = std::env::var("XPU_BENCH_XPU_ARGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(Into::into)
        .collect();
    let extra = if which == "kube" { Vec::new() } else { extra };
    let mut child = start_scheduler_gated(which, cp, &extra, gates);
    if !backlog {
        tokio::time::sleep(Duration::from_secs(3)).await;
        create_timed(&api, &pods, &created).await;
    }
    let limit = Instant::now() + Duration::from_secs(900);
    loop {
        let done = seen.lock().unwrap().keys().filter(|k| names.contains(*k)).count();
        if done >= n {
            break;
        }
        assert!(Instant::now() < limit, "{what}: only {done}/{n} pods bound after 15 minutes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_mib = peak_rss_mib(child.id());
    stop(&mut child);
    watch.abort();
    let mut seen = seen.lock().unwrap();
    seen.retain(|k, _| names.contains(k));
    let created = created.lock().unwrap();
    let from = |name: &str| if backlog { Some(started) } else { created.get(name).copied() };
    let t0 = if backlog { started } else { created.values().min().copied().unwrap_or(started) };
    let last = seen.values().max().copied().unwrap_or(t0);
    let mut lat: Vec<f64> = seen
        .iter()
        .filter_map(|(n, t)| Some(t.saturating_duration_since(from(n)?).as_secs_f64() * 1e3))
        .collect();
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(f64::NAN)
    };
    Figures {
        pods_per_s: n as f64 / last.duration_since(t0).as_secs_f64(),
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        rss_mib,
    }
}

/// How a scheduler of `XPU_BENCH_SCHEDULERS` is named in the tables.
pub fn label(which: &str) -> &'static str {
    match which {
        "kube" => "kube-scheduler",
        "null" => "null binder",
        _ => "xpu",
    }
}

/// Runs `bench(scheduler, workload)` for every workload of `workloads` and scheduler of
/// `which` (comma-separated; `kube`, `xpu`, `null`), printing one row each, the xpu / kube-scheduler
/// ratio per workload and the machine's load before and after. `title` heads the table.
pub fn table(
    title: &str,
    column: &str,
    workloads: &str,
    which: &str,
    mut bench: impl FnMut(&str, &str) -> Figures,
) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("{title}; load before: {}", load.trim());
    println!(
        "{:<16} {column:<9} {:>9} {:>10} {:>10} {:>10}",
        "scheduler", "pods/s", "p50 ms", "p99 ms", "peak MiB"
    );
    let mut rates: HashMap<(String, String), f64> = HashMap::new();
    for w in workloads.split(',') {
        for s in which.split(',') {
            let f = bench(s, w);
            let label = label(s);
            println!(
                "{label:<16} {w:<9} {:>9.1} {:>10.1} {:>10.1} {:>10.1}",
                f.pods_per_s, f.p50_ms, f.p99_ms, f.rss_mib
            );
            rates.insert((s.to_owned(), w.to_owned()), f.pods_per_s);
        }
        if let (Some(x), Some(k)) =
            (rates.get(&("xpu".into(), w.to_owned())), rates.get(&("kube".into(), w.to_owned())))
        {
            println!("xpu / kube-scheduler pods/s, {w}: {:.2}x", x / k);
        }
        if let Some(ceiling) = rates.get(&("null".into(), w.to_owned())) {
            for s in ["kube", "xpu"] {
                if let Some(r) = rates.get(&(s.into(), w.to_owned())) {
                    println!("{} / null binder pods/s, {w}: {:.2}", label(s), r / ceiling);
                }
            }
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
}

/// A bench pod named `name` for `scheduler`: tolerating not-ready nodes, one `pause` container
/// asking 100m CPU and 200Mi of memory plus `requests`, with `limits`.
pub fn pod(
    name: &str,
    scheduler: &str,
    requests: serde_json::Value,
    limits: serde_json::Value,
) -> Pod {
    let mut all = serde_json::json!({ "cpu": "100m", "memory": "200Mi" });
    if let (Some(all), Some(more)) = (all.as_object_mut(), requests.as_object()) {
        all.extend(more.clone());
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "schedulerName": scheduler,
            "tolerations": [{ "key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule" }],
            "containers": [{ "name": "c", "image": "pause",
                             "resources": { "requests": all, "limits": limits } }],
        },
    }))
    .unwrap()
}

/// A free loopback address for a scheduler's `--metrics-addr`.
pub fn free_addr() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Where xpu's time went, from its `/metrics` at `addr`: for each phase histogram, how many
/// were observed, their mean and the bucket bound under which 99 % fall. Empty when the
/// endpoint cannot be read.
pub fn phases(addr: std::net::SocketAddr) -> String {
    fn scrape(addr: std::net::SocketAddr) -> std::io::Result<String> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        Ok(text)
    }
    let text = match scrape(addr) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("phases: /metrics at {addr} not read: {e}");
            return String::new();
        }
    };
    let mut out = Vec::new();
    for (phase, name) in [
        ("cycle", "xpu_scheduler_cycle_duration_seconds"),
        ("plan", "xpu_scheduler_plan_duration_seconds"),
        ("bind", "xpu_scheduler_bind_duration_seconds"),
        ("status", "xpu_scheduler_status_update_duration_seconds"),
        ("claims", "xpu_scheduler_claims_duration_seconds"),
    ] {
        let value = |suffix: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name}{suffix} ")))
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        let (Some(count), Some(sum)) = (value("_count"), value("_sum")) else { continue };
        if count == 0.0 {
            continue;
        }
        // Cumulative buckets: the first bound holding 99 % of the observations.
        let p99 = text
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{name}_bucket{{le=\"")))
            .filter_map(|l| {
                let (bound, n) = l.split_once("\"} ")?;
                Some((bound.parse::<f64>().ok()?, n.trim().parse::<f64>().ok()?))
            })
            .find(|(_, n)| *n >= 0.99 * count)
            .map_or_else(|| "> 60 s".to_owned(), |(b, _)| format!("<= {b} s"));
        out.push(format!("{phase} {count:.0}× mean {:.1} ms p99 {p99}", 1e3 * sum / count));
    }
    let counter = |line: &str| {
        text.lines().find_map(|l| l.strip_prefix(line)).and_then(|v| v.trim().parse::<u64>().ok())
    };
    if let (Some(whole), Some(patched), Some(nodes)) = (
        counter("xpu_scheduler_cluster_builds_total{kind=\"whole\"} "),
        counter("xpu_scheduler_cluster_builds_total{kind=\"patched\"} "),
        counter("xpu_scheduler_cluster_nodes_built_total "),
    ) && whole + patched > 0
    {
        out.push(format!("clusters built whole {whole}, patched {patched}, {nodes} nodes built"));
    }
    out.join("; ")
}
