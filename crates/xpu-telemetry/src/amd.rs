//! AMD GPUs: the values `xpu_host::amdgpu` reads from amdgpu's sysfs and hwmon under a
//! [`Root`], as a [`Source`]. A missing file leaves its value unknown; a file with garbage in it
//! also gives a warning naming the file (the collector prints each once).

use xpu_core::Inventory;
use xpu_core::accel::VENDOR_AMD;
use xpu_host::Root;
use xpu_host::amdgpu::AmdgpuStats;

use crate::{Reading, Report, Source};

pub struct AmdSysfs {
    root: Root,
}

impl AmdSysfs {
    pub fn new(root: Root) -> Self {
        Self { root }
    }
}

fn reading(s: &AmdgpuStats) -> Reading {
    let mhz = |hz: Option<u64>| hz.and_then(|hz| u32::try_from(hz / 1_000_000).ok());
    Reading {
        utilization_percent: s.busy_percent.map(|v| v as f64),
        memory_used_bytes: s.vram_used_bytes,
        memory_total_bytes: s.vram_total_bytes,
        power_watts: s.power_microwatts.map(|uw| uw as f64 / 1e6),
        temperature_celsius: s.temp_millicelsius.map(|m| m as f64 / 1000.0),
        sm_clock_mhz: mhz(s.sclk_hz),
        memory_clock_mhz: mhz(s.mclk_hz),
        ecc_uncorrected: s.umc_errors.map(|(ue, _)| ue),
        ecc_corrected: s.umc_errors.map(|(_, ce)| ce),
        ..Reading::default()
    }
}

impl Source for AmdSysfs {
    fn name(&self) -> &'static str {
        "amd"
    }

    fn read(&mut self, inventory: &Inventory) -> Result<Report, String> {
        let mut report = Report::default();
        for d in inventory.accelerators().filter(|d| d.vendor_id == Some(VENDOR_AMD)) {
            let stats = xpu_host::amdgpu::read(&self.root, &d.address, &mut report.warnings);
            report.readings.insert(d.address, reading(&stats));
        }
        Ok(report)
    }
}
