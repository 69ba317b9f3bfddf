//! All of xpu together on several real nodes: one control plane (etcd, kube-apiserver,
//! kube-controller-manager with the Job, node-lifecycle and taint-eviction controllers), `xpu k8s
//! scheduler` as the cluster's scheduler (two replicas, leader election), and eight real nodes
//! (`xpu_testkit::kubelet::Node`: kubelet v1.37.2, containerd, runc, each in its own namespaces
//! on its own loopback address), each with a fixture host and the node agents an admin runs:
//! - `127.0.0.2` and `127.0.0.3`: four A100s each, `xpu k8s device-plugin` (whole GPUs) and
//!   `xpu exporter` reading the kubelet's PodResources;
//! - `127.0.0.4`: four A100s offered as shares (`xpu k8s device-plugin --share`);
//! - `127.0.0.5`: no accelerator;
//! - `127.0.0.7` and `127.0.0.8`: the two TPU v5p hosts of one 2x2x2 slice (GKE's node pool
//!   labels), the device plugin serving `google.com/tpu`;
//! - `127.0.0.9`: four A100s behind `xpu k8s dra-driver`;
//! - `127.0.0.10`: eight AMD MI300X, the device plugin serving `amd.com/gpu`; this node's
//!   containerd runs pods through `xpu-container-runtime` in place of runc (the plugin with
//!   `--device-list-strategy envvar`), the others' through runc with CDI.
//!
//! Each accelerator node carries the labels `xpu k8s nfd-features` writes for it (NVIDIA's GFD
//! names among them) and the GPU gang selects on `nvidia.com/gpu.product`. What runs, end to
//! end: an Indexed Job gang of two 4-GPU pods (one per GPU node), two pods sharing one GPU, a
//! CPU pod, the GKE seed's two-host TPU Job (each pod its host's four chips and its worker id),
//! a DRA claim for two GPUs of one NVLink domain, a pod of two MI300X; each container's `/dev` and device cgroup
//! hold exactly its devices, and the exporter labels each GPU's series with the pod that holds
//! it. Then the failures: a GPU node dies (its
//! kubelet and containerd killed), goes NotReady, its gang member is evicted and recreated by
//! the Job controller and waits (nothing else has four free GPUs) until a new node joins, where
//! xpu places it; the scheduler leader is killed and the standby binds what arrives.
//!
//! The node agents run as processes beside each node (as the single-node tests run them), not
//! yet as the DaemonSet pods of `deploy/kubernetes`; see docs/kubernetes-node.md.
//!
//! Needs root and runc; the binaries come from scripts/install-k8s and scripts/install-node.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, LogParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use xpu_testkit::bundle::{ContainerView, probe_script, skip_container_tests};
use xpu_testkit::cluster;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions, DEFAULT_CONTROLLERS, free_ports};
use xpu_testkit::kubelet::{BUSYBOX_IMAGE, Node, NodeOptions};
use xpu_testkit::sysfs::{MAJOR_DRM, MAJOR_KFD};
use xpu_testkit::{BuildOptions, Fixture, HostSpec};

use k8s_support::*;

const GPU: &str = "nvidia.com/gpu";
const SHARE: &str = "xpu.dev/gpu-milli";
const TPU: &str = "google.com/tpu";
const AMD: &str = "amd.com/gpu";
/// How long a pod stays bound to an unreachable node before it is evicted.
const TOLERATION_SECS: i64 = 2;

/// One real node with its fixture and the xpu processes serving it.
/// Fields drop in order: the agents, then the node, then the fixture they read.
struct ClusterNode {
    name: String,
    agents: Vec<XpuProcess>,
    /// Where its exporter serves `/metrics`, when it runs one.
    metrics: Option<String>,
    node: Node,
    fx: Fixture,
    spec: HostSpec,
}

impl ClusterNode {
    fn logs(&self) -> String {
        let mut out = format!("=== node {}\n{}", self.name, self.node.log_tails());
        for a in &self.agents {
            out += &format!("--- {}\n{}\n", a.log.display(), tail(&a.log_text(), 3000));
        }
        out
    }
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
    &s[start..]
}

#[derive(Clone, Copy, PartialEq)]
enum Role {
    /// Four A100s, the device plugin (whole GPUs) and the exporter.
    Whole,
    /// Four A100s offered as `xpu.dev/gpu-milli` shares.
    Share,
    /// Four A100s behind the DRA driver (no device plugin).
    Dra,
    /// A TPU v5p host (four chips) of one 2x2x2 slice, in GKE's node pool labels.
    Tpu,
    /// No accelerator.
    Cpu,
    /// Eight AMD MI300X on amdgpu, the device plugin (`amd.com/gpu`).
    Amd,
}

/// GKE's labels for a host of the two-host v5p slice `tpu-pool`.
const TPU_LABELS: [(&str, &str); 3] = [
    ("cloud.google.com/gke-tpu-accelerator", "tpu-v5p-slice"),
    ("cloud.google.com/gke-tpu-topology", "2x2x2"),
    ("cloud.google.com/gke-nodepool", "tpu-pool"),
];

/// Where, under a node's fixture root, its DRA driver reads NVML's events (`--fake-nvml`).
const FAKE_NVML: &str = "fake-nvml.json";

