//! Trace loaders: the OpenB node and pod lists (Alibaba, USENIX ATC '23) and the Philly job
//! trace (Microsoft, as shipped with the Pollux artifact). This is the only module of the crate
//! that touches files; the `parse_*` functions take text so tests need no files, and every
//! malformed value is reported with its file, line and column, an impossible row (a pod deleted
//! before it was created) with both values.

use std::path::Path;

use serde::Serialize;

/// The latest time (and longest duration) a trace may give, in seconds: 10^15, the bound Philly
/// durations already have. The simulator adds durations to times, so anything near `u64::MAX`
/// (a `creation_time` of 18446744073709551615) would not be a time it can reach; such a row is
/// an error naming its line rather than a job that silently never arrives.
pub const MAX_TIME: u64 = 1_000_000_000_000_000;

/// A malformed or unreadable trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read trace {file}: {error}")]
    Io { file: String, error: std::io::Error },
    #[error("{file}:{line}: column {column:?}: {message}")]
    Value { file: String, line: usize, column: String, message: String },
    #[error("{file}:{line}: {message}")]
    Row { file: String, line: usize, message: String },
    #[error("{file}: missing column {column:?}; the header has {header}")]
    MissingColumn { file: String, column: String, header: String },
    #[error("{file}: no rows after the header")]
    Empty { file: String },
}

/// One parsed CSV file: header names and rows of fields, with line numbers.
struct Csv<'a> {
    file: &'a str,
    header: Vec<&'a str>,
    rows: Vec<(usize, Vec<&'a str>)>,
}

impl<'a> Csv<'a> {
    /// Splits on commas. The traces have no quoted fields; a quote is rejected rather than
    /// misread.
    fn parse(file: &'a str, text: &'a str) -> Result<Self, TraceError> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        let Some((_, head)) = lines.next() else {
            return Err(TraceError::Empty { file: file.into() });
        };
        let header: Vec<&str> =
            head.trim_start_matches('\u{feff}').split(',').map(str::trim).collect();
        let mut rows = Vec::new();
        for (i, line) in lines {
            let line = line.strip_suffix('\r').unwrap_or(line);
            if line.contains('"') {
                return Err(TraceError::Row {
                    file: file.into(),
                    line: i + 1,
                    message: "quoted fields are not supported; remove the quotes".into(),
                });
            }
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if fields.len() != header.len() {
                return Err(TraceError::Row {
                    file: file.into(),
                    line: i + 1,
                    message: format!(
                        "has {} fields but the header has {}",
                        fields.len(),
                        header.len()
                    ),
                });
            }
            rows.push((i + 1, fields));
        }
        if rows.is_empty() {
            return Err(TraceError::Empty { file: file.into() });
        }
        Ok(Self { file, header, rows })
    }

    fn col(&self, name: &str) -> Result<usize, TraceError> {
        self.header.iter().position(|h| *h == name).ok_or_else(|| TraceError::MissingColumn {
            file: self.file.into(),
            column: name.into(),
            header: self.header.join(","),
        })
    }

    fn opt_col(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| *h == name)
    }

    fn err(&self, line: usize, col: usize, message: String) -> TraceError {
        TraceError::Value {
            file: self.file.into(),
            line,
            column: self.header.get(col).copied().unwrap_or("?").into(),
            message,
        }
    }

    fn uint(&self, line: usize, fields: &[&str], col: usize) -> Result<u64, TraceError> {
        let s = fields[col];
        s.parse::<u64>()
            .map_err(|_| self.err(line, col, format!("expected a non-negative integer, got {s:?}")))
    }

    /// A non-negative number that may have a fraction (`2951.0`), rounded to the nearest
    /// integer.
    fn number(&self, line: usize, fields: &[&str], col: usize) -> Result<u64, TraceError> {
        let s = fields[col];
        match s.parse::<f64>() {
            Ok(v) if (0.0..MAX_TIME as f64).contains(&v) => Ok(v.round() as u64),
            _ => Err(self.err(line, col, format!("expected a non-negative number, got {s:?}"))),
        }
    }
}

