//! Fragmentation Gradient Descent (FGD, Weng et al., USENIX ATC '23).
//!
//! A node's *fragmentation* is the GPU capacity the typical task mix could not use there: for
//! each typical task shape (weighted by its frequency), the node's free GPU milli counts as
//! fragmented if the task cannot run on the node at all (lacking GPU, CPU or the right model),
//! and otherwise only the free milli on GPUs too small for it counts. FGD places a task where
//! fragmentation grows least. As in the artifact (`fgd_score.go`, `utils/frag.go`), the score is
//! `int(sigmoid((before - after) / 1000) * 100)`, a share goes to the GPU that scores best
//! (lowest index on ties), and whole GPUs are the lowest-index free ones.
//!
//! The typical mix is the frequency table of task shapes (CPU milli, GPU milli per GPU, GPU
//! count, allowed models) of the workload, CPU-only tasks included, keeping the most frequent
//! shapes that together reach 95 % of the tasks and renormalising.

use crate::cluster::{ANY_MODEL, Cluster, MILLI, ModelMask, Node};
use crate::placement::{Demand, Policy, chosen_or_picked, device_matches};
use crate::rng::Rng;

/// One task shape of the typical mix.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TypicalTask {
    pub cpu_milli: u64,
    /// Mean memory of the tasks of this shape (FGD itself ignores memory).
    pub memory_mib: u64,
    /// Per GPU; 0 for CPU-only tasks.
    pub milli: u16,
    pub count: u16,
    pub models: ModelMask,
    /// Frequency, summing to 1 over the mix.
    pub freq: f64,
}

/// A typical task's shape: CPU milli, GPU milli per GPU, GPU count, allowed models.
type ShapeKey = (u64, u16, u16, ModelMask);

/// The typical task mix FGD measures fragmentation against.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskMix {
    pub tasks: Vec<TypicalTask>,
}

impl TaskMix {
    /// Builds the mix from a workload's demands, keeping the most frequent shapes until they
    /// cover `coverage` (0.95 in the paper) of all tasks.
    pub fn from_demands<'a>(demands: impl IntoIterator<Item = &'a Demand>, coverage: f64) -> Self {
        // (shape, tasks, summed memory)
        let mut counts: Vec<(ShapeKey, u64, u64)> = Vec::new();
        let mut index = crate::hash::FxHashMap::<ShapeKey, usize>::default();
        let mut total = 0u64;
        for d in demands {
            let key = (d.cpu_milli, if d.count == 0 { 0 } else { d.milli }, d.count, d.models);
            match index.get(&key) {
                Some(&i) => {
                    counts[i].1 += 1;
                    counts[i].2 += d.memory_mib;
                }
                None => {
                    index.insert(key, counts.len());
                    counts.push((key, 1, d.memory_mib));
                }
            }
            total += 1;
        }
        if total == 0 {
            return Self::default();
        }
        // Most frequent first; ties in the artifact's (reversed) shape order.
        counts.sort_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)));
        let want = coverage * total as f64;
        let mut kept = Vec::new();
        let mut cum = 0u64;
        for &(key, n, mem) in &counts {
            if cum as f64 >= want {
                break;
            }
            cum += n;
            kept.push((key, n, mem));
        }
        let tasks = kept
            .into_iter()
            .map(|((cpu_milli, milli, count, models), n, mem)| TypicalTask {
                cpu_milli,
                memory_mib: mem / n,
                milli,
                count,
                models,
                freq: n as f64 / cum as f64,
            })
            .collect();
        Self { tasks }
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}

