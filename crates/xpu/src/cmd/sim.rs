//! `xpu sim`: the scheduler simulator. `openb` runs the OpenB placement benchmark (FGD paper,
//! USENIX ATC '23) for one or more policies over a range of seeds; `replay` replays a job trace
//! (Philly or OpenB) over time on a cluster described by `--cluster` and reports job completion
//! times, queueing delays, GPU utilisation and makespan.

use std::io::{IsTerminal, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Subcommand, ValueEnum};
use serde::Serialize;
use xpu_sched::policy::PolicyKind;
use xpu_sched::scheduler::QueuePolicy;
use xpu_sched::sim::{dra, openb, plot, replay, spec, variant};
use xpu_sched::trace;

use crate::cmd::format::Format;
use crate::output::{CliError, CmdResult, print_json, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: SimCommand,
}

#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// The OpenB placement benchmark: GPU allocation ratio once 130 % of capacity has arrived.
    Openb(OpenbArgs),
    /// Replay a job trace over time and report JCT, queueing delay, utilisation and makespan.
    Replay(ReplayArgs),
    /// Write a synthetic variant of an OpenB pod list, built as the FGD paper built its traces:
    /// `gpushareL` (sharing tasks carry L % of the GPU request), `multigpuL` (multi-GPU tasks
    /// carry L %), `gpuspecL` (L % of GPU tasks constrained to GPU models), `cpuL` (CPU-only tasks
    /// are L/10 % of all tasks). Rows are drawn from the given trace, deterministically by seed.
    OpenbVariant(VariantArgs),
    /// An OpenB trace replayed as DRA claims on ResourceSlices with topology attributes (PCIe
    /// roots, NUMA nodes): claims placed by xpu's device choice against upstream's first fit,
    /// the node chosen the same way for both.
    Dra(DraArgs),
}

