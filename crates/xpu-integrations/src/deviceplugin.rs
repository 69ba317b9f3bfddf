//! The kubelet device plugin (API v1beta1, `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`):
//! one gRPC server per resource on a Unix socket in the kubelet's plugin directory.
//!
//! Life cycle, as the device plugin design (KEP 3573 and its predecessors) asks:
//! - serve first, then call the kubelet's `Registration.Register` on `kubelet.sock` with the
//!   socket's file name as `endpoint`;
//! - `ListAndWatch` sends the device list (id = PCI address, health, NUMA node as
//!   `TopologyInfo`) and sends it again whenever health changes: the host is re-discovered
//!   under the `Root` every interval, and a device that disappeared or whose driver changed is
//!   `Unhealthy` (healthy again if it comes back as it was);
//! - `GetPreferredAllocation` keeps multi-device requests inside one interconnect domain and NUMA
//!   node ([`crate::preferred`]);
//! - `Allocate` answers with CDI device names (`cdi_devices`, [`crate::cdi`]) and, for kubelets
//!   or runtimes without CDI, the `/dev` nodes (`devices`) and environment (`envs`);
//! - when `kubelet.sock` is deleted and created again (the kubelet restarted), register again;
//!   when the plugin's own socket is deleted (a restarting kubelet removes every socket in the
//!   directory), serve on a new one and register again.
//!
//! Every socket is served through [`transport::bind`] (the `h2authority` proxy) by a tonic
//! server built by [`limits::server`], so what a client may make the plugin hold is bounded
//! twice over: concurrent streams, header lists, message sizes, connections.
//!
//! What it does not do: device-specific preparation in `PreStartContainer` (not requested), or
//! reading sysfs other than through `xpu_host::discover`.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use xpu_core::accel::{VENDOR_AMD, VENDOR_NVIDIA};
use xpu_core::{DevNode, Inventory, PciAddress};
use xpu_host::{DiscoverOptions, Root, Scope};

use crate::preferred::{self, Candidate};

pub mod mig;
use crate::selector::Resource;
use crate::transport;
use crate::{limits, pb};

/// `pluginapi.Version`.
pub const API_VERSION: &str = "v1beta1";
/// `pluginapi.DevicePluginPath`.
pub const DEFAULT_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// `pluginapi.KubeletSocket` (its file name).
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// `pluginapi.Healthy` / `pluginapi.Unhealthy`.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// How long a `Register` call may take before it is retried on the next tick.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

/// What to serve, and where.
#[derive(Debug, Clone)]
pub struct Config {
    /// The host to discover (`/` in production).
    pub root: Root,
    /// The kubelet's plugin directory, holding `kubelet.sock` and the plugins' sockets.
    pub plugin_dir: PathBuf,
    pub resources: Vec<Resource>,
    /// How often to re-discover the host and check the sockets.
    pub interval: Duration,
    /// Device health from telemetry (XIDs, uncorrectable ECC errors, lost GPUs): a device it
    /// reports unhealthy is sent `Unhealthy` at the next refresh. `None`: presence and driver
    /// only.
    pub health: Option<xpu_telemetry::collect::Collector>,
    /// How long after registering the kubelet has to open `ListAndWatch` before the plugin
    /// reports it and registers again ([`LIST_AND_WATCH_WAIT`] by default).
    pub watch_timeout: Duration,
    /// Finds the pod an `Allocate` of [`SHARE_RESOURCE`] is for and the GPUs the scheduler
    /// chose for it; required when `resources` holds that resource.
    pub share: Option<Arc<dyn ShareResolver>>,
    /// Serve shares of less than a GPU through MPS ([`crate::mps`]).
    pub mps: Option<Arc<crate::mps::Mps>>,
    /// Time-slicing: every device offered this many times (1: each once).
    pub replicas: u16,
    /// How `Allocate` names devices to the runtime.
    pub device_list: DeviceList,
    /// MIG's `mixed` strategy ([`mig`]): each MIG instance on a GPU in MIG mode offered as one
    /// `nvidia.com/mig-<profile>` device, and such GPUs left out of whole-GPU resources.
    pub mig: Option<MigOptions>,
}

/// Where MIG state comes from, and where the instances' CDI spec goes.
#[derive(Debug, Clone)]
pub struct MigOptions {
    pub control: Arc<dyn xpu_telemetry::mig::MigControl>,
    /// The container runtime's CDI directory.
    pub cdi_dir: PathBuf,
}

/// The most replicas of one device time-slicing offers.
pub const MAX_REPLICAS: u16 = 64;
/// What a time-sliced resource's name ends with (`nvidia.com/gpu.shared`): pods ask for a
/// shared GPU by name, never get one unawares.
pub const SHARED_SUFFIX: &str = ".shared";

/// The GPU-share resource: each GPU is offered as [`SHARE_UNITS`] interchangeable units, and
/// which GPU a container gets is the scheduler's choice, not the unit ids the kubelet picked.
pub const SHARE_RESOURCE: &str = "xpu.dev/gpu-milli";
/// Units of [`SHARE_RESOURCE`] per GPU.
pub const SHARE_UNITS: usize = 1000;

/// GPUs given to one pod's container for a share allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareGrant {
    /// `namespace/name`, for the log.
    pub pod: String,
    /// Indices into the plugin's GPUs in PCI address order.
    pub gpus: Vec<u16>,
    /// The share of each GPU (`XPU_GPU_MILLI`): less than 1000 for part of one GPU.
    pub milli_per_gpu: u16,
}

/// Who knows which pod an allocation is for: the scheduler's signed record on the pod (see
/// `xpu_kube::share`).
#[tonic::async_trait]
pub trait ShareResolver: Send + Sync + std::fmt::Debug {
    /// The grant for an allocation of `units` units, or why none can be made.
    async fn resolve(&self, units: u64) -> Result<ShareGrant, String>;
}

