//! `xpu k8s dra-driver` against a real control plane with the real kube-scheduler (DRA is GA
//! and on by default in 1.37): the driver runs as a process on the 8×A100 + 6 NVSwitch fixture
//! host, publishes its ResourceSlices, kube-scheduler allocates claims from them, and a test
//! kubelet built from the upstream `dra/v1` and `pluginregistration/v1` protos registers the
//! driver and prepares and unprepares the claims; Debian's runc runs busybox with the claim's
//! CDI edits. No real kubelet: the test plays the Node. A second test holds `dra.yaml`'s
//! ValidatingAdmissionPolicy to its word with a pod-bound token of the driver's ServiceAccount.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{SelfSubjectReview, TokenRequest};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use xpu_integrations::drakubelet;
use xpu_integrations::drapb::v1;
use xpu_testkit::bundle::{self, Bundle, ContainerView, RUNC, RuncState, probe_script};
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};
use xpu_testkit::sysfs::{MAJOR_NVIDIA, MAJOR_NVIDIA_UVM};
use xpu_testkit::{BuildOptions, hosts};

use k8s_support::*;

const NODE: &str = "gpu-node";

/// `xpu k8s dra-driver` for the fixture host, as a process.
fn start_driver(cp: &ControlPlane, root: &Path, dirs: &Path, n: u32) -> XpuProcess {
    let dirs = ["plugins", "plugins_registry", "cdi"].map(|d| dirs.join(d));
    let args = dra_driver_args_in(cp, NODE, root, &dirs);
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

/// Runs busybox in Debian's runc with the edits a CDI-aware runtime makes for `ids` from
/// `spec` (CDI `SPEC.md`: the spec's `containerEdits`, then each device's): device nodes in
/// `linux.devices` with a cgroup rule allowing them, bind mounts, environment. Applied here
/// from the spec's JSON, not with xpu's code, so the check does not share the writer's reading.
fn run_with_cdi(spec: &Value, ids: &[String]) -> ContainerView {
    if let Some(why) = bundle::container_tests_unavailable() {
        panic!("runc with the claim's CDI edits cannot run: {why}");
    }
    let b = Bundle::busybox(&probe_script("cat /usr/lib/x86_64-linux-gnu/libcuda.so.1"));
    let mut c = b.config();
    let mut edits = vec![&spec["containerEdits"]];
    for id in ids {
        let (kind, name) = id.split_once('=').unwrap();
        assert_eq!(kind, spec["kind"]);
        let dev = spec["devices"].as_array().unwrap().iter().find(|d| d["name"] == name);
        edits.push(&dev.unwrap_or_else(|| panic!("{id} not in the spec"))["containerEdits"]);
    }
    for key in ["/linux/devices", "/linux/resources/devices", "/mounts", "/process/env"] {
        let v = c.pointer_mut(key);
        if v.as_ref().is_none_or(|v| v.is_null()) {
            let (parent, last) = key.rsplit_once('/').unwrap();
            c.pointer_mut(parent).unwrap()[last] = json!([]);
        }
    }
    for e in edits {
        for n in e["deviceNodes"].as_array().into_iter().flatten() {
            let mut d = json!({ "path": n["path"], "type": n["type"], "major": n["major"],
                                "minor": n["minor"], "uid": 0, "gid": 0 });
            if !n["fileMode"].is_null() {
                d["fileMode"] = n["fileMode"].clone();
            }
            c["linux"]["devices"].as_array_mut().unwrap().push(d);
            c["linux"]["resources"]["devices"].as_array_mut().unwrap().push(json!({
                "allow": true, "type": n["type"], "major": n["major"], "minor": n["minor"],
                "access": "rwm" }));
        }
        for m in e["mounts"].as_array().into_iter().flatten() {
            c["mounts"].as_array_mut().unwrap().push(json!({ "destination": m["containerPath"],
                "type": "bind", "source": m["hostPath"], "options": m["options"] }));
        }
        for v in e["env"].as_array().into_iter().flatten() {
            c["process"]["env"].as_array_mut().unwrap().push(v.clone());
        }
    }
    b.set_config(&c);
    let state = RuncState::new();
    let out = state.run(Path::new(RUNC), &[], &b, &bundle::container_id("dra-claim"), &[]);
    ContainerView::of(&out)
}

/// Slices accepted, claims allocated by the real kube-scheduler, prepared and unprepared
/// through the kubelet's gRPC API, runc given the claim's CDI edits seeing exactly its devices,
/// a restart keeping the checkpoint, bad claims refused with nothing written, and a device
/// removal and a rebind to vfio-pci reaching the slices. Needs root (mknod, runc). Timings
/// are printed, never asserted: `cargo bench -p xpu --bench k8s_dra` measures them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_driver_with_real_scheduler_and_test_kubelet() {
    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    install_dra(&admin).await;
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

    // runc started with the CDI edits of the returned ids sees exactly the allocated GPUs'
    // nodes and the driver's control nodes (those of `xpu cdi generate`'s nvidia.com/gpu spec,
    // nvidia-modeset among them as in nvidia-ctk's), no other GPU.
    let ids: Vec<String> = r.devices.iter().flat_map(|d| d.cdi_device_ids.clone()).collect();
    let mut want: BTreeMap<String, (char, u32, u32)> = [
        ("/dev/nvidiactl", MAJOR_NVIDIA, 255),
        ("/dev/nvidia-modeset", MAJOR_NVIDIA, 254),
        ("/dev/nvidia-uvm", MAJOR_NVIDIA_UVM, 0),
        ("/dev/nvidia-uvm-tools", MAJOR_NVIDIA_UVM, 1),
    ]
    .into_iter()
    .map(|(p, ma, mi)| (p.to_owned(), ('c', ma, mi)))
    .collect();
    for (_, _, dev) in &pair {
        let addr = attr(&slices, dev, "pciBusID")["string"].as_str().unwrap().to_owned();
        let minor = fx
            .spec
            .devices
            .iter()
            .find(|d| d.address.to_string() == addr)
            .and_then(|d| d.nvidia_minor)
            .unwrap();
        want.insert(format!("/dev/nvidia{minor}"), ('c', MAJOR_NVIDIA, minor));
    }
    let seen = run_with_cdi(&spec, &ids);
    assert_eq!(seen.accel_nodes(), want, "the container's device nodes: exactly the claim's");
    assert!(seen.extra.contains("fake libcuda.so"), "driver files mounted: {}", seen.extra);

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
    // The spec is not fsynced: one a power cut left empty is written again, not trusted.
    let whole = std::fs::read(&spec_path).unwrap();
    std::fs::write(&spec_path, b"").unwrap();
    let again = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![pc.clone()] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.claims[&pc.uid], *r);
    assert_eq!(std::fs::read(&spec_path).unwrap(), whole, "an emptied spec is written again");
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
    let checkpoint = dirs.path().join("plugins/xpu.dev/checkpoint.json");
    let checkpoint_before = std::fs::read(&checkpoint).unwrap();
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
        (
            "unknown-field",
            json!({
                "results": [{ "request": "r", "driver": "xpu.dev", "pool": NODE, "device": gpu }],
                "config": [{ "source": "FromClaim", "opaque": { "driver": "xpu.dev",
                    "parameters": { "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mdoe": "passthrough" } } }],
            }),
            "mdoe",
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
    assert_eq!(std::fs::read(&checkpoint).unwrap(), checkpoint_before, "checkpoint untouched");

    // 8. A GPU disappears: the slice follows, keeping it (its claim holds it) tainted, so that
    // no new claim gets it.
    let victim = pair[0].2.clone();
    let addr = attr(&slices, &victim, "pciBusID")["string"].as_str().unwrap().to_owned();
    let t = Instant::now();
    std::fs::remove_file(fx.device_dir(&addr)).unwrap();
    let gone = wait_until(Duration::from_secs(10), || async {
        let s = our_slices(&admin).await;
        let taints: Vec<String> = s
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .filter(|d| d.name == victim)
            .flat_map(|d| d.taints.iter().flatten())
            .map(|t| format!("{}={}:{}", t.key, t.value.clone().unwrap_or_default(), t.effect))
            .collect();
        device_names(&s).len() == 8
            && taints == ["xpu.dev/unhealthy=vanished-from-the-PCI-bus:NoSchedule"]
    })
    .await;
    let took = t.elapsed();
    assert!(
        gone,
        "slice updated: {:?}\n{}",
        device_names(&our_slices(&admin).await),
        driver.log_text()
    );
    eprintln!("device removed -> tainted in the API server's slice: {took:?}");
    let s = our_slices(&admin).await;
    assert!(s.iter().all(|s| s.spec.pool.generation > slices[0].spec.pool.generation));

    // 9. Another GPU is rebound to vfio-pci: the slice says so, and marks it for passthrough.
    let moved = device_names(&s).into_iter().find(|d| *d != victim).unwrap();
    let addr = attr(&s, &moved, "pciBusID")["string"].as_str().unwrap().to_owned();
    std::fs::create_dir_all(fx.root().join("sys/bus/pci/drivers/vfio-pci")).unwrap();
    let link = fx.device_dir(&addr).join("driver");
    let t = Instant::now();
    let tmp = link.with_file_name("driver.new");
    std::os::unix::fs::symlink("../../../bus/pci/drivers/vfio-pci", &tmp).unwrap();
    std::fs::rename(&tmp, &link).unwrap();
    let rebound = wait_until(Duration::from_secs(10), || async {
        let s = our_slices(&admin).await;
        device_names(&s).contains(&moved)
            && attr(&s, &moved, "driver") == json!({ "string": "vfio-pci" })
            && attr(&s, &moved, "passthrough") == json!({ "bool": true })
    })
    .await;
    let took = t.elapsed();
    let s = our_slices(&admin).await;
    assert!(
        rebound,
        "{moved} on vfio-pci in the slice: {:?}\n{}",
        attr(&s, &moved, "driver"),
        driver.log_text()
    );
    eprintln!("device rebound to vfio-pci -> slice updated in the API server: {took:?}");
}

