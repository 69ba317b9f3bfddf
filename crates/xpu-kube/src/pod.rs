//! What the scheduler keeps of a Pod: the fields a cycle reads, decoded straight from the API
//! server's JSON, under the names and shapes k8s-openapi gives them.
//!
//! The watch cache holds every pod of the cluster, and at scale it is most of the scheduler's
//! memory. k8s-openapi's `Pod` is 2.5 KB before its first container and each `Container` 2.3 KB,
//! almost all of it fields no scheduler reads (probes, lifecycle hooks, security contexts,
//! volume mounts, statuses of every container); decoded and then trimmed, a one-container pod
//! held about 7 KB. These types keep only what placement, preemption, gangs, DRA and status
//! writes read, and the fields left out are never decoded at all (serde skips unknown keys).
//! A bound one-container pod as the API server serves it (three default tolerations, two
//! annotations, one condition) holds 4.7 KB of RSS here, 1.2 KB of it the struct itself;
//! requests and limits are lists ([`Quantities`]), not k8s-openapi's maps (5.7 KB with them). The names match k8s-openapi's, so code reads a
//! cached pod as it would read the full one; the nested types (affinity, tolerations, claims,
//! resource requirements) are k8s-openapi's own.
//!
//! A field added to a cycle's reading must be added here: the compiler says so, since the
//! cycle only ever sees these types.

use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    Affinity, ContainerPort, PodCondition, PodExtendedResourceClaimStatus, PodResourceClaim,
    PodResourceClaimStatus, PodSchedulingGate, PodSchedulingGroup, ResourceClaim, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Serialize};

/// A Pod as the scheduler's watch cache keeps it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PodStatus>,
}

/// The scheduling fields of `core/v1` PodSpec.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PodSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    pub containers: Vec<Container>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_containers: Option<Vec<Container>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overhead: Option<BTreeMap<String, Quantity>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preemption_policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_claims: Option<Vec<PodResourceClaim>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduling_gates: Option<Vec<PodSchedulingGate>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduling_group: Option<PodSchedulingGroup>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology_spread_constraints: Option<Vec<TopologySpreadConstraint>>,
}

/// The scheduling fields of `core/v1` Container.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Container {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<ContainerPort>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
}

/// `core/v1` ResourceRequirements, its requests and limits as [`Quantities`].
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct ResourceRequirements {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claims: Option<Vec<ResourceClaim>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<Quantities>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests: Option<Quantities>,
}

/// A resource name → quantity map, as a list sorted by name. k8s-openapi types it as a
/// `BTreeMap`, whose first node has room for eleven pairs: with the one to three a container
/// names, the two maps of each cached container took about 1.3 KB of a pod's 5.7 (measured
/// by RSS over 20,000 decoded pods); as lists they take a tenth of that. Decoded as a map (a
/// name given twice keeps the last, as a map does), encoded as one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Quantities(Vec<(String, Quantity)>);

impl Quantities {
    pub fn get(&self, name: &str) -> Option<&Quantity> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name)).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// In name order.
    pub fn iter(&self) -> QuantitiesIter<'_> {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

/// [`Quantities::iter`]: pairs as a map's iterator gives them.
pub type QuantitiesIter<'a> = std::iter::Map<
    std::slice::Iter<'a, (String, Quantity)>,
    fn(&'a (String, Quantity)) -> (&'a String, &'a Quantity),
>;

impl<'a> IntoIterator for &'a Quantities {
    type Item = (&'a String, &'a Quantity);
    type IntoIter = QuantitiesIter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl FromIterator<(String, Quantity)> for Quantities {
    fn from_iter<I: IntoIterator<Item = (String, Quantity)>>(iter: I) -> Self {
        let map: BTreeMap<String, Quantity> = iter.into_iter().collect();
        Self(map.into_iter().collect())
    }
}

impl<'de> Deserialize<'de> for Quantities {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(BTreeMap::<String, Quantity>::deserialize(d)?.into_iter().collect())
    }
}

impl Serialize for Quantities {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// The fields of `core/v1` PodStatus a scheduler reads or writes.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PodStatus {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<PodCondition>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extended_resource_claim_status: Option<PodExtendedResourceClaimStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nominated_node_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_claim_statuses: Option<Vec<PodResourceClaimStatus>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
}

impl PodSpec {
    /// The spec as k8s-openapi types it, with only the fields kept here set (for a
    /// PodTemplate an autoscaler reads: what the pod asks and where it may go).
    pub fn to_full(&self) -> k8s_openapi::api::core::v1::PodSpec {
        // Every field here is one of the full spec's, under the same name: the round trip
        // cannot fail on a value these types produced.
        serde_json::to_value(self).and_then(serde_json::from_value).unwrap_or_default()
    }
}

/// `kube::Resource` for one of xpu's own `core/v1` types (`kube::Api` and the watch caches
/// need it; k8s-openapi's types get it through their own traits).
macro_rules! core_v1_resource {
    ($ty:ty, $kind:literal, $plural:literal, $scope:ty) => {
        impl kube::Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($kind)
            }

            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("")
            }

            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed("v1")
            }

            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                std::borrow::Cow::Borrowed($plural)
            }

            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }

            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
pub(crate) use core_v1_resource;

