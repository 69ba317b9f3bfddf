//! The scheduler's Prometheus metrics (text format 0.0.4) and the `/metrics` + `/healthz`
//! endpoint. Counters are atomics; the two histograms keep fixed buckets behind a mutex.
//!
//! The text is built with `writeln!` into a `String`, which cannot fail: those results are
//! ignored (`let _ =`), as in `xpu-server`'s metrics.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A histogram with fixed upper bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, inner: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }

    pub fn observe(&self, v: f64) {
        // A poisoned lock only means another thread panicked mid-update: keep counting.
        let mut g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                g.0[i] += 1;
            }
        }
        g.1 += v;
        g.2 += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, n) in self.bounds.iter().zip(&g.0) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            g.2, g.1, g.2
        );
    }
}

const LATENCY: &[f64] =
    &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// What the scheduler counts.
pub struct Metrics {
    pub attempts_scheduled: AtomicU64,
    pub attempts_unschedulable: AtomicU64,
    pub bind_errors: AtomicU64,
    pub status_errors: AtomicU64,
    /// `PodScheduled` updates written.
    pub status_writes: AtomicU64,
    /// Status writes and Events refused because the writer's table was full (tried again
    /// on a later cycle).
    pub status_dropped: AtomicU64,
    /// Status writes and Events waiting for the writer.
    pub status_queue: AtomicU64,
    pub nodes_skipped: AtomicU64,
    /// Preemptions carried out (victims evicted for one waiting unit).
    pub preemptions: AtomicU64,
    /// Flex-start ProvisioningRequests made (first ones and retries).
    pub provisioning_requests: AtomicU64,
    /// Cycles that built the whole cluster, cycles that patched the kept one, and nodes built
    /// by both (see [`crate::base`]).
    pub cluster_builds_whole: AtomicU64,
    pub cluster_builds_patched: AtomicU64,
    pub cluster_nodes_built: AtomicU64,
    pub pending: AtomicU64,
    pub leader: AtomicBool,
    /// One pass of the scheduling loop: planning, assuming, handing binds and status writes
    /// off, preemptions and flex-start requests.
    pub cycle_seconds: Histogram,
    /// The planning part of a pass alone.
    pub plan_seconds: Histogram,
    /// Pod creation to bound (second resolution at the start: `creationTimestamp`).
    pub e2e_seconds: Histogram,
    /// One `pods/binding` call.
    pub bind_seconds: Histogram,
    /// Writing one batch's ResourceClaims (finalizer, allocation, reservation) before it binds.
    pub claims_seconds: Histogram,
    /// One `PodScheduled=False` status write.
    pub status_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            attempts_scheduled: AtomicU64::new(0),
            attempts_unschedulable: AtomicU64::new(0),
            bind_errors: AtomicU64::new(0),
            status_errors: AtomicU64::new(0),
            status_writes: AtomicU64::new(0),
            status_dropped: AtomicU64::new(0),
            status_queue: AtomicU64::new(0),
            nodes_skipped: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            provisioning_requests: AtomicU64::new(0),
            cluster_builds_whole: AtomicU64::new(0),
            cluster_builds_patched: AtomicU64::new(0),
            cluster_nodes_built: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            leader: AtomicBool::new(false),
            cycle_seconds: Histogram::new(LATENCY),
            plan_seconds: Histogram::new(LATENCY),
            e2e_seconds: Histogram::new(LATENCY),
            bind_seconds: Histogram::new(LATENCY),
            claims_seconds: Histogram::new(LATENCY),
            status_seconds: Histogram::new(LATENCY),
        }
    }
}

