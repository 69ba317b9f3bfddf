//! A real Kubernetes node for tests: upstream kubelet and containerd (with Debian's runc) joined
//! to a [`ControlPlane`], so the device plugin and the DRA driver are driven by the kubelet users
//! run instead of a played one.
//!
//! The kubelet keeps some host paths fixed (`/var/lib/kubelet/device-plugins`, `/var/log/pods`,
//! containerd's `/run/containerd`), so [`Node::start`] runs both daemons in private mount and PID
//! namespaces (`unshare`) whose first process, a short bash script, lays the node out before
//! starting them:
//! - `/var/lib` and `/var/log` are bind mounts of the run directory's `var/lib` and `var/log`:
//!   the test reads the kubelet's sockets, checkpoints and container logs at
//!   [`Node::var_lib`]`/kubelet/...` from outside, and a plugin serving there is reached by the
//!   kubelet at its fixed path;
//! - `/run` is a fresh tmpfs, `/dev` an overlay of the host's `/dev` on a tmpfs, with the
//!   character devices of a fixture host ([`NodeOptions::devices_of`]) made there by `mknod`:
//!   containerd stats the node it is told to give a container and runc makes one with the same
//!   numbers inside it, neither opens it, so fixture majors and minors (195:N for `/dev/nvidiaN`)
//!   need no hardware;
//! - pods get their cgroups under a per-run `cgroupRoot` (`/xpu-node-<pid>-<n>` in every
//!   hierarchy) that the fixture makes and removes.
//!
//! The host is not changed otherwise: mounts die with the namespace, and killing the namespace's
//! first process (dropping the [`Node`]) kills containerd, its shims and every container with it.
//!
//! A node is named by a loopback address (`127.0.0.1` by default; [`NodeOptions::named`] gives
//! the other nodes of a multi-node test theirs, each in its own namespaces with its own run
//! directory, cgroup root and ports, its kubelet and stream server listening on that address):
//! the kubelet takes a node name that is an IP address as the Node's InternalIP, and the API
//! server accepts a loopback one. A CNI plugin of a few shell
//! lines creates no interface and reports a `127.0.x.y` address, which is all containerd needs to
//! call the pod network ready. Images come from `node-images.tar` (`scripts/install-node`):
//! `xpu.test/busybox:1` for test containers and `xpu.test/pause:1` (busybox `sleep`) as the
//! sandbox image, imported with `ctr`, never pulled. The kubelet authenticates as
//! `system:node:<name>` with a client certificate from the control plane's CA
//! ([`ControlPlane::node_kubeconfig`]), so the `Node` authorizer and NodeRestriction hold it to
//! its own Node as in a cluster; it serves its API to anyone on 127.0.0.1 (anonymous,
//! `AlwaysAllow`: the API server fetches logs through it), and runs with `failCgroupV1: false`
//! for cgroup v1 hosts.
//! Once the Node is Ready the fixture removes the `node.kubernetes.io/not-ready` taint that the
//! node lifecycle controller would remove in a cluster.
//!
//! Needs root. The kubelet comes from `scripts/install-k8s`, containerd, its shim, `ctr` and the
//! images from `scripts/install-node`, all in one cache ([`crate::kube::bin_dir`]); a missing one
//! fails with the command that makes it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ::kube::api::{Patch, PatchParams};
use ::kube::{Api, ResourceExt};
use k8s_openapi::api::core::v1::Node as NodeObject;

use crate::kube::{ControlPlane, bin_dir, free_ports, log_tail, target_dir};

/// The node's name, and its InternalIP.
pub const NODE_NAME: &str = "127.0.0.1";
/// Where a node started with [`NodeOptions::host_root`] shows that fixture host, in its own
/// mount namespace (under `/var/lib`, the node's own directory, so the host is not touched).
pub const HOST_ROOT: &str = "/var/lib/xpu-host";
/// The image test containers run (busybox, `sh` as its command), imported at start.
pub const BUSYBOX_IMAGE: &str = "xpu.test/busybox:1";
/// containerd's sandbox image: busybox `sleep`.
pub const PAUSE_IMAGE: &str = "xpu.test/pause:1";
/// containerd's version `scripts/install-node` builds.
pub const CONTAINERD_VERSION: &str = "v2.4.2";
/// Debian's runc, which containerd's shim runs.
pub const RUNC: &str = "/usr/sbin/runc";
/// The taint a kubelet registers its Node with until the node lifecycle controller sees it Ready.
const NOT_READY_TAINT: &str = "node.kubernetes.io/not-ready";
const POLL: Duration = Duration::from_millis(200);

