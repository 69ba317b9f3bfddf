//! CDI device names for accelerators, the convention xpu's CDI spec generator follows
//! (container-device-interface `SPEC.md`: a fully qualified name is `vendor.com/class=name`):
//!
//! - kind `nvidia.com/gpu`: NVIDIA GPUs named `0`..`N-1` in PCI address order;
//! - kind `google.com/tpu`: TPU chips `0`..`N-1` in PCI address order;
//! - kind `amd.com/gpu`: AMD GPUs `0`..`N-1` in PCI address order.
//!
//! The kubelet passes these names to the container runtime (`cdi_devices` in the device plugin
//! `Allocate` response), which resolves them against the spec files in `/etc/cdi` or `/var/run/cdi`.

use std::collections::HashMap;

use xpu_core::accel::{VENDOR_AMD, VENDOR_GOOGLE, VENDOR_NVIDIA};
use xpu_core::{DeviceKind, Inventory, PciAddress, PciDevice};

/// The CDI kind of a device, if xpu names it.
pub fn kind(d: &PciDevice) -> Option<&'static str> {
    match (d.vendor_id?, d.kind) {
        (VENDOR_NVIDIA, DeviceKind::Gpu) => Some("nvidia.com/gpu"),
        (VENDOR_GOOGLE, DeviceKind::Tpu) => Some("google.com/tpu"),
        (VENDOR_AMD, DeviceKind::Gpu) => Some("amd.com/gpu"),
        _ => None,
    }
}

/// Fully qualified CDI names (`nvidia.com/gpu=3`) of every named device, by address.
pub fn names(inv: &Inventory) -> HashMap<PciAddress, String> {
    let mut next: HashMap<&'static str, usize> = HashMap::new();
    let mut out = HashMap::new();
    // `Inventory::devices` is sorted by address, which is the naming order.
    for d in &inv.devices {
        if let Some(k) = kind(d) {
            let n = next.entry(k).or_default();
            out.insert(d.address, format!("{k}={n}"));
            *n += 1;
        }
    }
    out
}
