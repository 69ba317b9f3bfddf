//! [`Root`]: the prefix under which host paths are read and written. `Root::host()` is `/`;
//! tests and `--root DIR` point it at a fixture tree or a mounted image laid out like a real
//! host (`DIR/sys`, `DIR/proc`, `DIR/dev`, `DIR/etc`).
//!
//! Writes under a root ([`Root::write_file`], [`Root::create_file`], [`Root::open_write`]) and
//! the reads that decide them ([`Root::read_file`], [`Root::exists`]) never leave it: a mounted
//! image is untrusted, and a plain `std::fs` call under `DIR` follows an `etc -> /etc` link
//! onto the host. Paths are resolved with the semantics of `openat2(2)`'s `RESOLVE_IN_ROOT`
//! (links read as the image sees them at boot: an absolute target starts again at the root,
//! `..` stops at it), walked one component at a time from directory descriptors opened with
//! `O_PATH | O_NOFOLLOW` (and `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` where the kernel has
//! `openat2`), so the kernel never follows a link on our behalf and the walk can name the link
//! that is in the way. On top of `RESOLVE_IN_ROOT`, and refused with an error that names the
//! link and says what to do:
//!
//! - a missing directory is created only where no link points: a link whose target does not
//!   exist inside the root (`etc -> /somewhere/else`) is not filled in with new directories;
//! - the file itself is never a link: reads and writes use `O_NOFOLLOW`, so a planted
//!   `/etc/default/grub -> /etc/shadow` neither leaks into a diff nor receives a write;
//! - new files (the temporary file of an atomic replace, a backup) are created with
//!   `O_CREAT | O_EXCL | O_NOFOLLOW`, so a planted `grub.xpu-tmp` or dangling `grub.xpu-bak`
//!   link is never written through; modes are set on the descriptor (`fchmod`), not by path.
//!
//! [`write_atomic_in`] gives paths outside any root (`xpu host metadata-env --output`) the same
//! temporary-file rules.
//!
//! Everything else read under a root (sysfs attributes, `/proc` files, `pci.ids`,
//! `modules.alias`, the linker cache, configuration files) goes through one bounded reader,
//! [`Root::read_bounded`]: the tree is untrusted, and a FIFO would block a plain `read` for
//! ever, a link to `/dev/zero` or a sparse 3 GB file would fill memory. It follows links (sysfs
//! is made of them), opens with `O_NONBLOCK | O_NOCTTY`, takes only a regular file (by `fstat`
//! of what it opened; under a root other than `/` it also looks before opening, so that a
//! planted link never opens a device: opening `/dev/watchdog` arms it), and reads at most a
//! limit, never trusting `st_size` (sysfs says 4096 for every attribute, `/proc` says 0):
//! [`ATTR_MAX`] for an attribute, [`TEXT_MAX`] for a database or a large `/proc` file. Beyond
//! it the file is refused ([`ReadError::TooLarge`]), not cut.

use std::collections::VecDeque;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// A host filesystem prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Root {
    base: PathBuf,
}

/// Why a directory cannot serve as a root.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    #[error("root directory {} does not exist; pass an existing directory to --root", path.display())]
    Missing { path: PathBuf },
    #[error("root {} is not a directory; pass a directory to --root", path.display())]
    NotADirectory { path: PathBuf },
}

/// Symlinks followed in one path before giving up, as the kernel's `MAXSYMLINKS`.
const MAX_LINKS: usize = 40;

/// The largest file [`Root::read_file`] reads: the files it feeds (configuration files, the
/// VFIO state) are a few kilobytes, and an image may hold anything.
pub const MAX_READ: u64 = 4 << 20;

/// The most a sysfs attribute or a small `/proc` file holds: the one page the kernel fills for
/// it (`sysfs_emit`; <https://docs.kernel.org/filesystems/sysfs.html>, "Reading/Writing
/// Attribute Data").
pub const ATTR_MAX: u64 = 4096;

/// The most a host database or a large `/proc` file is read: `pci.ids` and `modules.alias` are
/// about 1.5 MB, `/proc/cpuinfo` of a thousand CPUs as much, the linker cache far less.
pub const TEXT_MAX: u64 = 16 << 20;

/// Why [`Root::read_bounded`] gave no content. It does not name the file: the caller does
/// (`/sys/bus/pci/devices/0000:25:00.0/vendor: is a FIFO, not a regular file`).
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("does not exist")]
    Missing,
    #[error("is {what}, not a regular file")]
    NotAFile {
        /// `a FIFO`, `a character device`, ...
        what: &'static str,
        /// Whether it is the null device (`/dev/null`, 1:3): a link to it is how systemd
        /// masks a configuration file (modprobe.d(5)), which reads as empty.
        null_device: bool,
    },
    #[error("is too large: more than {limit} bytes")]
    TooLarge { limit: u64 },
    #[error(transparent)]
    Io(std::io::Error),
}

