//! OpenStack Nova PCI passthrough semantics, as Nova implements them, so xpu can write the
//! `nova.conf` an operator would otherwise write by hand and answer "would Nova place this flavor
//! here?" without a cloud.
//!
//! What this module owns (each item follows the behaviour of the Nova code named in its docs):
//!
//! - [`DeviceSpec`]: one `[pci] device_spec` entry (the option was `passthrough_whitelist` before
//!   Zed; both names are multi-valued and hold the same JSON), with vendor/product ids or `*`,
//!   `address` as a glob string `[[[domain]:]bus]:][slot][.[func]]` or a dict of regexes,
//!   `devname` rejected, every other key kept as a tag (`physical_network`, `trusted`, `managed`
//!   normalised to `"true"`/`"false"`, `resource_class` and `traits` normalised as Placement does).
//! - [`Aliases`]: the `[pci] alias` entries with Nova's JSON schema (unknown keys rejected); a
//!   repeated name ORs its specs.
//! - [`parse_flavor_alias`] / [`Aliases::requests`]: the flavor extra spec
//!   `pci_passthrough:alias` (`"a100:2, t4 : 1"`) into [`PciRequest`]s.
//! - [`PciStats`]: the pools of `nova.pci.stats.PciDeviceStats` (keyed by vendor, product, NUMA
//!   node, device type and tags), the fit check that `PciPassthroughFilter` runs
//!   ([`PciStats::support_requests`]) with the NUMA affinity policies, and the compute node's
//!   claim ([`PciStats::consume_requests`]) that picks devices and takes a PF's VFs (or a VF's PF)
//!   out of the pools with it.
//!
//! What it does not own: reading `nova.conf` (an ini file) or the host; callers pass the option
//! values and the devices in. Placement (`[pci] report_in_placement`,
//! `[filter_scheduler] pci_in_placement`) is not modelled: the checks are those Nova runs with
//! both at their default (off).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::Value;

use crate::inventory::{Inventory, SriovType};
use crate::pci::PciAddress;

/// Limits Nova checks in `nova/pci/devspec.py`.
pub const MAX_VENDOR_ID: u32 = 0xFFFF;
pub const MAX_PRODUCT_ID: u32 = 0xFFFF;
pub const MAX_DOMAIN: u32 = 0xFFFF;
pub const MAX_BUS: u32 = 0xFF;
pub const MAX_SLOT: u32 = 0x1F;
pub const MAX_FUNC: u32 = 0x7;

/// Why a Nova option value or flavor property is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NovaError {
    #[error("[pci] {option} entry {entry} is not valid JSON ({reason}); write it as a JSON object")]
    Json { option: &'static str, entry: String, reason: String },
    #[error("[pci] device_spec {entry}: {reason}")]
    DeviceSpec { entry: String, reason: String },
    #[error("[pci] alias {entry}: {reason}")]
    Alias { entry: String, reason: String },
    #[error("pci_passthrough:alias {input:?}: {reason}; write it as NAME:COUNT[, NAME:COUNT...]")]
    Flavor { input: String, reason: String },
    #[error(
        "pci_passthrough:alias names alias {name:?}, which [pci] alias does not define (defined: {defined}); add an alias entry with that name"
    )]
    AliasNotDefined { name: String, defined: String },
}

/// Characters of an input value a message echoes; the rest is cut and marked with `…`.
pub const EXCERPT_CHARS: usize = 80;

/// `s`, cut to [`EXCERPT_CHARS`] characters plus `…` when longer: a message names the input it
/// rejects, but a 10 MB nova.conf line must not come back in full.
pub fn excerpt(s: &str) -> String {
    match s.char_indices().nth(EXCERPT_CHARS) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// An input string quoted for a message (`"..."`), cut as [`excerpt`] does.
pub fn quoted(s: &str) -> String {
    format!("{:?}", excerpt(s))
}

/// A JSON value from the input, for a message, cut as [`excerpt`] does.
fn json(v: &Value) -> String {
    excerpt(&v.to_string())
}

fn spec_err(entry: &str, reason: impl Into<String>) -> NovaError {
    NovaError::DeviceSpec { entry: excerpt(entry), reason: reason.into() }
}

fn alias_err(entry: &str, reason: impl Into<String>) -> NovaError {
    NovaError::Alias { entry: excerpt(entry), reason: reason.into() }
}

/// Python's `int(s, 16)` for the inputs Nova meets: surrounding whitespace, an optional `0x`,
/// hex digits. `None` when it does not parse.
fn py_hex(s: &str) -> Option<u32> {
    let t = s.trim();
    let t = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_hexdigit() || b == b'_') {
        return None;
    }
    if t.starts_with('_') || t.ends_with('_') || t.contains("__") {
        return None;
    }
    let digits: String = t.chars().filter(|&c| c != '_').collect();
    u32::from_str_radix(&digits, 16).ok()
}

/// `_set_pci_dev_info`: `*` stays a wildcard, anything else must be a hex number within `max`.
fn hex_field(entry: &str, prop: &str, raw: &str, max: u32) -> Result<Option<u32>, NovaError> {
    if raw == "*" {
        return Ok(None);
    }
    let v = py_hex(raw).ok_or_else(|| {
        spec_err(entry, format!("property {prop} ({}) does not parse as a hex number", quoted(raw)))
    })?;
    if v > max {
        return Err(spec_err(
            entry,
            format!(
                "property {prop} ({raw:?}) is greater than the maximum allowable value ({max:X})"
            ),
        ));
    }
    Ok(Some(v))
}

/// The address fields as Nova's `PhysicalPciAddress` formats them for matching: `%04x`, `%02x`,
/// `%02x`, `%1x`.
fn address_strings(a: &PciAddress) -> [String; 4] {
    [
        format!("{:04x}", a.domain),
        format!("{:02x}", a.bus),
        format!("{:02x}", a.device),
        format!("{:x}", a.function),
    ]
}

/// One compiled field of a regex address: Python's `re.match`, anchored at the start only.
#[derive(Debug, Clone)]
pub struct StartAnchored {
    source: String,
    re: regex_lite::Regex,
}

impl StartAnchored {
    fn new(source: &str) -> Result<Self, regex_lite::Error> {
        // `re.match` anchors at the start and nowhere else: "0" matches bus "0a".
        let re = regex_lite::Regex::new(&format!("^(?:{source})"))?;
        Ok(Self { source: source.to_owned(), re })
    }

