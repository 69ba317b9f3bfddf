//! Prometheus exposition of a [`Snapshot`] through `prometheus-client` (OpenMetrics text).
//!
//! xpu's series (`xpu_device_*`) carry `kind`, `vendor`, `model`, `uuid`, `pci_address` and
//! `index` (the device's position among its kind, as in `XPU_VISIBLE_DEVICES=gpu:N`), plus who
//! holds it (`namespace`, `pod`, `container` from the kubelet, or `job`, `task` from
//! `xpu serve`). NVIDIA GPUs are also exported under DCGM exporter's names and labels (`gpu`,
//! `UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname`, and `namespace`/`pod`/`container`
//! when known) with DCGM's units (MiB for framebuffer memory, KB/s for PCIe), so dashboards
//! built for `dcgm-exporter` keep working.

use prometheus_client::collector::Collector as PromCollector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::collect::{Collector, DeviceSample, Holder, Snapshot};

type Labels = Vec<(&'static str, String)>;

fn xpu_labels(d: &DeviceSample) -> Labels {
    let mut l = vec![
        ("kind", d.kind.as_str().to_owned()),
        ("vendor", d.vendor.clone()),
        ("model", d.model.clone()),
        ("uuid", d.uuid.clone().unwrap_or_default()),
        ("pci_address", d.address.to_string()),
        ("index", d.index.to_string()),
    ];
    holder_labels(d, &mut l);
    l
}

fn holder_labels(d: &DeviceSample, l: &mut Labels) {
    match &d.holder {
        Some(Holder::Pod { namespace, pod, container }) => {
            l.push(("namespace", namespace.clone()));
            l.push(("pod", pod.clone()));
            l.push(("container", container.clone()));
        }
        Some(Holder::Task { job, task }) => {
            l.push(("job", job.clone()));
            l.push(("task", task.clone()));
        }
        None => {}
    }
}

fn dcgm_labels(d: &DeviceSample, hostname: &str) -> Labels {
    let a = d.address;
    let mut l = vec![
        ("gpu", d.vendor_index.to_string()),
        ("UUID", d.uuid.clone().unwrap_or_default()),
        // NVML's bus id form: eight domain digits, upper-case hex.
        ("pci_bus_id", format!("{:08X}:{:02X}:{:02X}.{:X}", a.domain, a.bus, a.device, a.function)),
        ("device", format!("nvidia{}", d.vendor_index)),
        ("modelName", d.model.clone()),
        ("Hostname", hostname.to_owned()),
    ];
    holder_labels(d, &mut l);
    l
}

/// One gauge family: every device that has a value.
fn gauge<T>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(Labels, Option<T>)],
) -> Result<(), std::fmt::Error>
where
    ConstGauge<T>: EncodeMetric,
    T: Copy,
{
    if rows.iter().all(|(_, v)| v.is_none()) {
        return Ok(());
    }
    let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        if let Some(v) = v {
            ConstGauge::new(*v).encode(family.encode_family(labels)?)?;
        }
    }
    Ok(())
}

/// MIG instances under DCGM's labels for one: the GPU's `gpu`, `UUID` and `pci_bus_id`, the
/// instance's `GPU_I_ID` and `GPU_I_PROFILE`, and xpu's `compute_instance`, `start` (first
/// memory slice), `mig_uuid` and `made_by` (`xpu`, or `other` for the admin's).
fn encode_mig(snap: &Snapshot, enc: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
    let rows: Vec<(Labels, Option<u64>)> = snap
        .mig
        .iter()
        .map(|m| {
            let a = m.gpu;
            let l: Labels = vec![
                ("gpu", m.gpu_index.map(|i| i.to_string()).unwrap_or_default()),
                ("UUID", m.gpu_uuid.clone().unwrap_or_default()),
                (
                    "pci_bus_id",
                    format!("{:08X}:{:02X}:{:02X}.{:X}", a.domain, a.bus, a.device, a.function),
                ),
                ("GPU_I_ID", m.gi.to_string()),
                ("GPU_I_PROFILE", m.profile.to_owned()),
                ("compute_instance", m.ci.to_string()),
                ("start", m.start.to_string()),
                ("mig_uuid", m.uuid.clone().unwrap_or_default()),
                ("made_by", if m.by_xpu { "xpu" } else { "other" }.to_owned()),
            ];
            (l, m.memory_bytes)
        })
        .collect();
    let info: Vec<(Labels, Option<i64>)> = rows.iter().map(|(l, _)| (l.clone(), Some(1))).collect();
    gauge(enc, "xpu_mig_instance_info", "A MIG instance of this node's GPUs (always 1).", &info)?;
    let memory: Vec<(Labels, Option<i64>)> =
        rows.into_iter().map(|(l, b)| (l, b.and_then(|b| i64::try_from(b).ok()))).collect();
    gauge(
        enc,
        "xpu_mig_instance_memory_bytes",
        "The instance's memory, by its profile (NVML's size where xpu's table has it measured).",
        &memory,
    )
}

