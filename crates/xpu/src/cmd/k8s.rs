//! `xpu k8s`: plug this host into Kubernetes. `device-plugin` serves the kubelet device plugin
//! API; `nfd-features` writes the discovery labels where Node Feature Discovery reads them.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Subcommand, ValueEnum};
use xpu_host::{DiscoverOptions, Scope};
use xpu_integrations::deviceplugin::{self, DEFAULT_PLUGIN_DIR, Event, PluginError};
use xpu_integrations::nfd;
use xpu_integrations::selector::Resource;

use crate::cmd::discover::root_arg;
use crate::output::{CliError, CmdResult, print_json, warn_all};

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: K8sCommand,
}

#[derive(Debug, Subcommand)]
pub enum K8sCommand {
    /// Serve the kubelet device plugin API (v1beta1) for this host's accelerators, one plugin per
    /// resource, until SIGINT or SIGTERM.
    DevicePlugin(DevicePluginArgs),
    /// Write the discovery labels as a Node Feature Discovery local feature file.
    NfdFeatures(NfdArgs),
}

#[derive(Debug, clap::Args)]
pub struct DevicePluginArgs {
    /// A resource and the devices it advertises: NAME=TERM[,TERM...] with terms vendor:HEX4,
    /// device:HEX4, kind:gpu|tpu|npu|nvswitch|other, driver:NAME (repeatable). Default:
    /// nvidia.com/gpu, google.com/tpu and amd.com/gpu.
    #[arg(long = "resource", value_name = "NAME=SELECTOR")]
    pub resources: Vec<String>,
    /// The kubelet's device plugin directory (where kubelet.sock is).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PLUGIN_DIR)]
    pub plugin_dir: PathBuf,
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// How often to re-discover devices (health) and check the sockets, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..))]
    pub interval_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NfdFormat {
    Text,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct NfdArgs {
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Where to write; `-` prints the file to stdout instead. Default:
    /// ROOT/etc/kubernetes/node-feature-discovery/features.d/xpu.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Print the file that would be written, and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long, value_enum, default_value_t = NfdFormat::Text)]
    pub format: NfdFormat,
}

pub fn run(args: Args) -> CmdResult {
    match args.command {
        K8sCommand::DevicePlugin(a) => device_plugin(a),
        K8sCommand::NfdFeatures(a) => nfd_features(a),
    }
}

fn device_plugin(args: DevicePluginArgs) -> CmdResult {
    let root = root_arg(args.root)?;
    let resources = if args.resources.is_empty() {
        Resource::defaults()
    } else {
        args.resources
            .iter()
            .map(|r| r.parse::<Resource>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(CliError::input)?
    };
    let cfg = deviceplugin::Config {
        root,
        plugin_dir: args.plugin_dir,
        resources,
        interval: Duration::from_millis(args.interval_ms),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::failed)?;
    rt.block_on(async {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let printer = tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                eprintln!("xpu: {}", describe(&e));
            }
        });
        let result = deviceplugin::run(cfg, Some(tx), shutdown_signal()).await;
        let _ = printer.await;
        result
    })
    .map_err(|e| match e {
        PluginError::NoPluginDir { .. } | PluginError::Discover(_) => CliError::input(e),
        _ => CliError::failed(e),
    })?;
    Ok(ExitCode::SUCCESS)
}

/// SIGINT, or SIGTERM (what a pod's shutdown sends).
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

fn describe(e: &Event) -> String {
    match e {
        Event::Skipped { resource } => {
            format!("{resource}: no matching device on this host; not served")
        }
        Event::Serving { resource, socket, devices } => {
            format!("{resource}: serving {devices} device(s) on {}", socket.display())
        }
        Event::Registered { resource } => format!("{resource}: registered with the kubelet"),
        Event::RegisterFailed { resource, error } => {
            format!("{resource}: registration failed ({error}); retrying")
        }
        Event::Reserving { resource } => {
            format!("{resource}: its socket was removed; serving on a new one")
        }
        Event::Health { resource, id, healthy } => {
            format!("{resource}: device {id} is {}", if *healthy { "Healthy" } else { "Unhealthy" })
        }
    }
}

fn nfd_features(args: NfdArgs) -> CmdResult {
    let root = root_arg(args.root)?;
    // NFD's pci source looks at every PCI function, so the labels do too.
    let opts = DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).map_err(CliError::input)?;
    warn_all(&inv.warnings);
    let labels = xpu_core::labels::labels(&inv);
    let content = nfd::render(&labels);
    let to_stdout = args.output.as_deref() == Some(Path::new("-"));
    let path =
        args.output.clone().unwrap_or_else(|| root.path(nfd::FEATURES_DIR).join(nfd::FILE_NAME));
    nfd::check_size(&path, &content).map_err(CliError::failed)?;
    let write = !(to_stdout || args.dry_run);
    if write {
        nfd::write_atomic(&path, &content).map_err(|e| match e {
            nfd::NfdError::NoDir { .. } => CliError::input(e),
            _ => CliError::failed(e),
        })?;
    }
    match args.format {
        NfdFormat::Json => print_json(&serde_json::json!({
            "path": (!to_stdout).then(|| path.display().to_string()),
            "written": write,
            "bytes": content.len(),
            "labels": labels,
        }))?,
        NfdFormat::Text if write => println!(
            "wrote {} labels ({} bytes) to {}",
            labels.len(),
            content.len(),
            path.display()
        ),
        NfdFormat::Text => print!("{content}"),
    }
    Ok(ExitCode::SUCCESS)
}
