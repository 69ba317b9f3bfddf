//! What only the NVIDIA driver library (NVML) knows: the CUDA driver API version the installed
//! driver supports, a GPU's brand and compute capability. `NVIDIA_REQUIRE_*` constraints need
//! them. Behind a trait, as ARCHITECTURE.md puts hardware libraries, so tests use [`FakeNvml`].
//!
//! A real implementation would `dlopen("libnvidia-ml.so.1")` under the host root and call
//! `nvmlInit_v2`, `nvmlSystemGetCudaDriverVersion_v2`, and per GPU (by PCI bus id)
//! `nvmlDeviceGetHandleByPciBusId_v2`, `nvmlDeviceGetBrand` and
//! `nvmlDeviceGetCudaComputeCapability`. That needs `unsafe` FFI, which this workspace forbids,
//! so [`SmiNvml`] asks `nvidia-smi` (an NVML client shipped with every driver) instead, and
//! `cuda_version` in runtime.toml overrides it without running anything ([`Configured`]).

use std::cell::OnceCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use xpu_core::{PciAddress, PciDevice};

/// A dotted version (`12.2`, `535.104.05`), compared component by component with missing
/// components as zero.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Version(pub Vec<u64>);

impl Version {
    pub fn parse(s: &str) -> Option<Version> {
        let parts: Option<Vec<u64>> = s.trim().split('.').map(|p| p.parse().ok()).collect();
        parts.filter(|p| !p.is_empty()).map(Version)
    }

    pub fn cmp_padded(&self, other: &Version) -> std::cmp::Ordering {
        let n = self.0.len().max(other.0.len());
        (0..n)
            .map(|i| self.0.get(i).copied().unwrap_or(0).cmp(&other.0.get(i).copied().unwrap_or(0)))
            .find(|o| o.is_ne())
            .unwrap_or(std::cmp::Ordering::Equal)
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(u64::to_string).collect();
        f.write_str(&parts.join("."))
    }
}

/// The facts NVML provides; `None` when unknown.
pub trait Nvml {
    /// `nvmlSystemGetCudaDriverVersion`: the newest CUDA the driver runs (`12.2`).
    fn cuda_driver_version(&self) -> Option<Version>;
    /// `nvmlDeviceGetBrand`, lower-case: `tesla`, `geforce`, `quadro`, `nvidia`...
    fn brand(&self, gpu: &PciDevice) -> Option<String>;
    /// `nvmlDeviceGetCudaComputeCapability`: `(8, 0)` for an A100.
    fn compute_capability(&self, gpu: &PciDevice) -> Option<(u32, u32)>;
}

/// Fixed answers, for tests.
#[derive(Debug, Clone, Default)]
pub struct FakeNvml {
    pub cuda: Option<Version>,
    pub brands: HashMap<PciAddress, String>,
    pub compute: HashMap<PciAddress, (u32, u32)>,
}

impl Nvml for FakeNvml {
    fn cuda_driver_version(&self) -> Option<Version> {
        self.cuda.clone()
    }
    fn brand(&self, gpu: &PciDevice) -> Option<String> {
        self.brands.get(&gpu.address).cloned()
    }
    fn compute_capability(&self, gpu: &PciDevice) -> Option<(u32, u32)> {
        self.compute.get(&gpu.address).copied()
    }
}

/// `nvidia-smi` under the host root, run at most once, and only when a constraint asks.
#[derive(Debug)]
pub struct SmiNvml {
    program: PathBuf,
    facts: OnceCell<SmiFacts>,
}

#[derive(Debug, Default)]
struct SmiFacts {
    cuda: Option<Version>,
    gpus: HashMap<PciAddress, SmiGpu>,
}

/// One GPU's brand and compute capability.
#[derive(Debug, Default)]
struct SmiGpu(Option<String>, Option<(u32, u32)>);

impl SmiNvml {
    /// `nvidia-smi` at `program` (`ROOT/usr/bin/nvidia-smi`).
    pub fn new(program: PathBuf) -> Self {
        Self { program, facts: OnceCell::new() }
    }

