//! Turns one host's [`Inventory`] (what `xpu discover` found) into a scheduler [`NodeSpec`], so
//! the daemon can schedule onto the devices of the machine it runs on. GPUs, TPUs and NPUs
//! become devices (model = the product from the generation table, else the PCI device name,
//! else `vendor:device`), with their NUMA node and interconnect domain; NVSwitches and other
//! functions are not schedulable. CPU and memory come from the caller, who knows what it may
//! hand out. Labels are the host's NFD and `xpu.dev` labels.

use xpu_core::{DeviceKind, Inventory, SriovType};

use crate::cluster::{DeviceSpec, NodeSpec};

/// A node for one host. `name` defaults to the host name, then `localhost`. SR-IOV physical
/// functions that have VFs enabled are skipped (the VFs are the schedulable units).
pub fn node_from_inventory(
    inv: &Inventory,
    name: Option<&str>,
    cpu_milli: u64,
    memory_mib: u64,
) -> NodeSpec {
    let name = name
        .map(str::to_owned)
        .or_else(|| inv.host.hostname.clone())
        .unwrap_or_else(|| "localhost".into());
    let mut node = NodeSpec::new(name, cpu_milli, memory_mib);
    node.labels = xpu_core::labels::labels(inv);
    for d in &inv.devices {
        if !matches!(d.kind, DeviceKind::Gpu | DeviceKind::Tpu | DeviceKind::Npu) {
            continue;
        }
        if d.sriov.kind == SriovType::Pf && d.sriov.num_vfs.is_some_and(|n| n > 0) {
            continue;
        }
        let model = d.product.clone().or_else(|| d.device_name.clone()).unwrap_or_else(|| d.ids());
        node.devices.push(DeviceSpec {
            id: d.address.to_string(),
            kind: d.kind,
            model,
            numa_node: d.numa_node,
            interconnect_domain: d.interconnect_domain.clone(),
        });
    }
    node
}
