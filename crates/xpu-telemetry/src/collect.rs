//! The collector: sources read on their own threads, a scrape renders the last snapshot.
//!
//! One thread re-discovers the host's accelerators every interval (a device that disappears is
//! reported as vanished); one thread per [`Source`] reads every interval and folds its readings
//! into the [`HealthBook`]. A source whose last good read is older than two intervals (hung, or
//! failing) has its values dropped from the snapshot, so stale numbers are never exported, and
//! `xpu_exporter_source_up{source}` says 0. Warnings (a failing source, a garbage file) are
//! logged once each. Threads end when the last [`Collector`] handle is dropped (a thread stuck
//! in a hung source ends when that read returns).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread;
use std::time::{Duration, Instant};

use xpu_core::{DeviceKind, Inventory, PciAddress, PciDevice};
use xpu_host::Root;

use crate::health::HealthBook;
use crate::{Reading, Report, Source};

/// Who holds a device now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// From the kubelet's PodResources API.
    Pod { namespace: String, pod: String, container: String },
    /// From `xpu serve`.
    Task { job: String, task: String },
}

/// One device as a scrape sees it.
#[derive(Debug, Clone)]
pub struct DeviceSample {
    pub address: PciAddress,
    pub kind: DeviceKind,
    /// `nvidia`, `amd`, `google`...
    pub vendor: String,
    pub vendor_id: Option<u16>,
    pub model: String,
    pub uuid: Option<String>,
    /// Position among this host's devices of the same kind, in PCI address order: the index
    /// of `XPU_VISIBLE_DEVICES=gpu:N` and of the CDI names.
    pub index: usize,
    /// Position among this vendor's devices of this kind (NVML's and DCGM's `gpu` index).
    pub vendor_index: usize,
    /// Merged readings of every source that is up; default (all unknown) otherwise.
    pub reading: Reading,
    /// `None`: healthy. Else why not.
    pub unhealthy: Option<String>,
    pub xid_count: u64,
    pub last_xid: Option<u64>,
    pub holder: Option<Holder>,
}

/// A MIG instance as a scrape sees it, with its GPU's identity (DCGM names an instance by its
/// GPU's `gpu`, `UUID` and `pci_bus_id` and the instance's `GPU_I_ID` and `GPU_I_PROFILE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigSample {
    pub gpu: PciAddress,
    /// The GPU's NVML index (DCGM's `gpu`), when the GPU is in the inventory.
    pub gpu_index: Option<usize>,
    pub gpu_uuid: Option<String>,
    pub gi: u32,
    pub ci: u32,
    pub profile: &'static str,
    pub start: u8,
    pub uuid: Option<String>,
    pub by_xpu: bool,
    /// The profile's memory by NVIDIA's tables (NVML's where measured).
    pub memory_bytes: Option<u64>,
}

#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub hostname: Option<String>,
    pub devices: Vec<DeviceSample>,
    /// MIG instances, when the collector reads a MIG control ([`Collector::with_mig`]).
    pub mig: Vec<MigSample>,
    /// Every source by name and whether its last read is fresh.
    pub sources: Vec<(&'static str, bool)>,
}

struct SourceState {
    last_ok: Option<Instant>,
    report: Report,
}

#[derive(Default)]
struct State {
    inventory: Option<Inventory>,
    /// Every accelerator ever seen (a vanished one keeps its identity for the report).
    seen: BTreeMap<PciAddress, PciDevice>,
    sources: BTreeMap<&'static str, SourceState>,
    health: HealthBook,
    warned: HashSet<String>,
    holders: BTreeMap<PciAddress, Holder>,
    /// The MIG control's last reading.
    mig: Vec<crate::mig::MigGpu>,
}

struct Shared {
    interval: Duration,
    /// DCGM's `Hostname` label: the node's name, read once under the root.
    hostname: Option<String>,
    /// Devices added to every discovery (`xpu serve --devices`' fake accelerators).
    extra: Vec<PciDevice>,
    state: Mutex<State>,
}

/// A handle to the running collection. Cheap to clone.
#[derive(Clone)]
pub struct Collector {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Collector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collector").field("interval", &self.shared.interval).finish_non_exhaustive()
    }
}

impl Collector {
    /// Starts discovery under `root` and each source, every `interval`.
    pub fn start(root: Root, interval: Duration, sources: Vec<Box<dyn Source>>) -> Collector {
        Self::start_with(root, interval, sources, Vec::new())
    }

