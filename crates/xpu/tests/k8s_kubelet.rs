//! `xpu k8s device-plugin` on a real node: the upstream kubelet and containerd with Debian's
//! runc (`xpu_testkit::kubelet::Node`), joined to a real control plane whose kube-scheduler
//! places the pods. Nothing of the kubelet is played: the plugin registers on the kubelet's
//! socket, the node's allocatable shows the fixture's 4 GPUs within a node-status period, a
//! 2-GPU pod is bound by kube-scheduler and started by the kubelet, which calls `Allocate` (its
//! checkpoint records the answer); the container sees exactly its two GPUs and the control
//! nodes in `/dev` and in its device cgroup, compared with a GPU-less container of the same pod;
//! and a GPU unplugged from the fixture leaves allocatable at 3.
//!
//! Needs root and runc; the binaries come from scripts/install-k8s and scripts/install-node (a
//! missing one fails the test with the command).

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use serde_json::{Value, json};
use xpu_testkit::bundle::{ContainerView, probe_script, skip_container_tests};
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions, K8S_VERSION};
use xpu_testkit::kubelet::{
    BUSYBOX_IMAGE, CONTAINERD_VERSION, NODE_NAME, Node, NodeOptions, OLD_KUBELET_VERSION,
};
use xpu_testkit::{BuildOptions, HostSpec, hosts};

use k8s_support::*;

const GPU: &str = "nvidia.com/gpu";

/// `xpu k8s device-plugin`, killed on drop; its stderr goes to a file.
struct Plugin {
    child: Child,
    log: std::path::PathBuf,
}

impl Plugin {
    /// `xpu k8s device-plugin --interval-ms 200 ARGS --root ROOT --plugin-dir <node's>`, its
    /// log in the node's directory.
    fn spawn(node: &Node, root: &std::path::Path, args: &[&std::ffi::OsStr]) -> Plugin {
        let log = node.dir().join("device-plugin.log");
        let child = Command::new(env!("CARGO_BIN_EXE_xpu"))
            .args(["k8s", "device-plugin", "--interval-ms", "200"])
            .args(args)
            .arg("--root")
            .arg(root)
            .arg("--plugin-dir")
            .arg(node.device_plugin_dir())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Plugin { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill(); // fails only when it already exited
        let _ = self.child.wait(); // reaps it; nothing to do about an error in a test's drop
    }
}

fn quantity(node: &NodeObject, field: &str, resource: &str) -> Option<String> {
    let status = node.status.as_ref()?;
    let map = if field == "capacity" { &status.capacity } else { &status.allocatable };
    Some(map.as_ref()?.get(resource)?.0.clone())
}

async fn wait_for_quantity(
    nodes: &Api<NodeObject>,
    field: &str,
    want: &str,
    limit: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let ok = wait_until(limit, || async {
        let n = nodes.get(NODE_NAME).await.unwrap();
        quantity(&n, field, GPU).as_deref() == Some(want)
    })
    .await;
    ok.then(|| start.elapsed())
}

/// Runs pod `name` of two busybox containers printing their `/dev`, environment and
/// `devices.list`: `gpu` with `resources` (and the pod spec merged with `spec`), `plain`
/// without. Waits until it succeeded, bound to the node by kube-scheduler; returns it and what
/// each container printed. `diag` adds the logs worth reading to a failure.
async fn run_probe_pod(
    pods: &Api<Pod>,
    name: &str,
    spec: Value,
    resources: Value,
    diag: impl Fn() -> String,
) -> (Pod, ContainerView, ContainerView) {
    let probe = probe_script("cat /sys/fs/cgroup/devices/devices.list");
    let container = |name: &str, resources: Value| {
        json!({
            "name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c", probe], "resources": resources,
        })
    };
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [container("gpu", resources), container("plain", json!({}))],
        },
    });
    for (k, v) in spec.as_object().unwrap() {
        pod["spec"][k] = v.clone();
    }
    let pod: Pod = serde_json::from_value(pod).unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let done = wait_until(Duration::from_secs(120), || async {
        let p = pods.get(name).await.unwrap();
        matches!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded" | "Failed"))
    })
    .await;
    let p = pods.get(name).await.unwrap();
    let status = serde_json::to_string_pretty(&p.status).unwrap();
    assert!(done, "pod {name} finished\n{status}\n{}", diag());
    assert_eq!(node_of(&p), Some(NODE_NAME), "bound by its scheduler: {status}");
    let conditions = p.status.as_ref().unwrap().conditions.as_ref().unwrap();
    assert!(conditions.iter().any(|c| c.type_ == "PodScheduled" && c.status == "True"), "{status}");
    let scheduler =
        spec.get("schedulerName").and_then(Value::as_str).unwrap_or("default-scheduler");
    assert_eq!(p.spec.as_ref().unwrap().scheduler_name.as_deref(), Some(scheduler));
    let phase = p.status.as_ref().unwrap().phase.as_deref();
    assert_eq!(phase, Some("Succeeded"), "{status}\n{}", diag());

    let mut views = Vec::new();
    for c in ["gpu", "plain"] {
        let lp = LogParams { container: Some(c.to_owned()), ..LogParams::default() };
        let out = pods.logs(name, &lp).await.unwrap();
        eprintln!("--- {name}: container {c}\n{out}");
        views.push(ContainerView::parse(&out));
    }
    let plain = views.pop().unwrap();
    let gpu = views.pop().unwrap();
    (p, gpu, plain)
}

/// A node of `kubelet` (the control plane's release, or [`OLD_KUBELET_VERSION`] with `old`)
/// with the device plugin serving the four-GPU fixture, after a 2-GPU pod bound by
/// kube-scheduler ran on it and saw exactly its GPUs.
struct PluginNode {
    spec: HostSpec,
    fx: xpu_testkit::Fixture,
    node: Node,
    plugin: Plugin,
    nodes: Api<NodeObject>,
    /// A node-status period and a little.
    limit: Duration,
    pod: Pod,
    gpu: ContainerView,
    /// The device ids `Allocate` gave the GPU container.
    ids: Vec<String>,
}

