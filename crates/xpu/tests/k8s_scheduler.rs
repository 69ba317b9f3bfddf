//! `xpu k8s scheduler` against a real control plane (etcd, kube-apiserver, and the real Job
//! controller where a Job is involved), run with the token of the ServiceAccount that
//! `deploy/kubernetes` binds. No kubelet: the test creates Node objects with their status and
//! marks pods Succeeded where a kubelet would.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use xpu_testkit::kube::ControlPlaneOptions;

use k8s_support::*;

const TPU_ACC: &str = "cloud.google.com/gke-tpu-accelerator";
const TPU_TOPO: &str = "cloud.google.com/gke-tpu-topology";
const POOL: &str = "cloud.google.com/gke-nodepool";

fn tpu_host(name: &str, pool: &str, topology: &str) -> NodeDef {
    NodeDef::new(name)
        .gpus("google.com/tpu", 4)
        .label(TPU_ACC, "tpu-v5p-slice")
        .label(TPU_TOPO, topology)
        .label(POOL, pool)
        .label("cloud.google.com/gke-flex-start", "true")
}

/// The GKE seed's multi-host Job as a real batch/v1 Job: the Job controller makes the pods, xpu
/// binds both to the two hosts of the one pool of the right topology, the "kubelet" finishes
/// them and the Job completes. On the same cluster: a node with a malformed topology label is
/// skipped with an Event, and a pod with pod affinity nobody meets is told which rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpu_multihost_job_lands_on_one_slice_and_completes() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_controller_manager()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;

    // A pool of the wrong topology (4 hosts of 2x2x4), a pool of the right topology with a host
    // that is not ready, and the one pool that fits.
    for i in 0..4 {
        add_node(&admin, &tpu_host(&format!("wrong-{i}"), "wrong-topology", "2x2x4")).await;
    }
    add_node(&admin, &tpu_host("half-0", "half", "2x2x2")).await;
    add_node(&admin, &NodeDef { ready: false, ..tpu_host("half-1", "half", "2x2x2") }).await;
    add_node(&admin, &tpu_host("slice-0", "slice", "2x2x2")).await;
    add_node(&admin, &tpu_host("slice-1", "slice", "2x2x2")).await;
    add_node(
        &admin,
        &NodeDef::new("broken").label(TPU_ACC, "tpu-v5p-slice").label(TPU_TOPO, "2x2xbanana"),
    )
    .await;

    let mut sched = XpuScheduler::start(&cp, &kubeconfig, "tpu", &[]);

    let docs = documents(&repo().join("docs/examples/tpu-multihost-job.yaml"));
    for d in &docs {
        create(&admin, d, false).await.unwrap();
    }
    let jobs: Api<Job> = Api::namespaced(admin.clone(), "default");
    let bound = wait_until(Duration::from_secs(60), || async {
        let ps = pods(&admin, "default").await;
        ps.len() == 2 && ps.iter().all(|p| node_of(p).is_some())
    })
    .await;
    let ps = pods(&admin, "default").await;
    assert!(
        bound,
        "both pods bound: {:?}\n{}",
        ps.iter()
            .map(|p| (p.metadata.name.clone(), node_of(p).map(str::to_owned)))
            .collect::<Vec<_>>(),
        sched.log_text()
    );
    let mut nodes: Vec<&str> = ps.iter().filter_map(node_of).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, ["slice-0", "slice-1"], "one pod per host of the one fitting slice");

    for p in &ps {
        succeed(&admin, "default", p.metadata.name.as_deref().unwrap()).await;
    }
    let complete = wait_until(Duration::from_secs(60), || async {
        jobs.get("job-1")
            .await
            .ok()
            .and_then(|j| j.status)
            .and_then(|s| s.conditions)
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Complete" && c.status == "True"))
    })
    .await;
    assert!(complete, "the Job completes: {:?}", jobs.get("job-1").await.unwrap().status);

    // The malformed node: skipped, said in the log and as an Event on the node.
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    let warned = wait_until(Duration::from_secs(20), || async {
        events.list(&ListParams::default()).await.unwrap().items.iter().any(|e| {
            e.involved_object.name.as_deref() == Some("broken")
                && e.message.as_deref().is_some_and(|m| m.contains("2x2xbanana"))
        })
    })
    .await;
    assert!(warned, "an Event names the bad label");
    assert!(sched.log_text().contains("node skipped"), "{}", sched.log_text());

    // Pod affinity to a pod nobody runs: PodScheduled=False naming the rule, never a bind.
    let podsapi: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut p = pod("affine", "nvidia.com/gpu", 0, &[]);
    p.spec.as_mut().unwrap().affinity = Some(
        serde_json::from_value(json!({ "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
            { "labelSelector": { "matchLabels": { "app": "x" } }, "topologyKey": "kubernetes.io/hostname" }
        ]}}))
        .unwrap(),
    );
    podsapi.create(&PostParams::default(), &p).await.unwrap();
    let told = wait_until(Duration::from_secs(30), || async {
        let p = podsapi.get("affine").await.unwrap();
        p.status.and_then(|s| s.conditions).is_some_and(|c| {
            c.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
                    && c.message
                        .as_deref()
                        .is_some_and(|m| m.contains("didn't match pod affinity rules"))
            })
        })
    })
    .await;
    assert!(told, "the pod is told which rule: {:?}", podsapi.get("affine").await.unwrap().status);
    assert!(node_of(&podsapi.get("affine").await.unwrap()).is_none());
    assert!(sched.child.try_wait().unwrap().is_none(), "the scheduler is still running");
    sched.kill9();
}

