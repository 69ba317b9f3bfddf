//! Preemption by `xpu k8s scheduler` on a real control plane (etcd, kube-apiserver, and
//! kube-controller-manager's disruption controller, which keeps PodDisruptionBudgets' status):
//! victims leave through the Eviction API, a budget that forbids an eviction is respected and
//! another victim is chosen, the preemptor is nominated, and a gang preempts for all its members
//! or evicts nothing. The test plays the kubelet: bound pods become Running and Ready, and a pod
//! being deleted is removed.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use xpu_testkit::kube::ControlPlaneOptions;

use k8s_support::*;

fn gpu_pod(name: &str, class: &str, gpus: u32, scenario: &str, labels: &[(&str, &str)]) -> Pod {
    let mut p = pod(name, "nvidia.com/gpu", gpus, labels);
    let spec = p.spec.as_mut().unwrap();
    spec.priority_class_name = Some(class.into());
    spec.node_selector = Some([("scenario".to_owned(), scenario.to_owned())].into());
    p
}

/// The kubelet's part: bound pods run and are Ready; pods being deleted go.
fn play_kubelet(admin: kube::Client) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let api: Api<Pod> = Api::namespaced(admin, "default");
        loop {
            for p in api.list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default() {
                let name = p.metadata.name.clone().unwrap();
                if p.metadata.deletion_timestamp.is_some() {
                    let dp =
                        DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
                    // Already gone is fine: the next list will not show it.
                    let _ = api.delete(&name, &dp).await;
                    continue;
                }
                let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                if node_of(&p).is_some() && !running {
                    let now = jiff::Timestamp::now().to_string();
                    let status = json!({ "status": { "phase": "Running", "startTime": now,
                        "conditions": [{ "type": "Ready", "status": "True", "lastTransitionTime": now }] } });
                    // A pod deleted meanwhile is skipped; the loop looks again.
                    let _ = api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                        .await;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

async fn get(api: &Api<Pod>, name: &str) -> Option<Pod> {
    api.get_opt(name).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_respects_budgets_nominates_and_never_evicts_part_of_a_gang_for_nothing() {
    let _turn = TURN.lock().await;
    let cp =
        plane(ControlPlaneOptions::default().with_controller_manager().controllers(["disruption"]))
            .await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    for (name, value) in [("low", 100), ("high", 1000), ("top", 2000)] {
        let pc = json!({ "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                         "metadata": { "name": name }, "value": value });
        create(&admin, &pc, false).await.unwrap();
    }
    add_node(&admin, &NodeDef::new("a").gpus("nvidia.com/gpu", 2).label("scenario", "a")).await;
    add_node(&admin, &NodeDef::new("b1").gpus("nvidia.com/gpu", 2).label("scenario", "b")).await;
    add_node(&admin, &NodeDef::new("b2").gpus("nvidia.com/gpu", 2).label("scenario", "b")).await;
    let kubelet = play_kubelet(admin.clone());
    let sched = XpuScheduler::start(&cp, &kubeconfig, "preempt", &[]);
    let api: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let pp = PostParams::default();

    // Scenario a: two low pods fill node a; the younger is guarded by a budget.
    api.create(&pp, &gpu_pod("old", "low", 1, "a", &[("app", "old")])).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    api.create(&pp, &gpu_pod("young", "low", 1, "a", &[("app", "young")])).await.unwrap();
    let pdb = json!({ "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": { "name": "young", "namespace": "default" },
        "spec": { "minAvailable": 1, "selector": { "matchLabels": { "app": "young" } } } });
    create(&admin, &pdb, false).await.unwrap();
    // Scenario b: a low pod on b1, a top-priority pod on b2.
    api.create(&pp, &gpu_pod("low-b", "low", 2, "b", &[])).await.unwrap();
    api.create(&pp, &gpu_pod("top-b", "top", 2, "b", &[])).await.unwrap();
    let running = wait_until(Duration::from_secs(60), || async {
        let ps = pods(&admin, "default").await;
        ps.len() == 4
            && ps
                .iter()
                .all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
    })
    .await;
    assert!(running, "four low/top pods run\n{}", sched.log_text());
    // Let the disruption controller see the budget's pod healthy.
    let pdbs: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(admin.clone(), "default");
    let computed = wait_until(Duration::from_secs(30), || async {
        pdbs.get("young").await.unwrap().status.is_some_and(|s| s.current_healthy == Some(1))
    })
    .await;
    assert!(computed, "the budget's status: {:?}", pdbs.get("young").await.unwrap().status);

    // A high pod for node a: the younger pod (least work lost) is the first choice, but its
    // budget forbids it; the older one is evicted instead and the high pod binds there.
    // The nomination lasts until the bind (the API server clears it then): watch for it.
    let nominated = {
        let api = api.clone();
        tokio::spawn(async move {
            use futures_util::StreamExt;
            use kube::runtime::{WatchStreamExt, watcher};
            let cfg = watcher::Config::default().fields("metadata.name=high");
            let mut s = std::pin::pin!(watcher(api, cfg).applied_objects());
            while let Some(Ok(p)) = s.next().await {
                if let Some(n) = p.status.and_then(|s| s.nominated_node_name) {
                    return n;
                }
            }
            String::new()
        })
    };
    api.create(&pp, &gpu_pod("high", "high", 1, "a", &[])).await.unwrap();
    let bound = wait_until(Duration::from_secs(60), || async {
        get(&api, "high").await.as_ref().and_then(node_of) == Some("a")
    })
    .await;
    let log = sched.log_text();
    assert!(bound, "high binds on a\n{log}");
    assert!(get(&api, "old").await.is_none(), "old was evicted");
    let young = get(&api, "young").await.unwrap();
    assert!(young.metadata.deletion_timestamp.is_none(), "the budget kept young");
    assert!(
        log.contains("would break PodDisruptionBudget default/young"),
        "the refusal is logged\n{log}"
    );
    let nominated = tokio::time::timeout(Duration::from_secs(5), nominated).await;
    assert_eq!(nominated.unwrap().unwrap(), "a", "high was nominated to node a");

    // Scenario b: a high gang of two 2-GPU pods needs both b nodes; b2's pod outranks it, so
    // evicting low-b alone would be for nothing: nothing is evicted and the gang waits.
    for i in 0..2 {
        let labels = [("xpu.dev/gang", "hg"), ("xpu.dev/gang-size", "2")];
        api.create(&pp, &gpu_pod(&format!("hg-{i}"), "high", 2, "b", &labels)).await.unwrap();
    }
    let told = wait_until(Duration::from_secs(30), || async {
        get(&api, "hg-0")
            .await
            .and_then(|p| p.status?.conditions)
            .is_some_and(|c| c.iter().any(|c| c.type_ == "PodScheduled" && c.status == "False"))
    })
    .await;
    assert!(told, "the gang is told it waits\n{}", sched.log_text());
    tokio::time::sleep(Duration::from_secs(6)).await;
    let low_b = get(&api, "low-b").await.unwrap();
    assert!(low_b.metadata.deletion_timestamp.is_none(), "low-b is not evicted for nothing");
    assert!(node_of(&get(&api, "hg-0").await.unwrap()).is_none());

    // Once the top pod ends, evicting low-b is enough: the gang preempts for both members.
    api.delete("top-b", &DeleteParams::default()).await.unwrap();
    let both = wait_until(Duration::from_secs(60), || async {
        let a = get(&api, "hg-0").await.as_ref().and_then(node_of).map(str::to_owned);
        let b = get(&api, "hg-1").await.as_ref().and_then(node_of).map(str::to_owned);
        matches!((a, b), (Some(x), Some(y)) if x != y)
    })
    .await;
    assert!(both, "the gang binds whole on b1 and b2\n{}", sched.log_text());
    assert!(get(&api, "low-b").await.is_none(), "low-b was evicted for the gang");
    assert!(get(&api, "young").await.is_some(), "scenario a is untouched");
    kubelet.abort();
    drop(sched);
}
