//! xpu's default placement policy: *FGD first, stranding on FGD's ties*.
//!
//! FGD (Weng et al., ATC '23) places a task where the GPU capacity the typical task mix could not
//! use grows least, squashing that change through a sigmoid and truncating it to an integer
//! score. The truncation makes FGD tie often — nodes within about 40 milli-GPU of each other near
//! zero, several hundred farther out — and a tie goes to the first node in a fixed order, which is
//! what makes FGD pack. xpu keeps FGD's decision wherever FGD has one and changes only how its
//! ties are broken:
//!
//! 1. **FGD's score first.** A node FGD scores higher always wins. xpu never overrules FGD.
//! 2. **Then stranding, measured more completely than FGD does.** FGD asks, per typical task,
//!    whether a free GPU slice is big enough for it at all, and ignores memory. Among the nodes
//!    FGD ties, xpu prefers the one where the GPU capacity that *streams* of the typical tasks
//!    could not turn into allocation grows least: for each typical task, the free milli left
//!    after packing as many copies as the node's GPUs, CPU **and memory** allow (700 milli free
//!    holds one 500-milli task and strands 200; four free GPUs on a node with CPU for one more
//!    task strand three). Multi-GPU typical tasks keep FGD's all-or-nothing rule. This measure
//!    is blended 3:1 with FGD's own, so it refines FGD's view rather than replacing it.
//! 3. **Differences below 150 milli-GPU are not differences.** The stranding change is
//!    compared in 150-milli bands; within a band the node order decides, as in FGD, so the
//!    policy keeps FGD's packing wherever the extra information is too small to trust. A share
//!    goes to the GPU that scores best, the fullest on ties.
//!
//! **Why this generalizes.** Nothing here is fitted to a workload: the typical mix is the one
//! FGD estimates from the tasks themselves, and the policy can only reorder choices FGD considers
//! equal, so on a workload where stranding carries no information it degrades to FGD's own
//! order rather than below it. The earlier design (a half-and-half blend in uniform 75-milli
//! bands, with no FGD-first rule) won on the five traces it was tuned on and lost up to 0.3
//! points on workloads it was not: it overruled FGD's strict preferences, which on traces with
//! many 8-GPU tasks cost whole empty nodes. The two constants (3:1, 150 milli) were chosen among
//! nine FGD-first candidates by the largest worst-case margin over FGD on the five real OpenB
//! traces and the paper's sixteen synthetic variants drawn with one seed
//! ([`crate::sim::variant`]), then confirmed on variants drawn with another seed, which the
//! choice never saw; the leave-one-trace-out choice is the same on every fold. All FGD-first
//! candidates beat FGD on every real trace; what separates them is the worst synthetic row.
//! `cargo run --release -p xpu-sched --example policy_eval -- --loo` repeats the evaluation.

use xpu_core::DeviceKind;

use crate::cluster::{ANY_MODEL, Cluster, MILLI, Node};
use crate::hash::FxHashMap;
use crate::placement::{Demand, Policy, chosen_or_picked, device_matches};
use crate::rng::Rng;

use super::fgd::{
    CopyTables, ShareView, TaskMix, gpu_view, measures_of, share_views, shift_views, sigmoid,
};

/// How the two measures make a score (the evaluation tool compares these).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Combine {
    /// `floor(Δm / band)` of the blended measure `m`.
    Bands,
    /// FGD's own score first (`int(sigmoid(Δfgd/1000)·100)`), the blended bands only among
    /// nodes FGD ties.
    FgdFirst,
}

/// The policy's knobs. [`XpuParams::default`] is what `--policy xpu` runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct XpuParams {
    /// Weight of the stranding measure in the blend (the rest is FGD's measure).
    pub strand_weight: f64,
    /// Width of a score band, in milli-GPU of fragmentation change.
    pub band: f64,
    pub combine: Combine,
}

impl Default for XpuParams {
    fn default() -> Self {
        Self { strand_weight: 0.75, band: 150.0, combine: Combine::FgdFirst }
    }
}