async fn plugin_node(cp: &ControlPlane, old: bool) -> PluginNode {
    let admin = cp.admin_client();
    let spec = four_gpu_host();
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let mut options = NodeOptions::default().devices_of(fx.root());
    if old {
        options = options.old_kubelet();
    }
    let status_period = options.node_status_update;
    let node = Node::start(cp, options).await.unwrap_or_else(|e| panic!("node: {e}"));
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    let before = nodes.get(NODE_NAME).await.unwrap();
    let info = before.status.as_ref().unwrap().node_info.as_ref().unwrap();
    eprintln!(
        "node {NODE_NAME}: kubelet {}, runtime {}, kernel {}",
        info.kubelet_version, info.container_runtime_version, info.kernel_version
    );
    let want = if old { OLD_KUBELET_VERSION } else { K8S_VERSION };
    assert_eq!(info.kubelet_version, want);
    assert_eq!(
        info.container_runtime_version,
        format!("containerd://{}", CONTAINERD_VERSION.trim_start_matches('v'))
    );
    assert_eq!(quantity(&before, "allocatable", GPU), None, "no GPUs before the plugin");

    // The CDI spec the device plugin's Allocate names, where containerd reads specs.
    cdi_generate(fx.root(), "nvidia", &node.cdi_dir());

    // The plugin runs outside the node's namespace, in the directory the kubelet sees as
    // /var/lib/kubelet/device-plugins.
    let plugin = Plugin::spawn(&node, fx.root(), &[]);
    let registered = wait_until(Duration::from_secs(30), || async {
        plugin.log().contains("nvidia.com/gpu: registered with the kubelet")
    })
    .await;
    assert!(registered, "plugin registered\n{}\n{}", plugin.log(), node.log_tails());

    // Within one node-status period (and a little for the kubelet's ListAndWatch and the
    // status PATCH on a loaded machine).
    let limit = status_period + Duration::from_secs(5);
    let took = wait_for_quantity(&nodes, "allocatable", "4", limit).await;
    let took = took.unwrap_or_else(|| {
        panic!("allocatable {GPU}=4 within {limit:?}\n{}\n{}", plugin.log(), node.log_tails())
    });
    eprintln!(
        "allocatable {GPU}=4 {took:.2?} after registration (node status every {status_period:?})"
    );

    // A pod of two containers, one with 2 GPUs, one without, for kube-scheduler.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let diag = || format!("{}\n{}", plugin.log(), node.log_tails());
    let (pod, gpu, plain) =
        run_probe_pod(&pods, "two-gpus", json!({}), json!({ "limits": { GPU: "2" } }), diag).await;

    // Allocate's answer reached the container: the two devices the kubelet chose.
    let ids: Vec<String> = gpu.env["XPU_VISIBLE_DEVICES"].split(',').map(str::to_owned).collect();
    assert_eq!(ids.len(), 2, "{:?}", gpu.env);
    let minors: Vec<u32> = ids
        .iter()
        .map(|id| {
            let d = spec.devices.iter().find(|d| d.address.to_string() == *id).unwrap();
            d.nvidia_minor.unwrap()
        })
        .collect();
    assert!(!plain.env.contains_key("XPU_VISIBLE_DEVICES"), "{:?}", plain.env);
    assert_only_these_gpus(&gpu, &plain, &minors);
    PluginNode { spec, fx, node, plugin, nodes, limit, pod, gpu, ids }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_on_a_real_kubelet_gives_a_scheduled_pod_exactly_its_two_gpus_needs_root_and_runc()
 {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let PluginNode { spec, fx, node, plugin, nodes, limit, pod: p, gpu, ids } =
        plugin_node(&cp, false).await;
    // Allocate also named the CDI devices, and containerd applied `xpu cdi generate`'s spec
    // after the plugin's environment: the spec's `void` (the devices are in already, an NVIDIA
    // hook must add none) replaced the UUIDs the plugin put there for runtimes without CDI.
    assert_eq!(gpu.env["NVIDIA_VISIBLE_DEVICES"], "void", "{:?}", gpu.env);

    // The kubelet's checkpoint holds the allocation and the plugin's answer.
    let checkpoint = node.device_plugin_dir().join("kubelet_internal_checkpoint");
    let checkpoint: Value =
        serde_json::from_str(&std::fs::read_to_string(&checkpoint).unwrap()).unwrap();
    let entries = checkpoint["Data"]["PodDeviceEntries"].as_array().unwrap();
    let uid = p.metadata.uid.as_deref().unwrap();
    let entry = entries
        .iter()
        .find(|e| e["PodUID"] == uid && e["ContainerName"] == "gpu")
        .unwrap_or_else(|| panic!("{checkpoint}"));
    assert_eq!(entry["ResourceName"], GPU);
    let mut checkpointed: Vec<&str> = entry["DeviceIDs"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|v| v.as_array().unwrap().iter().map(|s| s.as_str().unwrap()))
        .collect();
    checkpointed.sort_unstable();
    let mut sorted: Vec<&str> = ids.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    assert_eq!(checkpointed, sorted);
    assert!(!entry["AllocResp"].as_str().unwrap_or("").is_empty(), "{entry}");

    // A GPU unplugged from the fixture: unhealthy, so allocatable drops to 3 (capacity stays 4).
    let gone = spec.devices.iter().find(|d| d.nvidia_minor == Some(3)).unwrap().address;
    std::fs::remove_file(fx.device_dir(&gone.to_string())).unwrap();
    let took = wait_for_quantity(&nodes, "allocatable", "3", limit).await;
    let took = took.unwrap_or_else(|| {
        panic!("allocatable {GPU}=3 after unplug\n{}\n{}", plugin.log(), node.log_tails())
    });
    let after = nodes.get(NODE_NAME).await.unwrap();
    assert_eq!(quantity(&after, "capacity", GPU).as_deref(), Some("4"));
    eprintln!("allocatable {GPU}=3 {took:.2?} after unplugging {gone}");
    assert!(
        plugin.log().contains(&format!("{GPU}: device {gone} is Unhealthy")),
        "{}",
        plugin.log()
    );
    drop(plugin);
    drop(node);
}

/// Issue 22: a kubelet built with an older grpc-go ([`OLD_KUBELET_VERSION`], the last minor
/// release before 1.26) sends the plugin socket's path as the HTTP/2 `:authority` of its calls,
/// which tonic alone answers with `RST_STREAM(PROTOCOL_ERROR)`. The plugin serves it: it
/// registers, allocatable shows the GPUs within a node-status period, and a 2-GPU pod bound by
/// kube-scheduler gets exactly its two GPUs. The plugin's log says the path was sent, so this
/// kubelet is one that sends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_serves_a_kubelet_that_sends_the_socket_path_as_authority_needs_root_and_runc()
 {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let PluginNode { node, plugin, .. } = plugin_node(&cp, true).await;
    let log = plugin.log();
    let sent = log.lines().find(|l| l.contains("sent a socket path as :authority"));
    let sent = sent.unwrap_or_else(|| panic!("the old kubelet sent a socket path\n{log}"));
    assert!(sent.contains(".sock"), "{sent}");
    eprintln!("{sent}");
    drop(plugin);
    drop(node);
}

/// The DRA driver on the same kind of node: its ResourceSlices name the node, kube-scheduler
/// allocates a 2-GPU claim from them, the kubelet calls `NodePrepareResources` and hands the
/// claim's CDI device to containerd, which finds the driver's per-claim spec: the container
/// sees exactly the claim's GPUs; deleting the pod makes the kubelet unprepare the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_driver_on_a_real_kubelet_gives_a_claim_its_devices_through_cdi_needs_root_and_runc() {
    dra_claim_on_a_real_kubelet(false).await;
}

/// The same with `xpu k8s scheduler` (no kube-scheduler running) allocating the claim: the
/// kubelet prepares what xpu wrote, and the container sees exactly those GPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_xpu_allocated_runs_on_a_real_kubelet_with_exactly_its_devices_needs_root_and_runc()
{
    dra_claim_on_a_real_kubelet(true).await;
}

