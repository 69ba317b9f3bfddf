//! Accelerator kinds and the generation table.
//!
//! `pci.ids` names devices but says nothing a scheduler needs (how many chips a full host has,
//! how much memory each carries, which TPU topologies exist), and it does not know Google's TPU
//! device ids at all. This table carries those facts for the accelerators xpu supports by name;
//! anything else is still discovered and classified by its PCI class.

use serde::{Deserialize, Serialize};

/// What a PCI function is, from xpu's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Gpu,
    Tpu,
    /// Neural/processing accelerators: Intel Gaudi and PCI class 12 devices.
    Npu,
    /// NVIDIA NVSwitch (class 0680 bridge on HGX boards).
    Nvswitch,
    Other,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 5] = [
        DeviceKind::Gpu,
        DeviceKind::Tpu,
        DeviceKind::Npu,
        DeviceKind::Nvswitch,
        DeviceKind::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Gpu => "gpu",
            DeviceKind::Tpu => "tpu",
            DeviceKind::Npu => "npu",
            DeviceKind::Nvswitch => "nvswitch",
            DeviceKind::Other => "other",
        }
    }

    /// Accelerators are what `xpu discover` lists by default (with their IOMMU group peers).
    pub fn is_accelerator(self) -> bool {
        !matches!(self, DeviceKind::Other)
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            format!("unknown device kind {s:?}; expected gpu, tpu, npu, nvswitch or other")
        })
    }
}

pub const VENDOR_NVIDIA: u16 = 0x10de;
pub const VENDOR_AMD: u16 = 0x1002;
pub const VENDOR_GOOGLE: u16 = 0x1ae0;
pub const VENDOR_HABANA: u16 = 0x1da3;
pub const VENDOR_INTEL: u16 = 0x8086;

/// Facts about a TPU generation that slice placement needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpuFacts {
    /// The value of GKE's `cloud.google.com/gke-tpu-accelerator` node label.
    pub gke_accelerator: &'static str,
    /// 2 for v5e/v6e (`2x4`), 3 for v4/v5p/TPU7x (`2x2x4`).
    pub topology_dims: u8,
    /// Chips per host (VM) in a multi-host slice.
    pub chips_per_host_multi: u8,
    /// Chip counts a single-host slice may have.
    pub single_host_chips: &'static [u8],
}

/// One row of the generation table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accelerator {
    pub vendor_id: u16,
    pub device_id: u16,
    pub kind: DeviceKind,
    /// Short vendor name used in CDI kinds and labels: `nvidia`, `amd`, `google`, `intel`.
    pub vendor: &'static str,
    /// Product name, label-safe: `A100-SXM4-40GB`, `TPU-v5p`.
    pub product: &'static str,
    /// Architecture or TPU generation: `ampere`, `hopper`, `v5p`, `cdna3`, `gaudi2`.
    pub generation: &'static str,
    pub memory_gib: u32,
    /// Chips on one fully populated host (an HGX board, a TPU VM, an OAM baseboard).
    pub chips_per_host: u8,
    pub tpu: Option<TpuFacts>,
}

const fn gpu(
    vendor_id: u16,
    device_id: u16,
    vendor: &'static str,
    product: &'static str,
    generation: &'static str,
    memory_gib: u32,
    chips_per_host: u8,
) -> Accelerator {
    Accelerator {
        vendor_id,
        device_id,
        kind: DeviceKind::Gpu,
        vendor,
        product,
        generation,
        memory_gib,
        chips_per_host,
        tpu: None,
    }
}

const fn nvswitch(device_id: u16, product: &'static str, generation: &'static str) -> Accelerator {
    Accelerator {
        vendor_id: VENDOR_NVIDIA,
        device_id,
        kind: DeviceKind::Nvswitch,
        vendor: "nvidia",
        product,
        generation,
        memory_gib: 0,
        chips_per_host: 6,
        tpu: None,
    }
}

const fn npu(
    device_id: u16,
    product: &'static str,
    generation: &'static str,
    mem: u32,
) -> Accelerator {
    Accelerator {
        vendor_id: VENDOR_HABANA,
        device_id,
        kind: DeviceKind::Npu,
        vendor: "intel",
        product,
        generation,
        memory_gib: mem,
        chips_per_host: 8,
        tpu: None,
    }
}

const fn tpu(
    device_id: u16,
    product: &'static str,
    generation: &'static str,
    memory_gib: u32,
    chips_per_host: u8,
    facts: TpuFacts,
) -> Accelerator {
    Accelerator {
        vendor_id: VENDOR_GOOGLE,
        device_id,
        kind: DeviceKind::Tpu,
        vendor: "google",
        product,
        generation,
        memory_gib,
        chips_per_host,
        tpu: Some(facts),
    }
}

