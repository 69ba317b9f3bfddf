//! xpu's default placement policy (first version): FGD's fragmentation delta without the
//! artifact's integer truncation, so near-equal nodes are not left to a coin toss.

use crate::cluster::{Cluster, Node};
use crate::placement::{Demand, Policy, pick_devices};
use crate::rng::Rng;

use super::fgd::{TaskMix, fragmentation, gpu_view};

#[derive(Debug, Clone)]
pub struct XpuPolicy {
    mix: TaskMix,
    buf: Vec<u16>,
}

impl XpuPolicy {
    pub fn new(mix: TaskMix) -> Self {
        Self { mix, buf: Vec::new() }
    }

    fn evaluate(&mut self, node: &Node, d: &Demand) -> (f64, Option<usize>) {
        let mut gpus = std::mem::take(&mut self.buf);
        let model = gpu_view(node, d, &mut gpus);
        let before = fragmentation(&self.mix, node.cpu_free, &gpus, model);
        let cpu_after = node.cpu_free - d.cpu_milli;
        let mut best: Option<(f64, usize)> = None;
        if d.is_shared() {
            for k in 0..gpus.len() {
                if gpus[k] >= d.milli {
                    gpus[k] -= d.milli;
                    let s = before - fragmentation(&self.mix, cpu_after, &gpus, model);
                    gpus[k] += d.milli;
                    if best.is_none_or(|(b, _)| s > b) {
                        best = Some((s, k));
                    }
                }
            }
        } else {
            let mut need = d.count;
            for g in gpus.iter_mut() {
                if need > 0 && *g >= d.milli {
                    *g -= d.milli;
                    need -= 1;
                }
            }
            best = Some((before - fragmentation(&self.mix, cpu_after, &gpus, model), usize::MAX));
        }
        self.buf = gpus;
        match best {
            Some((s, k)) if k != usize::MAX => {
                let idx = node
                    .devices
                    .iter()
                    .enumerate()
                    .filter(|&(i, x)| {
                        x.kind == d.kind && crate::placement::device_matches(node, i, d)
                    })
                    .nth(k)
                    .map(|(i, _)| i);
                (s, idx)
            }
            Some((s, _)) => (s, None),
            None => (f64::NEG_INFINITY, None),
        }
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
        match self.evaluate(node, d) {
            (_, Some(i)) => {
                out.clear();
                out.push(i as u16);
            }
            _ => pick_devices(node, d, out),
        }
    }
}
