//! The node labels the vendors' own labellers write, with their keys, value spellings and
//! units, so that manifests written for those tools keep matching a node xpu labels:
//!
//! - NVIDIA GPU feature discovery (GFD, and the GPU operator's `nvidia.com/gpu.present`):
//!   `nvidia.com/gpu.count`, `.product` (NVML's device name with spaces as `-`, e.g.
//!   `NVIDIA-H100-80GB-HBM3`), `.memory` (MiB, as NVML reports the total), `.family` (the
//!   architecture GFD names from the compute capability: `turing`, `ampere`, `ada-lovelace`,
//!   `hopper`, `blackwell`), `.compute.major`/`.minor`, `nvidia.com/mig.capable`, and
//!   `nvidia.com/cuda.driver.major`/`.minor`/`.rev` from the loaded driver's version.
//! - AMD's node labeller (`k8s-node-labeller`): `amd.com/gpu.device-id` (hex), `.family` (the
//!   two-letter family: `AI` for the gfx9 Instinct parts), `.product-name` (spaces as `_`,
//!   e.g. `AMD_Instinct_MI300X_OAM`), `.vram` (`192G`), `.cu-count`, `.simd-count`, and the
//!   legacy `beta.amd.com/gpu.<property>.<value>=<GPUs>` form it still writes.
//! - Intel's NFD rules for its GPU plugin: `gpu.intel.com/device-id.<class>-<device>.present`
//!   and `.count` for every Intel GPU, and `gpu.intel.com/family`, `.product` and
//!   `.device.count` for the data-center parts the rules name (Flex 140/170, Max 1100/1550).
//!
//! Facts a sysfs walk cannot read (NVML's name and memory total, compute capability, compute
//! units) come from the table below, per PCI device id; a device the table does not know gets
//! only the labels that need nothing from it (counts, ids, the driver version).

use std::collections::BTreeMap;

use crate::accel::{DeviceKind, VENDOR_AMD, VENDOR_INTEL, VENDOR_NVIDIA};
use crate::inventory::{Inventory, PciDevice};

/// What GFD reads from NVML for one NVIDIA part.
struct Nvidia {
    device_id: u16,
    /// NVML's device name.
    name: &'static str,
    /// NVML's memory total, MiB.
    memory_mib: u32,
    compute: (u8, u8),
    mig: bool,
}

const NVIDIA: &[Nvidia] = &[
    nv(0x20b0, "NVIDIA A100-SXM4-40GB", 40960, (8, 0), true),
    nv(0x20b2, "NVIDIA A100-SXM4-80GB", 81920, (8, 0), true),
    nv(0x20b3, "NVIDIA A100-SXM-64GB", 65536, (8, 0), true),
    nv(0x20b5, "NVIDIA A100 80GB PCIe", 81920, (8, 0), true),
    nv(0x20f1, "NVIDIA A100-PCIE-40GB", 40960, (8, 0), true),
    nv(0x2330, "NVIDIA H100 80GB HBM3", 81559, (9, 0), true),
    nv(0x2331, "NVIDIA H100 PCIe", 81559, (9, 0), true),
    nv(0x2321, "NVIDIA H100 NVL", 95830, (9, 0), true),
    nv(0x2335, "NVIDIA H200", 143771, (9, 0), true),
    nv(0x2901, "NVIDIA B200", 183359, (10, 0), true),
    nv(0x27b8, "NVIDIA L4", 23034, (8, 9), false),
    nv(0x1eb8, "Tesla T4", 15360, (7, 5), false),
];

const fn nv(
    device_id: u16,
    name: &'static str,
    memory_mib: u32,
    compute: (u8, u8),
    mig: bool,
) -> Nvidia {
    Nvidia { device_id, name, memory_mib, compute, mig }
}

/// What AMD's labeller reads for one Instinct part (per GPU the driver exposes: one GCD of an
/// MI250X).
struct Amd {
    device_id: u16,
    product_name: &'static str,
    family: &'static str,
    vram_gib: u32,
    compute_units: u32,
}

