//! xpu's inter-pod constraints against kube-scheduler v1.37.2's, on the same seeded random
//! clusters (zones, racks, node pools, taints, device-plugin GPUs) and workloads (required pod
//! affinity and anti-affinity on any key, `namespaceSelector`, topology spread with
//! `DoNotSchedule` and `minDomains`, preferred terms, `ScheduleAnyway`, node selectors,
//! tolerations, `matchFields`, an extended resource xpu does not place as a device
//! (`example.com/nic`), PodGroup gangs with and without a topology constraint), each on a
//! fresh real control plane with `GenericWorkload` and `TopologyAwareWorkloadScheduling` on. An independent checker
//! validates every binding of both from the generator's own description, and the test compares
//! how many pods each bound (`XPU_AFFINITY_DIFF_STRICT=1`: xpu must bind at least as many on
//! every seed; `XPU_AFFINITY_DIFF_SEEDS=1,2,...` picks the seeds).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod k8s_support;

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::api::scheduling::v1beta1::PodGroup;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use xpu_sched::rng::Rng;
use xpu_testkit::kube::ControlPlaneOptions;

use k8s_support::*;

/// Kubernetes' own gangs, on in the API server and in kube-scheduler.
const GATES: &str = "GenericWorkload=true,TopologyAwareWorkloadScheduling=true";

const KEYS: [&str; 3] =
    ["kubernetes.io/hostname", "topology.kubernetes.io/zone", "example.com/rack"];

#[derive(Debug, Clone)]
struct NodeCase {
    name: String,
    /// Topology labels by key (a node may lack one).
    labels: BTreeMap<&'static str, String>,
    pool: &'static str,
    gpus: u32,
    cpu_milli: u32,
    tainted: bool,
    /// `example.com/nic`, a device plugin's extended resource that xpu does not place as a device.
    nics: u32,
}