#[derive(Debug, clap::Args)]
pub struct DraArgs {
    /// Node list (openb_node_list_gpu_node.csv).
    #[arg(long, value_name = "CSV")]
    pub nodes: PathBuf,
    /// Pod list (openb_pod_list_<trace>.csv); repeat for several traces.
    #[arg(long, value_name = "CSV", required = true)]
    pub pods: Vec<PathBuf>,
    /// Seeds: `42..51` (inclusive), `42` or `42,43,50`.
    #[arg(long, default_value = "42..51")]
    pub seeds: String,
    /// 0: OpenB's workload (130 % of capacity arrives, nothing leaves); above 0: churn, claims
    /// leaving after exponential lifetimes that make this offered load (1.0 = the capacity).
    #[arg(long, default_value_t = 0.0)]
    pub load: f64,
    /// Every GPU an H200 in MIG mode, each GPU pod asking for MIG partitions (a share: the
    /// smallest profile whose compute holds it; a whole GPU: 7g.141gb); alloc % is then the
    /// compute slices the partitions hold.
    #[arg(long)]
    pub mig: bool,
    /// How the node is chosen: first (in the seed's node order), tightest (fewest whole free
    /// GPUs: xpu's best fit), spread (most free CPU and memory: kube-scheduler's default score),
    /// or several.
    #[arg(
        long,
        value_name = "NAME",
        value_delimiter = ',',
        default_value = "spread,first,tightest"
    )]
    pub node: Vec<String>,
    /// Threads running seeds in parallel (default: every core).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    #[arg(long, value_parser = Format::only(&[Format::Table, Format::Json]), default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct VariantArgs {
    /// Node list (openb_node_list_gpu_node.csv); keeps gpuspec model lists placeable.
    #[arg(long, value_name = "CSV")]
    pub nodes: PathBuf,
    /// The trace to draw from (openb_pod_list_default.csv).
    #[arg(long, value_name = "CSV")]
    pub pods: PathBuf,
    /// gpushare40, multigpu50, gpuspec10, cpu050, ...
    #[arg(long, value_name = "NAME")]
    pub variant: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write the pod list (default: stdout).
    #[arg(long, value_name = "CSV")]
    pub output: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct OpenbArgs {
    /// Node list (openb_node_list_gpu_node.csv).
    #[arg(long, value_name = "CSV")]
    pub nodes: PathBuf,
    /// Pod list (openb_pod_list_<trace>.csv); repeat for several traces.
    #[arg(long, value_name = "CSV", required = true)]
    pub pods: Vec<PathBuf>,
    /// Also run synthetic variants of the first `--pods` trace, built as the FGD paper built
    /// its 17 traces: gpushare40, multigpu50, gpuspec10, cpu050, ... or `paper` for all sixteen
    /// (see `xpu sim openb-variant --help`).
    #[arg(long, value_name = "NAME", value_delimiter = ',')]
    pub variant: Vec<String>,
    /// Seed of the variants' draws.
    #[arg(long, default_value_t = 1)]
    pub variant_seed: u64,
    /// The paper's published means (`workload,Random,DotProd,GpuClustering,GpuPacking,BestFit,FGD`
    /// per trace). Default: ../shared/benchmarks/openb-published-alloc-at-130.csv when present,
    /// else the same table built in.
    #[arg(long, value_name = "CSV")]
    pub published: Option<PathBuf>,
    /// Threads running seeds in parallel (default: every core).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Placement policy: random, dotprod, gpuclustering, gpupacking, bestfit, fgd, xpu, or all;
    /// repeat or separate with commas. Default: xpu.
    #[arg(long, value_name = "NAME", value_delimiter = ',')]
    pub policy: Vec<String>,
    /// Seeds: `42..51` (inclusive), `42` or `42,43,50`.
    #[arg(long, default_value = "42..51")]
    pub seeds: String,
    #[arg(long, value_parser = Format::only(&[Format::Table, Format::Json, Format::Csv]), default_value_t = Format::Table)]
    pub format: Format,
    /// Also draw allocation against arrived workload (mean over seeds) for each policy.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Print placement decisions per second (single thread) to stderr.
    #[arg(long)]
    pub bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TraceFormat {
    Philly,
    Openb,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// Trace file.
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,
    /// Trace format.
    #[arg(long, value_enum)]
    pub format: TraceFormat,
    /// Pools: `pool=a100:nodes=64:gpus=8`, `;`-separated or repeated; add `:flex:delay=300`
    /// for a flex-start pool (see `xpu sim replay --help` and docs/sim.md).
    #[arg(long, value_name = "SPEC", required = true)]
    pub cluster: Vec<String>,
    #[arg(long, default_value = "xpu")]
    pub policy: String,
    #[arg(long, value_enum, default_value_t = QueueArg::Fifo)]
    pub queue: QueueArg,
    /// With `--queue fair`: what a job that cannot start does to the jobs behind it. reserve:
    /// it reserves the nodes it will get as they free up, the others fill the rest (xpu's
    /// default everywhere); strict: it holds back the later jobs of its queue asking for the
    /// same device kind; best-effort: the later jobs are placed anywhere around it.
    #[arg(long, value_enum, default_value_t = crate::cmd::k8s::Queueing::Reserve)]
    pub queueing: crate::cmd::k8s::Queueing,
    /// Let higher-priority jobs evict lower-priority ones.
    #[arg(long)]
    pub preemption: bool,
    /// Replay only the first N jobs by submit time.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Output format (`--format` names the trace's).
    #[arg(long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueueArg {
    Fifo,
    Priority,
    Sjf,
    Backfill,
    Fair,
}

impl From<QueueArg> for QueuePolicy {
    fn from(q: QueueArg) -> Self {
        match q {
            QueueArg::Fifo => QueuePolicy::Fifo,
            QueueArg::Priority => QueuePolicy::Priority,
            QueueArg::Sjf => QueuePolicy::Sjf,
            QueueArg::Backfill => QueuePolicy::Backfill,
            QueueArg::Fair => QueuePolicy::Fair,
        }
    }
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        SimCommand::Openb(a) => run_openb(a),
        SimCommand::Replay(a) => run_replay(a),
        SimCommand::OpenbVariant(a) => run_variant(a),
        SimCommand::Dra(a) => run_dra(a),
    }
}

