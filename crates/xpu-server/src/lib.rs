//! `xpu serve`: the accelerator job daemon.
//!
//! A team with a few accelerator hosts queues jobs onto free devices without Kubernetes: the
//! daemon accepts Kubernetes `batch/v1` Job manifests (and xpu's short form) over an HTTP API
//! on a Unix socket and/or TCP, keeps every job durably in SQLite (default) or PostgreSQL,
//! queues them in `xpu-sched` onto the node's devices (whole or shared), runs them as process
//! groups, or as runc containers through `xpu runtime`, with the device environment set, and
//! shows it all on a live dashboard and in Prometheus metrics.
//!
//! - [`store`]: SQLite/PostgreSQL, migrations, group commit, leadership lock.
//! - [`engine`]: the scheduling loop around `xpu-sched`.
//! - [`executor`]: process groups, supervisor, re-adoption after a crash; [`container`]: the
//!   OCI bundle and runtime command line of a containerised task.
//! - [`api`]: the HTTP routes, dashboard and metrics endpoints; [`wire`]: their request and
//!   response types and the OpenAPI document generated from them; [`listen`]: serving them on a
//!   listener, with a connection cap and timeouts.
//! - [`client`]: the CLI's client (hyper, over the Unix socket or TCP), reading [`wire`]'s types.
//! - [`node`]: the node's devices, labels and device environment.
//! - [`view`]: what the API shows of the loop's state.

pub mod api;
pub mod client;
pub mod container;
pub mod datadir;
pub mod engine;
pub mod executor;
pub mod listen;
pub mod metrics;
pub mod node;
pub mod store;
pub mod users;
pub mod view;
pub mod wire;

use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::engine::{Engine, Msg};
use crate::metrics::Metrics;
use crate::node::{FakeDevices, Node};
use crate::store::{PgLeader, Store};
use crate::view::View;

/// The daemon's failures at start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("opening the store")]
    Store(#[from] store::StoreError),
    #[error("discovering accelerators")]
    Discover(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("{what} {path}")]
    Io { what: &'static str, path: String, source: std::io::Error },
    #[error("listening on {addr} (pick a free address with --listen)")]
    Listen { addr: String, source: std::io::Error },
    #[error("this node cannot be scheduled on; drop some --devices")]
    Scheduler(#[source] xpu_sched::scheduler::SchedError),
    #[error("--mps-dir: {0}")]
    Mps(String),
}

/// How often the daemon reads device telemetry (NVML, amdgpu sysfs): a device turning
/// unhealthy stops taking work within about this long.
const TELEMETRY_INTERVAL: Duration = Duration::from_secs(2);

/// `xpu serve` options.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// TCP address; `None` serves only the Unix socket.
    pub listen: Option<SocketAddr>,
    /// Unix socket path (default `<data-dir>/xpu.sock`).
    pub socket: Option<PathBuf>,
    /// Store URL (default `sqlite://<data-dir>/xpu.db`).
    pub db: Option<String>,
    pub root: xpu_host::Root,
    pub data_dir: PathBuf,
    /// Fake accelerators added to what discovery finds.
    pub devices: Vec<FakeDevices>,
    /// Extra node labels (`--label k=v`), matched by `nodeSelector`.
    pub labels: Vec<(String, String)>,
    /// Node name (default: the host name).
    pub node_name: Option<String>,
    /// Time between SIGTERM and SIGKILL when stopping a task.
    pub grace: Duration,
    /// The first wait before a task is restarted in place (`OnFailure`, a Pod's `Always`),
    /// doubled per restart up to 5 minutes, as the kubelet's crash-loop back-off (10 s).
    pub restart_backoff: Duration,
    /// The OCI runtime shim containerised tasks run through (`[/usr/bin/xpu, runtime]`); it
    /// takes runc's arguments.
    pub runtime: Vec<OsString>,
    /// Connection cap and timeouts of each listener.
    pub http: listen::HttpLimits,
    /// Told what happens while the daemon starts (the CLI prints it).
    pub notify: Notify,
    /// Serve tasks with a share of an NVIDIA GPU through that GPU's MPS daemon
    /// (`--mps-dir`, `--mps-control`): see `xpu_host::mps`.
    pub mps: Option<MpsOptions>,
}

/// Where the MPS daemons of `xpu serve` live and what runs them.
#[derive(Debug, Clone)]
pub struct MpsOptions {
    /// Absolute: `<dir>/<gpu uuid>/{pipe,log}`.
    pub dir: PathBuf,
    /// The `nvidia-cuda-mps-control` binary.
    pub control: PathBuf,
}

/// What the daemon tells whoever started it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice<'a> {
    /// Something found at start-up was wrong and has been put right, or something at stop
    /// could not be done and needs nothing from the user.
    Warning(&'a str),
    /// Every listener is bound: what a "serving" banner may say.
    Serving,
}

/// A function that takes [`Notice`]s.
type NoticeFn = dyn Fn(Notice<'_>) + Send + Sync;

/// A receiver of [`Notice`]s; the default drops them.
#[derive(Clone, Default)]
pub struct Notify(Option<Arc<NoticeFn>>);

impl Notify {
    pub fn new(f: impl Fn(Notice<'_>) + Send + Sync + 'static) -> Self {
        Notify(Some(Arc::new(f)))
    }

    pub fn send(&self, n: Notice<'_>) {
        if let Some(f) = &self.0 {
            f(n);
        }
    }
}

impl std::fmt::Debug for Notify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Notify(..)" } else { "Notify(none)" })
    }
}

/// The daemon's socket file, removed when start-up fails after binding it and when the daemon
/// stops.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        // Already gone is fine; one that cannot be removed is replaced at the next start.
        let _ = std::fs::remove_file(&self.0);
    }
}