/// Renders the snapshot's families into `enc`.
pub fn encode_snapshot(
    snap: &Snapshot,
    enc: &mut DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    let devs = &snap.devices;
    let l: Vec<Labels> = devs.iter().map(xpu_labels).collect();
    let rows = |f: &dyn Fn(&DeviceSample) -> Option<f64>| -> Vec<(Labels, Option<f64>)> {
        devs.iter().zip(&l).map(|(d, l)| (l.clone(), f(d))).collect()
    };
    let u = |v: Option<u64>| v.map(|v| v as f64);

    gauge(
        enc,
        "xpu_device_info",
        "An accelerator of this node (always 1).",
        &rows(&|_| Some(1.0)),
    )?;
    // Health: 1 healthy, 0 not; `reason` says why not.
    let health: Vec<(Labels, Option<f64>)> = devs
        .iter()
        .zip(&l)
        .map(|(d, l)| {
            let mut l = l.clone();
            l.push(("reason", d.unhealthy.clone().unwrap_or_default()));
            (l, Some(if d.unhealthy.is_some() { 0.0 } else { 1.0 }))
        })
        .collect();
    gauge(
        enc,
        "xpu_device_healthy",
        "1 if the device may take work; 0 with the reason if not.",
        &health,
    )?;
    gauge(
        enc,
        "xpu_device_utilization_percent",
        "Busy time of the compute engines over the last sample period (0-100).",
        &rows(&|d| d.reading.utilization_percent),
    )?;
    gauge(
        enc,
        "xpu_device_memory_used_bytes",
        "Device memory in use.",
        &rows(&|d| u(d.reading.memory_used_bytes)),
    )?;
    gauge(
        enc,
        "xpu_device_memory_total_bytes",
        "Device memory in total.",
        &rows(&|d| u(d.reading.memory_total_bytes)),
    )?;
    gauge(enc, "xpu_device_power_watts", "Power draw.", &rows(&|d| d.reading.power_watts))?;
    gauge(
        enc,
        "xpu_device_temperature_celsius",
        "Die (edge) temperature.",
        &rows(&|d| d.reading.temperature_celsius),
    )?;
    gauge(
        enc,
        "xpu_device_sm_clock_mhz",
        "Compute (SM / shader) clock.",
        &rows(&|d| d.reading.sm_clock_mhz.map(f64::from)),
    )?;
    gauge(
        enc,
        "xpu_device_memory_clock_mhz",
        "Memory clock.",
        &rows(&|d| d.reading.memory_clock_mhz.map(f64::from)),
    )?;
    gauge(
        enc,
        "xpu_device_pcie_tx_bytes_per_second",
        "PCIe transmit throughput.",
        &rows(&|d| u(d.reading.pcie_tx_bytes_per_second)),
    )?;
    gauge(
        enc,
        "xpu_device_pcie_rx_bytes_per_second",
        "PCIe receive throughput.",
        &rows(&|d| u(d.reading.pcie_rx_bytes_per_second)),
    )?;
    gauge(
        enc,
        "xpu_device_ecc_corrected_errors",
        "Corrected memory errors since the driver loaded (NVML volatile SBE, amdgpu RAS ce).",
        &rows(&|d| u(d.reading.ecc_corrected)),
    )?;
    gauge(
        enc,
        "xpu_device_ecc_uncorrected_errors",
        "Uncorrected memory errors since the driver loaded (NVML volatile DBE, amdgpu RAS ue).",
        &rows(&|d| u(d.reading.ecc_uncorrected)),
    )?;
    gauge(
        enc,
        "xpu_device_last_xid",
        "The last XID the device reported.",
        &rows(&|d| d.last_xid.map(|x| x as f64)),
    )?;
    {
        let mut family = enc.encode_descriptor(
            "xpu_device_xid_errors",
            "XID events seen since the exporter started.",
            None,
            MetricType::Counter,
        )?;
        for (d, l) in devs.iter().zip(&l) {
            ConstCounter::new(d.xid_count).encode(family.encode_family(l)?)?;
        }
    }
    {
        let mut family = enc.encode_descriptor(
            "xpu_exporter_source_up",
            "1 if the source's last read is fresh (within two intervals).",
            None,
            MetricType::Gauge,
        )?;
        for (name, up) in &snap.sources {
            let labels = [("source", *name)];
            ConstGauge::new(i64::from(*up)).encode(family.encode_family(&labels)?)?;
        }
    }
    encode_mig(snap, enc)?;
    encode_dcgm(snap, enc)
}

