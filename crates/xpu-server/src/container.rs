//! Tasks that run as OCI containers: a job naming a root filesystem (`xpu.dev/rootfs`) or a
//! bundle (`xpu.dev/bundle`) gets a bundle of its own in each attempt's task directory, and the
//! task's program is `xpu runtime --root <data-dir>/runc run --bundle <task-dir> <id>`: the
//! `xpu-container-runtime` shim reads the device environment, injects those devices, and execs
//! runc, which runs the container in the foreground with its output in the task's log.
//!
//! For a rootfs, `config.json` is what `runc spec` writes (OCI runtime spec 1.0.2,
//! <https://github.com/opencontainers/runtime-spec/blob/v1.0.2/config.md>), with three
//! differences that make it behave like a Kubernetes container: no network namespace (the host's
//! network, as multi-host training needs to reach its peers), a writable root, and the hostname
//! of the node. For a bundle, its own `config.json` is the base, with `root.path` made absolute.
//! Either way the manifest sets `process.args` (when it gives a command), `process.cwd`
//! (`workingDir`) and adds its environment and the device environment to `process.env`.
//!
//! Stopping follows the process tasks: SIGTERM to the supervisor's group reaches runc, which
//! passes it to the container's init; SIGKILL goes through `runc kill <id> KILL`, because the
//! container's processes are in their own session and would outlive runc.

use std::ffi::OsString;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// How to start one attempt's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerLaunch {
    /// The runtime shim's command: `[/usr/bin/xpu, runtime]`.
    pub runtime: Vec<OsString>,
    /// runc's state directory (`runc --root`).
    pub state_dir: PathBuf,
    /// Container id: unique on the machine, since runc names cgroups after it.
    pub id: String,
    pub source: Source,
    pub hostname: String,
    /// The ids of the pod's init containers and sidecars, each a container of its own beside
    /// `id` (the main one): `<id>-i<n>`. Killed and deleted with it.
    pub steps: Vec<String>,
}

/// A volume directory bound into a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// On the host: under the task directory.
    pub source: PathBuf,
    /// Absolute, in the container.
    pub destination: String,
    pub read_only: bool,
}

/// Where the container's filesystem comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Rootfs(PathBuf),
    Bundle(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("job {job}: rootfs {path} is not a directory; create it or fix xpu.dev/rootfs")]
    NoRootfs { job: i64, path: String },
    #[error("job {job}: {problem}")]
    BadRoot { job: i64, problem: String },
    #[error("job {job}: {path} is not valid OCI config JSON: {message}")]
    BadConfig { job: i64, path: String, message: String },
    #[error("job {job}: bundle {path} has no process.args and the manifest gives no command")]
    NoCommand { job: i64, path: String },
    #[error("writing {path}: {error}")]
    Write { path: String, error: std::io::Error },
}

/// Why runc would refuse `path` as a container's root filesystem, or `None` when it takes it: an
/// absolute path to a directory with no symlink in it (runc compares the path with its resolved
/// form and refuses a difference: libcontainer/configs/validate, `rootfs`).
pub fn root_problem(path: &Path) -> Option<String> {
    let shown = path.display();
    if !path.is_absolute() {
        return Some(format!("{shown} is not an absolute path; give the full path"));
    }
    if path.components().any(|c| c == std::path::Component::ParentDir) {
        return Some(format!("{shown} has .. in it; give the path without it"));
    }
    let real = match std::fs::canonicalize(path) {
        Ok(r) if r.is_dir() => r,
        _ => return Some(format!("{shown} is not a directory on the daemon's host")),
    };
    // `components` drops `.` and trailing slashes, as runc's filepath.Clean does.
    let clean: PathBuf = path.components().collect();
    if real != clean {
        return Some(format!(
            "{shown} has a symlink in it (it resolves to {}), which runc refuses as a root; give {0}",
            real.display()
        ));
    }
    None
}

/// The largest bundle `config.json` read (runc's own are a few KiB).
const MAX_CONFIG: u64 = 4 << 20;