impl ReadError {
    pub fn is_missing(&self) -> bool {
        matches!(self, ReadError::Missing)
    }

    /// Whether the file is a link to `/dev/null` (a masked configuration file).
    pub fn is_null_device(&self) -> bool {
        matches!(self, ReadError::NotAFile { null_device: true, .. })
    }
}

impl From<ReadError> for std::io::Error {
    fn from(e: ReadError) -> Self {
        use std::io::ErrorKind;
        match e {
            ReadError::Io(e) => e,
            ReadError::Missing => Errno::NOENT.into(),
            ReadError::NotAFile { .. } => std::io::Error::new(ErrorKind::InvalidInput, e),
            ReadError::TooLarge { .. } => std::io::Error::new(ErrorKind::FileTooLarge, e),
        }
    }
}

/// A path under a root that cannot be read or written safely. Paths are shown as they are on
/// this machine (`ROOT/etc/default/grub`).
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error(
        "{link} is a symlink to {target}{}, and {inside} does not exist inside the root; xpu resolves links under a root as the image sees them at boot and never follows one out of it: make {link} a directory or point it at one inside the root",
        if *escapes { ", outside the root" } else { "" }
    )]
    DanglingLink { link: String, target: String, inside: String, escapes: bool },
    #[error(
        "{link} is a symlink to {target}{}, which inside the root leads back to itself (more than {MAX_LINKS} links while resolving {path}); xpu never follows a link out of the root: make {link} a directory",
        if *escapes { ", outside the root" } else { "" }
    )]
    LinkLoop { path: String, link: String, target: String, escapes: bool },
    #[error(
        "{path} is a symlink to {target}; xpu does not read or write through a link there (it could lead out of the root): replace it with a regular file or remove it"
    )]
    FileIsLink { path: String, target: String },
    #[error("{path} is not a regular file; remove it or replace it with one")]
    NotAFile { path: String },
    #[error("{at} is not a directory, so {path} cannot be used; remove or rename {at}")]
    NotADirectory { path: String, at: String },
    #[error("{path} is larger than {MAX_READ} bytes; xpu only edits small configuration files")]
    TooLarge { path: String },
    #[error("{path} already exists; remove it and retry")]
    Exists { path: String },
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl PathError {
    /// Whether the error is the host's (permissions, I/O) rather than the tree's shape.
    pub fn is_io(&self) -> bool {
        matches!(self, PathError::Io { .. })
    }
}

/// A regular file read under a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootFile {
    pub bytes: Vec<u8>,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
}

/// The directory holding a path's last component, resolved inside the root.
struct Parent {
    dir: OwnedFd,
    name: String,
    /// The path as shown in errors (`ROOT/etc/default/grub`).
    shown: String,
    /// The directory, as shown in errors.
    dir_shown: String,
}

impl Root {
    /// The running host (`/`).
    pub fn host() -> Self {
        Self { base: PathBuf::from("/") }
    }

