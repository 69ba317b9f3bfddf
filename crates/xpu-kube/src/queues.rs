//! Which fair-share queue a pod is in, decided by what its author cannot forge, and what each
//! queue may hold at once. Pure: the driver hands it the admin's ConfigMap and the Namespaces'
//! labels.
//!
//! A pod's queue comes from its namespace. Without a mapping, each namespace is a queue of its
//! own (`namespace/<name>`). An admin maps namespaces to shared queues in one ConfigMap in the
//! scheduler's namespace (`xpu-system/xpu-queues` by default, key `queues.yaml`), as Kueue's
//! LocalQueues map namespaces to ClusterQueues; tenants with rights only in their own
//! namespaces cannot write it. A queue lists the namespaces that own it and, or instead, a
//! `namespaceSelector` over Namespace labels (which tenants cannot set either):
//!
//! ```yaml
//! queues:
//!   - name: research
//!     namespaces: [team-a, team-b]
//!     weight: 2            # fair-share weight (default 1)
//!     quota:               # at most this much bound at once (any of these, or none)
//!       nvidia.com/gpu: 16
//!       cpu: "64"
//!       memory: 512Gi
//!   - name: inference
//!     namespaceSelector: { matchLabels: { xpu.dev/tier: serving } }
//! ```
//!
//! A namespace's default queue is the first that owns it. The pod label `xpu.dev/queue` picks
//! another queue its namespace owns; a label naming any other queue is refused on the pod's
//! condition, so one tenant can neither wait in another's queue nor put its usage on another's
//! account. A pod bound with such a label (bound before the mapping changed, say) is counted on
//! its namespace's default queue.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;

use crate::convert::{self, DEVICE_RESOURCES, QUEUE_LABEL, SHARE_RESOURCE};

/// The ConfigMap key that holds the mapping.
pub const CONFIG_KEY: &str = "queues.yaml";
/// Where the mapping is looked for unless `--queue-config` says otherwise.
pub const DEFAULT_CONFIG: &str = "xpu-system/xpu-queues";
/// The most queues one mapping may define.
pub const MAX_QUEUES: usize = 10_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    queues: Vec<QueueDef>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct QueueDef {
    name: String,
    #[serde(default)]
    namespaces: Vec<String>,
    #[serde(default)]
    namespace_selector: Option<LabelSelector>,
    #[serde(default)]
    weight: Option<f64>,
    #[serde(default)]
    quota: BTreeMap<String, serde_json::Value>,
}

/// What pods hold or ask for, in the units a quota counts: milli-CPU, MiB, pods, and whole
/// devices per extended resource ([`SHARE_RESOURCE`] in its own thousandths).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Amounts {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub pods: u64,
    pub devices: BTreeMap<&'static str, u64>,
}

impl Amounts {
    /// What a pod with this usage holds.
    pub fn of(u: &convert::Usage) -> Self {
        Self {
            cpu_milli: u.cpu_milli,
            memory_mib: u.memory_mib,
            pods: 1,
            devices: u.devices.iter().map(|(k, v)| (*k, *v)).collect(),
        }
    }

    /// Adds `other`, saturating.
    pub fn add(&mut self, other: &Amounts) {
        self.cpu_milli = self.cpu_milli.saturating_add(other.cpu_milli);
        self.memory_mib = self.memory_mib.saturating_add(other.memory_mib);
        self.pods = self.pods.saturating_add(other.pods);
        for (k, v) in &other.devices {
            let e = self.devices.entry(k).or_default();
            *e = e.saturating_add(*v);
        }
    }

    /// `n` pods of this.
    pub fn times(&self, n: u64) -> Self {
        Self {
            cpu_milli: self.cpu_milli.saturating_mul(n),
            memory_mib: self.memory_mib.saturating_mul(n),
            pods: self.pods.saturating_mul(n),
            devices: self.devices.iter().map(|(k, v)| (*k, v.saturating_mul(n))).collect(),
        }
    }

    /// The fair-share usage xpu-sched counts: milli-CPU, MiB and device thousandths.
    pub fn fair_share(&self) -> (u64, u64, u64) {
        let dev = self.devices.iter().fold(0u64, |acc, (res, n)| {
            let milli =
                if *res == SHARE_RESOURCE { *n } else { n.saturating_mul(convert::MILLI_PER_GPU) };
            acc.saturating_add(milli)
        });
        (self.cpu_milli, self.memory_mib, dev)
    }

