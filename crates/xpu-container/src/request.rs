//! What a container asks for, read from its OCI spec: the visible-devices environment grammar
//! and CDI annotations, resolved against the host's [`Inventory`] into a [`Selection`].
//!
//! - `NVIDIA_VISIBLE_DEVICES` (NVIDIA's documented values): unset, empty or `void` add nothing;
//!   `none` adds the driver (control nodes and driver files) without a GPU; `all`; otherwise a
//!   comma-separated list of indices (`0,1`, in PCI address order like `nvidia-smi`), `GPU-`
//!   UUIDs, and PCI bus ids (`0000:25:00.0`, `00000000:25:00.0`, `25:00.0`). MIG devices
//!   (`MIG-...`, `0:1`) are refused until supported.
//! - `NVIDIA_DRIVER_CAPABILITIES`: `all` or a list of capabilities; unset or empty takes the
//!   configured default (`utility,compute`).
//! - `XPU_VISIBLE_DEVICES`, vendor-neutral: a comma-separated list of CDI names
//!   (`google.com/tpu=0`, `nvidia.com/gpu=all`), kind-qualified indices (`tpu:0`, `gpu:3`,
//!   `gpu:all`, counting every device of that kind in PCI address order whatever its vendor)
//!   and PCI addresses of accelerators (`0000:25:00.0`: what xpu's device plugin answers
//!   `Allocate` with); empty or `void` adds nothing.
//! - CDI annotations (`cdi.k8s.io/<key>`: comma-separated fully qualified names): names of the
//!   kinds xpu serves are resolved; names of other kinds are left to the engine.
//!
//! Every error names the variable (or annotation) and the value, and says what is accepted.

use std::collections::BTreeMap;

use xpu_core::driver::{Capabilities, CapabilityError};
use xpu_core::{DeviceKind, Inventory, PciAddress};

use crate::cdi::{self, CdiKind, QualifiedName};
use crate::edits::Selection;

pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
pub const NVIDIA_DRIVER_CAPABILITIES: &str = "NVIDIA_DRIVER_CAPABILITIES";
pub const NVIDIA_DISABLE_REQUIRE: &str = "NVIDIA_DISABLE_REQUIRE";
pub const NVIDIA_REQUIRE_PREFIX: &str = "NVIDIA_REQUIRE_";
pub const XPU_VISIBLE_DEVICES: &str = "XPU_VISIBLE_DEVICES";
pub const CDI_ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// A bad request value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {reason}")]
pub struct RequestError {
    /// The variable or annotation.
    pub var: String,
    pub value: String,
    pub reason: String,
}

fn err(var: &str, value: &str, reason: impl Into<String>) -> RequestError {
    RequestError { var: var.to_owned(), value: value.to_owned(), reason: reason.into() }
}

/// The container's environment: `process.env` with the last definition of a name winning, as
/// `execve` consumers (and runc) see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Env(BTreeMap<String, String>);

impl Env {
    pub fn from_entries<'a>(entries: impl IntoIterator<Item = &'a str>) -> Self {
        let mut m = BTreeMap::new();
        for e in entries {
            let (k, v) = e.split_once('=').unwrap_or((e, ""));
            m.insert(k.to_owned(), v.to_owned());
        }
        Env(m)
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// Everything a container asked for, resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub selection: Selection,
    /// The CDI names of the selected devices (`nvidia.com/gpu=1`), for the container's
    /// `XPU_DEVICES` and for logs.
    pub names: Vec<String>,
    /// Whether `NVIDIA_REQUIRE_*` constraints are to be checked (NVIDIA driver requested and
    /// `NVIDIA_DISABLE_REQUIRE` not set).
    pub check_require: bool,
}

