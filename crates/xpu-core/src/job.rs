//! Job manifests: Kubernetes `batch/v1` Jobs (and bare `v1` Pods) in YAML or JSON, and xpu's
//! short form, parsed once at the edge into a validated [`JobSpec`].
//!
//! What is read follows the Kubernetes Job API (`batch/v1`, <https://kubernetes.io/docs/concepts/workloads/controllers/job/>):
//! `completions`, `parallelism`, `completionMode: Indexed`, `backoffLimit` (default 6),
//! `activeDeadlineSeconds`, and from the pod template `restartPolicy` (a Job's must be `Never` or
//! `OnFailure`, as the API server requires), `nodeSelector`, `subdomain`, and one container's
//! `image`, `command`, `args`, `env`, `workingDir` and `resources`. Extended resources
//! (`nvidia.com/gpu`, `amd.com/gpu`, `google.com/tpu`, `habana.ai/gaudi`) follow the API
//! server's rule: they cannot be overcommitted, so `limits` must be set and `requests`, when set,
//! must equal it. A multi-document file is taken as `kubectl apply -f` takes it ([`parse_all`]):
//! every Job and Pod becomes a job, all or none; other objects (the GKE seed's headless
//! `Service`) are skipped with a note. Fields the API has and xpu does not act on (ports,
//! securityContext) are ignored; fields the API does not have are a note each, as the API
//! server's strict field validation warns (`unknown field "spec.containres"`).
//!
//! A Pod's `restartPolicy` defaults to `Always`, as in Kubernetes; a bare Pod has no
//! `backoffLimit` (its restarts never end the job). `initContainers` are read like the main
//! container (a sidecar is one with `restartPolicy: Always`) and may not ask for devices the
//! main container does not hold: they run on the task's. `volumes` of type `emptyDir` are
//! provided; any other type is refused naming the volume.
//!
//! Every error names the field path, as `kubectl` does:
//! `spec.template.spec.containers[0].resources.limits.nvidia.com/gpu: must be a positive integer`.
//! Nothing here panics on input: the parser walks a JSON value tree with checked accessors.
//!
//! Without a rootfs the container runs as a host process, so the image's entrypoint is not
//! available. The argv is then `command + args` when `command` is set; with `args` only, the
//! entrypoint is taken to be the image's base name without tag (`gcr.io/.../sleep:latest` with
//! `args: ["3600s"]` runs `sleep 3600s`); with neither, the base name alone.
//!
//! xpu's own annotations (short-form fields in brackets):
//! - `xpu.dev/queue` [`queue`], `xpu.dev/priority` [`priority`]: fair-share queue and priority.
//! - `xpu.dev/gpu-milli: "250"` [`gpuMilli: 250`]: each task gets that many thousandths (1 to
//!   999) of one GPU instead of whole GPUs, shared with other tasks. The container's GPU limit
//!   must then be 1 (`nvidia.com/gpu: 1`, that vendor's GPU) or absent (a GPU of any vendor).
//! - `xpu.dev/rootfs: /srv/rootfs` [`rootfs`]: run each task as an OCI container with this root
//!   filesystem (a directory on the daemon's host) through `xpu runtime` and runc.
//! - `xpu.dev/bundle: /srv/bundle` [`bundle`]: the same with an OCI bundle (`config.json` and
//!   its rootfs); the bundle's `process.args` run when the manifest gives no command.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::accel::DeviceKind;

/// Largest `completions` accepted (the Kubernetes limit for Indexed Jobs).
pub const MAX_COMPLETIONS: u64 = 100_000;
/// Default `backoffLimit` of a Kubernetes Job.
pub const DEFAULT_BACKOFF_LIMIT: u32 = 6;
/// Largest spec accepted, in bytes of its JSON (what the daemon stores and `GET /v1/jobs/{id}`
/// returns): 1.5 MiB, the size Kubernetes allows an object (etcd's default request limit).
pub const MAX_SPEC_BYTES: usize = 3 << 19;

/// A bad manifest: the field path and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct JobError {
    pub path: String,
    pub message: String,
}

impl JobError {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { path: path.into(), message: message.into() }
    }
}

/// `restartPolicy` of the task's pod template.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RestartPolicy {
    /// A failed task is replaced by a new attempt (new devices may be chosen).
    Never,
    /// A failed task is restarted in place, keeping its devices and working directory.
    OnFailure,
    /// A Pod's default: the task is restarted in place whenever it exits, success or not, and
    /// runs until the job is cancelled (a Job's pods may not use it, as the API server says).
    Always,
}

impl RestartPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            RestartPolicy::Never => "Never",
            RestartPolicy::OnFailure => "OnFailure",
            RestartPolicy::Always => "Always",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CompletionMode {
    NonIndexed,
    Indexed,
}

/// Where a spec came from, kept so `xpu job` can say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Kubernetes,
    Short,
}

/// Devices of one kind a task asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRequest {
    /// The Kubernetes resource name as written (`nvidia.com/gpu`), or `gpu`/`tpu` from the short
    /// form.
    pub resource: String,
    pub kind: DeviceKind,
    /// `nvidia`, `amd`, `google`, `intel`; `None` accepts any vendor.
    pub vendor: Option<String>,
    pub count: u32,
    /// A share of one device in thousandths (1 to 999; annotation `xpu.dev/gpu-milli`), with
    /// `count` 1; `None` for whole devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub milli: Option<u16>,
}

/// What one task needs from a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub devices: Vec<DeviceRequest>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

impl Resources {
    /// Total devices of a kind asked for.
    pub fn count(&self, kind: DeviceKind) -> u32 {
        self.devices.iter().filter(|d| d.kind == kind).map(|d| d.count).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvVar {
    pub name: String,
    /// The literal value (`$(VAR)` references expanded at start, [`crate::expand`]); empty when
    /// `from` gives the value.
    pub value: String,
    /// `valueFrom`: the downward API, resolved when the task starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<EnvFrom>,
}

/// Where a variable's value comes from when it is not written in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvFrom {
    /// `fieldRef.fieldPath`.
    Field(FieldPath),
    /// `resourceFieldRef`: a container's request or limit (`limits.cpu`, `requests.memory`,
    /// `limits.nvidia.com/gpu`...), divided by `divisor` and rounded up, as the kubelet does.
    Resource { resource: String, divisor: String },
}

/// The pod fields the downward API gives (`fieldRef.fieldPath`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldPath {
    Name,
    Namespace,
    Uid,
    Label(String),
    Annotation(String),
    NodeName,
    ServiceAccountName,
    HostIp,
    PodIp,
    /// `metadata.labels`: every label, one `key="value"` line each (downward API volumes only).
    Labels,
    /// `metadata.annotations`, likewise.
    Annotations,
}

impl FieldPath {
    /// A path a `downwardAPI` volume item may name: those of `env`, and the whole label and
    /// annotation maps.
    pub fn parse_for_volume(path: &str) -> Option<FieldPath> {
        match path {
            "metadata.labels" => Some(FieldPath::Labels),
            "metadata.annotations" => Some(FieldPath::Annotations),
            // The node's and the pod's addresses are env-only in Kubernetes.
            "spec.nodeName" | "spec.serviceAccountName" | "status.hostIP" | "status.podIP" => None,
            _ => FieldPath::parse(path),
        }
    }

    /// `metadata.labels['app']` and the like; `None` for a path the downward API does not give.
    pub fn parse(path: &str) -> Option<FieldPath> {
        let key = |prefix: &str| {
            let rest = path.strip_prefix(prefix)?.strip_suffix(']')?;
            let k = rest.strip_prefix('\'').and_then(|r| r.strip_suffix('\''));
            let k = k.or_else(|| rest.strip_prefix('"').and_then(|r| r.strip_suffix('"')))?;
            (!k.is_empty()).then(|| k.to_owned())
        };
        Some(match path {
            "metadata.name" => FieldPath::Name,
            "metadata.namespace" => FieldPath::Namespace,
            "metadata.uid" => FieldPath::Uid,
            "spec.nodeName" => FieldPath::NodeName,
            "spec.serviceAccountName" => FieldPath::ServiceAccountName,
            "status.hostIP" => FieldPath::HostIp,
            "status.podIP" => FieldPath::PodIp,
            _ => {
                if let Some(k) = key("metadata.labels[") {
                    FieldPath::Label(k)
                } else {
                    FieldPath::Annotation(key("metadata.annotations[")?)
                }
            }
        })
    }
}

/// The pod's own metadata, for the downward API: what `metadata.*` fields resolve to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodMeta {
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub service_account: Option<String>,
    /// `metadata.generateName` when the name was generated from it: a resubmission of the same
    /// manifest (an idempotent retry) is the same job whatever suffix each draw got.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generate_name: Option<String>,
}

/// The one container each task runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Container {
    pub name: String,
    pub image: Option<String>,
    /// The argv to run (see the module docs for the mapping from `command`/`args`).
    pub argv: Vec<String>,
    pub env: Vec<EnvVar>,
    pub working_dir: Option<String>,
    /// Run as an OCI container with this root filesystem (annotation `xpu.dev/rootfs`, short
    /// form `rootfs`) instead of as a host process.
    pub rootfs: Option<String>,
    /// Run as an OCI container from this bundle directory (annotation `xpu.dev/bundle`, short
    /// form `bundle`); `argv` empty means the bundle's own `process.args`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
    pub resources: Resources,
    /// `volumeMounts`: where the pod's volumes appear in a container job's filesystem.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// An init container with `restartPolicy: Always` (a sidecar): started in its turn, left
    /// running beside the next ones and the main container, stopped once the main one ends.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sidecar: bool,
}

/// One `volumeMounts` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    /// The volume's name (one of [`JobSpec::volumes`]).
    pub name: String,
    /// Absolute path inside the container.
    pub mount_path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// A relative path inside the volume to mount instead of its root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_path: Option<String>,
}

/// A volume: a directory made for each task attempt, shared by the pod's containers, removed
/// with the attempt. An `emptyDir` starts empty; a `downwardAPI` one holds its files. The only
/// volume types xpu provides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub name: String,
    /// `medium: Memory`: a tmpfs, at most `size_limit` bytes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_limit: Option<u64>,
    /// A `downwardAPI` volume instead of an `emptyDir`: these files, written before the first
    /// container starts and mounted read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downward_api: Option<Vec<DownwardFile>>,
}

/// One item of a `downwardAPI` volume: a file holding a field of the pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownwardFile {
    /// Relative to the volume.
    pub path: String,
    pub from: EnvFrom,
    /// Permission bits (`mode`, else the volume's `defaultMode`, else 0644).
    pub mode: u32,
}
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub name: String,
    /// Fair-share queue: annotation `xpu.dev/queue`, else the namespace, else `default`.
    pub queue: String,
    /// Higher runs first: annotation `xpu.dev/priority` or the pod's `priority`.
    pub priority: i32,
    pub completions: u32,
    pub parallelism: u32,
    pub completion_mode: CompletionMode,
    pub backoff_limit: u32,
    pub restart_policy: RestartPolicy,
    pub active_deadline_seconds: Option<u64>,
    pub node_selector: BTreeMap<String, String>,
    pub subdomain: Option<String>,
    pub container: Container,
    pub source: Source,
    /// The pod template's metadata (namespace, labels, annotations, service account).
    #[serde(default)]
    pub pod: PodMeta,
    /// `initContainers`, run in order before [`JobSpec::container`] in each task, each to
    /// completion unless it is a sidecar. They share the task's devices and volumes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub init_containers: Vec<Container>,
    /// The pod's `emptyDir` volumes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
}