/// A kubelet opens `ListAndWatch` within milliseconds of a registration; one that has not
/// after this long could not talk to the plugin's socket.
pub const LIST_AND_WATCH_WAIT: Duration = Duration::from_secs(10);

/// Things worth telling the operator, sent on the optional events channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// No device on the host matches this resource; no plugin for it.
    Skipped {
        resource: String,
    },
    Serving {
        resource: String,
        socket: PathBuf,
        devices: usize,
    },
    Registered {
        resource: String,
    },
    RegisterFailed {
        resource: String,
        error: String,
    },
    /// The plugin's socket was deleted; it serves on a new one.
    Reserving {
        resource: String,
    },
    /// The kubelet took the registration but never opened `ListAndWatch`: the plugin registers
    /// again.
    NoListAndWatch {
        resource: String,
        waited: Duration,
    },
    Health {
        resource: String,
        id: String,
        healthy: bool,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    Discover(#[from] xpu_host::DiscoverError),
    #[error(
        "plugin directory {} does not exist; pass the kubelet's device plugin directory (normally {DEFAULT_PLUGIN_DIR}) to --plugin-dir",
        path.display()
    )]
    NoPluginDir { path: PathBuf },
    #[error(
        "no device on this host matches any resource ({resources}); check `xpu discover` and the --resource selectors"
    )]
    NoDevices { resources: String },
    #[error(
        "{SHARE_RESOURCE} needs the pod lookup: pass --share with --kubeconfig, --node-name and --share-key"
    )]
    ShareWithoutResolver,
    #[error("GPU shares: {0}")]
    Share(String),
    #[error("cannot serve on {}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Dev {
    /// The PCI address: unique, stable across reboots, at most 63 characters as the API asks.
    id: String,
    address: PciAddress,
    numa: Option<u32>,
    domain: Option<String>,
    vendor: Option<u16>,
    /// The driver the device had when first seen; a different one makes it unhealthy.
    expected_driver: Option<String>,
    driver: Option<String>,
    present: bool,
    /// Why telemetry says the device may not take work (an XID needing a reset...).
    telemetry: Option<String>,
    uuid: Option<String>,
    nodes: Vec<String>,
    cdi: Option<String>,
    /// The model's memory, for MPS's memory limit.
    memory_mib: Option<u64>,
    /// A MIG instance of the GPU at `address` (its nodes are the GPU's and the instance's
    /// capabilities).
    mig: Option<mig::Instance>,
    /// A partition (its index) of the AMD GPU at `address`, whose only node is its render node.
    partition: Option<u32>,
}

impl Dev {
    fn healthy(&self) -> bool {
        self.present && self.driver == self.expected_driver && self.telemetry.is_none()
    }

    fn from_inventory(d: &xpu_core::PciDevice, cdi: Option<String>) -> Dev {
        Dev {
            id: d.address.to_string(),
            address: d.address,
            numa: d.numa_node,
            domain: d.interconnect_domain.clone(),
            vendor: d.vendor_id,
            expected_driver: d.driver.clone(),
            driver: d.driver.clone(),
            present: true,
            telemetry: None,
            uuid: d.uuid.clone(),
            nodes: d.dev_nodes.iter().map(|n| n.path.clone()).collect(),
            cdi,
            memory_mib: d
                .vendor_id
                .zip(d.device_id)
                .and_then(|(v, id)| xpu_core::accel::lookup(v, id))
                .map(|a| u64::from(a.memory_gib) * 1024),
            mig: None,
            partition: None,
        }
    }
}

/// The devices of `inv` that `resource` selects, an AMD GPU in a compute partition mode of more
/// than one partition as its partitions: each `<address>-xcp-<i>` with its render node alone
/// (`/dev/kfd` comes with every AMD device) and its memory, never the GPU's CDI device (which
/// names the whole GPU's nodes). Sorted by id.
fn devs_of(resource: &Resource, inv: &Inventory, cdi: &HashMap<PciAddress, String>) -> Vec<Dev> {
    let mut devs = Vec::new();
    for d in inv.devices.iter().filter(|d| resource.matches(d)) {
        match d.partitioning.as_ref().filter(|p| p.partitions.len() > 1 && !resource.is_vfio()) {
            Some(p) => {
                for x in &p.partitions {
                    let mut dev = Dev::from_inventory(d, None);
                    dev.id = format!("{}-xcp-{}", d.address, x.index);
                    dev.nodes = vec![x.render_node.path.clone()];
                    dev.memory_mib = x.memory_bytes.map(|b| b >> 20).or(dev.memory_mib);
                    dev.partition = Some(x.index);
                    devs.push(dev);
                }
            }
            None => devs.push(Dev::from_inventory(d, cdi.get(&d.address).cloned())),
        }
    }
    // Ids sort like addresses except for 5-digit (VMD) domains; lookups need id order.
    devs.sort_by(|a, b| a.id.cmp(&b.id));
    devs
}

#[derive(Debug, Default)]
struct Table {
    /// Sorted by id, so lookups are binary searches.
    devs: Vec<Dev>,
    control: Vec<DevNode>,
    /// Advertise each device as [`SHARE_UNITS`] units.
    share: bool,
    /// Time-slicing: advertise each device this many times (`<id>-r<i>`); 1: once, by its id.
    replicas: u16,
}

impl Table {
    fn get(&self, id: &str) -> Option<&Dev> {
        self.devs.binary_search_by(|d| d.id.as_str().cmp(id)).ok().map(|i| &self.devs[i])
    }

