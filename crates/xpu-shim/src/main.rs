//! `xpu-container-runtime`: the OCI runtime shim on its own (`xpu_shim`), which engines run in
//! place of runc. It links only `xpu-container` and `xpu-host`, not the rest of `xpu` (daemon,
//! scheduler, integrations), and `scripts/build-shim` links it statically with musl: `cargo bench
//! -p xpu --bench container` prints what it costs. A symlink named `xpu-container-runtime` to
//! `xpu`, or `xpu runtime`, runs the same code.

// The C `main` below is the entry point, not std's (see there); the test build has the test
// harness's.
#![cfg_attr(not(test), no_main)]

// The allocator, the glibc names std needs and the memory functions in place of musl's are this
// binary's alone (`xpu runtime` keeps the system's); they need `unsafe`, which the rest of the
// package denies.
#[allow(unsafe_code)]
mod arena;
#[cfg(any(xpu_musl, test))]
#[allow(unsafe_code)]
mod mem;
#[cfg(xpu_musl)]
#[allow(unsafe_code)]
mod musl;

// The test build keeps the system's, so that the arena's test sees only its own blocks.
#[cfg(not(test))]
#[global_allocator]
static ALLOCATOR: arena::Arena = arena::Arena;

// The entry point: not in the test build, which has the test harness's.
#[cfg(not(test))]
mod entry {
    use std::ffi::{CStr, OsString, c_char, c_int, c_ulong};
    use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
    use std::os::unix::ffi::OsStringExt;
    use std::path::PathBuf;
    use std::process::ExitCode;

    use rustix::fs::{Mode, OFlags};

    /// The process's entry, called by the C start code with the C arguments, in place of
    /// std's runtime start (`#![no_main]`). Under musl that start finds the main thread's stack
    /// guard by probing with 32 `mremap` calls and installs a stack-overflow handler (a
    /// `sigaltstack` with its own mapping, four `sigaction`s): about 15 µs of a container start
    /// that the shim does not need (serde_json bounds its recursion, and the shim starts no
    /// thread). What of it matters is done here: closed standard descriptors are opened on
    /// `/dev/null`, so that no file the shim opens becomes its stdout or stderr, and runc gets
    /// valid ones. SIGPIPE stays at its default (std would ignore it); the shim writes to stdout
    /// and stderr only to report, and runc gets the default either way. std's copy of the
    /// arguments is never set up in this binary: they come from `argv`, and nothing here may
    /// call `std::env::args`.
    #[unsafe(no_mangle)]
    #[allow(unsafe_code)]
    extern "C" fn main(argc: c_int, argv: *const *const c_char) -> c_int {
        open_standard_fds();
        let count = usize::try_from(argc).unwrap_or(0);
        let args = (1..count)
            .map(|i| {
                // SAFETY: the C start code passes `argc` pointers to NUL-terminated strings.
                let arg = unsafe { CStr::from_ptr(*argv.add(i)) };
                OsString::from_vec(arg.to_bytes().to_vec())
            })
            .collect();
        // `run` answers success or failure, nothing else.
        if xpu_shim::run_as(args, program()) == ExitCode::SUCCESS { 0 } else { 1 }
    }

    #[allow(unsafe_code)]
    unsafe extern "C" {
        /// The C library's reader of the auxiliary vector the kernel passed at exec (musl's and
        /// glibc's alike).
        fn getauxval(kind: c_ulong) -> c_ulong;
    }

    /// The path this binary was started by: the kernel's `AT_EXECFN`, the file name given to
    /// `execve`.
    #[allow(unsafe_code)]
    fn program() -> Option<PathBuf> {
        const AT_EXECFN: c_ulong = 31;
        // SAFETY: `getauxval` only reads the vector libc saved at start; 0 when absent.
        let name = unsafe { getauxval(AT_EXECFN) } as *const c_char;
        if name.is_null() {
            return None;
        }
        // SAFETY: the kernel's `AT_EXECFN` points to the NUL-terminated name on the initial
        // stack, which lives as long as the process.
        let name = unsafe { CStr::from_ptr(name) };
        Some(PathBuf::from(OsString::from_vec(name.to_bytes().to_vec())))
    }

    /// Opens `/dev/null` (without close-on-exec) on each of descriptors 0, 1 and 2 that is closed,
    /// as std's start does: the lowest free descriptor is taken first, so opening until one lands
    /// above 2 fills exactly the closed ones. Usually one `open` and one `close`.
    fn open_standard_fds() {
        while let Ok(fd) = rustix::fs::open("/dev/null", OFlags::RDWR, Mode::empty()) {
            if fd.as_raw_fd() > 2 {
                break;
            }
            // It is now a standard descriptor, for the life of the process and of what it execs.
            let _standard: RawFd = fd.into_raw_fd();
        }
    }
}
