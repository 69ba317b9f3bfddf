//! The front of xpu's OCI runtime shim. Engines run `xpu-container-runtime` where they would
//! run runc, for every command of every container: `create`, `start`, `state`, `kill`,
//! `delete`. Only a `create` (or `run`) whose spec asks for devices needs the shim's work; every
//! other command goes to runc untouched. This crate decides which is which and, in the
//! binary, does so without libc.
//!
//! Why without libc: glibc's start-up reads the CPU's cache geometry with `cpuid`, about a
//! hundred times, and in a virtual machine each `cpuid` traps to the hypervisor. On the 2-core
//! KVM guests xpu is built on that is 0.6 ms per process start (perf: 78 % of a static glibc
//! program that does nothing is `intel_check_word` and `handle_intel`), more than the whole
//! budget of a shim in front of runc. A binary that never runs glibc's start-up pays about
//! 0.05 ms for its exec.
//!
//! What it does ([`decide`]): reads `runtime.toml` with the full shim's own schema
//! ([`config::File`]), finds the real runtime as the full shim does, and on `create`/`run`
//! reads the bundle's `config.json` with the same JSON parser and asks the same question
//! ([`request::may_request`]). It hands the command to runc when the answer is no, and
//! otherwise (devices asked for) or whenever anything is out of the ordinary (`--version`, a
//! config it does not accept, a runtime it cannot find, a spec it cannot read) to the full shim
//! (`xpu-shim-std`, the `xpu-shim` package), which then does everything, errors included, as
//! it always has. So the front never refuses anything itself, and runc sees the same
//! arguments, environment, signal state and standard descriptors either way. The front runs
//! the full shim with its own absolute path as `argv[0]` (which the full shim does not pass on),
//! so that the full shim refuses a configured runtime that is the front, which would hand the
//! command back.
//!
//! The library has no `unsafe` and no I/O beyond reading files and `stat`; the binary
//! (`src/main.rs`) adds the entry point, the allocator and `execve`.

#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod args;
pub mod config;
pub mod request;

use alloc::ffi::CString;
use alloc::vec::Vec;

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

/// The environment variable naming another runtime config (as the full shim reads it).
pub const CONFIG_ENV: &str = "XPU_RUNTIME_CONFIG";
/// The runtime config read when [`CONFIG_ENV`] is unset or empty.
pub const CONFIG_PATH: &str = "/etc/xpu/runtime.toml";
/// The full shim's file name, looked for beside the front first.
pub const FULL_NAME: &str = "xpu-shim-std";
/// Where the package installs the full shim.
pub const FULL_PATH: &str = "/usr/libexec/xpu/xpu-shim-std";
/// Directories searched for a runtime named without a `/`, after `$PATH` (engines often run
/// with a minimal `$PATH`).
pub const SBIN_DIRS: [&str; 4] = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"];

/// The largest `runtime.toml` and `config.json` the front reads; larger ones go to the full
/// shim.
const MAX_CONFIG: usize = 1 << 20;
const MAX_SPEC: usize = 4 << 20;

/// What to do with the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Exec the real runtime at this path with the arguments verbatim.
    Runtime(CString),
    /// Hand the command to the full shim, for this reason.
    Full(Why),
}

/// Why a command goes to the full shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// `--version` or `-v`, which the full shim answers.
    Version,
    /// The runtime config is missing where named, unreadable, or not accepted as it is.
    Config,
    /// The real runtime is not found, or is one of xpu's shims.
    Runtime,
    /// The bundle's `config.json` is unreadable, too large, or not a spec the shim can read.
    Spec,
    /// The container may ask for devices: the shim's actual work.
    Request,
}

/// The value of `name` in `env` (`NAME=value` entries; the first definition, as `getenv`).
fn getenv<'a, E: AsRef<[u8]>>(env: &'a [E], name: &str) -> Option<&'a [u8]> {
    env.iter().find_map(|e| {
        let e = e.as_ref();
        e.strip_prefix(name.as_bytes())?.strip_prefix(b"=")
    })
}

/// Decides what to do with `args` (everything after the program name) in environment `env`;
/// `exe` is the front's own path (`/proc/self/exe`), `full` the full shim's.
pub fn decide<A: AsRef<[u8]>, E: AsRef<[u8]>>(
    args: &[A],
    env: &[E],
    exe: &[u8],
    full: &[u8],
) -> Action {
    if let [flag] = args
        && matches!(flag.as_ref(), b"--version" | b"-v")
    {
        return Action::Full(Why::Version);
    }
    let Some(cfg) = load_config(env) else { return Action::Full(Why::Config) };
    let Some(runtime) = real_runtime(&cfg, env, &[exe, full]) else {
        return Action::Full(Why::Runtime);
    };
    let inv = args::parse(args);
    if !inv.creates() {
        return Action::Runtime(runtime);
    }
    let mut spec = Vec::from(inv.bundle.unwrap_or(b"."));
    spec.extend_from_slice(b"/config.json");
    match spec_may_request(&spec) {
        Some(false) => Action::Runtime(runtime),
        Some(true) => Action::Full(Why::Request),
        None => Action::Full(Why::Spec),
    }
}