impl JobSpec {
    /// Indexed jobs whose parallelism covers every index are gangs: all tasks start together or
    /// none does (a multi-host TPU slice is useless in part).
    pub fn is_gang(&self) -> bool {
        self.completion_mode == CompletionMode::Indexed
            && self.completions > 1
            && self.parallelism >= self.completions
    }

    /// The number of tasks that may run at once.
    pub fn effective_parallelism(&self) -> u32 {
        self.parallelism.min(self.completions).max(1)
    }
}

/// A parsed manifest and the notes about what was skipped or assumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub spec: JobSpec,
    pub notes: Vec<String>,
}

/// Every workload of one manifest file, as `kubectl apply -f` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submission {
    /// One job per Job or Pod document, in file order.
    pub jobs: Vec<JobSpec>,
    /// What was skipped or assumed, each naming its document when the file has several.
    pub notes: Vec<String>,
}

/// Most workloads one file may submit (`kubectl apply` has no limit; a file of thousands is a
/// mistake or an attack, and each job costs the daemon a spec of up to [`MAX_SPEC_BYTES`]).
pub const MAX_WORKLOADS: usize = 100;

/// Parses a manifest that holds exactly one workload. A file with several is refused naming the
/// second; [`parse_all`] takes them all.
pub fn parse(text: &str) -> Result<Parsed, JobError> {
    let (mut jobs, notes) = parse_documents(text, 1)?;
    match jobs.pop() {
        Some(spec) => Ok(Parsed { spec, notes }),
        None => {
            Err(JobError::new("manifest", "no Job found; write a batch/v1 Job or xpu's short form"))
        }
    }
}

/// Parses every Job and Pod of a manifest (JSON, or YAML of one or several documents), each
/// into its own [`JobSpec`]; other kinds (a headless `Service`, a `Namespace`) are skipped with
/// a note. All or nothing: the first bad document is the error and no job comes back, so a
/// file is never half submitted.
pub fn parse_all(text: &str) -> Result<Submission, JobError> {
    let (jobs, notes) = parse_documents(text, MAX_WORKLOADS)?;
    Ok(Submission { jobs, notes })
}

fn parse_documents(text: &str, max: usize) -> Result<(Vec<JobSpec>, Vec<String>), JobError> {
    let docs = documents(text)?;
    let mut notes = Vec::new();
    let mut found: Vec<(usize, &Map<String, Value>)> = Vec::new();
    for (i, doc) in docs.iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let Some(obj) = doc.as_object() else {
            return Err(JobError::new(doc_path(i, docs.len()), "expected a mapping"));
        };
        match (obj.get("apiVersion"), obj.get("kind")) {
            (None, None) => found.push((i, obj)),
            (_, Some(Value::String(kind))) if kind == "Job" || kind == "Pod" => {
                found.push((i, obj))
            }
            (_, Some(Value::String(kind))) => {
                let name = obj
                    .get("metadata")
                    .and_then(|m| m.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or("unnamed");
                notes.push(format!("skipped {kind} {name}: xpu runs Jobs and Pods"));
            }
            (_, Some(_)) => {
                return Err(JobError::new(
                    join(&doc_path(i, docs.len()), "kind"),
                    "must be a string",
                ));
            }
            (Some(_), None) => {
                return Err(JobError::new(
                    join(&doc_path(i, docs.len()), "kind"),
                    "required with apiVersion; use kind: Job",
                ));
            }
        }
    }
    if found.is_empty() {
        return Err(JobError::new(
            "manifest",
            "no Job found; write a batch/v1 Job or xpu's short form",
        ));
    }
    if found.len() > max {
        let (second, _) = found[max];
        let problem = if max == 1 {
            "a second workload; this call takes one (submit the file to xpu serve, which takes them all)".to_owned()
        } else {
            format!("one workload too many: a file may hold at most {max} Jobs and Pods; split it")
        };
        return Err(JobError::new(doc_path(second, docs.len()), problem));
    }
    let multi = docs.len() > 1;
    let mut jobs: Vec<JobSpec> = Vec::with_capacity(found.len());
    // (kind, namespace, name) -> document: the same object twice in one file is a mistake the
    // API server would make into one object, the second overwriting the first.
    let mut seen: BTreeMap<(String, String, String), usize> = BTreeMap::new();
    for (i, obj) in found {
        let prefix = if multi { format!("document[{i}]") } else { String::new() };
        let mut p = Parser { prefix: prefix.clone(), notes: Vec::new(), unsupported: Vec::new() };
        let k8s = obj.contains_key("kind") || obj.contains_key("apiVersion");
        let spec = if k8s { p.kubernetes(obj)? } else { p.short(obj)? };
        let size = json_size(&spec);
        if size > MAX_SPEC_BYTES {
            return Err(JobError::new(
                doc_path(i, docs.len()),
                format!(
                    "the job's spec is {size} bytes as JSON, over the limit of {MAX_SPEC_BYTES} (1.5 MiB, as Kubernetes allows an object); move large env values or args into a file the job reads"
                ),
            ));
        }
        if k8s && spec.pod.generate_name.is_none() {
            let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("Job").to_owned();
            let ns = spec.pod.namespace.clone().unwrap_or_else(|| "default".to_owned());
            if let Some(first) = seen.insert((kind.clone(), ns, spec.name.clone()), i) {
                return Err(JobError::new(
                    join(&prefix, "metadata.name"),
                    format!(
                        "{kind} {:?} is already document[{first}] of this file; give each its own name",
                        spec.name
                    ),
                ));
            }
        }
        if multi {
            // Notes that name a field carry the document already.
            notes.extend(
                p.notes
                    .into_iter()
                    .map(|n| if n.starts_with(&prefix) { n } else { format!("{prefix}: {n}") }),
            );
        } else {
            notes.extend(p.notes);
        }
        jobs.push(spec);
    }
    Ok((jobs, notes))
}

fn doc_path(i: usize, n: usize) -> String {
    if n > 1 { format!("document[{i}]") } else { "manifest".to_owned() }
}

fn join(prefix: &str, field: &str) -> String {
    if prefix.is_empty() || prefix == "manifest" {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}

/// The size of `spec` as JSON, counted without building the text.
fn json_size(spec: &JobSpec) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Serializing a JobSpec cannot fail: every map key is a string and Count never errs; if
    // it did, the size so far still counts.
    let _ = serde_json::to_writer(&mut n, spec);
    n.0
}

/// Splits the text into JSON values: one for JSON input, one per YAML document (through the
/// bounded loader, [`crate::yaml`]).
fn documents(text: &str) -> Result<Vec<Value>, JobError> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') {
        crate::yaml::reject_duplicate_keys_json(trimmed)
            .map_err(|e| JobError::new("manifest", format!("invalid JSON: {e}")))?;
        return serde_json::from_str(trimmed)
            .map(|v| vec![v])
            .map_err(|e| JobError::new("manifest", format!("invalid JSON: {e}")));
    }
    crate::yaml::load(text, "manifest").map_err(|e| JobError::new(e.what, e.problem.to_string()))
}

struct Parser {
    prefix: String,
    notes: Vec<String>,
    /// Fields xpu does not support, gathered so one refusal names all of them.
    unsupported: Vec<JobError>,
}

/// Checked access to one mapping, with its path for errors.
struct Obj<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    fn field(&self, name: &str) -> String {
        if self.path.is_empty() { name.to_owned() } else { format!("{}.{name}", self.path) }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    fn obj(&self, name: &str) -> Result<Option<Obj<'a>>, JobError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Obj { path: self.field(name), map: m })),
            Some(_) => Err(JobError::new(self.field(name), "must be a mapping")),
        }
    }

    fn req_obj(&self, name: &str) -> Result<Obj<'a>, JobError> {
        self.obj(name)?.ok_or_else(|| JobError::new(self.field(name), "required"))
    }

    fn str(&self, name: &str) -> Result<Option<&'a str>, JobError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(JobError::new(self.field(name), "must be a string")),
        }
    }

    fn uint(&self, name: &str, min: u64, max: u64) -> Result<Option<u64>, JobError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let n = int_value(v).filter(|n| (min as i128..=max as i128).contains(n));
        match n {
            Some(n) => Ok(Some(n as u64)),
            None => Err(JobError::new(
                self.field(name),
                format!("must be an integer from {min} to {max}"),
            )),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, JobError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(JobError::new(self.field(name), "must be true or false")),
        }
    }

    fn strings(&self, name: &str) -> Result<Option<Vec<String>>, JobError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    _ => {
                        Err(JobError::new(format!("{}[{i}]", self.field(name)), "must be a string"))
                    }
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(JobError::new(self.field(name), "must be a list of strings")),
        }
    }

    fn string_map(&self, name: &str) -> Result<BTreeMap<String, String>, JobError> {
        let Some(m) = self.obj(name)? else { return Ok(BTreeMap::new()) };
        let mut out = BTreeMap::new();
        for (k, v) in m.map {
            let s = match v {
                Value::String(s) => s.clone(),
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                _ => return Err(JobError::new(m.field(k), "must be a string")),
            };
            out.insert(k.clone(), s);
        }
        Ok(out)
    }
}

/// An integer from a JSON number or a decimal string (Kubernetes quantities for extended
/// resources are often quoted).
fn int_value(v: &Value) -> Option<i128> {
    match v {
        Value::Number(n) => n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)),
        Value::String(s) => s.trim().parse::<i64>().ok().map(i128::from),
        _ => None,
    }
}

impl Parser {
    /// One refusal for every unsupported field met: the first names the field (`path`), the
    /// message goes on with the others.
    fn refuse_unsupported(&mut self) -> Result<(), JobError> {
        let mut all = std::mem::take(&mut self.unsupported).into_iter();
        let Some(mut first) = all.next() else { return Ok(()) };
        let rest: Vec<String> = all.map(|e| e.to_string()).collect();
        if !rest.is_empty() {
            first.message = format!("{}; also {}", first.message, rest.join("; also "));
        }
        Err(first)
    }

