//! Finds the user-space driver files a container needs (libraries, tools, ICD files, sockets)
//! under a [`Root`], for `xpu cdi generate` and the OCI shim.
//!
//! NVIDIA: one table of files per driver capability, modelled on the sets the NVIDIA container
//! toolkit mounts (`utility`: NVML and `nvidia-smi`; `compute`: `libcuda`, the PTX JIT, NVVM,
//! OpenCL; `video`, `graphics`, `display`, `ngx`; `compat32`: the 32-bit builds). A library is
//! looked up in the directories the dynamic linker's cache (`/etc/ld.so.cache`) names for it,
//! then in the usual library directories; the file matching the running driver version
//! (`libcuda.so.535.104.05`) wins, and every symlink next to it that resolves to it
//! (`libcuda.so.1`) becomes a second container path for the same file, so no symlink has to be
//! created inside the container.
//!
//! AMD and Google: ROCm and libtpu are shipped in the container image, so the host has no files
//! to contribute; containers get their device nodes only.
//!
//! Missing files are normal (a compute-only host has no graphics libraries) and are skipped
//! silently; unreadable directories and a garbled linker cache are warnings.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use xpu_core::driver::{Capability, DriverFile, DriverFiles, DriverVendor, FileKind};

use crate::Root;

/// NVIDIA's libraries by capability (the stem before the version: `libcuda.so`).
const NVIDIA_LIBRARIES: &[(Capability, &[&str])] = &[
    (Capability::Utility, &["libnvidia-ml.so", "libnvidia-cfg.so"]),
    (
        Capability::Compute,
        &[
            "libcuda.so",
            "libcudadebugger.so",
            "libnvidia-opencl.so",
            "libnvidia-ptxjitcompiler.so",
            "libnvidia-nvvm.so",
            "libnvidia-allocator.so",
            "libnvidia-pkcs11.so",
            "libnvidia-pkcs11-openssl3.so",
        ],
    ),
    (
        Capability::Video,
        &["libvdpau_nvidia.so", "libnvidia-encode.so", "libnvidia-opticalflow.so", "libnvcuvid.so"],
    ),
    (
        Capability::Graphics,
        &[
            "libnvidia-eglcore.so",
            "libnvidia-glcore.so",
            "libnvidia-tls.so",
            "libnvidia-glsi.so",
            "libnvidia-fbc.so",
            "libnvidia-rtcore.so",
            "libnvoptix.so",
            "libGLX_nvidia.so",
            "libEGL_nvidia.so",
            "libGLESv2_nvidia.so",
            "libGLESv1_CM_nvidia.so",
            "libnvidia-glvkspirv.so",
            "libnvidia-gpucomp.so",
            "libnvidia-egl-gbm.so",
            "libnvidia-egl-wayland.so",
        ],
    ),
    (Capability::Ngx, &["libnvidia-ngx.so"]),
];

/// Capabilities whose libraries also come in 32-bit builds (`compat32`).
const COMPAT32_OF: [Capability; 4] =
    [Capability::Utility, Capability::Compute, Capability::Video, Capability::Graphics];