    /// [`Collector::start`], with `extra` devices added to every discovery (devices the caller
    /// knows of that sysfs does not show, such as `xpu serve --devices`' fake ones).
    pub fn start_with(
        root: Root,
        interval: Duration,
        sources: Vec<Box<dyn Source>>,
        extra: Vec<PciDevice>,
    ) -> Collector {
        let shared = Arc::new(Shared {
            interval,
            hostname: xpu_host::discover::hostname(&root),
            extra,
            state: Mutex::new(State::default()),
        });
        // The first inventory before any source reads, so the first scrape has the devices.
        refresh_inventory(&shared, &root);
        let weak = Arc::downgrade(&shared);
        spawn("xpu-telemetry-discover", move || discovery_loop(&weak, &root));
        for source in sources {
            let weak = Arc::downgrade(&shared);
            spawn(&format!("xpu-telemetry-{}", source.name()), move || source_loop(&weak, source));
        }
        Collector { shared }
    }

    pub fn interval(&self) -> Duration {
        self.shared.interval
    }

    /// Also reads `control`'s MIG instances, every `every` (on a thread of its own: `nvidia-smi`
    /// takes its time); a failed read keeps the last one, with one warning.
    pub fn with_mig(self, control: Arc<dyn crate::mig::MigControl>, every: Duration) -> Collector {
        let weak = Arc::downgrade(&self.shared);
        spawn("xpu-telemetry-mig", move || {
            loop {
                let result = control.gpus();
                let Some(shared) = weak.upgrade() else { return };
                let mut st = lock(&shared);
                match result {
                    Ok(gpus) => st.mig = gpus,
                    Err(e) => warn_once(&mut st, &format!("MIG: {e}")),
                }
                drop(st);
                drop(shared);
                thread::sleep(every);
            }
        });
        self
    }

    /// Replaces who holds which device (the PodResources poller, `xpu serve`).
    pub fn set_holders(&self, holders: BTreeMap<PciAddress, Holder>) {
        lock(&self.shared).holders = holders;
    }

    /// The devices now, as a scrape renders them. Takes the lock briefly; never waits on a
    /// source.
    pub fn snapshot(&self) -> Snapshot {
        snapshot(&self.shared)
    }

    /// The host as the last discovery found it (drivers included); `None` before the first.
    pub fn inventory(&self) -> Option<Inventory> {
        lock(&self.shared).inventory.clone()
    }

    /// Addresses of the devices that are unhealthy now, with why: every device a source
    /// reported (also ones the inventory does not list, such as `xpu serve`'s fake devices in
    /// tests) and every device that vanished from the inventory.
    pub fn unhealthy(&self) -> BTreeMap<PciAddress, String> {
        let st = lock(&self.shared);
        let mut out = st.health.unhealthy();
        if let Some(inv) = &st.inventory {
            for addr in st.seen.keys().filter(|a| inv.device(a).is_none()) {
                out.insert(*addr, "vanished from the PCI bus".to_owned());
            }
        }
        out
    }
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, State> {
    // A poisoned lock means a panic elsewhere mid-update; the state is still usable.
    shared.state.lock().unwrap_or_else(PoisonError::into_inner)
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = thread::Builder::new().name(name.to_owned()).spawn(f) {
        tracing::warn!("telemetry: cannot start thread {name}: {e}");
    }
}

fn warn_once(state: &mut State, text: &str) {
    // Keyed by the text before the values (`path: expected a number, found ...`), so a file
    // whose garbage changes each read is still one warning.
    let key = text.split(", found").next().unwrap_or(text).to_owned();
    if state.warned.insert(key) {
        tracing::warn!("telemetry: {text}");
    }
}

fn refresh_inventory(shared: &Shared, root: &Root) {
    match xpu_host::discover::discover_nodes(root, None) {
        Ok(mut inv) => {
            if !shared.extra.is_empty() {
                inv.devices.extend(shared.extra.iter().cloned());
                inv.devices.sort_by_key(|d| d.address);
            }
            let mut st = lock(shared);
            for d in inv.accelerators() {
                st.seen.insert(d.address, d.clone());
            }
            st.inventory = Some(inv);
        }
        Err(e) => {
            let mut st = lock(shared);
            warn_once(&mut st, &format!("discovery under {}: {e}", root.base().display()));
        }
    }
}

fn discovery_loop(weak: &Weak<Shared>, root: &Root) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        let interval = shared.interval;
        drop(shared);
        thread::sleep(interval);
        let Some(shared) = weak.upgrade() else { return };
        refresh_inventory(&shared, root);
    }
}

