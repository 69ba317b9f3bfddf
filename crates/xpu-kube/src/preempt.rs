//! Preemption, planned as `xpu-sched` plans it: when pods that could not be placed outrank pods
//! already bound, a what-if scheduler holds every lower-priority bound pod as a running job
//! (the bound members of a gang as one job, so a gang is evicted whole or not at all) and
//! places the waiting units with preemption on. Its victims are xpu-sched's: lowest priority
//! first, then least work lost (age × size), then as few as the waiting unit needs; a waiting
//! gang preempts only if all its members then fit. The result says which pods to evict and
//! where each preemptor goes (`status.nominatedNodeName`); [`crate::scheduler`] checks
//! PodDisruptionBudgets and evicts through the Eviction API. Pure: objects in, a plan out.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::pod::Pod;
use tracing::{debug, warn};
use xpu_core::DeviceKind;
use xpu_sched::TaskRef;
use xpu_sched::policy::TaskMix;
use xpu_sched::{Decision, DeviceAsk, Job, Scheduler, SchedulerConfig, TaskGroup, TaskSpec};

use crate::convert::{self, DEVICE_RESOURCES, SHARE_RESOURCE};
use crate::cycle::{PodKey, Snapshot};
use crate::share;

/// One preemption: evict `victims` so that `nominate` can bind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemption {
    /// Each pod of the waiting unit, with the node it will get.
    pub nominate: Vec<(PodKey, String)>,
    /// Whole jobs: every bound member of a victim gang.
    pub victims: Vec<PodKey>,
    pub priority: i32,
}

/// A unit the cycle could not place.
pub struct Waiting {
    pub job: Job,
    pub pods: Vec<PodKey>,
}

/// A bound pod as a candidate victim.
struct Held<'a> {
    pod: &'a Pod,
    key: PodKey,
    node: String,
    priority: i32,
    /// Seconds it has run (from `status.startTime`).
    age: u64,
}

