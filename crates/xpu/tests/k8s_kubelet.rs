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

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node as NodeObject, Pod};
use kube::api::{Api, LogParams, PostParams};
use serde_json::{Value, json};
use xpu_testkit::bundle::{ContainerView, probe_script, skip_container_tests};
use xpu_testkit::kube::ControlPlaneOptions;
use xpu_testkit::kubelet::{BUSYBOX_IMAGE, NODE_NAME, Node, NodeOptions};
use xpu_testkit::sysfs::{MAJOR_NVIDIA, MAJOR_NVIDIA_UVM};
use xpu_testkit::{BuildOptions, HostSpec, hosts};

use k8s_support::*;

const GPU: &str = "nvidia.com/gpu";

/// The 8×A100 host with its first four GPUs (and the NVSwitches, which are not GPUs).
fn four_gpu_host() -> HostSpec {
    let mut h = hosts::a100_8x();
    h.name = "a100-4x".into();
    h.devices.retain(|d| d.nvidia_minor.is_none_or(|m| m < 4));
    h
}

/// `xpu k8s device-plugin`, killed on drop; its stderr goes to a file.
struct Plugin {
    child: Child,
    log: std::path::PathBuf,
}

impl Plugin {
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

/// `c 195:3 rwm` lines as (type, major, minor) → access.
fn device_rules(text: &str) -> BTreeMap<(String, String, String), String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let kind = f.next()?.to_owned();
            let (major, minor) = f.next()?.split_once(':')?;
            Some(((kind, major.to_owned(), minor.to_owned()), f.next().unwrap_or("").to_owned()))
        })
        .collect()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plugin_on_a_real_kubelet_gives_a_scheduled_pod_exactly_its_two_gpus_needs_root_and_runc()
 {
    if skip_container_tests() {
        return;
    }
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    let spec = four_gpu_host();
    let fx = spec.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let options = NodeOptions::default().devices_of(fx.root());
    let status_period = options.node_status_update;
    let node = Node::start(&cp, options).await.unwrap_or_else(|e| panic!("node: {e}"));
    let nodes: Api<NodeObject> = Api::all(admin.clone());
    let before = nodes.get(NODE_NAME).await.unwrap();
    let info = before.status.as_ref().unwrap().node_info.as_ref().unwrap();
    eprintln!(
        "node {NODE_NAME}: kubelet {}, runtime {}, kernel {}",
        info.kubelet_version, info.container_runtime_version, info.kernel_version
    );
    assert_eq!(quantity(&before, "allocatable", GPU), None, "no GPUs before the plugin");

    // The CDI spec the device plugin's Allocate names, where containerd reads specs.
    let out = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["cdi", "generate", "--vendor", "nvidia", "--root"])
        .arg(fx.root())
        .arg("--output")
        .arg(node.cdi_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "xpu cdi generate: {}", String::from_utf8_lossy(&out.stderr));

    // The plugin runs outside the node's namespace, in the directory the kubelet sees as
    // /var/lib/kubelet/device-plugins.
    let log = node.dir().join("device-plugin.log");
    let child = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["k8s", "device-plugin", "--interval-ms", "200", "--root"])
        .arg(fx.root())
        .arg("--plugin-dir")
        .arg(node.device_plugin_dir())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let plugin = Plugin { child, log };
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
    let probe = probe_script("cat /sys/fs/cgroup/devices/devices.list");
    let container = |name: &str, limits: Value| {
        json!({
            "name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c", probe], "resources": { "limits": limits },
        })
    };
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "two-gpus" },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [container("gpu", json!({ GPU: "2" })), container("plain", json!({}))],
        },
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let done = wait_until(Duration::from_secs(120), || async {
        let p = pods.get("two-gpus").await.unwrap();
        matches!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded" | "Failed"))
    })
    .await;
    let p = pods.get("two-gpus").await.unwrap();
    let status = serde_json::to_string_pretty(&p.status).unwrap();
    assert!(done, "pod finished\n{status}\n{}\n{}", plugin.log(), node.log_tails());
    assert_eq!(node_of(&p), Some(NODE_NAME), "bound by kube-scheduler: {status}");
    let scheduled = p.status.as_ref().unwrap().conditions.as_ref().unwrap();
    assert!(scheduled.iter().any(|c| c.type_ == "PodScheduled" && c.status == "True"), "{status}");
    assert_eq!(p.spec.as_ref().unwrap().scheduler_name.as_deref(), Some("default-scheduler"));
    assert_eq!(
        p.status.as_ref().unwrap().phase.as_deref(),
        Some("Succeeded"),
        "{status}\n{}",
        node.log_tails()
    );

    let logs = |c: &'static str| {
        let pods = pods.clone();
        async move {
            let lp = LogParams { container: Some(c.to_owned()), ..LogParams::default() };
            pods.logs("two-gpus", &lp).await.unwrap()
        }
    };
    let gpu_out = logs("gpu").await;
    let plain_out = logs("plain").await;
    eprintln!("--- container gpu\n{gpu_out}--- container plain\n{plain_out}");
    let gpu = ContainerView::parse(&gpu_out);
    let plain = ContainerView::parse(&plain_out);

    // Allocate's answer reached the container: the two devices the kubelet chose.
    let ids: Vec<&str> = gpu.env["XPU_VISIBLE_DEVICES"].split(',').collect();
    assert_eq!(ids.len(), 2, "{:?}", gpu.env);
    let minors: Vec<u32> = ids
        .iter()
        .map(|id| {
            let d = spec.devices.iter().find(|d| d.address.to_string() == *id).unwrap();
            d.nvidia_minor.unwrap()
        })
        .collect();
    // Allocate also named the CDI devices, and containerd applied `xpu cdi generate`'s spec
    // after the plugin's environment: the spec's `void` (the devices are in already, an NVIDIA
    // hook must add none) replaced the UUIDs the plugin put there for runtimes without CDI.
    assert_eq!(gpu.env["NVIDIA_VISIBLE_DEVICES"], "void", "{:?}", gpu.env);
    assert!(!plain.env.contains_key("XPU_VISIBLE_DEVICES"), "{:?}", plain.env);

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
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(checkpointed, sorted);
    assert!(!entry["AllocResp"].as_str().unwrap_or("").is_empty(), "{entry}");

    // /dev: exactly the two GPUs and the control nodes; nothing of them in the other container.
    let mut want: BTreeMap<String, (char, u32, u32)> =
        minors.iter().map(|&m| (format!("/dev/nvidia{m}"), ('c', MAJOR_NVIDIA, m))).collect();
    for (path, major, minor) in [
        ("/dev/nvidiactl", MAJOR_NVIDIA, 255),
        ("/dev/nvidia-modeset", MAJOR_NVIDIA, 254),
        ("/dev/nvidia-uvm", MAJOR_NVIDIA_UVM, 0),
        ("/dev/nvidia-uvm-tools", MAJOR_NVIDIA_UVM, 1),
    ] {
        want.insert(path.to_owned(), ('c', major, minor));
    }
    let ptys = |v: &ContainerView| {
        v.accel_nodes().into_iter().filter(|(p, _)| p != "/dev/ptmx").collect::<BTreeMap<_, _>>()
    };
    assert_eq!(ptys(&gpu), want, "the GPU container's /dev");
    assert_eq!(ptys(&plain), BTreeMap::new(), "the plain container's /dev");

    // The device cgroup: what the GPU container may open beyond its neighbour is exactly those.
    if Path::new("/sys/fs/cgroup/devices").is_dir() {
        let g = device_rules(&gpu.extra);
        let q = device_rules(&plain.extra);
        assert!(!q.is_empty(), "the plain container's devices.list: {}", plain.extra);
        let extra: BTreeSet<String> = g
            .iter()
            .filter(|(k, _)| !q.contains_key(*k))
            .map(|((kind, major, minor), access)| {
                assert!(access.contains("rw"), "{kind} {major}:{minor} {access}");
                format!("{kind} {major}:{minor}")
            })
            .collect();
        let expected: BTreeSet<String> =
            want.values().map(|(k, ma, mi)| format!("{k} {ma}:{mi}")).collect();
        assert_eq!(extra, expected, "devices.list beyond the plain container's");
        assert!(q.keys().all(|k| g.contains_key(k)), "the GPU container lost a default device");
    } else {
        eprintln!("cgroup v2 host: the device cgroup is an eBPF program, not compared here");
    }

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
