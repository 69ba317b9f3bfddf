//! Reading and editing an OCI runtime spec (`config.json`,
//! <https://github.com/opencontainers/runtime-spec/blob/main/config.md>).
//!
//! The spec is edited as a JSON tree, not through typed structs: fields this code does not know
//! (newer spec versions, engine extensions) pass through untouched, which a typed round trip
//! would silently drop. Edits are idempotent: a device, rule or mount already present (an engine
//! that also applied the CDI annotation) is not added twice, and a conflicting one is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::edits::{Edits, NodeEdit};
use crate::request::Env;

/// A spec that cannot be read or edited.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{}: the bundle has no readable config.json", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: not valid JSON", path.display())]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{}: {field} {problem}", path.display())]
    Shape { path: PathBuf, field: &'static str, problem: String },
    #[error(
        "{}: {path_in_container} is already in linux.devices as {have}, but the host's node is {want}",
        path.display()
    )]
    DeviceConflict { path: PathBuf, path_in_container: String, have: String, want: String },
    #[error(
        "{}: {destination} is already a mount of {have}; it cannot also receive {want}",
        path.display()
    )]
    MountConflict { path: PathBuf, destination: String, have: String, want: String },
    #[error("{}: writing the edited spec failed", path.display())]
    Write { path: PathBuf, source: std::io::Error },
}

/// A bundle's `config.json`.
#[derive(Debug, Clone)]
pub struct Spec {
    pub path: PathBuf,
    pub value: Value,
}

impl Spec {
    /// Reads `BUNDLE/config.json`.
    pub fn load(bundle: &Path) -> Result<Self, SpecError> {
        let path = bundle.join("config.json");
        let bytes = std::fs::read(&path)
            .map_err(|source| SpecError::Read { path: path.clone(), source })?;
        Self::parse(&bytes, path)
    }