async fn dra_claim_on_a_real_kubelet(by_xpu: bool) {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let opts = ControlPlaneOptions::default();
    let cp = plane(if by_xpu { opts } else { opts.with_scheduler() }).await;
    let admin = cp.admin_client();
    // Every manifest for xpu's scheduler (the DRA ones among them), only the DRA ones for
    // kube-scheduler.
    let xpu = if by_xpu {
        let kubeconfig = install_scheduler_rbac(&cp).await;
        Some(XpuScheduler::start(&cp, &kubeconfig, "dra", &[]))
    } else {
        install_dra(&admin).await;
        None
    };
    let spec = four_gpu_host();
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let node = Node::start(&cp, NodeOptions::default().devices_of(fx.root()))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));

    let args = dra_driver_args(&cp, &node, NODE_NAME, fx.root());
    let driver = XpuProcess::spawn(&cp, "xpu-dra-driver", &args);
    let diag = || {
        let sched = xpu.as_ref().map(|x| x.log_text()).unwrap_or_default();
        format!("{}\n{}\n{sched}", driver.log_text(), node.log_tails())
    };
    let registered = wait_until(Duration::from_secs(30), || async {
        driver.log_text().contains("registered with the kubelet")
    })
    .await;
    assert!(registered, "the kubelet took the driver's registration\n{}", diag());
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={NODE_NAME},spec.driver=xpu.dev"));
    let published = wait_until(Duration::from_secs(30), || async {
        let s = slices.list(&lp).await.unwrap().items;
        s.iter().flat_map(|s| s.spec.devices.iter().flatten()).count() == 4
    })
    .await;
    assert!(published, "4 GPUs in the node's slices\n{}", diag());
    let published = slices.list(&lp).await.unwrap().items;

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": "pair" },
        "spec": { "devices": { "requests": [
            { "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 2 } },
        ] } },
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut pod_spec =
        json!({ "resourceClaims": [{ "name": "gpus", "resourceClaimName": "pair" }] });
    if by_xpu {
        pod_spec["schedulerName"] = json!("xpu");
    }
    let (_, gpu, plain) =
        run_probe_pod(&pods, "claimed", pod_spec, json!({ "claims": [{ "name": "gpus" }] }), diag)
            .await;

    // The claim's devices, by the UUIDs the slices give them.
    let claim = claims.get("pair").await.unwrap();
    let results = claim.status.unwrap().allocation.unwrap().devices.unwrap().results.unwrap();
    assert_eq!(results.len(), 2);
    let minors: Vec<u32> = results
        .iter()
        .map(|r| {
            assert_eq!((r.driver.as_str(), r.pool.as_str()), ("xpu.dev", NODE_NAME));
            let d = published
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .find(|d| d.name == r.device)
                .unwrap();
            let uuid = d.attributes.as_ref().unwrap()["uuid"].string.clone().unwrap();
            (0..8u32).find(|&i| hosts::gpu_uuid(i as usize) == uuid).unwrap()
        })
        .collect();
    assert!(driver.log_text().contains("claim prepared"), "{}", diag());
    assert_only_these_gpus(&gpu, &plain, &minors);

    // The pod gone, the kubelet unprepares the claim and the driver removes its CDI spec.
    pods.delete("claimed", &DeleteParams::default()).await.unwrap();
    let unprepared = wait_until(Duration::from_secs(60), || async {
        driver.log_text().contains("claim unprepared")
    })
    .await;
    assert!(unprepared, "NodeUnprepareResources after the pod's deletion\n{}", diag());
    let left: Vec<_> = std::fs::read_dir(node.cdi_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.contains(claim.metadata.uid.as_deref().unwrap()))
        .collect();
    assert_eq!(left, Vec::<String>::new(), "the claim's CDI spec removed");
    drop(driver);
    drop(node);
}

/// A node of `spec` (character device nodes) on the control plane with `xpu k8s dra-driver`
/// (and `extra` arguments) serving it, once the kubelet took the driver's registration.
async fn dra_node(
    cp: &ControlPlane,
    spec: &HostSpec,
    extra: &[std::ffi::OsString],
) -> (xpu_testkit::Fixture, Node, XpuProcess) {
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let node = Node::start(cp, NodeOptions::default().devices_of(fx.root()))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));
    let mut args = dra_driver_args(cp, &node, NODE_NAME, fx.root());
    args.extend(extra.iter().cloned());
    let driver = XpuProcess::spawn(cp, "xpu-dra-driver", &args);
    let registered = wait_until(Duration::from_secs(30), || async {
        driver.log_text().contains("registered with the kubelet")
    })
    .await;
    assert!(
        registered,
        "the kubelet took the driver's registration\n{}\n{}",
        driver.log_text(),
        node.log_tails()
    );
    (fx, node, driver)
}

/// `key=value` (or `key="value"`) of a log line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line.find(&format!(" {key}=")).unwrap_or_else(|| panic!("{key} in {line}"));
    let v = &line[at + key.len() + 2..];
    v.split(' ').next().unwrap_or("").trim_matches('"')
}