    pub fn is_match(&self, s: &str) -> bool {
        self.re.is_match(s)
    }

    pub fn source(&self) -> &str {
        &self.source
    }
}

/// The `address` of a device spec.
#[derive(Debug, Clone)]
pub enum AddressSpec {
    /// `[[[domain]:]bus]:][slot][.[func]]`; `None` is `*` (also for a field left out).
    Glob { domain: Option<u32>, bus: Option<u32>, slot: Option<u32>, func: Option<u32> },
    /// `{"domain": RE, "bus": RE, "slot": RE, "function": RE}` in that order; a missing key is
    /// `.*`.
    Regex(Box<[StartAnchored; 4]>),
}

impl AddressSpec {
    /// `PciAddressGlobSpec`.
    pub fn parse_glob(entry: &str, s: &str) -> Result<Self, NovaError> {
        let (dbs, func) = match s.split_once('.') {
            Some((dbs, func)) => (dbs, func),
            None => (s, ""),
        };
        let func =
            if func.is_empty() { None } else { hex_field(entry, "func", func.trim(), MAX_FUNC)? };
        let (mut domain, mut bus, mut slot) = (None, None, None);
        if !dbs.is_empty() {
            let fields: Vec<&str> = dbs.split(':').collect();
            if fields.len() > 3 {
                return Err(spec_err(
                    entry,
                    format!(
                        "address {s:?} has more than three ':'-separated fields; expected [[[domain]:]bus]:][slot][.[func]]"
                    ),
                ));
            }
            // A short address is right-aligned: ":00." is domain *, bus *, slot 00.
            let mut all = vec!["*"; 3 - fields.len()];
            all.extend(fields);
            let f = |i: usize| {
                let t = all[i].trim();
                if t.is_empty() { "*" } else { t }
            };
            domain = hex_field(entry, "domain", f(0), MAX_DOMAIN)?;
            bus = hex_field(entry, "bus", f(1), MAX_BUS)?;
            slot = hex_field(entry, "slot", f(2), MAX_SLOT)?;
        }
        Ok(AddressSpec::Glob { domain, bus, slot, func })
    }

    /// `PciAddressRegexSpec`.
    pub fn parse_regex(
        entry: &str,
        map: &serde_json::Map<String, Value>,
    ) -> Result<Self, NovaError> {
        let field = |key: &str| -> Result<StartAnchored, NovaError> {
            let src = match map.get(key) {
                None => ".*",
                Some(Value::String(s)) => s.as_str(),
                Some(other) => {
                    return Err(spec_err(
                        entry,
                        format!("address {key} must be a regex string, not {}", json(other)),
                    ));
                }
            };
            StartAnchored::new(src).map_err(|e| {
                spec_err(
                    entry,
                    format!(
                        "address {key} regex {} does not compile: {}",
                        quoted(src),
                        excerpt(&e.to_string())
                    ),
                )
            })
        };
        Ok(AddressSpec::Regex(Box::new([
            field("domain")?,
            field("bus")?,
            field("slot")?,
            field("function")?,
        ])))
    }

    pub fn matches(&self, a: &PciAddress) -> bool {
        match self {
            AddressSpec::Glob { domain, bus, slot, func } => {
                domain.is_none_or(|d| d == a.domain)
                    && bus.is_none_or(|b| b == u32::from(a.bus))
                    && slot.is_none_or(|s| s == u32::from(a.device))
                    && func.is_none_or(|f| f == u32::from(a.function))
            }
            AddressSpec::Regex(res) => {
                res.iter().zip(address_strings(a)).all(|(re, field)| re.is_match(&field))
            }
        }
    }

    /// The sysfs name Nova would look up to decide whether a fully specified address is a PF
    /// (`is_single_address` + `utils.is_physical_function`): every field made only of hex digits.
    /// Nova then treats the spec as matching that PF's VFs too.
    pub fn single_address(&self) -> Option<String> {
        match self {
            AddressSpec::Glob { domain, bus, slot, func } => {
                Some(format!("{:04x}:{:02x}:{:02x}.{:x}", (*domain)?, (*bus)?, (*slot)?, (*func)?))
            }
            AddressSpec::Regex(res) => {
                let parts = res.each_ref().map(|re| re.source());
                parts
                    .iter()
                    .all(|p| p.bytes().all(|b| b.is_ascii_hexdigit()))
                    .then(|| format!("{}:{}:{}.{}", parts[0], parts[1], parts[2], parts[3]))
            }
        }
    }
}

/// The tags Nova normalises to `"true"`/`"false"` (`_normalize_device_spec_tag`).
const BOOL_TAGS: [&str; 3] = ["managed", "live_migratable", "one_time_use"];

/// `oslo_utils.strutils.bool_from_string(strict=True)`.
fn strict_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "t" | "true" | "on" | "y" | "yes" => Some(true),
        "0" | "f" | "false" | "off" | "n" | "no" => Some(false),
        _ => None,
    }
}

/// One `[pci] device_spec` (or legacy `passthrough_whitelist`) entry.
#[derive(Debug, Clone)]
pub struct DeviceSpec {
    /// `None` is `*`.
    pub vendor_id: Option<u16>,
    pub product_id: Option<u16>,
    pub address: AddressSpec,
    /// Every key other than `vendor_id`, `product_id` and `address`, values as strings.
    pub tags: BTreeMap<String, String>,
    /// The entry as written, for messages.
    pub source: String,
}

impl DeviceSpec {
    /// Parses one option value: a JSON object or a list of them (`Whitelist` accepts both).
    pub fn parse_all(entry: &str) -> Result<Vec<DeviceSpec>, NovaError> {
        let v: Value = serde_json::from_str(entry).map_err(|e| NovaError::Json {
            option: "device_spec",
            entry: excerpt(entry),
            reason: e.to_string(),
        })?;
        match v {
            Value::Object(m) => Ok(vec![Self::from_map(entry, m)?]),
            Value::Array(items) => items
                .into_iter()
                .map(|item| match item {
                    Value::Object(m) => Self::from_map(entry, m),
                    other => {
                        Err(spec_err(entry, format!("expecting a dict, got {}", json(&other))))
                    }
                })
                .collect(),
            other => {
                Err(spec_err(entry, format!("expecting a list or dict, got {}", json(&other))))
            }
        }
    }

