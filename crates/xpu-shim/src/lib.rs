//! The OCI runtime shim in front of runc: `xpu-container-runtime` (this package's binary), which
//! engines run in place of runc, and `xpu runtime` (the full `xpu` binary, which calls [`run`]).
//! Arguments are runc's and are never parsed by clap: they are handed over verbatim.
//!
//! The shim's logic is in `xpu_container::shim`; this crate adds the host it reads (`xpu-host`,
//! or the snapshot `xpu cdi generate` left) and the process around it. It is a package of its
//! own so that the binary links, and a build compiles, only what a container start needs:
//! `scripts/build-shim` builds it with the `shim` profile, linked statically with musl, and the
//! package installs it as `/usr/bin/xpu-container-runtime`.

// A runtime reports on stderr (the engine shows it) and `--version` on stdout.
#![allow(clippy::print_stderr, clippy::print_stdout)]

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
    /// The shim's log (`log_file`), for the snapshots passed over.
    log_file: Option<std::path::PathBuf>,
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
            log_file: cfg.log_file.clone(),
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
                // A file at the snapshot's name that is not one (a FIFO, a link to a device,
                // a huge file) is passed over at once: the start discovers, and says why on
                // stderr and in the log, where the engine's and the admin's eyes are.
                let mut passed_over = Vec::new();
                let found = xpu_container::snapshot::load_noting(&self.cdi_dirs, &mut passed_over);
                for w in &passed_over {
                    eprintln!("xpu: warning: {w}");
                    if let Some(log) = &self.log_file {
                        xpu_container::config::append_log(log, &format!("warning: {w}"));
                    }
                }
                let (_, snap) = found?;
                (snap.key == xpu_host::host_key(&self.root)).then_some(snap)
            })
            .as_ref()
    }
}

impl Host for HostReader {
    fn inventory(&self, only: Option<&[Wanted]>) -> Result<Inventory, String> {
        match self.snapshot() {
            Some(snap) => {
                self.from_snapshot.set(true);
                Ok(snap.inventory_for(only))
            }
            None => self.discover(only),
        }
    }

    fn nodes_current(&self, inv: &Inventory, devices: &[usize]) -> bool {
        if !self.from_snapshot.get() {
            return true;
        }
        // The nodes the edits would name must still be those recorded (a driver reload can
        // renumber them without changing the key); the other devices' are not read.
        let mut nodes = devices
            .iter()
            .filter_map(|&i| inv.devices.get(i))
            .flat_map(|d| &d.dev_nodes)
            .chain(&inv.host.control_nodes);
        let current =
            nodes.all(|n| xpu_host::devnode::stat(&self.root, &n.path).as_ref() == Some(n));
        if !current {
            self.from_snapshot.set(false);
        }
        current
    }