static RUN_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Why a node could not be started.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(
        "{binary} not found in {}; run {script} to build it, or set XPU_K8S_BIN to a directory that holds it",
        dir.display()
    )]
    MissingBinary { binary: &'static str, dir: PathBuf, script: &'static str },

    #[error(transparent)]
    Harness(#[from] crate::kube::HarnessError),

    #[error("a node needs root (mount namespaces, mknod, cgroups); this process runs as uid {0}")]
    NotRoot(u32),

    #[error("cannot {action} {}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "the node's socket directory {} is {len} bytes long, too long for the sockets in it (a Unix socket path has at most 107); set TMPDIR to a shorter directory",
        dir.display()
    )]
    PathTooLong { dir: PathBuf, len: usize },

    #[error("cannot run unshare for the node's namespaces; it comes with util-linux")]
    Spawn(#[source] io::Error),

    #[error("the node's namespace exited during start-up; logs in {}:\n{tails}", dir.display())]
    Exited { dir: PathBuf, tails: String },

    #[error(
        "Node {name} not Ready after {waited:.1?} (last: {last}); logs in {}:\n{tails}",
        dir.display()
    )]
    NotReady { name: String, waited: Duration, last: String, dir: PathBuf, tails: String },

    #[error(
        "node name {0:?} is not a loopback IPv4 address; name test nodes 127.0.0.2, 127.0.0.3, ... (the kubelet takes the name as the node's address and serves there)"
    )]
    BadName(String),

    #[error("{action} failed on the test API server")]
    Api {
        action: &'static str,
        #[source]
        source: ::kube::Error,
    },
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> NodeError + 'a {
    move |source| NodeError::Io { action, path: path.to_path_buf(), source }
}

/// How the node runs.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// The Node's name and address: a loopback IPv4 address ([`NODE_NAME`] by default), where
    /// the kubelet and containerd's stream server listen. Nodes of one test differ in it.
    pub name: String,
    /// The kubelet's `nodeStatusUpdateFrequency` (and report frequency): how soon a change of
    /// allocatable devices reaches the Node's status.
    pub node_status_update: Duration,
    /// A fixture host root whose character devices under `dev/` are made, with the same majors,
    /// minors and paths, in the node's `/dev`.
    pub devices_of: Option<PathBuf>,
    /// A fixture host root the node shows its pods at [`HOST_ROOT`] (a bind mount in the
    /// node's namespace), where a DaemonSet's `hostPath: /` is pointed for the test.
    pub host_root: Option<PathBuf>,
    /// More image archives (OCI layouts) imported into the node's containerd at start, beside
    /// the test images: `scripts/build-image --oci-archive`'s, say.
    pub images: Vec<PathBuf>,
    /// Flags appended to the kubelet's command line.
    pub kubelet_flags: Vec<String>,
    /// Run this older kubelet release ([`OLD_KUBELET_VERSION`]) instead of the control plane's.
    pub old_kubelet: bool,
    /// How long the node may take to become Ready.
    pub ready_timeout: Duration,
    /// The OCI runtime containerd's `runc` runtime runs (its `BinaryName`): [`RUNC`] unless
    /// set, an OCI runtime shim in front of it (`xpu-container-runtime`) when set.
    pub oci_runtime: Option<PathBuf>,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            name: NODE_NAME.to_owned(),
            node_status_update: Duration::from_secs(4),
            devices_of: None,
            host_root: None,
            images: Vec::new(),
            kubelet_flags: Vec::new(),
            old_kubelet: false,
            ready_timeout: Duration::from_secs(120),
            oci_runtime: None,
        }
    }
}

impl NodeOptions {
    /// Name the node (and give it the address) `name`, a loopback IPv4 address such as
    /// `127.0.0.2`: several nodes of one control plane each take their own.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Give the node's `/dev` the character devices of the fixture host at `root`.
    pub fn devices_of(mut self, root: impl Into<PathBuf>) -> Self {
        self.devices_of = Some(root.into());
        self
    }

    /// Show the fixture host at `root` to the node's pods at [`HOST_ROOT`].
    pub fn host_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.host_root = Some(root.into());
        self
    }

    /// Import the image archive at `path` into the node's containerd at start.
    pub fn image(mut self, path: impl Into<PathBuf>) -> Self {
        self.images.push(path.into());
        self
    }

    /// Have containerd run containers through the OCI runtime at `path` instead of runc.
    pub fn oci_runtime(mut self, path: impl Into<PathBuf>) -> Self {
        self.oci_runtime = Some(path.into());
        self
    }

    /// Append one flag to the kubelet's command line.
    pub fn kubelet_flag(mut self, flag: impl Into<String>) -> Self {
        self.kubelet_flags.push(flag.into());
        self
    }

    /// Run the kubelet of [`OLD_KUBELET_VERSION`] (`scripts/install-k8s` builds it beside the
    /// current one): a release built with a grpc-go that sends a Unix socket's path as the
    /// HTTP/2 `:authority`, as kubelets before 1.26 do. It takes the runtime endpoint as a flag
    /// (the configuration file's field came in 1.27) and has no `failCgroupV1` (cgroup v1 was
    /// simply supported then).
    pub fn old_kubelet(mut self) -> Self {
        self.old_kubelet = true;
        self
    }
}

/// The older kubelet release [`NodeOptions::old_kubelet`] runs: the last minor release before
/// kubelets sent `localhost` as the `:authority` of their plugin calls.
pub const OLD_KUBELET_VERSION: &str = "v1.25.16";
/// Its file name in the binaries' directory (`scripts/install-k8s`).
const OLD_KUBELET_BINARY: &str = "kubelet-v1.25.16";

/// The binaries and images a node needs, checked before anything starts.
struct NodeBinaries {
    dir: PathBuf,
    images: PathBuf,
    kubelet: PathBuf,
}

