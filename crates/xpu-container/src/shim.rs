//! The OCI runtime shim: `xpu-container-runtime` (or `xpu runtime`) stands where an engine
//! expects `runc`. On `create` and `run` it reads the bundle's `config.json`, resolves what the
//! container asks for ([`crate::request`]), checks `NVIDIA_REQUIRE_*`, checks every path it will
//! add against the rootfs ([`crate::rootfs`]), edits the spec and writes it back atomically, then
//! execs the real runtime with the original arguments. Every other subcommand, and a container
//! that asks for nothing, goes to the real runtime untouched, without discovering the host.
//!
//! Any error stops before the spec is written and before the real runtime runs: the engine sees
//! a failed `create` with the message on stderr, never a half-edited spec.
//!
//! Argument parsing follows runc's command line (<https://github.com/opencontainers/runc>,
//! `runc --help`): global options before the subcommand, `--bundle`/`-b` on `create`/`run`
//! (default: the current directory), Go flag syntax (`-b X`, `--bundle X`, `--bundle=X`,
//! `-bundle X`).

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use xpu_core::driver::{Capabilities, DriverFiles};
use xpu_core::{Inventory, PciDevice};

use crate::cdi::CdiKind;
use crate::config::{ConfigError, RuntimeConfig};
use crate::edits::{self, EditError, Edits};
use crate::nvml::{Nvml, Version};
use crate::oci::{Spec, SpecError};
use crate::request::{
    self, CDI_ANNOTATION_PREFIX, Env, NVIDIA_VISIBLE_DEVICES, Request, RequestError, Wanted,
};
use crate::require::{self, RequireError};
use crate::rootfs::{Rootfs, RootfsError};

/// The variable the shim and the hook set in the container: the CDI names it was given.
pub const XPU_DEVICES: &str = "XPU_DEVICES";

/// The host as the shim sees it; the binary implements it with `xpu-host`.
pub trait Host {
    /// The accelerators matching one of `only` (all of them when `None`) with their device
    /// nodes, driver and UUID, and the host's control nodes and NVIDIA driver version: what
    /// [`request::wanted`] says the container can name. The shim runs on every container start,
    /// so it reads no more than that (`xpu_host::discover_nodes`).
    fn inventory(&self, only: Option<&[Wanted]>) -> Result<Inventory, String>;
    /// Whether the device nodes of `inv.devices[i]` for each `i` in `devices`, and the host's
    /// control nodes, are still those `inv` records. An inventory just read from the host is;
    /// one taken from a saved snapshot is checked here, for the devices the request selected
    /// and no others. `false` makes the shim [`Host::discover`] and resolve the request again.
    fn nodes_current(&self, inv: &Inventory, devices: &[usize]) -> bool;
    /// [`Host::inventory`] read from the host itself, never from a snapshot.
    fn discover(&self, only: Option<&[Wanted]>) -> Result<Inventory, String>;
    /// NVIDIA's driver files for `caps`; called only when a container needs them.
    fn driver_files(&self, inv: &Inventory, caps: Capabilities) -> DriverFiles;
}

/// Why a container cannot be prepared.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("invalid request in config.json")]
    Request(#[from] RequestError),
    #[error(transparent)]
    Require(#[from] RequireError),
    #[error(transparent)]
    Edit(#[from] EditError),
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error("reading the host for devices failed: {0}")]
    Host(String),
    #[error(
        "the real runtime {runtime:?} was not found (tried $PATH and /usr/sbin, /usr/bin, /usr/local/sbin, /usr/local/bin); set runtime in {config}"
    )]
    RuntimeNotFound { runtime: String, config: String },
    #[error(
        "the real runtime {} is this shim itself; set runtime in {config} to runc's path",
        path.display()
    )]
    RuntimeIsShim { path: PathBuf, config: String },
    #[error("exec of the real runtime {} failed", path.display())]
    Exec { path: PathBuf, source: std::io::Error },
}

/// What the container gets, computed but not yet applied.
#[derive(Debug)]
pub struct Prepared {
    pub spec: Spec,
    pub request: Request,
    pub edits: Edits,
    pub rootfs: PathBuf,
}

