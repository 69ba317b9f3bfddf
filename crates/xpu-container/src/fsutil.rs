//! Writing files that other programs read: atomic replacement, where a reader (a container
//! runtime loading a CDI spec) sees the old content or the new one, never a partial write; and,
//! for a file nothing reads until the writer is done (a bundle's `config.json`, which runc reads
//! after the shim hands over), a rewrite in place whose failure leaves the old content.
//!
//! And reading a file someone else may have put in place ([`read_regular`]: the host snapshot
//! in a CDI directory): a regular file of bounded size only, never a FIFO that would block a
//! container start or a device that never ends. `xpu-host`'s `Root::read_bounded` does the
//! same for the files under a host root; this crate does not depend on `xpu-host`.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Writes `bytes` to a temporary file next to `path` (same directory, so the rename stays on one
/// filesystem), syncs it, and renames it over `path`. The temporary file never outlives a
/// failure. `mode` applies when `path` does not exist yet; an existing file keeps its mode.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_replace(path, bytes, mode, true)
}

/// [`write_atomic`] without the `fsync`: readers still see the old or the new content (the
/// rename is atomic), but a power cut may lose the new one. For a bundle's `config.json`, which
/// runc reads a millisecond later and which does not outlive the container, durability is not
/// worth the `fsync` on every container start.
pub fn write_replace(path: &Path, bytes: &[u8], mode: u32, durable: bool) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // One lstat answers both questions for the usual case, a regular file: its mode, and
    // whether it may be swapped out below.
    let existing = std::fs::symlink_metadata(path).ok();
    let is_file = existing.as_ref().is_some_and(std::fs::Metadata::is_file);
    let mode = match existing {
        Some(m) if m.is_file() => m.permissions().mode() & 0o7777,
        // A symlink keeps the mode of what it points to.
        Some(_) => std::fs::metadata(path).map_or(mode, |m| m.permissions().mode() & 0o7777),
        None => mode,
    };
    let tmp = dir.join(format!(".{name}.xpu-{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        if durable {
            f.sync_all()?;
            return std::fs::rename(&tmp, path);
        }
        // Without fsync, swap the files (`RENAME_EXCHANGE`, as atomic as a rename) and drop the
        // old one: ext4 starts writeback of a file renamed *over* another (`auto_da_alloc`),
        // 10x the cost of the swap. Only a regular file is swapped out, never a directory.
        if !is_file {
            return std::fs::rename(&tmp, path);
        }
        match rustix::fs::renameat_with(
            rustix::fs::CWD,
            &tmp,
            rustix::fs::CWD,
            path,
            rustix::fs::RenameFlags::EXCHANGE,
        ) {
            Ok(()) => std::fs::remove_file(&tmp),
            Err(_) => std::fs::rename(&tmp, path),
        }
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Why [`read_regular`] gave no content. It does not name the file: the caller does.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("does not exist")]
    Missing,
    #[error("is {0}, not a regular file")]
    NotAFile(&'static str),
    #[error("is too large: more than {0} bytes")]
    TooLarge(u64),
    #[error(transparent)]
    Io(std::io::Error),
}

/// The regular file at `path` (links followed), at most `limit` bytes. One `open` (with
/// `O_NONBLOCK`, so a FIFO without a writer does not block it, and `O_NOCTTY`) and one `fstat`,
/// which refuses anything but a regular file before a byte is read; then reads sized from
/// `st_size` but bounded by `limit` whatever the file says, refusing a longer file rather than
/// cutting it.
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    use std::io::Read as _;

    use rustix::fs::{FileType, Mode, OFlags};
    use rustix::io::Errno;
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = match rustix::fs::open(path, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Err(ReadError::Missing),
        // What a socket gives (and a device without a driver).
        Err(Errno::NXIO) => return Err(ReadError::NotAFile("a socket or a device")),
        Err(e) => return Err(ReadError::Io(e.into())),
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| ReadError::Io(e.into()))?;
    let what = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => None,
        FileType::Fifo => Some("a FIFO"),
        FileType::CharacterDevice => Some("a character device"),
        FileType::BlockDevice => Some("a block device"),
        FileType::Socket => Some("a socket"),
        FileType::Directory => Some("a directory"),
        FileType::Symlink | FileType::Unknown => Some("not a plain file"),
    };
    if let Some(what) = what {
        return Err(ReadError::NotAFile(what));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0).min(limit);
    // One read of the whole file, and the one that says it ended.
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0).saturating_add(1));
    std::fs::File::from(fd)
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(ReadError::Io)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge(limit));
    }
    Ok(bytes)
}

/// The most spaces [`rewrite_in_place`] pads a shorter text with.
const MAX_PADDING: usize = 1 << 20;

