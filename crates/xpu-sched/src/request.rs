//! Requests: a [`Job`] is one or more [`TaskGroup`]s; every task of a group asks for the same
//! CPU, memory and devices (a whole count, or a fraction of one device in milli-units), limited
//! to allowed models and to nodes whose labels match a Kubernetes-style `nodeSelector`. A group
//! may be a gang (all tasks at once or none), and a TPU group names a GKE accelerator and
//! topology (`tpu-v5p-slice` + `2x2x4`), which becomes a gang of one task per host, all in one
//! slice.
//!
//! Validation happens here, once, when a request is turned into [`Demand`]s; the scheduler
//! core only ever sees valid demands.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use xpu_core::DeviceKind;
use xpu_core::tpu::{self, TpuError};

use crate::cluster::{Cluster, ClusterError, MILLI, Selector};
use crate::placement::Demand;

/// Seconds. The scheduler has no clock; callers pass time in.
pub type Time = u64;

/// GKE's maximum run duration for flex-start capacity: seven days.
pub const FLEX_MAX_RUN: Time = 7 * 24 * 3600;

/// Devices one task asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", tag = "type", content = "value")]
pub enum DeviceAsk {
    #[default]
    None,
    /// This many whole devices.
    Whole(u16),
    /// A share of one device, in milli-units (1..=999).
    Fraction(u16),
}

/// A TPU slice: GKE accelerator label and topology.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TpuAsk {
    /// `cloud.google.com/gke-tpu-accelerator`, e.g. `tpu-v5p-slice`.
    pub accelerator: String,
    /// `cloud.google.com/gke-tpu-topology`, e.g. `2x2x4`.
    pub topology: String,
}

/// What each task of a group asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TaskSpec {
    #[serde(default)]
    pub cpu_milli: u64,
    #[serde(default)]
    pub memory_mib: u64,
    #[serde(default)]
    pub devices: DeviceAsk,
    /// Device kind; `gpu` when devices are asked for and this is absent.
    #[serde(default)]
    pub device_kind: Option<DeviceKind>,
    /// Allowed device models; empty: any.
    #[serde(default)]
    pub models: Vec<String>,
    /// Every pair must match a node label (`nodeSelector`).
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Only nodes of this pool.
    #[serde(default)]
    pub pool: Option<String>,
    /// Required node affinity terms (Kubernetes semantics, see [`crate::constraints`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub affinity: Vec<Vec<crate::constraints::Requirement>>,
    /// Tolerated node taints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<crate::constraints::Toleration>,
    /// What the task is to other pods and its inter-pod constraints (Kubernetes pods; see
    /// [`crate::pods`]). `None`: no other task's constraint concerns it.
    #[serde(skip)]
    pub pod: Option<std::sync::Arc<crate::pods::PodTerms>>,
}

/// A set of identical tasks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskGroup {
    #[serde(default)]
    pub name: String,
    /// Number of tasks (ignored for TPU groups, whose topology sets it).
    #[serde(default = "one")]
    pub count: u32,
    pub task: TaskSpec,
    /// All tasks start together or none do; no partial placement is ever held.
    #[serde(default)]
    pub gang: bool,
    /// A TPU slice; makes the group a gang of one task per host in one slice (pool).
    #[serde(default)]
    pub tpu: Option<TpuAsk>,
}

fn one() -> u32 {
    1
}

/// A job: task groups, scheduled together (a job starts when every group is placed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub name: String,
    /// Queue (tenant) for fair share; `default` when empty.
    #[serde(default)]
    pub queue: String,
    /// Higher runs first and may preempt lower.
    #[serde(default)]
    pub priority: i32,
    pub groups: Vec<TaskGroup>,
    /// Stop the job after this long (flex-start capacity caps it at 7 days anyway).
    #[serde(default)]
    pub max_run_duration: Option<Time>,
    /// Expected run time, for shortest-job-first and backfill (the simulator passes the real
    /// duration; a daemon can pass the user's time limit).
    #[serde(default)]
    pub duration_hint: Option<Time>,
}

impl Job {
    /// A one-group job.
    pub fn single(name: impl Into<String>, group: TaskGroup) -> Self {
        Self {
            name: name.into(),
            queue: String::new(),
            priority: 0,
            groups: vec![group],
            max_run_duration: None,
            duration_hint: None,
        }
    }

    pub fn priority(mut self, p: i32) -> Self {
        self.priority = p;
        self
    }

    pub fn queue(mut self, q: impl Into<String>) -> Self {
        self.queue = q.into();
        self
    }

    pub fn duration_hint(mut self, t: Time) -> Self {
        self.duration_hint = Some(t);
        self
    }

    pub fn max_run(mut self, t: Time) -> Self {
        self.max_run_duration = Some(t);
        self
    }
}

impl TaskGroup {
    /// `count` tasks asking for `task`.
    pub fn new(count: u32, task: TaskSpec) -> Self {
        Self { name: String::new(), count, task, gang: false, tpu: None }
    }

