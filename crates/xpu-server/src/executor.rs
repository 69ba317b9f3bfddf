//! Runs tasks: each attempt is a process group in its own directory under the data dir
//! (`tasks/<job>/<index>-<attempt>/`), with stdout and stderr appended to `output.log` there.
//!
//! The task's program runs under a small `/bin/sh` supervisor that is the process group leader.
//! It writes its pid to `pid` at start and the program's exit status to `exit` when it ends, so
//! a task outlives a daemon crash and the restarted daemon can re-adopt it (the pid is alive and
//! its command line names the task directory) and still learn its exit status. The supervisor
//! forwards SIGTERM to the program, so cancellation is SIGTERM to the whole group, then SIGKILL
//! after a grace period.
//!
//! This module only starts, signals and watches processes; the scheduling loop decides.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use rustix::process::{Pid, Signal};

/// The supervisor script. `$1` is the task directory; the rest is the program's argv.
/// Traps are set before anything else, so a SIGTERM that arrives while it starts is not lost:
/// it is remembered and passed on as soon as the program exists.
const SUPERVISOR: &str = r#"d=$1; shift
c=; t=
trap 't=TERM; [ -n "$c" ] && kill -TERM $c 2>/dev/null' TERM
trap 't=INT; [ -n "$c" ] && kill -INT $c 2>/dev/null' INT
echo $$ > "$d/pid"
"$@" &
c=$!
[ -n "$t" ] && kill -$t $c 2>/dev/null
while :; do
  wait $c; rc=$?
  kill -0 $c 2>/dev/null || break
done
echo $rc > "$d/exit.tmp" && mv "$d/exit.tmp" "$d/exit"
exit $rc"#;

/// The process name the supervisor runs under (`ps` shows it).
const SUPERVISOR_NAME: &str = "xpu-task";

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("creating task directory {path}: {source}")]
    Dir { path: String, source: std::io::Error },
    #[error("starting {program:?} for job {job} task {idx}: {source}")]
    Spawn { program: String, job: i64, idx: u32, source: std::io::Error },
    #[error("job {job}: working directory {dir} does not exist; create it or fix workingDir")]
    WorkingDir { job: i64, dir: String },
}

/// Everything needed to start one task attempt.
#[derive(Debug, Clone)]
pub struct Launch {
    pub job_id: i64,
    pub idx: u32,
    pub attempt: u32,
    pub argv: Vec<String>,
    /// Final environment additions, applied in order (later wins).
    pub env: Vec<(String, String)>,
    pub working_dir: Option<String>,
    pub dir: PathBuf,
}

/// A started task.
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub child: tokio::process::Child,
}

/// The directory of one attempt.
pub fn task_dir(data_dir: &Path, job_id: i64, idx: u32, attempt: u32) -> PathBuf {
    data_dir.join("tasks").join(job_id.to_string()).join(format!("{idx}-{attempt}"))
}

/// Variables passed through from the daemon's environment; everything else is the job's own.
const PASS_ENV: [&str; 6] = ["PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ"];

/// Starts the attempt. The directory is created; `output.log` is opened for appending so an
/// `OnFailure` restart in place keeps the earlier output.
pub fn spawn(l: &Launch) -> Result<Spawned, ExecError> {
    std::fs::create_dir_all(&l.dir)
        .map_err(|source| ExecError::Dir { path: l.dir.display().to_string(), source })?;
    let _ = std::fs::remove_file(l.dir.join("exit"));
    let log_path = l.dir.join("output.log");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|source| ExecError::Dir { path: log_path.display().to_string(), source })?;
    let log2 = log
        .try_clone()
        .map_err(|source| ExecError::Dir { path: log_path.display().to_string(), source })?;
    let cwd = match &l.working_dir {
        Some(w) if Path::new(w).is_absolute() => {
            if !Path::new(w).is_dir() {
                return Err(ExecError::WorkingDir { job: l.job_id, dir: w.clone() });
            }
            PathBuf::from(w)
        }
        Some(w) => {
            let p = l.dir.join(w);
            std::fs::create_dir_all(&p)
                .map_err(|source| ExecError::Dir { path: p.display().to_string(), source })?;
            p
        }
        None => l.dir.clone(),
    };
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.arg("-c").arg(SUPERVISOR).arg(SUPERVISOR_NAME).arg(&l.dir).args(&l.argv);
    cmd.env_clear();
    for k in PASS_ENV {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    if std::env::var_os("PATH").is_none() {
        cmd.env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin");
    }
    for (k, v) in &l.env {
        cmd.env(k, v);
    }
    cmd.current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        // Its own process group, so a signal reaches everything the task started.
        .process_group(0)
        .kill_on_drop(false);
    let child = cmd.spawn().map_err(|source| ExecError::Spawn {
        program: l.argv.first().cloned().unwrap_or_default(),
        job: l.job_id,
        idx: l.idx,
        source,
    })?;
    let pid = child.id().map_or(0, |p| p as i32);
    Ok(Spawned { pid, child })
}

/// Sends `sig` to the task's process group; a group that is already gone is not an error.
/// Pids 0 and 1 are refused: `kill(-1)` would signal every process on the host.
pub fn signal_group(pid: i32, sig: Signal) {
    if pid <= 1 {
        return;
    }
    if let Some(pid) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process_group(pid, sig);
    }
}

pub use rustix::process::Signal as Sig;

/// The exit status the supervisor recorded, if it finished.
pub fn recorded_exit(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join("exit")).ok()?.trim().parse().ok()
}

/// The supervisor's pid from its `pid` file.
pub fn recorded_pid(dir: &Path) -> Option<i32> {
    std::fs::read_to_string(dir.join("pid")).ok()?.trim().parse().ok()
}

/// Whether `pid` is alive and is the supervisor of the task in `dir` (its command line names the
/// directory), so a recycled pid is never mistaken for the task.
pub fn is_our_supervisor(pid: i32, dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // A zombie has exited; its parent has not reaped it yet.
    if stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')) {
        return false;
    }
    let want: OsString = dir.as_os_str().to_owned();
    cmdline.split(|b| *b == 0).any(|arg| arg == want.as_encoded_bytes())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn supervisor_records_pid_and_exit() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Launch {
            job_id: 1,
            idx: 0,
            attempt: 0,
            argv: vec!["sh".into(), "-c".into(), "echo hi $FOO; exit 3".into()],
            env: vec![("FOO".into(), "bar".into())],
            working_dir: None,
            dir: tmp.path().join("t"),
        };
        let mut s = spawn(&l).unwrap();
        let status = s.child.wait().await.unwrap();
        assert_eq!(status.code(), Some(3));
        assert_eq!(recorded_exit(&l.dir), Some(3));
        assert_eq!(recorded_pid(&l.dir), Some(s.pid));
        assert_eq!(std::fs::read_to_string(l.dir.join("output.log")).unwrap(), "hi bar\n");
    }

    #[tokio::test]
    async fn sigterm_reaches_the_program_and_is_recorded() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Launch {
            job_id: 1,
            idx: 0,
            attempt: 0,
            argv: vec!["sleep".into(), "30".into()],
            env: vec![],
            working_dir: None,
            dir: tmp.path().join("t"),
        };
        let mut s = spawn(&l).unwrap();
        for _ in 0..100 {
            if recorded_pid(&l.dir).is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(is_our_supervisor(s.pid, &l.dir));
        signal_group(s.pid, Signal::TERM);
        let status = s.child.wait().await.unwrap();
        assert_eq!(status.code(), Some(143));
        assert_eq!(recorded_exit(&l.dir), Some(143));
        assert!(!is_our_supervisor(s.pid, &l.dir));
    }
}