    fn root<'a>(&self, map: &'a Map<String, Value>) -> Obj<'a> {
        Obj { path: self.prefix.clone(), map }
    }

    fn kubernetes(&mut self, map: &Map<String, Value>) -> Result<JobSpec, JobError> {
        let root = self.root(map);
        let kind = root.str("kind")?.unwrap_or_default();
        let api = root.str("apiVersion")?;
        let is_pod = kind == "Pod";
        self.notes.extend(crate::k8s_fields::unknown_fields(map, is_pod));
        let want_api = if is_pod { "v1" } else { "batch/v1" };
        if api != Some(want_api) {
            return Err(JobError::new(
                root.field("apiVersion"),
                format!("must be {want_api} for kind {kind}"),
            ));
        }
        let meta = root.obj("metadata")?;
        let (name, namespace, annotations, labels) = match &meta {
            Some(m) => (
                match m.str("name")? {
                    Some(n) => Some(n.to_owned()),
                    // As the API server names it: the prefix and five random characters.
                    None => m.str("generateName")?.map(|p| format!("{p}{}", name_suffix())),
                },
                m.str("namespace")?.map(str::to_owned),
                m.string_map("annotations")?,
                m.string_map("labels")?,
            ),
            None => (None, None, BTreeMap::new(), BTreeMap::new()),
        };
        // The pod's own labels and annotations: a Pod's, or a Job's pod template's.
        let mut pod_meta = PodMeta { namespace: namespace.clone(), ..PodMeta::default() };
        if let Some(m) = &meta
            && m.str("name")?.is_none()
        {
            pod_meta.generate_name = m.str("generateName")?.map(str::to_owned);
        }
        if is_pod {
            pod_meta.labels = labels;
            pod_meta.annotations = annotations.clone();
        } else if let Some(t) = root.req_obj("spec")?.obj("template")?
            && let Some(m) = t.obj("metadata")?
        {
            pod_meta.labels = m.string_map("labels")?;
            pod_meta.annotations = m.string_map("annotations")?;
        }
        let name = match name {
            Some(n) => n,
            None => return Err(JobError::new(root.field("metadata.name"), "required")),
        };
        let spec = root.req_obj("spec")?;
        let (pod, completions, parallelism, mode, backoff, deadline) = if is_pod {
            let deadline = spec.uint("activeDeadlineSeconds", 1, i64::MAX as u64)?;
            (spec, 1, 1, CompletionMode::NonIndexed, 0, deadline)
        } else {
            let completions = spec.uint("completions", 1, MAX_COMPLETIONS)?.unwrap_or(1);
            let parallelism = spec.uint("parallelism", 1, MAX_COMPLETIONS)?.unwrap_or(1);
            let mode = match spec.str("completionMode")? {
                None | Some("NonIndexed") => CompletionMode::NonIndexed,
                Some("Indexed") => CompletionMode::Indexed,
                Some(other) => {
                    return Err(JobError::new(
                        spec.field("completionMode"),
                        format!("unknown mode {other:?}; use NonIndexed or Indexed"),
                    ));
                }
            };
            let backoff = spec
                .uint("backoffLimit", 0, i32::MAX as u64)?
                .unwrap_or(u64::from(DEFAULT_BACKOFF_LIMIT));
            let deadline = spec.uint("activeDeadlineSeconds", 1, i64::MAX as u64)?;
            if spec.bool("suspend")? == Some(true) {
                self.notes.push("spec.suspend is ignored: xpu queues the job".to_owned());
            }
            let template = spec.req_obj("template")?;
            let pod = template.req_obj("spec")?;
            (pod, completions, parallelism, mode, backoff, deadline)
        };
        let restart = match pod.str("restartPolicy")? {
            Some("Never") => RestartPolicy::Never,
            Some("OnFailure") => RestartPolicy::OnFailure,
            Some("Always") if is_pod => RestartPolicy::Always,
            None if is_pod => {
                self.notes.push(
                    "spec.restartPolicy: Always (the Pod default): restarted whenever it exits, with the kubelet's back-off, until cancelled; set Never to run it once".to_owned(),
                );
                RestartPolicy::Always
            }
            _ if is_pod => {
                return Err(JobError::new(
                    pod.field("restartPolicy"),
                    "must be Always, OnFailure or Never",
                ));
            }
            _ => {
                return Err(JobError::new(
                    pod.field("restartPolicy"),
                    "must be Never or OnFailure (a Job's pods run to completion)",
                ));
            }
        };
        // A bare Pod has no backoffLimit: the kubelet restarts it (OnFailure, Always) for ever.
        let backoff = match (is_pod, restart) {
            (true, RestartPolicy::Never) => 0,
            (true, _) => u64::from(u32::MAX),
            (false, _) => backoff,
        };
        pod_meta.service_account = pod.str("serviceAccountName")?.map(str::to_owned);
        let node_selector = pod.string_map("nodeSelector")?;
        let subdomain = pod.str("subdomain")?.map(str::to_owned);
        let priority = match annotations.get("xpu.dev/priority") {
            Some(p) => p.parse::<i32>().map_err(|_| {
                JobError::new(
                    root.field("metadata.annotations.xpu.dev/priority"),
                    "must be an integer",
                )
            })?,
            None => pod.uint("priority", 0, i32::MAX as u64)?.unwrap_or(0) as i32,
        };
        let queue = annotations
            .get("xpu.dev/queue")
            .cloned()
            .or(namespace)
            .unwrap_or_else(|| "default".to_owned());
        let containers = match pod.get("containers") {
            Some(Value::Array(c)) => c,
            Some(_) => return Err(JobError::new(pod.field("containers"), "must be a list")),
            None => return Err(JobError::new(pod.field("containers"), "required")),
        };
        let container = match containers.as_slice() {
            [Value::Object(c)] => Obj { path: format!("{}[0]", pod.field("containers")), map: c },
            [_] => {
                return Err(JobError::new(
                    format!("{}[0]", pod.field("containers")),
                    "must be a mapping",
                ));
            }
            [] => return Err(JobError::new(pod.field("containers"), "needs one container")),
            [Value::Object(c), more @ ..] => {
                // Refused, but the first container is read on, so the refusal can name what
                // else in the manifest is unsupported too.
                self.unsupported.push(JobError::new(
                    pod.field("containers"),
                    format!("has {} containers; xpu runs one container per task", more.len() + 1),
                ));
                Obj { path: format!("{}[0]", pod.field("containers")), map: c }
            }
            more => {
                return Err(JobError::new(
                    pod.field("containers"),
                    format!("has {} containers; xpu runs one container per task", more.len()),
                ));
            }
        };
        let rootfs = annotations.get("xpu.dev/rootfs").cloned();
        let bundle = annotations.get("xpu.dev/bundle").cloned();
        if pod.get("resourceClaims").is_some() {
            self.unsupported.push(JobError::new(pod.field("resourceClaims"), DRA_CLAIMS));
        }
        let (volumes, refused) = self.volumes(&pod)?;
        let mut container = self.container(&container, rootfs.clone(), bundle.clone())?;
        let mut init_containers = Vec::new();
        match pod.get("initContainers") {
            None => {}
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    let path = format!("{}[{i}]", pod.field("initContainers"));
                    let Value::Object(m) = item else {
                        return Err(JobError::new(path, "must be a mapping"));
                    };
                    let c = Obj { path, map: m };
                    init_containers.push(self.init_container(&c, &container, &rootfs, &bundle)?);
                }
            }
            Some(_) => return Err(JobError::new(pod.field("initContainers"), "must be a list")),
        }
        let in_container = rootfs.is_some() || bundle.is_some();
        let names = init_containers.iter().chain(std::iter::once(&container));
        let all: Vec<(String, &Container)> = init_containers
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("{}[{i}]", pod.field("initContainers")), c))
            .chain(std::iter::once((format!("{}[0]", pod.field("containers")), &container)))
            .collect();
        let mut seen_names: Vec<&str> = Vec::new();
        for c in names {
            if seen_names.contains(&c.name.as_str()) {
                return Err(JobError::new(
                    pod.field("initContainers"),
                    format!("container name {:?} is used twice; give each its own", c.name),
                ));
            }
            seen_names.push(&c.name);
        }
        for (path, c) in &all {
            for (j, m) in c.volume_mounts.iter().enumerate() {
                let here = format!("{path}.volumeMounts[{j}]");
                if refused.contains(&m.name) {
                    continue;
                }
                if !volumes.iter().any(|v| v.name == m.name) {
                    return Err(JobError::new(
                        format!("{here}.name"),
                        format!("no volume named {:?} in spec.volumes", m.name),
                    ));
                }
                if !in_container {
                    self.notes.push(format!(
                        "{here}: a host-process task cannot mount volumes, so {} (volume {}) is not mounted; the pod's containers share the task's working directory instead (set xpu.dev/rootfs to run it as a container)",
                        m.mount_path, m.name
                    ));
                }
            }
        }
        if let Some(v) = volumes.iter().find(|v| v.size_limit.is_some() && !v.memory) {
            self.notes.push(format!(
                "volume {}: sizeLimit is not enforced on a disk-backed emptyDir (medium: Memory is a tmpfs of that size)",
                v.name
            ));
        }
        if let Some(m) = annotations.get("xpu.dev/gpu-milli") {
            let path = root.field("metadata.annotations.xpu.dev/gpu-milli");
            let milli = m
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|n| (1..=999).contains(n))
                .ok_or_else(|| JobError::new(&path, SHARE_RANGE))?;
            share_gpu(&mut container.resources, milli, &path)?;
        }
        let spec = JobSpec {
            name,
            queue,
            priority,
            completions: completions as u32,
            parallelism: parallelism as u32,
            completion_mode: mode,
            backoff_limit: backoff as u32,
            restart_policy: restart,
            active_deadline_seconds: deadline,
            node_selector,
            subdomain,
            container,
            source: Source::Kubernetes,
            pod: pod_meta,
            init_containers,
            volumes,
        };
        self.refuse_unsupported()?;
        validate(&spec, &self.prefix)?;
        Ok(spec)
    }

    fn container(
        &mut self,
        c: &Obj<'_>,
        rootfs: Option<String>,
        bundle: Option<String>,
    ) -> Result<Container, JobError> {
        let name = c.str("name")?.unwrap_or("main").to_owned();
        let image = c.str("image")?.map(str::to_owned);
        let command = c.strings("command")?;
        let args = c.strings("args")?.unwrap_or_default();
        let argv = match (command, rootfs.is_some()) {
            (Some(cmd), _) if !cmd.is_empty() => cmd.into_iter().chain(args).collect(),
            // A bundle brings its own process.args; args alone cannot be put in front of them.
            _ if bundle.is_some() && args.is_empty() => Vec::new(),
            _ if bundle.is_some() => {
                return Err(JobError::new(
                    c.field("command"),
                    "required with args when the job names a bundle (the bundle's process.args run when both are absent)",
                ));
            }
            // A rootfs has no image config to read either, so the same rule applies there.
            _ => match image.as_deref().and_then(image_entrypoint) {
                Some(entry) => {
                    self.notes.push(format!(
                        "{}: no command; running {entry:?} (the image's base name) with args",
                        c.field("command")
                    ));
                    std::iter::once(entry).chain(args).collect()
                }
                None => {
                    return Err(JobError::new(
                        c.field("command"),
                        "required when the image name does not give the program to run",
                    ));
                }
            },
        };
        let mut env = Vec::new();
        match c.get("env") {
            None => {}
            Some(Value::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    let path = format!("{}[{i}]", c.field("env"));
                    let Value::Object(m) = item else {
                        return Err(JobError::new(path, "must be a mapping with name and value"));
                    };
                    let e = Obj { path, map: m };
                    let name =
                        e.str("name")?.ok_or_else(|| JobError::new(e.field("name"), "required"))?;
                    if let Some(from) = e.obj("valueFrom")? {
                        let from = match env_from(&from) {
                            Ok(f) => f,
                            Err(err) => {
                                self.unsupported.push(err);
                                continue;
                            }
                        };
                        env.push(EnvVar {
                            name: name.to_owned(),
                            value: String::new(),
                            from: Some(from),
                        });
                        continue;
                    }
                    let value = match e.get("value") {
                        None => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Number(n)) => n.to_string(),
                        Some(Value::Bool(b)) => b.to_string(),
                        Some(_) => return Err(JobError::new(e.field("value"), "must be a string")),
                    };
                    env.push(EnvVar { name: name.to_owned(), value, from: None });
                }
            }
            Some(_) => return Err(JobError::new(c.field("env"), "must be a list")),
        }
        if c.get("envFrom").is_some() {
            self.unsupported.push(JobError::new(
                c.field("envFrom"),
                "ConfigMaps and Secrets are not available outside Kubernetes; list the variables in env[] with their values, or put them in a file the job reads",
            ));
        }
        if let Some(r) = c.obj("resources")?
            && r.get("claims").is_some()
        {
            self.unsupported.push(JobError::new(r.field("claims"), DRA_CLAIMS));
        }
        let working_dir = c.str("workingDir")?.map(str::to_owned);
        let resources = match c.obj("resources")? {
            Some(r) => self.resources(&r)?,
            None => Resources::default(),
        };
        let volume_mounts = volume_mounts(c)?;
        Ok(Container {
            name,
            image,
            argv,
            env,
            working_dir,
            rootfs,
            bundle,
            resources,
            volume_mounts,
            sidecar: false,
        })
    }

    /// One of `initContainers`: a container like the main one that shares its devices, so it
    /// may not ask for devices the main container does not hold.
    fn init_container(
        &mut self,
        c: &Obj<'_>,
        main: &Container,
        rootfs: &Option<String>,
        bundle: &Option<String>,
    ) -> Result<Container, JobError> {
        let mut init = self.container(c, rootfs.clone(), bundle.clone())?;
        init.sidecar = match c.str("restartPolicy")? {
            None => false,
            Some("Always") => true,
            Some(_) => {
                return Err(JobError::new(
                    c.field("restartPolicy"),
                    "must be Always (a sidecar) or absent",
                ));
            }
        };
        for d in &init.resources.devices {
            let held = main
                .resources
                .devices
                .iter()
                .find(|m| m.resource == d.resource)
                .map_or(0, |m| m.count);
            if d.count > held {
                self.unsupported.push(JobError::new(
                    format!("{}.limits.{}", c.field("resources"), d.resource),
                    format!(
                        "an init container runs on the task's devices: ask for {} {} in containers[0] (it asks for {held})",
                        d.count, d.resource
                    ),
                ));
            }
        }
        Ok(init)
    }

    /// `spec.volumes`: `emptyDir` ones, and the names of the others, each refused (in
    /// [`Parser::unsupported`]) naming the volume.
    fn volumes(&mut self, pod: &Obj<'_>) -> Result<(Vec<Volume>, Vec<String>), JobError> {
        let mut refused = Vec::new();
        let items = match pod.get("volumes") {
            None => return Ok((Vec::new(), refused)),
            Some(Value::Array(items)) => items,
            Some(_) => return Err(JobError::new(pod.field("volumes"), "must be a list")),
        };
        let mut out: Vec<Volume> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("{}[{i}]", pod.field("volumes"));
            let Value::Object(m) = item else {
                return Err(JobError::new(path, "must be a mapping"));
            };
            let v = Obj { path, map: m };
            let name = v.str("name")?.ok_or_else(|| JobError::new(v.field("name"), "required"))?;
            if !is_dns_label(name) {
                return Err(JobError::new(
                    v.field("name"),
                    "must be a DNS label: 1 to 63 lower-case letters, digits and '-'",
                ));
            }
            if out.iter().any(|o| o.name == name) || refused.iter().any(|r| r == name) {
                return Err(JobError::new(
                    v.field("name"),
                    format!("volume {name:?} is declared twice"),
                ));
            }
            if let Some(d) = v.obj("downwardAPI")? {
                let files = downward_files(&d)?;
                out.push(Volume {
                    name: name.to_owned(),
                    memory: false,
                    size_limit: None,
                    downward_api: Some(files),
                });
                continue;
            }
            let Some(dir) = v.obj("emptyDir")? else {
                let kind = m
                    .keys()
                    .find(|k| k.as_str() != "name")
                    .map_or("a volume without a type", String::as_str);
                self.unsupported.push(JobError::new(
                    v.path.clone(),
                    format!(
                        "volume {name:?} is {kind}; xpu provides emptyDir and downwardAPI volumes only (put the data in the rootfs, or copy it in from an init container)"
                    ),
                ));
                refused.push(name.to_owned());
                continue;
            };
            let memory = match dir.str("medium")? {
                None | Some("") => false,
                Some("Memory") => true,
                Some(other) => {
                    return Err(JobError::new(
                        dir.field("medium"),
                        format!("unknown medium {other:?}; use Memory or leave it out"),
                    ));
                }
            };
            let size_limit = match dir.get("sizeLimit") {
                None => None,
                Some(q) => Some(memory_mib(q).map(|mib| mib << 20).ok_or_else(|| {
                    JobError::new(dir.field("sizeLimit"), "must be a quantity such as 1Gi")
                })?),
            };
            out.push(Volume { name: name.to_owned(), memory, size_limit, downward_api: None });
        }
        Ok((out, refused))
    }

    /// `resources.requests` / `resources.limits`.
    fn resources(&mut self, r: &Obj<'_>) -> Result<Resources, JobError> {
        let requests = r.obj("requests")?;
        let limits = r.obj("limits")?;
        let mut out = Resources::default();
        let mut keys: Vec<&String> = Vec::new();
        for m in [&requests, &limits].into_iter().flatten() {
            for k in m.map.keys() {
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        for key in keys {
            let req = requests.as_ref().and_then(|m| m.get(key).map(|v| (m.field(key), v)));
            let lim = limits.as_ref().and_then(|m| m.get(key).map(|v| (m.field(key), v)));
            match key.as_str() {
                "cpu" => {
                    // The scheduler reserves the request; with only a limit, Kubernetes
                    // defaults the request to the limit.
                    if let Some((path, v)) = req.or(lim) {
                        out.cpu_milli = cpu_milli(v).ok_or_else(|| {
                            JobError::new(path, "must be a CPU quantity such as 500m or 2")
                        })?;
                    }
                }
                "memory" => {
                    if let Some((path, v)) = req.or(lim) {
                        out.memory_mib = memory_mib(v).ok_or_else(|| {
                            JobError::new(path, "must be a memory quantity such as 512Mi or 16Gi")
                        })?;
                    }
                }
                k if extended_resource(k).is_some() => {
                    let Some((kind, vendor)) = extended_resource(k) else { continue };
                    let parse = |(path, v): (String, &Value)| -> Result<u32, JobError> {
                        int_value(v)
                            .filter(|n| (0..=1024).contains(n))
                            .map(|n| n as u32)
                            .ok_or_else(|| JobError::new(path, "must be a positive integer"))
                    };
                    let lim_path = limits
                        .as_ref()
                        .map(|l| l.field(key))
                        .unwrap_or_else(|| format!("{}.limits.{key}", r.path));
                    let count = match (req, lim) {
                        (Some(rq), Some(lm)) => {
                            let rq_path = rq.0.clone();
                            let a = parse(rq)?;
                            let b = parse(lm)?;
                            if a != b {
                                return Err(JobError::new(
                                    rq_path,
                                    format!(
                                        "must equal limits.{key} ({b}): extended resources cannot be overcommitted"
                                    ),
                                ));
                            }
                            b
                        }
                        (None, Some(lm)) => parse(lm)?,
                        (Some(rq), None) => {
                            parse(rq)?;
                            return Err(JobError::new(
                                lim_path,
                                "required when requests sets it: extended resources cannot be overcommitted",
                            ));
                        }
                        (None, None) => 0,
                    };
                    if count > 0 {
                        out.devices.push(DeviceRequest {
                            resource: key.clone(),
                            kind,
                            vendor: Some(vendor.to_owned()),
                            count,
                            milli: None,
                        });
                    }
                }
                k if k == "ephemeral-storage" || k.starts_with("hugepages-") => {
                    self.notes.push(format!("{}: {k} is not reserved by xpu", r.path));
                }
                k => {
                    let path = limits
                        .as_ref()
                        .filter(|l| l.get(k).is_some())
                        .or(requests.as_ref())
                        .map(|m| m.field(k))
                        .unwrap_or_else(|| r.field(k));
                    self.unsupported.push(JobError::new(path, unknown_resource(k)));
                }
            }
        }
        Ok(out)
    }

    /// xpu's short form: a flat mapping.
    ///
    /// ```yaml
    /// name: train            # default: the program's base name
    /// command: [python, train.py]
    /// gpus: 2                # or tpus: N, or devices: {nvidia.com/gpu: 2}
    /// cpu: 4                 # optional; memory: 16Gi
    /// queue: research        # priority: 10
    /// completions: 2         # parallelism: 2, indexed: true
    /// restartPolicy: OnFailure
    /// backoffLimit: 3        # activeDeadlineSeconds: 3600
    /// nodeSelector: {xpu.dev/gpu.product: A100-SXM4-40GB}
    /// env: {WANDB_MODE: offline}
    /// workingDir: /data      # rootfs: /srv/rootfs or bundle: /srv/bundle (an OCI container)
    /// gpuMilli: 250          # a quarter of one GPU, shared
    /// ```
    fn short(&mut self, map: &Map<String, Value>) -> Result<JobSpec, JobError> {
        const KNOWN: [&str; 22] = [
            "name",
            "command",
            "gpus",
            "tpus",
            "devices",
            "cpu",
            "memory",
            "queue",
            "priority",
            "completions",
            "parallelism",
            "indexed",
            "restartPolicy",
            "backoffLimit",
            "activeDeadlineSeconds",
            "nodeSelector",
            "env",
            "workingDir",
            "rootfs",
            "bundle",
            "gpuMilli",
            "image",
        ];
        let o = self.root(map);
        for k in map.keys() {
            if !KNOWN.contains(&k.as_str()) {
                return Err(JobError::new(
                    o.field(k),
                    format!(
                        "unknown field; the short form has {}; a Kubernetes manifest needs apiVersion and kind",
                        KNOWN.join(", ")
                    ),
                ));
            }
        }
        let argv = match o.get("command") {
            Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
            Some(_) => o.strings("command")?.unwrap_or_default(),
            None => Vec::new(),
        };
        let bundle = o.str("bundle")?.map(str::to_owned);
        if argv.is_empty() && bundle.is_none() {
            return Err(JobError::new(
                o.field("command"),
                "required: the program and its arguments",
            ));
        }
        let name = match o.str("name")? {
            Some(n) => n.to_owned(),
            None => argv
                .first()
                .or(bundle.as_ref())
                .map(|a| a.trim_end_matches('/').rsplit('/').next().unwrap_or(a).to_owned())
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| "job".to_owned()),
        };
        let mut resources = Resources::default();
        if let Some(n) = o.uint("gpus", 0, 1024)?
            && n > 0
        {
            resources.devices.push(DeviceRequest {
                resource: "gpu".to_owned(),
                kind: DeviceKind::Gpu,
                vendor: None,
                count: n as u32,
                milli: None,
            });
        }
        if let Some(n) = o.uint("tpus", 0, 1024)?
            && n > 0
        {
            resources.devices.push(DeviceRequest {
                resource: "google.com/tpu".to_owned(),
                kind: DeviceKind::Tpu,
                vendor: Some("google".to_owned()),
                count: n as u32,
                milli: None,
            });
        }
        if let Some(d) = o.obj("devices")? {
            for (k, v) in d.map {
                let Some((kind, vendor)) = extended_resource(k) else {
                    return Err(JobError::new(
                        d.field(k),
                        "unknown device resource; use nvidia.com/gpu, amd.com/gpu, google.com/tpu or habana.ai/gaudi",
                    ));
                };
                let n = int_value(v)
                    .filter(|n| (0..=1024).contains(n))
                    .ok_or_else(|| JobError::new(d.field(k), "must be a positive integer"))?;
                if n > 0 {
                    resources.devices.push(DeviceRequest {
                        resource: k.clone(),
                        kind,
                        vendor: Some(vendor.to_owned()),
                        count: n as u32,
                        milli: None,
                    });
                }
            }
        }
        if let Some(m) = o.uint("gpuMilli", 1, 999)? {
            share_gpu(&mut resources, m as u16, &o.field("gpuMilli"))?;
        }
        if let Some(v) = o.get("cpu") {
            resources.cpu_milli = cpu_milli(v).ok_or_else(|| {
                JobError::new(o.field("cpu"), "must be a CPU quantity such as 500m or 2")
            })?;
        }
        if let Some(v) = o.get("memory") {
            resources.memory_mib = memory_mib(v).ok_or_else(|| {
                JobError::new(o.field("memory"), "must be a memory quantity such as 512Mi or 16Gi")
            })?;
        }
        let completions = o.uint("completions", 1, MAX_COMPLETIONS)?.unwrap_or(1);
        let parallelism = o.uint("parallelism", 1, MAX_COMPLETIONS)?.unwrap_or(completions);
        let mode = if o.bool("indexed")?.unwrap_or(false) {
            CompletionMode::Indexed
        } else {
            CompletionMode::NonIndexed
        };
        let restart = match o.str("restartPolicy")? {
            None | Some("Never") => RestartPolicy::Never,
            Some("OnFailure") => RestartPolicy::OnFailure,
            Some(_) => {
                return Err(JobError::new(o.field("restartPolicy"), "must be Never or OnFailure"));
            }
        };
        let env = o
            .string_map("env")?
            .into_iter()
            .map(|(name, value)| EnvVar { name, value, from: None })
            .collect();
        let priority = match o.get("priority") {
            None => 0,
            Some(v) => int_value(v)
                .filter(|n| (i32::MIN as i128..=i32::MAX as i128).contains(n))
                .ok_or_else(|| JobError::new(o.field("priority"), "must be an integer"))?
                as i32,
        };
        let spec = JobSpec {
            name,
            queue: o.str("queue")?.unwrap_or("default").to_owned(),
            priority,
            completions: completions as u32,
            parallelism: parallelism as u32,
            completion_mode: mode,
            backoff_limit: o.uint("backoffLimit", 0, i32::MAX as u64)?.unwrap_or(0) as u32,
            restart_policy: restart,
            active_deadline_seconds: o.uint("activeDeadlineSeconds", 1, i64::MAX as u64)?,
            node_selector: o.string_map("nodeSelector")?,
            subdomain: None,
            container: Container {
                name: "main".to_owned(),
                image: o.str("image")?.map(str::to_owned),
                argv,
                env,
                working_dir: o.str("workingDir")?.map(str::to_owned),
                rootfs: o.str("rootfs")?.map(str::to_owned),
                bundle,
                resources,
                volume_mounts: Vec::new(),
                sidecar: false,
            },
            source: Source::Short,
            pod: PodMeta::default(),
            init_containers: Vec::new(),
            volumes: Vec::new(),
        };
        self.refuse_unsupported()?;
        validate(&spec, &self.prefix)?;
        Ok(spec)
    }
}

