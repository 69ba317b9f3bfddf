//! `xpu hook`: the shim's injection as an OCI hook (`createRuntime` or the older `prestart`,
//! <https://github.com/opencontainers/runtime-spec/blob/main/config.md#posix-platform-hooks>),
//! for runtimes configured with hooks instead of a wrapped runtime.
//!
//! The runtime runs the hook after it has set up the container's mount namespace and before
//! `pivot_root`, with the container state on stdin (`pid`, `bundle`). By then the spec has been
//! read, so editing `config.json` would change nothing: the hook does the work itself.
//! 1. Everything that reads the host happens first, in the host's mount namespace: the request,
//!    the requirements, the edits (as in [`crate::shim::prepare`], which also refuses unsafe
//!    rootfs paths), the cgroup `devices.allow` file, and a detached clone of each file to mount
//!    (`open_tree(OPEN_TREE_CLONE)`), so mount sources are always host paths.
//! 2. It joins the container's mount namespace (`setns` on `/proc/PID/ns/mnt`; the process is
//!    single-threaded as `setns(CLONE_NEWNS)` requires), checks every path again in that view,
//!    then creates the device nodes and mount targets with [`crate::rootfs`] (no symlink
//!    followed out of the rootfs) and attaches the clones (`move_mount`), remounted read-only.
//! 3. It allows the devices in the container's cgroup (v1 `devices.allow`). With cgroup v2 the
//!    runtime enforces device access with an eBPF program a hook cannot extend, so a container
//!    whose spec does not already allow the devices is refused with that explanation.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{CWD, FileType};
use rustix::mount::{MountFlags, MoveMountFlags, OpenTreeFlags};
use serde::Deserialize;
use xpu_core::inventory::NodeType;

use crate::config::RuntimeConfig;
use crate::edits::NodeEdit;
use crate::nvml::Nvml;
use crate::rootfs::{Rootfs, RootfsError};
use crate::shim::{self, Host, ShimError};

/// The container state a runtime passes to hooks on stdin.
#[derive(Debug, Clone, Deserialize)]
pub struct State {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub status: String,
    pub pid: Option<i64>,
    pub bundle: PathBuf,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// Why the hook failed; the runtime then fails the container.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error(
        "the container state on stdin is not valid: {0}; run xpu hook from an OCI runtime's hooks"
    )]
    State(String),
    #[error(
        "the container state has no pid; xpu hook must run as a createRuntime or prestart hook"
    )]
    NoPid,
    #[error(transparent)]
    Prepare(#[from] ShimError),
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error("{what} of container process {pid}")]
    Proc { what: &'static str, pid: i64, source: std::io::Error },
    #[error(
        "container process {pid} is in a cgroup v2 hierarchy, where device access is an eBPF program a hook cannot extend; run the container through xpu-container-runtime or CDI instead"
    )]
    CgroupV2 { pid: i64 },
    #[error("{op} {}", path.display())]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
}

fn errno_io(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.raw_os_error())
}

/// Parses the state JSON.
pub fn parse_state(bytes: &[u8]) -> Result<State, HookError> {
    serde_json::from_slice(bytes).map_err(|e| HookError::State(e.to_string()))
}

