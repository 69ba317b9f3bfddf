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
//! provided; any other type is refused naming the volume. A `medium: Memory` volume's
//! `sizeLimit` must be positive (the kernel reads a tmpfs of size 0 as one without a limit);
//! [`clamp_memory_volume`] sizes its tmpfs on a host.
//!
//! Names are checked as the API server checks them, since they become directories, script
//! words and log names on the daemon's host: `metadata.name` is a DNS-1123 subdomain (a
//! `generateName` prefix too, cut to 58 characters before its five random ones), the namespace,
//! `subdomain` and every container's, init container's and volume's name a DNS-1123 label, and
//! container names are unique across `containers` and `initContainers`. The short form's `name`
//! is a subdomain; one taken from the command is made one (`Train_Model.sh`: `train-model.sh`).
//! A relative `workingDir` is inside the task's directory (made there for a host process;
//! under the root in a container), so a `..` component is refused, as is NUL.
//!
//! A task's start fills in what the manifest only refers to: `$(VAR)` references (which let a
//! small manifest stand for gigabytes) and downward API values. Each is counted at submission
//! without being built, a value known only at start at its longest (a node name of 253 bytes,
//! a pod name of the job's name and 32 more), and a manifest is refused naming the variable or
//! argument that could take one value or argument past [`crate::expand::MAX_EXPANDED`], a
//! container's environment and arguments past [`crate::expand::MAX_EXEC_BYTES`], or all the
//! pod's containers past [`MAX_POD_EXEC_BYTES`]; what is accepted cannot pass them at start.
//!
//! The pod template's `affinity` is read into [`crate::affinity::Affinity`]: required node
//! affinity and pod (anti-)affinity terms, typed, each malformed one refused naming its field;
//! `preferred...` terms are a note (one host has no node to prefer). On one host every node
//! label names the same domain: required anti-affinity that selects the job's own pods over
//! `kubernetes.io/hostname` (which every node has) is refused for a gang, whose tasks must run
//! at once, and makes any other job run a task at a time. What depends on the node's labels and
//! on the other jobs running is for the daemon ([`JobSpec::never_fits`],
//! [`JobSpec::tasks_at_once`], [`crate::affinity::pod_fits`]).
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
use crate::affinity::{Affinity, HOSTNAME_LABEL};
use crate::expand::{MAX_EXEC_BYTES, MAX_EXPANDED, expanded_len};

/// Largest `completions` accepted (the Kubernetes limit for Indexed Jobs).
pub const MAX_COMPLETIONS: u64 = 100_000;
/// Largest `parallelism` accepted (the Kubernetes limit for Indexed Jobs).
pub const MAX_PARALLELISM: u64 = 100_000;
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
    /// `workingDir`: absolute, or relative to the task's directory (a host process) or to the
    /// container's root; never with a `..` component.
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
    /// The pod template's required node and pod (anti-)affinity ([`crate::affinity`]).
    #[serde(default, skip_serializing_if = "Affinity::is_empty")]
    pub affinity: Affinity,
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

    /// Checks a spec parsed before (one a store held from an older xpu) against the rules
    /// [`parse`] applies now to what reaches the host: names, paths, and the environment and
    /// arguments a task's start could build. Fields are named as in a Job (`spec.template.spec`).
    pub fn check(&self) -> Result<(), JobError> {
        let pod_path = match self.source {
            Source::Kubernetes => "spec.template.spec",
            Source::Short => "",
        };
        validate(self, "", pod_path)?;
        let p = Parser {
            prefix: String::new(),
            notes: Vec::new(),
            unsupported: Vec::new(),
            argv_origins: Vec::new(),
        };
        p.check_exec_size(self, pod_path)
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
        let mut p = Parser {
            prefix: prefix.clone(),
            notes: Vec::new(),
            unsupported: Vec::new(),
            argv_origins: Vec::new(),
        };
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
    /// Where each container's argv came from, by the container's path.
    argv_origins: Vec<(String, ArgvOrigin)>,
}

