//! A real Kubernetes control plane for tests, started the way controller-runtime's envtest
//! starts one.
//!
//! [`ControlPlane::start`] runs upstream etcd and kube-apiserver (and, when asked,
//! kube-scheduler and kube-controller-manager) as child processes bound to 127.0.0.1 on free
//! ports. A CA, a serving certificate, an admin token (group `system:masters`) and a
//! service-account signing key are generated for each run, so authentication (token file),
//! authorization (`Node,RBAC`) and the TokenRequest API behave as in a real cluster. Everything
//! of a run lives in one directory, `<target>/tmp/k8s-<pid>-<n>`: certificates, kubeconfigs,
//! etcd's data and one log file per process. Dropping the plane kills and reaps every process
//! and removes the directory, unless the thread is panicking or start-up failed: then the
//! directory is kept (without etcd's data) and its path printed.
//!
//! This module owns the processes, their flags and readiness. It does not build the binaries
//! (`scripts/install-k8s` does, into a cache outside the tree; `XPU_K8S_BIN` overrides the
//! directory searched) and runs no kubelet: Pods get bound by the scheduler, never run.

use std::env;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ::kube::api::{Api, PostParams};
use ::kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use ::kube::{Client, Config};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The Kubernetes release `scripts/install-k8s` builds and these tests run against.
pub const K8S_VERSION: &str = "v1.37.2";

/// kube-controller-manager's `--controllers` unless [`ControlPlaneOptions::controllers`] says
/// otherwise: the Job controller, and the service-account controller that gives every new
/// namespace its `default` ServiceAccount (the ServiceAccount admission plugin rejects Pods whose
/// ServiceAccount does not exist, Job pods included).
pub const DEFAULT_CONTROLLERS: &[&str] = &["job-controller", "serviceaccount-controller"];

/// The issuer of service-account tokens, as in a kubeadm cluster.
const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc";
/// Tokens minted by [`ControlPlane::service_account_kubeconfig`] outlive any test run.
const SERVICE_ACCOUNT_TOKEN_SECONDS: i64 = 24 * 3600;
const POLL: Duration = Duration::from_millis(100);
/// One readiness probe; the apiserver answers `/readyz` in milliseconds once it listens.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const START_ATTEMPTS: u32 = 3;
/// Where etcd keeps its data inside the run directory; not kept after a failure (tens of MiB of
/// preallocated WAL that nobody reads when debugging a test).
const ETCD_DATA: &str = "etcd-data";

static RUN_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Why a control plane could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(
        "{binary} not found in {}; run scripts/install-k8s to build the Kubernetes {K8S_VERSION} test binaries, or set XPU_K8S_BIN to a directory that holds them",
        dir.display()
    )]
    MissingBinary { binary: &'static str, dir: PathBuf },

    #[error(
        "cannot tell where scripts/install-k8s put the Kubernetes binaries: none of XPU_K8S_BIN, XPU_K8S_CACHE, XDG_CACHE_HOME, HOME is set; set XPU_K8S_BIN to the directory that holds etcd and kube-apiserver"
    )]
    NoBinDir,

    #[error("cannot {action} {}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot reserve a free port on 127.0.0.1 for the control plane")]
    Port(#[source] io::Error),

    #[error(
        "cannot run {} for {binary}; check that it is an executable built by scripts/install-k8s",
        path.display()
    )]
    Spawn {
        binary: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("cannot generate the test CA, serving certificate or service-account key")]
    Certificate(#[from] rcgen::Error),

    #[error("{process} exited during start-up ({status}); its log is {}, ending with:\n{tail}", log.display())]
    Exited { process: &'static str, status: ExitStatus, log: PathBuf, tail: String },

    #[error(
        "{process} not ready after {waited:.1?} (last answer: {last}); see its log {}, or raise ControlPlaneOptions::ready_timeout on a loaded machine",
        log.display()
    )]
    NotReady { process: &'static str, waited: Duration, last: String, log: PathBuf },

    #[error("cannot load the kubeconfig {} the harness wrote", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },

    #[error("cannot build a Kubernetes client for {server}")]
    Client {
        server: String,
        #[source]
        source: ::kube::Error,
    },

    #[error("{action} failed on the test API server; see kube-apiserver.log in {}", dir.display())]
    Api {
        action: String,
        dir: PathBuf,
        #[source]
        source: ::kube::Error,
    },

    #[error("the TokenRequest for ServiceAccount {namespace}/{name} came back without a token")]
    NoToken { namespace: String, name: String },
}

impl HarnessError {
    /// Another process took a port between our probe and the server's bind: worth a new try.
    fn is_port_clash(&self) -> bool {
        matches!(self, HarnessError::Exited { tail, .. } if tail.contains("address already in use"))
    }
}