/// A file a job names, read the way every such file is
/// ([`xpu_host::root::read_bounded`]): looked at before it is opened, so no device is ever
/// opened, opened without blocking (a FIFO would otherwise hold the thread until a writer
/// comes), checked to be a regular file, and read to at most
/// `cap` bytes (checked again at every use: the file may have been swapped for another since
/// the job was submitted). Callers run it off the async threads. `Err` says what is wrong in
/// words that follow the path.
pub fn read_bounded(path: &Path, cap: u64) -> Result<Vec<u8>, String> {
    use xpu_host::root::ReadError;
    xpu_host::root::read_bounded(path, cap).map_err(|e| match e {
        ReadError::Missing => "cannot be opened (it does not exist)".to_owned(),
        ReadError::TooLarge { limit } => format!("is larger than {limit} bytes"),
        ReadError::NotAFile { .. } => e.to_string(),
        ReadError::Io(e) => format!("cannot be read ({e})"),
    })
}

/// Why `dir` cannot be run as a bundle, or `None`: it must be a directory whose `config.json`
/// names a root ([`root_problem`]) for runc, and brings no device ([`device_problem`]). For a
/// job run as `user` (not the daemon's), the file must be one that user may read, and the
/// bundle must keep to what [`confine`] allows.
pub fn bundle_problem(dir: &Path, user: Option<(u32, u32)>) -> Option<String> {
    if let Some(p) = root_problem(dir) {
        return Some(p.replace("is not a directory", "is not a bundle directory with config.json"));
    }
    let path = dir.join("config.json");
    let text = match read_config(&path, user) {
        Ok(t) => t,
        Err(e) => return Some(e),
    };
    let v: Value = match serde_json::from_slice(&text) {
        Ok(v) => v,
        Err(e) => return Some(format!("{} is not valid JSON: {e}", path.display())),
    };
    let Some(root) = v.pointer("/root/path").and_then(Value::as_str) else {
        return Some(format!("{} has no root.path", path.display()));
    };
    if let Some(p) = root_problem(&dir.join(root)) {
        return Some(format!("root.path of {}: {p}", path.display()));
    }
    let brings = device_problem(&v).or_else(|| user.and_then(|_| confine_problem(&v, dir)));
    brings.map(|p| format!("{}: {p}", path.display()))
}

/// A bundle's `config.json`, read with [`read_bounded`]; for a job run as `user`, only when
/// that user could read it (the daemon reads it as root, and must not read for a user what the
/// user could not).
fn read_config(path: &Path, user: Option<(u32, u32)>) -> Result<Vec<u8>, String> {
    let shown = path.display();
    if let Some((uid, gid)) = user
        && !readable_by(path, uid, gid)
    {
        return Err(format!(
            "{shown} is not readable by uid {uid}, who submitted the job; make it readable by that user"
        ));
    }
    read_bounded(path, MAX_CONFIG).map_err(|e| format!("{shown} {e}; fix xpu.dev/bundle"))
}

/// Whether `uid`/`gid` may read `path` and search every directory above it, by the mode bits
/// (ACLs are not read: a file only an ACL opens is refused).
fn readable_by(path: &Path, uid: u32, gid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let allowed = |m: &std::fs::Metadata, bit: u32| {
        let mode = m.mode();
        if m.uid() == uid {
            mode & (bit << 6) != 0
        } else if m.gid() == gid {
            mode & (bit << 3) != 0
        } else {
            mode & bit != 0
        }
    };
    let Ok(real) = std::fs::canonicalize(path) else { return false };
    let dirs_ok =
        real.ancestors().skip(1).all(|d| std::fs::metadata(d).is_ok_and(|m| allowed(&m, 0o1)));
    dirs_ok && std::fs::metadata(&real).is_ok_and(|m| allowed(&m, 0o4))
}

/// Whether a mount in a configuration is a bind mount (`type: bind`, or `bind`/`rbind` among
/// its options, which runc binds whatever the type says).
fn is_bind(m: &Value) -> bool {
    m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|x| matches!(x.as_str(), Some("bind" | "rbind"))))
}