    fn from_map(entry: &str, mut m: serde_json::Map<String, Value>) -> Result<Self, NovaError> {
        let id = |m: &mut serde_json::Map<String, Value>, key: &str, max: u32| {
            match m.remove(key) {
                None => Ok(None),
                Some(Value::String(s)) => hex_field(entry, key, s.trim(), max)
                    .map(|v| v.map(|v| v as u16 /* range-checked against max */)),
                Some(other) => Err(spec_err(
                    entry,
                    format!(
                        "{key} must be a string of 4 hex digits or \"*\", not {}",
                        json(&other)
                    ),
                )),
            }
        };
        let vendor_id = id(&mut m, "vendor_id", MAX_VENDOR_ID)?;
        let product_id = id(&mut m, "product_id", MAX_PRODUCT_ID)?;
        if m.contains_key("devname") {
            return Err(spec_err(
                entry,
                "devname is not supported: it names a network interface, which xpu does not resolve; match the device by \"address\" (its PCI address) or vendor_id/product_id instead",
            ));
        }
        let address = match m.remove("address") {
            // `address or '*:*:*.*'`: missing, null and "" all mean every address.
            None | Some(Value::Null) => AddressSpec::parse_glob(entry, "*:*:*.*")?,
            Some(Value::String(s)) if s.is_empty() => AddressSpec::parse_glob(entry, "*:*:*.*")?,
            Some(Value::String(s)) => AddressSpec::parse_glob(entry, &s)?,
            Some(Value::Object(map)) => AddressSpec::parse_regex(entry, &map)?,
            Some(other) => {
                return Err(spec_err(
                    entry,
                    format!(
                        "address must be a glob string or a dict of regexes, not {other}; e.g. \"0000:25:00.*\" or {{\"bus\": \"2[5b]\"}}"
                    ),
                ));
            }
        };
        let mut tags = BTreeMap::new();
        for (k, v) in m {
            let s = match v {
                Value::String(s) => s,
                Value::Bool(b) => b.to_string(),
                Value::Number(n) => n.to_string(),
                other => {
                    return Err(spec_err(
                        entry,
                        format!(
                            "tag {} must be a string, number or boolean, not {}",
                            excerpt(&k),
                            json(&other)
                        ),
                    ));
                }
            };
            let s = if BOOL_TAGS.contains(&k.as_str()) {
                match strict_bool(&s) {
                    Some(b) => b.to_string(),
                    None => {
                        return Err(spec_err(
                            entry,
                            format!(
                                "cannot parse tag {k:?}: {s:?} is not a boolean; use \"true\" or \"false\""
                            ),
                        ));
                    }
                }
            } else {
                s
            };
            tags.insert(k, s);
        }
        Ok(DeviceSpec { vendor_id, product_id, address, tags, source: entry.to_owned() })
    }

    /// `PciDeviceSpec.match`: ids, then the address. `spec_is_pf` says whether the spec's single
    /// address (see [`AddressSpec::single_address`]) is a PF on this host, in which case a VF
    /// matches through its parent's address.
    pub fn matches(&self, dev: &HostDevice, spec_is_pf: bool) -> bool {
        if self.vendor_id.is_some_and(|v| v != dev.vendor_id)
            || self.product_id.is_some_and(|p| p != dev.product_id)
        {
            return false;
        }
        if spec_is_pf
            && let Some(parent) = &dev.parent
            && self.address.matches(parent)
        {
            return true;
        }
        self.address.matches(&dev.address)
    }

    /// The Placement resource class of a device this spec matches
    /// (`pci_placement_translator.get_resource_class`): the normalised `resource_class` tag, or
    /// `CUSTOM_PCI_<VENDOR>_<PRODUCT>`.
    pub fn resource_class(&self, dev: &HostDevice) -> String {
        match self.tags.get("resource_class") {
            Some(rc) if !rc.is_empty() => normalize_resource_class(rc),
            _ => format!("CUSTOM_PCI_{:04X}_{:04X}", dev.vendor_id, dev.product_id),
        }
    }

    /// The Placement traits of a matched device: the normalised `traits` tag plus
    /// `COMPUTE_MANAGED_PCI_DEVICE`, which Nova always adds.
    pub fn traits(&self) -> BTreeSet<String> {
        let mut t = get_traits(self.tags.get("traits").map_or("", String::as_str));
        t.insert("COMPUTE_MANAGED_PCI_DEVICE".to_owned());
        t
    }
}

/// Standard resource classes of `os-resource-classes`.
pub const STANDARD_RESOURCE_CLASSES: [&str; 21] = [
    "VCPU",
    "MEMORY_MB",
    "DISK_GB",
    "PCI_DEVICE",
    "SRIOV_NET_VF",
    "NUMA_SOCKET",
    "NUMA_CORE",
    "NUMA_THREAD",
    "NUMA_MEMORY_MB",
    "IPV4_ADDRESS",
    "VGPU",
    "VGPU_DISPLAY_HEAD",
    "NET_BW_EGR_KILOBIT_PER_SEC",
    "NET_BW_IGR_KILOBIT_PER_SEC",
    "PCPU",
    "MEM_ENCRYPTION_CONTEXT",
    "FPGA",
    "PGPU",
    "NET_PACKET_RATE_KILOPACKET_PER_SEC",
    "NET_PACKET_RATE_EGR_KILOPACKET_PER_SEC",
    "NET_PACKET_RATE_IGR_KILOPACKET_PER_SEC",
];

/// The standard traits (`os-traits`) that PCI and accelerator specs use. os-traits has several
/// hundred; names outside this list are treated as custom, which only matters for a standard
/// trait written here in a way Placement already accepts.
pub const STANDARD_TRAITS: [&str; 12] = [
    "COMPUTE_MANAGED_PCI_DEVICE",
    "HW_GPU_API_CUDA_V8_0",
    "HW_GPU_API_CUDA_V9_0",
    "HW_GPU_API_CUDA_V9_1",
    "HW_GPU_API_CUDA_V9_2",
    "HW_GPU_API_CUDA_V10_0",
    "HW_GPU_API_VULKAN",
    "HW_GPU_API_OPENGL_V4_6",
    "HW_GPU_MAX_DISPLAY_HEADS_1",
    "HW_NIC_SRIOV",
    "HW_NIC_SRIOV_TRUSTED",
    "HW_NUMA_ROOT",
];