    pub fn parse(bytes: &[u8], path: PathBuf) -> Result<Self, SpecError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|source| SpecError::Json { path: path.clone(), source })?;
        if !value.is_object() {
            return Err(SpecError::Shape {
                path,
                field: "the document",
                problem: "is not a JSON object".to_owned(),
            });
        }
        Ok(Self { path, value })
    }

    fn shape(&self, field: &'static str, problem: impl Into<String>) -> SpecError {
        SpecError::Shape { path: self.path.clone(), field, problem: problem.into() }
    }

    /// `process.env`.
    pub fn env(&self) -> Result<Env, SpecError> {
        match self.value.pointer("/process/env") {
            None | Some(Value::Null) => Ok(Env::default()),
            Some(Value::Array(a)) => {
                let mut entries = Vec::with_capacity(a.len());
                for v in a {
                    entries.push(
                        v.as_str()
                            .ok_or_else(|| self.shape("process.env", "has a non-string entry"))?,
                    );
                }
                Ok(Env::from_entries(entries))
            }
            Some(_) => Err(self.shape("process.env", "is not an array of strings")),
        }
    }

    /// `annotations`.
    pub fn annotations(&self) -> Result<BTreeMap<String, String>, SpecError> {
        match self.value.get("annotations") {
            None | Some(Value::Null) => Ok(BTreeMap::new()),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| {
                    v.as_str()
                        .map(|s| (k.clone(), s.to_owned()))
                        .ok_or_else(|| self.shape("annotations", format!("{k} is not a string")))
                })
                .collect(),
            Some(_) => Err(self.shape("annotations", "is not an object")),
        }
    }

    /// The container's root filesystem: `root.path`, relative to the bundle unless absolute.
    pub fn rootfs(&self, bundle: &Path) -> Result<PathBuf, SpecError> {
        let p = self
            .value
            .pointer("/root/path")
            .and_then(Value::as_str)
            .ok_or_else(|| self.shape("root.path", "is missing"))?;
        let p = Path::new(p);
        Ok(if p.is_absolute() { p.to_owned() } else { bundle.join(p) })
    }

    /// `linux.resources.devices`, the cgroup device rules.
    pub fn device_rules(&self) -> Vec<&Value> {
        self.value
            .pointer("/linux/resources/devices")
            .and_then(Value::as_array)
            .map(|a| a.iter().collect())
            .unwrap_or_default()
    }

    /// Whether the cgroup rules already let the container use `n` (a privileged container's
    /// blanket `{"allow": true, "access": "rwm"}`, or a rule naming it).
    pub fn allows(&self, n: &NodeEdit) -> bool {
        let mut allowed = false;
        for r in self.device_rules() {
            let ty = r.get("type").and_then(Value::as_str).unwrap_or("a");
            let major = r.get("major").and_then(Value::as_i64);
            let minor = r.get("minor").and_then(Value::as_i64);
            let access = r.get("access").and_then(Value::as_str).unwrap_or("rwm");
            let matches = (ty == "a" || ty.starts_with(n.type_char()))
                && major.is_none_or(|m| m == -1 || m == i64::from(n.major))
                && minor.is_none_or(|m| m == -1 || m == i64::from(n.minor));
            if matches {
                // Rules apply in order; the last matching one decides.
                allowed = r.get("allow").and_then(Value::as_bool).unwrap_or(false)
                    && access.contains('r')
                    && access.contains('w');
            }
        }
        allowed
    }

    /// Applies `edits`: `linux.devices`, `linux.resources.devices` allow rules, bind `mounts`
    /// and `process.env`. On error the spec in memory may be partly edited; callers write it
    /// only on success, so the file never is.
    pub fn apply(&mut self, edits: &Edits) -> Result<(), SpecError> {
        let path = self.path.clone();
        let root = self.value.as_object_mut().ok_or_else(|| SpecError::Shape {
            path: path.clone(),
            field: "the document",
            problem: "is not a JSON object".to_owned(),
        })?;
        let shape = |field: &'static str, problem: &str| SpecError::Shape {
            path: path.clone(),
            field,
            problem: problem.to_owned(),
        };

        // Device nodes and their cgroup rules.
        let linux = object_at(root, "linux").ok_or_else(|| shape("linux", "is not an object"))?;
        let devices =
            array_at(linux, "devices").ok_or_else(|| shape("linux.devices", "is not an array"))?;
        for n in &edits.nodes {
            let want = format!("{} {}:{}", n.type_char(), n.major, n.minor);
            if let Some(have) =
                devices.iter().find(|d| d.get("path").and_then(Value::as_str) == Some(&n.path))
            {
                let have = format!(
                    "{} {}:{}",
                    have.get("type").and_then(Value::as_str).unwrap_or("?"),
                    have.get("major").and_then(Value::as_i64).unwrap_or(-1),
                    have.get("minor").and_then(Value::as_i64).unwrap_or(-1)
                );
                if have != want {
                    return Err(SpecError::DeviceConflict {
                        path: path.clone(),
                        path_in_container: n.path.clone(),
                        have,
                        want,
                    });
                }
                continue;
            }
            let mut d = json!({
                "path": n.path,
                "type": n.type_char().to_string(),
                "major": n.major,
                "minor": n.minor,
                "uid": 0,
                "gid": 0,
            });
            if let Some(mode) = n.file_mode {
                d["fileMode"] = json!(mode);
            }
            devices.push(d);
        }
        let resources = object_at(linux, "resources")
            .ok_or_else(|| shape("linux.resources", "is not an object"))?;
        let rules = array_at(resources, "devices")
            .ok_or_else(|| shape("linux.resources.devices", "is not an array"))?;
        for n in &edits.nodes {
            let rule = json!({
                "allow": true,
                "type": n.type_char().to_string(),
                "major": n.major,
                "minor": n.minor,
                "access": "rwm",
            });
            if !rules.contains(&rule) {
                rules.push(rule);
            }
        }

        // Read-only bind mounts of driver files.
        let mounts = array_at(root, "mounts").ok_or_else(|| shape("mounts", "is not an array"))?;
        for m in &edits.mounts {
            let source = m.source.to_string_lossy();
            if let Some(have) = mounts
                .iter()
                .find(|x| x.get("destination").and_then(Value::as_str) == Some(&m.destination))
            {
                let have = have.get("source").and_then(Value::as_str).unwrap_or("?").to_owned();
                if have != source {
                    return Err(SpecError::MountConflict {
                        path: path.clone(),
                        destination: m.destination.clone(),
                        have,
                        want: source.into_owned(),
                    });
                }
                continue;
            }
            mounts.push(json!({
                "destination": m.destination,
                "type": "bind",
                "source": source,
                "options": crate::edits::MOUNT_OPTIONS,
            }));
        }

        // Environment: replace a variable's last definition, else append.
        if !edits.env.is_empty() {
            let process =
                object_at(root, "process").ok_or_else(|| shape("process", "is not an object"))?;
            let env = array_at(process, "env")
                .ok_or_else(|| shape("process.env", "is not an array of strings"))?;
            for (k, v) in &edits.env {
                let entry = Value::String(format!("{k}={v}"));
                let prefix = format!("{k}=");
                env.retain(|e| e.as_str().is_none_or(|s| !s.starts_with(&prefix) && s != k));
                env.push(entry);
            }
        }
        Ok(())
    }

    /// Writes the spec back atomically (temporary file in the bundle, then rename; no `fsync`,
    /// see [`crate::fsutil::write_replace`]).
    pub fn save(&self) -> Result<(), SpecError> {
        let bytes = serde_json::to_vec(&self.value).map_err(|e| SpecError::Write {
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        crate::fsutil::write_replace(&self.path, &bytes, 0o644, false)
            .map_err(|source| SpecError::Write { path: self.path.clone(), source })
    }
}

/// `obj[key]` as an object, created when missing or null; `None` when it is something else.
fn object_at<'a>(obj: &'a mut Map<String, Value>, key: &str) -> Option<&'a mut Map<String, Value>> {
    let v = obj.entry(key).or_insert_with(|| json!({}));
    if v.is_null() {
        *v = json!({});
    }
    v.as_object_mut()
}