/// What to start besides etcd and kube-apiserver, and how.
#[derive(Debug, Clone)]
pub struct ControlPlaneOptions {
    /// Start kube-scheduler (leader election off), so Pods get bound to Nodes.
    pub scheduler: bool,
    /// Start kube-controller-manager (leader election off) with [`Self::controllers`].
    pub controller_manager: bool,
    /// kube-controller-manager's `--controllers`; [`DEFAULT_CONTROLLERS`] by default.
    pub controllers: Vec<String>,
    /// Flags appended to kube-apiserver's command line; a flag given twice takes the last value,
    /// so these override the harness's own.
    pub apiserver_flags: Vec<String>,
    /// Flags appended to kube-scheduler's command line.
    pub scheduler_flags: Vec<String>,
    /// Flags appended to kube-controller-manager's command line.
    pub controller_manager_flags: Vec<String>,
    /// How long each process may take to become ready.
    pub ready_timeout: Duration,
    /// CustomResourceDefinitions to install once the API server is up; `start` returns when
    /// each is `Established` (served).
    pub crds: Vec<CustomResourceDefinition>,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        ControlPlaneOptions {
            scheduler: false,
            controller_manager: false,
            controllers: DEFAULT_CONTROLLERS.iter().map(ToString::to_string).collect(),
            apiserver_flags: Vec::new(),
            scheduler_flags: Vec::new(),
            controller_manager_flags: Vec::new(),
            ready_timeout: Duration::from_secs(90),
            crds: Vec::new(),
        }
    }
}

impl ControlPlaneOptions {
    /// Also start kube-scheduler.
    pub fn with_scheduler(mut self) -> Self {
        self.scheduler = true;
        self
    }

    /// Also start kube-controller-manager.
    pub fn with_controller_manager(mut self) -> Self {
        self.controller_manager = true;
        self
    }

    /// Set kube-controller-manager's `--controllers`.
    pub fn controllers<I, S>(mut self, controllers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.controllers = controllers.into_iter().map(Into::into).collect();
        self
    }

    /// Append one flag (`--name=value`) to kube-apiserver's command line.
    pub fn apiserver_flag(mut self, flag: impl Into<String>) -> Self {
        self.apiserver_flags.push(flag.into());
        self
    }

    /// Append one flag to kube-scheduler's command line.
    pub fn scheduler_flag(mut self, flag: impl Into<String>) -> Self {
        self.scheduler_flags.push(flag.into());
        self
    }

    /// Install `crd` (as a cluster's add-on would) before `start` returns.
    pub fn with_crd(mut self, crd: CustomResourceDefinition) -> Self {
        self.crds.push(crd);
        self
    }

    /// Append one flag to kube-controller-manager's command line.
    pub fn controller_manager_flag(mut self, flag: impl Into<String>) -> Self {
        self.controller_manager_flags.push(flag.into());
        self
    }
}

