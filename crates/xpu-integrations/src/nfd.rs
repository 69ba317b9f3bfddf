//! Node Feature Discovery local feature files: NFD's `local` source reads every file in
//! `/etc/kubernetes/node-feature-discovery/features.d/` and publishes each `name=value` line as a
//! node label (lines starting with `#` are comments). A file over 64 KiB is ignored by NFD
//! (`MaxFeatureFileSize = 65536` in `source/local/local.go`), so xpu refuses to write one.
//!
//! Writes are atomic: the content goes to a dot-file in the same directory, is synced, and is
//! renamed over the target, so NFD never reads half a file (it skips dot-files).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Where NFD looks for feature files.
pub const FEATURES_DIR: &str = "/etc/kubernetes/node-feature-discovery/features.d";
/// The file xpu owns there.
pub const FILE_NAME: &str = "xpu";
/// NFD ignores larger files.
pub const MAX_FEATURE_FILE_SIZE: usize = 65536;

#[derive(Debug, thiserror::Error)]
pub enum NfdError {
    #[error(
        "feature file for {} would be {size} bytes, over NFD's {MAX_FEATURE_FILE_SIZE}-byte limit (NFD would ignore it); select fewer labels",
        path.display()
    )]
    TooLarge { path: PathBuf, size: usize },
    #[error("directory {} does not exist; create it or pass --output", path.display())]
    NoDir { path: PathBuf },
    #[error("cannot write feature file {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The feature file content: a header comment and one `name=value` line per label.
pub fn render(labels: &BTreeMap<String, String>) -> String {
    let mut out = String::from("# Node Feature Discovery features from `xpu k8s nfd-features`.\n");
    for (k, v) in labels {
        out.push_str(k);
        out.push('=');
        out.push_str(v);
        out.push('\n');
    }
    out
}

/// Checks NFD's size limit.
pub fn check_size(path: &Path, content: &str) -> Result<(), NfdError> {
    if content.len() > MAX_FEATURE_FILE_SIZE {
        return Err(NfdError::TooLarge { path: path.to_owned(), size: content.len() });
    }
    Ok(())
}

/// Writes `content` to `path` atomically (dot-file in the same directory, fsync, rename).
pub fn write_atomic(path: &Path, content: &str) -> Result<(), NfdError> {
    check_size(path, content)?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(NfdError::NoDir { path: dir.to_owned() });
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write_err = |source| NfdError::Write { path: path.to_owned(), source };
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(write_err(e));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_writes_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xpu");
        let mut labels = BTreeMap::new();
        labels.insert("xpu.dev/gpu.count".to_owned(), "8".to_owned());
        let content = render(&labels);
        assert!(content.ends_with("\nxpu.dev/gpu.count=8\n"));
        std::fs::write(&path, "old").unwrap();
        write_atomic(&path, &content).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), content);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "no dot-file left behind");
    }

    #[test]
    fn refuses_over_the_limit_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xpu");
        std::fs::write(&path, "old").unwrap();
        let big = "x".repeat(MAX_FEATURE_FILE_SIZE + 1);
        let e = write_atomic(&path, &big).unwrap_err().to_string();
        assert!(e.contains("over NFD's 65536-byte limit"), "{e}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        assert!(write_atomic(&path, &"x".repeat(MAX_FEATURE_FILE_SIZE)).is_ok());
        let e = write_atomic(&dir.path().join("nope/xpu"), "a=b\n").unwrap_err().to_string();
        assert!(e.contains("does not exist"), "{e}");
    }
}
