//! Held-out evaluation of placement-policy variants on the OpenB benchmark: the five real
//! traces of `../shared/data/openb` and the paper's sixteen synthetic variants of the default
//! trace ([`xpu_sched::sim::variant`]), seeds 42–51, FGD run on the same seeds.
//!
//! `cargo run --release -p xpu-sched --example policy_eval -- [CONFIG ...]`
//!
//! A CONFIG is `bands:W:B` or `fgdfirst:W:B` (stranding weight W, band width B milli-GPU; B = 0
//! takes the width of FGD's own integer score there); without one, the default policy, or with
//! `--loo` the ten candidates the default was chosen from. For each config it prints, per
//! trace, the mean over seeds, the difference from xpu's FGD on the same seeds and from the
//! published FGD mean, and the worst of each. `--loo` adds the leave-one-trace-out check: for
//! each real trace, the config that does best (largest worst-case margin over FGD) on the other
//! four and the synthetic variants is measured on it. `--vseed=N` draws the variants with
//! another seed; `--synthetic` and `--real` keep only those traces.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use xpu_sched::placement::Placer;
use xpu_sched::policy::{Combine, Fgd, PolicyKind, TaskMix, XpuParams, XpuPolicy};
use xpu_sched::sim::{openb, variant};
use xpu_sched::trace::{self, OpenbNode, OpenbPod};

const REAL: [&str; 5] = ["default", "gpushare100", "multigpu50", "cpu100", "gpuspec10"];

#[derive(Debug, Clone, Copy)]
enum Pol {
    Fgd,
    Xpu(XpuParams),
}

fn parse(s: &str) -> Pol {
    let f: Vec<&str> = s.split(':').collect();
    let num = |i: usize, d: f64| f.get(i).map_or(d, |x| x.parse().unwrap());
    match f[0] {
        "fgd" => Pol::Fgd,
        "bands" => Pol::Xpu(XpuParams {
            strand_weight: num(1, 0.5),
            band: num(2, 75.0),
            combine: Combine::Bands,
        }),
        "fgdfirst" => Pol::Xpu(XpuParams {
            strand_weight: num(1, 0.5),
            band: num(2, 75.0),
            combine: Combine::FgdFirst,
        }),
        "default" => Pol::Xpu(XpuParams::default()),
        other => panic!("unknown config {other}"),
    }
}

fn run(nodes: &[OpenbNode], pods: &[OpenbPod], pol: Pol, seed: u64) -> f64 {
    let mut c = openb::cluster(nodes).unwrap();
    c.shuffle_ranks(openb::rank_seed(seed));
    let ds = openb::demands(&mut c, pods).unwrap();
    let mix = TaskMix::from_demands(&ds, 0.95);
    let policy: Box<dyn xpu_sched::placement::Policy> = match pol {
        Pol::Fgd => Box::new(Fgd::new(mix)),
        Pol::Xpu(p) => Box::new(XpuPolicy::with_params(mix, p)),
    };
    let mut placer = Placer::new(policy, openb::placer_seed(seed));
    openb::run_with(&mut c, &mut placer, pods, &ds, seed).alloc_at_130
}