    /// A root at `dir`, which must be an existing directory.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self, RootError> {
        let path = dir.into();
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => Ok(Self { base: path }),
            Ok(_) => Err(RootError::NotADirectory { path }),
            Err(_) => Err(RootError::Missing { path }),
        }
    }

    /// Whether this is the running host's `/`.
    pub fn is_host(&self) -> bool {
        self.base == Path::new("/")
    }

    pub fn base(&self) -> &Path {
        &self.base
    }

    /// The real path of host path `p` (`/sys/bus/pci` or `sys/bus/pci`) under this root. For
    /// reading sysfs and the like; writes go through [`Root::write_file`] and its siblings.
    ///
    /// A `..` in `p` never climbs above the root: host paths built from what the root holds (a
    /// mount point in its `/proc/self/mounts`, a cgroup in `/proc/self/cgroup`) are untrusted,
    /// and `/..` is `/` on the host too. (Links inside the root are the readers' business.)
    pub fn path(&self, p: impl AsRef<Path>) -> PathBuf {
        let p = p.as_ref();
        let rel = p.strip_prefix("/").unwrap_or(p);
        if !rel.as_os_str().as_encoded_bytes().windows(2).any(|w| w == b"..") {
            return self.base.join(rel);
        }
        let mut out = self.base.clone();
        let mut depth = 0usize;
        for c in rel.components() {
            match c {
                std::path::Component::Normal(name) => {
                    out.push(name);
                    depth += 1;
                }
                std::path::Component::ParentDir if depth > 0 => {
                    out.pop();
                    depth -= 1;
                }
                _ => {}
            }
        }
        out
    }

    /// The host path of a real path under this root, for messages (`/sys/...`).
    pub fn display(&self, real: &Path) -> String {
        match real.strip_prefix(&self.base) {
            Ok(rel) => format!("/{}", rel.display()),
            Err(_) => real.display().to_string(),
        }
    }

    /// Host path components (`["etc", "default"]`) as shown in errors.
    fn shown(&self, comps: &[&str]) -> String {
        let mut p = self.base.clone();
        p.extend(comps);
        p.display().to_string()
    }

    fn open_base(&self) -> Result<OwnedFd, PathError> {
        rustix::fs::open(
            self.base.as_path(),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("open the root", self.base.display().to_string(), e))
    }

    /// Resolves the directory of host path `path` inside the root (see the module
    /// documentation). `Ok(None)`: a directory on the way does not exist and `create` is off.
    fn parent(&self, path: &str, create: bool) -> Result<Option<Parent>, PathError> {
        let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
        let shown = self.shown(&comps);
        let Some((&name, dirs)) = comps.split_last().filter(|(n, _)| **n != "..") else {
            return Err(PathError::NotAFile { path: shown });
        };
        let base = self.open_base()?;
        // Physical directories from the root down: (descriptor, name). `..` pops, and stops at
        // the root as RESOLVE_IN_ROOT does.
        let mut stack: Vec<(OwnedFd, String)> = Vec::new();
        let mut queue: VecDeque<String> = dirs.iter().map(|c| (*c).to_owned()).collect();
        // How many entries at the front of `queue` came from link targets, and the last link.
        let mut from_link = 0usize;
        let mut last_link: Option<(String, String, bool)> = None;
        let mut first_link: Option<(String, String, bool)> = None;
        let mut links = 0usize;
        let here = |stack: &[(OwnedFd, String)], extra: Option<&str>| {
            let mut v: Vec<&str> = stack.iter().map(|(_, n)| n.as_str()).collect();
            v.extend(extra);
            self.shown(&v)
        };
        while let Some(comp) = queue.pop_front() {
            let in_target = from_link > 0;
            from_link = from_link.saturating_sub(1);
            if comp == "." {
                continue;
            }
            if comp == ".." {
                stack.pop();
                continue;
            }
            let at = here(&stack, Some(&comp));
            let dir = stack.last().map_or(&base, |(f, _)| f);
            let fd = match open_component(dir, &comp) {
                Ok(fd) => fd,
                Err(Errno::NOENT) if in_target || !create => {
                    if let (true, Some((link, target, escapes))) = (in_target, last_link) {
                        let mut rest: Vec<&str> = stack.iter().map(|(_, n)| n.as_str()).collect();
                        rest.push(&comp);
                        rest.extend(queue.iter().take(from_link).map(String::as_str));
                        return Err(PathError::DanglingLink {
                            link,
                            target,
                            inside: self.shown(&rest),
                            escapes,
                        });
                    }
                    return Ok(None);
                }
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(dir, comp.as_str(), Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(io("create the directory", at, e)),
                    }
                    open_component(dir, &comp).map_err(|e| io("open", at.clone(), e))?
                }
                Err(e) => return Err(io("open", at, e)),
            };
            let st = rustix::fs::fstat(&fd).map_err(|e| io("stat", at.clone(), e))?;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => stack.push((fd, comp)),
                FileType::Symlink => {
                    let target = rustix::fs::readlinkat(&fd, "", Vec::new())
                        .map_err(|e| io("read the link", at.clone(), e))?
                        .to_string_lossy()
                        .into_owned();
                    let absolute = target.starts_with('/');
                    // Whether the link, followed as written on this machine, leaves the root.
                    let mut depth = if absolute { 0 } else { stack.len() as isize };
                    let mut escapes = absolute;
                    for c in target.split('/').filter(|c| !c.is_empty() && *c != ".") {
                        depth += if c == ".." { -1 } else { 1 };
                        escapes |= depth < 0;
                    }
                    // Nothing is outside `/`.
                    escapes &= !self.is_host();
                    let link = (at, target.clone(), escapes);
                    links += 1;
                    if links > MAX_LINKS {
                        let (link, target, escapes) = first_link.unwrap_or(link);
                        return Err(PathError::LinkLoop { path: shown, link, target, escapes });
                    }
                    first_link.get_or_insert_with(|| link.clone());
                    last_link = Some(link);
                    if absolute {
                        stack.clear();
                    }
                    let parts: Vec<&str> =
                        target.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
                    from_link += parts.len();
                    for c in parts.into_iter().rev() {
                        queue.push_front(c.to_owned());
                    }
                }
                _ => return Err(PathError::NotADirectory { path: shown, at }),
            }
        }
        let dir_shown = here(&stack, None);
        let dir = match stack.pop() {
            Some((fd, _)) => fd,
            None => base,
        };
        Ok(Some(Parent { dir, name: name.to_owned(), shown, dir_shown }))
    }

    /// Reads the regular file at host path `path`; `None` when it (or a directory on the way)
    /// does not exist. A link there is an error, not followed.
    pub fn read_file(&self, path: &str) -> Result<Option<RootFile>, PathError> {
        let Some(p) = self.parent(path, false)? else { return Ok(None) };
        // Look before opening, so a device node is never opened (the fstat below still
        // decides, should the entry change in between).
        match rustix::fs::statat(&p.dir, p.name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => {}
                FileType::Symlink => return Err(link_error(&p)),
                _ => return Err(PathError::NotAFile { path: p.shown }),
            },
            Err(Errno::NOENT) => return Ok(None),
            Err(e) => return Err(io("stat", p.shown, e)),
        }
        // O_NONBLOCK: a FIFO swapped in after the look must not hang the read.
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = match rustix::fs::openat(&p.dir, p.name.as_str(), flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(Errno::LOOP) => return Err(link_error(&p)),
            Err(e) => return Err(io("open", p.shown, e)),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| io("stat", p.shown.clone(), e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(PathError::NotAFile { path: p.shown });
        }
        let mut bytes = Vec::new();
        std::fs::File::from(fd)
            .take(MAX_READ + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| PathError::Io { op: "read", path: p.shown.clone(), source })?;
        if bytes.len() as u64 > MAX_READ {
            return Err(PathError::TooLarge { path: p.shown });
        }
        Ok(Some(RootFile { bytes, mode: st.st_mode & 0o7777 }))
    }

    /// The regular file at `real` (a path from [`Root::path`]; links followed), at most `limit`
    /// bytes: anything else is refused, never read (see the module documentation).
    pub fn read_bounded(&self, real: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
        read_in(rustix::fs::CWD, real, limit, Cut::Refuse, !self.is_host())
    }

    /// [`Root::read_bounded`] of `name` in directory `dir` (a descriptor opened under this
    /// root; `O_PATH` will do), for many reads from one directory.
    pub fn read_bounded_at(
        &self,
        dir: impl AsFd,
        name: &str,
        limit: u64,
    ) -> Result<Vec<u8>, ReadError> {
        read_in(dir, name, limit, Cut::Refuse, !self.is_host())
    }

    /// The first `len` bytes (fewer when the file is shorter) of the regular file at `real`,
    /// with [`Root::read_bounded`]'s checks: for a magic number.
    pub fn read_head(&self, real: &Path, len: u64) -> Result<Vec<u8>, ReadError> {
        read_in(rustix::fs::CWD, real, len, Cut::Keep, !self.is_host())
    }

    /// Whether anything (a link included, not followed) is at host path `path`.
    pub fn exists(&self, path: &str) -> Result<bool, PathError> {
        let Some(p) = self.parent(path, false)? else { return Ok(false) };
        match rustix::fs::statat(&p.dir, p.name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(_) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(io("stat", p.shown, e)),
        }
    }

    /// Replaces the file at host path `path` with `content` and `mode`, atomically: a
    /// temporary file created beside it (`O_EXCL | O_NOFOLLOW`) is renamed into place, so a
    /// crash never leaves a half-written file. Missing directories are created (0755); a link
    /// at `path` is refused.
    pub fn write_file(&self, path: &str, content: &[u8], mode: u32) -> Result<(), PathError> {
        let p =
            self.parent(path, true)?.ok_or_else(|| PathError::NotAFile { path: path.into() })?;
        match rustix::fs::statat(&p.dir, p.name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
                return Err(link_error(&p));
            }
            Ok(_) | Err(Errno::NOENT) => {}
            Err(e) => return Err(io("stat", p.shown, e)),
        }
        replace_in(&p.dir, &p.dir_shown, &p.name, content, mode)
    }

    /// Creates a new file at host path `path` (it must not exist, as a link or otherwise).
    pub fn create_file(&self, path: &str, content: &[u8], mode: u32) -> Result<(), PathError> {
        let p =
            self.parent(path, true)?.ok_or_else(|| PathError::NotAFile { path: path.into() })?;
        let fd = create_excl(&p.dir, &p.name, &p.shown, mode)?;
        write_all(fd, content, &p.shown)
    }

    /// Opens the existing regular file at host path `path` for writing, truncated (a sysfs
    /// attribute: it must exist, and a link there is refused).
    pub fn open_write(&self, path: &str) -> Result<std::fs::File, PathError> {
        let p = self.parent(path, false)?.ok_or_else(|| PathError::Io {
            op: "open",
            path: self.shown(&[path.trim_start_matches('/')]),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        let flags = OFlags::WRONLY | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        match rustix::fs::openat(&p.dir, p.name.as_str(), flags, Mode::empty()) {
            Ok(fd) => Ok(std::fs::File::from(fd)),
            Err(Errno::LOOP) => Err(link_error(&p)),
            Err(e) => Err(io("open", p.shown, e)),
        }
    }
}

/// Writes `dir/name` atomically as [`Root::write_file`] does, for a path the user named outside
/// any root: `dir` is opened as given, the temporary file `.NAME.xpu-tmp` beside the target is
/// created with `O_EXCL | O_NOFOLLOW` (a planted link there is removed, never written through),
/// and renamed over `name` (which replaces a link there rather than following it).
pub fn write_atomic_in(dir: &Path, name: &str, content: &[u8], mode: u32) -> Result<(), PathError> {
    let shown = dir.display().to_string();
    let fd =
        rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| io("open the directory", shown.clone(), e))?;
    replace_in_named(&fd, &shown, name, &format!(".{name}.xpu-tmp"), content, mode)
}

