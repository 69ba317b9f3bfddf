//! `xpu vfio bind|unbind|status`: hand PCI devices to `vfio-pci` and back, refusing to break
//! IOMMU group viability, verifying each step and rolling back on failure. Kernel writes go
//! through the sysfs kernel; with `XPU_LOG=debug` each is printed to stderr as it was made.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Subcommand;
use xpu_core::PciAddress;
use xpu_host::kernel::SysfsKernel;
use xpu_host::vfio::{self, Outcome, Request, VfioError};
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_kube::dra::uses::DeviceUse;

use crate::cmd::discover::root_arg;
use crate::cmd::format::{Format, TABLE_JSON};
use crate::output::{CliError, CmdResult, or_dash, print_json, table};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: VfioCommand,
}

#[derive(Debug, Subcommand)]
pub enum VfioCommand {
    /// Bind devices to vfio-pci (driver_override, unbind, drivers_probe), verified.
    Bind(ChangeArgs),
    /// Return devices from vfio-pci to the driver they had before `xpu vfio bind`.
    Unbind(ChangeArgs),
    /// Per device: driver, IOMMU group, group viability, /dev/vfio node.
    Status(StatusArgs),
}

#[derive(Debug, clap::Args)]
pub struct ChangeArgs {
    /// PCI addresses, `dddd:bb:dd.f` or `bb:dd.f` (domain 0000).
    #[arg(value_name = "ADDRESS")]
    pub addresses: Vec<PciAddress>,
    /// Every accelerator on the host.
    #[arg(long)]
    pub all_accelerators: bool,
    /// Include the other endpoints of each device's IOMMU group.
    #[arg(long)]
    pub group: bool,
    /// Also write the udev rule and module load entry that redo this at boot.
    #[arg(long)]
    pub persist: bool,
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Print the kernel writes and file changes without making them.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// PCI addresses (default: accelerators and their IOMMU group peers).
    #[arg(value_name = "ADDRESS")]
    pub addresses: Vec<PciAddress>,
    #[arg(long)]
    pub all_accelerators: bool,
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// The DRA driver's checkpoint (a host path under the root): which claim holds a device.
    #[arg(long, value_name = "FILE", default_value = xpu_kube::dra::uses::DRA_CHECKPOINT)]
    pub dra_checkpoint: String,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

fn inventory(root: &Root) -> Result<xpu_core::Inventory, CliError> {
    // Every function: group peers of any device decide viability.
    let opts = DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true };
    xpu_host::discover(root, &opts).map_err(CliError::input)
}

fn vfio_err(e: VfioError) -> CliError {
    if e.is_input() { CliError::input(e) } else { CliError::failed(e) }
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        VfioCommand::Bind(a) => change(a, true),
        VfioCommand::Unbind(a) => change(a, false),
        VfioCommand::Status(a) => status(a),
    }
}

fn change(a: ChangeArgs, bind: bool) -> CmdResult {
    let root = root_arg(a.root)?;
    let inv = inventory(&root)?;
    let req = Request {
        addresses: a.addresses,
        all_accelerators: a.all_accelerators,
        group: a.group,
        persist: a.persist,
        dry_run: a.dry_run,
    };
    let mut kernel = SysfsKernel::new(root.clone());
    let result = if bind {
        vfio::bind(&root, &inv, &mut kernel, &req)
    } else {
        vfio::unbind(&root, &inv, &mut kernel, &req)
    };
    if std::env::var("XPU_LOG").is_ok_and(|v| v == "debug") {
        for line in kernel.log() {
            eprintln!("debug: kernel: {line}");
        }
    }
    let outcome = result.map_err(vfio_err)?;
    match a.format {
        Format::Json => print_json(&outcome)?,
        // The table: `Format::only` lets only it and JSON through.
        _ => print!("{}", render_outcome(&outcome)),
    }
    Ok(ExitCode::SUCCESS)
}

fn render_outcome(o: &Outcome) -> String {
    let mut out = String::new();
    for d in &o.devices {
        let before = d.before.as_deref().unwrap_or("no driver");
        let after = d.after.as_deref().unwrap_or("no driver");
        if d.changed {
            let verb = if o.dry_run { "would move" } else { "moved" };
            out.push_str(&format!("{}: {verb} {before} -> {after}\n", d.address));
        } else {
            out.push_str(&format!("{}: already on {before}, nothing to do\n", d.address));
        }
    }
    if !o.operations.is_empty() {
        out.push_str(if o.dry_run { "would write:\n" } else { "wrote:\n" });
        for op in &o.operations {
            out.push_str(&format!("  {op}\n"));
        }
    }
    for f in o.persisted.iter().filter(|f| f.action != "unchanged") {
        let verb = match (f.action, o.dry_run) {
            ("created", true) => "would create",
            ("created", false) => "created",
            (_, true) => "would modify",
            (_, false) => "modified",
        };
        out.push_str(&format!("{verb} {}\n{}", f.path, f.diff));
    }
    if !o.changed() {
        out.push_str("no changes\n");
    }
    out
}

fn status(a: StatusArgs) -> CmdResult {
    let root = root_arg(a.root)?;
    let inv = inventory(&root)?;
    let list = vfio::status(&root, &inv, &a.addresses, a.all_accelerators).map_err(vfio_err)?;
    let list = xpu_kube::dra::uses::uses(&root, &inv, list, &a.dra_checkpoint)
        .map_err(|e| CliError::input(anyhow::anyhow!(e)))?;
    match a.format {
        Format::Json => print_json(&list)?,
        _ => print!("{}", render_status(&list)),
    }
    Ok(ExitCode::SUCCESS)
}

fn render_status(list: &[DeviceUse]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|row| {
            let s = &row.status;
            let viable = match (s.iommu_group, s.group_viable) {
                (None, _) => "no: no IOMMU group".to_owned(),
                (_, true) => "yes".to_owned(),
                (_, false) => {
                    let b: Vec<String> = s
                        .blockers
                        .iter()
                        .map(|b| format!("{} ({})", b.address, b.driver.as_deref().unwrap_or("-")))
                        .collect();
                    format!("no: {}", b.join(", "))
                }
            };
            let node = match &s.vfio_node {
                None => "-".to_owned(),
                Some(n) if n.exists => format!("{} ({})", n.path, n.mode.as_deref().unwrap_or("?")),
                Some(n) => format!("{} missing", n.path),
            };
            vec![
                s.address.to_string(),
                s.kind.clone(),
                s.ids.clone(),
                or_dash(s.driver.clone()),
                or_dash(s.driver_override.clone()),
                or_dash(s.iommu_group),
                viable,
                node,
                or_dash(s.previous_driver.clone()),
                row.held_by.clone(),
                or_dash(row.since.clone()),
            ]
        })
        .collect();
    table(
        &[
            "ADDRESS",
            "KIND",
            "ID",
            "DRIVER",
            "OVERRIDE",
            "GROUP",
            "VIABLE",
            "VFIO NODE",
            "PREVIOUS",
            "HELD BY",
            "SINCE",
        ],
        &rows,
    )
}