    /// The device a time-slicing replica id (`0000:25:00.0-r3`) stands for.
    fn replica_of<'a>(&self, id: &'a str) -> Option<&'a str> {
        let (dev, i) = id.rsplit_once("-r")?;
        let i: u16 = i.parse().ok()?;
        (i < self.replicas && self.get(dev).is_some()).then_some(dev)
    }

    fn list(&self) -> Vec<pb::Device> {
        // Each device once by its id, as SHARE_UNITS units (`<id>-u042`), or as `replicas`
        // time-slicing replicas (`<id>-r3`).
        let (copies, id): (usize, fn(&str, usize) -> String) = if self.share {
            (SHARE_UNITS, |d, u| format!("{d}-u{u:03}"))
        } else if self.replicas > 1 {
            (usize::from(self.replicas), |d, r| format!("{d}-r{r}"))
        } else {
            (1, |d, _| d.to_owned())
        };
        self.devs
            .iter()
            .flat_map(|d| {
                let health = if d.healthy() { HEALTHY } else { UNHEALTHY };
                let topology = d
                    .numa
                    .map(|n| pb::TopologyInfo { nodes: vec![pb::NumaNode { id: i64::from(n) }] });
                (0..copies).map(move |c| pb::Device {
                    id: id(&d.id, c),
                    health: health.to_owned(),
                    topology: topology.clone(),
                })
            })
            .collect()
    }
}

/// The `DevicePlugin` service of one resource.
#[derive(Debug)]
pub struct Plugin {
    resource: Resource,
    table: RwLock<Table>,
    updates: watch::Sender<Vec<pb::Device>>,
    /// `ListAndWatch` calls so far, to notice a kubelet that registered the plugin and then
    /// never called it.
    watches: std::sync::atomic::AtomicU64,
    share: Option<Arc<dyn ShareResolver>>,
    mps: Option<Arc<crate::mps::Mps>>,
    device_list: DeviceList,
}

/// How `Allocate` names a container's devices to the runtime (NVIDIA's device plugin's
/// `--device-list-strategy` names).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum DeviceList {
    /// CDI device names (the kubelet passes them to the runtime through the CRI), the `/dev`
    /// nodes as `DeviceSpec`s and the environment, for runtimes with or without CDI.
    #[default]
    CdiCri,
    /// The environment alone (`NVIDIA_VISIBLE_DEVICES`, `XPU_VISIBLE_DEVICES`...): the runtime
    /// injects the devices, as `xpu-container-runtime` in place of runc does (or NVIDIA's
    /// runtime). xpu's own CDI devices (an MPS share's pipe, a MIG instance's capabilities) are
    /// still named: no runtime knows them from the environment.
    Envvar,
}

impl std::str::FromStr for DeviceList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cdi-cri" => Ok(DeviceList::CdiCri),
            "envvar" => Ok(DeviceList::Envvar),
            other => Err(format!("{other:?} is not a device list strategy; use cdi-cri or envvar")),
        }
    }
}

impl Plugin {
    /// Names devices to the runtime as `d` says.
    pub fn with_device_list(mut self, d: DeviceList) -> Plugin {
        self.device_list = d;
        self
    }

    /// A [`SHARE_RESOURCE`] plugin: the devices `resource` selects, each offered as
    /// [`SHARE_UNITS`] units, given out as `resolver` says.
    pub fn shared(resource: Resource, inv: &Inventory, resolver: Arc<dyn ShareResolver>) -> Plugin {
        let mut p = Plugin::new(resource, inv);
        let list = {
            let t = p.table.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            t.share = true;
            t.list()
        };
        p.updates.send_replace(list);
        p.share = Some(resolver);
        p
    }

    /// A time-slicing plugin: every device `resource` selects offered `replicas` times, under
    /// the resource's name with [`SHARED_SUFFIX`].
    pub fn time_sliced(resource: Resource, inv: &Inventory, replicas: u16) -> Plugin {
        let mut resource = resource;
        if !resource.name.ends_with(SHARED_SUFFIX) {
            resource.name.push_str(SHARED_SUFFIX);
        }
        let mut p = Plugin::new(resource, inv);
        let list = {
            let t = p.table.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
            t.replicas = replicas.clamp(1, MAX_REPLICAS);
            t.list()
        };
        p.updates.send_replace(list);
        p
    }

    /// The `Allocate` answer for one container of a time-sliced resource: one replica, its
    /// device's nodes, and the mode said in the environment.
    pub fn allocate_replica(
        &self,
        ids: &[String],
    ) -> Result<pb::ContainerAllocateResponse, Status> {
        let (dev, replicas) = {
            let t = self.read();
            if ids.len() != 1 {
                return Err(Status::invalid_argument(format!(
                    "{} is time-sliced: a container gets one GPU, shared in time with other pods, so it asks for 1 (this one asked for {}); for several GPUs ask for whole ones",
                    self.resource.name,
                    ids.len()
                )));
            }
            let dev = t.replica_of(&ids[0]).map(str::to_owned).ok_or_else(|| {
                Status::not_found(format!(
                    "device {} is not a replica of {}; use an id from ListAndWatch",
                    quoted(&ids[0]),
                    self.resource.name
                ))
            })?;
            (dev, t.replicas)
        };
        let mut resp = self.allocate_container(&[dev])?;
        resp.envs.insert("XPU_SHARING".to_owned(), "time-slicing".to_owned());
        resp.envs.insert("XPU_TIME_SLICE_REPLICAS".to_owned(), replicas.to_string());
        Ok(resp)
    }

    /// Shares of less than a GPU served through MPS.
    pub fn with_mps(mut self, mps: Option<Arc<crate::mps::Mps>>) -> Plugin {
        self.mps = mps;
        self
    }

    /// The devices of `inv` that `resource` selects.
    pub fn new(resource: Resource, inv: &Inventory) -> Plugin {
        let cdi = crate::cdi::names(inv);
        let devs = devs_of(&resource, inv, &cdi);
        Plugin::of(resource, devs, inv)
    }

    /// The MIG instances of one profile ([`mig`]), as `nvidia.com/mig-<profile>`.
    fn mig(profile: &str, devs: Vec<Dev>, inv: &Inventory) -> Plugin {
        Plugin::of(Resource { name: mig::resource_name(profile), terms: Vec::new() }, devs, inv)
    }

