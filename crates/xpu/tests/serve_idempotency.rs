//! `Idempotency-Key` on `POST /v1/jobs`, against SQLite and PostgreSQL: the same job under a
//! used key gets the first job back (200), a different job is refused (422, as the IETF
//! Idempotency-Key draft says) and the first job is kept.

#![allow(clippy::unwrap_used)]

mod serve_support;

use serve_support::{Daemon, Postgres, kill_tasks};

fn post(d: &Daemon, path: &str, body: &str, key: Option<&str>) -> (u16, serde_json::Value) {
    let h: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
    let r = d.client().request("POST", path, Some(body.as_bytes()), &h).unwrap();
    (r.status, r.json().unwrap())
}

fn reused_key_with_another_job_is_refused(d: &Daemon) {
    let first = "name: first\ncommand: [\"true\"]\n";
    let (status, v) = post(d, "/v1/jobs", first, Some("k-1"));
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_i64().unwrap();

    // The same job again, also written as JSON: the first job, 200.
    for same in [first, r#"{"command": ["true"], "name": "first"}"#] {
        let (status, v) = post(d, "/v1/jobs", same, Some("k-1"));
        assert_eq!(
            (status, v["id"].as_i64(), v["created"].as_bool()),
            (200, Some(id), Some(false))
        );
        assert_eq!(v["name"], "first");
    }

    // Another job under that key, by header or by query: 422 naming the key and the job.
    let other = "name: second\ncommand: [\"false\"]\n";
    for (path, key) in [("/v1/jobs", Some("k-1")), ("/v1/jobs?key=k-1", None)] {
        let (status, v) = post(d, path, other, key);
        assert_eq!(status, 422, "{v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.starts_with("idempotency key \"k-1\": already used for job"), "{e}");
        assert!(e.contains(&format!("job {id} with a different manifest")), "{e}");
        assert_eq!((v["field"].as_str(), v["id"].as_i64()), (Some("Idempotency-Key"), Some(id)));
    }

    // The first job is kept as it was, and no other job was made.
    let jobs = d.get("/v1/jobs");
    let jobs = jobs["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    let job = d.get(&format!("/v1/jobs/{id}"));
    assert_eq!((job["name"].as_str(), job["key"].as_str()), (Some("first"), Some("k-1")));
    assert_eq!(job["spec"]["container"]["argv"], serde_json::json!(["true"]));

    // A manifest with generateName gets a new random name on each parse; retried under its
    // key it is still the same job, and the answer names the first one.
    let generated = "apiVersion: v1\nkind: Pod\nmetadata: {generateName: sample-job-}\nspec:\n  restartPolicy: Never\n  containers:\n  - {name: c, command: [\"true\"]}\n";
    let (status, v) = post(d, "/v1/jobs", generated, Some("k-gen"));
    assert_eq!(status, 201, "{v}");
    let (gen_id, gen_name) = (v["id"].as_i64(), v["name"].clone());
    assert!(gen_name.as_str().unwrap().starts_with("sample-job-"), "{v}");
    let (status, v) = post(d, "/v1/jobs", generated, Some("k-gen"));
    assert_eq!((status, v["id"].as_i64(), &v["name"]), (200, gen_id, &gen_name), "{v}");
}

fn start(dir: &std::path::Path, db: Option<&str>) -> Daemon {
    Daemon::start(dir, db, &["--devices", "nvidia-a100:2", "--node-name", "node-a"])
}

#[test]
fn idempotency_key_reused_with_another_job_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(&dir.path().join("data"), None);
    reused_key_with_another_job_is_refused(&d);
    kill_tasks(&d.data_dir);
}

#[test]
fn idempotency_key_reused_with_another_job_postgres() {
    let pg = match Postgres::start() {
        Ok(pg) => pg,
        Err(why) => {
            eprintln!("skipping idempotency_key_reused_with_another_job_postgres: {why}");
            return;
        }
    };
    let url = pg.database("idem");
    let dir = tempfile::tempdir().unwrap();
    let d = start(&dir.path().join("data"), Some(&url));
    reused_key_with_another_job_is_refused(&d);
    kill_tasks(&d.data_dir);
}
