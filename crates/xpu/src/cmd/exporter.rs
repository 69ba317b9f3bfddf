//! `xpu exporter`: the node's accelerators as Prometheus metrics (xpu's and DCGM's names),
//! with health and the pod holding each device.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use xpu_integrations::exporter::{self, Config, DEFAULT_POD_RESOURCES, ExporterError};

use crate::cmd::discover::root_arg;
use crate::output::{CliError, CmdResult};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Read the host under DIR instead of / (a fixture tree, or the host mounted in a container).
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// Address to serve /metrics and /healthz on.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9402")]
    pub listen: SocketAddr,
    /// How often each source is read: 500ms, 10s, 1m. A scrape never waits longer than this.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub interval: Duration,
    /// The kubelet's PodResources socket, for the pod/namespace/container labels.
    #[arg(long, value_name = "SOCKET", default_value = DEFAULT_POD_RESOURCES)]
    pub pod_resources: PathBuf,
    /// Read every source once, print the exposition to stdout and exit.
    #[arg(long)]
    pub once: bool,
    /// With --mig, each MIG instance is exported too (`xpu_mig_instance_info` and
    /// `_memory_bytes`, with DCGM's `GPU_I_ID` and `GPU_I_PROFILE`), read every ten intervals.
    #[command(flatten)]
    pub mig: crate::cmd::MigReadArgs,
}

/// `250ms`, `10s`, `2m`; a bare number is seconds. At least 10 ms, at most an hour.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.find(|c: char| !c.is_ascii_digit()).map_or((s, "s"), |i| s.split_at(i));
    let n: u64 =
        num.parse().map_err(|_| format!("{s:?} is not a duration; use e.g. 500ms, 10s, 1m"))?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(format!("{s:?}: unknown unit {unit:?}; use ms, s or m")),
    };
    if d < Duration::from_millis(10) || d > Duration::from_secs(3600) {
        return Err(format!("{s:?}: the interval must be between 10ms and 1h"));
    }
    Ok(d)
}

pub fn run(args: Args) -> CmdResult {
    crate::output::init_tracing();
    let root = root_arg(args.root)?;
    let mig = args.mig.control()?;
    if args.once {
        let mut sources = exporter::default_sources(&root, args.interval);
        let mut snap = xpu_telemetry::collect::collect_once(&root, &mut sources);
        if let Some(m) = &mig {
            let gpus = m.gpus().map_err(|e| CliError::failed(anyhow::anyhow!("MIG: {e}")))?;
            snap.mig = xpu_telemetry::collect::mig_samples(&snap.devices, &gpus);
        }
        let text = xpu_telemetry::render::render_snapshot(&snap);
        print!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    let cfg = Config {
        root,
        listen: args.listen,
        interval: args.interval,
        pod_resources: args.pod_resources,
        mig,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::failed)?;
    rt.block_on(exporter::run(cfg, crate::cmd::k8s::shutdown_signal())).map_err(|e| match e {
        ExporterError::Listen { .. } => CliError::input(e),
    })?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_bounds() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("5ms").is_err());
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("fast").is_err());
    }
}
