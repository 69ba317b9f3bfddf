//! An OpenB trace replayed as DRA claims, to measure what the allocator's device choice is worth:
//! each GPU node of the node list becomes a ResourceSlice shaped as xpu's DRA driver publishes
//! one (a device per GPU with its `model`, `resource.kubernetes.io/pcieRoot` shared by pairs of
//! GPUs and `numaNode` by fours; shareable devices with a `compute` capacity of 1 when the trace
//! has GPU shares), and each GPU pod becomes a claim: `count` GPUs of the pod's models, two of one
//! PCIe root (`matchAttribute`), three or four of one NUMA node, a share as a `compute` capacity
//! request. The allocator is [`crate::dra::allocate`] itself, with xpu's packing order or with
//! upstream's first fit; the node is chosen the same way for both (the first node in the seed's
//! order where the claim fits, or the node with the fewest whole free GPUs), so the difference is
//! the device choice alone.
//!
//! With `mig`, every GPU is an H200 in MIG mode instead, published as xpu's DRA driver publishes
//! one (`xpu-kube`'s `dra::mig`: a counter set per GPU of its memory slices, compute slices and
//! media extension, and a device per profile and placement of NVIDIA's table drawing on it), and
//! each GPU pod asks for partitions: a share for the smallest profile whose compute holds it
//! (`1g.18gb` for up to 1/7 of a GPU, `2g.35gb` up to 2/7, ...), a whole GPU for `7g.141gb`.
//! The allocation ratio is then what the partitions hold (compute slices over the GPUs').
//!
//! Two workloads: OpenB's own ([`super::openb::workload`]: the trace shuffled and inflated to
//! 130 % of the GPU capacity, nothing leaves), and churn: claims arrive from the same draws until
//! four times the capacity has arrived, each living an exponentially distributed number of
//! arrivals chosen so that the offered load is `load` × the capacity, so devices free up in the
//! middle of domains as on a real cluster.

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;

use serde::Serialize;

use crate::dra::{
    self, Allocation, Claim, Class, Constraint, ConstraintKind, Device, DeviceId, Exact, InUse,
    Limits, Mode, NodeScope, Request, Selector, Slice, Value,
};
use crate::rng::Rng;
use crate::trace::{OpenbNode, OpenbPod};

/// The driver the slices are published under (xpu's DRA driver's name).
pub const DRIVER: &str = "xpu.dev";
/// The DeviceClass every claim names.
pub const CLASS: &str = "gpu.xpu.dev";
/// The standard PCIe root attribute.
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The NUMA node attribute, in the driver's domain.
pub const NUMA: &str = "xpu.dev/numaNode";
/// The capacity a share asks for, in thousandths of a GPU.
pub const COMPUTE: &str = "compute";

/// How a claim's node is chosen (the same for both device choices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeChoice {
    /// The first node in the seed's order where the claim fits.
    First,
    /// The node with the fewest whole free GPUs where the claim fits (xpu's best fit).
    Tightest,
    /// kube-scheduler's default score for a pod whose devices come from claims: the node with
    /// the most free CPU and memory (`NodeResourcesFit`'s `LeastAllocated`; devices of claims
    /// do not enter it).
    Spread,
}

impl NodeChoice {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeChoice::First => "first",
            NodeChoice::Tightest => "tightest",
            NodeChoice::Spread => "spread",
        }
    }
}

/// One run's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraOptions {
    pub node: NodeChoice,
    /// xpu's packing order ([`Limits::pack`]); false: upstream's first fit.
    pub pack: bool,
    /// 0: OpenB's workload, nothing leaves; above 0: churn at this offered load.
    pub load: f64,
    /// Every GPU an H200 in MIG mode, and GPU pods asking for MIG partitions.
    pub mig: bool,
}

/// The GPU model the MIG replay gives every node.
pub const MIG_MODEL: &str = "H200";

/// The MIG profile a GPU pod asks for: the smallest whose compute holds a share, the whole GPU
/// otherwise.
pub fn mig_profile(pod: &OpenbPod) -> &'static xpu_core::mig::Profile {
    let model = mig_model();
    let whole = &model.profiles[model.profiles.len() - 1];
    if pod.num_gpu != 1 || pod.gpu_milli >= 1000 {
        return whole;
    }
    model
        .profiles
        .iter()
        .filter(|p| !p.name.ends_with("+me") && p.name != "1g.35gb")
        .find(|p| u32::from(p.compute) * 1000 >= u32::from(pod.gpu_milli) * 7)
        .unwrap_or(whole)
}

