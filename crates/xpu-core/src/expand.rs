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
//!
//! References let a small manifest stand for a huge process: each value may name the one before
//! it twice, and thousands of values may each name a large one. Two limits stop that while the
//! text is built, never after: one value or argument is at most [`MAX_EXPANDED`], and a
//! process's environment and arguments together at most [`MAX_EXEC_BYTES`], charged to a
//! [`Budget`] as each one is made ([`EnvBuilder`] does both for a whole container). The parser
//! checks the same limits on lengths alone ([`expanded_len`]), so a manifest that could pass
//! them is refused when it is submitted.

/// The longest result: Linux refuses a longer single argument or variable (`MAX_ARG_STRLEN`)
/// anyway. References let a small manifest stand for a huge string (each variable twice the
/// one before it), so expansion stops here instead of building it.
pub const MAX_EXPANDED: usize = 128 * 1024;

/// The most bytes a process's environment and arguments may take together, counted as
/// [`Budget`] counts them: Linux's limit with the default 8 MiB stack (a quarter of it, checked
/// by `execve`).
pub const MAX_EXEC_BYTES: usize = 2 << 20;

/// An expansion that would be longer than [`MAX_EXPANDED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("expands to more than {} KiB, the kernel's limit for one argument or variable", MAX_EXPANDED / 1024)]
pub struct TooLong;

/// Why a value or argument was not built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    /// Longer than [`MAX_EXPANDED`] on its own.
    #[error(transparent)]
    TooLong(#[from] TooLong),
    /// With what was built before it, more than the budget's limit.
    #[error(
        "with the variables and arguments before it, takes the process past {} KiB of environment and arguments, the most it can be given",
        .limit / 1024
    )]
    OverBudget { limit: usize },
}

/// The bytes a process's environment and arguments take so far, against a limit: a variable is
/// charged `NAME=VALUE` and two bytes, an argument its length and one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    used: usize,
    limit: usize,
}

impl Budget {
    pub fn new(limit: usize) -> Self {
        Self { used: 0, limit }
    }

    pub fn used(&self) -> usize {
        self.used
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes that may still be charged.
    pub fn left(&self) -> usize {
        self.limit.saturating_sub(self.used)
    }

    /// Charges `bytes`, or leaves the budget as it was when they do not fit.
    pub fn charge(&mut self, bytes: usize) -> Result<(), ExpandError> {
        if bytes > self.left() {
            return Err(ExpandError::OverBudget { limit: self.limit });
        }
        self.used += bytes;
        Ok(())
    }

    /// Charges a variable as it sits in the environment: `NAME=VALUE` and two bytes.
    pub fn charge_var(&mut self, name: &str, value: &str) -> Result<(), ExpandError> {
        self.charge(name.len().saturating_add(value.len()).saturating_add(2))
    }
}

impl Default for Budget {
    fn default() -> Self {
        Self::new(MAX_EXEC_BYTES)
    }
}

/// One piece of a string with references: text as written, or a reference by name.
enum Piece<'a> {
    Text(&'a str),
    /// `$(NAME)`: the name, and the reference as written (what stays when it is undefined).
    Ref(&'a str, &'a str),
}

/// The pieces of `input`, in order, by the grammar in the module's docs.
struct Pieces<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = Piece<'a>;

    fn next(&mut self) -> Option<Piece<'a>> {
        let rest = self.rest;
        if rest.is_empty() {
            return None;
        }
        let Some(i) = rest.find('$') else {
            self.rest = "";
            return Some(Piece::Text(rest));
        };
        if i > 0 {
            self.rest = &rest[i..];
            return Some(Piece::Text(&rest[..i]));
        }
        let after = &rest[1..];
        if let Some(tail) = after.strip_prefix('$') {
            // `$$`: one literal `$` (the second), whatever follows.
            self.rest = tail;
            return Some(Piece::Text(&after[..1]));
        }
        if let Some(tail) = after.strip_prefix('(') {
            return match tail.find(')') {
                Some(end) => {
                    let written = &rest[..end + 3];
                    self.rest = &tail[end + 1..];
                    let name = &tail[..end];
                    Some(if name.is_empty() {
                        Piece::Text(written)
                    } else {
                        Piece::Ref(name, written)
                    })
                }
                None => {
                    // Never closed: the rest is literal.
                    self.rest = "";
                    Some(Piece::Text(rest))
                }
            };
        }
        self.rest = after;
        Some(Piece::Text(&rest[..1]))
    }
}

fn pieces(input: &str) -> Pieces<'_> {
    Pieces { rest: input }
}