/// One setting of `xpu sim dra` over its seeds, the `--format json` shape.
#[derive(Debug, Serialize)]
struct DraJson {
    trace: String,
    node: &'static str,
    /// `xpu` (packing) or `first-fit` (upstream's order).
    devices: &'static str,
    load: f64,
    /// GPUs as H200s in MIG mode, pods asking for partitions.
    mig: bool,
    /// Means over the seeds; per claim size, summed over them.
    #[serde(flatten)]
    summary: dra::DraSummary,
    seeds: Vec<dra::DraRun>,
}

fn run_dra(a: DraArgs) -> CmdResult {
    let seeds = parse_seeds(&a.seeds)?;
    if !(0.0..=100.0).contains(&a.load) {
        return Err(CliError::input(anyhow::anyhow!(
            "--load {} is out of range; give 0 (nothing leaves) or an offered load such as 0.9",
            a.load
        )));
    }
    let mut choices = Vec::new();
    for n in &a.node {
        choices.push(match n.as_str() {
            "first" => dra::NodeChoice::First,
            "tightest" => dra::NodeChoice::Tightest,
            "spread" => dra::NodeChoice::Spread,
            other => {
                return Err(CliError::input(anyhow::anyhow!(
                    "--node {other:?}: give first, tightest or spread, or several separated by commas"
                )));
            }
        });
    }
    let settings: Vec<dra::DraOptions> = choices
        .iter()
        .flat_map(|&node| {
            [false, true].map(|pack| dra::DraOptions { node, pack, load: a.load, mig: a.mig })
        })
        .collect();
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let nodes = trace::read_openb_nodes(&a.nodes).map_err(CliError::input)?;
    let mut out: Vec<DraJson> = Vec::new();
    for p in &a.pods {
        let pods = trace::read_openb_pods(p).map_err(CliError::input)?;
        let name = openb::trace_name(&p.to_string_lossy()).to_owned();
        for (opts, runs) in dra::run_all(&nodes, &pods, &settings, &seeds, threads) {
            out.push(DraJson {
                trace: name.clone(),
                node: opts.node.as_str(),
                devices: if opts.pack { "xpu" } else { "first-fit" },
                load: a.load,
                mig: opts.mig,
                summary: dra::summarize(&runs),
                seeds: runs,
            });
        }
    }
    if a.format == Format::Json {
        print_json(&out)?;
        return Ok(ExitCode::SUCCESS);
    }
    let headers = [
        "trace",
        "node",
        "devices",
        "claims",
        "placed",
        "placed %",
        "GPU placed %",
        "alloc %",
        "by size (placed/arrived)",
    ];
    let rows: Vec<Vec<String>> = out
        .iter()
        .map(|j| {
            let sizes: Vec<String> = j
                .summary
                .by_size
                .iter()
                .map(|s| format!("{}:{}/{}", s.size, s.placed, s.arrived))
                .collect();
            vec![
                j.trace.clone(),
                j.node.to_owned(),
                j.devices.to_owned(),
                format!("{:.1}", j.summary.claims),
                format!("{:.1}", j.summary.placed),
                format!("{:.2}", j.summary.placed_pct),
                format!("{:.2}", j.summary.gpu_placed_pct),
                format!("{:.2}", j.summary.alloc_pct),
                sizes.join(" "),
            ]
        })
        .collect();
    print!("{}", table(&headers, &rows));
    Ok(ExitCode::SUCCESS)
}

/// `42..51`, `42`, `42,43,50`.
fn parse_seeds(s: &str) -> Result<Vec<u64>, CliError> {
    let bad = || {
        CliError::input(anyhow::anyhow!(
            "--seeds {s:?} is not a seed list; write 42..51 (inclusive), 42, or 42,43,50"
        ))
    };
    let v: Vec<u64> = if let Some((a, b)) = s.split_once("..") {
        let a: u64 = a.trim().parse().map_err(|_| bad())?;
        let b: u64 = b.trim().trim_start_matches('=').parse().map_err(|_| bad())?;
        if b < a || b - a > 10_000 {
            return Err(bad());
        }
        (a..=b).collect()
    } else {
        s.split(',').map(|x| x.trim().parse().map_err(|_| bad())).collect::<Result<_, _>>()?
    };
    if v.is_empty() {
        return Err(bad());
    }
    Ok(v)
}