/// MIG on demand through DRA with real runc: the driver (with the fake NVML, `--fake-mig`) on a
/// real kubelet publishes GPU 0 of an H200 host, in MIG mode, as partitions; kube-scheduler
/// allocates a `1g.18gb` claim and a `3g.71gb` claim there; `NodePrepareResources` makes each
/// instance at the allocated placement and each container sees its GPU and exactly its
/// instance's two `/dev/nvidia-caps` nodes; a `7g.141gb` claim, which no longer fits, is not
/// allocated; deleting the pods destroys exactly the two instances, and an instance made
/// outside xpu stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_claims_get_instances_made_on_prepare_and_only_their_capabilities_needs_root_and_runc()
{
    use xpu_host::mig_caps::MigCaps;
    use xpu_telemetry::mig::{FakeMig, MigControl};
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    install_dra(&admin).await;
    let fx =
        hosts::h200_4x().build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let node = Node::start(&cp, NodeOptions::default().devices_of(fx.root()))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));
    // GPU 0 in MIG mode with one instance someone else made (1g.18gb at slice 0), the others
    // whole: 3g.71gb fits only at slice 4, and 1g.18gb then at 1, 2 or 3.
    let state = cp.dir().join("mig.json");
    write_fake_mig(&state, json!([{ "gi": 9, "profile": "1g.18gb", "start": 0, "byXpu": false }]));
    let mut args = dra_driver_args(&cp, &node, NODE_NAME, fx.root());
    args.extend(["--fake-mig".into(), state.clone().into()]);
    let driver = XpuProcess::spawn(&cp, "xpu-dra-driver", &args);
    let diag = || format!("{}\n{}", driver.log_text(), node.log_tails());
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={NODE_NAME},spec.driver=xpu.dev"));
    let published = wait_until(Duration::from_secs(30), || async {
        let s = slices.list(&lp).await.unwrap().items;
        s.iter().flat_map(|s| s.spec.devices.iter().flatten()).any(|d| d.name.contains("-mig-"))
    })
    .await;
    assert!(published, "GPU 0's partitions published\n{}", diag());
    let registered = wait_until(Duration::from_secs(30), || async {
        driver.log_text().contains("registered with the kubelet")
    })
    .await;
    assert!(registered, "the kubelet took the driver's registration\n{}", diag());

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let make_claim = |name: &str, profile: &str| -> ResourceClaim {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name },
            "spec": { "devices": { "requests": [{ "name": "mig", "exactly": {
                "deviceClassName": "mig.xpu.dev",
                "selectors": [{ "cel": { "expression":
                    format!("device.attributes[\"xpu.dev\"].profile == \"{profile}\"") } }] } }] } },
        }))
        .unwrap()
    };
    let caps = MigCaps::read(&xpu_host::Root::new(fx.root()).unwrap()).unwrap();
    let fake = || FakeMig::open(&state).unwrap().gpus().unwrap().remove(0).instances;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let pod_spec =
        |claim: &str| json!({ "resourceClaims": [{ "name": "mig", "resourceClaimName": claim }] });
    let mut made = Vec::new();
    for (name, profile) in [("big", "3g.71gb"), ("small", "1g.18gb")] {
        claims.create(&PostParams::default(), &make_claim(name, profile)).await.unwrap();
        let (_, view, plain) = run_probe_pod(
            &pods,
            &format!("{name}-pod"),
            pod_spec(name),
            json!({ "claims": [{ "name": "mig" }] }),
            diag,
        )
        .await;
        let claim = claims.get(name).await.unwrap();
        let device = claim
            .status
            .unwrap()
            .allocation
            .unwrap()
            .devices
            .unwrap()
            .results
            .unwrap()
            .remove(0)
            .device;
        let start: u8 = device.rsplit('-').next().unwrap().parse().unwrap();
        // The kubelet unprepares a pod's claims once it has finished: the instance was made
        // (the driver's log says where) and is gone again.
        let log = driver.log_text();
        let line = log
            .lines()
            .find(|l| l.contains("MIG instance made") && l.contains(&format!("device={device} ")))
            .unwrap_or_else(|| panic!("an instance made for {device}\n{}", diag()));
        assert!(line.contains(&format!("profile=\"{profile}\" start={start} ")), "{line}");
        let gi: u32 = field(line, "gi").parse().unwrap();
        let instance = xpu_telemetry::mig::Instance {
            gi,
            ci: 0,
            profile: "",
            start,
            uuid: Some(field(line, "uuid").to_owned()),
            by_xpu: true,
        };
        let mut want = gpu_nodes(&[0]);
        for n in caps.instance(0, instance.gi, instance.ci).unwrap() {
            want.insert(n.path, ('c', n.major, n.minor));
        }
        assert_only_these_nodes(&view, &plain, &want);
        eprintln!(
            "{name}: {device} is GPU instance {} ({})",
            instance.gi,
            instance.uuid.as_deref().unwrap_or("-")
        );
        made.push(instance);
    }

    // Every slice is held: 7g.141gb fits nowhere, and its pod waits unallocated.
    claims.create(&PostParams::default(), &make_claim("whole", "7g.141gb")).await.unwrap();
    let mut p = json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "whole-pod" },
        "spec": { "containers": [{ "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["true"], "resources": { "claims": [{ "name": "mig" }] } }] } });
    p["spec"]["resourceClaims"] = pod_spec("whole")["resourceClaims"].clone();
    pods.create(&PostParams::default(), &serde_json::from_value(p).unwrap()).await.unwrap();
    let waits = wait_until(Duration::from_secs(30), || async {
        let p = pods.get("whole-pod").await.unwrap();
        p.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.status == "False")
    })
    .await;
    assert!(waits, "the 7g.141gb pod waits\n{}", diag());
    let whole = claims.get("whole").await.unwrap();
    assert!(whole.status.and_then(|s| s.allocation).is_none(), "7g.141gb not allocated");

    // The pods gone, exactly their instances are destroyed.
    for name in ["small-pod", "big-pod", "whole-pod"] {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let destroyed =
        wait_until(Duration::from_secs(60), || async { fake().iter().all(|i| !i.by_xpu) }).await;
    assert!(destroyed, "both instances destroyed: {:?}\n{}", fake(), diag());
    assert_eq!(fake().len(), 1, "the outside instance stays");
    drop(driver);
    drop(node);
}

/// A node whose containerd runs `xpu-container-runtime` in place of runc (its `BinaryName`, as
/// docs/kubernetes-node.md tells an admin), with the device plugin's `--device-list-strategy
/// envvar`: `Allocate` answers only `NVIDIA_VISIBLE_DEVICES`, and the shim, reading it from the
/// container's spec, gives the container exactly its two GPUs and the control nodes (its other
/// container and the pod's sandbox pass through untouched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_get_their_gpus_through_the_runtime_shim_needs_root_and_runc() {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    let spec = four_gpu_host();
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let (wrapper, shim_log) = shim_runtime(&cp.dir().join("shim-bin"), fx.root());
    let node = Node::start(&cp, NodeOptions::default().devices_of(fx.root()).oci_runtime(&wrapper))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));
    let plugin =
        Plugin::spawn(&node, fx.root(), &["--device-list-strategy".as_ref(), "envvar".as_ref()]);
    let diag = || {
        let shim = std::fs::read_to_string(&shim_log).unwrap_or_default();
        format!("{}\nshim log:\n{shim}\n{}", plugin.log(), node.log_tails())
    };
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    let took = wait_for_quantity(&nodes, "allocatable", "4", Duration::from_secs(60)).await;
    assert!(took.is_some(), "allocatable {GPU}=4\n{}", diag());
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let (_, gpu, plain) =
        run_probe_pod(&pods, "shim-gpus", json!({}), json!({ "limits": { GPU: "2" } }), diag).await;
    let ids: Vec<String> = gpu.env["XPU_VISIBLE_DEVICES"].split(',').map(str::to_owned).collect();
    assert_eq!(ids.len(), 2, "{:?}", gpu.env);
    let minors: Vec<u32> = ids
        .iter()
        .map(|id| {
            spec.devices
                .iter()
                .find(|d| d.address.to_string() == *id)
                .unwrap()
                .nvidia_minor
                .unwrap()
        })
        .collect();
    assert!(gpu.env.contains_key("XPU_DEVICES"), "the shim edited the spec: {:?}", gpu.env);
    // The shim gives `/dev/nvidia-modeset` only for the `display` capability, as NVIDIA's
    // runtime does; the default capabilities are `utility,compute`.
    let mut want = gpu_nodes(&minors);
    want.remove("/dev/nvidia-modeset");
    assert_only_these_nodes(&gpu, &plain, &want);
    let shim = std::fs::read_to_string(&shim_log).unwrap_or_default();
    eprintln!("shim log:\n{shim}");
    drop(plugin);
    drop(node);
}

/// A fake NVML's MIG state at `path` for the H200 fixture's four GPUs: GPU 0 in MIG mode with
/// `instances`, the others whole. Returns the GPUs' addresses.
fn write_fake_mig(path: &std::path::Path, instances: Value) -> Vec<String> {
    let gpus: Vec<String> =
        hosts::A100_GPU_BUSES[..4].iter().map(|b| format!("0000:{b:02x}:00.0")).collect();
    let state = json!({ "gpus": gpus.iter().enumerate().map(|(i, a)| json!({
        "address": a, "product": "NVIDIA H200", "enabled": i == 0,
        "instances": if i == 0 { instances.clone() } else { json!([]) },
    })).collect::<Vec<_>>() });
    std::fs::write(path, serde_json::to_vec(&state).unwrap()).unwrap();
    gpus
}

