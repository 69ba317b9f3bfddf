//! What a placement decided: the node, CPU, memory and device shares one task holds. Both the
//! books ([`crate::cluster`], which allocates and releases it) and the policies
//! ([`crate::placement`], which choose it) use this type, so it lives below both of them.

use serde::{Deserialize, Serialize};

use crate::cluster::NodeId;

/// A share of one device of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceShare {
    /// Index into the node's `devices`.
    pub index: u16,
    pub milli: u16,
}

/// Where one task runs: a node, some of its devices (each with a share), CPU and memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Placement {
    pub node: NodeId,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub devices: Vec<DeviceShare>,
    /// Affinity tag of the task (GPU clustering's grouping); kept so release undoes it.
    #[serde(default)]
    pub tag: u8,
}

impl Placement {
    pub fn device_milli(&self) -> u64 {
        self.devices.iter().map(|d| u64::from(d.milli)).sum()
    }
}
