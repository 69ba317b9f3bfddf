//! `xpu doctor`: is this host ready for its profile? A table laid out like
//! `virt-host-validate`'s (`  AREA: Checking <what> : PASS|WARN|FAIL (detail; fix: ...)`), or the
//! report as JSON (`docs/host.md`). Exit 1 when any check fails.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::ValueEnum;
use xpu_host::doctor::{self, Report, Status};
use xpu_host::profile::Profile;
use xpu_host::{DiscoverOptions, Scope};

use crate::cmd::discover::root_arg;
use crate::cmd::format::{Format, TABLE_JSON};
use crate::output::{CliError, CmdResult, print_json, warn_all};

/// Host profiles, as clap values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProfileArg {
    /// A hypervisor passing accelerators through to VMs.
    VfioHost,
    /// A Cloud TPU VM image.
    TpuVm,
    /// Accelerators on vendor drivers, handed to containers.
    ContainerHost,
    /// Every profile that fits the host (doctor only).
    All,
}

impl From<ProfileArg> for Profile {
    fn from(p: ProfileArg) -> Self {
        match p {
            ProfileArg::VfioHost => Profile::VfioHost,
            ProfileArg::TpuVm => Profile::TpuVm,
            ProfileArg::ContainerHost => Profile::ContainerHost,
            ProfileArg::All => Profile::All,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Check the host under this directory instead of `/` (a fixture or a mounted image).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = ProfileArg::All)]
    pub profile: ProfileArg,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

pub fn run(args: Args) -> CmdResult {
    let root = root_arg(args.root)?;
    let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    let report = doctor::run(&root, &inv, args.profile.into()).map_err(CliError::input)?;
    warn_all(&report.warnings);
    match args.format {
        Format::Json => print_json(&report)?,
        // The table: `Format::only` lets only it and JSON through.
        _ => print!("{}", render_table(&report)),
    }
    Ok(if report.failed() { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

/// virt-host-validate prints `%6s: Checking %-60s: ` then the verdict, with the hint in
/// parentheses after WARN and FAIL.
pub fn render_table(r: &Report) -> String {
    let mut out = String::new();
    for c in &r.checks {
        out.push_str(&format!("{:>6}: Checking {:<60}: {}", c.area, c.check, c.status.as_str()));
        if c.status != Status::Pass {
            let parts: Vec<String> =
                c.detail.iter().cloned().chain(c.fix.iter().map(|f| format!("fix: {f}"))).collect();
            if !parts.is_empty() {
                out.push_str(&format!(" ({})", parts.join("; ")));
            }
        }
        out.push('\n');
    }
    out.push_str(&format!(
        "\nprofile {}: {} PASS, {} WARN, {} FAIL\n",
        r.profile, r.summary.pass, r.summary.warn, r.summary.fail
    ));
    out
}