fn mig_model() -> &'static xpu_core::mig::Model {
    // The table has the H200; a missing row would be a bug in xpu-core's table.
    xpu_core::mig::Model::of(MIG_MODEL).unwrap_or_else(|_| unreachable!("H200 is in the MIG table"))
}

/// Thousandths of a GPU a profile's compute is (rounded down: the books that skip nodes never
/// refuse a partition that fits).
fn profile_milli(p: &xpu_core::mig::Profile) -> u32 {
    if p.compute >= xpu_core::mig::COMPUTE_SLICES {
        1000
    } else {
        u32::from(p.compute) * 1000 / u32::from(xpu_core::mig::COMPUTE_SLICES)
    }
}

/// Arrived and placed, for one claim size.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SizeCount {
    /// `share`, `1`, `2`, `4`, `8`, ...
    pub size: String,
    pub arrived: u64,
    pub placed: u64,
}

/// One run (one seed, one setting).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DraRun {
    pub seed: u64,
    /// Claims (GPU pods) that arrived and that were allocated.
    pub claims: u64,
    pub placed: u64,
    /// GPU requested by the arrived claims, and by the placed ones, in thousandths.
    pub gpu_milli_arrived: u64,
    pub gpu_milli_placed: u64,
    /// GPU allocation ratio at the end, percent (OpenB's figure when nothing leaves).
    pub alloc_pct: f64,
    pub by_size: Vec<SizeCount>,
    /// Allocations the allocator refused on a node that had the devices free by count (its
    /// constraints or the fragmentation within the node).
    pub refused_in_node: u64,
    /// Devices held by two live claims at the end, by [`dra::double_booked`]: always 0 unless
    /// the allocator is wrong.
    pub double_booked: usize,
}

/// Selects devices whose `model` is one of the pod's.
#[derive(Debug)]
struct ModelIn(Vec<String>);

impl Selector for ModelIn {
    fn matches(&self, _: &DeviceId, device: &Device) -> Result<bool, String> {
        Ok(matches!(device.attributes.get("model"), Some(Value::String(m)) if self.0.contains(m)))
    }
}

/// The slice of each node (`None` for a node without GPUs), shaped as described above.
pub fn slices(nodes: &[OpenbNode], shares: bool) -> Vec<Option<Slice>> {
    nodes
        .iter()
        .enumerate()
        .map(|(ni, n)| {
            (n.gpus > 0).then(|| Slice {
                driver: DRIVER.into(),
                pool: n.name.clone(),
                generation: 1,
                slice_count: 1,
                scope: NodeScope::Node(n.name.clone()),
                devices: (0..n.gpus).map(|i| gpu(ni, i, &n.model, shares)).collect(),
                shared_counters: BTreeMap::new(),
            })
        })
        .collect()
}

/// The slice of each node with its GPUs in MIG mode: per GPU `gpu-<i>`, the counter set
/// `gpu-<i>-mig` and the devices `gpu-<i>-mig-<profile>-<start>` (the GPU's attributes, with
/// `profile` and `placementStart`).
pub fn mig_slices(nodes: &[OpenbNode]) -> Vec<Option<Slice>> {
    use xpu_core::mig::{COMPUTE_SLICES, MEMORY_SLICES};
    let model = mig_model();
    nodes
        .iter()
        .enumerate()
        .map(|(ni, n)| {
            (n.gpus > 0).then(|| {
                let mut devices = Vec::new();
                let mut shared_counters = BTreeMap::new();
                for i in 0..n.gpus {
                    let set = format!("gpu-{i}-mig");
                    let mut counters: BTreeMap<String, u64> =
                        (0..MEMORY_SLICES).map(|m| (format!("memory-slice-{m}"), 1)).collect();
                    counters.insert("compute-slices".into(), u64::from(COMPUTE_SLICES));
                    counters.insert("media-extensions".into(), 1);
                    shared_counters.insert(set.clone(), counters);
                    let base = gpu(ni, i, &n.model, false);
                    for p in &model.profiles {
                        for &start in p.starts {
                            let mut draws: BTreeMap<String, u64> = (start..start + p.size)
                                .map(|m| (format!("memory-slice-{m}"), 1))
                                .collect();
                            draws.insert("compute-slices".into(), u64::from(p.compute));
                            if p.name.ends_with("+me") {
                                draws.insert("media-extensions".into(), 1);
                            }
                            let mut attributes = base.attributes.clone();
                            attributes.insert("profile".into(), Value::String(p.name.into()));
                            attributes
                                .insert("placementStart".into(), Value::Int(i64::from(start)));
                            devices.push(Device {
                                name: xpu_core::mig::device_name(
                                    &format!("gpu-{i}"),
                                    p.name,
                                    start,
                                ),
                                attributes,
                                consumes: BTreeMap::from([(set.clone(), draws)]),
                                ..Device::default()
                            });
                        }
                    }
                }
                Slice {
                    driver: DRIVER.into(),
                    pool: n.name.clone(),
                    generation: 1,
                    slice_count: 1,
                    scope: NodeScope::Node(n.name.clone()),
                    devices,
                    shared_counters,
                }
            })
        })
        .collect()
}