fn source_loop(weak: &Weak<Shared>, mut source: Box<dyn Source>) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        let interval = shared.interval;
        let inventory = lock(&shared).inventory.clone().unwrap_or_default();
        // Not holding the Arc while the source reads: a hung read must not keep the collector
        // alive.
        drop(shared);
        let started = Instant::now();
        let result = source.read(&inventory);
        let Some(shared) = weak.upgrade() else { return };
        fold(&mut lock(&shared), source.name(), result, started);
        drop(shared);
        thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}

/// Folds one read of `name` into the state.
fn fold(st: &mut State, name: &'static str, result: Result<Report, String>, at: Instant) {
    match result {
        Ok(report) => {
            for w in &report.warnings {
                warn_once(st, &format!("{name}: {w}"));
            }
            for (addr, r) in &report.readings {
                if let Some(reason) = st.health.observe(*addr, r) {
                    tracing::warn!("telemetry: device {addr} is unhealthy: {reason}");
                }
            }
            st.sources.insert(name, SourceState { last_ok: Some(at), report });
        }
        Err(e) => {
            warn_once(st, &format!("{name}: {e}; exporting the other sources"));
            let entry = st
                .sources
                .entry(name)
                .or_insert_with(|| SourceState { last_ok: None, report: Report::default() });
            entry.report = Report::default();
        }
    }
}

fn merge(into: &mut Reading, from: &Reading) {
    macro_rules! take {
        ($($f:ident),*) => { $( if from.$f.is_some() { into.$f = from.$f.clone(); } )* };
    }
    take!(
        utilization_percent,
        memory_used_bytes,
        memory_total_bytes,
        power_watts,
        temperature_celsius,
        sm_clock_mhz,
        memory_clock_mhz,
        pcie_tx_bytes_per_second,
        pcie_rx_bytes_per_second,
        ecc_corrected,
        ecc_uncorrected,
        uuid,
        model
    );
    into.lost |= from.lost;
}

fn snapshot(shared: &Shared) -> Snapshot {
    let st = &lock(shared);
    let interval = shared.interval;
    let fresh = |s: &SourceState| s.last_ok.is_some_and(|t| t.elapsed() <= interval * 2);
    let present: BTreeSet<PciAddress> = st
        .inventory
        .as_ref()
        .map(|inv| inv.accelerators().map(|d| d.address).collect())
        .unwrap_or_default();
    let mut per_kind: BTreeMap<DeviceKind, usize> = BTreeMap::new();
    let mut per_vendor: BTreeMap<(DeviceKind, Option<u16>), usize> = BTreeMap::new();
    let mut devices = Vec::with_capacity(st.seen.len());
    for (addr, d) in &st.seen {
        let index = next(&mut per_kind, d.kind);
        let vendor_index = next(&mut per_vendor, (d.kind, d.vendor_id));
        let mut reading = Reading::default();
        for s in st.sources.values().filter(|s| fresh(s)) {
            if let Some(r) = s.report.readings.get(addr) {
                merge(&mut reading, r);
            }
        }
        let (xid_count, last_xid) = st.health.xids(addr);
        devices.push(DeviceSample {
            address: *addr,
            kind: d.kind,
            vendor: vendor_name(d),
            vendor_id: d.vendor_id,
            model: reading
                .model
                .clone()
                .or_else(|| d.product.clone())
                .or_else(|| d.device_name.clone())
                .unwrap_or_default(),
            uuid: reading.uuid.clone().or_else(|| d.uuid.clone()),
            index,
            vendor_index,
            unhealthy: st.health.reason(addr, present.contains(addr)),
            xid_count,
            last_xid,
            holder: st.holders.get(addr).cloned(),
            reading,
        });
    }
    let mig = mig_samples(&devices, &st.mig);
    Snapshot {
        hostname: shared.hostname.clone(),
        devices,
        mig,
        sources: st.sources.iter().map(|(n, s)| (*n, fresh(s))).collect(),
    }
}