/// NVIDIA's tools by capability; mounted at `/usr/bin/<name>`.
const NVIDIA_BINARIES: &[(Capability, &[&str])] = &[
    (Capability::Utility, &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced"]),
    (Capability::Compute, &["nvidia-cuda-mps-control", "nvidia-cuda-mps-server"]),
];

/// Loader configuration files, mounted where they are.
const NVIDIA_CONFIGS: &[(Capability, &str)] = &[
    (Capability::Compute, "/etc/OpenCL/vendors/nvidia.icd"),
    (Capability::Graphics, "/etc/vulkan/icd.d/nvidia_icd.json"),
    (Capability::Graphics, "/usr/share/vulkan/icd.d/nvidia_icd.json"),
    (Capability::Graphics, "/etc/vulkan/implicit_layer.d/nvidia_layers.json"),
    (Capability::Graphics, "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json"),
    (Capability::Graphics, "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
    (Capability::Display, "/usr/lib/xorg/modules/drivers/nvidia_drv.so"),
    (Capability::Display, "/usr/lib64/xorg/modules/drivers/nvidia_drv.so"),
];

/// `nvidia-persistenced`'s socket: NVML talks to it when persistence mode is on.
const PERSISTENCED_SOCKET: &str = "/run/nvidia-persistenced/socket";

/// Where 64-bit libraries live when the linker cache does not say (Debian/Ubuntu multiarch,
/// Red Hat, Debian's own NVIDIA packages, GKE's driver installer).
const LIB_DIRS_64: [&str; 7] = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
];

const LIB_DIRS_32: [&str; 4] = ["/usr/lib/i386-linux-gnu", "/usr/lib32", "/lib32", "/usr/lib"];

const BIN_DIRS: [&str; 6] =
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/nvidia/bin"];

/// The dynamic linker's cache.
pub const LD_SO_CACHE: &str = "/etc/ld.so.cache";

/// Finds the NVIDIA driver files under `root`. `driver_version` (from
/// `/proc/driver/nvidia/version`, see [`xpu_core::HostInfo::nvidia_driver_version`]) picks the
/// matching library builds; without it the highest-versioned build of each library is taken.
pub fn find(root: &Root, driver_version: Option<&str>) -> DriverFiles {
    let mut s = Search::new(root);
    let mut files = Vec::new();
    let cache = s.load_cache();

    for &(cap, stems) in NVIDIA_LIBRARIES {
        for stem in stems {
            if let Some(f) = s.library(stem, cap, driver_version, cache.as_ref(), false) {
                files.push(f);
            }
        }
    }
    for &(_, stems) in NVIDIA_LIBRARIES.iter().filter(|(c, _)| COMPAT32_OF.contains(c)) {
        for stem in stems {
            if let Some(f) =
                s.library(stem, Capability::Compat32, driver_version, cache.as_ref(), true)
            {
                files.push(f);
            }
        }
    }
    for &(cap, names) in NVIDIA_BINARIES {
        for name in names {
            if let Some(path) =
                BIN_DIRS.iter().map(|d| format!("{d}/{name}")).find(|p| s.root.path(p).is_file())
            {
                files.push(DriverFile {
                    vendor: DriverVendor::Nvidia,
                    capability: cap,
                    kind: FileKind::Binary,
                    path: s.resolve(&path),
                    container_paths: vec![format!("/usr/bin/{name}")],
                });
            }
        }
    }
    for &(cap, path) in NVIDIA_CONFIGS {
        if s.root.path(path).is_file() {
            files.push(DriverFile {
                vendor: DriverVendor::Nvidia,
                capability: cap,
                kind: FileKind::Config,
                path: s.resolve(path),
                container_paths: vec![path.to_owned()],
            });
        }
    }
    if std::fs::symlink_metadata(s.root.path(PERSISTENCED_SOCKET))
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        files.push(DriverFile {
            vendor: DriverVendor::Nvidia,
            capability: Capability::Utility,
            kind: FileKind::Socket,
            path: PERSISTENCED_SOCKET.to_owned(),
            container_paths: vec![PERSISTENCED_SOCKET.to_owned()],
        });
    }

    DriverFiles {
        nvidia_driver_version: driver_version.map(str::to_owned),
        files,
        warnings: s.warnings,
    }
}

/// One directory's entries: name → (is a regular file, symlink target).
type Listing = HashMap<String, Entry>;

#[derive(Debug, Clone)]
struct Entry {
    is_file: bool,
    link: Option<PathBuf>,
}

struct Search<'a> {
    root: &'a Root,
    /// Directory listings, read once each.
    dirs: HashMap<String, Option<Listing>>,
    warnings: Vec<String>,
}

impl<'a> Search<'a> {
    fn new(root: &'a Root) -> Self {
        Self { root, dirs: HashMap::new(), warnings: Vec::new() }
    }

    fn load_cache(&mut self) -> Option<LdCache> {
        let path = self.root.path(LD_SO_CACHE);
        let bytes = std::fs::read(&path).ok()?;
        match LdCache::parse(&bytes) {
            Ok(c) => Some(c),
            Err(e) => {
                self.warnings.push(format!(
                    "{LD_SO_CACHE}: {e}; searching the usual library directories only"
                ));
                None
            }
        }
    }