impl NodeBinaries {
    fn find(options: &NodeOptions) -> Result<NodeBinaries, NodeError> {
        let dir = bin_dir()?;
        let images = dir.parent().unwrap_or(&dir).join("node-images.tar");
        let (kubelet, kubelet_name) = if options.old_kubelet {
            (dir.join(OLD_KUBELET_BINARY), OLD_KUBELET_BINARY)
        } else {
            (dir.join("kubelet"), "kubelet")
        };
        let needed = [
            (kubelet_name, kubelet.clone(), "scripts/install-k8s"),
            ("containerd", dir.join("containerd"), "scripts/install-node"),
            (
                "containerd-shim-runc-v2",
                dir.join("containerd-shim-runc-v2"),
                "scripts/install-node",
            ),
            ("ctr", dir.join("ctr"), "scripts/install-node"),
            ("node-images.tar", images.clone(), "scripts/install-node"),
            ("runc", PathBuf::from(RUNC), "scripts/install-test-deps"),
        ];
        for (binary, path, script) in needed {
            if !path.is_file() {
                let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
                return Err(NodeError::MissingBinary { binary, dir, script });
            }
        }
        Ok(NodeBinaries { dir, images, kubelet })
    }
}

/// A running node; dropping it kills the kubelet, containerd and every container, removes the
/// pods' cgroups, and removes the run directory (kept, with its path printed, when the thread
/// is panicking or start-up failed).
pub struct Node {
    name: String,
    dir: PathBuf,
    holder: Option<Child>,
    cgroups: Vec<PathBuf>,
    kubelet_port: u16,
    startup: Duration,
    keep: bool,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("dir", &self.dir)
            .field("kubelet_port", &self.kubelet_port)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Start containerd and the kubelet joined to `cp`, and wait until the Node is Ready and
    /// schedulable.
    // Test-only crate: the start-up time is the number to watch on a loaded machine, and the
    // test harness shows stderr with the test's output.
    #[allow(clippy::print_stderr)]
    pub async fn start(cp: &ControlPlane, options: NodeOptions) -> Result<Node, NodeError> {
        let uid = rustix::process::geteuid();
        if !uid.is_root() {
            return Err(NodeError::NotRoot(uid.as_raw()));
        }
        let bins = NodeBinaries::find(&options)?;
        let started = Instant::now();
        let mut node = Node::prepare(&options)?;
        node.spawn(cp, &bins, &options)?;
        node.wait_ready(cp, &options, started).await?;
        node.startup = started.elapsed();
        node.keep = false;
        eprintln!(
            "xpu-testkit: node {} Ready in {:.2?} (kubelet on port {}), run directory {}",
            node.name,
            node.startup,
            node.kubelet_port,
            node.dir.display()
        );
        Ok(node)
    }

