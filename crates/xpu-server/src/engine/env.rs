//! What a task is started with: its environment, arguments and downward-API files, resolved
//! from the job's manifest and the node, and why a job can never run on the node. Pure
//! functions of their inputs, used by the [`super::machine`].

use std::collections::BTreeMap;

use xpu_core::DeviceKind;
use xpu_core::job::{CompletionMode, JobSpec};

use super::machine::Job;
use crate::executor;
use crate::node::Node;

/// Most tasks of one job that run on this host at once. A gang must start whole, so one larger
/// than this can never start here; other jobs run this many at a time at most. Each task is a
/// process group with a supervisor, and an Indexed job's tasks each carry every worker's host
/// name (`TPU_WORKER_HOSTNAMES`): 1,024 tasks keep that list under Linux's 128 KiB per variable
/// with the longest host names (64 bytes), and the daemon's memory per job in MiBs. A TPU
/// host has at most 8 chips; a GPU host 16 GPUs.
pub(crate) const MAX_TASKS_ON_HOST: u32 = 1024;

/// Why a job asks more of this one host than it can ever give, whatever else runs: `(field,
/// message)`, refused at submit and failed at start (a job stored before the bound existed).
pub(crate) fn too_big_for_host(spec: &JobSpec) -> Option<(&'static str, String)> {
    if spec.is_gang() && spec.completions > MAX_TASKS_ON_HOST {
        return Some((
            "spec.completions",
            format!(
                "a gang of {} tasks (Indexed, parallelism covering every completion) must start whole, and one host runs at most {MAX_TASKS_ON_HOST} tasks of a job at once; split it across hosts or lower parallelism",
                spec.completions
            ),
        ));
    }
    None
}

/// For a job the scheduler found can never run here: what in its manifest the node cannot
/// satisfy, naming the label or resource (the scheduler's report counts filters, not fields).
pub(super) fn why_never(node: &Node, spec: &JobSpec) -> Option<String> {
    if let Some((field, message)) = too_big_for_host(spec) {
        return Some(format!("{field}: {message}"));
    }
    if let Some(why) = spec.never_fits(&node.name, &node.labels) {
        return Some(why);
    }
    for (k, v) in &spec.node_selector {
        match node.labels.get(k) {
            Some(have) if have == v => {}
            Some(have) => {
                return Some(format!("nodeSelector {k}={v} does not match the node's {k}={have}"));
            }
            None => return Some(format!("nodeSelector {k}={v}: the node has no label {k}")),
        }
    }
    for req in &spec.container.resources.devices {
        let have = node
            .devices
            .iter()
            .filter(|d| d.kind == req.kind && req.vendor.as_ref().is_none_or(|v| *v == d.vendor))
            .count();
        let per_task = req.count as usize;
        let tasks = if spec.is_gang() { spec.completions as usize } else { 1 };
        if have < per_task * tasks {
            return Some(format!(
                "asks {} {} {}; the node has {have}",
                per_task * tasks,
                req.resource,
                if tasks > 1 { "for the whole gang" } else { "per task" }
            ));
        }
    }
    None
}