fn read(path: &Path) -> Result<(String, String), TraceError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|source| TraceError::Io { file: file.clone(), error: source })?;
    Ok((file, text))
}

/// A node of the OpenB cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OpenbNode {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: u16,
    pub model: String,
}

/// A task of an OpenB pod list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OpenbPod {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub num_gpu: u16,
    /// Per GPU: 1000 for whole GPUs, less for a share of one, 0 without GPUs.
    pub gpu_milli: u16,
    /// Allowed GPU models; empty = any.
    pub gpu_spec: Vec<String>,
    pub creation_time: Option<u64>,
    pub deletion_time: Option<u64>,
    pub scheduled_time: Option<u64>,
}

impl OpenbPod {
    /// GPU milli the task asks for in all.
    pub fn gpu_request(&self) -> u64 {
        u64::from(self.num_gpu) * u64::from(self.gpu_milli)
    }
}

pub fn parse_openb_nodes(file: &str, text: &str) -> Result<Vec<OpenbNode>, TraceError> {
    let csv = Csv::parse(file, text)?;
    let (sn, cpu, mem, gpu, model) = (
        csv.col("sn")?,
        csv.col("cpu_milli")?,
        csv.col("memory_mib")?,
        csv.col("gpu")?,
        csv.col("model")?,
    );
    let mut out = Vec::with_capacity(csv.rows.len());
    for (line, f) in &csv.rows {
        let gpus = csv.uint(*line, f, gpu)?;
        if gpus > crate::cluster::MAX_DEVICES as u64 {
            return Err(csv.err(
                *line,
                gpu,
                format!(
                    "{gpus} GPUs is more than the {} a node may have",
                    crate::cluster::MAX_DEVICES
                ),
            ));
        }
        if gpus > 0 && f[model].is_empty() {
            return Err(csv.err(*line, model, "a node with GPUs needs a model".into()));
        }
        if f[sn].is_empty() {
            return Err(csv.err(*line, sn, "empty node name".into()));
        }
        out.push(OpenbNode {
            name: f[sn].to_owned(),
            cpu_milli: csv.uint(*line, f, cpu)?,
            memory_mib: csv.uint(*line, f, mem)?,
            gpus: gpus as u16,
            model: f[model].to_owned(),
        });
    }
    Ok(out)
}

