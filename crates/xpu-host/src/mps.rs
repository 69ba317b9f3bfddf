//! NVIDIA MPS control daemons, one per GPU, and the environment that makes a process one of
//! their clients with a share's limits. The device plugin (`xpu_integrations::mps`, through
//! CDI) and `xpu serve` (host-process and container tasks) both start daemons here.
//!
//! Each daemon is the operator's `nvidia-cuda-mps-control` run with `-d`, seeing only its GPU
//! (`CUDA_VISIBLE_DEVICES=<uuid>`), in its own pipe and log directories
//! (`<dir>/<uuid>/pipe`, `<dir>/<uuid>/log`). Whether one is up is asked of the binary itself
//! (`get_server_list` on its standard input fails when no daemon answers in that pipe
//! directory), so a daemon that died is started again at the next client's start instead of
//! leaving clients to run outside MPS, unlimited. `quit` on standard input stops it.
//!
//! A client's limits are the share the scheduler placed, never the workload's: callers drop
//! every `CUDA_MPS_*` variable the workload set ([`is_client_var`]) and add [`Limits::env`].
//! MPS reads them in the client's CUDA driver when it starts; see docs/scheduler.md for what
//! that does and does not hold.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

/// A share's MPS limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, 1..=100.
    pub thread_percent: u16,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in MiB; `None` when the GPU's memory is unknown.
    pub memory_mib: Option<u64>,
}

impl Limits {
    /// The limits of `milli` thousandths of a GPU with `memory_mib` of memory: the share in
    /// percent rounded up, and that part of the memory rounded down.
    pub fn of(milli: u16, memory_mib: Option<u64>) -> Limits {
        let milli = milli.clamp(1, 1000);
        Limits {
            thread_percent: milli.div_ceil(10),
            memory_mib: memory_mib.map(|m| m * u64::from(milli) / 1000),
        }
    }

    /// The client's environment: the pipe directory as the client sees it, and the limits for
    /// its device 0 (the client sees one GPU: the daemon's).
    pub fn env(&self, pipe_dir: &str) -> Vec<(String, String)> {
        let mut env = vec![
            ("CUDA_MPS_PIPE_DIRECTORY".to_owned(), pipe_dir.to_owned()),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(), self.thread_percent.to_string()),
        ];
        if let Some(m) = self.memory_mib {
            env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(), format!("0={m}M")));
        }
        env
    }
}

/// A variable MPS reads in its clients: a workload's own are dropped where xpu sets limits.
pub fn is_client_var(name: &str) -> bool {
    name.starts_with("CUDA_MPS_")
}

/// Whether `uuid` can name a daemon's directory: the driver's `GPU-` UUIDs and MIG UUIDs.
fn uuid_problem(uuid: &str) -> Option<String> {
    let ok = !uuid.is_empty()
        && uuid.len() <= 96
        && !uuid.starts_with('.')
        && uuid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    (!ok).then(|| format!("GPU UUID {uuid:?} cannot name an MPS directory"))
}

/// The MPS daemons of one agent, with how many clients it started on each.
#[derive(Debug)]
pub struct Daemons {
    dir: PathBuf,
    control: PathBuf,
    clients: Mutex<BTreeMap<String, usize>>,
}

impl Daemons {
    /// Daemons under `dir` (absolute: clients and CDI specs name paths under it), run by
    /// `control`.
    pub fn new(dir: PathBuf, control: PathBuf) -> Result<Daemons, String> {
        if !dir.is_absolute() {
            return Err(format!(
                "the MPS directory {} must be an absolute path (clients are given paths under it)",
                dir.display()
            ));
        }
        Ok(Daemons { dir, control, clients: Mutex::new(BTreeMap::new()) })
    }

    /// The pipe directory of the GPU's daemon on the host.
    pub fn pipe_dir(&self, uuid: &str) -> PathBuf {
        self.dir.join(uuid).join("pipe")
    }

