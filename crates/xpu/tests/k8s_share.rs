//! GPU sharing through the real control plane (etcd, kube-apiserver): `xpu k8s scheduler`
//! places `xpu.dev/gpu-milli` pods with xpu's policy and signs its GPU choice into the Binding;
//! `xpu k8s device-plugin --share`, driven by the test kubelet (the v1beta1 protos on Unix
//! sockets), gives each bound pod exactly that GPU and nothing to a pod that chose for itself.
//! And the OpenB default trace replayed as Pods on every 4th of its 1,213 nodes (the same model
//! mix; `XPU_SHARE_REPLAY_STRIDE=1` replays all of them) ends within 0.5 points of `xpu sim
//! openb` on the same nodes for the same seed, for xpu's policy and for FGD.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use xpu_integrations::pb;
use xpu_integrations::testkubelet::TestKubelet;
use xpu_testkit::kube::ControlPlaneOptions;
use xpu_testkit::{DevSpec, HostSpec, hosts};

use k8s_support::*;

const SHARE: &str = "xpu.dev/gpu-milli";

fn share_pod(name: &str, milli: u64) -> Pod {
    let mut p = pod(name, SHARE, 0, &[]);
    let c = &mut p.spec.as_mut().unwrap().containers[0];
    let limits = c.resources.as_mut().unwrap().limits.get_or_insert_with(BTreeMap::new);
    limits.insert(
        SHARE.into(),
        k8s_openapi::apimachinery::pkg::api::resource::Quantity(milli.to_string()),
    );
    p
}

fn condition_message(p: &Pod) -> Option<String> {
    p.status.as_ref()?.conditions.as_ref()?.iter().find_map(|c| {
        (c.type_ == "PodScheduled" && c.status == "False")
            .then(|| c.message.clone().unwrap_or_default())
    })
}

fn annotation<'a>(p: &'a Pod, k: &str) -> Option<&'a str> {
    p.metadata.annotations.as_ref()?.get(k).map(String::as_str)
}

fn one_gpu_host() -> HostSpec {
    HostSpec::new("one-gpu").device(
        DevSpec::new("0000:25:00.0", 0x10de, 0x20b0, 0x030200)
            .driver("nvidia")
            .group(20)
            .numa(0)
            .nvidia(0, &hosts::gpu_uuid(0)),
    )
}

fn share_request(n: usize) -> pb::AllocateRequest {
    pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest {
            devices_ids: (0..n).map(|u| format!("0000:25:00.0-u{u:03}")).collect(),
        }],
    }
}