/// Reads and resolves the request of a container with environment `env` and OCI annotations
/// `annotations` on host `inv`. `default_caps` applies when `NVIDIA_DRIVER_CAPABILITIES` is
/// unset or empty.
pub fn resolve(
    env: &Env,
    annotations: &BTreeMap<String, String>,
    inv: &Inventory,
    default_caps: Capabilities,
) -> Result<Request, RequestError> {
    let mut sel = Selection::default();

    if let Some(v) = env.get(NVIDIA_VISIBLE_DEVICES) {
        nvidia_visible(v, inv, &mut sel)?;
    }
    if let Some(v) = env.get(XPU_VISIBLE_DEVICES) {
        xpu_visible(v, inv, &mut sel)?;
    }
    for (k, v) in annotations.iter().filter(|(k, _)| k.starts_with(CDI_ANNOTATION_PREFIX)) {
        cdi_annotation(k, v, inv, &mut sel)?;
    }

    sel.capabilities = match env.get(NVIDIA_DRIVER_CAPABILITIES).map(str::trim) {
        None | Some("") => default_caps,
        Some(v) => Capabilities::parse(v).map_err(|CapabilityError { value }| {
            err(
                NVIDIA_DRIVER_CAPABILITIES,
                v,
                format!(
                    "unknown capability {value:?}; use all or a comma-separated list of compute, compat32, display, graphics, ngx, utility, video"
                ),
            )
        })?,
    };

    let disable = match env.get(NVIDIA_DISABLE_REQUIRE) {
        None => false,
        Some(v) => parse_bool(v)
            .ok_or_else(|| err(NVIDIA_DISABLE_REQUIRE, v, "not a boolean; use true or false"))?,
    };
    let names = names_of(inv, &sel);
    Ok(Request { check_require: !disable && sel.wants_nvidia_driver(inv), selection: sel, names })
}

/// An accelerator a request can name, as [`Host::inventory`](crate::shim::Host::inventory)
/// takes it: its PCI vendor (any when `None`) and its kind.
pub type Wanted = (Option<u16>, DeviceKind);

/// The accelerators `env` and `annotations` can name, found before the host is read so that
/// discovery reads only those: `NVIDIA_VISIBLE_DEVICES` and `nvidia.com/gpu` names want NVIDIA
/// GPUs, `gpu:0` GPUs of any vendor, and so on. Per kind and vendor, [`resolve`] then sees the
/// same devices in the same order as on a full inventory. `None` when an entry is not
/// understood: the full read follows and [`resolve`] reports the entry.
pub fn wanted(env: &Env, annotations: &BTreeMap<String, String>) -> Option<Vec<Wanted>> {
    let cdi = |item: &str| -> Option<Option<Wanted>> {
        let name: QualifiedName = item.parse().ok()?;
        Some(CdiKind::from_kind(&name.kind).map(|k| {
            let (vendor, kind) = k.device();
            (Some(vendor), kind)
        }))
    };
    let items = |v: &str| -> Vec<String> {
        v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect()
    };
    let mut out = Vec::new();
    if let Some(v) = env.get(NVIDIA_VISIBLE_DEVICES)
        && !matches!(v.trim(), "" | "void" | "none")
    {
        let (vendor, kind) = CdiKind::NvidiaGpu.device();
        out.push((Some(vendor), kind));
    }
    if let Some(v) = env.get(XPU_VISIBLE_DEVICES)
        && !matches!(v.trim(), "" | "void")
    {
        for item in items(v) {
            if item.contains('=') {
                // An unknown CDI kind is an error for XPU_VISIBLE_DEVICES.
                out.push(cdi(&item)??);
            } else {
                let (kind, _) = item.split_once(':')?;
                out.push((None, kind.parse().ok()?));
            }
        }
    }
    for (_, v) in annotations.iter().filter(|(k, _)| k.starts_with(CDI_ANNOTATION_PREFIX)) {
        for item in items(v) {
            // Other vendors' kinds are the engine's business.
            out.extend(cdi(&item)?);
        }
    }
    out.sort();
    out.dedup();
    Some(out)
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// The CDI names of the selected devices, by index.
fn names_of(inv: &Inventory, sel: &Selection) -> Vec<String> {
    let mut names = Vec::new();
    for kind in CdiKind::ALL {
        for (n, i) in cdi::devices_of(inv, kind).into_iter().enumerate() {
            if sel.devices.contains(&i) {
                names.push(format!("{kind}={n}"));
            }
        }
    }
    names
}

fn nvidia_visible(v: &str, inv: &Inventory, sel: &mut Selection) -> Result<(), RequestError> {
    let var = NVIDIA_VISIBLE_DEVICES;
    let gpus = cdi::devices_of(inv, CdiKind::NvidiaGpu);
    match v.trim() {
        "" | "void" => return Ok(()),
        "none" => {
            sel.nvidia_driver = true;
            return Ok(());
        }
        "all" => {
            if gpus.is_empty() {
                return Err(err(var, v, "this host has no NVIDIA GPUs"));
            }
            gpus.into_iter().for_each(|i| sel.add(i));
            return Ok(());
        }
        _ => {}
    }
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let i = nvidia_item(item, inv, &gpus).map_err(|reason| err(var, v, reason))?;
        sel.add(i);
    }
    Ok(())
}

