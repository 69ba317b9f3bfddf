//! `cargo bench -p xpu --bench discover`: how fast and how small `xpu discover` is.
//!
//! Prints, in one run:
//! - in-process discovery of the 8×A100 fixture (median of many runs);
//! - the `xpu discover --format json` process on that fixture (target: under 5 ms) and its
//!   peak RSS (target: under 16 MiB);
//! - on this machine, `xpu discover --format json` (default view and `--all`) against
//!   `lspci -D -nnk`, run alternately, as a ratio of medians (target: at most 1.0×).
//!
//! Uses the release-profile `xpu` binary that cargo builds for benches.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_testkit::hosts;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time_cmd(program: &str, args: &[&str]) -> Duration {
    let t = Instant::now();
    let status = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let d = t.elapsed();
    assert!(status.success(), "{program} {args:?} failed");
    d
}

fn peak_rss_kib(args: &[&str]) -> u64 {
    let out = Command::new(XPU).args(args).env("XPU_REPORT_PEAK_RSS", "1").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    err.lines()
        .find_map(|l| l.strip_prefix("xpu: peak RSS "))
        .and_then(|v| v.trim_end_matches(" KiB").parse().ok())
        .unwrap()
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    // Cargo passes --bench; a filter argument selects nothing here.
    let fixture = hosts::a100_8x().build();
    let root_s = fixture.root().to_str().unwrap().to_owned();

    let root = Root::new(fixture.root()).unwrap();
    let opts = DiscoverOptions { scope: Scope::Accelerators, ..Default::default() };
    let runs: Vec<Duration> = (0..300)
        .map(|_| {
            let t = Instant::now();
            let inv = xpu_host::discover(&root, &opts).unwrap();
            assert_eq!(inv.devices.len(), 14);
            t.elapsed()
        })
        .collect();
    println!("discover (in process), 8xA100 fixture:        median {}", ms(median(runs)));

    let fx_args = ["discover", "--root", root_s.as_str(), "--format", "json"];
    let runs: Vec<Duration> = (0..200).map(|_| time_cmd(XPU, &fx_args)).collect();
    let fx = median(runs);
    println!("xpu discover --format json, 8xA100 fixture:   median {} (target < 5 ms)", ms(fx));
    let rss = peak_rss_kib(&fx_args);
    println!(
        "peak RSS, 8xA100 fixture:                     {rss} KiB = {:.1} MiB (target < 16 MiB)",
        rss as f64 / 1024.0
    );

    let lspci_ok =
        Command::new("lspci").arg("--version").output().is_ok_and(|o| o.status.success());
    if !lspci_ok {
        println!("lspci not installed: skipping the comparison on this machine");
        return;
    }
    let mut xd = Vec::new();
    let mut xa = Vec::new();
    let mut ls = Vec::new();
    for _ in 0..200 {
        xd.push(time_cmd(XPU, &["discover", "--format", "json"]));
        xa.push(time_cmd(XPU, &["discover", "--all", "--format", "json"]));
        ls.push(time_cmd("lspci", &["-D", "-nnk"]));
    }
    let (xd, xa, ls) = (median(xd), median(xa), median(ls));
    println!("this machine: lspci -D -nnk                   median {}", ms(ls));
    println!(
        "this machine: xpu discover --format json      median {} = {:.2}x lspci (target <= 1.0x)",
        ms(xd),
        xd.as_secs_f64() / ls.as_secs_f64()
    );
    println!(
        "this machine: xpu discover --all --format json median {} = {:.2}x lspci",
        ms(xa),
        xa.as_secs_f64() / ls.as_secs_f64()
    );
    let rss = peak_rss_kib(&["discover", "--all", "--format", "json"]);
    println!("this machine: peak RSS --all                  {rss} KiB");
}