/// Randomized gangs on a small GPU cluster: whenever the test looks (after every bind it sees),
/// a gang is either unbound or becomes fully bound before anything else changes; gangs that
/// cannot all fit at once run one after the other (the test finishes whole gangs only), and all
/// of them end up run: no deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gangs_bind_whole_and_take_turns() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    // 4 nodes x 4 GPUs = 16 GPUs.
    for i in 0..4 {
        add_node(&admin, &NodeDef::new(format!("gpu-{i}")).gpus("nvidia.com/gpu", 4)).await;
    }
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "gangs", &[]);

    // Gangs of 2..=4 pods x 2..=4 GPUs, seeded: each alone fits, most pairs do not.
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let podsapi: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut sizes: BTreeMap<String, usize> = BTreeMap::new();
    for g in 0..8 {
        let size = 2 + next(3) as usize;
        let gpus = 2 + next(3) as u32;
        let name = format!("g{g}");
        sizes.insert(name.clone(), size);
        let size_s = size.to_string();
        for m in 0..size {
            let p = pod(
                &format!("{name}-{m}"),
                "nvidia.com/gpu",
                gpus,
                &[("xpu.dev/gang", &name), ("xpu.dev/gang-size", &size_s)],
            );
            podsapi.create(&PostParams::default(), &p).await.unwrap();
        }
    }

    let mut done: BTreeMap<String, bool> = sizes.keys().map(|k| (k.clone(), false)).collect();
    let mut rounds = 0;
    while done.values().any(|d| !d) {
        rounds += 1;
        assert!(rounds < 40, "gangs still waiting after 40 rounds: {done:?}");
        // Wait for the scheduler to settle: no gang partially bound, and at least one bound
        // gang not yet finished. A partial gang that never completes fails here.
        let last = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let settled = wait_until(Duration::from_secs(30), || {
            let admin = admin.clone();
            let sizes = sizes.clone();
            let done = done.clone();
            let last = last.clone();
            async move {
                let ps = pods(&admin, "default").await;
                let mut bound: HashMap<String, usize> = HashMap::new();
                for p in &ps {
                    let g = p.metadata.labels.as_ref().unwrap()["xpu.dev/gang"].clone();
                    if node_of(p).is_some()
                        && p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Succeeded")
                    {
                        *bound.entry(g).or_default() += 1;
                    }
                }
                *last.lock().unwrap() = format!("{bound:?}");
                let partial = bound.iter().any(|(g, n)| *n != sizes[g]);
                !partial && bound.keys().any(|g| !done[g])
            }
        })
        .await;
        assert!(settled, "a gang stayed partially bound, or nothing ran: {}", last.lock().unwrap());
        // Check capacity and finish every running gang. The scheduler may be binding the next
        // gang while this lists: a gang seen partly bound here is left for the next round
        // (finishing its bound part would strand the rest), and the settle check above fails
        // the test if it stays partial.
        let ps = pods(&admin, "default").await;
        let mut bound_now: HashMap<String, usize> = HashMap::new();
        for p in &ps {
            if node_of(p).is_some()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Succeeded")
            {
                let g = p.metadata.labels.as_ref().unwrap()["xpu.dev/gang"].clone();
                *bound_now.entry(g).or_default() += 1;
            }
        }
        let mut per_node: HashMap<String, u32> = HashMap::new();
        let mut running: Vec<String> = Vec::new();
        for p in &ps {
            let Some(n) = node_of(p) else { continue };
            if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded") {
                continue;
            }
            let gpus: u32 = p.spec.as_ref().unwrap().containers[0]
                .resources
                .as_ref()
                .unwrap()
                .limits
                .as_ref()
                .unwrap()["nvidia.com/gpu"]
                .0
                .parse()
                .unwrap();
            *per_node.entry(n.to_owned()).or_default() += gpus;
            let g = &p.metadata.labels.as_ref().unwrap()["xpu.dev/gang"];
            if bound_now[g] == sizes[g] {
                running.push(p.metadata.name.clone().unwrap());
                done.insert(g.clone(), true);
            }
        }
        assert!(per_node.values().all(|&g| g <= 4), "no node over-committed: {per_node:?}");
        for name in running {
            succeed(&admin, "default", &name).await;
        }
    }
}