    /// The Node's name, which is also its address.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Stops the kubelet (SIGTERM, as `systemctl restart` does) and waits until it runs again
    /// and the Node is Ready: containerd and every container keep running meanwhile.
    pub async fn restart_kubelet(&self, cp: &ControlPlane) -> Result<Duration, NodeError> {
        let started = Instant::now();
        let old = self
            .kubelet_pid()
            .ok_or_else(|| NodeError::Exited { dir: self.dir.clone(), tails: tails(&self.dir) })?;
        rustix::process::kill_process(old, rustix::process::Signal::TERM).map_err(|e| {
            NodeError::Io { action: "signal", path: self.dir.clone(), source: e.into() }
        })?;
        let nodes: Api<NodeObject> = Api::all(cp.admin_client());
        loop {
            let again = self.kubelet_pid().is_some_and(|p| p != old);
            if again && self.kubelet_healthy() {
                let n = nodes.get_opt(&self.name).await.ok().flatten();
                let ready = n
                    .and_then(|n| n.status)
                    .and_then(|s| s.conditions)
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                if ready {
                    return Ok(started.elapsed());
                }
            }
            if started.elapsed() > Duration::from_secs(60) {
                return Err(NodeError::NotReady {
                    name: self.name.clone(),
                    waited: started.elapsed(),
                    last: "the kubelet after a restart".to_owned(),
                    dir: self.dir.clone(),
                    tails: tails(&self.dir),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// The host pid of this node's kubelet: the process whose command line names this run
    /// directory's `kubelet.json`.
    fn kubelet_pid(&self) -> Option<rustix::process::Pid> {
        let flag = format!("--config={}", self.dir.join("kubelet.json").display());
        let entries = fs::read_dir("/proc").ok()?;
        entries.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = fs::read(e.path().join("cmdline")).ok()?;
            cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == flag.as_bytes())
                .then(|| rustix::process::Pid::from_raw(pid))
                .flatten()
        })
    }

    /// Whether the kubelet's healthz answers `ok`.
    fn kubelet_healthy(&self) -> bool {
        let Ok(text) = fs::read_to_string(self.dir.join("kubelet.json")) else { return false };
        let Ok(config) = serde_json::from_str::<serde_json::Value>(&text) else { return false };
        let Some(port) = config["healthzPort"].as_u64() else { return false };
        let addr = format!("{}:{port}", self.name);
        let Ok(mut s) = std::net::TcpStream::connect(&addr) else { return false };
        if s.set_read_timeout(Some(Duration::from_secs(2))).is_err() {
            // Without a timeout the read below could wait for ever: not healthy yet.
            return false;
        }
        use std::io::{Read, Write};
        let req = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        let mut out = String::new();
        s.write_all(req.as_bytes()).is_ok()
            && s.read_to_string(&mut out).is_ok()
            && out.starts_with("HTTP/1.1 200")
    }

    /// The run directory: configurations and `node.log`, `containerd.log`, `kubelet.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the node sees as `/var/lib` (the kubelet's and containerd's state), from outside.
    pub fn var_lib(&self) -> PathBuf {
        self.dir.join("var/lib")
    }

    /// The kubelet's device plugin directory (`/var/lib/kubelet/device-plugins` in the node):
    /// pass it to a device plugin as its `--plugin-dir`.
    pub fn device_plugin_dir(&self) -> PathBuf {
        self.var_lib().join("kubelet/device-plugins")
    }

    /// The kubelet's plugin registration directory (`/var/lib/kubelet/plugins_registry`), where
    /// DRA drivers put their registration sockets.
    pub fn plugins_registry_dir(&self) -> PathBuf {
        self.var_lib().join("kubelet/plugins_registry")
    }

    /// `/var/lib/kubelet/plugins` in the node: DRA drivers' service sockets.
    pub fn plugins_dir(&self) -> PathBuf {
        self.var_lib().join("kubelet/plugins")
    }

    /// The directory containerd reads CDI specs from (`cdi_spec_dirs`).
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.join("cdi")
    }

    /// What the node sees as `/var/log` (`pods/<namespace>_<name>_<uid>/<container>/0.log`).
    pub fn var_log(&self) -> PathBuf {
        self.dir.join("var/log")
    }

    /// From the call to [`Node::start`] until the Node was Ready and untainted.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The last lines of the node's logs (its script, containerd, the kubelet).
    pub fn log_tails(&self) -> String {
        tails(&self.dir)
    }

    /// The run directory, configuration files, cgroups: everything before a process starts.
    fn prepare(options: &NodeOptions) -> Result<Node, NodeError> {
        let name = options.name.clone();
        if !name.parse::<std::net::Ipv4Addr>().is_ok_and(|a| a.is_loopback()) {
            return Err(NodeError::BadName(name));
        }
        let base = run_base();
        fs::create_dir_all(&base).map_err(io_err("create", &base))?;
        let pid = std::process::id();
        let (dir, n) = loop {
            let n = RUN_COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir = base.join(format!("node-{pid}-{n}"));
            match fs::create_dir(&dir) {
                Ok(()) => break (dir, n),
                // Left by an earlier process with the same pid.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(source) => return Err(NodeError::Io { action: "create", path: dir, source }),
            }
        };
        let [kubelet_port, healthz_port] = free_ports()?;
        let cgroup_root = format!("xpu-node-{pid}-{n}");
        let mut node = Node {
            name,
            dir,
            holder: None,
            cgroups: Vec::new(),
            kubelet_port,
            startup: Duration::ZERO,
            keep: true,
        };
        let dir = node.dir.clone();
        for sub in ["var/lib/kubelet", "var/log", "scratch", "cdi", "cni/bin", "cni/net.d"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(io_err("create", &path))?;
        }
        // The kubelet's device plugin directory exists before the kubelet does, so a plugin
        // started first finds it (as on a node where the kubelet package made it).
        let plugins = node.device_plugin_dir();
        fs::create_dir_all(&plugins).map_err(io_err("create", &plugins))?;

        let runtime = options.oci_runtime.clone().unwrap_or_else(|| PathBuf::from(RUNC));
        write(&dir.join("containerd.toml"), &containerd_config(&dir, &node.name, &runtime))?;
        write(
            &dir.join("kubelet.json"),
            &kubelet_config(
                &node.name,
                kubelet_port,
                healthz_port,
                &cgroup_root,
                options.node_status_update,
                options.old_kubelet,
            ),
        )?;
        let cni = dir.join("cni/bin/xpu-loopback");
        write(&cni, CNI_PLUGIN)?;
        fs::set_permissions(&cni, fs::Permissions::from_mode(0o755))
            .map_err(io_err("chmod", &cni))?;
        // containerd sets up the pod's `lo` through a network of type `loopback` too.
        let lo = dir.join("cni/bin/loopback");
        fs::copy(&cni, &lo).map_err(io_err("copy the CNI plugin to", &lo))?;
        write(
            &dir.join("cni/net.d/10-xpu-loopback.conflist"),
            r#"{"cniVersion":"1.0.0","name":"xpu-loopback","plugins":[{"type":"xpu-loopback"}]}"#,
        )?;
        let devices = match &options.devices_of {
            Some(root) => char_devices(root)?,
            None => BTreeMap::new(),
        };
        let mut list = String::new();
        for (path, (major, minor, mode)) in &devices {
            // "major minor mode path", one per line, for the script's `read`.
            let _ = writeln!(list, "{major} {minor} {mode:o} {path}"); // a String never fails
        }
        write(&dir.join("devices"), &list)?;
        let script = dir.join("node.sh");
        write(&script, NODE_SCRIPT)?;

        // Sockets go in there (`kubelet.sock`, `xpu-nvidia.com-gpu.sock`, a DRA driver's
        // `xpu.dev-reg.sock`); 40 bytes left for their names.
        for socket_dir in [node.device_plugin_dir(), node.plugins_registry_dir()] {
            let len = socket_dir.as_os_str().len();
            if len > MAX_SOCKET_DIR {
                return Err(NodeError::PathTooLong { dir: socket_dir, len });
            }
        }
        make_cgroup_root(&cgroup_root, &mut node.cgroups)?;
        Ok(node)
    }

    fn spawn(
        &mut self,
        cp: &ControlPlane,
        bins: &NodeBinaries,
        options: &NodeOptions,
    ) -> Result<(), NodeError> {
        let log_path = self.dir.join("node.log");
        let log = fs::File::create(&log_path).map_err(io_err("create", &log_path))?;
        let err = log.try_clone().map_err(io_err("reopen", &log_path))?;
        let child = Command::new("unshare")
            // A mount namespace for the fixed paths, a PID namespace so that killing its first
            // process kills everything containerd started; every mount private, so nothing
            // made inside reaches the host.
            .args(["--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc"])
            // unshare's own death (a test killed mid-run) takes the namespace with it.
            .arg("--kill-child=SIGKILL")
            .arg("bash")
            .arg(self.dir.join("node.sh"))
            .current_dir(&self.dir)
            .env_remove("KUBECONFIG")
            .env("XPU_NODE_RUN", &self.dir)
            .env("XPU_NODE_BIN", &bins.dir)
            .env("XPU_NODE_IMAGES", &bins.images)
            .env("XPU_NODE_EXTRA_IMAGES", join_paths(&options.images))
            .env("XPU_NODE_HOST_ROOT", options.host_root.as_deref().unwrap_or(Path::new("")))
            .env("XPU_NODE_NAME", &self.name)
            .env("XPU_NODE_KUBECONFIG", cp.node_kubeconfig(&self.name)?)
            .env("XPU_NODE_KUBELET", &bins.kubelet)
            .env("XPU_NODE_KUBELET_FLAGS", kubelet_flags(options).join(" "))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(NodeError::Spawn)?;
        tracing::debug!(pid = child.id(), dir = %self.dir.display(), "node namespace started");
        self.holder = Some(child);
        Ok(())
    }

    fn check_alive(&mut self) -> Result<(), NodeError> {
        let Some(holder) = &mut self.holder else { return Ok(()) };
        match holder.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(_)) | Err(_) => {
                Err(NodeError::Exited { dir: self.dir.clone(), tails: tails(&self.dir) })
            }
        }
    }

    async fn wait_ready(
        &mut self,
        cp: &ControlPlane,
        options: &NodeOptions,
        started: Instant,
    ) -> Result<(), NodeError> {
        let nodes: Api<NodeObject> = Api::all(cp.admin_client());
        let deadline = started + options.ready_timeout;
        let mut last = "no Node object yet".to_owned();
        loop {
            self.check_alive()?;
            match nodes.get_opt(&self.name).await {
                Ok(Some(node)) => {
                    let ready = node
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                        .map(|c| (c.status.clone(), c.message.clone().unwrap_or_default()));
                    match ready {
                        Some((status, _)) if status == "True" => {
                            // The node lifecycle controller, when the plane runs it, writes the
                            // taints too: on a conflict, read the Node again.
                            match untaint(&nodes, &node).await {
                                Ok(()) => return Ok(()),
                                Err(NodeError::Api { source: ::kube::Error::Api(e), .. })
                                    if e.code == 409 =>
                                {
                                    last = "taints changed while removing not-ready".to_owned();
                                }
                                Err(e) => return Err(e),
                            }
                        }
                        Some((status, message)) => last = format!("Ready={status}: {message}"),
                        None => last = "no Ready condition yet".to_owned(),
                    }
                }
                Ok(None) => {}
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(NodeError::NotReady {
                    name: self.name.clone(),
                    waited: started.elapsed(),
                    last,
                    dir: self.dir.clone(),
                    tails: tails(&self.dir),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn stop(&mut self) {
        if let Some(mut holder) = self.holder.take() {
            // Fails only when it already exited; the wait below reaps it either way.
            let _ = holder.kill();
            if let Err(e) = holder.wait() {
                tracing::warn!(error = %e, "cannot reap the node's unshare");
            }
        }
        // The namespace's processes die asynchronously after its first one; their cgroups can
        // be removed once they are gone.
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut left = self.cgroups.clone();
        while !left.is_empty() {
            left.retain(|root| remove_cgroup_tree(root).is_err());
            if left.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for root in &left {
            tracing::warn!(cgroup = %root.display(), "cannot remove the node's cgroup");
        }
    }
}

impl Drop for Node {
    // Test-only crate: the path of a kept run directory must reach the developer reading the
    // test output, and stderr is what the test harness shows for a failed test.
    #[allow(clippy::print_stderr)]
    fn drop(&mut self) {
        self.stop();
        if self.keep || std::thread::panicking() {
            // containerd's content store and snapshots are not worth keeping; the logs are.
            // Best effort: a leftover directory only costs disk space.
            let _ = fs::remove_dir_all(self.dir.join("var/lib/containerd"));
            eprintln!(
                "xpu-testkit: kept the node's configuration and logs in {}",
                self.dir.display()
            );
        } else if let Err(e) = fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the node's run directory");
        }
    }
}

fn write(path: &Path, contents: &str) -> Result<(), NodeError> {
    fs::write(path, contents).map_err(io_err("write", path))
}

/// The last lines of each of the node's logs.
/// Paths joined with `:` for the node script (none of the test's paths holds one).
fn join_paths(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":")
}

fn tails(dir: &Path) -> String {
    let mut out = String::new();
    for name in ["node.log", "containerd.log", "kubelet.log"] {
        let path = dir.join(name);
        if path.exists() {
            let _ = write!(out, "--- {name}\n{}\n", log_tail(&path)); // a String never fails
        }
    }
    out
}

/// Removes the `not-ready` taint the kubelet registered the Node with.
async fn untaint(nodes: &Api<NodeObject>, node: &NodeObject) -> Result<(), NodeError> {
    let taints = node.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default();
    if !taints.iter().any(|t| t.key == NOT_READY_TAINT) {
        return Ok(());
    }
    let kept: Vec<_> = taints.into_iter().filter(|t| t.key != NOT_READY_TAINT).collect();
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": node.metadata.resource_version },
        "spec": { "taints": kept },
    });
    nodes
        .patch(&node.name_any(), &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map_err(|source| NodeError::Api { action: "removing the not-ready taint", source })?;
    Ok(())
}

/// Every character device under `root/dev`, by its path in the node (`/dev/...`): major,
/// minor, permission bits.
fn char_devices(root: &Path) -> Result<BTreeMap<String, (u32, u32, u32)>, NodeError> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.join("dev")];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(io_err("read", &dir))? {
            let entry = entry.map_err(io_err("read", &dir))?;
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).map_err(io_err("stat", &path))?;
            if meta.is_dir() {
                stack.push(path);
            } else if meta.file_type().is_char_device() {
                let rel = path.strip_prefix(root).unwrap_or(&path);
                let dev = meta.rdev();
                out.insert(
                    format!("/{}", rel.display()),
                    (rustix::fs::major(dev), rustix::fs::minor(dev), meta.mode() & 0o777),
                );
            }
        }
    }
    Ok(out)
}

