//! The keys of `runtime.toml` and the checks that need nothing of the host; `xpu_container::config`
//! adds the messages and the typed values.

use alloc::string::String;
use alloc::vec::Vec;

use serde::Deserialize;

/// The settings file as written: every key optional, unknown keys refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    pub root: Option<String>,
    pub runtime: Option<String>,
    pub log_file: Option<String>,
    pub default_capabilities: Option<String>,
    pub cuda_version: Option<String>,
    pub cdi_dirs: Option<Vec<String>>,
}

/// A value the shim cannot use, found by [`File::problem`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem<'a> {
    /// `root` is not an absolute path.
    RelativeRoot(&'a str),
    /// A `cdi_dirs` entry is not an absolute path.
    RelativeCdiDir(&'a str),
    /// `cuda_version` is not a version like `12.2`.
    BadCudaVersion(&'a str),
}

impl File {
    /// Parses the file's text (TOML); the error is the parser's message.
    pub fn parse(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// The first value that cannot be used, in the order the shim reports them
    /// (`default_capabilities`, which needs the capability names, is checked there).
    pub fn problem(&self) -> Option<Problem<'_>> {
        if let Some(v) = self.cuda_version.as_deref()
            && version_parts(v).is_none()
        {
            return Some(Problem::BadCudaVersion(v));
        }
        if let Some(r) = self.root.as_deref()
            && !r.starts_with('/')
        {
            return Some(Problem::RelativeRoot(r));
        }
        if let Some(d) = self.cdi_dirs.iter().flatten().find(|d| !d.starts_with('/')) {
            return Some(Problem::RelativeCdiDir(d));
        }
        None
    }

    /// The real runtime as configured: `runc` when unset or empty.
    pub fn runtime(&self) -> &str {
        self.runtime.as_deref().filter(|r| !r.is_empty()).unwrap_or("runc")
    }
}

/// The numbers of a dotted version (`12.2` → `[12, 2]`), blanks around it ignored; `None` when
/// a part is not a number.
pub fn version_parts(s: &str) -> Option<Vec<u64>> {
    let parts: Option<Vec<u64>> = s.trim().split('.').map(|p| p.parse().ok()).collect();
    parts.filter(|p| !p.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_in_the_full_shims_order() {
        let f = File::parse("root = \"rel\"\ncuda_version = \"x\"\n").unwrap();
        assert_eq!(f.problem(), Some(Problem::BadCudaVersion("x")));
        let f = File::parse("root = \"rel\"\ncdi_dirs = [\"cdi\"]\n").unwrap();
        assert_eq!(f.problem(), Some(Problem::RelativeRoot("rel")));
        let f = File::parse("cdi_dirs = [\"/etc/cdi\", \"cdi\"]\n").unwrap();
        assert_eq!(f.problem(), Some(Problem::RelativeCdiDir("cdi")));
        assert!(File::parse("runtim = \"x\"").is_err());
        let f = File::parse("runtime = \"\"").unwrap();
        assert_eq!((f.problem(), f.runtime()), (None, "runc"));
        assert_eq!(version_parts(" 12.2 "), Some(alloc::vec![12, 2]));
        assert_eq!(version_parts("12."), None);
    }
}
