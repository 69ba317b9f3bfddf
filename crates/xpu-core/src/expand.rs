//! `$(VAR)` references in a container's `command`, `args` and `env[].value`, expanded by
//! Kubernetes' rules (the kubelet's, for the manifests users already write):
//!
//! - `$(NAME)` is replaced by the variable's value when `NAME` is defined;
//! - a reference to an undefined variable stays as written, `$(NAME)` included;
//! - `$$` is an escaped `$`: `$$(NAME)` gives the text `$(NAME)`, never the value;
//! - a `$` followed by anything else, and a `$(` never closed, stay as written.
//!
//! Which variables a string may use is the caller's: for `env[].value`, only those defined
//! earlier in the list; for `command` and `args`, every variable of the container.

/// The longest result: Linux refuses a longer single argument or variable (`MAX_ARG_STRLEN`)
/// anyway. References let a small manifest stand for a huge string (each variable twice the
/// one before it), so expansion stops here instead of building it.
pub const MAX_EXPANDED: usize = 128 * 1024;

/// An expansion that would be longer than [`MAX_EXPANDED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("expands to more than {} KiB, the kernel's limit for one argument or variable", MAX_EXPANDED / 1024)]
pub struct TooLong;

/// Expands `input` with `lookup` (the value of a defined variable, `None` otherwise).
pub fn expand(input: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, TooLong> {
    let mut out = String::with_capacity(input.len().min(MAX_EXPANDED));
    let mut rest = input;
    while let Some(i) = rest.find('$') {
        if out.len() > MAX_EXPANDED {
            return Err(TooLong);
        }
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            // `$$`: one literal `$`, whatever follows.
            out.push('$');
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('(') {
            match tail.find(')') {
                Some(end) => {
                    let name = &tail[..end];
                    match lookup(name) {
                        Some(v) if !name.is_empty() => {
                            if out.len() + v.len() > MAX_EXPANDED {
                                return Err(TooLong);
                            }
                            out.push_str(&v);
                        }
                        _ => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &tail[end + 1..];
                }
                None => {
                    // Never closed: the rest is literal.
                    out.push_str(&rest[i..]);
                    rest = "";
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    if out.len() > MAX_EXPANDED { Err(TooLong) } else { Ok(out) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(name: &str) -> Option<String> {
        match name {
            "JOB_COMPLETION_INDEX" => Some("3".to_owned()),
            "JOB_NAME" => Some("train".to_owned()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    fn x(s: &str) -> String {
        expand(s, &vars).unwrap()
    }

    #[test]
    fn defined_references_are_replaced() {
        assert_eq!(x("--node_rank=$(JOB_COMPLETION_INDEX)"), "--node_rank=3");
        assert_eq!(x("$(JOB_NAME)-0.headless-svc"), "train-0.headless-svc");
        assert_eq!(x("$(JOB_NAME)$(JOB_COMPLETION_INDEX)"), "train3");
        assert_eq!(x("a$(EMPTY)b"), "ab");
    }

    #[test]
    fn undefined_references_stay_as_written() {
        assert_eq!(x("rank=$(NOPE)"), "rank=$(NOPE)");
        assert_eq!(x("$()"), "$()");
    }

    #[test]
    fn double_dollar_escapes() {
        assert_eq!(x("$$(JOB_NAME)"), "$(JOB_NAME)");
        assert_eq!(x("$$$(JOB_NAME)"), "$train");
        assert_eq!(x("cost: $$5"), "cost: $5");
        assert_eq!(x("$$"), "$");
    }

    #[test]
    fn a_doubling_chain_stops_at_the_limit_instead_of_growing() {
        // A=x*1000, B=$(A)$(A), C=$(B)$(B)...: 40 links would be a terabyte.
        let mut env: Vec<(String, String)> = vec![("V0".into(), "x".repeat(1000))];
        let mut failed = None;
        for i in 1..40 {
            let lookup = |n: &str| env.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
            match expand(&format!("$(V{p})$(V{p})", p = i - 1), &lookup) {
                Ok(v) => env.push((format!("V{i}"), v)),
                Err(e) => {
                    failed = Some((i, e));
                    break;
                }
            }
        }
        let (i, e) = failed.unwrap();
        assert_eq!(i, 8, "1000 * 2^7 = 128,000 fits, 256,000 does not");
        assert!(e.to_string().contains("128 KiB"));
    }

    #[test]
    fn other_dollars_and_unclosed_references_are_literal() {
        assert_eq!(x("$HOME and ${HOME}"), "$HOME and ${HOME}");
        assert_eq!(x("$(JOB_NAME"), "$(JOB_NAME");
        assert_eq!(x("end$"), "end$");
        assert_eq!(x("no references"), "no references");
        assert_eq!(x("ünïcode $(JOB_NAME) ✓"), "ünïcode train ✓");
    }
}
