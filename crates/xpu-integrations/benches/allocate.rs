//! `Allocate` latency over the plugin's Unix socket, as the kubelet sees it: a running device
//! plugin on the 8×A100 fixture (registered with the test kubelet, re-discovering the host every
//! second as in production), and a client on the kubelet's side calling `Allocate` for two GPUs.
//! Prints p50, p99 and max; the target is p99 under 1 ms.
//!
//! Run: `cargo bench -p xpu-integrations --bench allocate` (`XPU_BENCH_CALLS` sets the sample
//! count, default 20000).

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use xpu_host::Root;
use xpu_integrations::deviceplugin::{self, Config};
use xpu_integrations::pb;
use xpu_integrations::selector::Resource;
use xpu_integrations::testkubelet::TestKubelet;
use xpu_testkit::hosts;

fn main() {
    let calls: usize =
        std::env::var("XPU_BENCH_CALLS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let fixture = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut kubelet = TestKubelet::start(dir.path()).unwrap();
        let cfg = Config {
            root: Root::new(fixture.root()).unwrap(),
            plugin_dir: dir.path().to_owned(),
            resources: Resource::defaults(),
            interval: Duration::from_secs(1),
            health: None,
            watch_timeout: deviceplugin::LIST_AND_WATCH_WAIT,
            share: None,
            mps: None,
            replicas: 1,
            mig: None,
            device_list: Default::default(),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let plugin = tokio::spawn(deviceplugin::run(cfg, None, async {
            let _ = stopped.await;
        }));
        let reg = kubelet.next_registration(Duration::from_secs(10)).await.unwrap();
        let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
        let request = || pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec!["0000:2b:00.0".to_owned(), "0000:48:00.0".to_owned()],
            }],
        };
        for _ in 0..500 {
            client.allocate(request()).await.unwrap();
        }
        let mut samples = Vec::with_capacity(calls);
        let start = Instant::now();
        for _ in 0..calls {
            let t = Instant::now();
            let r = client.allocate(request()).await.unwrap();
            samples.push(t.elapsed());
            assert_eq!(r.get_ref().container_responses[0].cdi_devices.len(), 2);
        }
        let total = start.elapsed();
        samples.sort();
        let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)];
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "allocate over unix socket: p50 {:.0} us, p99 {:.0} us, max {:.0} us ({calls} calls, {:.0} calls/s); target p99 < 1000 us",
            us(pct(0.50)),
            us(pct(0.99)),
            us(samples[samples.len() - 1]),
            calls as f64 / total.as_secs_f64()
        );
        let _ = stop.send(());
        plugin.await.unwrap().unwrap();
        kubelet.stop().await;
    });
}
