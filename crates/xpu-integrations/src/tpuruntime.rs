//! TPU chips' utilisation and HBM from the TPU runtime's metrics service: while a program runs,
//! libtpu serves `tpu.monitoring.runtime.RuntimeMetricService` on localhost:8431 (the port the
//! GKE TPU Job in the seeds exposes). An `xpu-telemetry` [`Source`]: each read asks for the
//! TensorCore duty cycle and the HBM use and size, per chip (`device-id` attribute, the chip's
//! position on the host, matched to the inventory's TPU chips in PCI address order).
//!
//! Nothing runs on a host without TPU chips. With no TPU program running the port is closed:
//! the read fails (one warning) and the chips are exported without those values. A port that
//! accepts and never answers is cut off after the timeout, so a hung runtime delays nothing
//! but this source.

use std::collections::BTreeMap;
use std::time::Duration;

use xpu_core::{DeviceKind, Inventory, PciAddress};
use xpu_telemetry::{Reading, Report, Source};

use crate::tpuruntimepb::runtime_metric_service_client::RuntimeMetricServiceClient;
use crate::tpuruntimepb::{MetricRequest, attr_value, counter, gauge, metric};

/// Where libtpu serves its metrics.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8431";
/// TensorCore duty cycle over the last sample period, percent.
pub const DUTY_CYCLE: &str = "tpu.runtime.tensorcore.dutycycle.percent";
/// HBM in use, bytes.
pub const HBM_USED: &str = "tpu.runtime.hbm.memory.usage.bytes";
/// HBM in all, bytes.
pub const HBM_TOTAL: &str = "tpu.runtime.hbm.memory.total.bytes";
/// The attribute naming the chip a value is for.
const DEVICE_ID: &str = "device-id";
/// The largest answer read (a few values per chip).
const MAX_MESSAGE: usize = 1024 * 1024;

pub struct TpuRuntime {
    addr: String,
    timeout: Duration,
    rt: Option<tokio::runtime::Runtime>,
}

impl TpuRuntime {
    /// `addr` is `host:port`; each read gives up after `timeout` (the collector's interval or
    /// less).
    pub fn new(addr: impl Into<String>, timeout: Duration) -> Self {
        Self { addr: addr.into(), timeout, rt: None }
    }
}

fn value(m: &crate::tpuruntimepb::Metric) -> Option<f64> {
    match m.measure.as_ref()? {
        metric::Measure::Gauge(g) => match g.value.as_ref()? {
            gauge::Value::AsDouble(v) => Some(*v),
            gauge::Value::AsInt(v) => Some(*v as f64),
            gauge::Value::AsString(_) | gauge::Value::AsBool(_) => None,
        },
        metric::Measure::Counter(c) => match c.value.as_ref()? {
            counter::Value::AsDouble(v) => Some(*v),
            counter::Value::AsInt(v) => Some(*v as f64),
        },
    }
}

fn device_id(m: &crate::tpuruntimepb::Metric) -> Option<usize> {
    let a = m.attribute.as_ref().filter(|a| a.key == DEVICE_ID)?;
    match a.value.as_ref()?.attr.as_ref()? {
        attr_value::Attr::IntAttr(i) => usize::try_from(*i).ok(),
        attr_value::Attr::StringAttr(s) => s.parse().ok(),
        _ => None,
    }
}

/// (chip index, value) for every finite, non-negative value of `name`.
async fn fetch(
    client: &mut RuntimeMetricServiceClient<tonic::transport::Channel>,
    name: &str,
) -> Result<Vec<(usize, f64)>, String> {
    let req = MetricRequest { metric_name: name.to_owned(), skip_node_aggregation: false };
    let resp =
        client.get_runtime_metric(req).await.map_err(|s| format!("{name}: {}", s.message()))?;
    let metrics = resp.into_inner().metric.map(|m| m.metrics).unwrap_or_default();
    Ok(metrics
        .iter()
        .filter_map(|m| Some((device_id(m)?, value(m).filter(|v| v.is_finite() && *v >= 0.0)?)))
        .collect())
}

impl Source for TpuRuntime {
    fn name(&self) -> &'static str {
        "tpu"
    }

    fn read(&mut self, inventory: &Inventory) -> Result<Report, String> {
        let chips: Vec<PciAddress> = inventory
            .accelerators()
            .filter(|d| d.kind == DeviceKind::Tpu)
            .map(|d| d.address)
            .collect();
        if chips.is_empty() {
            return Ok(Report::default());
        }
        if self.rt.is_none() {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start a runtime for the TPU metrics client: {e}"))?;
            self.rt = Some(rt);
        }
        let Some(rt) = self.rt.as_ref() else { return Err("no runtime".to_owned()) };
        let addr = self.addr.clone();
        let timeout = self.timeout;
        let ask = async move {
            let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .map_err(|e| format!("bad address {addr:?}: {e}"))?
                .connect_timeout(timeout);
            let channel = endpoint.connect().await.map_err(|e| {
                format!("TPU runtime metrics at {addr}: not serving ({e}); no TPU program running?")
            })?;
            let mut client =
                RuntimeMetricServiceClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
            let duty = fetch(&mut client, DUTY_CYCLE).await?;
            let used = fetch(&mut client, HBM_USED).await?;
            let total = fetch(&mut client, HBM_TOTAL).await?;
            Ok::<_, String>((duty, used, total))
        };
        let (duty, used, total) =
            rt.block_on(async { tokio::time::timeout(timeout, ask).await }).map_err(|_| {
                format!("TPU runtime metrics at {}: no answer within {timeout:?}", self.addr)
            })??;
        let mut readings: BTreeMap<PciAddress, Reading> = BTreeMap::new();
        let mut warnings = Vec::new();
        let mut put = |values: Vec<(usize, f64)>, f: &dyn Fn(&mut Reading, f64)| {
            for (i, v) in values {
                match chips.get(i) {
                    Some(a) => f(readings.entry(*a).or_default(), v),
                    None => warnings.push(format!(
                        "TPU runtime metrics: device-id {i} but this host has {} TPU chips",
                        chips.len()
                    )),
                }
            }
        };
        put(duty, &|r, v| r.utilization_percent = Some(v.min(100.0)));
        put(used, &|r, v| r.memory_used_bytes = Some(v as u64));
        put(total, &|r, v| r.memory_total_bytes = Some(v as u64));
        Ok(Report { readings, warnings })
    }
}
