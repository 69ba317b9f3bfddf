//! `xpu k8s scheduler` allocates DRA claims (`resource.k8s.io/v1`) on a real control plane:
//! etcd, kube-apiserver and kube-controller-manager's resourceclaim controller (claims from
//! templates), with ResourceSlices published as a driver would and the scheduler running with
//! the token of the ServiceAccount `deploy/kubernetes` binds. The tenant is a user with rights
//! only in its namespace.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use xpu_testkit::kube::ControlPlaneOptions;

use k8s_support::*;

const DRIVER: &str = "gpu.example.com";
const NS: &str = "team-a";

/// A node's slice: GPUs `(name, nvlink domain, model)`.
fn slice(node: &str, gpus: &[(&str, i64, &str)]) -> ResourceSlice {
    let devices: Vec<Value> = gpus
        .iter()
        .map(|(name, domain, model)| {
            json!({ "name": name, "attributes": {
                "nvlinkDomain": { "int": domain }, "model": { "string": model },
                "driverVersion": { "version": "550.54.15" } },
                "capacity": { "memory": { "value": "80Gi" } } })
        })
        .collect();
    serde_json::from_value(json!({
        "metadata": { "name": format!("{node}-{DRIVER}") },
        "spec": { "driver": DRIVER, "nodeName": node,
                  "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
                  "devices": devices }
    }))
    .unwrap()
}

fn template(name: &str, count: u32, selector: &str) -> ResourceClaimTemplate {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "spec": { "devices": {
            "requests": [{ "name": "gpus", "exactly": {
                "deviceClassName": "gpu", "count": count,
                "selectors": [{ "cel": { "expression": selector } }] } }],
            "constraints": [{ "matchAttribute": format!("{DRIVER}/nvlinkDomain") }] } } }
    }))
    .unwrap()
}

fn claim_pod(name: &str, template: &str, labels: &[(&str, &str)]) -> Pod {
    let mut p = pod(name, "", 0, labels);
    let spec = p.spec.as_mut().unwrap();
    spec.resource_claims = Some(vec![
        serde_json::from_value(json!({ "name": "gpus", "resourceClaimTemplateName": template }))
            .unwrap(),
    ]);
    spec.containers[0].resources.as_mut().unwrap().claims =
        Some(vec![serde_json::from_value(json!({ "name": "gpus" })).unwrap()]);
    p
}

/// DeviceClass `xgpu`: the driver's devices, also served as the extended resource
/// `example.com/gpu`.
fn extended_class() -> DeviceClass {
    serde_json::from_value(json!({
        "metadata": { "name": "xgpu" },
        "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == '{DRIVER}'") } }],
                  "extendedResourceName": "example.com/gpu" }
    }))
    .unwrap()
}

async fn tenant(cp: &xpu_testkit::kube::ControlPlane) -> Client {
    let admin = cp.admin_client();
    let pp = PostParams::default();
    let n: Namespace = serde_json::from_value(json!({ "metadata": { "name": NS } })).unwrap();
    Api::<Namespace>::all(admin.clone()).create(&pp, &n).await.unwrap();
    let sa: ServiceAccount =
        serde_json::from_value(json!({ "metadata": { "name": "default" } })).unwrap();
    // The serviceaccount controller may have made it first.
    match Api::<ServiceAccount>::namespaced(admin.clone(), NS).create(&pp, &sa).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("ServiceAccount {NS}/default: {e}"),
    }
    let role: Role = serde_json::from_value(json!({
        "metadata": { "name": "tenant" },
        "rules": [{ "apiGroups": ["", "resource.k8s.io"],
                    "resources": ["pods", "resourceclaims", "resourceclaimtemplates"],
                    "verbs": ["get", "list", "watch", "create", "delete"] }],
    }))
    .unwrap();
    Api::<Role>::namespaced(admin.clone(), NS).create(&pp, &role).await.unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": { "name": "alice" },
        "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant" },
        "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice" }],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(admin, NS).create(&pp, &rb).await.unwrap();
    cp.impersonating("alice", &[]).await.unwrap()
}