/// `/sys/fs/cgroup/<hierarchy>/<name>` in every mounted hierarchy (cgroup v1 controllers, the
/// named `systemd` one, and the `unified` v2 mount of a hybrid host; on a v2-only host the one
/// tree), made for the kubelet's `cgroupRoot`; each one made is added to `made` at once, so a
/// failure half way leaves nothing the node's drop does not remove.
fn make_cgroup_root(name: &str, made: &mut Vec<PathBuf>) -> Result<(), NodeError> {
    let base = Path::new("/sys/fs/cgroup");
    let mut hierarchies = Vec::new();
    if base.join("cgroup.procs").exists() {
        hierarchies.push(base.to_path_buf());
    } else {
        for entry in fs::read_dir(base).map_err(io_err("read", base))? {
            let path = entry.map_err(io_err("read", base))?.path();
            // A symlink (`cpu,cpuacct` -> `cpu`) names a hierarchy listed already.
            let is_link = fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
            if !is_link && path.join("cgroup.procs").exists() {
                hierarchies.push(path);
            }
        }
    }
    for h in hierarchies {
        let dir = h.join(name);
        fs::create_dir(&dir).map_err(io_err("create the cgroup", &dir))?;
        made.push(dir.clone());
        // cgroup v1 cpusets start empty and take no task until given CPUs and memory nodes.
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if h.join(file).exists() && !h.join("cgroup.subtree_control").exists() {
                let value = fs::read_to_string(h.join(file)).map_err(io_err("read", &h))?;
                let target = dir.join(file);
                fs::write(&target, value.trim()).map_err(io_err("write", &target))?;
            }
        }
    }
    Ok(())
}

