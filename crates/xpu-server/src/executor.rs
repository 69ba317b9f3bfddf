//! Runs tasks: each attempt is a process group in its own directory under the data dir
//! (`tasks/<job>/<index>-<attempt>/`), with stdout and stderr appended to `output.log` there.
//!
//! The task's program runs under a small `/bin/sh` supervisor that is the process group leader.
//! It writes its pid to `pid` at start and the program's exit status to `exit` when it ends, so
//! a task outlives a daemon crash and the restarted daemon can re-adopt it (the pid is alive and
//! its command line names the task directory) and still learn its exit status. Cancellation is
//! SIGTERM to the supervisor, which passes it on to its whole process group (the program and
//! whatever it started), each process getting it exactly once, then SIGKILL to the group after a
//! grace period. A containerised task's program is `xpu runtime ... run` (see
//! [`crate::container`]), which the supervisor treats like any other: runc, in the group, gets
//! the one SIGTERM and passes it to the container's init.
//!
//! This module only starts, signals and watches processes; the scheduling loop decides.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use rustix::process::{Pid, Signal};

/// The supervisor script. `$1` is the task directory, `$2` the supervisor's own `PATH`; the rest
/// is the program's argv.
///
/// The shell starts with the job's environment, because the program it forks inherits it, so
/// nothing the supervisor does itself may depend on that environment: every expansion is quoted
/// (a job's `IFS` does not split it), and right after the fork it takes the daemon's `PATH` for
/// the one external command it runs (`sleep`), so a job's `PATH` (`/opt/conda/bin`) cannot hide
/// it. The exit status is written with a builtin: the daemon reads `exit` only once the
/// supervisor is gone, so the write needs no rename to be seen whole.
///
/// Its marker files (`pid`, `started`, `exit`) are made `0600`, as everything the daemon writes;
/// the program gets the daemon's umask back.
///
/// Traps are set before anything else (and before the `pid` file exists, which is what callers
/// wait for), so a SIGTERM that arrives while it starts is remembered rather than fatal. The
/// trap only records the signal; the loop passes it on when `wait` returns, to the whole group
/// at once (`kill 0`), after ignoring it itself, so every process gets it exactly once. It does
/// so only once the program's process has reset its signal handlers (it creates `started` right
/// before `exec`): until then that process still runs the shell's handlers it was forked with,
/// and a signal landing there (on a loaded machine the fork may not even have run yet) would be
/// swallowed, leaving the program to run to the end.
const SUPERVISOR: &str = r#"d=$1; p=$2; shift 2
c=; t=
trap 't=TERM' TERM
trap 't=INT' INT
m=$(umask); umask 077
echo "$$" > "$d/pid"
{ : > "$d/started"; umask "$m"; exec "$@"; } &
c=$!
PATH=$p
while :; do
  if [ -n "$t" ]; then
    while [ ! -e "$d/started" ] && kill -0 "$c" 2>/dev/null; do sleep 0.01 2>/dev/null; done
    trap '' TERM INT
    kill "-$t" 0 2>/dev/null; t=
  fi
  wait "$c"; rc=$?
  kill -0 "$c" 2>/dev/null || break
done
echo "$rc" > "$d/exit"
exit "$rc""#;

/// The process name the supervisor runs under (`ps` shows it).
const SUPERVISOR_NAME: &str = "xpu-task";

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("creating task directory {path}: {error}")]
    Dir { path: String, error: std::io::Error },
    #[error("starting {program:?} for job {job} task {idx}: {error}")]
    Spawn { program: String, job: i64, idx: u32, error: std::io::Error },
    #[error(
        "job {job} task {idx}: its command line and environment ({bytes} bytes) are too large to start ({error}); Linux takes at most 128 KiB in one argument or variable and 2 MiB in all under the default stack limit; pass large inputs in a file"
    )]
    TooLarge { job: i64, idx: u32, bytes: usize, error: std::io::Error },
    #[error("job {job}: working directory {dir} does not exist; create it or fix workingDir")]
    WorkingDir { job: i64, dir: String },
    #[error("job {job}: working directory {dir} has .. in it; give a path without it")]
    WorkingDirUp { job: i64, dir: String },
    #[error(transparent)]
    Bundle(#[from] crate::container::BundleError),
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
    /// The files of `downwardAPI` volumes, written before anything runs.
    pub files: Vec<VolumeFile>,
    pub working_dir: Option<String>,
    pub dir: PathBuf,
    /// Run as a container (`argv`, `env` and `working_dir` then go into its `config.json`).
    pub container: Option<crate::container::ContainerLaunch>,
    /// The pod's init containers and sidecars, run before the main program ([`Step`]).
    pub init: Vec<Step>,
    /// The pod's `emptyDir` volumes, made under the attempt's directory.
    pub volumes: Vec<xpu_core::job::Volume>,
    /// Where the main container mounts them.
    pub mounts: Vec<xpu_core::job::VolumeMount>,
    /// How long sidecars have after SIGTERM, once the main container ended.
    pub grace: std::time::Duration,
    /// Who submitted the job, and so who its programs run as ([`RunAs`]); `None`: the daemon's
    /// own user (jobs stored before owners were recorded).
    pub user: Option<crate::store::Owner>,
    /// Host directories bound into each of the pod's containers besides its volumes (the MPS
    /// pipe directory); host-process tasks reach them by their host paths.
    pub host_mounts: Vec<crate::container::Mount>,
    /// The GPU (UUID) whose MPS daemon the task is a client of: the engine starts the daemon
    /// before the task and stops it after the GPU's last client.
    pub mps_gpu: Option<String>,
}