/// A running control plane; dropping it kills every process it started.
pub struct ControlPlane {
    client: Client,
    server_url: String,
    admin_kubeconfig: PathBuf,
    ca_cert: PathBuf,
    /// The CA's key (PEM), to sign the client certificates of nodes.
    ca_key: String,
    startup: Duration,
    // Last: the processes die after the client that talks to them is gone.
    run: Run,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server_url", &self.server_url)
            .field("dir", &self.run.dir)
            .field("processes", &self.process_ids())
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Start etcd and kube-apiserver (and what `options` asks for) and wait until they are
    /// ready, the `default` namespace and its `default` ServiceAccount included. Pods in other
    /// namespaces need that namespace's `default` ServiceAccount: the controller-manager's
    /// `serviceaccount-controller` makes it, or the test does.
    pub async fn start(options: ControlPlaneOptions) -> Result<ControlPlane, HarnessError> {
        // A workspace-wide build links rustls with both ring and aws-lc-rs (a dev-dependency
        // asks for the second), and rustls then refuses to pick one: the first client panics.
        // Name ring, as kube's features do; an error only means a provider is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let bins = Binaries::find(&bin_dir()?, &options)?;
        let mut attempt = 1;
        loop {
            match start_once(&options, &bins).await {
                Err(e) if e.is_port_clash() && attempt < START_ATTEMPTS => {
                    tracing::warn!(attempt, error = %e, "port taken during start-up; retrying");
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// A client with the admin token (group `system:masters`).
    pub fn admin_client(&self) -> Client {
        self.client.clone()
    }

    /// `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> &str {
        &self.server_url
    }

    /// The admin kubeconfig (token auth, the run's CA by file path).
    pub fn admin_kubeconfig(&self) -> &Path {
        &self.admin_kubeconfig
    }

    /// The CA that signed the apiserver's serving certificate.
    pub fn ca_cert(&self) -> &Path {
        &self.ca_cert
    }

    /// The run directory: certificates, kubeconfigs and `<process>.log` files.
    pub fn dir(&self) -> &Path {
        &self.run.dir
    }

    /// From the call to [`ControlPlane::start`] until every process was ready.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The process name and pid of everything this plane started.
    pub fn process_ids(&self) -> Vec<(&'static str, u32)> {
        self.run.procs.iter().map(|p| (p.name, p.child.id())).collect()
    }

    /// A client that authenticates with the bearer `token` (one the test minted itself through
    /// the TokenRequest API, bound to a Pod for instance) and trusts the run's CA. Its
    /// kubeconfig is written to `token-<name>.kubeconfig` in the run directory; `name` must be
    /// usable in a file name.
    pub async fn client_with_token(&self, name: &str, token: &str) -> Result<Client, HarnessError> {
        let path = self.run.dir.join(format!("token-{name}.kubeconfig"));
        write_kubeconfig(&path, &self.server_url, &self.ca_cert, name, token)?;
        client_from_kubeconfig(&path, &self.server_url).await
    }

    /// A client that acts as `user` in `groups` (plus `system:authenticated`) through the
    /// admin's right to impersonate (`Impersonate-User` and `Impersonate-Group` headers): the
    /// API server authorizes every request as that user, so RBAC applies as it would to a
    /// tenant with its own credentials.
    pub async fn impersonating(&self, user: &str, groups: &[&str]) -> Result<Client, HarnessError> {
        let path = &self.admin_kubeconfig;
        let kubeconfig = Kubeconfig::read_from(path)
            .map_err(|source| HarnessError::Kubeconfig { path: path.clone(), source })?;
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|source| HarnessError::Kubeconfig { path: path.clone(), source })?;
        config.auth_info.impersonate = Some(user.to_owned());
        let mut all: Vec<String> = groups.iter().map(|g| (*g).to_owned()).collect();
        all.push("system:authenticated".into());
        config.auth_info.impersonate_groups = Some(all);
        Client::try_from(config)
            .map_err(|source| HarnessError::Client { server: self.server_url.clone(), source })
    }

    /// Write a kubeconfig that authenticates as ServiceAccount `namespace/name`, with a token
    /// from the TokenRequest API. The namespace and the ServiceAccount are created when missing.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<PathBuf, HarnessError> {
        let dir = &self.run.dir;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        create_if_missing(&namespaces, named(Namespace::default(), namespace), dir).await?;
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), namespace);
        create_if_missing(&accounts, named(ServiceAccount::default(), name), dir).await?;

        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(SERVICE_ACCOUNT_TOKEN_SECONDS),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let answer = accounts
            .create_token_request(name, &PostParams::default(), &request)
            .await
            .map_err(|source| HarnessError::Api {
                action: format!("TokenRequest for ServiceAccount {namespace}/{name}"),
                dir: dir.clone(),
                source,
            })?;
        let token =
            answer.status.and_then(|s| s.token).filter(|t| !t.is_empty()).ok_or_else(|| {
                HarnessError::NoToken { namespace: namespace.to_owned(), name: name.to_owned() }
            })?;
        // The apiserver validated both names (DNS labels) when it created the objects, so they
        // are safe in a file name.
        let path = dir.join(format!("sa-{namespace}-{name}.kubeconfig"));
        let user = format!("system:serviceaccount:{namespace}:{name}");
        write_kubeconfig(&path, &self.server_url, &self.ca_cert, &user, &token)?;
        Ok(path)
    }
}

impl ControlPlane {
    /// Write a kubeconfig for the kubelet of Node `node`: a client certificate for
    /// `system:node:<node>` in group `system:nodes` signed by the run's CA, the identity the
    /// `Node` authorizer and the NodeRestriction admission plugin limit to that Node's objects
    /// (https://kubernetes.io/docs/reference/access-authn-authz/node/). `node` must be usable in
    /// a file name.
    pub fn node_kubeconfig(&self, node: &str) -> Result<PathBuf, HarnessError> {
        let issuer = Issuer::new(ca_params()?, KeyPair::from_pem(&self.ca_key)?);
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, format!("system:node:{node}"));
        params.distinguished_name.push(DnType::OrganizationName, "system:nodes");
        params.key_usages =
            vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer)?;
        let cert_path = self.run.write(&format!("node-{node}.crt"), &cert.pem())?;
        let key_path = self.run.write(&format!("node-{node}.key"), &key.serialize_pem())?;
        let user = format!("system:node:{node}");
        let config = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{
                "name": "xpu-test",
                "cluster": { "server": self.server_url, "certificate-authority": self.ca_cert },
            }],
            "users": [{
                "name": user,
                "user": { "client-certificate": cert_path, "client-key": key_path },
            }],
            "contexts": [{ "name": "xpu-test", "context": { "cluster": "xpu-test", "user": user } }],
            "current-context": "xpu-test",
        });
        let text = serde_json::to_string_pretty(&config)
            .expect("a JSON value built from strings always serializes");
        let path = self.run.write(&format!("node-{node}.kubeconfig"), &text)?;
        Ok(path)
    }
}