/// One entry of an `NVIDIA_VISIBLE_DEVICES` list: an index, a UUID or a bus id.
fn nvidia_item(item: &str, inv: &Inventory, gpus: &[usize]) -> Result<usize, String> {
    let count = || match gpus.len() {
        0 => "this host has no NVIDIA GPUs".to_owned(),
        1 => "this host has 1 NVIDIA GPU (index 0)".to_owned(),
        n => format!("this host has {n} NVIDIA GPUs (indices 0-{})", n - 1),
    };
    if item.starts_with("MIG-") || is_mig_index(item) {
        return Err(format!(
            "{item} is a MIG device; MIG devices are not supported yet, pass whole GPUs by index or UUID"
        ));
    }
    if item.bytes().all(|b| b.is_ascii_digit()) {
        return item
            .parse::<usize>()
            .ok()
            .and_then(|n| gpus.get(n).copied())
            .ok_or_else(|| format!("GPU index {item} does not exist; {}", count()));
    }
    if item.len() >= 4 && item[..4].eq_ignore_ascii_case("GPU-") {
        return gpus
            .iter()
            .copied()
            .find(|&i| {
                cdi::uuid_name(&inv.devices[i]).is_some_and(|u| u.eq_ignore_ascii_case(item))
            })
            .ok_or_else(|| format!("no NVIDIA GPU has UUID {item}"));
    }
    if let Some(addr) = parse_bus_id(item) {
        return gpus
            .iter()
            .copied()
            .find(|&i| inv.devices[i].address == addr)
            .ok_or_else(|| format!("no NVIDIA GPU at PCI address {addr}"));
    }
    Err(format!(
        "{item:?} is not a GPU index, a GPU- UUID or a PCI bus id; use all, none, void, or a comma-separated list of those"
    ))
}

/// `0:1` (GPU 0, MIG instance 1).
fn is_mig_index(s: &str) -> bool {
    s.split_once(':').is_some_and(|(a, b)| {
        !a.is_empty()
            && !b.is_empty()
            && a.bytes().all(|c| c.is_ascii_digit())
            && b.bytes().all(|c| c.is_ascii_digit())
    })
}

/// `0000:25:00.0`, NVML's `00000000:25:00.0`, or `25:00.0` (domain 0).
pub fn parse_bus_id(s: &str) -> Option<PciAddress> {
    if let Ok(a) = s.parse::<PciAddress>() {
        return Some(a);
    }
    let colons = s.matches(':').count();
    if colons == 2 {
        let (dom, rest) = s.split_once(':')?;
        let dom = u32::from_str_radix(dom, 16).ok()?;
        let dom = u16::try_from(dom).ok()?;
        return format!("{dom:04x}:{rest}").parse().ok();
    }
    if colons == 1 {
        return format!("0000:{s}").parse().ok();
    }
    None
}