    fn listing(&mut self, dir: &str) -> Option<&Listing> {
        if !self.dirs.contains_key(dir) {
            let listing = match std::fs::read_dir(self.root.path(dir)) {
                Ok(entries) => Some(
                    entries
                        .flatten()
                        .map(|e| {
                            let name = e.file_name().to_string_lossy().into_owned();
                            let ft = e.file_type().ok();
                            let link = ft
                                .filter(|t| t.is_symlink())
                                .and_then(|_| std::fs::read_link(e.path()).ok());
                            (name, Entry { is_file: ft.is_some_and(|t| t.is_file()), link })
                        })
                        .collect(),
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => None,
                Err(e) => {
                    self.warnings.push(format!("{dir}: {e}; not searched for driver libraries"));
                    None
                }
            };
            self.dirs.insert(dir.to_owned(), listing);
        }
        self.dirs.get(dir).and_then(Option::as_ref)
    }

    /// Host path of `path` with symlinks resolved inside the root.
    fn resolve(&self, path: &str) -> String {
        match std::fs::canonicalize(self.root.path(path)) {
            Ok(real) => self.root.display(&real),
            Err(_) => path.to_owned(),
        }
    }

    fn library(
        &mut self,
        stem: &str,
        cap: Capability,
        version: Option<&str>,
        cache: Option<&LdCache>,
        bits32: bool,
    ) -> Option<DriverFile> {
        // Directories the linker cache names for this library first, then the usual ones.
        let mut dirs: Vec<String> =
            cache.map(|c| c.dirs_of(stem, bits32).map(str::to_owned).collect()).unwrap_or_default();
        let usual: &[&str] = if bits32 { &LIB_DIRS_32 } else { &LIB_DIRS_64 };
        for d in usual {
            if !dirs.iter().any(|x| x == d) {
                dirs.push((*d).to_owned());
            }
        }
        for dir in dirs {
            let Some(listing) = self.listing(&dir) else { continue };
            let Some(file) = pick_build(listing, stem, version) else { continue };
            let mut links: Vec<String> = listing
                .iter()
                .filter(|(name, e)| {
                    name.starts_with(stem)
                        && e.link.is_some()
                        && resolves_to(listing, name, &file, 0)
                })
                .map(|(name, _)| format!("{dir}/{name}"))
                .collect();
            links.sort();
            let path = format!("{dir}/{file}");
            // A 64-bit search must not pick up a 32-bit build from /usr/lib and the reverse.
            if !elf_class_matches(&self.root.path(&path), bits32) {
                continue;
            }
            let mut container_paths = vec![path.clone()];
            container_paths.extend(links);
            return Some(DriverFile {
                vendor: DriverVendor::Nvidia,
                capability: cap,
                kind: FileKind::Library,
                path,
                container_paths,
            });
        }
        None
    }
}

/// The regular file in `listing` that is the build of `stem`: `stem.<version>` when the driver
/// version is known, else the highest-versioned `stem.<x>` regular file.
fn pick_build(listing: &Listing, stem: &str, version: Option<&str>) -> Option<String> {
    if let Some(v) = version {
        let name = format!("{stem}.{v}");
        return listing.get(&name).filter(|e| e.is_file).map(|_| name);
    }
    listing
        .iter()
        .filter(|(name, e)| {
            e.is_file && name.strip_prefix(stem).is_some_and(|r| r.starts_with('.'))
        })
        .map(|(name, _)| name.clone())
        .max_by(|a, b| version_key(a).cmp(&version_key(b)))
}

fn version_key(name: &str) -> Vec<u64> {
    name.split('.').filter_map(|p| p.parse().ok()).collect()
}

/// Whether symlink `name` (in the same directory) leads to `file` through same-directory links.
fn resolves_to(listing: &Listing, name: &str, file: &str, depth: u8) -> bool {
    if depth > 8 {
        return false;
    }
    match listing.get(name).and_then(|e| e.link.as_ref()) {
        Some(target) => {
            // Only links within the directory (`libcuda.so.1 -> libcuda.so.535.104.05`).
            let Some(t) = target.to_str().filter(|t| !t.contains('/')) else { return false };
            t == file || resolves_to(listing, t, file, depth + 1)
        }
        None => name == file,
    }
}

/// ELF class check (byte 4: 1 = 32-bit, 2 = 64-bit). Files that are not ELF (fixtures, scripts)
/// are accepted: only a real mismatch is skipped.
fn elf_class_matches(path: &Path, bits32: bool) -> bool {
    use std::io::Read;
    let mut head = [0u8; 5];
    let read = std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head));
    if read.is_err() || &head[..4] != b"\x7fELF" {
        return true;
    }
    head[4] == if bits32 { 1 } else { 2 }
}

/// The dynamic linker's cache (`/etc/ld.so.cache`, glibc's `glibc-ld.so.cache1.1` format):
/// library names (sonames) and the paths they resolve to.
#[derive(Debug, Clone, Default)]
pub struct LdCache {
    /// (soname, path, 64-bit)
    entries: Vec<(String, String, bool)>,
}