/// A control plane with the resourceclaim controller, the scheduler's manifests applied, the
/// tenant alice, and the DeviceClass `gpu` for the driver's devices.
async fn claims_plane() -> (xpu_testkit::kube::ControlPlane, Client, std::path::PathBuf, Client) {
    let cp = plane(
        ControlPlaneOptions::default()
            .with_controller_manager()
            .controllers(["serviceaccount-controller", "resourceclaim-controller"]),
    )
    .await;
    let admin = cp.admin_client();
    let kubeconfig = install_scheduler_rbac(&cp).await;
    let alice = tenant(&cp).await;
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": { "name": "gpu" },
        "spec": { "selectors": [{ "cel": { "expression": format!("device.driver == '{DRIVER}'") } }] }
    }))
    .unwrap();
    Api::<DeviceClass>::all(admin.clone()).create(&PostParams::default(), &class).await.unwrap();
    (cp, admin, kubeconfig, alice)
}

/// The claim made for `pod` from its template, once the controller has made it.
async fn claim_of(admin: &Client, pod: &str) -> Option<ResourceClaim> {
    let p = Api::<Pod>::namespaced(admin.clone(), NS).get(pod).await.ok()?;
    let name = p.status?.resource_claim_statuses?.first()?.resource_claim_name.clone()?;
    Api::<ResourceClaim>::namespaced(admin.clone(), NS).get(&name).await.ok()
}

fn reason(p: &Pod) -> Option<String> {
    p.status.as_ref()?.conditions.as_ref()?.iter().find_map(|c| {
        (c.type_ == "PodScheduled" && c.status == "False").then(|| c.message.clone()).flatten()
    })
}

async fn get(admin: &Client, name: &str) -> Pod {
    Api::<Pod>::namespaced(admin.clone(), NS).get(name).await.unwrap()
}

