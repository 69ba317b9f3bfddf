//! xpu's default placement policy: *stranding-aware fragmentation descent*.
//!
//! It keeps FGD's idea — place a task where the GPU capacity the typical task mix cannot use
//! grows least — and changes two things, each measured on the OpenB benchmark
//! (`xpu sim openb`):
//!
//! 1. **What counts as unusable.** FGD asks, per typical task, whether a free GPU slice is big
//!    enough for it at all. That misses capacity that is big enough for one copy but not for the
//!    next: 700 milli free is "usable" for a 500-milli task, yet 200 of it is stranded; four
//!    free GPUs on a node with CPU for one more task are mostly stranded too. xpu blends FGD's
//!    measure with a *capacity* measure — for each typical task, the free GPU milli left over
//!    after packing as many copies as the node's GPUs, CPU **and memory** allow (FGD ignores
//!    memory) — half and half. Multi-GPU typical tasks keep FGD's rule, which protects whole
//!    empty nodes for 8-GPU jobs better than counting copies does.
//! 2. **How close is a tie.** FGD squashes the fragmentation change through a sigmoid and
//!    truncates it to an integer, so nodes within roughly 40 milli-GPU (near zero) to several
//!    hundred (far from it) of each other tie, and the tie goes to the first node in a fixed
//!    order — which is what makes FGD pack. xpu uses uniform 75-milli-GPU bands: fine enough to
//!    prefer genuinely better nodes, coarse enough to keep packing. Within a band the node
//!    order decides, as in FGD; a share goes to the GPU that scores best, the fullest on ties.
//!
//! Over seeds 42–51 this beats the published FGD mean on all five OpenB traces; the margins are
//! small (0.1–0.8 points) and reported as measured.

use crate::cluster::{Cluster, MILLI, Node};
use crate::placement::{Demand, Policy, chosen_or_picked, device_matches};
use crate::rng::Rng;

use super::fgd::{CopyTables, TaskMix, blended, gpu_view};

/// Width of a score band, in milli-GPU of fragmentation change.
const BAND: f64 = 75.0;

/// xpu's default policy.
#[derive(Debug, Clone)]
pub struct XpuPolicy {
    mix: TaskMix,
    tabs: CopyTables,
    buf: Vec<u16>,
}

impl XpuPolicy {
    pub fn new(mix: TaskMix) -> Self {
        let tabs = CopyTables::new(&mix);
        Self { mix, tabs, buf: Vec::new() }
    }

    pub fn mix(&self) -> &TaskMix {
        &self.mix
    }

    fn frag(&self, cpu: u64, mem: u64, gpus: &[u16], model: u8) -> f64 {
        blended(&self.mix, &self.tabs, cpu, mem, gpus, model)
    }

    /// (score band, device index for a share).
    fn evaluate(&mut self, node: &Node, d: &Demand) -> (f64, Option<usize>) {
        let mut gpus = std::mem::take(&mut self.buf);
        let model = gpu_view(node, d, &mut gpus);
        let before = self.frag(node.cpu_free, node.mem_free, &gpus, model);
        let cpu = node.cpu_free - d.cpu_milli;
        let mem = node.mem_free - d.memory_mib;
        let band = |after: f64| ((before - after) / BAND).floor();
        let result = if d.is_shared() {
            // (band, fullness after, position in `gpus`)
            let mut best: Option<(f64, u16, usize)> = None;
            for k in 0..gpus.len() {
                // GPUs with equal free capacity leave equal states (the first one is kept, as
                // on ties): evaluate each value once.
                if gpus[k] >= d.milli && !gpus[..k].contains(&gpus[k]) {
                    gpus[k] -= d.milli;
                    let s = band(self.frag(cpu, mem, &gpus, model));
                    let fullness = MILLI - gpus[k];
                    gpus[k] += d.milli;
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
            let mut need = d.count;
            for g in gpus.iter_mut() {
                if need > 0 && *g >= d.milli {
                    *g -= d.milli;
                    need -= 1;
                }
            }
            (band(self.frag(cpu, mem, &gpus, model)), None)
        };
        self.buf = gpus;
        result
    }
}

impl Policy for XpuPolicy {
    fn name(&self) -> &'static str {
        "xpu"
    }
    fn score(&mut self, _: &Cluster, node: &Node, d: &Demand) -> f64 {
        self.evaluate(node, d).0
    }
    fn devices(&mut self, _: &Cluster, node: &Node, d: &Demand, _: &mut Rng, out: &mut Vec<u16>) {
        let chosen = self.evaluate(node, d).1;
        chosen_or_picked(chosen, node, d, out);
    }
}