const AMD: &[Amd] = &[
    Amd {
        device_id: 0x740f,
        product_name: "AMD Instinct MI210",
        family: "AI",
        vram_gib: 64,
        compute_units: 104,
    },
    Amd {
        device_id: 0x7408,
        product_name: "AMD Instinct MI250X",
        family: "AI",
        vram_gib: 64,
        compute_units: 110,
    },
    Amd {
        device_id: 0x740c,
        product_name: "AMD Instinct MI250X / MI250",
        family: "AI",
        vram_gib: 64,
        compute_units: 110,
    },
    Amd {
        device_id: 0x74a1,
        product_name: "AMD Instinct MI300X OAM",
        family: "AI",
        vram_gib: 192,
        compute_units: 304,
    },
    Amd {
        device_id: 0x74a5,
        product_name: "AMD Instinct MI325 OAM",
        family: "AI",
        vram_gib: 256,
        compute_units: 304,
    },
];

/// Intel data-center GPUs its NFD rules name: device id, family, product.
const INTEL: &[(u16, &str, &str)] = &[
    (0x56c0, "Flex_Series", "Flex_170"),
    (0x56c1, "Flex_Series", "Flex_140"),
    (0x0bd5, "Max_Series", "Max_1550"),
    (0x0bda, "Max_Series", "Max_1100"),
];

/// GFD's architecture family for a compute capability.
fn nvidia_family((major, minor): (u8, u8)) -> &'static str {
    match (major, minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, m) if m < 5 => "volta",
        (7, _) => "turing",
        (8, m) if m < 9 => "ampere",
        (8, _) => "ada-lovelace",
        (9, _) => "hopper",
        (10 | 12, _) => "blackwell",
        _ => "undefined",
    }
}

/// Adds the vendor labellers' labels for the GPUs of `inv`.
pub(super) fn add(inv: &Inventory, out: &mut BTreeMap<String, String>) {
    let gpus: Vec<&PciDevice> = inv.of_kind(DeviceKind::Gpu).collect();
    let of = |vendor: u16| -> Vec<&PciDevice> {
        gpus.iter().copied().filter(|d| d.vendor_id == Some(vendor)).collect()
    };
    nvidia(&of(VENDOR_NVIDIA), inv.host.nvidia_driver_version.as_deref(), out);
    amd(&of(VENDOR_AMD), out);
    intel(&of(VENDOR_INTEL), out);
}

/// The device id most of `devs` have (ties: the smallest).
fn majority(devs: &[&PciDevice]) -> Option<u16> {
    let mut counts: BTreeMap<u16, usize> = BTreeMap::new();
    for d in devs {
        *counts.entry(d.device_id.unwrap_or(0)).or_default() += 1;
    }
    let max = counts.values().copied().max()?;
    counts.into_iter().find(|(_, n)| *n == max).map(|(id, _)| id)
}

fn put(out: &mut BTreeMap<String, String>, key: &str, value: impl ToString) {
    out.insert(key.to_owned(), value.to_string());
}

fn nvidia(devs: &[&PciDevice], driver: Option<&str>, out: &mut BTreeMap<String, String>) {
    let Some(id) = majority(devs) else { return };
    put(out, "nvidia.com/gpu.present", "true");
    put(out, "nvidia.com/gpu.count", devs.len());
    if let Some(n) = NVIDIA.iter().find(|n| n.device_id == id) {
        put(out, "nvidia.com/gpu.product", super::label_value(&n.name.replace(' ', "-")));
        put(out, "nvidia.com/gpu.memory", n.memory_mib);
        put(out, "nvidia.com/gpu.family", nvidia_family(n.compute));
        put(out, "nvidia.com/gpu.compute.major", n.compute.0);
        put(out, "nvidia.com/gpu.compute.minor", n.compute.1);
        put(out, "nvidia.com/mig.capable", n.mig);
    }
    // `550.54.15`: major, minor, revision (a two-part version has no revision).
    let parts: Vec<&str> = driver.map(|v| v.trim().split('.').collect()).unwrap_or_default();
    let numeric = |s: &&str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if (2..=3).contains(&parts.len()) && parts.iter().all(numeric) {
        put(out, "nvidia.com/cuda.driver.major", parts[0]);
        put(out, "nvidia.com/cuda.driver.minor", parts[1]);
        if let Some(rev) = parts.get(2) {
            put(out, "nvidia.com/cuda.driver.rev", rev);
        }
    }
}

