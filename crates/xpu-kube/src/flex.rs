//! Flex-start on Kubernetes: capacity that appears all at once for a whole gang, asked of the
//! cluster autoscaler through its ProvisioningRequest API (`autoscaling.x-k8s.io/v1`), as Kueue
//! does for GKE's flex-start and queued-provisioning node pools.
//!
//! A gang (or single pod) aimed at a flex-start pool (`cloud.google.com/gke-flex-start: "true"`
//! or `xpu.dev/flex-start: "true"` in its node selector) that does not fit the nodes there are
//! gets one request of class [`CLASS`] with one PodTemplate for all its pods. Its pods are
//! annotated with the request ([`CONSUME`]) and wait, holding nothing, until the request is
//! `Provisioned`; then the gang is placed whole on the new nodes like any other. A request that
//! ends (`Failed`, `BookingExpired`, `CapacityRevoked`) is reported on the pods and asked again,
//! under a new name, after a backoff that doubles each attempt; which attempt it is travels on
//! the pods ([`ATTEMPT`]), so a restarted scheduler carries on where the last one was.
//!
//! Everything here is pure: [`crate::cycle`] decides, the driver creates and deletes.

use std::collections::BTreeMap;

use crate::pod::Pod;
use k8s_openapi::api::core::v1::{PodTemplate, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, OwnerReference};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The provisioning class for capacity that comes whole or not at all, the one GKE's
/// flex-start and queued provisioning serve.
pub const CLASS: &str = "best-effort-atomic-scale-up.autoscaling.x-k8s.io";
/// Pod annotation: the request whose capacity this pod consumes.
pub const CONSUME: &str = "autoscaling.x-k8s.io/consume-provisioning-request";
/// Pod annotation: the class of that request.
pub const CLASS_ANNOTATION: &str = "autoscaling.x-k8s.io/provisioning-class-name";
/// Pod annotation: which of xpu's attempts the request is (1, 2, ...). Its presence says the
/// request is xpu's to make again; a request named by anyone else is only reported.
pub const ATTEMPT: &str = "xpu.dev/provisioning-attempt";
/// Node selectors that aim a pod at flex-start capacity.
pub const FLEX_SELECTORS: [&str; 2] = ["cloud.google.com/gke-flex-start", "xpu.dev/flex-start"];
/// Conditions after which a request's capacity is gone (or never came).
const ENDED: [&str; 3] = ["Failed", "BookingExpired", "CapacityRevoked"];

/// ProvisioningRequest: additional capacity to provision for a set of pods, as the cluster
/// autoscaler's API (`autoscaling.x-k8s.io/v1`) defines it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "autoscaling.x-k8s.io",
    version = "v1",
    kind = "ProvisioningRequest",
    namespaced,
    status = "ProvisioningRequestStatus",
    derive = "PartialEq",
    shortname = "provreq",
    shortname = "provreqs",
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    doc = "ProvisioningRequest asks for capacity for a set of pods: the cluster autoscaler finds or adds it, and reports in status.conditions."
)]
#[serde(rename_all = "camelCase")]
pub struct ProvisioningRequestSpec {
    /// Groups of identical pods to provision for (1 to 32). Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("Value is immutable"))]
    #[schemars(length(min = 1, max = 32))]
    pub pod_sets: Vec<PodSet>,
    /// How to provision: `check-capacity.autoscaling.x-k8s.io`,
    /// `best-effort-atomic-scale-up.autoscaling.x-k8s.io`, or a provider's class. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("Value is immutable"))]
    #[schemars(
        length(max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub provisioning_class_name: String,
    /// Class parameters, each at most 255 characters (100 at most). Immutable.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("Value is immutable"))]
    #[schemars(length(max = 100))]
    pub parameters: BTreeMap<String, String>,
}

/// One group of pods: a PodTemplate in the same namespace and how many pods use it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodSet {
    pub pod_template_ref: Reference,
    #[schemars(range(min = 1))]
    pub count: i32,
}

/// An object in the request's namespace, by name.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
pub struct Reference {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// What the autoscaler observed: conditions `Accepted`, `Provisioned`, `Failed`,
/// `BookingExpired`, `CapacityRevoked`, and class-specific details.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProvisioningRequestStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(length(max = 64))]
    pub provisioning_class_details: BTreeMap<String, String>,
}

/// The ProvisioningRequest CustomResourceDefinition, generated from the types above.
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    <ProvisioningRequest as kube::CustomResourceExt>::crd()
}

/// Whether a pod's node selector aims it at flex-start capacity.
pub fn aimed(node_selector: &BTreeMap<String, String>) -> bool {
    FLEX_SELECTORS.iter().any(|k| node_selector.get(*k).is_some_and(|v| v == "true"))
}

