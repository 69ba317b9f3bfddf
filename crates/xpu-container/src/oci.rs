//! Reading and editing an OCI runtime spec (`config.json`,
//! <https://github.com/opencontainers/runtime-spec/blob/main/config.md>).
//!
//! The spec is edited as JSON, not through typed structs: fields this code does not know (newer
//! spec versions, engine extensions) pass through untouched, which a typed round trip would
//! silently drop. Only the members the shim reads or edits are parsed: `process.env` and
//! `annotations`, which tell whether the container asks for devices, when the spec is read, and
//! `root`, `mounts`, `linux.devices` and `linux.resources` only once it may
//! ([`Spec::materialize`]; most containers ask for nothing). Every other member keeps the text
//! the engine wrote, checked as JSON but not built into a tree, and is written back as it was. A
//! Docker or containerd spec is mostly its seccomp profile (10–20 KiB of syscall names) and
//! `process` its capability lists: parsing them into a tree and writing them out again cost the
//! shim more than the rest of its work on a container start. The spec is read in one pass, each
//! member parsed or kept as text as it is met, so the profile is scanned once.
//! Edits are idempotent: a device, rule or mount already present
//! (an engine that also applied the CDI annotation) is not added twice, and a conflicting one is
//! an error.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::value::SeqAccessDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::edits::{Edits, NodeEdit};
use crate::request::Env;

/// The top-level members parsed when the spec is read; `linux` and `process` are read member
/// by member. These and `process.env` tell whether the container asks for devices.
const PARSED: [&str; 1] = ["annotations"];
/// The members of `process` parsed when the spec is read.
const PROCESS_PARSED: [&str; 1] = ["env"];
/// The members the edits read and change, parsed by [`Spec::materialize`] once a container may
/// ask for devices: at the top, and in `linux`.
const EDITED: [&str; 2] = ["mounts", "root"];
const LINUX_EDITED: [&str; 2] = ["devices", "resources"];

/// A JSON object's members by name, sorted as `serde_json` writes an object. A name given twice
/// keeps its last value, as runc's Go decoder does.
type Members = BTreeMap<String, Member>;

/// A member of the spec.
#[derive(Debug, Clone)]
enum Member {
    /// Not read here: the engine's text, written back as it was.
    Text(Box<RawValue>),
    /// Read or edited here.
    Value(Value),
    /// `linux` or `process`, whose members are themselves kept as text or parsed.
    Object(Members),
}

impl Serialize for Member {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Member::Text(text) => text.serialize(s),
            Member::Value(v) => v.serialize(s),
            Member::Object(members) => members.serialize(s),
        }
    }
}

/// An object of the spec being read: the spec itself, or `linux` or `process` in it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Level {
    Top,
    Linux,
    Process,
}

impl Level {
    /// The members of this object parsed as values when the spec is read; the others are kept
    /// as text.
    fn parsed(self) -> &'static [&'static str] {
        match self {
            Level::Top => &PARSED,
            Level::Linux => &[],
            Level::Process => &PROCESS_PARSED,
        }
    }

    /// The object that member `name` of this one is, when it is read member by member too.
    fn nested(self, name: &str) -> Option<Level> {
        match (self, name) {
            (Level::Top, "linux") => Some(Level::Linux),
            (Level::Top, "process") => Some(Level::Process),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Level::Top => "the spec",
            Level::Linux => "linux",
            Level::Process => "process",
        }
    }
}

/// Reads an object of the spec as [`Members`], in one pass over its text: each member is parsed,
/// kept as text, or (`linux`, `process`) read member by member as it is met. A name given twice
/// keeps its last value, as runc's Go decoder does.
struct MembersOf(Level);

impl<'de> Visitor<'de> for MembersOf {
    type Value = Members;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} as a JSON object", self.0.name())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
        let mut members = Members::new();
        while let Some(name) = map.next_key::<String>()? {
            let member = match self.0.nested(&name) {
                Some(level) => map.next_value_seed(Nested(level))?,
                None if self.0.parsed().contains(&name.as_str()) => {
                    Member::Value(map.next_value()?)
                }
                None => Member::Text(map.next_value()?),
            };
            members.insert(name, member);
        }
        Ok(members)
    }
}

