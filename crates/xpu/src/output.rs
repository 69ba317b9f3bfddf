//! Output helpers shared by the subcommands: aligned tables for humans, JSON for scripts, and
//! the error type that carries the exit code (0 ok, 1 check/job failed, 2 usage or input).

use std::fmt::Write as _;
use std::process::ExitCode;

/// A failure with the exit code it maps to.
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub error: anyhow::Error,
}

impl CliError {
    /// Bad input: a flag, a file, an address. Exit 2.
    pub fn input(e: impl Into<anyhow::Error>) -> Self {
        Self { code: 2, error: e.into() }
    }

    /// Anything else that went wrong. Exit 1.
    pub fn failed(e: impl Into<anyhow::Error>) -> Self {
        Self { code: 1, error: e.into() }
    }

    /// Prints `error: outer: inner: root cause` and returns the exit code. With
    /// `XPU_ERROR_CHAIN=lines` (for tests), each link of the chain follows on a line of its
    /// own, `  cause: ...`, so a test can check that no message repeats its source.
    pub fn report(&self) -> ExitCode {
        let chain: Vec<String> = self.error.chain().map(ToString::to_string).collect();
        eprintln!("error: {}", chain.join(": "));
        if std::env::var_os("XPU_ERROR_CHAIN").is_some_and(|v| v == "lines") {
            for link in &chain {
                eprintln!("  cause: {link}");
            }
        }
        ExitCode::from(self.code)
    }
}

pub type CmdResult = Result<ExitCode, CliError>;

/// Prints warnings to stderr, one per line.
pub fn warn_all(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
}

/// Pretty JSON to stdout with a trailing newline.
pub fn print_json(value: &impl serde::Serialize) -> Result<(), CliError> {
    let s = serde_json::to_string_pretty(value).map_err(CliError::failed)?;
    println!("{s}");
    Ok(())
}

/// Columns padded to their widest cell; the last column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<&str> = cells.collect();
        let n = cells.len();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == n {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<w$}  ");
            }
        }
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// `-` for missing values in tables.
pub fn or_dash<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// With `XPU_REPORT_PEAK_RSS=1`, prints the process's peak resident set (`VmHWM`) to stderr as
/// `xpu: peak RSS <n> KiB`, so benchmarks measure the real binary without an external tool.
pub fn report_peak_rss() {
    if std::env::var_os("XPU_REPORT_PEAK_RSS").is_none() {
        return;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if let Some(kib) = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
    {
        eprintln!("xpu: peak RSS {kib} KiB");
    }
}

/// Structured logs for the long-running commands, on stderr: `RUST_LOG` sets the level
/// (`error`, `warn`, `info` (default), `debug`, `trace`); `XPU_LOG_FORMAT=json` prints one JSON
/// object per event (for journald and log shippers).
pub fn init_tracing() {
    init_tracing_with(&LogArgs::default());
}

/// `--log-level` and `--log-format` of a long-running command; unset, `RUST_LOG` and
/// `XPU_LOG_FORMAT` decide.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogArgs {
    /// Log level: error, warn, info, debug or trace [default: $RUST_LOG, else info].
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<tracing_subscriber::filter::LevelFilter>,
    /// Log format on stderr: text, or json (one object per event, for journald and log
    /// shippers) [default: $XPU_LOG_FORMAT, else text].
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
}

impl LogArgs {
    /// Whether the log is JSON: then everything the command writes to stderr is an event.
    pub fn json(&self) -> bool {
        match self.log_format {
            Some(f) => f == LogFormat::Json,
            None => std::env::var("XPU_LOG_FORMAT").is_ok_and(|v| v == "json"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// [`init_tracing`] with the command's flags first.
pub fn init_tracing_with(args: &LogArgs) {
    use tracing_subscriber::filter::LevelFilter;
    let level = args.log_level.unwrap_or_else(|| {
        std::env::var("RUST_LOG")
            .ok()
            .and_then(|v| v.trim().parse::<LevelFilter>().ok())
            .unwrap_or(LevelFilter::INFO)
    });
    let json = args.json();
    // Colour codes only for a person at a terminal: a log that goes to a file, a pipe or the
    // journal gets plain text (`NO_COLOR` turns colour off on a terminal too).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let b = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(false);
    // An already set subscriber (a test calling twice) keeps the first one.
    let _ = if json { b.json().try_init() } else { b.try_init() };
}
