//! The kernel side effects xpu makes, as values, and the one trait they go through.
//!
//! Binding a device to `vfio-pci` is a short conversation with the kernel's PCI core through
//! sysfs (Documentation/ABI/testing/sysfs-bus-pci): write the driver name to the device's
//! `driver_override`, write its address to the old driver's `unbind`, write its address to
//! `/sys/bus/pci/drivers_probe`, and load `vfio-pci` with `modprobe` if it is not loaded. Each
//! step is a [`KernelOp`]; [`Kernel`] carries them out. Production (`xpu-host`'s sysfs kernel)
//! writes the files and runs `modprobe`; tests use a fake (in `xpu-testkit`) that models the
//! kernel's reaction on a fixture tree and records every operation, so the bind/unbind/rollback
//! logic runs unchanged against both.
//!
//! This module owns only the vocabulary; reading device state back (the `driver` link) is the
//! caller's business, under its `Root`.

use std::fmt;

use crate::pci::PciAddress;

/// One side effect on the kernel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KernelOp {
    /// Write `driver` (or, for `None`, an empty line, which clears it) to
    /// `/sys/bus/pci/devices/<device>/driver_override`. Only the named driver may bind the device
    /// afterwards; nothing is unbound or probed by the write itself.
    DriverOverride { device: PciAddress, driver: Option<String> },
    /// Write the address to `/sys/bus/pci/drivers/<driver>/unbind`.
    Unbind { device: PciAddress, driver: String },
    /// Write the address to `/sys/bus/pci/drivers_probe`: the PCI core offers the device to
    /// drivers again (only the `driver_override` one, when set).
    Probe { device: PciAddress },
    /// `modprobe <module>`.
    Modprobe { module: String },
}

impl KernelOp {
    /// The sysfs file the operation writes (host path), or `None` for `modprobe`.
    pub fn path(&self) -> Option<String> {
        match self {
            KernelOp::DriverOverride { device, .. } => {
                Some(format!("/sys/bus/pci/devices/{device}/driver_override"))
            }
            KernelOp::Unbind { device: _, driver } => {
                Some(format!("/sys/bus/pci/drivers/{driver}/unbind"))
            }
            KernelOp::Probe { .. } => Some("/sys/bus/pci/drivers_probe".to_owned()),
            KernelOp::Modprobe { .. } => None,
        }
    }

    /// What is written to [`KernelOp::path`] (with the trailing newline `echo` would add).
    pub fn value(&self) -> String {
        match self {
            KernelOp::DriverOverride { driver, .. } => {
                format!("{}\n", driver.as_deref().unwrap_or(""))
            }
            KernelOp::Unbind { device, .. } | KernelOp::Probe { device } => format!("{device}\n"),
            KernelOp::Modprobe { module } => module.clone(),
        }
    }

    /// The device the operation is about, if any.
    pub fn device(&self) -> Option<PciAddress> {
        match self {
            KernelOp::DriverOverride { device, .. }
            | KernelOp::Unbind { device, .. }
            | KernelOp::Probe { device } => Some(*device),
            KernelOp::Modprobe { .. } => None,
        }
    }
}

/// The shell equivalent, for dry runs and logs: `echo vfio-pci > /sys/.../driver_override`.
impl fmt::Display for KernelOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelOp::Modprobe { module } => write!(f, "modprobe {module}"),
            KernelOp::DriverOverride { driver: None, device } => {
                write!(f, "echo > /sys/bus/pci/devices/{device}/driver_override")
            }
            op => {
                let value = op.value();
                let path = op.path().unwrap_or_default();
                write!(f, "echo {} > {path}", value.trim_end())
            }
        }
    }
}

/// A kernel operation that did not take effect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op} failed: {reason}")]
pub struct KernelError {
    /// The operation, in its shell form.
    pub op: String,
    pub reason: String,
}

impl KernelError {
    pub fn new(op: &KernelOp, reason: impl Into<String>) -> Self {
        Self { op: op.to_string(), reason: reason.into() }
    }
}

/// Carries out kernel operations. Implementations must perform exactly the one operation asked
/// (no retries, no extra writes) so callers can reason about partial failure and roll back.
pub trait Kernel {
    fn apply(&mut self, op: &KernelOp) -> Result<(), KernelError>;
}

impl<K: Kernel + ?Sized> Kernel for &mut K {
    fn apply(&mut self, op: &KernelOp) -> Result<(), KernelError> {
        (**self).apply(op)
    }
}

/// Normalises a module or driver name the way the kernel does for module names: `vfio-pci`
/// and `vfio_pci` are the same module (`/sys/module/vfio_pci`).
pub fn module_name(name: &str) -> String {
    name.replace('-', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_render_as_the_shell_commands_they_replace() {
        let dev: PciAddress = "0000:25:00.0".parse().unwrap();
        let ops = [
            KernelOp::DriverOverride { device: dev, driver: Some("vfio-pci".into()) },
            KernelOp::Unbind { device: dev, driver: "nvidia".into() },
            KernelOp::Probe { device: dev },
            KernelOp::DriverOverride { device: dev, driver: None },
            KernelOp::Modprobe { module: "vfio-pci".into() },
        ];
        let shown: Vec<String> = ops.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "echo vfio-pci > /sys/bus/pci/devices/0000:25:00.0/driver_override",
                "echo 0000:25:00.0 > /sys/bus/pci/drivers/nvidia/unbind",
                "echo 0000:25:00.0 > /sys/bus/pci/drivers_probe",
                "echo > /sys/bus/pci/devices/0000:25:00.0/driver_override",
                "modprobe vfio-pci",
            ]
        );
        assert_eq!(ops[3].value(), "\n");
        assert_eq!(module_name("vfio-pci"), "vfio_pci");
    }
}
