//! OpenStack Nova configuration for this host's accelerators, and the reverse: does a flavor fit
//! this host under a given `nova.conf`.
//!
//! [`plan`] turns an [`Inventory`] into what an operator would otherwise write by hand, following
//! the PCI passthrough guide (`admin/pci-passthrough`): `[pci] device_spec` lines for the compute
//! node, `[pci] alias` lines (on the compute node and the controller) whose `device_type` is the
//! one Nova will see from libvirt (type-PF for a function with SR-IOV virtual functions,
//! type-VF for a virtual function, type-PCI otherwise), `[filter_scheduler] enabled_filters` with
//! `PciPassthroughFilter`, and the `openstack flavor create/set` commands.
//!
//! [`NovaConf::parse`] reads `nova.conf` as oslo.config does (ini; `key = value` or `key: value`;
//! indented continuation lines; surrounding quotes removed; repeated keys are multi-valued, as
//! `MultiStrOpt` options like `alias` and `device_spec` are, across every file given). [`check`]
//! then runs Nova's own rules ([`xpu_core::nova`]) against the discovered devices.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use xpu_core::nova::{
    Aliases, Claimed, DeviceSpec, FitFailure, HostDevice, NovaError, NumaCell, NumaPolicy,
    PciStats, excerpt, quoted,
};
use xpu_core::{DeviceKind, Inventory, PciAddress, SriovType};

/// Nova's default `[filter_scheduler] enabled_filters`, to which PCI passthrough adds one.
pub const DEFAULT_FILTERS: [&str; 5] = [
    "ComputeFilter",
    "ComputeCapabilitiesFilter",
    "ImagePropertiesFilter",
    "ServerGroupAntiAffinityFilter",
    "ServerGroupAffinityFilter",
];

/// The default `--alias-name` template.
pub const DEFAULT_ALIAS_TEMPLATE: &str = "{vendor}-{product}{type_suffix}";

/// Placeholders an alias name template may use.
pub const PLACEHOLDERS: [&str; 7] =
    ["vendor", "product", "vendor_id", "product_id", "type", "type_suffix", "generation"];

/// Sizes the suggested flavors get per device; operators adjust them.
pub const FLAVOR_VCPUS_PER_DEVICE: usize = 8;
pub const FLAVOR_RAM_MB_PER_DEVICE: usize = 65536;
pub const FLAVOR_DISK_GB: usize = 100;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NovaConfError {
    #[error(
        "alias name template {template:?}: {reason}; placeholders are {{vendor}}, {{product}}, {{vendor_id}}, {{product_id}}, {{type}}, {{type_suffix}}, {{generation}}"
    )]
    Template { template: String, reason: String },
    #[error("{file}:{line}: {reason}")]
    Ini { file: String, line: usize, reason: String },
    #[error("{list}: {address} is not an accelerator of this host; `xpu discover` lists them")]
    NotHere { list: String, address: PciAddress },
    #[error(transparent)]
    Nova(#[from] NovaError),
}

/// Accelerators of one kind of passthrough device: same ids, same device type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AliasPlan {
    pub name: String,
    #[serde(serialize_with = "hex4")]
    pub vendor_id: u16,
    #[serde(serialize_with = "hex4")]
    pub product_id: u16,
    pub device_type: SriovType,
    pub product: Option<String>,
    pub devices: Vec<PciAddress>,
}

fn hex4<S: serde::Serializer>(v: &u16, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{v:04x}"))
}

/// A suggested flavor and the commands that create it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Flavor {
    pub name: String,
    pub alias: String,
    pub count: usize,
    pub commands: Vec<String>,
}

/// Everything `xpu openstack nova-config` prints. The JSON shape (`--format json`) is this struct.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub hostname: Option<String>,
    /// `[pci] device_spec` values for the compute node, one JSON object each.
    pub device_spec: Vec<String>,
    /// `[pci] alias` values for the compute node and the controller.
    pub alias: Vec<String>,
    /// `[filter_scheduler] enabled_filters` for the controller.
    pub enabled_filters: String,
    pub aliases: Vec<AliasPlan>,
    pub flavors: Vec<Flavor>,
    /// Things to do before Nova can use the devices (drivers to rebind).
    pub notes: Vec<String>,
}