/// A pod whose claim template asks for 2 A100s in one NVLink domain binds to the one node that
/// has them, its claim allocated with both devices, reserved for it and protected by the
/// finalizer; a selector failing at run time and a gang that cannot fit whole leave their pods
/// waiting, told why, with no claim allocated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_are_allocated_reserved_and_bound_by_xpu() {
    let _turn = TURN.lock().await;
    let (cp, admin, kubeconfig, alice) = claims_plane().await;
    for n in ["n1", "n2", "n3"] {
        add_node(&admin, &NodeDef::new(n)).await;
    }
    // n1: two A100s split across domains; n2: two H100s in domain 0, two A100s in domain 1.
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let pp = PostParams::default();
    slices.create(&pp, &slice("n1", &[("g0", 0, "A100"), ("g1", 1, "A100")])).await.unwrap();
    slices
        .create(
            &pp,
            &slice(
                "n2",
                &[("g0", 0, "H100"), ("g1", 0, "H100"), ("g2", 1, "A100"), ("g3", 1, "A100")],
            ),
        )
        .await
        .unwrap();
    // n3: eight H100s in two NVLink domains of four.
    let h100s: Vec<(String, i64)> = (0..8).map(|i| (format!("h{i}"), i / 4)).collect();
    let h100s: Vec<(&str, i64, &str)> =
        h100s.iter().map(|(n, d)| (n.as_str(), *d, "H100")).collect();
    slices.create(&pp, &slice("n3", &h100s)).await.unwrap();
    let sched = XpuScheduler::start(&cp, &kubeconfig, "claims", &[]);

    let templates: Api<ResourceClaimTemplate> = Api::namespaced(alice.clone(), NS);
    let a100 = format!(
        "device.attributes['{DRIVER}'].model == 'A100' && device.capacity['{DRIVER}'].memory.compareTo(quantity('40Gi')) >= 0 && device.attributes['{DRIVER}'].driverVersion.isGreaterThan(semver('535.0.0'))"
    );
    templates.create(&pp, &template("two-a100", 2, &a100)).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(alice.clone(), NS);
    pods.create(&pp, &claim_pod("trainer", "two-a100", &[])).await.unwrap();
    let bound = wait_until(Duration::from_secs(30), || async {
        node_of(&get(&admin, "trainer").await).is_some()
    })
    .await;
    let p = get(&admin, "trainer").await;
    assert!(bound, "trainer binds: {:?}\n{}", reason(&p), sched.log_text());
    assert_eq!(node_of(&p), Some("n2"));
    let claim = claim_of(&admin, "trainer").await.unwrap();
    let status = claim.status.clone().unwrap();
    let alloc = status.allocation.unwrap();
    let mut devices: Vec<String> = alloc
        .devices
        .unwrap()
        .results
        .unwrap()
        .iter()
        .map(|r| format!("{}/{}/{}", r.driver, r.pool, r.device))
        .collect();
    devices.sort();
    assert_eq!(devices, [format!("{DRIVER}/n2/g2"), format!("{DRIVER}/n2/g3")]);
    let reserved = status.reserved_for.unwrap();
    assert_eq!(reserved.len(), 1);
    assert_eq!(Some(&reserved[0].uid), p.metadata.uid.as_ref());
    assert!(
        claim
            .metadata
            .finalizers
            .unwrap_or_default()
            .iter()
            .any(|f| f == "resource.kubernetes.io/delete-protection")
    );

    // The same ask again: n2's A100s are taken, n1's are in two domains: it waits.
    pods.create(&pp, &claim_pod("second", "two-a100", &[])).await.unwrap();
    let told = wait_until(Duration::from_secs(30), || async {
        reason(&get(&admin, "second").await)
            .is_some_and(|m| m.contains("nodes can allocate the pod's ResourceClaims"))
    })
    .await;
    assert!(
        told,
        "second waits, told why: {:?}\n{}",
        reason(&get(&admin, "second").await),
        sched.log_text()
    );

    // A selector that fails at run time is named in the pod's condition.
    templates
        .create(
            &pp,
            &template("broken", 1, &format!("device.attributes['{DRIVER}'].noSuchAttribute == 1")),
        )
        .await
        .unwrap();
    pods.create(&pp, &claim_pod("broken", "broken", &[])).await.unwrap();
    let named = wait_until(Duration::from_secs(30), || async {
        reason(&get(&admin, "broken").await)
            .is_some_and(|m| m.contains("noSuchAttribute") && m.contains("no such key"))
    })
    .await;
    assert!(named, "{:?}\n{}", reason(&get(&admin, "broken").await), sched.log_text());

    // A gang of four pods, each with a claim for two H100s of one NVLink domain: n3 holds all
    // four claims (two per domain), so the gang binds whole there. A gang of four pods each
    // asking the same cannot fit (n2's one H100 pair is all that is left: each member alone
    // would fit): none binds and no claim of it is allocated.
    let h100 = format!("device.attributes['{DRIVER}'].model == 'H100'");
    templates.create(&pp, &template("two-h100", 2, &h100)).await.unwrap();
    for i in 0..4 {
        let labels = [("xpu.dev/gang", "h100s"), ("xpu.dev/gang-size", "4")];
        pods.create(&pp, &claim_pod(&format!("h100-{i}"), "two-h100", &labels)).await.unwrap();
    }
    let all = wait_until(Duration::from_secs(40), || async {
        let mut n = 0;
        for i in 0..4 {
            if node_of(&get(&admin, &format!("h100-{i}")).await) == Some("n3") {
                n += 1;
            }
        }
        n == 4
    })
    .await;
    if !all {
        for i in 0..4 {
            let p = get(&admin, &format!("h100-{i}")).await;
            eprintln!("h100-{i}: {:?} {:?}", node_of(&p), reason(&p));
        }
    }
    assert!(all, "the H100 gang binds whole on n3\n{}", sched.log_text());
    let mut domains = Vec::new();
    for i in 0..4 {
        let c = claim_of(&admin, &format!("h100-{i}")).await.unwrap();
        let results = c.status.unwrap().allocation.unwrap().devices.unwrap().results.unwrap();
        let d: Vec<i64> =
            results.iter().map(|r| i64::from(r.device.as_bytes()[1] - b'0') / 4).collect();
        assert_eq!((d.len(), d[0]), (2, d[1]), "two devices of one domain: {results:?}");
        domains.push(d[0]);
    }
    domains.sort_unstable();
    assert_eq!(domains, [0, 0, 1, 1]);
    for i in 0..4 {
        let labels = [("xpu.dev/gang", "late"), ("xpu.dev/gang-size", "4")];
        pods.create(&pp, &claim_pod(&format!("late-{i}"), "two-h100", &labels)).await.unwrap();
    }
    let waiting = wait_until(Duration::from_secs(45), || async {
        let mut n = 0;
        for i in 0..4 {
            // A reason given once its claim exists (the first may predate it).
            if reason(&get(&admin, &format!("late-{i}")).await)
                .is_some_and(|m| !m.contains("made from its template"))
            {
                n += 1;
            }
        }
        n == 4
    })
    .await;
    assert!(waiting, "{}", sched.log_text());
    eprintln!("second: {:?}", reason(&get(&admin, "second").await));
    eprintln!("broken: {:?}", reason(&get(&admin, "broken").await));
    eprintln!("late-0: {:?}", reason(&get(&admin, "late-0").await));
    for i in 0..4 {
        let name = format!("late-{i}");
        assert!(node_of(&get(&admin, &name).await).is_none(), "{name} must not bind alone");
        let c = claim_of(&admin, &name).await;
        assert!(
            c.as_ref().is_none_or(|c| c.status.as_ref().is_none_or(|s| s.allocation.is_none())),
            "{name}'s claim stays unallocated: {c:?}"
        );
    }
}