/// Fragmentation of a node state (free CPU and per-GPU free milli) under a mix, in GPU milli.
/// `model` is the model id of the node's GPUs (u8::MAX when it has none).
pub(crate) fn fragmentation(mix: &TaskMix, cpu_free: u64, gpus: &[u16], model: u8) -> f64 {
    let total: u64 = gpus.iter().map(|&g| u64::from(g)).sum();
    if total == 0 {
        return 0.0;
    }
    let mut frag = 0.0;
    for t in &mix.tasks {
        let fragmented = if t.milli == 0
            || model == u8::MAX
            || (t.models != ANY_MODEL && (t.models >> model) & 1 == 0)
        {
            // CPU-only tasks and tasks that may not use this model leave every free GPU idle.
            total
        } else {
            let mut usable = 0u16;
            let mut small = 0u64;
            for &g in gpus {
                if g >= t.milli {
                    usable += 1;
                } else {
                    small += u64::from(g);
                }
            }
            if usable >= t.count && cpu_free >= t.cpu_milli { small } else { total }
        };
        frag += t.freq * fragmented as f64;
    }
    frag
}

/// Capacity-based fragmentation (xpu's policy): for each typical task, the free GPU milli a
/// stream of that task alone could *not* turn into allocation on this node — what is left after
/// packing as many copies as the GPUs, CPU and memory allow. Multi-GPU typical tasks keep FGD's
/// rule (all or none of the free GPUs count), which guards whole empty nodes better.
#[cfg(test)]
pub(crate) fn stranded(
    mix: &TaskMix,
    cpu_free: u64,
    mem_free: u64,
    gpus: &[u16],
    model: u8,
) -> f64 {
    let total: u64 = gpus.iter().map(|&g| u64::from(g)).sum();
    if total == 0 {
        return 0.0;
    }
    let mut frag = 0.0;
    for t in &mix.tasks {
        let usable = if t.milli == 0
            || model == u8::MAX
            || (t.models != ANY_MODEL && (t.models >> model) & 1 == 0)
        {
            0
        } else if t.count > 1 {
            let mut usable = 0u16;
            let mut small = 0u64;
            for &g in gpus {
                if g >= t.milli {
                    usable += 1;
                } else {
                    small += u64::from(g);
                }
            }
            if usable >= t.count && cpu_free >= t.cpu_milli { total - small } else { 0 }
        } else {
            let mut by_gpu = 0u64;
            for &g in gpus {
                by_gpu += u64::from(g / t.milli);
            }
            let by_gpu = if t.count > 1 { by_gpu / u64::from(t.count) } else { by_gpu };
            let by_cpu = cpu_free.checked_div(t.cpu_milli).unwrap_or(u64::MAX);
            let by_mem = mem_free.checked_div(t.memory_mib).unwrap_or(u64::MAX);
            by_gpu.min(by_cpu).min(by_mem) * u64::from(t.count) * u64::from(t.milli)
        };
        frag += t.freq * total.saturating_sub(usable) as f64;
    }
    frag
}

/// Per distinct GPU share of the typical tasks, `floor(free / milli)` for every free value
/// 0..=1000 (the copies one GPU holds, looked up instead of divided on the hot path), and which
/// of these each task uses. Tasks with the same share see the same GPUs the same way, so the
/// per-GPU pass runs once per distinct share, not once per task.
#[derive(Debug, Clone, Default)]
pub(crate) struct CopyTables {
    /// (milli, copies per free value)
    groups: Vec<(u16, Box<[u8; 1001]>)>,
    /// Per task of the mix: index into `groups`, `usize::MAX` for CPU-only tasks.
    group_of: Vec<usize>,
}

impl CopyTables {
    pub(crate) fn new(mix: &TaskMix) -> Self {
        let mut groups: Vec<(u16, Box<[u8; 1001]>)> = Vec::new();
        let mut group_of = Vec::with_capacity(mix.tasks.len());
        for t in &mix.tasks {
            if t.milli == 0 {
                group_of.push(usize::MAX);
                continue;
            }
            let g = match groups.iter().position(|(m, _)| *m == t.milli) {
                Some(g) => g,
                None => {
                    let mut tab = Box::new([0u8; 1001]);
                    for (free, slot) in tab.iter_mut().enumerate() {
                        *slot = (free / usize::from(t.milli)).min(255) as u8;
                    }
                    groups.push((t.milli, tab));
                    groups.len() - 1
                }
            };
            group_of.push(g);
        }
        Self { groups, group_of }
    }
}

/// What one distinct share sees on a node: GPUs with at least that much free, the free milli
/// on the others, and the copies all GPUs hold.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ShareView {
    usable: u16,
    small: u64,
    copies: u64,
}

