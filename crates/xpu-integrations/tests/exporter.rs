//! `xpu exporter` end to end over HTTP: fixture hosts with amdgpu sysfs/hwmon values and a
//! fake NVML give exactly those values under xpu's and DCGM's names, and the text parses with
//! Prometheus' own parser (the `prometheus_client` Python package); garbage files and a failing
//! NVML leave the rest exported; a test kubelet's PodResources labels devices with their pods;
//! an XID 79 turns the GPU Unhealthy in the device plugin's ListAndWatch and in the metrics.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_stream::StreamExt;
use xpu_core::PciAddress;
use xpu_host::Root;
use xpu_integrations::deviceplugin::{self, Config};
use xpu_integrations::exporter;
use xpu_integrations::pb;
use xpu_integrations::podresources::{self, TestKubelet};
use xpu_integrations::podresourcespb::{ContainerDevices, ContainerResources, PodResources};
use xpu_integrations::selector::Resource;
use xpu_integrations::testkubelet;
use xpu_telemetry::collect::Collector;
use xpu_telemetry::nvml::FakeNvml;
use xpu_telemetry::{Reading, Source};
use xpu_testkit::{Fixture, hosts};

const WAIT: Duration = Duration::from_secs(10);
const INTERVAL: Duration = Duration::from_millis(100);

fn addr(bus: u8) -> PciAddress {
    PciAddress { domain: 0, bus, device: 0, function: 0 }
}

/// Serves `collector` on a free port; returns the address and a stop handle.
async fn serve(collector: Collector) -> (std::net::SocketAddr, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(exporter::serve(listener, collector, async {
        // Sent or dropped (the test ended): either way the server stops.
        let _ = stopped.await;
    }));
    (at, stop)
}

/// GET /metrics over plain HTTP/1.1; returns (content type, body).
async fn scrape(at: std::net::SocketAddr) -> (String, String) {
    let mut s = tokio::net::TcpStream::connect(at).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut buf)).await.unwrap().unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let ctype = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type: ").map(str::to_owned))
        .unwrap_or_default();
    (ctype, body.to_owned())
}

/// The value of the sample `name{...}` whose labels include every `want` pair.
fn value(text: &str, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, v) = l.rsplit_once(' ')?;
        let (n, labels) = series.split_once('{').unwrap_or((series, ""));
        if n != name {
            return None;
        }
        want.iter()
            .all(|(k, val)| labels.contains(&format!("{k}=\"{val}\"")))
            .then(|| v.parse().ok())
            .flatten()
    })
}

/// Parses `text` with the Prometheus project's Python client (its OpenMetrics parser) and
/// returns how many samples it read. Fails with the install command when it is missing.
fn prometheus_parse(text: &str) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("metrics.txt");
    std::fs::write(&f, text).unwrap();
    // Debian's interpreter, where python3-prometheus-client installs (a pyenv or venv python3
    // earlier on PATH would not see it).
    let out = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(
            "import sys\n\
             from prometheus_client.openmetrics.parser import text_string_to_metric_families as p\n\
             n = sum(len(f.samples) for f in p(open(sys.argv[1]).read()))\n\
             print(n)",
        )
        .arg(&f)
        .output()
        .expect("/usr/bin/python3 (run scripts/install-test-deps)");
    assert!(
        out.status.success(),
        "Prometheus' parser refused the exposition (if it says No module named prometheus_client, \
         run scripts/install-test-deps, which installs python3-prometheus-client): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// The sample lines of an exposition: what the parser must have read, every one.
fn samples(text: &str) -> usize {
    text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).count()
}

