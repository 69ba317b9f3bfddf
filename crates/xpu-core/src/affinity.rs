//! Where a pod may run relative to nodes and to other pods: the required terms of a pod
//! template's `affinity` (core/v1 `Affinity`: `nodeAffinity`, `podAffinity`, `podAntiAffinity`),
//! read into plain data and evaluated as kube-scheduler's `NodeAffinity` and `InterPodAffinity`
//! filters evaluate them on one node. It owns the rules, not the pods: which pods run where is
//! the caller's (the parser asks about a job's own pods, the daemon about the host's).
//!
//! Semantics (API reference for `NodeSelector`, `PodAffinityTerm` and `LabelSelector`;
//! kube-scheduler's `framework/plugins/interpodaffinity/filtering.go`):
//!
//! - Node selector terms are ORed, the requirements of one term ANDed; a term with no
//!   requirement matches no node. `Gt`/`Lt` compare the label's value as an integer.
//!   `matchFields` may only name `metadata.name`, the node's name.
//! - A pod affinity term applies to the pods of the namespaces in `namespaces` and of those
//!   `namespaceSelector` selects; with neither, to the pod's own namespace; `namespaceSelector:
//!   {}` selects every namespace. xpu has no Namespace objects, so a namespace's only label is
//!   `kubernetes.io/metadata.name`, its name, which the API server sets on every namespace.
//! - A missing `labelSelector` selects no pod; an empty one selects every pod.
//! - Required pod affinity: the node must carry every term's `topologyKey`, and a pod the term
//!   selects must run in the node's domain of that key, unless no pod matches anywhere and the
//!   pod matches all its own terms (the first of a group that attracts itself).
//! - Required pod anti-affinity: no pod the term selects may run in the node's domain of its
//!   key; a node without the key is in no domain, so nothing conflicts there. It works both
//!   ways: a pod may not join a domain where a running pod's term selects it.
//!
//! On one host every key the node carries names one domain, the host itself; `kubernetes.io/
//! hostname` is carried by every node. The `preferred...` terms rank nodes and decide nothing
//! on one; the parser notes them and keeps nothing of them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::job::{CompletionMode, JobError, JobSpec, Source};

/// The label every node carries: its host name.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// The label every namespace carries: its name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
/// The one field a node selector's `matchFields` may name.
pub const NODE_NAME_FIELD: &str = "metadata.name";
/// The label of an Indexed Job's pod that holds its completion index.
pub const COMPLETION_INDEX_LABEL: &str = "batch.kubernetes.io/job-completion-index";

/// A selector requirement's `operator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
    /// Node selectors only.
    Gt,
    /// Node selectors only.
    Lt,
}

impl std::str::FromStr for Operator {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "In" => Self::In,
            "NotIn" => Self::NotIn,
            "Exists" => Self::Exists,
            "DoesNotExist" => Self::DoesNotExist,
            "Gt" => Self::Gt,
            "Lt" => Self::Lt,
            _ => {
                return Err(format!(
                    "unknown operator {s:?}; expected In, NotIn, Exists, DoesNotExist, Gt or Lt"
                ));
            }
        })
    }
}

/// One `matchExpressions` (or `matchFields`) entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

impl Requirement {
    /// Whether `labels` (a node's, or a pod's) meet the requirement.
    pub fn matches_labels(&self, labels: &BTreeMap<String, String>) -> bool {
        self.matches(labels.get(&self.key).map(String::as_str))
    }

    /// Whether `value` (the key's value, `None` when the key is absent) meets the requirement.
    pub fn matches(&self, value: Option<&str>) -> bool {
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.iter().any(|x| x == v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.iter().any(|x| x == v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
            Operator::Gt | Operator::Lt => {
                let (Some(v), [bound]) = (value, self.values.as_slice()) else { return false };
                let (Ok(v), Ok(bound)) = (v.parse::<i64>(), bound.parse::<i64>()) else {
                    return false;
                };
                if self.operator == Operator::Gt { v > bound } else { v < bound }
            }
        }
    }
}

/// A `LabelSelector`: every `matchLabels` pair and every expression must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
}