/// Why a configuration may not run because it brings device access of its own, or `None`.
/// The daemon alone decides which devices a container gets: those the scheduler gave the task,
/// which the runtime shim adds from the device environment. So a bundle may not list
/// `linux.devices`, allow any device in `linux.resources.devices` (deny rules are fine), or
/// bind anything under `/dev` (or any device node) into the container.
pub fn device_problem(cfg: &Value) -> Option<String> {
    if cfg.pointer("/linux/devices").and_then(Value::as_array).is_some_and(|d| !d.is_empty()) {
        return Some(
            "linux.devices: a bundle may not bring device nodes; the daemon adds the devices the job was given (ask with resources.limits)".to_owned(),
        );
    }
    if let Some(rules) = cfg.pointer("/linux/resources/devices").and_then(Value::as_array) {
        for (i, r) in rules.iter().enumerate() {
            if r.get("allow").and_then(Value::as_bool) != Some(false) {
                return Some(format!(
                    "linux.resources.devices[{i}]: a bundle may only deny devices; the daemon allows the devices the job was given"
                ));
            }
        }
    }
    let mounts = cfg.get("mounts").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    for (i, m) in mounts.iter().enumerate() {
        if !is_bind(m) {
            continue;
        }
        let source = m.get("source").and_then(Value::as_str).unwrap_or_default();
        let path = Path::new(source);
        let clean: PathBuf = path.components().collect();
        let real = std::fs::canonicalize(path).unwrap_or_else(|_| clean.clone());
        let device = std::fs::metadata(&real).is_ok_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_char_device() || m.file_type().is_block_device()
        });
        if clean.starts_with("/dev") || real.starts_with("/dev") || device {
            return Some(format!(
                "mounts[{i}].source {source:?}: a bundle may not bind devices or /dev; the daemon adds the devices the job was given"
            ));
        }
    }
    None
}

/// Why a bundle may not run as a user other than the daemon's, or `None`. [`confine`] makes
/// its process that user's with no capabilities; what it could still bring to gain more is
/// refused: OCI hooks (they run on the host as the daemon's user), user namespace mappings (a
/// map could make the user root outside), and bind mounts from outside the bundle's directory
/// (the runtime binds as root what the user may not open).
fn confine_problem(cfg: &Value, dir: &Path) -> Option<String> {
    if cfg.get("hooks").and_then(Value::as_object).is_some_and(|h| !h.is_empty()) {
        return Some(
            "hooks: only root's bundles may run OCI hooks (they run on the host); drop them"
                .to_owned(),
        );
    }
    for field in ["uidMappings", "gidMappings"] {
        if cfg.pointer(&format!("/linux/{field}")).is_some_and(|v| !v.is_null()) {
            return Some(format!("linux.{field}: only root's bundles may map users; drop it"));
        }
    }
    let base = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let mounts = cfg.get("mounts").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    for (i, m) in mounts.iter().enumerate() {
        if !is_bind(m) {
            continue;
        }
        let source = m.get("source").and_then(Value::as_str).unwrap_or_default();
        let inside = std::fs::canonicalize(dir.join(source)).is_ok_and(|r| r.starts_with(&base));
        if !inside {
            return Some(format!(
                "mounts[{i}].source {source:?}: only root's bundles may bind paths from outside the bundle directory"
            ));
        }
    }
    None
}

/// Makes a configuration run as `uid`/`gid` and nothing more: its process is that user's, with
/// no supplementary group, no capability in any set and `noNewPrivileges` (so a set-user-id
/// file in the root gains nothing).
fn confine(cfg: &mut Value, uid: u32, gid: u32) {
    if let Some(process) = cfg.get_mut("process").and_then(Value::as_object_mut) {
        process.insert("user".into(), json!({"uid": uid, "gid": gid}));
        process.insert(
            "capabilities".into(),
            json!({"bounding": [], "effective": [], "permitted": [], "inheritable": [], "ambient": []}),
        );
        process.insert("noNewPrivileges".into(), json!(true));
    }
}

/// What goes into the container's process.
pub struct Process<'a> {
    pub job: i64,
    /// Empty: the bundle's own `process.args`.
    pub argv: &'a [String],
    pub env: &'a [(String, String)],
    pub working_dir: Option<&'a str>,
    /// Volumes to bind in, after the configuration's own mounts.
    pub mounts: &'a [Mount],
    /// The user the job runs as when not the daemon's: the container's process is made that
    /// user's ([`confine`]).
    pub user: Option<(u32, u32)>,
}

