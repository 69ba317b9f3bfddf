//! Inter-pod constraints on a real control plane (etcd + kube-apiserver, RBAC): pod affinity
//! and anti-affinity, topology spread, `matchFields`, a JobSet's exclusive placement of
//! multi-host TPU slices and LeaderWorkerSet groups, the pods written as those controllers
//! write them (labels, annotations and injected affinity from their published APIs; the
//! controllers themselves do not run). `xpu k8s scheduler` runs with the ServiceAccount token
//! `deploy/kubernetes` binds.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use xpu_testkit::kube::ControlPlaneOptions;

use k8s_support::*;

const POOL: &str = "cloud.google.com/gke-nodepool";
const ZONE: &str = "topology.kubernetes.io/zone";

fn waiting_reason(p: &Pod) -> Option<String> {
    p.status.as_ref()?.conditions.as_ref()?.iter().find_map(|c| {
        (c.type_ == "PodScheduled" && c.status == "False").then(|| c.message.clone()).flatten()
    })
}

async fn says(client: &Client, name: &str, text: &str) -> String {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let last = waiting_reason(&api.get(name).await.unwrap());
        if last.as_deref().is_some_and(|m| m.contains(text)) {
            return last.unwrap_or_default();
        }
        assert!(Instant::now() < end, "{name} should say {text:?}; it says {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A pod for scheduler `xpu` from JSON fragments merged into `pod(...)`.
fn pod_with(name: &str, res: &str, n: u32, labels: &[(&str, &str)], spec: Value) -> Pod {
    let mut v = serde_json::to_value(pod(name, res, n, labels)).unwrap();
    if let (Some(s), Some(extra)) = (v["spec"].as_object_mut(), spec.as_object()) {
        for (k, x) in extra {
            s.insert(k.clone(), x.clone());
        }
    }
    serde_json::from_value(v).unwrap()
}

async fn create(client: &Client, p: &Pod) {
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), p)
        .await
        .unwrap();
}

