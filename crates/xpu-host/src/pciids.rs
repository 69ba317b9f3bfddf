//! Names from the PCI ID database (`pci.ids`), offline.
//!
//! The file is the one the system ships (`/usr/share/misc/pci.ids` on Debian,
//! `/usr/share/hwdata/pci.ids` on Fedora/RHEL), looked up first under `--root` and then on the
//! running host, or a path given explicitly. Nothing is downloaded, at build time or run time.
//!
//! Only the names actually asked for are kept: one pass over the file collects the vendors and
//! devices in the wanted set and the class names, so a lookup costs one sequential read.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::Root;

/// Where `pci.ids` lives on the distributions we know.
pub const SEARCH_PATHS: [&str; 4] = [
    "/usr/share/misc/pci.ids",
    "/usr/share/hwdata/pci.ids",
    "/usr/share/pci.ids",
    "/usr/local/share/pci.ids",
];

/// The first `pci.ids` found under `root`, then on the running host.
pub fn find(root: &Root) -> Option<PathBuf> {
    let under_root = SEARCH_PATHS.iter().map(|p| root.path(p));
    let on_host = SEARCH_PATHS.iter().map(PathBuf::from);
    under_root.chain(on_host).find(|p| p.is_file())
}

/// Names for a set of vendors, devices and classes.
#[derive(Debug, Default, Clone)]
pub struct PciNames {
    vendors: HashMap<u16, String>,
    devices: HashMap<(u16, u16), String>,
    classes: HashMap<u8, String>,
    subclasses: HashMap<(u8, u8), String>,
}

impl PciNames {
    pub fn vendor(&self, vendor: u16) -> Option<&str> {
        self.vendors.get(&vendor).map(String::as_str)
    }

    pub fn device(&self, vendor: u16, device: u16) -> Option<&str> {
        self.devices.get(&(vendor, device)).map(String::as_str)
    }

    /// The subclass name (`3D controller`), falling back to the base class (`Bridge`), as
    /// `lspci` does.
    pub fn class(&self, class16: u16) -> Option<&str> {
        let (base, sub) = ((class16 >> 8) as u8, (class16 & 0xff) as u8);
        self.subclasses.get(&(base, sub)).or_else(|| self.classes.get(&base)).map(String::as_str)
    }

    /// Reads `path` and keeps the names of the `devices` (vendor, device) pairs, their vendors
    /// and every class.
    pub fn load(path: &Path, devices: &HashSet<(u16, u16)>) -> std::io::Result<Self> {
        let data = std::fs::read(path)?;
        Ok(Self::parse(&data, devices))
    }

    /// Parses `pci.ids` content. Malformed lines are skipped, as `lspci` skips them. Names are
    /// only allocated for what was asked for: a vendor like Intel has thousands of entries.
    pub fn parse(data: &[u8], devices: &HashSet<(u16, u16)>) -> Self {
        let mut wanted: HashMap<u16, Vec<u16>> = HashMap::new();
        for &(v, d) in devices {
            wanted.entry(v).or_default().push(d);
        }
        let mut out = Self::default();
        // Class lines ("C 03  Display controller") only appear in the trailing class section.
        let class_start = memchr::memmem::find(data, b"\nC ").map_or(data.len(), |i| i + 1);
        let vendors = &data[..class_start];
        for (&vendor, ids) in &wanted {
            let Some(at) = find_vendor(vendors, vendor) else { continue };
            let mut lines = Lines { data: vendors, pos: at };
            if let Some((_, name)) = lines.next().and_then(|l| hex_and_name(l, 4)) {
                out.vendors.insert(vendor, name);
            }
            for line in lines {
                match line.first() {
                    Some(b'\t') => {}
                    None | Some(b'#') => continue,
                    Some(_) => break,
                }
                // Device lines have one tab; subsystem lines two.
                if let Some(id) = hex_id(&line[1..], 4)
                    && ids.contains(&(id as u16))
                    && let Some((_, name)) = hex_and_name(&line[1..], 4)
                {
                    out.devices.insert((vendor, id as u16), name);
                }
            }
        }
        let mut class = None;
        for line in (Lines { data, pos: class_start }) {
            if let Some(rest) = line.strip_prefix(b"C ") {
                class = hex_and_name(rest, 2).map(|(id, name)| {
                    out.classes.insert(id as u8, name);
                    id as u8
                });
            } else if let (Some(c), Some(rest)) = (class, line.strip_prefix(b"\t"))
                && !rest.starts_with(b"\t")
                && let Some((id, name)) = hex_and_name(rest, 2)
            {
                out.subclasses.insert((c, id as u8), name);
            }
        }
        out
    }
}