/// Where a request stands.
#[derive(Debug, Clone, PartialEq)]
pub enum State<'a> {
    /// Not provisioned yet; the latest condition says why, when there is one.
    Waiting(Option<&'a Condition>),
    Provisioned,
    /// The capacity is gone or never came: this condition (`Failed`, ...) says so.
    Ended(&'a Condition),
}

/// The state of `r` from its conditions.
pub fn state(r: &ProvisioningRequest) -> State<'_> {
    let conds: &[Condition] = r.status.as_ref().map_or(&[], |s| &s.conditions);
    let is_true = |t: &str| conds.iter().find(|c| c.type_ == t && c.status == "True");
    if let Some(c) = ENDED.iter().find_map(|t| is_true(t)) {
        return State::Ended(c);
    }
    if is_true("Provisioned").is_some() {
        return State::Provisioned;
    }
    State::Waiting(conds.iter().max_by_key(|c| c.last_transition_time.0))
}

/// Seconds to wait after attempt `attempt` ended before the next: `base`, doubled per attempt,
/// at most `max`.
pub fn backoff(attempt: u32, base: u64, max: u64) -> u64 {
    base.saturating_mul(1u64 << attempt.saturating_sub(1).min(32)).min(max)
}

/// `NAME-flex-N`, kept a valid object name (253 characters at most).
pub fn request_name(base: &str, attempt: u32) -> String {
    let suffix = format!("-flex-{attempt}");
    let mut b: String = base.chars().take(253 - suffix.len()).collect();
    while b.ends_with(['-', '.']) {
        b.pop();
    }
    b + &suffix
}

/// What the driver makes for one gang: its PodTemplate and request, and the pods to point at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Provision {
    pub namespace: String,
    pub template: PodTemplate,
    pub request: ProvisioningRequest,
    /// The pods that consume it, annotated with [`CONSUME`], [`CLASS_ANNOTATION`], [`ATTEMPT`].
    pub pods: Vec<crate::cycle::PodKey>,
    pub attempt: u32,
    /// The ended request this one replaces (deleted, with its template).
    pub retire: Option<String>,
}

impl Provision {
    pub fn name(&self) -> &str {
        self.request.metadata.name.as_deref().unwrap_or_default()
    }
}

/// The request for `count` pods like `pod`, named `name`. Owned by the pods' Job when they
/// have one, else by the pods themselves, so the garbage collector removes it with them.
pub fn provision(
    pod: &Pod,
    members: &[&Pod],
    name: String,
    count: u32,
    attempt: u32,
    retire: Option<String>,
) -> Provision {
    let namespace = pod.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let owners: Vec<OwnerReference> = match crate::convert::job_owner(pod) {
        Some(j) => {
            vec![OwnerReference { controller: None, block_owner_deletion: None, ..j.clone() }]
        }
        None => members
            .iter()
            .filter_map(|p| {
                Some(OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: p.metadata.name.clone()?,
                    uid: p.metadata.uid.clone()?,
                    ..OwnerReference::default()
                })
            })
            .collect(),
    };
    let labels = BTreeMap::from([("app.kubernetes.io/managed-by".to_owned(), "xpu".to_owned())]);
    let meta = ObjectMeta {
        name: Some(name.clone()),
        namespace: Some(namespace.clone()),
        labels: Some(labels),
        owner_references: Some(owners),
        ..ObjectMeta::default()
    };
    // The pod as the autoscaler should imagine it: what it asks and where it may go, not where
    // it is or what it was told.
    let mut spec = pod.spec.as_ref().map(crate::pod::PodSpec::to_full).unwrap_or_default();
    spec.node_name = None;
    let template = PodTemplate {
        metadata: meta.clone(),
        template: Some(PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: pod.metadata.labels.clone(),
                ..ObjectMeta::default()
            }),
            spec: Some(spec),
        }),
    };
    let request = ProvisioningRequest {
        metadata: meta,
        spec: ProvisioningRequestSpec {
            pod_sets: vec![PodSet {
                pod_template_ref: Reference { name: name.clone() },
                count: i32::try_from(count).unwrap_or(i32::MAX),
            }],
            provisioning_class_name: CLASS.into(),
            parameters: BTreeMap::new(),
        },
        status: None,
    };
    let pods = members.iter().filter_map(|p| crate::cycle::PodKey::of(p)).collect();
    Provision { namespace, template, request, pods, attempt, retire }
}