/// Removes a cgroup and everything under it, deepest first; fails while a process is left.
fn remove_cgroup_tree(root: &Path) -> io::Result<()> {
    if !root.exists() {
        return Ok(());
    }
    let mut dirs = vec![root.to_path_buf()];
    let mut i = 0;
    while i < dirs.len() {
        for entry in fs::read_dir(&dirs[i])? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            }
        }
        i += 1;
    }
    for dir in dirs.iter().rev() {
        match fs::remove_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// containerd's configuration (version 4, containerd 2.4), fields as `containerd config
/// default` names them. CDI needs no switch in containerd 2.x (always on): only where specs are.
fn containerd_config(dir: &Path, address: &str, runtime: &Path) -> String {
    let cdi = dir.join("cdi");
    let cni_bin = dir.join("cni/bin");
    let cni_conf = dir.join("cni/net.d");
    format!(
        r#"version = 4
root = "/var/lib/containerd"
state = "/run/containerd"
# Never the host's /etc/containerd/conf.d.
imports = []

[plugins."io.containerd.server.v1.grpc"]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.server.v1.ttrpc"]
  address = "/run/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.cri.v1.runtime"]
  # The test's directory, and the default one a DRA driver pod writes through its hostPath.
  cdi_spec_dirs = ["{cdi}", "/var/run/cdi"]
  # Writing a negative oom_score_adj fails in these VMs; keep containers' at or above ours.
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runtime}"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "{address}"
  stream_server_port = "0"
"#,
        cdi = cdi.display(),
        cni_bin = cni_bin.display(),
        cni_conf = cni_conf.display(),
        runtime = runtime.display(),
    )
}

