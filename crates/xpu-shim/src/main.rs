//! `xpu-container-runtime`: the OCI runtime shim on its own, for engines to call instead of runc
//! (`xpu_shim`). It links only `xpu-container` and `xpu-host`, not the rest of `xpu` (daemon,
//! scheduler, integrations), and `scripts/build-shim` links it statically: the shim runs on every
//! container start, and `cargo bench -p xpu --bench container` prints what each costs. A symlink
//! named `xpu-container-runtime` to `xpu` works too.

use std::process::ExitCode;

fn main() -> ExitCode {
    xpu_shim::run(std::env::args_os().skip(1).collect())
}
