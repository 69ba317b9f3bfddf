//! AMD Instinct compute and memory partitions, as amdgpu reports them.
//!
//! - On the GPU's PCI function: `current_compute_partition` (`SPX`, `DPX`, `TPX`, `QPX`,
//!   `CPX`), `available_compute_partition` (`SPX, DPX, QPX, CPX`), `current_memory_partition`
//!   (`NPS1`, `NPS4`...) and `available_memory_partition`. A GPU without them (older Instinct,
//!   Radeon) has no partitioning.
//! - The logical GPUs a mode makes are KFD topology nodes
//!   (`/sys/class/kfd/kfd/topology/nodes/<n>/properties`): each partition is one node whose
//!   `domain` and `location_id` (bus << 8 | device << 3 | function) are its GPU's, with its own
//!   `drm_render_minor` (the function's own render node for the first, an `amdgpu_xcp`
//!   platform device's for the others), its `num_xcc` dies, and its memory in the node's first
//!   memory bank (`mem_banks/0/properties`, `size_in_bytes`).
//!
//! Every file is read through the bounded reader; a value that does not parse is a warning and
//! leaves the field out, never a guess.

use std::collections::BTreeMap;

use xpu_core::accel::VENDOR_AMD;
use xpu_core::{DeviceKind, Partition, Partitioning, PciDevice};

use super::{Attr, Warnings, read_attr};
use crate::{Root, devnode};

/// Where KFD lists its topology nodes.
const KFD_NODES: &str = "/sys/class/kfd/kfd/topology/nodes";
/// KFD nodes read at most (a host has a few hundred at the very most: CPUs and partitions).
const MAX_KFD_NODES: usize = 1024;

/// One GPU node of KFD's topology.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KfdNode {
    render_minor: u32,
    xcc: Option<u32>,
    memory_bytes: Option<u64>,
}

/// `key value` lines.
fn properties(text: &str) -> BTreeMap<&str, &str> {
    text.lines().filter_map(|l| l.trim().split_once(' ')).map(|(k, v)| (k, v.trim())).collect()
}

/// The GPU nodes of KFD's topology by (PCI domain, location id).
fn kfd_nodes(root: &Root, w: &mut Warnings) -> BTreeMap<(u32, u32), Vec<KfdNode>> {
    let mut by_gpu: BTreeMap<(u32, u32), Vec<KfdNode>> = BTreeMap::new();
    let dir = root.path(KFD_NODES);
    let Ok(entries) = std::fs::read_dir(&dir) else { return by_gpu };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .collect();
    if names.len() > MAX_KFD_NODES {
        w.push(format!(
            "{}: more than {MAX_KFD_NODES} nodes; partitions not listed",
            root.display(&dir)
        ));
        return by_gpu;
    }
    names.sort_by_key(|n| n.parse::<u64>().unwrap_or(u64::MAX));
    for n in names {
        let path = dir.join(&n).join("properties");
        let text = match read_attr(root, &path) {
            Attr::Value(t) => t,
            Attr::Missing => continue,
            Attr::Unreadable(e) => {
                w.push(format!("{}: {e}; node left out", root.display(&path)));
                continue;
            }
        };
        let p = properties(&text);
        let num = |k: &str| p.get(k).and_then(|v| v.parse::<u64>().ok());
        // CPU nodes have no SIMDs and no render node.
        if num("simd_count").unwrap_or(0) == 0 {
            continue;
        }
        let (Some(domain), Some(location), Some(minor)) =
            (num("domain"), num("location_id"), num("drm_render_minor"))
        else {
            w.push(format!(
                "{}: domain, location_id or drm_render_minor missing or not a number; node left out",
                root.display(&path)
            ));
            continue;
        };
        let (Ok(domain), Ok(location), Ok(render_minor)) =
            (u32::try_from(domain), u32::try_from(location), u32::try_from(minor))
        else {
            w.push(format!("{}: a value out of range; node left out", root.display(&path)));
            continue;
        };
        let bank = dir.join(&n).join("mem_banks/0/properties");
        let memory_bytes = match read_attr(root, &bank) {
            Attr::Value(t) => properties(&t).get("size_in_bytes").and_then(|v| v.parse().ok()),
            _ => None,
        };
        let xcc = num("num_xcc").and_then(|x| u32::try_from(x).ok());
        by_gpu.entry((domain, location)).or_default().push(KfdNode {
            render_minor,
            xcc,
            memory_bytes,
        });
    }
    by_gpu
}

