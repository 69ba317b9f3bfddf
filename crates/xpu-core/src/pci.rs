//! PCI addressing and identifiers: the `dddd:bb:dd.f` address grammar the kernel uses for sysfs
//! names (and that `lspci -D` prints), and the serde forms of ids and class codes that the JSON
//! shape of `xpu discover` promises (lower-case hex, fixed width).
//!
//! Parsing is strict: the kernel never prints upper-case or short fields in sysfs names, but
//! users do type `25:00.0` (bus:device.function, domain 0000) and upper-case hex, which we accept.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A PCI function address: domain, bus, device (slot) and function.
///
/// Domains are 16 bits on most hosts, but Intel VMD exposes 32-bit domains (`10000:e1:00.0`),
/// so the domain is kept as `u32` and printed with at least four digits, as the kernel does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

/// Why a string is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid PCI address {input:?}: {reason}; expected dddd:bb:dd.f (e.g. 0000:25:00.0) or bb:dd.f"
)]
pub struct PciAddressError {
    pub input: String,
    pub reason: &'static str,
}

impl PciAddress {
    pub const fn new(domain: u32, bus: u8, device: u8, function: u8) -> Self {
        Self { domain, bus, device, function }
    }

    /// The address without its domain, as `lspci` prints it without `-D`: `25:00.0`.
    pub fn short(&self) -> String {
        format!("{:02x}:{:02x}.{:x}", self.bus, self.device, self.function)
    }

    /// `0000-25-00-0`: the address as a DNS label (the DRA device names `gpu-0000-25-00-0`).
    pub fn dns_label(&self) -> String {
        format!("{:04x}-{:02x}-{:02x}-{:x}", self.domain, self.bus, self.device, self.function)
    }

    /// The address at the end of a name that [`PciAddress::dns_label`] made
    /// (`gpu-0000-25-00-0`, `0000-25-00-0`); `None` for anything else.
    pub fn from_dns_label_suffix(name: &str) -> Option<PciAddress> {
        let parts: Vec<&str> = name.rsplitn(5, '-').collect();
        let [f, d, b, dom, ..] = parts.as_slice() else { return None };
        format!("{dom}:{b}:{d}.{f}").parse().ok()
    }