/// Selects the MIG devices of one profile.
#[derive(Debug)]
struct ProfileIs(&'static str);

impl Selector for ProfileIs {
    fn matches(&self, _: &DeviceId, device: &Device) -> Result<bool, String> {
        Ok(matches!(device.attributes.get("profile"), Some(Value::String(p)) if p == self.0))
    }
}

/// The claim of a GPU pod in the MIG replay: its profile, `num_gpu` of them for whole GPUs, with
/// the topology constraints of [`claim`].
pub fn mig_claim(pod: &OpenbPod) -> Option<Claim> {
    let mut c = claim(pod)?;
    let p = mig_profile(pod);
    let exact = &mut c.requests[0].alternatives[0].1;
    exact.capacity.clear();
    exact.selectors.push(Arc::new(ProfileIs(p.name)));
    Some(c)
}

fn gpu(node: usize, i: u16, model: &str, shares: bool) -> Device {
    let attributes = BTreeMap::from([
        ("model".to_owned(), Value::String(model.to_owned())),
        (PCIE_ROOT.to_owned(), Value::String(format!("pci{node:04x}:{:02x}", i / 2))),
        ("numaNode".to_owned(), Value::Int(i64::from(i / 4))),
    ]);
    Device {
        name: format!("gpu-{i}"),
        attributes,
        capacity: BTreeMap::from([(COMPUTE.to_owned(), 1000)]),
        allow_multiple: shares,
        ..Device::default()
    }
}

/// The claim of a GPU pod (`None` for a CPU-only pod).
pub fn claim(pod: &OpenbPod) -> Option<Claim> {
    if pod.num_gpu == 0 {
        return None;
    }
    let share = pod.num_gpu == 1 && pod.gpu_milli < 1000;
    let selectors: Vec<Arc<dyn Selector>> = if pod.gpu_spec.is_empty() {
        Vec::new()
    } else {
        vec![Arc::new(ModelIn(pod.gpu_spec.clone()))]
    };
    let capacity = if share {
        BTreeMap::from([(COMPUTE.to_owned(), u64::from(pod.gpu_milli))])
    } else {
        BTreeMap::new()
    };
    let exact = Exact {
        class: CLASS.into(),
        selectors,
        mode: Mode::Count(u32::from(pod.num_gpu)),
        admin_access: false,
        tolerations: Vec::new(),
        capacity,
        whole_group: false,
    };
    let together = match pod.num_gpu {
        2 => Some(PCIE_ROOT),
        3 | 4 => Some(NUMA),
        _ => None,
    };
    Some(Claim {
        name: pod.name.clone(),
        requests: vec![Request { name: "gpus".into(), alternatives: vec![(None, exact)] }],
        constraints: together
            .map(|a| Constraint {
                requests: Vec::new(),
                kind: ConstraintKind::MatchAttribute(a.into()),
            })
            .into_iter()
            .collect(),
    })
}

fn size_label(pod: &OpenbPod) -> String {
    if pod.num_gpu == 1 && pod.gpu_milli < 1000 { "share".into() } else { pod.num_gpu.to_string() }
}

/// A node's books, mirrored from the allocations so that nodes that cannot fit are skipped
/// without calling the allocator.
struct NodeBooks {
    cpu: u64,
    mem: u64,
    /// Per device: compute left, in thousandths.
    left: Vec<u32>,
}

impl NodeBooks {
    fn whole_free(&self) -> usize {
        self.left.iter().filter(|&&l| l == 1000).count()
    }
}

/// What a placed pod holds, to give back when it leaves.
struct Held {
    node: usize,
    cpu: u64,
    mem: u64,
    allocation: Option<Allocation>,
}

/// Runs one seed with `opts`.
pub fn run(nodes: &[OpenbNode], pods: &[OpenbPod], seed: u64, opts: DraOptions) -> DraRun {
    let shares = pods.iter().any(|p| p.num_gpu == 1 && p.gpu_milli < 1000);
    let slices = if opts.mig { mig_slices(nodes) } else { slices(nodes, shares) };
    let claims: Vec<Option<Claim>> =
        pods.iter().map(if opts.mig { mig_claim } else { claim }).collect();
    // What a share takes of its GPU: its request, or in MIG mode its profile's compute.
    let share_milli = |pod: &OpenbPod| {
        if opts.mig { profile_milli(mig_profile(pod)) } else { u32::from(pod.gpu_milli) }
    };
    let classes = HashMap::from([(
        CLASS.to_owned(),
        Class { name: CLASS.into(), selectors: Vec::new(), whole_group: false },
    )]);
    let limits = Limits { pack: opts.pack, ..Limits::default() };
    let cap: u64 = nodes.iter().map(|n| u64::from(n.gpus) * 1000).sum();
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    Rng::new(super::openb::rank_seed(seed)).shuffle(&mut order);
    let mut books: Vec<NodeBooks> = nodes
        .iter()
        .map(|n| NodeBooks {
            cpu: n.cpu_milli,
            mem: n.memory_mib,
            left: vec![1000; usize::from(n.gpus)],
        })
        .collect();
    let arrivals = if opts.load > 0.0 {
        // `workload` inflates to 1.3 × what it is given: four times the capacity arrives.
        super::openb::workload(pods, cap.saturating_mul(40) / 13, seed)
    } else {
        super::openb::workload(pods, cap, seed)
    };
    // Churn: lifetimes in arrivals, exponential with the mean that makes the offered load.
    let mean_request = arrivals.iter().map(|&i| pods[i].gpu_request()).sum::<u64>() as f64
        / arrivals.len().max(1) as f64;
    let mean_life = if mean_request > 0.0 { opts.load * cap as f64 / mean_request } else { 0.0 };
    let mut life_rng = Rng::new(seed ^ 0x11fe);
    let mut leaving: BinaryHeap<std::cmp::Reverse<(usize, usize)>> = BinaryHeap::new();
    let mut held: HashMap<usize, Held> = HashMap::new();
    let mut in_use = InUse::default();
    let mut out = DraRun {
        seed,
        claims: 0,
        placed: 0,
        gpu_milli_arrived: 0,
        gpu_milli_placed: 0,
        alloc_pct: 0.0,
        by_size: Vec::new(),
        refused_in_node: 0,
        double_booked: 0,
    };
    let mut by_size: BTreeMap<(u16, String), SizeCount> = BTreeMap::new();
    let empty = BTreeMap::new();
    for (step, &pi) in arrivals.iter().enumerate() {
        while let Some(&std::cmp::Reverse((at, id))) = leaving.peek() {
            if at > step {
                break;
            }
            leaving.pop();
            if let Some(h) = held.remove(&id) {
                let b = &mut books[h.node];
                b.cpu += h.cpu;
                b.mem += h.mem;
                if let Some(a) = &h.allocation {
                    in_use.remove(a);
                    for (i, milli) in taken(a) {
                        if let Some(l) = b.left.get_mut(i) {
                            *l = (*l + milli).min(1000);
                        }
                    }
                }
            }
        }
        let pod = &pods[pi];
        let claim = claims[pi].as_ref();
        let is_share = pod.num_gpu == 1 && pod.gpu_milli < 1000;
        let fits = |b: &NodeBooks, n: &OpenbNode| {
            b.cpu >= pod.cpu_milli
                && b.mem >= pod.memory_mib
                && (pod.num_gpu == 0
                    || (pod.gpu_spec.is_empty() || pod.gpu_spec.contains(&n.model))
                        && if is_share {
                            b.left.iter().any(|&l| l >= share_milli(pod))
                        } else {
                            b.whole_free() >= usize::from(pod.num_gpu)
                        })
        };
        let mut candidates: Vec<usize> =
            order.iter().copied().filter(|&ni| fits(&books[ni], &nodes[ni])).collect();
        // A stable sort keeps the seed's order among equals.
        match opts.node {
            NodeChoice::Tightest if claim.is_some() => {
                candidates.sort_by_key(|&ni| books[ni].whole_free());
            }
            NodeChoice::Spread => candidates.sort_by_key(|&ni| {
                // LeastAllocated: the mean free share of CPU and memory after the pod, 0–100.
                let (b, n) = (&books[ni], &nodes[ni]);
                let free =
                    |have: u64, want: u64, cap: u64| (have - want).saturating_mul(100) / cap.max(1);
                let score = (free(b.cpu, pod.cpu_milli, n.cpu_milli)
                    + free(b.mem, pod.memory_mib, n.memory_mib))
                    / 2;
                std::cmp::Reverse(score)
            }),
            _ => {}
        }
        let mut placed = None;
        for ni in candidates {
            let Some(c) = claim else {
                placed = Some((ni, None));
                break;
            };
            let Some(slice) = slices[ni].as_ref() else { continue };
            match dra::allocate(
                std::slice::from_ref(c),
                &classes,
                &[slice],
                &in_use,
                &nodes[ni].name,
                &empty,
                limits,
            ) {
                Ok(mut a) => {
                    placed = a.pop().map(|a| (ni, Some(a)));
                    break;
                }
                Err(_) => out.refused_in_node += 1,
            }
        }
        if claim.is_some() {
            out.claims += 1;
            out.gpu_milli_arrived += pod.gpu_request();
            by_size.entry((pod.num_gpu, size_label(pod))).or_default().arrived += 1;
        }
        let Some((ni, allocation)) = placed else { continue };
        let b = &mut books[ni];
        b.cpu -= pod.cpu_milli;
        b.mem -= pod.memory_mib;
        if let Some(a) = &allocation {
            in_use.add(a);
            for (i, milli) in taken(a) {
                if let Some(l) = b.left.get_mut(i) {
                    *l = l.saturating_sub(milli);
                }
            }
            out.placed += 1;
            out.gpu_milli_placed += pod.gpu_request();
            by_size.entry((pod.num_gpu, size_label(pod))).or_default().placed += 1;
        }
        if opts.load > 0.0 {
            let u = (life_rng.below(1 << 30) as f64 + 1.0) / (1u64 << 30) as f64;
            let life = (-u.ln() * mean_life).ceil().max(1.0) as usize;
            leaving.push(std::cmp::Reverse((step + life, step)));
        }
        held.insert(step, Held { node: ni, cpu: pod.cpu_milli, mem: pod.memory_mib, allocation });
    }
    out.double_booked =
        dra::double_booked(held.values().filter_map(|h| h.allocation.as_ref())).len();
    out.alloc_pct = if cap == 0 {
        0.0
    } else if opts.mig {
        // Exactly what the partitions hold: compute slices over the GPUs'.
        let slices: u64 =
            held.values().filter_map(|h| h.allocation.as_ref()).map(mig_compute).sum();
        100.0 * slices as f64 / (cap / 1000 * u64::from(xpu_core::mig::COMPUTE_SLICES)) as f64
    } else {
        let used: u64 = books.iter().flat_map(|b| &b.left).map(|&l| u64::from(1000 - l)).sum();
        100.0 * used as f64 / cap as f64
    };
    out.by_size = by_size.into_iter().map(|((_, size), c)| SizeCount { size, ..c }).collect();
    out
}

/// The profile of a MIG device (`gpu-0-mig-3g-71gb-4`).
fn profile_of(device: &str) -> Option<&'static xpu_core::mig::Profile> {
    let (_, label, _) = xpu_core::mig::parse_device_name(device)?;
    mig_model().profile_by_label(label)
}