/// [`Root::read_bounded`] for a path outside any root (a file named on the command line): the
/// same checks, the entry always looked at before it is opened.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    read_in(rustix::fs::CWD, path, limit, Cut::Refuse, true)
}

/// `Ok` when `path` (links followed) is a regular file; else what it is, or
/// [`ReadError::Missing`]. A `stat`, nothing opened: for choosing among candidate files
/// (`pci.ids` under the root or on the host) before reading one.
pub fn regular_file(path: &Path) -> Result<(), ReadError> {
    match rustix::fs::stat(path) {
        Ok(st) => regular(&st),
        Err(Errno::NOENT | Errno::NOTDIR) => Err(ReadError::Missing),
        Err(e) => Err(ReadError::Io(e.into())),
    }
}

/// The first of `candidates` that is a regular file; each that is there but is not one (a FIFO,
/// a link to a device, a directory) is passed over with a warning in `w` naming it.
pub(crate) fn first_regular(
    candidates: impl IntoIterator<Item = PathBuf>,
    shown: impl Fn(&Path) -> String,
    w: &mut Vec<String>,
) -> Option<PathBuf> {
    candidates.into_iter().find(|p| match regular_file(p) {
        Ok(()) => true,
        Err(ReadError::Missing) => false,
        Err(e) => {
            w.push(format!("{}: {e}; passed over", shown(p)));
            false
        }
    })
}