    pub fn gang(mut self) -> Self {
        self.gang = true;
        self
    }

    /// A TPU slice group; CPU and memory per host come from `task`.
    pub fn tpu(accelerator: &str, topology: &str, task: TaskSpec) -> Self {
        Self {
            name: String::new(),
            count: 0,
            task,
            gang: true,
            tpu: Some(TpuAsk { accelerator: accelerator.into(), topology: topology.into() }),
        }
    }
}

impl TaskSpec {
    pub fn cpu(cpu_milli: u64, memory_mib: u64) -> Self {
        Self { cpu_milli, memory_mib, ..Self::default() }
    }

    pub fn gpus(cpu_milli: u64, memory_mib: u64, n: u16) -> Self {
        Self { devices: DeviceAsk::Whole(n), ..Self::cpu(cpu_milli, memory_mib) }
    }

    pub fn gpu_share(cpu_milli: u64, memory_mib: u64, milli: u16) -> Self {
        Self { devices: DeviceAsk::Fraction(milli), ..Self::cpu(cpu_milli, memory_mib) }
    }

    pub fn models(mut self, models: &[&str]) -> Self {
        self.models = models.iter().map(|m| (*m).to_owned()).collect();
        self
    }

    pub fn select(mut self, k: &str, v: &str) -> Self {
        self.node_selector.insert(k.into(), v.into());
        self
    }

    /// The scheduler's compact form of this task, with names interned in `cluster`.
    pub fn demand(&self, cluster: &mut Cluster) -> Result<Demand, RequestError> {
        let kind = self.device_kind.unwrap_or(DeviceKind::Gpu);
        let mut d = match self.devices {
            DeviceAsk::None => Demand::cpu(self.cpu_milli, self.memory_mib),
            DeviceAsk::Whole(0) => Demand::cpu(self.cpu_milli, self.memory_mib),
            DeviceAsk::Whole(n) => {
                if usize::from(n) > crate::cluster::MAX_DEVICES {
                    return Err(RequestError::TooManyDevices(n));
                }
                Demand::whole(self.cpu_milli, self.memory_mib, kind, n)
            }
            DeviceAsk::Fraction(m) if m == 0 || m >= MILLI => {
                return Err(RequestError::BadFraction(m));
            }
            DeviceAsk::Fraction(m) => Demand::share(self.cpu_milli, self.memory_mib, kind, m),
        };
        d.models = cluster.model_mask(&self.models)?;
        let sel = Selector {
            labels: self.node_selector.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            pool: self.pool.clone(),
            affinity: self.affinity.clone(),
            tolerations: self.tolerations.clone(),
        };
        d.selector = cluster.selector_id(&sel);
        d.taints = cluster.selector_id(&Selector {
            tolerations: self.tolerations.clone(),
            ..Selector::default()
        });
        Ok(d)
    }

    /// Selectors for topology spread's node counting (`nodeAffinityPolicy` /
    /// `nodeTaintsPolicy`): the node affinity and selector tolerating every taint, and the
    /// tolerations alone. Interned only for tasks with spread constraints.
    fn spread_selectors(&self, cluster: &mut Cluster) -> [u32; 2] {
        if self.pod.as_ref().is_none_or(|p| p.spread.is_empty()) {
            return [0, 0];
        }
        let any_taint = crate::constraints::Toleration {
            key: None,
            exists: true,
            value: String::new(),
            effect: None,
        };
        let affinity = Selector {
            labels: self.node_selector.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            pool: self.pool.clone(),
            affinity: self.affinity.clone(),
            tolerations: vec![any_taint],
        };
        let taints = Selector { tolerations: self.tolerations.clone(), ..Selector::default() };
        [cluster.selector_id(&affinity), cluster.selector_id(&taints)]
    }
}

/// What is wrong with a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("job has no task groups; add at least one group")]
    NoGroups,
    #[error("task group {group:?} has 0 tasks; set count to 1 or more")]
    NoTasks { group: String },
    #[error("a device fraction must be 1..=999 milli (got {0}); ask for whole devices instead")]
    BadFraction(u16),
    #[error("a task may ask for at most {max} devices (got {0})", max = crate::cluster::MAX_DEVICES)]
    TooManyDevices(u16),
    #[error("task group {group:?}: {error}")]
    Tpu { group: String, error: TpuError },
    #[error("task group {group:?} asks for {count} tasks; at most 100000 are supported")]
    TooManyTasks { group: String, count: u32 },
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// One group, expanded: the demand of each task, how many, and how they must be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandedGroup {
    pub demand: Demand,
    pub count: u32,
    pub gang: bool,
    /// All tasks in one slice (pool): multi-host TPU slices.
    pub colocate: bool,
    /// The tasks' inter-pod terms, with the selectors spread counts nodes by: the task's
    /// node affinity without its tolerations, and its tolerations alone.
    pub pod: Option<std::sync::Arc<crate::pods::PodTerms>>,
    pub spread_selectors: [u32; 2],
}

