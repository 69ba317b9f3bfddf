//! Helpers shared by the shim's tests and its `hot-functions` example.

#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use xpu_testkit::bundle::TestHost;
use xpu_testkit::hosts;

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Runs `scripts/build-shim` and returns the binary it built:
/// `<target>/shim/xpu-container-runtime`.
pub fn build_shim() -> PathBuf {
    let repo = repo();
    let out = Command::new(repo.join("scripts/build-shim")).output().unwrap();
    assert!(out.status.success(), "scripts/build-shim: {}", String::from_utf8_lossy(&out.stderr));
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo.join("target"), PathBuf::from);
    target.join("shim/xpu-container-runtime")
}

/// Each function symbol of `binary` with its name as `hot-functions.txt` writes it (without the
/// hash in the symbol), from `scripts/build-shim --symbols`, which the build matches by.
pub fn symbol_names(binary: &Path) -> Vec<(String, String)> {
    let out = Command::new(repo().join("scripts/build-shim"))
        .arg("--symbols")
        .arg(binary)
        .output()
        .unwrap();
    assert!(out.status.success(), "build-shim --symbols: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('\t').map(|(s, n)| (s.to_owned(), n.to_owned())))
        .collect()
}

/// The function symbols of `binary` with their addresses, in `nm`'s order for `order` (`-p`:
/// the symbol table's, `-n`: by address).
pub fn functions(binary: &Path, order: &str) -> Vec<(u64, String)> {
    let nm = Command::new("nm").args([order, "--defined-only"]).arg(binary).output().unwrap();
    assert!(nm.status.success(), "nm: {}", String::from_utf8_lossy(&nm.stderr));
    String::from_utf8(nm.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            match (f.next(), f.next(), f.next()) {
                (Some(addr), Some("t" | "T" | "w" | "W"), Some(symbol)) => {
                    Some((u64::from_str_radix(addr, 16).ok()?, symbol.to_owned()))
                }
                _ => None,
            }
        })
        .collect()
}

/// The 8×A100 fixture host with the host snapshot in its CDI directory (`dir/cdi`, where its
/// `runtime.toml` looks), as `xpu cdi generate` leaves it.
pub fn a100_host_with_snapshot() -> TestHost {
    let host = TestHost::new(&hosts::a100_8x());
    let root = xpu_host::Root::new(host.fixture.root()).unwrap();
    let snap = xpu_shim::host_snapshot(&root, xpu_host::host_key(&root)).unwrap();
    let cdi = host.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    std::fs::write(cdi.join(xpu_container::snapshot::FILE_NAME), snap.to_json()).unwrap();
    host
}