/// How the node's NVIDIA GPUs are shared, as the device plugin serves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// Each GPU to one container.
    None,
    /// Each GPU offered this many times, with no isolation.
    TimeSlicing(u16),
    /// Shares through MPS.
    Mps,
}

impl std::str::FromStr for Sharing {
    type Err = String;

    /// `none`, `mps` or `time-slicing:N` (N from 2 to 64).
    fn from_str(s: &str) -> Result<Sharing, String> {
        let bad =
            || format!("{s:?} is not a sharing mode; give none, mps or time-slicing:N (N 2 to 64)");
        match s {
            "none" => Ok(Sharing::None),
            "mps" => Ok(Sharing::Mps),
            _ => {
                let n: u16 =
                    s.strip_prefix("time-slicing:").ok_or_else(bad)?.parse().map_err(|_| bad())?;
                if (2..=64).contains(&n) { Ok(Sharing::TimeSlicing(n)) } else { Err(bad()) }
            }
        }
    }
}

/// GFD's sharing labels on a node with NVIDIA GPUs: `nvidia.com/gpu.sharing-strategy`
/// (`none`, `time-slicing`, `mps`), `nvidia.com/gpu.replicas` (1 unless time-sliced) and, for
/// time-slicing, `-SHARED` after `nvidia.com/gpu.product`, so that a selector for the plain
/// product does not land on a time-sliced node unawares. Nothing on a node without them.
pub fn sharing(labels: &mut BTreeMap<String, String>, mode: Sharing) {
    if !labels.contains_key("nvidia.com/gpu.present") {
        return;
    }
    let (strategy, replicas) = match mode {
        Sharing::None => ("none", 1),
        Sharing::TimeSlicing(n) => ("time-slicing", n),
        Sharing::Mps => ("mps", 1),
    };
    put(labels, "nvidia.com/gpu.sharing-strategy", strategy);
    put(labels, "nvidia.com/gpu.replicas", replicas);
    if let (Sharing::TimeSlicing(_), Some(p)) = (mode, labels.get_mut("nvidia.com/gpu.product")) {
        let shared = super::label_value(&format!("{p}-SHARED"));
        *p = shared;
    }
}

fn amd(devs: &[&PciDevice], out: &mut BTreeMap<String, String>) {
    let Some(id) = majority(devs) else { return };
    let n = devs.len();
    let id_hex = format!("{id:04x}");
    put(out, "amd.com/gpu.device-id", &id_hex);
    put(out, &format!("beta.amd.com/gpu.device-id.{id_hex}"), n);
    let Some(a) = AMD.iter().find(|a| a.device_id == id) else { return };
    let vram = format!("{}G", a.vram_gib);
    let product = super::label_value(&a.product_name.replace(' ', "_"));
    for (prop, value) in [
        ("family", a.family.to_owned()),
        ("vram", vram),
        ("cu-count", a.compute_units.to_string()),
        ("simd-count", (a.compute_units * 4).to_string()),
        ("product-name", product),
    ] {
        put(out, &format!("beta.amd.com/gpu.{prop}.{value}"), n);
        put(out, &format!("amd.com/gpu.{prop}"), value);
    }
}