/// Hostile selectors a tenant writes: huge, deep, slow, failing at run time. Whatever the API
/// server lets through is named in the pod's condition, and costs the scheduler a bounded
/// time: another tenant's claim pod still binds within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_selectors_are_named_and_cost_a_bounded_time() {
    let _turn = TURN.lock().await;
    let (cp, admin, kubeconfig, alice) = claims_plane().await;
    add_node(&admin, &NodeDef::new("n1")).await;
    let gpus: Vec<(String, i64, &str)> = (0..8).map(|i| (format!("g{i}"), i / 4, "A100")).collect();
    let gpus: Vec<(&str, i64, &str)> = gpus.iter().map(|(n, d, m)| (n.as_str(), *d, *m)).collect();
    Api::<ResourceSlice>::all(admin.clone())
        .create(&PostParams::default(), &slice("n1", &gpus))
        .await
        .unwrap();
    let sched = XpuScheduler::start(&cp, &kubeconfig, "hostile", &[]);

    let list = format!("[{}]", (0..300).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
    let attr = format!("device.attributes['{DRIVER}']");
    let hostile = [
        ("slow", format!("{list}.all(a, {list}.all(b, {list}.all(c, a + b + c >= 0)))")),
        ("deep", format!("{}true{}", "(".repeat(400), ")".repeat(400))),
        ("huge", format!("{}true", format!("{attr}.model == 'x' || ").repeat(700))),
        (
            "failing",
            format!("{attr}.model.size() / ({attr}.nvlinkDomain - {attr}.nvlinkDomain) == 1"),
        ),
        ("wrong-type", format!("{attr}.model")),
    ];
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(alice.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(alice.clone(), NS);
    let pp = PostParams::default();
    let mut admitted = Vec::new();
    for (name, expr) in &hostile {
        match templates.create(&pp, &template(name, 1, expr)).await {
            Ok(_) => {
                pods.create(&pp, &claim_pod(name, name, &[])).await.unwrap();
                admitted.push(*name);
            }
            Err(kube::Error::Api(e)) => {
                eprintln!(
                    "the API server refused the {name} selector ({}): {}",
                    e.code,
                    e.message.chars().take(200).collect::<String>()
                );
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    eprintln!("admitted by the API server: {admitted:?}");
    assert!(admitted.contains(&"failing"), "{admitted:?}");
    // A sound pod binds while the hostile ones wait.
    templates.create(&pp, &template("sound", 2, &format!("{attr}.model == 'A100'"))).await.unwrap();
    let t = std::time::Instant::now();
    pods.create(&pp, &claim_pod("sound", "sound", &[])).await.unwrap();
    let bound = wait_until(Duration::from_secs(20), || async {
        node_of(&get(&admin, "sound").await).is_some()
    })
    .await;
    eprintln!("the sound pod bound in {:?}", t.elapsed());
    assert!(bound && t.elapsed() < Duration::from_secs(10), "{}", sched.log_text());
    for name in &admitted {
        let said = wait_until(Duration::from_secs(20), || async {
            reason(&get(&admin, name).await).is_some_and(|m| m.contains("CEL selector"))
        })
        .await;
        let why = reason(&get(&admin, name).await);
        eprintln!("{name}: {why:?}");
        assert!(said, "{name} is told which selector failed: {why:?}");
        assert!(node_of(&get(&admin, name).await).is_none());
    }
}

/// Extended resources backed by DRA (1.37): a DeviceClass with `extendedResourceName` serves a
/// plain `example.com/gpu` request (and the implicit `deviceclass.resource.kubernetes.io/<class>`
/// name) from DRA devices on a node no device plugin advertises it on. xpu makes the pod's
/// claim as kube-scheduler does (`<pod>-extended-resources-*`, owned by the pod, marked,
/// one request per container), allocates and reserves it, names it in the pod's
/// `status.extendedResourceClaimStatus`, then binds; a pod that no longer fits waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_resources_backed_by_dra_get_a_claim_of_their_own() {
    let _turn = TURN.lock().await;
    let (cp, admin, kubeconfig, alice) = claims_plane().await;
    add_node(&admin, &NodeDef::new("n1")).await;
    let pp = PostParams::default();
    Api::<DeviceClass>::all(admin.clone()).create(&pp, &extended_class()).await.unwrap();
    let gpus: Vec<(String, i64)> = (0..4).map(|i| (format!("g{i}"), 0)).collect();
    let gpus: Vec<(&str, i64, &str)> = gpus.iter().map(|(n, d)| (n.as_str(), *d, "A100")).collect();
    Api::<ResourceSlice>::all(admin.clone()).create(&pp, &slice("n1", &gpus)).await.unwrap();
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "extended", &[]);

    let mk = |name: &str, asks: &[(&str, u32)]| -> Pod {
        let containers: Vec<Value> = asks
            .iter()
            .enumerate()
            .map(|(i, (res, n))| {
                json!({ "name": format!("c{}", i + 1), "image": "busybox",
                "resources": { "requests": { "cpu": "100m", res.to_string(): n.to_string() },
                               "limits": { res.to_string(): n.to_string() } } })
            })
            .collect();
        serde_json::from_value(json!({ "metadata": { "name": name },
            "spec": { "schedulerName": "xpu", "restartPolicy": "Never", "containers": containers } }))
        .unwrap()
    };
    let pods: Api<Pod> = Api::namespaced(alice.clone(), NS);
    pods.create(&pp, &mk("p1", &[("example.com/gpu", 2), ("example.com/gpu", 1)])).await.unwrap();
    pods.create(&pp, &mk("p2", &[("deviceclass.resource.kubernetes.io/xgpu", 1)])).await.unwrap();
    let bound = wait_until(Duration::from_secs(30), || async {
        node_of(&get(&admin, "p1").await).is_some() && node_of(&get(&admin, "p2").await).is_some()
    })
    .await;
    assert!(
        bound,
        "p1: {:?}, p2: {:?}",
        reason(&get(&admin, "p1").await),
        reason(&get(&admin, "p2").await)
    );
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let mut taken = std::collections::BTreeSet::new();
    for (pod, want) in [("p1", 3usize), ("p2", 1)] {
        let p = get(&admin, pod).await;
        let st = p.status.unwrap().extended_resource_claim_status.unwrap();
        assert!(
            st.resource_claim_name.starts_with(&format!("{pod}-extended-resources-")),
            "{st:?}"
        );
        let c = claims.get(&st.resource_claim_name).await.unwrap();
        assert_eq!(
            c.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("resource.kubernetes.io/extended-resource-claim"))
                .map(String::as_str),
            Some("true")
        );
        let owner = &c.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("Pod", pod, Some(true))
        );
        let status = c.status.unwrap();
        let results = status.allocation.unwrap().devices.unwrap().results.unwrap();
        assert_eq!(results.len(), want);
        for r in &results {
            assert!(taken.insert(r.device.clone()), "{} in two claims", r.device);
            assert!(
                st.request_mappings.iter().any(|m| m.request_name == r.request),
                "{st:?} {r:?}"
            );
        }
        assert_eq!(status.reserved_for.unwrap()[0].name, pod);
    }
    let p1 = get(&admin, "p1").await.status.unwrap().extended_resource_claim_status.unwrap();
    let mapped: Vec<(&str, &str, &str)> = p1
        .request_mappings
        .iter()
        .map(|m| (m.container_name.as_str(), m.request_name.as_str(), m.resource_name.as_str()))
        .collect();
    assert_eq!(
        mapped,
        [
            ("c1", "container-0-request-0", "example.com/gpu"),
            ("c2", "container-1-request-0", "example.com/gpu")
        ]
    );
    // All four devices are taken: one more waits, and no claim is made for it.
    pods.create(&pp, &mk("p3", &[("example.com/gpu", 1)])).await.unwrap();
    let told = wait_until(Duration::from_secs(30), || async {
        reason(&get(&admin, "p3").await).is_some()
    })
    .await;
    assert!(told);
    assert!(node_of(&get(&admin, "p3").await).is_none());
    let made = claims.list(&Default::default()).await.unwrap().items;
    assert!(!made.iter().any(|c| c.metadata.name.as_deref().is_some_and(|n| n.starts_with("p3-"))));
}