/// `os_resource_classes.normalize_name` / `os_traits.normalize_name`: runs of non-alphanumerics
/// become `_`, upper-cased, `CUSTOM_` in front.
pub fn normalize_name(name: &str) -> String {
    let mut out = String::from("CUSTOM_");
    let mut in_run = false;
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_uppercase());
            in_run = false;
        } else if !in_run {
            out.push('_');
            in_run = true;
        }
    }
    out
}

/// `pci_placement_translator._normalize_resource_class`: upper-case; standard and `CUSTOM_` names
/// stay, anything else is normalised into a custom name.
pub fn normalize_resource_class(rc: &str) -> String {
    let up = rc.to_uppercase();
    if STANDARD_RESOURCE_CLASSES.contains(&up.as_str()) || up.starts_with("CUSTOM_") {
        up
    } else {
        normalize_name(&up)
    }
}

/// `pci_placement_translator.get_traits`: a comma-separated list (not trimmed, as in Nova);
/// standard traits stay, the rest are upper-cased and kept when already `CUSTOM_`, else normalised.
pub fn get_traits(traits: &str) -> BTreeSet<String> {
    if traits.is_empty() {
        return BTreeSet::new();
    }
    traits
        .split(',')
        .map(|t| {
            if STANDARD_TRAITS.contains(&t) {
                return t.to_owned();
            }
            let up = t.to_uppercase();
            if up.starts_with("CUSTOM_") { up } else { normalize_name(&up) }
        })
        .collect()
}

/// `hw:pci_numa_affinity_policy` / alias `numa_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NumaPolicy {
    /// Devices must share a NUMA node with the guest.
    Required,
    /// Shared NUMA node if the device reports one; devices without NUMA information are fine.
    #[default]
    Legacy,
    /// Best effort.
    Preferred,
    /// Devices must be on a socket the guest's NUMA nodes are on.
    Socket,
}

impl NumaPolicy {
    pub const ALL: [NumaPolicy; 4] =
        [NumaPolicy::Required, NumaPolicy::Legacy, NumaPolicy::Preferred, NumaPolicy::Socket];

    pub fn as_str(self) -> &'static str {
        match self {
            NumaPolicy::Required => "required",
            NumaPolicy::Legacy => "legacy",
            NumaPolicy::Preferred => "preferred",
            NumaPolicy::Socket => "socket",
        }
    }
}

impl fmt::Display for NumaPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for NumaPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|p| p.as_str() == s).ok_or_else(|| {
            format!(
                "unknown NUMA policy {}; expected required, legacy, preferred or socket",
                quoted(s)
            )
        })
    }
}

/// One spec of an alias: the properties a device's pool must have.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AliasSpec {
    /// Lower-cased on comparison, as `pci_device_prop_match` does.
    pub vendor_id: Option<String>,
    pub product_id: Option<String>,
    pub dev_type: Option<SriovType>,
    pub capability_type: Option<String>,
    pub live_migratable: Option<String>,
    /// Matched by Placement, ignored by the pool filter.
    pub resource_class: Option<String>,
    pub traits: Option<String>,
}

impl AliasSpec {
    /// The `(key, value)` pairs the pool filter compares (`ignored_spec_tags` left out).
    fn match_props(&self) -> Vec<(&'static str, String)> {
        let mut v = Vec::new();
        if let Some(x) = &self.vendor_id {
            v.push(("vendor_id", x.to_lowercase()));
        }
        if let Some(x) = &self.product_id {
            v.push(("product_id", x.to_lowercase()));
        }
        if let Some(x) = self.dev_type {
            v.push(("dev_type", x.as_str().to_lowercase()));
        }
        if let Some(x) = &self.capability_type {
            v.push(("capability_type", x.to_lowercase()));
        }
        if let Some(x) = &self.live_migratable {
            v.push(("live_migratable", x.to_lowercase()));
        }
        v
    }

    /// `{vendor_id 10de, product_id 20b0, device_type type-PF}` for messages.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(x) = &self.vendor_id {
            parts.push(format!("vendor_id {x}"));
        }
        if let Some(x) = &self.product_id {
            parts.push(format!("product_id {x}"));
        }
        if let Some(x) = self.dev_type {
            parts.push(format!("device_type {x}"));
        }
        if let Some(x) = &self.capability_type {
            parts.push(format!("capability_type {x}"));
        }
        if let Some(x) = &self.live_migratable {
            parts.push(format!("live_migratable {x}"));
        }
        format!("{{{}}}", parts.join(", "))
    }
}

/// All entries that share one alias name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    pub name: String,
    pub numa_policy: NumaPolicy,
    /// ORed: a device matching any spec serves the alias.
    pub specs: Vec<AliasSpec>,
}

/// The `[pci] alias` option, parsed and validated as `nova.pci.request.get_alias_from_config`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Aliases {
    /// In the order first seen.
    pub aliases: Vec<Alias>,
}

const ALIAS_KEYS: [&str; 9] = [
    "name",
    "capability_type",
    "product_id",
    "vendor_id",
    "device_type",
    "numa_policy",
    "resource_class",
    "traits",
    "live_migratable",
];

