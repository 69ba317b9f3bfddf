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
//! created inside the container. In a directory the cache names for the library, with the driver
//! version known, those symlinks are the names the cache lists there and the development link
//! (`libcuda.so`), probed one by one; other directories are listed.
//!
//! AMD and Google: ROCm and libtpu are shipped in the container image, so the host has no files
//! to contribute; containers get their device nodes only.
//!
//! Missing files are normal (a compute-only host has no graphics libraries) and are skipped
//! silently; unreadable directories and a garbled linker cache are warnings. Files are read
//! with [`Root::read_bounded`] (the linker cache) and [`Root::read_head`] (an ELF header): a
//! FIFO or a link to a device where a file should be is never read.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use xpu_core::driver::{Capabilities, Capability, DriverFile, DriverFiles, DriverVendor, FileKind};

use crate::Root;
use crate::root::{ReadError, TEXT_MAX};

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

/// Directories the dynamic loader searches without an ld.so.cache entry (glibc's built-in
/// system directories on Debian-family and Red Hat-family systems).
const LOADER_DIRS: [&str; 8] = [
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/usr/lib/i386-linux-gnu",
    "/lib/i386-linux-gnu",
    "/usr/lib32",
    "/usr/lib",
];
/// Where a library from elsewhere is bound as well, so a container's loader finds it.
const LOADER_HOME_64: [&str; 2] = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"];
const LOADER_HOME_32: [&str; 2] = ["/usr/lib/i386-linux-gnu", "/usr/lib32"];

const LIB_DIRS_32: [&str; 4] = ["/usr/lib/i386-linux-gnu", "/usr/lib32", "/lib32", "/usr/lib"];

const BIN_DIRS: [&str; 6] =
    ["/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/nvidia/bin"];

/// The dynamic linker's cache.
pub const LD_SO_CACHE: &str = "/etc/ld.so.cache";

/// Finds the NVIDIA driver files under `root`, for every capability. `driver_version` (from
/// `/proc/driver/nvidia/version`, see [`xpu_core::HostInfo::nvidia_driver_version`]) picks the
/// matching library builds; without it the highest-versioned build of each library is taken.
pub fn find(root: &Root, driver_version: Option<&str>) -> DriverFiles {
    find_for(root, driver_version, Capabilities::all())
}

