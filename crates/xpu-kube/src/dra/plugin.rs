//! The kubelet side of the driver: plugin registration (`pluginregistration/v1`) on
//! `<registry-dir>/xpu.dev-reg.sock`, and the DRA service (`v1.DRAPlugin` and
//! `v1beta1.DRAPlugin`, the same messages) on `<plugin-dir>/xpu.dev/dra.sock`.
//!
//! `NodePrepareResources` reads each claim from the API server, decides with
//! [`super::prepare::plan`], writes the claim's CDI spec atomically into the CDI directory and
//! records it in a checkpoint (`<plugin-dir>/xpu.dev/checkpoint.json`, written atomically and
//! fsynced; the spec is atomic but not fsynced) before answering. A claim already in the
//! checkpoint whose spec is still there and parses is answered from it (idempotent, and right
//! after a restart). `NodeUnprepareResources` removes exactly the spec the checkpoint names.
//! Errors are per claim and nothing is written for a claim that fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, watch};
use tonic::transport::server::Router;
use tonic::{Request, Response, Status};
use tracing::{Instrument, info, info_span, warn};
use xpu_container::cdi::{CdiKind, DeviceNode, GenerateOptions, Spec};
use xpu_core::{Inventory, PciAddress};
use xpu_host::Root;
use xpu_host::mig_caps::MigCaps;
use xpu_integrations::drapb::{self, registration as reg, v1, v1beta1};
use xpu_integrations::limits;
use xpu_telemetry::mig::{MigControl, MigControlError, MigGpu};

use super::prepare::{self, ClaimError, PreparedDevice};
use super::{DRIVER, rebind};
use xpu_core::kernel::Kernel;
use xpu_host::kernel::SysfsKernel;

/// What the checkpoint remembers of one prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    /// The spec's file name in the CDI directory.
    pub spec_file: String,
    pub devices: Vec<PreparedDevice>,
    /// The MIG instances made for the claim, destroyed when it is unprepared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<MadeInstance>,
    /// The PCI functions moved to `vfio-pci` for the claim (its passthrough devices and their
    /// IOMMU group companions), returned to their drivers when it is unprepared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vfio: Vec<PciAddress>,
    /// When it was prepared (RFC 3339): `xpu vfio status` says since when a use holds a device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// The GPUs (UUIDs) whose MPS daemons serve the claim, one entry per shared device: each
    /// daemon stops after its last claim is unprepared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mps: Vec<String>,
}

/// A MIG instance made for a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MadeInstance {
    /// The allocated device it serves.
    pub device: String,
    /// The GPU's PCI address.
    pub gpu: String,
    /// NVML's GPU instance id.
    pub gi: u32,
    /// `MIG-<uuid>`, where the MIG control names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// The checkpoint file's content.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    /// By claim UID.
    pub claims: BTreeMap<String, PreparedClaim>,
}

impl Checkpoint {
    /// The prepared claim (uid, claim) holding each PCI function of `inv`: its devices (a MIG
    /// device holds its GPU) and the functions moved to `vfio-pci` for it; claim `but` left out.
    pub fn holders<'a>(
        &'a self,
        inv: &Inventory,
        but: &str,
    ) -> BTreeMap<PciAddress, (&'a str, &'a PreparedClaim)> {
        let mut out = BTreeMap::new();
        for (uid, p) in self.claims.iter().filter(|(uid, _)| uid.as_str() != but) {
            let devices = p.devices.iter().filter_map(|d| super::slices::by_name(inv, &d.device));
            for a in devices.map(|d| d.address).chain(p.vfio.iter().copied()) {
                out.insert(a, (uid.as_str(), p));
            }
        }
        out
    }
}

/// Errors starting the plugin.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("checkpoint {}: {reason}; move it aside to start afresh (claims it lists stay prepared on disk)", path.display())]
    Checkpoint { path: PathBuf, reason: String },
    #[error("creating {}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serve on {}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where the plugin lives.
#[derive(Debug, Clone)]
pub struct Paths {
    pub plugin_dir: PathBuf,
    pub registry_dir: PathBuf,
    pub cdi_dir: PathBuf,
}

impl Paths {
    pub fn dir(&self) -> PathBuf {
        self.plugin_dir.join(DRIVER)
    }
    pub fn endpoint(&self) -> PathBuf {
        self.dir().join("dra.sock")
    }
    pub fn registration(&self) -> PathBuf {
        self.registry_dir.join(format!("{DRIVER}-reg.sock"))
    }
    pub fn checkpoint(&self) -> PathBuf {
        self.dir().join("checkpoint.json")
    }
}

/// Reads the checkpoint; a missing file is an empty one.
pub fn load_checkpoint(path: &Path) -> Result<Checkpoint, PluginError> {
    let err = |reason: String| PluginError::Checkpoint { path: path.to_owned(), reason };
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| err(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(Checkpoint { version: 1, ..Default::default() })
        }
        Err(e) => Err(err(e.to_string())),
    }
}

/// Whether a prepared claim's spec is still there and whole (a spec that does not parse, such
/// as one left empty by a power cut before it reached the disk, is written again).
fn spec_intact(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| serde_json::from_slice::<Spec>(&b).is_ok())
}

fn save_checkpoint(path: &Path, c: &Checkpoint) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(c).map_err(std::io::Error::other)?;
    xpu_container::fsutil::write_atomic(path, &bytes, 0o600)
}

/// The host-wide CDI specs of an inventory, regenerated when the inventory changes.
struct HostSpecs {
    inv: Arc<Inventory>,
    specs: Arc<Vec<Spec>>,
}