    fn facts(&self) -> &SmiFacts {
        self.facts.get_or_init(|| {
            let run = |args: &[&str]| {
                Command::new(&self.program)
                    .args(args)
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            };
            let mut f = SmiFacts::default();
            if let Some(q) = run(&["-q"]) {
                f.cuda = parse_smi_cuda(&q);
                for (bus, brand) in parse_smi_brands(&q) {
                    f.gpus.entry(bus).or_default().0 = Some(brand);
                }
            }
            if let Some(csv) = run(&["--query-gpu=pci.bus_id,compute_cap", "--format=csv,noheader"])
            {
                for line in csv.lines() {
                    let Some((bus, cap)) = line.split_once(',') else { continue };
                    let Some(bus) = crate::request::parse_bus_id(bus.trim()) else { continue };
                    let cap = cap
                        .trim()
                        .split_once('.')
                        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
                    f.gpus.entry(bus).or_default().1 = cap;
                }
            }
            f
        })
    }
}

impl Nvml for SmiNvml {
    fn cuda_driver_version(&self) -> Option<Version> {
        self.facts().cuda.clone()
    }
    fn brand(&self, gpu: &PciDevice) -> Option<String> {
        self.facts().gpus.get(&gpu.address).and_then(|g| g.0.clone())
    }
    fn compute_capability(&self, gpu: &PciDevice) -> Option<(u32, u32)> {
        self.facts().gpus.get(&gpu.address).and_then(|g| g.1)
    }
}

/// `CUDA Version                              : 12.2` from `nvidia-smi -q`.
fn parse_smi_cuda(q: &str) -> Option<Version> {
    q.lines()
        .find_map(|l| l.trim().strip_prefix("CUDA Version"))
        .and_then(|r| Version::parse(r.trim_start().trim_start_matches(':')))
}

/// `GPU 00000000:25:00.0` section headers followed by `Product Brand : NVIDIA`.
fn parse_smi_brands(q: &str) -> Vec<(PciAddress, String)> {
    let mut out = Vec::new();
    let mut current = None;
    for line in q.lines() {
        let t = line.trim();
        if let Some(bus) = t.strip_prefix("GPU ") {
            current = crate::request::parse_bus_id(bus.trim());
        } else if let Some(r) = t.strip_prefix("Product Brand")
            && let Some(bus) = current
        {
            out.push((bus, r.trim_start().trim_start_matches(':').trim().to_ascii_lowercase()));
        }
    }
    out
}

/// The configured CUDA version when runtime.toml has one, everything else from `inner`.
pub struct Configured<N> {
    pub cuda_version: Option<Version>,
    pub inner: N,
}

impl<N: Nvml> Nvml for Configured<N> {
    fn cuda_driver_version(&self) -> Option<Version> {
        self.cuda_version.clone().or_else(|| self.inner.cuda_driver_version())
    }
    fn brand(&self, gpu: &PciDevice) -> Option<String> {
        self.inner.brand(gpu)
    }
    fn compute_capability(&self, gpu: &PciDevice) -> Option<(u32, u32)> {
        self.inner.compute_capability(gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMI_Q: &str = "\
==============NVSMI LOG==============

Driver Version                            : 535.104.05
CUDA Version                              : 12.2

Attached GPUs                             : 2
GPU 00000000:25:00.0
    Product Name                          : NVIDIA A100-SXM4-40GB
    Product Brand                         : NVIDIA
GPU 00000000:2B:00.0
    Product Name                          : Tesla T4
    Product Brand                         : Tesla
";

    #[test]
    fn parses_nvidia_smi_query_output() {
        assert_eq!(parse_smi_cuda(SMI_Q), Some(Version(vec![12, 2])));
        let brands = parse_smi_brands(SMI_Q);
        assert_eq!(brands.len(), 2);
        assert_eq!(brands[0].0.to_string(), "0000:25:00.0");
        assert_eq!(brands[1].1, "tesla");
    }

    #[test]
    fn versions_compare_with_zero_padding() {
        let v = |s| Version::parse(s).unwrap();
        assert!(v("535.104.05").cmp_padded(&v("470")).is_gt());
        assert!(v("470.0").cmp_padded(&v("470")).is_eq());
        assert!(v("12.2").cmp_padded(&v("12.10")).is_lt());
        assert_eq!(Version::parse("12.x"), None);
    }

    /// Needs an NVIDIA GPU and driver: compares `SmiNvml` with what `nvidia-smi` prints.
    #[test]
    #[ignore = "needs an NVIDIA GPU with its driver"]
    fn real_nvidia_smi_reports_a_cuda_version() {
        let smi = SmiNvml::new(PathBuf::from("/usr/bin/nvidia-smi"));
        let v = smi.cuda_driver_version().expect("nvidia-smi -q prints CUDA Version");
        assert!(v.0[0] >= 10, "{v}");
    }
}
