//! `xpu k8s dra-driver` (the release build) on a real control plane, the 8×A100 fixture host
//! with real character device nodes:
//!
//! - `NodePrepareResources` for one 2-GPU claim over the plugin's Unix socket, as the kubelet
//!   calls it, the driver's API read of the claim included: p50/p99 over N round trips, each an
//!   unprepare (timed on its own) and a prepare that writes a new CDI spec and checkpoint.
//! - The time from a device change in the fixture tree (a GPU removed and put back, a GPU
//!   rebound to `vfio-pci` and back) to the updated slice, as a watch on the API server sees
//!   it, with the driver's default re-discovery interval.
//!
//! For the profile it also times, from the bench process, a GET of the same claim (one API
//! round trip) and an fsynced atomic write of 2 KiB beside the checkpoint. It runs
//! at nice -20 where it can (root), as the container bench does, so that other work on the
//! machine disturbs the tail less.
//!
//!   cargo bench -p xpu --bench k8s_dra
//!   XPU_BENCH_ROUNDS=500 XPU_BENCH_CHANGES=12 (defaults)
//!
//! The claim is allocated as kube-scheduler would (status.allocation written through the API:
//! two GPUs of one NVLink domain from this node's pool); that the real kube-scheduler makes
//! such allocations from xpu's slices is the test `k8s_dra`'s business. Needs root (the
//! fixture's device nodes are made with mknod) and `scripts/install-k8s`.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;
use xpu_integrations::drakubelet;
use xpu_integrations::drapb::v1;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};
use xpu_testkit::{BuildOptions, hosts};

const NODE: &str = "gpu-node";

fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn summary(label: &str, mut v: Vec<Duration>) {
    if v.is_empty() {
        return;
    }
    v.sort();
    println!(
        "{label:<58} n={:<4} p50 {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms",
        v.len(),
        ms(pct(&v, 0.5)),
        ms(pct(&v, 0.99)),
        ms(v[v.len() - 1])
    );
}

/// The driver as `xpu k8s dra-driver` runs on a node (default interval, default log level).
fn start_driver(cp: &ControlPlane, root: &Path, dirs: &Path) -> Child {
    let log = std::fs::File::create(cp.dir().join("bench-dra-driver.log")).unwrap();
    Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["k8s", "dra-driver", "--node-name", NODE, "--root"])
        .arg(root)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig())
        .arg("--plugin-dir")
        .arg(dirs.join("plugins"))
        .arg("--registry-dir")
        .arg(dirs.join("plugins_registry"))
        .arg("--cdi-dir")
        .arg(dirs.join("cdi"))
        .env_remove("RUST_LOG")
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// Device name -> `driver` attribute (with ` tainted` after it when the device is tainted:
/// the driver keeps a vanished device published, tainted), over every slice of the node's pool.
type Devices = BTreeMap<String, String>;

fn devices_of(slices: &BTreeMap<String, ResourceSlice>) -> Devices {
    slices
        .values()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| {
            let drv = d
                .attributes
                .as_ref()
                .and_then(|a| a.get("driver"))
                .and_then(|a| a.string.clone())
                .unwrap_or_default();
            let tainted =
                if d.taints.as_ref().is_some_and(|t| !t.is_empty()) { " tainted" } else { "" };
            (d.name.clone(), format!("{drv}{tainted}"))
        })
        .collect()
}

/// Follows the node's slices with a watch; each change is sent with the instant it arrived.
fn follow_slices(client: kube::Client) -> tokio::sync::watch::Receiver<(Instant, Devices)> {
    let (tx, rx) = tokio::sync::watch::channel((Instant::now(), Devices::new()));
    let api: Api<ResourceSlice> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={NODE}"));
    tokio::spawn(async move {
        let mut known: BTreeMap<String, ResourceSlice> = BTreeMap::new();
        let mut s = std::pin::pin!(watcher(api, cfg));
        while let Some(ev) = s.next().await {
            let Ok(ev) = ev else { continue };
            let name = |s: &ResourceSlice| s.metadata.name.clone().unwrap_or_default();
            match ev {
                watcher::Event::Apply(s) | watcher::Event::InitApply(s) => {
                    known.insert(name(&s), s);
                }
                watcher::Event::Delete(s) => {
                    known.remove(&name(&s));
                }
                watcher::Event::Init => known.clear(),
                watcher::Event::InitDone => {}
            }
            tx.send_replace((Instant::now(), devices_of(&known)));
        }
    });
    rx
}

