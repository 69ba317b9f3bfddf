//! Resource limits: the effective ones of a process (`/proc/self/limits`) and the configured
//! ones (`/etc/security/limits.conf`, then `/etc/security/limits.d/*.conf`) as pam_limits(8)
//! applies them at login.
//!
//! pam_limits rules followed (limits.conf(5)):
//! - a line is `<domain> <type> <item> <value>`; `#` starts a comment; type is `soft`, `hard`
//!   or `-` (both); `unlimited`, `infinity` and `-1` mean no limit;
//! - files are read in order, limits.conf first, then `limits.d/*.conf` in C-locale order;
//! - a user-name entry beats a `*` entry whatever their order; among entries of the same kind
//!   the later one wins;
//! - group (`@grp`) and wildcard limits are not applied to root: root needs literal `root` lines
//!   (which is why the TPU seed writes `root ... nofile` lines next to its `*` lines).
//!
//! Only the two users that matter to provisioning are evaluated: `root` and "any other user"
//! (who matches `*` only, since xpu does not know their name or groups). `@group`, `%group` and
//! uid-range entries are parsed and ignored.
//!
//! A configuration file that exists but cannot be read is an error naming the file: a readiness
//! verdict built on a file we could not read would be a guess.

use crate::Root;
use crate::root::{MAX_READ, ReadError, TEXT_MAX};

/// One limit value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Limit {
    Value(u64),
    Unlimited,
}

impl Limit {
    /// `unlimited`, `infinity`, `-1` or a decimal number.
    pub fn parse(s: &str) -> Option<Limit> {
        match s {
            "unlimited" | "infinity" | "-1" => Some(Limit::Unlimited),
            _ => s.parse().ok().map(Limit::Value),
        }
    }

    pub fn at_least(self, n: u64) -> bool {
        match self {
            Limit::Unlimited => true,
            Limit::Value(v) => v >= n,
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Unlimited => f.write_str("unlimited"),
            Limit::Value(v) => write!(f, "{v}"),
        }
    }
}

/// The items xpu cares about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Item {
    /// `memlock` (KiB in limits.conf, bytes in /proc/self/limits).
    Memlock,
    /// `nofile`.
    Nofile,
}

impl Item {
    pub fn conf_name(self) -> &'static str {
        match self {
            Item::Memlock => "memlock",
            Item::Nofile => "nofile",
        }
    }

    /// The row name in `/proc/<pid>/limits`.
    pub fn proc_name(self) -> &'static str {
        match self {
            Item::Memlock => "Max locked memory",
            Item::Nofile => "Max open files",
        }
    }
}

/// Soft and hard values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SoftHard {
    pub soft: Option<Limit>,
    pub hard: Option<Limit>,
}

/// Reads the effective limits of `item` from a `/proc/<pid>/limits` text.
pub fn parse_proc_limits(text: &str, item: Item) -> Option<SoftHard> {
    let line = text.lines().find(|l| l.starts_with(item.proc_name()))?;
    let mut rest = line[item.proc_name().len()..].split_whitespace();
    let soft = Limit::parse(rest.next()?);
    let hard = Limit::parse(rest.next()?);
    Some(SoftHard { soft, hard })
}

/// The effective limits of the running process, or under a fixture root the file the fixture
/// provides at `ROOT/proc/self/limits`. `None` when there is no such file or no such line; an
/// error when the file is there but cannot be read (a FIFO, a link to a device, too large).
pub fn effective(root: &Root, item: Item) -> Result<Option<SoftHard>, LimitsError> {
    const PROC_LIMITS: &str = "/proc/self/limits";
    let Some(text) = read_text(PROC_LIMITS, root, TEXT_MAX)? else { return Ok(None) };
    Ok(parse_proc_limits(&text, item))
}

/// A configuration file that exists but cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {path}: {error}; make it a readable text file or remove it")]
pub struct LimitsError {
    /// Host path (`/etc/security/limits.conf`).
    pub path: String,
    pub error: std::io::Error,
}