/// A ResourceSlice of driver `xpu.dev` for `node`'s pool, named `name`.
fn slice_for(name: &str, node: &str) -> ResourceSlice {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": { "name": name },
        "spec": {
            "driver": "xpu.dev", "nodeName": node,
            "pool": { "name": node, "generation": 1, "resourceSliceCount": 1 },
            "devices": [{ "name": "gpu-0" }],
        },
    }))
    .unwrap()
}

/// A token for ServiceAccount xpu-system/xpu-dra-driver from the TokenRequest API, bound to
/// `pod` when given (as the kubelet asks for a pod's projected token).
async fn driver_token(admin: &Client, pod: Option<&Pod>) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), "xpu-system");
    let mut spec = json!({ "expirationSeconds": 3600 });
    if let Some(p) = pod {
        spec["boundObjectRef"] = json!({ "apiVersion": "v1", "kind": "Pod",
            "name": p.metadata.name, "uid": p.metadata.uid });
    }
    let request: TokenRequest = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec,
    }))
    .unwrap();
    let answer = accounts
        .create_token_request("xpu-dra-driver", &PostParams::default(), &request)
        .await
        .unwrap();
    let token = serde_json::to_value(answer.status.unwrap()).unwrap()["token"].clone();
    token.as_str().filter(|t| !t.is_empty()).unwrap().to_owned()
}