/// Expands `input` with `lookup` (the value of a defined variable, `None` otherwise).
pub fn expand(input: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, TooLong> {
    expand_capped(input, lookup, MAX_EXPANDED).map_err(|_| TooLong)
}

/// Expands `input` into at most `cap` bytes; `Err` as soon as the result would be longer, having
/// built no more than `cap` bytes.
fn expand_capped<S: AsRef<str>>(
    input: &str,
    lookup: &dyn Fn(&str) -> Option<S>,
    cap: usize,
) -> Result<String, ()> {
    let mut out = String::with_capacity(input.len().min(cap));
    for piece in pieces(input) {
        let push = |out: &mut String, s: &str| {
            if out.len() + s.len() > cap {
                return Err(());
            }
            out.push_str(s);
            Ok(())
        };
        match piece {
            Piece::Text(t) => push(&mut out, t)?,
            Piece::Ref(name, written) => match lookup(name) {
                Some(v) => push(&mut out, v.as_ref())?,
                None => push(&mut out, written)?,
            },
        }
    }
    Ok(out)
}

/// [`expand`], charging `budget` for the result and `overhead` bytes more (the name and
/// separators of a variable, the terminator of an argument). It stops as soon as the result
/// would pass [`MAX_EXPANDED`] or what the budget has left, so it never builds more than that;
/// on an error the budget is unchanged.
pub fn expand_charged<S: AsRef<str>>(
    input: &str,
    lookup: &dyn Fn(&str) -> Option<S>,
    overhead: usize,
    budget: &mut Budget,
) -> Result<String, ExpandError> {
    let left = budget.left().saturating_sub(overhead);
    let cap = left.min(MAX_EXPANDED);
    match expand_capped(input, lookup, cap) {
        Ok(out) => {
            budget.charge(out.len() + overhead)?;
            Ok(out)
        }
        Err(()) if cap < MAX_EXPANDED => Err(ExpandError::OverBudget { limit: budget.limit }),
        Err(()) => Err(ExpandError::TooLong(TooLong)),
    }
}

/// The length [`expand`] would give `input`, from the lengths of the defined variables alone
/// (`len_of`), without building it; saturates instead of overflowing. A reference counts as
/// the longer of its value and its text as written, so a variable the caller may leave out
/// after all is never counted short.
pub fn expanded_len(input: &str, len_of: &dyn Fn(&str) -> Option<usize>) -> usize {
    pieces(input).fold(0usize, |n, piece| {
        n.saturating_add(match piece {
            Piece::Text(t) => t.len(),
            Piece::Ref(name, written) => {
                len_of(name).map_or(written.len(), |v| v.max(written.len()))
            }
        })
    })
}

/// A process's environment and arguments built by Kubernetes' rules, each charged to one
/// [`Budget`] as it is made: what the daemon starts a container with. Looking a variable up
/// costs one map lookup, however many there are.
#[derive(Debug, Clone, Default)]
pub struct EnvBuilder {
    vars: Vec<(String, String)>,
    /// The latest index of each name: a later definition hides an earlier one.
    latest: std::collections::HashMap<String, usize>,
    budget: Budget,
}

impl EnvBuilder {
    /// An empty environment that may take at most `limit` bytes with its arguments
    /// ([`MAX_EXEC_BYTES`] for a process).
    pub fn new(limit: usize) -> Self {
        Self { budget: Budget::new(limit), ..Self::default() }
    }

    /// Adds `name`, its `value`'s references expanded with the variables added before it
    /// (`env[].value`). Nothing is added, and no more than the limits allow is built, when it
    /// does not fit.
    pub fn push_expanded(&mut self, name: &str, value: &str) -> Result<(), ExpandError> {
        let value = {
            let lookup = |n: &str| self.get(n);
            let mut budget = self.budget.clone();
            let v = expand_charged(value, &lookup, name.len() + 2, &mut budget)?;
            self.budget = budget;
            v
        };
        self.insert(name, value);
        Ok(())
    }

    /// Adds `name` with `value` as given (a `valueFrom`, the daemon's own variables), charged
    /// the same way.
    pub fn push(&mut self, name: &str, value: String) -> Result<(), ExpandError> {
        self.budget.charge_var(name, &value)?;
        self.insert(name, value);
        Ok(())
    }

    fn insert(&mut self, name: &str, value: String) {
        self.latest.insert(name.to_owned(), self.vars.len());
        self.vars.push((name.to_owned(), value));
    }

    /// The value of the latest variable named `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.latest.get(name).and_then(|&i| self.vars.get(i)).map(|(_, v)| v.as_str())
    }

    /// `arg` (of `command` or `args`) with every variable added so far, charged to the same
    /// budget: arguments and environment share the kernel's limit.
    pub fn expand_arg(&mut self, arg: &str) -> Result<String, ExpandError> {
        let lookup = |n: &str| self.get(n);
        let mut budget = self.budget.clone();
        let out = expand_charged(arg, &lookup, 1, &mut budget)?;
        self.budget = budget;
        Ok(out)
    }

    /// Charges an argument used as written (xpu's short form runs its command as given).
    pub fn charge_arg(&mut self, arg: &str) -> Result<(), ExpandError> {
        self.budget.charge(arg.len().saturating_add(1))
    }

    /// Bytes charged so far.
    pub fn used(&self) -> usize {
        self.budget.used()
    }

    pub fn vars(&self) -> &[(String, String)] {
        &self.vars
    }

    pub fn into_vars(self) -> Vec<(String, String)> {
        self.vars
    }
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

    #[test]
    fn lengths_alone_agree_with_the_expansion() {
        // Values longer than their references: the lengths are exact.
        let long = |n: &str| vars(n).map(|_| format!("{n:-<40}"));
        let len_of = |n: &str| long(n).map(|v| v.len());
        for s in [
            "--node_rank=$(JOB_COMPLETION_INDEX)",
            "$(JOB_NAME)$(JOB_NAME)-$(NOPE)",
            "$$(JOB_NAME) $$$(JOB_NAME) $$ $",
            "$(JOB_NAME $() $(EMPTY)x end$",
            "ünïcode $(JOB_NAME) ✓",
        ] {
            assert_eq!(expanded_len(s, &len_of), expand(s, &long).unwrap().len(), "{s}");
        }
        // A shorter value counts as its reference: never less than may be built.
        let short = |n: &str| vars(n).map(|v| v.len());
        assert_eq!(expanded_len("a$(EMPTY)b", &short), "a$(EMPTY)b".len());
        assert_eq!(expanded_len("$(BIG)$(BIG)", &|_| Some(usize::MAX)), usize::MAX);
    }

    #[test]
    fn a_fan_out_stops_at_the_total_while_it_is_built() {
        // The manifest: A of 64 KiB, B=$(A)$(A), then thousands of B=$(B); each value
        // is under the per-value cap, together they are gigabytes.
        let mut env = EnvBuilder::new(MAX_EXEC_BYTES);
        env.push_expanded("A", &"a".repeat(64 << 10)).unwrap();
        env.push_expanded("B", "$(A)$(A)").unwrap();
        let mut stopped = None;
        for i in 0..10_000 {
            if let Err(e) = env.push_expanded("B", "$(B)") {
                stopped = Some((i, e));
                break;
            }
            assert!(env.used() <= MAX_EXEC_BYTES);
        }
        let (i, e) = stopped.unwrap();
        assert_eq!(i, 14, "64 KiB + 15 x 128 KiB fit in 2 MiB, the next does not");
        assert_eq!(e, ExpandError::OverBudget { limit: MAX_EXEC_BYTES });
        assert!(e.to_string().contains("2048 KiB"), "{e}");
        assert_eq!(env.vars().len(), 16, "the refused one is not added");
        // Arguments share the budget.
        let mut small = EnvBuilder::new(100);
        small.push_expanded("X", &"x".repeat(40)).unwrap();
        assert_eq!(small.expand_arg("$(X)").unwrap().len(), 40);
        assert!(matches!(small.expand_arg("$(X)"), Err(ExpandError::OverBudget { limit: 100 })));
        assert_eq!(small.used(), 43 + 41);
        // One value past 128 KiB is still the per-value error.
        let mut one = EnvBuilder::new(MAX_EXEC_BYTES);
        one.push("A", "a".repeat(100 << 10)).unwrap();
        assert_eq!(one.push_expanded("B", "$(A)$(A)"), Err(ExpandError::TooLong(TooLong)));
        assert_eq!(one.get("A").map(str::len), Some(100 << 10));
        assert_eq!(one.get("B"), None);
    }

    #[test]
    fn a_budget_refuses_what_does_not_fit_and_stays_as_it_was() {
        let mut b = Budget::new(10);
        b.charge_var("AB", "cdef").unwrap();
        assert_eq!((b.used(), b.left()), (8, 2));
        assert!(b.charge(3).is_err());
        assert_eq!(b.used(), 8);
        let lookup = |_: &str| Some("0123456789");
        assert!(expand_charged("$(V)", &lookup, 0, &mut b).is_err());
        assert_eq!(expand_charged("ok", &lookup, 0, &mut b).unwrap(), "ok");
        assert_eq!(b.left(), 0);
    }
}
