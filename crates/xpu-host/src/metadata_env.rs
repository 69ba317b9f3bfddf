//! `tpu-env` metadata (a flat YAML map) to a shell-safe environment file.
//!
//! The custom-image seed turns the map into `KEY="value"` lines with a Python one-liner and
//! `eval`s the result, so a value holding `"`, `$(...)` or a backtick runs as shell code at
//! boot. Here every line is `KEY="value"` with `\`, `"`, `$` and `` ` `` escaped, which makes
//! the value literal inside double quotes (POSIX sh, 2.2.3); keys must be shell names
//! (`[A-Za-z_][A-Za-z0-9_]*`), and values containing a newline, carriage return or NUL are
//! refused rather than silently changed, since no `KEY="value"` line can carry them to every
//! consumer (`source`, systemd `EnvironmentFile=`, `docker --env-file`) intact.
//!
//! Scalars keep YAML's reading of them: strings as they are, numbers and booleans in YAML's
//! canonical form (`true`, `8`), `null` as an empty value. Lists and maps are refused: the
//! metadata is a flat map. Order is the input's.

use std::fmt::Write as _;
use std::path::Path;

use serde_norway::Value;

#[derive(Debug, thiserror::Error)]
pub enum MetadataEnvError {
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path} is not valid YAML: {reason}; expected a flat map like `KEY: value`")]
    Yaml { path: String, reason: String },
    #[error("{path} is a YAML {found}, not a map; expected a flat map like `KEY: value`")]
    NotAMap { path: String, found: &'static str },
    #[error(
        "{path}: key {key} is not a shell variable name; use letters, digits and _ (not first a digit)"
    )]
    BadKey { path: String, key: String },
    #[error(
        "{path}: value of {key} is a {found}; expected a flat map of scalars (string, number, boolean)"
    )]
    NotScalar { path: String, key: String, found: &'static str },
    #[error(
        "{path}: value of {key} contains {what}, which an environment file line cannot carry; remove it from the metadata"
    )]
    BadValue { path: String, key: String, what: &'static str },
    #[error("cannot write {path}")]
    Write {
        path: String,
        #[source]
        source: crate::root::PathError,
    },
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Sequence(_) => "list",
        Value::Mapping(_) => "map",
        Value::Tagged(_) => "tagged value",
    }
}

/// Whether `s` is a POSIX shell variable name.
pub fn is_shell_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next().is_some_and(|c| c == b'_' || c.is_ascii_alphabetic())
        && b.all(|c| c == b'_' || c.is_ascii_alphanumeric())
}

/// `value` with `\`, `"`, `$` and `` ` `` escaped for use inside double quotes.
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if matches!(c, '\\' | '"' | '$' | '`') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Converts YAML text (named `path` in errors) to the environment file's content.
pub fn convert(yaml: &str, path: &str) -> Result<String, MetadataEnvError> {
    // Through the bounded loader: aliases may not blow the file up (crate xpu_core::yaml).
    let doc: Value = xpu_core::yaml::load_one(yaml, path).map_err(|e| MetadataEnvError::Yaml {
        path: path.to_owned(),
        reason: match e.problem {
            xpu_core::yaml::Problem::Invalid(reason) => reason,
            other => other.to_string(),
        },
    })?;
    let map = match doc {
        Value::Mapping(m) => m,
        // An empty document: no variables.
        Value::Null => return Ok(String::new()),
        other => {
            return Err(MetadataEnvError::NotAMap { path: path.to_owned(), found: kind(&other) });
        }
    };
    let mut out = String::new();
    for (k, v) in &map {
        let key = match k {
            Value::String(s) => s.clone(),
            other => {
                let shown = serde_norway::to_string(other).unwrap_or_default();
                return Err(MetadataEnvError::BadKey {
                    path: path.to_owned(),
                    key: shown.trim().to_owned(),
                });
            }
        };
        if !is_shell_name(&key) {
            return Err(MetadataEnvError::BadKey {
                path: path.to_owned(),
                key: format!("{key:?}"),
            });
        }
        let value = match v {
            Value::String(s) => s.clone(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::Null => String::new(),
            other => {
                return Err(MetadataEnvError::NotScalar {
                    path: path.to_owned(),
                    key,
                    found: kind(other),
                });
            }
        };
        for (c, what) in [('\n', "a newline"), ('\r', "a carriage return"), ('\0', "a NUL byte")] {
            if value.contains(c) {
                return Err(MetadataEnvError::BadValue { path: path.to_owned(), key, what });
            }
        }
        let _ = writeln!(out, "{key}=\"{}\"", escape(&value));
    }
    Ok(out)
}

/// Reads `input`, converts it, and writes `output` atomically (a temporary file in the same
/// directory renamed into place, mode 0644). Returns the number of variables written.
pub fn run(input: &Path, output: &Path) -> Result<usize, MetadataEnvError> {
    let shown_in = input.display().to_string();
    // The metadata is someone else's: a regular file of configuration size, never a FIFO to
    // block on or a device to read for ever.
    let bytes = crate::root::read_bounded(input, crate::root::MAX_READ)
        .map_err(|e| MetadataEnvError::Read { path: shown_in.clone(), error: e.into() })?;
    let text = String::from_utf8(bytes).map_err(|e| MetadataEnvError::Read {
        path: shown_in.clone(),
        error: std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()),
    })?;
    let env = convert(&text, &shown_in)?;
    let shown_out = output.display().to_string();
    let dir = match output.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // `.NAME.xpu-tmp` is created with O_EXCL | O_NOFOLLOW: a link planted there is never
    // written through (see crate::root).
    crate::root::write_atomic_in(&dir, &name, env.as_bytes(), 0o644)
        .map_err(|source| MetadataEnvError::Write { path: shown_out, source })?;
    Ok(env.lines().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_map_becomes_quoted_lines_in_order() {
        let y = "ACCELERATOR_TYPE: 'v5p-8'\nWORKER_ID: 0\nZONE: us-east5-a\nENABLED: true\nEMPTY:\nTRICKY: 'a \"b\" $(rm -rf /) `x` \\ end'\n";
        assert_eq!(
            convert(y, "tpu-env").unwrap(),
            "ACCELERATOR_TYPE=\"v5p-8\"\nWORKER_ID=\"0\"\nZONE=\"us-east5-a\"\nENABLED=\"true\"\nEMPTY=\"\"\nTRICKY=\"a \\\"b\\\" \\$(rm -rf /) \\`x\\` \\\\ end\"\n"
        );
    }

    #[test]
    fn rejects_what_is_not_a_flat_map_of_scalars() {
        let cases = [
            ("- a\n- b\n", "is a YAML list, not a map"),
            ("just text\n", "is a YAML string, not a map"),
            ("A: [1, 2]\n", "value of A is a list"),
            ("A:\n  B: 1\n", "value of A is a map"),
            ("1BAD: x\n", "key \"1BAD\" is not a shell variable name"),
            ("BAD-KEY: x\n", "key \"BAD-KEY\" is not a shell variable name"),
            ("A: \"two\\nlines\"\n", "value of A contains a newline"),
            ("A: [unclosed\n", "is not valid YAML"),
            ("A: 1\nA: 2\n", "is not valid YAML"),
        ];
        for (y, want) in cases {
            let e = convert(y, "in.yaml").unwrap_err().to_string();
            assert!(e.contains(want), "{y:?}: {e}");
        }
    }

    #[test]
    fn shell_names() {
        assert!(is_shell_name("_A1"));
        assert!(!is_shell_name(""));
        assert!(!is_shell_name("A B"));
        assert!(!is_shell_name("É"));
    }
}