const SINGLE_HOST_3D: &[u8] = &[4];
const SINGLE_HOST_2D: &[u8] = &[1, 4, 8];

/// The generation table. Ids are from the PCI ID database where it has them; TPU ids and the
/// newest parts (H200, B200, MI325X, Gaudi3) are not in older `pci.ids` copies.
pub static ACCELERATORS: &[Accelerator] = &[
    // NVIDIA data-centre GPUs.
    gpu(VENDOR_NVIDIA, 0x20b0, "nvidia", "A100-SXM4-40GB", "ampere", 40, 8),
    gpu(VENDOR_NVIDIA, 0x20b2, "nvidia", "A100-SXM4-80GB", "ampere", 80, 8),
    gpu(VENDOR_NVIDIA, 0x20b3, "nvidia", "A100-SXM-64GB", "ampere", 64, 8),
    gpu(VENDOR_NVIDIA, 0x20b5, "nvidia", "A100-PCIE-80GB", "ampere", 80, 8),
    gpu(VENDOR_NVIDIA, 0x20f1, "nvidia", "A100-PCIE-40GB", "ampere", 40, 8),
    gpu(VENDOR_NVIDIA, 0x2330, "nvidia", "H100-SXM5-80GB", "hopper", 80, 8),
    gpu(VENDOR_NVIDIA, 0x2331, "nvidia", "H100-PCIE-80GB", "hopper", 80, 8),
    gpu(VENDOR_NVIDIA, 0x2321, "nvidia", "H100-NVL", "hopper", 94, 8),
    gpu(VENDOR_NVIDIA, 0x2335, "nvidia", "H200-SXM-141GB", "hopper", 141, 8),
    gpu(VENDOR_NVIDIA, 0x2901, "nvidia", "B200", "blackwell", 180, 8),
    gpu(VENDOR_NVIDIA, 0x27b8, "nvidia", "L4", "ada", 24, 8),
    gpu(VENDOR_NVIDIA, 0x1eb8, "nvidia", "T4", "turing", 16, 4),
    nvswitch(0x1af1, "A100-NVSwitch", "ampere"),
    nvswitch(0x22a3, "H100-NVSwitch", "hopper"),
    // AMD Instinct. MI250X shows up as two PCI functions (one per GCD) per OAM module.
    gpu(VENDOR_AMD, 0x740f, "amd", "MI210", "cdna2", 64, 8),
    gpu(VENDOR_AMD, 0x7408, "amd", "MI250X", "cdna2", 64, 8),
    gpu(VENDOR_AMD, 0x740c, "amd", "MI250X-MI250", "cdna2", 64, 8),
    gpu(VENDOR_AMD, 0x74a1, "amd", "MI300X", "cdna3", 192, 8),
    gpu(VENDOR_AMD, 0x74a5, "amd", "MI325X", "cdna3", 256, 8),
    // Intel Gaudi (Habana Labs vendor id).
    npu(0x1000, "Gaudi", "gaudi", 32),
    npu(0x1010, "Gaudi", "gaudi", 32),
    npu(0x1020, "Gaudi2", "gaudi2", 96),
    npu(0x1060, "Gaudi3", "gaudi3", 128),
    // Google Cloud TPU.
    tpu(
        0x0027,
        "TPU-v2-v3",
        "v2-v3",
        16,
        4,
        TpuFacts {
            gke_accelerator: "tpu-v3-slice",
            topology_dims: 2,
            chips_per_host_multi: 4,
            single_host_chips: SINGLE_HOST_3D,
        },
    ),
    tpu(
        0x005e,
        "TPU-v4",
        "v4",
        32,
        4,
        TpuFacts {
            gke_accelerator: "tpu-v4-podslice",
            topology_dims: 3,
            chips_per_host_multi: 4,
            single_host_chips: SINGLE_HOST_3D,
        },
    ),
    tpu(
        0x0062,
        "TPU-v5p",
        "v5p",
        95,
        4,
        TpuFacts {
            gke_accelerator: "tpu-v5p-slice",
            topology_dims: 3,
            chips_per_host_multi: 4,
            single_host_chips: SINGLE_HOST_3D,
        },
    ),
    tpu(
        0x0063,
        "TPU-v5e",
        "v5e",
        16,
        8,
        TpuFacts {
            gke_accelerator: "tpu-v5-lite-podslice",
            topology_dims: 2,
            chips_per_host_multi: 4,
            single_host_chips: SINGLE_HOST_2D,
        },
    ),
    tpu(
        0x006f,
        "TPU-v6e",
        "v6e",
        32,
        8,
        TpuFacts {
            gke_accelerator: "tpu-v6e-slice",
            topology_dims: 2,
            chips_per_host_multi: 4,
            single_host_chips: SINGLE_HOST_2D,
        },
    ),
    tpu(
        0x0076,
        "TPU7x",
        "tpu7x",
        192,
        4,
        TpuFacts {
            gke_accelerator: "tpu7x",
            topology_dims: 3,
            chips_per_host_multi: 4,
            single_host_chips: SINGLE_HOST_3D,
        },
    ),
];

