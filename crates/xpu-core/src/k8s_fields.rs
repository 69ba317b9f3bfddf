//! The field names of the Kubernetes objects xpu reads (`batch/v1` Job, `v1` Pod), so a field
//! the API does not have is reported as the API server's strict field validation reports it
//! (`kubectl` prints `Warning: unknown field "spec.template.spec.containres"`) instead of being
//! dropped without a word.
//!
//! The names are those of the published API reference (Kubernetes 1.35, alpha fields
//! included, since a cluster may enable them). The walk goes as deep as xpu reads: into the
//! metadata, the Job and pod specs, containers, env, resources, volumes and volume mounts, and
//! the pod's affinity (a misspelt `requiredDuringScheduling...` would otherwise be a rule
//! dropped without a word). Below that (probes, security contexts) a value is taken as written;
//! xpu does not act on those, and the API server checks them where they matter.

use serde_json::{Map, Value};

/// The shape of one value: a mapping with known fields, a list of one shape, or anything.
enum Shape {
    Fields(&'static [(&'static str, Shape)]),
    List(&'static Shape),
    Any,
}

use Shape::{Any, Fields, List};

const META: Shape = Fields(&[
    ("name", Any),
    ("generateName", Any),
    ("namespace", Any),
    ("selfLink", Any),
    ("uid", Any),
    ("resourceVersion", Any),
    ("generation", Any),
    ("creationTimestamp", Any),
    ("deletionTimestamp", Any),
    ("deletionGracePeriodSeconds", Any),
    ("labels", Any),
    ("annotations", Any),
    ("ownerReferences", Any),
    ("finalizers", Any),
    ("managedFields", Any),
]);

const ENV_SOURCE: Shape = Fields(&[
    ("fieldRef", Fields(&[("apiVersion", Any), ("fieldPath", Any)])),
    ("resourceFieldRef", Fields(&[("containerName", Any), ("resource", Any), ("divisor", Any)])),
    ("configMapKeyRef", Any),
    ("secretKeyRef", Any),
    ("fileKeyRef", Any),
]);

const ENV_VAR: Shape = Fields(&[("name", Any), ("value", Any), ("valueFrom", ENV_SOURCE)]);

const RESOURCES: Shape = Fields(&[("limits", Any), ("requests", Any), ("claims", Any)]);

const VOLUME_MOUNT: Shape = Fields(&[
    ("name", Any),
    ("readOnly", Any),
    ("recursiveReadOnly", Any),
    ("mountPath", Any),
    ("subPath", Any),
    ("mountPropagation", Any),
    ("subPathExpr", Any),
]);

const CONTAINER: Shape = Fields(&[
    ("name", Any),
    ("image", Any),
    ("command", Any),
    ("args", Any),
    ("workingDir", Any),
    ("ports", Any),
    ("envFrom", Any),
    ("env", List(&ENV_VAR)),
    ("resources", RESOURCES),
    ("resizePolicy", Any),
    ("restartPolicy", Any),
    ("restartPolicyRules", Any),
    ("volumeMounts", List(&VOLUME_MOUNT)),
    ("volumeDevices", Any),
    ("livenessProbe", Any),
    ("readinessProbe", Any),
    ("startupProbe", Any),
    ("lifecycle", Any),
    ("terminationMessagePath", Any),
    ("terminationMessagePolicy", Any),
    ("imagePullPolicy", Any),
    ("securityContext", Any),
    ("stdin", Any),
    ("stdinOnce", Any),
    ("tty", Any),
]);

const VOLUME: Shape = Fields(&[
    ("name", Any),
    ("emptyDir", Fields(&[("medium", Any), ("sizeLimit", Any)])),
    ("hostPath", Any),
    ("configMap", Any),
    ("secret", Any),
    ("persistentVolumeClaim", Any),
    ("projected", Any),
    ("downwardAPI", Any),
    ("ephemeral", Any),
    ("csi", Any),
    ("image", Any),
    ("nfs", Any),
    ("iscsi", Any),
    ("fc", Any),
    ("rbd", Any),
    ("cephfs", Any),
    ("cinder", Any),
    ("glusterfs", Any),
    ("gitRepo", Any),
    ("gcePersistentDisk", Any),
    ("awsElasticBlockStore", Any),
    ("azureDisk", Any),
    ("azureFile", Any),
    ("vsphereVolume", Any),
    ("flexVolume", Any),
    ("flocker", Any),
    ("quobyte", Any),
    ("photonPersistentDisk", Any),
    ("portworxVolume", Any),
    ("scaleIO", Any),
    ("storageos", Any),
]);

const SELECTOR_REQUIREMENT: Shape = Fields(&[("key", Any), ("operator", Any), ("values", Any)]);

