//! The OpenB benchmark on the real trace (skipped with a printed reason when `../shared/data`
//! is not beside the checkout): one seed of a cheap baseline lands near its published mean, and
//! the trace loaders agree with the data's README (1,213 nodes, 6,212 GPUs, 8,152 tasks).
//! The full six-policy × five-trace × ten-seed table is `xpu sim openb --policy all`.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};

use xpu_core::DeviceKind;
use xpu_sched::policy::PolicyKind;
use xpu_sched::sim::openb;
use xpu_sched::trace;

fn data() -> Option<PathBuf> {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/openb");
    if d.join("openb_node_list_gpu_node.csv").is_file() {
        Some(d)
    } else {
        eprintln!("skipping: OpenB trace not found at {}", d.display());
        None
    }
}

#[test]
fn loaders_read_the_real_trace() {
    let Some(d) = data() else { return };
    let nodes = trace::read_openb_nodes(&d.join("openb_node_list_gpu_node.csv")).unwrap();
    assert_eq!(nodes.len(), 1213);
    assert_eq!(nodes.iter().map(|n| u64::from(n.gpus)).sum::<u64>(), 6212);
    let pods = trace::read_openb_pods(&d.join("openb_pod_list_default.csv")).unwrap();
    assert_eq!(pods.len(), 8152);
    let c = openb::cluster(&nodes).unwrap();
    assert_eq!(c.capacity().device(DeviceKind::Gpu), 6_212_000);
    // The multigpu50 list has only five columns; it still loads.
    let m = trace::read_openb_pods(&d.join("openb_pod_list_multigpu50.csv")).unwrap();
    assert!(m.iter().all(|p| p.creation_time.is_none() && p.gpu_spec.is_empty()));
}

#[test]
fn best_fit_lands_near_its_published_mean_on_the_default_trace() {
    let Some(d) = data() else { return };
    let nodes = trace::read_openb_nodes(&d.join("openb_node_list_gpu_node.csv")).unwrap();
    let pods = trace::read_openb_pods(&d.join("openb_pod_list_default.csv")).unwrap();
    let run = openb::run(&nodes, &pods, PolicyKind::BestFit, 42).unwrap();
    let published = openb::published("default", PolicyKind::BestFit).unwrap();
    assert!(
        (run.alloc_at_130 - published).abs() < 1.5,
        "{} vs published {published}",
        run.alloc_at_130
    );
    // Seeds repeat exactly.
    let again = openb::run(&nodes, &pods, PolicyKind::BestFit, 42).unwrap();
    assert_eq!(run, again);
    assert!(run.curve.len() >= 130, "a point per arrived percent up to 130: {}", run.curve.len());
}