impl LabelSelector {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.matches_with(&|k| labels.get(k).map(String::as_str))
    }

    fn matches_with<'v>(&self, get: &dyn Fn(&str) -> Option<&'v str>) -> bool {
        self.match_labels.iter().all(|(k, v)| get(k) == Some(v.as_str()))
            && self.match_expressions.iter().all(|r| r.matches(get(&r.key)))
    }

    /// The values this selector compares `key` with.
    fn values_of<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let labels = self.match_labels.get(key).map(String::as_str);
        let exprs = self
            .match_expressions
            .iter()
            .filter(move |r| r.key == key)
            .flat_map(|r| r.values.iter().map(String::as_str));
        labels.into_iter().chain(exprs)
    }
}

/// One of `nodeSelectorTerms`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSelectorTerm {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<Requirement>,
    /// Requirements on [`NODE_NAME_FIELD`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_fields: Vec<Requirement>,
}

impl NodeSelectorTerm {
    /// Whether the node named `node_name` with `labels` matches; an empty term matches none.
    pub fn matches(&self, node_name: &str, labels: &BTreeMap<String, String>) -> bool {
        (!self.match_expressions.is_empty() || !self.match_fields.is_empty())
            && self.match_expressions.iter().all(|r| r.matches_labels(labels))
            && self.match_fields.iter().all(|r| r.matches(Some(node_name)))
    }
}

/// One required `podAffinity` or `podAntiAffinity` term.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodAffinityTerm {
    /// `None` selects no pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    pub topology_key: String,
}

impl PodAffinityTerm {
    /// Whether the term, written in a pod of `own_namespace`, covers pods of `namespace`.
    pub fn covers_namespace(&self, own_namespace: &str, namespace: &str) -> bool {
        if self.namespaces.is_empty() && self.namespace_selector.is_none() {
            return namespace == own_namespace;
        }
        self.namespaces.iter().any(|n| n == namespace)
            || self.namespace_selector.as_ref().is_some_and(|s| {
                s.matches_with(&|k| (k == NAMESPACE_NAME_LABEL).then_some(namespace))
            })
    }

    /// Whether the term, written in a pod of `own_namespace`, selects a pod of `namespace`
    /// with `labels`.
    pub fn selects(
        &self,
        own_namespace: &str,
        namespace: &str,
        labels: &BTreeMap<String, String>,
    ) -> bool {
        self.covers_namespace(own_namespace, namespace)
            && self.label_selector.as_ref().is_some_and(|s| s.matches(labels))
    }
}

/// The required terms of a pod template's `affinity`; empty when it has none.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Affinity {
    /// `nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms`, ORed;
    /// empty: any node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node: Vec<NodeSelectorTerm>,
    /// `podAffinity.requiredDuringSchedulingIgnoredDuringExecution`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_affinity: Vec<PodAffinityTerm>,
    /// `podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_anti_affinity: Vec<PodAffinityTerm>,
}

const REQUIRED: &str = "requiredDuringSchedulingIgnoredDuringExecution";
const PREFERRED: &str = "preferredDuringSchedulingIgnoredDuringExecution";

impl Affinity {
    pub fn is_empty(&self) -> bool {
        self.node.is_empty() && self.pod_affinity.is_empty() && self.pod_anti_affinity.is_empty()
    }

    /// Whether required node affinity lets the pod on the node named `node_name` with `labels`.
    pub fn node_matches(&self, node_name: &str, labels: &BTreeMap<String, String>) -> bool {
        self.node.is_empty() || self.node.iter().any(|t| t.matches(node_name, labels))
    }
}

/// A pod as the inter-pod rules see it.
#[derive(Debug, Clone, Copy)]
pub struct PodRef<'a> {
    pub namespace: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub affinity: &'a Affinity,
}