/// `kill -9` of the scheduler while it binds 2,000 pending pods, then a restart: every pod ends
/// bound, exactly once (a second binding of a bound pod is refused by the API server and would
/// show as a bind error), no node over-committed, no gang partial. Then two replicas with
/// `--leader-elect`: only one binds; killing it, the other takes over within 15 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mid_binding_and_leader_failover() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    for i in 0..100 {
        add_node(&admin, &NodeDef::new(format!("n{i:03}")).gpus("nvidia.com/gpu", 8)).await;
    }
    // 2,000 pods: 1,600 CPU pods, 100 one-GPU pods, 50 gangs of 6 x 1 GPU.
    let podsapi: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut creates = Vec::new();
    for i in 0..2000 {
        let p = if i < 1600 {
            pod(&format!("cpu-{i}"), "", 0, &[])
        } else if i < 1700 {
            pod(&format!("gpu-{i}"), "nvidia.com/gpu", 1, &[])
        } else {
            let g = format!("gang-{}", (i - 1700) / 6);
            pod(
                &format!("{g}-{}", (i - 1700) % 6),
                "nvidia.com/gpu",
                1,
                &[("xpu.dev/gang", &g), ("xpu.dev/gang-size", "6")],
            )
        };
        creates.push(p);
    }
    let pp = PostParams::default();
    for chunk in creates.chunks(50) {
        let futs = chunk.iter().map(|p| podsapi.create(&pp, p));
        for r in futures_util::future::join_all(futs).await {
            r.unwrap();
        }
    }
    let mut first = XpuScheduler::start(&cp, &kubeconfig, "first", &[]);
    let some = wait_until(Duration::from_secs(60), || async {
        pods(&admin, "default").await.iter().filter(|p| node_of(p).is_some()).count() >= 200
    })
    .await;
    assert!(some, "binding started: {}", first.log_text());
    first.kill9();
    let after_kill = pods(&admin, "default").await.iter().filter(|p| node_of(p).is_some()).count();
    eprintln!("bound when killed: {after_kill} of 2000");
    let second = XpuScheduler::start(&cp, &kubeconfig, "second", &[]);
    let all = wait_until(Duration::from_secs(120), || async {
        pods(&admin, "default").await.iter().all(|p| node_of(p).is_some())
    })
    .await;
    let ps = pods(&admin, "default").await;
    assert!(
        all,
        "{} of 2000 bound\n{}",
        ps.iter().filter(|p| node_of(p).is_some()).count(),
        second.log_text()
    );
    let mut gpus: HashMap<&str, u32> = HashMap::new();
    let mut gang_nodes: HashMap<String, usize> = HashMap::new();
    for p in &ps {
        let n = node_of(p).unwrap();
        let g = p.spec.as_ref().unwrap().containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .map_or(0, |l| l.get("nvidia.com/gpu").map_or(0, |q| q.0.parse::<u32>().unwrap()));
        *gpus.entry(n).or_default() += g;
        if let Some(gang) = p.metadata.labels.as_ref().and_then(|l| l.get("xpu.dev/gang")) {
            *gang_nodes.entry(gang.clone()).or_default() += 1;
        }
    }
    assert!(gpus.values().all(|&g| g <= 8), "no node over-committed: {gpus:?}");
    assert!(gang_nodes.values().all(|&n| n == 6), "every gang whole: {gang_nodes:?}");
    let log = format!("{}{}", first.log_text(), second.log_text());
    assert!(
        !log.contains("bind failed"),
        "no pod bound twice (the API refuses a second binding):\n{log}"
    );
    drop(second);

    // Leader election: two replicas, one leads.
    let le = [
        "--leader-elect",
        "--leader-elect-resource-namespace=xpu-system",
        "--leader-elect-lease-duration=8",
        "--leader-elect-renew-deadline=6",
        "--leader-elect-retry-period=1",
    ];
    let mut replicas = [
        XpuScheduler::start(&cp, &kubeconfig, "replica-a", &le),
        XpuScheduler::start(&cp, &kubeconfig, "replica-b", &le),
    ];
    for i in 0..20 {
        podsapi.create(&PostParams::default(), &pod(&format!("le-{i}"), "", 0, &[])).await.unwrap();
    }
    let bound = wait_until(Duration::from_secs(60), || async {
        pods(&admin, "default").await.iter().all(|p| node_of(p).is_some())
    })
    .await;
    assert!(bound, "the leader binds\n{}\n{}", replicas[0].log_text(), replicas[1].log_text());
    let binds: Vec<usize> =
        replicas.iter().map(|r| r.log_text().matches(" bound").count()).collect();
    assert!((binds[0] == 0) != (binds[1] == 0), "exactly one replica binds: {binds:?}");
    let leader = usize::from(binds[0] == 0);
    replicas[leader].kill9();
    let standby = &replicas[1 - leader];
    let killed_at = std::time::Instant::now();
    for i in 0..5 {
        podsapi
            .create(&PostParams::default(), &pod(&format!("after-{i}"), "", 0, &[]))
            .await
            .unwrap();
    }
    let taken_over = wait_until(Duration::from_secs(15), || async {
        pods(&admin, "default").await.iter().all(|p| node_of(p).is_some())
    })
    .await;
    assert!(
        taken_over,
        "the standby binds within 15 s of the leader's death\n{}",
        standby.log_text()
    );
    eprintln!("standby took over in {:?}", killed_at.elapsed());
}