/// Writes a JSON object with keys in the given order, as an operator would.
fn json_object(pairs: &[(&str, String)]) -> String {
    let fields: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            format!(
                "{}: {}",
                serde_json::Value::String((*k).to_owned()),
                serde_json::Value::String(v.clone())
            )
        })
        .collect();
    format!("{{{}}}", fields.join(", "))
}

fn render_template(template: &str, vars: &BTreeMap<&str, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let end = after.find('}').ok_or_else(|| "unclosed '{'".to_owned())?;
        let key = &after[..end];
        let v = vars.get(key).ok_or_else(|| format!("unknown placeholder {{{key}}}"))?;
        out.push_str(v);
        rest = &after[end + 1..];
    }
    if rest.contains('}') {
        return Err("unmatched '}'".to_owned());
    }
    out.push_str(rest);
    Ok(out)
}

/// The Nova configuration for the accelerators of `inv` (GPUs, TPUs, NPUs; NVSwitches and other
/// functions are not offered as aliases).
pub fn plan(inv: &Inventory, template: &str) -> Result<Plan, NovaConfError> {
    let terr = |reason: String| NovaConfError::Template { template: excerpt(template), reason };
    let mut groups: Vec<AliasPlan> = Vec::new();
    let mut notes = Vec::new();
    for d in inv
        .devices
        .iter()
        .filter(|d| matches!(d.kind, DeviceKind::Gpu | DeviceKind::Tpu | DeviceKind::Npu))
    {
        let (Some(vendor_id), Some(product_id)) = (d.vendor_id, d.device_id) else { continue };
        let t = d.sriov.kind;
        if d.driver.as_deref() != Some("vfio-pci") {
            notes.push(format!(
                "{} ({t}) is bound to {}, not vfio-pci; nova-compute can pass it through only once it is on vfio-pci",
                d.address,
                d.driver.as_deref().unwrap_or("no driver")
            ));
        }
        match groups
            .iter_mut()
            .find(|g| g.vendor_id == vendor_id && g.product_id == product_id && g.device_type == t)
        {
            Some(g) => g.devices.push(d.address),
            None => {
                let entry = xpu_core::accel::lookup(vendor_id, product_id);
                let mut vars: BTreeMap<&str, String> = BTreeMap::new();
                vars.insert(
                    "vendor",
                    entry.map_or_else(|| format!("{vendor_id:04x}"), |a| a.vendor.to_owned()),
                );
                vars.insert(
                    "product",
                    entry.map_or_else(|| format!("{product_id:04x}"), |a| a.product.to_lowercase()),
                );
                vars.insert("vendor_id", format!("{vendor_id:04x}"));
                vars.insert("product_id", format!("{product_id:04x}"));
                let short = match t {
                    SriovType::Pci => "pci",
                    SriovType::Pf => "pf",
                    SriovType::Vf => "vf",
                };
                vars.insert("type", short.to_owned());
                vars.insert(
                    "type_suffix",
                    if t == SriovType::Pci { String::new() } else { format!("-{short}") },
                );
                vars.insert(
                    "generation",
                    entry.map_or_else(|| "unknown".to_owned(), |a| a.generation.to_owned()),
                );
                let name = render_template(template, &vars).map_err(terr)?;
                if name.trim().is_empty() || name.chars().count() > 256 {
                    return Err(terr(format!("it renders {name:?}, not a 1-256 character name")));
                }
                if name.contains([':', ',']) || name.trim() != name {
                    return Err(terr(format!(
                        "it renders {name:?}, which cannot appear in pci_passthrough:alias (no ':', ',' or surrounding spaces)"
                    )));
                }
                if let Some(other) = groups.iter().find(|g| g.name == name) {
                    return Err(terr(format!(
                        "it gives the same name {name:?} to {:04x}:{:04x} {} and {vendor_id:04x}:{product_id:04x} {t}; add {{type_suffix}} or {{product_id}}",
                        other.vendor_id, other.product_id, other.device_type
                    )));
                }
                groups.push(AliasPlan {
                    name,
                    vendor_id,
                    product_id,
                    device_type: t,
                    product: d.product.clone(),
                    devices: vec![d.address],
                });
            }
        }
    }
    let mut device_spec = Vec::new();
    for g in &groups {
        let spec = json_object(&[
            ("vendor_id", format!("{:04x}", g.vendor_id)),
            ("product_id", format!("{:04x}", g.product_id)),
        ]);
        if !device_spec.contains(&spec) {
            device_spec.push(spec);
        }
    }
    let alias: Vec<String> = groups
        .iter()
        .map(|g| {
            json_object(&[
                ("name", g.name.clone()),
                ("vendor_id", format!("{:04x}", g.vendor_id)),
                ("product_id", format!("{:04x}", g.product_id)),
                ("device_type", g.device_type.to_string()),
            ])
        })
        .collect();
    let mut filters: Vec<&str> = DEFAULT_FILTERS.to_vec();
    filters.push("PciPassthroughFilter");
    let mut flavors = Vec::new();
    for g in &groups {
        let mut counts = vec![1];
        if g.devices.len() > 1 {
            counts.push(g.devices.len());
        }
        for n in counts {
            let name = format!("{}-x{n}", g.name);
            flavors.push(Flavor {
                commands: vec![
                    format!(
                        "openstack flavor create --vcpus {} --ram {} --disk {FLAVOR_DISK_GB} {name}",
                        FLAVOR_VCPUS_PER_DEVICE * n,
                        FLAVOR_RAM_MB_PER_DEVICE * n
                    ),
                    format!(
                        "openstack flavor set {name} --property 'pci_passthrough:alias={}:{n}'",
                        g.name
                    ),
                ],
                name,
                alias: g.name.clone(),
                count: n,
            });
        }
    }
    Ok(Plan {
        hostname: inv.host.hostname.clone(),
        device_spec,
        alias,
        enabled_filters: filters.join(","),
        aliases: groups,
        flavors,
        notes,
    })
}