/// Adds the partitioning of each AMD GPU on amdgpu that reports one.
pub(super) fn read(root: &Root, devices: &mut [PciDevice], w: &mut Warnings) {
    let on_amdgpu = |d: &PciDevice| {
        d.vendor_id == Some(VENDOR_AMD)
            && d.kind == DeviceKind::Gpu
            && d.driver.as_deref() == Some("amdgpu")
    };
    // KFD's topology is read once, and only when a GPU reports a partition mode.
    let mut kfd: Option<BTreeMap<(u32, u32), Vec<KfdNode>>> = None;
    for d in devices.iter_mut().filter(|d| on_amdgpu(d)) {
        let dir = root.path(format!("/sys/bus/pci/devices/{}", d.address));
        let mut text = |name: &str| match read_attr(root, &dir.join(name)) {
            Attr::Value(v) if !v.is_empty() => Some(v),
            Attr::Unreadable(e) => {
                w.push(format!("{}: {e}; not used", root.display(&dir.join(name))));
                None
            }
            _ => None,
        };
        let Some(compute) = text("current_compute_partition") else { continue };
        let list = |v: Option<String>| -> Vec<String> {
            v.map(|v| v.split(',').map(|m| m.trim().to_owned()).filter(|m| !m.is_empty()).collect())
                .unwrap_or_default()
        };
        let mode_ok =
            |m: &str| !m.is_empty() && m.len() <= 8 && m.bytes().all(|b| b.is_ascii_alphanumeric());
        let memory = text("current_memory_partition");
        let available_compute = list(text("available_compute_partition"));
        let available_memory = list(text("available_memory_partition"));
        if !mode_ok(&compute) || !memory.as_deref().is_none_or(mode_ok) {
            w.push(format!(
                "{}: a partition mode that is not a mode name ({compute:?}, {memory:?}); partitions not listed",
                root.display(&dir)
            ));
            continue;
        }
        let kfd = kfd.get_or_insert_with(|| kfd_nodes(root, w));
        let a = d.address;
        let location = u32::from(a.bus) << 8 | u32::from(a.device) << 3 | u32::from(a.function);
        let mut nodes = kfd.get(&(a.domain, location)).cloned().unwrap_or_default();
        nodes.sort_by_key(|n| n.render_minor);
        let mut partitions = Vec::new();
        for (i, n) in nodes.into_iter().enumerate() {
            let path = format!("/dev/dri/renderD{}", n.render_minor);
            let Some(render_node) = devnode::stat(root, &path) else {
                w.push(format!("{}: partition {i}'s {path} does not exist; left out", d.address));
                continue;
            };
            partitions.push(Partition {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                render_node,
                xcc: n.xcc,
                memory_bytes: n.memory_bytes,
            });
        }
        d.partitioning = Some(Partitioning {
            compute,
            memory,
            available_compute: available_compute.into_iter().filter(|m| mode_ok(m)).collect(),
            available_memory: available_memory.into_iter().filter(|m| mode_ok(m)).collect(),
            partitions,
        });
    }
}

#[cfg(test)]
mod tests {
    use crate::{DiscoverOptions, Root, Scope};

    fn discover(fx: &xpu_testkit::Fixture) -> xpu_core::Inventory {
        let root = Root::new(fx.root()).unwrap();
        let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
        crate::discover(&root, &opts).unwrap()
    }

    #[test]
    fn a_cpx_gpu_lists_its_partitions_and_their_render_nodes() {
        let fx = xpu_testkit::hosts::mi300x_cpx().build();
        let inv = discover(&fx);
        let gpus: Vec<_> = inv.accelerators().collect();
        assert_eq!(gpus.len(), 8);
        for (g, d) in gpus.iter().enumerate() {
            let p = d.partitioning.as_ref().unwrap_or_else(|| panic!("{}: {inv:?}", d.address));
            assert_eq!((p.compute.as_str(), p.memory.as_deref()), ("CPX", Some("NPS1")));
            assert_eq!(p.available_compute, ["SPX", "DPX", "QPX", "CPX"]);
            assert_eq!(p.available_memory, ["NPS1", "NPS4"]);
            let nodes: Vec<&str> =
                p.partitions.iter().map(|x| x.render_node.path.as_str()).collect();
            let want: Vec<String> =
                (0..8).map(|i| format!("/dev/dri/renderD{}", 128 + 8 * g + i)).collect();
            assert_eq!(nodes, want, "{}", d.address);
            assert!(
                p.partitions.iter().all(|x| x.xcc == Some(1) && x.memory_bytes == Some(24 << 30))
            );
        }
        assert!(inv.warnings.is_empty(), "{:?}", inv.warnings);
        // An MI300X without the files (an older driver) has no partitioning.
        let plain = discover(&xpu_testkit::hosts::mi300x().build());
        assert!(plain.accelerators().all(|d| d.partitioning.is_none()));
    }

    #[test]
    fn a_mode_that_is_not_a_mode_name_is_a_warning_not_a_value() {
        let fx = xpu_testkit::hosts::mi300x_cpx().build();
        let first = discover(&fx).accelerators().next().unwrap().address;
        let gpu = fx.root().join(format!("sys/bus/pci/devices/{first}"));
        std::fs::write(gpu.join("current_compute_partition"), "CPX\",x=\"1\n").unwrap();
        let inv = discover(&fx);
        let bad = inv.accelerators().filter(|d| d.partitioning.is_none()).count();
        assert_eq!(bad, 1);
        assert!(inv.warnings.iter().any(|w| w.contains("not a mode name")), "{:?}", inv.warnings);
    }
}