fn write(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

fn amd_values(fx: &Fixture, bus: u8, busy: &str, temp_milli: &str) {
    let dev = fx.device_dir(&addr(bus).to_string());
    write(&dev.join("gpu_busy_percent"), &format!("{busy}\n"));
    write(&dev.join("mem_info_vram_used"), "3221225472\n");
    write(&dev.join("mem_info_vram_total"), "206158430208\n");
    let hw = dev.join("hwmon/hwmon4");
    write(&hw.join("power1_average"), "245000000\n");
    write(&hw.join("temp1_input"), &format!("{temp_milli}\n"));
    write(&hw.join("freq1_input"), "2100000000\n");
    write(&hw.join("freq2_input"), "1300000000\n");
    write(&dev.join("ras/umc_err_count"), "ue: 0\nce: 4\n");
}

fn nvml_reading() -> Reading {
    Reading {
        utilization_percent: Some(88.0),
        memory_used_bytes: Some(10 * 1024 * 1024 * 1024),
        memory_total_bytes: Some(40 * 1024 * 1024 * 1024),
        power_watts: Some(312.5),
        temperature_celsius: Some(61.0),
        sm_clock_mhz: Some(1410),
        memory_clock_mhz: Some(1215),
        pcie_tx_bytes_per_second: Some(2 * 1024 * 1024),
        pcie_rx_bytes_per_second: Some(1024 * 1024),
        ecc_corrected: Some(2),
        ecc_uncorrected: Some(0),
        uuid: Some("GPU-fake-0".to_owned()),
        model: Some("NVIDIA A100-SXM4-40GB".to_owned()),
        ..Reading::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amd_sysfs_values_are_exported_exactly_and_garbage_is_skipped() {
    let fx = hosts::mi300x().build();
    let bus = hosts::MI300X_BUSES;
    amd_values(&fx, bus[0], "37", "51250");
    // Garbage in the second GPU's files: its other values still come through.
    amd_values(&fx, bus[1], "lots", "\u{221e}");
    write(&fx.device_dir(&addr(bus[1]).to_string()).join("ras/umc_err_count"), "broken");
    let root = Root::new(fx.root()).unwrap();
    let collector =
        Collector::start(root.clone(), INTERVAL, exporter::default_sources(&root, INTERVAL));
    let (at, _stop) = serve(collector).await;
    tokio::time::sleep(INTERVAL * 2).await;
    let (ctype, text) = scrape(at).await;
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");

    let a0 = addr(bus[0]).to_string();
    let l0 = [("pci_address", a0.as_str()), ("vendor", "amd"), ("kind", "gpu"), ("index", "0")];
    assert_eq!(value(&text, "xpu_device_utilization_percent", &l0), Some(37.0));
    assert_eq!(value(&text, "xpu_device_memory_used_bytes", &l0), Some(3221225472.0));
    assert_eq!(value(&text, "xpu_device_memory_total_bytes", &l0), Some(206158430208.0));
    assert_eq!(value(&text, "xpu_device_power_watts", &l0), Some(245.0));
    assert_eq!(value(&text, "xpu_device_temperature_celsius", &l0), Some(51.25));
    assert_eq!(value(&text, "xpu_device_sm_clock_mhz", &l0), Some(2100.0));
    assert_eq!(value(&text, "xpu_device_memory_clock_mhz", &l0), Some(1300.0));
    assert_eq!(value(&text, "xpu_device_ecc_corrected_errors", &l0), Some(4.0));
    assert_eq!(value(&text, "xpu_device_healthy", &l0), Some(1.0));

    let a1 = addr(bus[1]).to_string();
    let l1 = [("pci_address", a1.as_str())];
    assert_eq!(value(&text, "xpu_device_utilization_percent", &l1), None, "garbage is not a value");
    assert_eq!(value(&text, "xpu_device_temperature_celsius", &l1), None);
    assert_eq!(value(&text, "xpu_device_power_watts", &l1), Some(245.0), "the rest still exported");
    // All eight GPUs are listed; AMD GPUs get no DCGM series.
    assert_eq!(text.lines().filter(|l| l.starts_with("xpu_device_info{")).count(), 8);
    assert!(!text.contains("DCGM_FI_"));
    assert_eq!(value(&text, "xpu_exporter_source_up", &[("source", "amd")]), Some(1.0));
    assert_eq!(prometheus_parse(&text), samples(&text));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_nvml_values_are_exported_under_xpu_and_dcgm_names() {
    let fx = hosts::a100_8x().build();
    let root = Root::new(fx.root()).unwrap();
    let gpus: Vec<PciAddress> = hosts::A100_GPU_BUSES.iter().map(|b| addr(*b)).collect();
    let nvml = FakeNvml::new(BTreeMap::from([(gpus[2], nvml_reading())]));
    let collector =
        Collector::start(root, INTERVAL, vec![Box::new(nvml.clone()) as Box<dyn Source>]);
    let (at, _stop) = serve(collector).await;
    tokio::time::sleep(INTERVAL * 2).await;
    let (_, text) = scrape(at).await;

    let a = gpus[2].to_string();
    let x = [("pci_address", a.as_str()), ("uuid", "GPU-fake-0"), ("index", "2")];
    assert_eq!(value(&text, "xpu_device_utilization_percent", &x), Some(88.0));
    assert_eq!(value(&text, "xpu_device_memory_used_bytes", &x), Some(10737418240.0));
    assert_eq!(value(&text, "xpu_device_power_watts", &x), Some(312.5));
    assert_eq!(value(&text, "xpu_device_temperature_celsius", &x), Some(61.0));
    assert_eq!(value(&text, "xpu_device_pcie_tx_bytes_per_second", &x), Some(2097152.0));

    let bus_id = format!("00000000:{:02X}:00.0", hosts::A100_GPU_BUSES[2]);
    let d = [
        ("gpu", "2"),
        ("UUID", "GPU-fake-0"),
        ("pci_bus_id", bus_id.as_str()),
        ("device", "nvidia2"),
        ("modelName", "NVIDIA A100-SXM4-40GB"),
    ];
    assert_eq!(value(&text, "DCGM_FI_DEV_GPU_UTIL", &d), Some(88.0));
    assert_eq!(value(&text, "DCGM_FI_DEV_FB_USED", &d), Some(10240.0), "MiB, as DCGM");
    assert_eq!(value(&text, "DCGM_FI_DEV_FB_FREE", &d), Some(30720.0));
    assert_eq!(value(&text, "DCGM_FI_DEV_POWER_USAGE", &d), Some(312.5));
    assert_eq!(value(&text, "DCGM_FI_DEV_GPU_TEMP", &d), Some(61.0));
    assert_eq!(value(&text, "DCGM_FI_DEV_SM_CLOCK", &d), Some(1410.0));
    assert_eq!(value(&text, "DCGM_FI_DEV_MEM_CLOCK", &d), Some(1215.0));
    assert_eq!(value(&text, "DCGM_FI_DEV_PCIE_TX_THROUGHPUT", &d), Some(2048.0), "KB/s, as DCGM");
    assert_eq!(value(&text, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", &d), Some(2.0));
    assert_eq!(value(&text, "DCGM_FI_DEV_XID_ERRORS", &d), Some(0.0));
    assert_eq!(prometheus_parse(&text), samples(&text));

    // NVML starts failing: one warning, the values go stale within two intervals and are
    // dropped, the devices and the endpoint stay.
    nvml.update(|s| {
        s.fail = Some("no NVML: libnvidia-ml.so.1: cannot open shared object file".into())
    });
    tokio::time::sleep(INTERVAL * 3).await;
    let (_, text) = scrape(at).await;
    assert_eq!(value(&text, "xpu_device_utilization_percent", &x[..1]), None);
    assert_eq!(value(&text, "xpu_exporter_source_up", &[("source", "nvml")]), Some(0.0));
    assert_eq!(
        text.lines().filter(|l| l.starts_with("xpu_device_info{")).count(),
        14,
        "8 GPUs + 6 NVSwitches"
    );
    assert_eq!(prometheus_parse(&text), samples(&text));
}

/// A source that never answers: the scrape still answers at once.
struct Hung;

impl Source for Hung {
    fn name(&self) -> &'static str {
        "hung"
    }
    fn read(&mut self, _inventory: &xpu_core::Inventory) -> Result<xpu_telemetry::Report, String> {
        std::thread::sleep(Duration::from_secs(3600));
        Err("unreachable".to_owned())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_source_never_delays_a_scrape() {
    let fx = hosts::mi300x().build();
    amd_values(&fx, hosts::MI300X_BUSES[0], "5", "40000");
    let root = Root::new(fx.root()).unwrap();
    let mut sources = exporter::default_sources(&root, INTERVAL);
    sources.push(Box::new(Hung));
    let collector = Collector::start(root, INTERVAL, sources);
    let (at, _stop) = serve(collector).await;
    tokio::time::sleep(INTERVAL * 2).await;
    for _ in 0..5 {
        let t = Instant::now();
        let (_, text) = scrape(at).await;
        assert!(t.elapsed() < INTERVAL, "a scrape took {:?}", t.elapsed());
        assert!(value(&text, "xpu_device_utilization_percent", &[]).is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_label_each_device_with_its_pod() {
    let fx = hosts::a100_8x().build();
    let root = Root::new(fx.root()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kubelet.sock");
    let kubelet = TestKubelet::default();
    let g = |i: usize| addr(hosts::A100_GPU_BUSES[i]).to_string();
    *kubelet.pods.lock().unwrap() = vec![PodResources {
        name: "trainer-0".into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec![g(1), g(3)],
                topology: None,
            }],
            ..ContainerResources::default()
        }],
    }];
    let _server = kubelet.serve(&socket).unwrap();
    let collector = Collector::start(root, INTERVAL, Vec::new());
    tokio::spawn(podresources::poll(socket, collector.clone()));
    let (at, _stop) = serve(collector).await;
    tokio::time::sleep(INTERVAL * 3).await;
    let (_, text) = scrape(at).await;
    for i in [1, 3] {
        let want = [
            ("pci_address", g(i)),
            ("namespace", "ml".into()),
            ("pod", "trainer-0".into()),
            ("container", "main".into()),
        ];
        let want: Vec<(&str, &str)> = want.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(value(&text, "xpu_device_info", &want), Some(1.0), "gpu {i}:\n{text}");
    }
    let free = g(0);
    assert!(
        text.lines()
            .any(|l| l.starts_with("xpu_device_info{") && l.contains(&free) && !l.contains("pod="))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_turns_the_gpu_unhealthy_in_list_and_watch_and_metrics_until_reset() {
    let fx = hosts::a100_8x().build();
    let root = Root::new(fx.root()).unwrap();
    let gpus: Vec<PciAddress> = hosts::A100_GPU_BUSES.iter().map(|b| addr(*b)).collect();
    let nvml = FakeNvml::new(gpus.iter().map(|a| (*a, Reading::default())).collect());
    let collector =
        Collector::start(root.clone(), INTERVAL, vec![Box::new(nvml.clone()) as Box<dyn Source>]);
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = testkubelet::TestKubelet::start(dir.path()).unwrap();
    let cfg = Config {
        root,
        plugin_dir: dir.path().to_owned(),
        resources: Resource::defaults(),
        interval: INTERVAL,
        health: Some(collector.clone()),
        watch_timeout: deviceplugin::LIST_AND_WATCH_WAIT,
        share: None,
        mps: None,
        replicas: 1,
        mig: None,
        device_list: Default::default(),
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let plugin = tokio::spawn(deviceplugin::run(cfg, None, async {
        // Sent or dropped (the test failed early): either way the plugin stops.
        let _ = stopped.await;
    }));
    let reg = kubelet.next_registration(WAIT).await.unwrap();
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let mut stream = client.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
    assert!(stream.next().await.unwrap().unwrap().devices.iter().all(|d| d.health == "Healthy"));
    let (at, _stop) = serve(collector.clone()).await;

    let victim = gpus[5];
    let t = Instant::now();
    nvml.update(|s| s.devices.get_mut(&victim).unwrap().xids.push(79));
    let next = tokio::time::timeout(WAIT, stream.next()).await.unwrap().unwrap().unwrap();
    let took = t.elapsed();
    let health = |r: &pb::ListAndWatchResponse, id: &str| {
        r.devices.iter().find(|d| d.id == id).map(|d| d.health.clone())
    };
    assert_eq!(health(&next, &victim.to_string()).as_deref(), Some("Unhealthy"));
    assert_eq!(next.devices.iter().filter(|d| d.health == "Healthy").count(), 7);
    // One collector read and one plugin refresh, each an interval apart at most.
    eprintln!("XID 79 to Unhealthy in ListAndWatch: {took:?} (interval {INTERVAL:?})");
    assert!(took < INTERVAL * 4, "Unhealthy after {took:?}");

    let (_, text) = scrape(at).await;
    let a = victim.to_string();
    let l = [("pci_address", a.as_str()), ("reason", "xid 79: GPU has fallen off the bus")];
    assert_eq!(value(&text, "xpu_device_healthy", &l), Some(0.0), "{text}");
    assert_eq!(value(&text, "DCGM_FI_DEV_XID_ERRORS", &[("gpu", "5")]), Some(79.0));
    assert_eq!(
        value(&text, "xpu_device_xid_errors_total", &[("pci_address", a.as_str())]),
        Some(1.0)
    );

    // Reads that merely succeed do not clear it...
    tokio::time::sleep(INTERVAL * 3).await;
    assert!(collector.unhealthy().contains_key(&victim));
    // ...a reset reported by the source does.
    nvml.update(|s| s.devices.get_mut(&victim).unwrap().reset = true);
    let next = tokio::time::timeout(WAIT, stream.next()).await.unwrap().unwrap().unwrap();
    assert_eq!(health(&next, &victim.to_string()).as_deref(), Some("Healthy"));
    // The plugin is still running, so the receiver is there; the join below checks it stopped.
    let _ = stop.send(());
    tokio::time::timeout(WAIT, plugin).await.unwrap().unwrap().unwrap();
    kubelet.stop().await;
}

/// The TPU runtime's side of its metrics service, answering with values the test chose.
#[derive(Clone)]
struct FakeLibtpu {
    duty: Vec<f64>,
    used: Vec<i64>,
    total: Vec<i64>,
}

#[tonic::async_trait]
impl xpu_integrations::tpuruntimepb::runtime_metric_service_server::RuntimeMetricService
    for FakeLibtpu
{
    async fn get_runtime_metric(
        &self,
        req: tonic::Request<xpu_integrations::tpuruntimepb::MetricRequest>,
    ) -> Result<tonic::Response<xpu_integrations::tpuruntimepb::MetricResponse>, tonic::Status>
    {
        use xpu_integrations::tpuruntime::{DUTY_CYCLE, HBM_TOTAL, HBM_USED};
        use xpu_integrations::tpuruntimepb::{
            AttrValue, Attribute, Gauge, Metric, MetricResponse, TpuMetric, attr_value, gauge,
            metric,
        };
        let name = req.into_inner().metric_name;
        let values: Vec<gauge::Value> = match name.as_str() {
            DUTY_CYCLE => self.duty.iter().map(|v| gauge::Value::AsDouble(*v)).collect(),
            HBM_USED => self.used.iter().map(|v| gauge::Value::AsInt(*v)).collect(),
            HBM_TOTAL => self.total.iter().map(|v| gauge::Value::AsInt(*v)).collect(),
            _ => return Err(tonic::Status::not_found(format!("no metric {name}"))),
        };
        let metrics = values
            .into_iter()
            .enumerate()
            .map(|(i, v)| Metric {
                attribute: Some(Attribute {
                    key: "device-id".into(),
                    value: Some(AttrValue { attr: Some(attr_value::Attr::IntAttr(i as i64)) }),
                }),
                measure: Some(metric::Measure::Gauge(Gauge { value: Some(v) })),
            })
            .collect();
        Ok(tonic::Response::new(MetricResponse {
            metric: Some(TpuMetric { name, description: String::new(), metrics }),
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpu_runtime_metrics_fill_the_chips_and_a_hung_port_delays_nothing() {
    use xpu_integrations::tpuruntime::TpuRuntime;
    let fx = hosts::tpu_v5p().build();
    let root = Root::new(fx.root()).unwrap();
    let gib = 1i64 << 30;
    let libtpu = FakeLibtpu {
        duty: vec![0.0, 73.5, 12.0, 100.0],
        used: vec![0, 8 * gib, gib, 95 * gib],
        total: vec![95 * gib; 4],
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap();
    let svc =
        xpu_integrations::tpuruntimepb::runtime_metric_service_server::RuntimeMetricServiceServer::new(libtpu);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    // A port that accepts and never answers.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_addr = hung.local_addr().unwrap();

    let sources: Vec<Box<dyn Source>> = vec![Box::new(TpuRuntime::new(port.to_string(), INTERVAL))];
    let collector = Collector::start(root.clone(), INTERVAL, sources);
    let (at, _stop) = serve(collector).await;
    tokio::time::sleep(INTERVAL * 3).await;
    let (_, text) = scrape(at).await;
    let chip = |i: &'static str| [("kind", "tpu"), ("index", i)];
    assert_eq!(value(&text, "xpu_device_utilization_percent", &chip("1")), Some(73.5), "{text}");
    assert_eq!(value(&text, "xpu_device_memory_used_bytes", &chip("1")), Some((8 * gib) as f64));
    assert_eq!(value(&text, "xpu_device_memory_total_bytes", &chip("3")), Some((95 * gib) as f64));
    assert_eq!(value(&text, "xpu_exporter_source_up", &[("source", "tpu")]), Some(1.0));
    assert_eq!(prometheus_parse(&text), samples(&text));

    let sources: Vec<Box<dyn Source>> =
        vec![Box::new(TpuRuntime::new(hung_addr.to_string(), INTERVAL))];
    let collector = Collector::start(root, INTERVAL, sources);
    let (at, _stop2) = serve(collector).await;
    tokio::time::sleep(INTERVAL * 3).await;
    for _ in 0..3 {
        let t = Instant::now();
        let (_, text) = scrape(at).await;
        assert!(t.elapsed() < INTERVAL, "a scrape took {:?}", t.elapsed());
        assert_eq!(value(&text, "xpu_exporter_source_up", &[("source", "tpu")]), Some(0.0));
        assert_eq!(text.lines().filter(|l| l.starts_with("xpu_device_info{")).count(), 4);
    }
    drop(hung);
}

/// The port is open to the network: clients that connect and send nothing hold no slot past
/// the head timeout, so a scrape behind more of them than the connection cap still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_hold_the_port() {
    let fx = hosts::a100_8x().build();
    let root = Root::new(fx.root()).unwrap();
    let collector = Collector::start(root, INTERVAL, Vec::new());
    let (at, _stop) = serve(collector).await;
    let mut idle = Vec::new();
    for _ in 0..80 {
        idle.push(tokio::net::TcpStream::connect(at).await.unwrap());
    }
    let t = Instant::now();
    let (_, text) =
        tokio::time::timeout(WAIT, scrape(at)).await.expect("a scrape behind 80 idle clients");
    assert!(text.contains("xpu_device_info{"));
    eprintln!("scrape behind 80 idle connections answered after {:?}", t.elapsed());
    drop(idle);
}
