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
use serde_json::{Value, json};
use xpu_server::client::{Client, Response, Target};

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
    opts.notify = xpu_server::Notify::new(move |n| match n {
        xpu_server::Notice::Warning(w) => crate::output::warn_all(&[w.to_owned()]),
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

/// Sends a request; 4xx become input errors (exit 2), 5xx and transport failures exit 1.
fn call(
    client: &mut Client,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> Result<Response, CliError> {
    let r = client.request(method, path, body, headers).map_err(CliError::failed)?;
    if (400..500).contains(&r.status) {
        return Err(CliError::input(anyhow!("{}", r.error_message())));
    }
    if r.status >= 500 {
        return Err(CliError::failed(anyhow!("server error {}: {}", r.status, r.error_message())));
    }
    Ok(r)
}

fn json_of(r: &Response) -> Result<Value, CliError> {
    r.json()
        .ok_or_else(|| CliError::failed(anyhow!("the daemon answered something that is not JSON")))
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
            let mut m = serde_json::Map::new();
            m.insert("command".into(), json!(args.command));
            match args.gpu_milli {
                Some(milli) => m.insert("gpuMilli".into(), json!(milli)),
                None => m.insert("gpus".into(), json!(args.gpus.unwrap_or(0))),
            };
            if let Some(n) = &args.name {
                m.insert("name".into(), json!(n));
            }
            if let Some(q) = &args.queue {
                m.insert("queue".into(), json!(q));
            }
            if let Some(p) = args.priority {
                m.insert("priority".into(), json!(p));
            }
            Value::Object(m).to_string().into_bytes()
        }
    };
    let mut client = args.conn.client()?;
    let mut headers = vec![("Content-Type", "application/yaml")];
    if let Some(k) = &args.key {
        headers.push(("Idempotency-Key", k.as_str()));
    }
    let r = call(&mut client, "POST", "/v1/jobs", Some(&body), &headers)?;
    let v = json_of(&r)?;
    match args.format {
        Format::Json => print_json(&v)?,
        _ => {
            if let Some(notes) = v["notes"].as_array() {
                for n in notes.iter().filter_map(Value::as_str) {
                    eprintln!("note: {n}");
                }
            }
            // One id per line: a file of several Jobs and Pods submits each.
            match v["jobs"].as_array() {
                Some(jobs) if !jobs.is_empty() => {
                    for j in jobs {
                        println!("{}", j["id"]);
                    }
                }
                _ => println!("{}", v["id"]),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// Only jobs in this state: queued, running, succeeded, failed, cancelled.
    #[arg(long)]
    pub state: Option<String>,
    /// Page size (newest first).
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Continue after this id (the `next` of the previous page).
    #[arg(long)]
    pub before: Option<i64>,
    #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
    pub format: Format,
}

fn ms_to_time(ms: Option<i64>) -> String {
    let Some(ms) = ms else { return "-".to_owned() };
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

pub fn jobs(args: JobsArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    let mut path = format!("/v1/jobs?limit={}", args.limit);
    if let Some(s) = &args.state {
        path.push_str(&format!("&state={s}"));
    }
    if let Some(b) = args.before {
        path.push_str(&format!("&before={b}"));
    }
    let v = json_of(&call(&mut client, "GET", &path, None, &[])?)?;
    match args.format {
        Format::Json => print_json(&v)?,
        _ => {
            let rows: Vec<Vec<String>> = v["jobs"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|j| {
                    vec![
                        j["id"].to_string(),
                        j["name"].as_str().unwrap_or("").to_owned(),
                        j["state"].as_str().unwrap_or("").to_owned(),
                        j["queue"].as_str().unwrap_or("").to_owned(),
                        j["priority"].to_string(),
                        ms_to_time(j["submitted_at_ms"].as_i64()),
                        ms_to_time(j["finished_at_ms"].as_i64()),
                        or_dash(j["message"].as_str()),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &["ID", "NAME", "STATE", "QUEUE", "PRIO", "SUBMITTED", "FINISHED", "MESSAGE"],
                    &rows
                )
            );
            if let Some(n) = v["next"].as_i64() {
                println!("more: xpu jobs --before {n}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
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
    let v = json_of(&call(&mut client, "GET", &format!("/v1/jobs/{}", args.id), None, &[])?)?;
    match args.format {
        Format::Json => print_json(&v)?,
        _ => {
            println!("id:        {}", v["id"]);
            println!("name:      {}", v["name"].as_str().unwrap_or(""));
            println!("state:     {}", v["state"].as_str().unwrap_or(""));
            println!(
                "queue:     {} (priority {})",
                v["queue"].as_str().unwrap_or(""),
                v["priority"]
            );
            println!("submitted: {}", ms_to_time(v["submitted_at_ms"].as_i64()));
            println!("started:   {}", ms_to_time(v["started_at_ms"].as_i64()));
            println!("finished:  {}", ms_to_time(v["finished_at_ms"].as_i64()));
            println!("failures:  {}", v["failures"]);
            if let Some(m) = v["message"].as_str() {
                println!("message:   {m}");
            }
            if let Some(r) = v["reason"].as_str().filter(|r| !r.is_empty()) {
                println!("waiting:   position {} — {r}", v["queue_position"]);
            }
            let argv: Vec<&str> = v["spec"]["container"]["argv"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            println!("command:   {}", argv.join(" "));
            let rows: Vec<Vec<String>> = v["tasks"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|t| {
                    vec![
                        t["idx"].to_string(),
                        t["attempt"].to_string(),
                        t["state"].as_str().unwrap_or("").to_owned(),
                        or_dash(t["pid"].as_i64()),
                        or_dash(t["exit_code"].as_i64()),
                        t["devices"].to_string(),
                    ]
                })
                .collect();
            if !rows.is_empty() {
                println!();
                print!("{}", table(&["TASK", "ATTEMPT", "STATE", "PID", "EXIT", "DEVICES"], &rows));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
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
    let path = format!("/v1/jobs/{}/logs?task={}&follow={}", args.id, args.task, args.follow);
    let mut out = std::io::stdout().lock();
    let mut err_body = Vec::new();
    let status = client
        .request_streaming("GET", &path, None, &[], &mut |status, chunk| {
            if status < 400 {
                let _ = out.write_all(chunk);
                let _ = out.flush();
            } else {
                err_body.extend_from_slice(chunk);
            }
        })
        .map_err(CliError::failed)?;
    if status >= 400 {
        let r = Response { status, body: err_body };
        return Err(if status < 500 {
            CliError::input(anyhow!("{}", r.error_message()))
        } else {
            CliError::failed(anyhow!("{}", r.error_message()))
        });
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub conn: Conn,
    pub id: i64,
}

pub fn cancel(args: CancelArgs) -> CmdResult {
    let mut client = args.conn.client()?;
    call(&mut client, "POST", &format!("/v1/jobs/{}/cancel", args.id), None, &[])?;
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
    let v = json_of(&call(&mut client, "GET", "/v1/devices", None, &[])?)?;
    match args.format {
        Format::Json => print_json(&v)?,
        _ => {
            let rows: Vec<Vec<String>> = v["devices"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|d| {
                    let held: Vec<String> = d["holders"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                        .iter()
                        .map(|h| {
                            let share = match h["milli"].as_u64() {
                                Some(m) if m < 1000 => format!(" {m}m"),
                                _ => String::new(),
                            };
                            format!(
                                "job {} ({}) task {}{share}",
                                h["job"],
                                h["name"].as_str().unwrap_or(""),
                                h["task"]
                            )
                        })
                        .collect();
                    let holder = if held.is_empty() { "free".to_owned() } else { held.join(", ") };
                    vec![
                        d["id"].to_string(),
                        d["kind"].as_str().unwrap_or("").to_owned(),
                        d["product"].as_str().unwrap_or("").to_owned(),
                        d["address"].as_str().unwrap_or("").to_owned(),
                        holder,
                    ]
                })
                .collect();
            print!("{}", table(&["ID", "KIND", "PRODUCT", "ADDRESS", "HOLDER"], &rows));
        }
    }
    Ok(ExitCode::SUCCESS)
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