/// The binaries a run needs, checked before anything starts.
struct Binaries {
    etcd: PathBuf,
    apiserver: PathBuf,
    scheduler: Option<PathBuf>,
    controller_manager: Option<PathBuf>,
}

impl Binaries {
    fn find(dir: &Path, options: &ControlPlaneOptions) -> Result<Binaries, HarnessError> {
        let find = |binary: &'static str| {
            let path = dir.join(binary);
            if path.is_file() {
                Ok(path)
            } else {
                Err(HarnessError::MissingBinary { binary, dir: dir.to_path_buf() })
            }
        };
        Ok(Binaries {
            etcd: find("etcd")?,
            apiserver: find("kube-apiserver")?,
            scheduler: options.scheduler.then(|| find("kube-scheduler")).transpose()?,
            controller_manager: options
                .controller_manager
                .then(|| find("kube-controller-manager"))
                .transpose()?,
        })
    }
}

/// `$XPU_K8S_BIN`, else `${XPU_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/xpu/k8s}/<version>/bin`
/// (the directory `scripts/install-k8s` fills).
pub fn bin_dir() -> Result<PathBuf, HarnessError> {
    fn var(name: &str) -> Option<PathBuf> {
        env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
    }
    if let Some(dir) = var("XPU_K8S_BIN") {
        return Ok(dir);
    }
    let cache = var("XPU_K8S_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("xpu/k8s")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/xpu/k8s")))
        .ok_or(HarnessError::NoBinDir)?;
    Ok(cache.join(K8S_VERSION).join("bin"))
}

/// One child process and the file its stdout and stderr go to.
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

/// The run directory and the processes of one start attempt. Dropping it kills and reaps the
/// processes, then removes the directory or, after a failure or in a panicking thread, keeps it.
struct Run {
    dir: PathBuf,
    procs: Vec<Proc>,
    keep: bool,
}

impl Run {
    fn new() -> Result<Run, HarnessError> {
        let base = target_dir().join("tmp");
        fs::create_dir_all(&base).map_err(|source| HarnessError::Io {
            action: "create",
            path: base.clone(),
            source,
        })?;
        let pid = std::process::id();
        loop {
            let n = RUN_COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir = base.join(format!("k8s-{pid}-{n}"));
            match fs::create_dir(&dir) {
                // Until start-up succeeds, a drop keeps the directory for its logs.
                Ok(()) => {
                    return Ok(Run { dir, procs: Vec::new(), keep: true });
                }
                // Left by an earlier process with the same pid.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(source) => {
                    return Err(HarnessError::Io { action: "create", path: dir, source });
                }
            }
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn write(&self, name: &str, contents: &str) -> Result<PathBuf, HarnessError> {
        let path = self.path(name);
        fs::write(&path, contents).map_err(|source| HarnessError::Io {
            action: "write",
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }

    fn spawn(
        &mut self,
        name: &'static str,
        binary: &Path,
        args: Vec<OsString>,
    ) -> Result<(), HarnessError> {
        let log = self.path(&format!("{name}.log"));
        let open = |log: &Path| {
            File::create(log).map_err(|source| HarnessError::Io {
                action: "create",
                path: log.to_path_buf(),
                source,
            })
        };
        let stdout = open(&log)?;
        let stderr = stdout.try_clone().map_err(|source| HarnessError::Io {
            action: "reopen",
            path: log.clone(),
            source,
        })?;
        let child = Command::new(binary)
            .args(&args)
            .current_dir(&self.dir)
            // The processes get every setting from flags, never from a developer's cluster.
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|source| HarnessError::Spawn {
                binary: name,
                path: binary.to_path_buf(),
                source,
            })?;
        tracing::debug!(process = name, pid = child.id(), log = %log.display(), "started");
        self.procs.push(Proc { name, child, log });
        Ok(())
    }

    fn log_of(&self, name: &str) -> PathBuf {
        self.path(&format!("{name}.log"))
    }

    /// Fails when any process has exited: none of them exits while healthy.
    fn check_alive(&mut self) -> Result<(), HarnessError> {
        for proc in &mut self.procs {
            let status = match proc.child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(source) => {
                    return Err(HarnessError::Io {
                        action: "check on the process logging to",
                        path: proc.log.clone(),
                        source,
                    });
                }
            };
            return Err(HarnessError::Exited {
                process: proc.name,
                status,
                log: proc.log.clone(),
                tail: log_tail(&proc.log),
            });
        }
        Ok(())
    }

    /// Kill and reap, dependants (scheduler, controller-manager) before the apiserver before etcd.
    fn stop(&mut self) {
        while let Some(mut proc) = self.procs.pop() {
            // Fails only when the process already exited; the wait below reaps it either way.
            let _ = proc.child.kill();
            if let Err(e) = proc.child.wait() {
                tracing::warn!(process = proc.name, error = %e, "cannot reap");
            }
        }
    }
}

impl Drop for Run {
    // Test-only crate: the path of a kept run directory must reach the developer reading the
    // test output, and stderr is what the test harness shows for a failed test.
    #[allow(clippy::print_stderr)]
    fn drop(&mut self) {
        self.stop();
        if self.keep || std::thread::panicking() {
            // Best effort: a leftover data directory only costs disk space.
            let _ = fs::remove_dir_all(self.dir.join(ETCD_DATA));
            eprintln!(
                "xpu-testkit: kept the control plane's logs, certificates and kubeconfigs in {}",
                self.dir.display()
            );
        } else if let Err(e) = fs::remove_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the run directory");
        }
    }
}

