//! xpu on Kubernetes, through the API server: the secondary scheduler `xpu k8s scheduler`.
//!
//! - [`convert`]: Nodes and Pods to `xpu-sched` terms (pure).
//! - [`cycle`]: one scheduling cycle, objects in and decisions out (pure, no clock).
//! - [`scheduler`]: the driver: watch caches, binding, `PodScheduled` conditions, Events.
//! - [`share`]: GPU shares: the scheduler's signed choice on the pod, the device plugin's lookup.
//! - [`preempt`]: preemption planned by xpu-sched on a what-if cluster (pure).
//! - [`queues`]: which queue a pod is in (its namespace, or the admin's mapping) and quotas.
//! - [`status`]: waiting pods' conditions and Events, written off the scheduling loop.
//! - [`leader`]: Lease leader election, as kube-scheduler does it.
//! - [`metrics`]: Prometheus counters and `/metrics`.
//! - [`pod`], [`node`]: the fields of Pods and Nodes the scheduler keeps (its watch caches
//!   hold every one of the cluster).
//! - [`dra`]: the DRA driver `xpu k8s dra-driver`: ResourceSlices, the kubelet DRA plugin.
//!
//! Placement itself stays in `xpu-sched`: the policy `xpu sim` measures is the one a cluster
//! gets.

pub mod affinity;
pub mod base;
pub mod cel;
pub mod claims;
pub mod convert;
pub mod cycle;
pub mod dra;
pub mod extended;
pub mod flex;
pub mod leader;
pub mod ledger;
pub mod metrics;
pub mod node;
pub(crate) mod placed;
pub mod pod;
pub mod preempt;
pub mod queues;
pub mod scheduler;
pub mod share;
pub mod status;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kube::Client;
use tokio::sync::Notify;
use tracing::{error, info};

/// What `xpu k8s scheduler` was asked to do.
#[derive(Debug, Clone)]
pub struct SchedulerArgs {
    pub kubeconfig: Option<PathBuf>,
    pub options: scheduler::Options,
    pub leader_elect: Option<leader::LeaseConfig>,
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// Errors starting the scheduler.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("kubeconfig {path} cannot be used; pass --kubeconfig FILE or set KUBECONFIG")]
    Kubeconfig {
        path: String,
        #[source]
        source: SaidOnce,
    },
    #[error(
        "no kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config) and not in a cluster; pass --kubeconfig FILE"
    )]
    Infer(#[source] SaidOnce),
    #[error("connecting to the API server")]
    Client(#[source] SaidOnce),
    #[error("metrics address {addr} cannot be bound; choose another --metrics-addr")]
    Metrics {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A third-party error's chain as one cause, each link said once. kube's errors put their
/// source in their own text and also return it as `source()`, so a CLI printing the chain would
/// say it twice; this keeps a link only when the text so far does not already hold it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SaidOnce(String);

impl SaidOnce {
    pub fn of(e: &dyn std::error::Error) -> Self {
        Self(xpu_core::error::chain_once(e))
    }
}

/// A client from `--kubeconfig`, else `$KUBECONFIG`/`~/.kube/config`, else in-cluster.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, StartError> {
    // rustls picks its crypto provider from the crate features linked into the binary; when a
    // dependency also enables aws-lc-rs there are two and it refuses to choose (a panic in the
    // client). Say which: ring, as kube's features ask. An error only means one is installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = match kubeconfig {
        Some(path) => {
            let kc =
                kube::config::Kubeconfig::read_from(path).map_err(|e| StartError::Kubeconfig {
                    path: path.display().to_string(),
                    source: SaidOnce::of(&e),
                })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| StartError::Kubeconfig {
                    path: path.display().to_string(),
                    source: SaidOnce::of(&e),
                })?
        }
        None => kube::Config::infer().await.map_err(|e| StartError::Infer(SaidOnce::of(&e)))?,
    };
    Client::try_from(config).map_err(|e| StartError::Client(SaidOnce::of(&e)))
}

/// Runs the scheduler until SIGTERM/SIGINT (or, with leader election, until the lease is lost:
/// then it returns an error so the process restarts as a candidate, as kube-scheduler does).
pub async fn run_scheduler(
    args: SchedulerArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let client = client(args.kubeconfig.as_deref()).await?;
    let metrics = Arc::new(metrics::Metrics::default());
    if let Some(addr) = args.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Metrics { addr, source })?;
        let m = metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(listener, m).await {
                error!(%addr, error = %e, "metrics endpoint stopped");
            }
        });
    }
    let changed = Arc::new(Notify::new());
    let caches = scheduler::watch(&client, changed.clone(), &args.options.queue_config).await;
    info!(
        scheduler = %args.options.scheduler_name,
        policy = ?args.options.policy,
        nodes = caches.nodes.state().len(),
        pods = caches.pods.state().len(),
        "caches synced"
    );
    match args.leader_elect {
        None => {
            metrics.leader.store(true, Ordering::Relaxed);
            scheduler::run(client, caches, changed, args.options, metrics, shutdown).await;
            Ok(())
        }
        Some(cfg) => {
            let elector = leader::Elector::new(client.clone(), cfg);
            let mut shutdown = std::pin::pin!(shutdown);
            tokio::select! {
                () = elector.acquire() => {}
                () = &mut shutdown => return Ok(()),
            }
            metrics.leader.store(true, Ordering::Relaxed);
            let run = scheduler::run(
                client,
                caches,
                changed,
                args.options,
                metrics.clone(),
                &mut shutdown,
            );
            tokio::select! {
                () = run => {}
                () = elector.hold() => {
                    metrics.leader.store(false, Ordering::Relaxed);
                    return Err("lost the leader lease; exiting so that only the leader binds".into());
                }
            }
            metrics.leader.store(false, Ordering::Relaxed);
            // Clean stop: let a standby take over now rather than after the lease expires.
            if tokio::time::timeout(Duration::from_secs(2), elector.release()).await.is_err() {
                error!(
                    "could not release the lease within 2 s; a standby takes over when it expires"
                );
            }
            Ok(())
        }
    }
}