/// The DRA service's state, shared by both API versions.
pub struct Driver {
    node: String,
    root: Root,
    paths: Paths,
    client: kube::Client,
    inventory: watch::Receiver<Arc<Inventory>>,
    specs: std::sync::Mutex<Option<HostSpecs>>,
    /// MIG through NVML: instances made on prepare and destroyed on unprepare.
    mig: Option<Arc<dyn MigControl>>,
    /// Held across a whole prepare or unprepare: the checkpoint and CDI files change together.
    checkpoint: Mutex<Checkpoint>,
    /// The kernel the passthrough moves write to (sysfs under `root`; a fake in tests).
    kernel: std::sync::Mutex<Box<dyn Kernel + Send>>,
    /// MPS daemons for claims given part of a GPU (`--mps-dir`).
    mps: Option<Arc<xpu_host::mps::Daemons>>,
    /// Claims given part of a GPU get all of it, unlimited (`--time-slicing`).
    time_slicing: bool,
    /// The pool's device health, streamed to the kubelet ([`super::health`]).
    health: Option<watch::Receiver<Arc<Vec<super::health::DeviceHealth>>>>,
}

impl Driver {
    pub fn new(
        client: kube::Client,
        node: &str,
        root: Root,
        paths: Paths,
        inventory: watch::Receiver<Arc<Inventory>>,
        mig: Option<Arc<dyn MigControl>>,
    ) -> Result<Driver, PluginError> {
        for d in [paths.dir(), paths.cdi_dir.clone(), paths.registry_dir.clone()] {
            std::fs::create_dir_all(&d)
                .map_err(|source| PluginError::Dir { path: d.clone(), source })?;
        }
        let checkpoint = load_checkpoint(&paths.checkpoint())?;
        info!(claims = checkpoint.claims.len(), "checkpoint loaded");
        let root_for_kernel = root.clone();
        Ok(Driver {
            node: node.to_owned(),
            root,
            paths,
            client,
            inventory,
            specs: std::sync::Mutex::new(None),
            mig,
            checkpoint: Mutex::new(checkpoint),
            kernel: std::sync::Mutex::new(Box::new(SysfsKernel::new(root_for_kernel))),
            mps: None,
            time_slicing: false,
            health: None,
        })
    }

    /// The driver serving the kubelet its devices' health from `health` (the slice loop's).
    pub fn with_health(
        mut self,
        health: watch::Receiver<Arc<Vec<super::health::DeviceHealth>>>,
    ) -> Self {
        self.health = Some(health);
        self
    }

    /// The driver sharing GPUs by time-slicing: a claim given part of one gets all of it.
    pub fn with_time_slicing(mut self, on: bool) -> Self {
        self.time_slicing = on;
        self
    }

    /// The driver with MPS for shared GPUs. The claims the checkpoint lists as clients are
    /// counted again, and their daemons started again if they are not running (a restarted
    /// node, or a daemon that died while the driver was down).
    pub fn with_mps(mut self, mps: Option<Arc<xpu_host::mps::Daemons>>) -> Self {
        if let Some(d) = &mps {
            let cp = self.checkpoint.get_mut();
            for (uid, p) in &cp.claims {
                for gpu in &p.mps {
                    if let Err(e) = d.acquire(gpu) {
                        warn!(claim = %uid, gpu = %gpu, error = %e, "MPS daemon of a prepared claim not started");
                    }
                }
            }
        }
        self.mps = mps;
        self
    }

    /// Starts (or finds running) the MPS daemon of each shared device; on failure the ones
    /// acquired here are released.
    fn acquire_mps(&self, parts: &[prepare::MpsPart]) -> Result<Vec<String>, String> {
        let Some(d) = &self.mps else {
            return if parts.is_empty() {
                Ok(Vec::new())
            } else {
                Err("has shared devices, but this driver serves no MPS".into())
            };
        };
        let mut got = Vec::new();
        for p in parts {
            match d.acquire(&p.gpu) {
                Ok(started) => {
                    if started {
                        info!(gpu = %p.gpu, pipe = %d.pipe_dir(&p.gpu).display(), "MPS control daemon started");
                    }
                    got.push(p.gpu.clone());
                }
                Err(e) => {
                    self.release_mps(&got);
                    return Err(format!("device {}: MPS: {e}", p.device));
                }
            }
        }
        Ok(got)
    }

    fn release_mps(&self, gpus: &[String]) {
        let Some(d) = &self.mps else { return };
        for g in gpus {
            match d.release(g) {
                Ok(true) => info!(gpu = %g, "MPS control daemon stopped: its last claim ended"),
                Ok(false) => {}
                Err(e) => warn!(gpu = %g, error = %e, "MPS control daemon not stopped"),
            }
        }
    }

    /// The driver with `kernel` for its passthrough moves (a fake kernel, in tests).
    pub fn with_kernel(mut self, kernel: Box<dyn Kernel + Send>) -> Self {
        self.kernel = std::sync::Mutex::new(kernel);
        self
    }

    /// The host read again now (after a move to or from `vfio-pci`), with its CDI specs.
    fn rediscover(&self) -> Result<(Arc<Inventory>, Arc<Vec<Spec>>), String> {
        let opts = xpu_host::DiscoverOptions {
            scope: xpu_host::Scope::Accelerators,
            pci_ids: None,
            skip_names: true,
        };
        let inv = Arc::new(xpu_host::discover(&self.root, &opts).map_err(|e| e.to_string())?);
        let specs = self.specs_for(&inv);
        Ok((inv, specs))
    }

