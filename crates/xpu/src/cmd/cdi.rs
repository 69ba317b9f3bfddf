//! `xpu cdi generate`: Container Device Interface specs for this host's accelerators, for
//! podman, containerd, CRI-O and Docker to read from `/etc/cdi` or `/var/run/cdi`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Subcommand, ValueEnum};
use xpu_container::cdi::{self, CdiKind, GenerateError, GenerateOptions, Spec};
use xpu_host::{DiscoverOptions, Scope};

use crate::cmd::discover::root_arg;
use crate::cmd::format::Format;
use crate::output::{CliError, CmdResult, warn_all};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: CdiCommand,
}

#[derive(Debug, Subcommand)]
pub enum CdiCommand {
    /// Generate CDI specs (nvidia.com/gpu, google.com/tpu, amd.com/gpu) from this host.
    Generate(GenerateArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Vendor {
    Nvidia,
    Google,
    Amd,
    All,
}

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Read the host under this directory instead of `/`; mount sources then point into it.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Vendor::All)]
    pub vendor: Vendor,
    /// Output format; default: from the --output extension, else yaml.
    #[arg(long, value_parser = Format::only(&[Format::Json, Format::Yaml]))]
    pub format: Option<Format>,
    /// Write here (atomically) instead of stdout: a file for one spec, or a directory such as
    /// /etc/cdi for one file per kind.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Print what would be written, and where, without writing.
    #[arg(long)]
    pub dry_run: bool,
    /// With --output DIR and every vendor: do not write the host snapshot
    /// (`xpu-host.snapshot`) that lets the runtime shim skip discovery while it is current.
    #[arg(long)]
    pub no_snapshot: bool,
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        CdiCommand::Generate(a) => generate(a),
    }
}

fn render(spec: &Spec, format: Format) -> String {
    match format {
        Format::Json => cdi::to_json(spec),
        // YAML: the other format `Format::only` lets through.
        _ => cdi::to_yaml(spec),
    }
}

fn generate(args: GenerateArgs) -> CmdResult {
    let root = root_arg(args.root)?;
    let kinds: Vec<CdiKind> = match args.vendor {
        Vendor::Nvidia => vec![CdiKind::NvidiaGpu],
        Vendor::Google => vec![CdiKind::GoogleTpu],
        Vendor::Amd => vec![CdiKind::AmdGpu],
        Vendor::All => CdiKind::ALL.to_vec(),
    };
    let format = args.format.unwrap_or_else(|| {
        match args.output.as_deref().and_then(Path::extension).and_then(|e| e.to_str()) {
            Some("json") => Format::Json,
            _ => Format::Yaml,
        }
    });

    // The key first: a change while the host is read makes the snapshot stale, never a
    // snapshot of a mix that passes as current.
    let key = xpu_host::host_key(&root);
    let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    warn_all(&inv.warnings);
    let files = if kinds.contains(&CdiKind::NvidiaGpu)
        && !cdi::devices_of(&inv, CdiKind::NvidiaGpu).is_empty()
    {
        xpu_host::driver_files::find(&root, inv.host.nvidia_driver_version.as_deref())
    } else {
        Default::default()
    };
    warn_all(&files.warnings);
    let gen_opts = GenerateOptions {
        kinds,
        strict: args.vendor != Vendor::All,
        host_root: root.base().to_path_buf(),
    };
    // No devices, or a device whose nodes cannot be described: the check failed (exit 1).
    let generated = match cdi::generate(&inv, &files, &gen_opts) {
        Ok(g) => g,
        Err(e) => {
            if let GenerateError::Nothing { left_out } = &e {
                warn_all(left_out);
            }
            return Err(CliError::failed(e));
        }
    };
    warn_all(&generated.warnings);
    let specs = &generated.specs;

    let Some(out) = args.output else {
        print_specs(specs, format);
        return Ok(ExitCode::SUCCESS);
    };
    let targets: Vec<(PathBuf, &Spec)> = if out.is_dir() {
        specs.iter().map(|s| (out.join(cdi::file_name(s, format == Format::Json)), s)).collect()
    } else if specs.len() == 1 {
        vec![(out.clone(), &specs[0])]
    } else {
        return Err(CliError::input(anyhow::anyhow!(
            "this host has {} kinds of devices ({}) but --output {} is a single file; pass a directory such as /etc/cdi, or one --vendor",
            specs.len(),
            specs.iter().map(|s| s.kind.as_str()).collect::<Vec<_>>().join(", "),
            out.display()
        )));
    };
    for (path, spec) in targets {
        let text = render(spec, format);
        if args.dry_run {
            println!("# would write {}", path.display());
            print!("{text}");
            continue;
        }
        cdi::write(&path, text.as_bytes()).map_err(|e| {
            CliError::failed(anyhow::anyhow!(
                "writing {} failed: {e}; check the directory exists and is writable",
                path.display()
            ))
        })?;
        println!("wrote {}: {}, {} devices", path.display(), spec.kind, spec.devices.len());
    }
    if out.is_dir() && args.vendor == Vendor::All && !args.no_snapshot {
        write_snapshot(&root, key, &out, args.dry_run)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The host snapshot beside the specs: what the shim's own discovery returns (every
/// accelerator, device nodes only) and the driver files for every capability.
fn write_snapshot(root: &xpu_host::Root, key: String, dir: &Path, dry_run: bool) -> CmdResult {
    use xpu_container::snapshot::FILE_NAME;
    let snap = xpu_shim::host_snapshot(root, key).map_err(CliError::input)?;
    let devices = snap.inventory.devices.len();
    let path = dir.join(FILE_NAME);
    if dry_run {
        println!("# would write {} ({devices} devices)", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    cdi::write(&path, snap.to_json().as_bytes()).map_err(|e| {
        CliError::failed(anyhow::anyhow!(
            "writing {} failed: {e}; check the directory is writable, or pass --no-snapshot",
            path.display()
        ))
    })?;
    println!("wrote {}: host snapshot for the runtime shim, {devices} devices", path.display());
    Ok(ExitCode::SUCCESS)
}

/// One spec as itself; several as a JSON array or a YAML stream.
fn print_specs(specs: &[Spec], format: Format) {
    match (format, specs) {
        (_, [one]) => print!("{}", render(one, format)),
        (Format::Json, many) => {
            let s = serde_json::to_string_pretty(many).unwrap_or_default();
            println!("{s}");
        }
        (_, many) => {
            for s in many {
                println!("---");
                print!("{}", cdi::to_yaml(s));
            }
        }
    }
}
