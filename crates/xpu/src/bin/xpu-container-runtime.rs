//! `xpu-container-runtime`: the OCI runtime shim on its own, for engines to call instead of runc.
//! The same code as `xpu runtime` ([`runtime`] is `src/cmd/runtime.rs`), in a binary that links
//! only `xpu-container` and `xpu-host`: the shim runs on every container start, and this binary
//! starts about half a millisecond sooner than the full `xpu` binary (daemon, scheduler,
//! integrations); `cargo bench -p xpu --bench container` prints both. `scripts/build-shim` links it
//! statically, which saves the dynamic loader's half millisecond as well. A symlink named
//! `xpu-container-runtime` to `xpu` works too.

#![allow(clippy::print_stderr)]

use std::process::ExitCode;

// `runtime::Args` is the full binary's clap stand-in for `xpu --help`; unused here.
#[allow(dead_code)]
#[path = "../cmd/runtime.rs"]
mod runtime;

fn main() -> ExitCode {
    runtime::run(std::env::args_os().skip(1).collect())
}