#[derive(Debug, Clone)]
struct App {
    name: String,
    replicas: usize,
    gpus: u32,
    cpu_milli: u32,
    /// `example.com/nic` per pod.
    nics: u32,
    /// Required anti-affinity to its own pods, by key.
    anti_self: Option<&'static str>,
    /// Required affinity to an earlier app (or itself), by key.
    affinity: Option<(usize, &'static str)>,
    /// Topology spread (DoNotSchedule): key, maxSkew, minDomains.
    spread: Option<(&'static str, u32, u32)>,
    /// Soft terms (preferred anti-affinity to itself, ScheduleAnyway spread): scores only.
    soft: bool,
    pool: Option<&'static str>,
    tolerates: bool,
    /// `matchFields` on one node's name.
    on_node: Option<String>,
    /// Terms look in every namespace (`namespaceSelector: {}`).
    all_namespaces: bool,
    /// A PodGroup gang of all its replicas (`gang.minCount`), with a topology key or none.
    gang: Option<Option<&'static str>>,
}

#[derive(Debug)]
struct Case {
    nodes: Vec<NodeCase>,
    apps: Vec<App>,
}

impl Case {
    fn random(seed: u64) -> Case {
        let mut rng = Rng::new(seed);
        let nodes: Vec<NodeCase> = (0..4 + rng.index(5))
            .map(|i| {
                let name = format!("n{i}");
                let mut labels = BTreeMap::new();
                labels.insert(KEYS[0], name.clone());
                if rng.below(8) != 0 {
                    labels.insert(KEYS[1], ["a", "b", "c"][rng.index(3)].to_owned());
                }
                if rng.below(3) != 0 {
                    labels.insert(KEYS[2], format!("r{}", rng.below(3)));
                }
                NodeCase {
                    name,
                    labels,
                    pool: ["p0", "p1"][rng.index(2)],
                    gpus: [0, 4, 8, 8][rng.index(4)],
                    cpu_milli: [4000, 8000, 16000][rng.index(3)],
                    tainted: rng.below(6) == 0,
                    nics: 0,
                }
            })
            .collect();
        let key = |rng: &mut Rng| KEYS[rng.index(KEYS.len())];
        let mut apps = Vec::new();
        for a in 0..3 + rng.index(4) {
            let mut app = App {
                name: format!("app{a}"),
                replicas: 1 + rng.index(6),
                gpus: [0, 0, 1, 2, 4][rng.index(5)],
                cpu_milli: [250, 500, 1000, 2000][rng.index(4)],
                nics: 0,
                anti_self: None,
                affinity: None,
                spread: None,
                soft: rng.below(4) == 0,
                pool: None,
                tolerates: rng.below(3) == 0,
                on_node: None,
                all_namespaces: rng.below(4) == 0,
                gang: None,
            };
            match rng.below(6) {
                0 => app.anti_self = Some(key(&mut rng)),
                1 => app.affinity = Some((rng.index(a + 1), key(&mut rng))),
                2 => {
                    app.spread =
                        Some((key(&mut rng), 1 + rng.below(2) as u32, rng.below(2) as u32 * 3))
                }
                3 => {
                    app.anti_self = Some(key(&mut rng));
                    app.spread = Some((key(&mut rng), 1, 0));
                }
                4 if rng.below(2) == 0 => {
                    app.replicas = 1;
                    app.on_node = Some(nodes[rng.index(nodes.len())].name.clone());
                }
                _ => {}
            }
            if rng.below(4) == 0 {
                app.pool = Some(["p0", "p1"][rng.index(2)]);
            }
            if app.on_node.is_none() && rng.below(4) == 0 {
                app.replicas = 2 + rng.index(3);
                app.gang = Some([None, Some(KEYS[1]), Some(KEYS[2])][rng.index(3)]);
            }
            apps.push(app);
        }
        // Extended resources from a stream of their own, so the rest of a seed's case is what it
        // was before they came.
        let mut extra = Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED);
        let mut nodes = nodes;
        for n in &mut nodes {
            n.nics = [0, 1, 2, 4][extra.index(4)];
        }
        for a in &mut apps {
            a.nics = [0, 0, 0, 1, 2][extra.index(5)];
        }
        Case { nodes, apps }
    }

    fn selector(app: &str) -> Value {
        json!({ "matchLabels": { "app": app } })
    }

    fn term(&self, app: &App, target: &str, key: &str) -> Value {
        let mut t = json!({ "labelSelector": Self::selector(target), "topologyKey": key });
        if app.all_namespaces {
            t["namespaceSelector"] = json!({});
        }
        t
    }

    /// The index of an app's first pod in creation order (its gang's priority class).
    fn first_pod(&self, app: &App) -> usize {
        self.apps.iter().take_while(|a| a.name != app.name).map(|a| a.replicas).sum()
    }

    fn pod(&self, app: &App, i: usize, prio: usize, scheduler: &str) -> Value {
        let prio = if app.gang.is_some() { self.first_pod(app) } else { prio };
        let mut spec = json!({
            "schedulerName": scheduler, "restartPolicy": "Never",
            "priorityClassName": format!("diff-{prio:03}"),
            "containers": [{ "name": "c", "image": "busybox", "resources": {
                "requests": { "cpu": format!("{}m", app.cpu_milli) },
                "limits": {} } }],
        });
        if app.gpus > 0 {
            spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] =
                json!(app.gpus.to_string());
        }
        if app.nics > 0 {
            spec["containers"][0]["resources"]["limits"]["example.com/nic"] =
                json!(app.nics.to_string());
        }
        let mut affinity = serde_json::Map::new();
        if let Some(key) = app.anti_self {
            affinity.insert("podAntiAffinity".into(), json!({
                "requiredDuringSchedulingIgnoredDuringExecution": [self.term(app, &app.name, key)] }));
        } else if app.soft {
            affinity.insert(
                "podAntiAffinity".into(),
                json!({
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    { "weight": 50, "podAffinityTerm": self.term(app, &app.name, KEYS[0]) } ] }),
            );
        }
        if let Some((target, key)) = app.affinity {
            affinity.insert("podAffinity".into(), json!({
                "requiredDuringSchedulingIgnoredDuringExecution": [self.term(app, &self.apps[target].name, key)] }));
        }
        if let Some(n) = &app.on_node {
            affinity.insert("nodeAffinity".into(), json!({ "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{ "matchFields": [{ "key": "metadata.name", "operator": "In", "values": [n] }] }] } }));
        }
        if !affinity.is_empty() {
            spec["affinity"] = Value::Object(affinity);
        }
        let mut spread = Vec::new();
        if let Some((key, skew, min)) = app.spread {
            let mut c = json!({ "maxSkew": skew, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule",
                                "labelSelector": Self::selector(&app.name) });
            if min > 0 {
                c["minDomains"] = json!(min);
            }
            spread.push(c);
        }
        if app.soft {
            spread.push(
                json!({ "maxSkew": 1, "topologyKey": KEYS[1], "whenUnsatisfiable": "ScheduleAnyway",
                                "labelSelector": Self::selector(&app.name) }),
            );
        }
        if !spread.is_empty() {
            spec["topologySpreadConstraints"] = json!(spread);
        }
        if let Some(p) = app.pool {
            spec["nodeSelector"] = json!({ "pool": p });
        }
        if app.gang.is_some() {
            spec["schedulingGroup"] = json!({ "podGroupName": app.name });
        }
        if app.tolerates {
            spec["tolerations"] =
                json!([{ "key": "dedicated", "operator": "Exists", "effect": "NoSchedule" }]);
        }
        json!({ "metadata": { "name": format!("{}-{i}", app.name), "labels": { "app": app.name } }, "spec": spec })
    }

    async fn create(&self, admin: &Client, scheduler: &str) {
        for n in &self.nodes {
            let mut d =
                NodeDef::new(n.name.clone()).gpus("nvidia.com/gpu", n.gpus).label("pool", n.pool);
            if n.nics > 0 {
                d = d.gpus("example.com/nic", n.nics);
            }
            d.cpu = format!("{}m", n.cpu_milli);
            for (k, v) in &n.labels {
                if *k != KEYS[0] {
                    d = d.label(k, v);
                }
            }
            if n.tainted {
                d.taints.push(json!({ "key": "dedicated", "value": "x", "effect": "NoSchedule" }));
            }
            add_node(admin, &d).await;
        }
        let pp = PostParams::default();
        let total: usize = self.apps.iter().map(|a| a.replicas).sum();
        // One priority per pod, without preemption: both schedulers follow the generator's
        // order (creation timestamps tie within a second).
        for i in 0..total {
            let pc: PriorityClass = serde_json::from_value(json!({
                "metadata": { "name": format!("diff-{i:03}") }, "value": 10_000 - i as i32,
                "preemptionPolicy": "Never" }))
            .unwrap();
            Api::<PriorityClass>::all(admin.clone()).create(&pp, &pc).await.unwrap();
        }
        for app in &self.apps {
            let Some(topology) = app.gang else { continue };
            // A group's pods and the group share one priority (kube-scheduler requires it).
            let mut spec = json!({ "schedulingPolicy": { "gang": { "minCount": app.replicas } },
                                   "priorityClassName": format!("diff-{:03}", self.first_pod(app)) });
            if let Some(k) = topology {
                spec["schedulingConstraints"] = json!({ "topology": [{ "key": k }] });
            }
            let g: PodGroup =
                serde_json::from_value(json!({ "metadata": { "name": app.name }, "spec": spec }))
                    .unwrap();
            Api::<PodGroup>::namespaced(admin.clone(), "default").create(&pp, &g).await.unwrap();
        }
        let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
        let mut prio = 0;
        for app in &self.apps {
            for i in 0..app.replicas {
                let p: Pod = serde_json::from_value(self.pod(app, i, prio, scheduler)).unwrap();
                pods.create(&pp, &p).await.unwrap();
                prio += 1;
            }
        }
    }

    /// Validates every binding; returns the pods bound.
    fn check(&self, pods: &[Pod]) -> Result<usize, String> {
        let node = |n: &str| self.nodes.iter().find(|x| x.name == n);
        let app_of = |p: &Pod| {
            let a = p.metadata.labels.as_ref()?.get("app")?;
            self.apps.iter().position(|x| &x.name == a)
        };
        // Bound pods: (name, app index, node).
        let mut bound: Vec<(String, usize, &NodeCase)> = Vec::new();
        for p in pods {
            let Some(n) = node_of(p) else { continue };
            let name = p.metadata.name.clone().unwrap_or_default();
            let a = app_of(p).ok_or(format!("{name}: no app"))?;
            bound.push((name, a, node(n).ok_or(format!("{n}: no such node"))?));
        }
        let mut gpus: BTreeMap<&str, u32> = BTreeMap::new();
        let mut cpu: BTreeMap<&str, u32> = BTreeMap::new();
        let mut nics: BTreeMap<&str, u32> = BTreeMap::new();
        for (name, a, n) in &bound {
            let app = &self.apps[*a];
            *gpus.entry(&n.name).or_default() += app.gpus;
            *nics.entry(&n.name).or_default() += app.nics;
            *cpu.entry(&n.name).or_default() += app.cpu_milli;
            if app.pool.is_some_and(|p| p != n.pool) {
                return Err(format!("{name} on {} outside pool {:?}", n.name, app.pool));
            }
            if n.tainted && !app.tolerates {
                return Err(format!("{name} on tainted {} without a toleration", n.name));
            }
            if app.on_node.as_ref().is_some_and(|o| *o != n.name) {
                return Err(format!("{name} on {} against matchFields {:?}", n.name, app.on_node));
            }
            if let Some(key) = app.anti_self
                && let Some(v) = n.labels.get(key)
                && let Some((other, _, m)) = bound
                    .iter()
                    .find(|(o, b, m)| o != name && b == a && m.labels.get(key) == Some(v))
            {
                return Err(format!(
                    "{name} on {} and {other} on {} share {key}={v}",
                    n.name, m.name
                ));
            }
            if let Some((target, key)) = app.affinity {
                let Some(v) = n.labels.get(key) else {
                    return Err(format!("{name} on {} which lacks {key}", n.name));
                };
                let peer = bound
                    .iter()
                    .any(|(o, b, m)| o != name && *b == target && m.labels.get(key) == Some(v));
                if !peer && target != *a {
                    return Err(format!(
                        "{name} on {} with no {} pod in {key}={v}",
                        n.name, self.apps[target].name
                    ));
                }
            }
        }
        for n in &self.nodes {
            if gpus.get(n.name.as_str()).copied().unwrap_or(0) > n.gpus
                || cpu.get(n.name.as_str()).copied().unwrap_or(0) > n.cpu_milli
                || nics.get(n.name.as_str()).copied().unwrap_or(0) > n.nics
            {
                return Err(format!("{} over capacity", n.name));
            }
        }
        // Gangs: all or nothing, in one domain of the group's key.
        for (a, app) in self.apps.iter().enumerate() {
            let Some(topology) = app.gang else { continue };
            let on: Vec<&&NodeCase> =
                bound.iter().filter(|(_, b, _)| *b == a).map(|(_, _, n)| n).collect();
            if !on.is_empty() && on.len() != app.replicas {
                return Err(format!(
                    "gang {}: {} of {} pods bound",
                    app.name,
                    on.len(),
                    app.replicas
                ));
            }
            if let Some(k) = topology {
                let domains: std::collections::BTreeSet<Option<&String>> =
                    on.iter().map(|n| n.labels.get(k)).collect();
                if domains.len() > 1 || domains.contains(&None) {
                    return Err(format!("gang {} spans {k} domains {domains:?}", app.name));
                }
            }
        }
        // Spread: over the domains of the nodes the app may use, the counts differ by at most
        // maxSkew (the least counts 0 with fewer domains than minDomains).
        for (a, app) in self.apps.iter().enumerate() {
            let Some((key, skew, min_domains)) = app.spread else { continue };
            let eligible =
                |n: &NodeCase| app.pool.is_none_or(|p| p == n.pool) && n.labels.contains_key(key);
            let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
            for n in self.nodes.iter().filter(|n| eligible(n)) {
                counts.entry(n.labels[key].as_str()).or_default();
            }
            for (name, b, n) in &bound {
                if *b != a {
                    continue;
                }
                let Some(v) = n.labels.get(key) else {
                    return Err(format!("{name} on {} which lacks spread key {key}", n.name));
                };
                *counts.entry(v.as_str()).or_default() += 1;
            }
            let max = counts.values().copied().max().unwrap_or(0);
            let mut min = counts.values().copied().min().unwrap_or(0);
            if (counts.len() as u32) < min_domains {
                min = 0;
            }
            if max - min > skew {
                return Err(format!(
                    "{}: spread over {key} is {counts:?}, maxSkew {skew}",
                    app.name
                ));
            }
        }
        Ok(bound.len())
    }
}

async fn run(case: &Case, xpu: bool) -> (usize, Result<usize, String>, String) {
    let cp = plane(
        ControlPlaneOptions::default()
            .apiserver_flag(format!("--feature-gates={GATES}"))
            .apiserver_flag("--runtime-config=scheduling.k8s.io/v1beta1=true"),
    )
    .await;
    let admin = cp.admin_client();
    let kubeconfig = if xpu { Some(install_scheduler_rbac(&cp).await) } else { None };
    case.create(&admin, if xpu { "xpu" } else { "default-scheduler" }).await;
    let (sched, kube) = match &kubeconfig {
        Some(k) => (Some(XpuScheduler::start(&cp, k, "diff", &["--no-preemption"])), None),
        None => (None, Some(start_kube_scheduler(&cp, "kube-scheduler-diff", GATES))),
    };
    let total: usize = case.apps.iter().map(|a| a.replicas).sum();
    let n = settle(&admin, total, Duration::from_secs(12)).await;
    let all = pods(&admin, "default").await;
    let checked = case.check(&all);
    let mut text = report(&all);
    if let Some(s) = sched {
        text.push_str(&s.log_text());
    }
    kill(kube);
    (n, checked, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xpu_and_kube_scheduler_keep_inter_pod_constraints_and_bind_comparably() {
    let _turn = TURN.lock().await;
    let seeds = seeds("XPU_AFFINITY_DIFF_SEEDS");
    let mut table = BTreeMap::new();
    for seed in seeds {
        let case = Case::random(seed);
        let total: usize = case.apps.iter().map(|a| a.replicas).sum();
        let (kube, kube_check, kube_report) = run(&case, false).await;
        let (xpu, xpu_check, log) = run(&case, true).await;
        eprintln!("seed {seed}: {total} pods; kube-scheduler bound {kube}, xpu bound {xpu}");
        if let Err(e) = &kube_check {
            panic!(
                "seed {seed}: kube-scheduler's bindings fail the checker (the checker is wrong): {e}\n{case:#?}\n{kube_report}"
            );
        }
        if let Err(e) = &xpu_check {
            panic!("seed {seed}: {e}\n{case:#?}\n{log}");
        }
        // No pod is refused as unsupported.
        assert!(!log.contains("not supported"), "seed {seed}: {log}");
        if std::env::var_os("XPU_AFFINITY_DIFF_VERBOSE").is_some() {
            eprintln!("seed {seed}:\n{case:#?}\nkube-scheduler:\n{kube_report}\nxpu:\n{log}");
        }
        if xpu < kube {
            let msg = format!(
                "seed {seed}: xpu bound {xpu} < kube-scheduler's {kube}\n{case:#?}\nkube-scheduler:\n{kube_report}\nxpu:\n{log}"
            );
            assert!(std::env::var_os("XPU_AFFINITY_DIFF_STRICT").is_none(), "{msg}");
            eprintln!("NOTE {}", msg.lines().next().unwrap_or_default());
        }
        table.insert(seed, (total, kube, xpu));
    }
    eprintln!("seed: (pods, kube-scheduler bound, xpu bound) {table:?}");
}