/// `runc spec`'s default configuration with a rootfs, without the network namespace and with a
/// writable root (see the module docs).
fn default_config(rootfs: &Path, hostname: &str) -> Value {
    let caps = json!(["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]);
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["sh"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps, "ambient": caps
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}
        ],
        "linux": {
            "resources": {"devices": [{"allow": false, "access": "rwm"}]},
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
                "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                "/proc/sysrq-trigger"]
        }
    })
}

/// The configuration for one attempt, before it is written.
pub fn config(c: &ContainerLaunch, p: &Process<'_>) -> Result<Value, BundleError> {
    let mut cfg = match &c.source {
        Source::Rootfs(rootfs) => {
            if !rootfs.is_dir() {
                return Err(BundleError::NoRootfs {
                    job: p.job,
                    path: rootfs.display().to_string(),
                });
            }
            if let Some(problem) = root_problem(rootfs) {
                return Err(BundleError::BadRoot { job: p.job, problem });
            }
            default_config(rootfs, &c.hostname)
        }
        Source::Bundle(dir) => {
            let path = dir.join("config.json");
            let bad = |message: String| BundleError::BadConfig {
                job: p.job,
                path: path.display().to_string(),
                message,
            };
            let text = read_config(&path, p.user)
                .map_err(|problem| BundleError::BadRoot { job: p.job, problem })?;
            let mut v: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
            // The bundle's relative root is relative to the bundle, not to the task directory.
            let root = v
                .pointer("/root/path")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("root.path is missing".to_owned()))?;
            let abs = dir.join(root);
            if let Some(problem) = root_problem(&abs) {
                return Err(bad(format!("root.path: {problem}")));
            }
            if let Some(r) = v.pointer_mut("/root/path") {
                *r = json!(abs);
            }
            if !v.get("process").is_some_and(Value::is_object) {
                return Err(bad("process is missing".to_owned()));
            }
            if let Some(problem) = device_problem(&v) {
                return Err(bad(problem));
            }
            if p.user.is_some()
                && let Some(problem) = confine_problem(&v, dir)
            {
                return Err(bad(problem));
            }
            v
        }
    };
    if let Some((uid, gid)) = p.user {
        confine(&mut cfg, uid, gid);
    }
    let bad = |message: &str| BundleError::BadConfig {
        job: p.job,
        path: "config.json".to_owned(),
        message: message.to_owned(),
    };
    let process = cfg
        .get_mut("process")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| bad("process is not an object"))?;
    process.insert("terminal".into(), json!(false));
    if !p.argv.is_empty() {
        process.insert("args".into(), json!(p.argv));
    } else if process.get("args").and_then(Value::as_array).is_none_or(|a| a.is_empty()) {
        let path = match &c.source {
            Source::Rootfs(r) | Source::Bundle(r) => r.display().to_string(),
        };
        return Err(BundleError::NoCommand { job: p.job, path });
    }
    if let Some(w) = p.working_dir {
        // OCI requires an absolute cwd; Kubernetes' workingDir is absolute in practice.
        let cwd = if w.starts_with('/') { w.to_owned() } else { format!("/{w}") };
        process.insert("cwd".into(), json!(cwd));
    }
    // The base environment without its device variables (the daemon's alone: see
    // `crate::node::DEVICE_VARS`), then the job's and xpu's variables; a later name replaces an
    // earlier one.
    let mut env: Vec<String> = process
        .get("env")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default();
    env.retain(|e| !crate::node::selects_devices(e.split_once('=').map_or(e.as_str(), |(n, _)| n)));
    for (k, v) in p.env {
        env.retain(|e| e.split_once('=').map_or(e.as_str(), |(n, _)| n) != k);
        env.push(format!("{k}={v}"));
    }
    process.insert("env".into(), json!(env));
    if !p.mounts.is_empty() {
        let mounts = cfg
            .as_object_mut()
            .map(|o| o.entry("mounts").or_insert_with(|| json!([])))
            .and_then(Value::as_array_mut)
            .ok_or_else(|| bad("mounts is not a list"))?;
        for m in p.mounts {
            let mode = if m.read_only { "ro" } else { "rw" };
            mounts.push(json!({
                "destination": m.destination,
                "type": "bind",
                "source": m.source,
                "options": ["rbind", "nosuid", "nodev", mode],
            }));
        }
    }
    // A bundle's CDI annotations would ask the shim for devices too.
    if let Some(a) = cfg.get_mut("annotations").and_then(Value::as_object_mut) {
        a.retain(|k, _| !k.starts_with(crate::node::CDI_ANNOTATION_PREFIX));
    }
    Ok(cfg)
}