/// Starts node `name` with the role's fixture and agents, and labels it as NFD would with what
/// `xpu k8s nfd-features` found on its fixture.
async fn start_node(
    cp: &ControlPlane,
    name: &str,
    role: Role,
    share_key: &std::path::Path,
) -> ClusterNode {
    let spec = match role {
        Role::Tpu => xpu_testkit::hosts::tpu_v5p(),
        Role::Amd => xpu_testkit::hosts::mi300x(),
        _ => four_gpu_host(),
    };
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let mut options = NodeOptions::default().named(name);
    if role != Role::Cpu {
        options = options.devices_of(fx.root());
    }
    // The AMD node runs its pods through xpu's runtime shim instead of CDI: containerd's runc
    // is `xpu-container-runtime`, and its device plugin answers with the environment alone.
    if role == Role::Amd {
        let (wrapper, _) = shim_runtime(&cp.dir().join(format!("shim-{name}")), fx.root());
        options = options.oci_runtime(wrapper);
    }
    let node = Node::start(cp, options).await.unwrap_or_else(|e| panic!("node {name}: {e}"));
    let mut cn =
        ClusterNode { name: name.to_owned(), fx, node, agents: Vec::new(), metrics: None, spec };
    if role == Role::Cpu {
        return cn;
    }
    let xpu = env!("CARGO_BIN_EXE_xpu");
    let vendor = match role {
        Role::Tpu => "google",
        Role::Amd => "amd",
        _ => "nvidia",
    };
    cdi_generate(cn.fx.root(), vendor, &cn.node.cdi_dir());

    // The node's labels, as NFD's master writes them from the feature file.
    let out = std::process::Command::new(xpu)
        .args(["k8s", "nfd-features", "--output", "-", "--root"])
        .arg(cn.fx.root())
        .output()
        .unwrap();
    assert!(out.status.success(), "nfd-features: {}", String::from_utf8_lossy(&out.stderr));
    let mut labels: BTreeMap<String, String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if role == Role::Tpu {
        // What GKE writes on a TPU node pool's nodes (not a discovery label).
        labels.extend(TPU_LABELS.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    }
    let nodes: Api<NodeObject> = Api::all(cp.admin_client());
    let patch = json!({ "metadata": { "labels": labels } });
    nodes.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();

    if role == Role::Dra {
        // deploy/kubernetes lets the driver's ServiceAccount write slices only with a pod's
        // token, which names its node; a driver run beside the node has none, so it runs as the
        // admin (as the single-node test's does).
        let mut args = dra_driver_args(cp, &cn.node, name, cn.fx.root());
        // NVML's events for this node, written by the test (XIDs, resets).
        args.extend(["--fake-nvml".into(), cn.fx.root().join(FAKE_NVML).into()]);
        cn.agents.push(XpuProcess::spawn(cp, &format!("dra-driver-{name}"), &args));
        let slices: Api<ResourceSlice> = Api::all(cp.admin_client());
        let lp = ListParams::default().fields(&format!("spec.nodeName={name},spec.driver=xpu.dev"));
        let published = wait_until(Duration::from_secs(60), || async {
            let s = slices.list(&lp).await.unwrap().items;
            s.iter().flat_map(|s| s.spec.devices.iter().flatten()).count() == 4
        })
        .await;
        assert!(published, "node {name}: four GPUs in its ResourceSlices\n{}", cn.logs());
        return cn;
    }
    let agent_kc = cp.service_account_kubeconfig("xpu-system", "xpu-node-agent").await.unwrap();
    let mut args: Vec<OsString> =
        vec!["k8s".into(), "device-plugin".into(), "--interval-ms".into(), "200".into()];
    args.extend(["--root".into(), cn.fx.root().into()]);
    args.extend(["--plugin-dir".into(), cn.node.device_plugin_dir().into()]);
    if role == Role::Amd {
        args.extend(["--device-list-strategy".into(), "envvar".into()]);
    }
    if role == Role::Share {
        args.extend(["--share".into(), "--node-name".into(), name.into()]);
        args.extend([
            "--share-key".into(),
            share_key.into(),
            "--kubeconfig".into(),
            agent_kc.into(),
        ]);
    }
    cn.agents.push(XpuProcess::spawn(cp, &format!("device-plugin-{name}"), &args));
    if role == Role::Whole {
        let [port] = free_ports().unwrap();
        let listen = format!("127.0.0.1:{port}");
        let socket = cn.node.var_lib().join("kubelet/pod-resources/kubelet.sock");
        let args: Vec<OsString> = vec![
            "exporter".into(),
            "--root".into(),
            cn.fx.root().into(),
            "--listen".into(),
            listen.clone().into(),
            "--interval".into(),
            "500ms".into(),
            "--pod-resources".into(),
            socket.into(),
        ];
        cn.agents.push(XpuProcess::spawn(cp, &format!("exporter-{name}"), &args));
        cn.metrics = Some(listen);
    }
    let resource = match role {
        Role::Share => SHARE,
        Role::Tpu => TPU,
        Role::Amd => AMD,
        _ => GPU,
    };
    // The API server writes 4000 in its canonical form.
    let want = match role {
        Role::Share => "4k",
        Role::Amd => "8",
        _ => "4",
    };
    let limit = Duration::from_secs(60);
    let offered = wait_until(limit, || async {
        let n = nodes.get(name).await.unwrap();
        let alloc = n.status.and_then(|s| s.allocatable).unwrap_or_default();
        alloc.get(resource).is_some_and(|q| q.0 == want)
    })
    .await;
    assert!(offered, "node {name} allocatable {resource}={want} within {limit:?}\n{}", cn.logs());
    cn
}

/// A pod (or pod template) running the probe in container `gpu` (with `resources`), then
/// sleeping; and a plain container beside it.
fn probe_template(labels: Value, resources: Value) -> Value {
    let probe = format!(
        "{}; echo probe-done; sleep 3600",
        probe_script("cat /sys/fs/cgroup/devices/devices.list")
    );
    let container = |name: &str, resources: Value| {
        json!({
            "name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c", probe], "resources": resources,
        })
    };
    let toleration = |key: &str| {
        json!({ "key": key, "operator": "Exists", "effect": "NoExecute",
                "tolerationSeconds": TOLERATION_SECS })
    };
    json!({
        "metadata": { "labels": labels },
        "spec": {
            "schedulerName": "xpu",
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [
                toleration("node.kubernetes.io/unreachable"),
                toleration("node.kubernetes.io/not-ready"),
            ],
            "containers": [container("gpu", resources), container("plain", json!({}))],
        },
    })
}

/// What the pod's two containers printed, once both have run their probe.
async fn views(
    pods: &Api<Pod>,
    name: &str,
    diag: &dyn Fn() -> String,
) -> (ContainerView, ContainerView) {
    let mut out = Vec::new();
    for c in ["gpu", "plain"] {
        let lp = LogParams { container: Some(c.to_owned()), ..LogParams::default() };
        let done = wait_until(Duration::from_secs(90), || async {
            pods.logs(name, &lp).await.is_ok_and(|l| l.contains("probe-done"))
        })
        .await;
        let p = pods.get(name).await.unwrap();
        assert!(done, "pod {name} container {c} ran its probe\n{}\n{}", status(&p), diag());
        let text = pods.logs(name, &lp).await.unwrap();
        out.push(ContainerView::parse(&text));
    }
    let plain = out.pop().unwrap();
    (out.pop().unwrap(), plain)
}

fn status(p: &Pod) -> String {
    serde_json::to_string_pretty(&p.status).unwrap()
}

/// The GPU minors a container was given, from the `/dev/nvidiaN` nodes it sees.
fn minors(v: &ContainerView) -> Vec<u32> {
    v.accel_nodes().keys().filter_map(|p| p.strip_prefix("/dev/nvidia")?.parse().ok()).collect()
}

/// A GPU of the node's fixture, by its minor, unplugged: its sysfs link removed. Returns what
/// [`replug`] needs to put it back, and its PCI address.
fn unplug(n: &ClusterNode, minor: u32) -> (std::path::PathBuf, std::path::PathBuf, String) {
    let d = n.spec.devices.iter().find(|d| d.nvidia_minor == Some(minor)).unwrap();
    let addr = d.address.to_string();
    let link = n.fx.device_dir(&addr);
    let target = std::fs::read_link(&link).unwrap();
    std::fs::remove_file(&link).unwrap();
    (link, target, addr)
}

fn replug((link, target, _): &(std::path::PathBuf, std::path::PathBuf, String)) {
    std::os::unix::fs::symlink(target, link).unwrap();
}

/// The health the kubelet reports for `resource` device `id` in the pod's container `c`.
fn health_of(p: &Pod, c: &str, resource: &str, id: &str) -> Option<String> {
    let statuses = p.status.as_ref()?.container_statuses.as_ref()?;
    let s = statuses.iter().find(|s| s.name == c)?;
    let r = s.allocated_resources_status.as_ref()?.iter().find(|r| r.name == resource)?;
    r.resources.as_ref()?.iter().find(|h| h.resource_id == id)?.health.clone()
}

/// Creates an Indexed Job of `pods` pods at once (a gang to xpu) from the pod `template`.
async fn indexed_job(admin: &kube::Client, name: &str, pods: u32, backoff: u32, template: Value) {
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": { "name": name },
        "spec": {
            "completions": pods, "parallelism": pods, "completionMode": "Indexed",
            "backoffLimit": backoff, "template": template,
        },
    }))
    .unwrap();
    Api::<Job>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &job)
        .await
        .unwrap();
}