/// What a bounded read does past its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Refuse the file ([`ReadError::TooLarge`]).
    Refuse,
    /// Keep what was read up to the limit (a file's head).
    Keep,
}

/// The bounded read: `name` in `dir`, links followed. `look`: `stat` it first and open only a
/// regular file, so that no device is ever opened (for trees someone else made).
fn read_in<P: rustix::path::Arg + Copy>(
    dir: impl AsFd,
    name: P,
    limit: u64,
    cut: Cut,
    look: bool,
) -> Result<Vec<u8>, ReadError> {
    let dir = dir.as_fd();
    if look {
        match rustix::fs::statat(dir, name, AtFlags::empty()) {
            Ok(st) => regular(&st)?,
            Err(Errno::NOENT) => return Err(ReadError::Missing),
            Err(e) => return Err(ReadError::Io(e.into())),
        }
    }
    // O_NONBLOCK: opening a FIFO without a writer returns at once (and the fstat refuses it);
    // O_NOCTTY: a terminal never becomes ours.
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = match rustix::fs::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Err(ReadError::Missing),
        // A socket, or a device without a driver: say which, when a look can tell.
        Err(e @ Errno::NXIO) => {
            return Err(match rustix::fs::statat(dir, name, AtFlags::empty()) {
                Ok(st) => regular(&st).err().unwrap_or(ReadError::Io(e.into())),
                Err(_) => ReadError::Io(e.into()),
            });
        }
        Err(e) => return Err(ReadError::Io(e.into())),
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| ReadError::Io(e.into()))?;
    regular(&st)?;
    read_to_limit(fd, u64::try_from(st.st_size).unwrap_or(0), limit, cut)
}

/// `Ok` for a regular file; what it is otherwise.
fn regular(st: &rustix::fs::Stat) -> Result<(), ReadError> {
    let what = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => return Ok(()),
        FileType::Fifo => "a FIFO",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Socket => "a socket",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Unknown => "of an unknown type",
    };
    let null_device = FileType::from_raw_mode(st.st_mode) == FileType::CharacterDevice
        && (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev)) == (1, 3);
    Err(ReadError::NotAFile { what, null_device })
}

