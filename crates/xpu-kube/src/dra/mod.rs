//! `xpu k8s dra-driver`: a vendor-neutral Dynamic Resource Allocation driver
//! (`resource.k8s.io/v1`, KEP 4381), one process per node, named [`DRIVER`] (`xpu.dev`: one
//! driver for every accelerator xpu discovers; the DeviceClasses `gpu.xpu.dev`, `tpu.xpu.dev`
//! and `passthrough.xpu.dev` select by kind and driver).
//!
//! - [`slices`]: the node's devices as ResourceSlices, re-published within the discovery
//!   interval when a device disappears or changes driver.
//! - [`prepare`]: what preparing a claim means (pure): checks and the claim's CDI spec.
//! - [`plugin`]: the kubelet's gRPC side: registration, `NodePrepareResources`,
//!   `NodeUnprepareResources`, the checkpoint.
//! - [`health`]: the kubelet's device health stream (`v1alpha1.DRAResourceHealth`).
//!
//! Allocation is kube-scheduler's: this driver never picks devices.

pub mod health;
pub mod mig;
pub mod plugin;
pub mod prepare;
pub mod rebind;
pub mod slices;
pub mod uses;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tracing::info;
use xpu_host::Root;

/// The driver name in ResourceSlices, allocation results and registration.
pub const DRIVER: &str = "xpu.dev";

/// What `xpu k8s dra-driver` was asked to do.
#[derive(Debug, Clone)]
pub struct DriverArgs {
    pub root: Root,
    pub node_name: String,
    pub kubeconfig: Option<PathBuf>,
    pub paths: plugin::Paths,
    /// How often the host is re-discovered.
    pub interval: Duration,
    /// Device health from telemetry (XIDs, uncorrectable memory errors, lost GPUs): an
    /// unhealthy device is tainted `xpu.dev/unhealthy:NoSchedule` in the published pool until it
    /// recovers.
    pub health: Option<xpu_telemetry::collect::Collector>,
    /// MIG through NVML: GPUs in MIG mode are published as their partitions ([`mig`]). `None`
    /// where there is no NVML MIG control (every GPU is published whole).
    pub mig: Option<Arc<dyn xpu_telemetry::mig::MigControl>>,
    /// MPS for shared GPUs: whole NVIDIA GPUs are published shareable
    /// ([`slices::shareable`]) and a claim given part of one is a client of its MPS daemon.
    pub mps: Option<Arc<xpu_host::mps::Daemons>>,
    /// Time-slicing for shared GPUs (not with `mps`): published shareable the same way, and a
    /// claim given part of one gets all of it with no limit and no isolation.
    pub time_slicing: bool,
}

impl DriverArgs {
    /// How whole GPUs are shared, as the slices' `sharing` attribute says it.
    fn sharing(&self) -> Option<&'static str> {
        if self.mps.is_some() {
            Some("mps")
        } else if self.time_slicing {
            Some("time-slicing")
        } else {
            None
        }
    }
}

/// Errors starting the driver.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Start(#[from] crate::StartError),
    #[error(transparent)]
    Discover(#[from] xpu_host::DiscoverError),
    #[error(transparent)]
    Publish(#[from] slices::PublishError),
    #[error(transparent)]
    Plugin(#[from] plugin::PluginError),
}

/// Runs the driver until `stop` resolves: publishes slices (first publication before the
/// kubelet plugin is served, so an API error at start is an error), keeps them current, and
/// serves the kubelet.
pub async fn run(
    args: DriverArgs,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), DriverError> {
    let client = crate::client(args.kubeconfig.as_deref()).await?;
    let opts = xpu_host::DiscoverOptions {
        scope: xpu_host::Scope::Accelerators,
        pci_ids: None,
        skip_names: true,
    };
    let inv = xpu_host::discover(&args.root, &opts)?;
    let mut publisher = slices::Publisher::new(client.clone(), &args.node_name).await?;
    let (devices, counters) = slices::with_mig(
        slices::devices(&args.root, &inv),
        &inv,
        &slices::mig_gpus(args.mig.as_deref()),
    );
    let devices = match args.sharing() {
        Some(how) => slices::shareable(devices, how),
        None => devices,
    };
    let (health_tx, health_rx) = tokio::sync::watch::channel(Arc::new(health::of(&devices)));
    publisher.publish_with(devices, counters).await?;
    info!(node = %args.node_name, generation = publisher.generation(), "driver started");
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(inv));
    let driver = Arc::new(
        plugin::Driver::new(
            client,
            &args.node_name,
            args.root.clone(),
            args.paths.clone(),
            rx,
            args.mig.clone(),
        )?
        .with_mps(args.mps.clone())
        .with_time_slicing(args.time_slicing)
        .with_health(health_rx),
    );
    let loop_task = tokio::spawn(slices::run(
        publisher,
        args.root.clone(),
        args.interval,
        tx,
        args.health.clone(),
        args.mig.clone(),
        args.sharing(),
        health_tx,
    ));
    let r = plugin::serve(driver, stop).await;
    loop_task.abort();
    r?;
    Ok(())
}