fn encode_dcgm(snap: &Snapshot, enc: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
    let host = snap.hostname.clone().unwrap_or_default();
    let nv: Vec<&DeviceSample> = snap
        .devices
        .iter()
        .filter(|d| d.vendor == "nvidia" && d.kind == xpu_core::DeviceKind::Gpu)
        .collect();
    let l: Vec<Labels> = nv.iter().map(|d| dcgm_labels(d, &host)).collect();
    let rows = |f: &dyn Fn(&DeviceSample) -> Option<f64>| -> Vec<(Labels, Option<f64>)> {
        nv.iter().zip(&l).map(|(d, l)| (l.clone(), f(d))).collect()
    };
    let mib = |v: Option<u64>| v.map(|b| (b / (1024 * 1024)) as f64);
    gauge(
        enc,
        "DCGM_FI_DEV_GPU_UTIL",
        "GPU utilization (in %).",
        &rows(&|d| d.reading.utilization_percent),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_FB_USED",
        "Framebuffer memory used (in MiB).",
        &rows(&|d| mib(d.reading.memory_used_bytes)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_FB_FREE",
        "Framebuffer memory free (in MiB).",
        &rows(&|d| match (d.reading.memory_total_bytes, d.reading.memory_used_bytes) {
            (Some(t), Some(u)) => mib(Some(t.saturating_sub(u))),
            _ => None,
        }),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_FB_TOTAL",
        "Framebuffer memory total (in MiB).",
        &rows(&|d| mib(d.reading.memory_total_bytes)),
    )?;
    gauge(enc, "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", &rows(&|d| d.reading.power_watts))?;
    gauge(
        enc,
        "DCGM_FI_DEV_GPU_TEMP",
        "GPU temperature (in C).",
        &rows(&|d| d.reading.temperature_celsius),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_SM_CLOCK",
        "SM clock frequency (in MHz).",
        &rows(&|d| d.reading.sm_clock_mhz.map(f64::from)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_MEM_CLOCK",
        "Memory clock frequency (in MHz).",
        &rows(&|d| d.reading.memory_clock_mhz.map(f64::from)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
        "PCIe TX throughput (in KB/s).",
        &rows(&|d| d.reading.pcie_tx_bytes_per_second.map(|b| (b / 1024) as f64)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
        "PCIe RX throughput (in KB/s).",
        &rows(&|d| d.reading.pcie_rx_bytes_per_second.map(|b| (b / 1024) as f64)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Total number of single-bit volatile ECC errors.",
        &rows(&|d| d.reading.ecc_corrected.map(|v| v as f64)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
        &rows(&|d| d.reading.ecc_uncorrected.map(|v| v as f64)),
    )?;
    gauge(
        enc,
        "DCGM_FI_DEV_XID_ERRORS",
        "Value of the last XID error encountered.",
        &rows(&|d| Some(d.last_xid.unwrap_or(0) as f64)),
    )?;
    Ok(())
}

/// Adapts a [`Collector`] to `prometheus-client`'s registry: each scrape encodes the snapshot.
#[derive(Clone)]
pub struct Exposition(pub Collector);

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exposition")
    }
}

impl PromCollector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_snapshot(&self.0.snapshot(), &mut encoder)
    }
}

/// A registry holding the collector's families.
pub fn registry(collector: &Collector) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(Exposition(collector.clone())));
    r
}

/// The whole OpenMetrics exposition (ending in `# EOF`).
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // Writing into a String cannot fail; an error here would be an encoder bug, and the partial
    // text is still the best answer to give.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::warn!("telemetry: encoding metrics: {e}");
    }
    out
}

/// The device families without `# EOF`, to append to another exposition (`xpu serve`).
pub fn render_families(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    if let Err(e) = prometheus_client::encoding::text::encode_registry(&mut out, registry) {
        tracing::warn!("telemetry: encoding metrics: {e}");
    }
    out
}

/// The collector's device families without `# EOF`, to append to another exposition (`xpu
/// serve`'s `/metrics`).
pub fn render_collector_families(collector: &Collector) -> String {
    render_families(&registry(collector))
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug)]
struct Fixed(Snapshot);

impl PromCollector for Fixed {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_snapshot(&self.0, &mut encoder)
    }
}

/// The exposition of one snapshot (`xpu exporter --once`, the benchmark).
pub fn render_snapshot(snap: &Snapshot) -> String {
    let mut r = Registry::default();
    r.register_collector(Box::new(Fixed(snap.clone())));
    render(&r)
}