/// FGD's [`fragmentation`] and xpu's [`stranded`] in one pass, as `(fgd, stranded)`: what
/// xpu's policy computes through [`share_views`] and [`measures_of`], held to the two plain
/// functions by a unit test. `views` is scratch space.
#[cfg(test)]
pub(crate) fn both_measures(
    mix: &TaskMix,
    tabs: &CopyTables,
    views: &mut Vec<ShareView>,
    cpu_free: u64,
    mem_free: u64,
    gpus: &[u16],
    model: u8,
) -> (f64, f64) {
    share_views(tabs, gpus, views);
    let total: u64 = gpus.iter().map(|&g| u64::from(g)).sum();
    measures_of(mix, tabs, views, cpu_free, mem_free, total, model)
}

/// What each distinct share of the mix sees on GPUs with free milli `gpus`.
pub(crate) fn share_views(tabs: &CopyTables, gpus: &[u16], views: &mut Vec<ShareView>) {
    views.clear();
    for (milli, tab) in &tabs.groups {
        let mut v = ShareView::default();
        for &g in gpus {
            if g >= *milli {
                v.usable += 1;
            } else {
                v.small += u64::from(g);
            }
            v.copies += u64::from(tab[usize::from(g.min(1000))]);
        }
        views.push(v);
    }
}

/// Updates `views` for one GPU whose free milli goes from `from` to `to`, without another pass
/// over the node's GPUs.
pub(crate) fn shift_views(tabs: &CopyTables, views: &mut [ShareView], from: u16, to: u16) {
    for ((milli, tab), v) in tabs.groups.iter().zip(views.iter_mut()) {
        if from >= *milli {
            v.usable -= 1;
        } else {
            v.small -= u64::from(from);
        }
        if to >= *milli {
            v.usable += 1;
        } else {
            v.small += u64::from(to);
        }
        v.copies -= u64::from(tab[usize::from(from.min(1000))]);
        v.copies += u64::from(tab[usize::from(to.min(1000))]);
    }
}

/// The two measures from views already taken (`total`: the GPUs' free milli in all).
pub(crate) fn measures_of(
    mix: &TaskMix,
    tabs: &CopyTables,
    views: &[ShareView],
    cpu_free: u64,
    mem_free: u64,
    total: u64,
    model: u8,
) -> (f64, f64) {
    if total == 0 {
        return (0.0, 0.0);
    }
    let (mut frag, mut strand_sum) = (0.0, 0.0);
    for (t, &g) in mix.tasks.iter().zip(&tabs.group_of) {
        let (fgd, strand) = if g == usize::MAX
            || model == u8::MAX
            || (t.models != ANY_MODEL && (t.models >> model) & 1 == 0)
        {
            (total, total)
        } else {
            let v = views[g];
            let fgd = if v.usable >= t.count && cpu_free >= t.cpu_milli { v.small } else { total };
            let strand = if t.count > 1 {
                fgd
            } else {
                // Copies the GPUs hold, cut to what CPU and memory allow; the division runs
                // only when CPU or memory is what binds.
                let mut k = v.copies;
                if cpu_free < k.saturating_mul(t.cpu_milli) {
                    k = cpu_free / t.cpu_milli;
                }
                if mem_free < k.saturating_mul(t.memory_mib) {
                    k = mem_free / t.memory_mib;
                }
                total.saturating_sub(k * u64::from(t.milli))
            };
            (fgd, strand)
        };
        frag += t.freq * fgd as f64;
        strand_sum += t.freq * strand as f64;
    }
    (frag, strand_sum)
}

/// The GPUs of a node as FGD sees them: free milli of devices the demand may use (its kind and
/// model), plus that model's id.
pub(crate) fn gpu_view(node: &Node, d: &Demand, buf: &mut Vec<u16>) -> u8 {
    buf.clear();
    let mut model = u8::MAX;
    for (i, x) in node.devices.iter().enumerate() {
        if x.kind == d.kind && (d.count == 0 || device_matches(node, i, d)) {
            buf.push(x.free);
            model = x.model_id;
        }
    }
    model
}