/// Compute slices the MIG devices of an allocation hold.
fn mig_compute(a: &Allocation) -> u64 {
    a.devices.iter().filter_map(|d| profile_of(&d.id.device)).map(|p| u64::from(p.compute)).sum()
}

/// The devices of an allocation by GPU index on their node, with the compute each took (a MIG
/// device's: its profile's).
fn taken(a: &Allocation) -> impl Iterator<Item = (usize, u32)> + '_ {
    a.devices.iter().filter_map(|d| {
        if let Some((gpu, _, _)) = xpu_core::mig::parse_device_name(&d.id.device) {
            let i = gpu.strip_prefix("gpu-")?.parse().ok()?;
            return Some((i, profile_milli(profile_of(&d.id.device)?)));
        }
        let rest = d.id.device.strip_prefix("gpu-")?;
        let i = rest.parse().ok()?;
        let milli = d.consumed.as_ref().and_then(|c| c.get(COMPUTE)).copied().unwrap_or(1000);
        Some((i, u32::try_from(milli).unwrap_or(1000)))
    })
}

/// One setting's runs summed up: means over the seeds, and per claim size what arrived and was
/// placed, summed over them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DraSummary {
    pub claims: f64,
    pub placed: f64,
    pub placed_pct: f64,
    pub gpu_placed_pct: f64,
    pub alloc_pct: f64,
    pub by_size: Vec<SizeCount>,
}