/// Who the limits are evaluated for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject {
    Root,
    /// Any user other than root, known only through `*`.
    AnyUser,
}

/// One parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Host path of the file and 1-based line number.
    pub file: String,
    pub line: usize,
    pub domain: String,
    pub kind: String,
    pub item: String,
    pub value: String,
}

/// Every limits file of a host, in the order pam_limits reads them.
#[derive(Debug, Clone, Default)]
pub struct LimitsConfig {
    pub files: Vec<String>,
    pub entries: Vec<Entry>,
    /// Lines pam_limits would skip, with the reason.
    pub warnings: Vec<String>,
}

pub const LIMITS_CONF: &str = "/etc/security/limits.conf";
pub const LIMITS_D: &str = "/etc/security/limits.d";

/// Host file `host_path` under `root`, at most `limit` bytes; `None` when it does not exist. A
/// link to `/dev/null` (a masked file) is empty, as pam_limits reads it.
fn read_text(host_path: &str, root: &Root, limit: u64) -> Result<Option<String>, LimitsError> {
    match root.read_bounded(&root.path(host_path), limit) {
        Ok(bytes) => String::from_utf8(bytes).map(Some).map_err(|e| LimitsError {
            path: host_path.to_owned(),
            error: std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()),
        }),
        Err(ReadError::Missing) => Ok(None),
        Err(e) if e.is_null_device() => Ok(Some(String::new())),
        Err(e) => Err(LimitsError { path: host_path.to_owned(), error: e.into() }),
    }
}

impl LimitsConfig {
    /// Reads limits.conf and limits.d under `root`. Missing files are fine (no configuration).
    pub fn load(root: &Root) -> Result<LimitsConfig, LimitsError> {
        let mut cfg = LimitsConfig::default();
        let mut paths: Vec<String> = vec![LIMITS_CONF.to_owned()];
        match std::fs::read_dir(root.path(LIMITS_D)) {
            Ok(entries) => {
                let mut names: Vec<String> = entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(".conf") && !n.starts_with('.'))
                    .collect();
                // pam_limits sorts with the C locale: byte order.
                names.sort();
                paths.extend(names.into_iter().map(|n| format!("{LIMITS_D}/{n}")));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(LimitsError { path: LIMITS_D.to_owned(), error: source }),
        }
        for host in paths {
            if let Some(text) = read_text(&host, root, MAX_READ)? {
                cfg.parse_file(&host, &text);
                cfg.files.push(host);
            }
        }
        Ok(cfg)
    }

