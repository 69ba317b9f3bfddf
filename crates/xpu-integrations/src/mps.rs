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
//! The daemons are `xpu_host::mps::Daemons`: the `nvidia-cuda-mps-control` binary the operator
//! names, started again at the next allocation when one died; tests give a fake one. Each spec file
//! (one per GPU, `xpu.dev-mps_<uuid>.json`) depends only on the GPU and the shares given so far,
//! so it is written again, atomically, whenever a new share size appears, and never removed
//! while the plugin runs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use xpu_host::mps::Daemons;

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

pub use xpu_host::mps::Limits;

/// The MPS daemons and CDI specs of one device plugin.
#[derive(Debug)]
pub struct Mps {
    opts: MpsOptions,
    daemons: Daemons,
    /// Per GPU UUID: the share sizes (milli) whose CDI devices exist.
    state: Mutex<BTreeMap<String, BTreeSet<u16>>>,
}

impl Mps {
    pub fn new(opts: MpsOptions) -> Result<Mps, String> {
        check(&opts)?;
        let daemons = Daemons::new(opts.dir.clone(), opts.control.clone())?;
        Ok(Mps { opts, daemons, state: Mutex::new(BTreeMap::new()) })
    }

    /// The CDI device (qualified name) for a share of `milli` of the GPU `uuid`, starting the
    /// GPU's daemon and writing its spec first when needed.
    pub fn share(&self, uuid: &str, milli: u16, memory_mib: Option<u64>) -> Result<String, String> {
        if cdi::device_name_problem(uuid).is_some() || uuid.contains('/') || uuid.starts_with('.') {
            return Err(format!("GPU UUID {uuid:?} cannot name an MPS directory or CDI device"));
        }
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.daemons.ensure(uuid)? {
            tracing::info!(gpu = uuid, pipe = %self.daemons.pipe_dir(uuid).display(), "MPS control daemon started");
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
        let pipe = self.daemons.pipe_dir(uuid);
        let devices = sizes
            .iter()
            .map(|&milli| {
                let env = Limits::of(milli, memory_mib)
                    .env(CONTAINER_PIPE_DIR)
                    .into_iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
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

    /// Stops every daemon this plugin started (`quit` on the control's standard input).
    pub fn stop_all(&self) {
        let started: Vec<String> = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        for e in self.daemons.stop_all(started.iter().map(String::as_str)) {
            tracing::warn!(error = %e, "MPS control daemon not stopped");
        }
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
    fn a_share_starts_the_gpus_daemon_once_and_names_a_device_of_the_spec() {
        let dir = tempfile::tempdir().unwrap();
        let control = xpu_testkit::mps::fake_control(dir.path());
        let opts =
            MpsOptions { dir: dir.path().join("mps"), control, cdi_dir: dir.path().join("cdi") };
        let mps = Mps::new(opts).unwrap();
        let uuid = "GPU-5eed0000-a100-4000-8000-000000000000";
        assert_eq!(mps.share(uuid, 500, Some(40960)).unwrap(), format!("xpu.dev/mps={uuid}-m500"));
        assert_eq!(mps.share(uuid, 250, Some(40960)).unwrap(), format!("xpu.dev/mps={uuid}-m250"));
        assert_eq!(xpu_testkit::mps::calls(dir.path()), format!("start {uuid}\n"));
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
        assert_eq!(xpu_testkit::mps::calls(dir.path()), format!("start {uuid}\nquit {uuid}\n"));
        assert!(mps.share("../x", 500, None).is_err());
    }
}