fn xpu_visible(v: &str, inv: &Inventory, sel: &mut Selection) -> Result<(), RequestError> {
    let var = XPU_VISIBLE_DEVICES;
    if matches!(v.trim(), "" | "void") {
        return Ok(());
    }
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let found = if item.contains('=') {
            let name: QualifiedName = item.parse().map_err(|e| err(var, v, format!("{e}")))?;
            let kind = CdiKind::from_kind(&name.kind).ok_or_else(|| {
                err(
                    var,
                    v,
                    format!(
                        "unknown CDI kind {}; xpu provides nvidia.com/gpu, google.com/tpu and amd.com/gpu",
                        name.kind
                    ),
                )
            })?;
            cdi::resolve(inv, kind, &name.name)
                .ok_or_else(|| err(var, v, format!("this host has no device {item}")))?
        } else if let Some(a) = item.contains('.').then(|| parse_bus_id(item)).flatten() {
            let i = inv
                .devices
                .iter()
                .position(|d| d.address == a && d.kind.is_accelerator())
                .ok_or_else(|| err(var, v, format!("this host has no accelerator at {a}")))?;
            vec![i]
        } else if let Some((kind, index)) = item.split_once(':') {
            kind_index(kind, index, inv).map_err(|reason| err(var, v, reason))?
        } else {
            return Err(err(
                var,
                v,
                format!(
                    "{item:?} is neither a CDI name (nvidia.com/gpu=0), a kind-qualified index (gpu:0, tpu:all) nor an accelerator's PCI address (0000:25:00.0)"
                ),
            ));
        };
        found.into_iter().for_each(|i| sel.add(i));
    }
    Ok(())
}

/// `tpu:0`, `gpu:all`.
fn kind_index(kind: &str, index: &str, inv: &Inventory) -> Result<Vec<usize>, String> {
    let k: DeviceKind =
        kind.parse().ok().filter(|k: &DeviceKind| k.is_accelerator()).ok_or_else(|| {
            format!("unknown device kind {kind:?}; use gpu, tpu, npu or nvswitch")
        })?;
    let devs: Vec<usize> = (0..inv.devices.len()).filter(|&i| inv.devices[i].kind == k).collect();
    if index == "all" {
        if devs.is_empty() {
            return Err(format!("this host has no {k} devices"));
        }
        return Ok(devs);
    }
    let n: usize =
        index.parse().map_err(|_| format!("{index:?} is not an index; use a number or all"))?;
    devs.get(n).map(|&i| vec![i]).ok_or_else(|| {
        format!("{k} index {n} does not exist; this host has {} {k} devices", devs.len())
    })
}

