//! `xpu-shim-std`: the full OCI runtime shim on its own (`xpu_shim`), which the front
//! `xpu-container-runtime` hands requests to; engines may also call it directly in place of runc.
//! It links only `xpu-container` and `xpu-host`, not the rest of `xpu` (daemon, scheduler,
//! integrations), and `scripts/build-shim` links it statically: `cargo bench -p xpu --bench
//! container` prints what it costs with and without the front. A symlink named
//! `xpu-container-runtime` to `xpu` works too.

use std::process::ExitCode;

fn main() -> ExitCode {
    xpu_shim::run(std::env::args_os().skip(1).collect())
}
