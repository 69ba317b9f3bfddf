//! `xpu exporter`: one Prometheus endpoint per node for every accelerator xpu knows.
//!
//! The collection (sources, health, snapshot) is `xpu-telemetry`'s; this module serves it over
//! HTTP (`/metrics` in OpenMetrics text, `/healthz`) and, on a Kubernetes node, labels each
//! device with the pod holding it from the kubelet's PodResources API ([`podresources`]).
//! A scrape renders the last snapshot and never waits on a source.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use xpu_host::Root;
use xpu_telemetry::Source;
use xpu_telemetry::collect::Collector;
use xpu_telemetry::render;

use crate::podresources;

/// The kubelet's PodResources socket.
pub const DEFAULT_POD_RESOURCES: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

#[derive(Debug, Clone)]
pub struct Config {
    pub root: Root,
    pub listen: SocketAddr,
    pub interval: Duration,
    /// The kubelet's PodResources socket; not polled when it does not exist.
    pub pod_resources: PathBuf,
    /// MIG instances to export too, read every ten intervals.
    pub mig: Option<Arc<dyn xpu_telemetry::mig::MigControl>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    #[error("cannot listen on {addr}: {error}; pick a free address with --listen")]
    Listen { addr: SocketAddr, error: std::io::Error },
}

/// The production sources: [`xpu_telemetry::default_sources`] (NVML, amdgpu sysfs) and the
/// TPU runtime's metrics service on localhost:8431, each read cut off after `interval`.
pub fn default_sources(root: &Root, interval: Duration) -> Vec<Box<dyn Source>> {
    let mut s = xpu_telemetry::default_sources(root);
    let timeout = interval.min(Duration::from_secs(5));
    s.push(Box::new(crate::tpuruntime::TpuRuntime::new(crate::tpuruntime::DEFAULT_ADDR, timeout)));
    s
}

/// The collector the node agents run for device health (the device plugin, the DRA driver):
/// the production sources, read every `interval`; with `fake_nvml` (tests), NVML is that
/// file's ([`xpu_telemetry::nvml::FileNvml`]).
pub fn health_collector(root: &Root, interval: Duration, fake_nvml: Option<PathBuf>) -> Collector {
    let mut sources = default_sources(root, interval);
    if let Some(path) = fake_nvml {
        sources.retain(|s| s.name() != "nvml");
        sources.push(Box::new(xpu_telemetry::nvml::FileNvml::new(path)));
    }
    Collector::start(root.clone(), interval, sources)
}

/// Runs the exporter until `shutdown` resolves.
pub async fn run(
    cfg: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ExporterError> {
    let mut collector =
        Collector::start(cfg.root.clone(), cfg.interval, default_sources(&cfg.root, cfg.interval));
    if let Some(m) = cfg.mig.clone() {
        collector = collector.with_mig(m, cfg.interval * 10);
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ExporterError::Listen { addr: cfg.listen, error: source })?;
    tokio::spawn(podresources::poll(cfg.pod_resources.clone(), collector.clone()));
    serve(listener, collector, shutdown).await;
    Ok(())
}

/// Connections served at once; more wait in the kernel's accept queue. Prometheus scrapes
/// with one connection; the rest is room for a few people with curl.
const MAX_CONNECTIONS: usize = 64;
/// For a request head, from the connection opening or its previous response.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// For a whole connection: a scrape is a few kilobytes, so a client still connected after
/// this is not scraping.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `collector` on `listener` until `shutdown` resolves. The port is open to the
/// network, so a client cannot hold it: connections are capped, a request head must arrive
/// within [`HEAD_TIMEOUT`] and a connection lasts [`CONNECTION_TIMEOUT`] at most
/// (`axum::serve` sets none of these; `xpu serve`'s listener does the same with its own limits
/// and statistics).
pub async fn serve(
    listener: tokio::net::TcpListener,
    collector: Collector,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let registry = Arc::new(render::registry(&collector));
    let app = router(registry);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let accept = async {
        loop {
            // A slot before accepting: what is over the cap waits in the accept queue.
            let Ok(slot) = slots.clone().acquire_owned().await else { return };
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, or reset before accept: pause rather than spin.
                    tracing::warn!("exporter: accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let app = app.clone();
            tokio::spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .serve_connection(
                        hyper_util::rt::TokioIo::new(stream),
                        hyper_util::service::TowerToHyperService::new(app),
                    );
                // Dropped on the deadline, which closes the socket; a client's own error
                // (reset, bad request) ends only its connection and needs no report.
                if let Ok(Err(e)) = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
                    tracing::debug!("exporter: connection: {e}");
                }
                drop(slot);
            });
        }
    };
    tokio::select! {
        () = accept => {}
        () = shutdown => {}
    }
}

fn router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    ([(CONTENT_TYPE, render::CONTENT_TYPE)], render::render(&registry))
                        .into_response()
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
}
