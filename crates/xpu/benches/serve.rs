//! `cargo bench -p xpu --bench serve`: the daemon's figures, printed.
//!
//! - sustained submissions/s over HTTP (loopback TCP, keep-alive) with the SQLite store, and
//!   the p50/p99 latency of one submit (each answered only after its group commit);
//! - submit-to-process-start latency (the task supervisor's `pid` file mtime minus the time the
//!   request was sent), p50 and p99;
//! - idle daemon RSS, fresh and after the throughput run;
//! - `xpu jobs` (one page) with 100,000 finished jobs in the store, wall time of the CLI
//!   process, p50 and p99;
//! - with `-- rss` only: RSS over 200,000 jobs submitted and finished through one daemon
//!   (`XPU_BENCH_RSS_JOBS` to change the count).

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use xpu_server::client::{Client, Target};
use xpu_server::store::{JobState, NewJob, Store, Write};

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

struct Daemon {
    child: Child,
    port: u16,
}

impl Daemon {
    fn start(data: &Path, extra: &[&str]) -> Daemon {
        Daemon::start_logging(data, extra, Stdio::null())
    }

    /// With its log (stderr) going to `log`.
    fn start_logging(data: &Path, extra: &[&str], log: Stdio) -> Daemon {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(XPU)
            .args(["serve", "--data-dir"])
            .arg(data)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let d = Daemon { child, port };
        let t0 = Instant::now();
        while d.client().request("GET", "/v1/status", None, &[]).map(|r| r.status).ok() != Some(200)
        {
            assert!(t0.elapsed() < Duration::from_secs(30), "daemon did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    fn client(&self) -> Client {
        Client::new(Target::Tcp(format!("127.0.0.1:{}", self.port)), None)
    }

    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn kill_tasks(data: &Path) {
    let Ok(jobs) = std::fs::read_dir(data.join("tasks")) else { return };
    for j in jobs.flatten() {
        for t in std::fs::read_dir(j.path()).into_iter().flatten().flatten() {
            if let Ok(p) = std::fs::read_to_string(t.path().join("pid"))
                && let Ok(pid) = p.trim().parse::<i32>()
                && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    String::from_utf8_lossy(&c).contains(&*t.path().to_string_lossy())
                })
            {
                xpu_server::executor::signal_group(pid, xpu_server::executor::Sig::KILL);
            }
        }
    }
}

fn throughput(tmp: &Path) {
    let data = tmp.join("tput");
    let d = Daemon::start(&data, &["--devices", "nvidia-a100:1"]);
    println!("idle daemon RSS (fresh): {} KiB", d.rss_kib());
    // One job holds the GPU, so what is measured is accepting and queueing jobs.
    let r = d
        .client()
        .request("POST", "/v1/jobs", Some(b"command: [sleep, \"600\"]\ngpus: 1\n"), &[])
        .unwrap();
    assert_eq!(r.status, 201);
    let clients = 16;
    let secs = 5.0;
    let lat = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let lat = lat.clone();
            let port = d.port;
            std::thread::spawn(move || {
                let mut client = Client::new(Target::Tcp(format!("127.0.0.1:{port}")), None);
                let mut mine = Vec::new();
                let mut i = 0;
                while t0.elapsed().as_secs_f64() < secs {
                    let body = format!("name: bench-{c}-{i}\ncommand: [\"true\"]\ngpus: 1\n");
                    let s = Instant::now();
                    let r = client.request("POST", "/v1/jobs", Some(body.as_bytes()), &[]).unwrap();
                    mine.push(s.elapsed().as_secs_f64() * 1000.0);
                    assert_eq!(r.status, 201);
                    i += 1;
                }
                lat.lock().unwrap().extend(mine);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let mut l = lat.lock().unwrap().clone();
    l.sort_by(f64::total_cmp);
    println!(
        "submissions over HTTP (SQLite, {clients} clients, {secs} s): {:.0}/s, p50 {:.2} ms, p99 {:.2} ms ({} jobs)",
        l.len() as f64 / elapsed,
        pct(&l, 0.5),
        pct(&l, 0.99),
        l.len()
    );
    std::thread::sleep(Duration::from_secs(2));
    println!("daemon RSS after the run with {} queued jobs: {} KiB", l.len(), d.rss_kib());
    drop(d);
    kill_tasks(&data);
}

/// `--log-format json` under load: jobs submitted by 8 clients and run to the end; every line
/// of the log must parse as JSON, and every job must have one event per state change
/// (queued, running, succeeded; its task starting, running, succeeded) carrying its id.
fn json_logs(tmp: &Path) {
    let data = tmp.join("json");
    std::fs::create_dir_all(&data).unwrap();
    let log_path = data.join("serve.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let d = Daemon::start_logging(&data, &["--log-format", "json"], Stdio::from(log));
    let (clients, per_client) = (8, 250);
    let t0 = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let port = d.port;
            std::thread::spawn(move || {
                let mut client = Client::new(Target::Tcp(format!("127.0.0.1:{port}")), None);
                (0..per_client)
                    .map(|i| {
                        let body = format!("name: json-{c}-{i}\ncommand: [\"true\"]\n");
                        let r =
                            client.request("POST", "/v1/jobs", Some(body.as_bytes()), &[]).unwrap();
                        assert_eq!(r.status, 201);
                        r.json().unwrap()["id"].as_i64().unwrap()
                    })
                    .collect::<Vec<i64>>()
            })
        })
        .collect();
    let ids: Vec<i64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let submit_rate = ids.len() as f64 / t0.elapsed().as_secs_f64();
    // Until every job's last event is in the log.
    let parsed = loop {
        let text = std::fs::read_to_string(&log_path).unwrap();
        // A line still being written has no newline yet.
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        let lines: Vec<&str> = whole.lines().collect();
        let events: Vec<serde_json::Value> =
            lines.iter().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let done = events
            .iter()
            .filter(|e| {
                e["fields"]["message"] == "job state" && e["fields"]["state"] == "succeeded"
            })
            .count();
        if done >= ids.len() {
            break (lines.len(), events);
        }
        assert!(t0.elapsed() < Duration::from_secs(600), "jobs did not finish: {done}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let elapsed = t0.elapsed().as_secs_f64();
    let (lines, events) = parsed;
    let mut per_job: std::collections::HashMap<i64, (Vec<String>, Vec<String>)> =
        std::collections::HashMap::new();
    for e in &events {
        let Some(id) = e["fields"]["job_id"].as_i64() else { continue };
        let state = e["fields"]["state"].as_str().unwrap_or_default().to_owned();
        let entry = per_job.entry(id).or_default();
        match e["fields"]["message"].as_str() {
            Some("job state") => entry.0.push(state),
            Some("task state") => entry.1.push(state),
            _ => {}
        }
    }
    let whole = ids
        .iter()
        .filter(|id| {
            per_job.get(id).is_some_and(|(job, task)| {
                job == &["queued", "running", "succeeded"]
                    && task == &["starting", "running", "succeeded"]
            })
        })
        .count();
    println!(
        "--log-format json: {} of {lines} log lines parse as JSON; {whole} of {} jobs have exactly one event per state change with their job id (job queued/running/succeeded, task starting/running/succeeded); {:.0} submissions/s while logging, all run in {elapsed:.1} s",
        events.len(),
        ids.len(),
        submit_rate
    );
    let text = std::fs::read_to_string(&log_path).unwrap();
    let not_json: Vec<&str> =
        text.lines().filter(|l| serde_json::from_str::<serde_json::Value>(l).is_err()).collect();
    assert!(not_json.is_empty(), "log lines that are not JSON: {not_json:?}");
    assert_eq!(whole, ids.len(), "a job's state changes are not one event each");
}

fn start_latency(tmp: &Path) {
    let data = tmp.join("start");
    let d = Daemon::start(&data, &[]);
    let mut client = d.client();
    let mut lat = Vec::new();
    for i in 0..50 {
        let sent = SystemTime::now();
        let body = format!("name: start-{i}\ncommand: [\"true\"]\n");
        let r = client.request("POST", "/v1/jobs", Some(body.as_bytes()), &[]).unwrap();
        let id = r.json().unwrap()["id"].as_i64().unwrap();
        let pid_file = data.join(format!("tasks/{id}/0-0/pid"));
        let t0 = Instant::now();
        while !pid_file.exists() {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_micros(200));
        }
        let started = std::fs::metadata(&pid_file).unwrap().modified().unwrap();
        lat.push(started.duration_since(sent).map_or(0.0, |d| d.as_secs_f64() * 1000.0));
        std::thread::sleep(Duration::from_millis(20));
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "submit to process start: p50 {:.1} ms, p99 {:.1} ms (50 jobs, one at a time)",
        pct(&lat, 0.5),
        pct(&lat, 0.99)
    );
}

fn jobs_with_100k(tmp: &Path) {
    let data = tmp.join("big");
    std::fs::create_dir_all(&data).unwrap();
    let url = format!("sqlite://{}", data.join("xpu.db").display());
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let t0 = Instant::now();
    rt.block_on(async {
        let store = Arc::new(Store::open(&url).await.unwrap());
        let spec =
            serde_json::to_string(&xpu_core::job::parse("command: [\"true\"]\n").unwrap().spec)
                .unwrap();
        for chunk in 0..100 {
            let mut tasks = Vec::new();
            for i in 0..1000 {
                let store = store.clone();
                let spec = spec.clone();
                tasks.push(tokio::spawn(async move {
                    let n = chunk * 1000 + i;
                    let out = store
                        .write(Write::Submit(NewJob {
                            key: None,
                            name: format!("done-{n}"),
                            queue: "default".into(),
                            priority: 0,
                            spec,
                            at_ms: 1_700_000_000_000 + n,
                            owner: xpu_server::store::Owner { uid: 0, gid: 0 },
                        }))
                        .await
                        .unwrap();
                    let xpu_server::store::Outcome::Submitted { id, .. } = out else { panic!() };
                    store
                        .write(Write::SetJob {
                            id,
                            state: JobState::Succeeded,
                            at_ms: 1_700_000_000_000 + n + 5,
                            failures: 0,
                            message: Some("1 of 1 completions succeeded".into()),
                        })
                        .await
                        .unwrap();
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    });
    drop(rt);
    println!("stored 100,000 finished jobs in {:.1} s", t0.elapsed().as_secs_f64());
    let d = Daemon::start(&data, &[]);
    let server = format!("http://127.0.0.1:{}", d.port);
    for (label, args) in [
        ("xpu jobs", vec!["jobs"]),
        ("xpu jobs --format json", vec!["jobs", "--format", "json"]),
        (
            "xpu jobs --state succeeded --before 50000",
            vec!["jobs", "--state", "succeeded", "--before", "50000"],
        ),
    ] {
        let mut times = Vec::new();
        for _ in 0..20 {
            let s = Instant::now();
            let out = Command::new(XPU).args(&args).args(["--server", &server]).output().unwrap();
            times.push(s.elapsed().as_secs_f64() * 1000.0);
            assert!(out.status.success());
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{label} with 100,000 finished jobs (whole CLI process): p50 {:.1} ms, p99 {:.1} ms",
            pct(&times, 0.5),
            pct(&times, 0.99)
        );
    }
    println!("daemon RSS with 100,000 jobs in the store: {} KiB", d.rss_kib());
}

/// A gauge or counter from `/metrics`.
fn metric(d: &Daemon, name: &str) -> u64 {
    let r = d.client().request("GET", "/metrics", None, &[]).unwrap();
    let text = String::from_utf8_lossy(&r.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// `XPU_BENCH_RSS_JOBS` (200,000 by default) jobs submitted and run to the end through one
/// daemon, 1,000 at a time: RSS after the first 10,000 and at the end, and what the scheduler
/// still holds (it forgets each job it ends, so it never grows and is never rebuilt).
fn rss_over_many_jobs(tmp: &Path) {
    let total: u64 =
        std::env::var("XPU_BENCH_RSS_JOBS").ok().and_then(|n| n.parse().ok()).unwrap_or(200_000);
    let data = tmp.join("rss");
    let d = Daemon::start(&data, &["--devices", "nvidia-a100:8"]);
    let batch = 1000;
    let t0 = Instant::now();
    let mut after_10k = None;
    let mut done = 0;
    while done < total {
        let n = batch.min(total - done);
        let threads: Vec<_> = (0..4)
            .map(|c| {
                let port = d.port;
                std::thread::spawn(move || {
                    let mut client = Client::new(Target::Tcp(format!("127.0.0.1:{port}")), None);
                    for i in (c..n).step_by(4) {
                        let body = format!("name: rss-{}\ncommand: [\"true\"]\n", done + i);
                        let r =
                            client.request("POST", "/v1/jobs", Some(body.as_bytes()), &[]).unwrap();
                        assert_eq!(r.status, 201);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // Wait for the batch to end: the scheduler holds nothing once every job is reaped.
        let wait = Instant::now();
        while metric(&d, "xpu_scheduler_jobs") > 0 {
            assert!(wait.elapsed() < Duration::from_secs(600), "a batch did not end");
            std::thread::sleep(Duration::from_millis(50));
        }
        done += n;
        if done >= 10_000 && after_10k.is_none() {
            after_10k = Some(d.rss_kib());
            println!("RSS after the first {done} jobs: {} KiB", after_10k.unwrap_or(0));
        }
    }
    let end = d.rss_kib();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{done} jobs submitted and finished through one daemon in {secs:.0} s ({:.0} jobs/s); RSS at the end {end} KiB; after 10,000 {} KiB; growth {:+} KiB; scheduler jobs held at the end: {}; tasks started: {}",
        done as f64 / secs,
        after_10k.unwrap_or(0),
        end as i64 - after_10k.unwrap_or(end) as i64,
        metric(&d, "xpu_scheduler_jobs"),
        metric(&d, "xpu_tasks_started_total"),
    );
}

fn main() {
    // `cargo test --benches` runs this with `--bench` absent; only measure when benchmarking.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // `cargo bench -p xpu --bench serve -- rss`: only the long memory run.
    if std::env::args().any(|a| a == "rss") {
        rss_over_many_jobs(tmp.path());
        return;
    }
    throughput(tmp.path());
    start_latency(tmp.path());
    json_logs(tmp.path());
    jobs_with_100k(tmp.path());
    kill_tasks(&tmp.path().join("start"));
}