/// Mean over seeds for every (trace, policy), in parallel.
fn grid(
    nodes: &[OpenbNode],
    traces: &[(String, Vec<OpenbPod>)],
    pols: &[Pol],
    seeds: &[u64],
) -> Vec<Vec<f64>> {
    let jobs: Vec<(usize, usize, u64)> = (0..traces.len())
        .flat_map(|t| (0..pols.len()).flat_map(move |p| seeds.iter().map(move |&s| (t, p, s))))
        .collect();
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let results: Vec<(usize, f64)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(t, p, s)) = jobs.get(i) else { break };
                        out.push((i, run(nodes, &traces[t].1, pols[p], s)));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut sums = vec![vec![0.0; pols.len()]; traces.len()];
    for (i, v) in results {
        let (t, p, _) = jobs[i];
        sums[t][p] += v / seeds.len() as f64;
    }
    sums
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let loo = args.iter().any(|a| a == "--loo");
    let only_real = args.iter().any(|a| a == "--real");
    let only_synthetic = args.iter().any(|a| a == "--synthetic");
    let vseed: u64 = args
        .iter()
        .find_map(|a| a.strip_prefix("--vseed=").map(|v| v.parse().unwrap()))
        .unwrap_or(1);
    let mut configs: Vec<String> = args.iter().filter(|a| !a.starts_with("--")).cloned().collect();
    if configs.is_empty() && loo {
        // The candidates the default (fgdfirst:0.75:150) was chosen from, and the old design.
        for w in ["0.5", "0.75", "1"] {
            for b in ["0", "75", "150"] {
                configs.push(format!("fgdfirst:{w}:{b}"));
            }
        }
        configs.push("bands:0.5:75".into());
    } else if configs.is_empty() {
        configs.push("default".into());
    }
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/openb");
    let nodes = trace::read_openb_nodes(&data.join("openb_node_list_gpu_node.csv")).unwrap();
    let mut traces: Vec<(String, Vec<OpenbPod>)> = REAL
        .iter()
        .map(|t| {
            (
                t.to_string(),
                trace::read_openb_pods(&data.join(format!("openb_pod_list_{t}.csv"))).unwrap(),
            )
        })
        .collect();
    if !only_real {
        let base = traces[0].1.clone();
        for v in variant::Variant::paper() {
            traces.push((format!("~{v}"), variant::generate(&base, &nodes, v, vseed).unwrap()));
        }
    }
    if only_synthetic {
        traces.drain(..REAL.len());
    }
    let seeds: Vec<u64> = (42..=51).collect();
    let mut pols = vec![Pol::Fgd];
    pols.extend(configs.iter().map(|c| parse(c)));
    let start = std::time::Instant::now();
    let m = grid(&nodes, &traces, &pols, &seeds);
    eprintln!(
        "{} runs in {:.1} s",
        traces.len() * pols.len() * seeds.len(),
        start.elapsed().as_secs_f64()
    );
    let published = openb::Published::builtin();
    print!("{:<14} {:>7} {:>7}", "trace", "pubFGD", "fgd");
    for c in &configs {
        print!(" {:>22}", c);
    }
    println!();
    let mut worst = vec![(f64::INFINITY, f64::INFINITY); configs.len()];
    for (t, (name, _)) in traces.iter().enumerate() {
        let pubf = published.get(name.trim_start_matches('~'), PolicyKind::Fgd).unwrap_or(f64::NAN);
        print!("{name:<14} {pubf:>7.2} {:>7.2}", m[t][0]);
        for (k, w) in worst.iter_mut().enumerate() {
            let v = m[t][k + 1];
            let (a, b) = (v - m[t][0], v - pubf);
            w.0 = w.0.min(a);
            if !name.starts_with('~') {
                w.1 = w.1.min(b);
            }
            print!(" {v:>7.2} {a:>+6.2} {b:>+6.2}");
        }
        println!();
    }
    print!("{:<30}", "worst vs fgd / vs pub(real)");
    for w in &worst {
        print!(" {:>15.2} {:>+6.2}", w.0, w.1);
    }
    println!();
    if loo {
        // For each held-out real trace: pick the config with the best worst-case margin over
        // FGD (own and published) on the other real traces and the synthetic ones, measure it
        // on the held-out one.
        for (h, held) in REAL.iter().enumerate().filter(|_| !only_synthetic) {
            let margin = |k: usize| {
                (0..traces.len())
                    .filter(|&t| t != h)
                    .map(|t| {
                        let pubf =
                            published.get(traces[t].0.trim_start_matches('~'), PolicyKind::Fgd);
                        let own = m[t][k + 1] - m[t][0];
                        match pubf {
                            Some(p) if !traces[t].0.starts_with('~') => own.min(m[t][k + 1] - p),
                            _ => own,
                        }
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let best = (0..configs.len()).max_by(|&a, &b| margin(a).total_cmp(&margin(b))).unwrap();
            let pubf = published.get(held, PolicyKind::Fgd).unwrap();
            println!(
                "LOO {held:<12} chosen {:<16} (worst margin elsewhere {:+.2}): {:.2}, vs fgd {:+.2}, vs published {:+.2}",
                configs[best],
                margin(best),
                m[h][best + 1],
                m[h][best + 1] - m[h][0],
                m[h][best + 1] - pubf
            );
        }
    }
}