fn is_pci_id(s: &str) -> bool {
    s.len() == 4 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Aliases {
    /// Parses every `alias = ...` value, in order.
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>) -> Result<Aliases, NovaError> {
        let mut out = Aliases::default();
        // Which entries set device_type, per alias, for the repeated-name rule.
        let mut typed: Vec<bool> = Vec::new();
        for entry in entries {
            let (name, policy, spec, has_type) = Self::parse_one(entry)?;
            match out.aliases.iter().position(|a| a.name == name) {
                None => {
                    out.aliases.push(Alias { name, numa_policy: policy, specs: vec![spec] });
                    typed.push(has_type);
                }
                Some(i) => {
                    let a = &mut out.aliases[i];
                    if a.numa_policy != policy {
                        return Err(alias_err(
                            entry,
                            format!(
                                "NUMA policy mismatch for alias {name:?} ({} here, {} in its first entry); entries of one alias must have the same numa_policy",
                                policy, a.numa_policy
                            ),
                        ));
                    }
                    // Nova compares `dev_type` of the first and the new entry with `[...]`, so a
                    // repeated alias without device_type fails with a KeyError there.
                    if !typed[i] || !has_type {
                        return Err(alias_err(
                            entry,
                            format!(
                                "alias {name:?} is repeated, and Nova requires device_type on every entry of a repeated alias; add \"device_type\" to each"
                            ),
                        ));
                    }
                    if a.specs[0].dev_type != spec.dev_type {
                        return Err(alias_err(
                            entry,
                            format!(
                                "device type mismatch for alias {name:?}; entries of one alias must have the same device_type"
                            ),
                        ));
                    }
                    a.specs.push(spec);
                }
            }
        }
        // `_validate_required_ids` with pci_in_placement off.
        for a in &out.aliases {
            if a.specs.iter().any(|s| s.vendor_id.is_none() || s.product_id.is_none()) {
                return Err(alias_err(
                    &a.name,
                    format!(
                        "the PCI alias {:?} does not have vendor_id and product_id fields set; add both to every entry",
                        a.name
                    ),
                ));
            }
        }
        Ok(out)
    }

    fn parse_one(entry: &str) -> Result<(String, NumaPolicy, AliasSpec, bool), NovaError> {
        let v: Value = serde_json::from_str(entry).map_err(|e| NovaError::Json {
            option: "alias",
            entry: excerpt(entry),
            reason: e.to_string(),
        })?;
        let Value::Object(m) = v else {
            return Err(alias_err(entry, format!("{} is not of type 'object'", json(&v))));
        };
        for k in m.keys() {
            if !ALIAS_KEYS.contains(&k.as_str()) {
                return Err(alias_err(
                    entry,
                    format!(
                        "additional properties are not allowed ({} was unexpected); allowed keys: {}",
                        quoted(k),
                        ALIAS_KEYS.join(", ")
                    ),
                ));
            }
        }
        let string = |k: &str| -> Result<Option<String>, NovaError> {
            match m.get(k) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => {
                    Err(alias_err(entry, format!("{k}: {} is not of type 'string'", json(other))))
                }
            }
        };
        let name = string("name")?.ok_or_else(|| {
            alias_err(entry, "'name' is a required property; give the alias a name")
        })?;
        let chars = name.chars().count();
        if chars == 0 {
            return Err(alias_err(entry, "name \"\" is too short; give the alias a name"));
        }
        if chars > 256 {
            return Err(alias_err(entry, "name is longer than 256 characters"));
        }
        let mut spec = AliasSpec::default();
        for (key, slot) in
            [("vendor_id", &mut spec.vendor_id), ("product_id", &mut spec.product_id)]
        {
            if let Some(id) = string(key)? {
                if !is_pci_id(&id) {
                    return Err(alias_err(
                        entry,
                        format!(
                            "{key} {} does not match '^[\\da-fA-F]{{4}}$'; write 4 hex digits, e.g. \"10de\"",
                            quoted(&id)
                        ),
                    ));
                }
                *slot = Some(id);
            }
        }
        let has_type = m.contains_key("device_type");
        if let Some(t) = string("device_type")? {
            spec.dev_type = Some(t.parse().map_err(|_| {
                alias_err(
                    entry,
                    format!("device_type {} is not one of type-PCI, type-PF, type-VF", quoted(&t)),
                )
            })?);
        }
        if let Some(c) = string("capability_type")? {
            if c != "pci" {
                return Err(alias_err(
                    entry,
                    format!("capability_type {} is not one of ['pci']", quoted(&c)),
                ));
            }
            spec.capability_type = Some(c);
        }
        // `if not numa_policy`: absent or empty means legacy.
        let policy = match string("numa_policy")? {
            None => NumaPolicy::Legacy,
            Some(p) => p.parse().map_err(|_| {
                alias_err(
                    entry,
                    format!(
                        "numa_policy {} is not one of required, legacy, preferred, socket",
                        quoted(&p)
                    ),
                )
            })?,
        };
        spec.resource_class = string("resource_class")?;
        spec.traits = string("traits")?;
        if let Some(lm) = string("live_migratable")? {
            let b = strict_bool(&lm).ok_or_else(|| {
                alias_err(
                    entry,
                    format!(
                        "live_migratable {} is not a boolean; use \"true\" or \"false\"",
                        quoted(&lm)
                    ),
                )
            })?;
            spec.live_migratable = Some(b.to_string());
        }
        Ok((name.trim().to_owned(), policy, spec, has_type))
    }

    pub fn get(&self, name: &str) -> Option<&Alias> {
        self.aliases.iter().find(|a| a.name == name)
    }

    /// `_translate_alias_to_requests`: the flavor's `pci_passthrough:alias` into requests. A
    /// flavor `hw:pci_numa_affinity_policy` (`affinity_policy`) overrides each alias's policy.
    pub fn requests(
        &self,
        flavor_alias: &str,
        affinity_policy: Option<NumaPolicy>,
    ) -> Result<Vec<PciRequest>, NovaError> {
        parse_flavor_alias(flavor_alias)?
            .into_iter()
            .map(|(name, count)| {
                let a = self.get(&name).ok_or_else(|| NovaError::AliasNotDefined {
                    name: excerpt(&name),
                    defined: if self.aliases.is_empty() {
                        "none".to_owned()
                    } else {
                        let names: Vec<&str> =
                            self.aliases.iter().map(|a| a.name.as_str()).collect();
                        excerpt(&names.join(", "))
                    },
                })?;
                Ok(PciRequest {
                    alias_name: name,
                    count,
                    specs: a.specs.clone(),
                    numa_policy: affinity_policy.unwrap_or(a.numa_policy),
                })
            })
            .collect()
    }
}

/// Parses `pci_passthrough:alias` the way `_translate_alias_to_requests` does: split on `,`, each
/// part on `:` into exactly a name (trimmed) and a count (an integer, whitespace allowed around
/// it, as Python's `int()` allows).
pub fn parse_flavor_alias(s: &str) -> Result<Vec<(String, u32)>, NovaError> {
    let err = |reason: String| NovaError::Flavor { input: excerpt(s), reason };
    s.split(',')
        .map(|part| {
            let fields: Vec<&str> = part.split(':').collect();
            let [name, count] = fields[..] else {
                return Err(err(format!("{} is not NAME:COUNT", quoted(part))));
            };
            let c = count.trim();
            let c = c.strip_prefix('+').unwrap_or(c);
            if c.is_empty() || !c.bytes().all(|b| b.is_ascii_digit()) {
                return Err(err(format!(
                    "count {} of {} is not a whole number",
                    quoted(count),
                    quoted(part)
                )));
            }
            let n: u32 =
                c.parse().map_err(|_| err(format!("count {} is too large", quoted(count))))?;
            Ok((name.trim().to_owned(), n))
        })
        .collect()
}