impl ServeOptions {
    pub fn new(data_dir: PathBuf) -> Self {
        Self {
            listen: None,
            socket: None,
            db: None,
            root: xpu_host::Root::host(),
            data_dir,
            devices: Vec::new(),
            labels: Vec::new(),
            node_name: None,
            grace: Duration::from_secs(10),
            restart_backoff: Duration::from_secs(10),
            runtime: default_runtime(),
            http: listen::HttpLimits::default(),
            notify: Notify::default(),
            mps: None,
        }
    }

    pub fn socket_path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| self.data_dir.join("xpu.sock"))
    }

    pub fn db_url(&self) -> String {
        self.db
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", self.data_dir.join("xpu.db").display()))
    }
}

/// `xpu runtime` of the running binary (the daemon is `xpu serve`).
fn default_runtime() -> Vec<OsString> {
    let exe =
        std::env::current_exe().map_or_else(|_| OsString::from("xpu"), |p| p.into_os_string());
    vec![exe, OsString::from("runtime")]
}

/// State shared by the API handlers and the scheduling loop.
pub struct Shared {
    pub store: Store,
    pub node: Node,
    pub data_dir: PathBuf,
    pub engine: mpsc::UnboundedSender<Msg>,
    pub view: RwLock<View>,
    pub metrics: Metrics,
    pub leader: AtomicBool,
    /// The daemon's bearer token (`<data-dir>/token`): whoever sends it over TCP acts as the
    /// daemon's own user ([`Shared::me`]).
    pub token: String,
    /// Tokens of other users (`<data-dir>/tokens`, [`load_user_tokens`]): whoever sends one
    /// over TCP acts as that user.
    pub user_tokens: Vec<(String, store::Owner)>,
    /// The daemon's own user and group.
    pub me: store::Owner,
    /// The log followers streaming now, bounded ([`api::Followers`]).
    pub followers: Arc<api::Followers>,
    pub started_ms: i64,
    pub grace: Duration,
    /// See [`ServeOptions::restart_backoff`].
    pub restart_backoff: Duration,
    pub runtime: Vec<OsString>,
    db_url: String,
    /// The node's device telemetry and health (`xpu-telemetry`): `/metrics` exports its
    /// per-device series, the dashboard shows utilisation and memory, and the engine places
    /// nothing on a device it reports unhealthy. `None` in tests that do not need it.
    pub telemetry: Option<xpu_telemetry::collect::Collector>,
    /// The MPS daemons share tasks are clients of ([`ServeOptions::mps`]).
    pub mps: Option<Arc<xpu_host::mps::Daemons>>,
    /// The host the node was read from (`--root`): which use holds each device is read there.
    pub root: xpu_host::Root,
}

/// How the loop becomes leader: always with SQLite (one daemon per file), by advisory lock with
/// PostgreSQL.
pub enum Leadership {
    Sole,
    Pg(PgLeader),
}

impl Leadership {
    pub async fn acquire(&mut self) -> bool {
        match self {
            Leadership::Sole => true,
            Leadership::Pg(l) => l.try_acquire().await,
        }
    }
}

impl Shared {
    pub fn leadership(&self) -> Leadership {
        if self.store.is_postgres() {
            Leadership::Pg(PgLeader::new(&self.db_url))
        } else {
            Leadership::Sole
        }
    }
}

