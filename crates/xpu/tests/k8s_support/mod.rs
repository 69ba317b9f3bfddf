//! Shared by the Kubernetes tests: the control plane (real etcd and kube-apiserver from
//! `xpu_testkit::kube`), the deploy manifests applied as a cluster admin would, Node objects
//! played with their status, and `xpu k8s scheduler` run as a process with the token of the
//! ServiceAccount the manifests bind.
#![allow(dead_code, clippy::unwrap_used, clippy::print_stderr)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use xpu_testkit::bundle::ContainerView;
use xpu_testkit::kube::{ControlPlane, ControlPlaneOptions};
use xpu_testkit::sysfs::{MAJOR_NVIDIA, MAJOR_NVIDIA_UVM};
use xpu_testkit::{HostSpec, hosts};

/// Control planes are heavy on 2 cores: the tests of one binary take turns.
pub static TURN: LazyLock<tokio::sync::Mutex<()>> = LazyLock::new(|| tokio::sync::Mutex::new(()));

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Starts the plane; a missing binary fails the test with the install command (never a skip).
pub async fn plane(opts: ControlPlaneOptions) -> ControlPlane {
    match ControlPlane::start(opts).await {
        Ok(cp) => {
            eprintln!("control plane ready in {:?}", cp.startup_time());
            cp
        }
        Err(e) => panic!("control plane: {e}"),
    }
}

/// Every document of a manifest file, as JSON.
pub fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    xpu_testkit::cluster::documents(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Creates one object (server-side dry run when `dry_run`). `Err` carries the API's answer.
pub async fn create(
    client: &Client,
    doc: &Value,
    dry_run: bool,
) -> Result<(), xpu_testkit::cluster::CreateError> {
    xpu_testkit::cluster::create(client, doc, dry_run).await
}

/// Applies the scheduler's manifests as a cluster admin would (everything but the workloads,
/// which need a kubelet; those pass a server-side dry run) and returns a kubeconfig with the
/// token of the ServiceAccount they bind.
pub async fn install_scheduler_rbac(cp: &ControlPlane) -> PathBuf {
    let client = cp.admin_client();
    let dir = repo().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort_by_key(|p| (p.file_name() != Some("namespace.yaml".as_ref()), p.clone()));
    for f in &files {
        for doc in documents(f) {
            let kind = doc["kind"].as_str().unwrap_or("").to_owned();
            let workload = matches!(kind.as_str(), "Deployment" | "DaemonSet");
            create(&client, &doc, true).await.unwrap_or_else(|e| {
                panic!("{}: {kind} fails server-side dry run: {e}", f.display())
            });
            if !workload {
                create(&client, &doc, false).await.unwrap();
            }
        }
    }
    cp.service_account_kubeconfig("xpu-system", "xpu-scheduler").await.unwrap()
}

/// Namespace, then the DRA manifest as an admin applies it (the DaemonSet: dry run).
pub async fn install_dra(admin: &Client) {
    let dir = repo().join("deploy/kubernetes");
    for f in ["namespace.yaml", "dra.yaml"] {
        for doc in documents(&dir.join(f)) {
            let workload = doc["kind"] == "DaemonSet";
            create(admin, &doc, true)
                .await
                .unwrap_or_else(|e| panic!("{f}: {} fails dry run: {e}", doc["kind"]));
            if !workload {
                create(admin, &doc, false).await.unwrap();
            }
        }
    }
}

/// A Node object with its status as a kubelet would report it.
pub struct NodeDef {
    pub name: String,
    pub cpu: String,
    pub memory: String,
    pub extended: Vec<(String, u32)>,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Value>,
    pub ready: bool,
}

impl NodeDef {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            cpu: "32".into(),
            memory: "128Gi".into(),
            extended: Vec::new(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            ready: true,
        }
    }
    pub fn gpus(mut self, res: &str, n: u32) -> Self {
        self.extended.push((res.into(), n));
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }
}