/// `volumeMounts` of one container.
fn volume_mounts(c: &Obj<'_>) -> Result<Vec<VolumeMount>, JobError> {
    let items = match c.get("volumeMounts") {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(JobError::new(c.field("volumeMounts"), "must be a list")),
    };
    let mut out: Vec<VolumeMount> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let path = format!("{}[{i}]", c.field("volumeMounts"));
        let Value::Object(m) = item else {
            return Err(JobError::new(path, "must be a mapping"));
        };
        let v = Obj { path, map: m };
        let name = v.str("name")?.ok_or_else(|| JobError::new(v.field("name"), "required"))?;
        let mount_path =
            v.str("mountPath")?.ok_or_else(|| JobError::new(v.field("mountPath"), "required"))?;
        if !mount_path.starts_with('/')
            || mount_path.contains('\0')
            || mount_path.split('/').any(|p| p == "..")
        {
            return Err(JobError::new(
                v.field("mountPath"),
                "must be an absolute path without '..'",
            ));
        }
        if out.iter().any(|o| o.mount_path == mount_path) {
            return Err(JobError::new(
                v.field("mountPath"),
                format!("{mount_path} is mounted twice in this container"),
            ));
        }
        let sub_path = v.str("subPath")?.filter(|p| !p.is_empty());
        if let Some(p) = sub_path
            && (p.starts_with('/') || p.contains('\0') || p.split('/').any(|s| s == ".."))
        {
            return Err(JobError::new(
                v.field("subPath"),
                "must be a relative path inside the volume, without '..'",
            ));
        }
        out.push(VolumeMount {
            name: name.to_owned(),
            mount_path: mount_path.to_owned(),
            read_only: v.bool("readOnly")?.unwrap_or(false),
            sub_path: sub_path.map(str::to_owned),
        });
    }
    Ok(out)
}