/// Bound pods by name → node, once `want` of those named are bound (or 30 s pass).
async fn bound(client: &Client, names: &[String], want: usize) -> BTreeMap<String, String> {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let mut out = BTreeMap::new();
        for p in pods(client, "default").await {
            let name = p.metadata.name.clone().unwrap();
            if names.contains(&name)
                && let Some(n) = node_of(&p)
            {
                out.insert(name, n.to_owned());
            }
        }
        if out.len() >= want || Instant::now() >= end {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn term(selector: Value, key: &str) -> Value {
    json!({ "labelSelector": selector, "topologyKey": key })
}

/// Required pod affinity and anti-affinity (own and existing pods'), topology spread with
/// `DoNotSchedule`, `matchFields` on `metadata.name`; what cannot be met is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_anti_affinity_spread_and_match_fields_hold() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    for (name, zone) in [("n1", "a"), ("n2", "a"), ("n3", "b"), ("n4", "b")] {
        add_node(&admin, &NodeDef::new(name).gpus("nvidia.com/gpu", 8).label(ZONE, zone)).await;
    }
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "affinity", &[]);

    // Five replicas, one per host: four bind, the fifth names the rule.
    let web = json!({ "affinity": { "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
        term(json!({ "matchLabels": { "app": "web" } }), "kubernetes.io/hostname") ] } } });
    let webs: Vec<String> = (0..5).map(|i| format!("web-{i}")).collect();
    for w in &webs {
        create(&admin, &pod_with(w, "nvidia.com/gpu", 1, &[("app", "web")], web.clone())).await;
    }
    let placed = bound(&admin, &webs, 4).await;
    assert_eq!(placed.len(), 4, "{placed:?}");
    assert_eq!(placed.values().collect::<BTreeSet<_>>().len(), 4, "one web per host: {placed:?}");
    let fifth = webs.iter().find(|w| !placed.contains_key(*w)).unwrap();
    says(&admin, fifth, "anti-affinity rules").await;

    // Spread over zones, at most one apart: 2 + 2.
    let spread = json!({ "topologySpreadConstraints": [{ "maxSkew": 1, "topologyKey": ZONE,
        "whenUnsatisfiable": "DoNotSchedule", "labelSelector": { "matchLabels": { "app": "s" } } }] });
    let ss: Vec<String> = (0..4).map(|i| format!("s-{i}")).collect();
    for s in &ss {
        create(&admin, &pod_with(s, "nvidia.com/gpu", 1, &[("app", "s")], spread.clone())).await;
    }
    let placed_s = bound(&admin, &ss, 4).await;
    let mut per_zone: BTreeMap<&str, usize> = BTreeMap::new();
    for n in placed_s.values() {
        *per_zone.entry(if n == "n1" || n == "n2" { "a" } else { "b" }).or_default() += 1;
    }
    assert_eq!(per_zone, BTreeMap::from([("a", 2), ("b", 2)]), "{placed_s:?}");

    // Affinity to web's zone-mates, and to a pod nobody runs.
    let near = json!({ "affinity": { "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
        term(json!({ "matchLabels": { "app": "web" } }), "kubernetes.io/hostname") ] } } });
    create(&admin, &pod_with("near", "", 0, &[("app", "near")], near)).await;
    let lonely = json!({ "affinity": { "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
        term(json!({ "matchLabels": { "app": "nobody" } }), "kubernetes.io/hostname") ] } } });
    create(&admin, &pod_with("lonely", "", 0, &[("app", "lonely")], lonely)).await;
    let near_on = bound(&admin, &["near".to_owned()], 1).await;
    if near_on.is_empty() {
        let p = Api::<Pod>::namespaced(admin.clone(), "default").get("near").await.unwrap();
        panic!("near waits: {:?}", waiting_reason(&p));
    }
    assert!(placed.values().any(|n| Some(n) == near_on.get("near")), "{near_on:?} {placed:?}");
    says(&admin, "lonely", "didn't match pod affinity rules").await;
    // A loop of mutual affinity: neither is the first of its own group, both wait, named.
    for (me, other) in [("loop-a", "loop-b"), ("loop-b", "loop-a")] {
        let t = json!({ "affinity": { "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
            term(json!({ "matchLabels": { "app": other } }), "kubernetes.io/hostname") ] } } });
        create(&admin, &pod_with(me, "", 0, &[("app", me)], t)).await;
    }
    says(&admin, "loop-a", "didn't match pod affinity rules").await;
    says(&admin, "loop-b", "didn't match pod affinity rules").await;

    // A pod without terms that web's anti-affinity matches stays off web's hosts: every host
    // has one, so it waits, named by the existing pods' rule.
    create(&admin, &pod_with("web-plain", "", 0, &[("app", "web")], json!({}))).await;
    says(&admin, "web-plain", "existing pods anti-affinity rules").await;

    // matchFields on metadata.name, as the DaemonSet controller writes it.
    let ds = json!({ "affinity": { "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{ "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["n3"] }] }] } } } });
    create(&admin, &pod_with("ds-n3", "", 0, &[("app", "ds")], ds)).await;
    let ds_on = bound(&admin, &["ds-n3".to_owned()], 1).await;
    assert_eq!(ds_on.get("ds-n3").map(String::as_str), Some("n3"));

    // A topology key no node has: anti-affinity cannot clash, spread cannot count.
    let nokey = json!({ "affinity": { "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
        term(json!({ "matchLabels": { "app": "k" } }), "example.com/no-such-key") ] } } });
    create(&admin, &pod_with("nokey", "", 0, &[("app", "k")], nokey)).await;
    let nokey_spread = json!({ "topologySpreadConstraints": [{ "maxSkew": 1, "topologyKey": "example.com/no-such-key",
        "whenUnsatisfiable": "DoNotSchedule", "labelSelector": { "matchLabels": { "app": "k2" } } }] });
    create(&admin, &pod_with("nokey-spread", "", 0, &[("app", "k2")], nokey_spread)).await;
    assert_eq!(bound(&admin, &["nokey".to_owned()], 1).await.len(), 1);
    says(&admin, "nokey-spread", "missing required label").await;

    // A thousand requirements in one selector: refused, named, and the scheduler goes on.
    let exprs: Vec<Value> =
        (0..1000).map(|i| json!({ "key": format!("k{i}"), "operator": "Exists" })).collect();
    let huge = json!({ "affinity": { "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [
        term(json!({ "matchExpressions": exprs }), "kubernetes.io/hostname") ] } } });
    create(&admin, &pod_with("huge", "", 0, &[], huge)).await;
    says(&admin, "huge", "labelSelector").await;
    create(&admin, &pod_with("after-huge", "", 0, &[], json!({}))).await;
    assert_eq!(bound(&admin, &["after-huge".to_owned()], 1).await.len(), 1);
}

