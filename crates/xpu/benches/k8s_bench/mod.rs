//! What the Kubernetes scheduler benches share: creating objects fast, starting kube-scheduler
//! (client QPS 5000, as scheduler_perf runs it) or `xpu k8s scheduler` on a control plane, and
//! reading a process's peak RSS.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

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

/// The peak resident set of process `pid` (VmHWM), MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Starts `kube` (kube-scheduler) or `xpu` (with `xpu_args` after its kubeconfig) on `cp`,
/// logging to `bench-<which>.log` in the plane's directory.
pub fn start_scheduler(which: &str, cp: &ControlPlane, xpu_args: &[OsString]) -> Child {
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
            Command::new(bin)
                .arg(format!("--config={}", cfg.display()))
                .args(["--secure-port=0", "--v=0"])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        }
        _ => Command::new(env!("CARGO_BIN_EXE_xpu"))
            .args(["k8s", "scheduler", "--kubeconfig"])
            .arg(cp.admin_kubeconfig())
            .args(xpu_args)
            .env("RUST_LOG", "warn")
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