    fn get(&self, res: &str) -> u64 {
        match res {
            "cpu" => self.cpu_milli,
            "memory" => self.memory_mib,
            "pods" => self.pods,
            other => self.devices.get(other).copied().unwrap_or(0),
        }
    }
}

/// One queue of the mapping.
#[derive(Debug, Clone)]
struct Queue {
    name: String,
    namespaces: BTreeSet<String>,
    selector: Option<LabelSelector>,
    weight: f64,
    /// Resource name → most that may be bound at once (milli-CPU, MiB, counts).
    quota: BTreeMap<String, u64>,
}

/// The admin's mapping of namespaces to queues, or none (every namespace its own queue).
#[derive(Debug, Clone, Default)]
pub struct Queues {
    list: Vec<Queue>,
    by_name: HashMap<String, usize>,
    /// `namespace/name` of the ConfigMap it came from, for messages.
    source: String,
}

/// The queue id of a namespace that owns no queue of the mapping.
pub fn own_queue(namespace: &str) -> String {
    format!("namespace/{namespace}")
}

impl Queues {
    /// Parses the mapping in ConfigMap `source`'s [`CONFIG_KEY`]. `Err` names the field.
    pub fn parse(text: &str, source: &str) -> Result<Self, String> {
        let what = format!("ConfigMap {source} key {CONFIG_KEY}");
        let file: File = xpu_core::yaml::load_one(text, &what).map_err(|e| e.to_string())?;
        if file.queues.len() > MAX_QUEUES {
            return Err(format!("{what}: {} queues; at most {MAX_QUEUES}", file.queues.len()));
        }
        let mut out = Self { source: source.to_owned(), ..Self::default() };
        for (i, q) in file.queues.into_iter().enumerate() {
            let at = format!("{what}: queues[{i}]");
            if !xpu_core::job::is_dns_label(&q.name) {
                return Err(format!(
                    "{at}.name: {:?} is not a DNS-1123 label (lower-case letters, digits and '-', at most 63)",
                    q.name
                ));
            }
            if out.by_name.contains_key(&q.name) {
                return Err(format!("{at}.name: queue {:?} is defined twice", q.name));
            }
            for (j, ns) in q.namespaces.iter().enumerate() {
                if !xpu_core::job::is_dns_label(ns) {
                    return Err(format!("{at}.namespaces[{j}]: {ns:?} is not a namespace name"));
                }
            }
            if let Some(sel) = &q.namespace_selector {
                check_selector(sel).map_err(|e| format!("{at}.namespaceSelector: {e}"))?;
            }
            let weight = q.weight.unwrap_or(1.0);
            if !(weight.is_finite() && weight > 0.0) {
                return Err(format!("{at}.weight: {weight} must be a number above 0"));
            }
            let mut quota = BTreeMap::new();
            for (res, v) in &q.quota {
                let amount = quota_amount(res, v).map_err(|e| format!("{at}.quota[{res}]: {e}"))?;
                quota.insert(res.clone(), amount);
            }
            out.by_name.insert(q.name.clone(), out.list.len());
            out.list.push(Queue {
                name: q.name,
                namespaces: q.namespaces.into_iter().collect(),
                selector: q.namespace_selector,
                weight,
                quota,
            });
        }
        Ok(out)
    }

    /// Where the mapping came from (`namespace/name`), empty for none.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Fair-share weights by queue id.
    pub fn weights(&self) -> BTreeMap<String, f64> {
        self.list.iter().map(|q| (q.name.clone(), q.weight)).collect()
    }

    fn owns(q: &Queue, ns: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        q.namespaces.contains(ns)
            || q.selector.as_ref().is_some_and(|s| labels.is_some_and(|l| convert::selects(s, l)))
    }

