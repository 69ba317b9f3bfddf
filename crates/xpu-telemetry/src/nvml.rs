//! NVIDIA GPUs through NVML.
//!
//! [`LoadedNvml`] loads `libnvidia-ml.so.1` at run time with the `nvml-wrapper` crate (which
//! holds the FFI; this workspace forbids `unsafe`), so the binary has no link-time dependency on
//! the driver. A failed load is one `Err` from [`Source::read`] ("no NVML: ..."), which the
//! collector warns about once; the other sources keep exporting. XIDs arrive through an NVML
//! event set registered for critical XID events, polled without blocking at each read.
//!
//! [`FakeNvml`] returns what a test put in it, through the same trait.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Clock, EccCounter, MemoryError, PcieUtilCounter, TemperatureSensor,
};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::{Device, Nvml};
use xpu_core::{Inventory, PciAddress};

use crate::{Reading, Report, Source};

/// NVML loaded from the driver's library. Created lazily on the first read, so that a host
/// without NVIDIA's driver costs nothing but one warning.
#[derive(Default)]
pub struct LoadedNvml {
    state: Option<Loaded>,
}

struct Loaded {
    nvml: &'static Nvml,
    /// Critical-XID events of every GPU that supports them; `None` where registration failed
    /// (some virtualised GPUs): XIDs are then not reported, which the first read warns about.
    events: Option<EventSet<'static>>,
    /// Devices that answered `GPU_IS_LOST` at the last read: an answer after that is a reset.
    lost: Vec<PciAddress>,
}

impl LoadedNvml {
    pub fn new() -> Self {
        Self::default()
    }

    fn load(&mut self, warnings: &mut Vec<String>) -> Result<&mut Loaded, String> {
        if self.state.is_none() {
            let nvml = Nvml::init().map_err(|e| format!("no NVML: {e}"))?;
            // The library handle lives as long as the process: the event set and the device
            // handles borrow it, and NVML is initialised once per exporter.
            let nvml: &'static Nvml = Box::leak(Box::new(nvml));
            let events = match register_xid_events(nvml) {
                Ok(set) => Some(set),
                Err(e) => {
                    warnings.push(format!(
                        "nvml xid events: not available ({e}); XIDs are not reported"
                    ));
                    None
                }
            };
            self.state = Some(Loaded { nvml, events, lost: Vec::new() });
        }
        self.state.as_mut().ok_or_else(|| "no NVML".to_owned())
    }
}

fn register_xid_events(nvml: &'static Nvml) -> Result<EventSet<'static>, NvmlError> {
    let mut set = nvml.create_event_set()?;
    for i in 0..nvml.device_count()? {
        let dev = nvml.device_by_index(i)?;
        set = dev.register_events(EventTypes::CRITICAL_XID_ERROR, set).map_err(|e| e.error)?;
    }
    Ok(set)
}

fn pci_of(dev: &Device<'_>) -> Result<PciAddress, NvmlError> {
    let info = dev.pci_info()?;
    // NVML prints 8 domain digits (`00000000:25:00.0`); the fields are authoritative.
    Ok(PciAddress {
        domain: info.domain,
        bus: u8::try_from(info.bus).unwrap_or(u8::MAX),
        device: u8::try_from(info.device).unwrap_or(u8::MAX),
        function: 0,
    })
}

/// One device's values; each query that the GPU does not support is left `None`.
fn read_device(dev: &Device<'_>) -> Reading {
    let util = dev.utilization_rates().ok();
    let mem = dev.memory_info().ok();
    Reading {
        utilization_percent: util.map(|u| f64::from(u.gpu)),
        memory_used_bytes: mem.as_ref().map(|m| m.used),
        memory_total_bytes: mem.as_ref().map(|m| m.total),
        // Milliwatts.
        power_watts: dev.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        temperature_celsius: dev.temperature(TemperatureSensor::Gpu).ok().map(f64::from),
        sm_clock_mhz: dev.clock_info(Clock::SM).ok(),
        memory_clock_mhz: dev.clock_info(Clock::Memory).ok(),
        // KB/s over NVML's 20 ms sample.
        pcie_tx_bytes_per_second: dev
            .pcie_throughput(PcieUtilCounter::Send)
            .ok()
            .map(|kb| u64::from(kb) * 1024),
        pcie_rx_bytes_per_second: dev
            .pcie_throughput(PcieUtilCounter::Receive)
            .ok()
            .map(|kb| u64::from(kb) * 1024),
        ecc_corrected: dev.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile).ok(),
        ecc_uncorrected: dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile).ok(),
        uuid: dev.uuid().ok(),
        model: dev.name().ok(),
        ..Reading::default()
    }
}

impl Source for LoadedNvml {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn read(&mut self, inventory: &Inventory) -> Result<Report, String> {
        let mut report = Report::default();
        let loaded = self.load(&mut report.warnings)?;
        let nvml = loaded.nvml;
        let count = nvml.device_count().map_err(|e| format!("nvml: device count: {e}"))?;
        let wanted: Vec<PciAddress> = inventory
            .accelerators()
            .filter(|d| d.vendor_id == Some(xpu_core::accel::VENDOR_NVIDIA))
            .map(|d| d.address)
            .collect();
        let mut lost_now = Vec::new();
        for i in 0..count {
            let dev = match nvml.device_by_index(i) {
                Ok(d) => d,
                Err(e) => {
                    report.warnings.push(format!("nvml device {i}: {e}"));
                    continue;
                }
            };
            let Ok(addr) = pci_of(&dev) else {
                report.warnings.push(format!("nvml device {i}: no PCI address"));
                continue;
            };
            // Only what this host's inventory holds (a fixture root never mixes with the
            // real GPUs of the machine running the tests).
            if !wanted.contains(&addr) {
                continue;
            }
            let mut r = read_device(&dev);
            if matches!(dev.utilization_rates(), Err(NvmlError::GpuLost)) {
                r.lost = true;
                lost_now.push(addr);
            } else if loaded.lost.contains(&addr) {
                r.reset = true;
            }
            report.readings.insert(addr, r);
        }
        loaded.lost = lost_now;
        if let Some(set) = &loaded.events {
            // Drain what arrived since the last read; a timeout of 0 returns at once.
            while let Ok(ev) = set.wait(0) {
                if let (Ok(addr), Some(XidError::Value(xid))) = (pci_of(&ev.device), ev.event_data)
                {
                    report.readings.entry(addr).or_default().xids.push(xid);
                }
            }
        }
        Ok(report)
    }
}