impl Metrics {
    /// The exposition text.
    pub fn render(&self) -> String {
        let mut s = String::with_capacity(2048);
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_schedule_attempts_total Pods the scheduler tried to place, by result.\n\
             # TYPE xpu_scheduler_schedule_attempts_total counter\n\
             xpu_scheduler_schedule_attempts_total{{result=\"scheduled\"}} {}\n\
             xpu_scheduler_schedule_attempts_total{{result=\"unschedulable\"}} {}\n\
             xpu_scheduler_schedule_attempts_total{{result=\"error\"}} {}",
            c(&self.attempts_scheduled),
            c(&self.attempts_unschedulable),
            c(&self.bind_errors)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_bind_errors_total Bindings the API server refused.\n\
             # TYPE xpu_scheduler_bind_errors_total counter\nxpu_scheduler_bind_errors_total {}",
            c(&self.bind_errors)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_status_update_errors_total PodScheduled updates that failed.\n\
             # TYPE xpu_scheduler_status_update_errors_total counter\nxpu_scheduler_status_update_errors_total {}",
            c(&self.status_errors)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_status_updates_total PodScheduled updates written.\n\
             # TYPE xpu_scheduler_status_updates_total counter\nxpu_scheduler_status_updates_total {}",
            c(&self.status_writes)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_status_dropped_total Status writes and Events not queued because the writer was full (tried again later).\n\
             # TYPE xpu_scheduler_status_dropped_total counter\nxpu_scheduler_status_dropped_total {}",
            c(&self.status_dropped)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_status_queue Status writes and Events waiting to be written.\n\
             # TYPE xpu_scheduler_status_queue gauge\nxpu_scheduler_status_queue {}",
            c(&self.status_queue)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_nodes_skipped_total Times a node was left out for a malformed field.\n\
             # TYPE xpu_scheduler_nodes_skipped_total counter\nxpu_scheduler_nodes_skipped_total {}",
            c(&self.nodes_skipped)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_preemptions_total Preemptions carried out (victims evicted for a waiting pod or gang).\n\
             # TYPE xpu_scheduler_preemptions_total counter\nxpu_scheduler_preemptions_total {}",
            c(&self.preemptions)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_provisioning_requests_total Flex-start ProvisioningRequests made, retries included.\n\
             # TYPE xpu_scheduler_provisioning_requests_total counter\nxpu_scheduler_provisioning_requests_total {}",
            c(&self.provisioning_requests)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_cluster_builds_total Cycles by how their cluster was made: built whole, or the last cycle's patched.\n\
             # TYPE xpu_scheduler_cluster_builds_total counter\n\
             xpu_scheduler_cluster_builds_total{{kind=\"whole\"}} {}\n\
             xpu_scheduler_cluster_builds_total{{kind=\"patched\"}} {}",
            c(&self.cluster_builds_whole),
            c(&self.cluster_builds_patched)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_cluster_nodes_built_total Nodes built for cycles' clusters, whole builds and patches.\n\
             # TYPE xpu_scheduler_cluster_nodes_built_total counter\nxpu_scheduler_cluster_nodes_built_total {}",
            c(&self.cluster_nodes_built)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_pending_pods Pods waiting for this scheduler after the last cycle.\n\
             # TYPE xpu_scheduler_pending_pods gauge\nxpu_scheduler_pending_pods {}",
            c(&self.pending)
        );
        let _ = writeln!(
            s,
            "# HELP xpu_scheduler_leader 1 while this replica holds the lease.\n\
             # TYPE xpu_scheduler_leader gauge\nxpu_scheduler_leader {}",
            u8::from(self.leader.load(Ordering::Relaxed))
        );
        self.cycle_seconds.render(
            &mut s,
            "xpu_scheduler_cycle_duration_seconds",
            "Time one pass of the scheduling loop took, from waking to waiting again (binds and status writes are handed off, not awaited).",
        );
        self.plan_seconds.render(
            &mut s,
            "xpu_scheduler_plan_duration_seconds",
            "Time the planning part of a pass took.",
        );
        self.e2e_seconds.render(
            &mut s,
            "xpu_scheduler_pod_scheduling_duration_seconds",
            "From pod creation to a successful bind.",
        );
        self.bind_seconds.render(
            &mut s,
            "xpu_scheduler_bind_duration_seconds",
            "One pods/binding call to the API server.",
        );
        self.claims_seconds.render(
            &mut s,
            "xpu_scheduler_claims_duration_seconds",
            "Writing one batch's ResourceClaims (finalizer, allocation, reservation) before it binds.",
        );
        self.status_seconds.render(
            &mut s,
            "xpu_scheduler_status_update_duration_seconds",
            "One PodScheduled=False status write.",
        );
        s
    }
}

/// Serves `/metrics` and `/healthz` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: std::sync::Arc<Metrics>,
) -> std::io::Result<()> {
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let m = metrics.clone();
                async move { ([("content-type", "text/plain; version=0.0.4")], m.render()) }
            }),
        )
        .route("/healthz", get(|| async { "ok" }));
    axum::serve(listener, app).await
}
