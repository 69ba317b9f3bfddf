//! MIG's `mixed` strategy, as NVIDIA's device plugin names it, for clusters that stay on device
//! plugins: every MIG instance on a GPU in MIG mode is one device of the resource
//! `nvidia.com/mig-<profile>` (`nvidia.com/mig-1g.18gb`), and a GPU in MIG mode is no longer a
//! whole `nvidia.com/gpu`.
//!
//! The instances are what the MIG control reports (made by the admin or a MIG manager; the
//! device plugin makes none: that is the DRA driver's on-demand MIG). A container given one
//! gets its GPU's node, the control nodes, and the instance's two capability nodes
//! (`/dev/nvidia-caps/nvidia-cap<N>` for the GPU instance's and the compute instance's
//! `access`, from `/proc/driver/nvidia-caps/mig-minors`), which is what CUDA enumerates; its
//! MIG UUID as `NVIDIA_VISIBLE_DEVICES` where the control names it. The capability nodes go
//! through CDI (`xpu.dev/mig=<gpu>-gi<N>` in `<cdi-dir>/xpu.dev-mig.json`, with their numbers),
//! not as `DeviceSpec`s: the driver makes a host's `/dev/nvidia-caps` nodes only when something
//! asks (`nvidia-modprobe`), and a runtime refuses a `DeviceSpec` whose host node is missing. An instance destroyed under
//! the plugin is reported `Unhealthy`; one made later is added; a profile seen for the first
//! time gets its own resource while the plugin runs.

use std::collections::{BTreeMap, BTreeSet};

use std::path::Path;

use xpu_container::cdi::{self, ContainerEdits, Device, DeviceNode, Spec};
use xpu_core::mig::Model;
use xpu_core::{Inventory, PciAddress};
use xpu_host::Root;
use xpu_host::mig_caps::MigCaps;
use xpu_telemetry::mig::MigControl;

use super::Dev;

/// The CDI kind of the instances' capability nodes.
pub const CDI_KIND: &str = "xpu.dev/mig";
/// The spec file under the CDI directory.
const CDI_FILE: &str = "xpu.dev-mig.json";

/// What every MIG resource's name starts with.
pub const RESOURCE_PREFIX: &str = "nvidia.com/mig-";

/// The resource a profile's instances are offered as: `nvidia.com/mig-1g.18gb`.
pub fn resource_name(profile: &str) -> String {
    format!("{RESOURCE_PREFIX}{profile}")
}

/// The MIG instance a device stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Instance {
    pub gi: u32,
    pub ci: u32,
    pub profile: &'static str,
    /// The CDI device with its capability nodes (`xpu.dev/mig=0000:25:00.0-gi7`).
    pub cdi: String,
}

/// One reading of the MIG control.
#[derive(Debug, Default)]
pub(super) struct State {
    /// GPUs in MIG mode: none of them is offered whole.
    pub enabled: BTreeSet<PciAddress>,
    /// The instances to offer, by profile.
    pub by_profile: BTreeMap<&'static str, Vec<Dev>>,
    /// The CDI spec of their capability nodes as written (`None`: no instance, no spec).
    pub spec: Option<String>,
}

