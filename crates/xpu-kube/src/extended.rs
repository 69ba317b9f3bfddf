//! Extended resources xpu does not place as devices: a device plugin's
//! `nvidia.com/mig-1g.18gb` (MIG's mixed strategy), `rdma/hca`, `example.com/foo`. They are
//! counted as kube-scheduler's `NodeResourcesFit` counts them: a pod fits a node when, for each
//! one it asks for, the node's allocatable less what the pods bound to it ask for holds its
//! request. The request is the effective one (the containers' sum, or the largest init
//! container with the sidecars started before it, whichever is larger). A pod that asks for
//! one is kept to the nodes where it fits alone ([`fitting_nodes`]); after the cycle has
//! placed its pods, the binds that would together take a node past its allocatable are dropped
//! in bind order (a gang's with all its members) and those pods planned again next cycle
//! (`cycle::keep_extended_within_allocatable`): never a bind the kubelet would refuse.
//!
//! Not counted here: the resources xpu places as devices (`convert::DEVICE_RESOURCES`), those
//! a DeviceClass serves from DRA devices (their claims are), and native resources (`cpu`,
//! `memory`, `ephemeral-storage`, `hugepages-*`, anything in the `kubernetes.io` domain).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::convert::{self, DEVICE_RESOURCES};
use crate::node::Node;
use crate::pod::{Container, Pod};

/// Whether `name` is an extended resource this module counts (`skip`: the DRA-backed ones).
fn counted(name: &str, skip: &HashMap<String, String>) -> bool {
    let Some((domain, _)) = name.split_once('/') else { return false };
    let native = domain == "kubernetes.io" || domain.ends_with(".kubernetes.io");
    !native
        && !name.starts_with("requests.")
        && !DEVICE_RESOURCES.iter().any(|(r, _)| *r == name)
        && !skip.contains_key(name)
}

fn container_requests(
    c: &Container,
    skip: &HashMap<String, String>,
    out: &mut BTreeMap<String, u64>,
) {
    let r = c.resources.as_ref();
    let req = r.and_then(|r| r.requests.as_ref());
    let lim = r.and_then(|r| r.limits.as_ref());
    // Requests default to limits; a name only in limits counts as its limit.
    for map in [req, lim].into_iter().flatten() {
        for (k, v) in map {
            if !counted(k, skip) || out.contains_key(k) {
                continue;
            }
            let n = convert::quantity(&v.0, 1.0).unwrap_or(u64::MAX);
            out.insert(k.clone(), n);
        }
    }
}

/// The pod's effective request of each counted extended resource.
pub fn requests(p: &Pod, skip: &HashMap<String, String>) -> BTreeMap<String, u64> {
    let Some(spec) = p.spec.as_ref() else { return BTreeMap::new() };
    let mut total: BTreeMap<String, u64> = BTreeMap::new();
    for c in &spec.containers {
        let mut one = BTreeMap::new();
        container_requests(c, skip, &mut one);
        for (k, v) in one {
            let e = total.entry(k).or_default();
            *e = e.saturating_add(v);
        }
    }
    let mut sidecars: BTreeMap<String, u64> = BTreeMap::new();
    let mut init_max: BTreeMap<String, u64> = BTreeMap::new();
    for c in spec.init_containers.iter().flatten() {
        let mut one = BTreeMap::new();
        container_requests(c, skip, &mut one);
        if c.restart_policy.as_deref() == Some("Always") {
            for (k, v) in one {
                let e = sidecars.entry(k).or_default();
                *e = e.saturating_add(v);
            }
            continue;
        }
        for (k, v) in one {
            let with = v.saturating_add(sidecars.get(&k).copied().unwrap_or(0));
            let e = init_max.entry(k).or_default();
            *e = (*e).max(with);
        }
    }
    for (k, v) in sidecars {
        let e = total.entry(k).or_default();
        *e = e.saturating_add(v);
    }
    for (k, v) in init_max {
        let e = total.entry(k).or_default();
        *e = (*e).max(v);
    }
    total.retain(|_, v| *v > 0);
    total
}

/// What the pods bound to each node ask for, by node name; terminal pods and `hold_out` left
/// out. Computed once per cycle, when a waiting pod asks for an extended resource.
pub fn used(
    pods: &[Arc<Pod>],
    skip: &HashMap<String, String>,
    hold_out: Option<&std::collections::HashSet<&str>>,
    assumed: &HashMap<String, String>,
) -> HashMap<String, BTreeMap<String, u64>> {
    let mut out: HashMap<String, BTreeMap<String, u64>> = HashMap::new();
    for p in pods {
        // Bound, or bound by this scheduler and not yet shown so by the watch.
        let node =
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()).or_else(|| {
                p.metadata.uid.as_deref().and_then(|u| assumed.get(u)).map(String::as_str)
            });
        let Some(node) = node else { continue };
        if crate::cycle::terminal(p)
            || hold_out.is_some_and(|h| p.metadata.uid.as_deref().is_some_and(|u| h.contains(u)))
        {
            continue;
        }
        let r = requests(p, skip);
        if r.is_empty() {
            continue;
        }
        let e = out.entry(node.to_owned()).or_default();
        for (k, v) in r {
            let x = e.entry(k).or_default();
            *x = x.saturating_add(v);
        }
    }
    out
}