    /// The queues namespace `ns` (with Namespace labels `labels`) owns, in the mapping's order.
    fn owned<'a>(
        &'a self,
        ns: &'a str,
        labels: Option<&'a BTreeMap<String, String>>,
    ) -> impl Iterator<Item = &'a Queue> + 'a {
        self.list.iter().filter(move |q| Self::owns(q, ns, labels))
    }

    /// The queue of a namespace's pods that name none.
    pub fn default_for(&self, ns: &str, labels: Option<&BTreeMap<String, String>>) -> String {
        self.owned(ns, labels).next().map_or_else(|| own_queue(ns), |q| q.name.clone())
    }

    /// The queue of a pod in namespace `ns` whose `xpu.dev/queue` label is `asked`. `Err` is the
    /// pod's waiting reason: the label names a queue its namespace does not own.
    pub fn resolve(
        &self,
        ns: &str,
        labels: Option<&BTreeMap<String, String>>,
        asked: Option<&str>,
    ) -> Result<String, String> {
        let Some(asked) = asked else { return Ok(self.default_for(ns, labels)) };
        if let Some(q) = self.by_name.get(asked).map(|&i| &self.list[i])
            && Self::owns(q, ns, labels)
        {
            return Ok(q.name.clone());
        }
        let owned: Vec<&str> = self.owned(ns, labels).map(|q| q.name.as_str()).collect();
        if owned.is_empty() && (asked == ns || asked == own_queue(ns)) {
            return Ok(own_queue(ns));
        }
        let theirs = if owned.is_empty() {
            format!("it has only its own queue, {}", own_queue(ns))
        } else {
            format!("its queues: {}", owned.join(", "))
        };
        let mapping = if self.source.is_empty() {
            format!(
                "no queue mapping is set: an admin maps namespaces to queues in ConfigMap {DEFAULT_CONFIG}, key {CONFIG_KEY}"
            )
        } else {
            format!("the admin maps namespaces to queues in ConfigMap {}", self.source)
        };
        Err(format!(
            "metadata.labels[{QUEUE_LABEL}]: namespace {ns} may not use queue {asked:?} ({theirs}; {mapping}); remove the label or ask the admin for the queue"
        ))
    }

    /// Why `ask` more would take queue `queue` past its quota with `used` already bound, if it
    /// would.
    pub fn over_quota(&self, queue: &str, used: Option<&Amounts>, ask: &Amounts) -> Option<String> {
        let q = self.by_name.get(queue).map(|&i| &self.list[i])?;
        let none = Amounts::default();
        let used = used.unwrap_or(&none);
        q.quota.iter().find_map(|(res, &limit)| {
            let (have, want) = (used.get(res), ask.get(res));
            (want > 0 && have.saturating_add(want) > limit).then(|| {
                format!(
                    "queue {queue} is at its quota of {}: {} bound, this asks {} more (quota set by the admin in ConfigMap {})",
                    show(res, limit),
                    show(res, have),
                    show(res, want),
                    self.source
                )
            })
        })
    }
}

/// A quota value in its resource's units, as the quota messages show it.
fn show(res: &str, v: u64) -> String {
    match res {
        "cpu" if v.is_multiple_of(1000) => format!("{} {res}", v / 1000),
        "cpu" => format!("{v}m {res}"),
        "memory" => format!("{v}Mi {res}"),
        _ => format!("{v} {res}"),
    }
}

/// Resources a quota may name.
fn quota_resources() -> impl Iterator<Item = &'static str> {
    ["cpu", "memory", "pods"].into_iter().chain(DEVICE_RESOURCES.iter().map(|(r, _)| *r))
}

/// A quota value: a quantity (a string like `64`, `500m` or `512Gi`, or a plain number).
fn quota_amount(res: &str, v: &serde_json::Value) -> Result<u64, String> {
    if !quota_resources().any(|r| r == res) {
        let known: Vec<&str> = quota_resources().collect();
        return Err(format!("not a resource xpu counts; use {}", known.join(", ")));
    }
    let text = match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        other => return Err(format!("{other} is not a quantity")),
    };
    let parsed = match res {
        "cpu" => convert::quantity(&text, 1000.0),
        "memory" => convert::quantity(&text, 1.0).map(|b| b >> 20),
        _ => convert::quantity(&text, 1.0),
    };
    parsed.ok_or_else(|| format!("{text:?} is not a quantity (like 16, 500m or 512Gi)"))
}

