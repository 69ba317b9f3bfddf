//! The `xpu` binary: argument parsing and output only. Every subcommand is one call into a
//! library crate; nothing here reads the host or makes decisions.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod cmd;
mod output;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// `xpu --version`: the package version and the git commit it was built from.
const VERSION: &str = xpu_shim::VERSION_LINE;

/// Accelerators for AI work, from one host to a fleet.
#[derive(Debug, Parser)]
#[command(name = "xpu", version = VERSION, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List accelerators (GPUs, TPUs, NPUs, NVSwitches) and their IOMMU group peers.
    Discover(cmd::discover::Args),
    /// Check that the host is ready for a profile (vfio-host, tpu-vm, container-host, all).
    Doctor(cmd::doctor::Args),
    /// Render or apply the files that make a host ready; tpu-env metadata to an env file.
    Host(cmd::host::Args),
    /// Bind devices to vfio-pci and back, keeping IOMMU groups viable.
    Vfio(cmd::vfio::Args),
    /// Kubernetes: the kubelet device plugin and Node Feature Discovery features.
    K8s(cmd::k8s::Args),
    /// OpenStack: nova.conf PCI passthrough configuration and flavor checks.
    Openstack(cmd::openstack::Args),
    /// Prometheus exporter for every accelerator (xpu's and DCGM's metric names), with health
    /// and the pod holding each device.
    Exporter(cmd::exporter::Args),
    /// Run the job daemon: HTTP API, store, scheduler, executor, dashboard, metrics.
    Serve(cmd::server::ServeArgs),
    /// Submit a job (a Kubernetes Job manifest, or `--gpus N -- CMD ARGS`); prints its id.
    Submit(cmd::server::SubmitArgs),
    /// List jobs, newest first.
    Jobs(cmd::server::JobsArgs),
    /// Show one job with its tasks.
    Job(cmd::server::JobArgs),
    /// Print a task's output (`-f` follows it).
    Logs(cmd::server::LogsArgs),
    /// Cancel a job.
    Cancel(cmd::server::CancelArgs),
    /// The daemon's devices and who holds them.
    Devices(cmd::server::DevicesArgs),
    /// Container Device Interface specs for this host's accelerators.
    Cdi(cmd::cdi::Args),
    /// OCI runtime shim in front of runc (also installed as xpu-container-runtime).
    Runtime(cmd::runtime::Args),
    /// OCI createRuntime/prestart hook injecting the devices a container asks for.
    Hook(cmd::hook::Args),
    /// Scheduler simulator: the OpenB placement benchmark and trace replay.
    Sim(cmd::sim::Args),
    /// Shell completion script for bash, zsh or fish, to stdout (for packaging).
    #[command(hide = true)]
    Completions(cmd::generate::CompletionsArgs),
    /// Man pages, one per command, into a directory (for packaging).
    #[command(hide = true)]
    Man(cmd::generate::ManArgs),
}

/// `xpu jobs | head`: when whoever reads stdout goes away, stop quietly with the status a
/// process killed by SIGPIPE has, as Unix tools do. Rust ignores SIGPIPE, so a `println!` to a
/// closed pipe panics instead, and this crate forbids the unsafe call that would restore the
/// signal; the hook turns exactly that panic into the quiet exit and leaves every other panic
/// to the default hook.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(128 + 13);
        }
        default(info);
    }));
}

fn main() -> ExitCode {
    quiet_on_broken_pipe();
    // The runtime shim takes runc's command line verbatim: clap never sees it.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let invoked_as = argv.first().map(std::path::Path::new).and_then(|p| p.file_name());
    if invoked_as.is_some_and(|n| n == "xpu-container-runtime") {
        return cmd::runtime::run(argv[1..].to_vec());
    }
    if argv.get(1).is_some_and(|a| a == "runtime") {
        return cmd::runtime::run(argv[2..].to_vec());
    }
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
        Command::Doctor(args) => cmd::doctor::run(args),
        Command::Host(args) => cmd::host::run(args),
        Command::Vfio(args) => cmd::vfio::run(args),
        Command::K8s(args) => cmd::k8s::run(args),
        Command::Openstack(args) => cmd::openstack::run(args),
        Command::Exporter(args) => cmd::exporter::run(args),
        Command::Serve(args) => cmd::server::serve(args),
        Command::Submit(args) => cmd::server::submit(args),
        Command::Jobs(args) => cmd::server::jobs(args),
        Command::Job(args) => cmd::server::job(args),
        Command::Logs(args) => cmd::server::logs(args),
        Command::Cancel(args) => cmd::server::cancel(args),
        Command::Devices(args) => cmd::server::devices(args),
        Command::Cdi(args) => cmd::cdi::run(args),
        Command::Runtime(args) => return cmd::runtime::run(args.args),
        Command::Hook(args) => cmd::hook::run(args),
        Command::Sim(args) => cmd::sim::run(args),
        Command::Completions(args) => cmd::generate::completions(args, Cli::command()),
        Command::Man(args) => cmd::generate::man(args, Cli::command()),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => e.report(),
    };
    output::report_peak_rss();
    code
}