/// Lines of `data` from `pos` (a line start), without their newline.
struct Lines<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Iterator for Lines<'a> {
    type Item = &'a [u8];
    fn next(&mut self) -> Option<&'a [u8]> {
        if self.pos >= self.data.len() {
            return None;
        }
        let rest = &self.data[self.pos..];
        let len = memchr::memchr(b'\n', rest).unwrap_or(rest.len());
        self.pos += len + 1;
        Some(&rest[..len])
    }
}

/// Where vendor `vendor`'s line starts: one SIMD substring search, much cheaper than walking
/// the 36,000 lines of the file.
fn find_vendor(data: &[u8], vendor: u16) -> Option<usize> {
    if data.starts_with(format!("{vendor:04x}  ").as_bytes()) {
        return Some(0);
    }
    let needle = format!("\n{vendor:04x}  ");
    memchr::memmem::find(data, needle.as_bytes()).map(|i| i + 1)
}

/// The `width`-digit hex id a line starts with, when a space follows it.
fn hex_id(line: &[u8], width: usize) -> Option<u32> {
    let id = line.get(..width)?;
    if line.get(width) != Some(&b' ') {
        return None;
    }
    id.iter().try_fold(0u32, |acc, &b| Some(acc * 16 + (b as char).to_digit(16)?))
}

/// `10de  NVIDIA Corporation` → (0x10de, "NVIDIA Corporation").
fn hex_and_name(line: &[u8], width: usize) -> Option<(u32, String)> {
    let id = hex_id(line, width)?;
    let name = String::from_utf8_lossy(&line[width..]).trim().to_owned();
    Some((id, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
# comment
10de  NVIDIA Corporation
\t20b0  GA100 [A100 SXM4 40GB]
\t\t10de 134f  A100 subsystem
\t1af1  GA100 [A100 NVSwitch]
1af4  Red Hat, Inc.
\t1041  Virtio 1.0 network device
bogus line
C 03  Display controller
\t00  VGA compatible controller
\t\t00  VGA controller
\t02  3D controller
C 06  Bridge
\t80  Bridge
C 12  Processing accelerators
";

    #[test]
    fn keeps_wanted_vendors_and_all_classes() {
        let names = PciNames::parse(
            SAMPLE.as_bytes(),
            &HashSet::from([(0x10de, 0x20b0), (0x10de, 0x1af1)]),
        );
        assert_eq!(names.vendor(0x10de), Some("NVIDIA Corporation"));
        assert_eq!(names.device(0x10de, 0x20b0), Some("GA100 [A100 SXM4 40GB]"));
        assert_eq!(names.device(0x10de, 0x1af1), Some("GA100 [A100 NVSwitch]"));
        assert_eq!(names.vendor(0x1af4), None);
        assert_eq!(names.class(0x0302), Some("3D controller"));
        assert_eq!(names.class(0x0680), Some("Bridge"));
        assert_eq!(names.class(0x1200), Some("Processing accelerators"));
        assert_eq!(names.class(0x0399), Some("Display controller"));
    }

    #[test]
    fn garbage_is_skipped() {
        let names = PciNames::parse(b"\xff\xfe\n\tzz\nC zz\n", &HashSet::new());
        assert_eq!(names.class(0x0300), None);
    }
}