/// The runtime endpoint, as the kubelet's configuration or (older kubelets) flag names it.
const RUNTIME_ENDPOINT: &str = "unix:///run/containerd/containerd.sock";

/// The kubelet's command-line flags beyond the fixed ones: the test's, and for the older kubelet
/// the runtime endpoint.
fn kubelet_flags(options: &NodeOptions) -> Vec<String> {
    let mut flags = Vec::new();
    if options.old_kubelet {
        flags.push("--container-runtime=remote".to_owned());
        flags.push(format!("--container-runtime-endpoint={RUNTIME_ENDPOINT}"));
    }
    flags.extend(options.kubelet_flags.iter().cloned());
    flags
}

/// The kubelet's configuration file (`kubelet.config.k8s.io/v1beta1` KubeletConfiguration);
/// `old`: for [`OLD_KUBELET_VERSION`], without the fields it does not know.
fn kubelet_config(
    address: &str,
    port: u16,
    healthz_port: u16,
    cgroup_root: &str,
    status: Duration,
    old: bool,
) -> String {
    let status = format!("{}ms", status.as_millis());
    let mut config = serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": address,
        "healthzPort": healthz_port,
        // The API server (logs, exec) is the only client, on loopback.
        "authentication": {
            "anonymous": { "enabled": true },
            "webhook": { "enabled": false },
        },
        "authorization": { "mode": "AlwaysAllow" },
        "containerRuntimeEndpoint": RUNTIME_ENDPOINT,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": format!("/{cgroup_root}"),
        // These machines run cgroup v1, which kubelets since 1.35 refuse unless told.
        "failCgroupV1": false,
        "failSwapOn": false,
        // No cluster DNS and no host resolver in pods.
        "resolvConf": "",
        "nodeStatusUpdateFrequency": status,
        "nodeStatusReportFrequency": status,
        "syncFrequency": "5s",
        // A test machine's disk and memory are shared: never evict or collect the two images.
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
            "imagefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": 16,
    });
    if old && let Some(fields) = config.as_object_mut() {
        fields.remove("containerRuntimeEndpoint");
        fields.remove("failCgroupV1");
    }
    serde_json::to_string_pretty(&config).expect("a JSON value built in code always serializes")
}

/// A CNI plugin (spec 1.x: command in `CNI_COMMAND`, network configuration on stdin, result on
/// stdout) that creates no interface and reports a loopback address, different per container.
const CNI_PLUGIN: &str = r#"#!/bin/sh
# xpu-testkit's loopback-only CNI plugin: the pod keeps the network namespace containerd made
# (with only its own lo) and is told its address is 127.0.x.y.
conf=$(cat)
version=$(printf '%s' "$conf" | sed -n 's/.*"cniVersion" *: *"\([^"]*\)".*/\1/p')
case "$CNI_COMMAND" in
VERSION)
  echo '{"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}'
  ;;
ADD)
  n=$(printf '%s' "$CNI_CONTAINERID" | cksum | cut -d' ' -f1)
  ip="127.0.$((n / 256 % 256)).$((n % 254 + 1))"
  printf '{"cniVersion":"%s","interfaces":[{"name":"%s","sandbox":"%s"}],"ips":[{"version":"4","address":"%s/8","interface":0}]}\n' \
    "$version" "$CNI_IFNAME" "$CNI_NETNS" "$ip"
  ;;
DEL | CHECK | GC | STATUS) ;;
*)
  printf '{"cniVersion":"%s","code":4,"msg":"unknown CNI_COMMAND %s"}\n' "$version" "$CNI_COMMAND"
  exit 1
  ;;
esac
"#;

/// PID 1 of the node's namespaces: lays out the node's view of the host, then runs containerd
/// and the kubelet until one of them exits (or the namespace is killed).
const NODE_SCRIPT: &str = r#"#!/bin/bash
set -euo pipefail
run="$XPU_NODE_RUN"
bin="$XPU_NODE_BIN"
say() { echo "node.sh: $(date +%T.%N | cut -c1-12) $*"; }

# Upper layers on a tmpfs of this namespace: nothing of /dev or /run reaches the disk.
mount -t tmpfs -o mode=0755 xpu-node-scratch "$run/scratch"
mkdir -p "$run/scratch/dev" "$run/scratch/dev.work"
mount -t overlay xpu-node-dev -o "lowerdir=/dev,upperdir=$run/scratch/dev,workdir=$run/scratch/dev.work" /dev
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts /dev/pts
mount -t tmpfs -o mode=1777 xpu-node-shm /dev/shm
while read -r major minor mode path; do
  mkdir -p "$(dirname "$path")"
  rm -f "$path"
  mknod -m "$mode" "$path" c "$major" "$minor"
done <"$run/devices"
mount -t tmpfs -o mode=0755 xpu-node-run /run
mount --bind "$run/var/lib" /var/lib
mount --bind "$run/var/log" /var/log
# What pods write through a hostPath under /etc (NFD's features.d, say) stays in the node.
mkdir -p "$run/scratch/etc" "$run/scratch/etc.work"
mount -t overlay xpu-node-etc -o "lowerdir=/etc,upperdir=$run/scratch/etc,workdir=$run/scratch/etc.work" /etc
if [ -n "${XPU_NODE_HOST_ROOT:-}" ]; then
  mkdir -p /var/lib/xpu-host
  mount --bind "$XPU_NODE_HOST_ROOT" /var/lib/xpu-host
