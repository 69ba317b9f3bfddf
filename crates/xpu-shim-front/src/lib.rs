//! The front end of xpu's OCI runtime shim: what `xpu-container-runtime` reads before it looks
//! at the host. Engines run it where they would run runc, for every command of every container
//! (`create`, `start`, `state`, `kill`, `delete`), and only a `create` (or `run`) whose spec
//! asks for devices needs the shim's work; this crate answers the questions that decide it:
//!
//! - [`args`]: runc's command line, as far as the shim needs it (the subcommand and the bundle);
//! - [`config`]: the keys of `runtime.toml` and the checks that need nothing of the host;
//! - [`request`]: whether a spec's environment or annotations could ask for devices at all.
//!
//! `no_std`, without `unsafe` and without I/O: the callers (`xpu_container::shim` and
//! `xpu_container::config`) read the files and hand over their bytes. The crate once also held
//! a front binary without libc that passed pass-throughs to runc; since the shim links musl
//! (`scripts/build-shim`), one binary starts about as fast, and a request no longer pays for a
//! second exec.

#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;

pub mod args;
pub mod config;
pub mod request;

/// The environment variable naming another runtime config.
pub const CONFIG_ENV: &str = "XPU_RUNTIME_CONFIG";
/// The runtime config read when [`CONFIG_ENV`] is unset or empty.
pub const CONFIG_PATH: &str = "/etc/xpu/runtime.toml";
/// Directories searched for a runtime named without a `/`, after `$PATH` (engines often run
/// with a minimal `$PATH`).
pub const SBIN_DIRS: [&str; 4] = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"];
