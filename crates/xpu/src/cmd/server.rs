//! `xpu serve` and the commands that talk to it: `submit`, `jobs`, `job`, `logs`, `cancel`,
//! `devices`. The client commands reach the daemon over its Unix socket (default
//! `/var/lib/xpu/xpu.sock`, or `$XPU_SERVER`) or `--server http://HOST:PORT` with the token from
//! `--token-file` / `$XPU_TOKEN` when the daemon is not on loopback.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::anyhow;
use serde_json::json;
use xpu_server::client::{Client, ClientError, Target};
use xpu_server::wire::{self, DeviceList, JobDetail, JobList, JobState, ListParams, LogParams};

use crate::cmd::format::{Format, TABLE_JSON};
use crate::output::{CliError, CmdResult, or_dash, print_json, table};

/// Where `xpu serve` keeps its database, token, socket and task directories by default.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/xpu";

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Also serve HTTP on this TCP address (the dashboard); off-loopback needs the token.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8470")]
    pub listen: Option<SocketAddr>,
    /// Serve only the Unix socket.
    #[arg(long, conflicts_with = "listen")]
    pub no_tcp: bool,
    /// Unix socket path [default: <data-dir>/xpu.sock].
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Store: sqlite:///path/xpu.db or postgres://user@host:port/db [default: sqlite://<data-dir>/xpu.db].
    #[arg(long, value_name = "URL")]
    pub db: Option<String>,
    /// Read the host under this directory instead of `/`.
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    #[arg(long, value_name = "DIR", default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// Add fake accelerators (testing without hardware), e.g. nvidia-a100:8 or tpu-v6e:8.
    #[arg(long, value_name = "NAME:COUNT")]
    pub devices: Vec<String>,
    /// Extra node label matched by nodeSelector, e.g. cloud.google.com/gke-flex-start=true.
    #[arg(long, value_name = "KEY=VALUE")]
    pub label: Vec<String>,
    /// Node name [default: the host name].
    #[arg(long)]
    pub node_name: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when a task is stopped.
    #[arg(long, default_value_t = 10)]
    pub grace_seconds: u64,
    /// Seconds before a task is restarted in place (restartPolicy OnFailure, a Pod's Always),
    /// doubled per restart up to 300, as the kubelet's crash-loop back-off; 0 restarts at once.
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(0..=300))]
    pub restart_backoff_seconds: u64,
    /// Seconds a client has to send a request's head, from connecting or from its previous
    /// response (so also how long an idle connection stays open), and again for its body.
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub request_timeout_seconds: u64,
    /// Seconds a client may leave a response unread before it is disconnected.
    #[arg(long, value_name = "SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub send_timeout_seconds: u64,
    /// Connections open at once on each listener (socket, TCP); more wait to be accepted.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub max_connections: u32,
    /// Print the node and settings the daemon would use, and exit.
    /// With --mps-dir, a task with a share of an NVIDIA GPU (gpuMilli) is a client of the GPU's
    /// MPS daemon, which stops after the GPU's last share task.
    #[command(flatten)]
    pub mps: crate::cmd::MpsArgs,
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub log: crate::output::LogArgs,
}