/// Who the API server takes `client` for: user name and extra info (SelfSubjectReview).
async fn whoami(client: &Client) -> (String, BTreeMap<String, Vec<String>>) {
    let api: Api<SelfSubjectReview> = Api::all(client.clone());
    let review: SelfSubjectReview = serde_json::from_value(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
    }))
    .unwrap();
    let answer = api.create(&PostParams::default(), &review).await.unwrap();
    let user = answer.status.and_then(|s| s.user_info).unwrap();
    (user.username.unwrap_or_default(), user.extra.unwrap_or_default())
}

/// The API server's refusal of `result` (403 or 422), whose message must contain `want`.
fn refused<T: std::fmt::Debug>(result: Result<T, kube::Error>, want: &str, what: &str) -> String {
    match result {
        Err(kube::Error::Api(s)) if matches!(s.code, 403 | 422) && s.message.contains(want) => {
            eprintln!("{what}: {} {}", s.code, s.message);
            s.message
        }
        other => panic!("{what}: want a 403/422 refusal saying {want:?}, got {other:?}"),
    }
}

/// The ValidatingAdmissionPolicy of `dra.yaml`, enforced by the real API server: the driver's
/// ServiceAccount with a token bound to a Pod on node-a (the API server writes the Pod's node
/// into the token's extra info, `authentication.kubernetes.io/node-name`) creates, updates and
/// deletes node-a's ResourceSlices and is refused node-b's, for every verb; with a token bound
/// to no Pod it names no node and writes no slice at all. RBAC alone would allow all of these.
/// No kubelet, no scheduler: the Pod is created bound to node-a and never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_policy_limits_the_driver_to_its_own_nodes_slices() {
    let _turn = TURN.lock().await;
    let started = Instant::now();
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    install_dra(&admin).await;
    add_node(&admin, &NodeDef::new("node-a")).await;
    add_node(&admin, &NodeDef::new("node-b")).await;

    // The driver's pod on node-a, as the DaemonSet controller and scheduler would leave it.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "xpu-system");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "xpu-dra-driver-a" },
        "spec": {
            "nodeName": "node-a",
            "serviceAccountName": "xpu-dra-driver",
            "containers": [{ "name": "dra-driver", "image": "localhost/xpu:0.1.0" }],
        },
    }))
    .unwrap();
    let pod = pods.create(&PostParams::default(), &pod).await.unwrap();

    let token = driver_token(&admin, Some(&pod)).await;
    let bound = cp.client_with_token("xpu-dra-driver-a", &token).await.unwrap();
    let (user, extra) = whoami(&bound).await;
    assert_eq!(user, "system:serviceaccount:xpu-system:xpu-dra-driver");
    assert_eq!(
        extra.get("authentication.kubernetes.io/node-name"),
        Some(&vec!["node-a".to_owned()]),
        "the pod-bound token names the pod's node: {extra:?}"
    );
    let token = driver_token(&admin, None).await;
    let unbound = cp.client_with_token("xpu-dra-driver", &token).await.unwrap();
    let (user, extra) = whoami(&unbound).await;
    assert_eq!(user, "system:serviceaccount:xpu-system:xpu-dra-driver");
    assert!(!extra.contains_key("authentication.kubernetes.io/node-name"), "{extra:?}");

    let as_driver: Api<ResourceSlice> = Api::all(bound.clone());
    let as_admin: Api<ResourceSlice> = Api::all(admin.clone());
    let pp = PostParams::default();
    // The API server loads a new policy asynchronously: wait until it refuses a dry run.
    let dry = PostParams { dry_run: true, ..PostParams::default() };
    let b = slice_for("node-b-xpu.dev", "node-b");
    let enforced = wait_until(Duration::from_secs(30), || async {
        matches!(as_driver.create(&dry, &b).await, Err(kube::Error::Api(s)) if s.code != 404)
    })
    .await;
    assert!(
        enforced,
        "the policy never refused node-b's slice: {:?}",
        as_driver.create(&dry, &b).await
    );

    // node-a's own slice: create, update, delete.
    let a = as_driver.create(&pp, &slice_for("node-a-xpu.dev", "node-a")).await.unwrap();
    let mut a2 = a.clone();
    a2.spec.pool.generation = 2;
    let a2 = as_driver.replace("node-a-xpu.dev", &pp, &a2).await.unwrap();
    assert_eq!(a2.spec.pool.generation, 2);

    // node-b's: refused to create; the one an admin made refused to update and delete.
    let other = "xpu-dra-driver on node node-a may not write the ResourceSlices of node node-b";
    refused(as_driver.create(&pp, &b).await, other, "create node-b's slice");
    as_admin.create(&pp, &b).await.unwrap();
    let mut b2 = as_driver.get("node-b-xpu.dev").await.unwrap();
    b2.spec.pool.generation = 2;
    refused(as_driver.replace("node-b-xpu.dev", &pp, &b2).await, other, "update node-b's slice");
    let patch = json!({ "spec": { "pool": { "generation": 3 } } });
    let patch = Patch::Merge(&patch);
    let r = as_driver.patch("node-b-xpu.dev", &PatchParams::default(), &patch).await;
    refused(r, other, "patch node-b's slice");
    let r = as_driver.delete("node-b-xpu.dev", &DeleteParams::default()).await;
    refused(r, other, "delete node-b's slice");
    assert_eq!(as_admin.get("node-b-xpu.dev").await.unwrap().spec.pool.generation, 1);

    // A token bound to no pod names no node: not even node-a's slice.
    let no_pod = "may write ResourceSlices only from a pod's token";
    let as_unbound: Api<ResourceSlice> = Api::all(unbound.clone());
    let r = as_unbound.create(&pp, &slice_for("node-a-xpu.dev-2", "node-a")).await;
    refused(r, no_pod, "create without a pod-bound token");
    let r = as_unbound.delete("node-a-xpu.dev", &DeleteParams::default()).await;
    refused(r, no_pod, "delete without a pod-bound token");

    // Reads are RBAC's alone, and the policy leaves others (the admin) alone.
    assert_eq!(as_unbound.list(&ListParams::default()).await.unwrap().items.len(), 2);
    as_driver.delete("node-a-xpu.dev", &DeleteParams::default()).await.unwrap();
    as_admin.delete("node-b-xpu.dev", &DeleteParams::default()).await.unwrap();
    eprintln!("policy test done in {:?}", started.elapsed());
}

