//! Atomic file replacement: a reader (a container runtime loading a CDI spec, runc loading
//! `config.json`) sees the old content or the new one, never a partial write.

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