    /// A plugin offering `devs` (sorted by id) as `resource`.
    fn of(resource: Resource, devs: Vec<Dev>, inv: &Inventory) -> Plugin {
        let table =
            Table { devs, control: inv.host.control_nodes.clone(), share: false, replicas: 1 };
        let (updates, _) = watch::channel(table.list());
        Plugin {
            resource,
            table: RwLock::new(table),
            updates,
            watches: Default::default(),
            share: None,
            mps: None,
            device_list: DeviceList::CdiCri,
        }
    }

    /// Whether this plugin offers MIG instances.
    fn is_mig(&self) -> bool {
        self.resource.name.starts_with(mig::RESOURCE_PREFIX)
    }

    /// Merges `fresh` (the devices there are now, sorted by id: a discovery's, or a MIG
    /// reading's) into the table: a device still
    /// there takes its fresh values but keeps the driver it was first seen with (a different
    /// one makes it unhealthy); one gone, or under its id another MIG instance than it was, is
    /// absent (kept, `Unhealthy`, so that a pod holding it sees that); a new id is added.
    /// Returns `(id, healthy)` for each device whose health changed, and sends the new list to
    /// `ListAndWatch` streams when anything they show changed.
    fn merge(
        &self,
        fresh: Vec<Dev>,
        inv: &Inventory,
        unhealthy: &std::collections::BTreeMap<PciAddress, String>,
    ) -> Vec<(String, bool)> {
        let mut changed = Vec::new();
        let list = {
            let mut t = self.table.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            for dev in &mut t.devs {
                let was = dev.healthy();
                match fresh.binary_search_by(|x| x.id.as_str().cmp(&dev.id)) {
                    Ok(i) if fresh[i].mig == dev.mig => {
                        let expected_driver = dev.expected_driver.take();
                        *dev = Dev { expected_driver, ..fresh[i].clone() };
                    }
                    // Gone, or no longer one this resource selects (moved to another driver),
                    // a partition the GPU's mode no longer makes, another MIG instance.
                    _ => dev.present = false,
                }
                dev.telemetry = unhealthy.get(&dev.address).cloned();
                if dev.healthy() != was {
                    changed.push((dev.id.clone(), dev.healthy()));
                }
            }
            for f in fresh {
                if let Err(i) = t.devs.binary_search_by(|x| x.id.as_str().cmp(&f.id)) {
                    changed.push((f.id.clone(), true));
                    t.devs.insert(i, f);
                }
            }
            t.control = inv.host.control_nodes.clone();
            t.list()
        };
        self.publish(list);
        changed
    }

    /// Sends `list` to the `ListAndWatch` streams when it differs from what they last got.
    fn publish(&self, list: Vec<pb::Device>) {
        self.updates.send_if_modified(|cur| {
            if *cur == list {
                false
            } else {
                *cur = list;
                true
            }
        });
    }