/// Three half-GPU pods on a one-GPU node: two share it, the third waits saying why; the device
/// plugin gives each bound pod the chosen GPU with its share, and a pod bound by hand with a
/// copied choice gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_half_gpu_pods_on_one_gpu_two_share_it_and_the_plugin_gives_exactly_that_gpu() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let key = cp.dir().join("share.key");
    std::fs::write(&key, (0..32u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect::<Vec<u8>>())
        .unwrap();

    add_node(
        &admin,
        &NodeDef::new("gpu-1").gpus(SHARE, 1000).label("nvidia.com/gpu.product", "A100"),
    )
    .await;
    let sched =
        XpuScheduler::start(&cp, &kubeconfig, "share", &["--share-key", key.to_str().unwrap()]);

    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    for name in ["half-0", "half-1", "half-2"] {
        api.create(&PostParams::default(), &share_pod(name, 500)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let settled = wait_until(Duration::from_secs(60), || async {
        let ps = pods(&admin, "default").await;
        let bound = ps.iter().filter(|p| node_of(p).is_some()).count();
        let told = ps.iter().any(|p| condition_message(p).is_some_and(|m| m.contains(SHARE)));
        bound == 2 && told
    })
    .await;
    let ps = pods(&admin, "default").await;
    let view: Vec<_> = ps
        .iter()
        .map(|p| {
            (p.metadata.name.clone().unwrap(), node_of(p).map(str::to_owned), condition_message(p))
        })
        .collect();
    assert!(settled, "two bound, one told why: {view:?}\n{}", sched.log_text());
    let waiting = ps.iter().find(|p| node_of(p).is_none()).unwrap();
    assert_eq!(waiting.metadata.name.as_deref(), Some("half-2"), "{view:?}");
    eprintln!("half-2 waits: {}", condition_message(waiting).unwrap());
    for p in ps.iter().filter(|p| node_of(p).is_some()) {
        assert_eq!(annotation(p, "xpu.dev/gpus"), Some("0"), "the chosen GPU is on the pod");
        assert_eq!(annotation(p, "xpu.dev/gpus-signature").map(str::len), Some(64));
    }

    // The device plugin on that node, with the ServiceAccount deploy/kubernetes gives it.
    let fx = one_gpu_host().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let plugin_kc = cp.service_account_kubeconfig("xpu-system", "xpu-node-agent").await.unwrap();
    let log = cp.dir().join("device-plugin.log");
    let mut plugin = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["k8s", "device-plugin", "--share", "--node-name", "gpu-1", "--interval-ms", "200"])
        .arg("--root")
        .arg(fx.root())
        .arg("--plugin-dir")
        .arg(dir.path())
        .arg("--share-key")
        .arg(&key)
        .arg("--kubeconfig")
        .arg(&plugin_kc)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let plugin_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let reg = kubelet.next_registration(Duration::from_secs(20)).await;
    let reg = reg.unwrap_or_else(|| panic!("registration\n{}", plugin_log()));
    assert_eq!(reg.resource_name, SHARE);
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut stream = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 1000, "one GPU offered as 1000 units");

    for expected in ["half-0", "half-1"] {
        let resp = client.allocate(share_request(500)).await;
        let resp =
            resp.unwrap_or_else(|e| panic!("{expected}: {e}\n{}", plugin_log())).into_inner();
        let c = &resp.container_responses[0];
        assert_eq!(c.envs.get("XPU_GPU_MILLI").map(String::as_str), Some("500"));
        assert_eq!(c.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&hosts::gpu_uuid(0)));
        assert_eq!(c.envs.get("XPU_VISIBLE_DEVICES").map(String::as_str), Some("0000:25:00.0"));
        let given = api.get(expected).await.unwrap();
        let marked = wait_until(Duration::from_secs(10), || async {
            annotation(&api.get(expected).await.unwrap(), "xpu.dev/gpus-allocated").is_some()
        })
        .await;
        assert!(marked, "{expected} marked allocated: {:?}", given.metadata.annotations);
    }

    // A pod bound by hand, carrying a choice and signature copied from a scheduled pod.
    let donor = api.get("half-0").await.unwrap();
    let mut forged = share_pod("forged", 500);
    forged.metadata.annotations = Some(BTreeMap::from([
        ("xpu.dev/gpus".to_owned(), "0".to_owned()),
        (
            "xpu.dev/gpus-signature".to_owned(),
            annotation(&donor, "xpu.dev/gpus-signature").unwrap().to_owned(),
        ),
    ]));
    forged.spec.as_mut().unwrap().node_name = Some("gpu-1".into());
    api.create(&PostParams::default(), &forged).await.unwrap();
    let refused = client.allocate(share_request(500)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("default/forged: the GPU choice's signature does not match"),
        "{}",
        refused.message()
    );
    assert!(node_of(&api.get("half-2").await.unwrap()).is_none(), "the third still waits");

    // plugin kill fails only if it already exited; wait reaps it either way.
    let _ = plugin.kill();
    let _ = plugin.wait();
    kubelet.stop().await;
    drop(sched);
}

fn openb_dir() -> std::path::PathBuf {
    repo().join("../shared/data/openb")
}