fn check_selector(s: &LabelSelector) -> Result<(), String> {
    for (i, r) in s.match_expressions.iter().flatten().enumerate() {
        let n = r.values.as_ref().map_or(0, Vec::len);
        match r.operator.as_str() {
            "In" | "NotIn" if n == 0 => {
                return Err(format!("matchExpressions[{i}]: {} needs values", r.operator));
            }
            "Exists" | "DoesNotExist" if n > 0 => {
                return Err(format!("matchExpressions[{i}]: {} takes no values", r.operator));
            }
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => {
                return Err(format!(
                    "matchExpressions[{i}].operator: {other:?}; use In, NotIn, Exists or DoesNotExist"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPPING: &str = r#"
queues:
  - name: research
    namespaces: [team-a, team-b]
    weight: 2
    quota: { nvidia.com/gpu: 2, cpu: "1500m", memory: 1Gi }
  - name: batch
    namespaces: [team-a]
  - name: serving
    namespaceSelector: { matchLabels: { tier: serving } }
"#;

    #[test]
    fn the_namespace_decides_and_a_label_only_picks_among_its_own_queues() {
        let q = Queues::parse(MAPPING, "xpu-system/xpu-queues").unwrap();
        assert_eq!(q.resolve("team-a", None, None).unwrap(), "research");
        assert_eq!(q.resolve("team-a", None, Some("batch")).unwrap(), "batch");
        let e = q.resolve("team-b", None, Some("batch")).unwrap_err();
        assert!(
            e.contains("namespace team-b may not use queue \"batch\" (its queues: research"),
            "{e}"
        );
        // Without a mapping entry, a namespace is its own queue, and may say so.
        assert_eq!(q.resolve("team-c", None, None).unwrap(), "namespace/team-c");
        assert_eq!(q.resolve("team-c", None, Some("team-c")).unwrap(), "namespace/team-c");
        let e = q.resolve("team-c", None, Some("research")).unwrap_err();
        assert!(e.contains("it has only its own queue, namespace/team-c"), "{e}");
        // Forging another namespace's own queue does not work either.
        assert!(q.resolve("team-c", None, Some("namespace/team-d")).is_err());
        // Namespace labels (which only an admin sets) select queues too.
        let serving = BTreeMap::from([("tier".to_owned(), "serving".to_owned())]);
        assert_eq!(q.resolve("web", Some(&serving), None).unwrap(), "serving");
        assert_eq!(q.weights().get("research"), Some(&2.0));
    }

    #[test]
    fn quotas_count_each_resource_in_its_units() {
        let q = Queues::parse(MAPPING, "xpu-system/xpu-queues").unwrap();
        let gpu = |n| Amounts {
            cpu_milli: 500,
            memory_mib: 256,
            pods: 1,
            devices: BTreeMap::from([("nvidia.com/gpu", n)]),
        };
        assert_eq!(q.over_quota("research", None, &gpu(2)), None);
        let e = q.over_quota("research", Some(&gpu(1)), &gpu(2)).unwrap();
        assert!(
            e.contains("quota of 2 nvidia.com/gpu: 1 nvidia.com/gpu bound, this asks 2"),
            "{e}"
        );
        let mut used = gpu(0);
        used.add(&gpu(0));
        used.add(&gpu(0));
        let e = q.over_quota("research", Some(&used), &gpu(0)).unwrap();
        assert!(e.contains("quota of 1500m cpu"), "{e}");
        assert_eq!(q.over_quota("batch", Some(&used), &gpu(9)), None, "no quota set");
        assert_eq!(q.over_quota("namespace/x", Some(&used), &gpu(9)), None);
    }

    #[test]
    fn a_bad_mapping_is_refused_naming_the_field() {
        for (text, says) in [
            ("queues: [{ name: Research }]", "queues[0].name"),
            ("queues: [{ name: a }, { name: a }]", "defined twice"),
            (
                "queues: [{ name: a, quota: { nvidia.com/gpus: 1 } }]",
                "quota[nvidia.com/gpus]: not a resource",
            ),
            (
                "queues: [{ name: a, quota: { cpu: lots } }]",
                "quota[cpu]: \"lots\" is not a quantity",
            ),
            ("queues: [{ name: a, weight: 0 }]", "weight"),
            ("queues: [{ name: a, namespaces: [\"../x\"] }]", "namespaces[0]"),
            ("queues: [{ name: a, colour: red }]", "unknown field"),
            (
                "queues: [{ name: a, namespaceSelector: { matchExpressions: [{ key: k, operator: Gt }] } }]",
                "operator",
            ),
        ] {
            let e = Queues::parse(text, "xpu-system/xpu-queues").unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
            assert!(e.contains("ConfigMap xpu-system/xpu-queues key queues.yaml"), "{e}");
        }
    }
}
