//! Who may read the data dir. It holds the store (every job's manifest and environment, which
//! may carry credentials), the API token, and every task's output, so only the daemon's user
//! reads it: the data dir is `0750` when the socket (`0660`, for local users of the daemon's
//! group) is inside it, so that group can reach the socket, and `0700` otherwise; everything the
//! daemon keeps in it is `0700` (directories) or `0600` (files).
//!
//! New files and directories get their mode when they are created (the executor, the token and
//! the store do that); [`prepare`] creates the data dir and checks what an earlier version or
//! an operator left there, taking away the extra bits and saying so. It does not set the
//! process umask: tasks inherit it, and a job's own files keep the usual `0644`.

use std::fs::Permissions;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Mode of directories the daemon creates inside the data dir.
pub const DIR_MODE: u32 = 0o700;
/// Mode of files the daemon creates inside the data dir.
pub const FILE_MODE: u32 = 0o600;

/// Directories inside the data dir (`tasks/`: logs, bundles; `runc/`: container state).
const DIRS: [&str; 2] = ["tasks", "runc"];
/// Files inside the data dir: the token, and the SQLite store with its WAL, shared memory and
/// rollback journal (SQLite gives the last three the database file's mode when it creates them).
const FILES: [&str; 5] = ["token", "xpu.db", "xpu.db-wal", "xpu.db-shm", "xpu.db-journal"];

/// The mode the data dir gets: group access only to reach a socket inside it.
pub fn data_dir_mode(data_dir: &Path, socket: &Path) -> u32 {
    if socket.starts_with(data_dir) { 0o750 } else { DIR_MODE }
}

/// Creates the data dir (mode [`data_dir_mode`]) and its `tasks/`, and takes away whatever
/// access beyond those modes is found on them and on the files the daemon keeps there. `db` is
/// the SQLite file when the store is one (it may live outside the data dir). Returns one line
/// per change, for the operator.
pub fn prepare(
    data_dir: &Path,
    socket: &Path,
    db: Option<&Path>,
) -> Result<Vec<String>, (PathBuf, std::io::Error)> {
    let dir_mode = data_dir_mode(data_dir, socket);
    let mut fixed = Vec::new();
    create_dir(data_dir, dir_mode)?;
    restrict(data_dir, dir_mode, &mut fixed)?;
    create_dir(&data_dir.join("tasks"), DIR_MODE)?;
    for d in DIRS {
        restrict(&data_dir.join(d), DIR_MODE, &mut fixed)?;
    }
    let mut files: Vec<PathBuf> = FILES.iter().map(|f| data_dir.join(f)).collect();
    if let Some(db) = db {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut p = db.as_os_str().to_owned();
            p.push(suffix);
            files.push(PathBuf::from(p));
        }
    }
    files.sort();
    files.dedup();
    for f in files {
        restrict(&f, FILE_MODE, &mut fixed)?;
    }
    Ok(fixed)
}

/// `create_dir_all` with `mode` for every directory it creates.
pub fn create_dir(path: &Path, mode: u32) -> Result<(), (PathBuf, std::io::Error)> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|e| (path.to_owned(), e))
}

/// Takes the bits outside `allowed` away from `path` (when it exists), noting the change.
fn restrict(
    path: &Path,
    allowed: u32,
    fixed: &mut Vec<String>,
) -> Result<(), (PathBuf, std::io::Error)> {
    // Not followed: a symlink's own mode means nothing, and the daemon makes none here.
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_symlink() => m,
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err((path.to_owned(), e)),
    };
    let mode = meta.permissions().mode() & 0o7777;
    if mode & !allowed == 0 {
        return Ok(());
    }
    let want = mode & allowed;
    std::fs::set_permissions(path, Permissions::from_mode(want))
        .map_err(|e| (path.to_owned(), e))?;
    fixed.push(format!(
        "{} was mode {mode:04o}, open to {}; changed to {want:04o}",
        path.display(),
        if mode & 0o007 != 0 { "every local user" } else { "the daemon's group" }
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn creates_private_and_takes_away_what_is_open() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let socket = data.join("xpu.sock");
        assert!(prepare(&data, &socket, Some(&data.join("xpu.db"))).unwrap().is_empty());
        assert_eq!(mode(&data), 0o750);
        assert_eq!(mode(&data.join("tasks")), 0o700);
        // What an earlier version left: world-readable store and logs.
        std::fs::set_permissions(&data, Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(data.join("tasks"), Permissions::from_mode(0o755)).unwrap();
        for f in ["xpu.db", "xpu.db-wal", "token"] {
            std::fs::write(data.join(f), "x").unwrap();
            std::fs::set_permissions(data.join(f), Permissions::from_mode(0o644)).unwrap();
        }
        std::fs::write(data.join("other"), "x").unwrap();
        std::fs::set_permissions(data.join("other"), Permissions::from_mode(0o644)).unwrap();
        let fixed = prepare(&data, &socket, Some(&data.join("xpu.db"))).unwrap();
        assert_eq!(fixed.len(), 5, "{fixed:?}");
        assert!(fixed[0].ends_with("was mode 0755, open to every local user; changed to 0750"));
        assert_eq!(mode(&data), 0o750);
        assert_eq!(mode(&data.join("tasks")), 0o700);
        for f in ["xpu.db", "xpu.db-wal", "token"] {
            assert_eq!(mode(&data.join(f)), 0o600, "{f}");
        }
        assert_eq!(mode(&data.join("other")), 0o644, "not the daemon's: left alone");
        // A tighter mode chosen by the operator stays.
        std::fs::set_permissions(&data, Permissions::from_mode(0o700)).unwrap();
        assert!(prepare(&data, &socket, None).unwrap().is_empty());
        assert_eq!(mode(&data), 0o700);
        // With the socket elsewhere the group needs nothing.
        let fixed = prepare(&data, Path::new("/run/xpu.sock"), None).unwrap();
        assert!(fixed.is_empty(), "{fixed:?}");
        std::fs::set_permissions(&data, Permissions::from_mode(0o750)).unwrap();
        assert_eq!(prepare(&data, Path::new("/run/xpu.sock"), None).unwrap().len(), 1);
        assert_eq!(mode(&data), 0o700);
    }
}