/// The benches' null binder (`--null-binder`) binds every waiting pod, whatever it asks, to the
/// Ready nodes in turn, skipping a node that is not Ready, and leaves other schedulers' pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_null_binder_binds_every_pod_to_the_ready_nodes_in_turn() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    for i in 0..3 {
        add_node(&admin, &NodeDef::new(format!("n{i}")).gpus("nvidia.com/gpu", 1)).await;
    }
    let mut down = NodeDef::new("n3").gpus("nvidia.com/gpu", 1);
    down.ready = false;
    add_node(&admin, &down).await;
    let podsapi: Api<Pod> = Api::namespaced(admin.clone(), "default");
    // Six pods of 4 GPUs each: no node fits one, and the null binder binds them all.
    for i in 0..6 {
        podsapi
            .create(&PostParams::default(), &pod(&format!("p{i}"), "nvidia.com/gpu", 4, &[]))
            .await
            .unwrap();
    }
    let mut other = pod("other", "nvidia.com/gpu", 1, &[]);
    other.spec.as_mut().unwrap().scheduler_name = Some("someone-else".into());
    podsapi.create(&PostParams::default(), &other).await.unwrap();
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "null", &["--null-binder"]);
    let bound =
        wait_until(Duration::from_secs(30), || {
            let admin = admin.clone();
            async move {
                pods(&admin, "default").await.iter().filter(|p| node_of(p).is_some()).count() == 6
            }
        })
        .await;
    let ps = pods(&admin, "default").await;
    assert!(bound, "{}", report(&ps));
    let mut per_node: HashMap<&str, usize> = HashMap::new();
    for p in &ps {
        if p.metadata.name.as_deref() == Some("other") {
            assert_eq!(node_of(p), None, "another scheduler's pod was bound");
            continue;
        }
        *per_node.entry(node_of(p).unwrap()).or_default() += 1;
    }
    assert_eq!(per_node.get("n3"), None, "bound to a node that is not Ready: {per_node:?}");
    assert!(per_node.values().all(|&n| n == 2), "not in turn: {per_node:?}");
}
