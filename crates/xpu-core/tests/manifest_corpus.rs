//! Real public GPU/TPU Job and Pod manifests (`tests/corpus/*.yaml`, each naming its source on
//! its first line) against what `xpu serve` should do with them, as `tests/corpus/expected.tsv`
//! records it, one line per file:
//!
//! - `<file>\taccept N`: `parse_all` submits N jobs;
//! - `<file>\trefuse\t<substring>`: `parse_all` refuses the file and the refused field path
//!   (`JobError::path`) contains the substring; `a|b` accepts either (for files with several
//!   unsupported fields, where the spec does not say which is named first).
//!
//! Blank lines and lines starting with `#` are skipped. The test lists every mismatch at once,
//! and also fails when a manifest has no line, a line names a missing file, or the table is
//! shorter than [`MIN_ENTRIES`].

use std::collections::BTreeSet;
use std::path::Path;

use xpu_core::job;

/// The corpus stays at least this large.
const MIN_ENTRIES: usize = 30;

enum Expect {
    Accept(usize),
    /// Alternatives, any one of which the refused path must contain.
    Refuse(Vec<String>),
}

/// One line of `expected.tsv`: the file and what should happen to it.
fn parse_line(line: &str) -> Result<(String, Expect), String> {
    let cols: Vec<&str> = line.split('\t').map(str::trim).collect();
    let file = cols.first().copied().unwrap_or_default().to_owned();
    if file.is_empty() {
        return Err("no file name".to_owned());
    }
    let outcome: Vec<&str> = cols[1..].iter().flat_map(|c| c.split_whitespace()).collect();
    match outcome.as_slice() {
        ["accept", n] => n
            .parse::<usize>()
            .map(|n| (file, Expect::Accept(n)))
            .map_err(|_| format!("{n:?} is not a number of jobs")),
        ["refuse", path] => {
            let alternatives: Vec<String> =
                path.split('|').filter(|s| !s.is_empty()).map(str::to_owned).collect();
            if alternatives.is_empty() {
                Err("refuse needs the refused field path".to_owned())
            } else {
                Ok((file, Expect::Refuse(alternatives)))
            }
        }
        _ => Err("expected `accept N` or `refuse<TAB>PATH`".to_owned()),
    }
}

/// What is wrong with `text`'s outcome, if anything.
fn check(text: &str, expect: &Expect) -> Option<String> {
    let got = job::parse_all(text);
    match (expect, got) {
        (Expect::Accept(n), Ok(sub)) if sub.jobs.len() == *n => None,
        (Expect::Accept(n), Ok(sub)) => Some(format!(
            "expected {n} job(s), got {}: {:?}",
            sub.jobs.len(),
            sub.jobs.iter().map(|j| j.name.as_str()).collect::<Vec<_>>()
        )),
        (Expect::Accept(n), Err(e)) => Some(format!("expected {n} job(s), refused: {e}")),
        (Expect::Refuse(alts), Ok(sub)) => Some(format!(
            "expected a refusal naming {}, accepted {} job(s) (notes: {:?})",
            alts.join(" or "),
            sub.jobs.len(),
            sub.notes
        )),
        (Expect::Refuse(alts), Err(e)) if alts.iter().any(|a| e.path.contains(a.as_str())) => None,
        (Expect::Refuse(alts), Err(e)) => Some(format!(
            "expected a refusal naming {}, refused at {:?}: {}",
            alts.join(" or "),
            e.path,
            e.message
        )),
    }
}

#[test]
fn corpus_manifests_parse_as_expected() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("corpus");
    let table = std::fs::read_to_string(dir.join("expected.tsv"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join("expected.tsv").display()));
    let mut problems: Vec<String> = Vec::new();
    let mut listed: BTreeSet<String> = BTreeSet::new();
    for (i, line) in table.lines().enumerate() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let (file, expect) = match parse_line(line) {
            Ok(entry) => entry,
            Err(e) => {
                problems.push(format!("expected.tsv line {}: {e}: {line:?}", i + 1));
                continue;
            }
        };
        if !listed.insert(file.clone()) {
            problems.push(format!("expected.tsv line {}: {file} is listed twice", i + 1));
            continue;
        }
        let text = match std::fs::read_to_string(dir.join(&file)) {
            Ok(t) => t,
            Err(e) => {
                problems.push(format!("{file}: listed in expected.tsv but cannot be read: {e}"));
                continue;
            }
        };
        if !text.starts_with("# source: ") {
            problems.push(format!("{file}: the first line must be `# source: <where from>`"));
        }
        if let Some(p) = check(&text, &expect) {
            problems.push(format!("{file}: {p}"));
        }
    }
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let manifest = [".yaml", ".yml", ".json"].iter().any(|ext| name.ends_with(ext));
                if manifest && !listed.contains(&name) {
                    problems.push(format!("{name}: no line in expected.tsv"));
                }
            }
        }
        Err(e) => problems.push(format!("{}: {e}", dir.display())),
    }
    if listed.len() < MIN_ENTRIES {
        problems.push(format!(
            "expected.tsv lists {} manifests; the corpus keeps at least {MIN_ENTRIES}",
            listed.len()
        ));
    }
    assert!(
        problems.is_empty(),
        "{} problem(s) in the manifest corpus ({} manifests):\n  {}",
        problems.len(),
        listed.len(),
        problems.join("\n  ")
    );
}