/// Issue 41: MIG partitions as partitionable devices, against the real API server and
/// kube-scheduler v1.37.2. The 8×A100 fixture with its first GPU in MIG mode (the MIG fake, by
/// NVIDIA's A100 40GB table) is published by the driver's publisher (a slice of counter sets,
/// then the devices); the API server accepts it; kube-scheduler allocates claims for a
/// `1g.5gb` and a `3g.20gb` at placements that do not overlap and leaves a `4g.20gb` claim
/// unallocated (the GPU's slices are not all free), while an instance made outside xpu keeps
/// its slices from every claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_partitions_are_accepted_and_kube_scheduler_allocates_them_without_overlap() {
    use xpu_kube::dra::slices;
    use xpu_telemetry::mig::{FakeMig, MigControl};

    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default().with_scheduler()).await;
    let admin = cp.admin_client();
    // Every manifest (the DRA classes among them) and the scheduler's token, for xpu below.
    let kubeconfig = install_scheduler_rbac(&cp).await;
    add_node(&admin, &NodeDef::new(NODE)).await;

    let fx = hosts::a100_8x().build();
    let root = xpu_host::Root::new(fx.root()).unwrap();
    let inv = xpu_host::discover(&root, &Default::default()).unwrap();
    let gpus: Vec<_> = inv.accelerators().map(|d| d.address).collect();
    let mig =
        FakeMig::new(gpus.iter().enumerate().map(|(i, a)| (*a, "NVIDIA A100-SXM4-40GB", i == 0)));
    // Slices 0 and 1 of GPU 0 hold an instance someone else made.
    mig.create_outside(gpus[0], "1g.10gb", 0).unwrap();
    let (devices, counters) =
        slices::with_mig(slices::devices(&root, &inv), &inv, &mig.gpus().unwrap());
    let mut publisher = slices::Publisher::new(admin.clone(), NODE).await.unwrap();
    publisher.publish_with(devices, counters).await.unwrap_or_else(|e| {
        panic!("the API server refused the MIG pool: {}", xpu_core::error::chain_once(&e))
    });
    let published = our_slices(&admin).await;
    let names = device_names(&published);
    let parts: Vec<&String> = names.iter().filter(|n| n.contains("-mig-")).collect();
    // Of the 25 placements, those clear of slices 0-1: 1g (and 1g+me) at 2-6, 1g.10gb at
    // 2/4/6, 2g at 2/4, 3g at 4; no 4g or 7g.
    assert_eq!(parts.len(), 5 + 5 + 3 + 2 + 1, "{parts:?}");
    assert_eq!(names.len() - parts.len(), 7, "the other seven GPUs whole");

    let mig_request = |profile: &str| {
        json!({ "requests": [{ "name": "mig", "exactly": {
            "deviceClassName": "mig.xpu.dev",
            "selectors": [{ "cel": { "expression":
                format!("device.attributes[\"xpu.dev\"].profile == \"{profile}\"") } }] } }] })
    };
    let mut placed = Vec::new();
    for (claim, profile) in [("small", "1g.5gb"), ("large", "3g.20gb")] {
        create_claim(&admin, claim, mig_request(profile)).await;
        create_pod(&admin, &format!("{claim}-pod"), claim).await;
        let got = wait_until(Duration::from_secs(60), || async {
            allocated(&admin, claim).await.is_some()
        })
        .await;
        assert!(got, "kube-scheduler allocated {claim}");
        let device = allocated(&admin, claim).await.unwrap().remove(0).2;
        let start: u8 = device.rsplit('-').next().unwrap().parse().unwrap();
        let size = if profile == "1g.5gb" { 1 } else { 4 };
        assert!(device.contains(&profile.replace('.', "-")), "{device}");
        placed.push((device, start, size));
    }
    eprintln!("kube-scheduler placed {placed:?}");
    let (a, b) = (&placed[0], &placed[1]);
    assert!(a.1 + a.2 <= b.1 || b.1 + b.2 <= a.1, "no overlap: {placed:?}");
    assert!(placed.iter().all(|p| p.1 >= 2), "clear of the outside instance: {placed:?}");
    // A 4g cannot come: its slices are not all free.
    create_claim(&admin, "whole", mig_request("4g.20gb")).await;
    create_pod(&admin, "whole-pod", "whole").await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(allocated(&admin, "whole").await, None, "a 4g.20gb does not fit beside them");
    assert!(!bound(&admin, "whole-pod").await);

    // xpu's scheduler, on a second node with the same GPUs all in MIG mode: the same claims
    // (and a 4g beside a 3g: the whole GPU in two), never overlapping.
    let sched = XpuScheduler::start(&cp, &kubeconfig, "mig", &[]);
    add_node(&admin, &NodeDef::new("mig-node")).await;
    let mig = FakeMig::new(gpus.iter().map(|a| (*a, "NVIDIA A100-SXM4-40GB", true)));
    let (devices, counters) =
        slices::with_mig(slices::devices(&root, &inv), &inv, &mig.gpus().unwrap());
    let mut publisher = slices::Publisher::new(admin.clone(), "mig-node").await.unwrap();
    publisher.publish_with(devices, counters).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let mut held: BTreeMap<String, Vec<(u8, u8)>> = BTreeMap::new();
    for (claim, profile, size) in
        [("x-small", "1g.5gb", 1), ("x-large", "3g.20gb", 4), ("x-four", "4g.20gb", 4)]
    {
        create_claim(&admin, claim, mig_request(profile)).await;
        let p: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": format!("{claim}-pod") },
            "spec": {
                "schedulerName": "xpu",
                "nodeSelector": { "kubernetes.io/hostname": "mig-node" },
                "resourceClaims": [{ "name": "acc", "resourceClaimName": claim }],
                "containers": [{ "name": "c", "image": "busybox",
                                 "resources": { "claims": [{ "name": "acc" }] } }],
            },
        }))
        .unwrap();
        pods.create(&PostParams::default(), &p).await.unwrap();
        let got = wait_until(Duration::from_secs(60), || async {
            allocated(&admin, claim).await.is_some()
        })
        .await;
        let pod = pods.get(&format!("{claim}-pod")).await.unwrap();
        let why = serde_json::to_string(&pod.status).unwrap();
        let log: String = sched
            .log_text()
            .lines()
            .filter(|l| l.contains(claim) || l.contains("slice") || l.contains("pool"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(got, "xpu allocated {claim}: {why}\n{log}");
        let (_, pool, device) = allocated(&admin, claim).await.unwrap().remove(0);
        assert_eq!(pool, "mig-node");
        let start: u8 = device.rsplit('-').next().unwrap().parse().unwrap();
        let gpu = device.split("-mig-").next().unwrap().to_owned();
        held.entry(gpu).or_default().push((start, size));
    }
    eprintln!("xpu placed {held:?}");
    for (gpu, spans) in &held {
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "{gpu}: overlap in {spans:?}");
            }
        }
    }
}