fn parse_policies(names: &[String]) -> Result<Vec<PolicyKind>, CliError> {
    if names.is_empty() {
        return Ok(vec![PolicyKind::Xpu]);
    }
    let mut out = Vec::new();
    for n in names {
        if n.eq_ignore_ascii_case("all") {
            out.extend(PolicyKind::ALL);
            continue;
        }
        out.push(
            n.parse::<PolicyKind>()
                .map_err(|e| CliError::input(anyhow::anyhow!("--policy: {e}")))?,
        );
    }
    out.dedup();
    Ok(out)
}

/// One policy's result, the documented `--format json` shape.
#[derive(Debug, Serialize)]
struct OpenbJson {
    trace: String,
    policy: String,
    seeds: Vec<SeedJson>,
    mean_alloc_at_130: f64,
    min_alloc_at_130: f64,
    max_alloc_at_130: f64,
    /// The paper's published mean for the five baselines and FGD; null for xpu.
    published_mean: Option<f64>,
}

#[derive(Debug, Serialize)]
struct SeedJson {
    seed: u64,
    alloc_at_130: f64,
    failed_tasks: usize,
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The shared published table, looked for beside the project when `--published` is not given.
const SHARED_PUBLISHED: &str = "../shared/benchmarks/openb-published-alloc-at-130.csv";

fn load_published(path: Option<&std::path::Path>) -> Result<openb::Published, CliError> {
    let (path, required) = match path {
        Some(p) => (p.to_path_buf(), true),
        None => (PathBuf::from(SHARED_PUBLISHED), false),
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => openb::Published::parse(&path.display().to_string(), &text)
            .map_err(|e| CliError::input(anyhow::anyhow!("--published: {e}"))),
        Err(e) if required => Err(CliError::input(anyhow::anyhow!(
            "--published {}: {e}; give the paper's table as CSV \
             (workload,Random,DotProd,GpuClustering,GpuPacking,BestFit,FGD)",
            path.display()
        ))),
        Err(_) => Ok(openb::Published::builtin()),
    }
}

fn parse_variants(names: &[String]) -> Result<Vec<variant::Variant>, CliError> {
    let mut out = Vec::new();
    for n in names {
        if n.eq_ignore_ascii_case("paper") {
            out.extend(variant::Variant::paper());
            continue;
        }
        out.push(n.parse().map_err(|e| CliError::input(anyhow::anyhow!("--variant: {e}")))?);
    }
    out.dedup();
    Ok(out)
}

/// One trace's results.
struct TraceRuns {
    name: String,
    results: Vec<(PolicyKind, Vec<openb::OpenbRun>)>,
}

fn run_openb(a: OpenbArgs) -> CmdResult {
    let seeds = parse_seeds(&a.seeds)?;
    let policies = parse_policies(&a.policy)?;
    let variants = parse_variants(&a.variant)?;
    let published = load_published(a.published.as_deref())?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let nodes = trace::read_openb_nodes(&a.nodes).map_err(CliError::input)?;
    let mut traces: Vec<(String, Vec<trace::OpenbPod>)> = Vec::new();
    for p in &a.pods {
        let pods = trace::read_openb_pods(p).map_err(CliError::input)?;
        traces.push((openb::trace_name(&p.to_string_lossy()).to_owned(), pods));
    }
    if let Some((base_name, base)) = traces.first().cloned() {
        for v in &variants {
            let pods = variant::generate(&base, &nodes, *v, a.variant_seed)
                .map_err(|e| CliError::input(anyhow::anyhow!("--variant from {base_name}: {e}")))?;
            traces.push((format!("synthetic:{v}"), pods));
        }
    }
    // Thread-seconds spent placing: each trace's wall time times the threads its runs kept
    // busy (the simulator itself reads no clock).
    let mut wall = 0.0f64;
    let mut busy = 0.0f64;
    let mut runs: Vec<TraceRuns> = Vec::new();
    for (name, pods) in &traces {
        let start = Instant::now();
        let results =
            openb::run_all(&nodes, pods, &policies, &seeds, threads).map_err(CliError::input)?;
        let t = start.elapsed().as_secs_f64();
        wall += t;
        busy += t * threads.min(policies.len() * seeds.len()) as f64;
        runs.push(TraceRuns { name: name.clone(), results });
    }
    if a.bench {
        let decisions: usize =
            runs.iter().flat_map(|t| t.results.iter().flat_map(|(_, r)| r)).map(|r| r.tasks).sum();
        eprintln!(
            "placement: {decisions} decisions in {busy:.3} thread-seconds = {:.0} decisions/s per \
             thread ({} nodes); wall {wall:.3} s on {threads} threads",
            decisions as f64 / busy.max(1e-9),
            nodes.len()
        );
    }
    if let Some(path) = &a.plot {
        let first = runs.first().map(|t| (t.name.as_str(), &t.results));
        if let Some((trace_name, results)) = first {
            let series: Vec<plot::Series> = results
                .iter()
                .map(|(k, runs)| plot::Series {
                    label: k.to_string(),
                    points: plot::mean_curve(
                        &runs.iter().map(|r| r.curve.clone()).collect::<Vec<_>>(),
                    ),
                })
                .collect();
            let svg = plot::svg(
                &format!("OpenB {trace_name}: GPU allocation vs arrived workload"),
                &series,
            );
            std::fs::write(path, svg).map_err(|e| {
                CliError::failed(anyhow::anyhow!(
                    "cannot write plot {}: {e}; check the directory exists",
                    path.display()
                ))
            })?;
        }
    }
    let json: Vec<Vec<OpenbJson>> = runs
        .iter()
        .map(|t| {
            t.results
                .iter()
                .map(|(k, runs)| {
                    let s = openb::summarize(runs);
                    OpenbJson {
                        trace: t.name.clone(),
                        policy: k.to_string(),
                        seeds: runs
                            .iter()
                            .map(|r| SeedJson {
                                seed: r.seed,
                                alloc_at_130: round2(r.alloc_at_130),
                                failed_tasks: r.failed_tasks,
                            })
                            .collect(),
                        mean_alloc_at_130: round2(s.mean),
                        min_alloc_at_130: round2(s.min),
                        max_alloc_at_130: round2(s.max),
                        published_mean: published.get(&t.name, *k),
                    }
                })
                .collect()
        })
        .collect();
    match a.format {
        Format::Json if json.len() == 1 && json[0].len() == 1 => print_json(&json[0][0])?,
        Format::Json if json.len() == 1 => print_json(&json[0])?,
        Format::Json => print_json(&json.iter().flatten().collect::<Vec<_>>())?,
        Format::Csv => {
            println!("trace,policy,seed,alloc_at_130,failed_tasks");
            for j in json.iter().flatten() {
                for s in &j.seeds {
                    println!(
                        "{},{},{},{:.2},{}",
                        j.trace, j.policy, s.seed, s.alloc_at_130, s.failed_tasks
                    );
                }
            }
        }
        // The table: the formats `Format::only` lets through are all above.
        _ if json.len() == 1 => print_seed_table(&json[0], &seeds),
        _ => print_trace_table(&json),
    }
    Ok(ExitCode::SUCCESS)
}

/// One trace: a row per seed, then mean, min, max and the published mean.
fn print_seed_table(json: &[OpenbJson], seeds: &[u64]) {
    let trace_name = json.first().map_or("", |j| j.trace.as_str());
    let mut headers = vec!["seed".to_owned()];
    headers.extend(json.iter().map(|j| j.policy.clone()));
    let mut rows: Vec<Vec<String>> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut r = vec![s.to_string()];
            r.extend(json.iter().map(|j| format!("{:.2}", j.seeds[i].alloc_at_130)));
            r
        })
        .collect();
    for (label, f) in [
        (
            "mean",
            (|j: &OpenbJson| format!("{:.2}", j.mean_alloc_at_130)) as fn(&OpenbJson) -> String,
        ),
        ("min", |j| format!("{:.2}", j.min_alloc_at_130)),
        ("max", |j| format!("{:.2}", j.max_alloc_at_130)),
        ("published", |j| j.published_mean.map_or_else(|| "-".into(), |p| format!("{p:.2}"))),
    ] {
        let mut r = vec![label.to_owned()];
        r.extend(json.iter().map(f));
        rows.push(r);
    }
    let h: Vec<&str> = headers.iter().map(String::as_str).collect();
    println!("OpenB {trace_name}: GPU allocation ratio (%) at 130 % arrived");
    print!("{}", table(&h, &rows));
}

