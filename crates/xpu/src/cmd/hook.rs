//! `xpu hook`: the shim's device injection as an OCI `createRuntime`/`prestart` hook. Reads the
//! container state from stdin; settings from `$XPU_RUNTIME_CONFIG` or /etc/xpu/runtime.toml.

use std::io::Read;
use std::process::ExitCode;

use xpu_container::config::RuntimeConfig;
use xpu_container::hook;

use crate::output::{CliError, CmdResult};
use xpu_shim::{HostReader, nvml};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The hook point it is configured at (createRuntime or prestart), for the log.
    #[arg(value_name = "STAGE")]
    pub stage: Option<String>,
}

pub fn run(args: Args) -> CmdResult {
    let mut input = Vec::new();
    std::io::stdin().read_to_end(&mut input).map_err(|e| {
        CliError::failed(anyhow::anyhow!("reading the container state from stdin failed: {e}"))
    })?;
    let state = hook::parse_state(&input).map_err(CliError::input)?;
    let cfg = RuntimeConfig::load_default().map_err(CliError::failed)?;
    let host = HostReader::new(&cfg).map_err(CliError::failed)?;
    let stage = args.stage.as_deref().unwrap_or("hook");
    match hook::run(&state, &cfg, &host, &nvml(&cfg)) {
        Ok(Some(summary)) => cfg.log(&format!("{stage} {}: {summary}", state.id)),
        Ok(None) => {}
        Err(e) => {
            cfg.log(&format!("{stage} {} refused: {}", state.id, xpu_core::error::chain_once(&e)));
            return Err(CliError::failed(e));
        }
    }
    Ok(ExitCode::SUCCESS)
}