pub async fn add_node(client: &Client, n: &NodeDef) {
    let api: Api<Node> = Api::all(client.clone());
    let mut labels = n.labels.clone();
    labels.insert("kubernetes.io/hostname".into(), n.name.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": n.name, "labels": labels },
        "spec": { "taints": n.taints },
    }))
    .unwrap();
    api.create(&PostParams::default(), &node).await.unwrap();
    let mut alloc = serde_json::Map::new();
    alloc.insert("cpu".into(), json!(n.cpu));
    alloc.insert("memory".into(), json!(n.memory));
    alloc.insert("pods".into(), json!("110"));
    for (k, v) in &n.extended {
        alloc.insert(k.clone(), json!(v.to_string()));
    }
    let status = json!({ "status": {
        "capacity": alloc, "allocatable": alloc,
        "conditions": [{ "type": "Ready", "status": if n.ready { "True" } else { "False" },
                         "reason": "KubeletReady", "message": "played by the test",
                         "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z" }],
    }});
    api.patch_status(&n.name, &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    // Admission taints every new Node `node.kubernetes.io/not-ready:NoSchedule`; the node
    // lifecycle controller (not run: no kubelet heartbeats) would lift it once Ready.
    let spec = json!({ "spec": { "taints": n.taints } });
    api.patch(&n.name, &PatchParams::default(), &Patch::Merge(&spec)).await.unwrap();
}

/// A pod asking `gpus` of `res` (none when 0), for scheduler `xpu`.
pub fn pod(name: &str, res: &str, gpus: u32, labels: &[(&str, &str)]) -> Pod {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    let mut limits = serde_json::Map::new();
    if gpus > 0 {
        limits.insert(res.into(), json!(gpus.to_string()));
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "labels": labels },
        "spec": {
            "schedulerName": "xpu",
            "restartPolicy": "Never",
            "containers": [{ "name": "c", "image": "busybox",
                             "resources": { "requests": { "cpu": "100m", "memory": "64Mi" }, "limits": limits } }],
        },
    }))
    .unwrap()
}

/// Marks a pod Succeeded, as its kubelet would.
pub async fn succeed(client: &Client, ns: &str, name: &str) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let patch = json!({ "status": { "phase": "Succeeded" } });
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
}

pub async fn pods(client: &Client, ns: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    api.list(&ListParams::default()).await.unwrap().items
}

pub fn node_of(p: &Pod) -> Option<&str> {
    p.spec.as_ref()?.node_name.as_deref()
}

/// Polls `f` every 100 ms until it holds or `limit` passes.
pub async fn wait_until<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + limit;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An `xpu` command run as a process (the scheduler, the DRA driver); killed (SIGKILL) on
/// drop. Its log is kept beside the plane's logs and printed when the test fails.
pub struct XpuProcess {
    pub child: Child,
    pub log: PathBuf,
}

/// The scheduler is one such process.
pub type XpuScheduler = XpuProcess;

impl XpuProcess {
    /// `xpu ARGS...`, logging to `<plane dir>/<log_name>.log`.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(cp: &ControlPlane, log_name: &str, args: &[S]) -> Self {
        let log = cp.dir().join(format!("{log_name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_xpu"))
            .args(args)
            .env("RUST_LOG", std::env::var("XPU_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    /// `xpu k8s scheduler --kubeconfig FILE EXTRA...`.
    pub fn start(cp: &ControlPlane, kubeconfig: &Path, name: &str, extra: &[&str]) -> Self {
        let mut args: Vec<std::ffi::OsString> =
            vec!["k8s".into(), "scheduler".into(), "--kubeconfig".into(), kubeconfig.into()];
        args.extend(extra.iter().map(Into::into));
        Self::spawn(cp, &format!("xpu-scheduler-{name}"), &args)
    }

    pub fn kill9(&mut self) {
        // kill fails only when the process has already exited; wait then reaps it either way.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for XpuProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- {} ---\n{}", self.log.display(), tail(&self.log_text(), 4000));
        }
        self.kill9();
    }
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
    &s[start..]
}

/// kube-scheduler v1.37.2 from the test kit's binaries as the plane's default scheduler,
/// logging to `<plane dir>/<log_name>.log`, with `gates` as its `--feature-gates` (empty:
/// none). Kill the child when done.
pub fn start_kube_scheduler(cp: &ControlPlane, log_name: &str, gates: &str) -> Child {
    let cfg = cp.dir().join(format!("{log_name}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n\
             clientConnection:\n  kubeconfig: {}\nleaderElection:\n  leaderElect: false\n",
            cp.admin_kubeconfig().display()
        ),
    )
    .unwrap();
    let bin = xpu_testkit::kube::bin_dir().unwrap().join("kube-scheduler");
    let log = std::fs::File::create(cp.dir().join(format!("{log_name}.log"))).unwrap();
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--config={}", cfg.display())).args(["--secure-port=0", "--v=0"]);
    if !gates.is_empty() {
        cmd.arg(format!("--feature-gates={gates}"));
    }
    cmd.stdin(Stdio::null()).stdout(log.try_clone().unwrap()).stderr(log).spawn().unwrap()
}

/// Waits until the number of bound pods in `default` stays the same for `quiet` (or all
/// `total` are bound, or 90 s pass); returns it. It stops sooner, after [`EXPLAINED_QUIET`]
/// without a change, when every pod that waits has been told why (`PodScheduled=False`): both
/// schedulers write that on a failed attempt, and a pod retried later (kube-scheduler's backoff
/// after a cluster event) is back within that time.
pub async fn settle(admin: &Client, total: usize, quiet: Duration) -> usize {
    let start = Instant::now();
    let (mut last, mut since) = (usize::MAX, Instant::now());
    loop {
        let all = pods(admin, "default").await;
        let n = all.iter().filter(|p| node_of(p).is_some()).count();
        if n != last {
            (last, since) = (n, Instant::now());
        }
        let explained = all.iter().all(|p| node_of(p).is_some() || waits_with_reason(p));
        let still = since.elapsed().min(start.elapsed());
        if n == total
            || still >= quiet
            || (explained && still >= EXPLAINED_QUIET)
            || start.elapsed() > Duration::from_secs(90)
        {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// How long [`settle`] waits without a change once every waiting pod has its reason.
pub const EXPLAINED_QUIET: Duration = Duration::from_secs(5);

/// Whether `p` carries `PodScheduled=False` (a scheduler tried it and said why).
fn waits_with_reason(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "PodScheduled" && c.status == "False"))
}

/// Each pod's node, or why it waits (its `PodScheduled=False` message), one per line.
pub fn report(pods: &[Pod]) -> String {
    let mut out = String::new();
    for p in pods {
        let why = p.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| {
            c.iter()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                .and_then(|c| c.message.clone())
        });
        out.push_str(&format!(
            "  {}: {}\n",
            p.metadata.name.as_deref().unwrap_or(""),
            node_of(p).map_or_else(
                || format!("waits: {}", why.unwrap_or_default()),
                |n| format!("on {n}")
            )
        ));
    }
    out
}

/// Seeds from the comma-separated environment variable `var`, or 1, 2, 3.
pub fn seeds(var: &str) -> Vec<u64> {
    std::env::var(var)
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 3])
}