fn priority(p: &Pod) -> i32 {
    p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// The task a bound pod holds, for adopting it: its effective request, whole devices or a
/// share, and the device indices it holds on `node` of `sched`'s cluster.
fn held_task(
    p: &Pod,
    sched: &Scheduler,
    node: xpu_sched::NodeId,
    taken: &mut HashSet<(u32, u16)>,
) -> Option<(TaskSpec, Vec<u16>)> {
    let u = convert::usage(p).ok()?;
    let mut t = TaskSpec::cpu(u.cpu_milli, u.memory_mib);
    let n = sched.cluster().node(node)?;
    let Some((&res, &count)) = u.devices.iter().next() else { return Some((t, Vec::new())) };
    let kind = DEVICE_RESOURCES.iter().find(|(r, _)| *r == res).map_or(DeviceKind::Gpu, |x| x.1);
    t.device_kind = Some(kind);
    if res == SHARE_RESOURCE {
        let (gpus, milli) = share::spread(count)?;
        let recorded = share::recorded_gpus(p).filter(|g| g.len() == gpus)?;
        t.devices = if gpus == 1 && u64::from(milli) < convert::MILLI_PER_GPU {
            DeviceAsk::Fraction(milli)
        } else {
            DeviceAsk::Whole(gpus as u16)
        };
        return Some((t, recorded));
    }
    // Whole devices: the kubelet chose which; any free ones of that resource stand for them.
    let prefix = format!("{res}/");
    let idx: Vec<u16> = n
        .devices
        .iter()
        .enumerate()
        .filter(|(i, d)| {
            d.id.starts_with(&prefix)
                && d.free_milli() == 1000
                && !taken.contains(&(node, *i as u16))
        })
        .map(|(i, _)| i as u16)
        .take(count as usize)
        .collect();
    if idx.len() != count as usize {
        return None;
    }
    for &i in &idx {
        taken.insert((node, i));
    }
    t.devices = DeviceAsk::Whole(count as u16);
    Some((t, idx))
}

/// Plans preemptions for `waiting` units. `excluded(uid)`: bound pods that must not be chosen
/// (a PodDisruptionBudget refused them lately). `placed`: pods the cycle just bound (uid → node).
#[allow(clippy::too_many_arguments)]
pub fn plan(
    snap: &Snapshot<'_>,
    config: &SchedulerConfig,
    waiting: &[Waiting],
    binds: &[crate::cycle::Bind],
    excluded: &dyn Fn(&str) -> bool,
    mix: &[(TaskSpec, u64)],
) -> Vec<Preemption> {
    let Some(top) = waiting.iter().map(|w| w.job.priority).max() else { return Vec::new() };
    // The what-if scheduler keeps its own time, far enough from zero that every victim's start
    // (now minus its age) is representable.
    let now: u64 = 1 << 40;
    let placed: HashMap<String, String> =
        binds.iter().map(|b| (b.pod.uid.clone(), b.node.clone())).collect();
    let job_shape = |uid: &str| snap.jobs.get(uid).copied();

    // Bound pods, and which of them may be evicted: lower than the highest waiting priority,
    // not already terminating, not excluded, and for a gang, none of its members otherwise.
    let mut held: Vec<Held<'_>> = Vec::new();
    let mut gang_of: HashMap<usize, String> = HashMap::new();
    let mut blocked_gangs: HashSet<String> = HashSet::new();
    for p in snap.pods {
        let Some(key) = PodKey::of(p) else { continue };
        let node = match crate::cycle::bound_node(p, snap.assumed).map(str::to_owned) {
            Some(n) => n,
            None => match placed.get(&key.uid) {
                Some(n) => n.clone(),
                None => continue,
            },
        };
        if crate::cycle::terminal(p) {
            continue;
        }
        let gang = convert::gang(p, job_shape, snap.pod_groups).ok().flatten().map(|g| g.key);
        let evictable = priority(p) < top
            && p.metadata.deletion_timestamp.is_none()
            && !excluded(&key.uid)
            && !placed.contains_key(&key.uid);
        if !evictable {
            if let Some(g) = &gang {
                blocked_gangs.insert(g.clone());
            }
            continue;
        }
        let age = p
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map(|t| snap.unix_now.saturating_sub(t.0.as_second()).max(0) as u64)
            .unwrap_or(0);
        if let Some(g) = gang {
            gang_of.insert(held.len(), g);
        }
        held.push(Held { pod: p, key, node, priority: priority(p), age });
    }
    if held.is_empty() {
        return Vec::new();
    }
    let candidates: Vec<usize> = (0..held.len())
        .filter(|i| gang_of.get(i).is_none_or(|g| !blocked_gangs.contains(g)))
        .collect();
    if candidates.is_empty() {
        return Vec::new();
    }
    let evictable: HashSet<&str> = candidates.iter().map(|&i| held[i].key.uid.as_str()).collect();

    // The cluster without the candidates (everything else counted as the cycle counts it,
    // the pods it just bound included).
    let mut assumed = snap.assumed.clone();
    let mut assumed_gpus = snap.assumed_gpus.clone();
    for b in binds {
        assumed.insert(b.pod.uid.clone(), b.node.clone());
        if let Some((gpus, _)) = &b.share {
            assumed_gpus.insert(b.pod.uid.clone(), gpus.clone());
        }
    }
    let what_if = Snapshot {
        hold_out: Some(&evictable),
        assumed: &assumed,
        assumed_gpus: &assumed_gpus,
        ..snap.clone()
    };
    let cluster = crate::cycle::cluster_of(&what_if).cluster;
    let cfg =
        SchedulerConfig { preemption: true, best_effort: true, reserve: false, ..config.clone() };
    let mut sched = match Scheduler::new(cluster, cfg) {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "no preemption this cycle: the what-if scheduler cannot be built");
            return Vec::new();
        }
    };

    // Inter-pod constraints hold in the what-if too: the pods that stay are recorded where
    // they are, and the candidates carry their terms (released when they are evicted).
    let inter_pod = waiting.iter().any(|w| w.job.groups.iter().any(|g| g.task.pod.is_some()));
    if inter_pod {
        crate::cycle::record_placed(&what_if, &mut sched);
    }

    // Candidates as running jobs: a gang's members together.
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for &i in &candidates {
        let k = gang_of.get(&i).cloned().unwrap_or_else(|| format!("pod {}", held[i].key.uid));
        groups.entry(k).or_default().push(i);
    }
    let mut victims_of: HashMap<u32, Vec<PodKey>> = HashMap::new();
    let mut taken: HashSet<(u32, u16)> = HashSet::new();
    for (name, members) in &groups {
        let mut groups = Vec::with_capacity(members.len());
        let mut running = Vec::new();
        let mut ok = true;
        for (gi, &i) in members.iter().enumerate() {
            let h = &held[i];
            let Some(node) = sched.cluster().node_id(&h.node) else {
                ok = false;
                break;
            };
            let Some((mut task, devices)) = held_task(h.pod, &sched, node, &mut taken) else {
                ok = false;
                break;
            };
            if inter_pod {
                task.pod = crate::cycle::placed_terms(snap, h.pod);
            }
            groups.push(TaskGroup::new(1, task));
            running.push((TaskRef { group: gi as u32, index: 0 }, node, devices));
        }
        if !ok {
            continue;
        }
        let prio = members.iter().map(|&i| held[i].priority).max().unwrap_or(0);
        let age = members.iter().map(|&i| held[i].age).max().unwrap_or(0);
        let job = Job {
            name: name.clone(),
            queue: String::new(),
            priority: prio,
            groups,
            max_run_duration: None,
            duration_hint: None,
        };
        // Adopted as started `age` seconds ago, so that lost work counts its run time.
        match sched.adopt(job, &running, now.saturating_sub(age)) {
            Ok(id) => {
                victims_of.insert(id, members.iter().map(|&i| held[i].key.clone()).collect());
            }
            Err(e) => debug!(victim = %name, error = %e, "not a preemption candidate"),
        }
    }
    if !mix.is_empty() && config.policy.needs_mix() {
        let demands: Vec<_> = mix
            .iter()
            .filter_map(|(t, n)| Some((sched.demand(t).ok()?, *n as usize)))
            .flat_map(|(d, n)| std::iter::repeat_n(d, n))
            .collect();
        if !demands.is_empty() {
            sched.set_task_mix(&TaskMix::from_demands(&demands, 0.95));
        }
    }

    let mut order: Vec<&Waiting> = waiting.iter().collect();
    order.sort_by_key(|w| std::cmp::Reverse(w.job.priority));
    let mut unit_of: HashMap<u32, &Waiting> = HashMap::new();
    for w in order {
        match sched.submit(w.job.clone(), now) {
            Ok(id) => {
                unit_of.insert(id, w);
            }
            Err(e) => debug!(job = %w.job.name, error = %e, "cannot preempt for it"),
        }
    }
    let mut victims: HashMap<u32, Vec<PodKey>> = HashMap::new();
    let mut starts: HashMap<u32, Vec<(PodKey, String)>> = HashMap::new();
    for d in sched.schedule(now) {
        match d {
            Decision::Preempt { job, by, .. } if unit_of.contains_key(&by) => {
                if let Some(pods) = victims_of.get(&job) {
                    victims.entry(by).or_default().extend(pods.iter().cloned());
                }
            }
            Decision::Start { job, tasks } => {
                let Some(w) = unit_of.get(&job) else { continue };
                let nominate = tasks
                    .iter()
                    .filter_map(|t| {
                        // Groups are in job order, each group's pods after the last's.
                        let at: usize = w.job.groups
                            [..(t.task.group as usize).min(w.job.groups.len())]
                            .iter()
                            .map(|g| g.count as usize)
                            .sum();
                        let pod = w.pods.get(at + t.task.index as usize)?;
                        let node = sched.cluster().node(t.placement.node)?;
                        Some((pod.clone(), node.name.clone()))
                    })
                    .collect();
                starts.insert(job, nominate);
            }
            _ => {}
        }
    }
    let mut out: Vec<Preemption> = victims
        .into_iter()
        .filter_map(|(by, victims)| {
            let nominate = starts.remove(&by)?;
            let priority = unit_of.get(&by)?.job.priority;
            Some(Preemption { nominate, victims, priority })
        })
        .collect();
    out.sort_by_key(|p| std::cmp::Reverse(p.priority));
    out
}
