//! The Kubernetes control-plane harness against the real upstream binaries
//! (`scripts/install-k8s`): the scheduler binds a Pod to a Node, the Job controller makes a
//! Job's Pod, a ServiceAccount kubeconfig authenticates, and dropping the plane ends every
//! process.

// The start-up time is printed for whoever watches the harness on a loaded machine.
#![allow(clippy::print_stderr)]

use std::error::Error;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};

type TestResult = Result<(), Box<dyn Error>>;

const WAIT: Duration = Duration::from_secs(60);

/// Polls `probe` until it yields a value, or fails after [`WAIT`] naming `what`.
async fn eventually<T, F, Fut>(what: &str, mut probe: F) -> Result<T, Box<dyn Error>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, kube::Error>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = probe().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            return Err(format!("{what}: not seen within {WAIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn control_plane_schedules_pods_and_runs_jobs() -> TestResult {
    let plane = ControlPlane::start(
        ControlPlaneOptions::default().with_scheduler().with_controller_manager(),
    )
    .await?;
    eprintln!(
        "control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager) start-to-ready: {:.2?}",
        plane.startup_time()
    );
    // A failure panics while the plane is alive, so its drop keeps the logs and says where.
    if let Err(e) = exercise(&plane).await {
        panic!("{e}");
    }

    // Dropping the plane kills and reaps every process and removes its directory.
    let pids = plane.process_ids();
    assert_eq!(pids.len(), 4, "{pids:?}");
    let dir = plane.dir().to_path_buf();
    drop(plane);
    for (name, pid) in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{name} (pid {pid}) still exists after the plane dropped"
        );
    }
    assert!(!dir.exists(), "{} not removed", dir.display());
    Ok(())
}

async fn exercise(plane: &ControlPlane) -> TestResult {
    assert!(plane.server_url().starts_with("https://127.0.0.1:"));
    assert!(plane.admin_kubeconfig().is_file());
    let client = plane.admin_client();

    // A Node as a kubelet would register it, made Ready through the status subresource.
    let nodes: Api<Node> = Api::all(client.clone());
    let node = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": "worker-0", "labels": { "kubernetes.io/hostname": "worker-0" } },
    }))?;
    nodes.create(&PostParams::default(), &node).await?;
    let resources = json!({ "cpu": "8", "memory": "32Gi", "pods": "110" });
    let status = json!({ "status": {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "xpu-testkit",
        }],
    }});
    nodes.patch_status("worker-0", &PatchParams::default(), &Patch::Merge(&status)).await?;
    // The TaintNodesByCondition admission plugin gives every new Node the not-ready:NoSchedule
    // taint; the node-lifecycle controller lifts it once the Node reports Ready. That controller
    // would also mark this kubelet-less Node unreachable, so the test lifts the taint itself.
    let untaint = json!({ "spec": { "taints": null } });
    nodes.patch("worker-0", &PatchParams::default(), &Patch::Merge(&untaint)).await?;

    // The real kube-scheduler binds a Pod to it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": "sleeper" },
        "spec": { "containers": [{
            "name": "main",
            "image": "registry.k8s.io/pause:3.10",
            "resources": { "requests": { "cpu": "100m", "memory": "64Mi" } },
        }]},
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let bound_to = eventually("Pod default/sleeper bound by kube-scheduler", || async {
        let pod = pods.get("sleeper").await?;
        Ok(pod.spec.and_then(|s| s.node_name))
    })
    .await?;
    assert_eq!(bound_to, "worker-0");

    // The Job controller of kube-controller-manager makes the Job's Pod.
    let jobs: Api<Job> = Api::namespaced(client.clone(), "default");
    let job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": { "name": "one-shot" },
        "spec": { "backoffLimit": 0, "template": { "spec": {
            "restartPolicy": "Never",
            "containers": [{ "name": "main", "image": "registry.k8s.io/pause:3.10" }],
        }}},
    }))?;
    jobs.create(&PostParams::default(), &job).await?;
    let by_job = ListParams::default().labels("batch.kubernetes.io/job-name=one-shot");
    let job_pod = eventually("a Pod of Job default/one-shot", || async {
        Ok(pods.list(&by_job).await?.items.into_iter().next())
    })
    .await?;
    let owners = job_pod.metadata.owner_references.unwrap_or_default();
    assert!(
        owners.iter().any(|o| o.kind == "Job" && o.name == "one-shot"),
        "the Job's Pod is owned by the Job: {owners:?}"
    );

    // A ServiceAccount token authenticates (RBAC then forbids what it was not granted).
    let sa_kubeconfig = plane.service_account_kubeconfig("tenant", "runner").await?;
    let kubeconfig = kube::config::Kubeconfig::read_from(&sa_kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let as_runner: Api<Pod> = Api::namespaced(kube::Client::try_from(config)?, "tenant");
    match as_runner.list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "authenticated, then denied by RBAC: {status:?}");
            assert!(status.message.contains("system:serviceaccount:tenant:runner"), "{status:?}");
        }
        other => panic!("listing Pods as tenant/runner must be forbidden: {other:?}"),
    }
    Ok(())
}
