//! Node constraints with Kubernetes semantics beyond a plain `nodeSelector`: required node
//! affinity (`requiredDuringSchedulingIgnoredDuringExecution`, every operator), taints and
//! tolerations. Plain data, no Kubernetes types: `xpu-kube` converts a Pod's fields into these,
//! and [`crate::cluster::Selector`] evaluates them once per node shape.
//!
//! Semantics follow the Kubernetes API reference (core/v1 `NodeSelectorRequirement`,
//! `Toleration`, `Taint`): terms are ORed, the requirements of one term ANDed; `Gt`/`Lt` compare
//! the label's value as an integer and fail when it is not one; a taint whose effect is
//! `NoSchedule` or `NoExecute` must be tolerated, `PreferNoSchedule` is a preference and never
//! filters.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `NodeSelectorRequirement`: the operator and one `matchExpressions` entry (node labels) or
/// `matchFields` entry (`metadata.name`, passed as the pseudo-label [`NODE_NAME_FIELD`]), the
/// same types the job parser reads a pod's required node affinity into.
pub use xpu_core::affinity::{NODE_NAME_FIELD, Operator, Requirement};

/// `Taint.effect` / `Toleration.effect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Effect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

impl std::str::FromStr for Effect {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "NoSchedule" => Self::NoSchedule,
            "PreferNoSchedule" => Self::PreferNoSchedule,
            "NoExecute" => Self::NoExecute,
            _ => {
                return Err(format!(
                    "unknown effect {s:?}; expected NoSchedule, PreferNoSchedule or NoExecute"
                ));
            }
        })
    }
}

/// A node taint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Taint {
    pub key: String,
    #[serde(default)]
    pub value: String,
    pub effect: Effect,
}

/// A pod toleration. `key: None` with `exists` tolerates every taint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Toleration {
    #[serde(default)]
    pub key: Option<String>,
    /// `operator: Exists`; otherwise `Equal`.
    #[serde(default)]
    pub exists: bool,
    #[serde(default)]
    pub value: String,
    /// `None`: every effect.
    #[serde(default)]
    pub effect: Option<Effect>,
}

impl Toleration {
    pub fn tolerates(&self, t: &Taint) -> bool {
        if self.effect.is_some_and(|e| e != t.effect) {
            return false;
        }
        match &self.key {
            None => self.exists,
            Some(k) if k != &t.key => false,
            Some(_) => self.exists || self.value == t.value,
        }
    }
}

/// Whether every taint that filters (`NoSchedule`, `NoExecute`) is tolerated.
pub fn tolerated(taints: &[Taint], tolerations: &[Toleration]) -> bool {
    taints
        .iter()
        .filter(|t| t.effect != Effect::PreferNoSchedule)
        .all(|t| tolerations.iter().any(|tol| tol.tolerates(t)))
}

/// Required node affinity: empty matches every node; otherwise any term whose requirements all
/// match. A term with no requirements matches nothing (as in Kubernetes).
pub fn affinity_matches(terms: &[Vec<Requirement>], labels: &BTreeMap<String, String>) -> bool {
    terms.is_empty()
        || terms.iter().any(|t| !t.is_empty() && t.iter().all(|r| r.matches_labels(labels)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
    }

    fn req(key: &str, op: Operator, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            operator: op,
            values: values.iter().map(|v| (*v).into()).collect(),
        }
    }

    #[test]
    fn every_operator_follows_the_api_reference() {
        let l = labels(&[("zone", "a"), ("gpus", "8")]);
        assert!(req("zone", Operator::In, &["a", "b"]).matches_labels(&l));
        assert!(!req("zone", Operator::In, &["b"]).matches_labels(&l));
        assert!(req("zone", Operator::NotIn, &["b"]).matches_labels(&l));
        assert!(
            req("absent", Operator::NotIn, &["b"]).matches_labels(&l),
            "NotIn holds when unset"
        );
        assert!(req("zone", Operator::Exists, &[]).matches_labels(&l));
        assert!(req("absent", Operator::DoesNotExist, &[]).matches_labels(&l));
        assert!(req("gpus", Operator::Gt, &["4"]).matches_labels(&l));
        assert!(!req("gpus", Operator::Lt, &["4"]).matches_labels(&l));
        assert!(!req("zone", Operator::Gt, &["1"]).matches_labels(&l), "not an integer: no match");
        assert!(!req("gpus", Operator::Gt, &["1", "2"]).matches_labels(&l), "Gt takes one value");
    }

    #[test]
    fn terms_are_ored_and_requirements_anded() {
        let l = labels(&[("zone", "a"), ("tier", "gold")]);
        let t1 = vec![req("zone", Operator::In, &["b"])];
        let t2 = vec![req("zone", Operator::In, &["a"]), req("tier", Operator::In, &["gold"])];
        assert!(affinity_matches(&[], &l));
        assert!(affinity_matches(&[t1.clone(), t2], &l));
        assert!(!affinity_matches(&[t1], &l));
        assert!(!affinity_matches(&[vec![]], &l), "an empty term matches nothing");
    }

    #[test]
    fn tolerations_follow_the_api_reference() {
        let gpu = Taint {
            key: "nvidia.com/gpu".into(),
            value: "present".into(),
            effect: Effect::NoSchedule,
        };
        let soft =
            Taint { key: "x".into(), value: String::new(), effect: Effect::PreferNoSchedule };
        let exists = Toleration {
            key: Some("nvidia.com/gpu".into()),
            exists: true,
            value: String::new(),
            effect: None,
        };
        let wrong_value = Toleration {
            key: Some("nvidia.com/gpu".into()),
            exists: false,
            value: "no".into(),
            effect: None,
        };
        let all = Toleration { key: None, exists: true, value: String::new(), effect: None };
        let other_effect = Toleration { effect: Some(Effect::NoExecute), ..exists.clone() };
        assert!(tolerated(std::slice::from_ref(&gpu), std::slice::from_ref(&exists)));
        assert!(!tolerated(std::slice::from_ref(&gpu), &[wrong_value]));
        assert!(tolerated(std::slice::from_ref(&gpu), &[all]));
        assert!(!tolerated(std::slice::from_ref(&gpu), &[other_effect]));
        assert!(!tolerated(std::slice::from_ref(&gpu), &[]));
        assert!(tolerated(&[soft], &[]), "PreferNoSchedule never filters");
    }
}
