//! Tenants on a shared cluster: what a user with rights only in its own namespace can do to
//! `xpu k8s scheduler`, tried for real. A real control plane with RBAC; each tenant is a user
//! the admin impersonates (`Impersonate-User`), bound to an editor's Role in its namespace
//! only; the scheduler runs with the ServiceAccount `deploy/kubernetes` binds.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};

use k8s_support::*;

/// A namespace `ns` whose only editor is user `user`, and a client acting as that user.
async fn tenant(cp: &ControlPlane, ns: &str, user: &str) -> Client {
    let admin = cp.admin_client();
    let pp = PostParams::default();
    let n: Namespace = serde_json::from_value(json!({ "metadata": { "name": ns } })).unwrap();
    Api::<Namespace>::all(admin.clone()).create(&pp, &n).await.unwrap();
    // No controller-manager: the namespace's default ServiceAccount is made here.
    let sa: ServiceAccount =
        serde_json::from_value(json!({ "metadata": { "name": "default" } })).unwrap();
    Api::<ServiceAccount>::namespaced(admin.clone(), ns).create(&pp, &sa).await.unwrap();
    // What a namespace's editor holds over its workloads (the built-in `edit` role is filled
    // by the controller-manager's aggregation, which these planes do not run).
    let role: Role = serde_json::from_value(json!({
        "metadata": { "name": "tenant" },
        "rules": [
            { "apiGroups": [""], "resources": ["pods", "configmaps", "secrets", "services"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"] },
            { "apiGroups": ["batch"], "resources": ["jobs"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"] },
        ],
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), ns).create(&pp, &role).await.unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": { "name": format!("{user}-tenant") },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant" },
        "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user }],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin, ns).create(&pp, &rb).await.unwrap();
    cp.impersonating(user, &[]).await.unwrap()
}

/// A control plane with the scheduler's manifests applied, and two tenants: alice in team-a
/// and bob in team-b.
struct Shared {
    cp: ControlPlane,
    admin: Client,
    kubeconfig: std::path::PathBuf,
    alice: Client,
    bob: Client,
}

async fn shared() -> Shared {
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let alice = tenant(&cp, "team-a", "alice").await;
    let bob = tenant(&cp, "team-b", "bob").await;
    Shared { cp, admin, kubeconfig, alice, bob }
}

/// A pod for scheduler `xpu` asking `gpus` NVIDIA GPUs and 100m CPU, with `labels`.
fn gpu_pod(name: &str, gpus: u32, labels: &[(&str, &str)]) -> Pod {
    pod(name, "nvidia.com/gpu", gpus, labels)
}

async fn get(client: &Client, ns: &str, name: &str) -> Pod {
    Api::<Pod>::namespaced(client.clone(), ns).get(name).await.unwrap()
}

/// The pod's `PodScheduled=False` message, if it has one.
fn waiting_reason(p: &Pod) -> Option<String> {
    p.status.as_ref()?.conditions.as_ref()?.iter().find_map(|c| {
        (c.type_ == "PodScheduled" && c.status == "False").then(|| c.message.clone()).flatten()
    })
}

/// Creates `p` as `client` in `ns` and waits until it is bound; returns how long that took.
async fn bind_time(client: &Client, ns: &str, p: &Pod, limit: Duration) -> Option<Duration> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let name = p.metadata.name.clone().unwrap();
    let t0 = Instant::now();
    api.create(&PostParams::default(), p).await.unwrap();
    let bound =
        wait_until(limit, || async { node_of(&api.get(&name).await.unwrap()).is_some() }).await;
    bound.then(|| t0.elapsed())
}

/// Waits until pod `ns/name` says why it waits with `text` in the message.
async fn says(admin: &Client, ns: &str, name: &str, text: &str) -> String {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let last = waiting_reason(&get(admin, ns, name).await);
        if last.as_deref().is_some_and(|m| m.contains(text)) {
            return last.unwrap_or_default();
        }
        assert!(Instant::now() < end, "{ns}/{name} should say {text:?}; it says {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A pod bound straight to `node` (as a tenant may write `spec.nodeName` itself), marked Running.
async fn running_on(admin: &Client, as_user: &Client, ns: &str, mut p: Pod, node: &str) {
    p.spec.as_mut().unwrap().node_name = Some(node.into());
    let name = p.metadata.name.clone().unwrap();
    Api::<Pod>::namespaced(as_user.clone(), ns).create(&PostParams::default(), &p).await.unwrap();
    let patch = json!({ "status": { "phase": "Running" } });
    Api::<Pod>::namespaced(admin.clone(), ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// Item 1, and queue quotas: a label naming another tenant's queue is refused and holds nobody
/// up; a queue the admin shares between namespaces keeps to its quota, which no label steps
/// around.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_cannot_put_a_pod_in_another_tenants_queue() {
    let _turn = TURN.lock().await;
    let Shared { cp, admin, kubeconfig, alice, bob } = shared().await;
    let carol = tenant(&cp, "team-c", "carol").await;
    let dave = tenant(&cp, "team-d", "dave").await;

    // RBAC holds as a tenant has it: nothing in another namespace, nor in the scheduler's.
    let denied = Api::<Pod>::namespaced(alice.clone(), "team-b")
        .create(&PostParams::default(), &gpu_pod("intruder", 1, &[]))
        .await;
    assert!(matches!(denied, Err(kube::Error::Api(ref e)) if e.code == 403), "{denied:?}");
    let cms: Api<ConfigMap> = Api::namespaced(alice.clone(), "xpu-system");
    let denied = cms
        .patch(
            "xpu-queues",
            &PatchParams::default(),
            &Patch::Merge(json!({ "data": { "queues.yaml": "queues: []" } })),
        )
        .await;
    assert!(matches!(denied, Err(kube::Error::Api(ref e)) if e.code == 403), "{denied:?}");

    // The admin shares one queue between team-c and team-d, with a quota of 2 GPUs.
    let mapping = "queues:\n  - name: shared\n    namespaces: [team-c, team-d]\n    quota: { nvidia.com/gpu: 2 }\n";
    Api::<ConfigMap>::namespaced(admin.clone(), "xpu-system")
        .patch(
            "xpu-queues",
            &PatchParams::default(),
            &Patch::Merge(json!({ "data": { "queues.yaml": mapping } })),
        )
        .await
        .unwrap();

    add_node(&admin, &NodeDef::new("gpu-1").gpus("nvidia.com/gpu", 8)).await;
    add_node(&admin, &NodeDef::new("gpu-2").gpus("nvidia.com/gpu", 4)).await;
    // Another team's work holds 5 of gpu-1's GPUs: 3 and 4 are free.
    running_on(&admin, &bob, "team-b", gpu_pod("running", 5, &[]), "gpu-1").await;

    let sched = XpuScheduler::start(&cp, &kubeconfig, "tenants", &[]);

    // Item 1: alice's 5-GPU pod that cannot fit yet, labelled into bob's queue.
    let forged = gpu_pod("forged", 5, &[("xpu.dev/queue", "team-b")]);
    Api::<Pod>::namespaced(alice.clone(), "team-a")
        .create(&PostParams::default(), &forged)
        .await
        .unwrap();
    let why = says(&admin, "team-a", "forged", "may not use queue").await;
    assert!(
        why.contains(
            "metadata.labels[xpu.dev/queue]: namespace team-a may not use queue \"team-b\""
        ),
        "{why}"
    );
    let took = bind_time(&bob, "team-b", &gpu_pod("fits", 1, &[]), Duration::from_secs(10)).await;
    eprintln!("bob's fitting pod bound in {took:?} with alice's forged pod waiting");
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(2)),
        "bound in {took:?}\n{}",
        sched.log_text()
    );
    // Alice's own label (her namespace's queue) is fine: the pod is only too big.
    let own = gpu_pod("own-queue", 5, &[("xpu.dev/queue", "team-a")]);
    Api::<Pod>::namespaced(alice.clone(), "team-a")
        .create(&PostParams::default(), &own)
        .await
        .unwrap();
    says(&admin, "team-a", "own-queue", "nvidia.com/gpu").await;

    // The shared queue keeps to its quota of 2 GPUs across both namespaces.
    for (client, ns, name) in
        [(&carol, "team-c", "c-1"), (&dave, "team-d", "d-1"), (&carol, "team-c", "c-2")]
    {
        Api::<Pod>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &gpu_pod(name, 1, &[]))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let two = wait_until(Duration::from_secs(10), || async {
        node_of(&get(&admin, "team-c", "c-1").await).is_some()
            && node_of(&get(&admin, "team-d", "d-1").await).is_some()
    })
    .await;
    assert!(two, "the first two pods of the shared queue bind\n{}", sched.log_text());
    let why = says(&admin, "team-c", "c-2", "queue shared is at its quota").await;
    assert!(
        why.contains("quota of 2 nvidia.com/gpu: 2 nvidia.com/gpu bound, this asks 1"),
        "{why}"
    );
    // Dave cannot step around it by naming another queue.
    let around = gpu_pod("around", 1, &[("xpu.dev/queue", "team-d")]);
    Api::<Pod>::namespaced(dave.clone(), "team-d")
        .create(&PostParams::default(), &around)
        .await
        .unwrap();
    says(&admin, "team-d", "around", "its queues: shared").await;
    // A quota freed is a quota used: c-1 ends, c-2 binds.
    succeed(&admin, "team-c", "c-1").await;
    let freed = wait_until(Duration::from_secs(15), || async {
        node_of(&get(&admin, "team-c", "c-2").await).is_some()
    })
    .await;
    assert!(freed, "c-2 binds once c-1 ended\n{}", sched.log_text());
}

/// Item 3: requests that overflow when summed wait, naming the field; the same requests on a
/// pod a tenant binds itself fill its node instead of counting as nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_overflow_wait_or_fill_their_node() {
    let _turn = TURN.lock().await;
    let Shared { cp, admin, kubeconfig, alice, bob } = shared().await;
    add_node(&admin, &NodeDef::new("gpu-1").gpus("nvidia.com/gpu", 8)).await;
    add_node(&admin, &NodeDef { cpu: "4".into(), ..NodeDef::new("cpu-1") }).await;
    let sched = XpuScheduler::start(&cp, &kubeconfig, "overflow", &[]);

    // Item 3: requests that overflow when summed wait, naming the field.
    let mut overflow = pod("overflow", "", 0, &[]);
    let spec = overflow.spec.as_mut().unwrap();
    let big = json!({ "requests": { "cpu": "9223372036854775808m" }, "limits": { "cpu": "9223372036854775808m" } });
    let bigger = json!({ "requests": { "cpu": "9223372036854777856m" }, "limits": { "cpu": "9223372036854777856m" } });
    spec.containers[0].resources = Some(serde_json::from_value(big).unwrap());
    let mut second = spec.containers[0].clone();
    second.name = "d".into();
    second.resources = Some(serde_json::from_value(bigger).unwrap());
    spec.containers.push(second);
    Api::<Pod>::namespaced(alice.clone(), "team-a")
        .create(&PostParams::default(), &overflow)
        .await
        .unwrap();
    says(
        &admin,
        "team-a",
        "overflow",
        "spec.containers[1].resources: the pod's cpu requests add up to more than xpu can count",
    )
    .await;
    let mut gpus = gpu_pod("overflow-gpus", 0, &[]);
    let spec = gpus.spec.as_mut().unwrap();
    let huge = json!({ "limits": { "nvidia.com/gpu": "9223372036854775808" } });
    spec.containers[0].resources = Some(serde_json::from_value(huge).unwrap());
    let mut second = spec.containers[0].clone();
    second.name = "d".into();
    spec.containers.push(second);
    Api::<Pod>::namespaced(alice.clone(), "team-a")
        .create(&PostParams::default(), &gpus)
        .await
        .unwrap();
    says(&admin, "team-a", "overflow-gpus", "nvidia.com/gpu requests add up").await;

    // The same requests on a pod alice binds herself fill cpu-1: bob's 1-CPU pod aimed there
    // waits instead of landing on a node xpu would count as empty.
    let mut squatter = overflow.clone();
    squatter.metadata.name = Some("squatter".into());
    running_on(&admin, &alice, "team-a", squatter, "cpu-1").await;
    let mut aimed = pod("aimed", "", 0, &[]);
    let spec = aimed.spec.as_mut().unwrap();
    spec.node_selector = Some([("kubernetes.io/hostname".to_owned(), "cpu-1".to_owned())].into());
    spec.containers[0].resources =
        Some(serde_json::from_value(json!({ "requests": { "cpu": "1" } })).unwrap());
    Api::<Pod>::namespaced(bob.clone(), "team-b")
        .create(&PostParams::default(), &aimed)
        .await
        .unwrap();
    says(&admin, "team-b", "aimed", "Insufficient cpu").await;
    assert!(node_of(&get(&admin, "team-b", "aimed").await).is_none());
    let warned = wait_until(Duration::from_secs(10), || async {
        sched.log_text().contains("a bound pod's requests cannot be read")
    })
    .await;
    assert!(warned, "the scheduler warns about team-a/squatter\n{}", sched.log_text());
}

/// Item 2: while one tenant floods the cluster with pods that cannot fit, another tenant's pod
/// that fits binds within 2 s, during the flood, after it, and right after a restart (which
/// must not write every waiting pod's reason again before binding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_waiting_pods_does_not_delay_another_tenants_bind() {
    let _turn = TURN.lock().await;
    let Shared { cp, admin, kubeconfig, alice, bob } = shared().await;
    for i in 0..4 {
        add_node(&admin, &NodeDef::new(format!("n{i}")).gpus("nvidia.com/gpu", 8)).await;
    }
    let mut sched = XpuScheduler::start(&cp, &kubeconfig, "flood", &[]);

    const FLOOD: usize = 2000;
    let flood = {
        let alice = alice.clone();
        tokio::spawn(async move {
            let api: Api<Pod> = Api::namespaced(alice, "team-a");
            let pp = PostParams::default();
            let all: Vec<Pod> =
                (0..FLOOD).map(|i| gpu_pod(&format!("flood-{i}"), 9, &[])).collect();
            for chunk in all.chunks(50) {
                for r in
                    futures_util::future::join_all(chunk.iter().map(|p| api.create(&pp, p))).await
                {
                    r.unwrap();
                }
            }
        })
    };
    // During the flood.
    wait_until(Duration::from_secs(120), || async {
        pods(&admin, "team-a").await.len() >= FLOOD / 2
    })
    .await;
    let during =
        bind_time(&bob, "team-b", &gpu_pod("during", 1, &[]), Duration::from_secs(60)).await;
    flood.await.unwrap();
    // Right after it, with the reasons of up to 2,000 pods still to write.
    let after = bind_time(&bob, "team-b", &gpu_pod("after", 1, &[]), Duration::from_secs(60)).await;
    eprintln!("bob's pod bound in {during:?} during the flood and {after:?} after it");
    assert!(
        during.is_some_and(|t| t < Duration::from_secs(2)),
        "during: {during:?}\n{}",
        sched.log_text()
    );
    assert!(
        after.is_some_and(|t| t < Duration::from_secs(2)),
        "after: {after:?}\n{}",
        sched.log_text()
    );
    // Every waiting pod is told why, in time.
    let told = wait_until(Duration::from_secs(120), || async {
        pods(&admin, "team-a").await.iter().all(|p| waiting_reason(p).is_some())
    })
    .await;
    assert!(told, "every flooded pod says why it waits\n{}", sched.log_text());

    // A restart: the new scheduler binds bob's pod within 2 s of its first cycle.
    sched.kill9();
    let sched = XpuScheduler::start(&cp, &kubeconfig, "flood-restarted", &[]);
    let synced = wait_until(Duration::from_secs(60), || async {
        sched.log_text().contains("caches synced")
    })
    .await;
    assert!(synced, "{}", sched.log_text());
    let restarted =
        bind_time(&bob, "team-b", &gpu_pod("restarted", 1, &[]), Duration::from_secs(60)).await;
    eprintln!("bob's pod bound in {restarted:?} after a restart");
    assert!(
        restarted.is_some_and(|t| t < Duration::from_secs(2)),
        "restarted: {restarted:?}\n{}",
        sched.log_text()
    );
}

/// Item 4: a Lease renewed "in 2999" by a holder that is gone costs the replicas one lease
/// duration, not for ever: a tenant's pod binds soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewed_in_the_future_costs_one_lease_duration() {
    let _turn = TURN.lock().await;
    let Shared { cp, admin, kubeconfig, bob, .. } = shared().await;
    add_node(&admin, &NodeDef::new("n0")).await;
    let lease: Lease = serde_json::from_value(json!({
        "metadata": { "name": "xpu", "namespace": "xpu-system" },
        "spec": { "holderIdentity": "a-replica-whose-clock-ran-ahead", "leaseDurationSeconds": 6,
                  "acquireTime": "2999-01-01T00:00:00.000000Z", "renewTime": "2999-01-01T00:00:00.000000Z",
                  "leaseTransitions": 3 }
    }))
    .unwrap();
    Api::<Lease>::namespaced(admin.clone(), "xpu-system")
        .create(&PostParams::default(), &lease)
        .await
        .unwrap();
    let le = [
        "--leader-elect",
        "--leader-elect-resource-namespace=xpu-system",
        "--leader-elect-lease-duration=6",
        "--leader-elect-renew-deadline=4",
        "--leader-elect-retry-period=1",
    ];
    let started = Instant::now();
    let replicas = [
        XpuScheduler::start(&cp, &kubeconfig, "replica-a", &le),
        XpuScheduler::start(&cp, &kubeconfig, "replica-b", &le),
    ];
    let took =
        bind_time(&bob, "team-b", &pod("after-skew", "", 0, &[]), Duration::from_secs(30)).await;
    eprintln!("bound {took:?} after creation, {:?} after the replicas started", started.elapsed());
    assert!(
        took.is_some() && started.elapsed() < Duration::from_secs(6 + 8),
        "a replica takes the lease within one lease duration (6 s) and a few retries\n{}\n{}",
        replicas[0].log_text(),
        replicas[1].log_text()
    );
    let holder = Api::<Lease>::namespaced(admin, "xpu-system").get("xpu").await.unwrap();
    let spec = holder.spec.unwrap();
    assert_ne!(spec.holder_identity.as_deref(), Some("a-replica-whose-clock-ran-ahead"));
    assert_eq!(spec.lease_transitions, Some(4));
}