/// The MIG instances of `gpus`, each with its GPU's identity from `devices`.
pub fn mig_samples(devices: &[DeviceSample], gpus: &[crate::mig::MigGpu]) -> Vec<MigSample> {
    let mut mig = Vec::new();
    for g in gpus {
        let dev = devices.iter().find(|d| d.address == g.address);
        let model = xpu_core::mig::Model::of(&g.product).ok();
        for i in &g.instances {
            let memory_bytes = model
                .and_then(|m| m.profile(i.profile).ok())
                .map(|p| p.memory_mib.map_or(u64::from(p.memory_gb) << 30, |m| u64::from(m) << 20));
            mig.push(MigSample {
                gpu: g.address,
                gpu_index: dev.map(|d| d.vendor_index),
                gpu_uuid: dev.and_then(|d| d.uuid.clone()),
                gi: i.gi,
                ci: i.ci,
                profile: i.profile,
                start: i.start,
                uuid: i.uuid.clone(),
                by_xpu: i.by_xpu,
                memory_bytes,
            });
        }
    }
    mig
}

fn next<K: Ord>(counts: &mut BTreeMap<K, usize>, key: K) -> usize {
    let n = counts.entry(key).or_insert(0);
    *n += 1;
    *n - 1
}

fn vendor_name(d: &PciDevice) -> String {
    use xpu_core::accel::{VENDOR_AMD, VENDOR_GOOGLE, VENDOR_HABANA, VENDOR_INTEL, VENDOR_NVIDIA};
    match d.vendor_id {
        Some(VENDOR_NVIDIA) => "nvidia".to_owned(),
        Some(VENDOR_AMD) => "amd".to_owned(),
        Some(VENDOR_GOOGLE) => "google".to_owned(),
        Some(VENDOR_HABANA) => "habana".to_owned(),
        Some(VENDOR_INTEL) => "intel".to_owned(),
        Some(v) => format!("{v:04x}"),
        None => "unknown".to_owned(),
    }
}

/// One collection pass without threads: discovery then each source once, in order. For the
/// benchmark and for `xpu exporter --once`.
pub fn collect_once(root: &Root, sources: &mut [Box<dyn Source>]) -> Snapshot {
    let shared = Shared {
        interval: Duration::from_secs(3600),
        hostname: xpu_host::discover::hostname(root),
        extra: Vec::new(),
        state: Mutex::new(State::default()),
    };
    refresh_inventory(&shared, root);
    let inventory = lock(&shared).inventory.clone().unwrap_or_default();
    for s in sources.iter_mut() {
        let at = Instant::now();
        let r = s.read(&inventory);
        fold(&mut lock(&shared), s.name(), r, at);
    }
    snapshot(&shared)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A collector given a MIG control reads it on a thread of its own; its snapshot carries
    /// each instance with its GPU's index and the profile's memory, and follows a change.
    #[test]
    fn the_mig_thread_feeds_the_snapshot() {
        let fx = xpu_testkit::hosts::h200_4x().build();
        let root = Root::new(fx.root()).unwrap();
        let first = xpu_host::discover(&root, &Default::default())
            .unwrap()
            .accelerators()
            .next()
            .unwrap()
            .address;
        let mig = crate::mig::FakeMig::new([(first, "NVIDIA H200", true)]);
        mig.create_outside(first, "3g.71gb", 4).unwrap();
        let c = Collector::start(root, Duration::from_millis(20), Vec::new())
            .with_mig(Arc::new(mig.clone()), Duration::from_millis(20));
        let seen = |n: usize| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if c.snapshot().mig.len() == n {
                    return true;
                }
                thread::sleep(Duration::from_millis(10));
            }
            false
        };
        assert!(seen(1), "{:?}", c.snapshot().mig);
        let m = &c.snapshot().mig[0];
        assert_eq!((m.gpu, m.gpu_index, m.profile, m.start), (first, Some(0), "3g.71gb", 4));
        assert_eq!(m.memory_bytes, Some(71_424 << 20));
        mig.create_outside(first, "1g.18gb", 0).unwrap();
        assert!(seen(2), "{:?}", c.snapshot().mig);
    }

    #[test]
    fn a_failing_source_and_a_garbage_file_warn_once_each() {
        let mut st = State::default();
        let now = Instant::now();
        for _ in 0..3 {
            fold(&mut st, "nvml", Err("no NVML: libnvidia-ml.so.1: cannot open".to_owned()), now);
            let report = Report {
                readings: BTreeMap::new(),
                // The garbage differs each read; the file is the same.
                warnings: vec![format!(
                    "/sys/x/gpu_busy_percent: expected a number, found {now:?}"
                )],
            };
            fold(&mut st, "amd", Ok(report), now);
        }
        assert_eq!(st.warned.len(), 2, "{:?}", st.warned);
        // The failing source has no values, the other keeps its report.
        assert!(st.sources["nvml"].last_ok.is_none());
        assert!(st.sources["amd"].last_ok.is_some());
    }
}
