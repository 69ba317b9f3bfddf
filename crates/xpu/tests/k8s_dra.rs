//! `xpu k8s dra-driver` against a real control plane with the real kube-scheduler (DRA is GA
//! and on by default in 1.37): the driver runs as a process on the 8×A100 + 6 NVSwitch fixture
//! host, publishes its ResourceSlices, kube-scheduler allocates claims from them, and a test
//! kubelet built from the upstream `dra/v1` and `pluginregistration/v1` protos registers the
//! driver and prepares and unprepares the claims. No real kubelet: the test plays the Node.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use xpu_integrations::drakubelet;
use xpu_integrations::drapb::v1;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};
use xpu_testkit::{BuildOptions, hosts};

use k8s_support::*;

const NODE: &str = "gpu-node";

/// `xpu k8s dra-driver` for the fixture host, as a process.
fn start_driver(cp: &ControlPlane, root: &Path, dirs: &Path, n: u32) -> XpuProcess {
    let args: Vec<std::ffi::OsString> = vec![
        "k8s".into(),
        "dra-driver".into(),
        "--node-name".into(),
        NODE.into(),
        "--interval-ms".into(),
        "200".into(),
        "--root".into(),
        root.into(),
        "--kubeconfig".into(),
        cp.admin_kubeconfig().into(),
        "--plugin-dir".into(),
        dirs.join("plugins").into(),
        "--registry-dir".into(),
        dirs.join("plugins_registry").into(),
        "--cdi-dir".into(),
        dirs.join("cdi").into(),
    ];
    XpuProcess::spawn(cp, &format!("xpu-dra-driver-{n}"), &args)
}

async fn our_slices(client: &Client) -> Vec<ResourceSlice> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let lp = ListParams::default().fields(&format!("spec.nodeName={NODE},spec.driver=xpu.dev"));
    api.list(&lp).await.unwrap().items
}

fn device_names(slices: &[ResourceSlice]) -> Vec<String> {
    slices.iter().flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone())).collect()
}

fn attr(slices: &[ResourceSlice], device: &str, name: &str) -> Value {
    let d = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == device)
        .unwrap_or_else(|| panic!("device {device} in the slices"));
    serde_json::to_value(&d.attributes.as_ref().unwrap()[name]).unwrap()
}

async fn create_claim(client: &Client, name: &str, request: Value) -> ResourceClaim {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let c: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": { "name": name },
        "spec": { "devices": request },
    }))
    .unwrap();
    api.create(&PostParams::default(), &c).await.unwrap()
}

async fn create_pod(client: &Client, name: &str, claim: &str) {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    let p: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name },
        "spec": {
            "restartPolicy": "Never",
            "resourceClaims": [{ "name": "acc", "resourceClaimName": claim }],
            "containers": [{ "name": "c", "image": "busybox",
                             "resources": { "claims": [{ "name": "acc" }] } }],
        },
    }))
    .unwrap();
    api.create(&PostParams::default(), &p).await.unwrap();
}

async fn allocated(client: &Client, claim: &str) -> Option<Vec<(String, String, String)>> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let c = api.get(claim).await.ok()?;
    let r = c.status?.allocation?.devices?.results?;
    Some(r.into_iter().map(|r| (r.driver, r.pool, r.device)).collect())
}

async fn bound(client: &Client, pod: &str) -> bool {
    let api: Api<Pod> = Api::namespaced(client.clone(), "default");
    api.get(pod).await.ok().as_ref().and_then(node_of).is_some()
}

fn claim_ref(c: &ResourceClaim) -> v1::Claim {
    v1::Claim {
        namespace: c.metadata.namespace.clone().unwrap(),
        uid: c.metadata.uid.clone().unwrap(),
        name: c.metadata.name.clone().unwrap(),
    }
}

