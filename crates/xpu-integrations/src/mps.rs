//! GPU shares served through NVIDIA MPS: one MPS control daemon per GPU, started by the device
//! plugin when the first share of that GPU is allocated, in its own pipe and log directories
//! (`<dir>/<gpu uuid>/pipe`, `<dir>/<gpu uuid>/log`), and each share given to its container
//! as a CDI device of kind `xpu.dev/mps`, named by GPU and share
//! (`GPU-…-m500`): the pipe directory mounted at [`CONTAINER_PIPE_DIR`],
//! `CUDA_MPS_PIPE_DIRECTORY`, and the share's limits, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (the
//! share in percent, rounded up) and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (that part of the GPU's
//! memory, for device 0: the container sees one GPU).
//!
//! The limits come from the share the scheduler signed for the pod, never from the workload:
//! CDI edits are applied by the runtime after the container's own environment, so a pod that
//! sets `CUDA_MPS_*` itself gets these values. What MPS itself enforces is the client
//! runtime's: a process inside the container that rewrites its own environment before CUDA
//! starts is not held (the daemon's per-server defaults are not set per client); see
//! docs/scheduler.md.
//!
//! The daemon is the `nvidia-cuda-mps-control` binary the operator names (`-d` starts it, as
//! a daemon; `quit` on its standard input stops it); tests give a fake one. Each spec file
//! (one per GPU, `xpu.dev-mps_<uuid>.json`) depends only on the GPU and the shares given so far,
//! so it is written again, atomically, whenever a new share size appears, and never removed
//! while the plugin runs.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use xpu_container::cdi::{self, ContainerEdits, Device, Mount, Spec};

/// The CDI kind of MPS shares.
pub const CDI_KIND: &str = "xpu.dev/mps";
/// Where a container finds the MPS pipe directory.
pub const CONTAINER_PIPE_DIR: &str = "/var/run/xpu-mps";

/// Where MPS lives on the host.
#[derive(Debug, Clone)]
pub struct MpsOptions {
    /// Daemons' pipe and log directories go under it, one directory per GPU.
    pub dir: PathBuf,
    /// The `nvidia-cuda-mps-control` binary.
    pub control: PathBuf,
    /// Where the `xpu.dev/mps` CDI specs are written (the runtime's CDI directory).
    pub cdi_dir: PathBuf,
}

/// A share's MPS limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, 1..=100.
    pub thread_percent: u16,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in MiB; `None` when the GPU's memory is unknown.
    pub memory_mib: Option<u64>,
}

impl Limits {
    /// The limits of `milli` thousandths of a GPU with `memory_mib` of memory.
    pub fn of(milli: u16, memory_mib: Option<u64>) -> Limits {
        let milli = milli.clamp(1, 1000);
        Limits {
            thread_percent: milli.div_ceil(10),
            memory_mib: memory_mib.map(|m| m * u64::from(milli) / 1000),
        }
    }
}

/// The MPS daemons and CDI specs of one device plugin.
#[derive(Debug)]
pub struct Mps {
    opts: MpsOptions,
    /// Per GPU UUID: the share sizes (milli) whose CDI devices exist.
    state: Mutex<BTreeMap<String, BTreeSet<u16>>>,
}

impl Mps {
    pub fn new(opts: MpsOptions) -> Mps {
        Mps { opts, state: Mutex::new(BTreeMap::new()) }
    }

    fn gpu_dir(&self, uuid: &str) -> PathBuf {
        self.opts.dir.join(uuid)
    }