/// The last lines of a log, for an error message.
pub(crate) fn log_tail(path: &Path) -> String {
    const BYTES: u64 = 4096;
    const LINES: usize = 20;
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(BYTES)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(LINES)..].join("\n")
        }
        Err(e) => format!("(cannot read the log: {e})"),
    }
}

/// `$CARGO_TARGET_DIR`, else `target/` of the workspace around this crate (or the running
/// package), else the system temporary directory.
pub(crate) fn target_dir() -> PathBuf {
    if let Some(dir) = env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    let manifest = env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .map(|root| root.join("target"))
        .unwrap_or_else(env::temp_dir)
}

/// Free ports on 127.0.0.1, all held until every one is found so they are distinct.
pub fn free_ports<const N: usize>() -> Result<[u16; N], HarnessError> {
    let mut listeners = Vec::with_capacity(N);
    let mut ports = [0; N];
    for port in &mut ports {
        let listener = TcpListener::bind(("127.0.0.1", 0)).map_err(HarnessError::Port)?;
        *port = listener.local_addr().map_err(HarnessError::Port)?.port();
        listeners.push(listener);
    }
    Ok(ports)
}

/// The run CA's subject and uses; the same every run, so a signer can be rebuilt from the key.
fn ca_params() -> Result<CertificateParams, rcgen::Error> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "xpu-testkit CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(ca)
}

/// The certificates and keys of a run, PEM-encoded.
struct Pki {
    ca_cert: String,
    ca_key: String,
    serving_cert: String,
    serving_key: String,
    sa_key: String,
    sa_public_key: String,
    admin_token: String,
}

impl Pki {
    fn generate() -> Result<Pki, rcgen::Error> {
        let ca_key = KeyPair::generate()?;
        let ca = ca_params()?;
        let ca_cert = ca.self_signed(&ca_key)?;
        let ca_key_pem = ca_key.serialize_pem();
        let issuer = Issuer::new(ca, ca_key);

        let serving_key = KeyPair::generate()?;
        let mut serving = CertificateParams::new(
            [
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                // The first address of --service-cluster-ip-range: the `kubernetes` Service.
                "10.0.0.1",
            ]
            .map(String::from)
            .to_vec(),
        )?;
        serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        serving.key_usages =
            vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving.signed_by(&serving_key, &issuer)?;

        // ECDSA P-256: the apiserver signs service-account tokens with ES256.
        let sa_key = KeyPair::generate()?;

        // 256 random bits from the system RNG (a fresh key's public point); the key itself is
        // thrown away.
        let token_source = KeyPair::generate()?;
        let admin_token = token_source
            .public_key_raw()
            .iter()
            .skip(1)
            .take(32)
            .map(|b| format!("{b:02x}"))
            .collect();

        Ok(Pki {
            ca_cert: ca_cert.pem(),
            ca_key: ca_key_pem,
            serving_cert: serving_cert.pem(),
            serving_key: serving_key.serialize_pem(),
            sa_public_key: sa_key.public_key_pem(),
            sa_key: sa_key.serialize_pem(),
            admin_token,
        })
    }
}

