//! Crash safety of `xpu serve`: `kill -9` while clients submit 2,000 jobs (every acknowledged
//! job is there exactly once after restart; running tasks are re-adopted, lost ones failed and
//! retried per policy), and PostgreSQL leadership passing to a second daemon when the leader is
//! killed.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serve_support::{Daemon, Postgres, kill_tasks};
use xpu_server::client::{Client, Target};

const JOBS: usize = 2000;

/// Whether a process is alive: present and not a zombie.
fn alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}
const CLIENTS: usize = 8;

/// Every key a client saw acknowledged, with the id it got.
fn submit_all(
    port: u16,
    token: String,
    acked: Arc<Mutex<HashMap<String, i64>>>,
    stop: Arc<AtomicBool>,
    next: Arc<AtomicUsize>,
) {
    let mut client = Client::new(Target::Tcp(format!("127.0.0.1:{port}")), Some(token.clone()));
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= JOBS {
            return;
        }
        let key = format!("crash-{i}");
        let body = format!("name: crash-{i}\ncommand: [\"true\"]\ngpus: 1\n");
        // Retry the same key until acknowledged: the daemon may be dead for a while.
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match client.request(
                "POST",
                "/v1/jobs",
                Some(body.as_bytes()),
                &[("Idempotency-Key", &key)],
            ) {
                Ok(r) if r.status == 201 || r.status == 200 => {
                    let id = r.json().unwrap()["id"].as_i64().unwrap();
                    acked.lock().unwrap().insert(key.clone(), id);
                    break;
                }
                Ok(r) => panic!("submit {key}: {} {}", r.status, String::from_utf8_lossy(&r.body)),
                Err(_) => {
                    client =
                        Client::new(Target::Tcp(format!("127.0.0.1:{port}")), Some(token.clone()));
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

#[test]
fn kill9_during_2000_submissions_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut d = Daemon::start(&data, None, &["--devices", "nvidia-a100:1"]);

    // A task that will be running at the crash and must be re-adopted, and one whose process
    // dies while the daemon is down, which must be failed and retried (OnFailure, backoff 1).
    let blocker = d.submit("name: blocker\ncommand: [sleep, \"60\"]\ngpus: 1\n");
    let lost = d.submit(
        "name: lost\ncommand: [sleep, \"60\"]\nrestartPolicy: OnFailure\nbackoffLimit: 1\n",
    );
    d.wait_state(blocker, &["running"]);
    d.wait_state(lost, &["running"]);
    // Both recorded as running under their pids before the crash.
    let blocker_pid = d.wait_pid(blocker);
    let lost_pid = d.wait_pid(lost);
    let lost_job = d.get(&format!("/v1/jobs/{lost}"));
    eprintln!("blocker pid {blocker_pid}, lost pid {lost_pid}: {lost_job}");
    assert!(lost_pid > 1 && blocker_pid > 1);

    let acked = Arc::new(Mutex::new(HashMap::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (a, s, n, port) = (acked.clone(), stop.clone(), next.clone(), d.port);
            let token = d.token();
            std::thread::spawn(move || submit_all(port, token, a, s, n))
        })
        .collect();
    let t0 = Instant::now();
    while acked.lock().unwrap().len() < JOBS / 3 {
        assert!(t0.elapsed() < Duration::from_secs(serve_support::WAIT), "submissions too slow");
        std::thread::sleep(Duration::from_millis(5));
    }
    d.kill9();
    let at_kill = acked.lock().unwrap().len();
    // While the daemon is down, the "lost" task's process group dies too; the restart comes
    // once it is gone (or a zombie nobody has reaped yet).
    xpu_server::executor::signal_group(lost_pid as i32, xpu_server::executor::Sig::KILL);
    d.wait_for("the lost task to die", || (!alive(lost_pid)).then_some(()));
    d.restart();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let acked = acked.lock().unwrap().clone();
    eprintln!("acknowledged {at_kill} before kill -9, {} in all", acked.len());
    assert!(at_kill < JOBS, "the kill happened mid-way");
    assert_eq!(acked.len(), JOBS);

    // Every acknowledged job is in the store exactly once, with the id the client was told.
    let mut seen: HashMap<String, Vec<i64>> = HashMap::new();
    let mut before: Option<i64> = None;
    loop {
        let path = match before {
            Some(b) => format!("/v1/jobs?limit=1000&before={b}"),
            None => "/v1/jobs?limit=1000".to_owned(),
        };
        let page = d.get(&path);
        for j in page["jobs"].as_array().unwrap() {
            if let Some(k) = j["key"].as_str() {
                seen.entry(k.to_owned()).or_default().push(j["id"].as_i64().unwrap());
            }
        }
        match page["next"].as_i64() {
            Some(n) => before = Some(n),
            None => break,
        }
    }
    let dups: Vec<_> = seen.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(dups.is_empty(), "duplicated: {dups:?}");
    for (k, id) in &acked {
        assert_eq!(seen.get(k), Some(&vec![*id]), "acknowledged job {k} ({id})");
    }
    let names: HashSet<_> = seen.keys().collect();
    assert_eq!(names.len(), JOBS);

    // The re-adopted task still holds the only GPU in the scheduler's books: none of the
    // 2,000 GPU jobs started on it, and the device shows its holder.
    let running = d.get("/v1/jobs?state=running&limit=1000");
    let ids: HashSet<i64> =
        running["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_i64().unwrap()).collect();
    assert!(ids.iter().all(|id| *id == blocker || *id == lost), "{running}");
    // (The loop publishes its view once it has re-read the store, a moment after the API
    // answers.)
    d.wait_for("the GPU's holder to be the re-adopted task", || {
        (d.get("/v1/devices")["devices"][0]["holder"]["job"] == blocker).then_some(())
    });

    // The running task was re-adopted: same pid, still running, and an event says so.
    let b = d.get(&format!("/v1/jobs/{blocker}"));
    assert_eq!(b["state"], "running", "{b}");
    assert_eq!(b["tasks"].as_array().unwrap().len(), 1);
    assert_eq!(b["tasks"][0]["pid"].as_i64(), Some(blocker_pid));
    d.wait_for("the adopted event", || {
        let ev = d.get(&format!("/v1/events?job={blocker}"));
        ev["events"].as_array()?.iter().any(|e| e["kind"] == "adopted").then_some(())
    });

    // The dead one was failed (no exit status) and restarted per OnFailure.
    d.wait_state(lost, &["running", "failed"]);
    let l = d.wait_for("the lost task's retry to run", || {
        let l = d.get(&format!("/v1/jobs/{lost}"));
        (l["tasks"].as_array()?.len() >= 2 && l["tasks"][1]["state"] == "running").then_some(l)
    });
    assert_eq!(l["failures"], 1, "{l}");
    assert_eq!(l["tasks"][0]["state"], "failed");
    assert!(l["tasks"][0]["exit_code"].is_null());
    assert_eq!(l["tasks"][1]["state"], "running", "{l}");

    // The re-adopted task's exit status is still learned: cancel it and see it recorded.
    let r = d.client().request("POST", &format!("/v1/jobs/{blocker}/cancel"), None, &[]).unwrap();
    assert_eq!(r.status, 202);
    d.wait_state(blocker, &["cancelled"]);
    let b = d.wait_for("the re-adopted task's end to be recorded", || {
        let b = d.get(&format!("/v1/jobs/{blocker}"));
        (b["tasks"][0]["state"] == "cancelled").then_some(b)
    });
    assert_eq!(b["tasks"][0]["exit_code"], 143, "{b}");
    d.kill9();
    kill_tasks(&data);
}

#[test]
fn postgres_leader_killed_second_daemon_takes_over() {
    let pg = match Postgres::start() {
        Ok(pg) => pg,
        Err(why) => {
            eprintln!("skipping postgres_leader_killed_second_daemon_takes_over: {why}");
            return;
        }
    };
    let url = pg.database("leader");
    let dir = tempfile::tempdir().unwrap();
    let mut a = Daemon::start(&dir.path().join("a"), Some(&url), &["--node-name", "node-a"]);
    a.wait_for("the first daemon to lead", || {
        (a.get("/v1/status")["leader"] == true).then_some(())
    });
    let b = Daemon::start(&dir.path().join("b"), Some(&url), &["--node-name", "node-b"]);
    // b tries for leadership every second; over a few tries it must never get it.
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_millis(2500) {
        assert_eq!(b.get("/v1/status")["leader"], false, "exactly one daemon schedules");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Submitted through the follower, scheduled and run by the leader.
    let id = b.submit("command: [sh, -c, \"echo on $XPU_JOB_ID\"]\n");
    let j = b.wait_state(id, &["succeeded"]);
    assert_eq!(j["tasks"][0]["node"], "node-a");
    let long = b.submit("command: [sleep, \"60\"]\nrestartPolicy: Never\nbackoffLimit: 1\n");
    b.wait_state(long, &["running"]);
    b.wait_pid(long);

    let killed_at = Instant::now();
    a.kill9();
    let id2 = b.submit("command: [sh, -c, \"echo after takeover\"]\n");
    let j2 = b.wait_state(id2, &["succeeded"]);
    let took = killed_at.elapsed();
    eprintln!("takeover and run after leader kill: {took:?}");
    assert_eq!(j2["tasks"][0]["node"], "node-b");
    assert_eq!(b.get("/v1/status")["leader"], true);
    b.wait_for("node-b's leader event", || {
        let ev = b.get("/v1/events?limit=1000");
        let mine = |e: &serde_json::Value| {
            e["kind"] == "leader" && e["message"].as_str().is_some_and(|m| m.contains("node-b"))
        };
        ev["events"].as_array()?.iter().any(mine).then_some(())
    });
    // The task that ran under the dead leader is accounted for: re-adopted (same machine) or
    // failed and retried on the new leader.
    b.wait_for("the dead leader's task to be re-adopted or retried", || {
        let l = b.get(&format!("/v1/jobs/{long}"));
        let tasks = l["tasks"].as_array()?;
        let adopted = tasks.len() == 1 && tasks[0]["state"] == "running";
        let retried = tasks.len() == 2 && tasks[1]["node"] == "node-b";
        (adopted || retried).then_some(())
    });
    b.client().request("POST", &format!("/v1/jobs/{long}/cancel"), None, &[]).unwrap();
    b.wait_state(long, &["cancelled"]);
    kill_tasks(&dir.path().join("a"));
    kill_tasks(&dir.path().join("b"));
}