pub fn parse_openb_pods(file: &str, text: &str) -> Result<Vec<OpenbPod>, TraceError> {
    let csv = Csv::parse(file, text)?;
    let (name, cpu, mem, ngpu, milli) = (
        csv.col("name")?,
        csv.col("cpu_milli")?,
        csv.col("memory_mib")?,
        csv.col("num_gpu")?,
        csv.col("gpu_milli")?,
    );
    let spec = csv.opt_col("gpu_spec");
    let times =
        [csv.opt_col("creation_time"), csv.opt_col("deletion_time"), csv.opt_col("scheduled_time")];
    let mut out = Vec::with_capacity(csv.rows.len());
    for (line, f) in &csv.rows {
        let line = *line;
        let num_gpu = csv.uint(line, f, ngpu)?;
        let gpu_milli = csv.uint(line, f, milli)?;
        if num_gpu > crate::cluster::MAX_DEVICES as u64 {
            return Err(csv.err(
                line,
                ngpu,
                format!("{num_gpu} GPUs is more than a node may have"),
            ));
        }
        if gpu_milli > 1000 {
            return Err(csv.err(line, milli, format!("{gpu_milli} is more than one GPU (1000)")));
        }
        match (num_gpu, gpu_milli) {
            (0, 0) | (1, 1..=1000) => {}
            (0, _) => {
                return Err(csv.err(
                    line,
                    milli,
                    "a task without GPUs must have gpu_milli 0".into(),
                ));
            }
            (_, 1000) => {}
            (_, _) => {
                return Err(csv.err(
                    line,
                    milli,
                    format!("{num_gpu} GPUs with gpu_milli {gpu_milli}: shares are for one GPU; multi-GPU tasks use 1000"),
                ));
            }
        }
        let gpu_spec = spec
            .map(|c| f[c].split('|').filter(|s| !s.is_empty()).map(str::to_owned).collect())
            .unwrap_or_default();
        let mut t = [None; 3];
        for (slot, col) in t.iter_mut().zip(times) {
            if let Some(c) = col
                && !f[c].is_empty()
            {
                let v = csv.uint(line, f, c)?;
                if v > MAX_TIME {
                    return Err(csv.err(
                        line,
                        c,
                        format!("{v} is later than any trace time ({MAX_TIME} s, about 31 million years); times are seconds from the trace's start"),
                    ));
                }
                *slot = Some(v);
            }
        }
        if let ([Some(created), Some(deleted), _], [_, Some(c), _]) = (t, times)
            && deleted < created
        {
            return Err(csv.err(
                line,
                c,
                format!(
                    "deletion_time {deleted} is before creation_time {created}: a pod cannot end before it is created; fix or drop the row"
                ),
            ));
        }
        out.push(OpenbPod {
            name: f[name].to_owned(),
            cpu_milli: csv.uint(line, f, cpu)?,
            memory_mib: csv.uint(line, f, mem)?,
            num_gpu: num_gpu as u16,
            gpu_milli: gpu_milli as u16,
            gpu_spec,
            creation_time: t[0],
            deletion_time: t[1],
            scheduled_time: t[2],
        });
    }
    Ok(out)
}

pub fn read_openb_nodes(path: &Path) -> Result<Vec<OpenbNode>, TraceError> {
    let (file, text) = read(path)?;
    parse_openb_nodes(&file, &text)
}

pub fn read_openb_pods(path: &Path) -> Result<Vec<OpenbPod>, TraceError> {
    let (file, text) = read(path)?;
    parse_openb_pods(&file, &text)
}

/// A job of the Philly trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PhillyJob {
    /// Line in the file (jobs have no name).
    pub line: usize,
    /// Submit time, seconds since the Unix epoch (UTC).
    pub submit: u64,
    pub duration: u64,
    pub gpus: u32,
    pub cluster: String,
}

pub fn parse_philly(file: &str, text: &str) -> Result<Vec<PhillyJob>, TraceError> {
    let csv = Csv::parse(file, text)?;
    let (ts, dur, gpus, vc) =
        (csv.col("timestamp")?, csv.col("duration")?, csv.col("num_gpus")?, csv.col("cluster")?);
    let mut out = Vec::with_capacity(csv.rows.len());
    for (line, f) in &csv.rows {
        let line = *line;
        let submit = parse_datetime(f[ts]).ok_or_else(|| {
            csv.err(line, ts, format!("expected a time like 2017-10-09 07:01:55, got {:?}", f[ts]))
        })?;
        let g = csv.uint(line, f, gpus)?;
        if g == 0 || g > 1_000_000 {
            return Err(csv.err(line, gpus, format!("expected 1 or more GPUs, got {g}")));
        }
        out.push(PhillyJob {
            line,
            submit,
            duration: csv.number(line, f, dur)?,
            gpus: g as u32,
            cluster: f[vc].to_owned(),
        });
    }
    Ok(out)
}