/// xpu's default policy.
#[derive(Debug, Clone)]
pub struct XpuPolicy {
    mix: TaskMix,
    tabs: CopyTables,
    params: XpuParams,
    buf: Vec<u16>,
    views: Vec<ShareView>,
    /// Whether `views` holds the views of the node being evaluated.
    views_taken: bool,
    /// The node's views with one placement applied (scratch).
    after_views: Vec<ShareView>,
    /// The measures of each class's own state for GPU demands that may use any model (the same
    /// for every such demand: the measures do not depend on the order of the GPUs), by class
    /// id; NaN where not computed. Valid for one (cluster, class numbering), `before_epoch`.
    before: Vec<(f64, f64)>,
    before_epoch: (u64, u64),
    /// The measures of every node state scored so far, by [`StateKey`]: most "after" states
    /// recur (2.4 million evaluations of 95,000 distinct states at 10,000 × 8 GPUs), and a
    /// lookup costs a fraction of the pass over the mix. Bounded by [`STATE_CACHE_MAX`].
    states: FxHashMap<StateKey, (f64, f64)>,
}

/// A node state as the measures see it, in 32 bytes so that the cache stays small: the GPU
/// model, the GPU count and the GPUs' free milli as a multiset (sorted, 10 bits each), then
/// free CPU and free memory (32 bits each). The measures do not depend on the GPUs' order, so
/// states that differ only in it share an entry.
type StateKey = (u128, u64);

/// Most GPUs a state key packs (8 + 4 + 11 × 10 bits); nodes with more are measured uncached.
const STATE_KEY_GPUS: usize = 11;

/// Entries the state cache holds before it is cleared (about 6 MiB at most).
const STATE_CACHE_MAX: usize = 1 << 17;

/// The key of `gpus` (free milli, any order) after taking `take` from each GPU at
/// `positions`; `None` when the node has more GPUs, CPU or memory than a key packs.
fn state_key(
    gpus: &[u16],
    positions: impl IntoIterator<Item = usize>,
    take: u16,
    cpu: u64,
    mem: u64,
    model: u8,
) -> Option<StateKey> {
    if gpus.len() > STATE_KEY_GPUS {
        return None;
    }
    let (cpu, mem) = (u32::try_from(cpu).ok()?, u32::try_from(mem).ok()?);
    let mut free = [0u16; STATE_KEY_GPUS];
    let free = &mut free[..gpus.len()];
    free.copy_from_slice(gpus);
    for k in positions {
        free[k] -= take;
    }
    free.sort_unstable();
    let mut packed = (u128::from(model) << 4) | gpus.len() as u128;
    for &g in free.iter() {
        packed = (packed << 10) | u128::from(g.min(MILLI));
    }
    Some((packed, (u64::from(cpu) << 32) | u64::from(mem)))
}

impl XpuPolicy {
    pub fn new(mix: TaskMix) -> Self {
        Self::with_params(mix, XpuParams::default())
    }

    pub fn with_params(mix: TaskMix, params: XpuParams) -> Self {
        let tabs = CopyTables::new(&mix);
        Self {
            mix,
            tabs,
            params,
            buf: Vec::new(),
            views: Vec::new(),
            views_taken: false,
            after_views: Vec::new(),
            before: Vec::new(),
            before_epoch: (0, 0),
            states: FxHashMap::default(),
        }
    }

    pub fn mix(&self) -> &TaskMix {
        &self.mix
    }

    /// The score of going from `before` to `after` (each `(fgd, stranded)`).
    fn score_of(&self, before: (f64, f64), after: (f64, f64)) -> f64 {
        let w = self.params.strand_weight;
        let m = |x: (f64, f64)| (1.0 - w) * x.0 + w * x.1;
        let delta = m(before) - m(after);
        match self.params.combine {
            Combine::Bands => (delta / self.params.band).floor(),
            Combine::FgdFirst => {
                let fgd = (sigmoid((before.0 - after.0) / 1000.0) * 100.0).trunc();
                let band = if self.params.band > 0.0 {
                    self.params.band
                } else {
                    // The width, in milli-GPU of Δ, of FGD's integer score `fgd`.
                    let logit = |p: f64| (p / (1.0 - p)).ln();
                    let lo = (fgd / 100.0).max(0.005);
                    let hi = ((fgd + 1.0) / 100.0).min(0.995);
                    1000.0 * (logit(hi) - logit(lo)).max(0.01)
                };
                fgd * 1e6 + (delta / band).floor()
            }
        }
    }