/// A file mode (`mode`, `defaultMode`). Kubernetes reads YAML 1.1, where `0644` is octal; the
/// YAML loader here reads it as the decimal 644. A value over 0o777 whose digits are all octal
/// digits is therefore taken as written in octal (`0644`, `0755`, `0600`); others are decimal,
/// as JSON and `kubectl get -o yaml` write them (`420` is 0o644). An octal mode written with a
/// leading zero that is also a valid decimal mode (`0444`, `0400`) cannot be told from it and
/// is read as decimal.
fn file_mode(o: &Obj<'_>, key: &str) -> Result<Option<u32>, JobError> {
    let Some(v) = o.get(key) else { return Ok(None) };
    let bad = || JobError::new(o.field(key), "must be a file mode from 0 to 0777 (420 or 0644)");
    let n = int_value(v).filter(|n| *n >= 0).ok_or_else(bad)?;
    if n <= 0o777 {
        return Ok(Some(n as u32));
    }
    let digits = n.to_string();
    if digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        let octal = u32::from_str_radix(&digits, 8).map_err(|_| bad())?;
        if octal <= 0o777 {
            return Ok(Some(octal));
        }
    }
    Err(bad())
}

/// The `items` of a `downwardAPI` volume.
fn downward_files(d: &Obj<'_>) -> Result<Vec<DownwardFile>, JobError> {
    let default_mode = file_mode(d, "defaultMode")?.unwrap_or(0o644);
    let items = match d.get("items") {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(JobError::new(d.field("items"), "must be a list")),
    };
    let mut out: Vec<DownwardFile> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let path = format!("{}[{i}]", d.field("items"));
        let Value::Object(m) = item else {
            return Err(JobError::new(path, "must be a mapping"));
        };
        let it = Obj { path, map: m };
        let file = it.str("path")?.ok_or_else(|| JobError::new(it.field("path"), "required"))?;
        if file.is_empty()
            || file.starts_with('/')
            || file.contains('\0')
            || file.split('/').any(|p| p == ".." || p.is_empty())
        {
            return Err(JobError::new(
                it.field("path"),
                "must be a relative path inside the volume, without '..'",
            ));
        }
        if out.iter().any(|f| f.path == file) {
            return Err(JobError::new(it.field("path"), format!("{file} is written twice")));
        }
        let from = if let Some(f) = it.obj("fieldRef")? {
            let fp = f
                .str("fieldPath")?
                .ok_or_else(|| JobError::new(f.field("fieldPath"), "required"))?;
            EnvFrom::Field(FieldPath::parse_for_volume(fp).ok_or_else(|| {
                JobError::new(
                    f.field("fieldPath"),
                    format!(
                        "{fp:?} is not a field a downwardAPI volume gives; use metadata.name, metadata.namespace, metadata.uid, metadata.labels, metadata.annotations, or one label or annotation (metadata.labels['KEY'])"
                    ),
                )
            })?)
        } else if it.get("resourceFieldRef").is_some() {
            env_from(&it)?
        } else {
            return Err(JobError::new(it.path.clone(), "needs fieldRef or resourceFieldRef"));
        };
        let mode = file_mode(&it, "mode")?.unwrap_or(default_mode);
        out.push(DownwardFile { path: file.to_owned(), from, mode });
    }
    Ok(out)
}

/// A DNS label (RFC 1123), as Kubernetes requires of volume names.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Checks that hold for both forms.
fn validate(spec: &JobSpec, prefix: &str) -> Result<(), JobError> {
    let (name_path, env_path) = match spec.source {
        Source::Kubernetes => ("metadata.name", "spec.template.spec.containers[0].env"),
        Source::Short => ("name", "env"),
    };
    if spec.name.is_empty() || spec.name.len() > 253 || spec.name.chars().any(char::is_control) {
        return Err(JobError::new(
            join(prefix, name_path),
            "must be 1 to 253 printable characters",
        ));
    }
    if spec.queue.is_empty() || spec.queue.len() > 63 || spec.queue.chars().any(char::is_control) {
        return Err(JobError::new(join(prefix, "queue"), "must be 1 to 63 printable characters"));
    }
    let inits = spec
        .init_containers
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("spec.template.spec.initContainers[{i}]"), c));
    let main = std::iter::once((env_path.trim_end_matches(".env").to_owned(), &spec.container));
    for (path, c) in main.chain(inits) {
        let env_path =
            if spec.source == Source::Short { "env".to_owned() } else { format!("{path}.env") };
        for (i, e) in c.env.iter().enumerate() {
            if e.name.is_empty() || e.name.contains('=') || e.name.contains('\0') {
                return Err(JobError::new(
                    join(prefix, &format!("{env_path}[{i}].name")),
                    "must be a non-empty name without '=' or NUL",
                ));
            }
            if e.value.contains('\0') {
                return Err(JobError::new(
                    join(prefix, &format!("{env_path}[{i}].value")),
                    "must not contain NUL",
                ));
            }
        }
        if c.argv.iter().any(|a| a.contains('\0')) {
            let at = if spec.source == Source::Short {
                "command".to_owned()
            } else {
                format!("{path}.command")
            };
            return Err(JobError::new(join(prefix, &at), "must not contain NUL"));
        }
    }
    let (rootfs_path, bundle_path) = match spec.source {
        Source::Kubernetes => {
            ("metadata.annotations.xpu.dev/rootfs", "metadata.annotations.xpu.dev/bundle")
        }
        Source::Short => ("rootfs", "bundle"),
    };
    let c = &spec.container;
    if c.rootfs.is_some() && c.bundle.is_some() {
        return Err(JobError::new(
            join(prefix, bundle_path),
            "give either a rootfs or a bundle, not both",
        ));
    }
    for (path, value) in [(rootfs_path, &c.rootfs), (bundle_path, &c.bundle)] {
        if let Some(v) = value
            && (!v.starts_with('/') || v.contains('\0'))
        {
            return Err(JobError::new(
                join(prefix, path),
                "must be an absolute path to a directory on the daemon's host",
            ));
        }
    }
    Ok(())
}

