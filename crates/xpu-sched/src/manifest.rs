//! A parsed job manifest ([`xpu_core::job::JobSpec`]: a Kubernetes `batch/v1` Job or xpu's
//! short form) as a scheduler [`Job`], the way the daemon queues it.
//!
//! One task group whose tasks are the job's *slots*: as many as may run at once
//! (`min(parallelism, completions)`, [`JobSpec::effective_parallelism`]). The caller hands
//! completions to slots as they are placed and, when a slot's task ends with more completions
//! left, gives the slot back to the queue with [`crate::Scheduler::requeue_task`]; so a job with
//! `completions: 10, parallelism: 2` never holds more than two tasks' devices, and each
//! completion is placed anew, as Kubernetes schedules each pod. An Indexed job whose
//! parallelism covers every completion is a gang ([`JobSpec::is_gang`]): all of it starts at
//! once or none of it does.
//!
//! Each task asks for the CPU and memory of `resources.requests`, and for devices of one kind:
//! `nvidia.com/gpu: 2` is two whole GPUs of NVIDIA's models, the short form's `gpus: 2` two GPUs
//! of any vendor, and a share (`xpu.dev/gpu-milli: "250"`) a quarter of one GPU. The vendor of
//! an extended resource becomes the allowed models: the caller says which models of that vendor
//! its nodes have. Priority, queue (fair share) and `nodeSelector` carry over as they are;
//! `activeDeadlineSeconds` is the duration hint (the caller enforces the deadline itself, from
//! the job's recorded start, which survives its restarts).

use xpu_core::DeviceKind;
use xpu_core::job::JobSpec;

use crate::cluster::MAX_DEVICES;
use crate::request::{DeviceAsk, Job, TaskGroup, TaskSpec};

/// Why a manifest cannot become a scheduler job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error(
        "asks for {0}; a task may ask for devices of one kind and vendor: split the work into jobs"
    )]
    SeveralDeviceKinds(String),
    #[error("asks for {count} {resource} per task; one node holds at most {MAX_DEVICES} devices")]
    TooManyDevices { resource: String, count: u32 },
    #[error("{resource}: a share must be 1 to 999 thousandths of one device (got {milli})")]
    BadShare { resource: String, milli: u16 },
}

impl ManifestError {
    /// The extended resource the error is about (`nvidia.com/gpu`), for callers that name the
    /// manifest field.
    pub fn resource(&self) -> Option<&str> {
        match self {
            ManifestError::SeveralDeviceKinds(_) => None,
            ManifestError::TooManyDevices { resource, .. }
            | ManifestError::BadShare { resource, .. } => Some(resource),
        }
    }
}

/// The model name allowed when a vendor has no device of the kind on any node: matches no
/// device, so the job fails as unschedulable with `node(s) had no gpu of an allowed model`.
fn no_model(vendor: &str, kind: DeviceKind) -> String {
    format!("{vendor} {kind} (none on this cluster)")
}

