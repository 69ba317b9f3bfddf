//! Merging kernel parameters into `/etc/default/grub` without duplicates.
//!
//! The TPU seed edits the file with `sed`, which appends `transparent_hugepage=always` again on
//! every run and only works when `GRUB_CMDLINE_LINUX` is empty. This merge instead:
//!
//! - reads the last assignment of `GRUB_CMDLINE_LINUX` and of `GRUB_CMDLINE_LINUX_DEFAULT`
//!   (the shell lets the last one win), in any of the quoting forms `"..."`, `'...'` or a bare
//!   word;
//! - for each wanted parameter, finds its effective occurrence: GRUB writes `..._LINUX` then
//!   `..._LINUX_DEFAULT` on the kernel line and the kernel lets the last occurrence win, so an
//!   occurrence in `_DEFAULT` is the one that counts;
//! - leaves a satisfying occurrence alone; rewrites a conflicting one in place
//!   (`intel_iommu=on` → `intel_iommu=on,sm_on`, `transparent_hugepage=never` → `always`);
//!   appends a missing one to `GRUB_CMDLINE_LINUX` (all boot entries, recovery included);
//! - keeps every other byte of the file as it was: other parameters, their order, spacing,
//!   comments, quoting.

use crate::profile::{param_key, param_merge, param_satisfies};

pub const GRUB_DEFAULT: &str = "/etc/default/grub";
const LINUX: &str = "GRUB_CMDLINE_LINUX";
const LINUX_DEFAULT: &str = "GRUB_CMDLINE_LINUX_DEFAULT";

/// The file cannot be edited safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot parse {var} at {file}:{line}: {reason}; edit the line by hand or remove it")]
pub struct GrubError {
    pub file: String,
    pub var: String,
    pub line: usize,
    pub reason: String,
}

/// What a merge did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GrubMerge {
    pub content: String,
    /// Parameters appended to `GRUB_CMDLINE_LINUX`.
    pub added: Vec<String>,
    /// `(variable, old, new)` for rewritten parameters.
    pub replaced: Vec<(String, String, String)>,
}

impl GrubMerge {
    pub fn changed(&self) -> bool {
        !self.added.is_empty() || !self.replaced.is_empty()
    }
}

/// One assignment's value, located in the file.
#[derive(Debug, Clone)]
struct Assignment {
    line: usize,
    /// Byte range of the value inside the line, without its quotes.
    start: usize,
    end: usize,
    quote: Option<char>,
}

fn find_assignment(
    lines: &[String],
    var: &str,
    file: &str,
) -> Result<Option<Assignment>, GrubError> {
    let mut found = None;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let (rest, offset) = match trimmed.strip_prefix("export ") {
            Some(r) => {
                let r2 = r.trim_start();
                (r2, indent + trimmed.len() - r2.len())
            }
            None => (trimmed, indent),
        };
        let Some(value) = rest.strip_prefix(var).and_then(|r| r.strip_prefix('=')) else {
            continue;
        };
        let vstart = offset + var.len() + 1;
        let err = |reason: &str| GrubError {
            file: file.to_owned(),
            var: var.to_owned(),
            line: i + 1,
            reason: reason.to_owned(),
        };
        let a = match value.chars().next() {
            Some(q @ ('"' | '\'')) => {
                // Find the closing quote; in double quotes a backslash escapes the next char.
                let bytes = value.as_bytes();
                let mut j = 1;
                let mut close = None;
                while j < bytes.len() {
                    if q == '"' && bytes[j] == b'\\' {
                        j += 2;
                        continue;
                    }
                    if bytes[j] == q as u8 {
                        close = Some(j);
                        break;
                    }
                    j += 1;
                }
                let Some(close) = close else {
                    return Err(err("the quoted value does not end on this line"));
                };
                let after = value[close + 1..].trim_start();
                if !(after.is_empty() || after.starts_with('#')) {
                    return Err(err("unexpected text after the quoted value"));
                }
                Assignment { line: i, start: vstart + 1, end: vstart + close, quote: Some(q) }
            }
            _ => {
                let word_len = value.find(char::is_whitespace).unwrap_or(value.len());
                let after = value[word_len..].trim_start();
                if !(after.is_empty() || after.starts_with('#')) {
                    return Err(err("unquoted value with spaces"));
                }
                if value[..word_len].contains(['"', '\'', '\\']) {
                    return Err(err("partly quoted value"));
                }
                Assignment { line: i, start: vstart, end: vstart + word_len, quote: None }
            }
        };
        found = Some(a);
    }
    Ok(found)
}