const LABEL_SELECTOR: Shape =
    Fields(&[("matchLabels", Any), ("matchExpressions", List(&SELECTOR_REQUIREMENT))]);

const NODE_SELECTOR_TERM: Shape = Fields(&[
    ("matchExpressions", List(&SELECTOR_REQUIREMENT)),
    ("matchFields", List(&SELECTOR_REQUIREMENT)),
]);

const NODE_AFFINITY: Shape = Fields(&[
    (
        "requiredDuringSchedulingIgnoredDuringExecution",
        Fields(&[("nodeSelectorTerms", List(&NODE_SELECTOR_TERM))]),
    ),
    (
        "preferredDuringSchedulingIgnoredDuringExecution",
        List(&Fields(&[("weight", Any), ("preference", NODE_SELECTOR_TERM)])),
    ),
]);

const POD_AFFINITY_TERM: Shape = Fields(&[
    ("labelSelector", LABEL_SELECTOR),
    ("namespaces", Any),
    ("topologyKey", Any),
    ("namespaceSelector", LABEL_SELECTOR),
    ("matchLabelKeys", Any),
    ("mismatchLabelKeys", Any),
]);

const POD_AFFINITY: Shape = Fields(&[
    ("requiredDuringSchedulingIgnoredDuringExecution", List(&POD_AFFINITY_TERM)),
    (
        "preferredDuringSchedulingIgnoredDuringExecution",
        List(&Fields(&[("weight", Any), ("podAffinityTerm", POD_AFFINITY_TERM)])),
    ),
]);

const AFFINITY: Shape = Fields(&[
    ("nodeAffinity", NODE_AFFINITY),
    ("podAffinity", POD_AFFINITY),
    ("podAntiAffinity", POD_AFFINITY),
]);

const POD_SPEC: Shape = Fields(&[
    ("volumes", List(&VOLUME)),
    ("initContainers", List(&CONTAINER)),
    ("containers", List(&CONTAINER)),
    ("ephemeralContainers", Any),
    ("restartPolicy", Any),
    ("terminationGracePeriodSeconds", Any),
    ("activeDeadlineSeconds", Any),
    ("dnsPolicy", Any),
    ("dnsConfig", Any),
    ("nodeSelector", Any),
    ("serviceAccountName", Any),
    ("serviceAccount", Any),
    ("automountServiceAccountToken", Any),
    ("nodeName", Any),
    ("hostNetwork", Any),
    ("hostPID", Any),
    ("hostIPC", Any),
    ("hostUsers", Any),
    ("shareProcessNamespace", Any),
    ("securityContext", Any),
    ("imagePullSecrets", Any),
    ("hostname", Any),
    ("hostnameOverride", Any),
    ("subdomain", Any),
    ("setHostnameAsFQDN", Any),
    ("affinity", AFFINITY),
    ("schedulerName", Any),
    ("tolerations", Any),
    ("hostAliases", Any),
    ("priorityClassName", Any),
    ("priority", Any),
    ("preemptionPolicy", Any),
    ("readinessGates", Any),
    ("runtimeClassName", Any),
    ("enableServiceLinks", Any),
    ("overhead", Any),
    ("topologySpreadConstraints", Any),
    ("os", Any),
    ("schedulingGates", Any),
    ("schedulingGroup", Any),
    ("resourceClaims", Any),
    ("resources", RESOURCES),
    ("evictionResponders", Any),
]);

const TEMPLATE: Shape = Fields(&[("metadata", META), ("spec", POD_SPEC)]);

const JOB_SPEC: Shape = Fields(&[
    ("parallelism", Any),
    ("completions", Any),
    ("activeDeadlineSeconds", Any),
    ("podFailurePolicy", Any),
    ("successPolicy", Any),
    ("backoffLimit", Any),
    ("backoffLimitPerIndex", Any),
    ("maxFailedIndexes", Any),
    ("selector", Any),
    ("manualSelector", Any),
    ("template", TEMPLATE),
    ("ttlSecondsAfterFinished", Any),
    ("completionMode", Any),
    ("suspend", Any),
    ("podReplacementPolicy", Any),
    ("managedBy", Any),
]);

const JOB: Shape = Fields(&[
    ("apiVersion", Any),
    ("kind", Any),
    ("metadata", META),
    ("spec", JOB_SPEC),
    ("status", Any),
]);

const POD: Shape = Fields(&[
    ("apiVersion", Any),
    ("kind", Any),
    ("metadata", META),
    ("spec", POD_SPEC),
    ("status", Any),
]);

/// Most unknown fields reported one by one; past it, one line says how many more there are.
const MAX_REPORTED: usize = 20;