/// One `InstancePCIRequest` from a flavor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciRequest {
    pub alias_name: String,
    pub count: u32,
    pub specs: Vec<AliasSpec>,
    pub numa_policy: NumaPolicy,
}

/// A PCI function as Nova's libvirt driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevice {
    pub address: PciAddress,
    /// The PF of a VF.
    pub parent: Option<PciAddress>,
    pub vendor_id: u16,
    pub product_id: u16,
    pub numa_node: Option<u32>,
    pub dev_type: SriovType,
}

impl HostDevice {
    /// Every function of the inventory with known ids; `dev_type` is the inventory's SR-IOV role,
    /// which follows libvirt (`virt_functions` capability: type-PF, `phys_function`: type-VF).
    pub fn from_inventory(inv: &Inventory) -> Vec<HostDevice> {
        inv.devices
            .iter()
            .filter_map(|d| {
                Some(HostDevice {
                    address: d.address,
                    parent: d.sriov.physfn,
                    vendor_id: d.vendor_id?,
                    product_id: d.device_id?,
                    numa_node: d.numa_node,
                    dev_type: d.sriov.kind,
                })
            })
            .collect()
    }
}

/// A host NUMA cell: its id and the socket it is on (`None` when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NumaCell {
    pub id: u32,
    pub socket: Option<u32>,
}

/// Pool keys: `pool_keys` of `PciDeviceStats` plus the device spec's tags.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PoolKey {
    pub vendor_id: String,
    pub product_id: String,
    pub numa_node: Option<u32>,
    pub dev_type: SriovType,
    /// Tags of the matching device spec, without `resource_class` and `traits`
    /// (`ignored_pool_tags`).
    pub tags: BTreeMap<String, String>,
}

impl PoolKey {
    fn get(&self, key: &str) -> Option<String> {
        match key {
            "vendor_id" => Some(self.vendor_id.clone()),
            "product_id" => Some(self.product_id.clone()),
            "dev_type" => Some(self.dev_type.as_str().to_owned()),
            // A number in Nova; never equal to a string from an alias.
            "numa_node" => None,
            k => self.tags.get(k).cloned(),
        }
    }

    /// `pci_device_prop_match` for one spec: every key equal, strings compared lower-cased.
    fn matches(&self, spec: &AliasSpec) -> bool {
        spec.match_props().iter().all(|(k, v)| self.get(k).is_some_and(|p| p.to_lowercase() == *v))
    }
}

/// A pool of interchangeable devices.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Pool {
    pub key: PoolKey,
    /// Free devices, as indices into [`PciStats::devices`].
    pub devices: Vec<usize>,
}

/// Where a request failed, in the order `_filter_pools` checks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "stage", rename_all = "snake_case")]
pub enum FitStage {
    /// Not enough devices in pools matching the alias specs.
    Spec { matching: usize },
    /// Not enough after the NUMA policy.
    Numa { matching: usize, after_numa: usize },
    /// Not enough once PFs are held back from a non-PF request.
    Pf { after_numa: usize, without_pfs: usize },
    /// The guest has more NUMA nodes than the host has cells.
    NumaCells { guest: usize, host: usize },
}

/// A request this host cannot satisfy, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FitFailure {
    pub alias: String,
    pub count: u32,
    pub numa_policy: NumaPolicy,
    #[serde(flatten)]
    pub stage: FitStage,
    /// A hint when the mismatch is a known configuration mistake (a wrong `device_type`).
    pub hint: Option<String>,
}

impl fmt::Display for FitFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.count;
        let alias = &self.alias;
        match &self.stage {
            FitStage::Spec { matching } => write!(
                f,
                "alias {alias} needs {n} device(s) but only {matching} free device(s) on this host match its specs"
            )?,
            FitStage::Numa { matching, after_numa } => write!(
                f,
                "alias {alias} needs {n} device(s); {matching} match its specs but only {after_numa} satisfy NUMA policy {}",
                self.numa_policy
            )?,
            FitStage::Pf { after_numa, without_pfs } => write!(
                f,
                "alias {alias} needs {n} device(s); {after_numa} match, but {} of them are PFs, which Nova gives only to requests for device_type type-PF",
                after_numa - without_pfs
            )?,
            FitStage::NumaCells { guest, host } => write!(
                f,
                "alias {alias} cannot be placed: the guest asks for {guest} NUMA node(s) but the host has {host}"
            )?,
        }
        if let Some(h) = &self.hint {
            write!(f, "; {h}")?;
        }
        Ok(())
    }
}

/// A device given to a request by [`PciStats::consume_requests`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Claimed {
    pub alias: String,
    pub address: PciAddress,
}

/// The PCI stats of one compute node: its assignable devices grouped into pools.
#[derive(Debug, Clone, Default)]
pub struct PciStats {
    pub devices: Vec<HostDevice>,
    pub pools: Vec<Pool>,
    /// Host NUMA cells, for the `socket` policy.
    pub cells: Vec<NumaCell>,
}

impl PciStats {
    /// Builds the pools as the compute node does: each device that a spec matches (the first
    /// matching spec wins, as `Whitelist.get_devspec`) joins the pool of its keys; pools are kept
    /// ordered by their number of keys, as `add_device` sorts them.
    pub fn new(devices: Vec<HostDevice>, specs: &[DeviceSpec], cells: Vec<NumaCell>) -> Self {
        let pf_names: BTreeSet<String> = devices
            .iter()
            .filter(|d| d.dev_type == SriovType::Pf)
            .map(|d| d.address.to_string())
            .collect();
        let spec_is_pf: Vec<bool> = specs
            .iter()
            .map(|s| s.address.single_address().is_some_and(|a| pf_names.contains(&a)))
            .collect();
        let mut pools: Vec<Pool> = Vec::new();
        for (i, d) in devices.iter().enumerate() {
            let Some(si) = specs.iter().zip(&spec_is_pf).position(|(s, &pf)| s.matches(d, pf))
            else {
                continue;
            };
            let tags = specs[si]
                .tags
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "resource_class" | "traits"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let key = PoolKey {
                vendor_id: format!("{:04x}", d.vendor_id),
                product_id: format!("{:04x}", d.product_id),
                numa_node: d.numa_node,
                dev_type: d.dev_type,
                tags,
            };
            match pools.iter_mut().find(|p| p.key == key) {
                Some(p) => p.devices.push(i),
                None => {
                    pools.push(Pool { key, devices: vec![i] });
                    pools.sort_by_key(|p| p.key.tags.len());
                }
            }
        }
        PciStats { devices, pools, cells }
    }

