//! `xpu runtime` / `xpu-container-runtime`: the OCI runtime shim in front of runc. Arguments
//! are runc's and are never parsed by clap: `main` hands them over verbatim.
//!
//! Two binaries run this module: `xpu` (as `xpu runtime`, or called `xpu-container-runtime`
//! through a symlink), and the lean `xpu-container-runtime` binary
//! (`src/bin/xpu-container-runtime.rs`), which includes this file and links only `xpu-container`
//! and `xpu-host`. The shim runs on every container start, and the full binary's start-up (the
//! daemon, scheduler and integrations it also carries) is a millisecond of that; so this module
//! uses nothing else of the `xpu` binary.

use std::ffi::OsString;
use std::process::ExitCode;

use xpu_container::config::RuntimeConfig;
use xpu_container::nvml::{Configured, SmiNvml};
use xpu_container::request::Wanted;
use xpu_container::shim::{self, Host, Outcome};
use xpu_container::snapshot::HostSnapshot;
use xpu_core::Inventory;
use xpu_core::driver::{Capabilities, DriverFiles};
use xpu_host::{Root, RootError};

/// Reads the host under the configured root with `xpu-host`, or takes it from the host
/// snapshot `xpu cdi generate` left in the configured CDI directories while that is current
/// (`xpu_container::snapshot`).
pub struct HostReader {
    root: Root,
    cdi_dirs: Vec<std::path::PathBuf>,
    /// The current snapshot, looked for at the first request (a container that asks for
    /// nothing never reads it): `None` until then, `Some(None)` when there is none to use.
    snapshot: std::cell::OnceCell<Option<HostSnapshot>>,
    /// Whether the last inventory came from the snapshot, so the driver files come from the
    /// same place.
    from_snapshot: std::cell::Cell<bool>,
}

impl HostReader {
    pub fn new(cfg: &RuntimeConfig) -> Result<Self, RootError> {
        let root = if cfg.root == std::path::Path::new("/") {
            Root::host()
        } else {
            Root::new(&cfg.root)?
        };
        Ok(Self {
            root,
            cdi_dirs: cfg.cdi_dirs.clone(),
            snapshot: std::cell::OnceCell::new(),
            from_snapshot: std::cell::Cell::new(false),
        })
    }

    /// Whether the last request was answered from the snapshot (for the log line).
    pub fn used_snapshot(&self) -> bool {
        self.from_snapshot.get()
    }

    fn snapshot(&self) -> Option<&HostSnapshot> {
        self.snapshot
            .get_or_init(|| {
                if self.cdi_dirs.is_empty() {
                    return None;
                }
                let (_, snap) = xpu_container::snapshot::load(&self.cdi_dirs)?;
                (snap.key == xpu_host::host_key(&self.root)).then_some(snap)
            })
            .as_ref()
    }
}

impl Host for HostReader {
    fn inventory(&self, only: Option<&[Wanted]>) -> Result<Inventory, String> {
        if let Some(snap) = self.snapshot() {
            let inv = snap.inventory_for(only);
            // The nodes the edits would name must still be those recorded (a driver reload can
            // renumber them without changing the key).
            let nodes =
                inv.devices.iter().flat_map(|d| &d.dev_nodes).chain(&inv.host.control_nodes);
            let current = nodes
                .clone()
                .all(|n| xpu_host::devnode::stat(&self.root, &n.path).as_ref() == Some(n));
            if current {
                self.from_snapshot.set(true);
                return Ok(inv);
            }
        }
        self.from_snapshot.set(false);
        xpu_host::discover_nodes(&self.root, only).map_err(|e| e.to_string())
    }

    fn driver_files(&self, inv: &Inventory, caps: Capabilities) -> DriverFiles {
        if self.from_snapshot.get()
            && let Some(snap) = self.snapshot()
        {
            return snap.driver_files_for(caps);
        }
        let version = inv.host.nvidia_driver_version.as_deref();
        xpu_host::driver_files::find_for(&self.root, version, caps)
    }
}

/// NVML facts: `cuda_version` from the config, else `nvidia-smi` under the host root.
pub fn nvml(cfg: &RuntimeConfig) -> Configured<SmiNvml> {
    Configured {
        cuda_version: cfg.cuda_version.clone(),
        inner: SmiNvml::new(cfg.root.join("usr/bin/nvidia-smi")),
    }
}

fn fail(prefix: &str, e: impl Into<anyhow::Error>) -> ExitCode {
    let e: anyhow::Error = e.into();
    let chain: Vec<String> = e.chain().map(ToString::to_string).collect();
    eprintln!("{prefix}: error: {}", chain.join(": "));
    ExitCode::FAILURE
}

/// The shim's version and the git commit it was built from (`build.rs`).
const VERSION: &str = env!("CARGO_PKG_VERSION");
const COMMIT: &str = env!("XPU_GIT_COMMIT");

/// Runs the shim with runc's arguments `args`; returns only when it cannot exec runc.
pub fn run(args: Vec<OsString>) -> ExitCode {
    const ME: &str = "xpu-container-runtime";
    if let [flag] = args.as_slice()
        && (flag == "--version" || flag == "-v")
    {
        return version(ME);
    }
    let cfg = match RuntimeConfig::load_default() {
        Ok(c) => c,
        Err(e) => return fail(ME, e),
    };
    let host = match HostReader::new(&cfg) {
        Ok(h) => h,
        Err(e) => return fail(ME, e),
    };
    match shim::handle(&args, &cfg, &host, &nvml(&cfg)) {
        Ok((runtime, outcome)) => {
            if let Outcome::Edited(summary) = &outcome {
                let from = if host.used_snapshot() { " (host snapshot)" } else { "" };
                cfg.log(&format!("{summary}{from}"));
            }
            let e = shim::exec(&runtime, &args);
            cfg.log(&xpu_core::error::chain_once(&e));
            fail(ME, e)
        }
        Err(e) => {
            cfg.log(&format!(
                "refused {}: {}",
                display_args(&args),
                xpu_core::error::chain_once(&e)
            ));
            fail(ME, e)
        }
    }
}

/// `--version` (runc's `-v` too) alone: the shim's own version and commit, then the wrapped
/// runtime's `--version` lines, as nvidia-container-runtime prints them. Engines that show the
/// runtime's version (`docker info`) read runc's lines, which come last. The shim's own lines are
/// printed even when the runtime cannot be found or run; that is reported on stderr.
fn version(me: &str) -> ExitCode {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written =
        writeln!(out, "{me} version {VERSION}\ncommit: {COMMIT}").and_then(|()| out.flush());
    if written.is_err() {
        return ExitCode::FAILURE;
    }
    drop(out);
    let runtime = RuntimeConfig::load_default()
        .map_err(anyhow::Error::from)
        .and_then(|cfg| shim::real_runtime(&cfg).map_err(anyhow::Error::from));
    match runtime.and_then(|rt| {
        std::process::Command::new(&rt).arg("--version").status().map_err(anyhow::Error::from)
    }) {
        Ok(status) if !status.success() => eprintln!("{me}: the runtime's --version: {status}"),
        Ok(_) => {}
        Err(e) => eprintln!("{me}: no runtime version: {e:#}"),
    }
    ExitCode::SUCCESS
}

fn display_args(args: &[OsString]) -> String {
    args.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
}

/// The clap stand-in, for `xpu --help`: `main` dispatches `xpu runtime` before clap parses.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// runc's arguments, passed through verbatim (`create --bundle DIR ID`, `start ID`...).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "RUNC_ARGS")]
    pub args: Vec<OsString>,
}