/// kube-scheduler's `InterPodAffinity` filter on one node: whether `incoming` may start on the
/// node with `node_labels` while `running` run there. On one host the node's pods are every
/// pod, so "no pod matches anywhere" (the first pod of a group that attracts itself) is judged
/// on `running` too. `Err` gives the term and kube-scheduler's reason.
pub fn pod_fits(
    node_labels: &BTreeMap<String, String>,
    incoming: &PodRef<'_>,
    running: &[PodRef<'_>],
) -> Result<(), String> {
    for p in running {
        for (i, t) in p.affinity.pod_anti_affinity.iter().enumerate() {
            if node_labels.contains_key(&t.topology_key)
                && t.selects(p.namespace, incoming.namespace, incoming.labels)
            {
                return Err(format!(
                    "a running pod's podAntiAffinity.{REQUIRED}[{i}] (topologyKey {}) selects this pod: node(s) didn't satisfy existing pods anti-affinity rules",
                    t.topology_key
                ));
            }
        }
    }
    for (i, t) in incoming.affinity.pod_anti_affinity.iter().enumerate() {
        if node_labels.contains_key(&t.topology_key)
            && running.iter().any(|p| t.selects(incoming.namespace, p.namespace, p.labels))
        {
            return Err(format!(
                "podAntiAffinity.{REQUIRED}[{i}] (topologyKey {}): node(s) didn't match pod anti-affinity rules",
                t.topology_key
            ));
        }
    }
    let terms = &incoming.affinity.pod_affinity;
    let first_of_group = terms.iter().all(|t| {
        !running.iter().any(|p| t.selects(incoming.namespace, p.namespace, p.labels))
            && t.selects(incoming.namespace, incoming.namespace, incoming.labels)
    });
    for (i, t) in terms.iter().enumerate() {
        let reason = if !node_labels.contains_key(&t.topology_key) {
            format!("the node has no label {}", t.topology_key)
        } else if first_of_group
            || running.iter().any(|p| t.selects(incoming.namespace, p.namespace, p.labels))
        {
            continue;
        } else {
            "no pod it selects runs here".to_owned()
        };
        return Err(format!(
            "podAffinity.{REQUIRED}[{i}] (topologyKey {}): {reason}: node(s) didn't match pod affinity rules",
            t.topology_key
        ));
    }
    Ok(())
}

impl JobSpec {
    /// The labels task `index` runs with, as the Job controller sets them: the pod template's,
    /// then `job-name` and `controller-uid` (both also under `batch.kubernetes.io/`) for a
    /// Kubernetes manifest, and the completion index for an Indexed Job.
    pub fn pod_labels(&self, index: u32, controller_uid: &str) -> BTreeMap<String, String> {
        let mut labels = self.pod.labels.clone();
        if self.source == Source::Kubernetes {
            for (k, v) in [
                ("batch.kubernetes.io/job-name", self.name.as_str()),
                ("job-name", self.name.as_str()),
                ("batch.kubernetes.io/controller-uid", controller_uid),
                ("controller-uid", controller_uid),
            ] {
                labels.insert(k.to_owned(), v.to_owned());
            }
        }
        if self.completion_mode == CompletionMode::Indexed {
            labels.insert(COMPLETION_INDEX_LABEL.to_owned(), index.to_string());
        }
        labels
    }

    /// The namespace the job's pods are in.
    pub fn pod_namespace(&self) -> &str {
        self.pod.namespace.as_deref().unwrap_or("default")
    }

    /// Whether required anti-affinity term `t` selects one of the job's own pods. The
    /// controller's uid is not known before the job is stored: it is taken to be a value no
    /// selector names (`Exists` still holds). Linear in the selector's size, however many
    /// indices it lists.
    fn selects_own_pods(&self, t: &PodAffinityTerm) -> bool {
        let ns = self.pod_namespace();
        if !t.covers_namespace(ns, ns) {
            return false;
        }
        let Some(sel) = &t.label_selector else { return false };
        let indexed = self.completion_mode == CompletionMode::Indexed;
        // Everything but the index is the same for every pod: judged once.
        let labels = self.pod_labels(0, "\0uid");
        let get = |k: &str| labels.get(k).map(String::as_str);
        let on_index = |k: &str| indexed && k == COMPLETION_INDEX_LABEL;
        let rest =
            sel.match_labels.iter().filter(|(k, _)| !on_index(k)).all(|(k, v)| get(k) == Some(v))
                && sel
                    .match_expressions
                    .iter()
                    .filter(|r| !on_index(&r.key))
                    .all(|r| r.matches(get(&r.key)));
        if !rest || !indexed {
            return rest;
        }
        // The index: a requirement's answer depends only on whether it is one of the values
        // the selector names, so those and one other index stand for them all.
        let reqs: Vec<(Operator, std::collections::HashSet<&str>)> = sel
            .match_labels
            .iter()
            .filter(|(k, _)| on_index(k))
            .map(|(_, v)| (Operator::In, [v.as_str()].into()))
            .chain(
                sel.match_expressions
                    .iter()
                    .filter(|r| on_index(&r.key))
                    .map(|r| (r.operator, r.values.iter().map(String::as_str).collect())),
            )
            .collect();
        let mut named: std::collections::BTreeSet<u32> = sel
            .values_of(COMPLETION_INDEX_LABEL)
            .filter_map(|v| v.parse::<u32>().ok())
            .filter(|i| *i < self.completions)
            .collect();
        if let Some(other) = (0..self.completions).find(|i| !named.contains(i)) {
            named.insert(other);
        }
        named.iter().any(|i| {
            let v = i.to_string();
            reqs.iter().all(|(op, values)| match op {
                Operator::In => values.contains(v.as_str()),
                Operator::NotIn => !values.contains(v.as_str()),
                Operator::Exists => true,
                Operator::DoesNotExist | Operator::Gt | Operator::Lt => false,
            })
        })
    }

    /// The first required anti-affinity term that keeps the job's own pods apart on a node
    /// with `node_labels`: it selects them and the node carries its key.
    pub fn self_anti_affinity(&self, node_labels: &BTreeMap<String, String>) -> Option<usize> {
        self.affinity
            .pod_anti_affinity
            .iter()
            .position(|t| node_labels.contains_key(&t.topology_key) && self.selects_own_pods(t))
    }

    /// The most tasks of the job that may run at once on the node with `node_labels`: one when
    /// a required anti-affinity term keeps its pods apart there, else
    /// [`JobSpec::effective_parallelism`].
    pub fn tasks_at_once(&self, node_labels: &BTreeMap<String, String>) -> u32 {
        if self.self_anti_affinity(node_labels).is_some() {
            1
        } else {
            self.effective_parallelism()
        }
    }

    /// Why the job can never run on the node named `node_name` with `node_labels`, whatever
    /// else runs there, naming the field; `None` when it can. Required node affinity no term of
    /// which matches; a required pod affinity term whose `topologyKey` the node lacks; a gang
    /// whose tasks may not share the node. (Terms about other jobs' pods are for
    /// [`pod_fits`] as pods come and go.)
    pub fn never_fits(
        &self,
        node_name: &str,
        node_labels: &BTreeMap<String, String>,
    ) -> Option<String> {
        // The field's path below the pod spec: a Job's is its template's, a Pod's its own.
        let at = "affinity";
        if !self.affinity.node_matches(node_name, node_labels) {
            return Some(format!(
                "{at}.nodeAffinity.{REQUIRED}: no node selector term matches the node's labels: node(s) didn't match Pod's node affinity/selector"
            ));
        }
        for (i, t) in self.affinity.pod_affinity.iter().enumerate() {
            if !node_labels.contains_key(&t.topology_key) {
                return Some(format!(
                    "{at}.podAffinity.{REQUIRED}[{i}]: the node has no label {} (the topologyKey): node(s) didn't match pod affinity rules",
                    t.topology_key
                ));
            }
        }
        if self.is_gang()
            && let Some(i) = self.self_anti_affinity(node_labels)
        {
            return Some(format!(
                "{at}.podAntiAffinity.{REQUIRED}[{i}]: selects the job's own pods over {}, which the node has: its {} tasks must run at once but may not share the node",
                self.affinity.pod_anti_affinity[i].topology_key, self.completions
            ));
        }
        None
    }
}

/// Checked reads of one JSON mapping with its path, for the parser below.
struct At<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl<'a> At<'a> {
    fn field(&self, name: &str) -> String {
        format!("{}.{name}", self.path)
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    fn obj(&self, name: &str) -> Result<Option<At<'a>>, JobError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(At { path: self.field(name), map: m })),
            Some(_) => Err(err(self.field(name), "must be a mapping")),
        }
    }

    fn list(&self, name: &str) -> Result<&'a [Value], JobError> {
        match self.get(name) {
            None => Ok(&[]),
            Some(Value::Array(items)) => Ok(items),
            Some(_) => Err(err(self.field(name), "must be a list")),
        }
    }

    /// The mappings of list `name`, each with its path.
    fn objs(&self, name: &str) -> Result<Vec<At<'a>>, JobError> {
        let mut out = Vec::new();
        for (i, v) in self.list(name)?.iter().enumerate() {
            let path = format!("{}[{i}]", self.field(name));
            match v {
                Value::Object(m) => out.push(At { path, map: m }),
                _ => return Err(err(path, "must be a mapping")),
            }
        }
        Ok(out)
    }

    fn str(&self, name: &str) -> Result<Option<&'a str>, JobError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(err(self.field(name), "must be a string")),
        }
    }

    fn strings(&self, name: &str) -> Result<Vec<String>, JobError> {
        self.list(name)?
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(err(format!("{}[{i}]", self.field(name)), "must be a string")),
            })
            .collect()
    }
}