/// The daemon's own user and group (effective ids).
pub fn daemon_user() -> store::Owner {
    store::Owner {
        uid: rustix::process::geteuid().as_raw(),
        gid: rustix::process::getegid().as_raw(),
    }
}

/// Most user tokens read from `<data-dir>/tokens`.
const MAX_USER_TOKENS: usize = 10_000;

/// Reads `<data-dir>/tokens`, the tokens of users other than the daemon's, for TCP clients:
/// one `USER TOKEN` per line, `USER` a name from `/etc/passwd` or `UID:GID`, `#` comments. The
/// file must belong to the daemon's user and be private to it (0600), like `token`; it is
/// optional (none: only the daemon's token works over TCP).
pub fn load_user_tokens(data_dir: &Path) -> Result<Vec<(String, store::Owner)>, ServeError> {
    use std::os::unix::fs::MetadataExt;
    let path = data_dir.join("tokens");
    let bad = |msg: String| ServeError::Io {
        what: "reading the user tokens",
        path: path.display().to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, msg),
    };
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(bad(e.to_string())),
    };
    if !meta.is_file() || meta.uid() != daemon_user().uid || meta.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "must be a regular file of uid {} with mode 0600 (chmod 600, chown it)",
            daemon_user().uid
        )));
    }
    let text = container::read_bounded(&path, 1 << 20).map_err(&bad)?;
    let text = String::from_utf8(text).map_err(|_| bad("not UTF-8".to_owned()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(user), Some(token), None) = (words.next(), words.next(), words.next()) else {
            return Err(bad(format!("line {}: want `USER TOKEN`", n + 1)));
        };
        if token.len() < 32 {
            return Err(bad(format!("line {}: a token must be at least 32 characters", n + 1)));
        }
        let owner = user_ids(user)
            .ok_or_else(|| bad(format!("line {}: no user {user:?} in /etc/passwd", n + 1)))?;
        if out.len() == MAX_USER_TOKENS {
            return Err(bad(format!("more than {MAX_USER_TOKENS} tokens")));
        }
        out.push((token.to_owned(), owner));
    }
    Ok(out)
}

/// `UID:GID`, or a user name's ids from `/etc/passwd`.
fn user_ids(user: &str) -> Option<store::Owner> {
    if let Some((u, g)) = user.split_once(':') {
        return Some(store::Owner { uid: u.parse().ok()?, gid: g.parse().ok()? });
    }
    users::by_name(user).map(|a| store::Owner { uid: a.uid, gid: a.gid })
}

/// Reads `<data-dir>/token`, creating it (mode 0600, 32 random bytes in hex) when missing.
pub fn load_token(data_dir: &Path) -> Result<String, ServeError> {
    let path = data_dir.join("token");
    if let Ok(t) = std::fs::read_to_string(&path)
        && !t.trim().is_empty()
    {
        return Ok(t.trim().to_owned());
    }
    let io = |source| ServeError::Io {
        what: "creating the token",
        path: path.display().to_string(),
        source,
    };
    let mut bytes = [0u8; 32];
    let mut f = std::fs::File::open("/dev/urandom").map_err(io)?;
    std::io::Read::read_exact(&mut f, &mut bytes).map_err(io)?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    // Private from its creation: never readable by others, not even until a chmod.
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(datadir::FILE_MODE)
        .open(&path)
        .map_err(io)?;
    std::io::Write::write_all(&mut out, format!("{token}\n").as_bytes()).map_err(io)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(token)
}

/// The node the daemon schedules onto: discovered accelerators plus `--devices`, labels, CPU
/// and memory.
pub fn node_for(opts: &ServeOptions) -> Result<Node, ServeError> {
    let discover_opts = xpu_host::DiscoverOptions {
        scope: xpu_host::Scope::Accelerators,
        pci_ids: None,
        skip_names: true,
    };
    let mut inv = xpu_host::discover(&opts.root, &discover_opts)
        .map_err(|e| ServeError::Discover(Box::new(e)))?;
    node::add_fakes(&mut inv, &opts.devices);
    let (cpu, mem) = node::host_capacity(&opts.root);
    let mut node = node::node_from_inventory(&inv, &opts.labels, cpu, mem);
    if let Some(n) = &opts.node_name {
        node.rename(n);
    }
    // The scheduler takes it, or says why not (more than 32 devices, say).
    engine::scheduler_for(&node.sched).map_err(ServeError::Scheduler)?;
    Ok(node)
}