    fn command(&self, uuid: &str) -> Command {
        let dir = self.dir.join(uuid);
        let mut c = Command::new(&self.control);
        // The daemon starts `nvidia-cuda-mps-server` from its PATH: the control's own directory
        // first (drivers installed under one prefix ship both there), and the driver's
        // libraries where the agent was told they are.
        let mut path = String::new();
        if let Some(d) = self.control.parent().filter(|d| d.is_absolute()) {
            path = format!("{}:", d.display());
        }
        path.push_str("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        c.env_clear().env("PATH", path);
        if let Some(l) = std::env::var_os("LD_LIBRARY_PATH") {
            c.env("LD_LIBRARY_PATH", l);
        }
        c.env("CUDA_VISIBLE_DEVICES", uuid)
            .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
            .env("CUDA_MPS_LOG_DIRECTORY", dir.join("log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    /// Runs the control binary with `input` on its standard input.
    fn ask(&self, uuid: &str, input: &str) -> Result<(), String> {
        let mut child = self
            .command(uuid)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", self.control.display()))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A daemon gone makes the control exit before it reads: its status says so.
            let _ = stdin.write_all(input.as_bytes());
        }
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} ({}): {}",
                input.trim(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Whether the GPU's daemon answers.
    pub fn alive(&self, uuid: &str) -> bool {
        self.dir.join(uuid).join("pipe").is_dir() && self.ask(uuid, "get_server_list\n").is_ok()
    }

    /// Starts the GPU's daemon unless one answers; true when it started one.
    pub fn ensure(&self, uuid: &str) -> Result<bool, String> {
        if let Some(p) = uuid_problem(uuid) {
            return Err(p);
        }
        if self.alive(uuid) {
            return Ok(false);
        }
        let dir = self.dir.join(uuid);
        for d in ["pipe", "log"] {
            std::fs::create_dir_all(dir.join(d))
                .map_err(|e| format!("creating {}: {e}", dir.join(d).display()))?;
        }
        let out = self.command(uuid).arg("-d").output().map_err(|e| {
            format!("starting the MPS control daemon {}: {e}", self.control.display())
        })?;
        if !out.status.success() {
            return Err(format!(
                "the MPS control daemon for {uuid} did not start ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(true)
    }

    /// A client starts on the GPU: its daemon is started (again) if none answers.
    pub fn acquire(&self, uuid: &str) -> Result<bool, String> {
        let mut clients = self.clients.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let started = self.ensure(uuid)?;
        *clients.entry(uuid.to_owned()).or_default() += 1;
        Ok(started)
    }

    /// A client of the GPU ended: the daemon stops with its last. True when it stopped one.
    pub fn release(&self, uuid: &str) -> Result<bool, String> {
        let mut clients = self.clients.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(n) = clients.get_mut(uuid) else { return Ok(false) };
        *n = n.saturating_sub(1);
        if *n > 0 {
            return Ok(false);
        }
        clients.remove(uuid);
        self.ask(uuid, "quit\n").map(|()| true)
    }

    /// How many clients each GPU's daemon serves.
    pub fn clients(&self) -> BTreeMap<String, usize> {
        self.clients.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Stops every daemon started here (those with clients counted, and `others`).
    pub fn stop_all<'a>(&self, others: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        let mut uuids: Vec<String> = self.clients().into_keys().collect();
        uuids.extend(others.into_iter().map(str::to_owned));
        uuids.sort();
        uuids.dedup();
        uuids
            .iter()
            .filter_map(|u| self.ask(u, "quit\n").err().map(|e| format!("{u}: {e}")))
            .collect()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_the_share_rounded() {
        assert_eq!(
            Limits::of(500, Some(40960)),
            Limits { thread_percent: 50, memory_mib: Some(20480) }
        );
        assert_eq!(Limits::of(1, None).thread_percent, 1);
        assert_eq!(Limits::of(333, Some(81920)).thread_percent, 34);
        assert_eq!(Limits::of(5000, Some(100)).memory_mib, Some(100));
        let env = Limits::of(250, Some(143_771)).env("/p");
        assert_eq!(env[2], ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), "0=35942M".into()));
        assert!(is_client_var("CUDA_MPS_PIPE_DIRECTORY") && !is_client_var("CUDA_VISIBLE_DEVICES"));
    }

    #[test]
    fn a_daemon_runs_while_it_has_clients_and_is_started_again_when_it_died() {
        let dir = tempfile::tempdir().unwrap();
        let control = xpu_testkit::mps::fake_control(dir.path());
        let d = Daemons::new(dir.path().join("mps"), control).unwrap();
        let gpu = "GPU-5eed0000-a100-4000-8000-000000000000";
        assert!(d.acquire(gpu).unwrap());
        assert!(!d.acquire(gpu).unwrap(), "one daemon per GPU");
        assert!(!d.release(gpu).unwrap());
        // The daemon dies under a client: the next client's start brings it back.
        std::fs::remove_file(d.pipe_dir(gpu).join("control")).unwrap();
        assert!(d.acquire(gpu).unwrap());
        assert!(!d.release(gpu).unwrap());
        assert!(d.release(gpu).unwrap(), "the last client stops it");
        assert!(!d.alive(gpu));
        assert!(!d.release(gpu).unwrap(), "nothing to release");
        let calls = xpu_testkit::mps::calls(dir.path());
        assert_eq!(calls, format!("start {gpu}\nstart {gpu}\nquit {gpu}\n"));
        assert!(d.acquire("../etc").unwrap_err().contains("../etc"));
        assert!(Daemons::new("rel".into(), "x".into()).is_err());
    }
}