/// Stops a child process: kill fails only if it exited already, and wait reaps it either way.
pub fn kill(child: Option<Child>) {
    if let Some(mut k) = child {
        let _ = k.kill();
        let _ = k.wait();
    }
}

/// The 8×A100 host with its first four GPUs.
pub fn four_gpu_host() -> HostSpec {
    hosts::a100_4x()
}

/// `c 195:3 rwm` lines as (type, major, minor) → access.
pub fn device_rules(text: &str) -> BTreeMap<(String, String, String), String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let kind = f.next()?.to_owned();
            let (major, minor) = f.next()?.split_once(':')?;
            Some(((kind, major.to_owned(), minor.to_owned()), f.next().unwrap_or("").to_owned()))
        })
        .collect()
}

/// The `/dev` nodes a container given GPUs `minors` of the fixture holds: those and the
/// control nodes.
pub fn gpu_nodes(minors: &[u32]) -> BTreeMap<String, (char, u32, u32)> {
    let mut want: BTreeMap<String, (char, u32, u32)> =
        minors.iter().map(|&m| (format!("/dev/nvidia{m}"), ('c', MAJOR_NVIDIA, m))).collect();
    for (path, major, minor) in [
        ("/dev/nvidiactl", MAJOR_NVIDIA, 255),
        ("/dev/nvidia-modeset", MAJOR_NVIDIA, 254),
        ("/dev/nvidia-uvm", MAJOR_NVIDIA_UVM, 0),
        ("/dev/nvidia-uvm-tools", MAJOR_NVIDIA_UVM, 1),
    ] {
        want.insert(path.to_owned(), ('c', major, minor));
    }
    want
}

/// `/dev`: exactly GPUs `minors` and the control nodes in `gpu`, none in `plain`; the device
/// cgroup: what `gpu` may open beyond `plain` (same pod, same runtime defaults) is exactly those.
pub fn assert_only_these_gpus(gpu: &ContainerView, plain: &ContainerView, minors: &[u32]) {
    assert_only_these_nodes(gpu, plain, &gpu_nodes(minors));
}