/// `obj[key]` as an array, created when missing or null; `None` when it is something else.
fn array_at<'a>(obj: &'a mut Map<String, Value>, key: &str) -> Option<&'a mut Vec<Value>> {
    let v = obj.entry(key).or_insert_with(|| json!([]));
    if v.is_null() {
        *v = json!([]);
    }
    v.as_array_mut()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edits::MountEdit;
    use xpu_core::inventory::NodeType;

    fn spec(v: Value) -> Spec {
        Spec { path: PathBuf::from("/b/config.json"), value: v }
    }

    fn node(path: &str, minor: u32) -> NodeEdit {
        NodeEdit {
            path: path.into(),
            node_type: NodeType::Char,
            major: 195,
            minor,
            file_mode: Some(0o666),
        }
    }

    #[test]
    fn applies_idempotently_and_keeps_unknown_fields() {
        let mut s = spec(json!({
            "ociVersion": "1.0.2",
            "process": {"env": ["PATH=/bin", "XPU_DEVICES=old"]},
            "x-engine-extension": {"keep": [1, 2]},
        }));
        let e = Edits {
            env: vec![("XPU_DEVICES".into(), "nvidia.com/gpu=1".into())],
            nodes: vec![node("/dev/nvidia1", 1)],
            mounts: vec![MountEdit {
                source: "/usr/lib/libcuda.so.1".into(),
                destination: "/usr/lib/libcuda.so.1".into(),
            }],
            warnings: vec![],
        };
        s.apply(&e).unwrap();
        s.apply(&e).unwrap();
        let v = &s.value;
        assert_eq!(v["x-engine-extension"]["keep"], json!([1, 2]));
        assert_eq!(v["linux"]["devices"].as_array().unwrap().len(), 1);
        assert_eq!(v["linux"]["devices"][0]["fileMode"], 438);
        assert_eq!(v["linux"]["resources"]["devices"].as_array().unwrap().len(), 1);
        assert_eq!(v["mounts"].as_array().unwrap().len(), 1);
        assert_eq!(v["process"]["env"], json!(["PATH=/bin", "XPU_DEVICES=nvidia.com/gpu=1"]));
        assert!(s.allows(&node("/dev/nvidia1", 1)));
        assert!(!s.allows(&node("/dev/nvidia2", 2)));
    }

    #[test]
    fn conflicts_and_bad_shapes_are_errors() {
        let mut s = spec(json!({"linux": {"devices": [
            {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 7}
        ]}}));
        let e = Edits { nodes: vec![node("/dev/nvidia1", 1)], ..Default::default() };
        let err = s.apply(&e).unwrap_err().to_string();
        assert!(err.contains("/dev/nvidia1 is already in linux.devices as c 195:7"), "{err}");
        let s = spec(json!({"process": {"env": "A=1"}}));
        assert!(s.env().unwrap_err().to_string().contains("process.env is not an array"));
        assert!(Spec::parse(b"[1]", "c.json".into()).is_err());
        assert!(
            Spec::parse(b"{", "c.json".into()).unwrap_err().to_string().contains("not valid JSON")
        );
    }
}