/// The scheduler job for `spec`. `models(vendor, kind)` lists the device models of that vendor
/// (`nvidia`, `amd`, `google`, `intel`) and kind the cluster has; a request naming no vendor
/// (the short form's `gpus: N`) takes any model.
pub fn job_from_spec(
    spec: &JobSpec,
    models: &dyn Fn(&str, DeviceKind) -> Vec<String>,
) -> Result<Job, ManifestError> {
    let res = &spec.container.resources;
    let mut task = TaskSpec::cpu(res.cpu_milli, res.memory_mib);
    task.node_selector = spec.node_selector.clone();
    match res.devices.as_slice() {
        [] => {}
        [d] => {
            task.device_kind = Some(d.kind);
            task.devices = match d.milli {
                Some(m) if m == 0 || m >= crate::cluster::MILLI => {
                    return Err(ManifestError::BadShare { resource: d.resource.clone(), milli: m });
                }
                Some(m) => DeviceAsk::Fraction(m),
                None if d.count as usize > MAX_DEVICES => {
                    return Err(ManifestError::TooManyDevices {
                        resource: d.resource.clone(),
                        count: d.count,
                    });
                }
                None => DeviceAsk::Whole(d.count as u16),
            };
            if let Some(v) = &d.vendor {
                let mut m = models(v, d.kind);
                if m.is_empty() {
                    m.push(no_model(v, d.kind));
                }
                task.models = m;
            }
        }
        more => {
            let names: Vec<String> =
                more.iter().map(|d| format!("{} {}", d.count, d.resource)).collect();
            return Err(ManifestError::SeveralDeviceKinds(names.join(" and ")));
        }
    }
    let mut group = TaskGroup::new(spec.effective_parallelism(), task);
    group.name = spec.name.clone();
    group.gang = spec.is_gang();
    let mut job = Job::single(spec.name.clone(), group).priority(spec.priority).queue(&spec.queue);
    job.duration_hint = spec.active_deadline_seconds;
    Ok(job)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Cluster, NodeSpec};
    use crate::scheduler::{Decision, Scheduler, SchedulerConfig};

    fn models(vendor: &str, kind: DeviceKind) -> Vec<String> {
        match (vendor, kind) {
            ("nvidia", DeviceKind::Gpu) => vec!["A100-SXM4-40GB".into()],
            ("google", DeviceKind::Tpu) => vec!["TPU-v6e".into()],
            _ => Vec::new(),
        }
    }

    fn parse(text: &str) -> JobSpec {
        xpu_core::job::parse(text).unwrap().spec
    }

    #[test]
    fn slots_gangs_shares_and_vendors() {
        let s =
            parse("command: [x]\ngpus: 2\ncompletions: 5\nparallelism: 2\nqueue: r\npriority: 3\n");
        let j = job_from_spec(&s, &models).unwrap();
        assert_eq!((j.groups[0].count, j.groups[0].gang), (2, false));
        assert_eq!(j.groups[0].task.devices, DeviceAsk::Whole(2));
        assert!(j.groups[0].task.models.is_empty(), "no vendor: any model");
        assert_eq!((j.queue.as_str(), j.priority), ("r", 3));

        let s = parse("command: [x]\ntpus: 4\ncompletions: 2\nindexed: true\n");
        let j = job_from_spec(&s, &models).unwrap();
        assert_eq!((j.groups[0].count, j.groups[0].gang), (2, true));
        assert_eq!(j.groups[0].task.device_kind, Some(DeviceKind::Tpu));
        assert_eq!(j.groups[0].task.models, ["TPU-v6e"]);

        let s = parse("command: [x]\ngpuMilli: 250\n");
        let j = job_from_spec(&s, &models).unwrap();
        assert_eq!(j.groups[0].task.devices, DeviceAsk::Fraction(250));

        let s = parse("command: [x]\ndevices: {amd.com/gpu: 1}\n");
        let j = job_from_spec(&s, &models).unwrap();
        assert_eq!(j.groups[0].task.models, ["amd gpu (none on this cluster)"]);

        let s = parse("command: [x]\ngpus: 1\ntpus: 1\n");
        let e = job_from_spec(&s, &models).unwrap_err();
        assert_eq!(
            e.to_string(),
            "asks for 1 gpu and 1 google.com/tpu; a task may ask for devices of one kind and vendor: split the work into jobs"
        );
        let s = parse("command: [x]\ngpus: 40\n");
        let e = job_from_spec(&s, &models).unwrap_err();
        assert_eq!(e.resource(), Some("gpu"));
    }

    #[test]
    fn a_vendor_the_cluster_lacks_never_fits_and_says_why() {
        let c = Cluster::from_specs([NodeSpec::new("n", 8000, 8192).devices(
            2,
            DeviceKind::Gpu,
            "A100-SXM4-40GB",
        )])
        .unwrap();
        let mut s = Scheduler::new(c, SchedulerConfig::default()).unwrap();
        let spec = parse("command: [x]\ndevices: {amd.com/gpu: 1}\n");
        let id = s.submit(job_from_spec(&spec, &models).unwrap(), 0).unwrap();
        let ds = s.schedule(0);
        let Some(Decision::Fail { job, error }) = ds.first() else { panic!("{ds:?}") };
        assert_eq!(*job, id);
        assert_eq!(
            error.to_string(),
            "0/1 nodes are available: 1 node(s) had no gpu of an allowed model"
        );
    }
}