/// Rewrites the regular file at `path` with `bytes` in place, for a JSON file that no other
/// process reads while it is written: a bundle's `config.json` between the engine writing it
/// and runc reading it, which happens only after the shim has exec'd runc. Returns `false`,
/// having changed nothing, when `path` is not a regular file with one name opened without
/// following a symlink, or when its filesystem cannot reserve the space ahead; the caller then
/// replaces it ([`write_replace`]).
///
/// Space for every byte is reserved first (`fallocate`, keeping the size), so the write itself
/// cannot run out of space halfway: a failure before it leaves the file as it was. The file never
/// shrinks: a shorter `bytes` is padded with spaces to the old length, which JSON allows after
/// a value, so one write leaves either the old text or the new one. No inode is created and no
/// directory changes, where a swap through a temporary file created one, renamed two names and
/// unlinked one, the costliest part of the shim's work on ext4. The file keeps its inode, mode
/// and owner. Like [`write_replace`] without `fsync`, a power cut may lose the new text.
pub fn rewrite_in_place(path: &Path, bytes: &mut Vec<u8>) -> std::io::Result<bool> {
    use rustix::fs::{FallocateFlags, FileType, Mode, OFlags};
    use rustix::io::Errno;
    // Without following a symlink, and without waiting for a reader of a FIFO.
    let flags = OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let Ok(fd) = rustix::fs::open(path, flags, Mode::empty()) else { return Ok(false) };
    let st = rustix::fs::fstat(&fd)?;
    // A file with other names (an engine that links its own copy of the spec into the
    // bundle) is replaced, so that the other names keep the engine's text.
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_nlink != 1 {
        return Ok(false);
    }
    // Padding is bounded: a file far longer than the new text is replaced instead.
    let old = usize::try_from(st.st_size).unwrap_or(usize::MAX);
    if old > bytes.len().saturating_add(MAX_PADDING) {
        return Ok(false);
    }
    let len = bytes.len().max(old);
    match rustix::fs::fallocate(&fd, FallocateFlags::KEEP_SIZE, 0, len as u64) {
        Ok(()) => {}
        Err(Errno::OPNOTSUPP | Errno::NOSYS | Errno::INVAL) => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    bytes.resize(len, b' ');
    let mut done = 0;
    while done < bytes.len() {
        match rustix::io::pwrite(&fd, &bytes[done..], done as u64) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_and_keeps_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("spec.yaml");
        write_atomic(&p, b"one", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        write_atomic(&p, b"two", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file left");
    }

    #[test]
    fn fast_replace_swaps_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        write_replace(&p, b"new", 0o644, false).unwrap();
        write_replace(&p, b"newer", 0o644, false).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"newer");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let d = dir.path().join("d");
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("x"), b"").unwrap();
        assert!(write_replace(&d, b"data", 0o644, false).is_err());
        assert!(d.join("x").exists(), "a directory is never swapped out");
    }

    /// In place: the same inode, mode and owner; a shorter text padded to the old length with
    /// spaces after the JSON value; a symlink, a FIFO, a missing file or one with a second name
    /// left alone, for the caller to replace.
    #[test]
    fn rewrites_in_place_without_shrinking() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, br#"{"a": "the engine's text"}"#).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let ino = std::fs::metadata(&p).unwrap().ino();
        let mut longer = br#"{"a":"the engine's text","b":"and the shim's"}"#.to_vec();
        assert!(rewrite_in_place(&p, &mut longer).unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), longer);
        let mut shorter = br#"{"a":1}"#.to_vec();
        assert!(rewrite_in_place(&p, &mut shorter).unwrap());
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.len(), longer.len(), "never shrinks");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v, serde_json::json!({"a": 1}));
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((m.ino(), m.permissions().mode() & 0o7777), (ino, 0o600));

        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(!rewrite_in_place(&link, &mut b"{}".to_vec()).unwrap());
        let fifo = dir.path().join("fifo.json");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert!(!rewrite_in_place(&fifo, &mut b"{}".to_vec()).unwrap());
        assert!(!rewrite_in_place(&dir.path().join("none.json"), &mut b"{}".to_vec()).unwrap());
        let other_name = dir.path().join("engine-copy.json");
        std::fs::hard_link(&p, &other_name).unwrap();
        assert!(!rewrite_in_place(&p, &mut b"{}".to_vec()).unwrap(), "a file with two names");
        std::fs::remove_file(&other_name).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), text, "untouched by the refusals");
    }

    #[test]
    fn failure_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // Renaming a file over a non-empty directory fails.
        let p = dir.path().join("target");
        std::fs::create_dir(&p).unwrap();
        std::fs::write(p.join("x"), b"").unwrap();
        assert!(write_atomic(&p, b"data", 0o644).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