/// A Job object for `pods` pods (Indexed, parallelism = completions), as a JobSet's child.
async fn child_job(
    admin: &Client,
    name: &str,
    pods: i32,
    labels: &BTreeMap<String, String>,
) -> String {
    let job: Job = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": labels },
        "spec": { "completions": pods, "parallelism": pods, "completionMode": "Indexed",
                  "template": { "metadata": { "labels": labels }, "spec": {
                      "schedulerName": "xpu", "restartPolicy": "Never",
                      "containers": [{ "name": "c", "image": "busybox" }] } } },
    }))
    .unwrap();
    let j = Api::<Job>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &job)
        .await
        .unwrap();
    j.metadata.uid.unwrap()
}

/// The GKE seed's multi-host TPU training as a JobSet of 2 slices (`2x2x2`, 2 hosts of 4
/// chips each), exclusive per node pool: each child Job whole on one slice, the two on
/// different slices, a third pool of another topology never used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobset_puts_each_child_job_alone_on_one_slice() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let tpu = |name: &str, pool: &str, topo: &str| {
        NodeDef::new(name)
            .gpus("google.com/tpu", 4)
            .label(POOL, pool)
            .label("cloud.google.com/gke-tpu-accelerator", "tpu-v5p-slice")
            .label("cloud.google.com/gke-tpu-topology", topo)
    };
    for (n, pool, topo) in [
        ("a-0", "pool-a", "2x2x2"),
        ("a-1", "pool-a", "2x2x2"),
        ("b-0", "pool-b", "2x2x2"),
        ("b-1", "pool-b", "2x2x2"),
        ("c-0", "pool-c", "2x2x4"),
        ("c-1", "pool-c", "2x2x4"),
        ("c-2", "pool-c", "2x2x4"),
        ("c-3", "pool-c", "2x2x4"),
    ] {
        add_node(&admin, &tpu(n, pool, topo)).await;
    }
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "jobset", &[]);

    let mut names = Vec::new();
    for j in 0..2 {
        let job = format!("train-slice-{j}");
        // JobSet's job key: a hash of namespace/job name (any stable unique value will do).
        let key = format!("{:040x}", 0xabc0 + j);
        let labels: BTreeMap<String, String> = [
            ("jobset.sigs.k8s.io/jobset-name", "train".to_owned()),
            ("jobset.sigs.k8s.io/replicatedjob-name", "slice".to_owned()),
            ("jobset.sigs.k8s.io/job-index", j.to_string()),
            ("jobset.sigs.k8s.io/job-key", key.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let uid = child_job(&admin, &job, 2, &labels).await;
        for i in 0..2 {
            let name = format!("{job}-{i}");
            let mut l = labels.clone();
            l.insert("batch.kubernetes.io/job-completion-index".into(), i.to_string());
            let mut v = serde_json::to_value(pod(&name, "google.com/tpu", 4, &[])).unwrap();
            v["metadata"]["labels"] = json!(l);
            v["metadata"]["annotations"] = json!({
                "alpha.jobset.sigs.k8s.io/exclusive-topology": POOL,
                "batch.kubernetes.io/job-completion-index": i.to_string(),
            });
            v["metadata"]["ownerReferences"] = json!([{ "apiVersion": "batch/v1", "kind": "Job",
                "name": job, "uid": uid, "controller": true, "blockOwnerDeletion": true }]);
            v["spec"]["nodeSelector"] = json!({
                "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                "cloud.google.com/gke-tpu-topology": "2x2x2",
            });
            // The affinity JobSet's pod webhook injects for exclusive placement.
            v["spec"]["affinity"] = json!({
                "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": { "matchExpressions": [
                        { "key": "jobset.sigs.k8s.io/job-key", "operator": "In", "values": [key] } ] },
                    "topologyKey": POOL }] },
                "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": { "matchExpressions": [
                        { "key": "jobset.sigs.k8s.io/job-key", "operator": "Exists" },
                        { "key": "jobset.sigs.k8s.io/job-key", "operator": "NotIn", "values": [key] } ] },
                    "topologyKey": POOL }] },
            });
            create(&admin, &serde_json::from_value(v).unwrap()).await;
            names.push(name);
        }
    }
    let placed = bound(&admin, &names, 4).await;
    assert_eq!(placed.len(), 4, "{placed:?}");
    let pool_of = |n: &str| n.split('-').next().unwrap().to_owned();
    let pools: Vec<BTreeSet<String>> = (0..2)
        .map(|j| (0..2).map(|i| pool_of(&placed[&format!("train-slice-{j}-{i}")])).collect())
        .collect();
    assert!(pools.iter().all(|p| p.len() == 1), "each child on one slice: {placed:?}");
    assert_ne!(pools[0], pools[1], "children on different slices: {placed:?}");
    assert!(
        placed.values().all(|n| !n.starts_with("c-")),
        "pool-c is the wrong topology: {placed:?}"
    );
    let hosts: BTreeSet<&String> = placed.values().collect();
    assert_eq!(hosts.len(), 4, "one pod per host: {placed:?}");
}