/// The table row for a vendor/device pair.
pub fn lookup(vendor_id: u16, device_id: u16) -> Option<&'static Accelerator> {
    ACCELERATORS.iter().find(|a| a.vendor_id == vendor_id && a.device_id == device_id)
}

/// The TPU generation whose GKE accelerator label or generation name is `name`
/// (`tpu-v5p-slice` or `v5p`).
pub fn tpu_by_name(name: &str) -> Option<&'static Accelerator> {
    ACCELERATORS.iter().find(|a| {
        a.tpu.is_some_and(|t| t.gke_accelerator == name)
            || (a.kind == DeviceKind::Tpu && a.generation == name)
    })
}

/// Classifies a PCI function. `class` is the 24-bit class code (class, subclass, prog-if).
///
/// Order matters: the table wins (TPUs have no telling class), then NVIDIA's class-0680 bridge
/// is an NVSwitch, Habana and class 12 are NPUs, 3D controllers are GPUs, and VGA/other display
/// controllers are GPUs only from the GPU vendors, so a server's BMC VGA (ASPEED, Matrox) stays
/// `other`.
pub fn classify(vendor_id: Option<u16>, device_id: Option<u16>, class: Option<u32>) -> DeviceKind {
    if let (Some(v), Some(d)) = (vendor_id, device_id)
        && let Some(a) = lookup(v, d)
    {
        return a.kind;
    }
    let class16 = class.map(|c| (c >> 8) as u16);
    match (vendor_id, class16) {
        (Some(VENDOR_NVIDIA), Some(0x0680)) => DeviceKind::Nvswitch,
        (Some(VENDOR_HABANA), Some(c)) if c >> 8 == 0x12 || c >> 8 == 0x0b => DeviceKind::Npu,
        (_, Some(c)) if c >> 8 == 0x12 => DeviceKind::Npu,
        (_, Some(0x0302)) => DeviceKind::Gpu,
        (Some(VENDOR_NVIDIA | VENDOR_AMD | VENDOR_INTEL), Some(0x0300 | 0x0380)) => DeviceKind::Gpu,
        _ => DeviceKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_by_table_and_class() {
        assert_eq!(classify(Some(0x10de), Some(0x20b0), Some(0x030200)), DeviceKind::Gpu);
        assert_eq!(classify(Some(0x10de), Some(0x1af1), Some(0x068000)), DeviceKind::Nvswitch);
        assert_eq!(classify(Some(0x10de), Some(0x9999), Some(0x068000)), DeviceKind::Nvswitch);
        assert_eq!(classify(Some(0x1ae0), Some(0x0062), Some(0x0b4000)), DeviceKind::Tpu);
        assert_eq!(classify(Some(0x1ae0), Some(0x0042), Some(0x020000)), DeviceKind::Other);
        assert_eq!(classify(Some(0x1da3), Some(0x1020), Some(0x120000)), DeviceKind::Npu);
        assert_eq!(classify(Some(0x1234), Some(0x0001), Some(0x120000)), DeviceKind::Npu);
        assert_eq!(classify(Some(0x1a03), Some(0x2000), Some(0x030000)), DeviceKind::Other);
        assert_eq!(classify(Some(0x8086), Some(0x56c0), Some(0x038000)), DeviceKind::Gpu);
        assert_eq!(classify(None, None, None), DeviceKind::Other);
    }

    #[test]
    fn table_has_no_duplicates_and_labels_are_safe() {
        for (i, a) in ACCELERATORS.iter().enumerate() {
            for b in &ACCELERATORS[i + 1..] {
                assert!(!(a.vendor_id == b.vendor_id && a.device_id == b.device_id), "{a:?}");
            }
            for s in [a.product, a.generation, a.vendor] {
                assert!(s.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c)), "{s}");
            }
        }
    }

    #[test]
    fn tpu_lookup_by_gke_name() {
        assert_eq!(tpu_by_name("tpu-v5p-slice").map(|a| a.device_id), Some(0x0062));
        assert_eq!(tpu_by_name("v6e").map(|a| a.device_id), Some(0x006f));
        assert_eq!(tpu_by_name("a100"), None);
    }

    #[test]
    fn kind_round_trips() {
        for k in DeviceKind::ALL {
            assert_eq!(k.as_str().parse::<DeviceKind>().unwrap(), k);
        }
        assert!("fpga".parse::<DeviceKind>().is_err());
    }
}