pub fn serve(args: ServeArgs) -> CmdResult {
    // Every job and task state change, runtime call, leadership change and store error is an
    // event on stderr (journald under systemd).
    if !args.dry_run {
        crate::output::init_tracing_with(&args.log);
    }
    let mut opts = xpu_server::ServeOptions::new(args.data_dir);
    opts.listen = if args.no_tcp { None } else { args.listen };
    opts.socket = args.socket;
    opts.db = args.db;
    opts.root = crate::cmd::discover::root_arg(args.root)?;
    opts.devices = args
        .devices
        .iter()
        .map(|d| xpu_server::node::parse_fake(d))
        .collect::<Result<_, _>>()
        .map_err(CliError::input)?;
    opts.labels = args
        .label
        .iter()
        .map(|l| xpu_server::node::parse_label(l))
        .collect::<Result<_, _>>()
        .map_err(CliError::input)?;
    opts.node_name = args.node_name;
    if let Some(dir) = args.mps.mps_dir {
        if !dir.is_absolute() {
            return Err(CliError::input(anyhow::anyhow!(
                "--mps-dir {}: give an absolute path (MPS clients are given paths under it)",
                dir.display()
            )));
        }
        opts.mps = Some(xpu_server::MpsOptions { dir, control: args.mps.mps_control });
    }
    opts.grace = Duration::from_secs(args.grace_seconds);
    opts.restart_backoff = Duration::from_secs(args.restart_backoff_seconds);
    opts.http = xpu_server::listen::HttpLimits {
        max_connections: args.max_connections as usize,
        request_timeout: Duration::from_secs(args.request_timeout_seconds),
        send_timeout: Duration::from_secs(args.send_timeout_seconds),
    };
    if args.dry_run {
        let node = xpu_server::node_for(&opts).map_err(CliError::failed)?;
        print_json(&json!({
            "listen": opts.listen.map(|a| a.to_string()),
            "socket": opts.socket_path(),
            "db": opts.db_url(),
            "data_dir": opts.data_dir,
            "max_connections": opts.http.max_connections,
            "request_timeout_seconds": opts.http.request_timeout.as_secs(),
            "send_timeout_seconds": opts.http.send_timeout.as_secs(),
            "node": node,
        }))?;
        return Ok(ExitCode::SUCCESS);
    }
    // The banner once the daemon serves; a start that fails prints only its error.
    let banner = format!(
        "xpu serve: socket {}{}, store {}",
        opts.socket_path().display(),
        opts.listen.map(|a| format!(", dashboard http://{a}/")).unwrap_or_default(),
        opts.db_url()
    );
    // With a JSON log, the banner and warnings are events too, so every stderr line parses.
    let json = args.log.json();
    opts.notify = xpu_server::Notify::new(move |n| match n {
        xpu_server::Notice::Warning(w) if json => tracing::warn!("{w}"),
        xpu_server::Notice::Warning(w) => crate::output::warn_all(&[w.to_owned()]),
        xpu_server::Notice::Serving if json => tracing::info!(kind = "serving", "{banner}"),
        xpu_server::Notice::Serving => eprintln!("{banner}"),
    });
    xpu_server::serve_blocking(opts)
        .map_err(|e| CliError::failed(anyhow::Error::msg(xpu_core::error::chain_once(&e))))?;
    Ok(ExitCode::SUCCESS)
}

/// How a client command reaches the daemon.
#[derive(Debug, clap::Args)]
pub struct Conn {
    /// The daemon: unix:///path/xpu.sock or http://HOST:PORT [default: $XPU_SERVER, else
    /// /var/lib/xpu/xpu.sock].
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// File holding the bearer token (the daemon's <data-dir>/token) [default: $XPU_TOKEN].
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Wait up to this many seconds for the daemon to answer before sending the request (for
    /// scripts that have just started `xpu serve`).
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0)]
    pub wait_server: f64,
}

impl Conn {
    fn client(&self) -> Result<Client, CliError> {
        let url = self
            .server
            .clone()
            .or_else(|| std::env::var("XPU_SERVER").ok())
            .unwrap_or_else(|| format!("unix://{DEFAULT_DATA_DIR}/xpu.sock"));
        let target = Target::parse(&url).map_err(CliError::input)?;
        let token = match &self.token_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| {
                        CliError::input(anyhow!("reading token file {}: {e}", f.display()))
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => std::env::var("XPU_TOKEN").ok(),
        };
        let mut client = Client::new(target, token);
        if self.wait_server > 0.0 {
            wait_for(&mut client, self.wait_server)?;
        }
        Ok(client)
    }
}

/// Waits up to `seconds` for the daemon to answer (`--wait-server`).
fn wait_for(client: &mut Client, seconds: f64) -> Result<(), CliError> {
    if !seconds.is_finite() || seconds > 86_400.0 {
        return Err(CliError::input(anyhow!(
            "--wait-server {seconds}: give a number of seconds from 0 to 86400"
        )));
    }
    client
        .wait_until_answering(Duration::from_secs_f64(seconds))
        .map_err(|e| CliError::failed(anyhow!("{e} (waited {seconds} s)")))
}

/// Prints `value` as the API sent it with `--format json`, else as `human` shows it.
fn show<T: serde::Serialize>(format: Format, value: &T, human: impl FnOnce(&T)) -> CmdResult {
    match format {
        Format::Json => print_json(value)?,
        // Table: `Format::only(TABLE_JSON)` lets only it and JSON through.
        _ => human(value),
    }
    Ok(ExitCode::SUCCESS)
}

/// A client error as the CLI reports it: what the daemon refused (4xx) is the user's input
/// (exit 2); the rest, its failures and the transport's, exit 1.
fn cli_error(e: ClientError) -> CliError {
    if e.is_refusal() { CliError::input(e) } else { CliError::failed(e) }
}

