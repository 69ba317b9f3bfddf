//! VM-style requests placed as OpenStack Nova places them: a flavor's
//! `pci_passthrough:alias` (`nvidia-a100:1`) lands on the node Nova's `PciPassthroughFilter`,
//! `PCIWeigher` and compute-node claim would pick ([`xpu_core::nova::place`]), among the
//! cluster's `Ready` nodes.
//!
//! A thin adapter: Nova's view of a node (its PCI device pools under that node's
//! `[pci] device_spec`) is kept here, next to the [`Cluster`], because the cluster's devices do
//! not carry PCI ids or SR-IOV roles. The answer names the devices by the ids
//! [`crate::node_from_inventory`] gives them (PCI addresses), so the caller can book them in the
//! cluster. CPU, memory and the scheduler's own policies play no part, as in Nova's PCI filter.

use xpu_core::Inventory;
use xpu_core::nova::{self, Aliases, DeviceSpec, HostDevice, NovaError, NumaCell, NumaPolicy};

use crate::cluster::{Cluster, NodeId, NodeStatus};

/// A flavor's PCI side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlavorRequest {
    /// `pci_passthrough:alias`, e.g. `nvidia-a100:1`.
    pub pci_alias: String,
    /// `hw:numa_nodes`; `None` for a guest without NUMA topology.
    pub numa_nodes: Option<usize>,
    /// `hw:pci_numa_affinity_policy`.
    pub numa_policy: Option<NumaPolicy>,
}

impl FlavorRequest {
    pub fn new(pci_alias: impl Into<String>) -> Self {
        Self { pci_alias: pci_alias.into(), numa_nodes: None, numa_policy: None }
    }
}