    /// Who holds each PCI function now, by the checkpoint (`but`: the claim being prepared):
    /// the devices of every other prepared claim and the functions moved for them.
    fn holders(&self, cp: &Checkpoint, inv: &Inventory, but: &str) -> BTreeMap<PciAddress, String> {
        cp.holders(inv, but)
            .into_iter()
            .map(|(a, (uid, p))| (a, format!("claim {}/{} ({uid})", p.namespace, p.name)))
            .collect()
    }

    /// A plan's error, but for a device on `vfio-pci` because another claim's passthrough
    /// moved it there: that is named as held by that claim.
    fn explain(&self, e: ClaimError, cp: &Checkpoint, inv: &Inventory, uid: &str) -> String {
        if let ClaimError::Mode { device, .. } = &e
            && let Some(d) = super::slices::by_name(inv, device)
            && let Some(who) = self.holders(cp, inv, uid).get(&d.address)
        {
            return format!(
                "device {device} is passed through, with its IOMMU group, by {who}; it comes back when that claim is released"
            );
        }
        e.to_string()
    }

    /// Returns `moved` to their drivers after a prepare that failed later; what fails is
    /// logged (the functions stay on `vfio-pci`, recorded in the VFIO state file).
    fn give_back(&self, moved: &[PciAddress]) {
        if moved.is_empty() {
            return;
        }
        let r = self.rediscover().and_then(|(inv, _)| {
            let mut k = self.kernel.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            rebind::give_back(&self.root, &inv, &mut **k, moved).map_err(|e| e.to_string())
        });
        if let Err(e) = r {
            warn!(error = %e, "functions moved for a claim that failed to prepare stay on vfio-pci; `xpu vfio unbind` returns them");
        }
    }

    fn host(&self) -> (Arc<Inventory>, Arc<Vec<Spec>>) {
        let inv = self.inventory.borrow().clone();
        let specs = self.specs_for(&inv);
        (inv, specs)
    }

    /// The CDI specs `xpu cdi generate` writes for `inv` (kept for the last inventory).
    fn specs_for(&self, inv: &Arc<Inventory>) -> Arc<Vec<Spec>> {
        let inv = inv.clone();
        let mut cache = self.specs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = cache.as_ref().filter(|c| Arc::ptr_eq(&c.inv, &inv) || *c.inv == *inv) {
            return c.specs.clone();
        }
        let files =
            xpu_host::driver_files::find(&self.root, inv.host.nvidia_driver_version.as_deref());
        let opts = GenerateOptions {
            kinds: CdiKind::ALL.to_vec(),
            strict: false,
            host_root: self.root.base().to_path_buf(),
        };
        let specs = Arc::new(
            xpu_container::cdi::generate(&inv, &files, &opts).map(|g| g.specs).unwrap_or_default(),
        );
        *cache = Some(HostSpecs { inv, specs: specs.clone() });
        specs
    }

