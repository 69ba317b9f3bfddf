//! Flex-start against a real control plane: etcd, kube-apiserver with the ProvisioningRequest
//! CRD installed from xpu's own types, kube-controller-manager (the Job controller makes the
//! pods), and `xpu k8s scheduler` with the token the deploy manifests bind. The test plays the
//! cluster autoscaler: it reads the ProvisioningRequest, creates the nodes, and sets the
//! request's conditions.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodTemplate};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use xpu_kube::flex::{self, ProvisioningRequest};
use xpu_testkit::kube::ControlPlaneOptions;

use k8s_support::*;

fn tpu_host(name: &str, pool: &str) -> NodeDef {
    NodeDef::new(name)
        .gpus("google.com/tpu", 4)
        .label("cloud.google.com/gke-tpu-accelerator", "tpu-v5p-slice")
        .label("cloud.google.com/gke-tpu-topology", "2x2x2")
        .label("cloud.google.com/gke-nodepool", pool)
        .label("cloud.google.com/gke-flex-start", "true")
}

/// Sets one condition on a request, as the autoscaler does.
async fn condition(
    api: &Api<ProvisioningRequest>,
    name: &str,
    type_: &str,
    reason: &str,
    msg: &str,
) {
    let now = jiff::Timestamp::now().to_string();
    let mut conds = vec![json!({ "type": "Accepted", "status": "True", "reason": "Accepted",
        "message": "accepted by the test's autoscaler", "lastTransitionTime": now })];
    conds.push(json!({ "type": type_, "status": "True", "reason": reason, "message": msg,
        "lastTransitionTime": now }));
    let patch = json!({ "status": { "conditions": conds } });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
}

fn scheduled_message(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"))
        .and_then(|c| c.message.clone())
        .unwrap_or_default()
}

async fn job_pods(client: &kube::Client, job: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    api.list(&ListParams::default().labels(&format!("job-name={job}"))).await.unwrap().items
}

fn consumes(p: &Pod) -> Option<&str> {
    p.metadata.annotations.as_ref()?.get(flex::CONSUME).map(String::as_str)
}