/// Whitespace-separated tokens of a value with their byte ranges.
fn tokens(value: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in value.char_indices() {
        match (c.is_whitespace(), start) {
            (true, Some(s)) => {
                out.push((s, i));
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push((s, value.len()));
    }
    out
}

/// Merges `wanted` parameters into the grub defaults file `content` (named `file` in errors).
pub fn merge(content: &str, wanted: &[&str], file: &str) -> Result<GrubMerge, GrubError> {
    let trailing_newline = content.ends_with('\n') || content.is_empty();
    let mut lines: Vec<String> = content.lines().map(str::to_owned).collect();
    let mut out = GrubMerge::default();
    let mut append_new: Vec<String> = Vec::new();

    for &w in wanted {
        let key = param_key(w);
        let mut done = false;
        for var in [LINUX_DEFAULT, LINUX] {
            let Some(a) = find_assignment(&lines, var, file)? else { continue };
            let value = lines[a.line][a.start..a.end].to_owned();
            let Some(&(s, e)) =
                tokens(&value).iter().rev().find(|&&(s, e)| param_key(&value[s..e]) == key)
            else {
                continue;
            };
            let tok = &value[s..e];
            if !param_satisfies(tok, w) {
                let new = param_merge(tok, w);
                out.replaced.push((var.to_owned(), tok.to_owned(), new.clone()));
                let new_value = format!("{}{new}{}", &value[..s], &value[e..]);
                let line = &mut lines[a.line];
                *line = rewrite(line, &a, &new_value);
            }
            done = true;
            break;
        }
        if done {
            continue;
        }
        match find_assignment(&lines, LINUX, file)? {
            Some(a) => {
                let value = &lines[a.line][a.start..a.end];
                let new_value =
                    if value.trim().is_empty() { w.to_owned() } else { format!("{value} {w}") };
                let line = &mut lines[a.line];
                *line = rewrite(line, &a, &new_value);
            }
            None => append_new.push(w.to_owned()),
        }
        out.added.push(w.to_owned());
    }
    if !append_new.is_empty() {
        lines.push(format!("{LINUX}=\"{}\"", append_new.join(" ")));
    }
    let mut content_out = lines.join("\n");
    if trailing_newline || !append_new.is_empty() {
        content_out.push('\n');
    }
    out.content = content_out;
    Ok(out)
}

/// The line with the assignment's value replaced; a bare word gains double quotes when the new
/// value has a space.
fn rewrite(line: &str, a: &Assignment, new_value: &str) -> String {
    match a.quote {
        Some(_) => format!("{}{new_value}{}", &line[..a.start], &line[a.end..]),
        None if new_value.contains(' ') => {
            format!("{}\"{new_value}\"{}", &line[..a.start], &line[a.end..])
        }
        None => format!("{}{new_value}{}", &line[..a.start], &line[a.end..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: &str = "/etc/default/grub";

    #[test]
    fn keeps_other_parameters_and_adds_missing_ones_once() {
        let grub = "# If you change this file, run 'update-grub'\nGRUB_DEFAULT=0\nGRUB_CMDLINE_LINUX_DEFAULT=\"quiet splash\"\nGRUB_CMDLINE_LINUX=\"console=ttyS0,115200  net.ifnames=0\"\n";
        let want = ["idle=poll", "intel_iommu=on,sm_on", "transparent_hugepage=always"];
        let m = merge(grub, &want, F).unwrap();
        assert_eq!(
            m.content,
            "# If you change this file, run 'update-grub'\nGRUB_DEFAULT=0\nGRUB_CMDLINE_LINUX_DEFAULT=\"quiet splash\"\nGRUB_CMDLINE_LINUX=\"console=ttyS0,115200  net.ifnames=0 idle=poll intel_iommu=on,sm_on transparent_hugepage=always\"\n"
        );
        assert_eq!(m.added.len(), 3);
        let again = merge(&m.content, &want, F).unwrap();
        assert!(!again.changed());
        assert_eq!(again.content, m.content);
    }

    #[test]
    fn conflicting_values_are_rewritten_where_they_take_effect() {
        let grub = "GRUB_CMDLINE_LINUX='intel_iommu=on ro'\nGRUB_CMDLINE_LINUX_DEFAULT=\"quiet transparent_hugepage=never\"\n";
        let m = merge(grub, &["intel_iommu=on,sm_on", "transparent_hugepage=always"], F).unwrap();
        assert_eq!(
            m.content,
            "GRUB_CMDLINE_LINUX='intel_iommu=on,sm_on ro'\nGRUB_CMDLINE_LINUX_DEFAULT=\"quiet transparent_hugepage=always\"\n"
        );
        assert_eq!(m.replaced.len(), 2);
        assert!(m.added.is_empty());
    }

    #[test]
    fn missing_variable_empty_value_and_bare_words() {
        let m = merge("GRUB_TIMEOUT=5", &["iommu=pt"], F).unwrap();
        assert_eq!(m.content, "GRUB_TIMEOUT=5\nGRUB_CMDLINE_LINUX=\"iommu=pt\"\n");
        let m = merge("GRUB_CMDLINE_LINUX=\"\"\n", &["idle=poll"], F).unwrap();
        assert_eq!(m.content, "GRUB_CMDLINE_LINUX=\"idle=poll\"\n");
        let m = merge("GRUB_CMDLINE_LINUX=quiet # note\n", &["idle=poll"], F).unwrap();
        assert_eq!(m.content, "GRUB_CMDLINE_LINUX=\"quiet idle=poll\" # note\n");
        // The last assignment is the one the shell keeps.
        let m = merge(
            "GRUB_CMDLINE_LINUX=\"a\"\nGRUB_CMDLINE_LINUX=\"$GRUB_CMDLINE_LINUX b\"\n",
            &["c"],
            F,
        )
        .unwrap();
        assert_eq!(
            m.content,
            "GRUB_CMDLINE_LINUX=\"a\"\nGRUB_CMDLINE_LINUX=\"$GRUB_CMDLINE_LINUX b c\"\n"
        );
    }

    #[test]
    fn unparsable_lines_are_errors_naming_the_line() {
        let e =
            merge("X=1\nGRUB_CMDLINE_LINUX=\"quiet\n splash\"\n", &["idle=poll"], F).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(
            e.to_string().starts_with("cannot parse GRUB_CMDLINE_LINUX at /etc/default/grub:2"),
            "{e}"
        );
    }
}