/// A kubeconfig with a bearer token; JSON, which client-go and kube-rs read as YAML.
fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca_cert: &Path,
    user: &str,
    token: &str,
) -> Result<(), HarnessError> {
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "xpu-test",
            "cluster": { "server": server, "certificate-authority": ca_cert },
        }],
        "users": [{ "name": user, "user": { "token": token } }],
        "contexts": [{
            "name": "xpu-test",
            "context": { "cluster": "xpu-test", "user": user, "namespace": "default" },
        }],
        "current-context": "xpu-test",
    });
    let text = serde_json::to_string_pretty(&config)
        .expect("a JSON value built from strings always serializes");
    fs::write(path, text).map_err(|source| HarnessError::Io {
        action: "write",
        path: path.to_path_buf(),
        source,
    })
}

async fn client_from_kubeconfig(path: &Path, server: &str) -> Result<Client, HarnessError> {
    let kubeconfig = Kubeconfig::read_from(path)
        .map_err(|source| HarnessError::Kubeconfig { path: path.to_path_buf(), source })?;
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| HarnessError::Kubeconfig { path: path.to_path_buf(), source })?;
    Client::try_from(config)
        .map_err(|source| HarnessError::Client { server: server.to_owned(), source })
}

/// A client for the self-signed health endpoint of kube-scheduler or kube-controller-manager
/// (`/healthz` is always allowed without credentials).
fn health_client(port: u16) -> Result<Client, HarnessError> {
    let server = format!("https://127.0.0.1:{port}");
    let url = server.parse().expect("https://127.0.0.1:<u16> is a valid URI");
    let mut config = Config::new(url);
    config.accept_invalid_certs = true;
    Client::try_from(config).map_err(|source| HarnessError::Client { server, source })
}