/// Writes `<dir>/config.json` for the attempt.
pub fn write_bundle(dir: &Path, c: &ContainerLaunch, p: &Process<'_>) -> Result<(), BundleError> {
    let cfg = config(c, p)?;
    let path = dir.join("config.json");
    let bytes = serde_json::to_vec_pretty(&cfg).map_err(|e| BundleError::BadConfig {
        job: p.job,
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    // Private: it holds the job's environment (see [`crate::datadir`]).
    let write = |bytes: &[u8]| {
        // New, and never through a link: the directory is the attempt's own and fresh, so a
        // file already there (or a link planted to another bundle) is refused, not followed.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .mode(crate::datadir::FILE_MODE)
            .open(&path)?;
        std::io::Write::write_all(&mut f, bytes)
    };
    write(&bytes)
        .map_err(|source| BundleError::Write { path: path.display().to_string(), error: source })
}

/// The supervisor's program for the attempt: `xpu runtime --root STATE run --bundle DIR ID`.
pub fn run_argv(c: &ContainerLaunch, dir: &Path) -> Vec<OsString> {
    let mut argv = c.runtime.clone();
    argv.push("--root".into());
    argv.push(c.state_dir.clone().into_os_string());
    argv.push("run".into());
    argv.push("--bundle".into());
    argv.push(dir.as_os_str().to_owned());
    argv.push(c.id.clone().into());
    argv
}

/// Runs `xpu runtime --root STATE <args...> ID` (runc's `kill`, `delete`) for the attempt's
/// container and each of its init containers and sidecars, and waits for them; failures (the
/// container is already gone) are not errors.
pub async fn runtime_call(c: &ContainerLaunch, args: &[&str]) {
    for id in std::iter::once(&c.id).chain(&c.steps) {
        let mut cmd = tokio::process::Command::new(&c.runtime[0]);
        cmd.args(&c.runtime[1..])
            .arg("--root")
            .arg(&c.state_dir)
            .args(args)
            .arg(id)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        let line = format!(
            "{} --root {} {} {id}",
            c.runtime.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" "),
            c.state_dir.display(),
            args.join(" ")
        );
        tracing::debug!(command = %line, "runtime call");
        match cmd.output().await {
            Ok(out) if out.status.success() => {}
            Ok(out) => {
                let stderr = String::from_utf8_lossy(&out.stderr);
                let stderr = stderr.trim();
                // A container that is already gone is what was wanted (`runc run` deletes its
                // container when it exits).
                if !stderr.contains("does not exist") {
                    tracing::warn!(
                        command = %line,
                        status = %out.status,
                        stderr = %stderr,
                        "runtime call failed"
                    );
                }
            }
            Err(e) => tracing::warn!(command = %line, error = %e, "runtime call could not start"),
        }
    }
}

/// A container id for an attempt: `xpu-<hash of the data dir>-<job>-<index>-<attempt>`, so
/// daemons with different data dirs on one machine never collide in runc's cgroup names.
pub fn container_id(data_dir: &Path, job: i64, idx: u32, attempt: u32) -> String {
    // FNV-1a over the path: stable across restarts, which re-adoption relies on.
    let mut h: u32 = 0x811c_9dc5;
    for b in data_dir.as_os_str().as_encoded_bytes() {
        h = (h ^ u32::from(*b)).wrapping_mul(0x0100_0193);
    }
    format!("xpu-{h:08x}-{job}-{idx}-{attempt}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn launch(source: Source) -> ContainerLaunch {
        ContainerLaunch {
            runtime: vec!["/usr/bin/xpu".into(), "runtime".into()],
            state_dir: "/var/lib/xpu/runc".into(),
            id: "xpu-1-0-0".into(),
            source,
            hostname: "node-a".into(),
            steps: Vec::new(),
        }
    }

    #[test]
    fn rootfs_config_is_runc_spec_with_the_manifest() {
        let tmp = tempfile::tempdir().unwrap();
        let c = launch(Source::Rootfs(tmp.path().to_owned()));
        let env = [("A".to_owned(), "1".to_owned()), ("PATH".to_owned(), "/bin".to_owned())];
        let argv = ["sh".to_owned(), "-c".to_owned(), "true".to_owned()];
        let p = Process {
            job: 1,
            argv: &argv,
            env: &env,
            working_dir: Some("work"),
            mounts: &[],
            user: None,
        };
        let v = config(&c, &p).unwrap();
        assert_eq!(v["process"]["args"], json!(["sh", "-c", "true"]));
        assert_eq!(v["process"]["env"], json!(["TERM=xterm", "A=1", "PATH=/bin"]));
        assert_eq!(v["process"]["cwd"], "/work");
        assert_eq!(v["root"]["path"], json!(tmp.path()));
        assert_eq!(v["hostname"], "node-a");
        let ns: Vec<&str> = v["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        assert!(!ns.contains(&"network"), "the host's network");
        assert_eq!(
            run_argv(&c, Path::new("/d")),
            [
                "/usr/bin/xpu",
                "runtime",
                "--root",
                "/var/lib/xpu/runc",
                "run",
                "--bundle",
                "/d",
                "xpu-1-0-0"
            ]
            .map(OsString::from)
        );
        let missing = launch(Source::Rootfs("/nonexistent/rootfs".into()));
        assert!(config(&missing, &p).unwrap_err().to_string().contains("is not a directory"));
    }

    #[test]
    fn bundle_config_keeps_its_own_and_takes_the_manifest() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("rootfs")).unwrap();
        let mut base = default_config(Path::new("rootfs"), "runc");
        base["process"]["args"] = json!(["/app/train"]);
        base["process"]["env"] =
            json!(["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "XPU_VISIBLE_DEVICES=gpu:all"]);
        base["annotations"] =
            json!({"cdi.k8s.io/gpus": "nvidia.com/gpu=all", "org.example/keep": "yes"});
        std::fs::write(tmp.path().join("config.json"), base.to_string()).unwrap();
        let c = launch(Source::Bundle(tmp.path().to_owned()));
        let env = [("NVIDIA_VISIBLE_DEVICES".to_owned(), "2".to_owned())];
        let p =
            Process { job: 1, argv: &[], env: &env, working_dir: None, mounts: &[], user: None };
        let v = config(&c, &p).unwrap();
        assert_eq!(v["process"]["args"], json!(["/app/train"]), "the bundle's command");
        assert_eq!(v["process"]["env"], json!(["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=2"]));
        assert_eq!(v["annotations"], json!({"org.example/keep": "yes"}), "no CDI requests");
        assert_eq!(v["root"]["path"], json!(tmp.path().join("rootfs")));
        assert_eq!(v["hostname"], "runc", "the bundle's own settings stay");
        // A root runc would refuse fails here, not in runc.
        std::os::unix::fs::symlink(tmp.path().join("rootfs"), tmp.path().join("link")).unwrap();
        let mut linked = base.clone();
        linked["root"]["path"] = json!("link");
        std::fs::write(tmp.path().join("config.json"), linked.to_string()).unwrap();
        let e = config(&c, &p).unwrap_err().to_string();
        assert!(e.contains("has a symlink in it"), "{e}");
        assert!(bundle_problem(tmp.path(), None).unwrap().contains("has a symlink in it"));
        let empty = launch(Source::Bundle(tmp.path().join("nope")));
        let e = config(&empty, &p).unwrap_err().to_string();
        assert!(e.contains("config.json cannot be opened"), "{e}");
        assert_ne!(container_id(Path::new("/a"), 1, 0, 0), container_id(Path::new("/b"), 1, 0, 0));
    }
}
