//! What the API and the dashboard show of the scheduling loop's state: the engine replaces it
//! after every pass ([`crate::engine`]), the handlers read it ([`crate::api`]). The parts the
//! API sends are also its wire types ([`crate::wire`]): the client reads them back and the
//! OpenAPI document describes them.

use std::collections::VecDeque;

/// Queued jobs the view lists; a queue of 30,000 would make every dashboard refresh megabytes.
pub const QUEUE_VIEW: usize = 1000;

/// What the API shows of the loop's state, replaced after every pass.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct View {
    /// Per device: the tasks holding it (several when they share it).
    pub holders: Vec<Vec<Holder>>,
    /// Queued jobs in queue order, the first [`QUEUE_VIEW`] of them.
    pub queued: Vec<QueuedView>,
    /// Queued jobs in all.
    pub queued_total: usize,
    pub running: Vec<RunningView>,
    /// (time ms, devices allocated), one sample per change and at most one per second.
    pub history: VecDeque<(i64, u32)>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Holder {
    pub job: i64,
    pub name: String,
    pub task: u32,
    /// Thousandths of the device held: 1000 for a whole device.
    pub milli: u16,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct QueuedView {
    pub id: i64,
    pub name: String,
    pub queue: String,
    pub priority: i64,
    pub submitted_at_ms: i64,
    pub position: usize,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct RunningView {
    pub id: i64,
    pub name: String,
    pub queue: String,
    pub started_at_ms: i64,
    pub tasks: Vec<TaskView>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct TaskView {
    pub index: u32,
    pub attempt: u32,
    pub pid: Option<i32>,
    pub devices: Vec<u32>,
}