/// [`plan`] for a node that also serves Kubernetes: only the accelerators `kept` (the list of
/// devices kept for Nova, read from `list`, [`xpu_host::vm_devices`]), each `device_spec` pinned
/// by address. `Err` names an address of the list that is not an accelerator of the host.
pub fn plan_kept(
    inv: &Inventory,
    template: &str,
    kept: &std::collections::BTreeSet<PciAddress>,
    list: &str,
) -> Result<Plan, NovaConfError> {
    if let Some(a) = kept.iter().find(|a| !inv.device(a).is_some_and(|d| d.kind.is_accelerator())) {
        return Err(NovaConfError::NotHere { list: list.to_owned(), address: *a });
    }
    let mut only = inv.clone();
    only.devices.retain(|d| kept.contains(&d.address) || !d.kind.is_accelerator());
    let mut plan = plan(&only, template)?;
    pin_addresses(&mut plan);
    plan.notes.push(format!(
        "only the {} devices {list} lists are configured; the node's other accelerators stay with Kubernetes",
        kept.len()
    ));
    Ok(plan)
}

/// Makes each `device_spec` name its device by PCI address as well as ids, for a node whose
/// other devices of the same model are not Nova's (a mixed node, [`xpu_host::vm_devices`]): a
/// spec by ids alone would let nova-compute claim every such device of the host.
fn pin_addresses(plan: &mut Plan) {
    plan.device_spec = plan
        .aliases
        .iter()
        .flat_map(|g| {
            g.devices.iter().map(move |a| {
                json_object(&[
                    ("address", a.to_string()),
                    ("vendor_id", format!("{:04x}", g.vendor_id)),
                    ("product_id", format!("{:04x}", g.product_id)),
                ])
            })
        })
        .collect();
}

/// Which part of the plan to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    All,
    Compute,
    Controller,
    Flavors,
}