/// What a test wants NVML to say, shared with the test through an `Arc` so values can change
/// while the collector runs.
#[derive(Debug, Clone, Default)]
pub struct FakeNvml {
    pub state: Arc<Mutex<FakeState>>,
}

#[derive(Debug, Clone, Default)]
pub struct FakeState {
    /// `Err` makes the whole source fail (a library that does not load or errors).
    pub fail: Option<String>,
    pub devices: BTreeMap<PciAddress, Reading>,
}

impl FakeNvml {
    pub fn new(devices: BTreeMap<PciAddress, Reading>) -> Self {
        Self { state: Arc::new(Mutex::new(FakeState { fail: None, devices })) }
    }

    /// Applies `f` to the fake's state (values, failures, XIDs to deliver at the next read).
    pub fn update(&self, f: impl FnOnce(&mut FakeState)) {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
    }
}

impl Source for FakeNvml {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn read(&mut self, _inventory: &Inventory) -> Result<Report, String> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = &st.fail {
            return Err(e.clone());
        }
        let readings = st.devices.clone();
        // XIDs and resets are events: delivered once.
        for r in st.devices.values_mut() {
            r.xids.clear();
            r.reset = false;
        }
        Ok(Report { readings, warnings: Vec::new() })
    }
}

/// NVML as a JSON file says it, for the node agents run as processes in tests (`--fake-nvml`,
/// hidden): `{"devices": {"0000:48:00.0": {"xids": [79], "resets": 0, "lost": false}}}`, read
/// again at every read, bounded. `xids` are every XID since the agent started, oldest first:
/// each is delivered once; `resets` counts resets: each new one is delivered once. A file not
/// there yet says nothing.
#[derive(Debug)]
pub struct FileNvml {
    path: std::path::PathBuf,
    /// Per device: XIDs delivered so far, resets seen so far.
    seen: BTreeMap<PciAddress, (usize, u64)>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileState {
    #[serde(default)]
    devices: BTreeMap<String, FileDevice>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDevice {
    #[serde(default)]
    xids: Vec<u64>,
    #[serde(default)]
    resets: u64,
    #[serde(default)]
    lost: bool,
}

/// The most a fake NVML file may hold.
const MAX_FILE_BYTES: u64 = 64 * 1024;

impl FileNvml {
    pub fn new(path: std::path::PathBuf) -> FileNvml {
        FileNvml { path, seen: BTreeMap::new() }
    }

    fn state(&self) -> Result<FileState, String> {
        let bad = |why: String| format!("fake NVML {}: {why}", self.path.display());
        // Looked at before it is opened, opened without blocking, read to a cap.
        let bytes = match xpu_host::root::read_bounded(&self.path, MAX_FILE_BYTES) {
            Ok(b) => b,
            Err(xpu_host::root::ReadError::Missing) => return Ok(FileState::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))
    }
}

impl Source for FileNvml {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn read(&mut self, _inventory: &Inventory) -> Result<Report, String> {
        let state = self.state()?;
        let mut readings = BTreeMap::new();
        for (addr, d) in state.devices {
            let address: PciAddress = addr
                .parse()
                .map_err(|e| format!("fake NVML {}: {addr}: {e}", self.path.display()))?;
            let (delivered, resets) = self.seen.entry(address).or_default();
            let xids = d.xids.get(*delivered..).unwrap_or_default().to_vec();
            *delivered = d.xids.len().max(*delivered);
            let reset = d.resets > *resets;
            *resets = d.resets.max(*resets);
            readings.insert(address, Reading { xids, reset, lost: d.lost, ..Reading::default() });
        }
        Ok(Report { readings, warnings: Vec::new() })
    }
}

#[cfg(test)]
mod file_tests {
    use super::*;

    #[test]
    fn a_file_delivers_each_xid_and_reset_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvml.json");
        let mut s = FileNvml::new(path.clone());
        let inv = Inventory::default();
        assert!(s.read(&inv).unwrap().readings.is_empty(), "no file yet: nothing");
        let a: PciAddress = "0000:48:00.0".parse().unwrap();
        std::fs::write(&path, r#"{"devices": {"0000:48:00.0": {"xids": [79]}}}"#).unwrap();
        assert_eq!(s.read(&inv).unwrap().readings[&a].xids, [79]);
        assert!(s.read(&inv).unwrap().readings[&a].xids.is_empty(), "delivered once");
        std::fs::write(&path, r#"{"devices": {"0000:48:00.0": {"xids": [79], "resets": 1}}}"#)
            .unwrap();
        let r = &s.read(&inv).unwrap().readings[&a];
        assert!(r.reset && r.xids.is_empty());
        assert!(!s.read(&inv).unwrap().readings[&a].reset);
        std::fs::write(&path, r#"{"devices": {"gpu0": {}}}"#).unwrap();
        assert!(s.read(&inv).unwrap_err().contains("gpu0"));
    }
}