core_v1_resource!(Pod, "Pod", "pods", NamespaceResourceScope);

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod as the API server returns it, with the defaults it fills in.
    fn served() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "p", "namespace": "default", "uid": "u-1", "resourceVersion": "7",
                "labels": { "app": "a" }, "annotations": { "x": "y" },
                "managedFields": [{ "manager": "m", "operation": "Update", "apiVersion": "v1" }] },
            "spec": {
                "schedulerName": "xpu", "priority": 5, "nodeName": "n1",
                "nodeSelector": { "gpu": "a100" },
                "tolerations": [{ "key": "k", "operator": "Exists", "effect": "NoSchedule" }],
                "containers": [{ "name": "c", "image": "pause", "command": ["sleep"],
                    "env": [{ "name": "A", "value": "b" }],
                    "livenessProbe": { "exec": { "command": ["true"] } },
                    "ports": [{ "containerPort": 80, "hostPort": 8080 }],
                    "resources": { "requests": { "cpu": "1" }, "limits": { "nvidia.com/gpu": "2" } } }],
                "initContainers": [{ "name": "i", "restartPolicy": "Always",
                    "resources": { "requests": { "memory": "1Gi" } } }],
                "volumes": [{ "name": "v", "emptyDir": {} }],
                "dnsPolicy": "ClusterFirst", "securityContext": {}
            },
            "status": { "phase": "Running", "nominatedNodeName": "n2",
                "conditions": [{ "type": "PodScheduled", "status": "True" }],
                "containerStatuses": [{ "name": "c", "image": "pause", "imageID": "", "ready": true,
                    "restartCount": 0 }] }
        })
    }

    #[test]
    fn the_scheduling_fields_read_as_k8s_openapi_reads_them() {
        let slim: Pod = serde_json::from_value(served()).unwrap();
        let full: k8s_openapi::api::core::v1::Pod = serde_json::from_value(served()).unwrap();
        assert_eq!(slim.metadata, full.metadata);
        let (s, f) = (slim.spec.as_ref().unwrap(), full.spec.as_ref().unwrap());
        assert_eq!(s.scheduler_name, f.scheduler_name);
        assert_eq!(s.priority, f.priority);
        assert_eq!(s.node_name, f.node_name);
        assert_eq!(s.node_selector, f.node_selector);
        assert_eq!(s.tolerations, f.tolerations);
        // Resources are typed apart (see `Quantities`): compared as the API server writes them.
        let json = |v: &dyn erased::Json| v.json();
        assert_eq!(json(&s.containers[0].resources), json(&f.containers[0].resources));
        assert_eq!(s.containers[0].ports, f.containers[0].ports);
        let (si, fi) =
            (&s.init_containers.as_ref().unwrap()[0], &f.init_containers.as_ref().unwrap()[0]);
        assert_eq!(si.restart_policy, fi.restart_policy);
        assert_eq!(json(&si.resources), json(&fi.resources));
        let (ss, fs) = (slim.status.as_ref().unwrap(), full.status.as_ref().unwrap());
        assert_eq!(ss.phase, fs.phase);
        assert_eq!(ss.nominated_node_name, fs.nominated_node_name);
        assert_eq!(ss.conditions, fs.conditions);
        // Written back, only the kept fields remain, readable by k8s-openapi again.
        let again: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(serde_json::to_value(&slim).unwrap()).unwrap();
        assert_eq!(again.spec.unwrap().containers[0].resources, f.containers[0].resources);
        assert!(again.status.unwrap().container_statuses.is_none());
    }

    mod erased {
        /// Either crate's resources, as JSON.
        pub trait Json {
            fn json(&self) -> serde_json::Value;
        }
        impl<T: serde::Serialize> Json for T {
            fn json(&self) -> serde_json::Value {
                serde_json::to_value(self).unwrap()
            }
        }
    }

    #[test]
    fn quantities_read_and_write_as_the_map_they_stand_for() {
        let text = r#"{"requests":{"nvidia.com/gpu":"2","cpu":"1","memory":"1Gi","cpu":"3"},
                       "limits":{},"claims":[{"name":"gpu"}]}"#;
        let slim: ResourceRequirements = serde_json::from_str(text).unwrap();
        let full: k8s_openapi::api::core::v1::ResourceRequirements =
            serde_json::from_str(text).unwrap();
        let r = slim.requests.as_ref().unwrap();
        // A name given twice keeps the last, as the map does.
        assert_eq!(r.get("cpu").map(|q| q.0.as_str()), Some("3"));
        assert!(r.contains_key("nvidia.com/gpu") && !r.contains_key("gpu"));
        let names: Vec<&String> = r.iter().map(|(k, _)| k).collect();
        assert_eq!(names, full.requests.as_ref().unwrap().keys().collect::<Vec<_>>());
        assert!(slim.limits.as_ref().is_some_and(|l| l.iter().next().is_none()));
        assert_eq!(serde_json::to_value(&slim).unwrap(), serde_json::to_value(&full).unwrap());
        // Whatever k8s-openapi takes or refuses as a quantity, so do these.
        for odd in [r#"{"requests":{"cpu":1}}"#, r#"{"requests":[]}"#, r#"{"limits":{"a":null}}"#] {
            let full =
                serde_json::from_str::<k8s_openapi::api::core::v1::ResourceRequirements>(odd);
            let slim = serde_json::from_str::<ResourceRequirements>(odd);
            assert_eq!(slim.is_ok(), full.is_ok(), "{odd}");
        }
    }

    #[test]
    fn an_empty_object_is_a_pod_with_nothing_set() {
        let p: Pod = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(p, Pod::default());
        let p: Pod = serde_json::from_value(serde_json::json!({ "spec": {} })).unwrap();
        assert!(p.spec.unwrap().containers.is_empty());
    }
}
