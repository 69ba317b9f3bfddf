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
use crate::root::TEXT_MAX;

/// Where `pci.ids` lives on the distributions we know.
pub const SEARCH_PATHS: [&str; 4] = [
    "/usr/share/misc/pci.ids",
    "/usr/share/hwdata/pci.ids",
    "/usr/share/pci.ids",
    "/usr/local/share/pci.ids",
];

/// The first `pci.ids` found under `root`, then on the running host.
pub fn find(root: &Root) -> Option<PathBuf> {
    find_noting(root, &mut Vec::new())
}

/// [`find`], with a warning in `w` for a candidate that is there but is not a regular file (a
/// FIFO, a link to a device): it is passed over, never read.
pub fn find_noting(root: &Root, w: &mut Vec<String>) -> Option<PathBuf> {
    let under_root = SEARCH_PATHS.iter().map(|p| root.path(p));
    let on_host = SEARCH_PATHS.iter().filter(|_| !root.is_host()).map(PathBuf::from);
    crate::root::first_regular(under_root.chain(on_host), |p| p.display().to_string(), w)
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
    /// The file is a regular file of at most [`TEXT_MAX`] bytes (it is about 1.5 MB).
    pub fn load(path: &Path, devices: &HashSet<(u16, u16)>) -> std::io::Result<Self> {
        let data = crate::root::read_bounded(path, TEXT_MAX)?;
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
        // Class lines ("C 03  Display controller") only appear in the trailing class section,
        // which opens with class 00: look for it from the end, where it is, before scanning
        // the whole file forward.
        let class_start = memchr::memmem::rfind(data, b"\nC 00 ")
            .or_else(|| memchr::memmem::find(data, b"\nC "))
            .map_or(data.len(), |i| i + 1);
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
/// Where the line of `vendor` starts. `pci.ids` lists vendors in id order, so this is a binary
/// search over the bytes (a few dozen line scans instead of a pass over the whole file); a file
/// out of order falls back to the plain search.
fn find_vendor(data: &[u8], vendor: u16) -> Option<usize> {
    let (mut lo, mut hi) = (0, data.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match next_vendor_line(data, mid, hi) {
            Some((at, id)) if id == u32::from(vendor) => return Some(at),
            Some((at, id)) if id < u32::from(vendor) => lo = at + 1,
            _ => hi = mid,
        }
    }
    find_vendor_linear(data, vendor)
}

/// The first vendor line (4 hex digits and a space at the line's start) starting at or after
/// `from` and before `end`, with its id.
fn next_vendor_line(data: &[u8], from: usize, end: usize) -> Option<(usize, u32)> {
    let mut at = if from == 0 || data.get(from - 1) == Some(&b'\n') {
        from
    } else {
        memchr::memchr(b'\n', data.get(from..)?)? + from + 1
    };
    while at < end {
        let line = &data[at..];
        if let Some(id) = line.first().filter(|b| b.is_ascii_hexdigit()).and(hex_id(line, 4)) {
            return Some((at, id));
        }
        at += memchr::memchr(b'\n', line)? + 1;
    }
    None
}

fn find_vendor_linear(data: &[u8], vendor: u16) -> Option<usize> {
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

    /// Every vendor of a sorted file is found where the plain search finds it; ids that are
    /// absent are absent; a file out of order still finds each vendor.
    #[test]
    fn binary_search_agrees_with_the_plain_search() {
        let mut sorted = String::from("# head\n");
        for v in (0x0010u32..0xfff0).step_by(0x0123) {
            sorted.push_str(&format!(
                "{v:04x}  Vendor {v}\n\t0001  Device\n\t\t0002 0003  Sub\n# c\n"
            ));
        }
        let present = (0x0010u16..0xfff0).step_by(0x0123);
        let probes: Vec<u16> = present
            .flat_map(|v| [v - 1, v, v + 1])
            .chain((0..=u16::MAX).step_by(97))
            .chain([0, 0x10de, 0x1af4, u16::MAX])
            .collect();
        for data in [sorted.as_bytes(), SAMPLE.as_bytes()] {
            for &v in &probes {
                assert_eq!(find_vendor(data, v), find_vendor_linear(data, v), "vendor {v:04x}");
            }
        }
        let unsorted = "1af4  Red Hat\n10de  NVIDIA\n0001  First\n";
        for (v, at) in [(0x1af4, 0), (0x10de, 14), (0x0001, 27)] {
            assert_eq!(find_vendor(unsorted.as_bytes(), v), Some(at));
        }
    }

    /// The same over this machine's real `pci.ids`, when it has one.
    #[test]
    fn binary_search_on_the_system_database() {
        let Ok(data) = std::fs::read("/usr/share/misc/pci.ids") else { return };
        let end = memchr::memmem::find(&data, b"\nC ").map_or(data.len(), |i| i + 1);
        let vendors = &data[..end];
        // Each vendor line's position, read off the iterator (first one wins).
        let mut at: HashMap<u16, usize> = HashMap::new();
        for line in (Lines { data: vendors, pos: 0 }) {
            if let Some(id) = line.first().filter(|b| b.is_ascii_hexdigit()).and(hex_id(line, 4)) {
                let pos = line.as_ptr() as usize - vendors.as_ptr() as usize;
                at.entry(id as u16).or_insert(pos);
            }
        }
        assert!(at.len() > 1000, "{} vendors", at.len());
        for (&v, &pos) in &at {
            assert_eq!(find_vendor(vendors, v), Some(pos), "{v:04x}");
        }
        let names = PciNames::parse(&data, &HashSet::from([(0x10de, 0x20b0)]));
        assert_eq!(names.vendor(0x10de), Some("NVIDIA Corporation"));
        assert_eq!(names.class(0x0302), Some("3D controller"));
    }
}