/// A LeaderWorkerSet of 3 groups of 4 (leader and workers ask differently) with exclusive
/// placement per host, on two 8-GPU nodes: two groups bind whole, each on one host; the third
/// binds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_worker_set_groups_bind_whole_or_not_at_all() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    for n in ["g1", "g2"] {
        add_node(&admin, &NodeDef::new(n).gpus("nvidia.com/gpu", 8)).await;
    }
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "lws", &[]);
    let mut groups: Vec<Vec<String>> = Vec::new();
    for g in 0..3 {
        let key = format!("{:040x}", 0xfeed0 + g);
        let mut names = Vec::new();
        for w in 0..4 {
            // The leader is the group's StatefulSet pod `vllm-G`; workers `vllm-G-W`.
            let name = if w == 0 { format!("vllm-{g}") } else { format!("vllm-{g}-{w}") };
            let gpus = 2;
            let mut v = serde_json::to_value(pod(&name, "nvidia.com/gpu", gpus, &[])).unwrap();
            v["metadata"]["labels"] = json!({
                "leaderworkerset.sigs.k8s.io/name": "vllm",
                "leaderworkerset.sigs.k8s.io/group-index": g.to_string(),
                "leaderworkerset.sigs.k8s.io/group-key": key,
                "leaderworkerset.sigs.k8s.io/worker-index": w.to_string(),
                "role": if w == 0 { "leader" } else { "worker" },
            });
            v["metadata"]["annotations"] = json!({
                "leaderworkerset.sigs.k8s.io/size": "4",
                "leaderworkerset.sigs.k8s.io/exclusive-topology": "kubernetes.io/hostname",
            });
            if w == 0 {
                // The leader asks more CPU than its workers.
                v["spec"]["containers"][0]["resources"]["requests"]["cpu"] = json!("2");
            }
            v["spec"]["affinity"] = json!({
                "podAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": { "matchExpressions": [
                        { "key": "leaderworkerset.sigs.k8s.io/group-key", "operator": "In", "values": [key] } ] },
                    "topologyKey": "kubernetes.io/hostname" }] },
                "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": { "matchExpressions": [
                        { "key": "leaderworkerset.sigs.k8s.io/group-key", "operator": "Exists" },
                        { "key": "leaderworkerset.sigs.k8s.io/group-key", "operator": "NotIn", "values": [key] } ] },
                    "topologyKey": "kubernetes.io/hostname" }] },
            });
            create(&admin, &serde_json::from_value(v).unwrap()).await;
            names.push(name);
        }
        groups.push(names);
    }
    let all: Vec<String> = groups.iter().flatten().cloned().collect();
    let placed = bound(&admin, &all, 8).await;
    // Give the third group time to (wrongly) bind part of itself.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let placed_later = bound(&admin, &all, 8).await;
    assert_eq!(placed, placed_later);
    let mut whole = 0;
    for g in &groups {
        let on: Vec<&String> = g.iter().filter_map(|n| placed.get(n)).collect();
        assert!(on.is_empty() || on.len() == 4, "group {g:?} half bound: {placed:?}");
        if on.len() == 4 {
            whole += 1;
            assert_eq!(
                on.iter().collect::<BTreeSet<_>>().len(),
                1,
                "a group on one host: {placed:?}"
            );
        }
    }
    assert_eq!(whole, 2, "{placed:?}");
    let waiting = groups.iter().find(|g| !placed.contains_key(&g[0])).unwrap();
    let msg = says(&admin, &waiting[0], "nodes are available").await;
    eprintln!("third group waits: {msg}");
}

