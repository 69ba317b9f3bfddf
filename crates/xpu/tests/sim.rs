//! `xpu sim` as a process: the OpenB benchmark's output shapes and the plot, trace replay over
//! a slice of the real Philly trace under each queue, and clear errors (file, line, column;
//! exit 2) for malformed input.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

fn ok_json(args: &[&str]) -> Value {
    let out = xpu(args);
    assert!(out.status.success(), "xpu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The shared trace directory beside the checkout, if present.
fn data() -> Option<PathBuf> {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    if d.join("philly/philly.csv").is_file() {
        Some(d)
    } else {
        eprintln!("skipping: shared trace data not found at {}", d.display());
        None
    }
}

fn small_openb(dir: &Path) -> (String, String) {
    let nodes = dir.join("nodes.csv");
    let pods = dir.join("openb_pod_list_tiny.csv");
    let mut n = String::from("sn,cpu_milli,memory_mib,gpu,model\n");
    for i in 0..20 {
        n.push_str(&format!(
            "node-{i:02},64000,262144,{},{}\n",
            if i % 2 == 0 { 8 } else { 2 },
            if i < 10 { "V100M32" } else { "T4" }
        ));
    }
    std::fs::write(&nodes, n).unwrap();
    let mut p = String::from(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n",
    );
    for i in 0..60 {
        let (n, m, spec) = match i % 5 {
            0 => (0, 0, ""),
            1 => (1, 500, ""),
            2 => (1, 1000, "T4"),
            3 => (2, 1000, ""),
            _ => (1, 250, "V100M32|T4"),
        };
        p.push_str(&format!(
            "pod-{i:03},4000,8192,{n},{m},{spec},LS,Running,{},{},{}\n",
            i * 10,
            i * 10 + 500,
            i * 10
        ));
    }
    std::fs::write(&pods, p).unwrap();
    (nodes.display().to_string(), pods.display().to_string())
}

#[test]
fn openb_json_has_the_documented_shape() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, pods) = small_openb(dir.path());
    let v = ok_json(&[
        "sim", "openb", "--nodes", &nodes, "--pods", &pods, "--seeds", "42..44", "--format", "json",
    ]);
    assert_eq!(v["trace"], "tiny");
    assert_eq!(v["policy"], "xpu", "xpu's policy is the default");
    let seeds = v["seeds"].as_array().unwrap();
    assert_eq!(seeds.len(), 3);
    for (s, want) in seeds.iter().zip(42..) {
        assert_eq!(s["seed"], want);
        let a = s["alloc_at_130"].as_f64().unwrap();
        assert!((0.0..=100.0).contains(&a), "{a}");
        assert!(s["failed_tasks"].as_u64().is_some());
    }
    let mean = v["mean_alloc_at_130"].as_f64().unwrap();
    let avg = seeds.iter().map(|s| s["alloc_at_130"].as_f64().unwrap()).sum::<f64>() / 3.0;
    assert!((mean - avg).abs() < 0.011, "{mean} vs {avg}");
    // Several policies: an array of the same objects; a plot with one line each.
    let svg = dir.path().join("alloc.svg");
    let v = ok_json(&[
        "sim",
        "openb",
        "--nodes",
        &nodes,
        "--pods",
        &pods,
        "--seeds",
        "42",
        "--policy",
        "fgd,bestfit",
        "--format",
        "json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let names: Vec<&str> =
        v.as_array().unwrap().iter().map(|p| p["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["fgd", "bestfit"]);
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(plot.matches("<polyline").count(), 2);
    // Table and CSV.
    let out = xpu(&[
        "sim", "openb", "--nodes", &nodes, "--pods", &pods, "--seeds", "42,43", "--policy", "all",
        "--format", "csv",
    ]);
    assert!(out.status.success());
    let csv = String::from_utf8(out.stdout).unwrap();
    assert_eq!(csv.lines().count(), 1 + 7 * 2, "{csv}");
    let out = xpu(&["sim", "openb", "--nodes", &nodes, "--pods", &pods, "--seeds", "42"]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("seed") && table.contains("mean") && table.contains("published"),
        "{table}"
    );
}

#[test]
fn malformed_input_names_file_line_and_column_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, _) = small_openb(dir.path());
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,500\np1,lots,10,1,500\n",
    )
    .unwrap();
    let out = xpu(&["sim", "openb", "--nodes", &nodes, "--pods", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "bad.csv:3: column \"cpu_milli\": expected a non-negative integer, got \"lots\""
        ),
        "{err}"
    );
    let philly = dir.path().join("philly.csv");
    std::fs::write(&philly, "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 07:01:55,66.0,1,66.0,a\n2017-13-09 07:01:55,66.0,1,66.0,a\n").unwrap();
    let out = xpu(&[
        "sim",
        "replay",
        "--trace",
        philly.to_str().unwrap(),
        "--format",
        "philly",
        "--cluster",
        "pool=a:nodes=1:gpus=8",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("philly.csv:3: column \"timestamp\""), "{err}");
    let out = xpu(&[
        "sim",
        "replay",
        "--trace",
        philly.to_str().unwrap(),
        "--format",
        "philly",
        "--cluster",
        "pool=a:gpus=8",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing nodes=N"));
    let out = xpu(&["sim", "openb", "--nodes", &nodes, "--pods", &nodes, "--seeds", "51..42"]);
    assert_eq!(out.status.code(), Some(2));
    let out = xpu(&["sim", "openb", "--nodes", "/nonexistent.csv", "--pods", &nodes]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read trace /nonexistent.csv"));
}

#[test]
fn philly_slice_replays_under_each_queue() {
    let Some(d) = data() else { return };
    let trace = d.join("philly/philly.csv");
    let mut jct = Vec::new();
    for q in ["fifo", "sjf", "backfill", "fair"] {
        let v = ok_json(&[
            "sim",
            "replay",
            "--trace",
            trace.to_str().unwrap(),
            "--format",
            "philly",
            "--cluster",
            "pool=a100:nodes=4:gpus=8",
            "--queue",
            q,
            "--limit",
            "1500",
            "--output",
            "json",
        ]);
        assert_eq!(v["jobs"], 1500);
        let finished = v["finished"].as_u64().unwrap();
        let failed = v["failed"].as_u64().unwrap();
        assert_eq!(finished + failed, 1500, "{q}: every job finishes or can never fit");
        let u = v["gpu_utilization"].as_f64().unwrap();
        assert!(u > 0.0 && u <= 100.0, "{q}: {u}");
        for k in ["mean", "p50", "p95", "p99"] {
            assert!(
                v["jct"][k].as_f64().unwrap() >= v["queueing"][k].as_f64().unwrap() - 1e-9
                    || k != "mean"
            );
        }
        jct.push(v["jct"]["mean"].as_f64().unwrap());
    }
    // Shortest-job-first and backfill beat FIFO's mean completion time on a loaded cluster.
    assert!(jct[1] < jct[0] && jct[2] < jct[0], "{jct:?}");
    let out = xpu(&[
        "sim",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "philly",
        "--cluster",
        "pool=a100:nodes=4:gpus=8",
        "--limit",
        "200",
    ]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("JCT") && table.contains("queueing delay") && table.contains("makespan"),
        "{table}"
    );
}

#[test]
fn openb_trace_replays_with_a_flex_start_pool() {
    let dir = tempfile::tempdir().unwrap();
    let (_, pods) = small_openb(dir.path());
    let v = ok_json(&[
        "sim",
        "replay",
        "--trace",
        &pods,
        "--format",
        "openb",
        "--cluster",
        "pool=v100:nodes=1:gpus=8:model=V100M32;pool=burst:nodes=4:gpus=8:model=T4:flex:delay=60:idle=120",
        "--output",
        "json",
    ]);
    assert_eq!(v["jobs"], 60);
    let pool = &v["pools"][0];
    assert_eq!(pool["pool"], "burst");
    assert!(pool["provisionings"].as_u64().unwrap() > 0, "{v}");
    assert!(pool["node_hours_up"].as_f64().unwrap() >= pool["node_hours_used"].as_f64().unwrap());
}

#[test]
fn a_pod_at_the_end_of_time_is_an_error_naming_its_line() {
    // It used to vanish: the replay loop read u64::MAX as "no more events".
    let dir = tempfile::tempdir().unwrap();
    let pods = dir.path().join("pods.csv");
    std::fs::write(
        &pods,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\np0,1000,10,1,1000,0,100\np1,1000,10,1,1000,18446744073709551615,200\n",
    )
    .unwrap();
    let out = xpu(&[
        "sim",
        "replay",
        "--trace",
        pods.to_str().unwrap(),
        "--format",
        "openb",
        "--cluster",
        "pool=a:nodes=1:gpus=8",
        "--output",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pods.csv:3: column \"creation_time\": 18446744073709551615 is later than any trace time"),
        "{err}"
    );
}

#[test]
fn openb_variants_are_written_run_and_compared_with_the_published_table() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, pods) = small_openb(dir.path());
    // A variant written to a file reads back as a pod list with the same shape of rows.
    let out = dir.path().join("openb_pod_list_gpushare100.csv");
    let w = xpu(&[
        "sim",
        "openb-variant",
        "--nodes",
        &nodes,
        "--pods",
        &pods,
        "--variant",
        "gpushare100",
        "--seed",
        "3",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.starts_with("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"), "{text}");
    for row in text.lines().skip(1) {
        let c: Vec<&str> = row.split(',').collect();
        assert!(c[3] == "0" || (c[3] == "1" && c[4] != "1000"), "only shares and CPU: {row}");
    }
    // --variant adds synthetic traces, each with the published mean of its namesake.
    let published = dir.path().join("published.csv");
    std::fs::write(&published, "workload,a,b,c,d,e,f\nopenb_pod_list_cpu050,1,2,3,4,5,91.5\n")
        .unwrap();
    let v = ok_json(&[
        "sim",
        "openb",
        "--nodes",
        &nodes,
        "--pods",
        &pods,
        "--variant",
        "cpu050,multigpu50",
        "--policy",
        "fgd",
        "--seeds",
        "42",
        "--published",
        published.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let rows = v.as_array().unwrap();
    let traces: Vec<&str> = rows.iter().map(|r| r["trace"].as_str().unwrap()).collect();
    assert_eq!(traces, ["tiny", "synthetic:cpu050", "synthetic:multigpu50"]);
    assert_eq!(rows[1]["published_mean"], 91.5);
    assert!(rows[2]["published_mean"].is_null(), "not in the given table");
    // Bad names and files say what to write instead.
    let e = xpu(&["sim", "openb", "--nodes", &nodes, "--pods", &pods, "--variant", "gpushare"]);
    assert_eq!(e.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&e.stderr).contains("such as gpushare40"));
    std::fs::write(&published, "workload,a\nx,1\n").unwrap();
    let e = xpu(&[
        "sim",
        "openb",
        "--nodes",
        &nodes,
        "--pods",
        &pods,
        "--published",
        published.to_str().unwrap(),
    ]);
    assert_eq!(e.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&e.stderr).contains("2 columns, expected 7"));
}

/// `xpu sim dra`: one row per node choice and device order, in the documented JSON shape, no
/// device ever held twice; a bad `--node` or `--load` is a usage error naming it.
#[test]
fn dra_replay_compares_device_orders_under_each_node_choice() {
    let dir = tempfile::tempdir().unwrap();
    let (nodes, pods) = small_openb(dir.path());
    for load in ["0", "0.9"] {
        let v = ok_json(&[
            "sim", "dra", "--nodes", &nodes, "--pods", &pods, "--seeds", "1..3", "--load", load,
            "--format", "json",
        ]);
        let rows = v.as_array().unwrap();
        assert_eq!(rows.len(), 6, "{v}");
        for r in rows {
            assert!(["spread", "first", "tightest"].contains(&r["node"].as_str().unwrap()), "{r}");
            assert!(["xpu", "first-fit"].contains(&r["devices"].as_str().unwrap()), "{r}");
            assert!(r["placed"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["placed"].as_f64() <= r["claims"].as_f64(), "{r}");
            for s in r["seeds"].as_array().unwrap() {
                assert_eq!(s["double_booked"], 0, "{s}");
            }
        }
    }
    for (flag, value, named) in [("--node", "widest", "--node"), ("--load", "101", "--load")] {
        let out = xpu(&["sim", "dra", "--nodes", &nodes, "--pods", &pods, flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(named), "{err}");
    }
}