/// An MI300X node in CPX mode publishes its 64 partitions, which the API server accepts; and
/// slices deleted under the driver (as a restarting kubelet deletes them) are published again
/// at the next check, not left gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amd_partitions_are_accepted_and_deleted_slices_are_published_again() {
    use xpu_kube::dra::slices;

    let _turn = TURN.lock().await;
    let cp = plane(ControlPlaneOptions::default()).await;
    let admin = cp.admin_client();
    add_node(&admin, &NodeDef::new(NODE)).await;
    let fx = hosts::mi300x_cpx().build();
    let root = xpu_host::Root::new(fx.root()).unwrap();
    let inv = xpu_host::discover(&root, &Default::default()).unwrap();
    let devices = slices::devices(&root, &inv);
    let mut publisher = slices::Publisher::new(admin.clone(), NODE).await.unwrap();
    publisher.publish(devices.clone()).await.unwrap_or_else(|e| {
        panic!("the API server refused the partitions: {}", xpu_core::error::chain_once(&e))
    });
    let names = device_names(&our_slices(&admin).await);
    assert_eq!(names.len(), 64, "{names:?}");
    assert!(names.iter().all(|n| n.contains("-xcp-")), "{names:?}");
    let published = our_slices(&admin).await;
    let name = &names[3];
    assert_eq!(attr(&published, name, "computePartition"), json!({ "string": "CPX" }));

    // Deleted under the driver: within one check interval they are back, one generation on.
    let api: Api<ResourceSlice> = Api::all(admin.clone());
    for s in our_slices(&admin).await {
        api.delete(s.metadata.name.as_deref().unwrap(), &Default::default()).await.unwrap();
    }
    assert!(our_slices(&admin).await.is_empty());
    let generation = publisher.generation();
    let mut again = false;
    let deadline = Instant::now() + slices::SLICES_CHECKED_EVERY * 3;
    while !again && Instant::now() < deadline {
        again = publisher.publish(devices.clone()).await.unwrap();
        if !again {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    assert!(again, "published again within {:?}", slices::SLICES_CHECKED_EVERY * 3);
    assert_eq!(publisher.generation(), generation + 1);
    assert_eq!(device_names(&our_slices(&admin).await).len(), 64);
    // Unchanged and present: nothing written.
    assert!(!publisher.publish(devices).await.unwrap());
}
