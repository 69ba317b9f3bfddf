//! Inter-pod constraints through the scheduler: tasks placed in one pass see each other.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use xpu_sched::cluster::{Cluster, NodeSpec};
use xpu_sched::pods::{LabelOp, LabelReq, LabelSelector, Namespaces, PodMatcher, PodTerms, Term};
use xpu_sched::request::{Job, TaskGroup, TaskSpec};
use xpu_sched::scheduler::{Decision, QueuePolicy, Scheduler, SchedulerConfig};

fn nodes(n: usize) -> Cluster {
    Cluster::from_specs((0..n).map(|i| {
        NodeSpec::new(format!("n{i}"), 32_000, 65_536)
            .label("kubernetes.io/hostname", format!("n{i}"))
            .devices(8, xpu_core::DeviceKind::Gpu, "H100")
    }))
    .unwrap()
}

fn app(a: &str) -> PodTerms {
    PodTerms {
        namespace: "ns".into(),
        labels: [("app".to_owned(), a.to_owned())].into(),
        ..PodTerms::default()
    }
}

fn term(a: &str) -> Term {
    Term {
        pods: PodMatcher {
            selector: LabelSelector {
                nothing: false,
                reqs: vec![LabelReq { key: "app".into(), op: LabelOp::In, values: vec![a.into()] }],
            },
            namespaces: Namespaces::Only(vec!["ns".into()]),
        },
        topology_key: "kubernetes.io/hostname".into(),
    }
}

fn job(name: &str, gpus: u16, t: PodTerms) -> Job {
    let mut spec = TaskSpec::gpus(100, 64, gpus);
    spec.pod = Some(Arc::new(t));
    Job::single(name, TaskGroup::new(1, spec))
}

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        queue: QueuePolicy::Fair,
        lanes: true,
        fit_per_task: true,
        ..SchedulerConfig::default()
    }
}

#[test]
fn affinity_follows_placed_pods_and_anti_affinity_keeps_them_apart() {
    let mut s = Scheduler::new(nodes(4), cfg()).unwrap();
    let mut web = app("web");
    web.anti_affinity.push(term("web"));
    for i in 0..4 {
        s.place_pod(i, Arc::new(web.clone()));
    }
    let mut near = app("near");
    near.affinity.push(term("web"));
    let id = s.submit(job("near", 0, near), 0).unwrap();
    let ds = s.schedule(0);
    assert!(ds.iter().any(|d| matches!(d, Decision::Start { job, .. } if *job == id)), "{ds:?}");
}

#[test]
fn a_taint_is_named_as_a_taint_not_as_a_selector() {
    use xpu_sched::constraints::{Effect, Taint};
    let c = Cluster::from_specs([
        NodeSpec::new("t", 32_000, 65_536).taint(Taint {
            key: "node.kubernetes.io/not-ready".into(),
            value: String::new(),
            effect: Effect::NoSchedule,
        }),
        NodeSpec::new("l", 32_000, 65_536).label("pool", "other"),
    ])
    .unwrap();
    let mut s = Scheduler::new(c, cfg()).unwrap();
    let id = s
        .submit(
            Job::single("p", TaskGroup::new(1, TaskSpec::cpu(100, 64).select("pool", "mine"))),
            0,
        )
        .unwrap();
    let ds = s.schedule(0);
    let why = ds
        .iter()
        .find_map(|d| match d {
            Decision::Fail { job, error } if *job == id => Some(error.to_string()),
            _ => None,
        })
        .unwrap_or_default();
    assert!(why.contains("1 node(s) had untolerated taint(s)"), "{why}");
    assert!(why.contains("1 node(s) didn't match Pod's node affinity/selector"), "{why}");
}