/// [`DraSummary`] of `runs` (figures rounded to two decimals).
pub fn summarize(runs: &[DraRun]) -> DraSummary {
    let n = runs.len().max(1) as f64;
    let mean =
        |f: fn(&DraRun) -> f64| (runs.iter().map(f).sum::<f64>() / n * 100.0).round() / 100.0;
    let mut by_size: Vec<SizeCount> = Vec::new();
    for c in runs.iter().flat_map(|r| &r.by_size) {
        match by_size.iter_mut().find(|s| s.size == c.size) {
            Some(s) => {
                s.arrived += c.arrived;
                s.placed += c.placed;
            }
            None => by_size.push(c.clone()),
        }
    }
    DraSummary {
        claims: mean(|r| r.claims as f64),
        placed: mean(|r| r.placed as f64),
        placed_pct: mean(|r| 100.0 * r.placed as f64 / r.claims.max(1) as f64),
        gpu_placed_pct: mean(|r| {
            100.0 * r.gpu_milli_placed as f64 / r.gpu_milli_arrived.max(1) as f64
        }),
        alloc_pct: mean(|r| r.alloc_pct),
        by_size,
    }
}

/// Runs every setting of `settings` with every seed, spread over `threads` threads; results per
/// setting, seeds in the order given.
pub fn run_all(
    nodes: &[OpenbNode],
    pods: &[OpenbPod],
    settings: &[DraOptions],
    seeds: &[u64],
    threads: usize,
) -> Vec<(DraOptions, Vec<DraRun>)> {
    let jobs: Vec<(usize, u64)> =
        (0..settings.len()).flat_map(|k| seeds.iter().map(move |&s| (k, s))).collect();
    let done = super::parallel(&jobs, threads, |&(k, seed)| run(nodes, pods, seed, settings[k]));
    let mut out: Vec<(DraOptions, Vec<DraRun>)> =
        settings.iter().map(|&s| (s, Vec::with_capacity(seeds.len()))).collect();
    for (i, r) in done.into_iter().enumerate() {
        out[i / seeds.len().max(1)].1.push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(i: usize, gpus: u16, model: &str) -> OpenbNode {
        OpenbNode {
            name: format!("n{i:03}"),
            cpu_milli: 64_000,
            memory_mib: 262_144,
            gpus,
            model: model.into(),
        }
    }

    fn pod(i: usize, num_gpu: u16, gpu_milli: u16, spec: &[&str]) -> OpenbPod {
        OpenbPod {
            name: format!("p{i:05}"),
            cpu_milli: 4_000,
            memory_mib: 8_192,
            num_gpu,
            gpu_milli,
            gpu_spec: spec.iter().map(|s| s.to_string()).collect(),
            creation_time: None,
            deletion_time: None,
            scheduled_time: None,
        }
    }

    /// A random mixed cluster and workload: every setting places within bounds, never books a
    /// device twice, and gives the same figures twice for one seed.
    #[test]
    fn every_setting_stays_within_the_books_and_is_deterministic() {
        let mut rng = Rng::new(7);
        let nodes: Vec<OpenbNode> = (0..40)
            .map(|i| {
                let gpus = [0u16, 1, 2, 4, 8][rng.index(5)];
                node(i, gpus, ["A", "B"][rng.index(2)])
            })
            .collect();
        let pods: Vec<OpenbPod> = (0..300)
            .map(|i| match rng.index(6) {
                0 => pod(i, 0, 0, &[]),
                1 => pod(i, 1, 100 + 100 * rng.below(9) as u16, &[]),
                2 => pod(i, 2, 1000, &[]),
                3 => pod(i, 4, 1000, &["A"]),
                4 => pod(i, 8, 1000, &[]),
                _ => pod(i, 1, 1000, &["B"]),
            })
            .collect();
        for (load, mig) in [(0.0, false), (0.9, false), (0.0, true), (0.9, true)] {
            for node in [NodeChoice::First, NodeChoice::Tightest, NodeChoice::Spread] {
                for pack in [false, true] {
                    let opts = DraOptions { node, pack, load, mig };
                    let r = run(&nodes, &pods, 3, opts);
                    assert_eq!(r.double_booked, 0, "{opts:?}");
                    assert!(r.placed <= r.claims && r.placed > 0, "{opts:?}: {r:?}");
                    assert!(r.alloc_pct <= 100.0 + 1e-9, "{opts:?}: {}", r.alloc_pct);
                    let arrived: u64 = r.by_size.iter().map(|s| s.arrived).sum();
                    assert_eq!(arrived, r.claims);
                    assert_eq!(r, run(&nodes, &pods, 3, opts), "{opts:?} is not deterministic");
                }
            }
        }
    }

    /// Claims carry the topology the sizes ask for: two GPUs on one PCIe root, four on one NUMA
    /// node, a share as compute capacity, models as a selector.
    #[test]
    fn claims_ask_for_the_topology_of_their_size() {
        let kind = |c: &Claim| c.constraints.first().map(|c| c.kind.clone());
        let two = claim(&pod(0, 2, 1000, &[])).unwrap();
        assert_eq!(kind(&two), Some(ConstraintKind::MatchAttribute(PCIE_ROOT.into())));
        let four = claim(&pod(1, 4, 1000, &["A"])).unwrap();
        assert_eq!(kind(&four), Some(ConstraintKind::MatchAttribute(NUMA.into())));
        assert_eq!(four.requests[0].alternatives[0].1.selectors.len(), 1);
        let share = claim(&pod(2, 1, 300, &[])).unwrap();
        assert_eq!(share.requests[0].alternatives[0].1.capacity.get(COMPUTE), Some(&300));
        assert!(claim(&pod(3, 0, 0, &[])).is_none());
        let s = slices(&[node(0, 8, "A")], true);
        let d = &s[0].as_ref().unwrap().devices;
        assert_eq!(d[2].attributes.get("numaNode"), Some(&Value::Int(0)));
        assert_eq!(d[5].attributes.get("numaNode"), Some(&Value::Int(1)));
        assert_eq!(d[4].attributes.get(PCIE_ROOT), d[5].attributes.get(PCIE_ROOT));
        assert_ne!(d[3].attributes.get(PCIE_ROOT), d[4].attributes.get(PCIE_ROOT));
    }

    /// Shares ask for the smallest profile whose compute holds them, whole GPUs for the whole
    /// GPU; the MIG slices have a counter set per GPU and a device per profile and placement.
    #[test]
    fn mig_claims_ask_for_the_profile_that_holds_the_share() {
        let names: Vec<&str> = [100, 142, 200, 285, 300, 500, 571, 600, 1000]
            .iter()
            .map(|&m| mig_profile(&pod(0, 1, m, &[])).name)
            .collect();
        assert_eq!(
            names,
            [
                "1g.18gb", "1g.18gb", "2g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "4g.71gb",
                "7g.141gb", "7g.141gb"
            ]
        );
        assert_eq!(mig_profile(&pod(0, 2, 1000, &[])).name, "7g.141gb");
        let s = mig_slices(&[node(0, 2, "A")]);
        let s = s[0].as_ref().unwrap();
        assert_eq!(s.shared_counters.len(), 2);
        // H200: 7 (1g) + 7 (1g+me) + 4 (1g.35gb) + 3 (2g) + 2 (3g) + 1 (4g) + 1 (7g) per GPU.
        assert_eq!(
            s.devices.len(),
            2 * 25,
            "{:?}",
            s.devices.iter().map(|d| &d.name).collect::<Vec<_>>()
        );
        let c = mig_claim(&pod(1, 1, 300, &["A"])).unwrap();
        assert_eq!(c.requests[0].alternatives[0].1.selectors.len(), 2);
        assert!(c.requests[0].alternatives[0].1.capacity.is_empty());
    }
}