fn err(path: impl Into<String>, message: impl Into<String>) -> JobError {
    JobError { path: path.into(), message: message.into() }
}

/// What the parser takes from `affinity`.
pub(crate) struct Read {
    pub affinity: Affinity,
    pub notes: Vec<String>,
    /// Fields xpu cannot honour, each refused naming it.
    pub unsupported: Vec<JobError>,
}

/// Reads the pod spec's `affinity` at `path`. A term the API server would refuse is an error
/// naming its field; `preferred...` terms are notes.
pub(crate) fn read(v: &Value, path: &str) -> Result<Read, JobError> {
    let Value::Object(map) = v else { return Err(err(path, "must be a mapping")) };
    let a = At { path: path.to_owned(), map };
    let mut out =
        Read { affinity: Affinity::default(), notes: Vec::new(), unsupported: Vec::new() };
    if let Some(node) = a.obj("nodeAffinity")? {
        if let Some(req) = node.obj(REQUIRED)? {
            let terms = req.objs("nodeSelectorTerms")?;
            if terms.is_empty() {
                return Err(err(
                    req.field("nodeSelectorTerms"),
                    "required: at least one term (a node must match one of them)",
                ));
            }
            for t in &terms {
                let match_expressions = t
                    .objs("matchExpressions")?
                    .iter()
                    .map(|r| requirement(r, true))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut match_fields = Vec::new();
                for f in t.objs("matchFields")? {
                    let r = requirement(&f, true)?;
                    if r.key != NODE_NAME_FIELD {
                        return Err(err(
                            f.field("key"),
                            format!("{:?}: matchFields may only name {NODE_NAME_FIELD}", r.key),
                        ));
                    }
                    if !matches!(r.operator, Operator::In | Operator::NotIn) || r.values.len() != 1
                    {
                        return Err(err(
                            f.path.clone(),
                            "matchFields takes In or NotIn with exactly one value (the node's name)",
                        ));
                    }
                    match_fields.push(r);
                }
                out.affinity.node.push(NodeSelectorTerm { match_expressions, match_fields });
            }
        }
        if node.get(PREFERRED).is_some() {
            out.notes.push(preference(&node.field(PREFERRED)));
        }
    }
    for (key, anti) in [("podAffinity", false), ("podAntiAffinity", true)] {
        let Some(p) = a.obj(key)? else { continue };
        for t in p.objs(REQUIRED)? {
            let term = pod_term(&t, &mut out.unsupported)?;
            if anti {
                out.affinity.pod_anti_affinity.push(term);
            } else {
                out.affinity.pod_affinity.push(term);
            }
        }
        if p.get(PREFERRED).is_some() {
            out.notes.push(preference(&p.field(PREFERRED)));
        }
    }
    Ok(out)
}

