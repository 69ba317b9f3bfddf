//! Puts the git commit the binaries are built from into `XPU_GIT_COMMIT`, for
//! `xpu-container-runtime --version` and `xpu --version` (`VERSION_LINE`).
//!
//! `$XPU_GIT_COMMIT` wins when set (builds from a source tarball, a distribution's own commit id);
//! else `git rev-parse --short HEAD` when git and a repository are there; else `unknown`. Cargo
//! reruns this when HEAD moves: `.git/HEAD` changes on checkout, the branch's ref file (or
//! `packed-refs`) on commit. A path that does not exist is not named, since cargo would then rerun
//! the script on every build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-env-changed=XPU_GIT_COMMIT");
    println!("cargo::rerun-if-changed=build.rs");
    // `scripts/build-shim` builds the binary with `--cfg xpu_musl` when it links musl.
    println!("cargo::rustc-check-cfg=cfg(xpu_musl)");
    let commit = match std::env::var("XPU_GIT_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_owned(),
        _ => {
            watch_head();
            git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".to_owned())
        }
    };
    println!("cargo::rustc-env=XPU_GIT_COMMIT={commit}");
}

/// A git command's trimmed stdout, or `None` when git is missing or fails (no repository).
fn git(args: &[&str]) -> Option<String> {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")?;
    let out = Command::new("git").args(args).current_dir(dir).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!s.is_empty()).then_some(s)
}

fn watch_head() {
    let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]).map(PathBuf::from) else {
        return;
    };
    // Worktrees keep HEAD in their own directory and refs in the common one.
    let common = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])
        .map_or_else(|| git_dir.clone(), PathBuf::from);
    watch(&git_dir.join("HEAD"));
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(&common.join(reference));
        watch(&common.join("packed-refs"));
    }
}

fn watch(path: &Path) {
    if path.exists() {
        println!("cargo::rerun-if-changed={}", path.display());
    }
}