/// Reads an open regular file to its end, at most `limit` bytes. The first page goes through a
/// buffer on the stack, so a sysfs attribute (a few bytes, `st_size` 4096) costs one small
/// allocation and two `read`s; a longer file continues into a vector sized from `size`
/// (`st_size`, a hint only, never more than the limit).
fn read_to_limit(fd: OwnedFd, size: u64, limit: u64, cut: Cut) -> Result<Vec<u8>, ReadError> {
    let mut page = [0u8; 4096];
    // One byte past the limit tells a file of exactly `limit` bytes from a longer one.
    let want = match cut {
        Cut::Refuse => limit.saturating_add(1),
        Cut::Keep => limit,
    };
    let first = usize::try_from(want).unwrap_or(usize::MAX).min(page.len());
    let mut filled = 0;
    while filled < first {
        match rustix::io::read(&fd, &mut page[filled..first]) {
            Ok(0) => return Ok(page[..filled].to_vec()),
            Ok(n) => filled += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(ReadError::Io(e.into())),
        }
    }
    let mut out = Vec::with_capacity(
        usize::try_from(size.clamp(filled as u64, limit)).unwrap_or(filled).saturating_add(1),
    );
    out.extend_from_slice(&page[..filled]);
    std::fs::File::from(fd)
        .take(want - filled as u64)
        .read_to_end(&mut out)
        .map_err(ReadError::Io)?;
    if out.len() as u64 > limit {
        return Err(ReadError::TooLarge { limit });
    }
    Ok(out)
}

/// Opens one component of a directory, never following a symlink.
fn open_component(dir: &OwnedFd, name: &str) -> Result<OwnedFd, Errno> {
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(dir, name, flags, Mode::empty(), resolve) {
        // Kernels before 5.6: a single component with O_NOFOLLOW is just as strict.
        Err(Errno::NOSYS) => rustix::fs::openat(dir, name, flags, Mode::empty()),
        r => r,
    }
}

fn io(op: &'static str, path: String, e: Errno) -> PathError {
    PathError::Io { op, path, source: e.into() }
}

fn link_error(p: &Parent) -> PathError {
    let target = rustix::fs::readlinkat(&p.dir, p.name.as_str(), Vec::new())
        .map(|t| t.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".to_owned());
    PathError::FileIsLink { path: p.shown.clone(), target }
}

fn joined(dir_shown: &str, name: &str) -> String {
    format!("{}/{name}", dir_shown.trim_end_matches('/'))
}

fn create_excl(dir: &OwnedFd, name: &str, shown: &str, mode: u32) -> Result<OwnedFd, PathError> {
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = match rustix::fs::openat(dir, name, flags, Mode::from_raw_mode(0o600)) {
        Ok(fd) => fd,
        Err(Errno::EXIST) => return Err(PathError::Exists { path: shown.to_owned() }),
        Err(e) => return Err(io("create", shown.to_owned(), e)),
    };
    // On the descriptor, not the path: the umask does not apply and no link can be swapped in.
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode & 0o7777))
        .map_err(|e| io("set the mode of", shown.to_owned(), e))?;
    Ok(fd)
}

fn write_all(fd: OwnedFd, content: &[u8], shown: &str) -> Result<(), PathError> {
    std::fs::File::from(fd).write_all(content).map_err(|source| PathError::Io {
        op: "write",
        path: shown.to_owned(),
        source,
    })
}

fn replace_in(
    dir: &OwnedFd,
    dir_shown: &str,
    name: &str,
    content: &[u8],
    mode: u32,
) -> Result<(), PathError> {
    replace_in_named(dir, dir_shown, name, &format!("{name}.xpu-tmp"), content, mode)
}