impl Prepared {
    /// One line for logs: `nvidia.com/gpu=1,nvidia.com/gpu=3: 5 nodes, 9 mounts`.
    pub fn summary(&self) -> String {
        let names = if self.request.names.is_empty() {
            "NVIDIA driver only".to_owned()
        } else {
            self.request.names.join(",")
        };
        let mut s = format!(
            "{names}: {} nodes, {} mounts",
            self.edits.nodes.len(),
            self.edits.mounts.len()
        );
        for w in &self.edits.warnings {
            s.push_str("; warning: ");
            s.push_str(w);
        }
        s
    }
}

/// Whether a spec's environment or annotations could ask for anything: lets a plain container
/// skip host discovery.
fn may_request(env: &Env, annotations: &BTreeMap<String, String>) -> bool {
    let asks = |name: &str| env.get(name).is_some_and(|v| !matches!(v.trim(), "" | "void"));
    asks(NVIDIA_VISIBLE_DEVICES)
        || asks(request::XPU_VISIBLE_DEVICES)
        || annotations.keys().any(|k| k.starts_with(CDI_ANNOTATION_PREFIX))
}

/// Reads `BUNDLE/config.json` and computes what the container gets; `None` when it asks for
/// nothing. Checks requirements and the rootfs paths; writes nothing.
pub fn prepare(
    bundle: &Path,
    cfg: &RuntimeConfig,
    host: &dyn Host,
    nvml: &dyn Nvml,
) -> Result<Option<Prepared>, ShimError> {
    let mut spec = Spec::load(bundle)?;
    let env = spec.env()?;
    let annotations = spec.annotations()?;
    if !may_request(&env, &annotations) {
        return Ok(None);
    }
    // Most containers ask for nothing: the members the edits need are parsed only now.
    spec.materialize()?;
    let only = request::wanted(&env, &annotations);
    let mut inv = host.inventory(only.as_deref()).map_err(ShimError::Host)?;
    let mut req = request::resolve(&env, &annotations, &inv, cfg.default_capabilities)?;
    if !host.nodes_current(&inv, &req.selection.devices) {
        inv = host.discover(only.as_deref()).map_err(ShimError::Host)?;
        req = request::resolve(&env, &annotations, &inv, cfg.default_capabilities)?;
    }
    if req.selection.is_empty() {
        return Ok(None);
    }
    let wants_driver = req.selection.wants_nvidia_driver(&inv);
    let files = wants_driver.then(|| host.driver_files(&inv, req.selection.capabilities));
    if req.check_require {
        let gpus: Vec<&PciDevice> = req
            .selection
            .devices
            .iter()
            .map(|&i| &inv.devices[i])
            .filter(|d| CdiKind::of(d) == Some(CdiKind::NvidiaGpu))
            .collect();
        let facts = require::Facts {
            driver_version: inv.host.nvidia_driver_version.as_deref().and_then(Version::parse),
            nvml,
            gpus,
        };
        require::check(&env, &facts)?;
    }
    let mut edits = edits::for_selection(&inv, files.as_ref(), &req.selection, &cfg.root)?;
    if !req.names.is_empty() {
        edits.env.push((XPU_DEVICES.to_owned(), req.names.join(",")));
    }
    let rootfs = spec.rootfs(bundle)?;
    let fs = Rootfs::open(&rootfs)?;
    let nodes = edits.nodes.iter().map(|n| n.path.as_str());
    fs.check_all(nodes.chain(edits.mounts.iter().map(|m| m.destination.as_str())))?;
    Ok(Some(Prepared { spec, request: req, edits, rootfs }))
}

/// The subcommand and bundle of a runtime command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    pub subcommand: Option<String>,
    /// `--bundle`, or `None` for the current directory.
    pub bundle: Option<PathBuf>,
    /// The path this binary was started by (the kernel's `AT_EXECFN`), when its entry point
    /// knows it; [`real_runtime`] tells the shim apart from runc by it.
    pub program: Option<PathBuf>,
}

impl Invocation {
    /// `create` or `run`: the commands that start from a bundle's spec.
    pub fn creates(&self) -> bool {
        matches!(self.subcommand.as_deref(), Some("create" | "run"))
    }
}

/// Global options of runc (and crun, youki) that take a value.
const GLOBAL_WITH_VALUE: [&str; 6] =
    ["root", "log", "log-format", "criu", "rootless", "cgroup-manager"];