/// A DeviceTaintRule (`resource.k8s.io/v1`) taints the devices it selects: a claim that does
/// not tolerate the taint gets the other device, and one that needs both waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_taint_rule_keeps_claims_off_the_devices_it_taints() {
    let _turn = TURN.lock().await;
    let (cp, admin, kubeconfig, alice) = claims_plane().await;
    add_node(&admin, &NodeDef::new("n1")).await;
    let pp = PostParams::default();
    Api::<ResourceSlice>::all(admin.clone())
        .create(&pp, &slice("n1", &[("g0", 0, "A100"), ("g1", 0, "A100")]))
        .await
        .unwrap();
    let rule: k8s_openapi::api::resource::v1::DeviceTaintRule = serde_json::from_value(json!({
        "metadata": { "name": "g0-broken" },
        "spec": { "deviceSelector": { "driver": DRIVER, "pool": "n1", "device": "g0" },
                  "taint": { "key": "example.com/broken", "value": "ecc", "effect": "NoSchedule" } }
    }))
    .unwrap();
    Api::<k8s_openapi::api::resource::v1::DeviceTaintRule>::all(admin.clone())
        .create(&pp, &rule)
        .await
        .unwrap();
    let _sched = XpuScheduler::start(&cp, &kubeconfig, "taints", &[]);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(alice.clone(), NS);
    templates.create(&pp, &template("one", 1, "true")).await.unwrap();
    templates.create(&pp, &template("two", 2, "true")).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(alice.clone(), NS);
    pods.create(&pp, &claim_pod("two", "two", &[])).await.unwrap();
    pods.create(&pp, &claim_pod("one", "one", &[])).await.unwrap();
    let bound = wait_until(Duration::from_secs(30), || async {
        node_of(&get(&admin, "one").await).is_some()
    })
    .await;
    assert!(bound, "{:?}", reason(&get(&admin, "one").await));
    let c = claim_of(&admin, "one").await.unwrap();
    let results = c.status.unwrap().allocation.unwrap().devices.unwrap().results.unwrap();
    assert_eq!(results.iter().map(|r| r.device.as_str()).collect::<Vec<_>>(), ["g1"]);
    let told = wait_until(Duration::from_secs(30), || async {
        reason(&get(&admin, "two").await).is_some()
    })
    .await;
    assert!(told);
    assert!(node_of(&get(&admin, "two").await).is_none());
}

