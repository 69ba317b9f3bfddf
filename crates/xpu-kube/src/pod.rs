//! What the scheduler keeps of a Pod: the fields a cycle reads, decoded straight from the API
//! server's JSON, under the names and shapes k8s-openapi gives them.
//!
//! The watch cache holds every pod of the cluster, and at scale it is most of the scheduler's
//! memory. k8s-openapi's `Pod` is 2.5 KB before its first container and each `Container` 2.3 KB,
//! almost all of it fields no scheduler reads (probes, lifecycle hooks, security contexts,
//! volume mounts, statuses of every container); decoded and then trimmed, a one-container pod
//! held about 7 KB. These types keep only what placement, preemption, gangs, DRA and status
//! writes read, so a pod holds about a quarter of that, and the fields left out are never
//! decoded at all (serde skips unknown keys). The names match k8s-openapi's, so code reads a
//! cached pod as it would read the full one; the nested types (affinity, tolerations, claims,
//! resource requirements) are k8s-openapi's own.
//!
//! A field added to a cycle's reading must be added here: the compiler says so, since the
//! cycle only ever sees these types.

use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    Affinity, ContainerPort, PodCondition, PodExtendedResourceClaimStatus, PodResourceClaim,
    PodResourceClaimStatus, PodSchedulingGate, PodSchedulingGroup, ResourceRequirements,
    Toleration, TopologySpreadConstraint,
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
        assert_eq!(s.containers[0].resources, f.containers[0].resources);
        assert_eq!(s.containers[0].ports, f.containers[0].ports);
        let (si, fi) =
            (&s.init_containers.as_ref().unwrap()[0], &f.init_containers.as_ref().unwrap()[0]);
        assert_eq!((&si.restart_policy, &si.resources), (&fi.restart_policy, &fi.resources));
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

    #[test]
    fn an_empty_object_is_a_pod_with_nothing_set() {
        let p: Pod = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(p, Pod::default());
        let p: Pod = serde_json::from_value(serde_json::json!({ "spec": {} })).unwrap();
        assert!(p.spec.unwrap().containers.is_empty());
    }
}