/// Every `XPU_SHARE_REPLAY_STRIDE`-th node of OpenB's cluster (default 4: 304 of its 1,213
/// nodes, the same mix of models) and the default trace. The simulator runs on the same nodes,
/// so the comparison is exact at any stride; 1 replays the whole cluster (about 4× longer).
fn openb_sample() -> (Vec<xpu_sched::trace::OpenbNode>, Vec<xpu_sched::trace::OpenbPod>) {
    let stride = std::env::var("XPU_SHARE_REPLAY_STRIDE")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(4);
    let nodes =
        xpu_sched::trace::read_openb_nodes(&openb_dir().join("openb_node_list_gpu_node.csv"))
            .unwrap();
    let trace =
        xpu_sched::trace::read_openb_pods(&openb_dir().join("openb_pod_list_default.csv")).unwrap();
    (nodes.into_iter().step_by(stride).collect(), trace)
}

/// Creates `items` with at most `n` requests in flight, in order of issue.
async fn create_all<K>(api: &Api<K>, items: Vec<K>, n: usize)
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let pp = PostParams::default();
    let results: Vec<_> = futures_util::stream::iter(items)
        .map(|o| {
            let (api, pp) = (api.clone(), pp.clone());
            async move { api.create(&pp, &o).await.map(|_| ()) }
        })
        .buffered(n)
        .collect()
        .await;
    for r in results {
        r.unwrap();
    }
}