/// MIG's `mixed` strategy through the device plugin on a real kubelet: the instances an admin
/// made on GPU 0 of an H200 node (a fake NVML's) are offered as `nvidia.com/mig-<profile>`,
/// GPU 0 is no longer an `nvidia.com/gpu`, a pod asking `nvidia.com/mig-3g.71gb` (placed by
/// kube-scheduler) sees its GPU's node and exactly that instance's capability nodes; an
/// instance made later is added and one destroyed is taken out of allocatable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_instances_are_device_plugin_resources_with_the_mixed_strategy_needs_root_and_runc() {
    use xpu_host::mig_caps::MigCaps;
    use xpu_telemetry::mig::FakeMig;
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    let fx =
        hosts::h200_4x().build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let node = Node::start(&cp, NodeOptions::default().devices_of(fx.root()))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));
    cdi_generate(fx.root(), "nvidia", &node.cdi_dir());
    let state = cp.dir().join("mig.json");
    let gpus = write_fake_mig(
        &state,
        json!([
            { "gi": 7, "profile": "1g.18gb", "start": 0, "byXpu": false },
            { "gi": 8, "profile": "1g.18gb", "start": 1, "byXpu": false },
            { "gi": 2, "profile": "3g.71gb", "start": 4, "byXpu": false },
        ]),
    );
    let cdi_dir = node.cdi_dir();
    let args: [&std::ffi::OsStr; 6] = [
        "--mig-strategy".as_ref(),
        "mixed".as_ref(),
        "--fake-mig".as_ref(),
        state.as_ref(),
        "--cdi-dir".as_ref(),
        cdi_dir.as_ref(),
    ];
    let plugin = Plugin::spawn(&node, fx.root(), &args);
    let diag = || format!("{}\n{}", plugin.log(), node.log_tails());
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    let allocatable = |want: &'static [(&'static str, &'static str)]| {
        let nodes = nodes.clone();
        async move {
            wait_until(Duration::from_secs(60), || async {
                let n = nodes.get(NODE_NAME).await.unwrap();
                want.iter().all(|(r, v)| quantity(&n, "allocatable", r).as_deref() == Some(*v))
            })
            .await
        }
    };
    let ok = allocatable(&[
        ("nvidia.com/gpu", "3"),
        ("nvidia.com/mig-1g.18gb", "2"),
        ("nvidia.com/mig-3g.71gb", "1"),
    ])
    .await;
    assert!(ok, "GPU 0's instances offered, the other three GPUs whole\n{}", diag());

    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let (_, view, plain) = run_probe_pod(
        &pods,
        "mig-pod",
        json!({}),
        json!({ "limits": { "nvidia.com/mig-3g.71gb": "1" } }),
        diag,
    )
    .await;
    assert_eq!(view.env["XPU_MIG_DEVICES"], format!("{}-mig-gi2", gpus[0]), "{:?}", view.env);
    let caps = MigCaps::read(&xpu_host::Root::new(fx.root()).unwrap()).unwrap();
    let mut want = gpu_nodes(&[0]);
    for n in caps.instance(0, 2, 0).unwrap() {
        want.insert(n.path, ('c', n.major, n.minor));
    }
    assert_only_these_nodes(&view, &plain, &want);

    // xpu's scheduler counts these resources as kube-scheduler does: a pod asking one
    // `1g.18gb` is placed and sees exactly one instance's capabilities; one asking three (two
    // exist) waits, saying so, instead of being bound for the kubelet to refuse.
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let xpu = XpuScheduler::start(&cp, &kubeconfig, "mig-mixed", &[]);
    let (_, view, plain) = run_probe_pod(
        &pods,
        "mig-by-xpu",
        json!({ "schedulerName": "xpu" }),
        json!({ "limits": { "nvidia.com/mig-1g.18gb": "1" } }),
        || format!("{}\n{}", xpu.log_text(), diag()),
    )
    .await;
    let gi: u32 = view.env["XPU_MIG_DEVICES"].rsplit("-gi").next().unwrap().parse().unwrap();
    assert!([7, 8].contains(&gi), "{:?}", view.env);
    let mut want = gpu_nodes(&[0]);
    for n in caps.instance(0, gi, 0).unwrap() {
        want.insert(n.path, ('c', n.major, n.minor));
    }
    assert_only_these_nodes(&view, &plain, &want);
    let mut three = json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "three" },
        "spec": { "schedulerName": "xpu", "containers": [{ "name": "c", "image": BUSYBOX_IMAGE,
            "imagePullPolicy": "Never", "command": ["true"],
            "resources": { "limits": { "nvidia.com/mig-1g.18gb": "3" } } }] } });
    three["spec"]["restartPolicy"] = json!("Never");
    pods.create(&PostParams::default(), &serde_json::from_value(three).unwrap()).await.unwrap();
    let waits = wait_until(Duration::from_secs(30), || async {
        let p = pods.get("three").await.unwrap();
        p.status.and_then(|s| s.conditions).unwrap_or_default().iter().any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.message.as_deref().is_some_and(|m| m.contains("nvidia.com/mig-1g.18gb free"))
        })
    })
    .await;
    assert!(waits, "three 1g.18gb wait\n{}", xpu.log_text());
    assert_eq!(node_of(&pods.get("three").await.unwrap()), None);
    pods.delete("three", &DeleteParams::default()).await.unwrap();

    // The admin makes a third 1g.18gb and destroys the 3g.71gb: offered and withdrawn.
    let fake = FakeMig::open(&state).unwrap();
    let gpu0 = gpus[0].parse().unwrap();
    fake.create_outside(gpu0, "1g.18gb", 2).unwrap();
    fake.destroy_outside(gpu0, 2).unwrap();
    let ok = allocatable(&[("nvidia.com/mig-1g.18gb", "3"), ("nvidia.com/mig-3g.71gb", "0")]).await;
    assert!(ok, "the new instance offered, the destroyed one withdrawn\n{}", diag());
    drop(plugin);
    drop(node);
}

