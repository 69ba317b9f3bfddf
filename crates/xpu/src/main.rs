//! The `xpu` binary: argument parsing and output only. Every subcommand is one call into a
//! library crate; nothing here reads the host or makes decisions.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod cmd;
mod output;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Accelerators for AI work, from one host to a fleet.
#[derive(Debug, Parser)]
#[command(name = "xpu", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List accelerators (GPUs, TPUs, NPUs, NVSwitches) and their IOMMU group peers.
    Discover(cmd::discover::Args),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints help/version to stdout with exit 0 and usage errors with exit 2.
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli.command {
        Command::Discover(args) => cmd::discover::run(args),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => e.report(),
    };
    output::report_peak_rss();
    code
}