    /// Devices in pools, for reports.
    pub fn free_devices(&self) -> usize {
        self.pools.iter().map(|p| p.devices.len()).sum()
    }

    /// `_filter_pools`: the pools (indices, in the order to consume from) that can serve the
    /// request given the free counts, or where it failed.
    fn filter_pools(
        &self,
        counts: &[usize],
        req: &PciRequest,
        numa_cells: Option<&[u32]>,
    ) -> Result<Vec<usize>, FitStage> {
        let need = req.count as usize;
        let sum = |pools: &[usize]| pools.iter().map(|&p| counts[p]).sum::<usize>();
        let live: Vec<usize> = (0..self.pools.len()).filter(|&p| counts[p] > 0).collect();
        let pools: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&p| req.specs.iter().any(|s| self.pools[p].key.matches(s)))
            .collect();
        let matching = sum(&pools);
        if matching < need {
            return Err(FitStage::Spec { matching });
        }
        let pools = match numa_cells {
            Some(cells) if !cells.is_empty() => self.filter_numa(&pools, counts, req, cells),
            _ => pools,
        };
        let after_numa = sum(&pools);
        if after_numa < need {
            return Err(FitStage::Numa { matching, after_numa });
        }
        let pools: Vec<usize> = if req.specs.iter().all(|s| s.dev_type != Some(SriovType::Pf)) {
            pools.into_iter().filter(|&p| self.pools[p].key.dev_type != SriovType::Pf).collect()
        } else {
            pools
        };
        let without_pfs = sum(&pools);
        if without_pfs < need {
            return Err(FitStage::Pf { after_numa, without_pfs });
        }
        Ok(pools)
    }

    /// `_filter_pools_for_numa_cells`: stricter policies first, as Nova does, so even `preferred`
    /// gets NUMA-local devices when there are enough.
    fn filter_numa(
        &self,
        pools: &[usize],
        counts: &[usize],
        req: &PciRequest,
        cells: &[u32],
    ) -> Vec<usize> {
        let need = req.count as usize;
        let sum = |pools: &[usize]| pools.iter().map(|&p| counts[p]).sum::<usize>();
        let node = |p: usize| self.pools[p].key.numa_node;
        let local: Vec<usize> = pools
            .iter()
            .copied()
            .filter(|&p| node(p).is_some_and(|n| cells.contains(&n)))
            .collect();
        if req.numa_policy == NumaPolicy::Required || sum(&local) >= need {
            return local;
        }
        if req.numa_policy == NumaPolicy::Socket {
            // `_filter_pools_for_socket_affinity` starts again from all pools.
            if self.cells.is_empty() || self.cells.iter().any(|c| c.socket.is_none()) {
                return Vec::new();
            }
            let sockets: BTreeSet<u32> = self
                .cells
                .iter()
                .filter(|c| cells.contains(&c.id))
                .filter_map(|c| c.socket)
                .collect();
            let allowed: BTreeSet<u32> = self
                .cells
                .iter()
                .filter(|c| c.socket.is_some_and(|s| sockets.contains(&s)))
                .map(|c| c.id)
                .collect();
            return pools
                .iter()
                .copied()
                .filter(|&p| node(p).is_some_and(|n| allowed.contains(&n)))
                .collect();
        }
        // Devices that report no NUMA node are acceptable to `legacy`.
        let legacy: Vec<usize> =
            pools.iter().copied().filter(|&p| node(p).is_none_or(|n| cells.contains(&n))).collect();
        if req.numa_policy == NumaPolicy::Legacy || sum(&legacy) >= need {
            return legacy;
        }
        // `preferred`: everything, NUMA-local (or unknown) first.
        let mut all = pools.to_vec();
        all.sort_by_key(|&p| !node(p).is_none_or(|n| cells.contains(&n)));
        all
    }

    fn failure(&self, req: &PciRequest, stage: FitStage) -> FitFailure {
        let hint = match stage {
            FitStage::Spec { .. } => self.dev_type_hint(req),
            _ => None,
        };
        FitFailure {
            alias: req.alias_name.clone(),
            count: req.count,
            numa_policy: req.numa_policy,
            stage,
            hint,
        }
    }

    /// The seed's warning: an alias whose `device_type` differs from what libvirt reports for
    /// the device matches nothing.
    fn dev_type_hint(&self, req: &PciRequest) -> Option<String> {
        for s in &req.specs {
            let want = s.dev_type?;
            let relaxed = AliasSpec { dev_type: None, ..s.clone() };
            let mut found: Vec<&str> = self
                .pools
                .iter()
                .filter(|p| !p.devices.is_empty() && p.key.matches(&relaxed))
                .map(|p| p.key.dev_type.as_str())
                .collect();
            found.sort_unstable();
            found.dedup();
            if !found.is_empty() && !found.contains(&want.as_str()) {
                return Some(format!(
                    "the alias asks for device_type {want} but this host reports {} for {}:{}; set \"device_type\": \"{}\" in the alias (Nova takes it from libvirt: type-PF for a device with SR-IOV virtual functions)",
                    found.join(", "),
                    s.vendor_id.as_deref().unwrap_or("*"),
                    s.product_id.as_deref().unwrap_or("*"),
                    found[0]
                ));
            }
        }
        None
    }

    /// `support_requests`, the check `PciPassthroughFilter` runs: the requests applied one after
    /// another to a copy of the pool counts. `numa_cells` are the host cells the guest's NUMA
    /// nodes landed on (`None`: the guest has no NUMA topology, and no policy applies).
    pub fn support_requests(
        &self,
        requests: &[PciRequest],
        numa_cells: Option<&[u32]>,
    ) -> Result<(), FitFailure> {
        let mut counts: Vec<usize> = self.pools.iter().map(|p| p.devices.len()).collect();
        for req in requests {
            let pools =
                self.filter_pools(&counts, req, numa_cells).map_err(|s| self.failure(req, s))?;
            // `_apply_request` fails on an empty pool list even for a count of 0.
            if pools.is_empty() {
                return Err(self.failure(req, FitStage::Spec { matching: 0 }));
            }
            let mut need = req.count as usize;
            for p in pools {
                let take = need.min(counts[p]);
                counts[p] -= take;
                need -= take;
                if need == 0 {
                    break;
                }
            }
        }
        Ok(())
    }

    /// `consume_requests`, the compute node's claim: takes devices out of the pools (the last of
    /// each pool first, as Nova pops them) and, with each, its dependents: a PF takes its free
    /// VFs out of their pools, a VF its free PF. On failure nothing is taken.
    pub fn consume_requests(
        &mut self,
        requests: &[PciRequest],
        numa_cells: Option<&[u32]>,
    ) -> Result<Vec<Claimed>, FitFailure> {
        let before = self.pools.clone();
        let mut claimed = Vec::new();
        for req in requests {
            let counts: Vec<usize> = self.pools.iter().map(|p| p.devices.len()).collect();
            let pools = match self.filter_pools(&counts, req, numa_cells) {
                Ok(p) if !p.is_empty() => p,
                Ok(_) => {
                    self.pools = before;
                    return Err(self.failure(req, FitStage::Spec { matching: 0 }));
                }
                Err(s) => {
                    let f = self.failure(req, s);
                    self.pools = before;
                    return Err(f);
                }
            };
            let mut need = req.count as usize;
            for p in pools {
                while need > 0 {
                    let Some(dev) = self.pools[p].devices.pop() else { break };
                    self.remove_dependents(dev);
                    claimed.push(Claimed {
                        alias: req.alias_name.clone(),
                        address: self.devices[dev].address,
                    });
                    need -= 1;
                }
                if need == 0 {
                    break;
                }
            }
        }
        Ok(claimed)
    }

    /// `_handle_device_dependents`.
    fn remove_dependents(&mut self, dev: usize) {
        let d = &self.devices[dev];
        let related: Vec<usize> = match d.dev_type {
            SriovType::Pf => {
                let pf = d.address;
                (0..self.devices.len()).filter(|&i| self.devices[i].parent == Some(pf)).collect()
            }
            SriovType::Vf => match d.parent {
                Some(parent) => {
                    (0..self.devices.len()).filter(|&i| self.devices[i].address == parent).collect()
                }
                None => Vec::new(),
            },
            SriovType::Pci => Vec::new(),
        };
        for r in related {
            for p in &mut self.pools {
                p.devices.retain(|&x| x != r);
            }
        }
    }

    /// The host cells (by id) to try for a guest with `guest_nodes` NUMA nodes, in the order
    /// `numa_fit_instance_to_host` would try them (combinations of host cells; CPU and memory fit
    /// are not modelled). The first combination that supports the requests wins.
    pub fn fit_numa_guest(
        &self,
        requests: &[PciRequest],
        guest_nodes: usize,
    ) -> Result<Vec<u32>, FitFailure> {
        let ids: Vec<u32> = self.cells.iter().map(|c| c.id).collect();
        let mut last = None;
        for combo in combinations(&ids, guest_nodes) {
            match self.support_requests(requests, Some(&combo)) {
                Ok(()) => return Ok(combo),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| FitFailure {
            alias: requests.first().map(|r| r.alias_name.clone()).unwrap_or_default(),
            count: requests.first().map_or(0, |r| r.count),
            numa_policy: requests.first().map_or(NumaPolicy::Legacy, |r| r.numa_policy),
            stage: FitStage::NumaCells { guest: guest_nodes, host: ids.len() },
            hint: None,
        }))
    }
}