    fn discover(&self, only: Option<&[Wanted]>) -> Result<Inventory, String> {
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

/// The host snapshot `xpu cdi generate` writes beside its specs, of the host under `root`: what
/// the shim's own discovery returns (every accelerator, device nodes only) and NVIDIA's driver
/// files for every capability. `key` is `xpu_host::host_key`, taken by the caller *before* it
/// read the host, so that a change while it reads makes the snapshot stale rather than a mix
/// that passes as current.
pub fn host_snapshot(root: &Root, key: String) -> Result<HostSnapshot, xpu_host::DiscoverError> {
    let inventory = xpu_host::discover_nodes(root, None)?;
    let version = inventory.host.nvidia_driver_version.as_deref();
    let driver_files = xpu_host::driver_files::find_for(root, version, Capabilities::all());
    Ok(HostSnapshot { format: xpu_container::snapshot::FORMAT, key, inventory, driver_files })
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
/// `xpu --version`'s line: the workspace's version and the commit (this package's `build.rs`
/// stamps it for both binaries).
pub const VERSION_LINE: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (", env!("XPU_GIT_COMMIT"), ")");

/// Runs the shim with runc's arguments `args`; returns only when it cannot exec runc, with
/// `ExitCode::SUCCESS` or `ExitCode::FAILURE` (the packaged binary's `main` relies on that).
pub fn run(args: Vec<OsString>) -> ExitCode {
    run_as(args, None)
}

/// [`run`], given the path this binary was started by (`AT_EXECFN`), which tells the shim apart
/// from the runtime it execs faster than `/proc/self/exe` does.
pub fn run_as(args: Vec<OsString>, program: Option<std::path::PathBuf>) -> ExitCode {
    const ME: &str = "xpu-container-runtime";
    if let [flag] = args.as_slice()
        && (flag == "--version" || flag == "-v")
    {
        return version(ME);
    }
    // The command line first: it is in memory, and says whether the spec is read at all.
    let invocation = shim::Invocation { program, ..shim::parse_args(&args) };
    let cfg = match RuntimeConfig::load_default() {
        Ok(c) => c,
        Err(e) => return fail(ME, e),
    };
    let host = match HostReader::new(&cfg) {
        Ok(h) => h,
        Err(e) => return fail(ME, e),
    };
    match shim::handle(invocation, &cfg, &host, &nvml(&cfg)) {
        Ok((runtime, outcome)) => {
            if let Outcome::Edited(summary, _) = &outcome {
                let from = if host.used_snapshot() { " (host snapshot)" } else { "" };
                cfg.log(&format!("{summary}{from}"));
            }
            // `outcome` (the edited spec) and `host` (the snapshot) stay alive across the exec,
            // which replaces the process: freeing them first would only cost time.
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
        .and_then(|cfg| shim::real_runtime(&cfg, None).map_err(anyhow::Error::from));
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use xpu_testkit::traps::{Trap, returns};

    /// Issue 12: a FIFO named `xpu-host.snapshot` in a CDI directory (or a link to a device, a
    /// huge file) does not block the shim or the hook (both read the host through
    /// `HostReader`): it is passed over with a warning in the log, the host is discovered, and a
    /// current snapshot in a later directory still answers.
    #[test]
    fn a_snapshot_that_is_a_fifo_is_passed_over_and_the_host_discovered() {
        let fixture = xpu_testkit::hosts::a100_8x().build();
        let root = Root::new(fixture.root()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (etc, run) = (dir.path().join("etc-cdi"), dir.path().join("run-cdi"));
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::create_dir_all(&run).unwrap();
        let trap = etc.join(xpu_container::snapshot::FILE_NAME);
        let snap = host_snapshot(&root, xpu_host::host_key(&root)).unwrap();
        std::fs::write(run.join(xpu_container::snapshot::FILE_NAME), snap.to_json()).unwrap();
        type Plant = fn(&std::path::Path);
        let traps: [(Plant, &str); 3] = [
            (|p| Trap::Fifo.plant(p), "is a FIFO, not a regular file"),
            (|p| Trap::DevZero.plant(p), "is a character device, not a regular file"),
            (|p| Trap::Huge.plant(p), "is too large"),
        ];
        for (plant, said) in traps {
            plant(&trap);
            let log = dir.path().join("xpu.log");
            // Each trap's starts are counted in a log of their own; the first has none yet.
            let _ = std::fs::remove_file(&log);
            for (dirs, from_snapshot) in
                [(vec![etc.clone()], false), (vec![etc.clone(), run.clone()], true)]
            {
                let cfg = RuntimeConfig {
                    root: fixture.root().to_owned(),
                    cdi_dirs: dirs,
                    log_file: Some(log.clone()),
                    ..RuntimeConfig::default()
                };
                let (gpus, used) = returns("reading the host", move || {
                    let host = HostReader::new(&cfg).unwrap();
                    let inv = host.inventory(None).unwrap();
                    (inv.of_kind(xpu_core::DeviceKind::Gpu).count(), host.used_snapshot())
                });
                assert_eq!((gpus, used), (8, from_snapshot), "{said}");
            }
            let logged = std::fs::read_to_string(&log).unwrap();
            let lines: Vec<&str> = logged.lines().collect();
            assert_eq!(lines.len(), 2, "a warning per start: {logged}");
            for l in lines {
                assert!(
                    l.contains(&format!("warning: host snapshot {}: {said}", trap.display())),
                    "{l}"
                );
            }
        }
    }

    /// The snapshot file leaves out `null` fields and empty objects, and reads back as exactly
    /// what was written, on every fixture host (with NVIDIA's driver files where it has them).
    #[test]
    fn host_snapshot_reads_back_as_written_on_every_fixture_host() {
        for spec in xpu_testkit::hosts::all() {
            let fixture = spec.build();
            if let Some(v) = spec.nvidia_driver.as_deref() {
                xpu_testkit::driver::install_nvidia(fixture.root(), v);
            }
            let root = Root::new(fixture.root()).unwrap();
            let snap = host_snapshot(&root, xpu_host::host_key(&root)).unwrap();
            let text = snap.to_json();
            assert!(!text.contains("null") && !text.contains("{}"), "host {}: {text}", spec.name);
            let back: HostSnapshot = serde_json::from_str(&text).unwrap();
            assert_eq!(back, snap, "host {}", spec.name);
        }
    }
}