/// A control plane serving Kubernetes' own gangs (`scheduling.k8s.io/v1beta1` PodGroups).
fn workload_plane() -> ControlPlaneOptions {
    ControlPlaneOptions::default()
        .apiserver_flag("--feature-gates=GenericWorkload=true,TopologyAwareWorkloadScheduling=true")
        .apiserver_flag("--runtime-config=scheduling.k8s.io/v1beta1=true")
}

async fn pod_group(admin: &Client, name: &str, policy: Value, topology: Option<&str>) {
    let mut spec = json!({ "schedulingPolicy": policy });
    if let Some(k) = topology {
        spec["schedulingConstraints"] = json!({ "topology": [{ "key": k }] });
    }
    let g: k8s_openapi::api::scheduling::v1beta1::PodGroup =
        serde_json::from_value(json!({ "metadata": { "name": name }, "spec": spec })).unwrap();
    Api::<k8s_openapi::api::scheduling::v1beta1::PodGroup>::namespaced(admin.clone(), "default")
        .create(&PostParams::default(), &g)
        .await
        .unwrap();
}

fn group_member(name: &str, group: &str, gpus: u32) -> Pod {
    pod_with(
        name,
        "nvidia.com/gpu",
        gpus,
        &[("group", group)],
        json!({ "schedulingGroup": { "podGroupName": group } }),
    )
}

/// Upstream PodGroups: a gang with a rack topology binds whole in one rack (the rack that
/// holds it, not the first one tried), its status says `PodGroupInitiallyScheduled`; a gang
/// whose `minCount` is above its pods binds nothing and says why; a `basic` group's pods bind
/// one by one; a pod naming a group that does not exist waits, told so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_groups_bind_whole_in_one_domain_or_wait_named() {
    let _turn = TURN.lock().await;
    let cp = plane(workload_plane()).await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    // Rack r1: two 4-GPU nodes; rack r2: two 8-GPU nodes.
    for (n, rack, gpus) in [("a1", "r1", 4), ("a2", "r1", 4), ("b1", "r2", 8), ("b2", "r2", 8)] {
        add_node(
            &admin,
            &NodeDef::new(n).gpus("nvidia.com/gpu", gpus).label("example.com/rack", rack),
        )
        .await;
    }
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "podgroups", &[]);

    // 4 pods × 4 GPUs in one rack: only r2 holds them.
    pod_group(&admin, "train", json!({ "gang": { "minCount": 4 } }), Some("example.com/rack"))
        .await;
    let train: Vec<String> = (0..4).map(|i| format!("train-{i}")).collect();
    for t in &train {
        create(&admin, &group_member(t, "train", 4)).await;
    }
    let placed = bound(&admin, &train, 4).await;
    assert_eq!(placed.len(), 4, "{placed:?}");
    assert!(placed.values().all(|n| n.starts_with('b')), "all in rack r2: {placed:?}");
    let groups: Api<k8s_openapi::api::scheduling::v1beta1::PodGroup> =
        Api::namespaced(admin.clone(), "default");
    let scheduled = wait_until(Duration::from_secs(20), || async {
        groups.get("train").await.unwrap().status.and_then(|s| s.conditions).is_some_and(|c| {
            c.iter().any(|c| c.type_ == "PodGroupInitiallyScheduled" && c.status == "True")
        })
    })
    .await;
    assert!(scheduled, "{:?}", groups.get("train").await.unwrap().status);

    // minCount 3 with 2 pods: nothing binds, the pods and the group say why.
    pod_group(&admin, "short", json!({ "gang": { "minCount": 3 } }), None).await;
    for n in ["short-0", "short-1"] {
        create(&admin, &group_member(n, "short", 1)).await;
    }
    says(&admin, "short-0", "waiting for the rest of gang").await;
    let told = wait_until(Duration::from_secs(20), || async {
        groups.get("short").await.unwrap().status.and_then(|s| s.conditions).is_some_and(|c| {
            c.iter().any(|c| {
                c.type_ == "PodGroupInitiallyScheduled"
                    && c.status == "False"
                    && c.reason == "Unschedulable"
            })
        })
    })
    .await;
    assert!(told, "{:?}", groups.get("short").await.unwrap().status);

    // basic: each pod on its own, even when not all fit.
    pod_group(&admin, "loose", json!({ "basic": {} }), None).await;
    for n in ["loose-0", "loose-1"] {
        create(&admin, &group_member(n, "loose", 1)).await;
    }
    assert_eq!(bound(&admin, &["loose-0".to_owned(), "loose-1".to_owned()], 2).await.len(), 2);

    create(&admin, &group_member("orphan", "no-such-group", 1)).await;
    says(&admin, "orphan", "PodGroup default/no-such-group does not exist").await;
    let short: Vec<Pod> = pods(&admin, "default")
        .await
        .into_iter()
        .filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with("short-")))
        .collect();
    assert!(short.iter().all(|p| node_of(p).is_none()), "a short gang binds nothing");
}

