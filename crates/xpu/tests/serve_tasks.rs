//! How `xpu serve` runs a task whatever the job puts in it: a job's `PATH` does not break the
//! task supervisor, so an exit status is recorded even while the daemon is down.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod serve_support;

use serve_support::Daemon;

/// Whether a process is alive: present and not a zombie.
fn alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

#[test]
fn a_jobs_path_keeps_its_exit_status_across_a_daemon_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let gate = tmp.path().join("gate");
    let mut d = Daemon::start(&data, None, &[]);
    // The job's PATH has none of the usual commands; it names its own programs by path.
    let script =
        format!("while [ ! -e {} ]; do /bin/sleep 0.05; done; echo path=$PATH", gate.display());
    let id = d.submit(&format!(
        "command: [/bin/sh, -c, {}]\nenv: {{PATH: /opt/conda/bin}}\n",
        serde_json::to_string(&script).unwrap()
    ));
    let pid = d.wait_pid(id);
    // The daemon goes down; the task ends with status 0 while nobody waits for it.
    d.kill9();
    std::fs::write(&gate, "").unwrap();
    d.wait_for("the task to end", || (!alive(pid)).then_some(()));
    d.restart();
    let j = d.wait_state(id, &["succeeded", "failed"]);
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["tasks"][0]["exit_code"], 0, "{j}");
    d.wait_log(id, "path=/opt/conda/bin");
}
