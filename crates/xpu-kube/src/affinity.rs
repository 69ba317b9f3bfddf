//! A pod's inter-pod constraints, from `spec.affinity.podAffinity`, `podAntiAffinity` and
//! `topologySpreadConstraints`, to [`xpu_sched::pods::PodTerms`]: namespaces resolved
//! (`namespaces` ∪ `namespaceSelector`, the pod's own when neither is set, every namespace for
//! an empty selector), `matchLabelKeys` / `mismatchLabelKeys` merged into the selector from the
//! pod's own labels, and kube-scheduler's default soft spreading for pods of a ReplicaSet,
//! StatefulSet or ReplicationController that have no constraints of their own.
//!
//! A pod is tenant input: its terms, and the requirements and values of each selector, are
//! bounded, and a pod over a bound waits with the field named.

use std::collections::{BTreeMap, HashMap};

use crate::pod::Pod;
use k8s_openapi::api::core::v1::{
    PodAffinityTerm, TopologySpreadConstraint, WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector as KubeSelector;
use xpu_sched::pods::{
    LabelOp, LabelReq, LabelSelector, Namespaces, PodMatcher, PodTerms, Spread, Term,
};

use crate::convert::{Unsupported, selects, unsupported};

/// The most inter-pod terms (affinity, anti-affinity, preferred, spread together) of one pod.
pub const MAX_TERMS: usize = 64;
/// The most requirements of one label selector.
pub const MAX_REQUIREMENTS: usize = 64;
/// The most values of one requirement, and namespaces a term names.
pub const MAX_VALUES: usize = 256;

const HOSTNAME: &str = "kubernetes.io/hostname";
const ZONE: &str = "topology.kubernetes.io/zone";

/// Labels controllers add to each pod, which no workload selector names.
const PER_POD_LABELS: [&str; 4] = [
    "controller-revision-hash",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
    "pod-template-generation",
];

/// Whether a pod carries pod affinity or anti-affinity (required or preferred), or, with
/// `spread`, topology spread constraints.
pub fn has_terms(p: &Pod, spread: bool) -> bool {
    fn some<T>(v: &Option<Vec<T>>) -> bool {
        v.as_ref().is_some_and(|v| !v.is_empty())
    }
    let Some(spec) = p.spec.as_ref() else { return false };
    let aff = spec.affinity.as_ref();
    let pa = aff.and_then(|a| a.pod_affinity.as_ref());
    let pn = aff.and_then(|a| a.pod_anti_affinity.as_ref());
    (spread && some(&spec.topology_spread_constraints))
        || pa.is_some_and(|x| {
            some(&x.required_during_scheduling_ignored_during_execution)
                || some(&x.preferred_during_scheduling_ignored_during_execution)
        })
        || pn.is_some_and(|x| {
            some(&x.required_during_scheduling_ignored_during_execution)
                || some(&x.preferred_during_scheduling_ignored_during_execution)
        })
}

fn selector(
    sel: Option<&KubeSelector>,
    path: &str,
    own: &BTreeMap<String, String>,
    match_keys: &[String],
    mismatch_keys: &[String],
) -> Result<LabelSelector, Unsupported> {
    let Some(sel) = sel else {
        return Ok(LabelSelector { nothing: true, reqs: Vec::new() });
    };
    let mut reqs = Vec::new();
    for (k, v) in sel.match_labels.iter().flatten() {
        reqs.push(LabelReq { key: k.clone(), op: LabelOp::In, values: vec![v.clone()] });
    }
    for (i, e) in sel.match_expressions.iter().flatten().enumerate() {
        let values = e.values.clone().unwrap_or_default();
        let field = format!("{path}.matchExpressions[{i}]");
        if values.len() > MAX_VALUES {
            return Err(unsupported(
                &format!("{field}.values"),
                &format!("{} values; xpu takes at most {MAX_VALUES}", values.len()),
            ));
        }
        let op = match e.operator.as_str() {
            "In" => LabelOp::In,
            "NotIn" => LabelOp::NotIn,
            "Exists" => LabelOp::Exists,
            "DoesNotExist" => LabelOp::DoesNotExist,
            o => {
                return Err(unsupported(
                    &format!("{field}.operator"),
                    &format!("unknown operator {o:?}; use In, NotIn, Exists or DoesNotExist"),
                ));
            }
        };
        reqs.push(LabelReq { key: e.key.clone(), op, values });
    }
    // The pod's own values of `matchLabelKeys` must match, of `mismatchLabelKeys` must not.
    for (keys, op) in [(match_keys, LabelOp::In), (mismatch_keys, LabelOp::NotIn)] {
        for k in keys {
            if let Some(v) = own.get(k) {
                reqs.push(LabelReq { key: k.clone(), op, values: vec![v.clone()] });
            }
        }
    }
    if reqs.len() > MAX_REQUIREMENTS {
        return Err(unsupported(
            path,
            &format!(
                "{} requirements; xpu takes at most {MAX_REQUIREMENTS} per selector",
                reqs.len()
            ),
        ));
    }
    reqs.sort();
    reqs.dedup();
    Ok(LabelSelector { nothing: false, reqs })
}

fn namespaces(
    t: &PodAffinityTerm,
    own: &str,
    ns_labels: &HashMap<String, BTreeMap<String, String>>,
) -> Namespaces {
    let listed = t.namespaces.clone().unwrap_or_default();
    let mut out: Vec<String> = match &t.namespace_selector {
        Some(s)
            if s.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
                && s.match_expressions.as_ref().is_none_or(Vec::is_empty) =>
        {
            return Namespaces::All;
        }
        Some(s) => {
            let mut v = listed;
            v.extend(ns_labels.iter().filter(|(_, l)| selects(s, l)).map(|(n, _)| n.clone()));
            v
        }
        None if listed.is_empty() => vec![own.to_owned()],
        None => listed,
    };
    out.sort();
    out.dedup();
    Namespaces::Only(out)
}

fn term(
    t: &PodAffinityTerm,
    path: &str,
    own_ns: &str,
    own: &BTreeMap<String, String>,
    ns_labels: &HashMap<String, BTreeMap<String, String>>,
) -> Result<Term, Unsupported> {
    if t.topology_key.is_empty() {
        return Err(unsupported(&format!("{path}.topologyKey"), "empty; name a node label"));
    }
    let listed = t.namespaces.as_ref().map_or(0, Vec::len);
    if listed > MAX_VALUES {
        return Err(unsupported(
            &format!("{path}.namespaces"),
            &format!("{listed} namespaces; xpu takes at most {MAX_VALUES}"),
        ));
    }
    let keys = t.match_label_keys.as_ref().map_or(0, Vec::len)
        + t.mismatch_label_keys.as_ref().map_or(0, Vec::len);
    if keys > MAX_REQUIREMENTS {
        return Err(unsupported(
            &format!("{path}.matchLabelKeys"),
            &format!("{keys} label keys; xpu takes at most {MAX_REQUIREMENTS}"),
        ));
    }
    Ok(Term {
        pods: PodMatcher {
            selector: selector(
                t.label_selector.as_ref(),
                &format!("{path}.labelSelector"),
                own,
                t.match_label_keys.as_deref().unwrap_or(&[]),
                t.mismatch_label_keys.as_deref().unwrap_or(&[]),
            )?,
            namespaces: namespaces(t, own_ns, ns_labels),
        },
        topology_key: t.topology_key.clone(),
    })
}

fn spread(
    c: &TopologySpreadConstraint,
    path: &str,
    own: &BTreeMap<String, String>,
) -> Result<Spread, Unsupported> {
    let hard = match c.when_unsatisfiable.as_str() {
        "DoNotSchedule" => true,
        "ScheduleAnyway" => false,
        o => {
            return Err(unsupported(
                &format!("{path}.whenUnsatisfiable"),
                &format!("unknown value {o:?}; use DoNotSchedule or ScheduleAnyway"),
            ));
        }
    };
    if c.max_skew < 1 {
        return Err(unsupported(&format!("{path}.maxSkew"), "must be at least 1"));
    }
    if c.topology_key.is_empty() {
        return Err(unsupported(&format!("{path}.topologyKey"), "empty; name a node label"));
    }
    let policy = |v: Option<&str>, field: &str, default: bool| match v {
        None => Ok(default),
        Some("Honor") => Ok(true),
        Some("Ignore") => Ok(false),
        Some(o) => Err(unsupported(
            &format!("{path}.{field}"),
            &format!("unknown value {o:?}; use Honor or Ignore"),
        )),
    };
    Ok(Spread {
        max_skew: c.max_skew as u32,
        min_domains: c.min_domains.unwrap_or(0).max(0) as u32,
        topology_key: c.topology_key.clone(),
        hard,
        selector: selector(
            c.label_selector.as_ref(),
            &format!("{path}.labelSelector"),
            own,
            c.match_label_keys.as_deref().unwrap_or(&[]),
            &[],
        )?,
        honor_taints: policy(c.node_taints_policy.as_deref(), "nodeTaintsPolicy", false)?,
        honor_affinity: policy(c.node_affinity_policy.as_deref(), "nodeAffinityPolicy", true)?,
    })
}

/// A pod's terms. `pending`: the pod is to be placed (its spread and affinity matter);
/// otherwise only what bears on pods placed after it is kept (its anti-affinity and preferred
/// terms), and a term that does not convert is left out. `default_spread`: apply
/// kube-scheduler's default soft spreading to a replicated pod without constraints (xpu's
/// cycle asks it only for pods without accelerators, whose placement its policy packs).
pub fn terms(
    p: &Pod,
    ns_labels: &HashMap<String, BTreeMap<String, String>>,
    pending: bool,
    default_spread: bool,
) -> Result<PodTerms, Unsupported> {
    let namespace = p.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let labels = p.metadata.labels.clone().unwrap_or_default();
    let mut out = PodTerms { namespace, labels, ..PodTerms::default() };
    let Some(spec) = p.spec.as_ref() else { return Ok(out) };
    let aff = spec.affinity.as_ref();
    let pa = aff.and_then(|a| a.pod_affinity.as_ref());
    let pn = aff.and_then(|a| a.pod_anti_affinity.as_ref());
    let count = pa
        .iter()
        .map(|x| {
            x.required_during_scheduling_ignored_during_execution.as_ref().map_or(0, Vec::len)
                + x.preferred_during_scheduling_ignored_during_execution
                    .as_ref()
                    .map_or(0, Vec::len)
        })
        .chain(pn.iter().map(|x| {
            x.required_during_scheduling_ignored_during_execution.as_ref().map_or(0, Vec::len)
                + x.preferred_during_scheduling_ignored_during_execution
                    .as_ref()
                    .map_or(0, Vec::len)
        }))
        .sum::<usize>()
        + spec.topology_spread_constraints.as_ref().map_or(0, Vec::len);
    if count > MAX_TERMS {
        return Err(unsupported(
            "spec.affinity",
            &format!(
                "{count} pod affinity, anti-affinity and topology spread terms; xpu takes at most {MAX_TERMS} per pod"
            ),
        ));
    }
    let (ns, own) = (out.namespace.clone(), out.labels.clone());
    let keep = |r: Result<Term, Unsupported>| -> Result<Option<Term>, Unsupported> {
        match r {
            Ok(t) => Ok(Some(t)),
            Err(e) if pending => Err(e),
            Err(_) => Ok(None),
        }
    };
    const REQ: &str = "requiredDuringSchedulingIgnoredDuringExecution";
    const PREF: &str = "preferredDuringSchedulingIgnoredDuringExecution";
    // (field, required terms, preferred terms, sign of a preference).
    type Terms<'a> =
        (&'a str, Option<&'a Vec<PodAffinityTerm>>, Option<&'a Vec<WeightedPodAffinityTerm>>, i32);
    let kinds: [Terms<'_>; 2] = [
        (
            "podAffinity",
            pa.and_then(|x| x.required_during_scheduling_ignored_during_execution.as_ref()),
            pa.and_then(|x| x.preferred_during_scheduling_ignored_during_execution.as_ref()),
            1,
        ),
        (
            "podAntiAffinity",
            pn.and_then(|x| x.required_during_scheduling_ignored_during_execution.as_ref()),
            pn.and_then(|x| x.preferred_during_scheduling_ignored_during_execution.as_ref()),
            -1,
        ),
    ];
    for (field, required, preferred, sign) in kinds {
        // A placed pod's required affinity bears on nobody; its anti-affinity does.
        if pending || sign < 0 {
            for (i, t) in required.into_iter().flatten().enumerate() {
                let path = format!("spec.affinity.{field}.{REQ}[{i}]");
                let t = keep(term(t, &path, &ns, &own, ns_labels))?;
                if sign > 0 { out.affinity.extend(t) } else { out.anti_affinity.extend(t) }
            }
        }
        for (i, w) in preferred.into_iter().flatten().enumerate() {
            let path = format!("spec.affinity.{field}.{PREF}[{i}].podAffinityTerm");
            if let Some(t) = keep(term(&w.pod_affinity_term, &path, &ns, &own, ns_labels))? {
                out.preferred.push((sign * w.weight, t));
            }
        }
    }
    if !pending {
        return Ok(out);
    }
    for (i, c) in spec.topology_spread_constraints.iter().flatten().enumerate() {
        out.spread.push(spread(c, &format!("spec.topologySpreadConstraints[{i}]"), &own)?);
    }
    // kube-scheduler's default constraints (soft) for pods of replicated workloads.
    let replicated = p.metadata.owner_references.iter().flatten().any(|o| {
        o.controller == Some(true)
            && matches!(o.kind.as_str(), "ReplicaSet" | "StatefulSet" | "ReplicationController")
    });
    if default_spread && out.spread.is_empty() && replicated && !own.is_empty() {
        let reqs: Vec<LabelReq> = own
            .iter()
            .filter(|(k, _)| !PER_POD_LABELS.contains(&k.as_str()))
            .map(|(k, v)| LabelReq { key: k.clone(), op: LabelOp::In, values: vec![v.clone()] })
            .collect();
        for (key, skew) in [(HOSTNAME, 3), (ZONE, 5)] {
            out.spread.push(Spread {
                max_skew: skew,
                min_domains: 0,
                topology_key: key.into(),
                hard: false,
                selector: LabelSelector { nothing: false, reqs: reqs.clone() },
                honor_taints: false,
                honor_affinity: true,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(term: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": "p", "namespace": "a", "labels": { "app": "x" } },
            "spec": { "containers": [], "affinity": { "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [term] } } }
        }))
        .unwrap()
    }

    #[test]
    fn a_term_naming_too_many_namespaces_or_label_keys_is_refused_named() {
        let many: Vec<String> = (0..=MAX_VALUES).map(|i| format!("ns{i}")).collect();
        let p = pod(serde_json::json!({ "topologyKey": "k", "namespaces": many,
            "labelSelector": { "matchLabels": { "app": "x" } } }));
        let e = terms(&p, &HashMap::new(), true, false).unwrap_err();
        assert!(e.to_string().contains("[0].namespaces"), "{e}");
        let keys: Vec<String> = (0..=MAX_REQUIREMENTS).map(|i| format!("k{i}")).collect();
        let p = pod(serde_json::json!({ "topologyKey": "k", "matchLabelKeys": keys,
            "labelSelector": { "matchLabels": { "app": "x" } } }));
        let e = terms(&p, &HashMap::new(), true, false).unwrap_err();
        assert!(e.to_string().contains("[0].matchLabelKeys"), "{e}");
        // Within the bounds: the namespaces are the term's.
        let p = pod(serde_json::json!({ "topologyKey": "k", "namespaces": ["b", "c"],
            "labelSelector": { "matchLabels": { "app": "x" } } }));
        let t = terms(&p, &HashMap::new(), true, false).unwrap();
        assert_eq!(
            t.anti_affinity[0].pods.namespaces,
            Namespaces::Only(vec!["b".into(), "c".into()])
        );
    }
}