fn cdi_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Slices accepted, claims allocated by the real kube-scheduler, prepared and unprepared
/// through the kubelet's gRPC API, a restart keeping the checkpoint, bad claims refused with
/// nothing written, and a device removal reaching the slices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_driver_with_real_scheduler_and_test_kubelet() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    // Namespace, then the DRA manifest as an admin applies it (the DaemonSet: dry run).
    let dir = repo().join("deploy/kubernetes");
    for f in ["namespace.yaml", "dra.yaml"] {
        for doc in documents(&dir.join(f)) {
            let workload = doc["kind"] == "DaemonSet";
            create(&admin, &doc, true)
                .await
                .unwrap_or_else(|e| panic!("{f}: {} fails dry run: {e}", doc["kind"]));
            if !workload {
                create(&admin, &doc, false).await.unwrap();
            }
        }
    }
    add_node(&admin, &NodeDef::new(NODE)).await;

    let host = hosts::a100_8x();
    let fx = host.build_with(&BuildOptions { char_devices: true, ..Default::default() });
    if let Some(v) = &host.nvidia_driver {
        xpu_testkit::driver::install_nvidia(fx.root(), v);
    }
    let dirs = tempfile::tempdir().unwrap();
    let cdi_dir = dirs.path().join("cdi");
    let mut driver = start_driver(&cp, fx.root(), dirs.path(), 1);

    // 1. Slices for the 8 GPUs (not the NVSwitches), accepted by the API server.
    let published = wait_until(Duration::from_secs(30), || async {
        device_names(&our_slices(&admin).await).len() == 8
    })
    .await;
    assert!(
        published,
        "8 devices published: {:?}\n{}",
        our_slices(&admin).await,
        driver.log_text()
    );
    let slices = our_slices(&admin).await;
    assert_eq!(slices[0].spec.pool.name, NODE);
    for a in [
        "kind",
        "model",
        "uuid",
        "numaNode",
        "interconnectDomain",
        "resource.kubernetes.io/pcieRoot",
    ] {
        let d = &device_names(&slices)[0];
        assert!(!attr(&slices, d, a).is_null(), "{a} on {d}");
    }

    // 2. Two GPUs of one NVLink domain.
    create_claim(
        &admin,
        "pair",
        json!({
            "requests": [{ "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 2 } }],
            "constraints": [{ "requests": ["gpus"], "matchAttribute": "xpu.dev/interconnectDomain" }],
        }),
    )
    .await;
    create_pod(&admin, "p-pair", "pair").await;
    // 3. One GPU on NUMA node 1.
    create_claim(
        &admin,
        "numa1",
        json!({ "requests": [{ "name": "gpu", "exactly": { "deviceClassName": "gpu.xpu.dev",
            "selectors": [{ "cel": { "expression": "device.attributes[\"xpu.dev\"].numaNode == 1" } }] } }] }),
    )
    .await;
    create_pod(&admin, "p-numa1", "numa1").await;
    // 4. Nine GPUs: cannot be met.
    create_claim(
        &admin,
        "nine",
        json!({ "requests": [{ "name": "gpus", "exactly": { "deviceClassName": "gpu.xpu.dev", "count": 9 } }] }),
    )
    .await;
    create_pod(&admin, "p-nine", "nine").await;

    let ok = wait_until(Duration::from_secs(60), || async {
        bound(&admin, "p-pair").await && bound(&admin, "p-numa1").await
    })
    .await;
    assert!(ok, "pods bound by kube-scheduler: {:?}", pods(&admin, "default").await);
    let pair = allocated(&admin, "pair").await.unwrap();
    assert_eq!(pair.len(), 2);
    assert!(pair.iter().all(|(drv, pool, _)| drv == "xpu.dev" && pool == NODE));
    assert_eq!(
        attr(&slices, &pair[0].2, "interconnectDomain"),
        attr(&slices, &pair[1].2, "interconnectDomain"),
        "one NVLink domain"
    );
    let numa = allocated(&admin, "numa1").await.unwrap();
    assert_eq!(attr(&slices, &numa[0].2, "numaNode"), json!({ "int": 1 }));

    let podapi: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let pending = wait_until(Duration::from_secs(30), || async {
        podapi.get("p-nine").await.unwrap().status.and_then(|s| s.conditions).is_some_and(|c| {
            c.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
    })
    .await;
    let p9 = podapi.get("p-nine").await.unwrap();
    assert!(pending, "p-nine Pending and Unschedulable: {:?}", p9.status);
    assert!(node_of(&p9).is_none());
    eprintln!(
        "p-nine: {:?}",
        p9.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .map(|c| c.message.clone())
            .collect::<Vec<_>>()
    );

    // 5. The test kubelet registers the driver.
    let reg =
        drakubelet::register(&dirs.path().join("plugins_registry/xpu.dev-reg.sock")).await.unwrap();
    assert_eq!(reg.info.name, "xpu.dev");
    assert_eq!(reg.service, "v1.DRAPlugin");
    assert!(reg.info.supported_versions.contains(&"v1beta1.DRAPlugin".to_owned()));
    let endpoint = PathBuf::from(&reg.info.endpoint);
    let mut kubelet = drakubelet::client_v1(&endpoint).await.unwrap();

    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    let pair_claim = claims.get("pair").await.unwrap();
    let pc = claim_ref(&pair_claim);
    let resp = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![pc.clone()] })
        .await
        .unwrap()
        .into_inner();
    let r = &resp.claims[&pc.uid];
    assert_eq!(r.error, "");
    assert_eq!(r.devices.len(), 2);
    let spec_path = cdi_dir.join(format!("xpu.dev-claim_{}.json", pc.uid));
    // The spec's validation with the container-device-interface crate is xpu-kube's unit test
    // (`dra::prepare`); the crate's TLS features cannot share this binary with kube's.
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    let kind = spec["kind"].as_str().unwrap().to_owned();
    let in_spec: Vec<String> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect();
    for d in &r.devices {
        assert!(pair.iter().any(|(_, _, dev)| *dev == d.device_name));
        for id in &d.cdi_device_ids {
            let (k, name) = id.split_once('=').unwrap();
            assert_eq!(k, kind);
            assert!(in_spec.contains(&name.to_owned()), "{id} resolves in {in_spec:?}");
        }
    }
    let text = std::fs::read_to_string(&spec_path).unwrap();
    assert!(text.contains("/dev/nvidia"), "device nodes in the spec:\n{text}");
    // Idempotent: the same answer again.
    let again = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![pc.clone()] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.claims[&pc.uid], *r);
    // The v1beta1 service answers too.
    let mut beta = drakubelet::client_v1beta1(&endpoint).await.unwrap();
    let b = beta
        .node_prepare_resources(xpu_integrations::drapb::v1beta1::NodePrepareResourcesRequest {
            claims: vec![xpu_integrations::drapb::v1beta1::Claim {
                namespace: pc.namespace.clone(),
                uid: pc.uid.clone(),
                name: pc.name.clone(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(b.claims[&pc.uid].devices.len(), 2);

    // Benchmark: unprepare, then prepare with the API read, over the Unix socket.
    let mut times = Vec::new();
    for _ in 0..100 {
        kubelet
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![pc.clone()],
            })
            .await
            .unwrap();
        let t = Instant::now();
        let r = kubelet
            .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![pc.clone()] })
            .await
            .unwrap()
            .into_inner();
        times.push(t.elapsed());
        assert_eq!(r.claims[&pc.uid].error, "");
    }
    times.sort();
    eprintln!(
        "NodePrepareResources (2-GPU claim, API read, new CDI spec) over 100: p50 {:?} p99 {:?}",
        pct(&times, 0.5),
        pct(&times, 0.99)
    );

    // 6. A restart keeps the checkpoint: the new process unprepares what the old one prepared.
    drop(kubelet);
    drop(beta);
    driver.kill9();
    assert!(spec_path.exists());
    driver = start_driver(&cp, fx.root(), dirs.path(), 2);
    let up = wait_until(Duration::from_secs(20), || async { endpoint.exists() }).await;
    assert!(up, "{}", driver.log_text());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut kubelet = drakubelet::client_v1(&endpoint).await.unwrap();
    let cp_text =
        std::fs::read_to_string(dirs.path().join("plugins/xpu.dev/checkpoint.json")).unwrap();
    assert!(cp_text.contains(&pc.uid), "{cp_text}");
    let again = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![pc.clone()] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.claims[&pc.uid], *r, "the restarted driver answers from its checkpoint");
    let u = kubelet
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: vec![pc.clone()] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(u.claims[&pc.uid].error, "");
    assert!(!spec_path.exists(), "unprepare removes the claim's spec");
    let cp_text =
        std::fs::read_to_string(dirs.path().join("plugins/xpu.dev/checkpoint.json")).unwrap();
    assert!(!cp_text.contains(&pc.uid), "{cp_text}");

    // 7. Bad input: per-claim errors naming the claim, nothing written.
    let gpu = device_names(&slices)[0].clone();
    let before = cdi_files(&cdi_dir);
    let one_gpu =
        json!({ "requests": [{ "name": "r", "exactly": { "deviceClassName": "gpu.xpu.dev" } }] });
    let cases = [
        (
            "other-driver",
            json!({ "results": [{ "request": "r", "driver": "gpu.nvidia.com", "pool": NODE, "device": gpu }] }),
            "gpu.nvidia.com",
        ),
        (
            "other-node",
            json!({ "results": [{ "request": "r", "driver": "xpu.dev", "pool": "node-b", "device": gpu }] }),
            "node-b",
        ),
        (
            "unknown-device",
            json!({ "results": [{ "request": "r", "driver": "xpu.dev", "pool": NODE, "device": "gpu-0000-99-00-0" }] }),
            "gpu-0000-99-00-0",
        ),
        (
            "bad-config",
            json!({
                "results": [{ "request": "r", "driver": "xpu.dev", "pool": NODE, "device": gpu }],
                "config": [{ "source": "FromClaim", "opaque": { "driver": "xpu.dev",
                    "parameters": { "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mode": "vm" } } }],
            }),
            "opaque.parameters",
        ),
    ];
    let mut refs = Vec::new();
    for (name, devices, _) in &cases {
        let c = create_claim(&admin, name, one_gpu.clone()).await;
        let status = json!({ "status": { "allocation": { "devices": devices,
            "nodeSelector": { "nodeSelectorTerms": [{ "matchFields": [
                { "key": "metadata.name", "operator": "In", "values": [NODE] }] }] } } } });
        claims
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap_or_else(|e| panic!("allocating {name} by hand: {e}"));
        refs.push(claim_ref(&c));
    }
    let resp = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: refs.clone() })
        .await
        .unwrap()
        .into_inner();
    for ((name, _, cause), c) in cases.iter().zip(&refs) {
        let e = &resp.claims[&c.uid].error;
        eprintln!("{name}: {e}");
        assert!(e.contains(&format!("default/{name}")) && e.contains(cause), "{name}: {e}");
        assert!(resp.claims[&c.uid].devices.is_empty());
    }
    assert_eq!(cdi_files(&cdi_dir), before, "nothing written for a failed claim");

    // 8. A GPU disappears: the slice follows.
    let victim = pair[0].2.clone();
    let addr = attr(&slices, &victim, "pciBusID")["string"].as_str().unwrap().to_owned();
    let t = Instant::now();
    std::fs::remove_file(fx.device_dir(&addr)).unwrap();
    let gone = wait_until(Duration::from_secs(10), || async {
        let s = our_slices(&admin).await;
        let names = device_names(&s);
        names.len() == 7 && !names.contains(&victim)
    })
    .await;
    let took = t.elapsed();
    assert!(
        gone,
        "slice updated: {:?}\n{}",
        device_names(&our_slices(&admin).await),
        driver.log_text()
    );
    eprintln!("device removed -> slice updated in the API server: {took:?}");
    let s = our_slices(&admin).await;
    assert!(s.iter().all(|s| s.spec.pool.generation > slices[0].spec.pool.generation));
}