    /// The measures of `node`'s current state as `d` sees it (`gpus`: the free milli of the
    /// GPUs it may use, `total` in all).
    fn before(
        &mut self,
        cluster: &Cluster,
        node: &Node,
        d: &Demand,
        gpus: &[u16],
        total: u64,
        model: u8,
    ) -> (f64, f64) {
        let measure = |p: &mut Self| {
            p.after(gpus, std::iter::empty(), 0, total, node.cpu_free, node.mem_free, model)
        };
        let class = node.class as usize;
        if d.models != ANY_MODEL || d.kind != DeviceKind::Gpu || class == u32::MAX as usize {
            return measure(self);
        }
        let epoch = (cluster.uid.0, cluster.class_epoch);
        if epoch != self.before_epoch {
            self.before.clear();
            self.before_epoch = epoch;
        }
        if self.before.len() <= class {
            self.before.resize(cluster.classes.len().max(class + 1), (f64::NAN, f64::NAN));
        }
        if self.before[class].0.is_nan() {
            self.before[class] = measure(self);
        }
        self.before[class]
    }

    /// The share views of the node being evaluated (`gpus`), taken once per evaluation and
    /// only when some state misses the cache.
    fn views_of(&mut self, gpus: &[u16]) {
        if !self.views_taken {
            share_views(&self.tabs, gpus, &mut self.views);
            self.views_taken = true;
        }
    }

    /// The measures after taking `take` milli from each GPU at `positions` of `gpus` (free
    /// milli, `total` in all), from the state cache when the state was measured before.
    #[allow(clippy::too_many_arguments)]
    fn after(
        &mut self,
        gpus: &[u16],
        positions: impl IntoIterator<Item = usize> + Clone,
        take: u16,
        total: u64,
        cpu: u64,
        mem: u64,
        model: u8,
    ) -> (f64, f64) {
        if total == 0 {
            return (0.0, 0.0); // no GPU capacity to fragment (`measures_of`'s own answer)
        }
        let key = state_key(gpus, positions.clone(), take, cpu, mem, model);
        if let Some(m) = key.and_then(|k| self.states.get(&k)) {
            return *m;
        }
        let m = self.measure_after(gpus, positions, take, total, cpu, mem, model);
        if let Some(k) = key {
            if self.states.len() >= STATE_CACHE_MAX {
                self.states.clear();
            }
            self.states.insert(k, m);
        }
        m
    }

    /// [`Self::after`] without the cache: the node's views (`self.views`) shifted rather than
    /// recomputed.
    #[allow(clippy::too_many_arguments)]
    fn measure_after(
        &mut self,
        gpus: &[u16],
        positions: impl IntoIterator<Item = usize>,
        take: u16,
        mut total: u64,
        cpu: u64,
        mem: u64,
        model: u8,
    ) -> (f64, f64) {
        self.views_of(gpus);
        self.after_views.clone_from(&self.views);
        for k in positions {
            shift_views(&self.tabs, &mut self.after_views, gpus[k], gpus[k] - take);
            total -= u64::from(take);
        }
        measures_of(&self.mix, &self.tabs, &self.after_views, cpu, mem, total, model)
    }

