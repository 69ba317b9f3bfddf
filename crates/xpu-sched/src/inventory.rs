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

#[cfg(test)]
mod tests {
    use super::*;
    use xpu_core::{PciAddress, PciDevice};

    fn dev(
        addr: &str,
        kind: DeviceKind,
        product: Option<&str>,
        numa: u32,
        domain: Option<&str>,
    ) -> PciDevice {
        let mut d = PciDevice::new(addr.parse::<PciAddress>().unwrap());
        d.kind = kind;
        d.product = product.map(str::to_owned);
        d.numa_node = Some(numa);
        d.interconnect_domain = domain.map(str::to_owned);
        d.vendor_id = Some(0x10de);
        d.device_id = Some(0x20b0);
        d
    }

    #[test]
    fn accelerators_become_devices_with_numa_and_domain() {
        let mut inv = Inventory::default();
        inv.host.hostname = Some("gpu-host".into());
        inv.devices = vec![
            dev("0000:07:00.0", DeviceKind::Gpu, Some("A100-SXM4-40GB"), 0, Some("nvswitch-0")),
            dev("0000:0f:00.0", DeviceKind::Gpu, Some("A100-SXM4-40GB"), 1, Some("nvswitch-0")),
            dev("0000:ff:00.0", DeviceKind::Nvswitch, Some("A100-NVSwitch"), 0, None),
            dev("0000:20:00.0", DeviceKind::Other, None, 0, None),
            dev("0000:30:00.0", DeviceKind::Gpu, None, 0, None),
        ];
        let n = node_from_inventory(&inv, None, 64_000, 512_000);
        assert_eq!(n.name, "gpu-host");
        assert_eq!((n.cpu_milli, n.memory_mib), (64_000, 512_000));
        let ids: Vec<&str> = n.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(
            ids,
            ["0000:07:00.0", "0000:0f:00.0", "0000:30:00.0"],
            "NVSwitch and other functions are not schedulable"
        );
        assert_eq!(n.devices[1].numa_node, Some(1));
        assert_eq!(n.devices[0].interconnect_domain.as_deref(), Some("nvswitch-0"));
        assert_eq!(n.devices[2].model, "10de:20b0", "no product or name: the PCI ids");
        assert_eq!(node_from_inventory(&inv, Some("other"), 1, 1).name, "other");
        // It goes straight into a cluster.
        let c = crate::cluster::Cluster::from_specs([n]).unwrap();
        assert_eq!(c.capacity().device(DeviceKind::Gpu), 3000);
    }
}
