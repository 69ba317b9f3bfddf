//! `xpu discover`: what accelerators this host has, which driver holds each, and whether they
//! can be passed through.

use std::path::PathBuf;
use std::process::ExitCode;

use xpu_core::{DeviceKind, Inventory};
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_telemetry::mig::GpuReport;

use crate::cmd::format::Format;
use crate::output::{CliError, CmdResult, or_dash, print_json, table, warn_all};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Read the host under this directory instead of `/` (a fixture or a mounted image).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// List every PCI function, not only accelerators and their IOMMU group peers.
    #[arg(long)]
    pub all: bool,
    #[arg(long, value_parser = Format::only(&[Format::Table, Format::Json, Format::Labels]), default_value_t = Format::Table)]
    pub format: Format,
    /// Use this pci.ids file for names.
    #[arg(long, value_name = "FILE")]
    pub pci_ids: Option<PathBuf>,
    /// With --mig, each NVIDIA GPU's MIG mode and MIG instances are listed too (profile, GPU
    /// and compute instance ids, placement, capability nodes, and whether xpu's DRA driver made
    /// it).
    #[command(flatten)]
    pub mig: crate::cmd::MigReadArgs,
}

/// Resolves `--root` (absent: the running host).
pub fn root_arg(root: Option<PathBuf>) -> Result<Root, CliError> {
    match root {
        None => Ok(Root::host()),
        Some(dir) => Root::new(dir).map_err(CliError::input),
    }
}

pub fn run(args: Args) -> CmdResult {
    let root = root_arg(args.root)?;
    if let Some(p) = &args.pci_ids
        && !p.is_file()
    {
        return Err(CliError::input(anyhow::anyhow!(
            "pci.ids file {} does not exist; pass an existing file to --pci-ids",
            p.display()
        )));
    }
    // Labels follow NFD, which looks at every PCI function.
    let scope =
        if args.all || args.format == Format::Labels { Scope::All } else { Scope::Accelerators };
    let opts = DiscoverOptions { scope, pci_ids: args.pci_ids, skip_names: false };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    warn_all(&inv.warnings);
    let mig = match args.mig.control()? {
        Some(control) => {
            let gpus = control.gpus().map_err(|e| CliError::failed(anyhow::anyhow!("MIG: {e}")))?;
            let (reports, warnings) = xpu_telemetry::mig::report(&root, &inv, &gpus);
            warn_all(&warnings);
            Some(reports)
        }
        None => None,
    };
    match args.format {
        Format::Json => match mig {
            Some(m) => {
                let mut v = serde_json::to_value(&inv).map_err(CliError::failed)?;
                v["mig"] = serde_json::to_value(m).map_err(CliError::failed)?;
                print_json(&v)?
            }
            None => print_json(&inv)?,
        },
        Format::Labels => {
            for (k, v) in xpu_core::labels::labels(&inv) {
                println!("{k}={v}");
            }
        }
        // The table: the formats `Format::only` lets through are all above.
        _ => {
            print!("{}", render_table(&inv));
            if let Some(m) = &mig {
                print!("\n{}", render_mig(m));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn render_mig(gpus: &[GpuReport]) -> String {
    let mut rows = Vec::new();
    for g in gpus {
        if g.instances.is_empty() {
            let mut row = vec![g.address.clone(), g.mig_mode.to_owned()];
            row.resize(8, "-".to_owned());
            rows.push(row);
        }
        for i in &g.instances {
            rows.push(vec![
                g.address.clone(),
                g.mig_mode.to_owned(),
                i.profile.to_owned(),
                format!("{}/{}", i.gpu_instance, i.compute_instance),
                i.start.to_string(),
                if i.by_xpu { "xpu" } else { "other" }.to_owned(),
                or_dash(i.uuid.clone()),
                if i.capability_nodes.is_empty() {
                    "-".into()
                } else {
                    i.capability_nodes.join(",")
                },
            ]);
        }
    }
    table(&["GPU", "MIG", "PROFILE", "GI/CI", "START", "MADE BY", "UUID", "CAPS"], &rows)
}

fn render_table(inv: &Inventory) -> String {
    let rows: Vec<Vec<String>> = inv
        .devices
        .iter()
        .map(|d| {
            let name = d.product.clone().or_else(|| d.device_name.clone());
            let link = match (&d.link.speed, d.link.width) {
                (Some(s), Some(w)) => format!("{s} x{w}"),
                _ => "-".to_owned(),
            };
            let nodes: Vec<&str> = d.dev_nodes.iter().map(|n| n.path.as_str()).collect();
            vec![
                d.address.to_string(),
                d.kind.to_string(),
                d.ids(),
                or_dash(name),
                or_dash(d.driver.clone()),
                or_dash(d.iommu_group),
                or_dash(d.numa_node),
                d.sriov.kind.to_string(),
                link,
                if nodes.is_empty() { "-".to_owned() } else { nodes.join(",") },
            ]
        })
        .collect();
    let mut out = table(
        &["ADDRESS", "KIND", "ID", "NAME", "DRIVER", "GROUP", "NUMA", "SRIOV", "LINK", "NODES"],
        &rows,
    );
    let mut summary: Vec<String> = DeviceKind::ALL
        .iter()
        .filter(|k| k.is_accelerator())
        .filter_map(|&k| {
            let n = inv.of_kind(k).count();
            (n > 0).then(|| format!("{n} {k}"))
        })
        .collect();
    if summary.is_empty() {
        summary.push("no accelerators".to_owned());
    }
    if let Some(v) = &inv.host.nvidia_driver_version {
        summary.push(format!("NVIDIA driver {v}"));
    }
    summary.push(format!("{} IOMMU groups", inv.host.iommu_groups));
    out.push_str(&format!("\n{}\n", summary.join("; ")));
    // AMD Instinct partitioning: the modes and the render node of each partition.
    for d in &inv.devices {
        let Some(p) = &d.partitioning else { continue };
        let nodes: Vec<&str> = p
            .partitions
            .iter()
            .map(|x| x.render_node.path.trim_start_matches("/dev/dri/"))
            .collect();
        out.push_str(&format!(
            "{}: {}{}, {} partition(s): {} (modes: {}; {})\n",
            d.address,
            p.compute,
            p.memory.as_deref().map(|m| format!("/{m}")).unwrap_or_default(),
            p.partitions.len(),
            if nodes.is_empty() { "-".to_owned() } else { nodes.join(",") },
            p.available_compute.join(","),
            p.available_memory.join(","),
        ));
    }
    out
}
