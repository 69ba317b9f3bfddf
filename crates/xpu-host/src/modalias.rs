//! Which kernel modules claim a device: the device's `modalias`
//! (`pci:v000010DEd000020B0sv000010DEsd0000134Fbc03sc02i00`) matched against the `alias pci:...`
//! lines of `lib/modules/$(uname -r)/modules.alias`, with the shell-glob rules kmod uses
//! (`*`, `?`, `[...]`). This is what `lspci -k` prints as "Kernel modules".
//!
//! Patterns are indexed by their vendor field when it is literal, so a device is only matched
//! against its vendor's aliases plus the few vendor-wildcard ones (class-based drivers).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::Root;
use crate::root::TEXT_MAX;

/// Parsed `pci:` aliases.
#[derive(Debug, Default, Clone)]
pub struct ModuleAliases {
    by_vendor: HashMap<[u8; 8], Vec<(String, String)>>,
    wildcard: Vec<(String, String)>,
}

/// `modules.alias` for `release` under `root` (also the merged-/usr location).
pub fn find(root: &Root, release: &str) -> Option<PathBuf> {
    find_noting(root, release, &mut Vec::new())
}

/// [`find`], with a warning in `w` for a candidate that is there but is not a regular file.
pub fn find_noting(root: &Root, release: &str, w: &mut Vec<String>) -> Option<PathBuf> {
    let candidates = ["/lib/modules", "/usr/lib/modules"]
        .iter()
        .map(|d| root.path(format!("{d}/{release}/modules.alias")));
    crate::root::first_regular(candidates, |p| root.display(p), w)
}

impl ModuleAliases {
    /// Reads `path` (a regular file of at most [`TEXT_MAX`] bytes: a distribution kernel's is
    /// about 1.5 MB).
    pub fn load(path: &Path) -> std::io::Result<Self> {
        let data = crate::root::read_bounded(path, TEXT_MAX)?;
        Ok(Self::parse(&String::from_utf8_lossy(&data)))
    }

    pub fn parse(text: &str) -> Self {
        let mut out = Self::default();
        for line in text.lines() {
            let mut words = line.split_ascii_whitespace();
            let (Some("alias"), Some(pattern), Some(module)) =
                (words.next(), words.next(), words.next())
            else {
                continue;
            };
            if !pattern.starts_with("pci:") {
                continue;
            }
            let entry = (pattern.to_owned(), module.to_owned());
            match literal_vendor(pattern) {
                Some(v) => out.by_vendor.entry(v).or_default().push(entry),
                None => out.wildcard.push(entry),
            }
        }
        out
    }

    /// Modules whose aliases match `modalias`, each once, in file order.
    pub fn modules_for(&self, modalias: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let vendor_list = literal_vendor(modalias).and_then(|v| self.by_vendor.get(&v));
        let candidates = vendor_list.into_iter().flatten().chain(self.wildcard.iter());
        for (pattern, module) in candidates {
            if glob_match(pattern.as_bytes(), modalias.as_bytes()) && !out.contains(module) {
                out.push(module.clone());
            }
        }
        out
    }
}

/// The 8 vendor digits after `pci:v` when they contain no glob characters.
fn literal_vendor(s: &str) -> Option<[u8; 8]> {
    let v = s.as_bytes().get(5..13)?;
    if !s.starts_with("pci:v") || v.iter().any(|b| matches!(b, b'*' | b'?' | b'[')) {
        return None;
    }
    let mut out = [0u8; 8];
    for (o, b) in out.iter_mut().zip(v) {
        *o = b.to_ascii_uppercase();
    }
    Some(out)
}

/// fnmatch(3) without flags: `*`, `?`, `[abc]`, `[a-z]`, `[!x]`. Iterative with one backtrack
/// point, so it is linear in practice and never recurses on hostile input.
pub fn glob_match(pat: &[u8], s: &[u8]) -> bool {
    let (mut p, mut i) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        if p < pat.len() {
            match pat[p] {
                b'*' => {
                    star = Some((p, i));
                    p += 1;
                    continue;
                }
                b'?' => {
                    p += 1;
                    i += 1;
                    continue;
                }
                b'[' => {
                    if let Some((matched, next)) = class_match(pat, p, s[i]) {
                        if matched {
                            p = next;
                            i += 1;
                            continue;
                        }
                    } else if s[i] == b'[' {
                        // An unterminated bracket matches itself literally.
                        p += 1;
                        i += 1;
                        continue;
                    }
                }
                c if c == s[i] => {
                    p += 1;
                    i += 1;
                    continue;
                }
                _ => {}
            }
        }
        match star {
            Some((sp, si)) => {
                p = sp + 1;
                i = si + 1;
                star = Some((sp, si + 1));
            }
            None => return false,
        }
    }
    pat[p..].iter().all(|&c| c == b'*')
}

/// Matches `c` against the bracket expression at `pat[start]`; returns (matched, index after).
fn class_match(pat: &[u8], start: usize, c: u8) -> Option<(bool, usize)> {
    let mut j = start + 1;
    let negate = matches!(pat.get(j), Some(b'!' | b'^'));
    if negate {
        j += 1;
    }
    let mut matched = false;
    let mut first = true;
    loop {
        let &b = pat.get(j)?;
        if b == b']' && !first {
            return Some((matched != negate, j + 1));
        }
        first = false;
        if pat.get(j + 1) == Some(&b'-') && pat.get(j + 2).is_some_and(|&e| e != b']') {
            let e = pat[j + 2];
            matched |= b <= c && c <= e;
            j += 3;
        } else {
            matched |= b == c;
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALIASES: &str = "\
# Aliases extracted from modules themselves.
alias pci:v000010DEd*sv*sd*bc03sc02i00* nvidia
alias pci:v000010DEd*sv*sd*bc03sc00i00* nvidia
alias pci:v000010DEd000020B0sv*sd*bc*sc*i* nouveau
alias pci:v000010DEd*sv*sd*bc03sc*i* nouveau
alias pci:v*d*sv*sd*bc03sc*i* vfio_pci_core_fake
alias usb:v1234* usbthing
alias pci:v00001AE0d00000062sv*sd*bc*sc*i* tpu_fake
";

    #[test]
    fn matches_like_kmod() {
        let a = ModuleAliases::parse(ALIASES);
        let ma = "pci:v000010DEd000020B0sv000010DEsd0000134Fbc03sc02i00";
        assert_eq!(a.modules_for(ma), ["nvidia", "nouveau", "vfio_pci_core_fake"]);
        let nic = "pci:v00001AF4d00001041sv00001AF4sd00001100bc02sc00i00";
        assert!(a.modules_for(nic).is_empty());
        let tpu = "pci:v00001AE0d00000062sv00001AE0sd000000ADbc12sc00i00";
        assert_eq!(a.modules_for(tpu), ["tpu_fake"]);
    }

    #[test]
    fn glob_rules() {
        assert!(glob_match(b"a*c", b"abbbc"));
        assert!(glob_match(b"*", b""));
        assert!(glob_match(b"a?c", b"abc"));
        assert!(!glob_match(b"a?c", b"ac"));
        assert!(glob_match(b"[a-c]x", b"bx"));
        assert!(glob_match(b"[!a-c]x", b"dx"));
        assert!(!glob_match(b"[!a-c]x", b"ax"));
        assert!(glob_match(b"[]]", b"]"));
        assert!(glob_match(b"a[", b"a["));
        assert!(!glob_match(b"abc", b"abcd"));
        // Pathological patterns stay fast.
        let s = vec![b'a'; 200];
        assert!(!glob_match(b"*a*a*a*a*a*a*b", &s));
    }
}