/// Several traces: a row per trace, each policy's mean (min–max) [published mean].
fn print_trace_table(json: &[Vec<OpenbJson>]) {
    let mut headers = vec!["trace".to_owned()];
    headers.extend(json.first().into_iter().flatten().map(|j| j.policy.clone()));
    let rows: Vec<Vec<String>> = json
        .iter()
        .map(|t| {
            let mut r = vec![t.first().map_or_else(String::new, |j| j.trace.clone())];
            r.extend(t.iter().map(|j| {
                let p = j.published_mean.map_or_else(String::new, |p| format!(" [{p:.2}]"));
                format!(
                    "{:.2} ({:.2}-{:.2}){p}",
                    j.mean_alloc_at_130, j.min_alloc_at_130, j.max_alloc_at_130
                )
            }));
            r
        })
        .collect();
    let h: Vec<&str> = headers.iter().map(String::as_str).collect();
    println!("OpenB: GPU allocation ratio (%) at 130 % arrived, mean (min-max) [published mean]");
    print!("{}", table(&h, &rows));
}

fn run_variant(a: VariantArgs) -> CmdResult {
    let v: variant::Variant =
        a.variant.parse().map_err(|e| CliError::input(anyhow::anyhow!("--variant: {e}")))?;
    let nodes = trace::read_openb_nodes(&a.nodes).map_err(CliError::input)?;
    let base = trace::read_openb_pods(&a.pods).map_err(CliError::input)?;
    let pods = variant::generate(&base, &nodes, v, a.seed)
        .map_err(|e| CliError::input(anyhow::anyhow!("{}: {e}", a.pods.display())))?;
    let mut buf = Vec::new();
    variant::write_csv(&pods, &mut buf)
        .map_err(|e| CliError::failed(anyhow::anyhow!("cannot format the pod list: {e}")))?;
    match &a.output {
        Some(path) => std::fs::write(path, &buf).map_err(|e| {
            CliError::failed(anyhow::anyhow!(
                "cannot write {}: {e}; check the directory exists",
                path.display()
            ))
        })?,
        None => std::io::stdout()
            .write_all(&buf)
            .map_err(|e| CliError::failed(anyhow::anyhow!("cannot write to stdout: {e}")))?,
    }
    Ok(ExitCode::SUCCESS)
}