/// `xpu k8s scheduler --scheduler-name default-scheduler` as the only scheduler of a control
/// plane: the pods kube-controller-manager makes for a Deployment, a Job and a DaemonSet (one
/// pod per node, kept there by `matchFields` on `metadata.name`) are all scheduled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_the_default_scheduler_it_places_what_the_controllers_make() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_controller_manager().controllers([
        "serviceaccount-controller",
        "deployment-controller",
        "replicaset-controller",
        "job-controller",
        "daemonset-controller",
    ]))
    .await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    for n in ["d1", "d2", "d3"] {
        add_node(&admin, &NodeDef::new(n).gpus("nvidia.com/gpu", 4)).await;
    }
    let _sched = XpuScheduler::start(
        &cp,
        &kubeconfig,
        "default",
        &["--scheduler-name", "default-scheduler"],
    );
    let container = json!([{ "name": "c", "image": "busybox",
        "resources": { "requests": { "cpu": "100m", "memory": "64Mi" } } }]);
    let docs = [
        json!({ "apiVersion": "apps/v1", "kind": "Deployment", "metadata": { "name": "web" },
            "spec": { "replicas": 3, "selector": { "matchLabels": { "app": "web" } },
                "template": { "metadata": { "labels": { "app": "web" } },
                    "spec": { "containers": container } } } }),
        json!({ "apiVersion": "batch/v1", "kind": "Job", "metadata": { "name": "batch" },
            "spec": { "completions": 2, "parallelism": 2,
                "template": { "metadata": { "labels": { "app": "batch" } },
                    "spec": { "restartPolicy": "Never", "containers": container } } } }),
        json!({ "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": { "name": "agent" },
            "spec": { "selector": { "matchLabels": { "app": "agent" } },
                "template": { "metadata": { "labels": { "app": "agent" } },
                    "spec": { "containers": container } } } }),
    ];
    for d in &docs {
        k8s_support::create(&admin, d, false).await.unwrap();
    }
    let all_bound = wait_until(Duration::from_secs(60), || async {
        let ps = pods(&admin, "default").await;
        ps.len() == 8 && ps.iter().all(|p| node_of(p).is_some())
    })
    .await;
    let ps = pods(&admin, "default").await;
    let seen: Vec<(String, Option<String>)> = ps
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap(), node_of(p).map(str::to_owned)))
        .collect();
    assert!(all_bound, "{seen:?}");
    // One agent per node.
    let agents: BTreeSet<&str> = ps
        .iter()
        .filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with("agent-")))
        .filter_map(node_of)
        .collect();
    assert_eq!(agents.len(), 3, "{seen:?}");
}