/// Reads the control and builds the devices of each profile from `inv`'s GPUs, and writes the
/// CDI spec of their capability nodes into `cdi_dir` when it differs from `last` (the last
/// reading's, [`State::spec`]). Instances whose capability nodes are not found are left out,
/// with a warning (nothing would reach them).
pub(super) fn read(
    control: &dyn MigControl,
    root: &Root,
    inv: &Inventory,
    cdi_dir: &Path,
    last: Option<&str>,
) -> Result<State, String> {
    let gpus = control.gpus().map_err(|e| e.to_string())?;
    let mut state = State::default();
    let mut caps: Option<Result<MigCaps, String>> = None;
    let cdi = crate::cdi::names(inv);
    let mut spec = Spec {
        cdi_version: cdi::CDI_VERSION.to_owned(),
        kind: CDI_KIND.to_owned(),
        devices: Vec::new(),
        container_edits: ContainerEdits::default(),
    };
    for g in gpus.iter().filter(|g| g.enabled) {
        state.enabled.insert(g.address);
        let Some(parent) = inv.device(&g.address) else { continue };
        let Some(minor) = parent.nvidia_minor() else {
            tracing::warn!(gpu = %g.address, "a GPU in MIG mode without a /dev/nvidiaN node: its instances are not offered");
            continue;
        };
        let model = Model::of(&g.product).ok();
        for i in &g.instances {
            let Some(profile) = model.and_then(|m| m.profile(i.profile).ok()) else {
                tracing::warn!(gpu = %g.address, gi = i.gi, profile = i.profile, "a MIG instance of a profile xpu's tables lack is not offered");
                continue;
            };
            let caps = caps.get_or_insert_with(|| MigCaps::read(root).map_err(|e| e.to_string()));
            let nodes = match caps.as_ref().map(|c| c.instance(minor, i.gi, i.ci)) {
                Ok(Ok(n)) => n,
                Ok(Err(e)) => {
                    tracing::warn!(gpu = %g.address, gi = i.gi, error = %e, "MIG instance not offered");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(gpu = %g.address, error = %e, "MIG instances not offered");
                    break;
                }
            };
            let name = format!("{}-gi{}", g.address, i.gi);
            spec.devices.push(Device {
                name: name.clone(),
                container_edits: ContainerEdits {
                    device_nodes: nodes
                        .into_iter()
                        .map(|n| DeviceNode {
                            path: n.path,
                            node_type: "c".to_owned(),
                            major: n.major.into(),
                            minor: n.minor.into(),
                            file_mode: Some(0o444),
                        })
                        .collect(),
                    ..ContainerEdits::default()
                },
            });
            let mut d = Dev::from_inventory(parent, cdi.get(&g.address).cloned());
            d.id = format!("{}-mig-gi{}", g.address, i.gi);
            d.uuid = i.uuid.clone();
            d.memory_mib =
                Some(profile.memory_mib.map_or(u64::from(profile.memory_gb) * 1024, u64::from));
            d.mig = Some(Instance {
                gi: i.gi,
                ci: i.ci,
                profile: profile.name,
                cdi: format!("{CDI_KIND}={name}"),
            });
            state.by_profile.entry(profile.name).or_default().push(d);
        }
    }
    for devs in state.by_profile.values_mut() {
        devs.sort_by(|a, b| a.id.cmp(&b.id));
    }
    let path = cdi_dir.join(CDI_FILE);
    if spec.devices.is_empty() {
        // A spec must name a device; no instance, no spec.
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(format!("removing the MIG CDI spec {}: {e}", path.display()))
            }
            _ => Ok(state),
        };
    }
    let json = cdi::to_json(&spec);
    if last != Some(json.as_str()) {
        std::fs::create_dir_all(cdi_dir)
            .and_then(|()| {
                xpu_container::fsutil::write_replace(&path, json.as_bytes(), 0o644, false)
            })
            .map_err(|e| format!("writing the MIG CDI spec {}: {e}", path.display()))?;
    }
    state.spec = Some(json);
    Ok(state)
}

/// `inv` without the GPUs in MIG mode: what whole-GPU resources offer.
/// `inv` itself when no GPU is in MIG mode (every tick of a plugin without MIG).
pub(super) fn without_mig<'a>(
    inv: &'a Inventory,
    enabled: &BTreeSet<PciAddress>,
) -> std::borrow::Cow<'a, Inventory> {
    if enabled.is_empty() {
        return std::borrow::Cow::Borrowed(inv);
    }
    let mut inv = inv.clone();
    inv.devices.retain(|d| !enabled.contains(&d.address));
    std::borrow::Cow::Owned(inv)
}