    fn command(&self, uuid: &str) -> Command {
        let dir = self.gpu_dir(uuid);
        let mut c = Command::new(&self.opts.control);
        c.env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CUDA_VISIBLE_DEVICES", uuid)
            .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
            .env("CUDA_MPS_LOG_DIRECTORY", dir.join("log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    /// The CDI device (qualified name) for a share of `milli` of the GPU `uuid`, starting the
    /// GPU's daemon and writing its spec first when needed.
    pub fn share(&self, uuid: &str, milli: u16, memory_mib: Option<u64>) -> Result<String, String> {
        if cdi::device_name_problem(uuid).is_some() || uuid.contains('/') || uuid.starts_with('.') {
            return Err(format!("GPU UUID {uuid:?} cannot name an MPS directory or CDI device"));
        }
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !state.contains_key(uuid) {
            self.start(uuid)?;
            state.insert(uuid.to_owned(), BTreeSet::new());
        }
        let sizes = state.entry(uuid.to_owned()).or_default();
        if sizes.insert(milli) {
            let spec = self.spec(uuid, sizes, memory_mib);
            let path = self.opts.cdi_dir.join(format!("xpu.dev-mps_{uuid}.json"));
            let written = std::fs::create_dir_all(&self.opts.cdi_dir).and_then(|()| {
                xpu_container::fsutil::write_replace(
                    &path,
                    cdi::to_json(&spec).as_bytes(),
                    0o644,
                    false,
                )
            });
            if let Err(e) = written {
                sizes.remove(&milli);
                return Err(format!("writing MPS CDI spec {}: {e}", path.display()));
            }
        }
        Ok(format!("{CDI_KIND}={}", device_name(uuid, milli)))
    }

    fn spec(&self, uuid: &str, sizes: &BTreeSet<u16>, memory_mib: Option<u64>) -> Spec {
        let pipe = self.gpu_dir(uuid).join("pipe");
        let devices = sizes
            .iter()
            .map(|&milli| {
                let l = Limits::of(milli, memory_mib);
                let mut env = vec![
                    format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}"),
                    format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={}", l.thread_percent),
                ];
                if let Some(m) = l.memory_mib {
                    env.push(format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={m}M"));
                }
                Device {
                    name: device_name(uuid, milli),
                    container_edits: ContainerEdits {
                        env,
                        device_nodes: Vec::new(),
                        mounts: vec![Mount {
                            host_path: pipe.to_string_lossy().into_owned(),
                            container_path: CONTAINER_PIPE_DIR.to_owned(),
                            options: ["rbind", "rw", "nosuid", "nodev"].map(str::to_owned).to_vec(),
                        }],
                    },
                }
            })
            .collect();
        Spec {
            cdi_version: cdi::CDI_VERSION.to_owned(),
            kind: CDI_KIND.to_owned(),
            devices,
            container_edits: ContainerEdits::default(),
        }
    }

    /// Starts the GPU's control daemon (`-d`), in fresh pipe and log directories.
    fn start(&self, uuid: &str) -> Result<(), String> {
        let dir = self.gpu_dir(uuid);
        for d in ["pipe", "log"] {
            std::fs::create_dir_all(dir.join(d))
                .map_err(|e| format!("creating {}: {e}", dir.join(d).display()))?;
        }
        let out = self.command(uuid).arg("-d").output().map_err(|e| {
            format!("starting the MPS control daemon {}: {e}", self.opts.control.display())
        })?;
        if !out.status.success() {
            return Err(format!(
                "the MPS control daemon for {uuid} did not start ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        tracing::info!(gpu = uuid, pipe = %dir.join("pipe").display(), "MPS control daemon started");
        Ok(())
    }

    /// Stops every daemon this plugin started (`quit` on the control's standard input).
    pub fn stop_all(&self) {
        let state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for uuid in state.keys() {
            if let Err(e) = self.quit(uuid) {
                tracing::warn!(gpu = %uuid, error = %e, "MPS control daemon not stopped");
            }
        }
    }

    fn quit(&self, uuid: &str) -> Result<(), String> {
        let mut child = self
            .command(uuid)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", self.opts.control.display()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(b"quit\n").map_err(|e| e.to_string())?;
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        if status.success() { Ok(()) } else { Err(format!("quit: {status}")) }
    }
}

/// The CDI device name of a share: `<uuid>-m<milli>`.
pub fn device_name(uuid: &str, milli: u16) -> String {
    format!("{uuid}-m{milli}")
}

/// The MPS options' directories must be absolute: they go into CDI specs.
pub fn check(opts: &MpsOptions) -> Result<(), String> {
    for (what, p) in [("--mps-dir", &opts.dir), ("--cdi-dir", &opts.cdi_dir)] {
        if !Path::new(p).is_absolute() {
            return Err(format!("{what} {} must be an absolute path", p.display()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_the_share_rounded_up() {
        assert_eq!(
            Limits::of(500, Some(40960)),
            Limits { thread_percent: 50, memory_mib: Some(20480) }
        );
        assert_eq!(Limits::of(1, None).thread_percent, 1);
        assert_eq!(Limits::of(333, Some(81920)).thread_percent, 34);
        assert_eq!(Limits::of(5000, Some(100)).memory_mib, Some(100));
    }

    #[test]
    fn a_share_starts_the_gpus_daemon_once_and_names_a_device_of_the_spec() {
        let dir = tempfile::tempdir().unwrap();
        let control = dir.path().join("control.sh");
        let calls = dir.path().join("calls");
        std::fs::write(
            &control,
            format!(
                "#!/bin/sh\necho \"$* $CUDA_VISIBLE_DEVICES $CUDA_MPS_PIPE_DIRECTORY\" >> {}\n",
                calls.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&control, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let opts =
            MpsOptions { dir: dir.path().join("mps"), control, cdi_dir: dir.path().join("cdi") };
        let mps = Mps::new(opts);
        let uuid = "GPU-5eed0000-a100-4000-8000-000000000000";
        assert_eq!(mps.share(uuid, 500, Some(40960)).unwrap(), format!("xpu.dev/mps={uuid}-m500"));
        assert_eq!(mps.share(uuid, 250, Some(40960)).unwrap(), format!("xpu.dev/mps={uuid}-m250"));
        let started = std::fs::read_to_string(&calls).unwrap();
        assert_eq!(started.lines().count(), 1, "{started}");
        assert!(started.starts_with(&format!("-d {uuid} ")), "{started}");
        let spec: Spec = serde_json::from_slice(
            &std::fs::read(dir.path().join(format!("cdi/xpu.dev-mps_{uuid}.json"))).unwrap(),
        )
        .unwrap();
        assert_eq!(spec.devices.len(), 2);
        let quarter = spec.devices.iter().find(|d| d.name.ends_with("-m250")).unwrap();
        assert!(
            quarter
                .container_edits
                .env
                .contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25".to_owned())
        );
        assert!(
            quarter
                .container_edits
                .env
                .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".to_owned())
        );
        mps.stop_all();
        assert!(std::fs::read_to_string(&calls).unwrap().lines().count() == 2);
        assert!(mps.share("../x", 500, None).is_err());
    }
}