/// The environment of one task: the job's own variables, then what xpu sets (which wins). The
/// job's device variables are dropped ([`crate::node::DEVICE_VARS`]): only the daemon says which
/// devices a task has. A container is told which devices to inject instead of host index lists
/// (see [`crate::node::Node::container_device_env`]).
pub(super) fn task_env(
    node: &Node,
    job: &Job,
    c: &xpu_core::job::Container,
    idx: u32,
    devices: &[u32],
    container: bool,
) -> Result<Vec<(String, String)>, String> {
    let spec = &job.spec;
    let pod = pod_identity(job, idx);
    // The container's own variables in order: `valueFrom` resolved from the pod's identity,
    // `$(VAR)` in a value expanded with the variables defined before it (Kubernetes' rules).
    let mut env: Vec<(String, String)> = Vec::new();
    // Counted as each variable is made, not once all are: `$(VAR)` references can double the
    // size with every variable (`B=$(A)$(A)`, then `B=$(B)` thousands of times), and each value
    // stays under expansion's own bound while the whole grows to GiBs. Stopping at the bound
    // keeps what a start builds to this size, whatever the manifest.
    let mut total = 0usize;
    let over = || {
        format!(
            "the environment expands to more than {} MiB, what a process can be given; shorten the $(VAR) references",
            MAX_TASK_ENV >> 20
        )
    };
    for e in c.env.iter().filter(|e| !crate::node::selects_devices(&e.name)) {
        let value = match &e.from {
            Some(from) => resolve_env_from(node, spec, c, &pod, from, devices.len()),
            None if spec.source == xpu_core::job::Source::Kubernetes => {
                let lookup =
                    |n: &str| env.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.clone());
                xpu_core::expand::expand(&e.value, &lookup)
                    .map_err(|err| format!("env {}: {err}", e.name))?
            }
            None => e.value.clone(),
        };
        total += e.name.len() + value.len() + 2;
        if total > MAX_TASK_ENV {
            return Err(format!("env {}: {}", e.name, over()));
        }
        env.push((e.name.clone(), value));
    }
    if container {
        env.extend(node.container_device_env(devices));
    } else {
        env.extend(node.device_env(devices));
    }
    env.push(("XPU_JOB_ID".into(), job.id.to_string()));
    env.push(("XPU_JOB_NAME".into(), job.name.clone()));
    env.push(("XPU_TASK_INDEX".into(), idx.to_string()));
    if job.milli < 1000 && devices.iter().any(|&d| is_gpu(node, d)) {
        env.push(("XPU_GPU_MILLI".into(), job.milli.to_string()));
    }
    if spec.completion_mode == CompletionMode::Indexed {
        // Kubernetes sets JOB_COMPLETION_INDEX for Indexed Jobs; GKE's TPU webhook sets the TPU
        // worker id to the same index and lists every worker's hostname in index order.
        env.push(("JOB_COMPLETION_INDEX".into(), idx.to_string()));
        env.push(("TPU_WORKER_ID".into(), idx.to_string()));
        // Every task of the job shares the list: made once per job, not once per task (a gang's
        // tasks all start together, and each list is as long as the gang).
        let hosts = job.worker_hostnames.get_or_init(|| {
            let mut hosts =
                String::with_capacity((node.hostname.len() + 1) * spec.completions as usize);
            for i in 0..spec.completions {
                if i > 0 {
                    hosts.push(',');
                }
                hosts.push_str(&node.hostname);
            }
            hosts
        });
        env.push(("TPU_WORKER_HOSTNAMES".into(), hosts.clone()));
    }
    // Linux refuses an exec whose arguments and environment pass its limit (2 MiB with the
    // default stack); a manifest's references must not make the daemon build more than that.
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if total > MAX_TASK_ENV {
        return Err(format!(
            "the environment expands to {total} bytes, over the {} MiB a process can be given",
            MAX_TASK_ENV >> 20
        ));
    }
    Ok(env)
}

/// The files of the job's `downwardAPI` volumes for task `idx`: (volume, path, content, mode).
pub(super) fn downward_files(
    node: &Node,
    job: &Job,
    idx: u32,
    devices: usize,
) -> Vec<executor::VolumeFile> {
    use xpu_core::job::{EnvFrom, FieldPath};
    let pod = pod_identity(job, idx);
    // `key="value"` lines, sorted, as the kubelet writes a whole map.
    let map = |m: &BTreeMap<String, String>| -> String {
        m.iter().map(|(k, v)| format!("{k}={v:?}\n")).collect()
    };
    let mut out = Vec::new();
    for v in &job.spec.volumes {
        for f in v.downward_api.iter().flatten() {
            let content = match &f.from {
                EnvFrom::Field(FieldPath::Labels) => map(&pod.labels),
                EnvFrom::Field(FieldPath::Annotations) => map(&pod.annotations),
                from => resolve_env_from(node, &job.spec, &job.spec.container, &pod, from, devices),
            };
            out.push(executor::VolumeFile {
                volume: v.name.clone(),
                path: f.path.clone(),
                content,
                mode: f.mode,
            });
        }
    }
    out
}

