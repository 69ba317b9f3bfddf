//! Accelerator telemetry and health for `xpu exporter`, `xpu serve` and the node agents.
//!
//! - **Sources** ([`Source`]): one per vendor library or file tree, each behind the same trait
//!   so tests use fakes. [`nvml`] loads `libnvidia-ml.so.1` at run time (no build-time link to
//!   the driver; a host without it reports "no NVML" once); [`amd`] reads amdgpu's sysfs and
//!   hwmon files under a [`Root`](xpu_host::Root). The TPU runtime's metrics service (gRPC on
//!   localhost:8431) is a source too, in `xpu-integrations` with the other protobuf clients.
//! - **Collection** ([`collect::Collector`]): each source reads on its own thread once per
//!   interval, the inventory is re-discovered on another, and a scrape only renders the last
//!   snapshot: a hung source makes its series go stale (with one warning), never a slow scrape.
//! - **Health** ([`health`]): new uncorrectable ECC/RAS errors, XIDs of the kinds NVIDIA's Xid
//!   catalog says need a GPU reset, and vanished devices mark a device unhealthy with a reason,
//!   until the source says it recovered.
//! - **Exposition** ([`render`]): OpenMetrics text through `prometheus-client`, under xpu's
//!   names and, for NVIDIA GPUs, also DCGM exporter's names and labels.

pub mod amd;
pub mod collect;
pub mod health;
pub mod mig;
pub mod nvml;
pub mod render;

use std::collections::BTreeMap;

use xpu_core::{Inventory, PciAddress};

/// What one source measured for one device. `None` where the source does not know.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    /// Busy time of the compute engines over the last sample period, 0-100.
    pub utilization_percent: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub temperature_celsius: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub memory_clock_mhz: Option<u32>,
    pub pcie_tx_bytes_per_second: Option<u64>,
    pub pcie_rx_bytes_per_second: Option<u64>,
    /// Corrected (single-bit) memory errors since the driver loaded.
    pub ecc_corrected: Option<u64>,
    /// Uncorrected (double-bit) memory errors since the driver loaded.
    pub ecc_uncorrected: Option<u64>,
    /// XID events seen since the previous read, oldest first.
    pub xids: Vec<u64>,
    /// The source saw the device reset (or re-initialised) since the previous read: the only
    /// way a device marked unhealthy by an XID or ECC error becomes healthy again.
    pub reset: bool,
    /// The device is present to the kernel but the source cannot reach it (NVML's
    /// `GPU_IS_LOST`): unhealthy until it answers again.
    pub lost: bool,
    /// Identity the source knows better than sysfs: NVML's UUID and product name.
    pub uuid: Option<String>,
    pub model: Option<String>,
}

/// One read of a source: readings by PCI address plus problems worth one warning each.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub readings: BTreeMap<PciAddress, Reading>,
    /// Problems with single files or devices (garbage in a hwmon file): warned once each by
    /// the collector, keyed by the text before the first `:`.
    pub warnings: Vec<String>,
}

/// A telemetry source. `read` may block (NVML calls, a network port); the collector runs it on
/// its own thread and never waits on it from a scrape.
pub trait Source: Send {
    /// Short name for logs and the `source` label: `nvml`, `amd`.
    fn name(&self) -> &'static str;
    /// Reads every device this source knows among `inventory`'s accelerators. An `Err` is a
    /// whole-source failure (library missing, port down): reported once until it changes.
    fn read(&mut self, inventory: &Inventory) -> Result<Report, String>;
}

/// The production sources: NVML (loaded at run time; "no NVML" once where the driver is
/// absent) and amdgpu's sysfs under `root`. NVML is asked even under a root other than `/`: in
/// a DaemonSet the host is mounted at /host while the driver's library comes from the
/// container runtime. Its readings count only for GPUs the root's inventory has (matched by PCI
/// address).
pub fn default_sources(root: &xpu_host::Root) -> Vec<Box<dyn Source>> {
    vec![Box::new(nvml::LoadedNvml::new()), Box::new(amd::AmdSysfs::new(root.clone()))]
}