fi
say "namespace ready: /dev overlay with $(wc -l <"$run/devices") fixture device(s), /run tmpfs, /var/lib and /var/log from $run"

export PATH="$bin:$PATH"
"$bin/containerd" --config "$run/containerd.toml" >"$run/containerd.log" 2>&1 &
containerd=$!
until "$bin/ctr" --address /run/containerd/containerd.sock version >/dev/null 2>&1; do
  kill -0 "$containerd" 2>/dev/null || { say "containerd exited"; exit 1; }
  sleep 0.1
done
say "containerd $("$bin/ctr" --address /run/containerd/containerd.sock version | sed -n 's/^ *Version: *//p' | tail -1) serving"
for images in "$XPU_NODE_IMAGES" ${XPU_NODE_EXTRA_IMAGES//:/ }; do
  "$bin/ctr" --address /run/containerd/containerd.sock -n k8s.io images import "$images" >>"$run/import.log" 2>&1 ||
    { say "importing $images failed:"; cat "$run/import.log"; exit 1; }
done
say "images imported: $(tr '\n' ' ' <"$run/import.log")"

# The kubelet runs under a loop that starts it again when it exits (as systemd's
# Restart=always does), so a test can restart it (Node::restart_kubelet) without the node.
(
  while :; do
    # shellcheck disable=SC2086 # the extra flags are words
    "$XPU_NODE_KUBELET" --config="$run/kubelet.json" --kubeconfig="$XPU_NODE_KUBECONFIG" \
      --hostname-override="$XPU_NODE_NAME" --v=2 ${XPU_NODE_KUBELET_FLAGS:-} >>"$run/kubelet.log" 2>&1 &
    kubelet=$!
    say "kubelet started"
    wait "$kubelet"
    say "kubelet exited with status $?; starting it again"
    sleep 0.2
  done
) &
set +e
wait -n
status=$?
say "a node process exited with status $status"
exit 1
"#;

/// Longest socket directory the node accepts: a Unix socket path has at most 107 bytes, and the
/// sockets plugins and the kubelet make in it have names of up to 40.
const MAX_SOCKET_DIR: usize = 107 - 40;

/// Where node run directories go: beside the control plane's under the target directory when
/// the sockets fit there, else under the temporary directory (a checkout in a long path, as CI's
/// may be, would otherwise make every socket path too long).
fn run_base() -> PathBuf {
    let beside = target_dir().join("tmp");
    let longest = beside.join("node-4294967295-99999/var/lib/kubelet/plugins_registry");
    if longest.as_os_str().len() <= MAX_SOCKET_DIR {
        beside
    } else {
        std::env::temp_dir().join("xpu-node")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_name_the_run_directory_and_the_settings_this_machine_needs() {
        let c = containerd_config(Path::new("/t/node-1"), "127.0.0.3", Path::new(RUNC));
        assert!(c.contains(r#"stream_server_address = "127.0.0.3""#), "{c}");
        assert!(c.contains(r#"cdi_spec_dirs = ["/t/node-1/cdi", "/var/run/cdi"]"#), "{c}");
        assert!(c.contains("restrict_oom_score_adj = true"), "{c}");
        assert!(c.contains("SystemdCgroup = false"), "{c}");
        assert!(c.contains(r#"sandbox = "xpu.test/pause:1""#), "{c}");
        let config = |old| {
            let text = kubelet_config(
                "127.0.0.3",
                10250,
                10248,
                "xpu-node-1-0",
                Duration::from_secs(4),
                old,
            );
            serde_json::from_str::<serde_json::Value>(&text).unwrap()
        };
        let k = config(false);
        assert_eq!(k["failCgroupV1"], false);
        assert_eq!(
            (&k["address"], &k["healthzBindAddress"]),
            (&"127.0.0.3".into(), &"127.0.0.3".into())
        );
        assert_eq!(k["containerRuntimeEndpoint"], RUNTIME_ENDPOINT);
        assert_eq!(k["cgroupRoot"], "/xpu-node-1-0");
        assert_eq!(k["nodeStatusUpdateFrequency"], "4000ms");
        // The older kubelet: the fields it does not know go, the endpoint is a flag.
        let old = config(true);
        assert!(old.get("failCgroupV1").is_none() && old.get("containerRuntimeEndpoint").is_none());
        assert_eq!(old["cgroupRoot"], "/xpu-node-1-0");
        assert!(OLD_KUBELET_BINARY.ends_with(OLD_KUBELET_VERSION));
        let flags = kubelet_flags(&NodeOptions::default().old_kubelet().kubelet_flag("--v=3"));
        assert_eq!(
            flags,
            [
                "--container-runtime=remote",
                &format!("--container-runtime-endpoint={RUNTIME_ENDPOINT}"),
                "--v=3"
            ]
        );
    }

    #[test]
    fn a_missing_binary_names_the_install_script() {
        let err = NodeError::MissingBinary {
            binary: "containerd",
            dir: PathBuf::from("/c/bin"),
            script: "scripts/install-node",
        };
        assert_eq!(
            err.to_string(),
            "containerd not found in /c/bin; run scripts/install-node to build it, or set XPU_K8S_BIN to a directory that holds it"
        );
    }
}