/// The plan as ini fragments (`[pci]` with one `device_spec = <json>` line per spec and one
/// `alias = <json>` line per alias) followed by the shell commands.
pub fn render(plan: &Plan, part: Part) -> String {
    let mut out = String::new();
    let host = plan.hostname.as_deref().unwrap_or("this host");
    if matches!(part, Part::All | Part::Compute) {
        if part == Part::All {
            for n in &plan.notes {
                let _ = writeln!(out, "# note: {n}");
            }
            if !plan.notes.is_empty() {
                out.push('\n');
            }
        }
        let _ = writeln!(out, "# nova.conf on the compute node {host} (nova-compute)");
        out.push_str("[pci]\n");
        for s in &plan.device_spec {
            let _ = writeln!(out, "device_spec = {s}");
        }
        for a in &plan.alias {
            let _ = writeln!(out, "alias = {a}");
        }
    }
    if matches!(part, Part::All | Part::Controller) {
        if part == Part::All {
            out.push('\n');
        }
        out.push_str("# nova.conf on the controller (nova-api, nova-scheduler)\n[pci]\n");
        for a in &plan.alias {
            let _ = writeln!(out, "alias = {a}");
        }
        let _ = writeln!(
            out,
            "\n[filter_scheduler]\nenabled_filters = {}\navailable_filters = nova.scheduler.filters.all_filters",
            plan.enabled_filters
        );
    }
    if matches!(part, Part::All | Part::Flavors) {
        if part == Part::All {
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "# Flavors (sizes are placeholders: {FLAVOR_VCPUS_PER_DEVICE} vCPUs and {} GiB RAM per device, {FLAVOR_DISK_GB} GB disk)",
            FLAVOR_RAM_MB_PER_DEVICE / 1024
        );
        for f in &plan.flavors {
            for c in &f.commands {
                let _ = writeln!(out, "{c}");
            }
        }
    }
    out
}

/// The `[pci]` options of one or more `nova.conf` files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NovaConf {
    /// `[pci] device_spec` (or the pre-Zed `passthrough_whitelist`) values, in file order.
    pub device_spec: Vec<String>,
    pub alias: Vec<String>,
    /// Set when the legacy name was used.
    pub legacy_whitelist: bool,
}

/// One oslo.config ini file: `(section, key, value, line)` in order.
pub fn parse_ini(
    file: &str,
    text: &str,
) -> Result<Vec<(String, String, String, usize)>, NovaConfError> {
    let err =
        |line: usize, reason: String| NovaConfError::Ini { file: file.to_owned(), line, reason };
    let mut out: Vec<(String, String, String, usize)> = Vec::new();
    let mut section: Option<String> = None;
    let mut continuing = false;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim_end();
        if line.trim().is_empty() {
            continuing = false;
            continue;
        }
        let first = line.chars().next().unwrap_or(' ');
        if first == '#' || first == ';' {
            continue;
        }
        if first.is_whitespace() && continuing {
            if let Some(last) = out.last_mut() {
                last.2.push('\n');
                last.2.push_str(line.trim());
            }
            continue;
        }
        let line = line.trim();
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest.strip_suffix(']').ok_or_else(|| {
                err(n, format!("section header {} has no closing ']'", quoted(line)))
            })?;
            if name.trim().is_empty() {
                return Err(err(n, "empty section name".to_owned()));
            }
            section = Some(name.trim().to_owned());
            continuing = false;
            continue;
        }
        let sep = match (line.find('='), line.find(':')) {
            (Some(e), Some(c)) => e.min(c),
            (Some(e), None) => e,
            (None, Some(c)) => c,
            (None, None) => {
                return Err(err(n, format!("{} is not KEY = VALUE", quoted(line))));
            }
        };
        let key = line[..sep].trim();
        if key.is_empty() {
            return Err(err(n, format!("{} has no key before the separator", quoted(line))));
        }
        let sec = section
            .clone()
            .ok_or_else(|| err(n, format!("{} comes before any [section] header", quoted(key))))?;
        let mut value = line[sep + 1..].trim();
        if value.len() >= 2
            && (value.starts_with('"') || value.starts_with('\''))
            && value.ends_with(&value[..1])
        {
            value = &value[1..value.len() - 1];
        }
        out.push((sec, key.to_owned(), value.to_owned(), n));
        continuing = true;
    }
    Ok(out)
}