/// Which fields a container's argv items were read from: the first `head` from `command` (or
/// the image's base name, `image` true), the rest from `args`.
#[derive(Debug, Clone, Copy, Default)]
struct ArgvOrigin {
    head: usize,
    image: bool,
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
                    None => generated_name(m)?,
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
        if let Some(ns) = &pod_meta.namespace
            && !is_dns_label(ns)
        {
            return Err(JobError::new(
                root.field("metadata.namespace"),
                format!("{ns:?} {}", not_a_label(ns)),
            ));
        }
        let spec = root.req_obj("spec")?;
        let (pod, completions, parallelism, mode, backoff, deadline) = if is_pod {
            let deadline = spec.uint("activeDeadlineSeconds", 1, i64::MAX as u64)?;
            (spec, 1, 1, CompletionMode::NonIndexed, 0, deadline)
        } else {
            let completions = spec.uint("completions", 1, MAX_COMPLETIONS)?.unwrap_or(1);
            let parallelism = spec.uint("parallelism", 1, MAX_PARALLELISM)?.unwrap_or(1);
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
        if let Some(d) = &subdomain
            && !is_dns_label(d)
        {
            return Err(JobError::new(pod.field("subdomain"), format!("{d:?} {}", not_a_label(d))));
        }
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
        let all: Vec<(String, &Container)> = init_containers
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("{}[{i}]", pod.field("initContainers")), c))
            .chain(std::iter::once((format!("{}[0]", pod.field("containers")), &container)))
            .collect();
        // Names are unique across containers and initContainers (the API server's rule): each
        // names the container's directory and its log.
        let mut seen_names: std::collections::HashSet<&str> = [container.name.as_str()].into();
        for (i, c) in init_containers.iter().enumerate() {
            if !seen_names.insert(&c.name) {
                return Err(JobError::new(
                    format!("{}[{i}].name", pod.field("initContainers")),
                    format!(
                        "container name {:?} is used twice; give each container and init container its own",
                        c.name
                    ),
                ));
            }
        }
        let declared: std::collections::HashSet<&str> =
            volumes.iter().map(|v| v.name.as_str()).collect();
        let refused: std::collections::HashSet<&str> = refused.iter().map(String::as_str).collect();
        for (path, c) in &all {
            for (j, m) in c.volume_mounts.iter().enumerate() {
                let here = format!("{path}.volumeMounts[{j}]");
                if refused.contains(m.name.as_str()) {
                    continue;
                }
                if !declared.contains(m.name.as_str()) {
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
        let affinity = match pod.get("affinity") {
            None => Affinity::default(),
            Some(v) => {
                let read = crate::affinity::read(v, &pod.field("affinity"))?;
                self.notes.extend(read.notes);
                self.unsupported.extend(read.unsupported);
                read.affinity
            }
        };
        let mut spec = JobSpec {
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
            affinity,
        };
        self.own_anti_affinity(&mut spec, &pod.field("affinity"));
        self.refuse_unsupported()?;
        let pod_path = if is_pod { "spec" } else { "spec.template.spec" };
        validate(&spec, &self.prefix, pod_path)?;
        self.check_exec_size(&spec, pod_path)?;
        Ok(spec)
    }

    fn container(
        &mut self,
        c: &Obj<'_>,
        rootfs: Option<String>,
        bundle: Option<String>,
    ) -> Result<Container, JobError> {
        let name = match c.str("name")? {
            Some(n) if is_dns_label(n) => n.to_owned(),
            Some(n) => {
                return Err(JobError::new(c.field("name"), format!("{n:?} {}", not_a_label(n))));
            }
            None => {
                return Err(JobError::new(
                    c.field("name"),
                    "required: a DNS-1123 label such as \"main\" (lower-case letters, digits and '-')",
                ));
            }
        };
        let image = c.str("image")?.map(str::to_owned);
        let command = c.strings("command")?;
        let args = c.strings("args")?.unwrap_or_default();
        let mut origin = ArgvOrigin::default();
        let argv = match (command, rootfs.is_some()) {
            (Some(cmd), _) if !cmd.is_empty() => {
                origin.head = cmd.len();
                cmd.into_iter().chain(args).collect()
            }
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
                    origin = ArgvOrigin { head: 1, image: true };
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
        // Kubernetes takes an empty workingDir as none.
        let working_dir = c.str("workingDir")?.filter(|w| !w.is_empty()).map(str::to_owned);
        self.argv_origins.push((c.path.clone(), origin));
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
        let mut names: std::collections::HashSet<&str> = std::collections::HashSet::new();
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
                    format!("{name:?} {}", not_a_label(name)),
                ));
            }
            if !names.insert(name) {
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
                Some(q) => Some(
                    size_limit(q, memory).map_err(|m| JobError::new(dir.field("sizeLimit"), m))?,
                ),
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
            // The program's base name, made a valid name (`Train_Model.sh`: `train-model.sh`).
            None => argv
                .first()
                .or(bundle.as_ref())
                .map(|a| to_dns_subdomain(a.trim_end_matches('/').rsplit('/').next().unwrap_or(a)))
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
        let parallelism = o.uint("parallelism", 1, MAX_PARALLELISM)?.unwrap_or(completions);
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
                working_dir: o.str("workingDir")?.filter(|w| !w.is_empty()).map(str::to_owned),
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
            affinity: Affinity::default(),
        };
        self.argv_origins.push((
            self.prefix.clone(),
            ArgvOrigin { head: spec.container.argv.len(), image: false },
        ));
        self.refuse_unsupported()?;
        validate(&spec, &self.prefix, "")?;
        self.check_exec_size(&spec, "")?;
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
    let mut paths: std::collections::HashSet<&str> = std::collections::HashSet::new();
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
        if !paths.insert(mount_path) {
            return Err(JobError::new(
                v.field("mountPath"),
                format!("{mount_path} is mounted twice in this container"),
            ));
        }
        if v.get("subPathExpr").is_some() {
            return Err(JobError::new(
                v.field("subPathExpr"),
                "is not supported: xpu does not expand variables in paths; use subPath with the directory's name",
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
    let mut paths: std::collections::HashSet<&str> = std::collections::HashSet::new();
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
        if !paths.insert(file) {
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

/// A DNS-1123 label, as Kubernetes requires of container, volume and namespace names: 1 to 63
/// lower-case letters, digits and '-', starting and ending with a letter or digit.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain, as Kubernetes requires of Job and Pod names: at most 253 characters,
/// dot-separated parts of lower-case letters, digits and '-', each starting and ending with a
/// letter or digit.
pub fn is_dns_subdomain(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    !s.is_empty() && s.len() <= 253 && s.split('.').all(part)
}

/// `s` made a DNS-1123 subdomain as nearly as may be: lower case, other characters a single
/// '-', parts that start and end with a letter or digit; empty when nothing of it is left.
pub fn to_dns_subdomain(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().map(|c| c.to_ascii_lowercase()) {
        let after_alnum = out.ends_with(|p: char| p.is_ascii_alphanumeric());
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if c == '.' && !out.is_empty() {
            if out.ends_with('-') {
                out.pop();
            }
            if out.ends_with(|p: char| p.is_ascii_alphanumeric()) {
                out.push('.');
            }
        } else if after_alnum {
            out.push('-');
        }
    }
    out.truncate(253);
    out.trim_end_matches(['-', '.']).to_owned()
}

/// `s` made a DNS-1123 label as nearly as may be (see [`to_dns_subdomain`]).
fn to_dns_label(s: &str) -> String {
    let mut label = to_dns_subdomain(&s.replace('.', "-")).replace('.', "-");
    label.truncate(63);
    label.trim_end_matches('-').to_owned()
}

/// What a name that is not a DNS label must be, with a valid one to use instead.
fn not_a_label(s: &str) -> String {
    let fix = to_dns_label(s);
    let fix = if fix.is_empty() { "main".to_owned() } else { fix };
    format!(
        "is not a DNS-1123 label: use at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit, such as {fix:?}"
    )
}

/// What a name that is not a DNS subdomain must be, with a valid one to use instead.
fn not_a_subdomain(s: &str) -> String {
    let fix = to_dns_subdomain(s);
    let fix = if fix.is_empty() { "job".to_owned() } else { fix };
    format!(
        "is not a DNS-1123 subdomain: use at most 253 lower-case letters, digits, '-' and '.', each dot-separated part starting and ending with a letter or digit, such as {fix:?}"
    )
}

/// A name from `metadata.generateName`, as the API server makes one: the prefix (a name, but
/// for a trailing '-'), cut to 58 characters, and five random ones.
fn generated_name(meta: &Obj<'_>) -> Result<Option<String>, JobError> {
    let Some(prefix) = meta.str("generateName")? else { return Ok(None) };
    let whole = match prefix.strip_suffix('-') {
        Some(p) => format!("{p}a"),
        None => prefix.to_owned(),
    };
    if !is_dns_subdomain(&whole) {
        return Err(JobError::new(
            meta.field("generateName"),
            format!("{prefix:?} {}", not_a_subdomain(prefix)),
        ));
    }
    // The prefix is ASCII now: any cut is on a character.
    let base = &prefix[..prefix.len().min(MAX_GENERATED_PREFIX)];
    Ok(Some(format!("{base}{}", name_suffix())))
}

/// The longest `generateName` prefix the API server keeps (63 less its five characters).
const MAX_GENERATED_PREFIX: usize = 58;

/// A `workingDir`: a relative one is a directory inside the task's own (a container's, inside
/// its root), so it may not climb out of it.
fn check_working_dir(w: &str, path: String) -> Result<(), JobError> {
    if w.contains('\0') || w.split('/').any(|p| p == "..") {
        return Err(JobError::new(
            path,
            format!(
                "{w:?} may not contain a '..' component or NUL: a relative workingDir is inside the task's directory; give an absolute path to leave it"
            ),
        ));
    }
    Ok(())
}

/// An `emptyDir`'s `sizeLimit` in bytes (rounded up to MiB), or why it is refused.
fn size_limit(q: &Value, memory: bool) -> Result<u64, String> {
    const FIX: &str = "give a positive size such as 64Mi, or leave sizeLimit out for a tmpfs as large as the host's memory";
    let negative = match q {
        Value::Number(n) => n.as_f64().is_some_and(|f| f < 0.0),
        Value::String(s) => s.trim().starts_with('-'),
        _ => false,
    };
    if negative {
        return Err(format!("must not be negative; {FIX}"));
    }
    match memory_mib(q).map(|mib| mib << 20) {
        None => Err("must be a quantity such as 1Gi".to_owned()),
        // The kernel reads a tmpfs of size 0 as one without a limit.
        Some(0) if memory => Err(format!(
            "must be positive for medium: Memory (a tmpfs of size 0 has no limit at all); {FIX}"
        )),
        Some(b) => Ok(b),
    }
}

/// The size of the tmpfs for a `medium: Memory` volume of `sizeLimit` `limit` bytes on a host
/// with `host_memory` bytes of memory, never 0 (the kernel's "no limit"), and a note when it
/// is not what the manifest says. A limit above the host's memory is clamped to it. Without a
/// limit (or with 0, which specs stored before it was refused may hold) the host's memory, as
/// the kubelet sizes one to the node's allocatable memory; with the host's memory unknown (0),
/// the limit, or 64 MiB (a container's `/dev/shm` by default) without one.
pub fn clamp_memory_volume(limit: Option<u64>, host_memory: u64) -> (u64, Option<String>) {
    const UNKNOWN_HOST: u64 = 64 << 20;
    match (limit.filter(|&l| l > 0), host_memory) {
        (Some(l), 0) => (l, None),
        (None, 0) => (
            UNKNOWN_HOST,
            Some("no sizeLimit and the host's memory is unknown: a tmpfs of 64Mi".to_owned()),
        ),
        (Some(l), host) if l > host => (
            host,
            Some(format!(
                "sizeLimit {} is more than the host's {} of memory: a tmpfs of {}",
                bytes_text(l),
                bytes_text(host),
                bytes_text(host)
            )),
        ),
        (Some(l), _) => (l, None),
        (None, host) if limit == Some(0) => (
            host,
            Some(format!("sizeLimit 0 is no limit: a tmpfs of the host's {}", bytes_text(host))),
        ),
        (None, host) => (host, None),
    }
}

/// Bytes as a Kubernetes quantity: the largest binary suffix that divides them.
fn bytes_text(b: u64) -> String {
    for (shift, suffix) in [(60, "Ei"), (50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")]
    {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

/// `field` of the mapping at `base` (`base` empty: the top).
fn sub(base: &str, field: &str) -> String {
    if base.is_empty() { field.to_owned() } else { format!("{base}.{field}") }
}

/// The containers of `spec` with their paths below the pod spec at `pod_path` (empty for the
/// short form, whose one container is the top): the main one, then the init containers.
fn containers<'a>(spec: &'a JobSpec, pod_path: &str) -> Vec<(String, &'a Container)> {
    if spec.source == Source::Short {
        return vec![(String::new(), &spec.container)];
    }
    std::iter::once((sub(pod_path, "containers[0]"), &spec.container))
        .chain(
            spec.init_containers
                .iter()
                .enumerate()
                .map(|(i, c)| (sub(pod_path, &format!("initContainers[{i}]")), c)),
        )
        .collect()
}

/// Checks that hold for both forms. `pod_path` is where the pod spec is (`spec.template.spec`
/// for a Job, `spec` for a Pod, empty for the short form).
fn validate(spec: &JobSpec, prefix: &str, pod_path: &str) -> Result<(), JobError> {
    let name_path = match spec.source {
        Source::Kubernetes => "metadata.name",
        Source::Short => "name",
    };
    if !is_dns_subdomain(&spec.name) {
        return Err(JobError::new(
            join(prefix, name_path),
            format!("{:?} {}", spec.name, not_a_subdomain(&spec.name)),
        ));
    }
    if spec.queue.is_empty() || spec.queue.len() > 63 || spec.queue.chars().any(char::is_control) {
        return Err(JobError::new(join(prefix, "queue"), "must be 1 to 63 printable characters"));
    }
    // Names and paths are checked where they are read too; here again for a spec stored before
    // those checks ([`JobSpec::check`]).
    let mut names: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for (path, c) in containers(spec, pod_path) {
        let at = |field: &str| join(prefix, &sub(&path, field));
        if !is_dns_label(&c.name) {
            return Err(JobError::new(
                at("name"),
                format!("{:?} {}", c.name, not_a_label(&c.name)),
            ));
        }
        if !names.insert(&c.name) {
            return Err(JobError::new(
                at("name"),
                format!(
                    "container name {:?} is used twice; give each container and init container its own",
                    c.name
                ),
            ));
        }
        for (j, m) in c.volume_mounts.iter().enumerate() {
            let bad_mount = !m.mount_path.starts_with('/')
                || m.mount_path.contains('\0')
                || m.mount_path.split('/').any(|p| p == "..");
            let bad_sub = m.sub_path.as_deref().is_some_and(|p| {
                p.starts_with('/') || p.contains('\0') || p.split('/').any(|s| s == "..")
            });
            if bad_mount || bad_sub {
                let field = if bad_mount { "mountPath" } else { "subPath" };
                return Err(JobError::new(
                    at(&format!("volumeMounts[{j}].{field}")),
                    "must be a path without '..' (mountPath absolute, subPath relative)",
                ));
            }
        }
        for (i, e) in c.env.iter().enumerate() {
            // The short form's env is a mapping: the key is the name.
            let (name, value) = if spec.source == Source::Short {
                ("env".to_owned(), format!("env.{}", e.name))
            } else {
                (format!("env[{i}].name"), format!("env[{i}].value"))
            };
            if e.name.is_empty() || e.name.contains('=') || e.name.contains('\0') {
                return Err(JobError::new(
                    at(&name),
                    "must be a non-empty name without '=' or NUL",
                ));
            }
            if e.value.contains('\0') {
                return Err(JobError::new(at(&value), "must not contain NUL"));
            }
        }
        if c.argv.iter().any(|a| a.contains('\0')) {
            return Err(JobError::new(at("command"), "must not contain NUL"));
        }
        if let Some(w) = &c.working_dir {
            check_working_dir(w, at("workingDir"))?;
        }
    }
    let mut volumes: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for (i, v) in spec.volumes.iter().enumerate() {
        let at = join(prefix, &sub(pod_path, &format!("volumes[{i}].name")));
        if !is_dns_label(&v.name) {
            return Err(JobError::new(at, format!("{:?} {}", v.name, not_a_label(&v.name))));
        }
        if !volumes.insert(&v.name) {
            return Err(JobError::new(at, format!("volume {:?} is declared twice", v.name)));
        }
        for f in v.downward_api.iter().flatten() {
            if f.path.is_empty()
                || f.path.starts_with('/')
                || f.path.contains('\0')
                || f.path.split('/').any(|p| p == ".." || p.is_empty())
            {
                return Err(JobError::new(
                    join(prefix, &sub(pod_path, &format!("volumes[{i}].downwardAPI"))),
                    format!(
                        "item path {:?} must be a relative path inside the volume, without '..'",
                        f.path
                    ),
                ));
            }
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

/// Most bytes all of a pod's containers may be started with together: a task's start holds
/// every container's environment and arguments at once, and each may take up to
/// [`MAX_EXEC_BYTES`], so many containers (cheap to write) are bounded together too.
pub const MAX_POD_EXEC_BYTES: usize = 4 * MAX_EXEC_BYTES;

/// Most bytes the files of a pod's `downwardAPI` volumes may hold together (each item may name
/// the whole label or annotation map again).
pub const MAX_DOWNWARD_BYTES: usize = MAX_EXEC_BYTES;

/// The longest values a task can be given that are known only when it starts, as `xpu serve`
/// makes them (`xpu-server::engine::env`): counted at these lengths, a manifest accepted when it
/// is submitted cannot pass [`MAX_EXEC_BYTES`] when a task starts.
mod longest {
    /// A node's name (a Kubernetes name, a subdomain; the daemon's is its host name).
    pub const NODE_NAME: usize = 253;
    /// A host name in `TPU_WORKER_HOSTNAMES` (Linux's `HOST_NAME_MAX`).
    pub const HOST_NAME: usize = 64;
    /// A uid (`8-4-4-4-12` hex digits).
    pub const UID: usize = 36;
    /// An IP address as text (IPv6 with an IPv4 tail).
    pub const IP: usize = 45;
    /// A `u64` in decimal: a job id, a resource's value.
    pub const U64: usize = 20;
    /// A `u32` in decimal: a task index.
    pub const U32: usize = 10;
    /// One device in a device list (`google.com/tpu=4294967295,`).
    pub const DEVICE: usize = 26;
}

/// The longest value of each thing a task's start fills in, for one job.
struct StartLens<'a> {
    spec: &'a JobSpec,
    /// Longest value of each pod label, the Job controller's included.
    labels: BTreeMap<String, usize>,
    annotations: BTreeMap<String, usize>,
    /// Longest `metadata.labels` and `metadata.annotations` files of a downwardAPI volume.
    labels_file: usize,
    annotations_file: usize,
    /// The variables the daemon adds after the manifest's, with their longest values.
    vars: Vec<(&'static str, usize)>,
    /// Bytes of the environment they take (the worker host list aside: the daemon bounds it).
    reserve: usize,
}

impl<'a> StartLens<'a> {
    fn of(spec: &'a JobSpec) -> Self {
        use longest::*;
        let indexed = spec.completion_mode == CompletionMode::Indexed;
        // Each value's length, and its length as a downwardAPI file writes it (`{v:?}`).
        let mut labels: BTreeMap<String, (usize, usize)> = spec
            .pod
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), (v.len(), format!("{v:?}").len())))
            .collect();
        let mut annotations: BTreeMap<String, (usize, usize)> = spec
            .pod
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), (v.len(), format!("{v:?}").len())))
            .collect();
        let set = |m: &mut BTreeMap<String, (usize, usize)>, k: &str, n: usize| {
            let e = m.entry(k.to_owned()).or_insert((0, 0));
            // What the daemon sets is plain: quoting adds the two quotes.
            *e = (e.0.max(n), e.1.max(n + 2));
        };
        if spec.source == Source::Kubernetes {
            for k in ["batch.kubernetes.io/job-name", "job-name"] {
                set(&mut labels, k, spec.name.len());
            }
            for k in ["batch.kubernetes.io/controller-uid", "controller-uid"] {
                set(&mut labels, k, UID);
            }
        }
        if indexed {
            set(&mut labels, crate::affinity::COMPLETION_INDEX_LABEL, U32);
            set(&mut annotations, crate::affinity::COMPLETION_INDEX_LABEL, U32);
        }
        let file = |m: &BTreeMap<String, (usize, usize)>| {
            m.iter().fold(0usize, |n, (k, (_, q))| n.saturating_add(k.len() + q + 2))
        };
        let devices: usize =
            spec.container.resources.devices.iter().map(|d| d.count as usize).sum();
        let list = (devices * DEVICE).max(4);
        let mut vars = vec![
            ("NVIDIA_VISIBLE_DEVICES", list),
            ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".len()),
            ("CUDA_VISIBLE_DEVICES", list),
            ("HIP_VISIBLE_DEVICES", list),
            ("ROCR_VISIBLE_DEVICES", list),
            ("TPU_VISIBLE_CHIPS", list),
            ("HABANA_VISIBLE_DEVICES", list),
            ("XPU_VISIBLE_DEVICES", list),
            ("XPU_JOB_ID", U64),
            ("XPU_JOB_NAME", spec.name.len()),
            ("XPU_TASK_INDEX", U32),
            ("XPU_GPU_MILLI", 3),
        ];
        if indexed {
            vars.extend([("JOB_COMPLETION_INDEX", U32), ("TPU_WORKER_ID", U32)]);
        }
        let reserve = vars.iter().map(|(k, n)| k.len() + n + 2).sum();
        if indexed {
            let hosts = (spec.completions as usize).saturating_mul(HOST_NAME + 1);
            vars.push(("TPU_WORKER_HOSTNAMES", hosts));
        }
        StartLens {
            spec,
            labels_file: file(&labels),
            annotations_file: file(&annotations),
            labels: labels.into_iter().map(|(k, (n, _))| (k, n)).collect(),
            annotations: annotations.into_iter().map(|(k, (n, _))| (k, n)).collect(),
            vars,
            reserve,
        }
    }

    /// The longest value `from` can resolve to.
    fn value_len(&self, from: &EnvFrom) -> usize {
        use longest::*;
        let spec = self.spec;
        match from {
            // `<job>-<id>-<index>`.
            EnvFrom::Field(FieldPath::Name) => spec.name.len() + 2 + U64 + U32,
            EnvFrom::Field(FieldPath::Namespace) => spec.pod_namespace().len(),
            EnvFrom::Field(FieldPath::Uid) => UID,
            EnvFrom::Field(FieldPath::Label(k)) => self.labels.get(k).copied().unwrap_or(0),
            EnvFrom::Field(FieldPath::Annotation(k)) => {
                self.annotations.get(k).copied().unwrap_or(0)
            }
            EnvFrom::Field(FieldPath::NodeName) => NODE_NAME,
            EnvFrom::Field(FieldPath::ServiceAccountName) => {
                spec.pod.service_account.as_deref().unwrap_or("default").len()
            }
            EnvFrom::Field(FieldPath::HostIp | FieldPath::PodIp) => IP,
            EnvFrom::Field(FieldPath::Labels) => self.labels_file,
            EnvFrom::Field(FieldPath::Annotations) => self.annotations_file,
            EnvFrom::Resource { .. } => U64,
        }
    }
}

impl Parser {
    /// A required anti-affinity term that selects the job's own pods over
    /// `kubernetes.io/hostname`, which every node has: on one host they can never share it. A
    /// gang (its tasks must run at once) is refused; other jobs run a task at a time.
    fn own_anti_affinity(&mut self, spec: &mut JobSpec, affinity_path: &str) {
        let host: BTreeMap<String, String> = [(HOSTNAME_LABEL.to_owned(), String::new())].into();
        let Some(i) = spec.self_anti_affinity(&host) else { return };
        let path = format!(
            "{affinity_path}.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[{i}]"
        );
        if spec.is_gang() {
            self.unsupported.push(JobError::new(
                path,
                format!(
                    "selects the job's own pods over {HOSTNAME_LABEL}: its {} tasks must run at once but may not share a node, and xpu runs them all on one host; drop the term, or make its labelSelector not match the job's pods",
                    spec.completions
                ),
            ));
        } else if spec.effective_parallelism() > 1 {
            spec.parallelism = 1;
            self.notes.push(format!(
                "{path}: the job's pods may not share a node and xpu runs them all on one host, so they run one at a time (parallelism 1)"
            ));
        }
    }

    /// Refuses a job whose start could build more environment and arguments than a process may
    /// be given: every `$(VAR)` counted at its expanded length and every value known only at
    /// start at its longest ([`StartLens`]), without building any of it, stopping at the first
    /// variable or argument that passes a limit.
    fn check_exec_size(&self, spec: &JobSpec, pod_path: &str) -> Result<(), JobError> {
        let start = StartLens::of(spec);
        let mut pod_total = 0usize;
        for (k, (path, c)) in containers(spec, pod_path).into_iter().enumerate() {
            let full =
                if path.is_empty() { self.prefix.clone() } else { join(&self.prefix, &path) };
            // Recorded in the same order: the main container, then the init containers.
            let origin = match self.argv_origins.get(k) {
                Some((p, o)) if *p == full => *o,
                _ => ArgvOrigin::default(),
            };
            pod_total =
                pod_total.saturating_add(container_exec_size(spec, &start, &full, c, origin)?);
            if pod_total > MAX_POD_EXEC_BYTES {
                return Err(JobError::new(
                    full,
                    format!(
                        "with the containers before it, the pod's environments and arguments could take more than {} MiB when a task starts; use fewer containers or smaller values",
                        MAX_POD_EXEC_BYTES >> 20
                    ),
                ));
            }
        }
        let mut files = 0usize;
        for (vi, v) in spec.volumes.iter().enumerate() {
            for (fi, f) in v.downward_api.iter().flatten().enumerate() {
                files = files.saturating_add(start.value_len(&f.from));
                if files > MAX_DOWNWARD_BYTES {
                    return Err(JobError::new(
                        join(
                            &self.prefix,
                            &sub(pod_path, &format!("volumes[{vi}].downwardAPI.items[{fi}]")),
                        ),
                        format!(
                            "with the items before it, the pod's downwardAPI files could hold more than {} MiB; list fewer",
                            MAX_DOWNWARD_BYTES >> 20
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The most bytes container `c` (at path `at`) can be started with, or the variable or
/// argument that could take it past a limit.
fn container_exec_size(
    spec: &JobSpec,
    start: &StartLens<'_>,
    at: &str,
    c: &Container,
    origin: ArgvOrigin,
) -> Result<usize, JobError> {
    let kubernetes = spec.source == Source::Kubernetes;
    const TOTAL: &str = "the most a process can be given (each $(VAR) counted at its expanded length, values known only at start at their longest); remove references or move the data into a file the job reads";
    let too_long = |what: String, n: usize| {
        format!(
            "{what} expands to up to {n} bytes (each $(VAR) counted at its expanded length, values known only at start at their longest), over the {} KiB the kernel allows one variable or argument",
            MAX_EXPANDED >> 10
        )
    };
    // The daemon's own variables go in after the manifest's; they are counted first so that
    // whatever the manifest leaves room for is really there.
    let mut used = start.reserve;
    let mut lens: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, e) in c.env.iter().enumerate() {
        let (path, len) = match &e.from {
            Some(from) => (sub(at, &format!("env[{i}].valueFrom")), start.value_len(from)),
            None if kubernetes => (
                sub(at, &format!("env[{i}].value")),
                expanded_len(&e.value, &|n| lens.get(n).copied()),
            ),
            None => (sub(at, &format!("env.{}", e.name)), e.value.len()),
        };
        if kubernetes && len > MAX_EXPANDED {
            return Err(JobError::new(path, too_long(format!("variable {}", e.name), len)));
        }
        used = used.saturating_add(e.name.len()).saturating_add(len).saturating_add(2);
        if used > MAX_EXEC_BYTES {
            return Err(JobError::new(
                path,
                format!(
                    "variable {} brings the container's environment and arguments to more than {} MiB, {TOTAL}",
                    e.name,
                    MAX_EXEC_BYTES >> 20
                ),
            ));
        }
        lens.insert(&e.name, len);
    }
    // Arguments see every variable, the daemon's over the manifest's.
    for (k, n) in &start.vars {
        let e = lens.entry(k).or_insert(0);
        *e = (*e).max(*n);
    }
    for (j, a) in c.argv.iter().enumerate() {
        let field = match (j < origin.head, origin.image) {
            (true, true) => "image".to_owned(),
            (true, false) => format!("command[{j}]"),
            (false, _) => format!("args[{}]", j - origin.head),
        };
        let path = sub(at, &field);
        let len = if kubernetes { expanded_len(a, &|n| lens.get(n).copied()) } else { a.len() };
        if kubernetes && len > MAX_EXPANDED {
            return Err(JobError::new(path, too_long("the argument".to_owned(), len)));
        }
        used = used.saturating_add(len).saturating_add(1);
        if used > MAX_EXEC_BYTES {
            return Err(JobError::new(
                path,
                format!(
                    "the argument brings the container's environment and arguments to more than {} MiB, {TOTAL}",
                    MAX_EXEC_BYTES >> 20
                ),
            ));
        }
    }
    Ok(used)
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
            (
                "name: proxy",
                "name: worker",
                "spec.template.spec.initContainers[1].name",
                "used twice",
            ),
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

    /// A Job of `tasks` Indexed tasks (a gang when `tasks` > 1) whose pod spec is `pod` with
    /// `containers` set to one container with these fields (`name` and `command` defaulted).
    fn job_json(tasks: u32, pod: Value, container: Value) -> String {
        let mut c = serde_json::json!({"name": "main", "command": ["true"]});
        for (k, v) in container.as_object().cloned().unwrap_or_default() {
            c[k] = v;
        }
        let mut spec = serde_json::json!({"restartPolicy": "Never", "containers": [c]});
        for (k, v) in pod.as_object().cloned().unwrap_or_default() {
            spec[k] = v;
        }
        serde_json::json!({
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "train"},
            "spec": {
                "completions": tasks,
                "parallelism": tasks,
                "completionMode": "Indexed",
                "template": {"metadata": {"labels": {"app": "train"}}, "spec": spec}
            }
        })
        .to_string()
    }

    #[test]
    fn container_names_are_dns_labels_unique_in_the_pod() {
        let init = |name: &str| {
            job_json(
                1,
                serde_json::json!({"initContainers": [
                    {"name": "fetch", "command": ["true"]},
                    {"name": name, "command": ["true"]},
                ]}),
                serde_json::json!({}),
            )
        };
        let long = "a".repeat(64);
        for bad in [
            "setup\ntouch /tmp/x\n#",
            "x/../../../..../tmp/out",
            "Setup",
            "-a",
            "a-",
            &long,
            "a.b",
            "",
        ] {
            let e = parse(&init(bad)).unwrap_err();
            assert_eq!(e.path, "spec.template.spec.initContainers[1].name", "{bad:?}: {e}");
            assert!(e.message.contains("DNS-1123 label"), "{bad:?}: {e}");
        }
        // A sidecar is an init container too; the main container and a Pod's are checked alike.
        let sidecar = job_json(
            1,
            serde_json::json!({"initContainers": [{"name": "log/../x", "restartPolicy": "Always", "command": ["true"]}]}),
            serde_json::json!({}),
        );
        assert_eq!(parse(&sidecar).unwrap_err().path, "spec.template.spec.initContainers[0].name");
        let main =
            job_json(1, serde_json::json!({}), serde_json::json!({"name": "Main Container"}));
        let e = parse(&main).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.containers[0].name");
        assert!(e.message.contains("\"main-container\""), "suggests a valid name: {e}");
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  restartPolicy: Never\n  initContainers: [{name: \"a;b\", command: [\"true\"]}]\n  containers: [{name: c, command: [\"true\"]}]\n";
        assert_eq!(parse(pod).unwrap_err().path, "spec.initContainers[0].name");
        let unnamed = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  restartPolicy: Never\n  containers: [{command: [\"true\"]}]\n";
        assert_eq!(parse(unnamed).unwrap_err().path, "spec.containers[0].name");
        // Unique across containers and initContainers, named at the second use.
        let e = parse(&init("main")).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.initContainers[1].name", "{e}");
        assert!(e.message.contains("used twice"), "{e}");
        let e = parse(&init("fetch")).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.initContainers[1].name", "{e}");
        assert!(parse(&init("fetch-2")).is_ok());
    }

    #[test]
    fn volume_names_are_dns_labels_and_unique() {
        let vols = |a: &str, b: &str| {
            job_json(
                1,
                serde_json::json!({"volumes": [{"name": a, "emptyDir": {}}, {"name": b, "emptyDir": {}}]}),
                serde_json::json!({}),
            )
        };
        for bad in ["../../etc", "Data", "a/b", "a\nb"] {
            let e = parse(&vols("ok", bad)).unwrap_err();
            assert_eq!(e.path, "spec.template.spec.volumes[1].name", "{bad:?}: {e}");
        }
        let e = parse(&vols("data", "data")).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.volumes[1].name");
        // A mount names a declared volume; a subPath stays inside it.
        let mount = |m: Value| {
            job_json(
                1,
                serde_json::json!({"volumes": [{"name": "data", "emptyDir": {}}]}),
                serde_json::json!({"volumeMounts": [m]}),
            )
        };
        let e = parse(&mount(serde_json::json!({"name": "other", "mountPath": "/d"}))).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.containers[0].volumeMounts[0].name");
        for sub in ["../x", "a/../../x", "/abs", "a\u{0}b", ".."] {
            let e = parse(&mount(
                serde_json::json!({"name": "data", "mountPath": "/d", "subPath": sub}),
            ))
            .unwrap_err();
            assert_eq!(
                e.path, "spec.template.spec.containers[0].volumeMounts[0].subPath",
                "{sub:?}"
            );
        }
        let e = parse(&mount(
            serde_json::json!({"name": "data", "mountPath": "/d", "subPathExpr": "$(POD)"}),
        ))
        .unwrap_err();
        assert_eq!(e.path, "spec.template.spec.containers[0].volumeMounts[0].subPathExpr", "{e}");
    }

    #[test]
    fn job_and_pod_names_are_dns_subdomains() {
        let named = |meta: &str| {
            format!(
                "apiVersion: batch/v1\nkind: Job\nmetadata: {{{meta}}}\nspec:\n  template:\n    spec:\n      restartPolicy: Never\n      containers: [{{name: c, command: [\"true\"]}}]\n"
            )
        };
        let long = format!("name: {}", "a".repeat(254));
        for bad in [
            "name: \"a/../b\"",
            "name: Train",
            "name: \"a..b\"",
            "name: \"-a\"",
            "name: \"a\\nb\"",
            &long,
        ] {
            let e = parse(&named(bad)).unwrap_err();
            assert_eq!(e.path, "metadata.name", "{bad}: {e}");
            assert!(e.message.contains("DNS-1123 subdomain"), "{bad}: {e}");
        }
        assert_eq!(parse(&named("name: train.v2-a")).unwrap().spec.name, "train.v2-a");
        let e = parse(&named("generateName: \"../x-\"")).unwrap_err();
        assert_eq!(e.path, "metadata.generateName", "{e}");
        // As the API server does: a long prefix is cut to 58 characters before the suffix.
        let long = parse(&named(&format!("generateName: {}-", "a".repeat(80)))).unwrap().spec.name;
        assert_eq!(long.len(), 63, "{long}");
        assert!(
            long.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
            "{long}"
        );
        let e = parse(&named("namespace: \"a/b\", name: x")).unwrap_err();
        assert_eq!(e.path, "metadata.namespace", "{e}");
        // xpu's short form: a name given is checked; one taken from the command is made valid.
        let e = parse("name: \"a/b\"\ncommand: [x]\n").unwrap_err();
        assert_eq!(e.path, "name");
        let s = parse("command: [./Train_Model.sh]\n").unwrap().spec;
        assert_eq!(s.name, "train-model.sh");
        let s = parse("command: [\"__\"]\n").unwrap().spec;
        assert_eq!(s.name, "job");
    }

    #[test]
    fn working_dir_may_not_climb_out_of_the_task_directory() {
        for bad in ["..", "../x", "a/../../b", "/data/../etc", "a\u{0}b"] {
            let j = job_json(1, serde_json::json!({}), serde_json::json!({"workingDir": bad}));
            let e = parse(&j).unwrap_err();
            assert_eq!(e.path, "spec.template.spec.containers[0].workingDir", "{bad:?}: {e}");
            let j = job_json(
                1,
                serde_json::json!({"initContainers": [{"name": "i", "command": ["true"], "workingDir": bad}]}),
                serde_json::json!({}),
            );
            let e = parse(&j).unwrap_err();
            assert_eq!(e.path, "spec.template.spec.initContainers[0].workingDir", "{bad:?}: {e}");
            let e = parse(&format!("command: [x]\nworkingDir: {bad:?}\n")).unwrap_err();
            assert_eq!(e.path, "workingDir", "{bad:?}: {e}");
        }
        for good in ["work", "work/dir", "/data", "./out", "a..b"] {
            let j = job_json(1, serde_json::json!({}), serde_json::json!({"workingDir": good}));
            assert_eq!(parse(&j).unwrap().spec.container.working_dir.as_deref(), Some(good));
        }
    }

    /// The issue's fan-out: `A` of 64 KiB, `B=$(A)$(A)` (128 KiB, at the per-value cap), then
    /// thousands of `B=$(B)`: each value under the cap, gigabytes together.
    fn fan_out_env(copies: usize) -> Value {
        let mut env = vec![
            serde_json::json!({"name": "A", "value": "a".repeat(64 << 10)}),
            serde_json::json!({"name": "B", "value": "$(A)$(A)"}),
        ];
        env.extend((0..copies).map(|_| serde_json::json!({"name": "B", "value": "$(B)"})));
        Value::Array(env)
    }

    #[test]
    fn variable_fan_out_is_refused_at_submit() {
        let j = job_json(1, serde_json::json!({}), serde_json::json!({"env": fan_out_env(5000)}));
        assert!(j.len() < 256 << 10, "a small manifest: {}", j.len());
        let e = parse(&j).unwrap_err();
        assert!(e.path.starts_with("spec.template.spec.containers[0].env["), "{e}");
        assert!(e.path.ends_with("].value"), "{e}");
        assert!(e.message.contains("B") && e.message.contains("2 MiB"), "{e}");
        // The same through arguments, an init container, and a downward API seed.
        let mut env = fan_out_env(0);
        env.as_array_mut().unwrap().truncate(2);
        let args: Vec<String> = (0..5000).map(|_| "$(B)".to_owned()).collect();
        let j = job_json(1, serde_json::json!({}), serde_json::json!({"env": env, "args": args}));
        let e = parse(&j).unwrap_err();
        assert!(e.path.starts_with("spec.template.spec.containers[0].args["), "{e}");
        let j = job_json(
            1,
            serde_json::json!({"initContainers": [{"name": "i", "command": ["true"], "env": fan_out_env(5000)}]}),
            serde_json::json!({}),
        );
        let e = parse(&j).unwrap_err();
        assert!(e.path.starts_with("spec.template.spec.initContainers[0].env["), "{e}");
        let mut seeded = serde_json::from_str::<Value>(&job_json(
            1,
            serde_json::json!({}),
            serde_json::json!({"env": [
                {"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['big']"}}},
            ]}),
        ))
        .unwrap();
        let mut env = fan_out_env(5000);
        env.as_array_mut().unwrap()[0] =
            seeded["spec"]["template"]["spec"]["containers"][0]["env"][0].clone();
        seeded["spec"]["template"]["spec"]["containers"][0]["env"] = env;
        seeded["spec"]["template"]["metadata"]["annotations"] =
            serde_json::json!({"big": "a".repeat(64 << 10)});
        let e = parse(&seeded.to_string()).unwrap_err();
        assert!(e.path.starts_with("spec.template.spec.containers[0].env["), "{e}");
        // Many containers, each under the limit, are bounded together too.
        let inits: Vec<Value> = (0..200)
            .map(|i| serde_json::json!({"name": format!("i{i}"), "command": ["true"], "env": fan_out_env(12)}))
            .collect();
        let j = job_json(1, serde_json::json!({"initContainers": inits}), serde_json::json!({}));
        let e = parse(&j).unwrap_err();
        assert!(e.path.starts_with("spec.template.spec.initContainers["), "{e}");
        // A modest use is accepted.
        let j = job_json(1, serde_json::json!({}), serde_json::json!({"env": fan_out_env(4)}));
        assert!(parse(&j).is_ok());
    }

    #[test]
    fn values_known_only_at_start_count_at_their_longest() {
        // The pod's name is the job's name, its id and the index: up to 253 + 32 bytes. Eight
        // doublings of it stay under 128 KiB only if it is short.
        let mut env = vec![
            serde_json::json!({"name": "P0", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
        ];
        for i in 1..=9 {
            env.push(serde_json::json!({"name": format!("P{i}"), "value": format!("$(P{p})$(P{p})", p = i - 1)}));
        }
        let j = job_json(1, serde_json::json!({}), serde_json::json!({"env": env}));
        let long_name =
            j.replace("\"name\":\"train\"", &format!("\"name\":\"{}\"", "t".repeat(250)));
        assert!(parse(&j).is_ok(), "a short name fits");
        let e = parse(&long_name).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.containers[0].env[9].value", "{e}");
        // The node's name is not known until start: counted at its longest.
        let mut env = vec![
            serde_json::json!({"name": "N0", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}),
        ];
        for i in 1..=10 {
            env.push(serde_json::json!({"name": format!("N{i}"), "value": format!("$(N{p})$(N{p})", p = i - 1)}));
        }
        let j = job_json(1, serde_json::json!({}), serde_json::json!({"env": env}));
        let e = parse(&j).unwrap_err();
        assert_eq!(e.path, "spec.template.spec.containers[0].env[10].value", "{e}");
    }

    #[test]
    fn memory_volume_size_limit_must_be_positive() {
        for limit in [
            serde_json::json!("0"),
            serde_json::json!(0),
            serde_json::json!("0Mi"),
            serde_json::json!("-1Gi"),
            serde_json::json!("-5"),
        ] {
            let j = job_json(
                1,
                serde_json::json!({"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": limit}}]}),
                serde_json::json!({}),
            );
            let e = parse(&j).unwrap_err();
            assert_eq!(e.path, "spec.template.spec.volumes[0].emptyDir.sizeLimit", "{limit}: {e}");
            assert!(e.message.contains("positive"), "{limit}: {e}");
        }
        let j = job_json(
            1,
            serde_json::json!({"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "800Pi"}}]}),
            serde_json::json!({}),
        );
        assert_eq!(parse(&j).unwrap().spec.volumes[0].size_limit, Some(800 << 50));
    }

    #[test]
    fn pod_anti_affinity_to_its_own_gang_is_refused() {
        let anti = |selector: Value, key: &str| {
            serde_json::json!({"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": selector, "topologyKey": key}
            ]}}})
        };
        let path = "spec.template.spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]";
        for selector in [
            serde_json::json!({"matchLabels": {"app": "train"}}),
            serde_json::json!({"matchExpressions": [{"key": "job-name", "operator": "In", "values": ["train"]}]}),
            serde_json::json!({"matchExpressions": [{"key": "batch.kubernetes.io/job-completion-index", "operator": "In", "values": ["1"]}]}),
            serde_json::json!({}),
        ] {
            let e = parse(&job_json(
                4,
                anti(selector.clone(), "kubernetes.io/hostname"),
                serde_json::json!({}),
            ))
            .unwrap_err();
            assert_eq!(e.path, path, "{selector}: {e}");
            assert!(e.message.contains("4 tasks"), "{e}");
        }
        // Not its own pods, or one task: accepted.
        let other =
            anti(serde_json::json!({"matchLabels": {"app": "db"}}), "kubernetes.io/hostname");
        assert!(parse(&job_json(4, other, serde_json::json!({}))).is_ok());
        let own =
            anti(serde_json::json!({"matchLabels": {"app": "train"}}), "kubernetes.io/hostname");
        assert!(parse(&job_json(1, own, serde_json::json!({}))).is_ok());
        // Bad terms name their field, as the API server does.
        let bad = anti(
            serde_json::json!({"matchExpressions": [{"key": "app", "operator": "Near", "values": ["x"]}]}),
            "kubernetes.io/hostname",
        );
        let e = parse(&job_json(1, bad, serde_json::json!({}))).unwrap_err();
        assert_eq!(e.path, format!("{path}.labelSelector.matchExpressions[0].operator"), "{e}");
        let e = parse(&job_json(1, anti(serde_json::json!({}), ""), serde_json::json!({})))
            .unwrap_err();
        assert_eq!(e.path, format!("{path}.topologyKey"), "{e}");
    }

    #[test]
    fn node_affinity_and_preferences_are_not_dropped_silently() {
        let node = |term: Value| serde_json::json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}});
        let bad = node(
            serde_json::json!({"matchExpressions": [{"key": "gpu", "operator": "Gt", "values": ["a"]}]}),
        );
        let e = parse(&job_json(1, bad, serde_json::json!({}))).unwrap_err();
        assert_eq!(
            e.path,
            "spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].values",
            "{e}"
        );
        let preferred = serde_json::json!({"affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "kubernetes.io/hostname"}}
        ]}}});
        let p = parse(&job_json(1, preferred, serde_json::json!({}))).unwrap();
        assert!(
            p.notes.iter().any(|n| n.starts_with("spec.template.spec.affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution")),
            "{:?}",
            p.notes
        );
    }

    #[test]
    fn memory_volumes_are_clamped_to_the_host() {
        let host = 64 << 30;
        assert_eq!(clamp_memory_volume(Some(1 << 30), host), (1 << 30, None));
        let (size, note) = clamp_memory_volume(Some(800 << 50), host);
        assert_eq!(size, host);
        assert_eq!(
            note.as_deref(),
            Some("sizeLimit 800Pi is more than the host's 64Gi of memory: a tmpfs of 64Gi")
        );
        assert_eq!(clamp_memory_volume(None, host), (host, None));
        // Specs stored before 0 was refused: never a tmpfs of size 0 (no limit at all).
        let (size, note) = clamp_memory_volume(Some(0), host);
        assert_eq!(size, host);
        assert!(note.unwrap().contains("sizeLimit 0"));
        assert_eq!(clamp_memory_volume(Some(5 << 20), 0), (5 << 20, None));
        assert_eq!(clamp_memory_volume(None, 0).0, 64 << 20);
    }

    /// GKE's multi-host TPU pattern: the slice's pods attract each other over the node pool
    /// and keep other jobs' pods out of it.
    const GKE_TPU_AFFINITY: &str = r#"
apiVersion: batch/v1
kind: Job
metadata:
  name: tpu-job-podslice
spec:
  backoffLimit: 0
  completions: 4
  parallelism: 4
  completionMode: Indexed
  template:
    spec:
      restartPolicy: Never
      affinity:
        podAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
          - labelSelector:
              matchExpressions:
              - key: job-name
                operator: In
                values:
                - tpu-job-podslice
            topologyKey: cloud.google.com/gke-nodepool
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
          - labelSelector:
              matchExpressions:
              - key: job-name
                operator: NotIn
                values:
                - tpu-job-podslice
            topologyKey: cloud.google.com/gke-nodepool
            namespaceSelector:
              matchExpressions:
              - key: kubernetes.io/metadata.name
                operator: NotIn
                values:
                - kube-system
      nodeSelector:
        cloud.google.com/gke-tpu-accelerator: tpu-v5p-slice
        cloud.google.com/gke-tpu-topology: 2x2x4
      containers:
      - name: tpu-job
        image: python:3.10
        command: [python, -c, "print(1)"]
        resources:
          limits:
            google.com/tpu: 4
"#;

    #[test]
    fn gke_tpu_affinity_is_typed_and_decided_against_the_node() {
        let p = parse(GKE_TPU_AFFINITY).unwrap();
        let s = &p.spec;
        assert!(p.notes.is_empty(), "{:?}", p.notes);
        assert_eq!(s.parallelism, 4, "its anti-affinity is for other jobs");
        let a = &s.affinity;
        assert_eq!((a.pod_affinity.len(), a.pod_anti_affinity.len()), (1, 1));
        assert_eq!(a.pod_anti_affinity[0].topology_key, "cloud.google.com/gke-nodepool");
        let back: JobSpec = serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap();
        assert_eq!(&back, s, "the store keeps the terms");
        // A host without the node pool label is no domain: the affinity can never hold there.
        let mut labels: BTreeMap<String, String> = [
            ("kubernetes.io/hostname".to_owned(), "tpu-0".to_owned()),
            ("cloud.google.com/gke-tpu-accelerator".to_owned(), "tpu-v5p-slice".to_owned()),
        ]
        .into();
        let why = s.never_fits("tpu-0", &labels).unwrap();
        assert!(
            why.starts_with(
                "affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
            ),
            "{why}"
        );
        assert!(why.contains("cloud.google.com/gke-nodepool"), "{why}");
        labels.insert("cloud.google.com/gke-nodepool".into(), "pool-1".into());
        assert_eq!(s.never_fits("tpu-0", &labels), None);
        assert_eq!(s.tasks_at_once(&labels), 4);
        // Its pods start beside each other, not beside another job's.
        let uid = "00000001-0000-4000-8000-000000000000";
        let mine: Vec<_> = (0..2).map(|i| s.pod_labels(i, uid)).collect();
        let pod =
            |l| crate::affinity::PodRef { namespace: "default", labels: l, affinity: &s.affinity };
        assert!(crate::affinity::pod_fits(&labels, &pod(&mine[1]), &[pod(&mine[0])]).is_ok());
        let other = parse("apiVersion: v1\nkind: Pod\nmetadata: {name: other}\nspec:\n  restartPolicy: Never\n  containers: [{name: c, command: [\"true\"]}]\n").unwrap().spec;
        let other_labels = other.pod_labels(0, "u");
        let running = crate::affinity::PodRef {
            namespace: "default",
            labels: &other_labels,
            affinity: &other.affinity,
        };
        let e = crate::affinity::pod_fits(&labels, &pod(&mine[0]), &[running]).unwrap_err();
        assert!(e.contains("didn't match pod anti-affinity rules"), "{e}");
    }

    #[test]
    fn required_node_affinity_is_kept_and_matched_against_the_node() {
        let job = GKE_TPU_AFFINITY.replace(
            "      affinity:\n",
            "      affinity:\n        nodeAffinity:\n          requiredDuringSchedulingIgnoredDuringExecution:\n            nodeSelectorTerms:\n            - matchExpressions:\n              - {key: xpu.dev/gpu.count, operator: Gt, values: [\"3\"]}\n            - matchFields:\n              - {key: metadata.name, operator: In, values: [host-b]}\n          preferredDuringSchedulingIgnoredDuringExecution:\n          - {weight: 1, preference: {matchExpressions: [{key: a, operator: Exists}]}}\n",
        );
        let p = parse(&job).unwrap();
        assert_eq!(p.notes.len(), 1, "the preference is a note: {:?}", p.notes);
        let s = p.spec;
        assert_eq!(s.affinity.node.len(), 2);
        let mut labels: BTreeMap<String, String> =
            [("cloud.google.com/gke-nodepool".to_owned(), "p".to_owned())].into();
        let why = s.never_fits("host-a", &labels).unwrap();
        assert!(
            why.starts_with("affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"),
            "{why}"
        );
        assert_eq!(s.never_fits("host-b", &labels), None, "the second term");
        labels.insert("xpu.dev/gpu.count".into(), "8".into());
        assert_eq!(s.never_fits("host-a", &labels), None, "the first term");
        for (from, to, field) in [
            ("operator: Gt", "operator: Near", "nodeSelectorTerms[0].matchExpressions[0].operator"),
            ("key: metadata.name", "key: metadata.uid", "nodeSelectorTerms[1].matchFields[0].key"),
            ("values: [host-b]", "values: [a, b]", "nodeSelectorTerms[1].matchFields[0]"),
            ("values: [host-b]", "values: []", "nodeSelectorTerms[1].matchFields[0].values"),
        ] {
            let e = parse(&job.replace(from, to)).unwrap_err();
            assert!(e.path.ends_with(field), "{from}: {e}");
        }
        let none = job.replace(
            "            nodeSelectorTerms:\n            - matchExpressions:\n              - {key: xpu.dev/gpu.count, operator: Gt, values: [\"3\"]}\n            - matchFields:\n              - {key: metadata.name, operator: In, values: [host-b]}\n",
            "            nodeSelectorTerms: []\n",
        );
        assert!(parse(&none).unwrap_err().path.ends_with("nodeSelectorTerms"));
    }

    #[test]
    fn own_anti_affinity_runs_a_job_that_is_not_a_gang_a_task_at_a_time() {
        let job = |parallelism: u32, key: &str| {
            format!(
                "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: spread}}\nspec:\n  completions: 4\n  parallelism: {parallelism}\n  template:\n    metadata: {{labels: {{app: spread}}}}\n    spec:\n      restartPolicy: Never\n      affinity:\n        podAntiAffinity:\n          requiredDuringSchedulingIgnoredDuringExecution:\n          - {{labelSelector: {{matchLabels: {{app: spread}}}}, topologyKey: {key}}}\n      containers: [{{name: c, command: [\"true\"]}}]\n"
            )
        };
        let p = parse(&job(2, "kubernetes.io/hostname")).unwrap();
        assert_eq!(p.spec.parallelism, 1);
        assert!(p.notes.iter().any(|n| n.contains("one at a time")), "{:?}", p.notes);
        // Another key: decided by the node's labels.
        let s = parse(&job(2, "topology.kubernetes.io/zone")).unwrap().spec;
        assert_eq!(s.parallelism, 2);
        let zone: BTreeMap<String, String> =
            [("topology.kubernetes.io/zone".to_owned(), "z".to_owned())].into();
        assert_eq!(s.tasks_at_once(&zone), 1);
        assert_eq!(s.tasks_at_once(&BTreeMap::new()), 2);
        // matchLabelKeys cannot be honoured: refused naming it.
        let keys = job(2, "kubernetes.io/hostname").replace(
            "topologyKey: kubernetes.io/hostname}",
            "topologyKey: kubernetes.io/hostname, matchLabelKeys: [pod-template-hash]}",
        );
        let e = parse(&keys).unwrap_err();
        assert!(
            e.path.ends_with("requiredDuringSchedulingIgnoredDuringExecution[0].matchLabelKeys"),
            "{e}"
        );
    }

    #[test]
    fn a_stored_spec_is_checked_again() {
        let mut s = parse(INDEXED_INIT).unwrap().spec;
        assert_eq!(s.check(), Ok(()));
        s.init_containers[0].name = "x/../../../..../tmp/out".into();
        assert_eq!(s.check().unwrap_err().path, "spec.template.spec.initContainers[0].name");
        s.init_containers[0].name = "worker".into();
        assert!(s.check().unwrap_err().message.contains("used twice"));
        s.init_containers[0].name = "input".into();
        s.container.working_dir = Some("../../x".into());
        assert_eq!(s.check().unwrap_err().path, "spec.template.spec.containers[0].workingDir");
        s.container.working_dir = None;
        s.volumes[0].name = "../v".into();
        assert_eq!(s.check().unwrap_err().path, "spec.template.spec.volumes[0].name");
        s.volumes[0].name = "input".into();
        s.container.volume_mounts[0].sub_path = Some("../..".into());
        assert!(s.check().unwrap_err().path.ends_with("volumeMounts[0].subPath"));
        s.container.volume_mounts[0].sub_path = None;
        s.container.env = vec![EnvVar { name: "A".into(), value: "a".repeat(100_000), from: None }];
        s.container.env.extend((0..40).map(|_| EnvVar {
            name: "A".into(),
            value: "$(A)".into(),
            from: None,
        }));
        assert!(s.check().unwrap_err().path.starts_with("spec.template.spec.containers[0].env["));
    }

    #[test]
    fn completions_and_parallelism_keep_the_kubernetes_bounds() {
        let job = |c: u64, p: u64| {
            format!(
                "apiVersion: batch/v1\nkind: Job\nmetadata: {{name: wide}}\nspec:\n  completions: {c}\n  parallelism: {p}\n  completionMode: Indexed\n  template:\n    spec:\n      restartPolicy: Never\n      containers: [{{name: c, command: [\"true\"]}}]\n"
            )
        };
        let s = parse(&job(MAX_COMPLETIONS, MAX_PARALLELISM)).unwrap().spec;
        assert!(s.is_gang());
        assert_eq!(s.effective_parallelism(), 100_000);
        assert_eq!(parse(&job(MAX_COMPLETIONS + 1, 1)).unwrap_err().path, "spec.completions");
        assert_eq!(parse(&job(1, MAX_PARALLELISM + 1)).unwrap_err().path, "spec.parallelism");
    }
}