/// Why a linker cache could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LdCacheError {
    #[error("not a glibc linker cache (no glibc-ld.so.cache1.1 header)")]
    NoHeader,
    #[error("truncated linker cache: {0}")]
    Truncated(&'static str),
}

const CACHE_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
/// `struct cache_file_new` is 48 bytes; each `struct file_entry_new` 24.
const HEADER_LEN: usize = 48;
const ENTRY_LEN: usize = 24;
/// `FLAG_ELF_LIBC6` with `FLAG_X8664_LIB64` (glibc `ldconfig.h`).
const FLAG_TYPE_MASK: i32 = 0x00ff;
const FLAG_ARCH_MASK: i32 = 0xff00;
const FLAG_X8664_LIB64: i32 = 0x0300;
const FLAG_ELF_LIBC6: i32 = 0x0003;

impl LdCache {
    /// Parses the new (glibc 2.32+ default) format, alone or after the old-format block.
    pub fn parse(bytes: &[u8]) -> Result<Self, LdCacheError> {
        let start = memchr::memmem::find(bytes, CACHE_MAGIC).ok_or(LdCacheError::NoHeader)?;
        let new = &bytes[start..];
        if new.len() < HEADER_LEN {
            return Err(LdCacheError::Truncated("header"));
        }
        let u32_at = |b: &[u8], off: usize| -> Option<u32> {
            b.get(off..off + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        };
        let nlibs = u32_at(new, 20).ok_or(LdCacheError::Truncated("header"))? as usize;
        let table_end = nlibs
            .checked_mul(ENTRY_LEN)
            .and_then(|n| n.checked_add(HEADER_LEN))
            .filter(|&end| end <= new.len())
            .ok_or(LdCacheError::Truncated("entry table"))?;
        // String offsets are relative to the start of the new-format header.
        let string_at = |off: u32| -> Option<String> {
            let s = new.get(off as usize..)?;
            let end = memchr::memchr(0, s)?;
            std::str::from_utf8(&s[..end]).ok().map(str::to_owned)
        };
        let mut entries = Vec::with_capacity(nlibs);
        for e in new[HEADER_LEN..table_end].chunks_exact(ENTRY_LEN) {
            let flags = i32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            let (Some(key), Some(value)) = (u32_at(e, 4), u32_at(e, 8)) else { continue };
            if flags & FLAG_TYPE_MASK != FLAG_ELF_LIBC6 {
                continue;
            }
            let (Some(name), Some(path)) = (string_at(key), string_at(value)) else {
                return Err(LdCacheError::Truncated("string table"));
            };
            entries.push((name, path, flags & FLAG_ARCH_MASK == FLAG_X8664_LIB64));
        }
        Ok(Self { entries })
    }

    /// The path the cache gives for `soname` (`libc.so.6`), 64-bit builds.
    pub fn lookup(&self, soname: &str) -> Option<&str> {
        self.entries.iter().find(|(n, _, b64)| n == soname && *b64).map(|(_, p, _)| p.as_str())
    }

    /// Directories holding a build of `stem` (`libcuda.so` matches `libcuda.so.1`).
    fn dirs_of<'s>(&'s self, stem: &'s str, bits32: bool) -> impl Iterator<Item = &'s str> {
        self.entries
            .iter()
            .filter(move |(n, _, b64)| {
                *b64 != bits32
                    && n.strip_prefix(stem).is_some_and(|r| r.is_empty() || r.starts_with('.'))
            })
            .filter_map(|(_, p, _)| p.rsplit_once('/').map(|(d, _)| d))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_machines_linker_cache() {
        // The real cache, written by the real ldconfig: libc is always in it.
        let Ok(bytes) = std::fs::read(LD_SO_CACHE) else {
            eprintln!("skipping: no {LD_SO_CACHE} on this machine");
            return;
        };
        let cache = LdCache::parse(&bytes).unwrap();
        assert!(!cache.is_empty());
        let libc = cache.lookup("libc.so.6").unwrap();
        assert!(libc.ends_with("/libc.so.6"), "{libc}");
        assert!(Path::new(libc).exists());
    }

    #[test]
    fn built_cache_round_trips_and_garbage_is_an_error() {
        let bytes = xpu_testkit::driver::ld_cache(&[
            ("libcuda.so.1", "/usr/lib/nvidia-535/libcuda.so.1", true),
            ("libcuda.so.1", "/usr/lib32/libcuda.so.1", false),
        ]);
        let c = LdCache::parse(&bytes).unwrap();
        assert_eq!(c.lookup("libcuda.so.1"), Some("/usr/lib/nvidia-535/libcuda.so.1"));
        assert_eq!(c.dirs_of("libcuda.so", false).collect::<Vec<_>>(), ["/usr/lib/nvidia-535"]);
        assert_eq!(c.dirs_of("libcuda.so", true).collect::<Vec<_>>(), ["/usr/lib32"]);
        assert_eq!(LdCache::parse(b"nonsense").unwrap_err(), LdCacheError::NoHeader);
        assert!(matches!(
            LdCache::parse(&bytes[..bytes.len() - 20]),
            Err(LdCacheError::Truncated(_))
        ));
    }

    #[test]
    fn picks_the_driver_versions_build() {
        let mut l = Listing::new();
        let f = |is_file, link: Option<&str>| Entry { is_file, link: link.map(PathBuf::from) };
        l.insert("libcuda.so.535.104.05".into(), f(true, None));
        l.insert("libcuda.so.470.1".into(), f(true, None));
        l.insert("libcuda.so.1".into(), f(false, Some("libcuda.so.535.104.05")));
        l.insert("libcuda.so".into(), f(false, Some("libcuda.so.1")));
        assert_eq!(
            pick_build(&l, "libcuda.so", Some("535.104.05")).as_deref(),
            Some("libcuda.so.535.104.05")
        );
        assert_eq!(pick_build(&l, "libcuda.so", Some("550.1")), None);
        assert_eq!(pick_build(&l, "libcuda.so", None).as_deref(), Some("libcuda.so.535.104.05"));
        assert!(resolves_to(&l, "libcuda.so", "libcuda.so.535.104.05", 0));
        assert!(!resolves_to(&l, "libcuda.so", "libcuda.so.470.1", 0));
    }

    #[test]
    fn finds_the_fixture_drivers_files_by_capability() {
        use xpu_testkit::driver::{LIB32, LIB64};
        let fx = xpu_testkit::hosts::a100_8x().build();
        let drv = xpu_testkit::driver::install_nvidia(fx.root(), "535.104.05");
        let root = Root::new(fx.root()).unwrap();
        let files = find(&root, Some("535.104.05"));
        assert!(files.warnings.is_empty(), "{:?}", files.warnings);
        let by = |p: &str| files.files.iter().find(|f| f.path == p).unwrap();

        let cuda = by(&drv.lib("libcuda.so"));
        assert_eq!((cuda.capability, cuda.kind), (Capability::Compute, FileKind::Library));
        assert_eq!(
            cuda.container_paths,
            [drv.lib("libcuda.so"), format!("{LIB64}/libcuda.so"), format!("{LIB64}/libcuda.so.1")]
        );
        assert!(!files.files.iter().any(|f| f.path.contains("470.57.02")), "stale build ignored");
        assert_eq!(by(&drv.lib("libnvidia-ml.so")).capability, Capability::Utility);
        assert_eq!(by(&drv.lib("libnvidia-encode.so")).capability, Capability::Video);
        assert_eq!(by(&drv.lib("libGLX_nvidia.so")).capability, Capability::Graphics);
        assert_eq!(by(&drv.lib("libnvidia-ngx.so")).capability, Capability::Ngx);
        // Found only through /etc/ld.so.cache.
        let opencl = by(&format!("{}/libnvidia-opencl.so.535.104.05", drv.cache_only_dir));
        assert_eq!(opencl.capability, Capability::Compute);
        let c32 = by(&format!("{LIB32}/libcuda.so.535.104.05"));
        assert_eq!(c32.capability, Capability::Compat32);
        let smi = by("/usr/bin/nvidia-smi");
        assert_eq!(smi.kind, FileKind::Binary);
        assert_eq!(smi.container_paths, ["/usr/bin/nvidia-smi"]);
        assert_eq!(by("/etc/OpenCL/vendors/nvidia.icd").kind, FileKind::Config);

        // Without a version the newest build wins; another driver version finds no libraries.
        let any = find(&root, None);
        assert!(any.files.iter().any(|f| f.path == drv.lib("libcuda.so")));
        let other = find(&root, Some("550.54.14"));
        assert!(other.files.iter().all(|f| f.kind != FileKind::Library));
    }
}
