//! GPU sharing on Kubernetes: how the scheduler records which GPU a share pod gets, and how
//! xpu's device plugin finds that record and trusts it.
//!
//! The kubelet's `Allocate` names device ids, not a pod, and for [`SHARE_RESOURCE`] the ids are
//! interchangeable units (1000 per GPU). So the scheduler writes its choice on the pod in the
//! same request that binds it (annotations of the `Binding`, which the API server copies onto
//! the pod together with `spec.nodeName`):
//! - [`GPUS_ANNOTATION`]: the GPU indices on the node, `0` or `2,3`;
//! - [`SIGNATURE_ANNOTATION`]: HMAC-SHA256 over the pod's uid, the node, the indices and the
//!   amount asked, keyed with a secret only the scheduler and the device plugins hold
//!   (`--share-key FILE`, a mounted Secret).
//!
//! Anyone who can create or edit a pod can write annotations, and can set `spec.nodeName`
//! to skip the scheduler. The signature is what stops such a pod from picking a GPU: it names
//! the pod's uid and node, so it cannot be copied to another pod, moved to another node, or
//! changed, and the plugin refuses a pod without a valid one ([`ApiResolver`]).
//!
//! The plugin finds the pod as gpushare and HAMi do: among the pods bound to its node that ask
//! for exactly the amount being allocated, carry a valid signature and have not been given
//! devices yet, the oldest (the kubelet admits pods in creation order). When two such pods
//! are admitted out of that order they swap GPUs; both GPUs were chosen by the scheduler for a
//! share of that size, so no GPU holds more than the scheduler placed on it.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use crate::pod::Pod;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use tracing::{info, warn};
use xpu_integrations::deviceplugin::{ShareGrant, ShareResolver};

pub use crate::convert::{MILLI_PER_GPU, SHARE_RESOURCE};

/// The GPU indices the scheduler chose, on the pod.
pub const GPUS_ANNOTATION: &str = "xpu.dev/gpus";
/// The scheduler's signature over the choice.
pub const SIGNATURE_ANNOTATION: &str = "xpu.dev/gpus-signature";
/// Set by the device plugin once the pod's container was given its GPUs.
pub const ALLOCATED_ANNOTATION: &str = "xpu.dev/gpus-allocated";

/// Shortest key accepted, in bytes (the HMAC-SHA256 block security level).
pub const MIN_KEY_BYTES: usize = 32;
/// Longest key file read.
const MAX_KEY_BYTES: u64 = 4096;

/// Errors loading the key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error(
        "share key {path} cannot be read; create it with `head -c 32 /dev/urandom > FILE` or mount the Secret there"
    )]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "share key {path} has {len} bytes; it needs {MIN_KEY_BYTES} to {MAX_KEY_BYTES} random bytes (head -c 32 /dev/urandom)"
    )]
    Length { path: String, len: u64 },
}

/// The secret the scheduler signs with and the device plugins check with.
pub struct ShareKey(ring::hmac::Key);

impl std::fmt::Debug for ShareKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShareKey(..)")
    }
}

impl ShareKey {
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes))
    }

    /// Reads a key file (surrounding whitespace is part of the key: a Secret holds raw bytes).
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        use std::io::Read;
        let shown = path.display().to_string();
        let f = std::fs::File::open(path)
            .map_err(|source| KeyError::Read { path: shown.clone(), source })?;
        let mut bytes = Vec::new();
        f.take(MAX_KEY_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| KeyError::Read { path: shown.clone(), source })?;
        let len = bytes.len() as u64;
        if !(MIN_KEY_BYTES as u64..=MAX_KEY_BYTES).contains(&len) {
            return Err(KeyError::Length { path: shown, len });
        }
        Ok(Self::from_bytes(&bytes))
    }

    /// The signature of a choice, hex.
    pub fn sign(&self, uid: &str, node: &str, gpus: &[u16], ask: u64) -> String {
        let tag = ring::hmac::sign(&self.0, message(uid, node, gpus, ask).as_bytes());
        hex(tag.as_ref())
    }

    /// Whether `signature` is this key's for the choice (constant time).
    pub fn verify(&self, uid: &str, node: &str, gpus: &[u16], ask: u64, signature: &str) -> bool {
        let Some(tag) = unhex(signature) else { return false };
        ring::hmac::verify(&self.0, message(uid, node, gpus, ask).as_bytes(), &tag).is_ok()
    }
}