fn replace_in_named(
    dir: &OwnedFd,
    dir_shown: &str,
    name: &str,
    tmp: &str,
    content: &[u8],
    mode: u32,
) -> Result<(), PathError> {
    let tmp_shown = joined(dir_shown, tmp);
    // A leftover from a crash, or something planted: unlinkat removes a link itself, never
    // its target; O_EXCL below then refuses anything that reappears.
    match rustix::fs::unlinkat(dir, tmp, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => {}
        Err(e) => return Err(io("remove the stale temporary file", tmp_shown, e)),
    }
    let fd = create_excl(dir, tmp, &tmp_shown, mode)?;
    let done = write_all(fd, content, &tmp_shown).and_then(|()| {
        rustix::fs::renameat(dir, tmp, dir, name)
            .map_err(|e| io("replace", joined(dir_shown, name), e))
    });
    if done.is_err() {
        // The error being returned is the one that matters; a temporary file left behind is
        // removed by the next run.
        let _ = rustix::fs::unlinkat(dir, tmp, AtFlags::empty());
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_path_never_leads_above_the_root() {
        let root = Root::new("/tmp").unwrap();
        assert_eq!(root.path("/sys/fs/cgroup"), Path::new("/tmp/sys/fs/cgroup"));
        assert_eq!(root.path("/sys/../../../etc/shadow"), Path::new("/tmp/etc/shadow"));
        assert_eq!(root.path("../../x/./y/../z"), Path::new("/tmp/x/z"));
        assert_eq!(root.path("/a..b/..c"), Path::new("/tmp/a..b/..c"), "names with dots stay");
    }

    #[test]
    fn joins_absolute_paths_under_base() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::new(dir.path()).unwrap();
        assert_eq!(root.path("/sys/bus"), dir.path().join("sys/bus"));
        assert_eq!(root.display(&dir.path().join("sys/bus")), "/sys/bus");
        assert!(Root::host().is_host());
        assert_eq!(Root::host().path("/sys"), PathBuf::from("/sys"));
    }

    use std::os::unix::fs::{PermissionsExt, symlink};

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn links_resolve_inside_the_root_as_the_image_sees_them() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        std::fs::create_dir_all(t.join("usr/lib")).unwrap();
        std::fs::create_dir_all(t.join("etc")).unwrap();
        // Merged /usr, relative; an absolute link read from the image's own /.
        symlink("usr/lib", t.join("lib")).unwrap();
        symlink("/usr/lib", t.join("etc/udev")).unwrap();
        // A `..` above the root stops at it.
        symlink("../../../../usr", t.join("etc/up")).unwrap();
        let root = Root::new(&t).unwrap();
        root.write_file("/lib/udev/a.sh", b"a", 0o755).unwrap();
        root.write_file("/etc/udev/rules.d/b.rules", b"b", 0o644).unwrap();
        root.write_file("/etc/up/c", b"c", 0o600).unwrap();
        assert_eq!(std::fs::read(t.join("usr/lib/udev/a.sh")).unwrap(), b"a");
        assert_eq!(mode(&t.join("usr/lib/udev/a.sh")), 0o755);
        assert_eq!(std::fs::read(t.join("usr/lib/rules.d/b.rules")).unwrap(), b"b");
        assert_eq!(std::fs::read(t.join("usr/c")).unwrap(), b"c");
        assert_eq!(mode(&t.join("usr/c")), 0o600);
        let f = root.read_file("/etc/udev/rules.d/b.rules").unwrap().unwrap();
        assert_eq!((f.bytes, f.mode), (b"b".to_vec(), 0o644));
        assert!(root.read_file("/etc/none/x").unwrap().is_none());
        assert!(root.exists("/lib/udev/a.sh").unwrap());
    }

    #[test]
    fn links_that_lead_nowhere_inside_the_root_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let (t, outside) = (dir.path().join("t"), dir.path().join("outside"));
        std::fs::create_dir_all(&t).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        symlink(&outside, t.join("etc")).unwrap();
        symlink("../outside", t.join("var")).unwrap();
        symlink("/srv", t.join("srv")).unwrap();
        let root = Root::new(&t).unwrap();
        let e = root.write_file("/etc/default/grub", b"x", 0o644).unwrap_err().to_string();
        let want = format!(
            "{}/etc is a symlink to {}, outside the root, and {}{} does not exist inside the root;",
            t.display(),
            outside.display(),
            t.display(),
            outside.display()
        );
        assert!(e.starts_with(&want), "{e}");
        assert!(e.contains(&format!("make {}/etc a directory", t.display())), "{e}");
        let e = root.read_file("/var/lib/x").unwrap_err().to_string();
        assert!(e.contains("/var is a symlink to ../outside, outside the root"), "{e}");
        let e = root.write_file("/srv/x", b"x", 0o644).unwrap_err().to_string();
        assert!(e.contains("/srv is a symlink to /srv, outside the root, which inside the root leads back to itself"), "{e}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert!(!t.join("outside").exists(), "no directory made through a dangling link");
    }

    #[test]
    fn the_file_itself_is_never_a_link_and_new_files_are_new() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "victim").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::create_dir_all(t.join("etc")).unwrap();
        symlink(&victim, t.join("etc/grub")).unwrap();
        symlink(&victim, t.join("etc/conf.xpu-tmp")).unwrap();
        symlink(dir.path().join("new"), t.join("etc/bak")).unwrap();
        let fifo = t.join("etc/fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let root = Root::new(&t).unwrap();
        let e = root.read_file("/etc/grub").unwrap_err().to_string();
        assert!(e.contains("/etc/grub is a symlink to "), "{e}");
        assert!(root.write_file("/etc/grub", b"x", 0o644).is_err());
        assert!(
            root.read_file("/etc/fifo").unwrap_err().to_string().contains("is not a regular file")
        );
        // The planted temporary link is removed, never written through.
        root.write_file("/etc/conf", b"new", 0o644).unwrap();
        assert_eq!(std::fs::read(t.join("etc/conf")).unwrap(), b"new");
        assert!(!t.join("etc/conf.xpu-tmp").exists());
        // A dangling link at a new file's name is not followed.
        assert!(matches!(root.create_file("/etc/bak", b"x", 0o644), Err(PathError::Exists { .. })));
        assert!(!dir.path().join("new").exists());
        assert_eq!(std::fs::read(&victim).unwrap(), b"victim");
        assert_eq!(mode(&victim), 0o600);
        // Outside a root too.
        symlink(&victim, dir.path().join(".env.xpu-tmp")).unwrap();
        write_atomic_in(dir.path(), "env", b"A=1\n", 0o644).unwrap();
        assert_eq!(std::fs::read(dir.path().join("env")).unwrap(), b"A=1\n");
        assert_eq!(std::fs::read(&victim).unwrap(), b"victim");
        assert_eq!(mode(&victim), 0o600);
    }

    /// Issue 11: what is not a regular file is refused without being read (a FIFO would
    /// block, `/dev/zero` never ends), whether the entry is looked at first (a root other than
    /// `/`) or only the opened descriptor is (`/`); and nothing past the limit is read.
    #[test]
    fn bounded_reads_take_only_regular_files_within_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let fifo = d.join("fifo");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, FileType::Fifo, Mode::from_raw_mode(0o644), 0)
            .unwrap();
        symlink("/dev/zero", d.join("zero")).unwrap();
        symlink("/dev/null", d.join("null")).unwrap();
        symlink("fifo", d.join("to-fifo")).unwrap();
        std::fs::create_dir(d.join("dir")).unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(d.join("sock")).unwrap();
        let huge = std::fs::File::create(d.join("huge")).unwrap();
        // Sparse: 3 GB that cost no disk.
        huge.set_len(3 << 30).unwrap();
        std::fs::write(d.join("page"), vec![b'x'; ATTR_MAX as usize]).unwrap();
        std::fs::write(d.join("page+1"), vec![b'x'; ATTR_MAX as usize + 1]).unwrap();
        std::fs::write(d.join("small"), "0x10de\n").unwrap();

        for look in [false, true] {
            let read = |name: &str, limit| {
                read_in(rustix::fs::CWD, &d.join(name), limit, Cut::Refuse, look)
            };
            for (name, what) in [
                ("fifo", "a FIFO"),
                ("to-fifo", "a FIFO"),
                ("zero", "a character device"),
                ("dir", "a directory"),
                ("sock", "a socket"),
            ] {
                let e = read(name, ATTR_MAX).unwrap_err();
                assert!(
                    matches!(e, ReadError::NotAFile { what: w, null_device: false } if w == what),
                    "{name} (look {look}): {e:?}"
                );
                assert_eq!(e.to_string(), format!("is {what}, not a regular file"));
            }
            assert!(read("null", ATTR_MAX).unwrap_err().is_null_device());
            let e = read("huge", TEXT_MAX).unwrap_err();
            assert!(matches!(e, ReadError::TooLarge { limit: TEXT_MAX }), "{e:?}");
            assert!(e.to_string().starts_with("is too large: more than 16777216 bytes"), "{e}");
            assert_eq!(read("page", ATTR_MAX).unwrap().len(), ATTR_MAX as usize);
            assert!(matches!(read("page+1", ATTR_MAX), Err(ReadError::TooLarge { .. })));
            assert_eq!(read("page+1", 2 * ATTR_MAX).unwrap().len(), ATTR_MAX as usize + 1);
            assert_eq!(read("small", ATTR_MAX).unwrap(), b"0x10de\n");
            assert!(read("absent", ATTR_MAX).unwrap_err().is_missing());
            let head = read_in(rustix::fs::CWD, &d.join("huge"), 4, Cut::Keep, look).unwrap();
            assert_eq!(head, [0; 4]);
        }
        let root = Root::new(d).unwrap();
        assert_eq!(root.read_bounded_at(root.open_base().unwrap(), "small", 8).unwrap().len(), 7);
        let e = std::io::Error::from(root.read_bounded(&d.join("fifo"), ATTR_MAX).unwrap_err());
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert_eq!(e.to_string(), "is a FIFO, not a regular file");
        let e = std::io::Error::from(read_bounded(&d.join("huge"), ATTR_MAX).unwrap_err());
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge);
    }

    #[test]
    fn missing_root_is_a_clear_error() {
        let e = Root::new("/definitely/not/here").unwrap_err();
        assert!(e.to_string().contains("does not exist; pass an existing directory to --root"));
    }
}
