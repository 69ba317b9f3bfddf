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
//!   XPU_BENCH_BACKLOG=1: every pod is created before the scheduler starts, and the figures run
//!   from its start (the API server's create rate then bounds neither scheduler)
//!   XPU_BENCH_BOUND=50000: that many pods already bound before the measured ones arrive
//!   (spread over the nodes, each labelled with one of 100 other apps, one in ten anti-affine on
//!   the hostname to an app no measured pod has): the inter-pod state a cycle must account for
//!
//! kube-scheduler runs with `clientConnection.qps/burst` 5000, as scheduler_perf sets it.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

mod k8s_bench;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::scheduling::v1beta1::PodGroup;
use kube::api::Api;
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};

use k8s_bench::{create_all, env_num};

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

/// A pod already bound to its node ([`k8s_bench::bound_pod`]), with one of 100 other apps'
/// labels and (one in ten) an anti-affinity term of its own, so that every inter-pod check
/// meets it.
fn bound_pod(i: usize, nodes: usize) -> Pod {
    let mut p = k8s_bench::bound_pod(i, nodes);
    p.metadata.labels = Some([("app".to_owned(), format!("app-{}", i % 100))].into());
    if i.is_multiple_of(10) {
        let spec = p.spec.as_mut().unwrap();
        spec.affinity = Some(
            serde_json::from_value(
                json!({ "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
                { "labelSelector": { "matchLabels": { "color": "red" } },
                  "topologyKey": "kubernetes.io/hostname" } ] } }),
            )
            .unwrap(),
        );
    }
    p
}

fn group(i: usize) -> PodGroup {
    serde_json::from_value(json!({
        "metadata": { "name": format!("g-{i:05}") },
        "spec": { "schedulingPolicy": { "gang": { "minCount": GANG } } },
    }))
    .unwrap()
}

const GATES: &str = "GenericWorkload=true,TopologyAwareWorkloadScheduling=true";

async fn bench(
    which: &str,
    shape: &str,
    nodes: usize,
    bound: usize,
    pods: usize,
) -> k8s_bench::Figures {
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
    k8s_bench::create_bound(&client, which, bound, |i| bound_pod(i, nodes)).await;
    if gang {
        create_all(&Api::<PodGroup>::namespaced(client.clone(), "default"), pods / GANG, 32, group)
            .await;
    }
    let gates = if gang { GATES } else { "" };
    let make = |sched: &str| (0..pods).map(|i| pod(shape, i, sched)).collect();
    k8s_bench::run(&cp, which, gates, make, &format!("{which} {shape}")).await
}

fn main() {
    let nodes = env_num("XPU_BENCH_NODES", 500);
    let pods = env_num("XPU_BENCH_PODS", 402);
    let bound = env_num("XPU_BENCH_BOUND", 0);
    let which = std::env::var("XPU_BENCH_SCHEDULERS").unwrap_or_else(|_| "kube,xpu".into());
    let shapes =
        std::env::var("XPU_BENCH_SHAPES").unwrap_or_else(|_| "anti,affinity,spread,gang".into());
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let title = format!(
        "k8s inter-pod bench: {nodes} nodes in {ZONES} zones, {bound} pods bound before, {pods} pods per shape"
    );
    k8s_bench::table(&title, "shape", &shapes, &which, |w, shape| {
        rt.block_on(bench(w, shape, nodes, bound, pods))
    });
}
