//! The five baseline policies of the OpenB benchmark, scored as the FGD artifact scores them
//! (`pkg/simulator/plugin/*_score.go`): integer scores in 0..=100, ties broken at random.
//! Device choice inside a node is the artifact's "best" GPU selection (fullest GPU that fits a
//! share, lowest-index free GPUs for whole ones), which is what [`pick_devices`] does on nodes
//! without NVLink/NUMA information; Random picks a random fitting GPU for shares.

use crate::cluster::{Cluster, MILLI, Node};
use crate::placement::{Demand, Policy, TieBreak, device_matches, pick_devices};
use crate::rng::Rng;

use super::{MAX_SPEC_CPU, MAX_SPEC_GPU};

/// Free milli over the devices a demand could use (all devices of its kind and model).
pub(crate) fn free_total(node: &Node, d: &Demand) -> u64 {
    node.devices
        .iter()
        .enumerate()
        .filter(|&(i, _)| d.count == 0 || device_matches(node, i, d))
        .map(|(_, x)| u64::from(x.free))
        .sum()
}

/// A uniformly random feasible node (every node scores the same), and a random fitting GPU for
/// a share.
#[derive(Debug, Default, Clone, Copy)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn score(&mut self, _: &Cluster, _: &Node, _: &Demand) -> f64 {
        0.0
    }
    fn tie_break(&self) -> TieBreak {
        TieBreak::Uniform
    }
    fn devices(&mut self, _: &Cluster, node: &Node, d: &Demand, rng: &mut Rng, out: &mut Vec<u16>) {
        if !d.is_shared() {
            return pick_devices(node, d, out);
        }
        out.clear();
        let mut seen = 0u64;
        for (i, x) in node.devices.iter().enumerate() {
            if x.free >= d.milli && device_matches(node, i, d) {
                seen += 1;
                if rng.below(seen) == 0 {
                    out.clear();
                    out.push(i as u16);
                }
            }
        }
    }
}

/// Best fit: the node whose free (CPU, GPU) left after placement is smallest, each normalised
/// by the largest node spec and weighted ½.
#[derive(Debug, Default, Clone, Copy)]
pub struct BestFit;

impl Policy for BestFit {
    fn name(&self) -> &'static str {
        "bestfit"
    }
    fn score(&mut self, _: &Cluster, node: &Node, d: &Demand) -> f64 {
        let cpu = (node.cpu_free - d.cpu_milli) as f64 / MAX_SPEC_CPU;
        let gpu = (free_total(node, d) - d.device_milli()) as f64 / MAX_SPEC_GPU;
        ((1.0 - 0.5 * cpu - 0.5 * gpu) * 100.0).trunc()
    }
}

/// Tetris-style dot product of the node's free (CPU, GPU) vector and the task's request, both
/// normalised by the largest node spec; the artifact scores `1 - dot/2` ("merge" dimensions,
/// "max" normalisation), so the node whose free vector is least aligned with the task wins.
#[derive(Debug, Default, Clone, Copy)]
pub struct DotProduct;

impl Policy for DotProduct {
    fn name(&self) -> &'static str {
        "dotprod"
    }
    fn score(&mut self, _: &Cluster, node: &Node, d: &Demand) -> f64 {
        let node_v =
            [node.cpu_free as f64 / MAX_SPEC_CPU, free_total(node, d) as f64 / MAX_SPEC_GPU];
        let task_v = [d.cpu_milli as f64 / MAX_SPEC_CPU, d.device_milli() as f64 / MAX_SPEC_GPU];
        let dot = (node_v[0] * task_v[0] + node_v[1] * task_v[1]) / 2.0;
        ((1.0 - dot) * 100.0).trunc()
    }
}

/// GPU packing: prefer sharing an already shared GPU (the fuller the better), then free GPUs on
/// a partly used node, then an idle node (the one with fewer GPUs). CPU-only tasks score 0
/// everywhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct GpuPacking;

impl Policy for GpuPacking {
    fn name(&self) -> &'static str {
        "gpupacking"
    }
    fn score(&mut self, _: &Cluster, node: &Node, d: &Demand) -> f64 {
        if d.count == 0 {
            return 0.0;
        }
        let gpus: Vec<u16> = node
            .devices
            .iter()
            .enumerate()
            .filter(|&(i, _)| device_matches(node, i, d))
            .map(|(_, x)| x.free)
            .collect();
        let fully_free = gpus.iter().filter(|&&f| f == MILLI).count() as i64;
        if fully_free == gpus.len() as i64 {
            return (100 / 3 - fully_free).max(fully_free) as f64;
        }
        let mut sorted = gpus.clone();
        sorted.sort_unstable();
        let mut need = d.count;
        let mut fully_free_used = 0i64;
        let mut ratio_sum = 0i64;
        for &f in &sorted {
            if need == 0 {
                break;
            }
            if f >= d.milli {
                need -= 1;
                if f == MILLI {
                    fully_free_used += 1;
                }
                ratio_sum += i64::from(f) * 100 / i64::from(MILLI);
            }
        }
        if fully_free_used > 0 {
            return (100 / 2 - fully_free_used).max(100 / 3) as f64;
        }
        (100 - ratio_sum / 10).max(100 / 2) as f64
    }
}

/// GPU clustering: put tasks of the same GPU shape (shared, 1-GPU, 2-GPU...) together: a node
/// running only that shape scores highest, then mixed nodes that include it, then idle nodes,
/// then nodes running other shapes; within a band, fuller nodes win. CPU-only tasks score 0.
#[derive(Debug, Default, Clone, Copy)]
pub struct GpuClustering;

impl Policy for GpuClustering {
    fn name(&self) -> &'static str {
        "gpuclustering"
    }
    fn score(&mut self, _: &Cluster, node: &Node, d: &Demand) -> f64 {
        if d.count == 0 {
            return 0.0;
        }
        let left = free_total(node, d) as i64;
        let fill = 25 * (MAX_SPEC_GPU as i64 - left) / MAX_SPEC_GPU as i64;
        let mask = node.tag_mask();
        let mine = 1u16 << d.tag();
        let band = if mask & mine != 0 {
            if mask == mine { 75 } else { 50 }
        } else if mask == 0 {
            25
        } else {
            0
        };
        (fill + band) as f64
    }
}