pub(crate) fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// FGD.
#[derive(Debug, Clone)]
pub struct Fgd {
    mix: TaskMix,
    buf: Vec<u16>,
}

impl Fgd {
    pub fn new(mix: TaskMix) -> Self {
        Self { mix, buf: Vec::new() }
    }

    pub fn mix(&self) -> &TaskMix {
        &self.mix
    }

    /// Best score over the node's fitting GPUs for a share (first index on ties), or the score
    /// of the exclusive choice; returns (score, device index for a share).
    fn evaluate(&mut self, node: &Node, d: &Demand) -> (f64, Option<usize>) {
        let mut gpus = std::mem::take(&mut self.buf);
        let model = gpu_view(node, d, &mut gpus);
        let before = fragmentation(&self.mix, node.cpu_free, &gpus, model);
        let cpu_after = node.cpu_free - d.cpu_milli;
        let score_of = |after: f64| (sigmoid((before - after) / 1000.0) * 100.0).trunc();
        let result = if d.is_shared() {
            let mut best: Option<(f64, usize)> = None;
            // Map positions in `gpus` back to device indices.
            let idx: Vec<usize> = node
                .devices
                .iter()
                .enumerate()
                .filter(|&(i, x)| x.kind == d.kind && device_matches(node, i, d))
                .map(|(i, _)| i)
                .collect();
            for k in 0..gpus.len() {
                if gpus[k] >= d.milli {
                    gpus[k] -= d.milli;
                    let s = score_of(fragmentation(&self.mix, cpu_after, &gpus, model));
                    gpus[k] += d.milli;
                    if best.is_none_or(|(b, _)| s > b) {
                        best = Some((s, idx[k]));
                    }
                }
            }
            best.map_or((f64::NEG_INFINITY, None), |(s, i)| (s, Some(i)))
        } else {
            // Whole GPUs: the lowest-index free ones (the artifact's `Sub` packs the smallest
            // sufficient GPUs, which for whole GPUs are the free ones in index order).
            let mut need = d.count;
            for g in gpus.iter_mut() {
                if need == 0 {
                    break;
                }
                if *g >= d.milli && d.milli == MILLI {
                    *g = 0;
                    need -= 1;
                }
            }
            (score_of(fragmentation(&self.mix, cpu_after, &gpus, model)), None)
        };
        self.buf = gpus;
        result
    }
}