/// How a task's programs become their owner's when the daemon runs as another user (root): the
/// supervisor, its marker files and `pod.sh`'s mounts stay the daemon's, and only the exec of
/// each program goes through util-linux's `setpriv`, which sets the real and effective user and
/// group and drops every supplementary group (Slurm's `slurmstepd` does the same for a job
/// step). Root gives up its capabilities with its uid. A container's program is runc's, which
/// must stay root: the container's `process.user` is the owner instead ([`crate::container`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
    /// From the password database, for `HOME`, `USER` and `LOGNAME`; `/` and the uid when the
    /// user has no entry.
    pub name: String,
    pub home: PathBuf,
}

/// Where `setpriv` is (util-linux: on every Debian, Ubuntu and RHEL host).
const SETPRIV: &str = "/usr/bin/setpriv";

impl RunAs {
    /// `None` when `owner` is the daemon's own user (or there is none): nothing changes.
    pub fn for_owner(owner: Option<crate::store::Owner>) -> Option<RunAs> {
        let o = owner?;
        if o.uid == rustix::process::geteuid().as_raw() {
            return None;
        }
        let (name, home) = crate::users::by_uid(o.uid)
            .map_or_else(|| (o.uid.to_string(), PathBuf::from("/")), |a| (a.name, a.home));
        Some(RunAs { uid: o.uid, gid: o.gid, name, home })
    }

    /// The words in front of a program's argv.
    fn prefix(&self) -> [String; 6] {
        [
            SETPRIV.to_owned(),
            format!("--reuid={}", self.uid),
            format!("--regid={}", self.gid),
            "--clear-groups".to_owned(),
            "--inh-caps=-all".to_owned(),
            "--".to_owned(),
        ]
    }

    /// `HOME`, `USER` and `LOGNAME` of the owner, in place of the daemon's.
    fn env(&self) -> [(&'static str, String); 3] {
        let home = self.home.display().to_string();
        [("HOME", home), ("USER", self.name.clone()), ("LOGNAME", self.name.clone())]
    }

    /// Gives `path` (made by the daemon for the task: a volume, a volume's file) to the owner.
    fn give(&self, path: &Path) -> std::io::Result<()> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid))
    }
}

/// A file of a `downwardAPI` volume.
#[derive(Debug, Clone)]
pub struct VolumeFile {
    pub volume: String,
    /// Relative to the volume (the parser keeps it inside).
    pub path: String,
    pub content: String,
    pub mode: u32,
}

/// One init container (or sidecar) of a task: what it runs, with what, and where its volumes
/// go. A host-process task runs it as a process; a container task as a container of its own
/// on the same root filesystem.
#[derive(Debug, Clone)]
pub struct Step {
    pub name: String,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub working_dir: Option<String>,
    /// Started and left running beside the next steps and the main program; stopped after it.
    pub sidecar: bool,
    pub mounts: Vec<xpu_core::job::VolumeMount>,
}

/// A started task.
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub child: tokio::process::Child,
    /// Where a directory already at the attempt's path was moved (see [`fresh_dir`]).
    pub moved_aside: Option<PathBuf>,
}

/// The directory of one attempt.
pub fn task_dir(data_dir: &Path, job_id: i64, idx: u32, attempt: u32) -> PathBuf {
    data_dir.join("tasks").join(job_id.to_string()).join(format!("{idx}-{attempt}"))
}

/// Variables passed through from the daemon's environment; everything else is the job's own.
const PASS_ENV: [&str; 6] = ["PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ"];
/// The `PATH` of tasks and of the supervisor when the daemon has none.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin";
/// Also passed to the container runtime: where the shim reads its settings
/// (`xpu_container::config::ENV_VAR`).
const RUNTIME_ENV: [&str; 1] = ["XPU_RUNTIME_CONFIG"];

/// Creates the attempt's directory, new and empty. Every attempt has a path of its own (job id,
/// index, attempt number), so one that is already there was left by another store, one that
/// started job ids from 1 again: it is moved aside to `<dir>.stale-<ms>`, never reused, so a
/// new job's log never starts with an old job's output and an old `exit` is never read as the
/// new task's. Returns where it went.
pub fn fresh_dir(dir: &Path) -> Result<Option<PathBuf>, ExecError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ExecError::Dir { path, error: source }
    };
    if let Some(parent) = dir.parent() {
        // Private (the log and the bundle hold the job's output and environment): see
        // [`crate::datadir`].
        crate::datadir::create_dir(parent, crate::datadir::DIR_MODE).map_err(
            |(path, source)| ExecError::Dir { path: path.display().to_string(), error: source },
        )?;
    }
    let mkdir = || std::fs::DirBuilder::new().mode(crate::datadir::DIR_MODE).create(dir);
    match mkdir() {
        Ok(()) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let base = dir.as_os_str().to_owned();
            let mut n = 0u32;
            let aside = loop {
                let mut p = base.clone();
                p.push(format!(".stale-{}", crate::store::now_ms() + i64::from(n)));
                let p = PathBuf::from(p);
                if std::fs::symlink_metadata(&p).is_err() {
                    break p;
                }
                n += 1;
            };
            std::fs::rename(dir, &aside).map_err(io(dir))?;
            mkdir().map_err(io(dir))?;
            Ok(Some(aside))
        }
        Err(e) => Err(io(dir)(e)),
    }
}