pub fn read_philly(path: &Path) -> Result<Vec<PhillyJob>, TraceError> {
    let (file, text) = read(path)?;
    parse_philly(&file, &text)
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) to seconds since the Unix epoch.
pub fn parse_datetime(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    if b.len() != 19
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b' '
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        if !part.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        part.parse().ok()
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if m <= 2 { y - 1 } else { y };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let t = days * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(t).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datetimes_match_the_unix_epoch() {
        assert_eq!(parse_datetime("1970-01-01 00:00:00"), Some(0));
        assert_eq!(parse_datetime("2017-10-09 07:01:55"), Some(1_507_532_515));
        assert_eq!(parse_datetime("2000-02-29 12:00:00"), Some(951_825_600));
        for bad in ["2017-13-01 00:00:00", "2017-10-09T07:01:55", "2017-10-09 7:01:55", "x"] {
            assert_eq!(parse_datetime(bad), None, "{bad}");
        }
    }

    #[test]
    fn malformed_rows_name_file_line_and_column() {
        let e = parse_philly("p.csv", "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 07:01:55,66.0,1,66.0,a\n2017-10-09 07:01:55,abc,1,66.0,a\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "p.csv:3: column \"duration\": expected a non-negative number, got \"abc\""
        );
        let e = parse_philly(
            "p.csv",
            "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09,1,1,1,a\n",
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("p.csv:2: column \"timestamp\""), "{e}");
        let e = parse_philly(
            "p.csv",
            "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 07:01:55,1,1,1\n",
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "p.csv:2: has 4 fields but the header has 5");
        let e =
            parse_openb_pods("o.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n")
                .unwrap_err();
        assert!(
            e.to_string().starts_with("o.csv:2: column \"gpu_milli\": 2 GPUs with gpu_milli 500"),
            "{e}"
        );
        let e = parse_openb_nodes("n.csv", "sn,cpu_milli,memory_mib,gpu\na,1,1,1\n").unwrap_err();
        assert!(e.to_string().contains("missing column \"model\""), "{e}");
    }

    #[test]
    fn openb_pods_parse_with_and_without_optional_columns() {
        let p = parse_openb_pods(
            "o.csv",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
             a,6000,12288,1,460,V100M16|V100M32,LS,Running,10,20,11\n\
             b,1000,10,0,0,,BE,Running,,,\n",
        )
        .unwrap();
        assert_eq!(p[0].gpu_spec, vec!["V100M16", "V100M32"]);
        assert_eq!((p[0].creation_time, p[0].deletion_time), (Some(10), Some(20)));
        assert_eq!(p[0].gpu_request(), 460);
        assert_eq!(p[1].creation_time, None);
        let p = parse_openb_pods(
            "o.csv",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nx,1,1,4,1000\n",
        )
        .unwrap();
        assert_eq!(p[0].gpu_request(), 4000);
    }

    #[test]
    fn openb_times_beyond_any_trace_time_name_their_line() {
        let head = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n";
        let e = parse_openb_pods(
            "o.csv",
            &format!("{head}a,1,1,0,0,10,20\nb,1,1,0,0,{},30\n", u64::MAX),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "o.csv:3: column \"creation_time\": 18446744073709551615 is later than any trace time (1000000000000000 s, about 31 million years); times are seconds from the trace's start"
        );
        let e = parse_openb_pods("o.csv", &format!("{head}a,1,1,0,0,10,{}\n", MAX_TIME + 1))
            .unwrap_err();
        assert!(e.to_string().starts_with("o.csv:2: column \"deletion_time\""), "{e}");
        assert!(
            parse_openb_pods("o.csv", &format!("{head}a,1,1,0,0,{MAX_TIME},{MAX_TIME}\n")).is_ok()
        );
    }

    #[test]
    fn a_pod_deleted_before_it_was_created_names_its_line_and_both_times() {
        let head = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n";
        let e = parse_openb_pods("o.csv", &format!("{head}a,1,1,0,0,10,20\nb,1,1,0,0,30,29\n"))
            .unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("o.csv:3: "), "{text}");
        assert!(text.contains("deletion_time 29") && text.contains("creation_time 30"), "{text}");
        // Ending when it starts is a pod that ran for no time, not an error.
        assert!(parse_openb_pods("o.csv", &format!("{head}a,1,1,0,0,10,10\n")).is_ok());
    }
}