/// GPU shares through MPS on a real kubelet with real runc: `xpu k8s scheduler` places a
/// 250- and a 500-milli `xpu.dev/gpu-milli` pod on a one-GPU node, and `xpu k8s device-plugin --share --mps-dir`
/// starts that GPU's MPS control daemon once (a fake `nvidia-cuda-mps-control`), and gives
/// each container the pipe directory and its share's limits through CDI, even the container
/// that sets its own `CUDA_MPS_*`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_shares_get_the_daemons_pipe_and_their_own_limits_needs_root_and_runc() {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let key = cp.dir().join("share.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    let sched =
        XpuScheduler::start(&cp, &kubeconfig, "mps", &["--share-key", key.to_str().unwrap()]);
    // One GPU, which both shares must use.
    let mut spec = four_gpu_host();
    spec.devices.retain(|d| d.nvidia_minor.is_none_or(|m| m == 0));
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let node = Node::start(&cp, NodeOptions::default().devices_of(fx.root()))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));
    cdi_generate(fx.root(), "nvidia", &node.cdi_dir());

    // The fake control: `-d` leaves a file naming its GPU in the pipe directory, as the real
    // daemon leaves its control socket there; `get_server_list` succeeds while it is there;
    // `quit` removes it. Starts and quits are logged.
    let calls = cp.dir().join("mps-calls");
    let control = cp.dir().join("nvidia-cuda-mps-control");
    std::fs::write(
        &control,
        format!(
            "#!/bin/sh\ncase \"$1\" in\n-d) echo \"$CUDA_VISIBLE_DEVICES\" > \"$CUDA_MPS_PIPE_DIRECTORY/control\"; echo \"start $CUDA_VISIBLE_DEVICES $CUDA_MPS_LOG_DIRECTORY\" >> {calls} ;;\n*) read cmd; [ \"$cmd\" = get_server_list ] && exec test -e \"$CUDA_MPS_PIPE_DIRECTORY/control\"; echo \"$cmd $CUDA_VISIBLE_DEVICES\" >> {calls}; rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\" ;;\nesac\n",
            calls = calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&control, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .unwrap();
    let mps_dir = cp.dir().join("mps");
    let mut args: Vec<std::ffi::OsString> =
        vec!["k8s".into(), "device-plugin".into(), "--interval-ms".into(), "200".into()];
    args.extend(["--root".into(), fx.root().into()]);
    args.extend(["--plugin-dir".into(), node.device_plugin_dir().into()]);
    args.extend(["--share".into(), "--node-name".into(), NODE_NAME.into()]);
    args.extend(["--share-key".into(), key.clone().into()]);
    args.extend(["--kubeconfig".into(), cp.admin_kubeconfig().into()]);
    args.extend(["--mps-dir".into(), mps_dir.clone().into()]);
    args.extend(["--mps-control".into(), control.into()]);
    args.extend(["--cdi-dir".into(), node.cdi_dir().into()]);
    let plugin = XpuProcess::spawn(&cp, "xpu-device-plugin", &args);
    let diag = || format!("{}\n{}\n{}", plugin.log_text(), sched.log_text(), node.log_tails());
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    let offered = wait_until(Duration::from_secs(60), || async {
        let n = nodes.get(NODE_NAME).await.unwrap();
        quantity(&n, "allocatable", "xpu.dev/gpu-milli").as_deref() == Some("1k")
    })
    .await;
    assert!(offered, "1000 GPU units offered\n{}", diag());

    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let probe = probe_script(&format!("cat {}/control", xpu_integrations::mps::CONTAINER_PIPE_DIR));
    // A quarter and a half of one GPU, each limited to its own share.
    let shares = [("honest", "250", "25", "0=10240M"), ("greedy", "500", "50", "0=20480M")];
    for (name, own_env) in [
        ("honest", json!([])),
        (
            "greedy",
            json!([
                { "name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100" },
                { "name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=40960M" },
                { "name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/mine" },
            ]),
        ),
    ] {
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": { "name": name },
            "spec": { "schedulerName": "xpu", "restartPolicy": "Never",
                "automountServiceAccountToken": false, "enableServiceLinks": false,
                "containers": [{ "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                    "command": ["sh", "-c", probe], "env": own_env,
                    "resources": { "limits": { "xpu.dev/gpu-milli": shares.iter().find(|s| s.0 == name).unwrap().1 } } }] },
        });
        pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    }
    let mut seen = Vec::new();
    for (name, milli, percent, memory) in shares {
        let done = wait_until(Duration::from_secs(90), || async {
            let p = pods.get(name).await.unwrap();
            matches!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded" | "Failed"))
        })
        .await;
        let p = pods.get(name).await.unwrap();
        let phase = p.status.as_ref().and_then(|s| s.phase.clone());
        assert!(done && phase.as_deref() == Some("Succeeded"), "{name}: {phase:?}\n{}", diag());
        let out = pods.logs(name, &LogParams::default()).await.unwrap();
        eprintln!("--- {name}\n{out}");
        let view = ContainerView::parse(&out);
        for (k, v) in [
            ("CUDA_MPS_PIPE_DIRECTORY", xpu_integrations::mps::CONTAINER_PIPE_DIR),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percent),
            // That part of an A100 40GB.
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", memory),
            ("XPU_GPU_MILLI", milli),
        ] {
            assert_eq!(view.env.get(k).map(String::as_str), Some(v), "{name}: {k}\n{out}");
        }
        // The daemon's pipe directory, as its file there shows: the pod's own GPU.
        let minors: Vec<u32> =
            view.nodes.keys().filter_map(|p| p.strip_prefix("/dev/nvidia")?.parse().ok()).collect();
        assert_eq!(minors.len(), 1, "{name}: one GPU\n{out}");
        let gpu = hosts::gpu_uuid(minors[0] as usize);
        assert_eq!(view.extra.trim(), gpu, "{name}: the pipe directory of its GPU's daemon\n{out}");
        seen.push(gpu);
    }
    assert_eq!(seen[0], seen[1], "both shares on one GPU");
    let started = std::fs::read_to_string(&calls).unwrap();
    assert_eq!(started.lines().filter(|l| l.starts_with("start ")).count(), 1, "{started}");
    assert!(
        started.contains(&format!(
            "start {} {}",
            seen[0],
            mps_dir.join(&seen[0]).join("log").display()
        )),
        "{started}"
    );
    drop(plugin);
    drop(node);
}

/// GPU shares through DRA and MPS with real runc: the driver with `--mps-dir` (a fake
/// `nvidia-cuda-mps-control`) publishes the GPUs shareable (`allowMultipleAllocations`, a
/// `compute` capacity beside `memory`); kube-scheduler allocates a claim for 25 % and 10 GiB
/// and one for 75 % and 30 GiB; each container gets its GPU's MPS pipe directory and exactly
/// its allocated capacity as limits, the second although its manifest sets its own
/// `CUDA_MPS_*`; a daemon is started for the GPUs they share and stopped after the last claim
/// is unprepared. The same with xpu's scheduler allocating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_shares_are_mps_clients_limited_to_their_allocated_capacity_needs_root_and_runc() {
    dra_shares_through_mps(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_shares_xpu_allocated_are_mps_clients_limited_to_their_capacity_needs_root_and_runc() {
    dra_shares_through_mps(true).await;
}

async fn dra_shares_through_mps(by_xpu: bool) {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let opts = ControlPlaneOptions::default();
    let cp = plane(if by_xpu { opts } else { opts.with_scheduler() }).await;
    let admin = cp.admin_client();
    let sched = if by_xpu {
        let kubeconfig = install_scheduler_rbac(&cp).await;
        Some(XpuScheduler::start(&cp, &kubeconfig, "mps-dra", &[]))
    } else {
        install_dra(&admin).await;
        None
    };
    let control = xpu_testkit::mps::fake_control(cp.dir());
    let mps_dir = cp.dir().join("mps");
    let extra =
        ["--mps-dir".into(), mps_dir.clone().into(), "--mps-control".into(), control.into()];
    let (_fx, node, driver) = dra_node(&cp, &four_gpu_host(), &extra).await;
    let diag = || {
        let s = sched.as_ref().map(|x| x.log_text()).unwrap_or_default();
        format!("{}\n{}\n{s}", driver.log_text(), node.log_tails())
    };
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={NODE_NAME},spec.driver=xpu.dev"));
    let shareable = wait_until(Duration::from_secs(30), || async {
        let s = slices.list(&lp).await.unwrap().items;
        let devs: Vec<_> = s.iter().flat_map(|s| s.spec.devices.iter().flatten()).collect();
        devs.len() == 4
            && devs.iter().all(|d| {
                d.allow_multiple_allocations == Some(true)
                    && d.capacity.as_ref().is_some_and(|c| c["compute"].value.0 == "100")
                    && d.attributes.as_ref().is_some_and(|a| {
                        a.get("sharing").and_then(|s| s.string.as_deref()) == Some("mps")
                    })
            })
    })
    .await;
    assert!(shareable, "4 shareable GPUs published\n{}", diag());

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let probe = probe_script(&format!("cat {}/control", xpu_integrations::mps::CONTAINER_PIPE_DIR));
    // (name, compute, memory, limits the container must see, its own env)
    let shares = [
        ("quarter", "25", "10Gi", ("25", "0=10240M"), json!([])),
        (
            "greedy",
            "75",
            "30Gi",
            ("75", "0=30720M"),
            json!([
                { "name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100" },
                { "name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=40960M" },
                { "name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/mine" },
            ]),
        ),
    ];
    for (name, compute, memory, _, own_env) in &shares {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name },
            "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": {
                "deviceClassName": "gpu.xpu.dev",
                "capacity": { "requests": { "compute": compute, "memory": memory } } } }] } },
        }))
        .unwrap();
        claims.create(&PostParams::default(), &claim).await.unwrap();
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": { "name": name },
            "spec": { "restartPolicy": "Never",
                "automountServiceAccountToken": false, "enableServiceLinks": false,
                "resourceClaims": [{ "name": "gpu", "resourceClaimName": name }],
                "containers": [{ "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                    "command": ["sh", "-c", probe], "env": own_env,
                    "resources": { "claims": [{ "name": "gpu" }] } }] },
        });
        if by_xpu {
            pod["spec"]["schedulerName"] = json!("xpu");
        }
        pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    }
    let mut gpus = Vec::new();
    for (name, compute, memory, (percent, limit), _) in &shares {
        let done = wait_until(Duration::from_secs(90), || async {
            let p = pods.get(name).await.unwrap();
            matches!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded" | "Failed"))
        })
        .await;
        let p = pods.get(name).await.unwrap();
        let phase = p.status.as_ref().and_then(|s| s.phase.clone());
        let conditions = p.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        assert!(
            done && phase.as_deref() == Some("Succeeded"),
            "{name}: {phase:?} {conditions:?}\n{}",
            diag()
        );
        // What the scheduler allocated is what the container is limited to.
        let c = claims.get(name).await.unwrap();
        let r = c.status.unwrap().allocation.unwrap().devices.unwrap().results.unwrap().remove(0);
        let consumed = r.consumed_capacity.clone().unwrap_or_default();
        let amount = |q: &str| xpu_kube::convert::quantity(q, 1.0);
        for (k, want) in [("compute", compute), ("memory", memory)] {
            let got = consumed.get(k).and_then(|q| amount(&q.0));
            assert_eq!(got, amount(want), "{name}: {k} consumed: {r:?}");
        }
        let out = pods.logs(name, &LogParams::default()).await.unwrap();
        eprintln!("--- {name} on {}\n{out}", r.device);
        let view = ContainerView::parse(&out);
        for (k, v) in [
            ("CUDA_MPS_PIPE_DIRECTORY", xpu_integrations::mps::CONTAINER_PIPE_DIR),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percent),
            ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limit),
            ("XPU_SHARING", "mps"),
        ] {
            assert_eq!(view.env.get(k).map(String::as_str), Some(v), "{name}: {k}\n{out}");
        }
        // The daemon's pipe directory is its own GPU's (the fake's file there names it).
        let minors: Vec<u32> =
            view.nodes.keys().filter_map(|p| p.strip_prefix("/dev/nvidia")?.parse().ok()).collect();
        assert_eq!(minors.len(), 1, "{name}: one GPU\n{out}");
        let gpu = hosts::gpu_uuid(minors[0] as usize);
        assert_eq!(view.extra.trim(), gpu, "{name}: its GPU's daemon\n{out}");
        gpus.push(gpu);
    }
    // The pods gone, their claims are unprepared and each daemon stops after its last.
    for (name, ..) in &shares {
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
    gpus.sort();
    gpus.dedup();
    let stopped = wait_until(Duration::from_secs(60), || async {
        let calls = xpu_testkit::mps::calls(cp.dir());
        gpus.iter().all(|g| calls.contains(&format!("quit {g}")))
    })
    .await;
    let calls = xpu_testkit::mps::calls(cp.dir());
    assert!(stopped, "each daemon stopped after its last claim: {calls}\n{}", diag());
    for g in &gpus {
        assert_eq!(calls.matches(&format!("start {g}")).count(), 1, "{calls}");
    }
    drop(driver);
    drop(node);
}

