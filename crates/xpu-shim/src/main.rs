//! `xpu-container-runtime`: the OCI runtime shim on its own (`xpu_shim`), which engines run in
//! place of runc. It links only `xpu-container` and `xpu-host`, not the rest of `xpu` (daemon,
//! scheduler, integrations), and `scripts/build-shim` links it statically with musl: `cargo bench
//! -p xpu --bench container` prints what it costs. A symlink named `xpu-container-runtime` to
//! `xpu`, or `xpu runtime`, runs the same code.

use std::process::ExitCode;

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

fn main() -> ExitCode {
    xpu_shim::run(std::env::args_os().skip(1).collect())
}