/// The short form's manifest for `xpu submit -- CMD` (`xpu_core::job`'s short form).
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ShortForm<'a> {
    command: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    gpus: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_milli: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    queue: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<i32>,
}

#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// A Kubernetes Job/Pod manifest or xpu's short form (YAML or JSON); `-` reads stdin.
    #[arg(value_name = "FILE", required_unless_present = "command")]
    pub file: Option<PathBuf>,
    /// GPUs per task for a command given after `--` (0 for none).
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// A share of one GPU per task instead, in thousandths (250 is a quarter), shared with
    /// other tasks.
    #[arg(long, value_name = "MILLI", conflicts_with = "gpus", value_parser = clap::value_parser!(u16).range(1..=999))]
    pub gpu_milli: Option<u16>,
    #[arg(long)]
    pub name: Option<String>,
    #[arg(long)]
    pub queue: Option<String>,
    #[arg(long)]
    pub priority: Option<i32>,
    /// Idempotency key: submitting again with the same key returns the first job.
    #[arg(long)]
    pub key: Option<String>,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
    /// The program and its arguments, after `--`.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub fn submit(args: SubmitArgs) -> CmdResult {
    let body: Vec<u8> = match (&args.file, args.command.is_empty()) {
        (Some(_), false) => {
            return Err(CliError::input(anyhow!("give either FILE or -- CMD, not both")));
        }
        (Some(f), true) => {
            let mut buf = Vec::new();
            if f.as_os_str() == "-" {
                std::io::stdin()
                    .read_to_end(&mut buf)
                    .map_err(|e| CliError::input(anyhow!("reading stdin: {e}")))?;
            } else {
                buf = std::fs::read(f)
                    .map_err(|e| CliError::input(anyhow!("reading {}: {e}", f.display())))?;
            }
            buf
        }
        (None, _) => {
            let short = ShortForm {
                command: &args.command,
                gpus: args.gpu_milli.is_none().then_some(args.gpus.unwrap_or(0)),
                gpu_milli: args.gpu_milli,
                name: args.name.as_deref(),
                queue: args.queue.as_deref(),
                priority: args.priority,
            };
            serde_json::to_vec(&short).map_err(CliError::failed)?
        }
    };
    let mut client = args.conn.client()?;
    let answer = client.submit(&body, args.key.as_deref()).map_err(cli_error)?;
    show(args.format, &answer, |answer| {
        for n in &answer.notes {
            eprintln!("note: {n}");
        }
        // One id per line: a file of several Jobs and Pods submits each.
        for j in &answer.jobs {
            println!("{}", j.id);
        }
    })
}

#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Only jobs in this state: queued, running, succeeded, failed, cancelled.
    #[arg(long, value_parser = |s: &str| s.parse::<JobState>())]
    pub state: Option<JobState>,
    /// Page size (newest first).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=i64::from(wire::MAX_PAGE)))]
    pub limit: u32,
    /// Continue after this id (the `next` of the previous page).
    #[arg(long)]
    pub before: Option<i64>,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

/// A time in ms since the epoch as a UTC calendar date and time, `-` for none.
fn ms_to_time(ms: Option<i64>) -> String {
    ms.and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(|| "-".to_owned(), |t| t.strftime("%Y-%m-%d %H:%M:%S").to_string())
}

pub fn jobs(args: JobsArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    let params = ListParams { state: args.state, before: args.before, limit: Some(args.limit) };
    let page = client.jobs(&params).map_err(cli_error)?;
    show(args.format, &page, print_jobs)
}

fn print_jobs(page: &JobList) {
    let rows: Vec<Vec<String>> = page
        .jobs
        .iter()
        .map(|j| {
            vec![
                j.id.to_string(),
                j.name.clone(),
                j.state.to_string(),
                j.queue.clone(),
                j.priority.to_string(),
                ms_to_time(Some(j.submitted_at_ms)),
                ms_to_time(j.finished_at_ms),
                or_dash(j.message.as_deref()),
            ]
        })
        .collect();
    let head = ["ID", "NAME", "STATE", "QUEUE", "PRIO", "SUBMITTED", "FINISHED", "MESSAGE"];
    print!("{}", table(&head, &rows));
    if let Some(n) = page.next {
        println!("more: xpu jobs --before {n}");
    }
}

