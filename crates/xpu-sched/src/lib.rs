//! xpu's scheduler: where accelerator work runs, and when.
//!
//! Deterministic and single-threaded, with no clock and no I/O in the core: callers pass time
//! in (seconds) and get decisions back. The daemon (`xpu serve`) and the simulator (`xpu sim`)
//! drive the same code.
//!
//! - [`cluster`]: nodes (labels, pool, CPU milli, memory MiB) and their devices (kind, model,
//!   NUMA node, interconnect domain, free capacity in milli-units — 1000 is a whole device, so
//!   GPU sharing is first-class). Nodes in identical states share a *state class* and are
//!   scored once per decision.
//! - [`request`]: jobs → task groups → tasks asking CPU, memory and devices (whole count or a
//!   milli fraction), allowed models, a `nodeSelector`, a TPU accelerator + topology; gangs,
//!   priority, queue, maximum run duration.
//! - [`placement`]: the [`placement::Policy`] trait, the [`placement::Placer`] that filters,
//!   scores and picks a node (NVLink/NUMA-aware inside it) and explains misfits
//!   kube-scheduler-style (`0/1213 nodes are available: 800 Insufficient gpu, ...`).
//! - [`policy`]: Random, BestFit, DotProduct, GpuPacking, GpuClustering, FGD and xpu's default.
//! - [`scheduler`]: the queue (FIFO, priority with aging, SJF, EASY backfill, DRF fair share),
//!   gangs, preemption and flex-start pools ([`pool`]); for a daemon, adopting running work
//!   after a restart, re-queueing one task, draining a job, and explaining why one waits.
//! - [`inventory`]: one host's discovered devices as a scheduler node.
//! - [`manifest`]: a parsed job manifest (Kubernetes Job or xpu's short form) as a scheduler
//!   job, the way `xpu serve` queues it.
//! - [`sim`] and [`trace`]: the OpenB placement benchmark and trace replay; `trace` is the only
//!   module that reads files.
//!
//! # Driving the scheduler
//!
//! ```
//! use xpu_core::DeviceKind;
//! use xpu_sched::cluster::{Cluster, NodeSpec};
//! use xpu_sched::request::{Job, TaskGroup, TaskSpec};
//! use xpu_sched::scheduler::{Decision, Scheduler, SchedulerConfig};
//!
//! // Two 8-GPU nodes.
//! let cluster = Cluster::from_specs((0..2).map(|i| {
//!     NodeSpec::new(format!("node-{i}"), 96_000, 1_048_576).devices(8, DeviceKind::Gpu, "H100")
//! }))?;
//! let mut sched = Scheduler::new(cluster, SchedulerConfig::default())?;
//!
//! // A gang of two tasks with 8 GPUs each, and a task wanting a quarter of one GPU.
//! let train = sched.submit(
//!     Job::single("train", TaskGroup::new(2, TaskSpec::gpus(8_000, 65_536, 8)).gang()),
//!     0,
//! )?;
//! let notebook = sched.submit(Job::single("nb", TaskGroup::new(1, TaskSpec::gpu_share(1_000, 4_096, 250))), 0)?;
//!
//! // The caller's clock says it is t=10: start what fits.
//! let decisions = sched.schedule(10);
//! assert!(matches!(&decisions[0], Decision::Start { job, tasks } if *job == train && tasks.len() == 2));
//! // The notebook waits (FIFO; every GPU is taken) until the training job finishes.
//! assert_eq!(decisions.len(), 1);
//! sched.finish(train, 3_600)?;
//! let decisions = sched.schedule(3_600);
//! let Decision::Start { job, tasks } = &decisions[0] else { unreachable!() };
//! assert_eq!((*job, tasks[0].placement.devices[0].milli), (notebook, 250));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Time only moves when the caller says so: call [`scheduler::Scheduler::schedule`] after
//! submissions and completions, and again at [`scheduler::Scheduler::next_wakeup`] (flex-start
//! nodes coming up or due for release, jobs reaching their maximum run time).

pub mod assignment;
pub mod cluster;
pub mod constraints;
pub mod dra;
pub mod hash;
pub mod inventory;
pub mod manifest;
pub mod nova;
pub mod placement;
pub mod pods;
pub mod policy;
pub mod pool;
pub mod request;
pub mod rng;
pub mod scheduler;
pub mod sim;
pub mod trace;

pub use cluster::{Cluster, DeviceSpec, NodeId, NodeSpec, NodeStatus};
pub use inventory::node_from_inventory;
pub use manifest::job_from_spec;
pub use placement::{Demand, FitReport, Placement, Placer, Policy, Unschedulable};
pub use policy::PolicyKind;
pub use request::{DeviceAsk, Job, TaskGroup, TaskSpec, Time, TpuAsk};
pub use scheduler::{Decision, JobId, JobStatus, QueuePolicy, Scheduler, SchedulerConfig, TaskRef};
