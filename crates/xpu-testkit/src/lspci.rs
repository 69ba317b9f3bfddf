//! Runs `lspci -D -nnk` (on the host or on a fixture through `-O sysfs.path=ROOT/sys/bus/pci`) and parses what
//! it prints, so tests can hold xpu's discovery against the tool users trust.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// What `lspci -D -nnk` says about one function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LspciDevice {
    pub address: String,
    /// `0302`
    pub class: String,
    pub vendor: String,
    pub device: String,
    pub revision: Option<String>,
    /// `None` when lspci prints no Subsystem line (ids 0000 or absent).
    pub subsystem: Option<(String, String)>,
    pub driver: Option<String>,
}

/// Whether `lspci` can be run here.
pub fn available() -> bool {
    Command::new("lspci").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Runs `lspci -D -nnk`, against `ROOT/sys` when `root` is given.
pub fn run(root: Option<&Path>) -> Result<BTreeMap<String, LspciDevice>, String> {
    let mut cmd = Command::new("lspci");
    cmd.args(["-D", "-nnk"]);
    if let Some(root) = root {
        cmd.args(["-A", "linux-sysfs", "-O"])
            .arg(format!("sysfs.path={}", root.join("sys/bus/pci").display()));
    }
    let out = cmd.output().map_err(|e| format!("running lspci: {e}"))?;
    if !out.status.success() {
        return Err(format!("lspci failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(parse(&String::from_utf8_lossy(&out.stdout)))
}

/// The last `[hhhh:hhhh]` in a line.
fn last_ids(line: &str) -> Option<(String, String)> {
    let b = line.as_bytes();
    (0..b.len().saturating_sub(10)).rev().find_map(|i| {
        let s = line.get(i..i + 11)?;
        let ok = s.starts_with('[')
            && s.ends_with(']')
            && s.as_bytes()[5] == b':'
            && s[1..5].bytes().all(|c| c.is_ascii_hexdigit())
            && s[6..10].bytes().all(|c| c.is_ascii_hexdigit());
        ok.then(|| (s[1..5].to_owned(), s[6..10].to_owned()))
    })
}

pub fn parse(text: &str) -> BTreeMap<String, LspciDevice> {
    let mut out = BTreeMap::new();
    let mut cur: Option<LspciDevice> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix('\t') {
            let Some(d) = cur.as_mut() else { continue };
            if let Some(s) = rest.strip_prefix("Subsystem: ") {
                d.subsystem = last_ids(s);
            } else if let Some(s) = rest.strip_prefix("Kernel driver in use: ") {
                d.driver = Some(s.trim().to_owned());
            }
            continue;
        }
        if let Some(d) = cur.take() {
            out.insert(d.address.clone(), d);
        }
        let Some((address, rest)) = line.split_once(' ') else { continue };
        let class = rest
            .find("]: ")
            .and_then(|end| rest.get(end.saturating_sub(4)..end))
            .unwrap_or_default()
            .to_owned();
        let (vendor, device) = last_ids(rest).unwrap_or_default();
        let revision = rest.find("(rev ").and_then(|i| rest.get(i + 5..i + 7)).map(str::to_owned);
        cur = Some(LspciDevice {
            address: address.to_owned(),
            class,
            vendor,
            device,
            revision,
            subsystem: None,
            driver: None,
        });
    }
    if let Some(d) = cur.take() {
        out.insert(d.address.clone(), d);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_seed_listing() {
        let text = "0000:4d:00.0 3D controller [0302]: NVIDIA Corporation GA100 [A100 SXM4 40GB] [10de:20b0] (rev a1)\n\tSubsystem: NVIDIA Corporation Device [10de:134f]\n\tKernel driver in use: vfio-pci\n\tKernel modules: nouveau, nvidia_drm, nvidia\n0000:00:00.0 Host bridge [0600]: Intel Corporation Device [8086:0d57]\n";
        let m = parse(text);
        let d = &m["0000:4d:00.0"];
        assert_eq!(
            (d.class.as_str(), d.vendor.as_str(), d.device.as_str()),
            ("0302", "10de", "20b0")
        );
        assert_eq!(d.subsystem, Some(("10de".into(), "134f".into())));
        assert_eq!(d.driver.as_deref(), Some("vfio-pci"));
        assert_eq!(d.revision.as_deref(), Some("a1"));
        let h = &m["0000:00:00.0"];
        assert_eq!((h.class.as_str(), h.subsystem.clone(), h.driver.clone()), ("0600", None, None));
    }
}
