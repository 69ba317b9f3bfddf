//! A small unified diff (`diff -u` format) for showing what `xpu host apply` and
//! `xpu vfio --persist` change. Files here are configuration files of at most a few thousand
//! lines, so a longest-common-subsequence table is fast enough and keeps the code obvious.
//! Lines are compared without their terminators; a change that only adds or drops the final
//! newline shows as headers without hunks.

use std::fmt::Write as _;

const CONTEXT: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Keep,
    Del,
    Add,
}

/// Line-level edit script from `a` to `b`.
fn edits<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<(Op, &'a str)> {
    // Trim the common prefix and suffix first: typical edits touch a few lines of a long file.
    let pre = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let suf = a[pre..].iter().rev().zip(b[pre..].iter().rev()).take_while(|(x, y)| x == y).count();
    let (am, bm) = (&a[pre..a.len() - suf], &b[pre..b.len() - suf]);
    let (n, m) = (am.len(), bm.len());
    // lcs[i][j]: LCS length of am[i..] and bm[j..].
    let mut lcs = vec![0u32; (n + 1) * (m + 1)];
    let at = |i: usize, j: usize| i * (m + 1) + j;
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[at(i, j)] = if am[i] == bm[j] {
                lcs[at(i + 1, j + 1)] + 1
            } else {
                lcs[at(i + 1, j)].max(lcs[at(i, j + 1)])
            };
        }
    }
    let mut out: Vec<(Op, &str)> = a[..pre].iter().map(|l| (Op::Keep, *l)).collect();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && am[i] == bm[j] {
            out.push((Op::Keep, am[i]));
            i += 1;
            j += 1;
        } else if i < n && (j == m || lcs[at(i + 1, j)] >= lcs[at(i, j + 1)]) {
            // Deletions before additions, as diff(1) prints a replaced line.
            out.push((Op::Del, am[i]));
            i += 1;
        } else {
            out.push((Op::Add, bm[j]));
            j += 1;
        }
    }
    out.extend(a[a.len() - suf..].iter().map(|l| (Op::Keep, *l)));
    out
}

/// `diff -u` of `old` and `new`, labelled `old_label` / `new_label`; empty when equal. A missing
/// file is passed as `None` and labelled `/dev/null`, as `diff -N` does.
pub fn unified(old: Option<&str>, new: Option<&str>, old_label: &str, new_label: &str) -> String {
    if old == new {
        return String::new();
    }
    let a: Vec<&str> = old.map(|s| s.lines().collect()).unwrap_or_default();
    let b: Vec<&str> = new.map(|s| s.lines().collect()).unwrap_or_default();
    let script = edits(&a, &b);
    let mut out = String::new();
    let _ = writeln!(out, "--- {}", if old.is_some() { old_label } else { "/dev/null" });
    let _ = writeln!(out, "+++ {}", if new.is_some() { new_label } else { "/dev/null" });

    // Group changes into hunks with CONTEXT lines around them.
    let changed: Vec<usize> =
        script.iter().enumerate().filter(|(_, (op, _))| *op != Op::Keep).map(|(i, _)| i).collect();
    let mut k = 0;
    while k < changed.len() {
        let start = changed[k].saturating_sub(CONTEXT);
        let mut end = changed[k];
        while k + 1 < changed.len() && changed[k + 1] <= end + 2 * CONTEXT + 1 {
            k += 1;
            end = changed[k];
        }
        let end = (end + CONTEXT + 1).min(script.len());
        // Line numbers (1-based) of the hunk's first line in each file.
        let a_before = script[..start].iter().filter(|(op, _)| *op != Op::Add).count();
        let b_before = script[..start].iter().filter(|(op, _)| *op != Op::Del).count();
        let a_len = script[start..end].iter().filter(|(op, _)| *op != Op::Add).count();
        let b_len = script[start..end].iter().filter(|(op, _)| *op != Op::Del).count();
        let range = |before: usize, len: usize| {
            let first = if len == 0 { before } else { before + 1 };
            if len == 1 { format!("{first}") } else { format!("{first},{len}") }
        };
        let _ = writeln!(out, "@@ -{} +{} @@", range(a_before, a_len), range(b_before, b_len));
        for (op, line) in &script[start..end] {
            let sign = match op {
                Op::Keep => ' ',
                Op::Del => '-',
                Op::Add => '+',
            };
            let _ = writeln!(out, "{sign}{line}");
        }
        k += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_is_empty() {
        assert_eq!(unified(Some("a\n"), Some("a\n"), "a", "b"), "");
    }

    #[test]
    fn one_changed_line_with_context() {
        let old = "1\n2\n3\n4\n5\n6\n7\n8\n9\n";
        let new = "1\n2\n3\n4\nfive\n6\n7\n8\n9\n";
        assert_eq!(
            unified(Some(old), Some(new), "a/f", "b/f"),
            "--- a/f\n+++ b/f\n@@ -2,7 +2,7 @@\n 2\n 3\n 4\n-5\n+five\n 6\n 7\n 8\n"
        );
    }

    #[test]
    fn new_file_and_separate_hunks() {
        assert_eq!(
            unified(None, Some("x\ny\n"), "a/f", "b/f"),
            "--- /dev/null\n+++ b/f\n@@ -0,0 +1,2 @@\n+x\n+y\n"
        );
        let old: String = (1..=20).map(|i| format!("{i}\n")).collect();
        let new = old.replace("2\n", "two\n").replace("19\n", "nineteen\n");
        let d = unified(Some(&old), Some(&new), "a", "b");
        assert_eq!(d.matches("@@ -").count(), 2, "{d}");
    }

    #[test]
    fn applying_the_script_gives_the_new_text() {
        let a: Vec<&str> = "a b c d e f".split(' ').collect();
        let b: Vec<&str> = "a x c e f g".split(' ').collect();
        let e = edits(&a, &b);
        let rebuilt: Vec<&str> =
            e.iter().filter(|(op, _)| *op != Op::Del).map(|(_, l)| *l).collect();
        let orig: Vec<&str> = e.iter().filter(|(op, _)| *op != Op::Add).map(|(_, l)| *l).collect();
        assert_eq!(rebuilt, b);
        assert_eq!(orig, a);
    }
}