/// Who a task is, as the downward API tells a pod: its name, uid, labels and annotations as
/// the Job controller sets them.
pub(super) struct PodIdentity {
    name: String,
    uid: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

/// The uid of job `id` as its pods' `controller-uid` label and the downward API give it.
pub(super) fn controller_uid(id: i64) -> String {
    format!("{id:08x}-0000-4000-8000-{:012x}", 0)
}

pub(super) fn pod_identity(job: &Job, idx: u32) -> PodIdentity {
    let spec = &job.spec;
    let uid_of = |n: u64| format!("{:08x}-0000-4000-8000-{:012x}", job.id, n);
    let job_uid = controller_uid(job.id);
    // The labels the Job controller sets, as affinity terms see them too.
    let labels = spec.pod_labels(idx, &job_uid);
    let mut annotations = spec.pod.annotations.clone();
    if spec.completion_mode == CompletionMode::Indexed {
        let key = xpu_core::affinity::COMPLETION_INDEX_LABEL;
        annotations.insert(key.to_owned(), idx.to_string());
    }
    PodIdentity {
        name: format!("{}-{}-{idx}", job.name, job.id),
        uid: uid_of(u64::from(idx) + 1),
        labels,
        annotations,
    }
}

/// A `valueFrom` value. Tasks share the host's network (and a container has only loopback), so
/// both IPs are 127.0.0.1. A resource the container does not set reads as the node's capacity,
/// as the kubelet gives a limit that is not set.
pub(super) fn resolve_env_from(
    node: &Node,
    spec: &JobSpec,
    c: &xpu_core::job::Container,
    pod: &PodIdentity,
    from: &xpu_core::job::EnvFrom,
    devices: usize,
) -> String {
    use xpu_core::job::{EnvFrom, FieldPath};
    match from {
        EnvFrom::Field(f) => match f {
            FieldPath::Name => pod.name.clone(),
            FieldPath::Namespace => spec.pod.namespace.clone().unwrap_or_else(|| "default".into()),
            FieldPath::Uid => pod.uid.clone(),
            FieldPath::Label(k) => pod.labels.get(k).cloned().unwrap_or_default(),
            FieldPath::Annotation(k) => pod.annotations.get(k).cloned().unwrap_or_default(),
            FieldPath::NodeName => node.name.clone(),
            FieldPath::ServiceAccountName => {
                spec.pod.service_account.clone().unwrap_or_else(|| "default".into())
            }
            FieldPath::HostIp | FieldPath::PodIp => "127.0.0.1".to_owned(),
            // Whole maps are for volumes (`downward_files`); the parser keeps them out of env.
            FieldPath::Labels | FieldPath::Annotations => String::new(),
        },
        EnvFrom::Resource { resource, divisor } => {
            let r = &c.resources;
            let name = resource.split_once('.').map_or(resource.as_str(), |(_, n)| n);
            let value = match name {
                "cpu" if r.cpu_milli > 0 => r.cpu_milli as f64 / 1000.0,
                "cpu" => node.cpu_milli as f64 / 1000.0,
                "memory" if r.memory_mib > 0 => r.memory_mib as f64 * 1048576.0,
                "memory" => node.memory_mib as f64 * 1048576.0,
                other => {
                    if r.devices.iter().any(|d| d.resource == other) {
                        devices as f64
                    } else {
                        0.0
                    }
                }
            };
            let d = xpu_core::job::quantity(divisor).filter(|d| *d > 0.0).unwrap_or(1.0);
            format!("{}", (value / d).ceil() as u64)
        }
    }
}

/// Most bytes of environment, or of arguments, a task is started with (Linux's default limit
/// for both together is 2 MiB).
const MAX_TASK_ENV: usize = 2 << 20;

/// `$(VAR)` in a Kubernetes manifest's command and args, by Kubernetes' rules, with every
/// variable of the task. xpu's short form runs its command as written (a shell's `$(cmd)`
/// stays a shell's).
pub(super) fn task_argv(
    spec: &JobSpec,
    c: &xpu_core::job::Container,
    env: &[(String, String)],
) -> Result<Vec<String>, String> {
    if spec.source != xpu_core::job::Source::Kubernetes {
        return Ok(c.argv.clone());
    }
    let lookup = |n: &str| env.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut total = 0;
    let mut argv = Vec::with_capacity(c.argv.len());
    for (i, a) in c.argv.iter().enumerate() {
        let a = xpu_core::expand::expand(a, &lookup).map_err(|e| format!("argument {i}: {e}"))?;
        total += a.len() + 1;
        if total > MAX_TASK_ENV {
            return Err(format!(
                "the arguments expand to over the {} MiB a process can be given",
                MAX_TASK_ENV >> 20
            ));
        }
        argv.push(a);
    }
    Ok(argv)
}

pub(super) fn is_gpu(node: &Node, d: u32) -> bool {
    node.devices.get(d as usize).is_some_and(|x| x.kind == DeviceKind::Gpu)
}