fn run_replay(a: ReplayArgs) -> CmdResult {
    let policy: PolicyKind =
        a.policy.parse().map_err(|e| CliError::input(anyhow::anyhow!("--policy: {e}")))?;
    let mut pools = Vec::new();
    for c in &a.cluster {
        pools.extend(spec::parse_cluster(c).map_err(CliError::input)?);
    }
    let mut jobs = match a.format {
        TraceFormat::Philly => {
            let t = trace::read_philly(&a.trace).map_err(CliError::input)?;
            let per = pools.iter().map(|p| p.devices).max().unwrap_or(8);
            replay::from_philly(&t, per)
        }
        TraceFormat::Openb => {
            let pods = trace::read_openb_pods(&a.trace).map_err(CliError::input)?;
            let (jobs, skipped) = replay::from_openb(&pods);
            if jobs.is_empty() {
                return Err(CliError::input(anyhow::anyhow!(
                    "trace {} has no pods with creation_time and deletion_time; replay needs arrival and departure times",
                    a.trace.display()
                )));
            }
            if skipped > 0 {
                eprintln!("warning: {skipped} pods without creation/deletion times were skipped");
            }
            jobs
        }
    };
    if let Some(n) = a.limit {
        jobs.sort_by_key(|j| j.submit);
        jobs.truncate(n);
    }
    let opts = replay::ReplayOptions {
        policy,
        queue: a.queue.into(),
        preemption: a.preemption,
        seed: a.seed,
        lanes: a.queueing == crate::cmd::k8s::Queueing::Strict,
        best_effort: a.queueing == crate::cmd::k8s::Queueing::BestEffort,
        reserve: a.queueing == crate::cmd::k8s::Queueing::Reserve,
    };
    let tty = std::io::stderr().is_terminal();
    let mut last_draw = 0usize;
    let mut progress = |done: usize, total: usize| {
        if tty && (done > last_draw + total / 200 || done == total) {
            last_draw = done;
            let width = 40;
            let filled = done * width / total.max(1);
            let mut err = std::io::stderr();
            let _ = write!(
                err,
                "\r[{}{}] {done}/{total} jobs",
                "#".repeat(filled),
                " ".repeat(width - filled)
            );
            let _ = err.flush();
        }
    };
    let start = Instant::now();
    let report = replay::replay(&pools, &jobs, &opts, &mut progress).map_err(CliError::failed)?;
    let wall = start.elapsed().as_secs_f64();
    if tty {
        eprintln!();
    }
    match a.output {
        Output::Json => {
            #[derive(Serialize)]
            struct Out<'a> {
                #[serde(flatten)]
                report: &'a replay::ReplayReport,
                wall_seconds: f64,
            }
            print_json(&Out { report: &report, wall_seconds: (wall * 1000.0).round() / 1000.0 })?;
        }
        Output::Table => {
            let gpus: u64 = pools.iter().map(|p| u64::from(p.nodes) * u64::from(p.devices)).sum();
            println!(
                "{} jobs on {} nodes / {gpus} devices, policy {}, queue {:?}: {} finished, {} failed (never fit), {} stopped, {} preemptions",
                report.jobs,
                pools.iter().map(|p| p.nodes).sum::<u32>(),
                report.policy,
                report.queue,
                report.finished,
                report.failed,
                report.stopped,
                report.preemptions
            );
            let row = |name: &str, s: &replay::Stats| {
                vec![name.to_owned(), hms(s.mean), hms(s.p50), hms(s.p95), hms(s.p99)]
            };
            print!(
                "{}",
                table(
                    &["", "mean", "p50", "p95", "p99"],
                    &[
                        row("JCT", &report.jct),
                        row("queueing delay", &report.queueing),
                        row("queueing, jobs of 8+ GPUs", &report.queueing_large),
                    ]
                )
            );
            println!(
                "GPU utilisation {:.2} %, makespan {} ({} s); replayed in {wall:.2} s",
                report.gpu_utilization,
                hms(report.makespan as f64),
                report.makespan
            );
            for p in &report.pools {
                println!(
                    "pool {}: {} provisionings, mean wait {:.0} s, node-hours up {:.1}, used {:.1}, idle {:.1}, {} stopped at max run",
                    p.pool,
                    p.provisionings,
                    p.mean_provisioning_wait,
                    p.node_hours_up,
                    p.node_hours_used,
                    p.node_hours_idle,
                    p.stopped_at_max_run
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `1d02h03m` style durations for tables.
fn hms(secs: f64) -> String {
    let s = secs.round() as u64;
    let (d, h, m, s) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d{h:02}h{m:02}m")
    } else if h > 0 {
        format!("{h}h{m:02}m{s:02}s")
    } else if m > 0 {
        format!("{m}m{s:02}s")
    } else {
        format!("{s}s")
    }
}