/// Starts the attempt in a new directory ([`fresh_dir`]).
pub fn spawn(l: &Launch) -> Result<Spawned, ExecError> {
    if !l.init.is_empty() || !l.volumes.is_empty() || !l.files.is_empty() {
        return spawn_pod(l);
    }
    let moved_aside = fresh_dir(&l.dir)?;
    let (log, log2) = open_log(&l.dir)?;
    let run_as = RunAs::for_owner(l.user);
    if let Some(c) = &l.container {
        let p = crate::container::Process {
            job: l.job_id,
            argv: &l.argv,
            env: &l.env,
            working_dir: l.working_dir.as_deref(),
            mounts: &[],
            user: run_as.as_ref().map(|r| (r.uid, r.gid)),
        };
        crate::container::write_bundle(&l.dir, c, &p)?;
        let argv = crate::container::run_argv(c, &l.dir);
        tracing::debug!(job_id = l.job_id, task = l.idx, attempt = l.attempt, argv = ?argv, "starting a container");
        let mut cmd = supervisor(&l.dir, &argv, log, log2);
        for k in RUNTIME_ENV {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
        cmd.current_dir(&l.dir);
        return finish_spawn(cmd, l, "xpu runtime", moved_aside);
    }
    let cwd = working_dir(l, l.working_dir.as_deref(), run_as.as_ref())?;
    tracing::debug!(job_id = l.job_id, task = l.idx, attempt = l.attempt, argv = ?l.argv, user = ?l.user, "starting a process");
    let mut argv: Vec<String> = Vec::new();
    if let Some(r) = &run_as {
        argv.extend(r.prefix());
    }
    argv.extend(l.argv.iter().cloned());
    let mut cmd = supervisor(&l.dir, &argv, log, log2);
    if let Some(r) = &run_as {
        for (k, v) in r.env() {
            cmd.env(k, v);
        }
    }
    for (k, v) in &l.env {
        cmd.env(k, v);
    }
    cmd.current_dir(cwd);
    let program = l.argv.first().cloned().unwrap_or_default();
    finish_spawn(cmd, l, &program, moved_aside)
}

/// The directory a host-process step starts in. A job of the daemon's own user: an absolute
/// `workingDir` that exists, a relative one made under the attempt's directory (the parser
/// refuses `..` in it; the check here keeps that true whatever the spec says), else the
/// attempt's directory. A job run as its owner ([`RunAs`]): the daemon makes nothing for it, so
/// a relative `workingDir` is under the owner's home and must exist, and the default is the
/// home (`/` when it has none).
fn working_dir(l: &Launch, w: Option<&str>, run_as: Option<&RunAs>) -> Result<PathBuf, ExecError> {
    let missing =
        |dir: &Path| ExecError::WorkingDir { job: l.job_id, dir: dir.display().to_string() };
    let Some(w) = w else {
        return Ok(match run_as {
            None => l.dir.clone(),
            // `nobody`'s home is `/nonexistent`.
            Some(r) if r.home.is_dir() => r.home.clone(),
            Some(_) => PathBuf::from("/"),
        });
    };
    let w = Path::new(w);
    if w.components().any(|c| c == std::path::Component::ParentDir) {
        return Err(ExecError::WorkingDirUp { job: l.job_id, dir: w.display().to_string() });
    }
    if w.is_absolute() {
        return if w.is_dir() { Ok(w.to_owned()) } else { Err(missing(w)) };
    }
    match run_as {
        Some(r) => {
            let p = r.home.join(w);
            if p.is_dir() { Ok(p) } else { Err(missing(&p)) }
        }
        None => {
            let p = l.dir.join(w);
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(crate::datadir::DIR_MODE)
                .create(&p)
                .map_err(|source| ExecError::Dir {
                    path: p.display().to_string(),
                    error: source,
                })?;
            Ok(p)
        }
    }
}

/// A task with init containers or volumes: the supervisor runs `pod.sh`, a script written for
/// the attempt that makes the volumes, runs each init container to completion in order (a
/// failing one ends the task with its status), starts sidecars and leaves them running, runs
/// the main program, then stops the sidecars (SIGTERM) and waits for them. Its status is the
/// main program's. A SIGTERM to the task reaches every step at once (they share the process
/// group); the script then stops what is left the same way.
///
/// Host-process steps run through `env NAME=VALUE... -- ARGV` on the daemon's pass-through
/// environment, each with its own variables, as containers each have their own. Container
/// steps are `xpu runtime ... run` on a bundle of their own under `containers/<n>-<name>/`,
/// ids `<id>-i<n>`; a volume is the directory `volumes/<name>/` bound into each container that
/// mounts it (a tmpfs of `sizeLimit` bytes for `medium: Memory`, which needs the daemon to run
/// as root, as runc does).
fn spawn_pod(l: &Launch) -> Result<Spawned, ExecError> {
    let moved_aside = fresh_dir(&l.dir)?;
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ExecError::Dir { path, error: source }
    };
    let mkdir = |p: &Path| {
        std::fs::DirBuilder::new().recursive(true).mode(crate::datadir::DIR_MODE).create(p)
    };
    // The volumes and the steps; `end` (stopping sidecars, unmounting) goes in front at the end.
    let mut script = String::new();
    // What kills a container sidecar outright: its init ignores SIGTERM when it has no handler
    // (PID 1), and killing `runc run` would leave the container behind.
    let mut hard_kills: Vec<String> = Vec::new();
    let run_as = RunAs::for_owner(l.user);
    // Volumes are named by their place in the pod, never by the name the manifest gives them
    // (the parser checks names as Kubernetes does; a path made of one must still stay here).
    let volume_index =
        |name: &str| l.volumes.iter().position(|v| v.name == name).unwrap_or(usize::MAX);
    let volume_dir = |name: &str| l.dir.join("volumes").join(volume_index(name).to_string());
    for v in &l.volumes {
        let dir = volume_dir(&v.name);
        mkdir(&dir).map_err(io(&dir))?;
        if let Some(r) = &run_as {
            r.give(&dir).map_err(io(&dir))?;
        }
        if v.memory {
            let size = v.size_limit.map(|b| format!(",size={b}")).unwrap_or_default();
            let owner = run_as
                .as_ref()
                .map(|r| format!(",uid={},gid={}", r.uid, r.gid))
                .unwrap_or_default();
            script.push_str(&format!(
                "mount -t tmpfs -o nosuid,nodev,mode=0755{size}{owner} xpu-emptydir {d} || {{ echo {msg} >&2; exit 1; }}\n",
                d = quote(&dir),
                msg = quote(format!(
                    "xpu: volume {}: cannot mount a tmpfs (medium: Memory needs the daemon to run as root)",
                    v.name
                )),
            ));
        }
    }
    let mounts_of = |ms: &[xpu_core::job::VolumeMount]| -> Vec<crate::container::Mount> {
        ms.iter()
            .map(|m| {
                let mut source = volume_dir(&m.name);
                if let Some(sub) = &m.sub_path {
                    source = source.join(sub);
                }
                // A downwardAPI volume is read-only, as the kubelet mounts it.
                let downward =
                    l.volumes.iter().any(|v| v.name == m.name && v.downward_api.is_some());
                crate::container::Mount {
                    source,
                    destination: m.mount_path.clone(),
                    read_only: m.read_only || downward,
                }
            })
            .collect()
    };
    for f in &l.files {
        let path = volume_dir(&f.volume).join(&f.path);
        if let Some(parent) = path.parent() {
            mkdir(parent).map_err(io(parent))?;
        }
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .mode(f.mode)
            .open(&path)
            .and_then(|mut file| std::io::Write::write_all(&mut file, f.content.as_bytes()))
            .map_err(io(&path))?;
        if let Some(r) = &run_as {
            r.give(&path).map_err(io(&path))?;
        }
    }
    // subPath directories are made inside the volume (after a tmpfs is mounted on it), as the
    // kubelet makes them.
    let mut subs: Vec<PathBuf> = Vec::new();
    for m in l.init.iter().flat_map(|s| &s.mounts).chain(&l.mounts) {
        if let Some(sub) = &m.sub_path {
            let p = volume_dir(&m.name).join(sub);
            if !subs.contains(&p) {
                script.push_str(&format!("mkdir -p {} || exit 1\n", quote(&p)));
                subs.push(p);
            }
        }
    }
    let main = Step {
        name: "main".to_owned(),
        argv: l.argv.clone(),
        env: l.env.clone(),
        working_dir: l.working_dir.clone(),
        sidecar: false,
        mounts: l.mounts.clone(),
    };
    let steps: Vec<(usize, &Step)> =
        l.init.iter().chain(std::iter::once(&main)).enumerate().collect();
    let last = l.init.len();
    for (n, step) in steps {
        let line = match &l.container {
            Some(c) => {
                let mut c = c.clone();
                if n < last {
                    c.id = format!("{}-i{n}", c.id);
                }
                // By its place in the pod alone: a name is never a path.
                let dir = l.dir.join("containers").join(n.to_string());
                mkdir(&dir).map_err(io(&dir))?;
                let mut mounts = mounts_of(&step.mounts);
                mounts.extend(l.host_mounts.iter().cloned());
                let p = crate::container::Process {
                    job: l.job_id,
                    argv: &step.argv,
                    env: &step.env,
                    working_dir: step.working_dir.as_deref(),
                    mounts: &mounts,
                    user: run_as.as_ref().map(|r| (r.uid, r.gid)),
                };
                crate::container::write_bundle(&dir, &c, &p)?;
                if step.sidecar {
                    let mut kill: Vec<String> = c.runtime.iter().map(quote).collect();
                    kill.extend(["'--root'".to_owned(), quote(&c.state_dir), "'kill'".to_owned()]);
                    kill.extend([quote(&c.id), "'KILL'".to_owned()]);
                    hard_kills.push(kill.join(" "));
                }
                let argv = crate::container::run_argv(&c, &dir);
                let words: Vec<String> = argv.iter().map(quote).collect();
                format!("exec {}", words.join(" "))
            }
            None => {
                let cd = match (&step.working_dir, &run_as) {
                    (None, None) => String::new(),
                    (w, _) => {
                        format!("cd {} && ", quote(working_dir(l, w.as_deref(), run_as.as_ref())?))
                    }
                };
                let mut words: Vec<String> = Vec::new();
                if let Some(r) = &run_as {
                    words.extend(r.prefix().iter().map(quote));
                    words.extend(["env".to_owned(), "--".to_owned()]);
                    words.extend(r.env().iter().map(|(k, v)| quote(format!("{k}={v}"))));
                } else {
                    words.extend(["env".to_owned(), "--".to_owned()]);
                }
                words.extend(step.env.iter().map(|(k, v)| quote(format!("{k}={v}"))));
                words.extend(step.argv.iter().map(quote));
                format!("{cd}exec {}", words.join(" "))
            }
        };
        // Comments name a step by its place and a name made safe for a comment line: a
        // newline in it would end the comment and run the rest as a command.
        let label = format!("{n} {}", comment_safe(&step.name));
        // A subPath must still lead into its volume when the container starts: an earlier
        // container may have replaced it with a symlink to anywhere on the host, which runc
        // would follow when it binds the source. (A sidecar still running could swap it between
        // this check and runc's mount; the job's own containers are the only ones that can.)
        if l.container.is_some() {
            for m in step.mounts.iter().filter(|m| m.sub_path.is_some()) {
                let vol = volume_dir(&m.name);
                let src = vol.join(m.sub_path.as_deref().unwrap_or_default());
                script.push_str(&format!(
                    "case \"$(readlink -f {src})\" in {vol}/*) ;; *) echo {msg} >&2; end; exit 1 ;; esac\n",
                    src = quote(&src),
                    vol = quote(&vol),
                    msg = quote(format!(
                        "xpu: container {:?}: subPath {:?} of volume {:?} leads out of the volume",
                        step.name,
                        m.sub_path.as_deref().unwrap_or_default(),
                        m.name
                    )),
                ));
            }
        }
        if n == last {
            script
                .push_str(&format!("# main container {label}\n( {line} ); rc=$?\nend\nexit $rc\n"));
        } else if step.sidecar {
            script.push_str(&format!("# sidecar {label}\n( {line} ) & s=\"$s $!\"\n"));
        } else {
            script.push_str(&format!(
                "# init container {label}\n( {line} ) || {{ rc=$?; echo {failed}\"$rc\" >&2; end; exit $rc; }}\n",
                failed = quote(format!("xpu: init container {:?} failed with status ", step.name))
            ));
        }
    }
    // Sidecars get SIGTERM, then the grace period (in tenths of a second), then SIGKILL, as
    // the kubelet stops them after the main container.
    let tenths = l.grace.as_millis().div_ceil(100).max(1);
    let mut head = String::from(
        "# Written by xpu serve for this attempt: the pod's containers in order.\ns=\nend() {\n  for p in $s; do kill -TERM \"$p\" 2>/dev/null; done\n  n=0; alive=\n",
    );
    head.push_str(&format!(
        "  while [ -n \"$s\" ] && [ $n -lt {tenths} ]; do\n    alive=; for p in $s; do kill -0 \"$p\" 2>/dev/null && alive=1; done\n    [ -n \"$alive\" ] || break\n    sleep 0.1; n=$((n+1))\n  done\n"
    ));
    if !hard_kills.is_empty() {
        head.push_str("  if [ -n \"$alive\" ]; then\n");
        for k in &hard_kills {
            head.push_str(&format!("    {k} >/dev/null 2>&1\n"));
        }
        head.push_str("  fi\n");
    }
    head.push_str("  for p in $s; do kill -KILL \"$p\" 2>/dev/null; done\n  wait\n");
    for v in l.volumes.iter().filter(|v| v.memory) {
        head.push_str(&format!("  umount {} 2>/dev/null\n", quote(volume_dir(&v.name))));
    }
    head.push_str("  :\n}\ntrap 'end; exit 143' TERM\ntrap 'end; exit 130' INT\n");
    let script = head + &script;
    let script_path = l.dir.join("pod.sh");
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(crate::datadir::FILE_MODE)
        .open(&script_path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, script.as_bytes()))
        .map_err(io(&script_path))?;
    let (log, log2) = open_log(&l.dir)?;
    tracing::debug!(job_id = l.job_id, task = l.idx, attempt = l.attempt, script = %script_path.display(), steps = l.init.len() + 1, "starting a pod script");
    let argv = [OsString::from("/bin/sh"), script_path.into_os_string()];
    let mut cmd = supervisor(&l.dir, &argv, log, log2);
    for k in RUNTIME_ENV {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    cmd.current_dir(&l.dir);
    finish_spawn(cmd, l, "/bin/sh pod.sh", moved_aside)
}