/// The runtime config, when the front accepts it exactly as the full shim would. A file that
/// sets `default_capabilities` goes to the full shim, which knows the capability names.
fn load_config<E: AsRef<[u8]>>(env: &[E]) -> Option<config::File> {
    let text = match getenv(env, CONFIG_ENV).filter(|p| !p.is_empty()) {
        Some(path) => read_file(path, MAX_CONFIG).ok()??,
        None => match read_file(CONFIG_PATH.as_bytes(), MAX_CONFIG) {
            Ok(text) => text?,
            Err(Errno::NOENT) => return Some(config::File::default()),
            Err(_) => return None,
        },
    };
    let file = config::File::parse(core::str::from_utf8(&text).ok()?).ok()?;
    (file.problem().is_none() && file.default_capabilities.is_none()).then_some(file)
}

/// The real runtime's path, as the full shim finds it (`xpu_container::shim::real_runtime`):
/// the configured path, or the name looked up in `$PATH` and then [`SBIN_DIRS`]. `None` when
/// it is not a file or is one of `shims` (by device and inode).
fn real_runtime<E: AsRef<[u8]>>(cfg: &config::File, env: &[E], shims: &[&[u8]]) -> Option<CString> {
    let name = cfg.runtime().as_bytes();
    // One `stat` per candidate answers both questions: a regular file, and which one.
    let found = |p: Vec<u8>| regular_file(&p).map(|id| (p, id));
    let (path, id) = if name.contains(&b'/') {
        found(Vec::from(name))
    } else {
        let search = getenv(env, "PATH").unwrap_or_default();
        search
            .split(|&b| b == b':')
            .chain(SBIN_DIRS.iter().map(|d| d.as_bytes()))
            .find_map(|dir| found(join(dir, name)))
    }?;
    let shim_id = |p: &[u8]| rustix::fs::stat(p).ok().map(|s| (s.st_dev, s.st_ino));
    if shims.iter().any(|s| shim_id(s) == Some(id)) {
        return None;
    }
    CString::new(path).ok()
}

/// `dir/name` as `Path::join` makes it: just `name` when `dir` is empty (a `$PATH` entry for
/// the current directory), no second `/` when `dir` ends with one.
fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(dir.len() + 1 + name.len());
    p.extend_from_slice(dir);
    if !dir.is_empty() && !dir.ends_with(b"/") {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

/// The device and inode of `path` when it is a regular file, following symlinks (as
/// `Path::is_file` decides).
fn regular_file(path: &[u8]) -> Option<(u64, u64)> {
    let s = rustix::fs::stat(path).ok()?;
    FileType::from_raw_mode(s.st_mode).is_file().then_some((s.st_dev, s.st_ino))
}

/// Whether the spec at `path` may ask for devices; `None` when it cannot be read, is larger
/// than the front reads, or is not a JSON object with a readable `process.env` and
/// `annotations` (the full shim then reports what is wrong). Always parsed, even when its text
/// names a request variable: `NVIDIA_VISIBLE_DEVICES=void` (which CUDA images' users set to get
/// no GPU) asks for nothing and stays with the front, and a name written with JSON escapes
/// still counts.
fn spec_may_request(path: &[u8]) -> Option<bool> {
    use serde_json::Value;
    let bytes = read_file(path, MAX_SPEC).ok()??;
    let spec: Value = serde_json::from_slice(&bytes).ok()?;
    if !spec.is_object() {
        return None;
    }
    let env = match spec.pointer("/process/env") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(Value::as_str).collect::<Option<Vec<_>>>()?,
        Some(_) => return None,
    };
    let annotations = match spec.get("annotations") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) if m.values().all(Value::is_string) => Some(m),
        Some(_) => return None,
    };
    let keys = annotations.into_iter().flat_map(|m| m.keys().map(alloc::string::String::as_str));
    Some(request::may_request(env, keys))
}

/// The whole file at `path`; `Ok(None)` when it is larger than `max` bytes.
fn read_file(path: &[u8], max: usize) -> Result<Option<Vec<u8>>, Errno> {
    let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    let mut buf = Vec::with_capacity(16 << 10);
    loop {
        if buf.len() == buf.capacity() {
            buf.reserve(buf.capacity());
        }
        // Reads into the spare capacity and counts what was read into the length.
        if rustix::io::read(&fd, rustix::buffer::spare_capacity(&mut buf))? == 0 {
            return Ok(Some(buf));
        }
        if buf.len() > max {
            return Ok(None);
        }
    }
}
