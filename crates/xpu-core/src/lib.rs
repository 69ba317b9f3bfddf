//! Domain types of xpu, shared by every other crate. No I/O happens here: values are parsed and
//! validated at the edge (sysfs, CLI flags, manifests) and then travel as these types.
//!
//! - [`pci`]: PCI addresses (`dddd:bb:dd.f`), vendor/device ids, class codes.
//! - [`accel`]: accelerator kinds, the generation table (A100, H100, TPU v5p, MI300X, Gaudi...)
//!   and the classification rule that turns a PCI function into a [`accel::DeviceKind`].
//! - [`inventory`]: the [`inventory::Inventory`] that `xpu-host::discover` produces and every
//!   downstream consumer reads.
//! - [`driver`]: driver capabilities and the driver files (libraries, tools) a container needs.
//! - [`tpu`]: TPU slice topology math (`2x2x4` → chips and hosts).
//! - [`kernel`]: the kernel side effects (`driver_override`, `unbind`, `drivers_probe`,
//!   `modprobe`) as values, and the [`kernel::Kernel`] trait they go through.
//! - [`nova`]: OpenStack Nova `[pci]` device specs, aliases, flavor PCI requests and the
//!   `PciPassthroughFilter` pool fit check.
//! - [`yaml`]: the bounded YAML loader every reader of outside YAML goes through.
//! - [`job`]: job manifests (Kubernetes Jobs and Pods, xpu's short form) parsed and validated
//!   into a `JobSpec`; [`affinity`]: their required node and pod (anti-)affinity, evaluated on
//!   one node; [`expand`]: `$(VAR)` expansion within the kernel's limits.

pub mod accel;
pub mod affinity;
pub mod driver;
pub mod error;
pub mod expand;
pub mod inventory;
pub mod job;
mod k8s_fields;
pub mod kernel;
pub mod labels;
pub mod mig;
pub mod nova;
pub mod pci;
pub mod tpu;
pub mod yaml;

pub use accel::{Accelerator, DeviceKind};
pub use inventory::{
    DevNode, HostInfo, Inventory, Link, Partition, Partitioning, PciDevice, Sriov, SriovType,
};
pub use pci::{PciAddress, PciAddressError};
