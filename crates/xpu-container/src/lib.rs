//! Accelerators in containers, for all three vendors: the Container Device Interface specs
//! engines read from `/etc/cdi`, and, for engines that call an OCI runtime, a shim in front of
//! runc (`xpu-container-runtime`) and an OCI hook that inject devices on request.
//!
//! - [`cdi`]: CDI kinds and device names (`nvidia.com/gpu=0`), spec generation.
//! - [`request`]: what a container asks for (`NVIDIA_VISIBLE_DEVICES`, `XPU_VISIBLE_DEVICES`,
//!   CDI annotations), resolved against the host's inventory.
//! - [`require`]: `NVIDIA_REQUIRE_*` constraints; [`nvml`]: the NVML facts they need.
//! - [`edits`]: the device nodes, mounts and environment a selection means.
//! - [`oci`]: editing `config.json`; [`rootfs`]: symlink-safe paths in the container rootfs.
//! - [`shim`]: the runtime shim; [`hook`]: the hook; [`config`]: their settings file.
//! - [`snapshot`]: the host's accelerators as `xpu cdi generate` last saw them, which the shim
//!   reads instead of discovering while it is current.
//!
//! This crate never reads the host itself: callers pass the [`xpu_core::Inventory`] and
//! [`xpu_core::driver::DriverFiles`] that `xpu-host` read (see [`shim::Host`]).

pub mod cdi;
pub mod config;
pub mod edits;
pub mod fsutil;
pub mod hook;
pub mod nvml;
pub mod oci;
pub mod request;
pub mod require;
pub mod rootfs;
pub mod shim;
pub mod snapshot;