/// The GKE flex-start seed's multi-host TPU Job on a cluster with no TPU nodes: xpu asks for
/// the whole slice with one ProvisioningRequest, the pods wait holding nothing (even once the
/// nodes exist) until it is Provisioned, then bind together. A second Job's request fails:
/// its pods say why, hold nothing (a plain pod takes the spare host), and a new request
/// replaces the failed one after the backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flex_start_job_is_provisioned_whole_and_a_failed_request_is_reported_and_retried() {
    let _turn = TURN.lock().await;
    let cp =
        plane(ControlPlaneOptions::default().with_controller_manager().with_crd(flex::crd())).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let sched = XpuScheduler::start(&cp, &kubeconfig, "flex", &["--provisioning-backoff", "5"]);
    let requests: Api<ProvisioningRequest> = Api::namespaced(admin.clone(), "default");
    let templates: Api<PodTemplate> = Api::namespaced(admin.clone(), "default");

    let docs = documents(&repo().join("docs/examples/tpu-multihost-job.yaml"));
    for d in &docs {
        create(&admin, d, false).await.unwrap();
    }

    // One request, for both pods, of the atomic class, with its template.
    let asked = wait_until(Duration::from_secs(60), || async {
        let ps = job_pods(&admin, "job-1").await;
        ps.len() == 2 && ps.iter().all(|p| consumes(p) == Some("job-1-flex-1"))
    })
    .await;
    assert!(asked, "pods point at job-1-flex-1\n{}", sched.log_text());
    let all = requests.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(all.len(), 1, "one request for the gang: {all:?}");
    let r = &all[0];
    assert_eq!(r.spec.provisioning_class_name, flex::CLASS);
    assert_eq!(r.spec.pod_sets.len(), 1);
    assert_eq!(r.spec.pod_sets[0].count, 2);
    let t = templates.get(&r.spec.pod_sets[0].pod_template_ref.name).await.unwrap();
    let spec = t.template.unwrap().spec.unwrap();
    let selector = spec.node_selector.unwrap();
    assert_eq!(selector["cloud.google.com/gke-tpu-topology"], "2x2x2");
    assert_eq!(selector["cloud.google.com/gke-flex-start"], "true");
    let limits = spec.containers[0].resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["google.com/tpu"].0, "4");
    assert!(spec.node_name.is_none());
    let owner = &r.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str()), ("Job", "job-1"));
    for p in job_pods(&admin, "job-1").await {
        let notes = p.metadata.annotations.unwrap();
        assert_eq!(notes[flex::CLASS_ANNOTATION], flex::CLASS);
        assert_eq!(notes[flex::ATTEMPT], "1");
    }
    let told = wait_until(Duration::from_secs(30), || async {
        job_pods(&admin, "job-1").await.iter().all(|p| {
            scheduled_message(p).contains("waiting for ProvisioningRequest default/job-1-flex-1")
        })
    })
    .await;
    assert!(
        told,
        "pods say what they wait for: {:?}",
        job_pods(&admin, "job-1").await.iter().map(scheduled_message).collect::<Vec<_>>()
    );

    // The autoscaler brings the slice; until it says Provisioned, nothing binds.
    add_node(&admin, &tpu_host("flex-0", "flex-a")).await;
    add_node(&admin, &tpu_host("flex-1", "flex-a")).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let early: Vec<Pod> = job_pods(&admin, "job-1").await;
    assert!(early.iter().all(|p| node_of(p).is_none()), "bound before Provisioned");
    assert_eq!(requests.list(&ListParams::default()).await.unwrap().items.len(), 1, "asked once");
    condition(&requests, "job-1-flex-1", "Provisioned", "Provisioned", "VMs created").await;
    let bound = wait_until(Duration::from_secs(30), || async {
        job_pods(&admin, "job-1").await.iter().all(|p| node_of(p).is_some())
    })
    .await;
    let ps = job_pods(&admin, "job-1").await;
    assert!(bound, "both bind once Provisioned\n{}", sched.log_text());
    let mut on: Vec<&str> = ps.iter().filter_map(node_of).collect();
    on.sort_unstable();
    assert_eq!(on, ["flex-0", "flex-1"]);

    // A second Job, and one spare host (not a slice: the gang cannot use it).
    add_node(&admin, &tpu_host("spare-0", "spare")).await;
    let mut job2 = docs.iter().find(|d| d["kind"] == "Job").unwrap().clone();
    job2["metadata"]["name"] = json!("job-2");
    create(&admin, &job2, false).await.unwrap();
    let asked = wait_until(Duration::from_secs(30), || async {
        requests.get_opt("job-2-flex-1").await.unwrap().is_some()
    })
    .await;
    assert!(asked, "job-2 asks for its slice\n{}", sched.log_text());
    condition(
        &requests,
        "job-2-flex-1",
        "Failed",
        "FailedToBookCapacity",
        "no v5p capacity in us-east5-a",
    )
    .await;
    let told = wait_until(Duration::from_secs(30), || async {
        let ps = job_pods(&admin, "job-2").await;
        ps.len() == 2
            && ps.iter().all(|p| scheduled_message(p).contains("no v5p capacity in us-east5-a"))
    })
    .await;
    assert!(
        told,
        "the failure is reported on the pods: {:?}",
        job_pods(&admin, "job-2").await.iter().map(scheduled_message).collect::<Vec<_>>()
    );
    // It holds no capacity: a plain pod takes the spare host while job-2 waits.
    let podsapi: Api<Pod> = Api::namespaced(admin.clone(), "default");
    podsapi.create(&PostParams::default(), &pod("plain", "google.com/tpu", 4, &[])).await.unwrap();
    let plain = wait_until(Duration::from_secs(30), || async {
        podsapi.get("plain").await.ok().as_ref().and_then(node_of) == Some("spare-0")
    })
    .await;
    assert!(plain, "the plain pod takes spare-0\n{}", sched.log_text());
    for p in job_pods(&admin, "job-2").await {
        assert!(node_of(&p).is_none());
        assert!(p.status.and_then(|s| s.nominated_node_name).is_none(), "nothing held for job-2");
    }

    // After the backoff: attempt 2 replaces attempt 1.
    let retried = wait_until(Duration::from_secs(30), || async {
        let ps = job_pods(&admin, "job-2").await;
        requests.get_opt("job-2-flex-1").await.unwrap().is_none()
            && requests.get_opt("job-2-flex-2").await.unwrap().is_some()
            && ps.iter().all(|p| {
                consumes(p) == Some("job-2-flex-2")
                    && p.metadata.annotations.as_ref().unwrap()[flex::ATTEMPT] == "2"
            })
    })
    .await;
    assert!(retried, "a new request after the backoff\n{}", sched.log_text());
    assert!(templates.get_opt("job-2-flex-1").await.unwrap().is_none(), "its template goes too");
    assert!(sched.log_text().contains("asked for flex-start capacity"));
}

/// `xpu k8s crd` prints the CRD the harness installs, as YAML `kubectl apply` takes.
#[test]
fn xpu_k8s_crd_prints_the_provisioning_request_crd() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["k8s", "crd"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: serde_json::Value = serde_norway::from_slice(&out.stdout).unwrap();
    assert_eq!(printed, serde_json::to_value(flex::crd()).unwrap());
    assert_eq!(printed["metadata"]["name"], "provisioningrequests.autoscaling.x-k8s.io");
}