    /// How many times `ListAndWatch` was opened.
    pub fn watches(&self) -> u64 {
        self.watches.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    pub fn device_count(&self) -> usize {
        self.read().devs.len()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        // A panic while holding the lock cannot leave the table half-written (updates replace
        // whole fields), so a poisoned lock is still safe to read.
        self.table.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current `ListAndWatch` device list.
    pub fn devices(&self) -> Vec<pb::Device> {
        self.read().list()
    }

    /// Applies a fresh discovery: marks devices present/absent, notes driver changes and what
    /// telemetry says is unhealthy (`unhealthy`, by address, with why), adds new matching
    /// devices ([`Plugin::merge`]).
    pub fn refresh(
        &self,
        inv: &Inventory,
        unhealthy: &std::collections::BTreeMap<PciAddress, String>,
    ) -> Vec<(String, bool)> {
        let cdi = crate::cdi::names(inv);
        self.merge(devs_of(&self.resource, inv, &cdi), inv, unhealthy)
    }

    /// The `Allocate` answer for one container.
    pub fn allocate_container(
        &self,
        ids: &[String],
    ) -> Result<pb::ContainerAllocateResponse, Status> {
        let t = self.read();
        let mut resp = pb::ContainerAllocateResponse::default();
        let mut nvidia = Vec::new();
        let mut control: Vec<&str> = Vec::new();
        for id in ids {
            let d = t.get(id).ok_or_else(|| {
                Status::not_found(format!(
                    "device {} is not a {} device of this plugin; use an id from ListAndWatch",
                    quoted(id),
                    self.resource.name
                ))
            })?;
            if !d.healthy() {
                return Err(Status::failed_precondition(format!(
                    "device {} is unhealthy ({}); ListAndWatch reports it Unhealthy",
                    quoted(id),
                    d.telemetry.as_deref().unwrap_or("missing or its driver changed")
                )));
            }
            // A VFIO resource's functions are for VMs: their group nodes below are all they
            // get, never a vendor kind's CDI edits (driver files, control nodes).
            if let Some(name) = d.cdi.as_ref().filter(|_| !self.resource.is_vfio()) {
                resp.cdi_devices.push(pb::CdiDevice { name: name.clone() });
            }
            if let Some(m) = &d.mig {
                resp.cdi_devices.push(pb::CdiDevice { name: m.cdi.clone() });
            }
            for n in &d.nodes {
                resp.devices.push(device_spec(n));
            }
            // A function on vfio-pci is for a VM: no vendor runtime may see it.
            if d.mig.is_some() {
                // A MIG instance by its MIG UUID where the control names it; otherwise its
                // capability nodes alone say which instance CUDA sees.
                nvidia.extend(d.uuid.clone());
            } else if d.vendor == Some(VENDOR_NVIDIA) && d.driver.as_deref() != Some("vfio-pci") {
                nvidia.push(d.uuid.clone().unwrap_or_else(|| d.id.clone()));
            }
            // Nodes every device of its kind needs besides its own.
            let needs: &[&str] = match (d.driver.as_deref(), d.vendor) {
                (Some("vfio-pci"), _) => &["/dev/vfio/vfio"],
                (_, Some(VENDOR_NVIDIA)) => &[
                    "/dev/nvidiactl",
                    "/dev/nvidia-uvm",
                    "/dev/nvidia-uvm-tools",
                    "/dev/nvidia-modeset",
                ],
                (_, Some(VENDOR_AMD)) => &["/dev/kfd"],
                _ => &[],
            };
            for n in needs {
                if !control.contains(n) && t.control.iter().any(|c| c.path == *n) {
                    control.push(n);
                }
            }
        }
        for n in control {
            resp.devices.push(device_spec(n));
        }
        if !nvidia.is_empty() {
            resp.envs.insert("NVIDIA_VISIBLE_DEVICES".to_owned(), nvidia.join(","));
        }
        // MIG instances (`0000:25:00.0-mig-gi7`) and AMD partitions (`0000:05:00.0-xcp-3`) by
        // their own ids in variables of their own: `XPU_VISIBLE_DEVICES` names whole devices, as
        // the runtime shim reads it.
        let mut whole = Vec::new();
        let mut parts = Vec::new();
        for id in ids {
            if t.get(id).is_some_and(|d| d.partition.is_some()) {
                parts.push(id.as_str());
            } else {
                whole.push(id.as_str());
            }
        }
        let var = if self.is_mig() { "XPU_MIG_DEVICES" } else { "XPU_VISIBLE_DEVICES" };
        if !whole.is_empty() {
            resp.envs.insert(var.to_owned(), whole.join(","));
        }
        if !parts.is_empty() {
            resp.envs.insert("XPU_AMD_PARTITIONS".to_owned(), parts.join(","));
        }
        if self.resource.is_vfio() {
            // KubeVirt's virt-launcher gives each hostDevice of this resource one of these
            // addresses (ids are PCI addresses).
            resp.envs.insert(crate::selector::kubevirt_env(&self.resource.name), ids.join(","));
        }
        Ok(resp)
    }

    /// The `Allocate` answer for one container of a [`SHARE_RESOURCE`] plugin: `units` unit ids
    /// were picked by the kubelet; the GPUs are those the scheduler chose for the pod.
    pub async fn allocate_share(
        &self,
        resolver: &dyn ShareResolver,
        units: &[String],
    ) -> Result<pb::ContainerAllocateResponse, Status> {
        let grant =
            resolver.resolve(units.len() as u64).await.map_err(Status::failed_precondition)?;
        let ids: Vec<String> = {
            let t = self.read();
            grant
                .gpus
                .iter()
                .map(|&i| {
                    t.devs.get(usize::from(i)).map(|d| d.id.clone()).ok_or_else(|| {
                        Status::failed_precondition(format!(
                            "pod {}: the scheduler chose GPU {i} but this node has {} GPUs; the node's {SHARE_RESOURCE} capacity and the plugin disagree",
                            grant.pod,
                            t.devs.len()
                        ))
                    })
                })
                .collect::<Result<_, _>>()?
        };
        let mut resp = self.allocate_container(&ids)?;
        resp.envs.insert("XPU_GPU_MILLI".to_owned(), grant.milli_per_gpu.to_string());
        if let Some(mps) = self.mps.as_ref().filter(|_| grant.milli_per_gpu < 1000) {
            let gpus: Vec<(Option<String>, Option<u64>)> = {
                let t = self.read();
                ids.iter()
                    .filter_map(|id| t.get(id))
                    .map(|d| (d.uuid.clone(), d.memory_mib))
                    .collect()
            };
            for (uuid, memory) in gpus {
                let uuid = uuid.ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "pod {}: its GPU has no UUID for MPS",
                        grant.pod
                    ))
                })?;
                // Starting a daemon runs a process: off the runtime, which also serves every
                // other resource's ListAndWatch.
                let (m, milli) = (mps.clone(), grant.milli_per_gpu);
                let name = tokio::task::spawn_blocking(move || m.share(&uuid, milli, memory))
                    .await
                    .map_err(|e| Status::internal(format!("pod {}: MPS: {e}", grant.pod)))?
                    .map_err(|e| {
                        Status::failed_precondition(format!("pod {}: MPS: {e}", grant.pod))
                    })?;
                resp.cdi_devices.push(pb::CdiDevice { name });
            }
        }
        Ok(resp)
    }

    /// The `GetPreferredAllocation` answer for one container.
    pub fn preferred_container(
        &self,
        r: &pb::ContainerPreferredAllocationRequest,
    ) -> pb::ContainerPreferredAllocationResponse {
        let t = self.read();
        let size = usize::try_from(r.allocation_size).unwrap_or(0);
        if t.share {
            // Units are interchangeable; the GPU comes from the scheduler's choice.
            let mut ids: Vec<String> = r.must_include_device_i_ds.clone();
            for id in &r.available_device_i_ds {
                if ids.len() >= size {
                    break;
                }
                if !ids.contains(id) {
                    ids.push(id.clone());
                }
            }
            return pb::ContainerPreferredAllocationResponse { device_i_ds: ids };
        }
        if t.replicas > 1 {
            // One replica, of the device with the most replicas still free (the least shared),
            // counted once (up to 64 replicas of each device are offered).
            let mut free: HashMap<&str, usize> = HashMap::new();
            for dev in r.available_device_i_ds.iter().filter_map(|id| t.replica_of(id)) {
                *free.entry(dev).or_default() += 1;
            }
            let mut ids: Vec<String> = r.must_include_device_i_ds.clone();
            let mut avail: Vec<&String> = r
                .available_device_i_ds
                .iter()
                .filter(|id| !ids.contains(id))
                .filter(|id| t.replica_of(id).and_then(|d| t.get(d)).is_some_and(Dev::healthy))
                .collect();
            avail.sort_by_key(|id| {
                std::cmp::Reverse(t.replica_of(id).and_then(|d| free.get(d)).copied().unwrap_or(0))
            });
            ids.extend(avail.into_iter().take(size.saturating_sub(ids.len())).cloned());
            return pb::ContainerPreferredAllocationResponse { device_i_ds: ids };
        }
        let candidates: Vec<Candidate<'_>> = t
            .devs
            .iter()
            .filter(|d| d.healthy())
            .map(|d| Candidate { id: &d.id, numa: d.numa, domain: d.domain.as_deref() })
            .collect();
        pb::ContainerPreferredAllocationResponse {
            device_i_ds: preferred::choose(
                &candidates,
                &r.available_device_i_ds,
                &r.must_include_device_i_ds,
                size,
            ),
        }
    }
}