fn message(uid: &str, node: &str, gpus: &[u16], ask: u64) -> String {
    format!("xpu-gpu-share/v1\n{uid}\n{node}\n{}\n{ask}", format_gpus(gpus))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

/// `0,1`.
pub fn format_gpus(gpus: &[u16]) -> String {
    gpus.iter().map(u16::to_string).collect::<Vec<_>>().join(",")
}

/// Parses [`GPUS_ANNOTATION`]: distinct indices below the per-node device limit.
pub fn parse_gpus(s: &str) -> Option<Vec<u16>> {
    if s.len() > 512 {
        return None;
    }
    let mut out: Vec<u16> = Vec::new();
    for part in s.split(',') {
        let i: u16 = part.trim().parse().ok()?;
        if usize::from(i) >= xpu_sched::cluster::MAX_DEVICES || out.contains(&i) {
            return None;
        }
        out.push(i);
    }
    Some(out)
}

/// The GPUs a bound pod's [`GPUS_ANNOTATION`] records, when it records valid ones (the
/// annotation is not checked against its signature here: this is what the pod holds, not a
/// choice to act on).
pub fn recorded_gpus(p: &Pod) -> Option<Vec<u16>> {
    p.metadata.annotations.as_ref()?.get(GPUS_ANNOTATION).and_then(|g| parse_gpus(g))
}

/// What a pod asks of [`SHARE_RESOURCE`] (0 when nothing).
pub fn ask_of(p: &Pod) -> u64 {
    crate::convert::usage(p).ok().and_then(|u| u.devices.get(SHARE_RESOURCE).copied()).unwrap_or(0)
}

/// How many GPUs an ask spans, and the share of each.
pub fn spread(ask: u64) -> Option<(usize, u16)> {
    match ask {
        0 => None,
        a if a < MILLI_PER_GPU => Some((1, a as u16)),
        a if a % MILLI_PER_GPU == 0 => Some(((a / MILLI_PER_GPU) as usize, MILLI_PER_GPU as u16)),
        _ => None,
    }
}

/// The GPUs a pod bound to `node` was given by the scheduler, if its record is intact and
/// signed with `key`.
pub fn verified_choice(p: &Pod, node: &str, key: &ShareKey) -> Result<Vec<u16>, String> {
    let ann = p.metadata.annotations.as_ref();
    let get = |k: &str| ann.and_then(|a| a.get(k));
    let uid = p.metadata.uid.as_deref().unwrap_or("");
    let gpus = get(GPUS_ANNOTATION).ok_or("no GPU choice from the xpu scheduler")?;
    let gpus =
        parse_gpus(gpus).ok_or_else(|| format!("{GPUS_ANNOTATION} {gpus:?} is malformed"))?;
    let ask = ask_of(p);
    if spread(ask).map(|(n, _)| n) != Some(gpus.len()) {
        return Err(format!("{GPUS_ANNOTATION} names {} GPUs for an ask of {ask}", gpus.len()));
    }
    let sig = get(SIGNATURE_ANNOTATION).ok_or("the GPU choice is not signed")?;
    if !key.verify(uid, node, &gpus, ask, sig) {
        return Err("the GPU choice's signature does not match (not written by the xpu scheduler for this pod and node)".into());
    }
    Ok(gpus)
}

fn terminal(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_some()
        || matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        )
}

/// The device plugin's view of the API server: finds the pod an `Allocate` is for.
pub struct ApiResolver {
    client: Client,
    node: String,
    key: ShareKey,
    /// Pods already given devices by this process (the annotation may not be visible yet).
    granted: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for ApiResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiResolver").field("node", &self.node).finish_non_exhaustive()
    }
}

impl ApiResolver {
    pub fn new(client: Client, node: String, key: ShareKey) -> Self {
        Self { client, node, key, granted: Mutex::default() }
    }