impl NovaConf {
    /// Parses `(file name, content)` pairs in order, as `--config-file` options stack.
    pub fn parse<'a>(
        files: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<NovaConf, NovaConfError> {
        let mut conf = NovaConf::default();
        let mut legacy = Vec::new();
        for (name, text) in files {
            for (section, key, value, _) in parse_ini(name, text)? {
                if section != "pci" {
                    continue;
                }
                match key.as_str() {
                    "device_spec" => conf.device_spec.push(value),
                    "passthrough_whitelist" => legacy.push(value),
                    "alias" => conf.alias.push(value),
                    _ => {}
                }
            }
        }
        // oslo.config reads the deprecated name only when the new one is not set.
        if conf.device_spec.is_empty() && !legacy.is_empty() {
            conf.device_spec = legacy;
            conf.legacy_whitelist = true;
        }
        Ok(conf)
    }
}

/// One pool, for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolReport {
    pub vendor_id: String,
    pub product_id: String,
    pub numa_node: Option<u32>,
    pub dev_type: SriovType,
    pub tags: BTreeMap<String, String>,
    pub free: usize,
    pub devices: Vec<PciAddress>,
}

/// One PCI request of the flavor, for reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestReport {
    pub alias: String,
    pub count: u32,
    pub numa_policy: NumaPolicy,
    pub specs: Vec<String>,
}

/// The answer of `xpu openstack check`; its JSON shape is this struct.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckReport {
    pub flavor: String,
    /// Whether Nova would place the flavor here: the scheduler's `PciPassthroughFilter` passes
    /// and the compute node's claim succeeds.
    pub fits: bool,
    pub requests: Vec<RequestReport>,
    pub pools: Vec<PoolReport>,
    /// The host NUMA cells the guest's NUMA nodes were fitted to (`--numa-nodes`).
    pub guest_numa_cells: Option<Vec<u32>>,
    /// Why the scheduler filter rejects the host, if it does.
    pub filter_failure: Option<FitFailure>,
    /// Why the compute node's claim fails, if it does (it can fail after the filter passed: the
    /// filter counts pools and does not see a PF and its VFs excluding each other).
    pub claim_failure: Option<FitFailure>,
    /// The devices the claim would take.
    pub claimed: Vec<Claimed>,
    /// Reasons in words, one per line.
    pub reasons: Vec<String>,
}

/// What to check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckRequest {
    /// The flavor's `pci_passthrough:alias` value.
    pub flavor: String,
    /// `hw:numa_nodes`: the guest's NUMA node count; `None` for a guest without NUMA topology
    /// (then no PCI NUMA policy applies, as in Nova).
    pub numa_nodes: Option<usize>,
    /// `hw:pci_numa_affinity_policy`, overriding each alias's `numa_policy`.
    pub numa_policy: Option<NumaPolicy>,
}

