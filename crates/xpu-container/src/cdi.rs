//! Container Device Interface (CDI) specs for the host's accelerators, and the CDI device naming
//! convention the whole project shares (the kubelet device plugin returns these names).
//!
//! Kinds and names (CDI "fully qualified device names" are `vendor.com/class=name`,
//! <https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md>):
//! - `nvidia.com/gpu`: `0`..`N-1` are the NVIDIA GPUs (kind gpu, vendor `10de`) in PCI address
//!   order, `GPU-<uuid>` the same GPUs by UUID where the driver published one that is a valid
//!   CDI device name ([`is_device_name`]; a device whose UUID is not keeps its index name only,
//!   with a warning), and `all`;
//! - `google.com/tpu`: `0`..`N-1` the TPU chips in PCI address order, and `all`;
//! - `amd.com/gpu`: `0`..`N-1` the AMD GPUs in PCI address order, and `all`.
//!
//! `cdiVersion` is the lowest version whose fields the spec uses (the loaders reject a spec that
//! declares less, and older engines reject a higher one): device names starting with a digit need
//! 0.5.0, and nothing we write needs more (no mount `type`, which would need 0.4.0 anyway; no
//! annotations (0.6.0), no `additionalGids`/`intelRdt` (0.7.0), no `netDevices` (1.1.0)).

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xpu_core::accel::{VENDOR_AMD, VENDOR_GOOGLE, VENDOR_NVIDIA};
use xpu_core::driver::{Capabilities, DriverFiles, DriverVendor};
use xpu_core::inventory::NodeType;
use xpu_core::{DeviceKind, Inventory, PciAddress, PciDevice};

use crate::edits::{self, EditError, Edits, MOUNT_OPTIONS};

/// The CDI version xpu's specs declare; see the module documentation for why.
pub const CDI_VERSION: &str = "0.5.0";

/// The device kinds xpu generates specs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CdiKind {
    NvidiaGpu,
    GoogleTpu,
    AmdGpu,
}

impl CdiKind {
    pub const ALL: [CdiKind; 3] = [CdiKind::NvidiaGpu, CdiKind::GoogleTpu, CdiKind::AmdGpu];

    /// `nvidia.com/gpu`
    pub fn as_str(self) -> &'static str {
        match self {
            CdiKind::NvidiaGpu => "nvidia.com/gpu",
            CdiKind::GoogleTpu => "google.com/tpu",
            CdiKind::AmdGpu => "amd.com/gpu",
        }
    }

    pub fn vendor(self) -> DriverVendor {
        match self {
            CdiKind::NvidiaGpu => DriverVendor::Nvidia,
            CdiKind::GoogleTpu => DriverVendor::Google,
            CdiKind::AmdGpu => DriverVendor::Amd,
        }
    }

    /// The kind a device is published under, if any.
    pub fn of(d: &PciDevice) -> Option<CdiKind> {
        Self::ALL.into_iter().find(|k| {
            let (vendor, kind) = k.device();
            d.kind == kind && d.vendor_id == Some(vendor)
        })
    }

    /// The PCI vendor and device kind of this kind's devices.
    pub fn device(self) -> (u16, DeviceKind) {
        match self {
            CdiKind::NvidiaGpu => (VENDOR_NVIDIA, DeviceKind::Gpu),
            CdiKind::GoogleTpu => (VENDOR_GOOGLE, DeviceKind::Tpu),
            CdiKind::AmdGpu => (VENDOR_AMD, DeviceKind::Gpu),
        }
    }

    pub fn from_kind(s: &str) -> Option<CdiKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The `--vendor` spelling: `nvidia`, `google`, `amd`.
    pub fn vendor_name(self) -> &'static str {
        match self {
            CdiKind::NvidiaGpu => "nvidia",
            CdiKind::GoogleTpu => "google",
            CdiKind::AmdGpu => "amd",
        }
    }
}

