//! Prometheus metrics, written by hand in the text exposition format
//! (<https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format>): jobs by
//! state, queue wait and scheduling-pass histograms, device allocation.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A cumulative histogram with fixed bucket bounds (seconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Debug, Default)]
struct HistInner {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new(HistInner { counts: vec![0; bounds.len()], ..Default::default() }),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Ok(mut h) = self.inner.lock() {
            for (i, b) in self.bounds.iter().enumerate() {
                if v <= *b {
                    h.counts[i] += 1;
                }
            }
            h.sum += v;
            h.count += 1;
        }
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        if let Ok(h) = self.inner.lock() {
            for (b, c) in self.bounds.iter().zip(&h.counts) {
                let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
            }
            let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum {}", h.sum);
            let _ = writeln!(out, "{name}_count {}", h.count);
        }
    }
}

const WAIT_BOUNDS: &[f64] = &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 60.0, 300.0, 1800.0, 3600.0];
const PASS_BOUNDS: &[f64] = &[0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5];

/// The daemon's counters.
#[derive(Debug)]
pub struct Metrics {
    pub queue_wait: Histogram,
    pub sched_pass: Histogram,
    pub submitted: AtomicU64,
    pub tasks_started: AtomicU64,
    pub tasks_failed: AtomicU64,
    /// Jobs the scheduler holds (live ones: ended jobs are forgotten).
    pub scheduler_jobs: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            queue_wait: Histogram::new(WAIT_BOUNDS),
            sched_pass: Histogram::new(PASS_BOUNDS),
            submitted: AtomicU64::new(0),
            tasks_started: AtomicU64::new(0),
            tasks_failed: AtomicU64::new(0),
            scheduler_jobs: AtomicU64::new(0),
        }
    }
}

/// One device's allocation, for the gauge.
pub struct DeviceSample<'a> {
    pub id: u32,
    pub kind: &'a str,
    pub vendor: &'a str,
    pub product: &'a str,
    /// Share held by tasks: 1 for a whole device, 0.25 for a quarter, 0 when free.
    pub allocated: f64,
}

/// Escapes a label value (backslash, quote, newline).
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    /// The whole exposition.
    pub fn render(
        &self,
        jobs: &[(&str, i64)],
        devices: &[DeviceSample<'_>],
        leader: bool,
    ) -> String {
        let mut out = String::with_capacity(4096);
        out.push_str("# HELP xpu_jobs Jobs in the store by state.\n# TYPE xpu_jobs gauge\n");
        for (state, n) in jobs {
            let _ = writeln!(out, "xpu_jobs{{state=\"{state}\"}} {n}");
        }
        out.push_str(
            "# HELP xpu_device_allocated Share of a device held by tasks (1 whole, 0.25 a quarter, 0 free).\n# TYPE xpu_device_allocated gauge\n",
        );
        for d in devices {
            let _ = writeln!(
                out,
                "xpu_device_allocated{{device=\"{}\",kind=\"{}\",vendor=\"{}\",product=\"{}\"}} {}",
                d.id,
                esc(d.kind),
                esc(d.vendor),
                esc(d.product),
                d.allocated
            );
        }
        let held: f64 = devices.iter().map(|d| d.allocated).sum();
        let _ = writeln!(
            out,
            "# HELP xpu_devices_allocated_ratio Share of the node's devices held by tasks.\n# TYPE xpu_devices_allocated_ratio gauge\nxpu_devices_allocated_ratio {}",
            if devices.is_empty() { 0.0 } else { held / devices.len() as f64 }
        );
        self.queue_wait.render(
            &mut out,
            "xpu_queue_wait_seconds",
            "Time from submission to the first task's start.",
        );
        self.sched_pass.render(
            &mut out,
            "xpu_scheduling_latency_seconds",
            "Duration of one scheduling pass over the queue.",
        );
        for (name, help, v) in [
            ("xpu_jobs_submitted_total", "Jobs accepted by this daemon's API.", &self.submitted),
            (
                "xpu_tasks_started_total",
                "Task attempts started by this daemon.",
                &self.tasks_started,
            ),
            ("xpu_tasks_failed_total", "Task attempts that failed.", &self.tasks_failed),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP xpu_scheduler_jobs Jobs the scheduler holds (ended jobs are forgotten).\n# TYPE xpu_scheduler_jobs gauge\nxpu_scheduler_jobs {}",
            self.scheduler_jobs.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP xpu_leader Whether this daemon is the scheduling leader.\n# TYPE xpu_leader gauge\nxpu_leader {}",
            u8::from(leader)
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_is_well_formed() {
        let m = Metrics::default();
        m.queue_wait.observe(0.02);
        m.queue_wait.observe(2.0);
        let text = m.render(
            &[("queued", 3)],
            &[DeviceSample {
                id: 0,
                kind: "gpu",
                vendor: "nvidia",
                product: "A\"1",
                allocated: 1.0,
            }],
            true,
        );
        assert!(text.contains("xpu_jobs{state=\"queued\"} 3"));
        assert!(text.contains("xpu_queue_wait_seconds_bucket{le=\"0.05\"} 1"));
        assert!(text.contains("xpu_queue_wait_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("product=\"A\\\"1\"} 1"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap_or("");
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }
}
