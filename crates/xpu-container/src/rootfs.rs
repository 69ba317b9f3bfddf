//! Safe paths inside a container's root filesystem.
//!
//! The image is untrusted: CVE-2024-0132 was a container image whose symlink made NVIDIA's hook
//! mount and write host paths. Every path the shim or the hook touches inside the rootfs is
//! walked one component at a time from a directory file descriptor with `openat2(2)`
//! (`RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, `O_PATH | O_NOFOLLOW`), so the kernel never follows
//! a link on our behalf. A symlink met on the way is judged as the host would follow it: an
//! absolute target (`/dev -> /etc`, `/usr/lib/x86_64-linux-gnu -> /`) or a relative one that
//! climbs above the rootfs points outside it, and the path is refused with an error naming the
//! link; a relative link that stays inside (`/lib -> usr/lib`) is followed, within the root.
//!
//! The hook then creates directories, device nodes and mount targets relative to the directory
//! descriptors this walk returns, with `O_EXCL`/`O_NOFOLLOW`, so nothing can be swapped in
//! between the check and the write.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// How every `openat2` here resolves: beneath the directory given, following no symlink.
const STRICT: ResolveFlags =
    ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS).union(ResolveFlags::NO_MAGICLINKS);

/// Symlinks followed in one path before giving up, as the kernel's `MAXSYMLINKS`.
const MAX_LINKS: usize = 40;

/// A path that cannot be used safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RootfsError {
    #[error(
        "refusing {path}: {link} in the container rootfs {} is a symlink to {target}, which points outside the rootfs; fix the image",
        rootfs.display()
    )]
    SymlinkOutside { rootfs: PathBuf, path: String, link: String, target: String },
    #[error("refusing {path}: {at} in the container rootfs {} is not a directory", rootfs.display())]
    NotADirectory { rootfs: PathBuf, path: String, at: String },
    #[error("refusing {path}: too many symlinks in the container rootfs {}", rootfs.display())]
    TooManyLinks { rootfs: PathBuf, path: String },
    #[error("refusing {path:?}: not an absolute, normalized container path")]
    BadPath { path: String },
    #[error("container rootfs {}: {op} {path}: {errno}", rootfs.display())]
    Io { rootfs: PathBuf, op: &'static str, path: String, errno: Errno },
}

/// Where a walk ended.
#[derive(Debug)]
pub struct Resolved {
    /// The deepest existing directory on the path.
    pub dir: OwnedFd,
    /// Its path inside the container.
    pub dir_path: String,
    /// Components below `dir` that do not exist yet (the last one is the target's name). Empty
    /// when the target is `/`.
    pub missing: Vec<String>,
    /// The target's name when it exists (and is not a symlink), directly in `dir`.
    pub existing: Option<String>,
}

/// A parent directory as [`Rootfs::check_all`] found it.
#[derive(Debug)]
enum Parent {
    /// The root itself.
    Root,
    /// Reached through directories only.
    Dir(OwnedFd),
    /// A component is missing, and none before it is a symlink.
    Missing,
    /// Anything else: each path in it gets the full walk.
    Doubt,
}

/// An open container root filesystem.
#[derive(Debug)]
pub struct Rootfs {
    fd: OwnedFd,
    path: PathBuf,
}