async fn wait_for(
    rx: &mut tokio::sync::watch::Receiver<(Instant, Devices)>,
    what: &str,
    f: impl Fn(&Devices) -> bool,
) -> Instant {
    let r = tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|(_, d)| f(d)))
        .await
        .map(|r| r.map(|v| v.0));
    match r {
        Ok(Ok(seen)) => seen,
        _ => panic!("the slices never showed {what}: {:?}", rx.borrow().1),
    }
}

/// A small pseudo-random fraction, so device changes land anywhere in the driver's interval.
fn jitter(i: usize, max: Duration) -> Duration {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let nanos = now.map_or(0, |d| d.subsec_nanos() as usize) ^ i.wrapping_mul(2_654_435_761);
    max.mul_f64((nanos % 1000) as f64 / 1000.0)
}

async fn bench(rounds: usize, changes: usize) {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap_or_else(|e| panic!("control plane: {e}"));
    let client = cp.admin_client();
    let host = hosts::a100_8x();
    let fx = host.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    if let Some(v) = &host.nvidia_driver {
        xpu_testkit::driver::install_nvidia(fx.root(), v);
    }
    let dirs = tempfile::tempdir().unwrap();
    let mut slices = follow_slices(client.clone());
    let mut driver = start_driver(&cp, fx.root(), dirs.path());
    wait_for(&mut slices, "8 GPUs", |d| d.len() == 8).await;
    let gpus: Vec<String> = slices.borrow().1.keys().cloned().collect();

    // A 2-GPU claim of one NVLink domain (every GPU of the fixture shares nvswitch-0),
    // allocated as kube-scheduler writes it.
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let c: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": "bench-pair" },
        "spec": { "devices": {
            "requests": [{ "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 2 } }],
            "constraints": [{ "requests": ["gpus"], "matchAttribute": "xpu.dev/interconnectDomain" }],
        } },
    }))
    .unwrap();
    let c = claims.create(&PostParams::default(), &c).await.unwrap();
    let results: Vec<_> = gpus[..2]
        .iter()
        .map(|g| json!({ "request": "gpus", "driver": "xpu.dev", "pool": NODE, "device": g }))
        .collect();
    let status = json!({ "status": { "allocation": { "devices": { "results": results },
        "nodeSelector": { "nodeSelectorTerms": [{ "matchFields": [
            { "key": "metadata.name", "operator": "In", "values": [NODE] }] }] } } } });
    claims
        .patch_status("bench-pair", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let claim = v1::Claim {
        namespace: "default".into(),
        uid: c.metadata.uid.clone().unwrap(),
        name: "bench-pair".into(),
    };

    // The slices go out before the plugin is served: wait for its registration socket.
    let socket = dirs.path().join("plugins_registry/xpu.dev-reg.sock");
    let until = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < until, "the driver never served {}", socket.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reg = drakubelet::register(&socket).await.unwrap();
    let mut kubelet = drakubelet::client_v1(Path::new(&reg.info.endpoint)).await.unwrap();
    let prepare = v1::NodePrepareResourcesRequest { claims: vec![claim.clone()] };
    let unprepare = v1::NodeUnprepareResourcesRequest { claims: vec![claim.clone()] };
    let mut prep = Vec::with_capacity(rounds);
    let mut unprep = Vec::with_capacity(rounds);
    for i in 0..rounds + 20 {
        let t = Instant::now();
        let r = kubelet.node_prepare_resources(prepare.clone()).await.unwrap().into_inner();
        let took = t.elapsed();
        let r = &r.claims[&claim.uid];
        assert!(r.error.is_empty() && r.devices.len() == 2, "prepare: {r:?}");
        let t = Instant::now();
        let u = kubelet.node_unprepare_resources(unprepare.clone()).await.unwrap().into_inner();
        let took_u = t.elapsed();
        assert!(u.claims[&claim.uid].error.is_empty(), "unprepare: {u:?}");
        // The first 20 warm up connections and caches.
        if i >= 20 {
            prep.push(took);
            unprep.push(took_u);
        }
    }
    // Already prepared: answered from the checkpoint, no API read, nothing written.
    kubelet.node_prepare_resources(prepare.clone()).await.unwrap();
    let mut again = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        kubelet.node_prepare_resources(prepare.clone()).await.unwrap();
        again.push(t.elapsed());
    }
    kubelet.node_unprepare_resources(unprepare.clone()).await.unwrap();

    // The parts, measured from here: one GET of the claim; one fsynced atomic write.
    let mut get = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        claims.get("bench-pair").await.unwrap();
        get.push(t.elapsed());
    }
    let spec_bytes = vec![b' '; 2048];
    let probe = dirs.path().join("plugins/xpu.dev/bench-probe.json");
    let mut fsync = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        xpu_container::fsutil::write_atomic(&probe, &spec_bytes, 0o644).unwrap();
        fsync.push(t.elapsed());
    }
    std::fs::remove_file(&probe).unwrap();

    // Device changes in the fixture tree -> the slice in the API server.
    let victim = &gpus[2];
    let victim_addr = pci_address(victim);
    let link = fx.device_dir(&victim_addr);
    let target = std::fs::read_link(&link).unwrap();
    let rebound = &gpus[3];
    let driver_link = fx.device_dir(&pci_address(rebound)).join("driver");
    std::fs::create_dir_all(fx.root().join("sys/bus/pci/drivers/vfio-pci")).unwrap();
    let interval = Duration::from_millis(500);
    let mut removed = Vec::new();
    let mut rebinds = Vec::new();
    for i in 0..changes {
        tokio::time::sleep(jitter(i, interval)).await;
        let (t, seen) = match i % 4 {
            0 => {
                let t = Instant::now();
                std::fs::remove_file(&link).unwrap();
                let gone = |d: &Devices| d.get(victim).is_some_and(|v| v.ends_with(" tainted"));
                (t, wait_for(&mut slices, "the GPU gone (tainted)", gone).await)
            }
            1 => {
                let t = Instant::now();
                std::os::unix::fs::symlink(&target, &link).unwrap();
                let back = |d: &Devices| d.get(victim).is_some_and(|v| !v.ends_with(" tainted"));
                (t, wait_for(&mut slices, "the GPU back", back).await)
            }
            2 => {
                let t = Instant::now();
                rebind(&driver_link, "vfio-pci");
                let seen = wait_for(&mut slices, "the GPU on vfio-pci", |d| {
                    d.get(rebound).is_some_and(|v| v == "vfio-pci")
                })
                .await;
                (t, seen)
            }
            _ => {
                let t = Instant::now();
                rebind(&driver_link, "nvidia");
                let seen = wait_for(&mut slices, "the GPU on nvidia", |d| {
                    d.get(rebound).is_some_and(|v| v == "nvidia")
                })
                .await;
                (t, seen)
            }
        };
        let took = seen.saturating_duration_since(t);
        if i % 4 < 2 { removed.push(took) } else { rebinds.push(took) }
    }

    println!("xpu k8s dra-driver (release), 8×A100 fixture, one claim of 2 GPUs");
    summary("NodePrepareResources (API read, CDI spec + checkpoint)", prep);
    summary("NodeUnprepareResources (spec removed, checkpoint)", unprep);
    summary("NodePrepareResources, already prepared (checkpoint)", again);
    summary("  part: GET of the claim from this process", get);
    summary("  part: fsynced atomic write of 2 KiB (as the checkpoint)", fsync);
    let mut all = removed.clone();
    all.extend(rebinds.iter().copied());
    summary("device removed or restored -> slice (watch), 500 ms tick", removed);
    summary("device rebound nvidia <-> vfio-pci -> slice (watch)", rebinds);
    summary("any device change -> slice (watch)", all);
    // The figures are taken; kill fails only if the driver already exited, wait reaps it.
    let _ = driver.kill();
    let _ = driver.wait();
}

/// `gpu-0000-25-00-0` -> `0000:25:00.0`.
fn pci_address(device: &str) -> String {
    xpu_core::PciAddress::from_dns_label_suffix(device).unwrap().to_string()
}

/// Points a fixture device's `driver` link at another driver, as a kernel rebind leaves it.
fn rebind(driver_link: &Path, to: &str) {
    let tmp = driver_link.with_file_name("driver.new");
    std::os::unix::fs::symlink(format!("../../../bus/pci/drivers/{to}"), &tmp).unwrap();
    std::fs::rename(&tmp, driver_link).unwrap();
}

fn main() {
    let rounds = env_num("XPU_BENCH_ROUNDS", 500);
    let changes = env_num("XPU_BENCH_CHANGES", 12);
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Other work on the machine (builds) disturbs the tail less; the plane and the driver,
    // started after, inherit the priority.
    let raised = xpu_testkit::bundle::raise_priority();
    println!(
        "k8s DRA bench; nice -20: {raised}; load before: {}",
        xpu_testkit::bundle::load_average()
    );
    rt.block_on(bench(rounds, changes));
    println!("load after: {}", xpu_testkit::bundle::load_average());
}