impl Policy for Fgd {
    fn name(&self) -> &'static str {
        "fgd"
    }
    fn score(&mut self, _: &Cluster, node: &Node, d: &Demand) -> f64 {
        self.evaluate(node, d).0
    }
    fn devices(&mut self, _: &Cluster, node: &Node, d: &Demand, _: &mut Rng, out: &mut Vec<u16>) {
        let chosen = self.evaluate(node, d).1;
        chosen_or_picked(chosen, node, d, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpu_core::DeviceKind;

    #[test]
    fn mix_keeps_the_most_frequent_shapes_up_to_coverage() {
        let mut ds = Vec::new();
        ds.extend(std::iter::repeat_n(Demand::share(4000, 0, DeviceKind::Gpu, 500), 60));
        ds.extend(std::iter::repeat_n(Demand::whole(8000, 0, DeviceKind::Gpu, 1), 30));
        ds.extend(std::iter::repeat_n(Demand::cpu(2000, 0), 7));
        ds.extend(std::iter::repeat_n(Demand::whole(8000, 0, DeviceKind::Gpu, 8), 3));
        let mix = TaskMix::from_demands(&ds, 0.95);
        assert_eq!(mix.len(), 3, "{mix:?}");
        let f: Vec<f64> = mix.tasks.iter().map(|t| t.freq).collect();
        assert!((f[0] - 60.0 / 97.0).abs() < 1e-9 && (f.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn fragmentation_counts_what_the_mix_cannot_use() {
        let mix = TaskMix {
            tasks: vec![TypicalTask {
                cpu_milli: 1000,
                memory_mib: 100,
                milli: 500,
                count: 1,
                models: ANY_MODEL,
                freq: 1.0,
            }],
        };
        // 300 milli free on one GPU is too small for a 500 share: fragmented; 700 is usable.
        assert_eq!(fragmentation(&mix, 8000, &[300, 700], 0), 300.0);
        // Without CPU nothing is usable.
        assert_eq!(fragmentation(&mix, 500, &[300, 700], 0), 1000.0);
        assert_eq!(fragmentation(&mix, 8000, &[0, 0], 0), 0.0);
    }

    #[test]
    fn the_fused_measure_equals_the_two_measures_it_blends() {
        let mut rng = Rng::new(3);
        let mut tasks = Vec::new();
        for i in 0..20u64 {
            let count = [0u16, 1, 1, 1, 2, 4, 8][rng.index(7)];
            let milli = match count {
                0 => 0,
                1 if i % 2 == 0 => [100u16, 250, 460, 500, 700][rng.index(5)],
                _ => 1000,
            };
            tasks.push(TypicalTask {
                cpu_milli: 1000 * (1 + rng.below(16)),
                memory_mib: 1024 * rng.below(64),
                milli,
                count,
                models: if i % 5 == 0 { 0b10 } else { ANY_MODEL },
                freq: 0.05,
            });
        }
        let mix = TaskMix { tasks };
        let tabs = CopyTables::new(&mix);
        for _ in 0..500 {
            let gpus: Vec<u16> = (0..8).map(|_| rng.below(1001) as u16).collect();
            let (cpu, mem, model) = (rng.below(64_000), rng.below(262_144), rng.below(3) as u8);
            let want =
                (fragmentation(&mix, cpu, &gpus, model), stranded(&mix, cpu, mem, &gpus, model));
            let got = both_measures(&mix, &tabs, &mut Vec::new(), cpu, mem, &gpus, model);
            assert!(
                (want.0 - got.0).abs() < 1e-6 && (want.1 - got.1).abs() < 1e-6,
                "{gpus:?} {cpu} {mem}: {want:?} vs {got:?}"
            );
        }
    }

    #[test]
    fn shifted_views_equal_views_taken_again() {
        let mut rng = Rng::new(5);
        let tasks = [100u16, 250, 460, 500, 1000]
            .iter()
            .map(|&milli| TypicalTask {
                cpu_milli: 1000,
                memory_mib: 0,
                milli,
                count: 1,
                models: ANY_MODEL,
                freq: 0.2,
            })
            .collect();
        let tabs = CopyTables::new(&TaskMix { tasks });
        let (mut views, mut again) = (Vec::new(), Vec::new());
        for _ in 0..300 {
            let mut gpus: Vec<u16> = (0..8).map(|_| rng.below(1001) as u16).collect();
            share_views(&tabs, &gpus, &mut views);
            let k = rng.index(8);
            let to = rng.below(u64::from(gpus[k]) + 1) as u16;
            shift_views(&tabs, &mut views, gpus[k], to);
            gpus[k] = to;
            share_views(&tabs, &gpus, &mut again);
            for (a, b) in views.iter().zip(&again) {
                assert_eq!(
                    (a.usable, a.small, a.copies),
                    (b.usable, b.small, b.copies),
                    "{gpus:?}"
                );
            }
        }
    }

    #[test]
    fn stranding_counts_what_packing_copies_leaves_over() {
        let mix = TaskMix {
            tasks: vec![TypicalTask {
                cpu_milli: 1000,
                memory_mib: 100,
                milli: 500,
                count: 1,
                models: ANY_MODEL,
                freq: 1.0,
            }],
        };
        // 700 fits one copy and strands 200; 300 strands all: FGD would say 300.
        assert_eq!(stranded(&mix, 8000, 10_000, &[300, 700], 0), 500.0);
        // CPU for one copy only: 1000 free, 500 usable.
        assert_eq!(stranded(&mix, 1500, 10_000, &[1000], 0), 500.0);
        // Memory for none: everything stranded (FGD ignores memory).
        assert_eq!(stranded(&mix, 8000, 50, &[1000], 0), 1000.0);
    }
}
