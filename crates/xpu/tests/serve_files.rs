//! What `xpu serve` keeps in its data dir and who may read it: the store, the token and every
//! task's output are the daemon user's alone (the data dir is `0750` so that the socket's group
//! reaches the socket), from their creation, and modes an earlier version left open are taken
//! back at start with a warning. A store that was created and is now missing, empty or damaged
//! is refused at start, and a task never runs in a directory an earlier store left.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serve_support::{Daemon, WAIT, free_port, xpu_bin};
use xpu_server::client::{Client, Target};

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

#[test]
fn store_logs_and_token_are_private_and_fixed_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut d = Daemon::start(&data, None, &[]);
    let id = d.submit("command: [sh, -c, \"echo secret; umask\"]\nenv: {API_KEY: hunter2}\n");
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    let task = data.join("tasks").join(id.to_string()).join("0-0");
    let want: [(&Path, u32); 10] = [
        (&data, 0o750),
        (&data.join("xpu.sock"), 0o660),
        (&data.join("xpu.db"), 0o600),
        (&data.join("xpu.db-wal"), 0o600),
        (&data.join("xpu.db-shm"), 0o600),
        (&data.join("token"), 0o600),
        (&data.join("tasks"), 0o700),
        (&data.join("tasks").join(id.to_string()), 0o700),
        (&task, 0o700),
        (&task.join("output.log"), 0o600),
    ];
    for (p, m) in want {
        assert_eq!(format!("{:04o}", mode(p)), format!("{m:04o}"), "{}", p.display());
    }
    // The job's own files keep the usual umask.
    d.wait_log(id, "secret\n0022\n");

    // What an earlier version left: world-readable. Taken back at the next start, saying so.
    d.kill9();
    chmod(&data, 0o755);
    chmod(&data.join("tasks"), 0o755);
    for f in ["xpu.db", "xpu.db-wal", "token"] {
        chmod(&data.join(f), 0o644);
    }
    d.restart();
    assert_eq!(mode(&data), 0o750);
    assert_eq!(mode(&data.join("tasks")), 0o700);
    for f in ["xpu.db", "xpu.db-wal", "xpu.db-shm", "token"] {
        assert_eq!(mode(&data.join(f)), 0o600, "{f}");
    }
    let log = d.log();
    assert!(
        log.contains(&format!(
            "warning: {} was mode 0755, open to every local user; changed to 0750",
            data.display()
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!("warning: {} was mode 0644", data.join("xpu.db").display())),
        "{log}"
    );
}

/// Stops the daemon as an operator would (SIGTERM) and waits for it.
fn stop(d: &mut Daemon) {
    xpu_server::executor::signal_task(d.child.id() as i32, xpu_server::executor::Sig::TERM);
    d.child.wait().unwrap();
}

/// Starts `xpu serve` on `data` expecting it to refuse: its exit code and stderr, or a failure
/// naming what happened when it serves instead.
fn start_refused(data: &Path) -> (Option<i32>, String) {
    let port = free_port();
    let err = data.parent().unwrap().join("refused.log");
    let mut child = Command::new(xpu_bin())
        .args(["serve", "--data-dir", data.to_str().unwrap()])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(WAIT);
    let mut client = Client::new(Target::Tcp(format!("127.0.0.1:{port}")), None);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status.code(), std::fs::read_to_string(&err).unwrap());
        }
        let serving = client.request("GET", "/v1/status", None, &[]).is_ok_and(|r| r.status == 200);
        if serving || Instant::now() > deadline {
            // The test fails below either way; kill fails only if it already exited.
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "xpu serve started on {} instead of refusing it:\n{}",
                data.display(),
                std::fs::read_to_string(&err).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_store_that_was_created_and_is_now_empty_or_missing_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut d = Daemon::start(&data, None, &[]);
    let id = d.submit("command: [echo, old output]\n");
    d.wait_state(id, &["succeeded"]);
    stop(&mut d);
    let db = data.join("xpu.db");
    // Truncated to 0 bytes (a full disk, a botched copy): refused, and left as it is.
    std::fs::File::create(&db).unwrap();
    let (code, stderr) = start_refused(&data);
    assert_eq!(code, Some(1), "{stderr}");
    let marker = data.join("xpu.db.created");
    assert!(
        stderr.contains(&format!(
            "store {} is empty, but {} records that a store was created there: restore",
            db.display(),
            marker.display()
        )),
        "{stderr}"
    );
    assert!(stderr.contains(&format!("remove {} first", marker.display())), "{stderr}");
    assert!(!stderr.contains("xpu serve: socket"), "{stderr}");
    assert_eq!(std::fs::metadata(&db).unwrap().len(), 0, "the evidence is left as it was");
    // Gone altogether: refused too.
    std::fs::remove_file(&db).unwrap();
    let (code, stderr) = start_refused(&data);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&format!("store {} is missing, but", db.display())), "{stderr}");
}