/// Runs the hook for `state`. Returns the summary of what was injected, or `None` when the
/// container asked for nothing.
pub fn run(
    state: &State,
    cfg: &RuntimeConfig,
    host: &dyn Host,
    nvml: &dyn Nvml,
) -> Result<Option<String>, HookError> {
    let pid = state.pid.filter(|&p| p > 0).ok_or(HookError::NoPid)?;
    let Some(prepared) = shim::prepare(&state.bundle, cfg, host, nvml)? else {
        return Ok(None);
    };
    let edits = &prepared.edits;

    // Host side: cgroup rules still needed, their file, and clones of the mount sources.
    let rules: Vec<&NodeEdit> = edits.nodes.iter().filter(|n| !prepared.spec.allows(n)).collect();
    let mut allow_file = None;
    if !rules.is_empty() {
        let path = devices_allow(pid)?;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|source| HookError::Io { op: "open", path: path.clone(), source })?;
        allow_file = Some((path, f));
    }
    let mut trees: Vec<(OwnedFd, &str)> = Vec::with_capacity(edits.mounts.len());
    for m in &edits.mounts {
        let fd = rustix::mount::open_tree(
            CWD,
            &m.source,
            OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
        )
        .map_err(|e| HookError::Io {
            op: "clone mount of",
            path: m.source.clone(),
            source: errno_io(e),
        })?;
        trees.push((fd, m.destination.as_str()));
    }

    // Into the container's mount namespace.
    let ns_path = PathBuf::from(format!("/proc/{pid}/ns/mnt"));
    let ns = std::fs::File::open(&ns_path).map_err(|source| HookError::Proc {
        what: "mount namespace",
        pid,
        source,
    })?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&ns),
        Some(rustix::thread::LinkNameSpaceType::Mount),
    )
    .map_err(|e| HookError::Proc {
        what: "joining the mount namespace",
        pid,
        source: errno_io(e),
    })?;

    let fs = Rootfs::open(&prepared.rootfs)?;
    let nodes = edits.nodes.iter().map(|n| n.path.as_str());
    fs.check_all(nodes.chain(trees.iter().map(|(_, dest)| *dest)))?;
    for n in &edits.nodes {
        let ft = match n.node_type {
            NodeType::Char => FileType::CharacterDevice,
            NodeType::Block => FileType::BlockDevice,
        };
        fs.mknod(&n.path, ft, n.file_mode.unwrap_or(0o666), n.major, n.minor)?;
    }
    for (tree, dest) in &trees {
        attach(&fs, tree, dest)?;
    }
    if let Some((path, mut f)) = allow_file {
        for n in rules {
            // One rule per write, as the kernel parses devices.allow.
            let rule = format!("{} {}:{} rwm", n.type_char(), n.major, n.minor);
            f.write_all(rule.as_bytes()).map_err(|source| HookError::Io {
                op: "write",
                path: path.clone(),
                source,
            })?;
        }
    }
    Ok(Some(prepared.summary()))
}

/// Mounts the detached clone `tree` at `dest` inside the rootfs and makes it read-only.
fn attach(fs: &Rootfs, tree: &OwnedFd, dest: &str) -> Result<(), HookError> {
    let target = fs.mount_target(dest)?;
    let io = |op, e: rustix::io::Errno| HookError::Io {
        op,
        path: fs.path().join(dest.trim_start_matches('/')),
        source: errno_io(e),
    };
    rustix::mount::move_mount(
        tree,
        "",
        &target,
        "",
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
    )
    .map_err(|e| io("mount", e))?;
    // The descriptor still names the file under the new mount; open the mount itself, by the
    // same checked path, to remount it.
    let mounted = fs.open_existing(dest)?;
    let path = format!("/proc/self/fd/{}", mounted.as_raw_fd());
    rustix::mount::mount_remount(
        path.as_str(),
        MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
        "",
    )
    .map_err(|e| io("remount read-only", e))
}

/// The cgroup v1 `devices.allow` file of process `pid`, found through `/proc/PID/cgroup` and
/// this process's mount table.
fn devices_allow(pid: i64) -> Result<PathBuf, HookError> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|source| HookError::Proc { what: "cgroup", pid, source })?;
    let cg_path = text
        .lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers.split(',').any(|c| c == "devices").then(|| path.to_owned())
        })
        .next()
        .ok_or(HookError::CgroupV2 { pid })?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|source| HookError::Proc { what: "mount table", pid, source })?;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let f: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if f.len() < 5 || r.len() < 3 || r[0] != "cgroup" {
            continue;
        }
        if !r[2].split(',').any(|o| o == "devices") {
            continue;
        }
        let (root, mountpoint) = (f[3], f[4]);
        let rel = cg_path.strip_prefix(root).unwrap_or(&cg_path);
        return Ok(Path::new(mountpoint).join(rel.trim_start_matches('/')).join("devices.allow"));
    }
    Err(HookError::Proc {
        what: "devices cgroup mount",
        pid,
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no cgroup v1 devices hierarchy is mounted",
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_needs_a_bundle_and_a_pid() {
        let s = parse_state(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"creating","pid":42,"bundle":"/b"}"#,
        )
        .unwrap();
        assert_eq!((s.pid, s.bundle.as_path()), (Some(42), Path::new("/b")));
        let e = parse_state(b"{\"id\": 1}").unwrap_err().to_string();
        assert!(e.starts_with("the container state on stdin is not valid"), "{e}");
    }

    #[test]
    fn finds_this_process_devices_cgroup_when_v1() {
        let me = i64::from(std::process::id());
        match devices_allow(me) {
            Ok(p) => assert!(p.ends_with("devices.allow"), "{}", p.display()),
            Err(HookError::CgroupV2 { .. }) => eprintln!("cgroup v2 host: nothing to find"),
            Err(e) => panic!("{e}"),
        }
    }
}