impl Rootfs {
    pub fn open(path: &Path) -> Result<Self, RootfsError> {
        let fd = rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| RootfsError::Io {
            rootfs: path.to_owned(),
            op: "open",
            path: "/".to_owned(),
            errno,
        })?;
        Ok(Self { fd, path: path.to_owned() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, op: &'static str, path: &str, errno: Errno) -> RootfsError {
        RootfsError::Io { rootfs: self.path.clone(), op, path: path.to_owned(), errno }
    }

    fn dup(&self, fd: &OwnedFd, path: &str) -> Result<OwnedFd, RootfsError> {
        rustix::io::fcntl_dupfd_cloexec(fd, 0).map_err(|e| self.io("dup", path, e))
    }

    /// Opens one component of a directory, never following a symlink.
    fn open_component(&self, dir: &OwnedFd, name: &str) -> Result<OwnedFd, Errno> {
        let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat2(dir, name, flags, Mode::empty(), STRICT) {
            // Kernels before 5.6: a single component with O_NOFOLLOW is just as strict.
            Err(Errno::NOSYS) => rustix::fs::openat(dir, name, flags, Mode::empty()),
            r => r,
        }
    }

    /// Walks `path` (absolute, as the container sees it) from the root, following only
    /// symlinks that stay inside; see the module documentation.
    pub fn resolve(&self, path: &str) -> Result<Resolved, RootfsError> {
        let bad = || RootfsError::BadPath { path: path.to_owned() };
        if !path.starts_with('/') {
            return Err(bad());
        }
        let mut queue: VecDeque<String> = VecDeque::new();
        for c in path.split('/').filter(|c| !c.is_empty()) {
            if c == "." || c == ".." {
                return Err(bad());
            }
            queue.push_back(c.to_owned());
        }
        // The directories from the root down to where we are: (fd, name).
        let mut stack: Vec<(OwnedFd, String)> = Vec::new();
        let mut links = 0;
        let here = |stack: &Vec<(OwnedFd, String)>| {
            let mut s = String::new();
            for (_, n) in stack {
                s.push('/');
                s.push_str(n);
            }
            if s.is_empty() { "/".to_owned() } else { s }
        };
        loop {
            let Some(comp) = queue.pop_front() else {
                // The path names an existing directory.
                let existing = stack.pop().map(|(_, name)| name);
                let dir = self.dup(stack.last().map_or(&self.fd, |(f, _)| f), path)?;
                return Ok(Resolved { dir, dir_path: here(&stack), missing: Vec::new(), existing });
            };
            if comp == ".." {
                // Only from a relative link target already checked to stay inside.
                stack.pop();
                continue;
            }
            let dir = stack.last().map(|(f, _)| f).unwrap_or(&self.fd);
            let fd = match self.open_component(dir, &comp) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    let mut missing = vec![comp];
                    missing.extend(queue);
                    let dir = self.dup(dir, path)?;
                    return Ok(Resolved { dir, dir_path: here(&stack), missing, existing: None });
                }
                Err(e) => {
                    return Err(self.io(
                        "open",
                        &format!("{}/{comp}", here(&stack).trim_end_matches('/')),
                        e,
                    ));
                }
            };
            let at = format!("{}/{comp}", here(&stack).trim_end_matches('/'));
            let st = rustix::fs::fstat(&fd).map_err(|e| self.io("stat", &at, e))?;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Symlink => {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(RootfsError::TooManyLinks {
                            rootfs: self.path.clone(),
                            path: path.to_owned(),
                        });
                    }
                    let target = rustix::fs::readlinkat(&fd, "", Vec::new())
                        .map_err(|e| self.io("readlink", &at, e))?;
                    let target = target.to_string_lossy().into_owned();
                    let outside = || RootfsError::SymlinkOutside {
                        rootfs: self.path.clone(),
                        path: path.to_owned(),
                        link: at.clone(),
                        target: target.clone(),
                    };
                    if target.starts_with('/') {
                        return Err(outside());
                    }
                    let mut depth = stack.len() as isize;
                    let mut comps = Vec::new();
                    for c in target.split('/').filter(|c| !c.is_empty() && *c != ".") {
                        depth += if c == ".." { -1 } else { 1 };
                        if depth < 0 {
                            return Err(outside());
                        }
                        comps.push(c.to_owned());
                    }
                    for c in comps.into_iter().rev() {
                        queue.push_front(c);
                    }
                }
                FileType::Directory => stack.push((fd, comp)),
                _ if queue.is_empty() => {
                    let dir = self.dup(dir, path)?;
                    return Ok(Resolved {
                        dir,
                        dir_path: here(&stack),
                        missing: Vec::new(),
                        existing: Some(comp),
                    });
                }
                _ => {
                    return Err(RootfsError::NotADirectory {
                        rootfs: self.path.clone(),
                        path: path.to_owned(),
                        at,
                    });
                }
            }
        }
    }

    /// Checks that `path` can be created or used without leaving the rootfs.
    pub fn check(&self, path: &str) -> Result<(), RootfsError> {
        self.resolve(path).map(|_| ())
    }

    /// [`Rootfs::check`] of every path, in order, each first by a shortcut: its parent
    /// directory is opened once, with `openat2(2)` from the root (`RESOLVE_BENEATH |
    /// RESOLVE_NO_SYMLINKS`, `O_PATH | O_DIRECTORY`), and each name in it is looked at with one
    /// `fstatat` that does not follow it. When the parent is missing, or the name is missing or
    /// anything but a symlink in a parent the kernel reached through directories only, the walk
    /// would meet no symlink: exactly the paths `check` accepts without following anything.
    /// Anything else (a symlink anywhere, a component that is not a directory, no permission, a
    /// kernel before 5.6) gets the full [`Rootfs::check`], with its answer or error. A
    /// container's nodes and driver files are about twenty paths in five or six directories, and
    /// in a minimal image most of those directories are missing: a dozen system calls on every
    /// container start, where a walk one component at a time cost a hundred and fifty.
    pub fn check_all<'p>(
        &self,
        paths: impl IntoIterator<Item = &'p str>,
    ) -> Result<(), RootfsError> {
        let mut parents: Vec<(&str, Parent)> = Vec::new();
        for path in paths {
            if !self.plainly_inside(path, &mut parents) {
                self.check(path)?;
            }
        }
        Ok(())
    }

    /// Whether `path` (absolute, normalized) resolves from the root through directories only,
    /// to a missing name or to anything that is not a symlink; `false` when in doubt. `parents`
    /// holds the parent directories opened so far.
    fn plainly_inside<'p>(&self, path: &'p str, parents: &mut Vec<(&'p str, Parent)>) -> bool {
        let Some(relative) = path.strip_prefix('/') else { return false };
        if relative.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
            return false;
        }
        let (parent, name) = relative.rsplit_once('/').unwrap_or(("", relative));
        let at = match parents.iter().position(|(p, _)| *p == parent) {
            Some(i) => i,
            None => {
                parents.push((parent, self.open_parent(parent)));
                parents.len() - 1
            }
        };
        let dir = match &parents[at].1 {
            Parent::Missing => return true,
            Parent::Doubt => return false,
            Parent::Root => self.fd.as_fd(),
            Parent::Dir(fd) => fd.as_fd(),
        };
        match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => FileType::from_raw_mode(st.st_mode) != FileType::Symlink,
            Err(e) => e == Errno::NOENT,
        }
    }

    /// Opens `parent` (relative to the root, normalized) for [`Rootfs::plainly_inside`].
    fn open_parent(&self, parent: &str) -> Parent {
        if parent.is_empty() {
            return Parent::Root;
        }
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        match rustix::fs::openat2(&self.fd, parent, flags, Mode::empty(), STRICT) {
            Ok(fd) => Parent::Dir(fd),
            Err(Errno::NOENT) => Parent::Missing,
            Err(_) => Parent::Doubt,
        }
    }

    /// Resolves `path` and creates its missing parent directories (mode 0755). Returns the
    /// parent directory and the target's name.
    pub fn prepare(&self, path: &str) -> Result<(OwnedFd, String), RootfsError> {
        let r = self.resolve(path)?;
        if let Some(name) = r.existing {
            return Ok((r.dir, name));
        }
        let Some((name, parents)) = r.missing.split_last() else {
            return Err(RootfsError::BadPath { path: path.to_owned() });
        };
        let mut dir = r.dir;
        let mut at = r.dir_path;
        for comp in parents {
            at = format!("{}/{comp}", at.trim_end_matches('/'));
            match rustix::fs::mkdirat(&dir, comp.as_str(), Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(self.io("mkdir", &at, e)),
            }
            // Re-open without following: whatever is there now must be a real directory.
            let fd = self.open_component(&dir, comp).map_err(|e| self.io("open", &at, e))?;
            let st = rustix::fs::fstat(&fd).map_err(|e| self.io("stat", &at, e))?;
            if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                return Err(RootfsError::NotADirectory {
                    rootfs: self.path.clone(),
                    path: path.to_owned(),
                    at,
                });
            }
            dir = fd;
        }
        Ok((dir, name.clone()))
    }

    /// Creates device node `path` (or accepts an identical one already there).
    pub fn mknod(
        &self,
        path: &str,
        file_type: FileType,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), RootfsError> {
        let (dir, name) = self.prepare(path)?;
        // The mode is exact: the umask does not apply to what the container should see.
        let old = rustix::process::umask(Mode::empty());
        let made = rustix::fs::mknodat(
            &dir,
            name.as_str(),
            file_type,
            Mode::from_raw_mode(mode),
            rustix::fs::makedev(major, minor),
        );
        rustix::process::umask(old);
        match made {
            Ok(()) => Ok(()),
            Err(Errno::EXIST) => {
                let st = rustix::fs::statat(&dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|e| self.io("stat", path, e))?;
                let same = FileType::from_raw_mode(st.st_mode) == file_type
                    && rustix::fs::major(st.st_rdev) == major
                    && rustix::fs::minor(st.st_rdev) == minor;
                if same { Ok(()) } else { Err(self.io("mknod", path, Errno::EXIST)) }
            }
            Err(e) => Err(self.io("mknod", path, e)),
        }
    }

    /// Creates (or finds) a regular file at `path` to mount over and returns an `O_PATH`
    /// descriptor of it.
    pub fn mount_target(&self, path: &str) -> Result<OwnedFd, RootfsError> {
        let (dir, name) = self.prepare(path)?;
        match rustix::fs::openat(
            &dir,
            name.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        ) {
            Ok(_) | Err(Errno::EXIST) => {}
            Err(e) => return Err(self.io("create", path, e)),
        }
        let fd = self.open_component(&dir, &name).map_err(|e| self.io("open", path, e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| self.io("stat", path, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(self.io("mount over", path, Errno::ISDIR));
        }
        Ok(fd)
    }

    /// An `O_PATH` descriptor of the existing `path` (whatever is mounted there).
    pub fn open_existing(&self, path: &str) -> Result<OwnedFd, RootfsError> {
        let r = self.resolve(path)?;
        let name = r.existing.ok_or_else(|| self.io("open", path, Errno::NOENT))?;
        self.open_component(&r.dir, &name).map_err(|e| self.io("open", path, e))
    }

    pub fn fd(&self) -> impl AsFd + '_ {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tree() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        std::fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        std::fs::create_dir_all(r.join("dev")).unwrap();
        symlink("usr/lib", r.join("lib")).unwrap();
        std::fs::write(r.join("usr/lib/file"), b"").unwrap();
        t
    }

    #[test]
    fn follows_links_that_stay_inside() {
        let t = tree();
        let fs = Rootfs::open(t.path()).unwrap();
        let r = fs.resolve("/lib/x86_64-linux-gnu/libcuda.so.1").unwrap();
        assert_eq!(r.dir_path, "/usr/lib/x86_64-linux-gnu");
        assert_eq!(r.missing, ["libcuda.so.1"]);
        let r = fs.resolve("/usr/lib/file").unwrap();
        assert_eq!(r.existing.as_deref(), Some("file"));
        fs.check("/dev/nvidia0").unwrap();
        fs.check("/usr/bin/nvidia-smi").unwrap();
        assert!(matches!(fs.check("/usr/lib/file/x"), Err(RootfsError::NotADirectory { .. })));
        assert!(matches!(fs.check("dev/x"), Err(RootfsError::BadPath { .. })));
        assert!(matches!(fs.check("/dev/../etc"), Err(RootfsError::BadPath { .. })));
    }

    #[test]
    fn refuses_links_that_point_outside() {
        let t = tree();
        let r = t.path();
        std::fs::remove_dir(r.join("dev")).unwrap();
        symlink("/etc", r.join("dev")).unwrap();
        std::fs::remove_dir(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        symlink("../../..", r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        symlink("loop", r.join("loop")).unwrap();
        let fs = Rootfs::open(r).unwrap();
        let e = fs.check("/dev/nvidia0").unwrap_err();
        assert!(
            e.to_string().starts_with("refusing /dev/nvidia0: /dev in the container rootfs"),
            "{e}"
        );
        assert!(e.to_string().contains("is a symlink to /etc, which points outside the rootfs"));
        let e = fs.check("/lib/x86_64-linux-gnu/libcuda.so.1").unwrap_err();
        assert!(
            matches!(&e, RootfsError::SymlinkOutside { link, .. } if link == "/usr/lib/x86_64-linux-gnu"),
            "{e}"
        );
        assert!(matches!(fs.check("/loop/x"), Err(RootfsError::TooManyLinks { .. })));
    }

    #[test]
    fn checking_many_paths_at_once_judges_each_like_check() {
        let t = tree();
        let r = t.path();
        std::fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        std::fs::write(r.join("usr/lib/x86_64-linux-gnu/libc.so.6"), b"").unwrap();
        symlink("/etc/passwd", r.join("usr/lib/x86_64-linux-gnu/libcuda.so.1")).unwrap();
        symlink("libc.so.6", r.join("usr/lib/x86_64-linux-gnu/libinside.so")).unwrap();
        symlink("/", r.join("opt")).unwrap();
        let fs = Rootfs::open(r).unwrap();
        let paths = [
            "/dev/nvidia0",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libnew.so",
            "/lib/x86_64-linux-gnu/libinside.so",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/opt/x/y",
            "/usr/lib/file/x",
            "/new/deep/file",
            "/usr/bin/nvidia-smi",
            "/dev/../etc",
            "relative",
            "/dev//nvidia1",
            "/dev/",
            "/",
            "/opt",
            "/topfile",
            "/lib/x86_64-linux-gnu/libother.so",
            "/usr/lib/x86_64-linux-gnu/libc.so.6/x",
        ];
        for p in paths {
            let one = fs.check(p);
            let all = fs.check_all([p]);
            assert_eq!(all, one, "{p}");
        }
        let ok: Vec<&str> = paths.into_iter().filter(|p| fs.check(p).is_ok()).collect();
        fs.check_all(ok.iter().copied()).unwrap();
        let e = fs.check_all(paths).unwrap_err();
        assert_eq!(Err(e), fs.check("/usr/lib/x86_64-linux-gnu/libcuda.so.1"), "the first bad one");
    }

    #[test]
    fn prepare_creates_directories_inside() {
        let t = tree();
        let fs = Rootfs::open(t.path()).unwrap();
        let (_, name) = fs.prepare("/lib/nvidia/deep/libx.so").unwrap();
        assert_eq!(name, "libx.so");
        assert!(t.path().join("usr/lib/nvidia/deep").is_dir());
        let fd = fs.mount_target("/lib/nvidia/deep/libx.so").unwrap();
        drop(fd);
        assert!(t.path().join("usr/lib/nvidia/deep/libx.so").is_file());
    }
}