#[test]
fn a_damaged_store_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut d = Daemon::start(&data, None, &[]);
    // Enough jobs that the store spans many pages.
    let pad = "p".repeat(1000);
    let ids: Vec<i64> = (0..200)
        .map(|_| d.submit(&format!("command: [\"true\"]\nenv: {{PAD: {pad}}}\n")))
        .collect();
    for id in ids {
        d.wait_state(id, &["succeeded"]);
    }
    stop(&mut d);
    let db = data.join("xpu.db");
    let wal = std::fs::metadata(data.join("xpu.db-wal")).map_or(0, |m| m.len());
    assert_eq!(wal, 0, "a daemon that stops leaves its whole store in xpu.db");
    // Garbage over pages in the middle.
    let len = std::fs::metadata(&db).unwrap().len();
    assert!(len > 256 * 1024, "{len}");
    let mut bytes = std::fs::read(&db).unwrap();
    let at = (len as usize / 2) & !4095;
    for (i, b) in bytes[at..at + 16384].iter_mut().enumerate() {
        *b = (i * 7 + 13) as u8;
    }
    std::fs::write(&db, bytes).unwrap();
    let (code, stderr) = start_refused(&data);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&format!("store {} is damaged (", db.display())), "{stderr}");
    assert!(stderr.contains("restore it from a backup"), "{stderr}");

    // Not a database at all.
    std::fs::write(
        &db,
        "this is not a database, but it is long enough to look like one ".repeat(100),
    )
    .unwrap();
    let (code, stderr) = start_refused(&data);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&format!("store {} is damaged (", db.display())), "{stderr}");
}

#[test]
fn a_new_store_never_reuses_an_old_task_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let mut d = Daemon::start(&data, None, &[]);
    let id = d.submit("command: [echo, old output]\n");
    d.wait_state(id, &["succeeded"]);
    stop(&mut d);
    // The operator starts a new store on purpose; the task directories stay.
    for f in ["xpu.db", "xpu.db-wal", "xpu.db-shm", "xpu.db.created"] {
        // The WAL and SHM files may not exist after a checkpointed stop.
        let _ = std::fs::remove_file(data.join(f));
    }
    d.restart();
    let again = d.submit("command: [echo, new output]\n");
    assert_eq!(again, id, "job ids start from 1 again in a new store");
    d.wait_state(again, &["succeeded"]);
    let r = d.client().request("GET", &format!("/v1/jobs/{again}/logs"), None, &[]).unwrap();
    assert_eq!(String::from_utf8_lossy(&r.body), "new output\n");
    // The old output is kept, moved aside.
    let job_dir = data.join("tasks").join(id.to_string());
    let aside: Vec<_> = std::fs::read_dir(&job_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("0-0.stale-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(
        std::fs::read_to_string(aside[0].path().join("output.log")).unwrap(),
        "old output\n"
    );
}