fn device_spec(path: &str) -> pb::DeviceSpec {
    pb::DeviceSpec {
        container_path: path.to_owned(),
        host_path: path.to_owned(),
        permissions: "rw".to_owned(),
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::device_plugin_server::DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        self.watches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The current list first, then every change.
        let stream = WatchStream::new(self.updates.subscribe())
            .map(|devices| Ok(pb::ListAndWatchResponse { devices }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let container_responses = request
            .get_ref()
            .container_requests
            .iter()
            .map(|r| self.preferred_container(r))
            .collect();
        Ok(Response::new(pb::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let requests = &request.get_ref().container_requests;
        let container_responses = match &self.share {
            Some(resolver) => {
                let mut out = Vec::with_capacity(requests.len());
                for r in requests {
                    out.push(self.allocate_share(resolver.as_ref(), &r.devices_ids).await?);
                }
                out
            }
            None if self.read().replicas > 1 => requests
                .iter()
                .map(|r| self.allocate_replica(&r.devices_ids))
                .collect::<Result<_, _>>()?,
            None => requests
                .iter()
                .map(|r| self.allocate_container(&r.devices_ids))
                .collect::<Result<_, _>>()?,
        };
        let mut container_responses: Vec<pb::ContainerAllocateResponse> = container_responses;
        if self.device_list == DeviceList::Envvar {
            for c in &mut container_responses {
                c.devices.clear();
                c.cdi_devices.retain(|d| d.name.starts_with("xpu.dev/"));
            }
        }
        Ok(Response::new(pb::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}

/// A client's device id as an error message quotes it: its first 64 characters, so that an
/// answer's trailers never carry a large request back (a `grpc-message` of megabytes is refused
/// by the client's HTTP/2 library, which then drops the whole connection).
fn quoted(id: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 64;
    match id.char_indices().nth(MAX) {
        None => id.into(),
        Some((end, _)) => format!("{}… ({} octets)", &id[..end], id.len()).into(),
    }
}

/// What this plugin tells the kubelet it implements.
pub fn options() -> pb::DevicePluginOptions {
    pb::DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }
}

/// A running gRPC server on one socket.
#[derive(Debug)]
pub struct Server {
    socket: PathBuf,
    identity: Option<transport::SocketId>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Server {
    /// Binds `socket` (replacing a stale file) and serves `plugin` on it. The socket accepts
    /// connections as soon as this returns, before any registration.
    pub fn start(socket: &Path, plugin: Arc<Plugin>) -> Result<Server, PluginError> {
        let incoming = transport::bind(socket)
            .map_err(|source| PluginError::Listen { path: socket.to_owned(), source })?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            limits::server()
                .add_service(
                    pb::device_plugin_server::DevicePluginServer::from_arc(plugin)
                        .max_decoding_message_size(limits::MAX_MESSAGE)
                        .max_encoding_message_size(limits::MAX_MESSAGE),
                )
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                }),
        );
        Ok(Server {
            socket: socket.to_owned(),
            identity: transport::identity(socket),
            stop: Some(stop),
            task,
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Whether the socket file is still the one this server bound.
    pub fn socket_intact(&self) -> bool {
        self.identity.is_some() && transport::identity(&self.socket) == self.identity
    }

    /// Stops serving. Open `ListAndWatch` streams never end on their own, so after a short grace
    /// period the connections are dropped. Removes the socket file if it is still ours.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(Duration::from_millis(200), &mut self.task).await.is_err() {
            self.task.abort();
        }
        if self.socket_intact() {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// Registers `resource` (served on `endpoint`, a file name in the kubelet's directory) with the
/// kubelet listening on `kubelet_socket`.
pub async fn register(kubelet_socket: &Path, resource: &str, endpoint: &str) -> Result<(), String> {
    let call = async {
        let channel = transport::connect(kubelet_socket).await.map_err(|e| e.to_string())?;
        let mut client = pb::registration_client::RegistrationClient::new(channel);
        client
            .register(pb::RegisterRequest {
                version: API_VERSION.to_owned(),
                endpoint: endpoint.to_owned(),
                resource_name: resource.to_owned(),
                options: Some(options()),
            })
            .await
            .map_err(|s| s.message().to_owned())?;
        Ok(())
    };
    match tokio::time::timeout(REGISTER_TIMEOUT, call).await {
        Ok(r) => r,
        Err(_) => Err(format!("the kubelet did not answer within {REGISTER_TIMEOUT:?}")),
    }
}

/// The host's accelerators, less those kept for Nova's VMs ([`xpu_host::vm_devices`]; a list
/// that cannot be read keeps every accelerator back, logged, rather than offer one Nova may
/// hold).
async fn discover(root: &Root) -> Result<Inventory, xpu_host::DiscoverError> {
    let root = root.clone();
    let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
    let read = move || {
        let mut inv = xpu_host::discover(&root, &opts)?;
        match xpu_host::vm_devices::read(&root, xpu_host::vm_devices::VM_DEVICES) {
            Ok(Some(kept)) => inv.devices.retain(|d| !kept.contains(&d.address)),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(error = %e, "offering no device until the list of devices kept for VMs reads");
                inv.devices.retain(|d| !d.kind.is_accelerator());
            }
        }
        Ok(inv)
    };
    match tokio::task::spawn_blocking(read).await {
        Ok(r) => r,
        // The blocking pool only fails this way when the runtime shuts down.
        Err(_) => Ok(Inventory::default()),
    }
}

struct Slot {
    plugin: Arc<Plugin>,
    socket: PathBuf,
    server: Option<Server>,
    /// The `kubelet.sock` identity this plugin last registered with.
    registered_with: Option<transport::SocketId>,
    /// The identity a registration last failed against, so failures are reported once.
    failed_with: Option<transport::SocketId>,
    /// When the last registration was taken and how many `ListAndWatch` calls there had been,
    /// until the kubelet opens one more.
    awaiting_watch: Option<(tokio::time::Instant, u64)>,
}

impl Slot {
    fn new(plugin_dir: &Path, plugin: Arc<Plugin>) -> Slot {
        Slot {
            socket: plugin_dir.join(plugin.resource().socket_name()),
            plugin,
            server: None,
            registered_with: None,
            failed_with: None,
            awaiting_watch: None,
        }
    }
}

/// Reads the MIG control off the runtime's threads (`nvidia-smi` takes its time).
async fn read_mig(
    m: &MigOptions,
    root: &Root,
    inv: &Inventory,
    last: Option<String>,
) -> Result<mig::State, String> {
    let (m, root, inv) = (m.clone(), root.clone(), inv.clone());
    tokio::task::spawn_blocking(move || {
        mig::read(m.control.as_ref(), &root, &inv, &m.cdi_dir, last.as_deref())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Serves every resource that has devices until `shutdown` completes, then stops the servers
/// and removes their sockets.
pub async fn run(
    cfg: Config,
    events: Option<mpsc::UnboundedSender<Event>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PluginError> {
    let emit = |e: Event| {
        if let Some(tx) = &events {
            let _ = tx.send(e);
        }
    };
    if !cfg.plugin_dir.is_dir() {
        return Err(PluginError::NoPluginDir { path: cfg.plugin_dir });
    }
    let inv = discover(&cfg.root).await?;
    let mut mig_state = match &cfg.mig {
        Some(control) => match read_mig(control, &cfg.root, &inv, None).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "MIG state unread: GPUs are offered whole until it reads");
                mig::State::default()
            }
        },
        None => mig::State::default(),
    };
    let mut mig_read = tokio::time::Instant::now();
    let mig_every = cfg.interval * 10;
    let whole = mig::without_mig(&inv, &mig_state.enabled);
    let mut slots = Vec::new();
    for (profile, devs) in &mig_state.by_profile {
        let plugin =
            Arc::new(Plugin::mig(profile, devs.clone(), &inv).with_device_list(cfg.device_list));
        slots.push(Slot::new(&cfg.plugin_dir, plugin));
    }
    for r in &cfg.resources {
        let plugin = if r.name == SHARE_RESOURCE {
            let resolver = cfg.share.clone().ok_or(PluginError::ShareWithoutResolver)?;
            Arc::new(
                Plugin::shared(r.clone(), &whole, resolver)
                    .with_mps(cfg.mps.clone())
                    .with_device_list(cfg.device_list),
            )
        } else if cfg.replicas > 1
            && r.terms.contains(&crate::selector::Term::Kind(xpu_core::DeviceKind::Gpu))
        {
            // GPUs only: a TPU or another accelerator is not time-sliced by its runtime.
            Arc::new(
                Plugin::time_sliced(r.clone(), &whole, cfg.replicas)
                    .with_device_list(cfg.device_list),
            )
        } else {
            Arc::new(Plugin::new(r.clone(), &whole).with_device_list(cfg.device_list))
        };
        if plugin.device_count() == 0 {
            emit(Event::Skipped { resource: r.name.clone() });
            continue;
        }
        slots.push(Slot::new(&cfg.plugin_dir, plugin));
    }
    // With MIG, a node whose instances are all still to be made has nothing yet, and waits.
    if slots.is_empty() && cfg.mig.is_none() {
        let names: Vec<String> = cfg.resources.iter().map(ToString::to_string).collect();
        return Err(PluginError::NoDevices { resources: names.join(" ") });
    }
    for s in &mut slots {
        s.server = Some(Server::start(&s.socket, s.plugin.clone())?);
        emit(Event::Serving {
            resource: s.plugin.resource.name.clone(),
            socket: s.socket.clone(),
            devices: s.plugin.device_count(),
        });
    }
    let kubelet = cfg.plugin_dir.join(KUBELET_SOCKET);
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let result = loop {
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            _ = tick.tick() => {}
        }
        for s in &mut slots {
            let name = s.plugin.resource.name.clone();
            if !s.server.as_ref().is_some_and(Server::socket_intact) {
                if let Some(old) = s.server.take() {
                    old.stop().await;
                }
                match Server::start(&s.socket, s.plugin.clone()) {
                    Ok(server) => s.server = Some(server),
                    Err(e) => report_restart_failure(&emit, &name, &e),
                }
                s.registered_with = None;
                emit(Event::Reserving { resource: name.clone() });
            }
            if let Some((since, watches)) = s.awaiting_watch {
                if s.plugin.watches() > watches {
                    s.awaiting_watch = None;
                } else if since.elapsed() >= cfg.watch_timeout {
                    // Registered, never called: register again (a kubelet that lost the first
                    // one takes the second), and say so.
                    emit(Event::NoListAndWatch { resource: name.clone(), waited: since.elapsed() });
                    s.awaiting_watch = None;
                    s.registered_with = None;
                }
            }
            let k = transport::identity(&kubelet);
            if k.is_none() {
                // The kubelet is down; whatever comes up next needs a registration.
                s.registered_with = None;
            }
            if let Some(k) = k
                && s.registered_with != Some(k)
                && s.server.is_some()
            {
                let endpoint = s.plugin.resource.socket_name();
                // Counted before the call: the kubelet may open ListAndWatch before its answer
                // to Register reaches us (a real kubelet 1.37 often does).
                let (asked, watches) = (tokio::time::Instant::now(), s.plugin.watches());
                match register(&kubelet, &name, &endpoint).await {
                    Ok(()) => {
                        s.registered_with = Some(k);
                        s.failed_with = None;
                        s.awaiting_watch = Some((asked, watches));
                        emit(Event::Registered { resource: name.clone() });
                    }
                    Err(error) => {
                        if s.failed_with != Some(k) {
                            emit(Event::RegisterFailed { resource: name.clone(), error });
                        }
                        s.failed_with = Some(k);
                    }
                }
            }
        }
        if let Ok(inv) = discover(&cfg.root).await {
            if let Some(control) = cfg.mig.as_ref().filter(|_| mig_read.elapsed() >= mig_every) {
                mig_read = tokio::time::Instant::now();
                match read_mig(control, &cfg.root, &inv, mig_state.spec.clone()).await {
                    Ok(m) => mig_state = m,
                    Err(e) => {
                        tracing::warn!(error = %e, "MIG state unread; the last reading stands")
                    }
                }
            }
            let whole = mig::without_mig(&inv, &mig_state.enabled);
            let unhealthy = cfg.health.as_ref().map(|c| c.unhealthy()).unwrap_or_default();
            for s in &slots {
                let changed = if s.plugin.is_mig() {
                    let profile = &s.plugin.resource.name[mig::RESOURCE_PREFIX.len()..];
                    let fresh = mig_state.by_profile.get(profile).map_or(&[][..], Vec::as_slice);
                    s.plugin.merge(fresh.to_vec(), &inv, &unhealthy)
                } else {
                    s.plugin.refresh(&whole, &unhealthy)
                };
                for (id, healthy) in changed {
                    emit(Event::Health { resource: s.plugin.resource.name.clone(), id, healthy });
                }
            }
            // A profile seen for the first time: its resource is served from the next tick on.
            for (profile, devs) in &mig_state.by_profile {
                let name = mig::resource_name(profile);
                if slots.iter().any(|s| s.plugin.resource.name == name) {
                    continue;
                }
                let plugin = Arc::new(
                    Plugin::mig(profile, devs.clone(), &inv).with_device_list(cfg.device_list),
                );
                let mut slot = Slot::new(&cfg.plugin_dir, plugin);
                match Server::start(&slot.socket, slot.plugin.clone()) {
                    Ok(server) => {
                        slot.server = Some(server);
                        emit(Event::Serving {
                            resource: name,
                            socket: slot.socket.clone(),
                            devices: slot.plugin.device_count(),
                        });
                    }
                    Err(e) => report_restart_failure(&emit, &name, &e),
                }
                slots.push(slot);
            }
        }
    };
    for s in slots {
        if let Some(server) = s.server {
            server.stop().await;
        }
    }
    result
}

/// A socket that cannot be re-created is reported and retried on the next tick.
fn report_restart_failure(emit: &impl Fn(Event), resource: &str, e: &PluginError) {
    emit(Event::RegisterFailed { resource: resource.to_owned(), error: e.to_string() });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Devices kept for Nova's VMs are not offered; a list that does not read offers none.
    /// An MI300X in CPX mode is eight `amd.com/gpu` devices, one per partition, each its render
    /// node alone (and `/dev/kfd`); a mode change under the plugin withdraws the partitions it
    /// no longer makes.
    #[test]
    fn amd_partitions_are_devices_of_their_own() {
        let fx = xpu_testkit::hosts::mi300x_cpx()
            .build_with(&xpu_testkit::BuildOptions { char_devices: true, ..Default::default() });
        let root = Root::new(fx.root()).unwrap();
        let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
        let mut inv = xpu_host::discover(&root, &opts).unwrap();
        let amd = Resource::defaults().into_iter().find(|r| r.name == "amd.com/gpu").unwrap();
        let plugin = Plugin::new(amd, &inv);
        assert_eq!(plugin.device_count(), 64);
        let gpu = inv.accelerators().next().unwrap().address;
        let id = format!("{gpu}-xcp-3");
        let r = plugin.allocate_container(std::slice::from_ref(&id)).unwrap();
        let nodes: Vec<&str> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(nodes, ["/dev/dri/renderD131", "/dev/kfd"]);
        assert!(r.cdi_devices.is_empty(), "{:?}", r.cdi_devices);
        assert_eq!(r.envs.get("XPU_AMD_PARTITIONS"), Some(&id));
        assert!(!r.envs.contains_key("XPU_VISIBLE_DEVICES"));
        // DPX now: partitions 2-7 of every GPU are gone.
        for d in inv.devices.iter_mut() {
            if let Some(p) = d.partitioning.as_mut() {
                p.compute = "DPX".into();
                p.partitions.truncate(2);
            }
        }
        let changed = plugin.refresh(&inv, &Default::default());
        assert_eq!(changed.iter().filter(|(_, healthy)| !healthy).count(), 48, "{changed:?}");
        let listed = plugin.devices();
        let healthy = listed.iter().filter(|d| d.health == HEALTHY).count();
        assert_eq!(healthy, 16);
    }

    #[tokio::test]
    async fn devices_kept_for_nova_are_left_out_and_a_bad_list_leaves_out_every_one() {
        let fx = xpu_testkit::hosts::a100_8x().build();
        let root = Root::new(fx.root()).unwrap();
        let gpus = |inv: &Inventory| inv.accelerators().count();
        let all = discover(&root).await.unwrap();
        let first = all.accelerators().next().unwrap().address;
        let list = fx.root().join("etc/xpu/vm-devices");
        std::fs::create_dir_all(list.parent().unwrap()).unwrap();
        std::fs::write(&list, format!("{first}\n")).unwrap();
        let left = discover(&root).await.unwrap();
        assert_eq!(gpus(&left), gpus(&all) - 1);
        assert!(left.device(&first).is_none());
        std::fs::write(&list, "first-gpu\n").unwrap();
        assert_eq!(gpus(&discover(&root).await.unwrap()), 0);
    }
}