#[derive(Debug, clap::Args)]
pub struct JobArgs {
    #[command(flatten)]
    pub conn: Conn,
    pub id: i64,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

pub fn job(args: JobArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    let v = client.job(args.id).map_err(cli_error)?;
    show(args.format, &v, print_job)
}

fn print_job(v: &JobDetail) {
    let j = &v.job;
    println!("id:        {}", j.id);
    println!("name:      {}", j.name);
    println!("state:     {}", j.state);
    println!("queue:     {} (priority {})", j.queue, j.priority);
    println!("submitted: {}", ms_to_time(Some(j.submitted_at_ms)));
    println!("started:   {}", ms_to_time(j.started_at_ms));
    println!("finished:  {}", ms_to_time(j.finished_at_ms));
    println!("failures:  {}", j.failures);
    if let Some(m) = &j.message {
        println!("message:   {m}");
    }
    if let Some(r) = v.reason.as_deref().filter(|r| !r.is_empty()) {
        println!("waiting:   position {} — {r}", or_dash(v.queue_position));
    }
    let argv = v.spec.as_ref().map(|s| s.container.argv.join(" ")).unwrap_or_default();
    println!("command:   {argv}");
    let rows: Vec<Vec<String>> = v
        .tasks
        .iter()
        .map(|t| {
            vec![
                t.idx.to_string(),
                t.attempt.to_string(),
                t.state.as_str().to_owned(),
                or_dash(t.pid),
                or_dash(t.exit_code),
                format!("{:?}", t.devices),
            ]
        })
        .collect();
    if !rows.is_empty() {
        println!();
        print!("{}", table(&["TASK", "ATTEMPT", "STATE", "PID", "EXIT", "DEVICES"], &rows));
    }
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    #[command(flatten)]
    pub conn: Conn,
    pub id: i64,
    /// Task (completion index).
    #[arg(long, default_value_t = 0)]
    pub task: u32,
    /// Keep streaming until the task ends.
    #[arg(short, long)]
    pub follow: bool,
}

pub fn logs(args: LogsArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    let params = LogParams {
        task: Some(i64::from(args.task)),
        follow: Some(args.follow),
        ..LogParams::default()
    };
    let mut out = std::io::stdout().lock();
    let mut written = Ok(());
    client
        .logs(args.id, &params, &mut |chunk| {
            if written.is_ok() {
                written = out.write_all(chunk).and_then(|()| out.flush());
            }
        })
        .map_err(cli_error)?;
    // A reader that went away (`xpu logs 1 | head`) has what it wanted.
    match written {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::failed(anyhow!("writing the log to stdout: {e}")))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub conn: Conn,
    pub id: i64,
}

pub fn cancel(args: CancelArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    client.cancel(args.id).map_err(cli_error)?;
    println!("job {} cancelled", args.id);
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
pub struct DevicesArgs {
    #[command(flatten)]
    pub conn: Conn,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

pub fn devices(args: DevicesArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    let v = client.devices().map_err(cli_error)?;
    show(args.format, &v, print_devices)
}

fn print_devices(v: &DeviceList) {
    let rows: Vec<Vec<String>> = v
        .devices
        .iter()
        .map(|d| {
            let held: Vec<String> = d
                .holders
                .iter()
                .map(|h| {
                    let share =
                        if h.milli < 1000 { format!(" {}m", h.milli) } else { String::new() };
                    format!("job {} ({}) task {}{share}", h.job, h.name, h.task)
                })
                .collect();
            let holder = match (held.is_empty(), d.outside_use()) {
                (false, _) => held.join(", "),
                (true, Some(u)) => u.to_owned(),
                (true, None) => "free".to_owned(),
            };
            let dev = &d.device;
            vec![
                dev.id.to_string(),
                dev.kind.as_str().to_owned(),
                dev.product.clone(),
                dev.address.clone(),
                holder,
            ]
        })
        .collect();
    print!("{}", table(&["ID", "KIND", "PRODUCT", "ADDRESS", "HOLDER"], &rows));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_is_printed_once() {
        #[derive(Debug)]
        struct E(&'static str, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let os = E("file is not a database", None);
        let e = E(
            "opening the store",
            Some(Box::new(E("sqlite: file is not a database", Some(Box::new(os))))),
        );
        assert_eq!(
            xpu_core::error::chain_once(&e),
            "opening the store: sqlite: file is not a database"
        );
    }

    #[test]
    fn civil_time() {
        assert_eq!(ms_to_time(Some(0)), "1970-01-01 00:00:00");
        assert_eq!(ms_to_time(Some(1_700_000_000_000)), "2023-11-14 22:13:20");
        assert_eq!(ms_to_time(None), "-");
    }
}