/// The Job that controls a pod.
fn job_of(p: &Pod) -> Option<&str> {
    p.metadata.labels.as_ref()?.get("batch.kubernetes.io/job-name").map(String::as_str)
}

/// `GET /metrics` from `addr`.
fn scrape(addr: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return String::new() };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let req = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return String::new();
    }
    let mut text = String::new();
    let _ = s.read_to_string(&mut text); // a short read leaves the test's wait to retry
    text
}

/// Pods of the cluster as `name → (node, phase, deleting)`, for failure messages.
async fn placements(pods: &Api<Pod>) -> String {
    let mut out = String::new();
    for p in pods.list(&ListParams::default()).await.unwrap().items {
        let phase = p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
        let why = p
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled" && c.status == "False"))
            .and_then(|c| c.message.clone())
            .unwrap_or_default();
        out += &format!(
            "  {} on {:?} {phase}{} {why}\n",
            p.metadata.name.as_deref().unwrap_or(""),
            node_of(&p),
            if p.metadata.deletion_timestamp.is_some() { " (deleting)" } else { "" },
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seven_real_nodes_run_the_seeds_workloads_and_survive_a_node_and_a_leader_dying_needs_root_and_runc()
 {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let started = Instant::now();
    let mut controllers: Vec<String> =
        DEFAULT_CONTROLLERS.iter().map(ToString::to_string).collect();
    controllers.extend(["node-lifecycle-controller".into(), "taint-eviction-controller".into()]);
    let cp = plane(
        ControlPlaneOptions::default()
            .with_controller_manager()
            .controllers(controllers)
            .controller_manager_flag("--node-monitor-period=1s")
            .controller_manager_flag("--node-monitor-grace-period=16s"),
    )
    .await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let key = cp.dir().join("share.key");
    std::fs::write(&key, (0..32u8).map(|i| i.wrapping_mul(29) ^ 0xa5).collect::<Vec<u8>>())
        .unwrap();
    let key_arg = key.to_str().unwrap().to_owned();
    let replica = |n: &str| {
        let extra = [
            "--share-key",
            key_arg.as_str(),
            "--leader-elect",
            "--leader-elect-resource-namespace=xpu-system",
            "--leader-elect-lease-duration=8",
            "--leader-elect-renew-deadline=5",
            "--leader-elect-retry-period=1",
        ];
        XpuScheduler::start(&cp, &kubeconfig, n, &extra)
    };
    let mut schedulers = vec![replica("a"), replica("b")];

    let (a, b, s, c) = tokio::join!(
        start_node(&cp, "127.0.0.2", Role::Whole, &key),
        start_node(&cp, "127.0.0.3", Role::Whole, &key),
        start_node(&cp, "127.0.0.4", Role::Share, &key),
        start_node(&cp, "127.0.0.5", Role::Cpu, &key),
    );
    let (t0, t1, d, m) = tokio::join!(
        start_node(&cp, "127.0.0.7", Role::Tpu, &key),
        start_node(&cp, "127.0.0.8", Role::Tpu, &key),
        start_node(&cp, "127.0.0.9", Role::Dra, &key),
        start_node(&cp, "127.0.0.10", Role::Amd, &key),
    );
    let mut nodes = vec![a, b, s, c, t0, t1, d, m];
    eprintln!("eight nodes Ready with their agents {:.1?} after the start", started.elapsed());
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let logs = |nodes: &[ClusterNode], schedulers: &[XpuScheduler]| {
        let mut out = String::new();
        for n in nodes {
            out += &n.logs();
        }
        for s in schedulers {
            out += &format!("--- {}\n{}\n", s.log.display(), tail(&s.log_text(), 4000));
        }
        out
    };

    // 1. An Indexed Job gang: two pods of four GPUs, selecting A100 nodes by GFD's label.
    let product = "NVIDIA-A100-SXM4-40GB";
    let mut template = probe_template(
        json!({ "xpu.dev/gang": "train", "xpu.dev/gang-size": "2" }),
        json!({ "limits": { GPU: "4" } }),
    );
    template["spec"]["nodeSelector"] = json!({ "nvidia.com/gpu.product": product });
    indexed_job(&admin, "train", 2, 6, template).await;

    // 2. Two pods of half a GPU each, and 3. a pod with no device.
    for name in ["half-0", "half-1"] {
        let mut p = probe_template(json!({}), json!({ "limits": { SHARE: "500" } }));
        p["metadata"]["name"] = json!(name);
        pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    }
    let mut p = probe_template(json!({}), json!({}));
    p["metadata"]["name"] = json!("cpu");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();

    // 4. The GKE seed's multi-host TPU Job: two pods of four chips on the 2x2x2 slice, with the
    // TPU worker environment a JAX job reads (GKE's webhook writes it there; here the Job does,
    // from its completion index and the headless Service's names). Not privileged, unlike the
    // seed's: xpu gives the chips without it.
    let mut template = probe_template(json!({}), json!({ "limits": { TPU: "4" } }));
    template["spec"]["subdomain"] = json!("headless-svc");
    let selector: serde_json::Map<String, Value> =
        TPU_LABELS[..2].iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
    template["spec"]["nodeSelector"] = Value::Object(selector);
    template["spec"]["containers"][0]["env"] = json!([
        { "name": "TPU_WORKER_ID", "valueFrom": { "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']" } } },
        { "name": "TPU_WORKER_HOSTNAMES", "value": "job-1-0.headless-svc,job-1-1.headless-svc" },
    ]);
    indexed_job(&admin, "job-1", 2, 0, template).await;

    // 5. A DRA claim for two GPUs of one NVLink domain.
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": "nvlink-pair" },
        "spec": { "devices": {
            "requests": [{ "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 2 } }],
            "constraints": [{ "matchAttribute": "xpu.dev/interconnectDomain" }],
        } },
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let mut p = probe_template(json!({}), json!({ "claims": [{ "name": "gpus" }] }));
    p["metadata"]["name"] = json!("claimed");
    p["spec"]["resourceClaims"] = json!([{ "name": "gpus", "resourceClaimName": "nvlink-pair" }]);
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();

    // 6. Two AMD MI300X of the AMD node.
    let mut p = probe_template(json!({}), json!({ "limits": { AMD: "2" } }));
    p["metadata"]["name"] = json!("amd");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();

    let running = |names: &'static [&'static str]| {
        let pods = pods.clone();
        async move {
            let all = pods.list(&ListParams::default()).await.unwrap().items;
            let running = |job: &str| {
                all.iter()
                    .filter(|p| job_of(p) == Some(job))
                    .filter(|p| p.metadata.deletion_timestamp.is_none())
                    .filter(|p| {
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .count()
            };
            let named = names.iter().all(|n| {
                all.iter().any(|p| {
                    p.metadata.name.as_deref() == Some(n)
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                })
            });
            running("train") == 2 && running("job-1") == 2 && named
        }
    };
    let ok = wait_until(Duration::from_secs(120), || {
        running(&["half-0", "half-1", "cpu", "claimed", "amd"])
    })
    .await;
    assert!(
        ok,
        "every workload running\n{}\n{}",
        placements(&pods).await,
        logs(&nodes, &schedulers)
    );
    eprintln!(
        "workloads running {:.1?} after the start:\n{}",
        started.elapsed(),
        placements(&pods).await
    );
    let diag = || String::new();

    // The gang: one member per whole-GPU node, each with exactly the node's four GPUs.
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    let mut gang: Vec<&Pod> = all
        .iter()
        .filter(|p| p.metadata.labels.as_ref().is_some_and(|l| l.contains_key("xpu.dev/gang")))
        .collect();
    gang.sort_by_key(|p| node_of(p).map(str::to_owned));
    let gang_nodes: Vec<&str> = gang.iter().filter_map(|p| node_of(p)).collect();
    assert_eq!(gang_nodes, ["127.0.0.2", "127.0.0.3"], "{}", placements(&pods).await);
    for p in &gang {
        let name = p.metadata.name.as_deref().unwrap();
        let (gpu, plain) = views(&pods, name, &diag).await;
        assert_only_these_gpus(&gpu, &plain, &[0, 1, 2, 3]);
    }
    // The shares: both on the share node, on one GPU, each seeing only that GPU.
    let mut share_gpu = Vec::new();
    for name in ["half-0", "half-1"] {
        let p = pods.get(name).await.unwrap();
        assert_eq!(node_of(&p), Some("127.0.0.4"), "{}", placements(&pods).await);
        let chosen = p.metadata.annotations.as_ref().and_then(|a| a.get("xpu.dev/gpus")).cloned();
        let (gpu, plain) = views(&pods, name, &diag).await;
        let seen = minors(&gpu);
        assert_eq!(seen.len(), 1, "{name} sees one GPU: {:?}", gpu.accel_nodes());
        assert_eq!(
            chosen,
            Some(seen[0].to_string()),
            "{name}: the GPU xpu chose is the one it sees"
        );
        assert_only_these_gpus(&gpu, &plain, &seen);
        share_gpu.push(seen[0]);
    }
    assert_eq!(share_gpu[0], share_gpu[1], "two halves of one GPU");
    // The CPU pod sees no accelerator.
    let (cpu, _) = views(&pods, "cpu", &diag).await;
    assert_eq!(cpu.accel_nodes(), BTreeMap::new(), "the CPU pod's /dev");
    // The TPU slice: one pod per host of the pool, each with the host's four chips (their vfio
    // groups and the container node) and its worker id.
    let mut tpu: Vec<Pod> = all.iter().filter(|p| job_of(p) == Some("job-1")).cloned().collect();
    tpu.sort_by_key(|p| node_of(p).map(str::to_owned));
    let tpu_nodes: Vec<&str> = tpu.iter().filter_map(|p| node_of(p)).collect();
    assert_eq!(tpu_nodes, ["127.0.0.7", "127.0.0.8"], "{}", placements(&pods).await);
    let mut ids = Vec::new();
    for p in &tpu {
        let name = p.metadata.name.as_deref().unwrap();
        let (chips, plain) = views(&pods, name, &diag).await;
        let paths: Vec<String> = chips.accel_nodes().into_keys().collect();
        assert_eq!(
            paths,
            ["/dev/vfio/0", "/dev/vfio/1", "/dev/vfio/2", "/dev/vfio/3", "/dev/vfio/vfio"],
            "{name}: its four chips"
        );
        assert_eq!(plain.accel_nodes(), BTreeMap::new(), "{name}: the plain container");
        let annotations = p.metadata.annotations.clone().unwrap_or_default();
        let index = annotations["batch.kubernetes.io/job-completion-index"].clone();
        assert_eq!(chips.env.get("TPU_WORKER_ID"), Some(&index), "{name}");
        assert_eq!(
            chips.env.get("TPU_WORKER_HOSTNAMES").map(String::as_str),
            Some("job-1-0.headless-svc,job-1-1.headless-svc")
        );
        ids.push(index);
    }
    ids.sort();
    assert_eq!(ids, ["0", "1"]);
    // The AMD pod: its two GPUs' DRM nodes and /dev/kfd, nothing else.
    let amd = pods.get("amd").await.unwrap();
    assert_eq!(node_of(&amd), Some("127.0.0.10"), "{}", placements(&pods).await);
    let (gpus, plain) = views(&pods, "amd", &diag).await;
    let given = gpus.env.get("XPU_VISIBLE_DEVICES").cloned().unwrap_or_default();
    let mut want = BTreeMap::from([("/dev/kfd".to_owned(), ('c', MAJOR_KFD, 0))]);
    for a in given.split(',') {
        let i = xpu_testkit::hosts::MI300X_BUSES
            .iter()
            .position(|b| format!("0000:{b:02x}:00.0") == a)
            .unwrap_or_else(|| panic!("{a} is no MI300X of the node: {:?}", gpus.env))
            as u32;
        want.insert(format!("/dev/dri/card{i}"), ('c', MAJOR_DRM, i));
        want.insert(format!("/dev/dri/renderD{}", 128 + i), ('c', MAJOR_DRM, 128 + i));
    }
    assert_eq!(given.split(',').count(), 2, "{:?}", gpus.env);
    assert_only_these_nodes(&gpus, &plain, &want);
    // Put there by the shim, not by CDI: the shim records what it added.
    assert!(gpus.env.contains_key("XPU_DEVICES"), "the shim edited the spec: {:?}", gpus.env);
    eprintln!("the AMD pod: {given} and only their nodes, through the runtime shim");

    // The claim: two GPUs of the DRA node, of one NVLink domain, and nothing else.
    let claimed = pods.get("claimed").await.unwrap();
    assert_eq!(node_of(&claimed), Some("127.0.0.9"), "{}", placements(&pods).await);
    let (gpu, plain) = views(&pods, "claimed", &diag).await;
    let seen_by_claim = minors(&gpu);
    assert_eq!(seen_by_claim.len(), 2, "two GPUs: {:?}", gpu.accel_nodes());
    assert_only_these_gpus(&gpu, &plain, &seen_by_claim);
    let alloc = claims.get("nvlink-pair").await.unwrap().status.unwrap().allocation.unwrap();
    let results = alloc.devices.unwrap().results.unwrap();
    let published =
        Api::<ResourceSlice>::all(admin.clone()).list(&ListParams::default()).await.unwrap().items;
    let domains: std::collections::BTreeSet<Option<String>> = results
        .iter()
        .map(|r| {
            assert_eq!(r.pool, "127.0.0.9");
            published
                .iter()
                .filter(|s| s.spec.pool.name == r.pool)
                .flat_map(|s| s.spec.devices.iter().flatten())
                .find(|d| d.name == r.device)
                .and_then(|d| d.attributes.as_ref()?.get("interconnectDomain")?.string.clone())
        })
        .collect();
    assert_eq!(results.len(), 2);
    assert_eq!(domains.len(), 1, "one NVLink domain: {domains:?}");
    assert!(domains.iter().all(Option::is_some), "devices with a domain: {domains:?}");

    // The exporters label each GPU's series with the gang member that holds it.
    for (node, member) in nodes[..2].iter().zip(&gang) {
        let addr = node.metrics.clone().unwrap();
        let member = member.metadata.name.clone().unwrap();
        let want = format!("pod=\"{member}\"");
        let mut last = String::new();
        let labelled = wait_until(Duration::from_secs(30), || {
            let text = scrape(&addr);
            let hit = text
                .lines()
                .filter(|l| l.starts_with("xpu_device_info") && l.contains(&want))
                .count();
            last = text;
            async move { hit == 4 }
        })
        .await;
        assert!(
            labelled,
            "{addr}: four devices held by {member}\n{}\n{}",
            tail(&last, 3000),
            node.logs()
        );
    }

    // A device fails under a running pod (it vanishes from the node's PCI bus): the device
    // plugin reports it Unhealthy, the kubelet takes it out of allocatable and writes it into
    // the pod's allocatedResourcesStatus; back, it is Healthy again.
    let holder = gang[0].metadata.name.clone().unwrap();
    let gone = unplug(&nodes[0], 2);
    let node_api: Api<NodeObject> = Api::all(admin.clone());
    let gpus_of = |n: NodeObject| {
        let alloc = n.status.and_then(|s| s.allocatable).unwrap_or_default();
        alloc.get(GPU).map(|q| q.0.clone())
    };
    let seen = wait_until(Duration::from_secs(60), || async {
        let p = pods.get(&holder).await.unwrap();
        let n = node_api.get("127.0.0.2").await.unwrap();
        health_of(&p, "gpu", GPU, &gone.2).as_deref() == Some("Unhealthy")
            && gpus_of(n).as_deref() == Some("3")
    })
    .await;
    let p = pods.get(&holder).await.unwrap();
    assert!(
        seen,
        "{} Unhealthy in {holder}'s status, allocatable 3\n{}\n{}",
        gone.2,
        status(&p),
        nodes[0].logs()
    );
    assert!(
        nodes[0].agents[0].log_text().contains(&format!("{GPU}: device {} is Unhealthy", gone.2))
    );
    eprintln!(
        "{} vanished: Unhealthy in {holder}'s allocatedResourcesStatus, allocatable 3",
        gone.2
    );
    replug(&gone);
    let back = wait_until(Duration::from_secs(60), || async {
        let p = pods.get(&holder).await.unwrap();
        let n = node_api.get("127.0.0.2").await.unwrap();
        health_of(&p, "gpu", GPU, &gone.2).as_deref() == Some("Healthy")
            && gpus_of(n).as_deref() == Some("4")
    })
    .await;
    assert!(back, "{} Healthy again\n{}", gone.2, status(&pods.get(&holder).await.unwrap()));

    // On the DRA node: a free GPU vanishes, the driver taints it in its slice, and a claim for
    // the two GPUs left free there waits until it is back.
    let dra = nodes.iter().find(|n| n.name == "127.0.0.9").unwrap();
    let free: Vec<u32> = (0..4).filter(|m| !seen_by_claim.contains(m)).collect();
    let gone = unplug(dra, free[0]);
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let tainted = wait_until(Duration::from_secs(30), || async {
        slices.list(&ListParams::default()).await.unwrap().items.iter().any(|s| {
            s.spec.pool.name == "127.0.0.9"
                && s.spec.devices.iter().flatten().any(|d| {
                    d.taints
                        .iter()
                        .flatten()
                        .any(|t| t.key == "xpu.dev/unhealthy" && t.effect == "NoSchedule")
                })
        })
    })
    .await;
    assert!(tainted, "the vanished GPU tainted in the slice\n{}", dra.logs());
    let mut second = claim.clone();
    second.metadata =
        kube::api::ObjectMeta { name: Some("second-pair".into()), ..Default::default() };
    second.status = None;
    claims.create(&PostParams::default(), &second).await.unwrap();
    let mut p = probe_template(json!({}), json!({ "claims": [{ "name": "gpus" }] }));
    p["metadata"]["name"] = json!("second");
    p["spec"]["resourceClaims"] = json!([{ "name": "gpus", "resourceClaimName": "second-pair" }]);
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let waiting = claims.get("second-pair").await.unwrap();
    assert!(
        waiting.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none(),
        "no claim gets a tainted device: {:?}\n{}",
        waiting.status,
        placements(&pods).await
    );
    assert_eq!(node_of(&pods.get("second").await.unwrap()), None);
    replug(&gone);
    let placed = wait_until(Duration::from_secs(60), || async {
        let p = pods.get("second").await.unwrap();
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await;
    assert!(
        placed,
        "the claim placed once the GPU is back\n{}\n{}",
        placements(&pods).await,
        dra.logs()
    );
    let (gpu, plain) = views(&pods, "second", &diag).await;
    let mut mine = minors(&gpu);
    mine.sort_unstable();
    assert_eq!(mine, free, "the two GPUs the first claim left");
    assert_only_these_gpus(&gpu, &plain, &free);
    eprintln!(
        "a GPU of the DRA node vanished: tainted, a claim waited, and got it when it came back"
    );

    // NVML reports a fatal XID (79, fallen off the bus) for a GPU the first claim holds, under
    // its running pod: the driver taints it and its health stream (v1alpha1.DRAResourceHealth)
    // says Unhealthy, and the kubelet writes that into the pod's allocatedResourcesStatus under
    // the claim; after NVML reports the GPU reset, it is Healthy again.
    let xid_gpu = dra.spec.devices.iter().find(|d| d.nvidia_minor == Some(seen_by_claim[0]));
    let xid_gpu = xid_gpu.unwrap().address;
    let nvml = dra.fx.root().join(FAKE_NVML);
    let say = |resets: u32| {
        let v = json!({ "devices": { xid_gpu.to_string(): { "xids": [79], "resets": resets } } });
        std::fs::write(&nvml, v.to_string()).unwrap();
    };
    say(0);
    let device = format!("gpu-{}", xid_gpu.dns_label());
    // The kubelet names the entry after the pod's claim entry and each device by its CDI id.
    let uid = claims.get("nvlink-pair").await.unwrap().metadata.uid.unwrap_or_default();
    let id = format!("k8s.xpu.dev/claim={uid}-{device}");
    let claim_health = |p: &Pod| health_of(p, "gpu", "claim:gpus", &id);
    let unhealthy = wait_until(Duration::from_secs(60), || async {
        claim_health(&pods.get("claimed").await.unwrap()).as_deref() == Some("Unhealthy")
    })
    .await;
    let p = pods.get("claimed").await.unwrap();
    assert!(unhealthy, "{id} Unhealthy under the claim\n{}\n{}", status(&p), dra.logs());
    let said = p.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
    let message = said
        .iter()
        .flat_map(|c| c.allocated_resources_status.clone().unwrap_or_default())
        .flat_map(|r| r.resources.unwrap_or_default())
        .find(|r| r.resource_id == id)
        .and_then(|r| r.message);
    assert!(message.as_deref().is_some_and(|m| m.contains("xid-79")), "{message:?}");
    say(1);
    let healthy = wait_until(Duration::from_secs(60), || async {
        claim_health(&pods.get("claimed").await.unwrap()).as_deref() == Some("Healthy")
    })
    .await;
    let p = pods.get("claimed").await.unwrap();
    assert!(healthy, "{id} Healthy again\n{}\n{}", status(&p), dra.logs());
    eprintln!(
        "XID 79 on a claimed GPU: Unhealthy ({message:?}) in the claim's allocatedResourcesStatus, Healthy after its reset"
    );

    // The kubelets of the gang member's node and of the DRA node restart: the device plugin and
    // the DRA driver register again, prepared claims stay prepared, and the running containers
    // keep their devices (the same containers, never restarted).
    let dra = nodes.iter().find(|n| n.name == "127.0.0.9").unwrap();
    let containers = |p: &Pod| -> Vec<(String, Option<String>, i32)> {
        let statuses =
            p.status.as_ref().and_then(|s| s.container_statuses.clone()).unwrap_or_default();
        statuses.into_iter().map(|s| (s.name, s.container_id, s.restart_count)).collect()
    };
    let registered =
        |n: &ClusterNode| n.agents[0].log_text().matches("registered with the kubelet").count();
    let unprepared = |n: &ClusterNode| n.agents[0].log_text().matches("claim unprepared").count();
    let held_before = [
        containers(&pods.get(&holder).await.unwrap()),
        containers(&pods.get("claimed").await.unwrap()),
    ];
    let (plugin_regs, driver_regs, driver_unprepared) =
        (registered(&nodes[0]), registered(dra), unprepared(dra));
    let cdi_before: Vec<String> = std::fs::read_dir(dra.node.cdi_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let (a, b) = tokio::join!(nodes[0].node.restart_kubelet(&cp), dra.node.restart_kubelet(&cp));
    let (a, b) = (a.unwrap(), b.unwrap());
    eprintln!("kubelets of 127.0.0.2 and 127.0.0.9 restarted and Ready in {a:.1?} and {b:.1?}");
    let again = wait_until(Duration::from_secs(60), || async {
        let n = node_api.get("127.0.0.2").await.unwrap();
        registered(&nodes[0]) > plugin_regs
            && registered(dra) > driver_regs
            && gpus_of(n).as_deref() == Some("4")
    })
    .await;
    assert!(
        again,
        "the plugin and the driver registered again\n{}\n{}",
        nodes[0].logs(),
        dra.logs()
    );
    let held_after = [
        containers(&pods.get(&holder).await.unwrap()),
        containers(&pods.get("claimed").await.unwrap()),
    ];
    assert_eq!(held_after, held_before, "the same containers, never restarted");
    for name in [holder.as_str(), "claimed"] {
        let p = pods.get(name).await.unwrap();
        assert_eq!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Running"), "{name}");
    }
    assert_eq!(
        unprepared(dra),
        driver_unprepared,
        "no claim unprepared by the restart\n{}",
        dra.logs()
    );
    let cdi_after: Vec<String> = std::fs::read_dir(dra.node.cdi_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(cdi_after, cdi_before, "the prepared claims' CDI specs stay");
    // A pod sent to the restarted node runs there.
    let mut p = probe_template(json!({}), json!({}));
    p["metadata"]["name"] = json!("after-restart");
    p["spec"]["nodeName"] = json!("127.0.0.9");
    p["spec"]["schedulerName"] = json!("default-scheduler");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let ran = wait_until(Duration::from_secs(60), || async {
        let p = pods.get("after-restart").await.unwrap();
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await;
    assert!(ran, "a pod runs on the restarted node\n{}", dra.logs());

    // A GPU node dies: its gang member is evicted and recreated, and waits for room.
    let dead = nodes.remove(1);
    let victim = gang[1].metadata.name.clone().unwrap();
    let died = Instant::now();
    drop(dead);
    let not_ready = wait_until(Duration::from_secs(60), || async {
        let n = node_api.get("127.0.0.3").await.unwrap();
        let ready = n.status.and_then(|s| s.conditions).unwrap_or_default();
        ready.iter().any(|c| c.type_ == "Ready" && c.status != "True")
    })
    .await;
    assert!(not_ready, "node 127.0.0.3 NotReady after its kubelet died");
    eprintln!("127.0.0.3 NotReady {:.1?} after it died", died.elapsed());
    let replaced = wait_until(Duration::from_secs(60), || async {
        let all = pods.list(&ListParams::default()).await.unwrap().items;
        let evicted = all
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(victim.as_str()))
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some());
        let fresh = all.iter().any(|p| {
            p.metadata.labels.as_ref().is_some_and(|l| l.contains_key("xpu.dev/gang"))
                && p.metadata.deletion_timestamp.is_none()
                && node_of(p).is_none()
        });
        evicted && fresh
    })
    .await;
    assert!(replaced, "{victim} evicted and recreated\n{}", placements(&pods).await);
    eprintln!("{victim} evicted and recreated {:.1?} after its node died", died.elapsed());
    // Nothing has four free GPUs: the member waits (never half a gang member on the share node).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    let waiting: Vec<&Pod> = all
        .iter()
        .filter(|p| p.metadata.labels.as_ref().is_some_and(|l| l.contains_key("xpu.dev/gang")))
        .filter(|p| p.metadata.deletion_timestamp.is_none() && node_of(p).is_none())
        .collect();
    assert_eq!(waiting.len(), 1, "one member waits\n{}", placements(&pods).await);
    let replacement = waiting[0].metadata.name.clone().unwrap();

    // A new node joins: the member goes there and sees its four GPUs.
    let fresh = start_node(&cp, "127.0.0.6", Role::Whole, &key).await;
    nodes.push(fresh);
    let placed = wait_until(Duration::from_secs(90), || async {
        let p = pods.get(&replacement).await.unwrap();
        node_of(&p) == Some("127.0.0.6")
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await;
    assert!(
        placed,
        "{replacement} on the new node\n{}\n{}",
        placements(&pods).await,
        logs(&nodes, &schedulers)
    );
    let (gpu, plain) = views(&pods, &replacement, &diag).await;
    assert_only_these_gpus(&gpu, &plain, &[0, 1, 2, 3]);
    eprintln!("{replacement} running on 127.0.0.6 {:.1?} after 127.0.0.3 died", died.elapsed());

    // 5. The leader dies: the standby binds what arrives.
    let leader = schedulers
        .iter()
        .position(|s| s.log_text().contains("bound"))
        .unwrap_or_else(|| panic!("a replica bound the pods\n{}", logs(&nodes, &schedulers)));
    schedulers[leader].kill9();
    let killed = Instant::now();
    let mut p = probe_template(json!({}), json!({}));
    p["metadata"]["name"] = json!("after-failover");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let bound = wait_until(Duration::from_secs(60), || async {
        node_of(&pods.get("after-failover").await.unwrap()).is_some()
    })
    .await;
    assert!(bound, "the standby binds after the leader died\n{}", logs(&nodes, &schedulers));
    eprintln!("a pod bound {:.1?} after the leader was killed", killed.elapsed());
    eprintln!("the whole cluster test took {:.1?}", started.elapsed());
}

/// Pods of `namespace` with label `app.kubernetes.io/name=app` and their nodes, when Running.
async fn running_pods(admin: &kube::Client, namespace: &str, app: &str) -> Vec<(String, String)> {
    let api: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/name={app}"));
    let mut out: Vec<(String, String)> = api
        .list(&lp)
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| Some((p.metadata.name.clone()?, node_of(&p)?.to_owned())))
        .collect();
    out.sort_by(|a, b| a.1.cmp(&b.1));
    out
}

/// xpu installed as an admin installs it, on two real nodes: the image `scripts/build-image`
/// makes (here from this build's binary, `--binaries`) imported into each node's containerd,
/// the Helm chart rendered with a node group for the device plugin and one for DRA, and
/// applied. The scheduler Deployment (two replicas, leader election), the node agent, the DRA
/// driver and the exporter DaemonSets run as pods (kube-scheduler places them); xpu's scheduler
/// pods then place a GPU pod (on the device plugin's node, exactly its GPUs) and a DRA claim's
/// pod (on the DRA node), the exporter pod labels the GPUs with their pod, and when the leader's
/// pod is deleted the other replica binds what arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installed_as_an_admin_runs_xpu_as_pods_on_real_nodes_needs_root_and_runc() {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let started = Instant::now();
    let work = tempfile::tempdir().unwrap();
    let archive = work.path().join("xpu-image.tar");
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_xpu")).parent().unwrap().to_owned();
    let built = cluster::build_image(&repo(), &bin_dir, &archive).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{built}");

    let controllers = cluster::chart_controllers(&[]);
    let cp = plane(
        ControlPlaneOptions::default()
            .with_scheduler()
            .with_controller_manager()
            .controllers(controllers),
    )
    .await;
    let admin = cp.admin_client();
    let api_port: u16 = cp.server_url().rsplit(':').next().unwrap().parse().unwrap();

    // Two nodes of four A100s: one for the device plugin, one for DRA.
    let node = |name: &'static str, group: &'static str| {
        let (cp, archive) = (&cp, &archive);
        async move {
            let spec = four_gpu_host();
            let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
            let options = NodeOptions::default()
                .named(name)
                .devices_of(fx.root())
                .host_root(fx.root())
                .image(archive);
            let node =
                Node::start(cp, options).await.unwrap_or_else(|e| panic!("node {name}: {e}"));
            // The node's CDI spec, as the admin's host set-up writes it (docs/containers.md).
            cdi_generate(fx.root(), "nvidia", &node.cdi_dir());
            let nodes: Api<NodeObject> = Api::all(cp.admin_client());
            let patch = json!({ "metadata": { "labels": { "xpu.dev/agent": group } } });
            nodes.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
            ClusterNode { name: name.into(), agents: Vec::new(), metrics: None, node, fx, spec }
        }
    };
    let (a, b) = tokio::join!(node("127.0.0.2", "device-plugin"), node("127.0.0.3", "dra"));
    let nodes = [a, b];
    let logs = || nodes.iter().map(ClusterNode::logs).collect::<String>();

    // The chart, with the node groups an admin sets, applied in the order the files come.
    let docs = render(&[
        "--set",
        "nodeAgent.nodeSelector.xpu\\.dev/agent=device-plugin",
        "--set",
        "dra.nodeSelector.xpu\\.dev/agent=dra",
    ]);
    let (mut first, mut rest): (Vec<Value>, Vec<Value>) =
        docs.into_iter().partition(|d| d["kind"] == "Namespace");
    first.append(&mut rest);
    for mut doc in first {
        cluster::for_fixture_nodes(&mut doc, api_port);
        create(&admin, &doc, false)
            .await
            .unwrap_or_else(|e| panic!("{} {}: {e}", doc["kind"], doc["metadata"]["name"]));
    }
    let want = [
        ("xpu-node-agent", vec!["127.0.0.2"]),
        ("xpu-dra-driver", vec!["127.0.0.3"]),
        ("xpu-exporter", vec!["127.0.0.2", "127.0.0.3"]),
        ("xpu-scheduler", vec!["127.0.0.2", "127.0.0.3"]),
    ];
    let last = std::sync::Mutex::new(Vec::new());
    let up = wait_until(Duration::from_secs(120), || async {
        let mut seen = Vec::new();
        let mut ok = true;
        for (app, on) in &want {
            let pods = running_pods(&admin, "xpu-system", app).await;
            let nodes: Vec<&str> = pods.iter().map(|(_, n)| n.as_str()).collect();
            ok &= nodes == *on;
            seen.push(format!("{app}: {pods:?}"));
        }
        *last.lock().unwrap() = seen;
        ok
    })
    .await;
    let last = last.into_inner().unwrap();
    let system: Api<Pod> = Api::namespaced(admin.clone(), "xpu-system");
    let diag = || async {
        let mut out = placements(&system).await;
        for p in system.list(&ListParams::default()).await.unwrap().items {
            let name = p.metadata.name.clone().unwrap();
            let c = p.spec.as_ref().unwrap().containers[0].name.clone();
            let lp = LogParams { container: Some(c), tail_lines: Some(20), ..LogParams::default() };
            out += &format!("--- {name}\n{}\n", system.logs(&name, &lp).await.unwrap_or_default());
        }
        out
    };
    assert!(
        up,
        "xpu's pods running where the chart puts them: {last:?}\n{}\n{}",
        diag().await,
        logs()
    );
    eprintln!("xpu's pods running {:.1?} after the start: {last:?}", started.elapsed());

    // The device plugin pod's GPUs reach allocatable, the driver pod's reach its slices.
    let node_api: Api<NodeObject> = Api::all(admin.clone());
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let offered = wait_until(Duration::from_secs(60), || async {
        let n = node_api.get("127.0.0.2").await.unwrap();
        let alloc = n.status.and_then(|s| s.allocatable).unwrap_or_default();
        let lp = ListParams::default().fields("spec.nodeName=127.0.0.3,spec.driver=xpu.dev");
        let devices: usize = slices
            .list(&lp)
            .await
            .unwrap()
            .items
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        alloc.get(GPU).is_some_and(|q| q.0 == "4") && devices == 4
    })
    .await;
    assert!(offered, "4 GPUs allocatable on 127.0.0.2, 4 in 127.0.0.3's slices\n{}", diag().await);

    // xpu's scheduler pods place a GPU pod and a claim's pod.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut p = probe_template(json!({}), json!({ "limits": { GPU: "2" } }));
    p["metadata"]["name"] = json!("two-gpus");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": "pair" },
        "spec": { "devices": { "requests": [
            { "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 2 } }] } },
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let mut p = probe_template(json!({}), json!({ "claims": [{ "name": "gpus" }] }));
    p["metadata"]["name"] = json!("claimed");
    p["spec"]["resourceClaims"] = json!([{ "name": "gpus", "resourceClaimName": "pair" }]);
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let ran = wait_until(Duration::from_secs(90), || async {
        let a = pods.get("two-gpus").await.unwrap();
        let b = pods.get("claimed").await.unwrap();
        [a, b].iter().all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
    })
    .await;
    assert!(ran, "both pods running\n{}\n{}\n{}", placements(&pods).await, diag().await, logs());
    let none = || String::new();
    for (name, node) in [("two-gpus", "127.0.0.2"), ("claimed", "127.0.0.3")] {
        let p = pods.get(name).await.unwrap();
        assert_eq!(node_of(&p), Some(node), "{name}");
        assert_eq!(p.spec.as_ref().unwrap().scheduler_name.as_deref(), Some("xpu"));
        let (gpu, plain) = views(&pods, name, &none).await;
        let seen = minors(&gpu);
        assert_eq!(seen.len(), 2, "{name}: {:?}", gpu.accel_nodes());
        assert_only_these_gpus(&gpu, &plain, &seen);
    }

    // The exporter pod on 127.0.0.2 labels the two GPUs with their pod.
    let labelled = wait_until(Duration::from_secs(60), || async {
        let text = scrape("127.0.0.2:9402");
        text.lines()
            .filter(|l| l.starts_with("xpu_device_info") && l.contains("pod=\"two-gpus\""))
            .count()
            == 2
    })
    .await;
    assert!(
        labelled,
        "the exporter pod labels two GPUs with two-gpus\n{}",
        tail(&scrape("127.0.0.2:9402"), 3000)
    );

    // The example workloads the local cluster's guide applies (docs/examples/local-cluster) are valid
    // objects of this API server (server-side dry run).
    let mut examples: Vec<_> = std::fs::read_dir(repo().join("docs/examples/local-cluster"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    examples.sort();
    for f in &examples {
        for doc in documents(f) {
            create(&admin, &doc, true).await.unwrap_or_else(|e| {
                panic!("{}: {} fails a dry run: {e}", f.display(), doc["kind"])
            });
        }
    }

    // The leader's pod deleted: the other replica binds what arrives.
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(admin.clone(), "xpu-system");
    let holder_of = || async {
        let l = leases.get_opt("xpu").await.unwrap();
        l.and_then(|l| l.spec?.holder_identity).filter(|h| !h.is_empty())
    };
    let held = wait_until(Duration::from_secs(30), || async { holder_of().await.is_some() }).await;
    let restarts: Vec<(String, i32)> = system
        .list(&ListParams::default().labels("app.kubernetes.io/name=xpu-scheduler"))
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| {
            let s = p.status.as_ref().and_then(|s| s.container_statuses.as_ref());
            (p.metadata.name.clone().unwrap(), s.map_or(-1, |s| s[0].restart_count))
        })
        .collect();
    assert!(
        held,
        "a replica holds the Lease xpu-system/xpu; restarts {restarts:?}\n{}",
        diag().await
    );
    let holder = holder_of().await.unwrap();
    let leader = running_pods(&admin, "xpu-system", "xpu-scheduler")
        .await
        .into_iter()
        .map(|(name, _)| name)
        .find(|name| holder.starts_with(&format!("{name}_")))
        .unwrap_or_else(|| panic!("the holder {holder} is a scheduler pod"));
    system.delete(&leader, &Default::default()).await.unwrap();
    let deleted = Instant::now();
    // Gone (its container stopped, the Lease given up on SIGTERM) before the next pod comes.
    let gone = wait_until(Duration::from_secs(60), || async {
        system.get_opt(&leader).await.unwrap().is_none()
    })
    .await;
    assert!(gone, "{leader} deleted\n{}", diag().await);
    let mut p = probe_template(json!({}), json!({ "limits": { GPU: "1" } }));
    p["metadata"]["name"] = json!("after-failover");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let bound = wait_until(Duration::from_secs(60), || async {
        node_of(&pods.get("after-failover").await.unwrap()) == Some("127.0.0.2")
    })
    .await;
    assert!(bound, "the other replica binds after {leader} was deleted\n{}", diag().await);
    let other = wait_until(Duration::from_secs(30), || async {
        holder_of().await.is_some_and(|h| h != holder)
    })
    .await;
    let now = holder_of().await.unwrap_or_default();
    assert!(other, "another replica holds the lease: {now:?}");
    eprintln!("{leader} deleted: {now} bound a pod {:.1?} later", deleted.elapsed());

    // Both kubelets restarted under the running pods: the device plugin pod and the DRA driver
    // pod register again, the running containers keep their devices (not restarted), the
    // prepared claim stays prepared, and new pods get devices from both again.
    let restarts_of = |pods: Vec<Pod>| -> BTreeMap<String, i32> {
        pods.iter()
            .map(|p| {
                let s = p.status.as_ref().and_then(|s| s.container_statuses.clone());
                let n = s.unwrap_or_default().iter().map(|c| c.restart_count).sum();
                (p.metadata.name.clone().unwrap(), n)
            })
            .collect()
    };
    let agents = || async {
        restarts_of(system.list(&ListParams::default()).await.unwrap().items)
            .into_iter()
            .filter(|(n, _)| !n.starts_with("xpu-scheduler"))
            .collect::<BTreeMap<_, _>>()
    };
    let before = agents().await;
    let (ra, rb) =
        tokio::join!(nodes[0].node.restart_kubelet(&cp), nodes[1].node.restart_kubelet(&cp));
    let (ra, rb) = (ra.unwrap_or_else(|e| panic!("{e}")), rb.unwrap_or_else(|e| panic!("{e}")));
    eprintln!("kubelets restarted: Ready again after {ra:.1?} and {rb:.1?}");
    for name in ["two-gpus", "claimed"] {
        let p = pods.get(name).await.unwrap();
        assert_eq!(p.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Running"), "{name}");
        assert_eq!(restarts_of(vec![p]).values().sum::<i32>(), 0, "{name} kept running");
    }
    let (gpu, plain) = views(&pods, "two-gpus", &none).await;
    assert_only_these_gpus(&gpu, &plain, &minors(&gpu));
    let mut p = probe_template(json!({}), json!({ "limits": { GPU: "1" } }));
    p["metadata"]["name"] = json!("after-restart");
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": "one-more" },
        "spec": { "devices": { "requests": [
            { "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 1 } }] } },
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let mut p = probe_template(json!({}), json!({ "claims": [{ "name": "gpus" }] }));
    p["metadata"]["name"] = json!("claimed-after-restart");
    p["spec"]["resourceClaims"] = json!([{ "name": "gpus", "resourceClaimName": "one-more" }]);
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let running = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    let ran = wait_until(Duration::from_secs(90), || async {
        let a = pods.get("after-restart").await.unwrap();
        let b = pods.get("claimed-after-restart").await.unwrap();
        running(&a) && running(&b)
    })
    .await;
    if !ran {
        let all_claims = claims.list(&ListParams::default()).await.unwrap().items;
        let all_slices = slices.list(&ListParams::default()).await.unwrap().items;
        panic!(
            "new pods get devices after the kubelets restarted\n{}\nclaims: {}\nslices: {}\n{}\n{}",
            placements(&pods).await,
            serde_json::to_string(&all_claims.iter().map(|c| &c.status).collect::<Vec<_>>())
                .unwrap(),
            serde_json::to_string(&all_slices.iter().map(|s| &s.spec).collect::<Vec<_>>()).unwrap(),
            diag().await,
            logs()
        );
    }
    for (name, node) in [("after-restart", "127.0.0.2"), ("claimed-after-restart", "127.0.0.3")] {
        let p = pods.get(name).await.unwrap();
        assert_eq!(node_of(&p), Some(node), "{name}");
        let (gpu, plain) = views(&pods, name, &none).await;
        let seen = minors(&gpu);
        assert_eq!(seen.len(), 1, "{name}: {:?}", gpu.accel_nodes());
        assert_only_these_gpus(&gpu, &plain, &seen);
    }
    // The claim prepared before the restart is still this driver's (its checkpoint) and its
    // pod's devices are the claim's.
    let (gpu, _) = views(&pods, "claimed", &none).await;
    assert_eq!(minors(&gpu).len(), 2);
    assert_eq!(agents().await, before, "the agent pods were not restarted");
    eprintln!("the chart's test took {:.1?}", started.elapsed());
}
