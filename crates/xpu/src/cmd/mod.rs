//! One module per subcommand: clap arguments and a `run` that calls the library and prints.

pub mod cdi;
pub mod discover;
pub mod doctor;
pub mod exporter;
pub mod format;
pub mod generate;
pub mod hook;
pub mod host;
pub mod k8s;
pub mod openstack;
pub mod runtime;
pub mod server;
pub mod sim;
pub mod vfio;

/// NVIDIA MPS for GPU shares, the same two flags wherever shares are served (`xpu serve`, the
/// device plugin with `--share`, the DRA driver): each share is a client of its GPU's MPS
/// control daemon, limited to its share (`xpu_host::mps`).
/// Reading MIG state (`xpu discover --mig`, `xpu exporter --mig`) through `nvidia-smi mig`.
#[derive(Debug, clap::Args)]
pub struct MigReadArgs {
    /// Also read each NVIDIA GPU's MIG mode and MIG instances through `nvidia-smi mig`.
    #[arg(long)]
    pub mig: bool,
    /// The nvidia-smi --mig reads with (absolute, or on PATH).
    #[arg(long, value_name = "PATH", default_value = "nvidia-smi", requires = "mig")]
    pub nvidia_smi: std::path::PathBuf,
    /// The DRA driver's ledger of the instances it made (DIR/xpu.dev/mig-instances.json under
    /// its --plugin-dir), so that those are told apart from the admin's.
    #[arg(
        long,
        value_name = "FILE",
        requires = "mig",
        default_value = "/var/lib/kubelet/plugins/xpu.dev/mig-instances.json"
    )]
    pub mig_ledger: std::path::PathBuf,
    /// Tests only: MIG state from a fake NVML's JSON state FILE.
    #[arg(long, value_name = "FILE", hide = true, requires = "mig")]
    pub fake_mig: Option<std::path::PathBuf>,
}

impl MigReadArgs {
    /// The MIG control asked for; `None` without --mig.
    pub fn control(
        &self,
    ) -> Result<Option<std::sync::Arc<dyn xpu_telemetry::mig::MigControl>>, crate::output::CliError>
    {
        Ok(match &self.fake_mig {
            _ if !self.mig => None,
            Some(f) => Some(std::sync::Arc::new(
                xpu_telemetry::mig::FakeMig::open(f).map_err(crate::output::CliError::input)?,
            )),
            None => Some(std::sync::Arc::new(xpu_telemetry::mig::smi::SmiMig::new(
                self.nvidia_smi.clone(),
                self.mig_ledger.clone(),
            ))),
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct MpsArgs {
    /// Serve GPU shares through NVIDIA MPS: one control daemon per GPU, its pipe and log
    /// directories under DIR/<gpu uuid>/, started with the GPU's first share (again if it
    /// died) and each share limited to its part (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
    /// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT), whatever CUDA_MPS_* the workload sets. Absolute path.
    #[arg(long, value_name = "DIR")]
    pub mps_dir: Option<std::path::PathBuf>,
    /// The MPS control binary.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "nvidia-cuda-mps-control",
        requires = "mps_dir"
    )]
    pub mps_control: std::path::PathBuf,
}