/// `create`/`run` options that take a value, besides `bundle`.
const CREATE_WITH_VALUE: [&str; 4] = ["console-socket", "pid-file", "preserve-fds", "criu"];

/// `--name=value` / `-name=value` / `--name` / `-name` → (name, inline value).
fn flag(arg: &OsStr) -> Option<(String, Option<OsString>)> {
    let s = arg.to_str()?;
    let body = s.strip_prefix("--").or_else(|| s.strip_prefix('-'))?;
    if body.is_empty() {
        return None;
    }
    Some(match body.split_once('=') {
        Some((n, v)) => (n.to_owned(), Some(OsString::from(v))),
        None => (body.to_owned(), None),
    })
}

/// Finds the subcommand and, for `create`/`run`, the bundle.
pub fn parse_args(args: &[OsString]) -> Invocation {
    let mut i = 0;
    let mut subcommand = None;
    while i < args.len() {
        match flag(&args[i]) {
            Some((name, inline)) => {
                if inline.is_none() && GLOBAL_WITH_VALUE.contains(&name.as_str()) {
                    i += 1;
                }
            }
            None => {
                subcommand = args[i].to_str().map(str::to_owned);
                break;
            }
        }
        i += 1;
    }
    let mut inv = Invocation { subcommand, bundle: None, program: None };
    if inv.creates() {
        let mut j = i + 1;
        while j < args.len() {
            if let Some((name, inline)) = flag(&args[j]) {
                if name == "bundle" || name == "b" {
                    match inline {
                        Some(v) => inv.bundle = Some(PathBuf::from(v)),
                        None => {
                            inv.bundle = args.get(j + 1).map(PathBuf::from);
                            j += 1;
                        }
                    }
                } else if inline.is_none() && CREATE_WITH_VALUE.contains(&name.as_str()) {
                    j += 1;
                }
            }
            j += 1;
        }
    }
    inv
}

/// The real runtime's path: `runtime` from the config, looked up in `$PATH` (and the usual
/// sbin directories, which engines' minimal `$PATH` often lacks) when it is a bare name. Never
/// this shim itself, which `program` (the path this binary was started by, when known) or else
/// `/proc/self/exe` names.
pub fn real_runtime(cfg: &RuntimeConfig, program: Option<&Path>) -> Result<PathBuf, ShimError> {
    let config = cfg
        .source
        .as_ref()
        .map_or_else(|| crate::config::DEFAULT_PATH.to_owned(), |p| p.display().to_string());
    // A regular file (after symlinks), with its device and inode: one `stat` per candidate.
    let file = |p: PathBuf| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&p).ok().filter(std::fs::Metadata::is_file)?;
        Some((p, (m.dev(), m.ino())))
    };
    let candidate = if cfg.runtime.contains('/') {
        file(PathBuf::from(&cfg.runtime))
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain(
                ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"].map(PathBuf::from),
            )
            .find_map(|d| file(d.join(&cfg.runtime)))
    };
    let (path, runtime) = candidate.ok_or_else(|| ShimError::RuntimeNotFound {
        runtime: cfg.runtime.clone(),
        config: config.clone(),
    })?;
    // The same file as this binary, by device and inode: a symlink or hard link to it too. The
    // path it was started by answers in a `stat` of a few µs; a new process's first look at its
    // own `/proc` entry costs 13 µs, so `/proc/self/exe` is only asked when that path is gone.
    let me =
        program.and_then(|p| file(p.to_owned())).or_else(|| file(PathBuf::from("/proc/self/exe")));
    if me.is_some_and(|(_, id)| id == runtime) {
        return Err(ShimError::RuntimeIsShim { path, config });
    }
    Ok(path)
}

/// What the shim did before handing over.
#[derive(Debug)]
pub enum Outcome {
    /// Not a create, or nothing requested: the spec is untouched.
    PassThrough,
    /// The spec was edited; the summary is for the log. The prepared edits come along so that
    /// a caller about to exec can keep them alive rather than spend the time freeing them.
    Edited(String, Box<Prepared>),
}