/// Label GKE puts on TPU nodes: the accelerator type.
pub const GKE_TPU_ACCELERATOR: &str = "cloud.google.com/gke-tpu-accelerator";
/// Label GKE puts on TPU nodes: the slice topology.
pub const GKE_TPU_TOPOLOGY: &str = "cloud.google.com/gke-tpu-topology";
/// Label GKE puts on flex-start nodes.
pub const GKE_FLEX_START: &str = "cloud.google.com/gke-flex-start";

/// Validates a job and turns each group into demands interned in `cluster`.
pub fn expand(job: &Job, cluster: &mut Cluster) -> Result<Vec<ExpandedGroup>, RequestError> {
    if job.groups.is_empty() {
        return Err(RequestError::NoGroups);
    }
    let mut out = Vec::with_capacity(job.groups.len());
    for (i, g) in job.groups.iter().enumerate() {
        let gname = if g.name.is_empty() { format!("{}#{i}", job.name) } else { g.name.clone() };
        if let Some(t) = &g.tpu {
            let shape = tpu::slice(&t.accelerator, &t.topology)
                .map_err(|source| RequestError::Tpu { group: gname.clone(), error: source })?;
            let mut spec = g.task.clone();
            spec.devices = DeviceAsk::Whole(shape.chips_per_host as u16);
            spec.device_kind = Some(DeviceKind::Tpu);
            spec.node_selector
                .insert(GKE_TPU_ACCELERATOR.into(), shape.facts.gke_accelerator.into());
            spec.node_selector.insert(GKE_TPU_TOPOLOGY.into(), shape.topology.to_string());
            out.push(ExpandedGroup {
                demand: spec.demand(cluster)?,
                count: shape.hosts,
                gang: true,
                colocate: shape.is_multi_host(),
                pod: spec.pod.clone(),
                spread_selectors: spec.spread_selectors(cluster),
            });
            continue;
        }
        if g.count == 0 {
            return Err(RequestError::NoTasks { group: gname });
        }
        if g.count > 100_000 {
            return Err(RequestError::TooManyTasks { group: gname, count: g.count });
        }
        out.push(ExpandedGroup {
            demand: g.task.demand(cluster)?,
            count: g.count,
            gang: g.gang,
            colocate: false,
            pod: g.task.pod.clone(),
            spread_selectors: g.task.spread_selectors(cluster),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tpu_groups_become_colocated_gangs_of_hosts() {
        let mut c = Cluster::new();
        let job = Job::single(
            "train",
            TaskGroup::tpu("tpu-v5p-slice", "2x2x4", TaskSpec::cpu(1000, 1000)),
        );
        let g = expand(&job, &mut c).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!((g[0].count, g[0].gang, g[0].colocate), (4, true, true));
        assert_eq!(
            (g[0].demand.kind, g[0].demand.count, g[0].demand.milli),
            (DeviceKind::Tpu, 4, 1000)
        );
        let single = Job::single("s", TaskGroup::tpu("tpu-v6e-slice", "2x4", TaskSpec::default()));
        let g = expand(&single, &mut c).unwrap();
        assert_eq!((g[0].count, g[0].colocate, g[0].demand.count), (1, false, 8));
        let bad = Job::single("b", TaskGroup::tpu("tpu-v5p-slice", "4x4", TaskSpec::default()));
        let e = expand(&bad, &mut c).unwrap_err();
        assert!(e.to_string().contains("2x2x4"), "{e}");
    }

    #[test]
    fn invalid_requests_are_refused_with_the_fix() {
        let mut c = Cluster::new();
        let e =
            expand(&Job::single("j", TaskGroup::new(1, TaskSpec::gpu_share(0, 0, 1000))), &mut c)
                .unwrap_err();
        assert_eq!(e, RequestError::BadFraction(1000));
        let e =
            expand(&Job::single("j", TaskGroup::new(0, TaskSpec::default())), &mut c).unwrap_err();
        assert!(matches!(e, RequestError::NoTasks { .. }));
        let mut j = Job::single("j", TaskGroup::new(1, TaskSpec::default()));
        j.groups.clear();
        assert_eq!(expand(&j, &mut c).unwrap_err(), RequestError::NoGroups);
    }

    #[test]
    fn jobs_round_trip_through_json() {
        let j = Job::single(
            "train",
            TaskGroup::new(
                2,
                TaskSpec::gpus(4000, 16_000, 8).models(&["H100"]).select("zone", "a"),
            )
            .gang(),
        )
        .priority(5)
        .queue("research");
        let s = serde_json::to_string(&j).unwrap();
        let back: Job = serde_json::from_str(&s).unwrap();
        assert_eq!(back, j);
        let minimal: Job = serde_json::from_str(
            r#"{"name":"x","groups":[{"task":{"devices":{"type":"fraction","value":250}}}]}"#,
        )
        .unwrap();
        assert_eq!(minimal.groups[0].count, 1);
        assert_eq!(minimal.groups[0].task.devices, DeviceAsk::Fraction(250));
    }
}