/// Polls `path` until it answers `ok`, failing early when any process of the run exits.
async fn wait_healthy(
    run: &mut Run,
    client: &Client,
    process: &'static str,
    path: &str,
    deadline: Instant,
    started: Instant,
) -> Result<(), HarnessError> {
    loop {
        run.check_alive()?;
        let request = http::Request::get(path)
            .body(Vec::new())
            .expect("a constant absolute path is a valid request URI");
        let mut last = match tokio::time::timeout(PROBE_TIMEOUT, client.request_text(request)).await
        {
            Ok(Ok(body)) if body.trim() == "ok" => return Ok(()),
            Ok(Ok(body)) => body,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
        };
        if Instant::now() >= deadline {
            last.truncate(2000);
            return Err(HarnessError::NotReady {
                process,
                waited: started.elapsed(),
                last,
                log: run.log_of(process),
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

fn named<K: ::kube::Resource>(mut object: K, name: &str) -> K {
    object.meta_mut().name = Some(name.to_owned());
    object
}

/// Creates `object`; one that already exists is fine.
/// Creates each CRD and waits until the API server says it is `Established`.
async fn install_crds(
    client: &Client,
    crds: &[CustomResourceDefinition],
    dir: &Path,
    deadline: Instant,
    started: Instant,
) -> Result<(), HarnessError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in crds {
        create_if_missing(&api, crd.clone(), dir).await?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        loop {
            let got = api.get(&name).await.map_err(|source| HarnessError::Api {
                action: format!("reading CustomResourceDefinition {name}"),
                dir: dir.to_path_buf(),
                source,
            })?;
            let conditions = got.status.and_then(|s| s.conditions).unwrap_or_default();
            if conditions.iter().any(|c| c.type_ == "Established" && c.status == "True") {
                break;
            }
            if Instant::now() >= deadline {
                return Err(HarnessError::NotReady {
                    process: "kube-apiserver",
                    waited: started.elapsed(),
                    last: format!(
                        "CustomResourceDefinition {name} not Established: {conditions:?}"
                    ),
                    log: dir.join("kube-apiserver.log"),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

async fn create_if_missing<K>(api: &Api<K>, object: K, dir: &Path) -> Result<(), HarnessError>
where
    K: ::kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(::kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(source) => Err(HarnessError::Api {
            action: format!(
                "creating {} {}",
                K::kind(&()),
                object.meta().name.as_deref().unwrap_or_default()
            ),
            dir: dir.to_path_buf(),
            source,
        }),
    }
}

fn os_args<I, S>(args: I) -> Vec<OsString>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    args.into_iter().map(Into::into).collect()
}

fn flag(name: &str, path: &Path) -> OsString {
    let mut flag = OsString::from(format!("--{name}="));
    flag.push(path);
    flag
}

async fn start_once(
    options: &ControlPlaneOptions,
    bins: &Binaries,
) -> Result<ControlPlane, HarnessError> {
    let mut run = Run::new()?;
    let result = start_in(&mut run, options, bins).await;
    match result {
        Ok(parts) => {
            run.keep = false;
            let (client, server_url, admin_kubeconfig, ca_cert, ca_key, startup) = parts;
            Ok(ControlPlane { client, server_url, admin_kubeconfig, ca_cert, ca_key, startup, run })
        }
        Err(e) => {
            // A retried attempt leaves nothing behind; a final failure keeps the logs (Run::drop).
            if e.is_port_clash() {
                run.keep = false;
            }
            Err(e)
        }
    }
}

type Started = (Client, String, PathBuf, PathBuf, String, Duration);

// Test-only crate: the start-up time is the number to watch on a loaded machine, and the test
// harness shows stderr with the test's output.
#[allow(clippy::print_stderr)]
async fn start_in(
    run: &mut Run,
    options: &ControlPlaneOptions,
    bins: &Binaries,
) -> Result<Started, HarnessError> {
    let started = Instant::now();
    let deadline = started + options.ready_timeout;
    let pki = Pki::generate()?;
    let ca_cert = run.write("ca.crt", &pki.ca_cert)?;
    let serving_cert = run.write("apiserver.crt", &pki.serving_cert)?;
    let serving_key = run.write("apiserver.key", &pki.serving_key)?;
    let sa_key = run.write("sa.key", &pki.sa_key)?;
    let sa_pub = run.write("sa.pub", &pki.sa_public_key)?;
    // https://kubernetes.io/docs/reference/access-authn-authz/authentication/#static-token-file
    let tokens =
        run.write("tokens.csv", &format!("{},admin,admin,\"system:masters\"\n", pki.admin_token))?;

    let [etcd_port, peer_port, apiserver_port] = free_ports()?;
    let server_url = format!("https://127.0.0.1:{apiserver_port}");
    let admin_kubeconfig = run.path("admin.kubeconfig");
    write_kubeconfig(&admin_kubeconfig, &server_url, &ca_cert, "admin", &pki.admin_token)?;

    let etcd_url = format!("http://127.0.0.1:{etcd_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut etcd_args = os_args([
        "--name=default".to_owned(),
        format!("--listen-client-urls={etcd_url}"),
        format!("--advertise-client-urls={etcd_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=default={peer_url}"),
        // A test's data dies with the test: skip every fsync.
        "--unsafe-no-fsync=true".to_owned(),
        "--log-level=warn".to_owned(),
    ]);
    etcd_args.push(flag("data-dir", &run.path(ETCD_DATA)));
    run.spawn("etcd", &bins.etcd, etcd_args)?;

    // The apiserver retries etcd until it answers, so both start together.
    let mut apiserver_args = os_args([
        format!("--etcd-servers={etcd_url}"),
        "--bind-address=127.0.0.1".to_owned(),
        "--advertise-address=127.0.0.1".to_owned(),
        format!("--secure-port={apiserver_port}"),
        "--authorization-mode=Node,RBAC".to_owned(),
        "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
        format!("--service-account-issuer={SERVICE_ACCOUNT_ISSUER}"),
        "--allow-privileged=true".to_owned(),
        // The `kubernetes` Service's endpoints would be 127.0.0.1, which Endpoints validation
        // rejects: do not reconcile them.
        "--endpoint-reconciler-type=none".to_owned(),
        "--profiling=false".to_owned(),
    ]);
    apiserver_args.extend([
        flag("tls-cert-file", &serving_cert),
        flag("tls-private-key-file", &serving_key),
        // Client certificates signed by the run's CA authenticate too: a node's kubelet uses one.
        flag("client-ca-file", &ca_cert),
        flag("cert-dir", &run.path("apiserver-certs")),
        flag("token-auth-file", &tokens),
        flag("service-account-key-file", &sa_pub),
        flag("service-account-signing-key-file", &sa_key),
    ]);
    apiserver_args.extend(os_args(&options.apiserver_flags));
    run.spawn("kube-apiserver", &bins.apiserver, apiserver_args)?;

    let client = client_from_kubeconfig(&admin_kubeconfig, &server_url).await?;
    wait_healthy(run, &client, "kube-apiserver", "/readyz", deadline, started).await?;
    let apiserver_ready = started.elapsed();

    // Components start once the apiserver is ready: kube-controller-manager gives up on an
    // apiserver that is not healthy within 10 s.
    let mut components = Vec::new();
    if let Some(binary) = &bins.scheduler {
        let [port] = free_ports()?;
        let mut args = component_args(run, port, &admin_kubeconfig, "kube-scheduler");
        args.push(flag("kubeconfig", &admin_kubeconfig));
        args.extend(os_args(&options.scheduler_flags));
        run.spawn("kube-scheduler", binary, args)?;
        components.push(("kube-scheduler", port));
    }
    if let Some(binary) = &bins.controller_manager {
        let [port] = free_ports()?;
        let mut args = component_args(run, port, &admin_kubeconfig, "kube-controller-manager");
        args.extend([
            flag("kubeconfig", &admin_kubeconfig),
            flag("service-account-private-key-file", &sa_key),
            flag("root-ca-file", &ca_cert),
            // Controllers act with the admin credentials rather than one ServiceAccount each:
            // fewer objects and tokens to wait for at start-up.
            "--use-service-account-credentials=false".into(),
            format!("--controllers={}", options.controllers.join(",")).into(),
        ]);
        args.extend(os_args(&options.controller_manager_flags));
        run.spawn("kube-controller-manager", binary, args)?;
        components.push(("kube-controller-manager", port));
    }

    // Pods in `default` need its ServiceAccount (ServiceAccount admission); the controller that
    // makes it may not run, so the harness makes it.
    let dir = run.dir.clone();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    create_if_missing(&namespaces, named(Namespace::default(), "default"), &dir).await?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    create_if_missing(&accounts, named(ServiceAccount::default(), "default"), &dir).await?;
    install_crds(&client, &options.crds, &dir, deadline, started).await?;

    for (process, port) in components {
        let health = health_client(port)?;
        wait_healthy(run, &health, process, "/healthz", deadline, started).await?;
    }

    let startup = started.elapsed();
    eprintln!(
        "xpu-testkit: control plane ready in {startup:.2?} (kube-apiserver ready after {apiserver_ready:.2?}) at {server_url}, run directory {}",
        run.dir.display()
    );
    Ok((client, server_url, admin_kubeconfig, ca_cert, pki.ca_key, startup))
}

/// Flags shared by kube-scheduler and kube-controller-manager: serving (for `/healthz`) on
/// 127.0.0.1 only, delegated authentication through the admin kubeconfig, no leader election.
fn component_args(run: &Run, port: u16, kubeconfig: &Path, name: &str) -> Vec<OsString> {
    let mut args = os_args([
        "--bind-address=127.0.0.1".to_owned(),
        format!("--secure-port={port}"),
        "--leader-elect=false".to_owned(),
        // Client CAs would come from a ConfigMap nobody needs here; skip the lookup.
        "--authentication-skip-lookup=true".to_owned(),
    ]);
    args.extend([
        flag("cert-dir", &run.path(&format!("{name}-certs"))),
        flag("authentication-kubeconfig", kubeconfig),
        flag("authorization-kubeconfig", kubeconfig),
    ]);
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binary_names_it_the_directory_and_the_install_script() {
        let empty = tempfile::tempdir().expect("a temporary directory can be made");
        let err = Binaries::find(empty.path(), &ControlPlaneOptions::default())
            .err()
            .expect("an empty directory holds no etcd");
        let message = err.to_string();
        assert!(message.starts_with("etcd not found in "), "{message}");
        assert!(message.contains(&empty.path().display().to_string()), "{message}");
        assert!(message.contains("scripts/install-k8s"), "{message}");
    }

    #[test]
    fn optional_components_are_looked_for_only_when_asked() {
        let dir = tempfile::tempdir().expect("a temporary directory can be made");
        for binary in ["etcd", "kube-apiserver"] {
            fs::write(dir.path().join(binary), "").expect("the directory is writable");
        }
        assert!(Binaries::find(dir.path(), &ControlPlaneOptions::default()).is_ok());
        let err = Binaries::find(dir.path(), &ControlPlaneOptions::default().with_scheduler())
            .err()
            .expect("no kube-scheduler in the directory");
        assert!(
            matches!(err, HarnessError::MissingBinary { binary: "kube-scheduler", .. }),
            "{err}"
        );
    }

    #[test]
    fn certificates_are_pem_and_the_token_is_random() {
        let one = Pki::generate().expect("ring generates keys");
        let two = Pki::generate().expect("ring generates keys");
        assert!(one.ca_cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(one.serving_key.contains("PRIVATE KEY"));
        assert!(one.sa_public_key.starts_with("-----BEGIN PUBLIC KEY-----"));
        assert_eq!(one.admin_token.len(), 64);
        assert_ne!(one.admin_token, two.admin_token);
    }
}
