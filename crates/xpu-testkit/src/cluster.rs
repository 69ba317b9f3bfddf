//! xpu installed on real test nodes ([`crate::kubelet::Node`]) the way an admin installs it:
//! the image `scripts/build-image` makes, the Helm chart `deploy/helm/xpu` rendered with
//! `helm template`, and its objects created through the API server. Shared by the suite's
//! multi-node tests and `scripts/local-cluster` (the `local_cluster` example).
//!
//! [`for_fixture_nodes`] is the one place the rendering is changed for nodes that are not
//! machines.

use std::path::{Path, PathBuf};
use std::process::Command;

use ::kube::Client;
use ::kube::api::{Api, DynamicObject, PostParams};
use ::kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

use crate::kubelet::HOST_ROOT;

/// The Helm release `scripts/install-helm` installs (kept in step with it).
pub const HELM_VERSION: &str = "v3.22.0";

/// Where `scripts/install-helm` puts `helm` (`$XPU_HELM` overrides; `$XPU_HELM_CACHE` or the
/// XDG cache directory otherwise).
pub fn helm_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("XPU_HELM") {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("XPU_HELM_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir)
            .join("xpu/helm")
    });
    cache.join(HELM_VERSION).join("bin/helm")
}

/// `helm ARGS...` run in `repo`; its standard output, or what it said when it failed.
pub fn helm(repo: &Path, args: &[&str]) -> Result<String, String> {
    let helm = helm_binary();
    if !helm.exists() {
        return Err(format!("{} is missing: run scripts/install-helm", helm.display()));
    }
    let o = Command::new(&helm)
        .args(args)
        .current_dir(repo)
        .output()
        .map_err(|e| format!("running {}: {e}", helm.display()))?;
    if !o.status.success() {
        return Err(format!(
            "helm {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    String::from_utf8(o.stdout).map_err(|e| format!("helm {args:?} printed non-UTF-8: {e}"))
}

/// The chart rendered (`helm template xpu deploy/helm/xpu --namespace xpu-system`, for
/// Kubernetes v1.37.2) with `extra` arguments (`--set ...`), as JSON documents.
pub fn render_chart(repo: &Path, extra: &[&str]) -> Result<Vec<Value>, String> {
    let mut args = vec!["template", "xpu", "deploy/helm/xpu", "--namespace", "xpu-system"];
    args.extend_from_slice(&["--kube-version", "v1.37.2"]);
    args.extend_from_slice(extra);
    documents(&helm(repo, &args)?)
}

/// Every document of a YAML stream (a manifest file, helm's output), as JSON.
pub fn documents(text: &str) -> Result<Vec<Value>, String> {
    text.split("\n---")
        .filter(|d| d.lines().any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#')))
        .map(|d| serde_norway::from_str::<Value>(d).map_err(|e| format!("a YAML document: {e}")))
        .collect()
}

/// `scripts/build-image --binaries BINARIES --oci-archive OUT` in `repo`: xpu's image
/// (`localhost/xpu:<version>`, what the chart names) from binaries already built. Returns what
/// the script printed.
pub fn build_image(repo: &Path, binaries: &Path, out: &Path) -> Result<String, String> {
    let o = Command::new("bash")
        .arg(repo.join("scripts/build-image"))
        .arg("--binaries")
        .arg(binaries)
        .arg("--oci-archive")
        .arg(out)
        .current_dir(repo)
        .output()
        .map_err(|e| format!("running scripts/build-image: {e}"))?;
    if !o.status.success() {
        return Err(format!("scripts/build-image: {}", String::from_utf8_lossy(&o.stderr)));
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// kube-controller-manager's controllers for a cluster the chart is installed on: the harness's
/// defaults, those that run its Deployment and DaemonSets and give pods the API server's CA,
/// and `extra`.
pub fn chart_controllers(extra: &[&str]) -> Vec<String> {
    let mut c: Vec<String> =
        crate::kube::DEFAULT_CONTROLLERS.iter().map(ToString::to_string).collect();
    c.extend(
        [
            "daemonset-controller",
            "deployment-controller",
            "replicaset-controller",
            "root-ca-certificate-publisher-controller",
        ]
        .iter()
        .chain(extra)
        .map(ToString::to_string),
    );
    c
}

/// The one place the chart's rendering is changed for the fixture nodes, because they are not
/// machines: (1) `hostPath: /` (the node's root, which the agents read as `/host`) is the node's
/// fixture host at [`HOST_ROOT`]; (2) the nodes have no pod network and no Service proxy, so
/// every xpu pod runs in the node's network (`hostNetwork`), reaches the API server at its
/// loopback address (`KUBERNETES_SERVICE_HOST`/`PORT`, which in-cluster configuration reads)
/// and serves its metrics on the node's address (`0.0.0.0:PORT` → `$(POD_IP):PORT`, as the
/// nodes share one network namespace). Nothing else differs from what an admin applies.
pub fn for_fixture_nodes(doc: &mut Value, api_port: u16) {
    let Some(spec) = doc.pointer_mut("/spec/template/spec") else { return };
    for v in spec["volumes"].as_array_mut().into_iter().flatten() {
        if v.pointer("/hostPath/path").and_then(Value::as_str) == Some("/") {
            v["hostPath"]["path"] = json!(HOST_ROOT);
        }
    }
    spec["hostNetwork"] = json!(true);
    for c in spec["containers"].as_array_mut().into_iter().flatten() {
        let mut env = c["env"].as_array().cloned().unwrap_or_default();
        env.push(json!({ "name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1" }));
        env.push(json!({ "name": "KUBERNETES_SERVICE_PORT", "value": api_port.to_string() }));
        env.push(json!({
            "name": "POD_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } },
        }));
        c["env"] = Value::Array(env);
        for a in c["args"].as_array_mut().into_iter().flatten() {
            if let Some(s) = a.as_str()
                && s.contains("=0.0.0.0:")
            {
                *a = json!(s.replace("=0.0.0.0:", "=$(POD_IP):"));
            }
        }
    }
}

/// (group, version, plural, namespaced) of the kinds the chart and the tests create.
fn resource_of(kind: &str) -> Option<(&'static str, &'static str, &'static str, bool)> {
    Some(match kind {
        "Namespace" => ("", "v1", "namespaces", false),
        "Pod" => ("", "v1", "pods", true),
        "ServiceAccount" => ("", "v1", "serviceaccounts", true),
        "Service" => ("", "v1", "services", true),
        "Secret" => ("", "v1", "secrets", true),
        "ClusterRole" => ("rbac.authorization.k8s.io", "v1", "clusterroles", false),
        "ClusterRoleBinding" => ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", false),
        "Role" => ("rbac.authorization.k8s.io", "v1", "roles", true),
        "ConfigMap" => ("", "v1", "configmaps", true),
        "RoleBinding" => ("rbac.authorization.k8s.io", "v1", "rolebindings", true),
        "Deployment" => ("apps", "v1", "deployments", true),
        "DaemonSet" => ("apps", "v1", "daemonsets", true),
        "Job" => ("batch", "v1", "jobs", true),
        "DeviceClass" => ("resource.k8s.io", "v1", "deviceclasses", false),
        "ResourceClaim" => ("resource.k8s.io", "v1", "resourceclaims", true),
        "ResourceClaimTemplate" => ("resource.k8s.io", "v1", "resourceclaimtemplates", true),
        "PriorityClass" => ("scheduling.k8s.io", "v1", "priorityclasses", false),
        "PodDisruptionBudget" => ("policy", "v1", "poddisruptionbudgets", true),
        "ValidatingAdmissionPolicy" => {
            ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", false)
        }
        "ValidatingAdmissionPolicyBinding" => {
            ("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings", false)
        }
        _ => return None,
    })
}

/// Why [`create`] did not create an object.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("no resource is known for kind {0:?} (xpu_testkit::cluster knows the chart's kinds)")]
    UnknownKind(String),
    #[error("the document is not an object with apiVersion, kind and metadata: {0}")]
    Malformed(#[source] serde_json::Error),
    #[error(transparent)]
    Api(#[from] ::kube::Error),
}

/// Creates one object (server-side dry run when `dry_run`); one that exists already counts as
/// created.
pub async fn create(client: &Client, doc: &Value, dry_run: bool) -> Result<(), CreateError> {
    let kind = doc["kind"].as_str().unwrap_or("");
    let (group, version, plural, namespaced) =
        resource_of(kind).ok_or_else(|| CreateError::UnknownKind(kind.to_owned()))?;
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
    let ns = doc["metadata"]["namespace"].as_str().unwrap_or("default");
    let api: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(client.clone(), ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    };
    let obj: DynamicObject = serde_json::from_value(doc.clone()).map_err(CreateError::Malformed)?;
    let pp = PostParams { dry_run, ..PostParams::default() };
    match api.create(&pp, &obj).await {
        Ok(_) => Ok(()),
        Err(::kube::Error::Api(e)) if e.code == 409 && !dry_run => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixture_patch_changes_the_host_root_and_the_network_only() {
        let mut doc = json!({
            "kind": "DaemonSet",
            "spec": { "template": { "spec": {
                "volumes": [
                    { "name": "host", "hostPath": { "path": "/" } },
                    { "name": "plugins", "hostPath": { "path": "/var/lib/kubelet/device-plugins" } },
                ],
                "containers": [{ "name": "c", "args": ["exporter", "--listen=0.0.0.0:9402", "--root=/host"],
                    "env": [{ "name": "NODE_NAME", "value": "n" }] }],
            } } },
        });
        for_fixture_nodes(&mut doc, 6443);
        let spec = &doc["spec"]["template"]["spec"];
        assert_eq!(spec["volumes"][0]["hostPath"]["path"], HOST_ROOT);
        assert_eq!(spec["volumes"][1]["hostPath"]["path"], "/var/lib/kubelet/device-plugins");
        assert_eq!(spec["hostNetwork"], true);
        let c = &spec["containers"][0];
        assert_eq!(c["args"], json!(["exporter", "--listen=$(POD_IP):9402", "--root=/host"]));
        let names: Vec<&str> =
            c["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            ["NODE_NAME", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "POD_IP"]
        );
        assert_eq!(c["env"][2]["value"], "6443");
        // Not a workload: untouched.
        let mut ns = json!({ "kind": "Namespace", "metadata": { "name": "x" } });
        for_fixture_nodes(&mut ns, 6443);
        assert_eq!(ns, json!({ "kind": "Namespace", "metadata": { "name": "x" } }));
    }

    #[test]
    fn documents_skips_empty_and_comment_only_ones() {
        let docs = documents("# c\n---\na: 1\n---\n\n---\nb: [2]\n").unwrap();
        assert_eq!(docs, [json!({ "a": 1 }), json!({ "b": [2] })]);
        assert!(documents("a: [").is_err());
    }
}