/// Does the shim's work for the command line `inv` ([`parse_args`] of everything after the
/// program name) and returns the real runtime to exec. Errors leave the bundle as it was.
pub fn handle(
    inv: Invocation,
    cfg: &RuntimeConfig,
    host: &dyn Host,
    nvml: &dyn Nvml,
) -> Result<(PathBuf, Outcome), ShimError> {
    let runtime = real_runtime(cfg, inv.program.as_deref())?;
    if !inv.creates() {
        return Ok((runtime, Outcome::PassThrough));
    }
    let bundle = inv.bundle.unwrap_or_else(|| PathBuf::from("."));
    let Some(mut prepared) = prepare(&bundle, cfg, host, nvml)? else {
        return Ok((runtime, Outcome::PassThrough));
    };
    prepared.spec.apply(&prepared.edits)?;
    prepared.spec.save()?;
    let summary = format!(
        "{} {}: {}",
        inv.subcommand.unwrap_or_default(),
        bundle.display(),
        prepared.summary()
    );
    Ok((runtime, Outcome::Edited(summary, Box::new(prepared))))
}

/// Replaces this process with the real runtime, arguments verbatim. Returns only on failure.
pub fn exec(runtime: &Path, args: &[OsString]) -> ShimError {
    use std::os::unix::process::CommandExt;
    let e = std::process::Command::new(runtime).args(args).exec();
    ShimError::Exec { path: runtime.to_owned(), source: e }
}

#[cfg(test)]
mod tests {
    use std::os::unix::ffi::OsStringExt;

    use super::*;

    fn args(s: &[&str]) -> Vec<OsString> {
        s.iter().map(OsString::from).collect()
    }

    /// The last definition of a variable decides; empty, blank and `void` ask for nothing; any
    /// CDI annotation may ask.
    #[test]
    fn the_last_definition_decides_whether_a_spec_may_ask() {
        let asks = |env: &[&str], annotations: &[&str]| {
            let annotations: serde_json::Map<String, serde_json::Value> =
                annotations.iter().map(|k| ((*k).to_owned(), "x".into())).collect();
            let spec = serde_json::json!({ "process": { "env": env }, "annotations": annotations });
            let spec = Spec::parse(spec.to_string().as_bytes(), PathBuf::from("config.json"));
            let spec = spec.unwrap();
            may_request(&spec.env().unwrap(), &spec.annotations().unwrap())
        };
        assert!(asks(&["NVIDIA_VISIBLE_DEVICES=0"], &[]));
        assert!(!asks(&["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=void"], &[]));
        assert!(!asks(&["NVIDIA_VISIBLE_DEVICES= "], &[]));
        assert!(!asks(&["NVIDIA_VISIBLE_DEVICES"], &[]));
        assert!(asks(&["XPU_VISIBLE_DEVICES=nvidia.com/gpu=1"], &[]));
        assert!(asks(&[], &["cdi.k8s.io/x"]));
        assert!(!asks(&["PATH=/bin"], &["io.kubernetes.cri.x"]));
    }

    #[test]
    fn finds_subcommand_and_bundle_like_runc() {
        let i = parse_args(&args(&[
            "--root",
            "/run/x",
            "--log",
            "/l",
            "--systemd-cgroup",
            "create",
            "--bundle",
            "/b",
            "--pid-file",
            "/p",
            "id",
        ]));
        assert_eq!(i.subcommand.as_deref(), Some("create"));
        assert_eq!(i.bundle, Some(PathBuf::from("/b")));
        let i = parse_args(&args(&["--root=/r", "run", "-b=/c", "id"]));
        assert_eq!((i.subcommand.as_deref(), i.bundle), (Some("run"), Some(PathBuf::from("/c"))));
        let i = parse_args(&args(&["create", "--console-socket", "-b", "-bundle", "/d", "id"]));
        assert_eq!(i.bundle, Some(PathBuf::from("/d")));
        let i = parse_args(&args(&["create", "id"]));
        assert_eq!(i.bundle, None);
        let i = parse_args(&args(&["--debug", "state", "id"]));
        assert_eq!((i.subcommand.as_deref(), i.bundle), (Some("state"), None));
        assert_eq!(parse_args(&args(&["--version"])).subcommand, None);
        let not_utf8 = [OsString::from_vec(b"\xff".to_vec()), OsString::from("create")];
        assert_eq!(parse_args(&not_utf8).subcommand, None, "a non-UTF-8 word is not a subcommand");
    }
}
