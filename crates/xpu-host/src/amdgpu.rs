//! What amdgpu tells about a GPU's load through sysfs and hwmon, under a [`Root`]: the raw
//! values, for `xpu-telemetry`'s AMD source. Per device directory
//! (`sys/bus/pci/devices/<addr>`):
//! - `gpu_busy_percent` (0-100), `mem_info_vram_used` and `mem_info_vram_total` (bytes);
//! - `hwmon/hwmon*/power1_average` (µW; `power1_input` on newer parts), `temp1_input` (edge,
//!   m°C), `freq1_input` (sclk, Hz) and `freq2_input` (mclk, Hz);
//! - `ras/umc_err_count` (`ue: N` / `ce: N`, the memory controller's RAS counters) where the
//!   kernel exposes RAS.
//!
//! A missing file leaves its value unknown; a file with garbage in it (or unreadable: a FIFO, a
//! link to a device, more than a page, see [`Root::read_bounded`]) also gives a warning naming
//! the file.

use std::path::{Path, PathBuf};

use xpu_core::PciAddress;

use crate::Root;
use crate::discover::{Attr, read_attr};

/// One GPU's values; `None` where amdgpu does not say (or says garbage).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmdgpuStats {
    pub busy_percent: Option<u64>,
    pub vram_used_bytes: Option<u64>,
    pub vram_total_bytes: Option<u64>,
    pub power_microwatts: Option<u64>,
    pub temp_millicelsius: Option<u64>,
    pub sclk_hz: Option<u64>,
    pub mclk_hz: Option<u64>,
    /// RAS memory-controller counts: (uncorrected, corrected).
    pub umc_errors: Option<(u64, u64)>,
}

/// Reads the GPU at `addr`; problems with single files go to `warnings`.
pub fn read(root: &Root, addr: &PciAddress, warnings: &mut Vec<String>) -> AmdgpuStats {
    let dev = root.path(format!("/sys/bus/pci/devices/{addr}"));
    let num = |p: &Path, w: &mut Vec<String>| read_num(root, p, w);
    let mut s = AmdgpuStats {
        busy_percent: num(&dev.join("gpu_busy_percent"), warnings).filter(|v| *v <= 100),
        vram_used_bytes: num(&dev.join("mem_info_vram_used"), warnings),
        vram_total_bytes: num(&dev.join("mem_info_vram_total"), warnings),
        ..AmdgpuStats::default()
    };
    if let Some(hw) = hwmon_dir(&dev) {
        s.power_microwatts = num(&hw.join("power1_average"), warnings)
            .or_else(|| num(&hw.join("power1_input"), warnings));
        s.temp_millicelsius = num(&hw.join("temp1_input"), warnings);
        s.sclk_hz = num(&hw.join("freq1_input"), warnings);
        s.mclk_hz = num(&hw.join("freq2_input"), warnings);
    }
    let ras = dev.join("ras/umc_err_count");
    match read_attr(root, &ras) {
        Attr::Value(text) => match parse_ras(&text) {
            Some(c) => s.umc_errors = Some(c),
            None => warnings.push(format!(
                "{}: expected \"ue: N\" and \"ce: N\", found {:?}",
                root.display(&ras),
                short(&text)
            )),
        },
        Attr::Missing => {}
        Attr::Unreadable(e) => warnings.push(format!("{}: {e}", root.display(&ras))),
    }
    s
}

fn read_num(root: &Root, path: &Path, warnings: &mut Vec<String>) -> Option<u64> {
    match read_attr(root, path) {
        Attr::Value(s) => match s.parse::<u64>() {
            Ok(v) => Some(v),
            Err(_) => {
                let shown = root.display(path);
                warnings.push(format!("{shown}: expected a number, found {:?}", short(&s)));
                None
            }
        },
        Attr::Missing => None,
        Attr::Unreadable(e) => {
            warnings.push(format!("{}: {e}", root.display(path)));
            None
        }
    }
}

fn short(s: &str) -> String {
    s.chars().take(40).collect()
}

/// The first `hwmon/hwmonN` directory of a device (amdgpu registers one).
fn hwmon_dir(dev: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dev.join("hwmon"))
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("hwmon")))
        .collect();
    dirs.sort();
    dirs.into_iter().next()
}

/// `ue: 3\nce: 12` -> (uncorrected, corrected).
fn parse_ras(text: &str) -> Option<(u64, u64)> {
    let mut ue = None;
    let mut ce = None;
    for line in text.lines() {
        let (k, v) = line.split_once(':')?;
        let v: u64 = v.trim().parse().ok()?;
        match k.trim() {
            "ue" => ue = Some(v),
            "ce" => ce = Some(v),
            _ => {}
        }
    }
    Some((ue?, ce?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ras_counts_parse_and_garbage_is_refused() {
        assert_eq!(parse_ras("ue: 3\nce: 12\n"), Some((3, 12)));
        assert_eq!(parse_ras("ce: 1\nue: 0"), Some((0, 1)));
        assert_eq!(parse_ras("ue: x\nce: 1"), None);
        assert_eq!(parse_ras("garbage"), None);
    }
}