fn cdi_annotation(
    key: &str,
    v: &str,
    inv: &Inventory,
    sel: &mut Selection,
) -> Result<(), RequestError> {
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let name: QualifiedName = item.parse().map_err(|e| err(key, v, format!("{e}")))?;
        // Other vendors' kinds are the engine's business (it resolves them from /etc/cdi).
        let Some(kind) = CdiKind::from_kind(&name.kind) else { continue };
        let found = cdi::resolve(inv, kind, &name.name)
            .ok_or_else(|| err(key, v, format!("this host has no device {item}")))?;
        found.into_iter().for_each(|i| sel.add(i));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_in_every_spelling() {
        let want: PciAddress = "0000:25:00.0".parse().unwrap();
        for s in ["0000:25:00.0", "00000000:25:00.0", "25:00.0"] {
            assert_eq!(parse_bus_id(s), Some(want), "{s}");
        }
        assert_eq!(parse_bus_id("GPU-1"), None);
        assert!(is_mig_index("0:1"));
        assert!(!is_mig_index("25:00.0"));
    }

    /// The shim reads only what [`wanted`] names; every request must resolve (or fail) on that
    /// narrow inventory exactly as on the full one.
    #[test]
    fn narrow_inventory_resolves_like_the_full_one() {
        let requests: &[(&str, &str)] = &[
            (NVIDIA_VISIBLE_DEVICES, "1,3"),
            (NVIDIA_VISIBLE_DEVICES, "all"),
            (NVIDIA_VISIBLE_DEVICES, "none"),
            (NVIDIA_VISIBLE_DEVICES, "9"),
            (NVIDIA_VISIBLE_DEVICES, "0000:4d:00.0,GPU-nope"),
            (NVIDIA_VISIBLE_DEVICES, "MIG-1"),
            (XPU_VISIBLE_DEVICES, "gpu:0,gpu:1"),
            (XPU_VISIBLE_DEVICES, "gpu:all"),
            (XPU_VISIBLE_DEVICES, "tpu:3"),
            (XPU_VISIBLE_DEVICES, "nvswitch:0"),
            (XPU_VISIBLE_DEVICES, "google.com/tpu=all,amd.com/gpu=1"),
            (XPU_VISIBLE_DEVICES, "nvidia.com/gpu=0"),
            (XPU_VISIBLE_DEVICES, "intel.com/gpu=0"),
            (XPU_VISIBLE_DEVICES, "fpga:0"),
            (XPU_VISIBLE_DEVICES, "junk"),
            (XPU_VISIBLE_DEVICES, "0000:25:00.0,0000:2b:00.0"),
            (XPU_VISIBLE_DEVICES, "0000:99:00.0"),
            ("cdi.k8s.io/x", "nvidia.com/gpu=2,vendor.com/nic=1"),
            ("cdi.k8s.io/y", "amd.com/gpu=all"),
            ("cdi.k8s.io/z", "not a name"),
        ];
        let caps = Capabilities::parse("utility,compute").unwrap();
        for spec in xpu_testkit::hosts::all() {
            let f = spec.build();
            let root = xpu_host::Root::new(f.root()).unwrap();
            let full = xpu_host::discover(&root, &xpu_host::DiscoverOptions::default()).unwrap();
            for &(var, value) in requests {
                let (mut env, mut ann) = (Env::default(), BTreeMap::new());
                if var.starts_with(CDI_ANNOTATION_PREFIX) {
                    ann.insert(var.to_owned(), value.to_owned());
                } else {
                    env = Env::from_entries([format!("{var}={value}").as_str()]);
                }
                let only = wanted(&env, &ann);
                let narrow = xpu_host::discover_nodes(&root, only.as_deref()).unwrap();
                let view = |inv: &Inventory| {
                    resolve(&env, &ann, inv, caps).map(|r| {
                        let addrs: Vec<_> =
                            r.selection.devices.iter().map(|&i| inv.devices[i].address).collect();
                        (addrs, r.names, r.selection.nvidia_driver, r.check_require)
                    })
                };
                assert_eq!(view(&narrow), view(&full), "{} {var}={value}", spec.name);
            }
        }
    }

    /// What xpu's device plugin answers `Allocate` with (PCI addresses) is a request the shim
    /// understands, so a node running the shim needs nothing else from the plugin.
    #[test]
    fn pci_addresses_name_accelerators() {
        let f = xpu_testkit::hosts::a100_8x().build();
        let root = xpu_host::Root::new(f.root()).unwrap();
        let inv = xpu_host::discover(&root, &xpu_host::DiscoverOptions::default()).unwrap();
        let caps = Capabilities::parse("utility,compute").unwrap();
        let req = |v: &str| {
            let env = Env::from_entries([format!("{XPU_VISIBLE_DEVICES}={v}").as_str()]);
            resolve(&env, &BTreeMap::new(), &inv, caps)
        };
        let r = req("0000:25:00.0,0000:2b:00.0").unwrap();
        assert_eq!(r.names, ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]);
        let e = req("0000:99:00.0").unwrap_err().to_string();
        assert!(e.contains("no accelerator at 0000:99:00.0"), "{e}");
        // A function that is not an accelerator (an NVSwitch is one; a bridge is not).
        let bridge = inv.devices.iter().find(|d| !d.kind.is_accelerator()).map(|d| d.address);
        if let Some(b) = bridge {
            assert!(req(&b.to_string()).is_err());
        }
    }

    #[test]
    fn env_last_definition_wins() {
        let e = Env::from_entries(["A=1", "B", "A=2=x"]);
        assert_eq!(e.get("A"), Some("2=x"));
        assert_eq!(e.get("B"), Some(""));
    }
}
