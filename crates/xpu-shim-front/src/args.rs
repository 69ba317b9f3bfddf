//! runc's command line, as far as the shim needs it: the subcommand and, on `create` and `run`,
//! the bundle. Follows runc's own parsing (`runc --help`): global options before the subcommand,
//! `--bundle`/`-b` on `create`/`run` (default: the current directory), Go flag syntax (`-b X`,
//! `--bundle X`, `--bundle=X`, `-bundle X`). Arguments are bytes, as the kernel passes them; one
//! that is not UTF-8 is never a flag nor a subcommand.

/// Global options of runc (and crun, youki) that take a value.
const GLOBAL_WITH_VALUE: [&str; 6] =
    ["root", "log", "log-format", "criu", "rootless", "cgroup-manager"];
/// `create`/`run` options that take a value, besides `bundle`.
const CREATE_WITH_VALUE: [&str; 4] = ["console-socket", "pid-file", "preserve-fds", "criu"];

/// The subcommand and bundle of a runtime command line, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Invocation<'a> {
    pub subcommand: Option<&'a str>,
    /// `--bundle`, or `None` for the current directory.
    pub bundle: Option<&'a [u8]>,
}

impl Invocation<'_> {
    /// Whether the runtime is asked to create a container (`create`, or `run`, which creates
    /// one first): the only commands whose spec the shim reads.
    pub fn creates(&self) -> bool {
        matches!(self.subcommand, Some("create" | "run"))
    }
}

/// `--name=value` / `-name=value` / `--name` / `-name` → (name, inline value).
fn flag(arg: &[u8]) -> Option<(&str, Option<&[u8]>)> {
    let s = core::str::from_utf8(arg).ok()?;
    let body = s.strip_prefix("--").or_else(|| s.strip_prefix('-'))?;
    if body.is_empty() {
        return None;
    }
    Some(match body.split_once('=') {
        Some((n, v)) => (n, Some(v.as_bytes())),
        None => (body, None),
    })
}

/// Finds the subcommand and, for `create`/`run`, the bundle, in `args` (everything after the
/// program name).
pub fn parse<'a, A: AsRef<[u8]>>(args: &'a [A]) -> Invocation<'a> {
    let arg = |i: usize| args.get(i).map(AsRef::as_ref);
    let mut i = 0;
    let mut subcommand = None;
    while let Some(a) = arg(i) {
        match flag(a) {
            Some((name, inline)) => {
                if inline.is_none() && GLOBAL_WITH_VALUE.contains(&name) {
                    i += 1;
                }
            }
            None => {
                subcommand = core::str::from_utf8(a).ok();
                break;
            }
        }
        i += 1;
    }
    let mut inv = Invocation { subcommand, bundle: None };
    if inv.creates() {
        let mut j = i + 1;
        while let Some(a) = arg(j) {
            if let Some((name, inline)) = flag(a) {
                if name == "bundle" || name == "b" {
                    match inline {
                        Some(v) => inv.bundle = Some(v),
                        None => {
                            inv.bundle = arg(j + 1);
                            j += 1;
                        }
                    }
                } else if inline.is_none() && CREATE_WITH_VALUE.contains(&name) {
                    j += 1;
                }
            }
            j += 1;
        }
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_subcommand_and_bundle_like_runc() {
        let i = parse(&[
            "--root",
            "/run/x",
            "--log",
            "/l",
            "--systemd-cgroup",
            "create",
            "--bundle",
            "/b",
            "--pid-file",
            "/p",
            "id",
        ]);
        assert_eq!(i.subcommand, Some("create"));
        assert_eq!(i.bundle, Some(&b"/b"[..]));
        let i = parse(&["--root=/r", "run", "-b=/c", "id"]);
        assert_eq!((i.subcommand, i.bundle), (Some("run"), Some(&b"/c"[..])));
        let i = parse(&["create", "--console-socket", "-b", "-bundle", "/d", "id"]);
        assert_eq!(i.bundle, Some(&b"/d"[..]));
        let i = parse(&["create", "id"]);
        assert_eq!(i.bundle, None);
        let i = parse(&["--debug", "state", "id"]);
        assert_eq!((i.subcommand, i.bundle), (Some("state"), None));
        assert_eq!(parse(&["--version"]).subcommand, None);
        let words: [&[u8]; 2] = [b"\xff", b"create"];
        let i = parse(&words);
        assert_eq!(i.subcommand, None, "a non-UTF-8 word is not a subcommand");
    }
}
