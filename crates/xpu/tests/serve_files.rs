//! What `xpu serve` keeps in its data dir and who may read it: the store, the token and every
//! task's output are the daemon user's alone (the data dir is `0750` so that the socket's group
//! reaches the socket), from their creation, and modes an earlier version left open are taken
//! back at start with a warning.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use serve_support::Daemon;

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
