//! `xpu discover`: what accelerators this host has, which driver holds each, and whether they
//! can be passed through.

use std::path::PathBuf;
use std::process::ExitCode;

use xpu_core::{DeviceKind, Inventory};
use xpu_host::mig_caps::MigCaps;
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_telemetry::mig::MigGpu;

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
            Some(mig_rows(&root, &inv, &gpus))
        }
        None => None,
    };
    match args.format {
        Format::Json => match mig {
            Some(m) => {
                let mut v = serde_json::to_value(&inv).map_err(CliError::failed)?;
                v["mig"] = serde_json::Value::Array(m);
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

/// Each GPU the MIG control reports, with its instances and their capability nodes.
fn mig_rows(root: &Root, inv: &Inventory, gpus: &[MigGpu]) -> Vec<serde_json::Value> {
    let caps = MigCaps::read(root).ok();
    gpus.iter()
        .map(|g| {
            let minor = inv.device(&g.address).and_then(|d| {
                d.dev_nodes
                    .iter()
                    .find(|n| xpu_container::edits::is_nvidia_gpu_node(&n.path))
                    .and_then(|n| n.minor)
            });
            let instances: Vec<serde_json::Value> = g
                .instances
                .iter()
                .map(|i| {
                    let nodes: Vec<String> = match (&caps, minor) {
                        (Some(c), Some(m)) => c
                            .instance(m, i.gi, i.ci)
                            .map(|n| n.into_iter().map(|n| n.path).collect())
                            .unwrap_or_default(),
                        _ => Vec::new(),
                    };
                    serde_json::json!({
                        "gpuInstance": i.gi, "computeInstance": i.ci, "profile": i.profile,
                        "start": i.start, "uuid": i.uuid, "byXpu": i.by_xpu, "capabilityNodes": nodes,
                    })
                })
                .collect();
            serde_json::json!({
                "address": g.address.to_string(), "product": g.product,
                "migMode": if g.enabled { "enabled" } else { "disabled" },
                "instances": instances,
            })
        })
        .collect()
}

fn render_mig(gpus: &[serde_json::Value]) -> String {
    let s = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".to_owned(),
        other => other.to_string(),
    };
    let mut rows = Vec::new();
    for g in gpus {
        let instances = g["instances"].as_array().map(Vec::as_slice).unwrap_or_default();
        if instances.is_empty() {
            rows.push(vec![
                s(&g["address"]),
                s(&g["migMode"]),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
        for i in instances {
            let nodes: Vec<String> =
                i["capabilityNodes"].as_array().into_iter().flatten().map(s).collect();
            rows.push(vec![
                s(&g["address"]),
                s(&g["migMode"]),
                s(&i["profile"]),
                format!("{}/{}", s(&i["gpuInstance"]), s(&i["computeInstance"])),
                s(&i["start"]),
                if i["byXpu"].as_bool() == Some(true) { "xpu".into() } else { "other".into() },
                s(&i["uuid"]),
                if nodes.is_empty() { "-".into() } else { nodes.join(",") },
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
