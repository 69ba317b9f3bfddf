//! Node labels from an [`Inventory`]: the keys Node Feature Discovery's PCI source would publish
//! with its default configuration, plus xpu's own accelerator summary.
//!
//! NFD (`source/pci`): for devices whose class starts with one of `deviceClassWhitelist`
//! (default `03`, `0b40`, `12`) it publishes `feature.node.kubernetes.io/pci-<label>.present`,
//! where `<label>` joins `deviceLabelFields` (default `class`, `vendor`) with `_`, and
//! `pci-<label>.sriov.capable` for devices that can create VFs. xpu adds
//! `xpu.dev/<kind>.count`, `.product` and `.generation` for each accelerator kind, and the
//! labels NVIDIA's, AMD's and Intel's own labellers write ([`vendor`]), so a node moved to xpu
//! keeps matching the manifests written for those.

use std::collections::BTreeMap;

use crate::accel::DeviceKind;
use crate::inventory::Inventory;

pub mod vendor;

/// NFD's default `deviceClassWhitelist`.
pub const NFD_CLASS_WHITELIST: [&str; 3] = ["03", "0b40", "12"];
pub const NFD_PREFIX: &str = "feature.node.kubernetes.io";
pub const XPU_PREFIX: &str = "xpu.dev";

/// All labels, sorted by key.
pub fn labels(inv: &Inventory) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for d in &inv.devices {
        let (Some(class), Some(vendor)) = (d.class, d.vendor_id) else { continue };
        let class = format!("{class:04x}");
        if !NFD_CLASS_WHITELIST.iter().any(|p| class.starts_with(p)) {
            continue;
        }
        let label = format!("{class}_{vendor:04x}");
        out.insert(format!("{NFD_PREFIX}/pci-{label}.present"), "true".to_owned());
        if d.sriov.total_vfs.is_some_and(|n| n > 0) {
            out.insert(format!("{NFD_PREFIX}/pci-{label}.sriov.capable"), "true".to_owned());
        }
    }
    for kind in DeviceKind::ALL.into_iter().filter(|k| k.is_accelerator()) {
        let devs: Vec<_> = inv.of_kind(kind).collect();
        if devs.is_empty() {
            continue;
        }
        out.insert(format!("{XPU_PREFIX}/{kind}.count"), devs.len().to_string());
        let product = most_common(devs.iter().map(|d| {
            d.product.clone().unwrap_or_else(|| {
                format!("{:04x}-{:04x}", d.vendor_id.unwrap_or(0), d.device_id.unwrap_or(0))
            })
        }));
        if let Some(p) = product {
            out.insert(format!("{XPU_PREFIX}/{kind}.product"), label_value(&p));
        }
        if let Some(g) = most_common(devs.iter().filter_map(|d| d.generation.clone())) {
            out.insert(format!("{XPU_PREFIX}/{kind}.generation"), label_value(&g));
        }
    }
    vendor::add(inv, &mut out);
    out
}

/// The most frequent value (ties: the smallest), so a host with mixed parts labels its majority.
fn most_common(values: impl Iterator<Item = String>) -> Option<String> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for v in values {
        *counts.entry(v).or_default() += 1;
    }
    let max = counts.values().copied().max()?;
    counts.into_iter().find(|(_, n)| *n == max).map(|(v, _)| v)
}

/// A valid Kubernetes label value: at most 63 characters of `[A-Za-z0-9._-]`, starting and
/// ending alphanumeric.
pub fn label_value(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' })
        .take(63)
        .collect();
    mapped.trim_matches(|c: char| !c.is_ascii_alphanumeric()).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::PciDevice;

    fn dev(addr: &str, vendor: u16, device: u16, class: u16, kind: DeviceKind) -> PciDevice {
        let mut d = PciDevice::new(addr.parse().unwrap());
        d.vendor_id = Some(vendor);
        d.device_id = Some(device);
        d.class = Some(class);
        d.kind = kind;
        d.product = crate::accel::lookup(vendor, device).map(|a| a.product.to_owned());
        d.generation = crate::accel::lookup(vendor, device).map(|a| a.generation.to_owned());
        d
    }

    #[test]
    fn nfd_and_xpu_keys() {
        let mut pf = dev("0000:41:00.0", 0x10de, 0x20b0, 0x0302, DeviceKind::Gpu);
        pf.sriov.total_vfs = Some(16);
        let inv = Inventory {
            devices: vec![
                pf,
                dev("0000:42:00.0", 0x10de, 0x20b0, 0x0302, DeviceKind::Gpu),
                dev("0000:b7:00.0", 0x10de, 0x1af1, 0x0680, DeviceKind::Nvswitch),
                dev("0000:0c:00.0", 0x15b3, 0x101b, 0x0207, DeviceKind::Other),
                dev("0000:00:04.0", 0x1ae0, 0x0062, 0x1200, DeviceKind::Tpu),
            ],
            ..Default::default()
        };
        let l = labels(&inv);
        assert_eq!(l["feature.node.kubernetes.io/pci-0302_10de.present"], "true");
        assert_eq!(l["feature.node.kubernetes.io/pci-0302_10de.sriov.capable"], "true");
        assert_eq!(l["feature.node.kubernetes.io/pci-1200_1ae0.present"], "true");
        assert!(!l.contains_key("feature.node.kubernetes.io/pci-0680_10de.present"));
        assert!(!l.keys().any(|k| k.contains("15b3")));
        assert_eq!(l["xpu.dev/gpu.count"], "2");
        assert_eq!(l["xpu.dev/gpu.product"], "A100-SXM4-40GB");
        assert_eq!(l["xpu.dev/gpu.generation"], "ampere");
        assert_eq!(l["xpu.dev/nvswitch.count"], "1");
        assert_eq!(l["xpu.dev/tpu.generation"], "v5p");
    }

    #[test]
    fn label_values_are_valid() {
        assert_eq!(label_value("GA100 [A100 SXM4 40GB]"), "GA100--A100-SXM4-40GB");
        assert_eq!(label_value(&"x".repeat(80)).len(), 63);
    }
}
