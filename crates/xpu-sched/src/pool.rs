//! Flex-start pools: a pool of identical nodes that scales from zero to `max_nodes` on demand,
//! the way GKE's flex-start node pools do (`--flex-start --enable-autoscaling --num-nodes=0
//! --min-nodes=0 --max-nodes=N`). Capacity is asked for when a job needs it, arrives after a
//! provisioning delay, all nodes of a gang at once or none; it is given back after it has been
//! idle for a while; and a job running on it is stopped at its maximum run duration (seven days
//! by default, as the flex-start guide states).
//!
//! This module holds the pool's description and its accounting; the scheduler drives it.

use serde::{Deserialize, Serialize};

use crate::cluster::{NodeId, NodeSpec};
use crate::request::{FLEX_MAX_RUN, GKE_FLEX_START, Time};

/// A flex-start pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlexPool {
    pub name: String,
    /// The node every slot of the pool becomes; its name is used as a prefix (`{name}-{i}`).
    pub node: NodeSpec,
    pub max_nodes: u32,
    /// Seconds from asking for capacity to the nodes being ready.
    pub provisioning_delay: Time,
    /// Seconds a node may sit idle before it is given back.
    pub idle_release: Time,
    /// Longest a job may run on this capacity.
    #[serde(default = "default_max_run")]
    pub max_run_duration: Time,
}

fn default_max_run() -> Time {
    FLEX_MAX_RUN
}

impl FlexPool {
    pub fn new(name: impl Into<String>, node: NodeSpec, max_nodes: u32) -> Self {
        Self {
            name: name.into(),
            node,
            max_nodes,
            provisioning_delay: 300,
            idle_release: 600,
            max_run_duration: FLEX_MAX_RUN,
        }
    }

    /// The node spec of slot `i`: the template with its name, the pool set, and GKE's
    /// `cloud.google.com/gke-flex-start: "true"` label.
    pub fn slot(&self, i: u32) -> NodeSpec {
        let mut n = self.node.clone();
        n.name = format!("{}-{i}", self.node.name);
        n.pool = Some(self.name.clone());
        n.labels.insert(GKE_FLEX_START.into(), "true".into());
        n
    }
}

/// What a pool cost and how long jobs waited for it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PoolReport {
    pub pool: String,
    /// Node-hours from ready to release.
    pub node_hours_up: f64,
    /// Node-hours with at least one task running.
    pub node_hours_used: f64,
    /// Node-hours up but running nothing (up - used).
    pub node_hours_idle: f64,
    /// Times capacity was asked for.
    pub provisionings: u32,
    /// Mean seconds from asking for capacity to it being ready.
    pub mean_provisioning_wait: f64,
    pub max_provisioning_wait: Time,
    /// Jobs stopped at the maximum run duration.
    pub stopped_at_max_run: u32,
}

/// Per-node accounting of a pool slot.
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotState {
    pub node: NodeId,
    /// When it is (or will be) ready, while provisioning.
    pub ready_at: Option<Time>,
    pub up_since: Option<Time>,
    pub busy_since: Option<Time>,
    pub idle_since: Option<Time>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct PoolState {
    pub slots: Vec<SlotState>,
    pub up_seconds: u64,
    pub busy_seconds: u64,
    pub waits: Vec<Time>,
    pub stopped: u32,
}