/// [`find`] for the capabilities `caps` only (the runtime shim, which knows the container's
/// `NVIDIA_DRIVER_CAPABILITIES`): the files of other capabilities are not looked for, and
/// library directories are listed keeping only the names of the libraries looked for, so a
/// host's large `/usr/lib/x86_64-linux-gnu` costs its `getdents` and no `readlink` per entry.
/// `find_for(.., caps).select(Nvidia, caps)` is `find(..).select(Nvidia, caps)`.
pub fn find_for(root: &Root, driver_version: Option<&str>, caps: Capabilities) -> DriverFiles {
    let libraries: Vec<(Capability, &[&str])> =
        NVIDIA_LIBRARIES.iter().copied().filter(|(c, _)| caps.contains(*c)).collect();
    let compat32: Vec<&str> = if caps.contains(Capability::Compat32) {
        NVIDIA_LIBRARIES
            .iter()
            .filter(|(c, _)| COMPAT32_OF.contains(c))
            .flat_map(|(_, stems)| stems.iter().copied())
            .collect()
    } else {
        Vec::new()
    };
    let mut stems: Vec<&str> = libraries.iter().flat_map(|(_, s)| s.iter().copied()).collect();
    stems.extend(compat32.iter().copied());
    let mut s = Search::new(root, stems);
    let mut files = Vec::new();
    let cache = if s.stems.is_empty() { None } else { s.load_cache() };

    for (cap, stems) in libraries {
        for stem in stems {
            if let Some(f) = s.library(stem, cap, driver_version, cache.as_ref(), false) {
                files.push(f);
            }
        }
    }
    for stem in compat32 {
        if let Some(f) = s.library(stem, Capability::Compat32, driver_version, cache.as_ref(), true)
        {
            files.push(f);
        }
    }
    for &(cap, names) in NVIDIA_BINARIES.iter().filter(|(c, _)| caps.contains(*c)) {
        for name in names {
            let found: Vec<String> = BIN_DIRS
                .iter()
                .filter(|d| s.is_file_in(d, name, true))
                .map(|d| format!("{d}/{name}"))
                .collect();
            // The program itself, not a shell wrapper in front of it (some images put a script
            // in /usr/bin that execs /usr/local/nvidia/bin/nvidia-smi): a wrapper bound into a
            // container execs a path the container does not have.
            let elf = found.iter().find(|p| is_elf(s.root, &s.root.path(s.resolve(p))));
            if let Some(path) = elf.or(found.first()).cloned() {
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
    for &(cap, path) in NVIDIA_CONFIGS.iter().filter(|(c, _)| caps.contains(*c)) {
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
    if caps.contains(Capability::Utility)
        && std::fs::symlink_metadata(s.root.path(PERSISTENCED_SOCKET))
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
    /// The library stems looked for: listings keep only names starting with one.
    stems: Vec<&'a str>,
    /// Directory listings, read once each.
    dirs: HashMap<String, Option<Listing>>,
    /// Directories opened for probing, once each.
    fds: HashMap<String, Option<OwnedFd>>,
    /// (device, inode) of the directories opened.
    seen: HashSet<(u64, u64)>,
    warnings: Vec<String>,
}

impl<'a> Search<'a> {
    fn new(root: &'a Root, stems: Vec<&'a str>) -> Self {
        Self {
            root,
            stems,
            dirs: HashMap::new(),
            fds: HashMap::new(),
            seen: HashSet::new(),
            warnings: Vec::new(),
        }
    }

    fn load_cache(&mut self) -> Option<LdCache> {
        let path = self.root.path(LD_SO_CACHE);
        let bytes = match self.root.read_bounded(&path, TEXT_MAX) {
            Ok(b) => b,
            Err(ReadError::Missing) => return None,
            Err(e) => {
                self.warnings.push(format!(
                    "{LD_SO_CACHE}: {e}; searching the usual library directories only"
                ));
                return None;
            }
        };
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
            let stems = &self.stems;
            let listing = match std::fs::read_dir(self.root.path(dir)) {
                Ok(entries) => Some(
                    entries
                        .flatten()
                        .filter(|e| {
                            let name = e.file_name();
                            let name = name.as_encoded_bytes();
                            stems.iter().any(|s| name.starts_with(s.as_bytes()))
                        })
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
            let cached: Vec<&str> =
                cache.map(|c| c.names_in(stem, &dir, bits32).collect()).unwrap_or_default();
            // With the driver version known, only `stem.<version>` can be the build: look for it
            // before listing anything. Listing a host's library directory (thousands of
            // entries) costs a millisecond, on every container start.
            if let Some(v) = version
                && !self.is_file_in(&dir, &format!("{stem}.{v}"), false)
            {
                continue;
            }
            let (file, mut links) = match version {
                // The links the linker cache names next to the build, and the development link
                // `stem`, probed by name.
                Some(v) if !cached.is_empty() => {
                    let file = format!("{stem}.{v}");
                    let mut names = cached;
                    names.push(stem);
                    names.sort_unstable();
                    names.dedup();
                    let links: Vec<String> = names
                        .into_iter()
                        .filter(|n| *n != file && self.links_to(&dir, n, &file, 0))
                        .map(|n| format!("{dir}/{n}"))
                        .collect();
                    (file, links)
                }
                // A directory the cache does not name for it, or no driver version to match:
                // list it.
                _ => {
                    let Some(listing) = self.listing(&dir) else { continue };
                    let Some(file) = pick_build(listing, stem, version) else { continue };
                    let links: Vec<String> = listing
                        .iter()
                        .filter(|(name, e)| {
                            name.starts_with(stem)
                                && e.link.is_some()
                                && resolves_to(listing, name, &file, 0)
                        })
                        .map(|(name, _)| format!("{dir}/{name}"))
                        .collect();
                    (file, links)
                }
            };
            links.sort();
            let path = format!("{dir}/{file}");
            // A 64-bit search must not pick up a 32-bit build from /usr/lib and the reverse.
            if !elf_class_matches(self.root, &self.root.path(&path), bits32) {
                continue;
            }
            let mut container_paths = vec![path.clone()];
            container_paths.extend(links);
            // A directory the dynamic loader does not search by default (the driver under
            // /usr/local/nvidia/lib64, as on GPU cloud images): an image without an
            // ld.so.conf entry for it would not find the library there, so it is bound into
            // the loader's own directories too (Debian's and Red Hat's layouts).
            if !LOADER_DIRS.contains(&dir.as_str()) {
                let own: &[&str] = if bits32 { &LOADER_HOME_32 } else { &LOADER_HOME_64 };
                let names: Vec<String> = container_paths
                    .iter()
                    .filter_map(|p| p.rsplit('/').next().map(str::to_owned))
                    .collect();
                for d in own {
                    container_paths.extend(names.iter().map(|n| format!("{d}/{n}")));
                }
            }
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

impl Search<'_> {
    /// An `O_PATH` descriptor of `dir`, opened once: probes resolve one name from it instead of
    /// the whole path under the root.
    /// A directory met before under another name (`/lib/x86_64-linux-gnu` is
    /// `/usr/lib/x86_64-linux-gnu` on a merged-`/usr` host) is `None`: it holds nothing new.
    fn dir_fd(&mut self, dir: &str) -> Option<&OwnedFd> {
        if !self.fds.contains_key(dir) {
            let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
            let fd =
                rustix::fs::open(self.root.path(dir), flags, Mode::empty()).ok().filter(|fd| {
                    rustix::fs::fstat(fd).is_ok_and(|st| self.seen.insert((st.st_dev, st.st_ino)))
                });
            self.fds.insert(dir.to_owned(), fd);
        }
        self.fds.get(dir).and_then(Option::as_ref)
    }

    /// Whether `dir/name` is a regular file; `follow`: or a symlink to one.
    fn is_file_in(&mut self, dir: &str, name: &str, follow: bool) -> bool {
        let Some(fd) = self.dir_fd(dir) else { return false };
        let flags = if follow { AtFlags::empty() } else { AtFlags::SYMLINK_NOFOLLOW };
        rustix::fs::statat(fd, name, flags)
            .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile)
    }

    /// Whether `dir/name` is a symlink that leads to `file` through same-directory links, read
    /// with `readlink` (the probing counterpart of [`resolves_to`]).
    fn links_to(&mut self, dir: &str, name: &str, file: &str, depth: u8) -> bool {
        if depth > 8 {
            return false;
        }
        let Some(fd) = self.dir_fd(dir) else { return false };
        let Ok(target) = rustix::fs::readlinkat(fd, name, Vec::new()) else { return false };
        // Only links within the directory (`libcuda.so.1 -> libcuda.so.535.104.05`).
        let Some(t) = target.to_str().ok().filter(|t| !t.contains('/')) else { return false };
        t == file || self.links_to(dir, t, file, depth + 1)
    }
}

/// Whether the file (a regular one) starts with the ELF magic number.
fn is_elf(root: &Root, path: &Path) -> bool {
    root.read_head(path, 4).is_ok_and(|magic| magic == *b"\x7fELF")
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
fn elf_class_matches(root: &Root, path: &Path, bits32: bool) -> bool {
    match root.read_head(path, 5) {
        Ok(head) if head.len() == 5 && head[..4] == *b"\x7fELF" => {
            head[4] == if bits32 { 1 } else { 2 }
        }
        _ => true,
    }
}

/// The dynamic linker's cache (`/etc/ld.so.cache`, glibc's `glibc-ld.so.cache1.1` format):
/// library names (sonames) and the paths they resolve to.
#[derive(Debug, Clone, Default)]
pub struct LdCache {
    /// The new-format block: header, entry table, string table.
    data: Vec<u8>,
    /// (soname, path, 64-bit), as byte ranges of `data`; both checked to be UTF-8. Kept as
    /// ranges so that reading a host's cache (thousands of entries) allocates nothing per entry.
    entries: Vec<(Span, Span, bool)>,
}

/// A string in [`LdCache::data`]: offset and length.
type Span = (u32, u32);

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

/// Whether `name` is a build or link of `stem` (`libcuda.so`, `libcuda.so.1`).
fn of_stem(name: &[u8], stem: &str) -> bool {
    name.strip_prefix(stem.as_bytes()).is_some_and(|r| r.is_empty() || r[0] == b'.')
}

impl LdCache {
    /// Parses the new (glibc 2.32+ default) format, alone or after the old-format block.
    pub fn parse(bytes: &[u8]) -> Result<Self, LdCacheError> {
        // No `memchr` here: its first call detects CPU features, and in a virtual machine each
        // `cpuid` traps to the hypervisor; the shim pays that on every container start. The new
        // format starts the file (glibc 2.32+) or follows the old one.
        let start = if bytes.starts_with(CACHE_MAGIC) {
            0
        } else {
            bytes
                .windows(CACHE_MAGIC.len())
                .position(|w| w == CACHE_MAGIC)
                .ok_or(LdCacheError::NoHeader)?
        };
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
        let string_at = |off: u32| -> Option<Span> {
            let s = new.get(off as usize..)?;
            let end = s.iter().position(|&b| b == 0)?;
            std::str::from_utf8(&s[..end]).ok()?;
            Some((off, u32::try_from(end).ok()?))
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
        Ok(Self { data: new.to_vec(), entries })
    }

    fn bytes(&self, (off, len): Span) -> &[u8] {
        self.data.get(off as usize..off as usize + len as usize).unwrap_or_default()
    }

    fn str(&self, span: Span) -> &str {
        // Checked to be UTF-8 when parsed.
        std::str::from_utf8(self.bytes(span)).unwrap_or_default()
    }

    /// The path the cache gives for `soname` (`libc.so.6`), 64-bit builds.
    pub fn lookup(&self, soname: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|(n, _, b64)| *b64 && self.bytes(*n) == soname.as_bytes())
            .map(|(_, p, _)| self.str(*p))
    }

    /// Paths of the builds and links of `stem` (`libcuda.so` matches `libcuda.so.1`).
    fn paths_of<'s>(&'s self, stem: &'s str, bits32: bool) -> impl Iterator<Item = &'s str> {
        self.entries
            .iter()
            .filter(move |(n, _, b64)| *b64 != bits32 && of_stem(self.bytes(*n), stem))
            .map(|(_, p, _)| self.str(*p))
    }

    /// Directories holding a build of `stem`.
    fn dirs_of<'s>(&'s self, stem: &'s str, bits32: bool) -> impl Iterator<Item = &'s str> {
        self.paths_of(stem, bits32).filter_map(|p| p.rsplit_once('/').map(|(d, _)| d))
    }

    /// The file names the cache lists for builds of `stem` in directory `dir` (`libcuda.so.1`).
    fn names_in<'s>(
        &'s self,
        stem: &'s str,
        dir: &'s str,
        bits32: bool,
    ) -> impl Iterator<Item = &'s str> {
        self.paths_of(stem, bits32)
            .filter_map(move |p| p.rsplit_once('/').filter(|(d, _)| *d == dir))
            .map(|(_, name)| name)
            .filter(move |name| of_stem(name.as_bytes(), stem))
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

    #[test]
    fn a_tool_behind_a_wrapper_script_is_found_as_the_program() {
        // Seen on a GPU machine: /usr/bin/nvidia-smi is `exec /usr/local/nvidia/bin/nvidia-smi`.
        let fx = xpu_testkit::hosts::a100_8x().build();
        xpu_testkit::driver::install_nvidia(fx.root(), "535.104.05");
        let root = Root::new(fx.root()).unwrap();
        std::fs::write(
            root.path("/usr/bin/nvidia-smi"),
            "#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi \"$@\"\n",
        )
        .unwrap();
        std::fs::create_dir_all(root.path("/usr/local/nvidia/bin")).unwrap();
        std::fs::write(root.path("/usr/local/nvidia/bin/nvidia-smi"), b"\x7fELF\x02\x01\x01")
            .unwrap();
        let files = find(&root, Some("535.104.05"));
        let smi: Vec<&DriverFile> =
            files.files.iter().filter(|f| f.path.ends_with("/nvidia-smi")).collect();
        assert_eq!(smi.len(), 1);
        assert_eq!(smi[0].path, "/usr/local/nvidia/bin/nvidia-smi");
        assert_eq!(smi[0].container_paths, ["/usr/bin/nvidia-smi"]);
    }

    #[test]
    fn a_library_outside_the_loaders_directories_is_bound_into_them_too() {
        // Seen on a GPU machine: the driver lives in /usr/local/nvidia/lib64, which an image's
        // loader does not search; nvidia-smi in a container then finds no libnvidia-ml.so.
        let fx = xpu_testkit::hosts::a100_8x().build();
        let root = Root::new(fx.root()).unwrap();
        let dir = root.path("/usr/local/nvidia/lib64");
        std::fs::create_dir_all(&dir).unwrap();
        let elf64 = b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00";
        std::fs::write(dir.join("libnvidia-ml.so.580.159.04"), elf64).unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.580.159.04", dir.join("libnvidia-ml.so.1"))
            .unwrap();
        let files = find(&root, Some("580.159.04"));
        let ml =
            files.files.iter().find(|f| f.path.ends_with("libnvidia-ml.so.580.159.04")).unwrap();
        assert_eq!(ml.path, "/usr/local/nvidia/lib64/libnvidia-ml.so.580.159.04");
        for want in [
            "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.04",
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "/usr/lib64/libnvidia-ml.so.1",
        ] {
            assert!(
                ml.container_paths.iter().any(|p| p == want),
                "{want} in {:?}",
                ml.container_paths
            );
        }
    }

    #[test]
    fn finding_by_capability_finds_what_selecting_would() {
        let fx = xpu_testkit::hosts::a100_8x().build();
        xpu_testkit::driver::install_nvidia(fx.root(), "535.104.05");
        let root = Root::new(fx.root()).unwrap();
        let all = find(&root, Some("535.104.05"));
        for list in
            ["utility", "utility,compute", "compute,compat32", "video,graphics,display", "ngx"]
        {
            let caps = Capabilities::parse(list).unwrap();
            let some = find_for(&root, Some("535.104.05"), caps);
            let want: Vec<&DriverFile> = all.select(DriverVendor::Nvidia, caps).collect();
            assert_eq!(some.files.iter().collect::<Vec<_>>(), want, "{list}");
            assert_eq!(some.warnings, all.warnings);
        }
        assert!(find_for(&root, None, Capabilities::default()).files.is_empty());
    }
}