    /// Adds the entries of one file's text.
    pub fn parse_file(&mut self, file: &str, text: &str) {
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() != 4 {
                self.warnings.push(format!(
                    "{file}:{}: expected <domain> <type> <item> <value>, got {line:?}; pam_limits skips it",
                    i + 1
                ));
                continue;
            }
            if !matches!(f[1], "soft" | "hard" | "-") {
                self.warnings.push(format!(
                    "{file}:{}: type {:?} is not soft, hard or -; pam_limits skips it",
                    i + 1,
                    f[1]
                ));
                continue;
            }
            self.entries.push(Entry {
                file: file.to_owned(),
                line: i + 1,
                domain: f[0].to_owned(),
                kind: f[1].to_owned(),
                item: f[2].to_owned(),
                value: f[3].to_owned(),
            });
        }
    }

    /// The soft and hard values `subject` gets for `item` at login, `None` where no line sets
    /// one (the kernel's or the init system's default then applies).
    pub fn resolve(&self, subject: Subject, item: Item) -> SoftHard {
        // pam_limits' sources: a user line (0) beats a wildcard line (1); an entry is taken when
        // its source is at least as specific as the one already taken, so later lines of the
        // same kind win.
        let mut soft: Option<(u8, Limit)> = None;
        let mut hard: Option<(u8, Limit)> = None;
        for e in self.entries.iter().filter(|e| e.item == item.conf_name()) {
            let source = match (e.domain.as_str(), subject) {
                ("root", Subject::Root) => 0,
                ("*", Subject::AnyUser) => 1,
                _ => continue,
            };
            let Some(value) = Limit::parse(&e.value) else { continue };
            let take = |slot: &mut Option<(u8, Limit)>| {
                if slot.is_none_or(|(s, _)| source <= s) {
                    *slot = Some((source, value));
                }
            };
            if e.kind == "soft" || e.kind == "-" {
                take(&mut soft);
            }
            if e.kind == "hard" || e.kind == "-" {
                take(&mut hard);
            }
        }
        SoftHard { soft: soft.map(|(_, v)| v), hard: hard.map(|(_, v)| v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC: &str = "\
Limit                     Soft Limit           Hard Limit           Units
Max open files            20000                20000                files
Max locked memory         8388608              unlimited            bytes
";

    #[test]
    fn proc_limits() {
        let m = parse_proc_limits(PROC, Item::Memlock).unwrap();
        assert_eq!(m.soft, Some(Limit::Value(8388608)));
        assert_eq!(m.hard, Some(Limit::Unlimited));
        assert_eq!(parse_proc_limits(PROC, Item::Nofile).unwrap().soft, Some(Limit::Value(20000)));
        assert_eq!(parse_proc_limits("", Item::Nofile), None);
    }

    #[test]
    fn wildcard_does_not_reach_root_and_user_lines_beat_wildcards() {
        let mut c = LimitsConfig::default();
        c.parse_file(
            "/etc/security/limits.conf",
            "# seed lines\n*  hard  memlock  unlimited\n*  soft  memlock  unlimited\nroot - nofile 100000\n",
        );
        c.parse_file(
            "/etc/security/limits.d/10-x.conf",
            "* - nofile 4096\nroot soft nofile 1024 # later\n@wheel - nofile 5\nbad line\n",
        );
        assert_eq!(
            c.resolve(Subject::AnyUser, Item::Memlock),
            SoftHard { soft: Some(Limit::Unlimited), hard: Some(Limit::Unlimited) }
        );
        assert_eq!(c.resolve(Subject::Root, Item::Memlock), SoftHard::default());
        assert_eq!(
            c.resolve(Subject::Root, Item::Nofile),
            SoftHard { soft: Some(Limit::Value(1024)), hard: Some(Limit::Value(100000)) }
        );
        assert_eq!(c.resolve(Subject::AnyUser, Item::Nofile).soft, Some(Limit::Value(4096)));
        assert_eq!(c.warnings.len(), 1);
        assert!(c.warnings[0].contains("10-x.conf:4"), "{:?}", c.warnings);
    }

    #[test]
    fn a_user_line_beats_a_later_wildcard_line() {
        let mut c = LimitsConfig::default();
        c.parse_file("a", "root - nofile 100000\n");
        c.parse_file("b", "* - nofile 10\nroot soft nofile 200000\n");
        let r = c.resolve(Subject::Root, Item::Nofile);
        assert_eq!(r.soft, Some(Limit::Value(200000)));
        assert_eq!(r.hard, Some(Limit::Value(100000)));
    }

    #[test]
    fn unreadable_file_names_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc/security/limits.conf")).unwrap();
        let e = LimitsConfig::load(&Root::new(dir.path()).unwrap()).unwrap_err();
        assert!(e.to_string().starts_with("cannot read /etc/security/limits.conf: "), "{e}");
        std::fs::remove_dir(dir.path().join("etc/security/limits.conf")).unwrap();
        std::fs::write(dir.path().join("etc/security/limits.conf"), b"* - nofile \xff\n").unwrap();
        let e = LimitsConfig::load(&Root::new(dir.path()).unwrap()).unwrap_err();
        assert!(e.to_string().contains("limits.conf"), "{e}");
    }
}