/// The benches' null binder makes the writes a DRA scheduler makes and decides nothing: each
/// pod with a claim waits for its claim, then goes to the next node in turn with free devices,
/// its claim allocated the node's first free ones (never one another claim holds) and
/// reserved for it; a pod asking an extended resource backed by DRA gets a claim made for it,
/// as xpu makes one; a pod for which no node has devices left waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_null_binder_allocates_first_free_devices_and_binds() {
    let _turn = TURN.lock().await;
    let (cp, admin, kubeconfig, alice) = claims_plane().await;
    let pp = PostParams::default();
    for n in ["n1", "n2"] {
        add_node(&admin, &NodeDef::new(n)).await;
        Api::<ResourceSlice>::all(admin.clone())
            .create(&pp, &slice(n, &[("g0", 0, "A100"), ("g1", 0, "A100")]))
            .await
            .unwrap();
    }
    // An extended resource backed by DRA: the null binder makes its claim as xpu does (the
    // pod is named to come first of the pods made in the same second).
    Api::<DeviceClass>::all(admin.clone()).create(&pp, &extended_class()).await.unwrap();
    let sched = XpuScheduler::start(&cp, &kubeconfig, "null", &["--null-binder"]);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(alice.clone(), NS);
    templates.create(&pp, &template("one", 1, "true")).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(alice.clone(), NS);
    let extended: Pod = serde_json::from_value(json!({ "metadata": { "name": "a1" },
        "spec": { "schedulerName": "xpu", "restartPolicy": "Never", "containers": [{
            "name": "c", "image": "busybox",
            "resources": { "requests": { "example.com/gpu": "1" }, "limits": { "example.com/gpu": "1" } } }] } }))
    .unwrap();
    pods.create(&pp, &extended).await.unwrap();
    let names = ["a1", "p1", "p2", "p3", "p4"];
    for n in &names[1..] {
        pods.create(&pp, &claim_pod(n, "one", &[])).await.unwrap();
    }
    let four = wait_until(Duration::from_secs(60), || async {
        let mut bound = 0;
        for n in names {
            bound += usize::from(node_of(&get(&admin, n).await).is_some());
        }
        bound == 4
    })
    .await;
    assert!(four, "four of five bind\n{}", sched.log_text());
    let a1 = get(&admin, "a1").await;
    let st = a1.status.as_ref().and_then(|s| s.extended_resource_claim_status.clone());
    let st = st.unwrap_or_else(|| panic!("a1: {:?}\n{}", a1.status, sched.log_text()));
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let mut held = Vec::new();
    for n in names {
        let p = get(&admin, n).await;
        let Some(node) = node_of(&p) else { continue };
        let c = if n == "a1" {
            claims.get(&st.resource_claim_name).await.unwrap()
        } else {
            claim_of(&admin, n).await.unwrap()
        };
        let st = c.status.unwrap();
        let r = st.allocation.unwrap().devices.unwrap().results.unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].pool, node, "{n}: a device of its own node");
        held.push(format!("{}/{}", r[0].pool, r[0].device));
        assert_eq!(st.reserved_for.unwrap()[0].uid, p.metadata.uid.unwrap());
    }
    held.sort();
    assert_eq!(held, ["n1/g0", "n1/g1", "n2/g0", "n2/g1"], "every device once");
}