/// Runs the daemon until SIGINT/SIGTERM.
pub async fn serve(opts: ServeOptions) -> Result<(), ServeError> {
    let io = |what, path: &Path| {
        let path = path.display().to_string();
        move |source| ServeError::Io { what, path, source }
    };
    let db_file = opts.db_url().strip_prefix("sqlite://").map(PathBuf::from);
    let fixed = datadir::prepare(&opts.data_dir, &opts.socket_path(), db_file.as_deref()).map_err(
        |(path, source)| ServeError::Io {
            what: "making private",
            path: path.display().to_string(),
            source,
        },
    )?;
    for f in &fixed {
        opts.notify.send(Notice::Warning(f));
    }
    let node = node_for(&opts)?;
    // `--devices`' fake accelerators, for the telemetry's device list (no source reads them).
    let fakes = {
        let mut inv = xpu_core::Inventory::default();
        node::add_fakes(&mut inv, &opts.devices);
        inv.devices
    };
    let db_url = opts.db_url();
    let store = Store::open(&db_url).await?;
    let token = load_token(&opts.data_dir)?;
    let user_tokens = load_user_tokens(&opts.data_dir)?;
    let mps = match &opts.mps {
        Some(m) => Some(Arc::new(
            xpu_host::mps::Daemons::new(m.dir.clone(), m.control.clone())
                .map_err(ServeError::Mps)?,
        )),
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        store,
        node,
        data_dir: opts.data_dir.clone(),
        engine: tx.clone(),
        view: RwLock::new(View::default()),
        metrics: Metrics::default(),
        leader: AtomicBool::new(false),
        token,
        user_tokens,
        me: daemon_user(),
        followers: Arc::default(),
        started_ms: store::now_ms(),
        grace: opts.grace,
        restart_backoff: opts.restart_backoff,
        runtime: opts.runtime.clone(),
        db_url,
        telemetry: Some(xpu_telemetry::collect::Collector::start_with(
            opts.root.clone(),
            TELEMETRY_INTERVAL,
            xpu_telemetry::default_sources(&opts.root),
            fakes,
        )),
        mps,
        root: opts.root.clone(),
    });
    let engine = Engine::new(shared.clone(), rx, tx).map_err(ServeError::Scheduler)?;

    let socket = opts.socket_path();
    let _ = std::fs::remove_file(&socket);
    let unix = tokio::net::UnixListener::bind(&socket).map_err(io("binding socket", &socket))?;
    let _socket_file = SocketFile(socket.clone());
    // rw for owner and group: local users in the daemon's group may submit.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660))
        .map_err(io("setting mode on", &socket))?;
    let conns = Arc::new(listen::ConnStats::default());
    let api_opts = |tcp| api::ApiOptions {
        tcp,
        body_timeout: opts.http.request_timeout,
        conn_stats: conns.clone(),
    };
    let unix_app = api::router(shared.clone(), &api_opts(None));
    let mut servers = tokio::task::JoinSet::new();
    servers.spawn(listen::serve(unix, unix_app, opts.http, listen::Kind::Unix, conns.clone()));
    if let Some(addr) = opts.listen {
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Listen { addr: addr.to_string(), source })?;
        // The address actually bound (the port, when 0 was asked for).
        let bound = tcp.local_addr().unwrap_or(addr);
        let app = api::router(shared.clone(), &api_opts(Some(bound)));
        servers.spawn(listen::serve(tcp, app, opts.http, listen::Kind::Tcp, conns.clone()));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io("installing signal handler", Path::new("SIGTERM")))?;
    // Scheduling (re-adopting tasks, starting queued ones) begins once start-up cannot fail.
    tokio::spawn(engine.run());
    opts.notify.send(Notice::Serving);
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = servers.join_next() => {}
    }
    // Tasks keep running: a restarted daemon re-adopts them. The socket goes with its guard.
    // The store is left whole in its file; one that cannot be checkpointed now (a reader holds
    // the WAL) is as durable, only in two files, and the next start reads both.
    if let Err(e) = shared.store.checkpoint().await {
        let msg = format!(
            "store: the write-ahead log was not checkpointed at stop ({e}); the next start reads it"
        );
        opts.notify.send(Notice::Warning(&msg));
    }
    Ok(())
}

/// Builds a runtime and runs [`serve`] (what the CLI calls).
pub fn serve_blocking(opts: ServeOptions) -> Result<(), ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| ServeError::Io {
            what: "starting",
            path: "tokio runtime".into(),
            source,
        })?;
    rt.block_on(serve(opts))
}
