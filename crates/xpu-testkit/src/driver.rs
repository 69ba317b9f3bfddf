//! Fake NVIDIA user-space driver files under a fixture root: versioned libraries with their
//! soname links, a stale build from an older driver, a library only the linker cache knows
//! about, 32-bit builds, `nvidia-smi` (a shell script a busybox container can run), an OpenCL
//! ICD file, and `/etc/ld.so.cache` in glibc's binary format.

use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;

/// The multiarch library directory the fixture uses.
pub const LIB64: &str = "/usr/lib/x86_64-linux-gnu";
pub const LIB32: &str = "/usr/lib/i386-linux-gnu";

/// What [`install_nvidia`] laid out, as host paths (without the fixture prefix).
#[derive(Debug, Clone)]
pub struct NvidiaDriver {
    pub version: String,
    /// The directory only `/etc/ld.so.cache` points at (`/usr/lib/nvidia-535`).
    pub cache_only_dir: String,
}

impl NvidiaDriver {
    /// `LIB64/<stem>.<version>`
    pub fn lib(&self, stem: &str) -> String {
        format!("{LIB64}/{stem}.{}", self.version)
    }
}

fn write(path: &Path, content: impl AsRef<[u8]>, mode: u32) {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).unwrap();
    }
    fs::write(path, content).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

fn link(target: &str, at: &Path) {
    let _ = fs::remove_file(at);
    symlink(target, at).unwrap();
}

fn p(root: &Path, host: &str) -> std::path::PathBuf {
    root.join(host.trim_start_matches('/'))
}

/// Installs driver `version`'s files under `root`.
pub fn install_nvidia(root: &Path, version: &str) -> NvidiaDriver {
    let major = version.split('.').next().unwrap_or(version);
    // (stem, soname suffix) in the multiarch directory.
    let libs: [(&str, &str); 8] = [
        ("libnvidia-ml.so", "1"),
        ("libnvidia-cfg.so", "1"),
        ("libcuda.so", "1"),
        ("libnvidia-ptxjitcompiler.so", "1"),
        ("libnvidia-nvvm.so", "4"),
        ("libnvidia-encode.so", "1"),
        ("libGLX_nvidia.so", "0"),
        ("libnvidia-ngx.so", "1"),
    ];
    let mut cache: Vec<(String, String, bool)> = Vec::new();
    for (stem, soname) in libs {
        let file = format!("{stem}.{version}");
        write(&p(root, &format!("{LIB64}/{file}")), format!("fake {file}\n"), 0o644);
        link(&file, &p(root, &format!("{LIB64}/{stem}.{soname}")));
        cache.push((format!("{stem}.{soname}"), format!("{LIB64}/{stem}.{soname}"), true));
    }
    // The development link points at the soname link, as the driver installer makes it.
    link("libcuda.so.1", &p(root, &format!("{LIB64}/libcuda.so")));
    // A stale build from the driver before: never mounted, the version picks the right one.
    write(&p(root, &format!("{LIB64}/libcuda.so.470.57.02")), "stale\n", 0o644);

    // A library in a directory only the linker cache names.
    let cache_only_dir = format!("/usr/lib/nvidia-{major}");
    let file = format!("libnvidia-opencl.so.{version}");
    write(&p(root, &format!("{cache_only_dir}/{file}")), format!("fake {file}\n"), 0o644);
    link(&file, &p(root, &format!("{cache_only_dir}/libnvidia-opencl.so.1")));
    cache.push((
        "libnvidia-opencl.so.1".to_owned(),
        format!("{cache_only_dir}/libnvidia-opencl.so.1"),
        true,
    ));

    // 32-bit builds for compat32.
    let file32 = format!("libcuda.so.{version}");
    write(&p(root, &format!("{LIB32}/{file32}")), format!("fake 32-bit {file32}\n"), 0o644);
    link(&file32, &p(root, &format!("{LIB32}/libcuda.so.1")));
    cache.push(("libcuda.so.1".to_owned(), format!("{LIB32}/libcuda.so.1"), false));

    write(
        &p(root, "/usr/bin/nvidia-smi"),
        format!("#!/bin/sh\necho \"NVIDIA-SMI {version} (xpu fixture)\"\n"),
        0o755,
    );
    write(&p(root, "/etc/OpenCL/vendors/nvidia.icd"), "libnvidia-opencl.so.1\n", 0o644);

    let entries: Vec<(&str, &str, bool)> =
        cache.iter().map(|(n, p, b)| (n.as_str(), p.as_str(), *b)).collect();
    write(&p(root, "/etc/ld.so.cache"), ld_cache(&entries), 0o644);
    NvidiaDriver { version: version.to_owned(), cache_only_dir }
}

/// A linker cache in glibc's `glibc-ld.so.cache1.1` format (`struct cache_file_new` followed
/// by 24-byte `struct file_entry_new`s and the string table; string offsets count from the
/// header), with entries `(soname, path, 64-bit)`.
pub fn ld_cache(entries: &[(&str, &str, bool)]) -> Vec<u8> {
    const HEADER: usize = 48;
    const ENTRY: usize = 24;
    let strings_at = HEADER + entries.len() * ENTRY;
    let mut strings: Vec<u8> = Vec::new();
    let mut table = Vec::new();
    for (name, path, b64) in entries {
        let key = (strings_at + strings.len()) as u32;
        strings.extend_from_slice(name.as_bytes());
        strings.push(0);
        let value = (strings_at + strings.len()) as u32;
        strings.extend_from_slice(path.as_bytes());
        strings.push(0);
        // FLAG_ELF_LIBC6, plus FLAG_X8664_LIB64 for 64-bit builds.
        let flags: i32 = 0x0003 | if *b64 { 0x0300 } else { 0 };
        table.extend_from_slice(&flags.to_le_bytes());
        table.extend_from_slice(&key.to_le_bytes());
        table.extend_from_slice(&value.to_le_bytes());
        table.extend_from_slice(&0u32.to_le_bytes());
        table.extend_from_slice(&0u64.to_le_bytes());
    }
    let mut out = Vec::new();
    out.extend_from_slice(b"glibc-ld.so.cache1.1");
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&[0u8; 16]);
    out.extend_from_slice(&table);
    out.extend_from_slice(&strings);
    out
}