fn intel(devs: &[&PciDevice], out: &mut BTreeMap<String, String>) {
    let mut by_id: BTreeMap<(u16, u16), usize> = BTreeMap::new();
    for d in devs {
        let class = d.class.unwrap_or(0x0300);
        *by_id.entry((class, d.device_id.unwrap_or(0))).or_default() += 1;
    }
    for ((class, id), n) in &by_id {
        let key = format!("gpu.intel.com/device-id.{class:04x}-{id:04x}");
        put(out, &format!("{key}.present"), "true");
        put(out, &format!("{key}.count"), n);
    }
    let Some(id) = majority(devs) else { return };
    if let Some((_, family, product)) = INTEL.iter().find(|(d, ..)| *d == id) {
        put(out, "gpu.intel.com/family", family);
        put(out, "gpu.intel.com/product", product);
        put(
            out,
            "gpu.intel.com/device.count",
            devs.iter().filter(|d| d.device_id == Some(id)).count(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::PciDevice;

    fn dev(bus: u8, vendor: u16, device: u16, class: u16) -> PciDevice {
        let mut d = PciDevice::new(format!("0000:{bus:02x}:00.0").parse().unwrap());
        (d.vendor_id, d.device_id, d.class, d.kind) =
            (Some(vendor), Some(device), Some(class), DeviceKind::Gpu);
        d
    }

    fn labels_of(devices: Vec<PciDevice>, driver: Option<&str>) -> BTreeMap<String, String> {
        let mut inv = Inventory { devices, ..Default::default() };
        inv.host.nvidia_driver_version = driver.map(str::to_owned);
        let mut out = BTreeMap::new();
        add(&inv, &mut out);
        out
    }

    #[test]
    fn intel_rules_count_every_gpu_and_name_the_data_center_parts() {
        let l = labels_of(
            vec![dev(1, VENDOR_INTEL, 0x56c0, 0x0380), dev(2, VENDOR_INTEL, 0x56c0, 0x0380)],
            None,
        );
        assert_eq!(l["gpu.intel.com/device-id.0380-56c0.present"], "true");
        assert_eq!(l["gpu.intel.com/device-id.0380-56c0.count"], "2");
        assert_eq!(l["gpu.intel.com/family"], "Flex_Series");
        assert_eq!(l["gpu.intel.com/product"], "Flex_170");
        assert_eq!(l["gpu.intel.com/device.count"], "2");
        // An integrated GPU gets the id labels only.
        let l = labels_of(vec![dev(0, VENDOR_INTEL, 0x9a49, 0x0300)], None);
        assert_eq!(l["gpu.intel.com/device-id.0300-9a49.count"], "1");
        assert!(!l.contains_key("gpu.intel.com/family"));
    }

    #[test]
    fn nvidia_labels_follow_gfd() {
        let l = labels_of(vec![dev(1, VENDOR_NVIDIA, 0x2335, 0x0302)], Some("570.86.15"));
        assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-H200");
        assert_eq!(l["nvidia.com/gpu.family"], "hopper");
        assert_eq!(l["nvidia.com/cuda.driver.major"], "570");
        assert_eq!(l["nvidia.com/cuda.driver.rev"], "15");
        let l = labels_of(vec![dev(1, VENDOR_NVIDIA, 0x27b8, 0x0302)], Some("garbage"));
        assert_eq!(l["nvidia.com/gpu.family"], "ada-lovelace");
        assert_eq!(l["nvidia.com/mig.capable"], "false");
        assert!(!l.contains_key("nvidia.com/cuda.driver.major"), "a version that does not parse");
        // A part the table does not know: counts, no guesses.
        let l = labels_of(vec![dev(1, VENDOR_NVIDIA, 0x9999, 0x0302)], None);
        assert_eq!(l["nvidia.com/gpu.count"], "1");
        assert!(!l.contains_key("nvidia.com/gpu.product"));
        assert_eq!(nvidia_family((7, 0)), "volta");
        assert_eq!(nvidia_family((12, 0)), "blackwell");
    }

    #[test]
    fn sharing_labels_say_the_mode_and_mark_a_time_sliced_product() {
        let mut l = BTreeMap::from([
            ("nvidia.com/gpu.present".to_owned(), "true".to_owned()),
            ("nvidia.com/gpu.product".to_owned(), "NVIDIA-H200".to_owned()),
        ]);
        sharing(&mut l, "time-slicing:4".parse().unwrap());
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "time-slicing");
        assert_eq!(l["nvidia.com/gpu.replicas"], "4");
        assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-H200-SHARED");
        let mut m = BTreeMap::from([("nvidia.com/gpu.present".to_owned(), "true".to_owned())]);
        sharing(&mut m, Sharing::Mps);
        assert_eq!(
            (m["nvidia.com/gpu.sharing-strategy"].as_str(), m["nvidia.com/gpu.replicas"].as_str()),
            ("mps", "1")
        );
        let mut none = BTreeMap::new();
        sharing(&mut none, Sharing::Mps);
        assert!(none.is_empty(), "no NVIDIA GPU, no label");
        for bad in ["time-slicing:1", "time-slicing:65", "time-slicing", "hami"] {
            let e = bad.parse::<Sharing>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }
}
