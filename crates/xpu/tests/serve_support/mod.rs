//! Helpers for the `xpu serve` tests: a private PostgreSQL server (Debian's PostgreSQL 15, run
//! as the `postgres` user on a free loopback port in a temporary directory), a daemon process
//! with its data dir, and a client. Everything started here is stopped on drop.

#![allow(clippy::unwrap_used, clippy::print_stderr, dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use xpu_server::client::{Client, Target};

pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// Seconds a test waits for something the daemon does: generous, because CI runs the whole
/// suite at once on two cores. Every wait polls and ends as soon as its condition holds, so
/// this costs nothing when the machine is idle; no test sleeps a fixed time instead.
pub const WAIT: u64 = 120;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A PostgreSQL server for one test binary.
pub struct Postgres {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

fn uid_gid(user: &str) -> Option<(u32, u32)> {
    let out = Command::new("id").args(["-u", user]).output().ok()?;
    let uid = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    let out = Command::new("id").args(["-g", user]).output().ok()?;
    let gid = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some((uid, gid))
}

impl Postgres {
    /// Starts a server, or says why it cannot (PostgreSQL not installed: run
    /// scripts/install-test-deps).
    pub fn start() -> Result<Postgres, String> {
        if !Path::new(PG_BIN).join("postgres").exists() {
            return Err(format!("{PG_BIN}/postgres is missing; run scripts/install-test-deps"));
        }
        let (uid, gid) = uid_gid("postgres").ok_or("no postgres user")?;
        let dir =
            tempfile::Builder::new().prefix("xpu-pg-").tempdir().map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| e.to_string())?;
        let data = dir.path().join("data");
        // initdb refuses to run as root, so the server runs as the postgres user.
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(format!("{PG_BIN}/initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8", "-D"])
            .arg(&data)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("initdb failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let port = free_port();
        let child = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(format!("{PG_BIN}/postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(dir.path())
            .args(["-c", "max_connections=100"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let pg = Postgres { port, child, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(WAIT);
        loop {
            let ok = Command::new(format!("{PG_BIN}/pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-q"])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ok {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("postgres did not become ready in {WAIT} s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(pg)
    }

    /// A fresh database on this server, so each test starts from an empty store.
    pub fn database(&self, name: &str) -> String {
        let out = Command::new(format!("{PG_BIN}/createdb"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres", name])
            .output()
            .unwrap();
        assert!(out.status.success(), "createdb: {}", String::from_utf8_lossy(&out.stderr));
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // runuser forwards SIGTERM to postgres (smart shutdown); then it is waited for.
        let _ = rustix_kill(self.child.id() as i32, 15);
        let _ = self.child.wait();
    }
}

fn rustix_kill(pid: i32, sig: i32) -> bool {
    // `--` keeps procps kill from reading the pid as an option.
    Command::new("kill")
        .args(["-s".to_owned(), sig.to_string(), "--".to_owned(), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// A running `xpu serve`.
pub struct Daemon {
    pub child: Child,
    pub data_dir: PathBuf,
    pub port: u16,
    pub args: Vec<String>,
    /// Added to the daemon's environment.
    pub env: Vec<(String, String)>,
    /// Leave the tasks running on drop (the daemon is being replaced by a restarted one).
    keep_tasks: bool,
}

pub fn xpu_bin() -> &'static str {
    env!("CARGO_BIN_EXE_xpu")
}

impl Daemon {
    /// Starts `xpu serve` with `extra` args and waits until its socket answers.
    pub fn start(data_dir: &Path, db: Option<&str>, extra: &[&str]) -> Daemon {
        Self::start_with_env(data_dir, db, extra, &[])
    }

    /// [`Daemon::start`] with variables added to the daemon's environment.
    pub fn start_with_env(
        data_dir: &Path,
        db: Option<&str>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let port = free_port();
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--grace-seconds".into(),
            "1".into(),
            // In-place restarts at once: the kubelet's 10 s back-off would only slow tests.
            "--restart-backoff-seconds".into(),
            "0".into(),
        ];
        if let Some(db) = db {
            args.push("--db".into());
            args.push(db.into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Self::spawn(data_dir, port, args, env)
    }

    fn spawn(data_dir: &Path, port: u16, args: Vec<String>, env: Vec<(String, String)>) -> Daemon {
        std::fs::create_dir_all(data_dir).unwrap();
        let log = std::fs::File::create(data_dir.join(format!("daemon-{port}.log"))).unwrap();
        let child = Command::new(xpu_bin())
            .args(&args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        let d = Daemon { child, data_dir: data_dir.to_owned(), port, args, env, keep_tasks: false };
        d.wait_ready();
        d
    }

    /// The same daemon again (after a crash), on the same address.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let again = Self::spawn(&self.data_dir, self.port, self.args.clone(), self.env.clone());
        let mut old = std::mem::replace(self, again);
        old.keep_tasks = true;
    }

    fn wait_ready(&self) {
        self.wait_for("the daemon to answer", || {
            self.client()
                .request("GET", "/v1/status", None, &[])
                .ok()
                .filter(|r| r.status == 200)
                .map(|_| ())
        });
    }

    /// Polls `f` until it gives `Some` and returns that; fails after [`WAIT`] seconds, naming
    /// `what` and showing the daemon's log.
    pub fn wait_for<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(WAIT);
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data_dir.join(format!("daemon-{}.log", self.port)))
            .unwrap_or_default()
    }

    pub fn socket(&self) -> String {
        format!("unix://{}", self.data_dir.join("xpu.sock").display())
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A client over loopback TCP with the daemon's token: as the daemon's own user.
    pub fn client(&self) -> Client {
        Client::new(Target::Tcp(format!("127.0.0.1:{}", self.port)), Some(self.token()))
    }

    /// A client over loopback TCP without a token: what any local user has.
    pub fn anonymous(&self) -> Client {
        Client::new(Target::Tcp(format!("127.0.0.1:{}", self.port)), None)
    }

    /// The daemon's token (`<data-dir>/token`).
    pub fn token(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("token")).unwrap_or_default().trim().to_owned()
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills with SIGKILL: no cleanup runs.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Runs the CLI against this daemon (over its Unix socket).
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(xpu_bin()).args(args).env("XPU_SERVER", self.socket()).output().unwrap()
    }

    pub fn cli_json(&self, args: &[&str]) -> Value {
        let out = self.cli(args);
        assert!(out.status.success(), "xpu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    pub fn get(&self, path: &str) -> Value {
        let r = self.client().request("GET", path, None, &[]).unwrap();
        assert_eq!(r.status, 200, "GET {path}: {}", String::from_utf8_lossy(&r.body));
        r.json().unwrap()
    }

    /// Submits a manifest and returns the job id.
    pub fn submit(&self, manifest: &str) -> i64 {
        let r = self.client().request("POST", "/v1/jobs", Some(manifest.as_bytes()), &[]).unwrap();
        assert_eq!(r.status, 201, "submit: {}", String::from_utf8_lossy(&r.body));
        r.json().unwrap()["id"].as_i64().unwrap()
    }

    /// Waits (up to [`WAIT`] seconds) until the job is in one of the `want` states and
    /// returns it.
    pub fn wait_state(&self, id: i64, want: &[&str]) -> Value {
        let deadline = Instant::now() + Duration::from_secs(WAIT);
        loop {
            let j = self.get(&format!("/v1/jobs/{id}"));
            if want.contains(&j["state"].as_str().unwrap_or("")) {
                return j;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} never reached {want:?}: {j}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the job's first task has a pid recorded, and returns it.
    pub fn wait_pid(&self, id: i64) -> i64 {
        self.wait_for(&format!("job {id}'s task pid"), || {
            self.get(&format!("/v1/jobs/{id}"))["tasks"][0]["pid"].as_i64()
        })
    }

    /// Waits until the job's log (task 0) contains `text`.
    pub fn wait_log(&self, id: i64, text: &str) {
        self.wait_for(&format!("{text:?} in job {id}'s log"), || {
            let r = self.client().request("GET", &format!("/v1/jobs/{id}/logs"), None, &[]).ok()?;
            String::from_utf8_lossy(&r.body).contains(text).then_some(())
        });
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Tasks outlive their daemon by design; a test that ends (or fails) leaves none behind.
        if !self.keep_tasks {
            kill_tasks(&self.data_dir);
        }
    }
}

/// Kills every process still running under a data dir's tasks (supervisors outlive a killed
/// daemon by design).
pub fn kill_tasks(data_dir: &Path) {
    let Ok(jobs) = std::fs::read_dir(data_dir.join("tasks")) else { return };
    for job in jobs.flatten() {
        let Ok(tasks) = std::fs::read_dir(job.path()) else { continue };
        for t in tasks.flatten() {
            if let Ok(pid) = std::fs::read_to_string(t.path().join("pid"))
                && let Ok(pid) = pid.trim().parse::<i32>()
                && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    String::from_utf8_lossy(&c).contains(&*t.path().to_string_lossy())
                })
            {
                xpu_server::executor::signal_group(pid, xpu_server::executor::Sig::KILL);
            }
        }
    }
}