impl fmt::Display for CdiKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The devices of `kind`, as indices into `inv.devices`, in CDI index order (PCI address order;
/// the inventory is sorted by address).
pub fn devices_of(inv: &Inventory, kind: CdiKind) -> Vec<usize> {
    (0..inv.devices.len()).filter(|&i| CdiKind::of(&inv.devices[i]) == Some(kind)).collect()
}

/// One CDI device name and what it stands for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CdiDevice {
    pub kind: CdiKind,
    /// `0`, `GPU-8f6...`, `all`.
    pub name: String,
    /// The PCI function; `None` for `all`.
    pub address: Option<PciAddress>,
}

impl CdiDevice {
    /// `nvidia.com/gpu=0`
    pub fn qualified(&self) -> String {
        format!("{}={}", self.kind, self.name)
    }
}

impl fmt::Display for CdiDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.kind, self.name)
    }
}

/// Every CDI device name this host offers: per kind, the indices, then (NVIDIA) the UUIDs, then
/// `all`. This is the naming convention the device plugin and the specs share.
pub fn device_names(inv: &Inventory) -> Vec<CdiDevice> {
    let mut out = Vec::new();
    for kind in CdiKind::ALL {
        let devs = devices_of(inv, kind);
        if devs.is_empty() {
            continue;
        }
        for (n, &i) in devs.iter().enumerate() {
            out.push(CdiDevice {
                kind,
                name: n.to_string(),
                address: Some(inv.devices[i].address),
            });
        }
        if kind == CdiKind::NvidiaGpu {
            for &i in &devs {
                if let Some(uuid) = uuid_name(&inv.devices[i]) {
                    out.push(CdiDevice {
                        kind,
                        name: uuid.to_owned(),
                        address: Some(inv.devices[i].address),
                    });
                }
            }
        }
        out.push(CdiDevice { kind, name: "all".to_owned(), address: None });
    }
    out
}

/// The devices (indices into `inv.devices`) a name of `kind` stands for, or `None` when the
/// host has no such device.
pub fn resolve(inv: &Inventory, kind: CdiKind, name: &str) -> Option<Vec<usize>> {
    let devs = devices_of(inv, kind);
    if name == "all" {
        return (!devs.is_empty()).then_some(devs);
    }
    if let Ok(n) = name.parse::<usize>() {
        return devs.get(n).map(|&i| vec![i]);
    }
    devs.into_iter()
        .find(|&i| uuid_name(&inv.devices[i]).is_some_and(|u| u.eq_ignore_ascii_case(name)))
        .map(|i| vec![i])
}

/// A device's UUID when it can serve as its CDI device name.
pub fn uuid_name(d: &PciDevice) -> Option<&str> {
    d.uuid.as_deref().filter(|u| is_device_name(u))
}

/// Why `name` is not a CDI device name, or `None` when it is one. The rule of the CDI spec's
/// reference parser (`pkg/parser`, `ValidateDeviceName`): ASCII letters, digits, `_`, `-`, `.`
/// and `:`, starting and ending with a letter or digit.
pub fn device_name_problem(name: &str) -> Option<&'static str> {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !alnum(name.chars().next()) || !alnum(name.chars().last()) {
        return Some("it must start and end with a letter or digit");
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c)) {
        return Some("it may hold only letters, digits, '-', '_', '.' and ':'");
    }
    None
}

/// Whether `name` is a CDI device name (see [`device_name_problem`]).
pub fn is_device_name(name: &str) -> bool {
    device_name_problem(name).is_none()
}

/// A fully qualified CDI device name, split and checked against the spec's character rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QualifiedName {
    /// `vendor.com/class`
    pub kind: String,
    pub name: String,
}

/// Why a string is not a CDI device name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a fully qualified CDI device name (vendor.com/class=name): {reason}")]
pub struct NameError {
    pub input: String,
    pub reason: &'static str,
}