/// `linux` or `process`: its members when it is an object, else the value it is (null, which an
/// edit replaces, or something an edit reports as not an object).
struct Nested(Level);

impl<'de> DeserializeSeed<'de> for Nested {
    type Value = Member;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Member, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Nested {
    type Value = Member;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} as JSON", self.0.name())
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Member, A::Error> {
        MembersOf(self.0).visit_map(map).map(Member::Object)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Member, A::Error> {
        Value::deserialize(SeqAccessDeserializer::new(seq)).map(Member::Value)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Member, E> {
        Ok(Member::Value(Value::Null))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Member, E> {
        Ok(Member::Value(v.into()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Member, E> {
        Ok(Member::Value(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Member, E> {
        Ok(Member::Value(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Member, E> {
        Ok(Member::Value(v.into()))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Member, E> {
        Ok(Member::Value(v.into()))
    }
}

/// `text`, a JSON object, as the spec's members (see [`MembersOf`]); the whole text must be
/// that object.
fn members(text: &str) -> serde_json::Result<Members> {
    let mut de = serde_json::Deserializer::from_str(text);
    let members = de.deserialize_map(MembersOf(Level::Top))?;
    de.end()?;
    Ok(members)
}

/// The parsed value of `name` in `members`.
fn value<'a>(members: &'a Members, name: &str) -> Option<&'a Value> {
    match members.get(name) {
        Some(Member::Value(v)) => Some(v),
        _ => None,
    }
}

/// `members[name]` as a value to edit, `empty()` when missing or null; `None` when it is not
/// a parsed value, which [`members`] makes every name the shim edits.
fn value_at<'a>(
    members: &'a mut Members,
    name: &str,
    empty: fn() -> Value,
) -> Option<&'a mut Value> {
    match members.entry(name.to_owned()).or_insert(Member::Value(Value::Null)) {
        Member::Value(v) => {
            if v.is_null() {
                *v = empty();
            }
            Some(v)
        }
        Member::Text(_) | Member::Object(_) => None,
    }
}

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
    /// The top-level members (see the module's documentation).
    members: Members,
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
        let json = |source| SpecError::Json { path: path.clone(), source };
        // Checked as UTF-8 once, in bulk, rather than string by string as `from_slice` does.
        let text = std::str::from_utf8(bytes).map_err(|e| {
            json(de::Error::custom(format_args!("not UTF-8 at byte {}", e.valid_up_to())))
        })?;
        if !text.trim_start().starts_with('{') {
            // Not an object: reported as bad JSON when it is not JSON at all.
            serde_json::from_str::<de::IgnoredAny>(text).map_err(json)?;
            return Err(SpecError::Shape {
                path,
                field: "the document",
                problem: "is not a JSON object".to_owned(),
            });
        }
        let members = members(text).map_err(json)?;
        Ok(Self { path, members })
    }

    /// Parses the members the edits read and change (`root`, `mounts`, `linux.devices`,
    /// `linux.resources`), which [`Spec::parse`] keeps as text, so that a container asking for
    /// nothing never builds them. Does nothing to those already parsed; every accessor but
    /// [`Spec::env`] and [`Spec::annotations`] needs this first, and [`Spec::apply`] calls it.
    pub fn materialize(&mut self) -> Result<(), SpecError> {
        let json = |source| SpecError::Json { path: self.path.clone(), source };
        let parse = |members: &mut Members, names: &[&str]| -> serde_json::Result<()> {
            for name in names {
                if let Some(member) = members.get_mut(*name)
                    && let Member::Text(raw) = member
                {
                    let value = serde_json::from_str(raw.get())?;
                    *member = Member::Value(value);
                }
            }
            Ok(())
        };
        parse(&mut self.members, &EDITED).map_err(json)?;
        if let Some(Member::Object(linux)) = self.members.get_mut("linux") {
            parse(linux, &LINUX_EDITED).map_err(json)?;
        }
        Ok(())
    }

    /// The whole spec as a JSON tree, as it would be written.
    #[cfg(test)]
    fn to_value(&self) -> Value {
        serde_json::to_value(&self.members).unwrap_or_default()
    }

    /// Member `name` of `object` (`linux` or `process`) that is read here.
    fn member_of(&self, object: &str, name: &str) -> Option<&Value> {
        match self.members.get(object) {
            Some(Member::Object(members)) => value(members, name),
            _ => None,
        }
    }

    fn shape(&self, field: &'static str, problem: impl Into<String>) -> SpecError {
        SpecError::Shape { path: self.path.clone(), field, problem: problem.into() }
    }

    /// `process.env`.
    pub fn env(&self) -> Result<Env, SpecError> {
        match self.member_of("process", "env") {
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
        match value(&self.members, "annotations") {
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

    /// The container's root filesystem: `root.path`, relative to the bundle unless absolute
    /// (after [`Spec::materialize`]).
    pub fn rootfs(&self, bundle: &Path) -> Result<PathBuf, SpecError> {
        let p = value(&self.members, "root")
            .and_then(|r| r.get("path"))
            .and_then(Value::as_str)
            .ok_or_else(|| self.shape("root.path", "is missing"))?;
        let p = Path::new(p);
        Ok(if p.is_absolute() { p.to_owned() } else { bundle.join(p) })
    }

    /// `linux.resources.devices`, the cgroup device rules (after [`Spec::materialize`]).
    pub fn device_rules(&self) -> Vec<&Value> {
        self.member_of("linux", "resources")
            .and_then(|r| r.get("devices"))
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
        self.materialize()?;
        let path = self.path.clone();
        let shape = |field: &'static str, problem: &str| SpecError::Shape {
            path: path.clone(),
            field,
            problem: problem.to_owned(),
        };

        // Device nodes and their cgroup rules.
        let linux = object_mut(&mut self.members, "linux")
            .ok_or_else(|| shape("linux", "is not an object"))?;
        let devices = value_at(linux, "devices", || json!([]))
            .and_then(Value::as_array_mut)
            .ok_or_else(|| shape("linux.devices", "is not an array"))?;
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
        let resources = value_at(linux, "resources", || json!({}))
            .and_then(Value::as_object_mut)
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
        let mounts = value_at(&mut self.members, "mounts", || json!([]))
            .and_then(Value::as_array_mut)
            .ok_or_else(|| shape("mounts", "is not an array"))?;
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
            let process = object_mut(&mut self.members, "process")
                .ok_or_else(|| shape("process", "is not an object"))?;
            let env = value_at(process, "env", || json!([]))
                .and_then(Value::as_array_mut)
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

    /// Writes the spec back: in place, with its space reserved first, so that a failure leaves
    /// the engine's spec as it was ([`crate::fsutil::rewrite_in_place`]; runc reads it only
    /// after the shim has handed over); where that cannot be done (a symlink, a filesystem
    /// without `fallocate`), through a temporary file swapped in ([`crate::fsutil::write_replace`]).
    /// No `fsync` either way.
    pub fn save(&self) -> Result<(), SpecError> {
        let write = |source| SpecError::Write { path: self.path.clone(), source };
        let mut bytes =
            serde_json::to_vec(&self.members).map_err(std::io::Error::other).map_err(write)?;
        if crate::fsutil::rewrite_in_place(&self.path, &mut bytes).map_err(write)? {
            return Ok(());
        }
        crate::fsutil::write_replace(&self.path, &bytes, 0o644, false).map_err(write)
    }
}

/// The members of `name` (`linux` or `process`), to edit: created when missing or null; `None`
/// when it is something else.
fn object_mut<'a>(members: &'a mut Members, name: &str) -> Option<&'a mut Members> {
    let member = members.entry(name.to_owned()).or_insert_with(|| Member::Object(Members::new()));
    if matches!(member, Member::Value(Value::Null)) {
        *member = Member::Object(Members::new());
    }
    match member {
        Member::Object(object) => Some(object),
        Member::Value(_) | Member::Text(_) => None,
    }
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
        Spec::parse(v.to_string().as_bytes(), PathBuf::from("/b/config.json")).unwrap()
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
        let v = &s.to_value();
        assert_eq!(v["x-engine-extension"]["keep"], json!([1, 2]));
        assert_eq!(v["linux"]["devices"].as_array().unwrap().len(), 1);
        assert_eq!(v["linux"]["devices"][0]["fileMode"], 438);
        assert_eq!(v["linux"]["resources"]["devices"].as_array().unwrap().len(), 1);
        assert_eq!(v["mounts"].as_array().unwrap().len(), 1);
        assert_eq!(v["process"]["env"], json!(["PATH=/bin", "XPU_DEVICES=nvidia.com/gpu=1"]));
        assert!(s.allows(&node("/dev/nvidia1", 1)));
        assert!(!s.allows(&node("/dev/nvidia2", 2)));
    }

    /// Members the shim does not read are written back as the engine wrote them: spacing, key
    /// order and numbers a float would round (a seccomp argument of 2^64-1) stay as they were,
    /// beside the members it edits.
    #[test]
    fn members_not_read_pass_through_as_written() {
        let seccomp = r#"{ "defaultAction": "SCMP_ACT_ERRNO",
            "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW",
              "args": [{"index": 0, "value": 18446744073709551615, "op": "SCMP_CMP_EQ"}]}],
            "weight": 0.1000000000000000055511151231257827 }"#;
        let hooks = r#"{"z": 1, "a": [ 2 ]}"#;
        let caps = r#"{"bounding": [ "CAP_KILL", "CAP_CHOWN" ], "ambient": []}"#;
        let text = format!(
            r#"{{"ociVersion": "1.2.0", "hooks": {hooks},
               "process": {{"capabilities": {caps}, "env": ["A=1"]}},
               "linux": {{"seccomp": {seccomp}, "namespaces": [{{"type": "pid"}}]}}}}"#
        );
        let mut s = Spec::parse(text.as_bytes(), "/b/config.json".into()).unwrap();
        let e = Edits {
            env: vec![("XPU_DEVICES".into(), "nvidia.com/gpu=1".into())],
            nodes: vec![node("/dev/nvidia1", 1)],
            ..Default::default()
        };
        s.apply(&e).unwrap();
        let dir = tempfile::tempdir().unwrap();
        s.path = dir.path().join("config.json");
        s.save().unwrap();
        let written = std::fs::read_to_string(&s.path).unwrap();
        assert!(written.contains(&format!(r#""seccomp":{seccomp}"#)), "{written}");
        assert!(written.contains(&format!(r#""hooks":{hooks}"#)), "{written}");
        assert!(written.contains(&format!(r#""capabilities":{caps}"#)), "{written}");
        let v: Value = serde_json::from_str(&written).unwrap();
        assert_eq!(v["linux"]["namespaces"], json!([{"type": "pid"}]));
        assert_eq!(v["linux"]["devices"][0]["path"], "/dev/nvidia1");
        assert_eq!(v["process"]["env"], json!(["A=1", "XPU_DEVICES=nvidia.com/gpu=1"]));
        assert_eq!(v["ociVersion"], "1.2.0");
    }

    /// `linux`, `mounts` and `process` that are missing or null are created; one that is not an
    /// object or array is an error naming it, and the spec is then not written.
    #[test]
    fn missing_null_and_mistyped_members() {
        let e = Edits {
            env: vec![("A".into(), "1".into())],
            nodes: vec![node("/dev/nvidia1", 1)],
            mounts: vec![MountEdit { source: "/l".into(), destination: "/l".into() }],
            warnings: vec![],
        };
        for text in [r#"{}"#, r#"{"linux": null, "mounts": null, "process": null}"#] {
            let mut s = Spec::parse(text.as_bytes(), "c.json".into()).unwrap();
            s.apply(&e).unwrap();
            let v = s.to_value();
            assert_eq!(v["linux"]["devices"].as_array().unwrap().len(), 1, "{text}");
            assert_eq!(v["linux"]["resources"]["devices"].as_array().unwrap().len(), 1);
            assert_eq!(v["mounts"].as_array().unwrap().len(), 1, "{text}");
            assert_eq!(v["process"]["env"], json!(["A=1"]), "{text}");
        }
        for (text, field) in [
            (r#"{"linux": 3}"#, "linux is not an object"),
            (r#"{"linux": {"devices": {}}}"#, "linux.devices is not an array"),
            (r#"{"linux": {"resources": []}}"#, "linux.resources is not an object"),
            (r#"{"mounts": {}}"#, "mounts is not an array"),
            (r#"{"process": "x"}"#, "process is not an object"),
            (r#"{"process": 1.5}"#, "process is not an object"),
            (r#"{"linux": [{"devices": []}]}"#, "linux is not an object"),
            (r#"{"linux": true}"#, "linux is not an object"),
            (r#"{"process": {"env": "A=1"}}"#, "process.env is not an array of strings"),
        ] {
            let mut s = Spec::parse(text.as_bytes(), "c.json".into()).unwrap();
            let err = s.apply(&e).unwrap_err().to_string();
            assert!(err.contains(field), "{text}: {err}");
        }
        let err = Spec::parse(b"{\"a\": \"\xff\"}", "c.json".into()).unwrap_err();
        assert!(format!("{err:#}").contains("not valid JSON"), "{err}");
        let source = std::error::Error::source(&err).unwrap().to_string();
        assert!(source.contains("not UTF-8 at byte 7"), "{source}");
        // Bad JSON anywhere, in a member kept as text too, or after the spec, is an error.
        for text in [
            r#"{"hooks": {"a": }}"#,
            r#"{"linux": {"seccomp": [}}"#,
            r#"{"process": {"user": {"uid": 0,}}}"#,
            r#"{"ociVersion": "1.2.0"} {}"#,
        ] {
            let err = Spec::parse(text.as_bytes(), "c.json".into()).unwrap_err();
            assert!(err.to_string().contains("not valid JSON"), "{text}: {err}");
        }
    }

    /// Reading a spec parses only `process.env` and the annotations; the members the edits need
    /// are parsed once a container may ask for devices ([`Spec::materialize`]), as the engine
    /// wrote them. The spec reads the same either way.
    #[test]
    fn edited_members_are_parsed_only_when_needed() {
        let text = r#"{"process": {"args": ["sh"], "env": ["A=1", "NVIDIA_VISIBLE_DEVICES=1,3"]},
            "annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0", "k\u0065y": "v"},
            "root": {"path": "rootfs"}, "mounts": [{"destination": "/proc"}],
            "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]},
                      "devices": [], "seccomp": {"syscalls": [{"names": ["read"]}]}}}"#;
        let mut s = Spec::parse(text.as_bytes(), "/b/config.json".into()).unwrap();
        assert_eq!(s.env().unwrap().get("A"), Some("1"));
        assert_eq!(s.annotations().unwrap()["key"], "v");
        for (members, name) in [(&s.members, "mounts"), (&s.members, "root")] {
            assert!(matches!(members.get(name), Some(Member::Text(_))), "{name} kept as text");
        }
        let before = s.to_value();
        s.materialize().unwrap();
        s.materialize().unwrap();
        assert!(matches!(s.members.get("mounts"), Some(Member::Value(_))));
        assert_eq!(s.to_value(), before);
        assert_eq!(s.rootfs(Path::new("/b")).unwrap(), Path::new("/b/rootfs"));
        assert_eq!(s.device_rules().len(), 1);
        // A member kept as text is still checked as JSON when the spec is read.
        let err = Spec::parse(br#"{"mounts": [}"#, "c.json".into()).unwrap_err();
        assert!(err.to_string().contains("not valid JSON"), "{err}");
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
        // A name given twice keeps its last value, at the top and inside `linux` and `process`.
        let mut s = Spec::parse(
            br#"{"process": {"env": ["A=1"]}, "linux": {"devices": 1, "devices": []},
                "process": {"env": ["B=1"], "env": ["C=1"]}, "root": {"path": "a"},
                "root": {"path": "b"}}"#,
            "c.json".into(),
        )
        .unwrap();
        assert_eq!(s.env().unwrap(), Env::from_entries(["C=1"]));
        s.materialize().unwrap();
        assert_eq!(s.to_value()["linux"]["devices"], json!([]));
        assert_eq!(s.rootfs(Path::new("/bundle")).unwrap(), Path::new("/bundle/b"));
        assert!(
            Spec::parse(b"{", "c.json".into()).unwrap_err().to_string().contains("not valid JSON")
        );
    }
}
