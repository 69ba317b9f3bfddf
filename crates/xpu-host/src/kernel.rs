//! The real [`Kernel`]: writes sysfs files under a [`Root`] and runs `modprobe`.
//!
//! This is the one place xpu changes kernel state and the one place it runs `modprobe`; every
//! operation's shell form is appended to [`SysfsKernel::log`] before it runs, so the CLI can show
//! the exact command lines at debug level (`XPU_LOG=debug`).
//!
//! Under a fixture root (`--root DIR`) the writes land in plain files and nothing reacts; callers
//! verify every step by reading the `driver` link back, so such a run fails cleanly and rolls
//! back. Modules cannot be loaded into a fixture: `modprobe` under a non-host root succeeds only
//! when the module is already present there (`ROOT/sys/module/<name>`).

use std::io::Write as _;
use std::process::Command;

use xpu_core::kernel::{Kernel, KernelError, KernelOp, module_name};

use crate::Root;
use crate::root::PathError;

/// Writes to sysfs under its root.
#[derive(Debug)]
pub struct SysfsKernel {
    root: Root,
    log: Vec<String>,
}

impl SysfsKernel {
    pub fn new(root: Root) -> Self {
        Self { root, log: Vec::new() }
    }

    /// The operations attempted so far, in their shell form, in order.
    pub fn log(&self) -> &[String] {
        &self.log
    }

    fn write(&self, op: &KernelOp, path: &str) -> Result<(), KernelError> {
        // sysfs attributes exist before they are written; never create one (a typo in a driver
        // name must fail, not leave a stray file behind). Resolved inside the root: sysfs's own
        // links (`devices/<addr>`, `driver`) are relative and stay in it.
        let mut f = self.root.open_write(path).map_err(|e| {
            let why = match e {
                PathError::Io { source, .. } => format!("cannot open {path}: {source}"),
                other => other.to_string(),
            };
            KernelError::new(op, why)
        })?;
        // One write(2) call: sysfs stores take the whole buffer at once.
        f.write_all(op.value().as_bytes())
            .map_err(|e| KernelError::new(op, format!("write to {path}: {e}")))
    }

    fn modprobe(&self, op: &KernelOp, module: &str) -> Result<(), KernelError> {
        let loaded = self.root.path(format!("/sys/module/{}", module_name(module)));
        if loaded.exists() {
            return Ok(());
        }
        if !self.root.is_host() {
            return Err(KernelError::new(
                op,
                format!(
                    "module {module} is not loaded under {} and cannot be loaded into a root \
                     other than /; load it on that host",
                    self.root.base().display()
                ),
            ));
        }
        let out = Command::new("modprobe")
            .arg(module)
            .output()
            .map_err(|e| KernelError::new(op, format!("cannot run modprobe: {e}")))?;
        if out.status.success() {
            Ok(())
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            Err(KernelError::new(
                op,
                format!("modprobe exited with {}: {}", out.status, stderr.trim()),
            ))
        }
    }
}

impl Kernel for SysfsKernel {
    fn apply(&mut self, op: &KernelOp) -> Result<(), KernelError> {
        self.log.push(op.to_string());
        match op {
            KernelOp::Modprobe { module } => self.modprobe(op, module),
            _ => {
                let path = op.path().unwrap_or_default();
                self.write(op, &path)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_existing_attributes_and_refuses_to_create_new_ones() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("sys/bus/pci/devices/0000:25:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("driver_override"), "(null)\n").unwrap();
        let mut k = SysfsKernel::new(Root::new(dir.path()).unwrap());
        let addr = "0000:25:00.0".parse().unwrap();
        k.apply(&KernelOp::DriverOverride { device: addr, driver: Some("vfio-pci".into()) })
            .unwrap();
        assert_eq!(std::fs::read_to_string(dev.join("driver_override")).unwrap(), "vfio-pci\n");
        let e = k.apply(&KernelOp::Unbind { device: addr, driver: "nvidia".into() }).unwrap_err();
        assert!(e.to_string().contains("/sys/bus/pci/drivers/nvidia/unbind"), "{e}");
        assert!(!dir.path().join("sys/bus/pci/drivers/nvidia").exists());
        let e = k.apply(&KernelOp::Modprobe { module: "vfio-pci".into() }).unwrap_err();
        assert!(e.to_string().contains("cannot be loaded into a root other than /"), "{e}");
        assert_eq!(k.log().len(), 3);
    }
}
