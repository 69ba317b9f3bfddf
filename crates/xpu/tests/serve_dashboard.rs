//! The dashboard in a real headless browser (Debian's chromium): the page loads, fills itself
//! from the API without a reload (devices with their holder, the queue, running and finished
//! jobs, the allocation chart, each device's utilisation and memory from telemetry), and a
//! screenshot is saved under the target directory. A missing chromium fails the test with the
//! install command.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::path::Path;
use std::process::Command;

use serve_support::{Daemon, kill_tasks};

const CHROMIUM: &str = "/usr/bin/chromium";

fn chromium(profile: &Path, extra: &[String], url: &str) -> std::process::Output {
    Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1280,900",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .output()
        .unwrap()
}

fn need_chromium() {
    assert!(Path::new(CHROMIUM).exists(), "{CHROMIUM} is missing; run scripts/install-test-deps");
}

#[test]
fn dashboard_in_headless_chromium_shows_a_submitted_job() {
    need_chromium();
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(&dir.path().join("data"), None, &["--devices", "nvidia-a100:2"]);
    let done = d.submit("name: finished-job\ncommand: [\"true\"]\n");
    d.wait_state(done, &["succeeded"]);
    let running = d.submit("name: training-run\ncommand: [sleep, \"60\"]\ngpus: 2\n");
    let queued = d.submit("name: waiting-job\ncommand: [\"true\"]\ngpus: 1\n");
    d.wait_state(running, &["running"]);
    // The page shows what the API shows: wait until the queue has the waiting job's reason.
    d.wait_for("the waiting job's reason in the queue", || {
        let q = d.get("/v1/queue");
        (q["queued"][0]["id"] == queued && q["queued"][0]["reason"].is_string()).then_some(())
    });

    let profile = dir.path().join("profile");
    let out = chromium(&profile, &["--dump-dom".to_owned()], &format!("{}/", d.url()));
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
    // Filled in by the page's script from /v1/*, not present in the served HTML.
    assert!(dom.contains("training-run"), "running job missing from the DOM:\n{dom}");
    assert!(
        dom.contains(&format!("job {running} training-run task 0")),
        "device holder missing:\n{dom}"
    );
    assert!(dom.contains("waiting-job"), "queued job missing:\n{dom}");
    assert!(dom.contains("Insufficient gpu"), "queue reason missing:\n{dom}");
    assert!(dom.contains(&format!("data-job=\"{done}\"")) && dom.contains("succeeded"));
    assert!(dom.contains("<path d=\"M"), "allocation chart not drawn:\n{dom}");
    assert!(dom.contains("scheduling (leader)"));

    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("xpu-dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let out =
        chromium(&profile, &[format!("--screenshot={}", shot.display())], &format!("{}/", d.url()));
    assert!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "screenshot {}", shot.display());
    eprintln!("dashboard screenshot: {}", shot.display());
    kill_tasks(&d.data_dir);
}

/// Utilisation and memory per device, from the daemon's telemetry (here amdgpu's sysfs values
/// in a fixture host), next to the holder.
#[test]
fn dashboard_shows_each_devices_utilisation_and_memory() {
    need_chromium();
    let fx = xpu_testkit::hosts::mi300x().build();
    let bus = xpu_testkit::hosts::MI300X_BUSES[0];
    let dev = fx.device_dir(&format!("0000:{bus:02x}:00.0"));
    std::fs::write(dev.join("gpu_busy_percent"), "37\n").unwrap();
    std::fs::write(dev.join("mem_info_vram_used"), "3221225472\n").unwrap();
    std::fs::write(dev.join("mem_info_vram_total"), "206158430208\n").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = fx.root().to_str().unwrap().to_owned();
    let d = Daemon::start(&dir.path().join("data"), None, &["--root", &root]);
    d.wait_for("telemetry in /v1/devices", || {
        let v = d.get("/v1/devices");
        (v["devices"][0]["telemetry"]["utilization_percent"] == 37.0).then_some(())
    });
    let profile = dir.path().join("profile");
    let out = chromium(&profile, &["--dump-dom".to_owned()], &format!("{}/", d.url()));
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
    assert!(dom.contains("<td>37%</td><td>3.0 / 192.0 GiB</td>"), "utilisation and memory:\n{dom}");
}