/// Would Nova, configured by `conf`, place a flavor asking for `req` on the host `inv`?
pub fn check(
    conf: &NovaConf,
    inv: &Inventory,
    cells: Vec<NumaCell>,
    req: &CheckRequest,
) -> Result<CheckReport, NovaConfError> {
    let mut specs = Vec::new();
    for entry in &conf.device_spec {
        specs.extend(DeviceSpec::parse_all(entry)?);
    }
    let aliases = Aliases::parse(conf.alias.iter().map(String::as_str))?;
    let requests = aliases.requests(&req.flavor, req.numa_policy)?;
    let mut stats = PciStats::new(HostDevice::from_inventory(inv), &specs, cells);
    let pools = stats
        .pools
        .iter()
        .map(|p| PoolReport {
            vendor_id: p.key.vendor_id.clone(),
            product_id: p.key.product_id.clone(),
            numa_node: p.key.numa_node,
            dev_type: p.key.dev_type,
            tags: p.key.tags.clone(),
            free: p.devices.len(),
            devices: p.devices.iter().map(|&i| stats.devices[i].address).collect(),
        })
        .collect();
    let mut reasons = Vec::new();
    if specs.is_empty() {
        reasons.push(
            "the configuration has no [pci] device_spec, so nova-compute offers no PCI device"
                .to_owned(),
        );
    }
    let guest = match req.numa_nodes {
        Some(n) => match stats.fit_numa_guest(&requests, n) {
            Ok(cells) => Some(cells),
            Err(f) => {
                reasons.push(f.to_string());
                return Ok(CheckReport {
                    flavor: req.flavor.clone(),
                    fits: false,
                    requests: request_reports(&requests),
                    pools,
                    guest_numa_cells: None,
                    filter_failure: Some(f),
                    claim_failure: None,
                    claimed: Vec::new(),
                    reasons,
                });
            }
        },
        None => None,
    };
    let filter_failure = stats.support_requests(&requests, guest.as_deref()).err();
    if let Some(f) = &filter_failure {
        reasons.push(format!("PciPassthroughFilter rejects this host: {f}"));
    }
    let (claimed, claim_failure) = if filter_failure.is_none() {
        match stats.consume_requests(&requests, guest.as_deref()) {
            Ok(c) => (c, None),
            Err(f) => {
                reasons.push(format!("the compute node's PCI claim fails: {f}"));
                (Vec::new(), Some(f))
            }
        }
    } else {
        (Vec::new(), None)
    };
    Ok(CheckReport {
        flavor: req.flavor.clone(),
        fits: filter_failure.is_none() && claim_failure.is_none(),
        requests: request_reports(&requests),
        pools,
        guest_numa_cells: guest,
        filter_failure,
        claim_failure,
        claimed,
        reasons,
    })
}

fn request_reports(requests: &[xpu_core::nova::PciRequest]) -> Vec<RequestReport> {
    requests
        .iter()
        .map(|r| RequestReport {
            alias: r.alias_name.clone(),
            count: r.count,
            numa_policy: r.numa_policy,
            specs: r.specs.iter().map(|s| s.describe()).collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ini_as_oslo_reads_it() {
        let text = "[DEFAULT]\ndebug = true\n\n[pci]\n# a comment\nalias = '{\"name\": \"a\",\n  \"vendor_id\": \"10de\"}'\nalias: {\"name\": \"b\"}\ndevice_spec = \"{}\"\n";
        let v = parse_ini("nova.conf", text).unwrap();
        assert_eq!(v[1].2, "'{\"name\": \"a\",\n\"vendor_id\": \"10de\"}'");
        let conf = NovaConf::parse([("nova.conf", "[pci]\nalias = '{\"name\": \"a\"}'\nalias: {\"name\": \"b\"}\npassthrough_whitelist = {}\n")]).unwrap();
        assert_eq!(conf.alias, ["{\"name\": \"a\"}", "{\"name\": \"b\"}"]);
        assert_eq!(conf.device_spec, ["{}"]);
        assert!(conf.legacy_whitelist);
        for (bad, want) in [
            ("alias = x\n", "before any [section]"),
            ("[pci\n", "no closing"),
            ("[pci]\njust words\n", "is not KEY = VALUE"),
        ] {
            let e = parse_ini("f.conf", bad).unwrap_err().to_string();
            assert!(e.starts_with("f.conf:") && e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn templates() {
        let mut vars = BTreeMap::new();
        vars.insert("vendor", "nvidia".to_owned());
        assert_eq!(render_template("{vendor}-gpu", &vars).unwrap(), "nvidia-gpu");
        assert!(render_template("{vendr}", &vars).unwrap_err().contains("unknown placeholder"));
        assert!(render_template("{vendor", &vars).unwrap_err().contains("unclosed"));
        assert_eq!(json_object(&[("name", "a\"b".to_owned())]), r#"{"name": "a\"b"}"#);
    }
}
