//! Reading (and, in later modules, changing) a host. Every function takes a [`Root`]: `/` in
//! production, a fixture tree in tests, so both run the same code path.
//!
//! - [`root`]: the path prefix everything is read under.
//! - [`discover`]: PCI functions from sysfs into an [`xpu_core::Inventory`].
//! - [`pciids`]: vendor/device/class names from the PCI ID database, offline.
//! - [`modalias`]: which kernel modules claim a device (`modules.alias`).
//! - [`devnode`]: `stat` of `/dev` nodes (type, major, minor, mode).
//! - [`driver_files`]: the driver libraries and tools a container needs (`libcuda`, `nvidia-smi`).
//! - [`amdgpu`]: an AMD GPU's load, memory, power, temperature, clocks and RAS counts from
//!   sysfs and hwmon (for `xpu-telemetry`).
//! - [`profile`]: host profiles (vfio-host, tpu-vm, container-host) and what each wants.
//! - [`doctor`]: readiness checks (`xpu doctor`), with [`cgroups`] and [`limits`] readers.
//! - [`provision`]: the files that make a host ready, rendered, as cloud-init, or applied with
//!   backups and a diff ([`textdiff`]); [`grub`] merges kernel parameters.
//! - [`vfio`]: binding devices to `vfio-pci` and back through [`kernel::SysfsKernel`].
//! - [`metadata_env`]: `tpu-env` metadata to a shell-safe environment file.

pub mod amdgpu;
pub mod cgroups;
pub mod devnode;
pub mod discover;
pub mod doctor;
pub mod driver_files;
pub mod grub;
pub mod kernel;
pub mod limits;
pub mod metadata_env;
pub mod mig_caps;
pub mod modalias;
pub mod mps;
pub mod pciids;
pub mod profile;
pub mod provision;
pub mod root;
pub mod textdiff;
pub mod vfio;
pub mod vm_devices;

pub use discover::{
    DiscoverError, DiscoverOptions, Scope, Wanted, discover, discover_nodes, host_key,
};
pub use root::{Root, RootError};