    /// Prepares one claim; the error names the claim.
    async fn prepare_one(
        &self,
        c: &v1::Claim,
        cp: &mut Checkpoint,
    ) -> Result<Vec<PreparedDevice>, String> {
        let who = format!("claim {}/{} ({})", c.namespace, c.name, c.uid);
        if let Some(p) = cp.claims.get(&c.uid)
            && spec_intact(&self.paths.cdi_dir.join(&p.spec_file))
        {
            return Ok(p.devices.clone());
        }
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &c.namespace);
        let claim = api
            .get(&c.name)
            .await
            .map_err(|e| format!("{who}: reading it from the API server: {e}"))?;
        self.prepare_fetched(c, &claim, cp, &who)
    }

    /// [`Driver::prepare_one`] once the claim is read: its passthrough devices moved to
    /// vfio-pci (and back if anything after fails), then [`Driver::prepare_on`].
    fn prepare_fetched(
        &self,
        c: &v1::Claim,
        claim: &ResourceClaim,
        cp: &mut Checkpoint,
        who: &str,
    ) -> Result<Vec<PreparedDevice>, String> {
        let (inv, specs) = self.host();
        // Passthrough devices on their vendor driver go to vfio-pci first, group and all; they
        // go back if anything after fails.
        let moves = prepare::to_move(claim, &inv).map_err(|e| format!("{who} {e}"))?;
        if moves.is_empty() {
            return self.prepare_on(c, claim, cp, &inv, &specs, &[], who);
        }
        let held = self.holders(cp, &inv, &c.uid);
        rebind::check(&self.root, &inv, &moves, &held).map_err(|e| format!("{who}: {e}"))?;
        let moved = {
            let mut k = self.kernel.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            rebind::take(&self.root, &inv, &mut **k, &moves)
        }
        .map_err(|e| format!("{who}: {e}"))?;
        info!(claim = %c.uid, moved = ?moved, "moved to vfio-pci for passthrough");
        let prepared = self
            .rediscover()
            .map_err(|e| format!("{who}: reading the host after moving its devices: {e}"))
            .and_then(|(inv, specs)| self.prepare_on(c, claim, cp, &inv, &specs, &moved, who));
        if prepared.is_err() {
            self.give_back(&moved);
        }
        prepared
    }

    /// The rest of [`Driver::prepare_one`], on the host as it is now (`moved`: the functions
    /// moved to `vfio-pci` for the claim, recorded with it): the plan, its MIG instances, the
    /// claim's CDI spec and the checkpoint; what this made is undone if a later step fails.
    #[allow(clippy::too_many_arguments)]
    fn prepare_on(
        &self,
        c: &v1::Claim,
        claim: &ResourceClaim,
        cp: &mut Checkpoint,
        inv: &Inventory,
        specs: &[Spec],
        moved: &[PciAddress],
        who: &str,
    ) -> Result<Vec<PreparedDevice>, String> {
        let mig_gpus = match &self.mig {
            Some(m) => m.gpus().map_err(|e| format!("{who}: reading MIG state: {e}"))?,
            None => Vec::new(),
        };
        let mut plan = prepare::plan(claim, &c.uid, &self.node, inv, specs, &mig_gpus)
            .map_err(|e| format!("{who} {}", self.explain(e, cp, inv, &c.uid)))?;
        let mps_dir = self.mps.as_ref().map(|d| d.dir().to_owned());
        let sharing = match &mps_dir {
            Some(d) => Some(prepare::Sharing::Mps(d)),
            None => self.time_slicing.then_some(prepare::Sharing::TimeSlicing),
        };
        let shared =
            prepare::mps(claim, inv, &mut plan, sharing).map_err(|e| format!("{who} {e}"))?;
        let made =
            self.make_instances(&mut plan, &mig_gpus, cp).map_err(|e| format!("{who} {e}"))?;
        let clients = match self.acquire_mps(&shared) {
            Ok(c) => c,
            Err(e) => {
                self.destroy_instances(&made);
                return Err(format!("{who} {e}"));
            }
        };
        let file = prepare::spec_file(&c.uid);
        let path = self.paths.cdi_dir.join(&file);
        // Atomic (a runtime sees the old spec or the new one) but not fsynced: the spec is
        // derived from the claim, `--cdi-dir` is normally on tmpfs (/var/run/cdi), and a spec
        // a power cut emptied fails `spec_intact` and is written again by the kubelet's next
        // prepare. The checkpoint, which a restart needs whole, is fsynced.
        let json = xpu_container::cdi::to_json(&plan.spec);
        if let Err(e) = xpu_container::fsutil::write_replace(&path, json.as_bytes(), 0o644, false) {
            self.destroy_instances(&made);
            self.release_mps(&clients);
            return Err(format!("{who}: writing CDI spec {}: {e}", path.display()));
        }
        cp.claims.insert(
            c.uid.clone(),
            PreparedClaim {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                spec_file: file,
                devices: plan.devices.clone(),
                mig: made.clone(),
                vfio: moved.to_vec(),
                since: Some(k8s_openapi::jiff::Timestamp::now().to_string()),
                mps: clients.clone(),
            },
        );
        if let Err(e) = save_checkpoint(&self.paths.checkpoint(), cp) {
            cp.claims.remove(&c.uid);
            // Neither the spec nor the instances may outlive a claim the checkpoint does not
            // know.
            if let Err(rm) = std::fs::remove_file(&path) {
                warn!(spec = %path.display(), error = %rm, "could not remove the spec of a claim that failed to prepare");
            }
            self.destroy_instances(&made);
            self.release_mps(&clients);
            return Err(format!(
                "{who}: writing checkpoint {}: {e}",
                self.paths.checkpoint().display()
            ));
        }
        Ok(plan.devices)
    }

    /// Makes the plan's MIG instances (or takes over one xpu made at that placement that no
    /// prepared claim holds: left by a prepare that stopped before its checkpoint) and adds
    /// each one's capability nodes to its device. On any failure the instances made here are
    /// destroyed again.
    fn make_instances(
        &self,
        plan: &mut prepare::Plan,
        gpus: &[MigGpu],
        cp: &Checkpoint,
    ) -> Result<Vec<MadeInstance>, String> {
        if plan.mig.is_empty() {
            return Ok(Vec::new());
        }
        let control = self
            .mig
            .as_ref()
            .ok_or("names MIG devices, but this driver has no MIG control (NVML)")?;
        let caps = MigCaps::read(&self.root).map_err(|e| e.to_string())?;
        let held = |gpu: &str, gi: u32| {
            cp.claims.values().flat_map(|p| &p.mig).any(|m| m.gpu == gpu && m.gi == gi)
        };
        let mut made: Vec<MadeInstance> = Vec::new();
        let mut created: Vec<MadeInstance> = Vec::new();
        for part in &plan.mig {
            let gpu = part.gpu.to_string();
            let left =
                gpus.iter().filter(|g| g.address == part.gpu).flat_map(|g| &g.instances).find(
                    |i| {
                        i.by_xpu
                            && i.profile == part.profile
                            && i.start == part.start
                            && !held(&gpu, i.gi)
                    },
                );
            let instance = match left {
                Some(i) => i.clone(),
                None => match control.create(part.gpu, part.profile, part.start) {
                    Ok(i) => {
                        info!(device = %part.device, gpu = %gpu, gi = i.gi, profile = part.profile, start = part.start, uuid = ?i.uuid, "MIG instance made");
                        created.push(MadeInstance {
                            device: part.device.clone(),
                            gpu: gpu.clone(),
                            gi: i.gi,
                            uuid: i.uuid.clone(),
                        });
                        i
                    }
                    Err(e) => {
                        self.destroy_instances(&created);
                        return Err(format!(
                            "MIG device {}: making {} at memory slice {}: {e}",
                            part.device, part.profile, part.start
                        ));
                    }
                },
            };
            let nodes = match caps.instance(part.gpu_minor, instance.gi, instance.ci) {
                Ok(n) => n,
                Err(e) => {
                    self.destroy_instances(&created);
                    return Err(format!("MIG device {}: {e}", part.device));
                }
            };
            let edits = &mut plan.spec.devices[part.spec_device].container_edits;
            edits.device_nodes.extend(nodes.into_iter().map(|n| DeviceNode {
                path: n.path,
                node_type: "c".to_owned(),
                major: n.major.into(),
                minor: n.minor.into(),
                file_mode: Some(0o444),
            }));
            made.push(MadeInstance {
                device: part.device.clone(),
                gpu,
                gi: instance.gi,
                uuid: instance.uuid,
            });
        }
        Ok(made)
    }

    /// Destroys `instances`; what fails is logged (an instance left over is reported by NVML
    /// and taken over by the next prepare of its placement).
    fn destroy_instances(&self, instances: &[MadeInstance]) {
        for m in instances {
            if let Err(e) = self.destroy_instance(m) {
                warn!(gpu = %m.gpu, gi = m.gi, error = %e, "MIG instance not destroyed");
            }
        }
    }

    fn destroy_instance(&self, m: &MadeInstance) -> Result<(), String> {
        let Some(control) = &self.mig else {
            return Err("no MIG control (NVML) to destroy it with".into());
        };
        let gpu: PciAddress = m.gpu.parse().map_err(|e| format!("{e}"))?;
        match control.destroy(gpu, m.gi) {
            Ok(()) | Err(MigControlError::NoInstance { .. }) => {
                info!(gpu = %m.gpu, gi = m.gi, uuid = ?m.uuid, "MIG instance destroyed");
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn unprepare_one(&self, c: &v1::Claim, cp: &mut Checkpoint) -> Result<(), String> {
        let who = format!("claim {}/{} ({})", c.namespace, c.name, c.uid);
        let file = cp
            .claims
            .get(&c.uid)
            .map(|p| p.spec_file.clone())
            .unwrap_or_else(|| prepare::spec_file(&c.uid));
        let path = self.paths.cdi_dir.join(&file);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{who}: removing CDI spec {}: {e}", path.display())),
        }
        // Its MIG instances go with it; one that will not go keeps the claim in the checkpoint
        // (the kubelet calls again).
        let instances = cp.claims.get(&c.uid).map(|p| p.mig.clone()).unwrap_or_default();
        for m in &instances {
            self.destroy_instance(m).map_err(|e| {
                format!("{who}: destroying MIG instance {} on the GPU at {}: {e}", m.gi, m.gpu)
            })?;
            if let Some(p) = cp.claims.get_mut(&c.uid) {
                p.mig.retain(|x| x != m);
            }
        }
        // The functions moved to vfio-pci for it go back to their drivers; a move that fails
        // keeps the claim in the checkpoint (the kubelet calls again).
        let moved = cp.claims.get(&c.uid).map(|p| p.vfio.clone()).unwrap_or_default();
        if !moved.is_empty() {
            let (inv, _) =
                self.rediscover().map_err(|e| format!("{who}: reading the host: {e}"))?;
            let mut k = self.kernel.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            rebind::give_back(&self.root, &inv, &mut **k, &moved)
                .map_err(|e| format!("{who}: {e}"))?;
            drop(k);
            info!(claim = %c.uid, returned = ?moved, "returned from vfio-pci");
            if let Some(p) = cp.claims.get_mut(&c.uid) {
                p.vfio.clear();
            }
        }
        // Its MPS daemons lose a client; each stops after its last.
        let clients = cp.claims.get(&c.uid).map(|p| p.mps.clone()).unwrap_or_default();
        self.release_mps(&clients);
        if cp.claims.remove(&c.uid).is_some() {
            save_checkpoint(&self.paths.checkpoint(), cp).map_err(|e| {
                format!("{who}: writing checkpoint {}: {e}", self.paths.checkpoint().display())
            })?;
        }
        Ok(())
    }

    pub async fn prepare(
        &self,
        req: v1::NodePrepareResourcesRequest,
    ) -> v1::NodePrepareResourcesResponse {
        let mut cp = self.checkpoint.lock().await;
        let mut out = v1::NodePrepareResourcesResponse::default();
        for c in &req.claims {
            let span = info_span!("prepare", claim = %c.uid);
            let r = match self.prepare_one(c, &mut cp).instrument(span).await {
                Ok(devs) => {
                    info!(namespace = %c.namespace, name = %c.name, devices = devs.len(), "claim prepared");
                    v1::NodePrepareResourceResponse {
                        devices: devs
                            .into_iter()
                            .map(|d| v1::Device {
                                request_names: d.requests,
                                pool_name: d.pool,
                                device_name: d.device,
                                cdi_device_ids: d.cdi_ids,
                            })
                            .collect(),
                        error: String::new(),
                    }
                }
                Err(error) => {
                    warn!(%error, "claim not prepared");
                    v1::NodePrepareResourceResponse { devices: Vec::new(), error }
                }
            };
            out.claims.insert(c.uid.clone(), r);
        }
        out
    }

    pub async fn unprepare(
        &self,
        req: v1::NodeUnprepareResourcesRequest,
    ) -> v1::NodeUnprepareResourcesResponse {
        let mut cp = self.checkpoint.lock().await;
        let mut out = v1::NodeUnprepareResourcesResponse::default();
        for c in &req.claims {
            let error = match self.unprepare_one(c, &mut cp) {
                Ok(()) => {
                    info!(claim = %c.uid, "claim unprepared");
                    String::new()
                }
                Err(e) => e,
            };
            out.claims.insert(c.uid.clone(), v1::NodeUnprepareResourceResponse { error });
        }
        out
    }
}

/// `v1.DRAPlugin`.
#[derive(Clone)]
pub struct V1(pub Arc<Driver>);

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for V1 {
    async fn node_prepare_resources(
        &self,
        r: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        Ok(Response::new(self.0.prepare(r.into_inner()).await))
    }
    async fn node_unprepare_resources(
        &self,
        r: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        Ok(Response::new(self.0.unprepare(r.into_inner()).await))
    }
}

// v1beta1 has the same messages with the same numbers: convert through the wire format, which
// cannot fail between identical definitions.
fn convert<A: prost::Message, B: prost::Message + Default>(a: &A) -> B {
    B::decode(a.encode_to_vec().as_slice()).unwrap_or_default()
}

/// `v1beta1.DRAPlugin`, for kubelets before 1.34.
#[derive(Clone)]
pub struct V1beta1(pub Arc<Driver>);

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for V1beta1 {
    async fn node_prepare_resources(
        &self,
        r: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let out = self.0.prepare(convert(&r.into_inner())).await;
        Ok(Response::new(convert(&out)))
    }
    async fn node_unprepare_resources(
        &self,
        r: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let out = self.0.unprepare(convert(&r.into_inner())).await;
        Ok(Response::new(convert(&out)))
    }
}

/// `pluginregistration.Registration`.
pub struct Registrar {
    pub endpoint: PathBuf,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registrar {
    async fn get_info(
        &self,
        _: Request<reg::InfoRequest>,
    ) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: drapb::DRA_PLUGIN_TYPE.to_owned(),
            name: DRIVER.to_owned(),
            endpoint: self.endpoint.display().to_string(),
            // The health service is listed as a service it serves, as the kubelet's plugin
            // helper lists it: a kubelet opens the health stream only for plugins that do.
            supported_versions: vec![
                drapb::SERVICE_V1.to_owned(),
                drapb::SERVICE_V1BETA1.to_owned(),
                drapb::SERVICE_HEALTH_V1ALPHA1.to_owned(),
            ],
        }))
    }
    async fn notify_registration_status(
        &self,
        r: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = r.into_inner();
        if s.plugin_registered {
            info!("registered with the kubelet");
        } else {
            warn!(error = %s.error, "the kubelet refused the registration");
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

fn listen(path: &Path) -> Result<xpu_integrations::transport::Incoming, PluginError> {
    xpu_integrations::transport::bind(path)
        .map_err(|source| PluginError::Listen { path: path.to_owned(), source })
}

/// The DRA service, both versions, on a server with xpu's bounds on what a client may make it
/// hold ([`limits`]: the same as the device plugin's).
fn dra_server(driver: Arc<Driver>) -> Router {
    let health = driver.health.clone().map(|health| {
        use xpu_integrations::drapb::health::dra_resource_health_server::DraResourceHealthServer;
        let service = super::health::Service { pool: driver.node.clone(), health };
        DraResourceHealthServer::new(service)
            .max_decoding_message_size(limits::MAX_MESSAGE)
            .max_encoding_message_size(limits::MAX_MESSAGE)
    });
    limits::server()
        .add_service(
            v1::dra_plugin_server::DraPluginServer::new(V1(driver.clone()))
                .max_decoding_message_size(limits::MAX_MESSAGE)
                .max_encoding_message_size(limits::MAX_MESSAGE),
        )
        .add_service(
            v1beta1::dra_plugin_server::DraPluginServer::new(V1beta1(driver))
                .max_decoding_message_size(limits::MAX_MESSAGE)
                .max_encoding_message_size(limits::MAX_MESSAGE),
        )
        .add_optional_service(health)
}

/// The registration service, bounded as [`dra_server`] is.
fn registration_server(endpoint: PathBuf) -> Router {
    limits::server().add_service(
        reg::registration_server::RegistrationServer::new(Registrar { endpoint })
            .max_decoding_message_size(limits::MAX_MESSAGE)
            .max_encoding_message_size(limits::MAX_MESSAGE),
    )
}

/// Serves the DRA service, then registration (so the kubelet never finds an endpoint that does
/// not answer), until `stop` resolves. Both sockets go through xpu-integrations' transport: the
/// `h2authority` proxy and its bounds, and a cap on connections.
pub async fn serve(
    driver: Arc<Driver>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), PluginError> {
    let endpoint = driver.paths.endpoint();
    let registration = driver.paths.registration();
    let dra = listen(&endpoint)?;
    let regl = listen(&registration)?;
    let (tx, rx) = watch::channel(false);
    let mut rx2 = rx.clone();
    let mut rx1 = rx;
    let a =
        tokio::spawn(dra_server(driver.clone()).serve_with_incoming_shutdown(dra, async move {
            // Err: the sender is gone, which means stop as well.
            rx1.wait_for(|s| *s).await.ok();
        }));
    let b = tokio::spawn(registration_server(endpoint.clone()).serve_with_incoming_shutdown(
        regl,
        async move {
            rx2.wait_for(|s| *s).await.ok();
        },
    ));
    info!(endpoint = %endpoint.display(), registration = %registration.display(), "serving the kubelet DRA plugin");
    stop.await;
    // Receivers live in the two servers; a send error only means they already stopped.
    tx.send(true).ok();
    for t in [a, b] {
        if let Ok(Err(e)) = t.await {
            warn!(error = %e, "gRPC server");
        }
    }
    for socket in [&registration, &endpoint] {
        if let Err(e) = xpu_integrations::transport::unbind(socket) {
            warn!(socket = %socket.display(), error = %e, "could not remove the socket; the kubelet may keep the plugin registered");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;
    use xpu_integrations::h2probe::{self, Answer, Probe};

    use super::*;

    /// A bound on waiting for what a correct server sends at once; never reached when it works.
    const WAIT: Duration = Duration::from_secs(10);
    const PREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources";
    const PREPARE_V1BETA1: &str =
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources";
    const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
    /// Streams opened past the cap in a flood.
    const EXTRA: usize = 100;

    /// A driver whose API server is never reached: no call here gets that far.
    fn driver(dir: &Path) -> Arc<Driver> {
        // Another test may have installed it already (see `crate::client`).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let paths = Paths {
            plugin_dir: dir.join("plugins"),
            registry_dir: dir.join("plugins_registry"),
            cdi_dir: dir.join("cdi"),
        };
        let (_, inventory) = watch::channel(Arc::new(Inventory::default()));
        Arc::new(
            Driver::new(client, "node-a", Root::new(dir).unwrap(), paths, inventory, None).unwrap(),
        )
    }

    /// Connects once the socket is served.
    async fn connect(socket: &Path) -> Probe {
        for _ in 0..200 {
            if let Ok(p) = Probe::connect(socket, WAIT).await {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{} is not served", socket.display());
    }

    /// The stream cap is advertised and enforced: exactly the streams past it are refused.
    async fn streams_are_capped(socket: &Path, path: &str) {
        let cap = limits::MAX_CONCURRENT_STREAMS as usize;
        let mut p = connect(socket).await;
        assert_eq!(
            p.setting(h2probe::MAX_CONCURRENT_STREAMS),
            Some(limits::MAX_CONCURRENT_STREAMS)
        );
        assert_eq!(p.setting(h2probe::MAX_HEADER_LIST_SIZE), Some(limits::MAX_HEADER_LIST));
        let flood = h2probe::flood(&mut p, path, cap + EXTRA, EXTRA, WAIT).await.unwrap();
        let mut refused = flood.refused.clone();
        refused.sort_unstable();
        assert_eq!(refused, flood.opened[cap..], "{} on {}", flood.summary(), socket.display());
    }

    /// Issue 13 on the DRA driver's two sockets as the kubelet reaches them: streams past the
    /// cap refused, a length prefix over the message cap refused on its five octets with
    /// RESOURCE_EXHAUSTED, connections bounded; and the kubelet's registration still works.
    #[tokio::test]
    async fn served_sockets_bound_streams_messages_and_connections() {
        let dir = tempfile::tempdir().unwrap();
        let driver = driver(dir.path());
        let (endpoint, registration) = (driver.paths.endpoint(), driver.paths.registration());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(driver, async {
            stopped.await.ok();
        }));
        for (socket, path) in
            [(&endpoint, PREPARE), (&endpoint, PREPARE_V1BETA1), (&registration, GET_INFO)]
        {
            streams_are_capped(socket, path).await;
            let mut p = connect(socket).await;
            for declared in [u32::try_from(limits::MAX_MESSAGE + 1).unwrap(), 1 << 30] {
                let answer = h2probe::oversized(&mut p, path, declared, WAIT).await.unwrap();
                assert!(answer.is_resource_exhausted(), "{path}, {declared} octets: {answer:?}");
            }
        }
        let mut held = Vec::new();
        for _ in 0..limits::MAX_CONNECTIONS {
            held.push(connect(&registration).await);
        }
        assert!(Probe::connect(&registration, WAIT).await.is_err(), "a connection past the cap");
        drop(held);
        // The held connections' slots come back as the proxy sees them close.
        let mut registered = None;
        for _ in 0..200 {
            match xpu_integrations::drakubelet::register(&registration).await {
                Ok(r) => {
                    registered = Some(r);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
        assert_eq!(
            registered.expect("registration once a slot is free").service,
            drapb::SERVICE_V1
        );
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    /// The tonic servers themselves, with no proxy in front, advertise and enforce the same
    /// stream cap, and refuse a message over the cap as soon as its prefix arrives (tonic's own
    /// answer, OUT_OF_RANGE).
    #[tokio::test]
    async fn its_servers_bound_streams_and_messages_without_the_proxy() {
        let dir = tempfile::tempdir().unwrap();
        let driver = driver(dir.path());
        let endpoint = driver.paths.endpoint();
        for (name, router, path) in [
            ("dra", dra_server(driver), PREPARE),
            ("registration", registration_server(endpoint), GET_INFO),
        ] {
            let socket = dir.path().join(format!("{name}-plain.sock"));
            let listener = tokio::net::UnixListener::bind(&socket).unwrap();
            let server = tokio::spawn(
                router
                    .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
            );
            streams_are_capped(&socket, path).await;
            let mut p = connect(&socket).await;
            let over = u32::try_from(limits::MAX_MESSAGE + 1).unwrap();
            let answer = h2probe::oversized(&mut p, path, over, WAIT).await.unwrap();
            assert!(
                matches!(&answer, Answer::Status(code, _) if code == "11"),
                "{name}: {answer:?}"
            );
            server.abort();
        }
    }

    /// A node of 8 GPUs serving VMs and containers at once, through the driver's whole prepare
    /// (the claim's moves, plan, CDI spec and checkpoint) on the fake kernel: two passthrough
    /// claims and three container claims; unprepare returns every function; and a failure at
    /// every kernel write of a passthrough claim leaves every device as it was.
    #[tokio::test]
    async fn two_vms_and_three_containers_on_one_node_and_back() {
        use super::super::rebind::tests::{gpus, host_with, same_tree};
        use xpu_testkit::fake_kernel::{FakeKernel, snapshot};
        let build = xpu_testkit::BuildOptions { char_devices: true, ..Default::default() };
        let probe = host_with(&build);
        let chars = std::fs::symlink_metadata(probe.root().join("dev/vfio/vfio"))
            .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_char_device(&m.file_type()));
        if !chars {
            eprintln!("skipping: CDI specs need the fixture's device nodes (mknod, root)");
            return;
        }
        let discover =
            |root: &Root| xpu_host::discover(root, &xpu_host::DiscoverOptions::default()).unwrap();
        let claim = |uid: &str, device: &str, passthrough: bool| -> (v1::Claim, ResourceClaim) {
            let config = if passthrough {
                serde_json::json!([{ "source": "FromClass", "requests": ["r"], "opaque": {
                    "driver": DRIVER, "parameters": {
                        "apiVersion": "xpu.dev/v1", "kind": "DeviceConfig", "mode": "passthrough" } } }])
            } else {
                serde_json::json!([])
            };
            let c: ResourceClaim = serde_json::from_value(serde_json::json!({
                "metadata": { "name": format!("c-{uid}"), "namespace": "ns", "uid": uid },
                "spec": {},
                "status": { "allocation": { "devices": {
                    "results": [{ "request": "r", "driver": DRIVER, "pool": "n1", "device": device }],
                    "config": config } } },
            }))
            .unwrap();
            let k = v1::Claim { namespace: "ns".into(), name: format!("c-{uid}"), uid: uid.into() };
            (k, c)
        };
        // (uid, GPU index, passthrough)
        let plan = [
            ("vm0", 0, true),
            ("vm1", 1, true),
            ("c4", 4, false),
            ("c5", 5, false),
            ("c6", 6, false),
        ];
        let start = |fx: &xpu_testkit::Fixture, kernel: FakeKernel, dir: &Path| {
            // Another test may have installed it already (see `crate::client`).
            let _ = rustls::crypto::ring::default_provider().install_default();
            let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
            let client = kube::Client::try_from(config).unwrap();
            let root = Root::new(fx.root()).unwrap();
            let (tx, rx) = watch::channel(Arc::new(discover(&root)));
            let paths = Paths {
                plugin_dir: dir.join("plugins"),
                registry_dir: dir.join("plugins_registry"),
                cdi_dir: dir.join("cdi"),
            };
            let d = Driver::new(client, "n1", root, paths, rx, None)
                .unwrap()
                .with_kernel(Box::new(kernel));
            (d, tx)
        };

        let fx = host_with(&build);
        let tmp = tempfile::tempdir().unwrap();
        let root = Root::new(fx.root()).unwrap();
        let inv = discover(&root);
        let gpu = gpus(&inv);
        let name =
            |i: usize| super::super::slices::device_name(inv.device(&gpu[i]).unwrap()).unwrap();
        let before = snapshot(fx.root());
        let (driver, tx) = start(&fx, FakeKernel::new(fx.root()), tmp.path());
        let mut cp = driver.checkpoint.lock().await;
        let mut made = Vec::new();
        for (uid, i, vm) in plan {
            let (k, c) = claim(uid, &name(i), vm);
            driver.prepare_fetched(&k, &c, &mut cp, uid).unwrap_or_else(|e| panic!("{uid}: {e}"));
            tx.send_replace(Arc::new(discover(&root)));
            made.push(k);
        }
        let now = discover(&root);
        for (uid, i, vm) in plan {
            let d = now.device(&gpu[i]).unwrap();
            let want = if vm { "vfio-pci" } else { "nvidia" };
            assert_eq!(d.driver.as_deref(), Some(want), "{uid}");
            let spec =
                std::fs::read_to_string(tmp.path().join("cdi").join(prepare::spec_file(uid)))
                    .unwrap();
            let group = format!("/dev/vfio/{}", d.iommu_group.unwrap());
            if vm {
                assert!(
                    spec.contains(&format!("\"{group}\"")) && spec.contains("/dev/vfio/vfio"),
                    "{uid}: {spec}"
                );
                assert!(!spec.contains("/dev/nvidia"), "{uid}: {spec}");
            } else {
                assert!(
                    spec.contains("/dev/nvidia") && !spec.contains("/dev/vfio"),
                    "{uid}: {spec}"
                );
            }
        }
        // GPU 0's audio function went with it, and came back.
        assert_eq!(cp.claims["vm0"].vfio.len(), 2, "{:?}", cp.claims["vm0"].vfio);
        for k in &made {
            driver.unprepare_one(k, &mut cp).unwrap();
        }
        assert!(cp.claims.is_empty());
        same_tree(&before, &snapshot(fx.root()), "after unprepare");
        drop(cp);

        // A failure at each of the 6 writes moving GPU 0's group (3 per function), while a
        // container claim holds GPU 4: the claim fails naming the rollback, and the host is as
        // it was.
        for n in 1..=6 {
            let fx = host_with(&build);
            let tmp = tempfile::tempdir().unwrap();
            let before = snapshot(fx.root());
            let (driver, _tx) = start(&fx, FakeKernel::new(fx.root()).fail_at(n), tmp.path());
            let mut cp = driver.checkpoint.lock().await;
            let (k4, c4) = claim("c4", &name(4), false);
            driver.prepare_fetched(&k4, &c4, &mut cp, "c4").unwrap();
            let (k0, c0) = claim("vm0", &name(0), true);
            let e = driver.prepare_fetched(&k0, &c0, &mut cp, "vm0").unwrap_err();
            assert!(e.contains("rolled back"), "write {n}: {e}");
            assert_eq!(cp.claims.keys().collect::<Vec<_>>(), ["c4"], "write {n}");
            assert!(!tmp.path().join("cdi").join(prepare::spec_file("vm0")).exists());
            driver.unprepare_one(&k4, &mut cp).unwrap();
            same_tree(&before, &snapshot(fx.root()), &format!("write {n}: {e}"));
        }
    }
}