/// Every field of a Job (`is_pod` false) or Pod document that the API does not define, as
/// `kubectl` names them: `unknown field "spec.template.spec.containres"`. `prefix` goes in front
/// of each path (`document[1]` in a multi-document file). Values of the wrong type are not
/// reported here; the parser refuses those where it reads them.
pub(crate) fn unknown_fields(doc: &Map<String, Value>, is_pod: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut extra = 0usize;
    let shape = if is_pod { &POD } else { &JOB };
    walk_fields(doc, shape, "", &mut out, &mut extra);
    if extra > 0 {
        out.push(format!("{extra} more unknown fields"));
    }
    out
}

fn walk(v: &Value, shape: &Shape, path: &str, out: &mut Vec<String>, extra: &mut usize) {
    match (shape, v) {
        (Fields(_), Value::Object(m)) => walk_fields(m, shape, path, out, extra),
        (List(item), Value::Array(items)) => {
            for (i, v) in items.iter().enumerate() {
                walk(v, item, &format!("{path}[{i}]"), out, extra);
            }
        }
        _ => {}
    }
}

fn walk_fields(
    m: &Map<String, Value>,
    shape: &Shape,
    path: &str,
    out: &mut Vec<String>,
    extra: &mut usize,
) {
    let Fields(fields) = shape else { return };
    // In key order whatever the map type (serde_json keeps document order when another crate
    // of the build turns on its `preserve_order`), so the notes are the same in every build.
    let mut keys: Vec<(&String, &Value)> = m.iter().collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in keys {
        let here = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
        match fields.iter().find(|(name, _)| name == k) {
            Some((_, inner)) => walk(v, inner, &here, out, extra),
            None if out.len() < MAX_REPORTED => out.push(format!("unknown field {here:?}")),
            None => *extra += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unknown(yaml: &str, is_pod: bool) -> Vec<String> {
        let v: Value = serde_norway::from_str(yaml).unwrap();
        unknown_fields(v.as_object().unwrap(), is_pod)
    }

    #[test]
    fn a_well_formed_job_has_no_unknown_fields() {
        let job = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j, labels: {anything: goes}}\nspec:\n  completions: 2\n  completionMode: Indexed\n  template:\n    metadata: {annotations: {a: b}}\n    spec:\n      restartPolicy: Never\n      affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: a, operator: Exists}]}]}}, podAntiAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: 1, podAffinityTerm: {topologyKey: t, labelSelector: {matchLabels: {a: b}}}}]}}\n      volumes: [{name: d, emptyDir: {medium: Memory, sizeLimit: 1Gi}}]\n      initContainers: [{name: i, image: busybox, restartPolicy: Always}]\n      containers:\n      - name: c\n        image: busybox\n        env: [{name: A, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]\n        resources: {limits: {nvidia.com/gpu: 1}}\n        volumeMounts: [{name: d, mountPath: /d}]\n";
        assert_eq!(unknown(job, false), Vec::<String>::new());
    }

    #[test]
    fn misspelt_and_misplaced_fields_are_named_by_their_path() {
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p, label: {a: b}}\nspec:\n  restartPolicy: Never\n  containres: []\n  containers:\n  - name: c\n    imagePullPolice: Always\n    env: [{name: A, valu: x}]\n    resources: {limit: {nvidia.com/gpu: 1}}\n";
        assert_eq!(
            unknown(pod, true),
            vec![
                "unknown field \"metadata.label\"",
                "unknown field \"spec.containers[0].env[0].valu\"",
                "unknown field \"spec.containers[0].imagePullPolice\"",
                "unknown field \"spec.containers[0].resources.limit\"",
                "unknown field \"spec.containres\"",
            ]
        );
        let affinity = "apiVersion: v1\nkind: Pod\nspec:\n  affinity:\n    podAntiAffinity:\n      requiredDuringScheduling: [{topologyKey: k}]\n      requiredDuringSchedulingIgnoredDuringExecution: [{topologyKey: k, labelSelecter: {}}]\n";
        assert_eq!(
            unknown(affinity, true),
            vec![
                "unknown field \"spec.affinity.podAntiAffinity.requiredDuringScheduling\"",
                "unknown field \"spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelecter\"",
            ]
        );
        // A Job's fields are not a Pod's.
        let job_in_pod = "apiVersion: v1\nkind: Pod\nspec: {completions: 2, containers: []}\n";
        assert_eq!(unknown(job_in_pod, true), vec!["unknown field \"spec.completions\""]);
    }

    #[test]
    fn many_unknown_fields_are_counted_past_the_first_twenty() {
        let keys: String = (0..25).map(|i| format!("f{i}: 1\n")).collect();
        let got = unknown(&format!("apiVersion: v1\nkind: Pod\n{keys}"), true);
        assert_eq!(got.len(), MAX_REPORTED + 1);
        assert_eq!(got.last().map(String::as_str), Some("5 more unknown fields"));
    }
}
