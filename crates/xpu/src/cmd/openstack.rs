//! `xpu openstack`: the `nova.conf` PCI passthrough configuration for this host's accelerators,
//! and whether a flavor's `pci_passthrough:alias` fits this host under a given `nova.conf`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Subcommand, ValueEnum};
use xpu_core::nova::NumaPolicy;
use xpu_host::{DiscoverOptions, Scope};
use xpu_integrations::novaconf::{self, CheckRequest, NovaConf, Part};

use crate::cmd::discover::root_arg;
use crate::cmd::format::Format;
use crate::output::{CliError, CmdResult, print_json, table, warn_all};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: OpenstackCommand,
}

#[derive(Debug, Subcommand)]
pub enum OpenstackCommand {
    /// Print the nova.conf [pci] device_spec and alias lines, the scheduler filters and the
    /// flavor commands for this host's accelerators.
    NovaConfig(NovaConfigArgs),
    /// Say whether this host satisfies a flavor's pci_passthrough:alias under a nova.conf, and
    /// why not (exit 1 when it does not).
    Check(CheckArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Only {
    /// The compute node's [pci] section.
    Compute,
    /// The controller's [pci] alias lines and [filter_scheduler].
    Controller,
    /// The openstack flavor commands.
    Flavors,
}

#[derive(Debug, clap::Args)]
pub struct NovaConfigArgs {
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Alias names: placeholders {vendor} (nvidia), {product} (a100-sxm4-40gb), {vendor_id},
    /// {product_id}, {type} (pci, pf, vf), {type_suffix} ("", -pf, -vf), {generation}.
    #[arg(long, value_name = "TEMPLATE", default_value = novaconf::DEFAULT_ALIAS_TEMPLATE)]
    pub alias_name: String,
    /// Print only one part.
    #[arg(long, value_enum)]
    pub only: Option<Only>,
    /// The devices kept for Nova on a node that also serves Kubernetes: a file of PCI
    /// addresses, one per line (a host path under the root). When it exists, only these are
    /// configured, and xpu's device plugin and DRA driver leave them out.
    #[arg(long, value_name = "FILE", default_value = xpu_host::vm_devices::VM_DEVICES)]
    pub vm_devices: String,
    #[arg(long, value_parser = Format::only(&[Format::Text, Format::Json]), default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// A nova.conf to read (repeatable; multi-valued options accumulate across files, as with
    /// nova's --config-file).
    #[arg(long = "config", value_name = "FILE", required = true)]
    pub configs: Vec<PathBuf>,
    /// The flavor's pci_passthrough:alias, e.g. 'a100:2' or 'a100:2, t4:1'.
    #[arg(long, value_name = "ALIAS:COUNT[,...]")]
    pub flavor: String,
    /// The guest's NUMA node count (hw:numa_nodes); NUMA policies apply only to guests with one.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub numa_nodes: Option<u32>,
    /// hw:pci_numa_affinity_policy, overriding the aliases' numa_policy.
    #[arg(long, value_name = "POLICY", value_parser = parse_policy)]
    pub numa_policy: Option<NumaPolicy>,
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    #[arg(long, value_parser = Format::only(&[Format::Text, Format::Json]), default_value_t = Format::Text)]
    pub format: Format,
}

fn parse_policy(s: &str) -> Result<NumaPolicy, String> {
    s.parse()
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        OpenstackCommand::NovaConfig(a) => nova_config(a),
        OpenstackCommand::Check(a) => check(a),
    }
}

fn nova_config(args: NovaConfigArgs) -> CmdResult {
    let root = root_arg(args.root)?;
    let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    warn_all(&inv.warnings);
    let kept = xpu_host::vm_devices::read(&root, &args.vm_devices).map_err(CliError::input)?;
    let plan = match &kept {
        None => novaconf::plan(&inv, &args.alias_name),
        Some(kept) => novaconf::plan_kept(&inv, &args.alias_name, kept, &args.vm_devices),
    }
    .map_err(CliError::input)?;
    if plan.aliases.is_empty() {
        return Err(CliError::failed(anyhow::anyhow!(
            "no GPU, TPU or NPU on this host to pass through; `xpu discover` lists what was found"
        )));
    }
    match args.format {
        Format::Json => print_json(&plan)?,
        // Text: `Format::only` lets only it and JSON through.
        _ => {
            let part = match args.only {
                None => Part::All,
                Some(Only::Compute) => Part::Compute,
                Some(Only::Controller) => Part::Controller,
                Some(Only::Flavors) => Part::Flavors,
            };
            print!("{}", novaconf::render(&plan, part));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn check(args: CheckArgs) -> CmdResult {
    let root = root_arg(args.root)?;
    let mut texts = Vec::new();
    for p in &args.configs {
        let text = std::fs::read_to_string(p).map_err(|e| {
            CliError::input(anyhow::anyhow!(
                "cannot read nova.conf {}: {e}; pass an existing file to --config",
                p.display()
            ))
        })?;
        texts.push((p.display().to_string(), text));
    }
    let conf = NovaConf::parse(texts.iter().map(|(n, t)| (n.as_str(), t.as_str())))
        .map_err(CliError::input)?;
    if conf.legacy_whitelist {
        eprintln!(
            "warning: [pci] passthrough_whitelist is the pre-Zed name of device_spec; rename it"
        );
    }
    // A device_spec may select any PCI function, not only accelerators.
    let opts = DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    warn_all(&inv.warnings);
    let cells = xpu_integrations::numa::host_cells(&root, &inv);
    let req = CheckRequest {
        flavor: args.flavor,
        numa_nodes: args.numa_nodes.map(|n| n as usize),
        numa_policy: args.numa_policy,
    };
    let report = novaconf::check(&conf, &inv, cells, &req).map_err(CliError::input)?;
    match args.format {
        Format::Json => print_json(&report)?,
        // Text: `Format::only` lets only it and JSON through.
        _ => {
            let verdict = if report.fits { "fits" } else { "does not fit" };
            println!("flavor pci_passthrough:alias={:?} {verdict} this host", report.flavor);
            for r in &report.requests {
                println!(
                    "  request {} x{} (numa_policy {}): any of {}",
                    r.alias,
                    r.count,
                    r.numa_policy,
                    r.specs.join(" or ")
                );
            }
            if let Some(cells) = &report.guest_numa_cells {
                let cells: Vec<String> = cells.iter().map(ToString::to_string).collect();
                println!("  guest NUMA nodes on host cell(s) {}", cells.join(","));
            }
            for r in &report.reasons {
                println!("  why: {r}");
            }
            if !report.claimed.is_empty() {
                let c: Vec<String> =
                    report.claimed.iter().map(|c| format!("{} ({})", c.address, c.alias)).collect();
                println!("  devices: {}", c.join(", "));
            }
            let rows: Vec<Vec<String>> = report
                .pools
                .iter()
                .map(|p| {
                    let tags: Vec<String> =
                        p.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    vec![
                        format!("{}:{}", p.vendor_id, p.product_id),
                        p.dev_type.to_string(),
                        p.numa_node.map_or_else(|| "-".to_owned(), |n| n.to_string()),
                        p.free.to_string(),
                        if tags.is_empty() { "-".to_owned() } else { tags.join(",") },
                    ]
                })
                .collect();
            println!();
            print!("{}", table(&["POOL", "DEVICE_TYPE", "NUMA", "FREE", "TAGS"], &rows));
        }
    }
    Ok(if report.fits { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
