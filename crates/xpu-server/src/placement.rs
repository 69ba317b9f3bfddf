//! Placement on the daemon's node: queue order (priority, then fair share across queues, then
//! submission order) and device choice (free devices of the requested kind and vendor, taken
//! from one interconnect domain and NUMA node when they fit there).
//!
//! This is the node-local fit the scheduling loop needs; fleet-wide placement policies live in
//! `xpu-sched`.

use std::collections::HashMap;

use xpu_core::job::{JobSpec, Resources};

use crate::node::Node;

/// What the queue order looks at.
pub struct QueueEntry<'a> {
    pub id: i64,
    pub priority: i64,
    pub queue: &'a str,
    pub running: usize,
}

/// Job ids in the order they get to start: higher priority first; among equals, the queue
/// with fewer running tasks first (fair share), then the older job.
pub fn order<'a>(entries: impl Iterator<Item = QueueEntry<'a>>) -> Vec<i64> {
    let entries: Vec<QueueEntry<'a>> = entries.collect();
    let mut share: HashMap<&str, usize> = HashMap::new();
    for e in &entries {
        *share.entry(e.queue).or_default() += e.running;
    }
    let mut keyed: Vec<(i64, usize, i64)> = entries
        .iter()
        .map(|e| (-e.priority, share.get(e.queue).copied().unwrap_or(0), e.id))
        .collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, id)| id).collect()
}

/// Free capacity during one pass.
#[derive(Debug, Clone)]
pub struct Free {
    devices: Vec<bool>,
    cpu_milli: u64,
    memory_mib: u64,
}

impl Free {
    /// `used` yields (cpu milli, memory MiB) held by running work.
    pub fn new(
        node: &Node,
        held: &[Option<(i64, u32)>],
        used: impl Iterator<Item = (u64, u64)>,
    ) -> Free {
        let (mut cpu, mut mem) = (0u64, 0u64);
        for (c, m) in used {
            cpu += c;
            mem += m;
        }
        Free {
            devices: held.iter().map(Option::is_none).collect(),
            cpu_milli: node.cpu_milli.saturating_sub(cpu),
            memory_mib: node.memory_mib.saturating_sub(mem),
        }
    }

    /// Takes what one task needs, or says why it does not fit now.
    pub fn take(&mut self, node: &Node, res: &Resources) -> Result<Vec<u32>, String> {
        if res.cpu_milli > self.cpu_milli {
            return Err(format!(
                "insufficient cpu: asks {}m, {}m free",
                res.cpu_milli, self.cpu_milli
            ));
        }
        if res.memory_mib > self.memory_mib {
            return Err(format!(
                "insufficient memory: asks {} MiB, {} MiB free",
                res.memory_mib, self.memory_mib
            ));
        }
        let mut taken: Vec<u32> = Vec::new();
        for req in &res.devices {
            let candidates: Vec<u32> = node
                .devices
                .iter()
                .filter(|d| {
                    d.kind == req.kind
                        && req.vendor.as_ref().is_none_or(|v| *v == d.vendor)
                        && self.devices.get(d.id as usize).copied().unwrap_or(false)
                        && !taken.contains(&d.id)
                })
                .map(|d| d.id)
                .collect();
            if candidates.len() < req.count as usize {
                return Err(format!(
                    "insufficient {}: asks {}, {} free",
                    req.resource,
                    req.count,
                    candidates.len()
                ));
            }
            // Best fit among groups sharing an interconnect domain and NUMA node, so a task's
            // devices talk over NVLink/ICI and the smallest group that fits is used up first.
            let mut groups: HashMap<(Option<&str>, Option<u32>), Vec<u32>> = HashMap::new();
            for &c in &candidates {
                let d = &node.devices[c as usize];
                groups.entry((d.interconnect_domain.as_deref(), d.numa_node)).or_default().push(c);
            }
            let mut fitting: Vec<&Vec<u32>> =
                groups.values().filter(|g| g.len() >= req.count as usize).collect();
            fitting.sort_by_key(|g| (g.len(), g.first().copied()));
            let chosen: Vec<u32> = match fitting.first() {
                Some(g) => g.iter().copied().take(req.count as usize).collect(),
                None => candidates.into_iter().take(req.count as usize).collect(),
            };
            taken.extend(chosen);
        }
        for &d in &taken {
            if let Some(f) = self.devices.get_mut(d as usize) {
                *f = false;
            }
        }
        self.cpu_milli -= res.cpu_milli;
        self.memory_mib -= res.memory_mib;
        taken.sort_unstable();
        Ok(taken)
    }
}

/// Whether the job could ever run on this node; `Err` says why not (a nodeSelector label the
/// node lacks, more devices than it has).
pub fn feasible(node: &Node, spec: &JobSpec) -> Result<(), String> {
    for (k, v) in &spec.node_selector {
        match node.labels.get(k) {
            Some(have) if have == v => {}
            Some(have) => {
                return Err(format!("nodeSelector {k}={v} does not match the node's {k}={have}"));
            }
            None => return Err(format!("nodeSelector {k}={v}: the node has no label {k}")),
        }
    }
    let res = &spec.container.resources;
    for req in &res.devices {
        let have = node
            .devices
            .iter()
            .filter(|d| d.kind == req.kind && req.vendor.as_ref().is_none_or(|v| *v == d.vendor))
            .count();
        if have < req.count as usize {
            return Err(format!(
                "asks {} {} per task; the node has {have}",
                req.count, req.resource
            ));
        }
    }
    if spec.is_gang() {
        // A gang starts whole, so the node must hold every member at once.
        let n = spec.completions as usize;
        for req in &res.devices {
            let have = node
                .devices
                .iter()
                .filter(|d| {
                    d.kind == req.kind && req.vendor.as_ref().is_none_or(|v| *v == d.vendor)
                })
                .count();
            if have < req.count as usize * n {
                return Err(format!(
                    "gang of {n} tasks asks {} {} in all; the node has {have}",
                    req.count as usize * n,
                    req.resource
                ));
            }
        }
    }
    if res.cpu_milli > node.cpu_milli {
        return Err(format!("asks {}m cpu; the node has {}m", res.cpu_milli, node.cpu_milli));
    }
    if res.memory_mib > node.memory_mib {
        return Err(format!(
            "asks {} MiB memory; the node has {} MiB",
            res.memory_mib, node.memory_mib
        ));
    }
    Ok(())
}
