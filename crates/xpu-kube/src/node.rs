//! What the scheduler keeps of a Node: its labels, taints, whether it is cordoned, what it
//! offers and its conditions, decoded straight from the API server's JSON under k8s-openapi's
//! names, as [`crate::pod`] does for pods.
//!
//! A kubelet's Node also carries its image list, addresses, daemon endpoints, runtime
//! handlers, features and node info, which no scheduling decision reads; k8s-openapi's `Node`
//! is 1.5 KB inline before any of it. At 15,000 nodes the difference is tens of MiB, and the
//! fields left out are never decoded.

use std::collections::BTreeMap;

use k8s_openapi::ClusterResourceScope;
use k8s_openapi::api::core::v1::{NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// A Node as the scheduler's watch cache keeps it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<NodeSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<NodeStatus>,
}

/// The scheduling fields of `core/v1` NodeSpec.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub taints: Option<Vec<Taint>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unschedulable: Option<bool>,
}

/// The scheduling fields of `core/v1` NodeStatus.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeStatus {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocatable: Option<BTreeMap<String, Quantity>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<BTreeMap<String, Quantity>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<NodeCondition>>,
}

crate::pod::core_v1_resource!(Node, "Node", "nodes", ClusterResourceScope);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kubelets_node_reads_as_k8s_openapi_reads_its_scheduling_fields() {
        let served = serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": "n1", "resourceVersion": "9", "labels": { "zone": "a" } },
            "spec": { "unschedulable": true, "podCIDR": "10.0.0.0/24",
                "taints": [{ "key": "k", "value": "v", "effect": "NoSchedule" }] },
            "status": {
                "capacity": { "cpu": "8", "nvidia.com/gpu": "4" },
                "allocatable": { "cpu": "7500m", "pods": "110" },
                "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady" }],
                "images": [{ "names": ["pause"], "sizeBytes": 1 }],
                "nodeInfo": { "machineID": "m", "systemUUID": "s", "bootID": "b",
                    "kernelVersion": "6", "osImage": "x", "containerRuntimeVersion": "c",
                    "kubeletVersion": "v1.37.2", "kubeProxyVersion": "", "operatingSystem": "linux",
                    "architecture": "amd64" },
                "addresses": [{ "type": "InternalIP", "address": "127.0.0.2" }]
            }
        });
        let slim: Node = serde_json::from_value(served.clone()).unwrap();
        let full: k8s_openapi::api::core::v1::Node = serde_json::from_value(served).unwrap();
        assert_eq!(slim.metadata, full.metadata);
        let (s, f) = (slim.spec.unwrap(), full.spec.unwrap());
        assert_eq!((s.taints, s.unschedulable), (f.taints, f.unschedulable));
        let (s, f) = (slim.status.unwrap(), full.status.unwrap());
        assert_eq!(s.capacity, f.capacity);
        assert_eq!(s.allocatable, f.allocatable);
        assert_eq!(s.conditions, f.conditions);
    }
}
