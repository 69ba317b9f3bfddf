//! `xpu-container-runtime`: the OCI runtime engines call instead of runc. The decision is
//! `xpu_shim_front::decide`; this file runs it and execs what it chose.
//!
//! Built with `panic = "abort"` (the `shim` profile, `scripts/build-shim`: what the package
//! installs and the container bench measures) it is a static-pie executable without libc: its
//! own entry point, relocation, allocator and memory functions (`bare.rs`), system calls through
//! rustix's raw Linux backend. In the workspace's other profiles, which unwind and so need std,
//! it is an ordinary std program running the same code, so that `cargo test` exercises the
//! decisions; the tests run the bare build too.

#![cfg_attr(xpu_bare, no_std, no_main)]
// What libc would do for us: the entry point, the allocator, execve.
#![allow(unsafe_code)]

extern crate alloc;

#[cfg(xpu_bare)]
mod bare;
mod sys;

use alloc::ffi::CString;
use alloc::vec::Vec;
use core::ffi::CStr;

use xpu_shim_front::{Action, FULL_NAME, FULL_PATH};

#[cfg(not(xpu_bare))]
fn main() {
    use std::os::unix::ffi::OsStrExt;
    let cstring = |b: &[u8]| CString::new(b).unwrap_or_default();
    let args: Vec<CString> = std::env::args_os().skip(1).map(|a| cstring(a.as_bytes())).collect();
    let env: Vec<CString> = std::env::vars_os()
        .map(|(k, v)| cstring(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect();
    let args: Vec<&CStr> = args.iter().map(CString::as_c_str).collect();
    let env: Vec<&CStr> = env.iter().map(CString::as_c_str).collect();
    run(&args, &env)
}

/// Decides and execs; returns never. `args` are everything after the program name.
fn run(args: &[&CStr], env: &[&CStr]) -> ! {
    sanitize_standard_fds();
    let exe = rustix::fs::readlink("/proc/self/exe", Vec::new()).unwrap_or_default();
    let full = full_shim(exe.as_bytes());
    #[cfg(xpu_bare)]
    bare::remember_full_shim(&full);
    let action = xpu_shim_front::decide(&bytes(args), &bytes(env), exe.as_bytes(), &full);
    if let Action::Runtime(runtime) = action {
        sys::reset_signals();
        // Returns only on failure; the full shim then reports it as it always has.
        exec(&runtime, &runtime, args, env);
    }
    // The full shim gets this binary's path as argv[0]: it refuses a runtime that is this file.
    let full = CString::new(full).unwrap_or_default();
    let me = CString::new(exe.into_bytes()).unwrap_or_default();
    let e = exec(&full, &me, args, env);
    fail(&full, e)
}

fn bytes<'a>(v: &[&'a CStr]) -> Vec<&'a [u8]> {
    v.iter().map(|c| c.to_bytes()).collect()
}

/// The full shim: [`FULL_NAME`] beside this binary (a build tree, `scripts/build-shim
/// --install DIR`), else in `../libexec/xpu/` from it (the package's layout, wherever it is
/// unpacked), else the package's [`FULL_PATH`].
fn full_shim(exe: &[u8]) -> Vec<u8> {
    if let Some(slash) = exe.iter().rposition(|&b| b == b'/') {
        let dir = &exe[..=slash];
        for rel in [&b""[..], b"../libexec/xpu/"] {
            let candidate = [dir, rel, FULL_NAME.as_bytes()].concat();
            if rustix::fs::access(candidate.as_slice(), rustix::fs::Access::EXEC_OK).is_ok() {
                return candidate;
            }
        }
    }
    FULL_PATH.as_bytes().to_vec()
}

/// `execve(path, [argv0, args..], env)`; returns the errno when it fails.
fn exec(path: &CStr, argv0: &CStr, args: &[&CStr], env: &[&CStr]) -> i32 {
    let mut argv: Vec<*const u8> = Vec::with_capacity(args.len() + 2);
    argv.push(argv0.as_ptr().cast());
    argv.extend(args.iter().map(|a| a.as_ptr().cast::<u8>()));
    argv.push(core::ptr::null());
    let mut envp: Vec<*const u8> = Vec::with_capacity(env.len() + 1);
    envp.extend(env.iter().map(|e| e.as_ptr().cast::<u8>()));
    envp.push(core::ptr::null());
    // SAFETY: both arrays are null-terminated arrays of pointers to NUL-terminated strings that
    // outlive the call (`argv0`, `args`, `env` and `path` are borrowed for all of it).
    unsafe { sys::execve(path, argv.as_ptr(), envp.as_ptr()) }
}

/// As std does at start-up: a standard descriptor (0, 1, 2) that is closed is opened on
/// `/dev/null`, so that a file the program opens never becomes its stdout by accident.
fn sanitize_standard_fds() {
    use rustix::event::{PollFd, PollFlags};
    use rustix::fd::BorrowedFd;
    // SAFETY: descriptors 0-2 are only polled here, never closed or read; a closed one is
    // reported as POLLNVAL, not used.
    let fds = [0, 1, 2].map(|fd| unsafe { BorrowedFd::borrow_raw(fd) });
    let mut polled = fds.map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::empty()));
    let closed: Vec<bool> = match rustix::event::poll(&mut polled, Some(&Default::default())) {
        Ok(_) => polled.iter().map(|p| p.revents().contains(PollFlags::NVAL)).collect(),
        Err(_) => fds
            .iter()
            .map(|fd| rustix::io::fcntl_getfd(fd) == Err(rustix::io::Errno::BADF))
            .collect(),
    };
    // In ascending order, so that each `open` returns the lowest free descriptor: this one.
    for _ in closed.into_iter().filter(|&c| c) {
        if let Ok(null) =
            rustix::fs::open("/dev/null", rustix::fs::OFlags::RDWR, rustix::fs::Mode::empty())
        {
            // Kept open for the programs exec'd after us: the raw number is not needed, it is
            // the descriptor being filled.
            let _ = rustix::fd::IntoRawFd::into_raw_fd(null);
        }
    }
}

/// The full shim could not be run: say so on stderr and exit 1, as a runtime that fails.
fn fail(full: &CStr, errno: i32) -> ! {
    let msg = alloc::format!(
        "xpu-container-runtime: error: the full shim {} cannot be run ({}); reinstall xpu, or put xpu-shim-std beside xpu-container-runtime\n",
        full.to_string_lossy(),
        rustix::io::Errno::from_raw_os_error(errno)
    );
    sys::write_stderr(msg.as_bytes());
    sys::exit_group(1)
}