fn preference(path: &str) -> String {
    format!(
        "{path}: a preference between nodes; xpu runs every task on its one host, so there is nothing to prefer and it is ignored"
    )
}

/// One `PodAffinityTerm`.
fn pod_term(t: &At<'_>, unsupported: &mut Vec<JobError>) -> Result<PodAffinityTerm, JobError> {
    let topology_key = match t.str("topologyKey")? {
        Some(k) if !k.is_empty() => k.to_owned(),
        _ => {
            return Err(err(
                t.field("topologyKey"),
                "required: the node label whose value names the domain (kubernetes.io/hostname: the node)",
            ));
        }
    };
    for key in ["matchLabelKeys", "mismatchLabelKeys"] {
        if !t.list(key)?.is_empty() {
            unsupported.push(err(
                t.field(key),
                "is not supported by xpu; name the labels and their values in labelSelector instead",
            ));
        }
    }
    Ok(PodAffinityTerm {
        label_selector: t.obj("labelSelector")?.map(|s| label_selector(&s)).transpose()?,
        namespaces: t.strings("namespaces")?,
        namespace_selector: t.obj("namespaceSelector")?.map(|s| label_selector(&s)).transpose()?,
        topology_key,
    })
}

fn label_selector(s: &At<'_>) -> Result<LabelSelector, JobError> {
    let mut match_labels = BTreeMap::new();
    if let Some(m) = s.obj("matchLabels")? {
        for (k, v) in m.map {
            match v {
                Value::String(v) => {
                    match_labels.insert(k.clone(), v.clone());
                }
                _ => return Err(err(m.field(k), "must be a string")),
            }
        }
    }
    let match_expressions = s
        .objs("matchExpressions")?
        .iter()
        .map(|r| requirement(r, false))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(LabelSelector { match_labels, match_expressions })
}