/// Why a manifest's DRA claims are refused.
const DRA_CLAIMS: &str = "ResourceClaims (DRA) are allocated by a Kubernetes cluster (xpu k8s dra-driver serves them there); outside Kubernetes ask for devices in resources.limits (nvidia.com/gpu: 1)";

const SHARE_RANGE: &str = "must be an integer from 1 to 999 (thousandths of one GPU)";

/// Turns the task's GPU request into a share of one GPU: the GPU limit must be 1 (that vendor's
/// GPU) or absent (any vendor's).
fn share_gpu(res: &mut Resources, milli: u16, path: &str) -> Result<(), JobError> {
    let gpus: Vec<usize> =
        (0..res.devices.len()).filter(|&i| res.devices[i].kind == DeviceKind::Gpu).collect();
    match gpus.as_slice() {
        [] => res.devices.push(DeviceRequest {
            resource: "gpu".to_owned(),
            kind: DeviceKind::Gpu,
            vendor: None,
            count: 1,
            milli: Some(milli),
        }),
        [i] if res.devices[*i].count == 1 => res.devices[*i].milli = Some(milli),
        _ => {
            return Err(JobError::new(
                path,
                "a share is of one GPU; set the container's GPU limit to 1 or leave it out",
            ));
        }
    }
    Ok(())
}

/// Five characters from the API server's `generateName` alphabet (no vowels, no 0/1/3).
fn name_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    // A randomly keyed hasher: random enough for a name, without a dependency.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let mut x = h.finish();
    (0..5)
        .map(|_| {
            let c = ALPHABET[(x % ALPHABET.len() as u64) as usize];
            x /= ALPHABET.len() as u64;
            char::from(c)
        })
        .collect()
}

/// Why a resource name is refused, naming xpu's equivalent where there is one.
fn unknown_resource(name: &str) -> String {
    const SHARE: &str = "ask for a share of one GPU with the annotation xpu.dev/gpu-milli \
                         (thousandths of a GPU) and nvidia.com/gpu: 1, or for whole GPUs";
    if name.starts_with("nvidia.com/mig-") {
        return format!(
            "MIG devices are not supported yet; ask for whole GPUs (nvidia.com/gpu) or {}",
            "for a share of one with the annotation xpu.dev/gpu-milli"
        );
    }
    let sharing = [
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
        "nvidia.com/gpu.shared",
        "aliyun.com/gpu-mem",
        "aliyun.com/gpu-count",
    ];
    if sharing.contains(&name) || name.starts_with("volcano.sh/vgpu") {
        return format!("{name} is another project's GPU sharing resource; {SHARE}");
    }
    "unknown resource; xpu schedules cpu, memory, nvidia.com/gpu, amd.com/gpu, \
     gpu.intel.com/i915, gpu.intel.com/xe, google.com/tpu and habana.ai/gaudi"
        .to_owned()
}

/// The device kind and vendor an extended resource name stands for.
pub fn extended_resource(name: &str) -> Option<(DeviceKind, &'static str)> {
    match name {
        "nvidia.com/gpu" => Some((DeviceKind::Gpu, "nvidia")),
        "amd.com/gpu" => Some((DeviceKind::Gpu, "amd")),
        "google.com/tpu" => Some((DeviceKind::Tpu, "google")),
        "habana.ai/gaudi" => Some((DeviceKind::Npu, "intel")),
        // Intel's device plugin: i915 (Flex, Max) and xe (newer parts) drivers.
        "gpu.intel.com/i915" | "gpu.intel.com/xe" => Some((DeviceKind::Gpu, "intel")),
        _ => None,
    }
}

/// `gcr.io/k8s-staging-perf-tests/sleep:latest` → `sleep`.
fn image_entrypoint(image: &str) -> Option<String> {
    let no_digest = image.split('@').next().unwrap_or(image);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    let base = last.split(':').next().unwrap_or(last);
    (!base.is_empty()).then(|| base.to_owned())
}

/// A Kubernetes CPU quantity (`500m`, `2`, `1.5`) in millicores.
pub fn cpu_milli(v: &Value) -> Option<u64> {
    let s = match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.trim().to_owned(),
        _ => return None,
    };
    if let Some(m) = s.strip_suffix('m') {
        return m.parse::<u64>().ok();
    }
    let f: f64 = s.parse().ok()?;
    (f.is_finite() && (0.0..1e9).contains(&f)).then(|| (f * 1000.0).ceil() as u64)
}

/// A Kubernetes memory quantity (`512Mi`, `16Gi`, `1G`, `1000000`) in MiB, rounded up.
pub fn memory_mib(v: &Value) -> Option<u64> {
    let s = match v {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.trim().to_owned(),
        _ => return None,
    };
    let bytes = quantity(&s)?;
    (0.0..1e18).contains(&bytes).then(|| (bytes / 1048576.0).ceil() as u64)
}

/// A Kubernetes quantity as a number: `500m` is 0.5, `1Ki` 1024, `2G` 2e9, `3` 3.
pub fn quantity(s: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 11] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
    ];
    let s = s.trim();
    let (num, mult) = SUFFIXES
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n, *m)))
        .unwrap_or((s, 1.0));
    let f: f64 = num.parse().ok()?;
    Some(f * mult).filter(|v| v.is_finite() && *v >= 0.0)
}