/// Whether `dir` is a mount point: on another device than its parent.
pub fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::symlink_metadata(p).map(|m| m.dev()).ok();
    match (dev(dir), dir.parent().and_then(dev)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

/// `name` for a comment in a script: printable ASCII only, at most 63 characters (a DNS-1123
/// label's length), anything else as `?`.
fn comment_safe(name: &str) -> String {
    name.chars().take(63).map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect()
}

/// `p` as one word for `/bin/sh`: in single quotes, each `'` written as `'\''`.
fn quote<S: AsRef<std::ffi::OsStr>>(p: S) -> String {
    let s = p.as_ref().to_string_lossy();
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The attempt's `output.log`, new, twice: the supervisor's stdout and stderr.
fn open_log(dir: &Path) -> Result<(std::fs::File, std::fs::File), ExecError> {
    let path = dir.join("output.log");
    let err = |source| ExecError::Dir { path: path.display().to_string(), error: source };
    let log = OpenOptions::new()
        .create_new(true)
        .append(true)
        .mode(crate::datadir::FILE_MODE)
        .open(&path)
        .map_err(err)?;
    let log2 = log.try_clone().map_err(err)?;
    Ok((log, log2))
}

/// The supervisor running `argv` with the daemon's pass-through environment, output to the log.
fn supervisor<S: AsRef<std::ffi::OsStr>>(
    dir: &Path,
    argv: &[S],
    log: std::fs::File,
    log2: std::fs::File,
) -> tokio::process::Command {
    let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.arg("-c").arg(SUPERVISOR).arg(SUPERVISOR_NAME).arg(dir).arg(&path).args(argv);
    cmd.env_clear();
    for k in PASS_ENV {
        if let Some(v) = std::env::var_os(k) {
            cmd.env(k, v);
        }
    }
    cmd.env("PATH", &path);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        // Its own process group, so a signal reaches everything the task started.
        .process_group(0)
        .kill_on_drop(false);
    cmd
}

fn finish_spawn(
    mut cmd: tokio::process::Command,
    l: &Launch,
    program: &str,
    moved_aside: Option<PathBuf>,
) -> Result<Spawned, ExecError> {
    let child = cmd.spawn().map_err(|source| {
        if source.kind() == std::io::ErrorKind::ArgumentListTooLong {
            let bytes = l.argv.iter().map(|a| a.len() + 1).sum::<usize>()
                + l.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum::<usize>();
            return ExecError::TooLarge { job: l.job_id, idx: l.idx, bytes, error: source };
        }
        ExecError::Spawn { program: program.to_owned(), job: l.job_id, idx: l.idx, error: source }
    })?;
    let pid = child.id().map_or(0, |p| p as i32);
    Ok(Spawned { pid, child, moved_aside })
}

/// Asks the task to stop: `sig` (SIGTERM) to its supervisor, which passes it to everything in
/// the task exactly once. Pids 0 and 1 are refused.
pub fn signal_task(pid: i32, sig: Signal) {
    if pid <= 1 {
        return;
    }
    if let Some(pid) = Pid::from_raw(pid) {
        report_kill(rustix::process::kill_process(pid, sig), "task", pid, sig);
    }
}

/// A signal that could not be sent is a warning, unless its target is already gone.
fn report_kill(r: rustix::io::Result<()>, what: &str, pid: Pid, sig: Signal) {
    match r {
        Ok(()) => {
            tracing::debug!(pid = pid.as_raw_nonzero().get(), signal = ?sig, "signalled the {what}")
        }
        Err(rustix::io::Errno::SRCH) => {}
        Err(e) => tracing::warn!(
            pid = pid.as_raw_nonzero().get(),
            signal = ?sig,
            error = %e,
            "could not signal the {what}"
        ),
    }
}

/// Sends `sig` to the task's process group; a group that is already gone is not an error.
/// Pids 0 and 1 are refused: `kill(-1)` would signal every process on the host.
pub fn signal_group(pid: i32, sig: Signal) {
    if pid <= 1 {
        return;
    }
    if let Some(pid) = Pid::from_raw(pid) {
        report_kill(
            rustix::process::kill_process_group(pid, sig),
            "task's process group",
            pid,
            sig,
        );
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
    use std::time::{Duration, Instant};

    fn launch(dir: PathBuf, argv: &[&str]) -> Launch {
        Launch {
            job_id: 1,
            idx: 0,
            attempt: 0,
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            env: vec![("FOO".into(), "bar".into())],
            files: Vec::new(),
            working_dir: None,
            dir,
            container: None,
            init: Vec::new(),
            volumes: Vec::new(),
            mounts: Vec::new(),
            grace: Duration::from_secs(1),
            user: None,
            host_mounts: Vec::new(),
            mps_gpu: None,
        }
    }

    fn step(name: &str, script: &str, sidecar: bool) -> Step {
        Step {
            name: name.to_owned(),
            argv: vec!["sh".into(), "-c".into(), script.to_owned()],
            env: vec![("WHO".into(), format!("{name} 'quoted' $x"))],
            working_dir: None,
            sidecar,
            mounts: Vec::new(),
        }
    }

    #[tokio::test]
    async fn init_containers_run_in_order_and_sidecars_stop_after_the_main_one() {
        let tmp = tempfile::tempdir().unwrap();
        let mut l = launch(tmp.path().join("t"), &["sh", "-c", "echo main $FOO; cat state"]);
        l.init = vec![
            step("first", "echo \"$WHO\"; echo one > state", false),
            step(
                "side",
                "trap 'echo sidecar stopped; exit 0' TERM; echo sidecar up; while :; do sleep 0.05; done",
                true,
            ),
            step("second", "echo \"$WHO\" FOO=${FOO-unset}; sleep 0.2", false),
        ];
        let mut s = spawn(&l).unwrap();
        let status = s.child.wait().await.unwrap();
        let log = std::fs::read_to_string(l.dir.join("output.log")).unwrap();
        let script = std::fs::read_to_string(l.dir.join("pod.sh")).unwrap();
        assert_eq!(status.code(), Some(0), "{log}\n{script}");
        let lines: Vec<&str> = log.lines().collect();
        // Each step has its own environment: the main one's FOO is not the init ones'.
        assert_eq!(lines[0], "first 'quoted' $x", "{log}");
        assert!(lines.contains(&"second 'quoted' $x FOO=unset"), "{log}");
        assert!(lines.contains(&"sidecar up"), "{log}");
        let main = lines.iter().position(|l| *l == "main bar").unwrap();
        assert_eq!(lines[main + 1], "one", "the init containers ran first: {log}");
        assert_eq!(lines.last(), Some(&"sidecar stopped"), "{log}");

        // A failing init container ends the task with its status; the main one never runs.
        let mut l = launch(tmp.path().join("u"), &["sh", "-c", "echo main"]);
        l.init = vec![step("bad", "exit 7", false)];
        let mut s = spawn(&l).unwrap();
        assert_eq!(s.child.wait().await.unwrap().code(), Some(7));
        assert_eq!(recorded_exit(&l.dir), Some(7));
        let log = std::fs::read_to_string(l.dir.join("output.log")).unwrap();
        assert_eq!(log, "xpu: init container \"bad\" failed with status 7\n");
    }

    #[tokio::test]
    async fn a_step_name_never_runs_as_a_command_nor_makes_a_path() {
        // A name with newlines would end pod.sh's comment line and run the rest on the host;
        // one with slashes and `..` would make a directory outside the task's. The parser
        // refuses both; the executor must be safe with whatever a stored spec says.
        let tmp = tempfile::tempdir().unwrap();
        let marker = tmp.path().join("pwned");
        let mut l = launch(tmp.path().join("t"), &["true"]);
        let evil = format!("setup\ntouch {}\n#", marker.display());
        l.init = vec![step(&evil, "true", false), step("x/../../../../out", "true", false)];
        let mut s = spawn(&l).unwrap();
        assert_eq!(s.child.wait().await.unwrap().code(), Some(0));
        let script = std::fs::read_to_string(l.dir.join("pod.sh")).unwrap();
        assert!(!marker.exists(), "a container name ran a host command:\n{script}");
        assert!(!tmp.path().join("out").exists());
    }

    #[tokio::test]
    async fn marker_files_are_private_and_the_program_keeps_its_umask() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let l = launch(tmp.path().join("t"), &["sh", "-c", "umask"]);
        let mut s = spawn(&l).unwrap();
        s.child.wait().await.unwrap();
        for f in ["pid", "started", "exit", "output.log"] {
            let mode = std::fs::metadata(l.dir.join(f)).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{f} is {mode:o}");
        }
        let umask = std::fs::read_to_string(l.dir.join("output.log")).unwrap();
        assert_ne!(umask.trim(), "0077", "the program got the supervisor's umask");
    }

    #[tokio::test]
    async fn a_working_dir_with_dotdot_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        for w in ["../../../../escaped", "a/../../b"] {
            let mut l = launch(tmp.path().join("t").join(w.replace('/', "_")), &["true"]);
            l.working_dir = Some(w.to_owned());
            let e = spawn(&l).unwrap_err().to_string();
            assert!(e.contains("has .. in it"), "{e}");
            let mut l = launch(tmp.path().join("p").join(w.replace('/', "_")), &["true"]);
            l.working_dir = Some(w.to_owned());
            l.init = vec![step("i", "true", false)];
            let e = spawn(&l).unwrap_err().to_string();
            assert!(e.contains("has .. in it"), "{e}");
        }
        assert!(!tmp.path().join("escaped").exists());
    }

    #[tokio::test]
    async fn a_job_runs_as_its_owner() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root to run a task as another user");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let mut l = launch(tmp.path().join("t"), &["sh", "-c", "id -u; id -g; id -G; echo $HOME"]);
        l.user = Some(crate::store::Owner { uid: 65534, gid: 65534 });
        let mut s = spawn(&l).unwrap();
        assert_eq!(s.child.wait().await.unwrap().code(), Some(0));
        let out = std::fs::read_to_string(l.dir.join("output.log")).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(&lines[..3], ["65534", "65534", "65534"], "{out}");
        // The supervisor stays the daemon's: its records are root's.
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(l.dir.join("exit")).unwrap().uid(), 0);
        // The same in a pod script's steps.
        let mut l = launch(tmp.path().join("u"), &["id", "-u"]);
        l.user = Some(crate::store::Owner { uid: 65534, gid: 65534 });
        l.init = vec![step("i", "id -u", false)];
        let mut s = spawn(&l).unwrap();
        assert_eq!(s.child.wait().await.unwrap().code(), Some(0));
        let out = std::fs::read_to_string(l.dir.join("output.log")).unwrap();
        assert_eq!(out, "65534\n65534\n", "{out}");
    }

    /// Waits for a condition, with a deadline generous enough for a loaded 2-core machine.
    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn supervisor_records_pid_and_exit() {
        let tmp = tempfile::tempdir().unwrap();
        let l = launch(tmp.path().join("t"), &["sh", "-c", "echo hi $FOO; exit 3"]);
        let mut s = spawn(&l).unwrap();
        let status = s.child.wait().await.unwrap();
        assert_eq!(status.code(), Some(3));
        assert_eq!(recorded_exit(&l.dir), Some(3));
        assert_eq!(recorded_pid(&l.dir), Some(s.pid));
        assert_eq!(std::fs::read_to_string(l.dir.join("output.log")).unwrap(), "hi bar\n");
    }

    #[tokio::test]
    async fn the_jobs_path_does_not_reach_the_supervisor() {
        // A job's PATH without the usual commands (a conda environment): the program gets it,
        // and the supervisor still records the exit status the daemon reads after a restart.
        let tmp = tempfile::tempdir().unwrap();
        let mut l = launch(tmp.path().join("t"), &["/bin/sh", "-c", "echo $PATH"]);
        l.env.push(("PATH".into(), "/opt/conda/bin".into()));
        let mut s = spawn(&l).unwrap();
        assert_eq!(s.child.wait().await.unwrap().code(), Some(0));
        assert_eq!(recorded_exit(&l.dir), Some(0));
        assert_eq!(std::fs::read_to_string(l.dir.join("output.log")).unwrap(), "/opt/conda/bin\n");
    }

    #[tokio::test]
    async fn an_attempt_never_runs_in_a_directory_left_by_another() {
        let tmp = tempfile::tempdir().unwrap();
        let l = launch(tmp.path().join("t"), &["sh", "-c", "echo new"]);
        std::fs::create_dir_all(&l.dir).unwrap();
        std::fs::write(l.dir.join("output.log"), "old\n").unwrap();
        std::fs::write(l.dir.join("exit"), "0\n").unwrap();
        let mut s = spawn(&l).unwrap();
        s.child.wait().await.unwrap();
        assert_eq!(std::fs::read_to_string(l.dir.join("output.log")).unwrap(), "new\n");
        let aside = s.moved_aside.unwrap();
        assert_eq!(std::fs::read_to_string(aside.join("output.log")).unwrap(), "old\n");
        assert!(aside.file_name().unwrap().to_str().unwrap().starts_with("t.stale-"));
    }

    #[tokio::test]
    async fn sigterm_reaches_the_program_and_is_recorded() {
        let tmp = tempfile::tempdir().unwrap();
        let l = launch(tmp.path().join("t"), &["sleep", "300"]);
        let mut s = spawn(&l).unwrap();
        // The pid file is written after the traps are set: from then on a SIGTERM is passed on
        // however early it comes, even before the program has started.
        until("the pid file", || recorded_pid(&l.dir).is_some()).await;
        assert!(is_our_supervisor(s.pid, &l.dir));
        signal_task(s.pid, Signal::TERM);
        let status = tokio::time::timeout(Duration::from_secs(60), s.child.wait())
            .await
            .expect("SIGTERM did not end the task")
            .unwrap();
        assert_eq!(status.code(), Some(143));
        assert_eq!(recorded_exit(&l.dir), Some(143));
        assert!(!is_our_supervisor(s.pid, &l.dir));
    }

    #[tokio::test]
    async fn sigterm_reaches_every_process_of_the_task_once() {
        // The program and a child it started each count the SIGTERMs they get.
        let tmp = tempfile::tempdir().unwrap();
        let script = "trap 'echo parent >> n; exit 143' TERM; \
                      sh -c 'trap \"echo child >> n; exit 0\" TERM; echo > ready; while :; do sleep 1 & wait $!; done' & \
                      while :; do sleep 1 & wait $!; done";
        let l = launch(tmp.path().join("t"), &["sh", "-c", script]);
        let mut s = spawn(&l).unwrap();
        until("the child to start", || l.dir.join("ready").exists()).await;
        signal_task(s.pid, Signal::TERM);
        let status = tokio::time::timeout(Duration::from_secs(60), s.child.wait())
            .await
            .expect("SIGTERM did not end the task")
            .unwrap();
        assert_eq!(status.code(), Some(143));
        until("the child's line", || {
            std::fs::read_to_string(l.dir.join("n")).is_ok_and(|n| n.contains("child"))
        })
        .await;
        let mut got: Vec<String> =
            std::fs::read_to_string(l.dir.join("n")).unwrap().lines().map(str::to_owned).collect();
        got.sort();
        assert_eq!(got, ["child", "parent"], "each process got SIGTERM once");
    }

    #[tokio::test]
    async fn sigterm_at_every_moment_of_start_up_is_never_lost() {
        // Signals sent at once, and at staggered moments while the supervisor forks and the
        // program execs: every task must end by SIGTERM (143), none may sleep on.
        let tmp = tempfile::tempdir().unwrap();
        let mut tasks = Vec::new();
        for i in 0..12u64 {
            let l = launch(tmp.path().join(format!("t{i}")), &["sleep", "300"]);
            let s = spawn(&l).unwrap();
            tasks.push((i, l, s));
        }
        for (i, l, s) in &tasks {
            until("the pid file", || recorded_pid(&l.dir).is_some()).await;
            tokio::time::sleep(Duration::from_micros(300 * i)).await;
            signal_task(s.pid, Signal::TERM);
        }
        for (_, l, mut s) in tasks {
            let status = tokio::time::timeout(Duration::from_secs(60), s.child.wait())
                .await
                .expect("a SIGTERM was lost during start-up")
                .unwrap();
            assert_eq!(status.code(), Some(143), "{}", l.dir.display());
        }
    }
}