/// KubeVirt's side of a node with GPUs on vfio-pci, on a real kubelet with real runc:
/// `xpu k8s device-plugin --vfio` registers `xpu.dev/a100-sxm4-40gb-vfio` (no `nvidia.com/gpu`:
/// nothing is left for containers), and a pod asking for one, as virt-launcher's pod does for a
/// VMI's `hostDevices`, gets `PCI_RESOURCE_XPU_DEV_A100-SXM4-40GB-VFIO` with its GPU's address,
/// that GPU's `/dev/vfio/<group>` and `/dev/vfio/vfio`, and no `/dev/nvidia*`; its other
/// container sees no VFIO group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubevirt_resource_gives_a_pod_its_vfio_group_and_no_gpu_node_needs_root_and_runc() {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    let spec = hosts::a100_8x_vfio();
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let node = Node::start(&cp, NodeOptions::default().devices_of(fx.root()))
        .await
        .unwrap_or_else(|e| panic!("node: {e}"));
    const VFIO: &str = "xpu.dev/a100-sxm4-40gb-vfio";
    let log = node.dir().join("device-plugin.log");
    let child = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["k8s", "device-plugin", "--vfio", "--interval-ms", "200", "--root"])
        .arg(fx.root())
        .arg("--plugin-dir")
        .arg(node.device_plugin_dir())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let plugin = Plugin { child, log };
    let diag = || format!("{}\n{}", plugin.log(), node.log_tails());
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    let offered = wait_until(Duration::from_secs(60), || async {
        let n = nodes.get(NODE_NAME).await.unwrap();
        quantity(&n, "allocatable", VFIO).as_deref() == Some("8")
    })
    .await;
    assert!(offered, "8 GPUs offered for VMs\n{}", diag());
    let n = nodes.get(NODE_NAME).await.unwrap();
    assert_eq!(quantity(&n, "allocatable", GPU), None, "none for containers");

    // virt-launcher reads the variable from its own environment; a shell drops a name with a
    // '-' before its children see it, so the probe reads the one its process was started with.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let probe = probe_script("tr '\\0' '\\n' < /proc/1/environ | grep ^PCI_RESOURCE_");
    let container = |name: &str, resources: Value| {
        json!({ "name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["sh", "-c", probe], "resources": resources })
    };
    let pod = json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "virt-launcher" },
        "spec": { "restartPolicy": "Never", "automountServiceAccountToken": false,
            "enableServiceLinks": false, "terminationGracePeriodSeconds": 1,
            "containers": [container("vm", json!({ "limits": { VFIO: "1" } })),
                           container("plain", json!({}))] } });
    pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    let done = wait_until(Duration::from_secs(120), || async {
        let p = pods.get("virt-launcher").await.unwrap();
        matches!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded" | "Failed"))
    })
    .await;
    assert!(done, "the pod finished\n{}", diag());
    let mut views = Vec::new();
    for c in ["vm", "plain"] {
        let lp = LogParams { container: Some(c.to_owned()), ..LogParams::default() };
        let out = pods.logs("virt-launcher", &lp).await.unwrap();
        eprintln!("--- {c}\n{out}");
        views.push(ContainerView::parse(&out));
    }
    let (plain, vm) = (views.pop().unwrap(), views.pop().unwrap());
    let addr = vm
        .extra
        .lines()
        .find_map(|l| l.strip_prefix("PCI_RESOURCE_XPU_DEV_A100-SXM4-40GB-VFIO="))
        .unwrap_or_default()
        .to_owned();
    let dev = spec
        .devices
        .iter()
        .find(|d| d.address.to_string() == addr)
        .unwrap_or_else(|| panic!("one GPU's address in the KubeVirt variable: {}", vm.extra));
    let group = format!("/dev/vfio/{}", dev.iommu_group.unwrap());
    for p in [group.as_str(), "/dev/vfio/vfio"] {
        assert!(vm.nodes.contains_key(p), "{p} in the VM's container: {:?}", vm.nodes);
    }
    let vfio_groups = |v: &ContainerView| {
        v.nodes.keys().filter(|p| p.starts_with("/dev/vfio/") && *p != "/dev/vfio/vfio").count()
    };
    assert_eq!(vfio_groups(&vm), 1, "only its GPU's group: {:?}", vm.nodes);
    assert!(!vm.nodes.keys().any(|p| p.starts_with("/dev/nvidia")), "{:?}", vm.nodes);
    assert!(!vm.env.contains_key("NVIDIA_VISIBLE_DEVICES"), "{:?}", vm.env);
    assert_eq!(vfio_groups(&plain), 0, "{:?}", plain.nodes);
    assert!(plain.extra.trim().is_empty(), "{}", plain.extra);
    drop(plugin);
    drop(node);
}

