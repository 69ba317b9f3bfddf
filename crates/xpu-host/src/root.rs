//! [`Root`]: the prefix under which host paths are read. `Root::host()` is `/`; tests and
//! `--root DIR` point it at a fixture tree laid out like a real host (`DIR/sys`, `DIR/proc`,
//! `DIR/dev`, `DIR/etc`).

use std::path::{Path, PathBuf};

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

    /// The real path of host path `p` (`/sys/bus/pci` or `sys/bus/pci`) under this root.
    pub fn path(&self, p: impl AsRef<Path>) -> PathBuf {
        let p = p.as_ref();
        let rel = p.strip_prefix("/").unwrap_or(p);
        self.base.join(rel)
    }

    /// The host path of a real path under this root, for messages (`/sys/...`).
    pub fn display(&self, real: &Path) -> String {
        match real.strip_prefix(&self.base) {
            Ok(rel) => format!("/{}", rel.display()),
            Err(_) => real.display().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_absolute_paths_under_base() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::new(dir.path()).unwrap();
        assert_eq!(root.path("/sys/bus"), dir.path().join("sys/bus"));
        assert_eq!(root.display(&dir.path().join("sys/bus")), "/sys/bus");
        assert!(Root::host().is_host());
        assert_eq!(Root::host().path("/sys"), PathBuf::from("/sys"));
    }

    #[test]
    fn missing_root_is_a_clear_error() {
        let e = Root::new("/definitely/not/here").unwrap_err();
        assert!(e.to_string().contains("does not exist; pass an existing directory to --root"));
    }
}