/// One policy's replay: the trace's nodes (named so that name order is the simulator's node
/// order for the seed), the seed's arrival sequence as Pods created oldest first, then the
/// scheduler started; returns the GPU allocation ratio read back from the API server.
async fn replay(
    cp: &xpu_testkit::kube::ControlPlane,
    kubeconfig: &Path,
    policy: &str,
    seed: u64,
    key: &Path,
) -> f64 {
    use xpu_sched::sim::openb;
    let admin = cp.admin_client();
    let (nodes, trace) = openb_sample();
    let mut c = openb::cluster(&nodes).unwrap();
    c.shuffle_ranks(openb::rank_seed(seed));
    let total_gpus: u64 = nodes.iter().map(|n| u64::from(n.gpus)).sum();

    let t0 = Instant::now();
    let node_api: Api<Node> = Api::all(admin.clone());
    let defs: Vec<NodeDef> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut d = NodeDef::new(format!("{policy}-{:04}", c.rank(i as u32)))
                .gpus(SHARE, u32::from(n.gpus) * 1000)
                .label("xpu.dev/gpu.product", &n.model);
            d.cpu = format!("{}m", n.cpu_milli);
            d.memory = format!("{}Mi", n.memory_mib);
            d
        })
        .collect();
    futures_util::stream::iter(defs.iter()).for_each_concurrent(16, |d| add_node(&admin, d)).await;
    let made_nodes = t0.elapsed();

    let ns = format!("replay-{policy}");
    create(
        &admin,
        &json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": ns } }),
        false,
    )
    .await
    .unwrap();
    // No controller manager runs: the namespace's default ServiceAccount, which admission
    // wants before any pod, is made here.
    let sa = json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "default", "namespace": ns } });
    create(&admin, &sa, false).await.unwrap();
    let scheduler = format!("xpu-{policy}");
    let order = openb::workload(&trace, total_gpus * 1000, seed);
    let items: Vec<Pod> = order
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let tp = &trace[t];
            let mut limits = serde_json::Map::new();
            if tp.gpu_request() > 0 {
                limits.insert(SHARE.into(), json!(tp.gpu_request().to_string()));
            }
            let mut spec = json!({
                "schedulerName": scheduler, "restartPolicy": "Never",
                "containers": [{ "name": "c", "image": "busybox", "resources": {
                    "requests": { "cpu": format!("{}m", tp.cpu_milli), "memory": format!("{}Mi", tp.memory_mib) },
                    "limits": limits } }],
            });
            if !tp.gpu_spec.is_empty() {
                spec["affinity"] = json!({ "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{ "matchExpressions": [
                        { "key": "xpu.dev/gpu.product", "operator": "In", "values": tp.gpu_spec } ] }] } } });
            }
            serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": { "name": format!("p{i:05}"), "namespace": ns },
                "spec": spec,
            }))
            .unwrap()
        })
        .collect();
    let count = items.len();
    let pod_api: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    create_all(&pod_api, items, 16).await;
    let made_pods = t0.elapsed() - made_nodes;

    let placer_seed = openb::placer_seed(seed).to_string();
    let t1 = Instant::now();
    let sched = XpuScheduler::start(
        cp,
        kubeconfig,
        &format!("replay-{policy}"),
        &[
            "--scheduler-name",
            &scheduler,
            "--policy",
            policy,
            "--queueing",
            "best-effort",
            "--seed",
            &placer_seed,
            "--share-key",
            key.to_str().unwrap(),
            "--bind-concurrency",
            "64",
        ],
    );
    // Done when the number bound stops changing for 5 s after the first binds.
    let mut last = (0usize, Instant::now());
    let ps = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ps = pod_api.list(&ListParams::default()).await.unwrap().items;
        let bound = ps.iter().filter(|p| node_of(p).is_some()).count();
        if bound != last.0 {
            last = (bound, Instant::now());
        } else if bound > 0 && last.1.elapsed() > Duration::from_secs(5) {
            break ps;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(300),
            "replay stalled at {bound} bound\n{}",
            sched.log_text()
        );
    };
    let placed = t1.elapsed();
    // What each bound pod asks, read as the scheduler reads it (its own Pod type).
    let milli: u64 = ps
        .iter()
        .filter(|p| node_of(p).is_some())
        .filter_map(|p| serde_json::to_value(p).and_then(serde_json::from_value).ok())
        .map(|p: xpu_kube::pod::Pod| xpu_kube::share::ask_of(&p))
        .sum();
    let ratio = 100.0 * milli as f64 / (total_gpus * 1000) as f64;
    let bound = ps.iter().filter(|p| node_of(p).is_some()).count();
    eprintln!(
        "replay {policy} seed {seed}: {count} pods, {bound} bound, GPU allocation {ratio:.2} % (nodes {made_nodes:?}, pods {made_pods:?}, scheduling and binding {placed:?})"
    );
    drop(sched);
    // The next policy gets a cluster of its own: these nodes go.
    let names: Vec<String> = defs.iter().map(|d| d.name.clone()).collect();
    futures_util::stream::iter(names)
        .for_each_concurrent(16, |n| {
            let node_api = node_api.clone();
            async move {
                node_api.delete(&n, &DeleteParams::default()).await.unwrap();
            }
        })
        .await;
    ratio
}

/// The simulator's figure, reproduced through the API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openb_default_trace_replayed_as_pods_matches_xpu_sim() {
    let _turn = TURN.lock().await;
    assert!(
        openb_dir().join("openb_pod_list_default.csv").is_file(),
        "the OpenB trace is read from {} (../shared/data beside the repository)",
        openb_dir().display()
    );
    let cp = plane(ControlPlaneOptions::default()).await;
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let key = cp.dir().join("share.key");
    std::fs::write(&key, [42u8; 32]).unwrap();
    let seed = 42;
    let (nodes, trace) = openb_sample();
    for (policy, kind) in [("xpu", xpu_sched::PolicyKind::Xpu), ("fgd", xpu_sched::PolicyKind::Fgd)]
    {
        let sim = xpu_sched::sim::openb::run(&nodes, &trace, kind, seed).unwrap().alloc_at_130;
        let k8s = replay(&cp, &kubeconfig, policy, seed, &key).await;
        eprintln!("{policy}: xpu sim openb {sim:.2} %, through the API server {k8s:.2} %");
        assert!(
            (k8s - sim).abs() <= 0.5,
            "{policy}: {k8s:.2} % on Kubernetes vs {sim:.2} % simulated"
        );
    }
}
