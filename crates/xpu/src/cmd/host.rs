//! `xpu host render|apply|metadata-env`: the files that make a host ready for a profile,
//! printed, written to a directory, emitted as cloud-init, or applied under a root with
//! backups and a diff; and the TPU `tpu-env` metadata as a shell-safe environment file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Subcommand, ValueEnum};
use xpu_host::profile::CpuVendor;
use xpu_host::provision::{self, ApplyOptions, ApplyReport, DeviceMatch, RenderOptions};
use xpu_host::{DiscoverOptions, Scope, metadata_env};

use crate::cmd::discover::root_arg;
use crate::cmd::doctor::ProfileArg;
use crate::cmd::format::{Format, TABLE_JSON};
use crate::output::{CliError, CmdResult, print_json};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: HostCommand,
}

#[derive(Debug, Subcommand)]
pub enum HostCommand {
    /// Print (or write to --out) the files that make a host ready for a profile.
    Render(RenderArgs),
    /// Write the profile's files under the root, merging kernel parameters into
    /// /etc/default/grub, backing up what changes and printing a diff.
    Apply(ApplyArgs),
    /// Turn a flat YAML map (the TPU `tpu-env` metadata) into a KEY="value" environment file.
    MetadataEnv(MetadataEnvArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VendorArg {
    Intel,
    Amd,
}

impl From<VendorArg> for CpuVendor {
    fn from(v: VendorArg) -> Self {
        match v {
            VendorArg::Intel => CpuVendor::Intel,
            VendorArg::Amd => CpuVendor::Amd,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RenderFormat {
    /// Each file with its path, mode and owner (or the files themselves under --out).
    Files,
    /// One `#cloud-config` document with `write_files` and `runcmd`.
    CloudInit,
    /// `{profile, files: [{path, content, mode, owner}], commands}`.
    Json,
}

#[derive(Debug, clap::Args)]
pub struct RenderArgs {
    #[arg(long, value_enum)]
    pub profile: ProfileArg,
    /// Devices to bind to vfio-pci, `VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE]` in hex, comma-separated.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub devices: Vec<DeviceMatch>,
    #[arg(long, value_enum, default_value_t = RenderFormat::Files)]
    pub format: RenderFormat,
    /// Write the files under this directory (`DIR/etc/...`; cloud-init: `DIR/cloud-init.yaml`).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Render the kernel parameters for this CPU vendor only (default: both, chosen when
    /// update-grub runs).
    #[arg(long, value_enum)]
    pub cpu_vendor: Option<VendorArg>,
    /// Huge pages to reserve at boot (`vm.nr_hugepages`).
    #[arg(long, value_name = "N")]
    pub hugepages: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    #[arg(long, value_enum)]
    pub profile: ProfileArg,
    /// Write under this directory instead of `/` (a fixture or a mounted image).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Print the diff and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Devices to bind to vfio-pci (default: the profile's devices found on the host).
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    pub devices: Vec<DeviceMatch>,
    /// CPU vendor for the IOMMU parameters (default: from /proc/cpuinfo).
    #[arg(long, value_enum)]
    pub cpu_vendor: Option<VendorArg>,
    #[arg(long, value_name = "N")]
    pub hugepages: Option<u64>,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct MetadataEnvArgs {
    /// The YAML map (`tpu-env` metadata as fetched from the metadata server).
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// The environment file to write (atomically).
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        HostCommand::Render(a) => render(a),
        HostCommand::Apply(a) => apply(a),
        HostCommand::MetadataEnv(a) => metadata(a),
    }
}

fn render(a: RenderArgs) -> CmdResult {
    let opts = RenderOptions {
        profile: a.profile.into(),
        devices: a.devices,
        cpu_vendor: a.cpu_vendor.map(Into::into),
        hugepages: a.hugepages,
        extra_drivers: Vec::new(),
    };
    let r = provision::render(&opts).map_err(CliError::input)?;
    match (a.format, &a.out) {
        (RenderFormat::Json, _) => print_json(&r)?,
        (RenderFormat::CloudInit, None) => {
            print!("{}", provision::cloud_init(&r).map_err(CliError::failed)?);
        }
        (RenderFormat::CloudInit, Some(dir)) => {
            std::fs::create_dir_all(dir).map_err(|e| {
                CliError::input(anyhow::anyhow!("cannot create {}: {e}", dir.display()))
            })?;
            let path = dir.join("cloud-init.yaml");
            let doc = provision::cloud_init(&r).map_err(CliError::failed)?;
            std::fs::write(&path, doc).map_err(|e| {
                CliError::failed(anyhow::anyhow!("cannot write {}: {e}", path.display()))
            })?;
            println!("wrote {}", path.display());
        }
        (RenderFormat::Files, None) => {
            for f in &r.files {
                println!("# --- {} ({:04o} {})", f.path, f.mode, f.owner);
                print!("{}", f.content);
            }
            println!("# --- then run:");
            for c in &r.commands {
                println!("{c}");
            }
        }
        (RenderFormat::Files, Some(dir)) => {
            std::fs::create_dir_all(dir).map_err(|e| {
                CliError::input(anyhow::anyhow!("cannot create {}: {e}", dir.display()))
            })?;
            provision::write_tree(&r, dir).map_err(CliError::failed)?;
            println!("wrote {} files under {}", r.files.len(), dir.display());
            for f in &r.files {
                println!("  {} ({:04o})", f.path, f.mode);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn apply(a: ApplyArgs) -> CmdResult {
    let root = root_arg(a.root)?;
    let inv = xpu_host::discover(
        &root,
        &DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true },
    )
    .map_err(CliError::input)?;
    let opts = ApplyOptions {
        profile: a.profile.into(),
        devices: a.devices,
        cpu_vendor: a.cpu_vendor.map(Into::into),
        hugepages: a.hugepages,
        dry_run: a.dry_run,
    };
    let report = provision::apply(&root, &inv, &opts).map_err(|e| match &e {
        provision::ProvisionError::Io { .. } => CliError::failed(e),
        provision::ProvisionError::Path(p) if p.is_io() => CliError::failed(e),
        // A link out of the root, a FIFO where a file should be: the tree given is wrong.
        _ => CliError::input(e),
    })?;
    match a.format {
        Format::Json => print_json(&report)?,
        // The table: `Format::only` lets only it and JSON through.
        _ => print!("{}", render_apply(&report)),
    }
    Ok(ExitCode::SUCCESS)
}

fn render_apply(r: &ApplyReport) -> String {
    let mut out = String::new();
    let verb = |action: &str| match (action, r.dry_run) {
        ("created", true) => "would create",
        ("created", false) => "created",
        (_, true) => "would modify",
        (_, false) => "modified",
    };
    for f in r.files.iter().filter(|f| f.action != "unchanged") {
        out.push_str(&format!("{} {}", verb(f.action), f.path));
        if let Some(b) = &f.backup {
            out.push_str(&format!(" (backup {b})"));
        }
        out.push('\n');
        out.push_str(&f.diff);
    }
    let unchanged = r.files.iter().filter(|f| f.action == "unchanged").count();
    if !r.changed() {
        out.push_str(&format!(
            "no changes: all {} files already match profile {}\n",
            r.files.len(),
            r.profile
        ));
        return out;
    }
    if unchanged > 0 {
        out.push_str(&format!("{unchanged} files already up to date\n"));
    }
    for p in &r.decided_at_boot {
        out.push_str(&format!(
            "note: {p} is decided at boot: the CPU vendor is unknown under this root (an image has no /proc/cpuinfo), so it is written for either vendor; the kernel applies it on Intel (VT-d) and ignores it on AMD, whose IOMMU is on by default (--cpu-vendor chooses now)\n"
        ));
    }
    if r.dry_run {
        out.push_str("dry run: nothing written\n");
    }
    out.push_str("to activate now (kernel parameters need a reboot):\n");
    for c in &r.commands {
        out.push_str(&format!("  {c}\n"));
    }
    out
}

fn metadata(a: MetadataEnvArgs) -> CmdResult {
    let n = metadata_env::run(&a.input, &a.output).map_err(|e| match e {
        metadata_env::MetadataEnvError::Write { .. } => CliError::failed(e),
        _ => CliError::input(e),
    })?;
    match a.format {
        Format::Json => print_json(&serde_json::json!({
            "input": a.input.display().to_string(),
            "output": a.output.display().to_string(),
            "variables": n,
        }))?,
        _ => println!("wrote {n} variables to {}", a.output.display()),
    }
    Ok(ExitCode::SUCCESS)
}