/// A condition as one line: `Failed (CapacityIsNotFound): no zone has v5p capacity`.
pub fn describe(c: &Condition) -> String {
    let mut s = c.type_.clone();
    if !c.reason.is_empty() {
        s.push_str(&format!(" ({})", c.reason));
    }
    if !c.message.is_empty() {
        s.push_str(&format!(": {}", c.message));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::CustomResourceExt;

    fn cond(t: &str, status: &str, at: i64) -> Condition {
        Condition {
            type_: t.into(),
            status: status.into(),
            reason: "R".into(),
            message: "m".into(),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::from_second(at).unwrap()),
            observed_generation: None,
        }
    }

    fn with(conds: Vec<Condition>) -> ProvisioningRequest {
        let mut r = ProvisioningRequest::new(
            "r",
            ProvisioningRequestSpec {
                pod_sets: vec![],
                provisioning_class_name: CLASS.into(),
                parameters: BTreeMap::new(),
            },
        );
        r.status = Some(ProvisioningRequestStatus { conditions: conds, ..Default::default() });
        r
    }

    #[test]
    fn an_ended_request_wins_over_provisioned_and_the_latest_condition_explains_waiting() {
        let r = with(vec![cond("Provisioned", "True", 5), cond("BookingExpired", "True", 9)]);
        assert!(matches!(state(&r), State::Ended(c) if c.type_ == "BookingExpired"));
        let r = with(vec![cond("Accepted", "True", 5), cond("Provisioned", "True", 9)]);
        assert_eq!(state(&r), State::Provisioned);
        let r = with(vec![cond("Accepted", "True", 5), cond("Provisioned", "False", 9)]);
        assert!(matches!(state(&r), State::Waiting(Some(c)) if c.type_ == "Provisioned"));
        assert_eq!(state(&with(vec![])), State::Waiting(None));
        let r = with(vec![cond("Failed", "False", 5)]);
        assert!(matches!(state(&r), State::Waiting(Some(_))));
    }

    #[test]
    fn backoff_doubles_and_stops_at_its_cap() {
        assert_eq!(backoff(1, 30, 900), 30);
        assert_eq!(backoff(2, 30, 900), 60);
        assert_eq!(backoff(5, 30, 900), 480);
        assert_eq!(backoff(6, 30, 900), 900);
        assert_eq!(backoff(u32::MAX, 30, 900), 900);
        assert_eq!(backoff(0, 30, 900), 30);
    }

    #[test]
    fn names_stay_valid_object_names() {
        assert_eq!(request_name("job-1", 2), "job-1-flex-2");
        let long = format!("{}-x", "a".repeat(300));
        let n = request_name(&long, 12);
        assert!(n.len() <= 253 && n.ends_with("a-flex-12"), "{n}");
    }

    #[test]
    fn the_crd_is_the_published_api() {
        let crd = ProvisioningRequest::crd();
        assert_eq!(crd.metadata.name.as_deref(), Some("provisioningrequests.autoscaling.x-k8s.io"));
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1");
        assert!(v.subresources.as_ref().is_some_and(|s| s.status.is_some()));
        let schema = serde_json::to_value(&v.schema).unwrap();
        let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(spec["required"], serde_json::json!(["podSets", "provisioningClassName"]));
        assert_eq!(spec["properties"]["podSets"]["maxItems"], 32);
        assert_eq!(
            spec["properties"]["podSets"]["x-kubernetes-validations"][0]["rule"],
            "self == oldSelf"
        );
        let conds = &schema["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"];
        assert_eq!(conds["x-kubernetes-list-type"], "map");
    }

    #[test]
    fn a_jobs_request_is_owned_by_the_job_and_its_template_drops_the_node() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "job-1-0-x", "namespace": "ml", "uid": "u0",
                "labels": { "job-name": "job-1" },
                "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": "job-1",
                    "uid": "j1", "controller": true, "blockOwnerDeletion": true }] },
            "spec": { "nodeName": "n", "containers": [{ "name": "c", "image": "i" }],
                "nodeSelector": { "cloud.google.com/gke-flex-start": "true" } }
        }))
        .unwrap();
        let p = provision(&pod, &[&pod], request_name("job-1", 1), 2, 1, None);
        assert_eq!(p.name(), "job-1-flex-1");
        assert_eq!(p.namespace, "ml");
        let owners = p.request.metadata.owner_references.as_ref().unwrap();
        assert_eq!((owners[0].kind.as_str(), owners[0].uid.as_str()), ("Job", "j1"));
        assert_eq!(owners[0].controller, None);
        assert_eq!(p.request.spec.pod_sets[0].count, 2);
        assert_eq!(p.request.spec.pod_sets[0].pod_template_ref.name, "job-1-flex-1");
        let spec = p.template.template.as_ref().unwrap().spec.as_ref().unwrap();
        assert_eq!(spec.node_name, None);
        assert!(aimed(spec.node_selector.as_ref().unwrap()));
        assert_eq!(p.pods[0].uid, "u0");
    }
}
