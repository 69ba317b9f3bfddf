//! `xpu runtime`, and `xpu` called `xpu-container-runtime` through a symlink: the OCI runtime
//! shim in front of runc, the same code (`xpu_shim`) as the packaged `xpu-container-runtime`.
//! Arguments are runc's and are never parsed by clap: `main` hands them over verbatim.

use std::ffi::OsString;

pub use xpu_shim::run;

/// The clap stand-in, for `xpu --help`: `main` dispatches `xpu runtime` before clap parses.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// runc's arguments, passed through verbatim (`create --bundle DIR ID`, `start ID`...).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "RUNC_ARGS")]
    pub args: Vec<OsString>,
}