/// The nodes (of `nodes`) where every request of `want` fits, or, when none does, why: the
/// first resource that no node has room for.
pub fn fitting_nodes(
    want: &BTreeMap<String, u64>,
    nodes: &[Arc<Node>],
    used: &HashMap<String, BTreeMap<String, u64>>,
) -> Result<Vec<String>, String> {
    let mut fit = Vec::new();
    let mut short: BTreeMap<&str, usize> = BTreeMap::new();
    for n in nodes {
        let Some(name) = n.metadata.name.as_deref() else { continue };
        let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
        let taken = used.get(name);
        let mut ok = true;
        for (k, v) in want {
            let have = alloc
                .and_then(|a| a.get(k))
                .and_then(|q| convert::quantity(&q.0, 1.0))
                .unwrap_or(0);
            let held = taken.and_then(|t| t.get(k)).copied().unwrap_or(0);
            if have.saturating_sub(held) < *v {
                *short.entry(k.as_str()).or_default() += 1;
                ok = false;
            }
        }
        if ok {
            fit.push(name.to_owned());
        }
    }
    if fit.is_empty() {
        let (k, v) = want.iter().next().map(|(k, v)| (k.as_str(), *v)).unwrap_or(("", 0));
        let (k, v) = want
            .iter()
            .find(|(k, _)| short.contains_key(k.as_str()))
            .map(|(k, v)| (k.as_str(), *v))
            .unwrap_or((k, v));
        return Err(format!(
            "0/{} nodes have {v} {k} free (the extended resource's allocatable less what their pods ask for)",
            nodes.len()
        ));
    }
    Ok(fit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(
                json!({ "metadata": { "name": "p", "uid": "u" }, "spec": spec }),
            )
            .unwrap(),
        )
    }

    fn node(name: &str, alloc: serde_json::Value) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(
                json!({ "metadata": { "name": name }, "status": { "allocatable": alloc } }),
            )
            .unwrap(),
        )
    }

    #[test]
    fn requests_count_as_kube_scheduler_counts_them() {
        let none = HashMap::new();
        let p = pod(json!({
            "initContainers": [
                { "name": "i", "resources": { "limits": { "rdma/hca": "3" } } },
                { "name": "s", "restartPolicy": "Always", "resources": { "requests": { "rdma/hca": "1" } } }],
            "containers": [
                { "name": "a", "resources": { "limits": { "nvidia.com/mig-1g.18gb": "1", "nvidia.com/gpu": "2", "cpu": "1" } } },
                { "name": "b", "resources": { "requests": { "nvidia.com/mig-1g.18gb": "2", "hugepages-2Mi": "1Gi", "kubernetes.io/x": "1" } } }],
        }));
        let r = requests(&p, &none);
        // mig: 1 + 2; rdma: max(3, sidecar 1 + 0) then sidecar... the init's 3 vs 1 running.
        assert_eq!(r.get("nvidia.com/mig-1g.18gb"), Some(&3));
        assert_eq!(r.get("rdma/hca"), Some(&3));
        assert!(!r.contains_key("nvidia.com/gpu") && !r.contains_key("kubernetes.io/x"));
        // A DRA-backed one is its claim's business.
        let dra = HashMap::from([("rdma/hca".to_owned(), "rdma".to_owned())]);
        assert!(!requests(&p, &dra).contains_key("rdma/hca"));
    }

    #[test]
    fn a_pod_fits_where_allocatable_less_use_holds_it() {
        let none = HashMap::new();
        let nodes = [
            node("a", json!({ "nvidia.com/mig-1g.18gb": "2" })),
            node("b", json!({ "nvidia.com/mig-1g.18gb": "3" })),
            node("c", json!({ "cpu": "8" })),
        ];
        let mut bound = (*pod(json!({ "nodeName": "b", "containers": [
            { "name": "x", "resources": { "limits": { "nvidia.com/mig-1g.18gb": "2" } } }] })))
        .clone();
        bound.metadata.uid = Some("v".into());
        let used = used(&[Arc::new(bound)], &none, None, &HashMap::new());
        let want = BTreeMap::from([("nvidia.com/mig-1g.18gb".to_owned(), 2)]);
        assert_eq!(fitting_nodes(&want, &nodes, &used).unwrap(), ["a"]);
        let three = BTreeMap::from([("nvidia.com/mig-1g.18gb".to_owned(), 3)]);
        let e = fitting_nodes(&three, &nodes, &used).unwrap_err();
        assert!(e.contains("0/3 nodes have 3 nvidia.com/mig-1g.18gb free"), "{e}");
    }
}