    /// `pci_0000_25_00_0`: the name libvirt gives the node device (and Nova logs as `dev_id`).
    pub fn libvirt_name(&self) -> String {
        format!("pci_{:04x}_{:02x}_{:02x}_{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

fn hex_field(s: &str, max_len: usize) -> Option<u32> {
    if s.is_empty() || s.len() > max_len || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

impl FromStr for PciAddress {
    type Err = PciAddressError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| PciAddressError { input: input.to_owned(), reason };
        let (rest, function) = input.rsplit_once('.').ok_or_else(|| err("missing .function"))?;
        let function =
            hex_field(function, 1).ok_or_else(|| err("function is not one hex digit"))?;
        if function > 7 {
            return Err(err("function must be 0-7"));
        }
        let mut parts = rest.rsplitn(3, ':');
        let device = parts.next().ok_or_else(|| err("missing device"))?;
        let bus = parts.next().ok_or_else(|| err("missing bus"))?;
        let domain = parts.next();
        let device = hex_field(device, 2).ok_or_else(|| err("device is not 1-2 hex digits"))?;
        if device > 0x1f {
            return Err(err("device must be 00-1f"));
        }
        let bus = hex_field(bus, 2).ok_or_else(|| err("bus is not 1-2 hex digits"))?;
        let domain = match domain {
            None => 0,
            Some(d) => hex_field(d, 8).ok_or_else(|| err("domain is not 1-8 hex digits"))?,
        };
        // Each field was range-checked above, so the narrowing casts are lossless.
        Ok(Self::new(domain, bus as u8, device as u8, function as u8))
    }
}

impl Serialize for PciAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Parses a sysfs id file's content (`0x10de\n`) into its value. `None` for anything else.
pub fn parse_sysfs_hex(content: &str) -> Option<u32> {
    let t = content.trim();
    let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    hex_field(digits, 8)
}

/// Serde helpers for the fixed-width lower-case hex forms of the JSON shape.
pub mod hex {
    use serde::{Deserialize, Deserializer, Serializer};

    fn de_hex<'de, D: Deserializer<'de>>(d: D, width: usize) -> Result<Option<u32>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        match s {
            None => Ok(None),
            Some(s) if s.len() == width && s.bytes().all(|b| b.is_ascii_hexdigit()) => {
                u32::from_str_radix(&s, 16).map(Some).map_err(serde::de::Error::custom)
            }
            Some(s) => {
                Err(serde::de::Error::custom(format!("expected {width} hex digits, got {s:?}")))
            }
        }
    }

    /// `Option<u16>` as `"10de"` / `null`.
    pub mod u16_4 {
        use super::*;
        pub fn serialize<S: Serializer>(v: &Option<u16>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(v) => s.collect_str(&format_args!("{v:04x}")),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u16>, D::Error> {
            Ok(de_hex(d, 4)?.and_then(|v| u16::try_from(v).ok()))
        }
    }

    /// `Option<u8>` as `"a1"` / `null`.
    pub mod u8_2 {
        use super::*;
        pub fn serialize<S: Serializer>(v: &Option<u8>, s: S) -> Result<S::Ok, S::Error> {
            match v {
                Some(v) => s.collect_str(&format_args!("{v:02x}")),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u8>, D::Error> {
            Ok(de_hex(d, 2)?.and_then(|v| u8::try_from(v).ok()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels_round_trip() {
        let a: PciAddress = "0000:c5:1f.7".parse().unwrap();
        assert_eq!(a.dns_label(), "0000-c5-1f-7");
        assert_eq!(PciAddress::from_dns_label_suffix(&format!("gpu-{}", a.dns_label())), Some(a));
        assert_eq!(PciAddress::from_dns_label_suffix(&a.dns_label()), Some(a));
        assert_eq!(PciAddress::from_dns_label_suffix("gpu-0"), None);
        assert_eq!(PciAddress::from_dns_label_suffix("GPU-6f2b"), None);
    }

    #[test]
    fn parses_full_and_short_forms() {
        let a: PciAddress = "0000:25:00.0".parse().unwrap();
        assert_eq!(a, PciAddress::new(0, 0x25, 0, 0));
        assert_eq!(a.to_string(), "0000:25:00.0");
        let b: PciAddress = "b7:00.1".parse().unwrap();
        assert_eq!(b.to_string(), "0000:b7:00.1");
        let c: PciAddress = "10000:E1:1F.7".parse().unwrap();
        assert_eq!(c.to_string(), "10000:e1:1f.7");
        assert_eq!(a.short(), "25:00.0");
        assert_eq!(a.libvirt_name(), "pci_0000_25_00_0");
    }

    #[test]
    fn rejects_garbage_with_reason() {
        for bad in
            ["", "25:00", "0000:25:00.8", "0000:25:20.0", "zz:00.0", "0000:125:00.0", ":00.0"]
        {
            let e = bad.parse::<PciAddress>().unwrap_err();
            assert!(e.to_string().contains("expected dddd:bb:dd.f"), "{bad}: {e}");
        }
    }

    #[test]
    fn sysfs_hex() {
        assert_eq!(parse_sysfs_hex("0x10de\n"), Some(0x10de));
        assert_eq!(parse_sysfs_hex("0x030200\n"), Some(0x030200));
        assert_eq!(parse_sysfs_hex("0xzz"), None);
        assert_eq!(parse_sysfs_hex(""), None);
    }

    #[test]
    fn ordering_is_numeric() {
        let mut v: Vec<PciAddress> = ["0000:b7:00.0", "0000:25:00.0", "0001:00:00.0"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        v.sort();
        assert_eq!(v[0].to_string(), "0000:25:00.0");
        assert_eq!(v[2].to_string(), "0001:00:00.0");
    }
}
