//! Which cgroup controllers the host offers, decided the way libvirt decides it for
//! `virt-host-validate` ("Checking for cgroup 'X' controller support"), so `xpu doctor` and
//! `virt-host-validate` agree on the same host:
//!
//! - cgroup v1: a controller is available when a `cgroup` filesystem is mounted with it among
//!   its options (`/proc/self/mounts`).
//! - cgroup v2: the unified hierarchy counts only when its root `cgroup.controllers` is not
//!   empty (systemd mounts an empty one for process tracking on hybrid hosts); then the
//!   controllers are those listed in the process's own cgroup's `cgroup.controllers`
//!   (`/proc/self/cgroup` gives the path), with `io` reported as `blkio`, `cpuacct` always
//!   present (v2's `cpu.stat` replaces it) and `devices` present (v2 implements it with BPF
//!   programs; libvirt probes the BPF syscall, which xpu cannot do under a fixture root, so it
//!   assumes a kernel with cgroup v2 has it).
//!
//! Both hierarchies are read on hybrid hosts and their controllers combined. Files are read
//! with [`Root::read_bounded`]; one that cannot be (a FIFO, a link to a device, too large)
//! reads as empty, with a warning from [`detect_noting`].

use std::collections::BTreeSet;

use crate::Root;
use crate::root::{ATTR_MAX, ReadError, TEXT_MAX};

/// Controller names as libvirt prints them.
const V1_CONTROLLERS: [&str; 14] = [
    "cpu",
    "cpuacct",
    "cpuset",
    "memory",
    "devices",
    "freezer",
    "blkio",
    "net_cls",
    "perf_event",
    "net_prio",
    "hugetlb",
    "pids",
    "rdma",
    "misc",
];

/// How cgroups are mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No cgroup filesystem mounted.
    None,
    V1,
    /// v1 controllers plus a unified (v2) hierarchy.
    Hybrid,
    V2,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::V1 => "v1",
            Mode::Hybrid => "hybrid",
            Mode::V2 => "v2",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    pub mode: Mode,
    pub controllers: BTreeSet<String>,
}

impl Cgroups {
    pub fn has(&self, controller: &str) -> bool {
        self.controllers.contains(controller)
    }
}

/// Reads the mount table and the process's cgroup under `root`.
pub fn detect(root: &Root) -> Cgroups {
    detect_noting(root, &mut Vec::new())
}

/// [`detect`], with a warning in `w` for each file that is there but cannot be read.
pub fn detect_noting(root: &Root, w: &mut Vec<String>) -> Cgroups {
    // `Err`: missing; `Ok(None)`: there but unreadable (warned).
    let mut read = |p: &str, limit: u64| -> Result<Option<String>, ()> {
        match root.read_bounded(&root.path(p), limit) {
            Ok(b) => Ok(Some(String::from_utf8_lossy(&b).into_owned())),
            Err(ReadError::Missing) => Err(()),
            Err(e) => {
                w.push(format!("{p}: {e}; taken as empty"));
                Ok(None)
            }
        }
    };
    let mounts = read("/proc/self/mounts", TEXT_MAX)
        .or_else(|()| read("/proc/mounts", TEXT_MAX))
        .ok()
        .flatten()
        .unwrap_or_default();
    let self_cgroup = read("/proc/self/cgroup", TEXT_MAX).ok().flatten().unwrap_or_default();
    let mut controllers = BTreeSet::new();
    let mut v1 = false;
    let mut v2 = false;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [_, mount_point, fstype, options, ..] = f[..] else { continue };
        match fstype {
            "cgroup" => {
                v1 = true;
                for opt in options.split(',') {
                    if V1_CONTROLLERS.contains(&opt) {
                        controllers.insert(opt.to_owned());
                    }
                }
            }
            "cgroup2" => {
                let mount_point = unescape_mount(mount_point);
                let top = read(&format!("{mount_point}/cgroup.controllers"), ATTR_MAX)
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                if top.trim().is_empty() {
                    continue;
                }
                v2 = true;
                let placement = self_cgroup
                    .lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .unwrap_or("/")
                    .trim_end_matches('/');
                let own = read(&format!("{mount_point}{placement}/cgroup.controllers"), ATTR_MAX)
                    .ok()
                    .flatten()
                    .unwrap_or(top);
                for c in own.split_whitespace() {
                    controllers.insert(if c == "io" { "blkio".to_owned() } else { c.to_owned() });
                }
                controllers.insert("cpuacct".to_owned());
                controllers.insert("devices".to_owned());
            }
            _ => {}
        }
    }
    let mode = match (v1, v2) {
        (false, false) => Mode::None,
        (true, false) => Mode::V1,
        (true, true) => Mode::Hybrid,
        (false, true) => Mode::V2,
    };
    Cgroups { mode, controllers }
}

/// `/proc/mounts` escapes space, tab, newline and backslash as octal (`\040`).
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && let Some(digits) = b.get(i + 1..i + 4)
            && digits.iter().all(|d| (b'0'..=b'7').contains(d))
        {
            let v = digits.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            // Three octal digits can exceed a byte (\777); keep such a sequence as written.
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with(files: &[(&str, &str)]) -> (tempfile::TempDir, Root) {
        let dir = tempfile::tempdir().unwrap();
        for (p, c) in files {
            let path = dir.path().join(p.trim_start_matches('/'));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, c).unwrap();
        }
        let root = Root::new(dir.path()).unwrap();
        (dir, root)
    }

    #[test]
    fn hybrid_with_empty_unified_counts_only_v1() {
        let (_d, root) = root_with(&[
            (
                "/proc/self/mounts",
                "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                 cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n\
                 cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0\n\
                 cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n",
            ),
            ("/sys/fs/cgroup/unified/cgroup.controllers", "\n"),
        ]);
        let c = detect(&root);
        assert_eq!(c.mode, Mode::V1);
        assert_eq!(c.controllers.iter().collect::<Vec<_>>(), ["cpu", "cpuacct"]);
    }

    #[test]
    fn v2_reads_own_cgroup_and_maps_io() {
        let (_d, root) = root_with(&[
            ("/proc/self/mounts", "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"),
            ("/proc/self/cgroup", "0::/user.slice/\n"),
            ("/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n"),
            ("/sys/fs/cgroup/user.slice/cgroup.controllers", "cpu io memory pids\n"),
        ]);
        let c = detect(&root);
        assert_eq!(c.mode, Mode::V2);
        for want in ["cpu", "cpuacct", "blkio", "memory", "pids", "devices"] {
            assert!(c.has(want), "{want}: {c:?}");
        }
        assert!(!c.has("cpuset"), "not delegated to this cgroup");
    }

    #[test]
    fn octal_escapes() {
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
    }
}