/// [`assert_only_these_gpus`] for any set of nodes (a MIG instance's capabilities besides its
/// GPU's).
pub fn assert_only_these_nodes(
    gpu: &ContainerView,
    plain: &ContainerView,
    want: &BTreeMap<String, (char, u32, u32)>,
) {
    let want = want.clone();
    assert_eq!(gpu.accel_nodes(), want, "the GPU container's /dev");
    assert_eq!(plain.accel_nodes(), BTreeMap::new(), "the plain container's /dev");
    if !Path::new("/sys/fs/cgroup/devices").is_dir() {
        eprintln!("cgroup v2 host: the device cgroup is an eBPF program, not compared here");
        return;
    }
    let g = device_rules(&gpu.extra);
    let q = device_rules(&plain.extra);
    assert!(!q.is_empty(), "the plain container's devices.list: {}", plain.extra);
    let extra: BTreeSet<String> = g
        .iter()
        .filter(|(k, _)| !q.contains_key(*k))
        .map(|((kind, major, minor), access)| {
            assert!(access.contains("rw"), "{kind} {major}:{minor} {access}");
            format!("{kind} {major}:{minor}")
        })
        .collect();
    let expected: BTreeSet<String> =
        want.values().map(|(k, ma, mi)| format!("{k} {ma}:{mi}")).collect();
    assert_eq!(extra, expected, "devices.list beyond the plain container's");
    assert!(q.keys().all(|k| g.contains_key(k)), "the GPU container lost a default device");
}

/// `helm ARGS...` in the repository; fails the test with its output when it fails.
pub fn helm_run(args: &[&str]) -> String {
    xpu_testkit::cluster::helm(&repo(), args).unwrap_or_else(|e| panic!("{e}"))
}

/// The chart rendered with `extra` arguments (`--set ...`), as one stream of documents.
pub fn render(extra: &[&str]) -> Vec<Value> {
    xpu_testkit::cluster::render_chart(&repo(), extra).unwrap_or_else(|e| panic!("{e}"))
}

/// `xpu cdi generate --vendor VENDOR --root ROOT --output OUT`: the CDI spec a node's device
/// plugin names, where the node's containerd reads specs.
/// `xpu-container-runtime` as a node's containerd runs it in place of runc (its
/// `BinaryName`), set up in `dir`: xpu's multi-call binary under that name, its settings
/// (`runtime.toml`: the host under `root`, runc behind it, a log, no host snapshot) named by
/// `XPU_RUNTIME_CONFIG` in a wrapper (containerd's runtime options carry no environment).
/// Returns the wrapper, for `NodeOptions::oci_runtime`, and the shim's log.
pub fn shim_runtime(dir: &Path, root: &Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let shim = dir.join("xpu-container-runtime");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_xpu"), &shim).unwrap();
    let config = dir.join("runtime.toml");
    let log = dir.join("shim.log");
    std::fs::write(
        &config,
        format!(
            "root = \"{}\"\nruntime = \"{}\"\nlog_file = \"{}\"\ncdi_dirs = []\n",
            root.display(),
            xpu_testkit::kubelet::RUNC,
            log.display()
        ),
    )
    .unwrap();
    let wrapper = dir.join("runtime");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nXPU_RUNTIME_CONFIG={} exec {} \"$@\"\n",
            config.display(),
            shim.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .unwrap();
    (wrapper, log)
}

pub fn cdi_generate(root: &Path, vendor: &str, out: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["cdi", "generate", "--vendor", vendor, "--root"])
        .arg(root)
        .arg("--output")
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "xpu cdi generate: {}", String::from_utf8_lossy(&o.stderr));
}

/// `xpu k8s dra-driver`'s arguments for node `name` of `node`, discovering `root`, writing
/// slices as the admin (a driver run beside the node has no pod token), every 200 ms.
pub fn dra_driver_args(
    cp: &ControlPlane,
    node: &xpu_testkit::kubelet::Node,
    name: &str,
    root: &Path,
) -> Vec<std::ffi::OsString> {
    let dirs = [node.plugins_dir(), node.plugins_registry_dir(), node.cdi_dir()];
    dra_driver_args_in(cp, name, root, &dirs)
}

/// [`dra_driver_args`] with the kubelet's plugin and registry directories and the CDI
/// directory given.
pub fn dra_driver_args_in(
    cp: &ControlPlane,
    name: &str,
    root: &Path,
    [plugins, registry, cdi]: &[PathBuf; 3],
) -> Vec<std::ffi::OsString> {
    vec![
        "k8s".into(),
        "dra-driver".into(),
        "--node-name".into(),
        name.into(),
        "--interval-ms".into(),
        "200".into(),
        "--root".into(),
        root.into(),
        "--kubeconfig".into(),
        cp.admin_kubeconfig().into(),
        "--plugin-dir".into(),
        plugins.into(),
        "--registry-dir".into(),
        registry.into(),
        "--cdi-dir".into(),
        cdi.into(),
    ]
}