/// Where a flavor went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NovaPlacement {
    pub node: NodeId,
    /// Device ids (PCI addresses) on that node, in claim order.
    pub devices: Vec<String>,
    /// Host NUMA cells of the guest's NUMA nodes, for NUMA guests.
    pub numa_cells: Option<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NovaPlaceError {
    #[error(transparent)]
    Request(#[from] NovaError),
    #[error("no node can take pci_passthrough:alias {flavor:?}: {}", reasons.join("; "))]
    NoNode { flavor: String, reasons: Vec<String> },
}

/// Nova's PCI view of the cluster's nodes.
#[derive(Debug, Clone, Default)]
pub struct NovaHosts {
    nodes: Vec<NodeId>,
    stats: Vec<nova::PciStats>,
}

impl NovaHosts {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `node` with the PCI functions of its inventory, as its nova-compute configured with
    /// `device_spec` would report them; `cells` are its NUMA cells with their sockets (empty:
    /// the NUMA nodes its devices report, without sockets).
    pub fn add(
        &mut self,
        node: NodeId,
        inv: &Inventory,
        device_spec: &[DeviceSpec],
        mut cells: Vec<NumaCell>,
    ) {
        if cells.is_empty() {
            let ids: std::collections::BTreeSet<u32> =
                inv.devices.iter().filter_map(|d| d.numa_node).collect();
            cells = ids.into_iter().map(|id| NumaCell { id, socket: None }).collect();
        }
        self.nodes.push(node);
        self.stats.push(nova::PciStats::new(HostDevice::from_inventory(inv), device_spec, cells));
    }

    /// Free passthrough devices Nova sees on `node`.
    pub fn free(&self, node: NodeId) -> Option<usize> {
        self.nodes.iter().position(|&n| n == node).map(|i| self.stats[i].free_devices())
    }

    /// Places the flavor on a `Ready` node of `cluster` and takes its devices from Nova's pools.
    pub fn place(
        &mut self,
        cluster: &Cluster,
        aliases: &Aliases,
        req: &FlavorRequest,
    ) -> Result<NovaPlacement, NovaPlaceError> {
        let requests = aliases.requests(&req.pci_alias, req.numa_policy)?;
        let name =
            |id: NodeId| cluster.node(id).map_or_else(|| format!("node {id}"), |n| n.name.clone());
        let ready: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| {
                cluster.node(self.nodes[i]).is_some_and(|n| n.status() == NodeStatus::Ready)
            })
            .collect();
        let mut subset: Vec<nova::PciStats> =
            ready.iter().map(|&i| std::mem::take(&mut self.stats[i])).collect();
        let result = nova::place(&mut subset, &requests, req.numa_nodes);
        for (k, &i) in ready.iter().enumerate() {
            self.stats[i] = std::mem::take(&mut subset[k]);
        }
        match result {
            Ok(choice) => Ok(NovaPlacement {
                node: self.nodes[ready[choice.host]],
                devices: choice.claimed.iter().map(|c| c.address.to_string()).collect(),
                numa_cells: choice.numa_cells,
            }),
            Err(failures) => {
                let mut reasons: Vec<String> = failures
                    .iter()
                    .map(|(k, f)| format!("{}: {f}", name(self.nodes[ready[*k]])))
                    .collect();
                if reasons.is_empty() {
                    reasons.push("no Ready node has PCI devices Nova can pass through".to_owned());
                }
                Err(NovaPlaceError::NoNode { flavor: req.pci_alias.clone(), reasons })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xpu_core::{DeviceKind, PciDevice};

    fn host(name: &str, gpus: usize) -> Inventory {
        let mut inv = Inventory::default();
        inv.host.hostname = Some(name.to_owned());
        for i in 0..gpus {
            let mut d = PciDevice::new(format!("0000:{:02x}:00.0", 0x20 + i).parse().unwrap());
            d.vendor_id = Some(0x10de);
            d.device_id = Some(0x20b0);
            d.class = Some(0x0302);
            d.kind = DeviceKind::Gpu;
            d.product = Some("A100-SXM4-40GB".to_owned());
            d.numa_node = Some(u32::from(i >= gpus / 2));
            d.driver = Some("vfio-pci".to_owned());
            inv.devices.push(d);
        }
        inv
    }

    #[test]
    fn flavor_places_as_nova_would() {
        let invs = [host("big", 8), host("small", 2)];
        let mut cluster = Cluster::from_specs(
            invs.iter().map(|i| crate::node_from_inventory(i, None, 64_000, 512_000)),
        )
        .unwrap();
        let specs =
            DeviceSpec::parse_all(r#"{"vendor_id": "10de", "product_id": "20b0"}"#).unwrap();
        let aliases = Aliases::parse([
            r#"{"name": "nvidia-a100", "vendor_id": "10de", "product_id": "20b0", "device_type": "type-PCI"}"#,
        ])
        .unwrap();
        let mut nova = NovaHosts::new();
        for inv in &invs {
            let id = cluster.node_id(inv.host.hostname.as_deref().unwrap()).unwrap();
            nova.add(id, inv, &specs, Vec::new());
        }
        let big = cluster.node_id("big").unwrap();
        let small = cluster.node_id("small").unwrap();

        // One GPU stacks onto the host with the fewest free devices (PCIWeigher).
        let p = nova.place(&cluster, &aliases, &FlavorRequest::new("nvidia-a100:1")).unwrap();
        assert_eq!(p.node, small);
        // The ids are the cluster's device ids.
        let node = cluster.node(small).unwrap();
        assert!(node.devices.iter().any(|d| d.id == p.devices[0]));
        // Two no longer fit there.
        let p = nova.place(&cluster, &aliases, &FlavorRequest::new("nvidia-a100 : 2")).unwrap();
        assert_eq!((p.node, p.devices.len()), (big, 2));
        // A NUMA guest with the required policy gets one node's devices.
        let req = FlavorRequest {
            pci_alias: "nvidia-a100:3".to_owned(),
            numa_nodes: Some(1),
            numa_policy: Some(NumaPolicy::Required),
        };
        let p = nova.place(&cluster, &aliases, &req).unwrap();
        assert_eq!(p.node, big);
        assert_eq!(nova.free(big), Some(3));

        // Cordoned nodes are not candidates; the error names every node's reason.
        cluster.set_status(big, NodeStatus::Cordoned).unwrap();
        let e = nova.place(&cluster, &aliases, &FlavorRequest::new("nvidia-a100:2")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("small: alias nvidia-a100 needs 2 device(s)"), "{msg}");
        assert!(!msg.contains("big:"), "{msg}");
        let e = nova.place(&cluster, &aliases, &FlavorRequest::new("t4:1")).unwrap_err();
        assert!(matches!(e, NovaPlaceError::Request(_)), "{e}");
    }
}
