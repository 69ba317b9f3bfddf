//! `xpu serve` against manifests built to cost it: YAML aliases that expand a small body into a
//! huge job, and specs too large to store.

#![allow(clippy::unwrap_used)]

mod serve_support;

use serve_support::{Daemon, kill_tasks};

fn start(dir: &std::path::Path) -> Daemon {
    Daemon::start(dir, None, &["--devices", "nvidia-a100:2", "--node-name", "node-a"])
}

/// A short-form manifest whose env holds one `size`-byte value and `aliases` aliases of it.
fn aliased_env(size: usize, aliases: usize) -> String {
    let mut m = format!("command: [\"true\"]\nenv:\n  BASE: &v {}\n", "y".repeat(size));
    for i in 0..aliases {
        m.push_str(&format!("  V{i}: *v\n"));
    }
    m
}

/// What `POST /v1/jobs` answers to `body`: the status and the JSON.
fn post(d: &Daemon, body: &str) -> (u16, serde_json::Value) {
    let r = d.client().request("POST", "/v1/jobs", Some(body.as_bytes()), &[]).unwrap();
    (r.status, r.json().unwrap())
}

#[test]
fn alias_amplified_and_oversized_manifests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(&dir.path().join("data"));

    // 10 KB named by 2,000 aliases: a 30 KB body, a 20 MB job.
    let (status, v) = post(&d, &aliased_env(10_000, 2_000));
    assert_eq!(status, 400, "{v}");
    let e = v["error"].as_str().unwrap();
    assert!(e.starts_with("manifest: expands to more than"), "{e}");
    assert!(e.contains("remove the aliases"), "{e}");
    assert_eq!(v["field"], "manifest");

    // Within 4 times the body but over the stored spec's bound (1.5 MiB of JSON).
    let (status, v) = post(&d, &aliased_env(450_000, 3));
    assert_eq!(status, 400, "{v}");
    let e = v["error"].as_str().unwrap();
    assert!(e.contains("over the limit of 1572864"), "{e}");

    // Nothing was stored; a few aliases are still fine.
    assert_eq!(d.get("/v1/jobs")["jobs"].as_array().unwrap().len(), 0);
    let (status, v) = post(&d, &aliased_env(100, 3));
    assert_eq!(status, 201, "{v}");
    let job = d.get(&format!("/v1/jobs/{}", v["id"]));
    assert_eq!(job["spec"]["container"]["env"][3]["value"], "y".repeat(100));
    kill_tasks(&d.data_dir);
}

#[test]
fn deeply_nested_manifest_is_refused_and_status_answers_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(&dir.path().join("data"));
    let nested = |depth: usize| format!("command: {}x{}\n", "[".repeat(depth), "]".repeat(depth));

    let (status, v) = post(&d, &nested(5_000));
    assert_eq!(status, 400, "{v}");
    let e = v["error"].as_str().unwrap();
    assert!(e.starts_with("manifest: nests flow collections"), "{e}");
    assert!(e.contains("more than 64 deep at line 1 column 74"), "{e}");
    assert_eq!(v["field"], "manifest");

    // The body, 120 KB of brackets, twice at once: both refused, and the daemon
    // answers its status while they are in flight.
    let body = nested(60_000);
    let senders: Vec<_> = (0..2)
        .map(|_| {
            let (mut c, body) = (d.client(), body.clone());
            std::thread::spawn(move || {
                c.request("POST", "/v1/jobs", Some(body.as_bytes()), &[]).unwrap().status
            })
        })
        .collect();
    assert_eq!(d.get("/v1/status")["leader"], true);
    for s in senders {
        assert_eq!(s.join().unwrap(), 400);
    }
    kill_tasks(&d.data_dir);
}
