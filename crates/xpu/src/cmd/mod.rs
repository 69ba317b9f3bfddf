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