impl std::str::FromStr for QualifiedName {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| NameError { input: s.to_owned(), reason };
        let (kind, name) = s.split_once('=').ok_or_else(|| err("missing '='"))?;
        let (vendor, class) = kind.split_once('/').ok_or_else(|| err("kind has no '/'"))?;
        let alnum_ends = |t: &str| {
            t.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
                && t.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
        };
        let vendor_ok = vendor.split('.').all(|label| {
            alnum_ends(label) && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
        if !vendor_ok {
            return Err(err("vendor must be a DNS name"));
        }
        if !alnum_ends(class)
            || !class.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(err("class must be letters, digits, '-', '_' or '.'"));
        }
        if !is_device_name(name) {
            return Err(err("name must be letters, digits, '-', '_', '.' or ':'"));
        }
        Ok(QualifiedName { kind: kind.to_owned(), name: name.to_owned() })
    }
}

/// A CDI spec file (the fields xpu writes). Field names as in the CDI JSON schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    pub path: String,
    #[serde(rename = "type")]
    pub node_type: String,
    pub major: i64,
    pub minor: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub options: Vec<String>,
}

impl From<&Edits> for ContainerEdits {
    fn from(e: &Edits) -> Self {
        ContainerEdits {
            env: e.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            device_nodes: e
                .nodes
                .iter()
                .map(|n| DeviceNode {
                    path: n.path.clone(),
                    node_type: match n.node_type {
                        NodeType::Char => "c",
                        NodeType::Block => "b",
                    }
                    .to_owned(),
                    major: n.major.into(),
                    minor: n.minor.into(),
                    file_mode: n.file_mode,
                })
                .collect(),
            mounts: e
                .mounts
                .iter()
                .map(|m| Mount {
                    host_path: m.source.to_string_lossy().into_owned(),
                    container_path: m.destination.clone(),
                    options: MOUNT_OPTIONS.map(str::to_owned).to_vec(),
                })
                .collect(),
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Kinds to generate; the ones the caller named explicitly must have devices.
    pub kinds: Vec<CdiKind>,
    /// Whether `kinds` was narrowed by the user (`--vendor nvidia`): then a kind without devices
    /// and a device whose node lacks numbers are errors, not warnings.
    pub strict: bool,
    /// Where host paths really are (`--root`), for mount sources.
    pub host_root: PathBuf,
}

/// Specs plus what was left out and why.
#[derive(Debug, Clone, Default)]
pub struct Generated {
    pub specs: Vec<Spec>,
    pub warnings: Vec<String>,
}

/// Why no spec can be generated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    #[error("no {kind} devices on this host; nothing to generate for --vendor {vendor}")]
    NoDevices { kind: CdiKind, vendor: &'static str },
    /// `left_out` says why each device was left out.
    #[error("no accelerators with usable device nodes on this host; nothing to generate")]
    Nothing { left_out: Vec<String> },
    #[error(transparent)]
    Edit(#[from] EditError),
}

/// Generates one spec per kind that has devices.
pub fn generate(
    inv: &Inventory,
    files: &DriverFiles,
    opts: &GenerateOptions,
) -> Result<Generated, GenerateError> {
    let mut out = Generated::default();
    for &kind in &opts.kinds {
        match spec_for(inv, files, kind, opts, &mut out.warnings)? {
            Some(spec) => out.specs.push(spec),
            None if opts.strict => {
                return Err(GenerateError::NoDevices { kind, vendor: kind.vendor_name() });
            }
            None => {}
        }
    }
    if out.specs.is_empty() {
        return Err(GenerateError::Nothing { left_out: out.warnings });
    }
    Ok(out)
}

fn spec_for(
    inv: &Inventory,
    files: &DriverFiles,
    kind: CdiKind,
    opts: &GenerateOptions,
    warnings: &mut Vec<String>,
) -> Result<Option<Spec>, GenerateError> {
    // Per device: its own nodes. A device whose nodes cannot be described is an error when the
    // user asked for this vendor, and is left out with a warning when generating for all.
    let mut usable: Vec<(usize, usize, Vec<edits::NodeEdit>)> = Vec::new(); // (index, inv idx, nodes)
    for (n, i) in devices_of(inv, kind).into_iter().enumerate() {
        match edits::device_nodes(&inv.devices[i]) {
            Ok(nodes) => usable.push((n, i, nodes)),
            Err(e) if opts.strict => return Err(e.into()),
            Err(e) => warnings.push(format!("{kind}={n} left out: {e}")),
        }
    }
    if usable.is_empty() {
        return Ok(None);
    }
    // Names in the order of `device_names`: indices, UUIDs, `all`.
    let mut devices = Vec::new();
    let mut by_uuid = Vec::new();
    let mut all = Edits::default();
    for (n, i, nodes) in &usable {
        let e = Edits { nodes: nodes.clone(), ..Default::default() };
        let ce = ContainerEdits::from(&e);
        devices.push(Device { name: n.to_string(), container_edits: ce.clone() });
        if let Some(uuid) = &inv.devices[*i].uuid
            && kind == CdiKind::NvidiaGpu
        {
            // The UUID comes from the host (a driver's /proc file, or a tree someone made):
            // only a valid name is written, or a loader would reject the whole spec.
            match device_name_problem(uuid) {
                None => by_uuid.push(Device { name: uuid.clone(), container_edits: ce }),
                Some(why) => warnings.push(format!(
                    "{kind}={n}: UUID {uuid:?} is not a valid CDI device name ({why}); the device is named {kind}={n} only"
                )),
            }
        }
        all.nodes.extend(nodes.iter().cloned());
    }
    devices.extend(by_uuid);
    devices.push(Device { name: "all".to_owned(), container_edits: ContainerEdits::from(&all) });

    // Shared by every device of the kind: control nodes, driver files, environment.
    let mut common = Edits::default();
    let idx: Vec<usize> = usable.iter().map(|(_, i, _)| *i).collect();
    edits::control_nodes(inv, &idx, false, None, &mut common)?;
    if kind == CdiKind::NvidiaGpu && idx.iter().any(|&i| edits::uses_nvidia_driver(&inv.devices[i]))
    {
        edits::driver_mounts(
            files,
            DriverVendor::Nvidia,
            Capabilities::all(),
            &opts.host_root,
            &mut common,
        );
    }
    if kind == CdiKind::NvidiaGpu {
        // The devices come from CDI: keep NVIDIA's legacy hook (and xpu's shim) from adding
        // the image's NVIDIA_VISIBLE_DEVICES=all on top, as NVIDIA's own CDI specs do.
        common.env.push(("NVIDIA_VISIBLE_DEVICES".to_owned(), "void".to_owned()));
    }
    warnings.extend(common.warnings.iter().map(|w| format!("{kind}: {w}")));
    Ok(Some(Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: kind.as_str().to_owned(),
        devices,
        container_edits: ContainerEdits::from(&common),
    }))
}

/// The file name a spec gets in a CDI directory: `xpu-nvidia.com-gpu.yaml`.
pub fn file_name(spec: &Spec, json: bool) -> String {
    format!("xpu-{}.{}", spec.kind.replace('/', "-"), if json { "json" } else { "yaml" })
}

/// The spec as YAML, the usual format of `/etc/cdi`.
pub fn to_yaml(spec: &Spec) -> String {
    // Serializing plain structs of strings and integers cannot fail.
    serde_norway::to_string(spec).unwrap_or_default()
}

/// The spec as pretty JSON with a trailing newline.
pub fn to_json(spec: &Spec) -> String {
    let mut s = serde_json::to_string_pretty(spec).unwrap_or_default();
    s.push('\n');
    s
}

/// Writes `bytes` to `path` atomically (see [`crate::fsutil::write_atomic`]): a runtime that
/// reads the CDI directory while we write sees the old spec or the new one, never half of one.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    crate::fsutil::write_atomic(path, bytes, 0o644)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 15: a UUID the host gave that is not a CDI device name (quotes, braces, spaces,
    /// a newline: label or YAML injection) never becomes a device name; the device keeps its
    /// index name, with a warning. A valid UUID still names its device.
    #[test]
    fn uuids_that_are_not_cdi_device_names_are_never_written() {
        use xpu_core::inventory::{DevNode, NodeType};
        let gpu = |bus: u8, uuid: &str| {
            let mut d = PciDevice::new(format!("0000:{bus:02x}:00.0").parse().unwrap());
            (d.vendor_id, d.device_id, d.kind) =
                (Some(VENDOR_NVIDIA), Some(0x20b0), DeviceKind::Gpu);
            d.uuid = Some(uuid.to_owned());
            d.dev_nodes.push(DevNode {
                path: format!("/dev/nvidia{bus}"),
                node_type: Some(NodeType::Char),
                major: Some(195),
                minor: Some(u32::from(bus)),
                mode: Some(0o666),
                uid: Some(0),
                gid: Some(0),
            });
            d
        };
        let evil = [
            "GPU-x\",evil=\"1\"} 666",
            "GPU-a\nkind: x",
            "GPU-",
            "-GPU-1",
            "GPU-1/../2",
            "GPU-é",
            "GPU-1 2",
        ];
        let good = "GPU-5eed0001-a100-4000-8000-000000000001";
        let mut inv = Inventory::default();
        inv.devices.push(gpu(1, good));
        for (i, u) in evil.iter().enumerate() {
            inv.devices.push(gpu(2 + i as u8, u));
        }
        let opts = GenerateOptions {
            kinds: vec![CdiKind::NvidiaGpu],
            strict: true,
            host_root: PathBuf::from("/"),
        };
        let g = generate(&inv, &DriverFiles::default(), &opts).unwrap();
        let names: Vec<&str> = g.specs[0].devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["0", "1", "2", "3", "4", "5", "6", "7", good, "all"]);
        for (i, u) in evil.iter().enumerate() {
            let n = i + 1;
            assert!(
                g.warnings.iter().any(|w| w.starts_with(&format!("nvidia.com/gpu={n}: UUID "))
                    && w.contains("is not a valid CDI device name")
                    && w.ends_with(&format!("the device is named nvidia.com/gpu={n} only"))),
                "{u:?}: {:#?}",
                g.warnings
            );
            assert!(!is_device_name(u) && resolve(&inv, CdiKind::NvidiaGpu, u).is_none(), "{u:?}");
        }
        // Nothing of them in the text, escaped or not.
        let text = to_yaml(&g.specs[0]) + &to_json(&g.specs[0]);
        assert!(!text.contains("evil") && !text.contains("kind: x") && !text.contains("666"));
        let named: Vec<String> = device_names(&inv)
            .into_iter()
            .map(|d| d.name)
            .filter(|n| n.starts_with("GPU"))
            .collect();
        assert_eq!(named, [good]);
        assert_eq!(resolve(&inv, CdiKind::NvidiaGpu, good), Some(vec![0]));
    }

    #[test]
    fn qualified_names_follow_the_spec() {
        let n: QualifiedName = "nvidia.com/gpu=GPU-5eed0001-a100".parse().unwrap();
        assert_eq!((n.kind.as_str(), n.name.as_str()), ("nvidia.com/gpu", "GPU-5eed0001-a100"));
        assert!("nvidia.com/gpu=0".parse::<QualifiedName>().is_ok());
        assert!("vendor.example.com/fpga-x.1=card:0".parse::<QualifiedName>().is_ok());
        for bad in
            ["nvidia.com/gpu", "gpu=0", "nvidia.com/gpu=", "nvidia.com/gpu=-0", "a_b.com/c=0"]
        {
            let e = bad.parse::<QualifiedName>().unwrap_err();
            assert!(e.to_string().contains("is not a fully qualified CDI device name"), "{bad}");
        }
    }
}
