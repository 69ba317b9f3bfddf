//! `cargo bench -p xpu --bench exporter`: how fast a scrape is and how small the exporter is.
//!
//! Prints, in one run, on the 8×MI300X fixture with amdgpu sysfs/hwmon values for every GPU
//! (the sources read real files; NVML is not loaded under a fixture root):
//! - one collection pass in process (discovery + every source), median of many;
//! - rendering one snapshot in process, median;
//! - `xpu exporter` as a process: GET /metrics over TCP, p50/p99 of 500 scrapes (target: a
//!   scrape under 10 ms), and the process's resident memory after them (target: under 15 MiB).
//!
//! Uses the release-profile `xpu` binary that cargo builds for benches.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use xpu_host::Root;
use xpu_testkit::hosts;

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn write(p: &std::path::Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

fn get(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

fn status_kib(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap()
}

fn main() {
    let fx = hosts::mi300x().build();
    for (i, bus) in hosts::MI300X_BUSES.iter().enumerate() {
        let dev = fx.device_dir(&format!("0000:{bus:02x}:00.0"));
        write(&dev.join("gpu_busy_percent"), &format!("{}\n", 10 * i));
        write(&dev.join("mem_info_vram_used"), "3221225472\n");
        write(&dev.join("mem_info_vram_total"), "206158430208\n");
        let hw = dev.join("hwmon/hwmon3");
        write(&hw.join("power1_average"), "245000000\n");
        write(&hw.join("temp1_input"), "51000\n");
        write(&hw.join("freq1_input"), "2100000000\n");
        write(&hw.join("freq2_input"), "1300000000\n");
        write(&dev.join("ras/umc_err_count"), "ue: 0\nce: 4\n");
    }
    let root = Root::new(fx.root()).unwrap();

    let mut collect = Vec::new();
    let mut render = Vec::new();
    let mut text = String::new();
    for _ in 0..200 {
        let mut sources =
            xpu_integrations::exporter::default_sources(&root, Duration::from_secs(1));
        let t = Instant::now();
        let snap = xpu_telemetry::collect::collect_once(&root, &mut sources);
        collect.push(t.elapsed());
        let t = Instant::now();
        text = xpu_telemetry::render::render_snapshot(&snap);
        render.push(t.elapsed());
    }
    let samples = text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).count();
    println!("exporter in process, 8×MI300X fixture ({samples} samples, {} bytes):", text.len());
    println!("  collection pass (discovery + sources): median {}", ms(pct(&mut collect, 0.5)));
    println!("  render one snapshot: median {}", ms(pct(&mut render, 0.5)));

    // A free port: bind, read it, release; the exporter binds it next.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(XPU)
        .args(["exporter", "--root"])
        .arg(fx.root())
        .args(["--listen", &addr, "--interval", "1s"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "the exporter did not listen on {addr}");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1200));
    let mut scrapes = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        let body = get(&addr);
        scrapes.push(t.elapsed());
        assert!(body.contains("xpu_device_power_watts"));
    }
    let rss = status_kib(child.id(), "VmRSS:");
    let hwm = status_kib(child.id(), "VmHWM:");
    // The figures are taken; kill fails only if the exporter already exited, wait reaps it.
    let _ = child.kill();
    let _ = child.wait();
    let (p50, p99) = (pct(&mut scrapes, 0.5), pct(&mut scrapes, 0.99));
    println!("xpu exporter process, GET /metrics over TCP, 500 scrapes:");
    println!(
        "  p50 {}  p99 {}  (target < 10 ms: {})",
        ms(p50),
        ms(p99),
        if p99 < Duration::from_millis(10) { "met" } else { "NOT met" }
    );
    println!(
        "  RSS {:.1} MiB, peak {:.1} MiB (target < 15 MiB: {})",
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0,
        if hwm < 15 * 1024 { "met" } else { "NOT met" }
    );
}