/// A container and a VM on one node through DRA, with real runc: GPU 3 of the four-GPU host is
/// on vfio-pci (an admin bound it), the others on nvidia. kube-scheduler allocates a
/// `passthrough.xpu.dev` claim (GPU 3) and a `gpu.xpu.dev` claim; the passthrough pod sees
/// exactly `/dev/vfio/vfio` and its GPU's `/dev/vfio/<group>` and no `/dev/nvidia*`, and the
/// container pod its GPU's nodes and no VFIO node. (Moving a device to vfio-pci on prepare is
/// the fake kernel's test, in process: a fixture's sysfs is files, which a real write does not
/// rebind.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_claim_and_a_container_claim_on_one_node_see_only_their_nodes_needs_root_and_runc()
 {
    use xpu_testkit::sysfs::{MAJOR_MISC, MAJOR_VFIO_GROUP, MINOR_VFIO_CONTAINER};
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    install_dra(&admin).await;
    let mut spec = four_gpu_host();
    spec.loaded_modules.extend(["vfio", "vfio_pci", "vfio_iommu_type1"].map(str::to_owned));
    spec.control_nodes.push(xpu_testkit::NodeSpec::new(
        "/dev/vfio/vfio",
        MAJOR_MISC,
        MINOR_VFIO_CONTAINER,
    ));
    let vm_gpu = spec.devices.iter_mut().find(|d| d.nvidia_minor == Some(3)).unwrap();
    vm_gpu.driver = Some("vfio-pci".to_owned());
    vm_gpu.nvidia_minor = None;
    vm_gpu.uuid = None;
    let (vm_addr, group) = (vm_gpu.address, vm_gpu.iommu_group.unwrap());
    let (_fx, node, driver) = dra_node(&cp, &spec, &[]).await;
    let diag = || format!("{}\n{}", driver.log_text(), node.log_tails());
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={NODE_NAME},spec.driver=xpu.dev"));
    let published = wait_until(Duration::from_secs(30), || async {
        let s = slices.list(&lp).await.unwrap().items;
        s.iter().flat_map(|s| s.spec.devices.iter().flatten()).count() == 4
    })
    .await;
    assert!(published, "4 GPUs published\n{}", diag());

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    // The VM's claim asks for a device already on vfio-pci: a GPU the driver would move is the
    // fake kernel's case.
    for (name, class, selector) in [
        ("vm", "passthrough.xpu.dev", Some("device.attributes[\"xpu.dev\"].passthrough")),
        ("ctr", "gpu.xpu.dev", None),
    ] {
        let mut exactly = json!({ "deviceClassName": class });
        if let Some(s) = selector {
            exactly["selectors"] = json!([{ "cel": { "expression": s } }]);
        }
        let claim: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name },
            "spec": { "devices": { "requests": [{ "name": "d", "exactly": exactly }] } },
        }))
        .unwrap();
        claims.create(&PostParams::default(), &claim).await.unwrap();
    }
    let pod_spec =
        |claim: &str| json!({ "resourceClaims": [{ "name": "d", "resourceClaimName": claim }] });
    let uses = json!({ "claims": [{ "name": "d" }] });
    let (_, vm, plain) = run_probe_pod(&pods, "vm-pod", pod_spec("vm"), uses.clone(), diag).await;
    let vm_claim = claims.get("vm").await.unwrap();
    let device = vm_claim.status.unwrap().allocation.unwrap().devices.unwrap().results.unwrap();
    assert_eq!(device[0].device, format!("gpu-{}", vm_addr.dns_label()));
    let want: std::collections::BTreeMap<String, (char, u32, u32)> = [
        (format!("/dev/vfio/{group}"), ('c', MAJOR_VFIO_GROUP, group)),
        ("/dev/vfio/vfio".to_owned(), ('c', MAJOR_MISC, MINOR_VFIO_CONTAINER)),
    ]
    .into();
    assert_only_these_nodes(&vm, &plain, &want);
    let (_, ctr, plain) = run_probe_pod(&pods, "ctr-pod", pod_spec("ctr"), uses, diag).await;
    let minors: Vec<u32> =
        ctr.nodes.keys().filter_map(|p| p.strip_prefix("/dev/nvidia")?.parse().ok()).collect();
    assert_eq!(minors.len(), 1, "one GPU: {:?}", ctr.nodes);
    assert_ne!(minors[0], 3);
    assert_only_these_gpus(&ctr, &plain, &minors);
    drop(driver);
    drop(node);
}

/// Device health through DRA, on a real kubelet: a GPU under a running pod's claim vanishes;
/// the driver's health stream (`v1alpha1.DRAResourceHealth`) says Unhealthy and the kubelet
/// writes it into the container's `allocatedResourcesStatus`; back, it is Healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_gpu_that_fails_is_unhealthy_in_the_pods_status_needs_root_and_runc() {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    install_dra(&admin).await;
    let (fx, node, driver) = dra_node(&cp, &four_gpu_host(), &[]).await;
    let diag = || format!("{}\n{}", driver.log_text(), node.log_tails());
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": { "name": "one" },
        "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": { "deviceClassName": "gpu.xpu.dev" } }] } },
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let pod = json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": "holder" },
        "spec": { "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": false, "enableServiceLinks": false,
            "resourceClaims": [{ "name": "gpu", "resourceClaimName": "one" }],
            "containers": [{ "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["sleep", "600"], "resources": { "claims": [{ "name": "gpu" }] } }] } });
    pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    let running = wait_until(Duration::from_secs(90), || async {
        let p = pods.get("holder").await.unwrap();
        p.status.and_then(|s| s.phase).as_deref() == Some("Running")
    })
    .await;
    assert!(running, "the pod runs\n{}", diag());
    let c = claims.get("one").await.unwrap();
    let device =
        c.status.unwrap().allocation.unwrap().devices.unwrap().results.unwrap().remove(0).device;
    let addr = xpu_core::PciAddress::from_dns_label_suffix(&device).unwrap().to_string();
    // The kubelet's view of the claim's devices in the container's status.
    let health = |p: &Pod| -> Vec<(String, String, Option<String>)> {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
            .flat_map(|s| s.allocated_resources_status.clone().unwrap_or_default())
            .flat_map(|r| {
                let name = r.name.clone();
                r.resources
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |h| (name.clone(), h.resource_id, h.health))
            })
            .collect()
    };
    let link = fx.device_dir(&addr);
    let target = std::fs::read_link(&link).unwrap();
    std::fs::remove_file(&link).unwrap();
    let unhealthy = wait_until(Duration::from_secs(60), || async {
        let p = pods.get("holder").await.unwrap();
        health(&p)
            .iter()
            .any(|(_, id, h)| id.contains(&device) && h.as_deref() == Some("Unhealthy"))
    })
    .await;
    let p = pods.get("holder").await.unwrap();
    assert!(unhealthy, "{device} Unhealthy: {:?}\n{}", health(&p), diag());
    eprintln!("{device} vanished: {:?}", health(&p));
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let healthy = wait_until(Duration::from_secs(60), || async {
        let p = pods.get("holder").await.unwrap();
        health(&p).iter().any(|(_, id, h)| id.contains(&device) && h.as_deref() == Some("Healthy"))
    })
    .await;
    let p = pods.get("holder").await.unwrap();
    assert!(healthy, "{device} Healthy again: {:?}\n{}", health(&p), diag());
    drop(driver);
    drop(node);
}
