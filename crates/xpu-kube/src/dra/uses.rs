//! Which use holds each PCI function of a node now, and since when, for `xpu vfio status`: a
//! DRA claim prepared on the node (from the driver's checkpoint: a VM's when the function is on
//! `vfio-pci`, a container's otherwise), the list of devices kept for Nova
//! ([`xpu_host::vm_devices`]), xpu's own `vfio bind` (its state file), or the host's driver.

use serde::Serialize;
use xpu_core::Inventory;
use xpu_host::Root;
use xpu_host::vfio::{self, DeviceStatus};
use xpu_host::vm_devices;

use super::plugin::Checkpoint;

/// Where `xpu k8s dra-driver` keeps its checkpoint with the default `--plugin-dir`.
pub const DRA_CHECKPOINT: &str = "/var/lib/kubelet/plugins/xpu.dev/checkpoint.json";

/// A device's status with the use that holds it.
#[derive(Debug, Serialize)]
pub struct DeviceUse {
    #[serde(flatten)]
    pub status: DeviceStatus,
    /// `vm: claim ns/name`, `container: claim ns/name`, `nova: ...`, `vfio-pci: ...`,
    /// `host: <driver>` or `free`.
    pub held_by: String,
    /// RFC 3339, when known.
    pub since: Option<String>,
}

fn rfc3339(unix: u64) -> Option<String> {
    let t = k8s_openapi::jiff::Timestamp::from_second(i64::try_from(unix).ok()?).ok()?;
    Some(t.to_string())
}

/// The use holding each device of `list`; `checkpoint` is the DRA driver's (a host path under
/// `root`; none there: no claim holds anything). `Err` names the file that does not read.
pub fn uses(
    root: &Root,
    inv: &Inventory,
    list: Vec<DeviceStatus>,
    checkpoint: &str,
) -> Result<Vec<DeviceUse>, String> {
    let cp: Checkpoint = match root.read_file(checkpoint) {
        Ok(Some(f)) => serde_json::from_slice(&f.bytes)
            .map_err(|e| format!("{checkpoint}: {e}; pass --dra-checkpoint FILE"))?,
        Ok(None) => Checkpoint::default(),
        Err(e) => return Err(format!("{e}; pass --dra-checkpoint FILE")),
    };
    let kept = vm_devices::read(root, vm_devices::VM_DEVICES)
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    let holders = cp.holders(inv, "");
    Ok(list
        .into_iter()
        .map(|status| {
            let a = status.address;
            let on_vfio = status.driver.as_deref() == Some(vfio::VFIO_DRIVER);
            let (held_by, since) = match holders.get(&a) {
                Some((_, p)) => {
                    let use_ = if on_vfio { "vm" } else { "container" };
                    (format!("{use_}: claim {}/{}", p.namespace, p.name), p.since.clone())
                }
                None => {
                    let (by, since) = vfio::held_by(&status, &kept);
                    (by, since.and_then(rfc3339))
                }
            };
            DeviceUse { status, held_by, since }
        })
        .collect())
}