    /// (score, device index for a share).
    fn evaluate(&mut self, cluster: &Cluster, node: &Node, d: &Demand) -> (f64, Option<usize>) {
        let mut gpus = std::mem::take(&mut self.buf);
        let model = gpu_view(node, d, &mut gpus);
        self.views_taken = false;
        let total: u64 = gpus.iter().map(|&g| u64::from(g)).sum();
        let before = self.before(cluster, node, d, &gpus, total, model);
        let cpu = node.cpu_free - d.cpu_milli;
        let mem = node.mem_free - d.memory_mib;
        let result = if d.is_shared() {
            // (score, fullness after, position in `gpus`)
            let mut best: Option<(f64, u16, usize)> = None;
            for k in 0..gpus.len() {
                // GPUs with equal free capacity leave equal states (the first one is kept, as
                // on ties): evaluate each value once.
                if gpus[k] >= d.milli && !gpus[..k].contains(&gpus[k]) {
                    let after = self.after(&gpus, [k], d.milli, total, cpu, mem, model);
                    let s = self.score_of(before, after);
                    let fullness = MILLI - (gpus[k] - d.milli);
                    if best.is_none_or(|(b, f, _)| s > b || (s == b && fullness > f)) {
                        best = Some((s, fullness, k));
                    }
                }
            }
            match best {
                Some((s, _, k)) => {
                    let idx = (0..node.devices.len())
                        .filter(|&i| node.devices[i].kind == d.kind && device_matches(node, i, d))
                        .nth(k);
                    (s, idx)
                }
                None => (f64::NEG_INFINITY, None),
            }
        } else {
            // Whole devices: the ones the default NVLink/NUMA-aware choice would take (the
            // lowest-index free ones on nodes without topology information).
            let taken = (0..gpus.len()).filter(|&k| gpus[k] >= d.milli).take(usize::from(d.count));
            let after = self.after(&gpus, taken, d.milli, total, cpu, mem, model);
            (self.score_of(before, after), None)
        };
        self.buf = gpus;
        result
    }
}

impl Policy for XpuPolicy {
    fn name(&self) -> &'static str {
        "xpu"
    }
    fn score(&mut self, cluster: &Cluster, node: &Node, d: &Demand) -> f64 {
        self.evaluate(cluster, node, d).0
    }
    fn devices(
        &mut self,
        cluster: &Cluster,
        node: &Node,
        d: &Demand,
        _: &mut Rng,
        out: &mut Vec<u16>,
    ) {
        let chosen = self.evaluate(cluster, node, d).1;
        chosen_or_picked(chosen, node, d, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// A state's key does not depend on the GPUs' order, and a cached measure equals one taken
    /// afresh, for random states and placements.
    #[test]
    fn cached_measures_equal_fresh_ones_in_any_gpu_order() {
        let demands: Vec<Demand> = [100u16, 250, 500, 700]
            .iter()
            .map(|&m| Demand::share(2000, 8000, DeviceKind::Gpu, m))
            .chain((1..=4).map(|n| Demand::whole(4000, 16_000, DeviceKind::Gpu, n)))
            .chain([Demand::cpu(8000, 32_000)])
            .collect();
        let mix = TaskMix::from_demands(&demands, 1.0);
        let mut cached = XpuPolicy::new(mix.clone());
        let mut rng = Rng::new(3);
        for _ in 0..5000 {
            let n = rng.index(STATE_KEY_GPUS + 3);
            let gpus: Vec<u16> =
                (0..n).map(|_| [0u16, 100, 300, 500, 1000][rng.index(5)]).collect();
            let take = [0u16, 100, 300][rng.index(3)];
            let positions: Vec<usize> =
                (0..n).filter(|&k| gpus[k] >= take && rng.below(3) == 0).collect();
            let total: u64 = gpus.iter().map(|&g| u64::from(g)).sum();
            let (cpu, mem) = (rng.below(64_000), rng.below(256_000));
            let mut fresh = XpuPolicy::new(mix.clone());
            let want =
                fresh.measure_after(&gpus, positions.iter().copied(), take, total, cpu, mem, 0);
            for _ in 0..2 {
                cached.views_taken = false;
                let got = cached.after(&gpus, positions.iter().copied(), take, total, cpu, mem, 0);
                assert_eq!(got, want, "{gpus:?} take {take} at {positions:?}");
            }
            // The same state with its GPUs in another order has the same key.
            let mut after: Vec<u16> = gpus.clone();
            for &k in &positions {
                after[k] -= take;
            }
            let mut shuffled = after.clone();
            rng.shuffle(&mut shuffled);
            let key = state_key(&after, std::iter::empty(), 0, cpu, mem, 0);
            assert_eq!(key, state_key(&shuffled, std::iter::empty(), 0, cpu, mem, 0));
            assert_eq!(key, state_key(&gpus, positions.iter().copied(), take, cpu, mem, 0));
            assert_eq!(key.is_some(), n <= STATE_KEY_GPUS);
        }
    }
}