/// One requirement, checked as the API server checks it; `node`: a node selector's (which
/// also has `Gt` and `Lt`).
fn requirement(r: &At<'_>, node: bool) -> Result<Requirement, JobError> {
    let key = match r.str("key")? {
        Some(k) if !k.is_empty() => k.to_owned(),
        _ => return Err(err(r.field("key"), "required")),
    };
    let op = r.str("operator")?;
    let operator = op
        .and_then(|o| o.parse::<Operator>().ok())
        .filter(|o| node || !matches!(o, Operator::Gt | Operator::Lt));
    let operator = match operator {
        Some(o) => o,
        None => {
            let allowed = if node {
                "In, NotIn, Exists, DoesNotExist, Gt or Lt"
            } else {
                "In, NotIn, Exists or DoesNotExist"
            };
            let what =
                op.map_or_else(|| "required".to_owned(), |o| format!("{o:?} is not an operator"));
            return Err(err(r.field("operator"), format!("{what}; use {allowed}")));
        }
    };
    let values = r.strings("values")?;
    let problem = match operator {
        Operator::In | Operator::NotIn if values.is_empty() => {
            Some("must list at least one value for In and NotIn")
        }
        Operator::Exists | Operator::DoesNotExist if !values.is_empty() => {
            Some("must be empty for Exists and DoesNotExist")
        }
        Operator::Gt | Operator::Lt if values.len() != 1 || values[0].parse::<i64>().is_err() => {
            Some("must be exactly one integer for Gt and Lt")
        }
        _ => None,
    };
    if let Some(p) = problem {
        return Err(err(r.field("values"), p));
    }
    Ok(Requirement { key, operator, values })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn req(key: &str, operator: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| (*v).to_owned()).collect(),
        }
    }

    #[test]
    fn requirements_and_selectors_follow_the_api() {
        let l = labels(&[("app", "train"), ("gpus", "8")]);
        let get = |k: &str| l.get(k).map(String::as_str);
        assert!(req("app", Operator::In, &["train", "x"]).matches(get("app")));
        assert!(!req("app", Operator::NotIn, &["train"]).matches(get("app")));
        assert!(req("zone", Operator::NotIn, &["a"]).matches(get("zone")));
        assert!(req("zone", Operator::DoesNotExist, &[]).matches(get("zone")));
        assert!(req("gpus", Operator::Gt, &["4"]).matches(get("gpus")));
        assert!(!req("app", Operator::Lt, &["4"]).matches(get("app")), "not an integer");
        let empty = LabelSelector::default();
        assert!(empty.matches(&l), "an empty selector selects everything");
        let term = NodeSelectorTerm::default();
        assert!(!term.matches("n", &l), "an empty term matches no node");
        let by_name = NodeSelectorTerm {
            match_fields: vec![req(NODE_NAME_FIELD, Operator::In, &["host-a"])],
            ..NodeSelectorTerm::default()
        };
        assert!(by_name.matches("host-a", &l) && !by_name.matches("host-b", &l));
    }

    #[test]
    fn namespaces_of_a_term() {
        let mut t = PodAffinityTerm {
            label_selector: Some(LabelSelector::default()),
            topology_key: HOSTNAME_LABEL.into(),
            ..PodAffinityTerm::default()
        };
        assert!(t.covers_namespace("ml", "ml") && !t.covers_namespace("ml", "db"));
        t.namespaces = vec!["db".into()];
        assert!(t.covers_namespace("ml", "db") && !t.covers_namespace("ml", "ml"));
        t.namespace_selector = Some(LabelSelector::default());
        assert!(t.covers_namespace("ml", "anything"), "{{}} selects every namespace");
        t.namespace_selector = Some(LabelSelector {
            match_expressions: vec![req(NAMESPACE_NAME_LABEL, Operator::NotIn, &["kube-system"])],
            ..LabelSelector::default()
        });
        assert!(t.covers_namespace("ml", "ml") && !t.covers_namespace("ml", "kube-system"));
        t.label_selector = None;
        assert!(!t.selects("ml", "ml", &BTreeMap::new()), "no selector selects no pod");
    }

    #[test]
    fn pod_fits_as_kube_scheduler_filters() {
        let node = labels(&[(HOSTNAME_LABEL, "h"), ("pool", "p1")]);
        let term = |key: &str, sel: &[(&str, &str)]| PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: labels(sel),
                ..LabelSelector::default()
            }),
            topology_key: key.into(),
            ..PodAffinityTerm::default()
        };
        let none = Affinity::default();
        let db_labels = labels(&[("app", "db")]);
        let db = PodRef { namespace: "default", labels: &db_labels, affinity: &none };
        let me_labels = labels(&[("app", "train")]);
        // Anti-affinity to db pods: refused while one runs, in either direction.
        let avoid =
            Affinity { pod_anti_affinity: vec![term("pool", &[("app", "db")])], ..none.clone() };
        let me = PodRef { namespace: "default", labels: &me_labels, affinity: &avoid };
        assert!(pod_fits(&node, &me, &[]).is_ok());
        let e = pod_fits(&node, &me, &[db]).unwrap_err();
        assert!(e.contains("didn't match pod anti-affinity rules"), "{e}");
        let plain = PodRef { namespace: "default", labels: &me_labels, affinity: &none };
        let guard =
            Affinity { pod_anti_affinity: vec![term("pool", &[("app", "train")])], ..none.clone() };
        let guarded = PodRef { namespace: "default", labels: &db_labels, affinity: &guard };
        let e = pod_fits(&node, &plain, &[guarded]).unwrap_err();
        assert!(e.contains("existing pods anti-affinity"), "{e}");
        // A key the node lacks is no domain: nothing conflicts.
        let elsewhere =
            Affinity { pod_anti_affinity: vec![term("zone", &[("app", "db")])], ..none.clone() };
        let me = PodRef { namespace: "default", labels: &me_labels, affinity: &elsewhere };
        assert!(pod_fits(&node, &me, &[db]).is_ok());
        // Affinity to db pods: waits for one; affinity to its own kind: the first may start.
        let near = Affinity { pod_affinity: vec![term("pool", &[("app", "db")])], ..none.clone() };
        let me = PodRef { namespace: "default", labels: &me_labels, affinity: &near };
        assert!(pod_fits(&node, &me, &[]).unwrap_err().contains("no pod it selects runs here"));
        assert!(pod_fits(&node, &me, &[db]).is_ok());
        let own =
            Affinity { pod_affinity: vec![term("pool", &[("app", "train")])], ..none.clone() };
        let me = PodRef { namespace: "default", labels: &me_labels, affinity: &own };
        assert!(pod_fits(&node, &me, &[]).is_ok(), "the first of its group");
        let no_key = Affinity { pod_affinity: vec![term("zone", &[("app", "train")])], ..none };
        let me = PodRef { namespace: "default", labels: &me_labels, affinity: &no_key };
        assert!(pod_fits(&node, &me, &[]).unwrap_err().contains("the node has no label zone"));
    }
}
