//! scheduler_perf's DRA shape (`SchedulingWithResourceClaimTemplate`) on real control planes:
//! N Node objects, each with a ResourceSlice of 8 GPUs in two NVLink domains, then pods
//! created as fast as the API server takes them, each with one claim from a template, and
//! kube-scheduler of the same release and `xpu k8s scheduler` each scheduling them on a fresh
//! plane (with kube-controller-manager's resourceclaim controller making the claims), side by
//! side in one run. Three mixes: one device per claim; one device with a CEL selector on an
//! attribute; two devices with `matchAttribute` on the NVLink domain. Prints pods bound per
//! second (first create to last bind, as a watch sees it), p50/p99 create-to-bound latency and
//! each scheduler's peak RSS.
//!
//!   cargo bench -p xpu --bench k8s_claims
//!   XPU_BENCH_NODES=100 XPU_BENCH_PODS=400 (defaults; scheduler_perf runs 500 and 5000)
//!   XPU_BENCH_SCHEDULERS=kube,xpu (and null) XPU_BENCH_MIXES=template,cel,match,extended
//!   (`extended`: no claim, a plain `deviceclass.resource.kubernetes.io/gpu: 1` request that the
//!   scheduler serves from the class's devices with a claim it makes, as 1.37 does)
//!   XPU_BENCH_BACKLOG=1: every pod is created before the scheduler starts, and the figures run
//!   from its start (the API server's create rate then bounds neither scheduler)
//!
//! kube-scheduler runs with `clientConnection.qps/burst` 5000 (as scheduler_perf sets it), and so
//! does the controller-manager that makes the claims; xpu's client has no limiter. Pods tolerate the `not-ready` taint admission puts on every new Node.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

mod k8s_bench;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate, ResourceSlice};
use kube::api::{Api, PostParams};
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};

use k8s_bench::{create_all, env_num};

const DRIVER: &str = "gpu.example.com";

fn node(i: usize) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": format!("node-{i:05}"), "labels": { "kubernetes.io/hostname": format!("node-{i:05}") } },
        "status": {
            "capacity": { "cpu": "64", "memory": "512Gi", "pods": "110" },
            "allocatable": { "cpu": "64", "memory": "512Gi", "pods": "110" },
            "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady",
                             "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z" }],
        },
    }))
    .unwrap()
}

fn slice(i: usize) -> ResourceSlice {
    let node = format!("node-{i:05}");
    let devices: Vec<serde_json::Value> = (0..8)
        .map(|d| {
            json!({ "name": format!("gpu-{d}"), "attributes": {
                "model": { "string": "A100" }, "nvlinkDomain": { "int": d / 4 } },
                "capacity": { "memory": { "value": "80Gi" } } })
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": { "name": format!("{node}-gpus") },
        "spec": { "driver": DRIVER, "nodeName": node, "devices": devices,
                  "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 } }
    }))
    .unwrap()
}

fn template(mix: &str) -> ResourceClaimTemplate {
    let mut exactly =
        json!({ "deviceClassName": "gpu", "count": if mix == "match" { 2 } else { 1 } });
    if mix == "cel" {
        exactly["selectors"] = json!([{ "cel": { "expression": format!("device.attributes['{DRIVER}'].model == 'A100'") } }]);
    }
    let mut devices = json!({ "requests": [{ "name": "gpus", "exactly": exactly }] });
    if mix == "match" {
        devices["constraints"] = json!([{ "matchAttribute": format!("{DRIVER}/nvlinkDomain") }]);
    }
    serde_json::from_value(
        json!({ "metadata": { "name": "claim" }, "spec": { "spec": { "devices": devices } } }),
    )
    .unwrap()
}

fn pod(name: &str, scheduler: &str, mix: &str) -> Pod {
    if mix == "extended" {
        // No claim: a plain extended-resource request that the DeviceClass serves (its implicit
        // name), for which the scheduler makes the claim itself.
        let gpu = json!({ "deviceclass.resource.kubernetes.io/gpu": "1" });
        return k8s_bench::pod(name, scheduler, gpu.clone(), gpu);
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "schedulerName": scheduler,
            "tolerations": [{ "key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoSchedule" }],
            "resourceClaims": [{ "name": "gpus", "resourceClaimTemplateName": "claim" }],
            "containers": [{ "name": "c", "image": "pause",
                             "resources": { "requests": { "cpu": "100m", "memory": "200Mi" }, "claims": [{ "name": "gpus" }] } }],
        },
    }))
    .unwrap()
}

async fn bench(which: &str, mix: &str, nodes: usize, pods: usize) -> k8s_bench::Figures {
    let cp = ControlPlane::start(
        ControlPlaneOptions::default()
            .with_controller_manager()
            .controllers(["serviceaccount-controller", "resourceclaim-controller"])
            // Its default client limit (20 qps) would make the claims, not the scheduler, the
            // bottleneck: each pod costs the controller two writes.
            .controller_manager_flag("--kube-api-qps=5000")
            .controller_manager_flag("--kube-api-burst=5000"),
    )
    .await
    .unwrap_or_else(|e| panic!("control plane: {e}"));
    let client = cp.admin_client();
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": "gpu" },
        "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == '{DRIVER}'") } }] }
    }))
    .unwrap();
    Api::<DeviceClass>::all(client.clone()).create(&PostParams::default(), &class).await.unwrap();
    create_all(&Api::<Node>::all(client.clone()), nodes, 32, node).await;
    create_all(&Api::<ResourceSlice>::all(client.clone()), nodes, 32, slice).await;
    Api::<ResourceClaimTemplate>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &template(mix))
        .await
        .unwrap();
    let make = |sched: &str| (0..pods).map(|i| pod(&format!("p-{i:05}"), sched, mix)).collect();
    k8s_bench::run(&cp, which, "", make, &format!("{which} {mix}")).await
}

fn main() {
    let nodes = env_num("XPU_BENCH_NODES", 100);
    let pods = env_num("XPU_BENCH_PODS", 400);
    let which = std::env::var("XPU_BENCH_SCHEDULERS").unwrap_or_else(|_| "kube,xpu".into());
    let mixes = std::env::var("XPU_BENCH_MIXES").unwrap_or_else(|_| "template,cel,match".into());
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let title = format!(
        "k8s DRA bench: {nodes} nodes with 8 GPUs each (a ResourceSlice per node, two NVLink domains), {pods} pods per mix, one claim each from a template"
    );
    k8s_bench::table(&title, "mix", &mixes, &which, |w, mix| {
        rt.block_on(bench(w, mix, nodes, pods))
    });
}