/// Devices with binding conditions (KEP-5007, GA in 1.37), as a fabric-attached GPU publishes
/// them: xpu allocates the claim with the conditions copied and reserves it for the pod, but
/// binds the pod only once the driver sets the conditions True in the claim's
/// `status.devices`; a True failure condition makes xpu take the allocation back, and the next
/// allocation waits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_with_binding_conditions_bind_once_their_driver_says_so() {
    let _turn = TURN.lock().await;
    let (cp, admin, kubeconfig, alice) = claims_plane().await;
    add_node(&admin, &NodeDef::new("n1")).await;
    let mut s = serde_json::to_value(slice("n1", &[("f0", 0, "A100")])).unwrap();
    s["spec"]["devices"][0]["bindingConditions"] = json!(["example.com/attached"]);
    s["spec"]["devices"][0]["bindingFailureConditions"] = json!(["example.com/failed"]);
    let s: ResourceSlice = serde_json::from_value(s).unwrap();
    let pp = PostParams::default();
    let stored = Api::<ResourceSlice>::all(admin.clone()).create(&pp, &s).await.unwrap();
    assert_eq!(
        stored.spec.devices.as_ref().unwrap()[0].binding_conditions.as_deref(),
        Some(&["example.com/attached".to_owned()][..]),
        "the API server keeps binding conditions"
    );
    let sched = XpuScheduler::start(&cp, &kubeconfig, "binding", &[]);
    Api::<ResourceClaimTemplate>::namespaced(alice.clone(), NS)
        .create(&pp, &template("one", 1, "true"))
        .await
        .unwrap();
    Api::<Pod>::namespaced(alice.clone(), NS)
        .create(&pp, &claim_pod("fabric", "one", &[]))
        .await
        .unwrap();

    // Allocated with the conditions, reserved, and the pod waiting, told why.
    let allocated_since = |c: &ResourceClaim| {
        let s = c.status.as_ref()?;
        let a = s.allocation.as_ref()?;
        s.reserved_for.as_ref().filter(|r| !r.is_empty())?;
        Some(a.allocation_timestamp.as_ref()?.0)
    };
    let first = wait_until(Duration::from_secs(30), || async {
        claim_of(&admin, "fabric").await.as_ref().and_then(allocated_since).is_some()
    })
    .await;
    assert!(first, "the claim is allocated and reserved\n{}", sched.log_text());
    let claim = claim_of(&admin, "fabric").await.unwrap();
    let t1 = allocated_since(&claim).unwrap();
    let result = &claim
        .status
        .as_ref()
        .unwrap()
        .allocation
        .as_ref()
        .unwrap()
        .devices
        .as_ref()
        .unwrap()
        .results
        .as_ref()
        .unwrap()[0];
    assert_eq!(
        result.binding_conditions.as_deref(),
        Some(&["example.com/attached".to_owned()][..])
    );
    assert_eq!(
        result.binding_failure_conditions.as_deref(),
        Some(&["example.com/failed".to_owned()][..])
    );
    let told = wait_until(Duration::from_secs(20), || async {
        reason(&get(&admin, "fabric").await).is_some_and(|r| r.contains("binding conditions"))
    })
    .await;
    let p = get(&admin, "fabric").await;
    assert!(told, "the pod is told it waits: {:?}", reason(&p));
    assert_eq!(node_of(&p), None, "bound before its device was attached");

    // The driver reports a failure: the allocation is taken back and made again.
    let set = |ty: &'static str| {
        json!({ "status": { "devices": [{ "driver": DRIVER, "pool": "n1", "device": "f0",
            "conditions": [{ "type": ty, "status": "True", "reason": "Driver", "message": "",
                             "lastTransitionTime": "2026-11-28T00:00:00Z" }] }] } })
    };
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NS);
    let name = claim.metadata.name.clone().unwrap();
    let patch = kube::api::Patch::Merge(set("example.com/failed"));
    claims.patch_status(&name, &Default::default(), &patch).await.unwrap();
    let again = wait_until(Duration::from_secs(40), || async {
        claim_of(&admin, "fabric").await.is_some_and(|c| {
            // The patch left the failure in `status.devices`: only taking the allocation
            // back clears it (timestamps have whole seconds: the new one may equal the old).
            let fresh = allocated_since(&c).is_some_and(|t| t >= t1);
            let no_status =
                c.status.as_ref().is_some_and(|s| s.devices.as_ref().is_none_or(Vec::is_empty));
            fresh && no_status
        })
    })
    .await;
    assert!(again, "the failed allocation is taken back and made again\n{}", sched.log_text());
    assert_eq!(node_of(&get(&admin, "fabric").await), None);

    // The driver attaches the device: the pod binds.
    let patch = kube::api::Patch::Merge(set("example.com/attached"));
    claims.patch_status(&name, &Default::default(), &patch).await.unwrap();
    let bound = wait_until(Duration::from_secs(30), || async {
        node_of(&get(&admin, "fabric").await).is_some()
    })
    .await;
    let p = get(&admin, "fabric").await;
    assert!(bound, "binds once attached: {:?}\n{}", reason(&p), sched.log_text());
    assert_eq!(node_of(&p), Some("n1"));
}