/// Where [`place`] put a flavor.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HostChoice {
    /// Index of the chosen host in the slice given to [`place`].
    pub host: usize,
    /// The host cells the guest's NUMA nodes went to (NUMA guests only).
    pub numa_cells: Option<Vec<u32>>,
    pub claimed: Vec<Claimed>,
}

/// Places a flavor's PCI requests on one of `hosts` as Nova's scheduler and compute node would:
/// `PciPassthroughFilter` (with the NUMA fit for a guest of `guest_numa_nodes` nodes) keeps the
/// hosts that support the requests; `PCIWeigher` prefers, among them, the host with the fewest
/// free PCI devices (stacking, so whole hosts stay free for big requests; ties go to the earlier
/// host); the chosen host's claim then takes the devices. Other weighers (RAM, CPU, affinity)
/// are not modelled. On failure, every host's reason with the host's index: filter failures in
/// host order, then claim failures.
pub fn place(
    hosts: &mut [PciStats],
    requests: &[PciRequest],
    guest_numa_nodes: Option<usize>,
) -> Result<HostChoice, Vec<(usize, FitFailure)>> {
    let mut passing: Vec<(usize, Option<Vec<u32>>)> = Vec::new();
    let mut failures = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        let fit = match guest_numa_nodes {
            Some(n) => h.fit_numa_guest(requests, n).map(Some),
            None => h.support_requests(requests, None).map(|()| None),
        };
        match fit {
            Ok(cells) => passing.push((i, cells)),
            Err(f) => failures.push((i, f)),
        }
    }
    // Stable: the earlier host wins a tie.
    passing.sort_by_key(|(i, _)| hosts[*i].free_devices());
    for (i, cells) in passing {
        match hosts[i].consume_requests(requests, cells.as_deref()) {
            Ok(claimed) => return Ok(HostChoice { host: i, numa_cells: cells, claimed }),
            // The filter counts pools; a claim can still fail on PF/VF dependencies, and Nova
            // then reschedules to the next host.
            Err(f) => failures.push((i, f)),
        }
    }
    Err(failures)
}

/// k-combinations of `items`, in lexicographic order of positions.
fn combinations(items: &[u32], k: usize) -> Vec<Vec<u32>> {
    let n = items.len();
    if k == 0 || k > n {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut idx: Vec<usize> = (0..k).collect();
    loop {
        out.push(idx.iter().map(|&i| items[i]).collect());
        // The rightmost position that can still move right.
        let Some(i) = (0..k).rev().find(|&i| idx[i] != i + n - k) else { return out };
        idx[i] += 1;
        for j in i + 1..k {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

#[cfg(test)]
mod tests;