/// `env[].valueFrom`: the downward API (`fieldRef`, `resourceFieldRef`); secrets and config
/// maps are refused naming the field, since no API server holds them here.
fn env_from(from: &Obj<'_>) -> Result<EnvFrom, JobError> {
    for (key, what) in [("secretKeyRef", "secrets"), ("configMapKeyRef", "config maps")] {
        if from.get(key).is_some() {
            return Err(JobError::new(
                from.field(key),
                format!(
                    "{what} are not available outside Kubernetes; put the value in env[].value, \
                     or in a file the job reads"
                ),
            ));
        }
    }
    if let Some(f) = from.obj("fieldRef")? {
        let path =
            f.str("fieldPath")?.ok_or_else(|| JobError::new(f.field("fieldPath"), "required"))?;
        return FieldPath::parse(path).map(EnvFrom::Field).ok_or_else(|| {
            JobError::new(
                f.field("fieldPath"),
                format!(
                    "{path:?} is not a downward API field; use metadata.name, metadata.namespace, \
                     metadata.uid, metadata.labels['KEY'], metadata.annotations['KEY'], \
                     spec.nodeName, spec.serviceAccountName, status.hostIP or status.podIP"
                ),
            )
        });
    }
    if let Some(r) = from.obj("resourceFieldRef")? {
        let resource =
            r.str("resource")?.ok_or_else(|| JobError::new(r.field("resource"), "required"))?;
        if !(resource.starts_with("limits.") || resource.starts_with("requests.")) {
            return Err(JobError::new(
                r.field("resource"),
                format!(
                    "{resource:?}: must be limits.NAME or requests.NAME (limits.cpu, requests.memory)"
                ),
            ));
        }
        let divisor = match r.get("divisor") {
            None => "1".to_owned(),
            Some(Value::String(d)) => d.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(_) => {
                return Err(JobError::new(r.field("divisor"), "must be a quantity (1, 1m, 1Mi)"));
            }
        };
        if quantity(&divisor).is_none_or(|d| d <= 0.0) {
            return Err(JobError::new(
                r.field("divisor"),
                format!("{divisor:?} is not a positive quantity"),
            ));
        }
        return Ok(EnvFrom::Resource { resource: resource.to_owned(), divisor });
    }
    Err(JobError::new(
        &from.path,
        "needs fieldRef or resourceFieldRef (secretKeyRef and configMapKeyRef are not available here)",
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const SINGLE: &str = r#"
apiVersion: batch/v1
kind: Job
metadata:
  name: job-1
spec:
  template:
    spec:
      nodeSelector:
        cloud.google.com/gke-flex-start: "true"
        cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
        cloud.google.com/gke-tpu-topology: 2x4
      containers:
      - name: container-1
        image: gcr.io/k8s-staging-perf-tests/sleep:latest
        args: ["3600s"] # Sleep for 1 hour
        resources:
          requests:
              google.com/tpu: 8
          limits:
              google.com/tpu: 8
      restartPolicy: OnFailure
"#;

    const MULTI: &str = r#"
apiVersion: v1
kind: Service
metadata:
  name: headless-svc
spec:
  clusterIP: None
  selector:
    job-name: job-1
---
apiVersion: batch/v1
kind: Job
metadata:
  name: job-1
spec:
  backoffLimit: 0
  completions: 2
  parallelism: 2
  completionMode: Indexed
  template:
    spec:
      subdomain: headless-svc
      restartPolicy: Never
      nodeSelector:
          cloud.google.com/gke-flex-start: "true"
          cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
          cloud.google.com/gke-tpu-topology: 2x4
      containers:
      - name: tpu-job
        image: us-docker.pkg.dev/cloud-tpu-images/jax-ai-image/tpu:latest
        ports:
        - containerPort: 8471 # Default port using which TPU VMs communicate
        - containerPort: 8431 # Port to export TPU runtime metrics, if supported.
        securityContext:
          privileged: true
        command:
        - bash
        - -c
        - |
          python -c 'import jax; print("TPU cores:", jax.device_count())'
        resources:
          requests:
            google.com/tpu: 4
          limits:
            google.com/tpu: 4
"#;

    #[test]
    fn seed_single_host_job() {
        let p = parse(SINGLE).unwrap();
        let s = &p.spec;
        assert_eq!(s.name, "job-1");
        assert_eq!(s.restart_policy, RestartPolicy::OnFailure);
        assert_eq!(s.backoff_limit, DEFAULT_BACKOFF_LIMIT);
        assert_eq!(s.container.argv, ["sleep", "3600s"]);
        assert_eq!(s.container.resources.count(DeviceKind::Tpu), 8);
        assert_eq!(s.node_selector["cloud.google.com/gke-tpu-topology"], "2x4");
        assert!(!s.is_gang());
        assert!(p.notes.iter().any(|n| n.contains("sleep")), "{:?}", p.notes);
    }

    #[test]
    fn seed_multi_host_indexed_job_skips_the_service() {
        let p = parse(MULTI).unwrap();
        let s = &p.spec;
        assert_eq!(s.completions, 2);
        assert_eq!(s.completion_mode, CompletionMode::Indexed);
        assert_eq!(s.backoff_limit, 0);
        assert_eq!(s.restart_policy, RestartPolicy::Never);
        assert_eq!(s.subdomain.as_deref(), Some("headless-svc"));
        assert_eq!(s.container.argv[0], "bash");
        assert_eq!(s.container.argv.len(), 3);
        assert!(s.is_gang());
        assert!(p.notes.iter().any(|n| n.contains("Service headless-svc")), "{:?}", p.notes);
    }

    #[test]
    fn seed_placeholders_name_the_field() {
        let bad = SINGLE.replace("google.com/tpu: 8", "google.com/tpu: NUM_CHIPS");
        let e = parse(&bad).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.template.spec.containers[0].resources.requests.google.com/tpu: must be a positive integer"
        );
        let gpu = SINGLE.replace("google.com/tpu: 8", "nvidia.com/gpu: -1");
        let e = parse(&gpu).unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.template.spec.containers[0].resources.requests.nvidia.com/gpu: must be a positive integer"
        );
    }

    #[test]
    fn openshift_pod_is_accepted() {
        let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: nvidia-smi\nspec:\n  containers:\n  - image: nvidia/cuda\n    name: nvidia-smi\n    command: [ nvidia-smi ]\n    resources:\n      limits:\n        nvidia.com/gpu: 1\n      requests:\n        nvidia.com/gpu: 1\n";
        let p = parse(pod).unwrap();
        assert_eq!(p.spec.container.argv, ["nvidia-smi"]);
        assert_eq!(p.spec.container.resources.devices[0].vendor.as_deref(), Some("nvidia"));
        // Kubernetes' default for a Pod, said in a note; no backoffLimit stops its restarts.
        assert_eq!(p.spec.restart_policy, RestartPolicy::Always);
        assert_eq!(p.spec.backoff_limit, u32::MAX);
        assert!(p.notes.iter().any(|n| n.contains("restartPolicy: Always (the Pod default)")));
        let once = pod.replace("spec:\n", "spec:\n  restartPolicy: Never\n");
        let p = parse(&once).unwrap();
        assert_eq!((p.spec.restart_policy, p.spec.backoff_limit), (RestartPolicy::Never, 0));
        // A Job's pods run to completion: Always stays refused there.
        let job = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: j}\nspec:\n  template:\n    spec:\n      restartPolicy: Always\n      containers: [{name: c, command: [\"true\"]}]\n";
        assert!(parse(job).unwrap_err().to_string().contains("must be Never or OnFailure"));
    }

    #[test]
    fn json_job_and_field_errors() {
        let j = r#"{"apiVersion":"batch/v1","kind":"Job","metadata":{"name":"j"},"spec":{"template":{"spec":{"restartPolicy":"Never","containers":[{"name":"c","command":["true"],"resources":{"limits":{"amd.com/gpu":"2","cpu":"500m","memory":"1Gi"}}}]}}}}"#;
        let s = parse(j).unwrap().spec;
        assert_eq!(s.container.resources.count(DeviceKind::Gpu), 2);
        assert_eq!(s.container.resources.cpu_milli, 500);
        assert_eq!(s.container.resources.memory_mib, 1024);
        let no_restart = j.replace(r#""restartPolicy":"Never","#, "");
        assert_eq!(
            parse(&no_restart).unwrap_err().to_string(),
            "spec.template.spec.restartPolicy: must be Never or OnFailure (a Job's pods run to completion)"
        );
        let mismatch = j.replace(
            r#""limits":{"amd.com/gpu":"2""#,
            r#""requests":{"amd.com/gpu":1},"limits":{"amd.com/gpu":"2""#,
        );
        assert!(parse(&mismatch).unwrap_err().to_string().starts_with(
            "spec.template.spec.containers[0].resources.requests.amd.com/gpu: must equal"
        ));
        let unknown = j.replace("amd.com/gpu", "example.com/fpga");
        assert!(parse(&unknown).unwrap_err().path.ends_with("limits.example.com/fpga"));
        let two = j.replace(r#"[{"name":"c""#, r#"[{"name":"a","command":["x"]},{"name":"c""#);
        assert!(parse(&two).unwrap_err().to_string().contains("2 containers"));
        let neg = j.replace(r#""template""#, r#""completions":0,"template""#);
        assert_eq!(parse(&neg).unwrap_err().path, "spec.completions");
    }

    #[test]
    fn short_form() {
        let s = parse("command: [python, train.py]\ngpus: 2\nqueue: research\npriority: 5\n")
            .unwrap()
            .spec;
        assert_eq!(s.name, "python");
        assert_eq!(s.container.resources.count(DeviceKind::Gpu), 2);
        assert_eq!(s.container.resources.devices[0].vendor, None);
        assert_eq!(s.queue, "research");
        assert_eq!(s.priority, 5);
        assert_eq!(s.backoff_limit, 0);
        let e = parse("command: [x]\ngpu: 2\n").unwrap_err();
        assert_eq!(e.path, "gpu");
        let e = parse("gpus: 1\n").unwrap_err();
        assert_eq!(e.path, "command");
        let s = parse("command: sleep 1\ncompletions: 3\nindexed: true\n").unwrap().spec;
        assert!(s.is_gang());
        assert_eq!(s.container.argv, ["sleep", "1"]);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for text in ["", "[1,2]", "{", "- a\n- b", "kind: 3", "apiVersion: batch/v1", "\0", "a: *b"]
        {
            assert!(parse(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn gpu_shares_and_containers() {
        let k8s = SINGLE.replace("google.com/tpu: 8", "nvidia.com/gpu: 1").replace(
            "  name: job-1\n",
            "  name: job-1\n  annotations:\n    xpu.dev/gpu-milli: \"250\"\n    xpu.dev/rootfs: /srv/r\n",
        );
        let s = parse(&k8s).unwrap().spec;
        let d = &s.container.resources.devices[0];
        assert_eq!((d.count, d.milli, d.vendor.as_deref()), (1, Some(250), Some("nvidia")));
        assert_eq!(s.container.rootfs.as_deref(), Some("/srv/r"));
        assert_eq!(s.container.argv, ["sleep", "3600s"], "a rootfs has no image config either");
        let with_args = k8s.replace("xpu.dev/rootfs: /srv/r", "xpu.dev/bundle: /srv/b");
        assert!(parse(&with_args).unwrap_err().message.contains("the bundle's process.args"));
        let two = k8s.replace("nvidia.com/gpu: 1", "nvidia.com/gpu: 2");
        assert_eq!(parse(&two).unwrap_err().path, "metadata.annotations.xpu.dev/gpu-milli");
        let bad = k8s.replace("\"250\"", "\"1000\"");
        assert_eq!(
            parse(&bad).unwrap_err().to_string(),
            "metadata.annotations.xpu.dev/gpu-milli: must be an integer from 1 to 999 (thousandths of one GPU)"
        );
        let s = parse("command: [x]\ngpuMilli: 500\n").unwrap().spec;
        let d = &s.container.resources.devices[0];
        assert_eq!(
            (d.resource.as_str(), d.count, d.milli, d.vendor.clone()),
            ("gpu", 1, Some(500), None)
        );
        assert_eq!(parse("command: [x]\ngpus: 2\ngpuMilli: 500\n").unwrap_err().path, "gpuMilli");
        // A bundle may bring its own command; a rootfs must be absolute; not both.
        let s = parse("bundle: /srv/train-bundle/\n").unwrap().spec;
        assert!(s.container.argv.is_empty());
        assert_eq!(s.name, "train-bundle");
        assert_eq!(parse("command: [x]\nrootfs: srv\n").unwrap_err().path, "rootfs");
        assert_eq!(parse("command: [x]\nrootfs: /a\nbundle: /b\n").unwrap_err().path, "bundle");
        let stored: JobSpec = serde_json::from_str(
            &serde_json::to_string(&parse("command: [x]\ngpus: 1\n").unwrap().spec)
                .unwrap()
                .replace(",\"milli\":null", ""),
        )
        .unwrap();
        assert_eq!(stored.container.resources.devices[0].milli, None, "old stored specs load");
    }

    #[test]
    fn alias_amplified_manifest_is_refused() {
        // One 10 KB scalar named by 2,000 aliases in env: 30 KB of text, 20 MB of job.
        let mut m = format!("command: [x]\nenv:\n  BIG: &v {}\n", "y".repeat(10_000));
        for i in 0..2_000 {
            m.push_str(&format!("  V{i}: *v\n"));
        }
        let e = parse(&m).unwrap_err();
        assert_eq!(e.path, "manifest");
        assert!(e.message.starts_with("expands to more than"), "{e}");
        assert!(e.message.contains("remove the aliases"), "{e}");
    }

    #[test]
    fn spec_size_is_bounded() {
        // No aliases, just a large value: what the daemon would store and serve back.
        let m = format!("command: [x]\nenv:\n  BIG: {}\n", "y".repeat(MAX_SPEC_BYTES));
        let e = parse(&m).unwrap_err();
        assert_eq!(e.path, "manifest");
        assert!(e.message.contains("over the limit of 1572864"), "{e}");
        let m = format!("command: [x]\nenv:\n  BIG: {}\n", "y".repeat(MAX_SPEC_BYTES / 2));
        assert!(parse(&m).is_ok());
    }

    #[test]
    fn quantities() {
        assert_eq!(cpu_milli(&Value::from("250m")), Some(250));
        assert_eq!(cpu_milli(&Value::from(1.5)), Some(1500));
        assert_eq!(cpu_milli(&Value::from("x")), None);
        assert_eq!(memory_mib(&Value::from("1G")), Some(954));
        assert_eq!(memory_mib(&Value::from("16Gi")), Some(16384));
        assert_eq!(memory_mib(&Value::from("-1Gi")), None);
    }

    #[test]
    fn downward_api_env_parses_and_secrets_are_refused_naming_the_field() {
        let job = |env: &str| {
            format!(
                "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: j}}\nspec:\n  completionMode: Indexed\n  template:\n    metadata: {{labels: {{app: t}}}}\n    spec:\n      restartPolicy: Never\n      containers:\n      - name: c\n        command: [\"true\"]\n        env:\n{env}"
            )
        };
        let ok = job(
            "        - {name: R, valueFrom: {fieldRef: {fieldPath: \"metadata.annotations['batch.kubernetes.io/job-completion-index']\"}}}\n        - {name: A, valueFrom: {fieldRef: {fieldPath: \"metadata.labels['app']\"}}}\n        - {name: N, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}\n        - {name: M, valueFrom: {resourceFieldRef: {resource: limits.memory, divisor: 1Mi}}}\n",
        );
        let spec = parse(&ok).unwrap().spec;
        let from: Vec<_> = spec.container.env.iter().map(|e| e.from.clone().unwrap()).collect();
        assert_eq!(
            from,
            [
                EnvFrom::Field(FieldPath::Annotation(
                    "batch.kubernetes.io/job-completion-index".into()
                )),
                EnvFrom::Field(FieldPath::Label("app".into())),
                EnvFrom::Field(FieldPath::NodeName),
                EnvFrom::Resource { resource: "limits.memory".into(), divisor: "1Mi".into() },
            ]
        );
        assert_eq!(spec.pod.labels.get("app").map(String::as_str), Some("t"));

        let secret = job("        - {name: P, valueFrom: {secretKeyRef: {name: s, key: k}}}\n");
        let e = parse(&secret).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef");
        assert!(e.to_string().contains("not available outside Kubernetes"), "{e}");
        let bad = job("        - {name: P, valueFrom: {fieldRef: {fieldPath: status.phase}}}\n");
        let e = parse(&bad).unwrap_err();
        assert!(e.path.ends_with("valueFrom.fieldRef.fieldPath"), "{}", e.path);
        let cpu = job("        - {name: P, valueFrom: {resourceFieldRef: {resource: cpu}}}\n");
        assert!(parse(&cpu).unwrap_err().to_string().contains("limits.NAME or requests.NAME"));
        assert_eq!(quantity("500m"), Some(0.5));
        assert_eq!(quantity("1Mi"), Some(1048576.0));
        assert_eq!(quantity("x"), None);
    }

    #[test]
    fn generate_name_gets_a_suffix_and_sharing_resources_name_xpus_equivalent() {
        let pod = |meta: &str, res: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{{meta}}}\nspec:\n  restartPolicy: Never\n  containers:\n  - name: c\n    command: [\"true\"]\n    resources: {{limits: {{{res}}}}}\n"
            )
        };
        let a = parse(&pod("generateName: sample-job-", "nvidia.com/gpu: 1")).unwrap().spec.name;
        let b = parse(&pod("generateName: sample-job-", "nvidia.com/gpu: 1")).unwrap().spec.name;
        assert!(a.starts_with("sample-job-") && a.len() == "sample-job-".len() + 5, "{a}");
        assert_ne!(a, b, "two submissions get two names");
        let intel = parse(&pod("name: x", "gpu.intel.com/i915: 2")).unwrap().spec;
        assert_eq!(intel.container.resources.devices[0].vendor.as_deref(), Some("intel"));
        let e = parse(&pod("name: x", "nvidia.com/mig-1g.10gb: 1")).unwrap_err();
        assert!(e.to_string().contains("MIG devices are not supported yet"), "{e}");
        for r in ["nvidia.com/gpumem: 3000", "volcano.sh/vgpu-number: 1", "aliyun.com/gpu-mem: 4"] {
            let e = parse(&pod("name: x", r)).unwrap_err();
            assert!(e.to_string().contains("xpu.dev/gpu-milli"), "{r}: {e}");
        }
    }

    #[test]
    fn a_key_given_twice_is_refused_not_silently_replaced() {
        let yaml = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  restartPolicy: Never\n  containers:\n  - {name: a, command: [\"true\"]}\n  containers:\n  - {name: b, command: [\"false\"]}\n";
        let e = parse(yaml).unwrap_err().to_string();
        assert!(e.contains("duplicate key \"containers\""), "{e}");
        // The mapping's path and where it starts.
        assert!(e.contains("spec: duplicate key") && e.contains("line 5"), "names where: {e}");
        let json =
            r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","name":"q"},"spec":{}}"#;
        let e = parse(json).unwrap_err().to_string();
        assert!(e.contains("duplicate key \"name\""), "{e}");
        // The same key in two different mappings is fine.
        let ok = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  restartPolicy: Never\n  containers:\n  - {name: a, command: [\"true\"]}\n";
        assert!(parse(ok).is_ok());
    }

    #[test]
    fn a_refusal_names_every_unsupported_field() {
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  restartPolicy: Never\n  volumes:\n  - {name: data, hostPath: {path: /data}}\n  containers:\n  - name: a\n    command: [\"true\"]\n    env:\n    - {name: S, valueFrom: {secretKeyRef: {name: s, key: k}}}\n    resources: {limits: {nvidia.com/mig-1g.10gb: 1}}\n  - {name: b, command: [\"true\"]}\n";
        let e = parse(pod).unwrap_err();
        assert_eq!(e.path, "spec.containers", "the first one is the field");
        let text = e.to_string();
        for part in [
            "has 2 containers",
            "volume \"data\" is hostPath; xpu provides emptyDir and downwardAPI volumes only",
            "env[0].valueFrom.secretKeyRef: secrets are not available",
            "nvidia.com/mig-1g.10gb: MIG devices are not supported yet",
        ] {
            assert!(text.contains(part), "{part} missing from: {text}");
        }
    }

    const INDEXED_INIT: &str = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: indexed, annotations: {xpu.dev/rootfs: /srv/rootfs}}\nspec:\n  completions: 3\n  parallelism: 3\n  completionMode: Indexed\n  template:\n    spec:\n      restartPolicy: Never\n      initContainers:\n      - name: input\n        image: docker.io/library/bash\n        command: [bash, -c, 'echo $JOB_COMPLETION_INDEX > /input/data.txt']\n        volumeMounts:\n        - {mountPath: /input, name: input}\n      - {name: proxy, image: busybox, restartPolicy: Always, command: [sleep, '600']}\n      containers:\n      - name: worker\n        image: docker.io/library/busybox\n        command: [cat, /input/data.txt]\n        volumeMounts:\n        - {mountPath: /input, name: input, readOnly: true}\n      volumes:\n      - name: input\n        emptyDir: {}\n      - name: scratch\n        emptyDir: {medium: Memory, sizeLimit: 64Mi}\n";

    #[test]
    fn init_containers_and_empty_dir_volumes() {
        let p = parse(INDEXED_INIT).unwrap();
        let s = &p.spec;
        assert_eq!(s.init_containers.len(), 2);
        assert_eq!(s.init_containers[0].name, "input");
        assert!(!s.init_containers[0].sidecar);
        assert!(s.init_containers[1].sidecar, "restartPolicy: Always makes a sidecar");
        assert_eq!(s.init_containers[0].rootfs.as_deref(), Some("/srv/rootfs"));
        assert_eq!(
            s.volumes,
            vec![
                Volume {
                    name: "input".into(),
                    memory: false,
                    size_limit: None,
                    downward_api: None
                },
                Volume {
                    name: "scratch".into(),
                    memory: true,
                    size_limit: Some(64 << 20),
                    downward_api: None
                },
            ]
        );
        assert_eq!(
            s.container.volume_mounts,
            vec![VolumeMount {
                name: "input".into(),
                mount_path: "/input".into(),
                read_only: true,
                sub_path: None,
            }]
        );
        assert!(p.notes.is_empty(), "{:?}", p.notes);
        // The spec round-trips through the store's JSON.
        let back: JobSpec = serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap();
        assert_eq!(&back, s);

        // As a host process, the mounts cannot be honoured: each one says so.
        let host = INDEXED_INIT.replace(", annotations: {xpu.dev/rootfs: /srv/rootfs}", "");
        let p = parse(&host).unwrap();
        let mounts: Vec<&String> = p.notes.iter().filter(|n| n.contains("cannot mount")).collect();
        assert_eq!(mounts.len(), 2, "{:?}", p.notes);
        assert!(mounts[0].starts_with("spec.template.spec.initContainers[0].volumeMounts[0]"));

        // Bad references and types name their field.
        let cases = [
            (
                "name: input\n        emptyDir: {}",
                "name: input\n        configMap: {name: c}",
                "spec.template.spec.volumes[0]",
                "is configMap",
            ),
            (
                "{mountPath: /input, name: input, readOnly: true}",
                "{mountPath: /input, name: nope}",
                "spec.template.spec.containers[0].volumeMounts[0].name",
                "no volume named \"nope\"",
            ),
            (
                "{mountPath: /input, name: input, readOnly: true}",
                "{mountPath: input, name: input}",
                "spec.template.spec.containers[0].volumeMounts[0].mountPath",
                "absolute",
            ),
            (
                "restartPolicy: Always, command",
                "restartPolicy: OnFailure, command",
                "spec.template.spec.initContainers[1].restartPolicy",
                "must be Always",
            ),
            (
                "medium: Memory",
                "medium: Disk",
                "spec.template.spec.volumes[1].emptyDir.medium",
                "unknown medium",
            ),
            ("name: proxy", "name: worker", "spec.template.spec.initContainers", "used twice"),
        ];
        for (from, to, path, msg) in cases {
            let bad = INDEXED_INIT.replace(from, to);
            assert_ne!(bad, INDEXED_INIT, "{from}");
            let e = parse(&bad).unwrap_err();
            assert_eq!(e.path, path, "{e}");
            assert!(e.message.contains(msg), "{e}");
        }
        // An init container runs on the task's devices; it cannot ask for more.
        let greedy = INDEXED_INIT.replace(
            "command: [sleep, '600']}",
            "command: [sleep, '600'], resources: {limits: {nvidia.com/gpu: 1}}}",
        );
        let e = parse(&greedy).unwrap_err();
        assert!(e.message.contains("an init container runs on the task's devices"), "{e}");
    }

    #[test]
    fn a_file_of_several_workloads_is_taken_whole_or_not_at_all() {
        let pod = |name: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  restartPolicy: Never\n  containers:\n  - {{name: c, command: [\"true\"], resources: {{limits: {{nvidia.com/gpu: 1}}}}}}\n"
            )
        };
        let svc =
            "apiVersion: v1\nkind: Service\nmetadata: {name: headless}\nspec: {clusterIP: None}\n";
        let two = format!("{}---\n{svc}---\n{}", pod("a"), pod("b"));
        let all = parse_all(&two).unwrap();
        let names: Vec<&str> = all.jobs.iter().map(|j| j.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(all.notes, ["skipped Service headless: xpu runs Jobs and Pods"]);
        // `parse` takes one workload and names the second.
        let e = parse(&two).unwrap_err();
        assert_eq!(e.path, "document[2]");
        // One bad document refuses the file, naming it.
        let bad = format!(
            "{}---\n{}",
            pod("a"),
            pod("b").replace("nvidia.com/gpu: 1", "nvidia.com/gpu: x")
        );
        let e = parse_all(&bad).unwrap_err();
        assert_eq!(e.path, "document[1].spec.containers[0].resources.limits.nvidia.com/gpu");
        // The same Pod twice is a mistake, not two jobs.
        let e = parse_all(&format!("{}---\n{}", pod("a"), pod("a"))).unwrap_err();
        assert_eq!(e.path, "document[1].metadata.name");
        assert!(e.message.contains("already document[0]"), "{e}");
        // Bounded.
        let many: Vec<String> = (0..=MAX_WORKLOADS).map(|i| pod(&format!("p{i}"))).collect();
        let e = parse_all(&many.join("---\n")).unwrap_err();
        assert!(e.message.contains("at most 100"), "{e}");
        // Notes name their document.
        let noted =
            format!("{}---\n{}", pod("a"), pod("b").replace("restartPolicy", "restartPolisy"));
        let all = parse_all(&noted).unwrap();
        assert!(
            all.notes.contains(&"document[1]: unknown field \"spec.restartPolisy\"".to_owned()),
            "{:?}",
            all.notes
        );
    }

    #[test]
    fn downward_api_volumes_hold_the_pods_fields() {
        let job = "apiVersion: batch/v1\nkind: Job\nmetadata: {name: indexed-job}\nspec:\n  completions: 5\n  completionMode: Indexed\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n      - {name: worker, image: busybox, command: [rev, /input/data.txt], volumeMounts: [{mountPath: /input, name: input}]}\n      volumes:\n      - name: input\n        downwardAPI:\n          defaultMode: 420\n          items:\n          - path: data.txt\n            mode: 0640\n            fieldRef: {fieldPath: \"metadata.annotations['batch.kubernetes.io/job-completion-index']\"}\n          - {path: meta/labels, fieldRef: {fieldPath: metadata.labels}, mode: 0644}\n          - {path: cpu, resourceFieldRef: {containerName: worker, resource: limits.cpu, divisor: 1m}}\n";
        let p = parse(job).unwrap();
        let files = p.spec.volumes[0].downward_api.clone().unwrap();
        assert_eq!(files.len(), 3);
        assert_eq!(files[0].path, "data.txt");
        assert_eq!(
            files[0].from,
            EnvFrom::Field(FieldPath::Annotation(
                "batch.kubernetes.io/job-completion-index".into()
            ))
        );
        // 0640 and 0644 as Kubernetes reads them (octal), 420 as JSON writes 0o644.
        assert_eq!((files[0].mode, files[1].mode, files[2].mode), (0o640, 0o644, 0o644));
        assert_eq!(files[1].from, EnvFrom::Field(FieldPath::Labels));
        assert!(matches!(files[2].from, EnvFrom::Resource { .. }));
        // Not a field for env.
        assert_eq!(FieldPath::parse("metadata.labels"), None);
    }
}
