//! `xpu completions SHELL` and `xpu man --out DIR`: shell completions and man pages generated
//! from the clap definitions, so they never drift from `--help`. Both are hidden: they exist for
//! `scripts/build-deb`, which runs them on the binary it packages; nothing generated is
//! committed. They read nothing from the host.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::ValueEnum;
use clap_complete::Shell as ClapShell;

use crate::output::{CliError, CmdResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell to write the completion script for.
    #[arg(value_enum)]
    pub shell: Shell,
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Directory to write the pages into (created if missing): xpu.1, xpu-discover.1, ...
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// Writes the completion script for `args.shell` to stdout.
pub fn completions(args: CompletionsArgs, mut cmd: clap::Command) -> CmdResult {
    let shell = match args.shell {
        Shell::Bash => ClapShell::Bash,
        Shell::Zsh => ClapShell::Zsh,
        Shell::Fish => ClapShell::Fish,
    };
    let mut buf = Vec::new();
    clap_complete::generate(shell, &mut cmd, "xpu", &mut buf);
    use std::io::Write as _;
    std::io::stdout()
        .lock()
        .write_all(&buf)
        .context("cannot write the completion script to stdout")
        .map_err(CliError::failed)?;
    Ok(ExitCode::SUCCESS)
}

/// Writes one roff page per visible command (`xpu.1`, `xpu-k8s-device-plugin.1`, ...) into
/// `args.out` and prints their paths.
pub fn man(args: ManArgs, cmd: clap::Command) -> CmdResult {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create man page directory {}", args.out.display()))
        .map_err(CliError::input)?;
    clap_mangen::generate_to(cmd, &args.out)
        .with_context(|| format!("cannot write man pages into {}", args.out.display()))
        .map_err(CliError::failed)?;
    let mut pages: Vec<PathBuf> = std::fs::read_dir(&args.out)
        .with_context(|| format!("cannot list {}", args.out.display()))
        .map_err(CliError::failed)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "1"))
        .collect();
    pages.sort();
    for p in pages {
        println!("{}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}