    fn granted(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // Only inserts happen under the lock; a poisoned set is still a valid set.
        self.granted.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Picks the pod among `pods` (all bound to this node) that an allocation of `milli` is
    /// for. Pure, for tests.
    pub fn choose(&self, pods: &[Pod], milli: u64) -> Result<(Pod, Vec<u16>), String> {
        let granted = self.granted().clone();
        let mut refused: Vec<String> = Vec::new();
        let mut valid: Vec<(&Pod, Vec<u16>)> = Vec::new();
        for p in pods {
            let uid = p.metadata.uid.as_deref().unwrap_or("");
            let allocated = p
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(ALLOCATED_ANNOTATION));
            if terminal(p) || allocated || granted.contains(uid) || ask_of(p) != milli {
                continue;
            }
            let name = format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or("default"),
                p.metadata.name.as_deref().unwrap_or("")
            );
            match verified_choice(p, &self.node, &self.key) {
                Ok(gpus) => valid.push((p, gpus)),
                Err(why) => refused.push(format!("{name}: {why}")),
            }
        }
        valid.sort_by(|(a, _), (b, _)| {
            (&a.metadata.creation_timestamp, &a.metadata.name)
                .partial_cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        match valid.into_iter().next() {
            Some((p, gpus)) => Ok((p.clone(), gpus)),
            None => {
                let seen = if refused.is_empty() {
                    "none is bound here".to_owned()
                } else {
                    refused.truncate(8);
                    refused.join("; ")
                };
                Err(format!(
                    "no pod on node {} asking {SHARE_RESOURCE}: {milli} has a GPU chosen by the xpu scheduler ({seen}); a pod gets a GPU share only through the xpu scheduler (schedulerName: xpu, no nodeName or {GPUS_ANNOTATION} of its own)",
                    self.node
                ))
            }
        }
    }
}

#[tonic::async_trait]
impl ShareResolver for ApiResolver {
    async fn resolve(&self, milli: u64) -> Result<ShareGrant, String> {
        let api: Api<Pod> = Api::all(self.client.clone());
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let pods = tokio::time::timeout(Duration::from_secs(10), api.list(&lp))
            .await
            .map_err(|_| "listing this node's pods timed out after 10 s".to_owned())?
            .map_err(|e| format!("listing this node's pods: {e}"))?;
        let (pod, gpus) = self.choose(&pods.items, milli)?;
        let (ns, name, uid) = (
            pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            pod.metadata.name.clone().unwrap_or_default(),
            pod.metadata.uid.clone().unwrap_or_default(),
        );
        self.granted().insert(uid);
        let per_gpu = spread(milli).map(|(_, m)| m).unwrap_or(MILLI_PER_GPU as u16);
        info!(pod = %format!("{ns}/{name}"), gpus = %format_gpus(&gpus), milli, "GPU share allocated");
        let patch =
            serde_json::json!({ "metadata": { "annotations": { ALLOCATED_ANNOTATION: "true" } } });
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        if let Err(e) = api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            warn!(pod = %format!("{ns}/{name}"), error = %e, "could not mark the pod allocated; after a plugin restart it could be matched again");
        }
        Ok(ShareGrant { pod: format!("{ns}/{name}"), gpus, milli_per_gpu: per_gpu })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, uid: &str, milli: &str, ann: serde_json::Value, created: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": "default", "uid": uid, "annotations": ann,
                          "creationTimestamp": created },
            "spec": { "nodeName": "n1", "containers": [{ "name": "c",
                "resources": { "limits": { SHARE_RESOURCE: milli } } }] },
            "status": { "phase": "Pending" }
        }))
        .unwrap()
    }

    #[test]
    fn signatures_bind_the_choice_to_its_pod_node_and_amount() {
        let k = ShareKey::from_bytes(&[7; 32]);
        let s = k.sign("u1", "n1", &[0], 500);
        assert!(k.verify("u1", "n1", &[0], 500, &s));
        assert!(!k.verify("u2", "n1", &[0], 500, &s), "another pod");
        assert!(!k.verify("u1", "n2", &[0], 500, &s), "another node");
        assert!(!k.verify("u1", "n1", &[1], 500, &s), "another GPU");
        assert!(!k.verify("u1", "n1", &[0], 600, &s), "another amount");
        assert!(!ShareKey::from_bytes(&[8; 32]).verify("u1", "n1", &[0], 500, &s), "another key");
        assert!(!k.verify("u1", "n1", &[0], 500, "zz"), "garbage");
        assert_eq!(parse_gpus("2,3"), Some(vec![2, 3]));
        assert_eq!(parse_gpus("2,2"), None);
        assert_eq!(parse_gpus("x"), None);
        assert_eq!(parse_gpus("99999"), None);
    }

    #[tokio::test]
    async fn the_plugin_takes_the_oldest_signed_pod_and_refuses_forged_ones() {
        let key = ShareKey::from_bytes(&[7; 32]);
        // Another test may have installed it already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:9".parse().unwrap())).unwrap();
        let r = ApiResolver::new(client, "n1".into(), ShareKey::from_bytes(&[7; 32]));
        let signed = |uid: &str, g: u16| json!({ GPUS_ANNOTATION: g.to_string(), SIGNATURE_ANNOTATION: key.sign(uid, "n1", &[g], 500) });
        let forged =
            pod("forged", "uf", "500", json!({ GPUS_ANNOTATION: "1" }), "2026-01-01T00:00:00Z");
        let copied = pod(
            "copied",
            "uc",
            "500",
            json!({ GPUS_ANNOTATION: "0", SIGNATURE_ANNOTATION: key.sign("ua", "n1", &[0], 500) }),
            "2026-01-01T00:00:00Z",
        );
        let e = r.choose(&[forged.clone(), copied.clone()], 500).unwrap_err();
        assert!(e.contains("default/forged: the GPU choice is not signed"), "{e}");
        assert!(e.contains("default/copied: the GPU choice's signature does not match"), "{e}");

        let a = pod("a", "ua", "500", signed("ua", 0), "2026-01-01T00:00:02Z");
        let b = pod("b", "ub", "500", signed("ub", 1), "2026-01-01T00:00:01Z");
        let other = pod("c", "uo", "250", signed("uo", 0), "2026-01-01T00:00:00Z");
        let all = [forged, copied, a, b, other];
        let (p, gpus) = r.choose(&all, 500).unwrap();
        assert_eq!((p.metadata.name.as_deref(), gpus), (Some("b"), vec![1]), "oldest first");
        r.granted().insert("ub".into());
        let (p, gpus) = r.choose(&all, 500).unwrap();
        assert_eq!((p.metadata.name.as_deref(), gpus), (Some("a"), vec![0]));
        r.granted().insert("ua".into());
        assert!(r.choose(&all, 500).is_err(), "nothing left of that size");
    }
}
