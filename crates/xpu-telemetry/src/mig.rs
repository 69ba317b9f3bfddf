//! Making and destroying MIG instances: the NVML calls (`nvmlDeviceGetMigMode`,
//! `nvmlDeviceCreateGpuInstanceWithPlacement`, `nvmlGpuInstanceCreateComputeInstance`,
//! `nvmlGpuInstanceDestroy`) behind [`MigControl`], and [`FakeMig`], which models them with the
//! profiles, placements and instance lifetimes of `xpu_core::mig`'s tables so that everything
//! above it is tested without a GPU.
//!
//! One compute instance per GPU instance, spanning it (what `nvidia-smi mig -cgi ... -C` makes).
//! MIG mode itself is never changed here: turning it on needs a GPU reset, which is the admin's.
//! Instances xpu did not make are reported (`by_xpu: false`) and never destroyed.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use xpu_core::mig::{Layout, MigError, Model};
use xpu_core::{Inventory, PciAddress, PciDevice};
use xpu_host::Root;
use xpu_host::mig_caps::MigCaps;

pub mod smi;

/// A GPU instance and its compute instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// NVML's GPU instance id on its GPU.
    pub gi: u32,
    /// The compute instance's id in it.
    pub ci: u32,
    pub profile: &'static str,
    /// First memory slice.
    pub start: u8,
    /// `MIG-<uuid>`, what `NVIDIA_VISIBLE_DEVICES` and CUDA name it by, where the control
    /// knows it ([`smi::SmiMig`] does not).
    pub uuid: Option<String>,
    /// Made through [`MigControl::create`] (by xpu); `false`: found there.
    pub by_xpu: bool,
}

/// A GPU as MIG sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigGpu {
    pub address: PciAddress,
    /// NVML's product name (`NVIDIA H200`).
    pub product: String,
    /// MIG mode is on (current, not pending).
    pub enabled: bool,
    pub instances: Vec<Instance>,
}

/// Why an instance was not made or destroyed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigControlError {
    #[error("no GPU at {0} for MIG")]
    NoGpu(PciAddress),
    #[error(
        "MIG mode is off on the GPU at {0}; xpu leaves it as the admin set it (turning it on needs a GPU reset: nvidia-smi -i <gpu> -mig 1)"
    )]
    Disabled(PciAddress),
    #[error("the GPU at {gpu}: {source}")]
    Geometry {
        gpu: PciAddress,
        #[source]
        source: MigError,
    },
    #[error("no GPU instance {gi} on the GPU at {gpu}")]
    NoInstance { gpu: PciAddress, gi: u32 },
    #[error("GPU instance {gi} on the GPU at {gpu} was not made by xpu; it is left as it is")]
    NotOurs { gpu: PciAddress, gi: u32 },
    #[error("NVML: {0}")]
    Nvml(String),
}

/// The NVML calls MIG needs.
pub trait MigControl: Send + Sync + std::fmt::Debug {
    /// Every GPU NVML reports, with its MIG state.
    fn gpus(&self) -> Result<Vec<MigGpu>, MigControlError>;
    /// Makes a GPU instance of `profile` at memory slice `start` on the GPU at `gpu`, and a
    /// compute instance spanning it.
    fn create(
        &self,
        gpu: PciAddress,
        profile: &str,
        start: u8,
    ) -> Result<Instance, MigControlError>;
    /// Destroys GPU instance `gi` (and its compute instances) if xpu made it.
    fn destroy(&self, gpu: PciAddress, gi: u32) -> Result<(), MigControlError>;
}

/// GPU instance ids NVML hands out on one GPU (at most seven instances exist at once).
const MAX_GI: u32 = 14;

#[derive(Debug, Clone)]
struct FakeGpu {
    product: String,
    enabled: bool,
    instances: Vec<Instance>,
}

/// MIG as NVML would do it on the GPUs it is given, by NVIDIA's tables. [`FakeMig::open`] keeps
/// its state in a file, as the driver keeps it across a process's restarts, so that a test can
/// run `xpu k8s dra-driver --fake-mig FILE` as a process and read back what it made.
#[derive(Debug, Clone, Default)]
pub struct FakeMig {
    gpus: Arc<Mutex<BTreeMap<PciAddress, FakeGpu>>>,
    file: Option<PathBuf>,
}

/// [`FakeMig`]'s state file: `{"gpus": [{"address": "0000:25:00.0", "product": "NVIDIA H200",
/// "enabled": true, "instances": [{"gi": 1, "profile": "1g.18gb", "start": 0, "byXpu": true}]}]}`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct StateFile {
    gpus: Vec<GpuState>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuState {
    address: String,
    product: String,
    enabled: bool,
    #[serde(default)]
    instances: Vec<InstanceState>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct InstanceState {
    gi: u32,
    profile: String,
    start: u8,
    by_xpu: bool,
}

/// State files larger than this are refused.
const MAX_STATE_BYTES: u64 = 1 << 20;

impl FakeMig {
    /// GPUs by address, with their product name and whether MIG mode is on.
    pub fn new<'a>(gpus: impl IntoIterator<Item = (PciAddress, &'a str, bool)>) -> Self {
        let map = gpus
            .into_iter()
            .map(|(a, product, enabled)| {
                (a, FakeGpu { product: product.to_owned(), enabled, instances: Vec::new() })
            })
            .collect();
        FakeMig { gpus: Arc::new(Mutex::new(map)), file: None }
    }

    /// The fake whose state is the file at `path` (read now and before every call, as another
    /// process may change it the way an admin's `nvidia-smi` would; rewritten after every
    /// change).
    pub fn open(path: &Path) -> Result<FakeMig, MigControlError> {
        let map = Self::load(path)?;
        Ok(FakeMig { gpus: Arc::new(Mutex::new(map)), file: Some(path.to_owned()) })
    }

    /// Reads the state file again, when there is one.
    fn reload(&self, gpus: &mut BTreeMap<PciAddress, FakeGpu>) -> Result<(), MigControlError> {
        if let Some(path) = &self.file {
            *gpus = Self::load(path)?;
        }
        Ok(())
    }

    fn load(path: &Path) -> Result<BTreeMap<PciAddress, FakeGpu>, MigControlError> {
        let bad = |why: String| {
            MigControlError::Nvml(format!("fake MIG state {}: {why}", path.display()))
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_STATE_BYTES + 1).read_to_end(&mut bytes))
            .map_err(|e| bad(e.to_string()))?;
        if bytes.len() as u64 > MAX_STATE_BYTES {
            return Err(bad(format!("larger than {MAX_STATE_BYTES} bytes")));
        }
        let state: StateFile = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        let mut map = BTreeMap::new();
        for g in state.gpus {
            let address: PciAddress = g.address.parse().map_err(|e| bad(format!("{e}")))?;
            let model = Model::of(&g.product).map_err(|e| bad(format!("{}: {e}", g.address)))?;
            let mut instances = Vec::new();
            for i in g.instances {
                let p =
                    model.profile(&i.profile).map_err(|e| bad(format!("{}: {e}", g.address)))?;
                instances.push(Instance {
                    gi: i.gi,
                    ci: 0,
                    profile: p.name,
                    start: i.start,
                    uuid: Some(mig_uuid(address, i.gi)),
                    by_xpu: i.by_xpu,
                });
            }
            map.insert(address, FakeGpu { product: g.product, enabled: g.enabled, instances });
        }
        Ok(map)
    }

    /// Writes the state file (when there is one).
    fn save(&self, gpus: &BTreeMap<PciAddress, FakeGpu>) -> Result<(), MigControlError> {
        let Some(path) = &self.file else { return Ok(()) };
        let state = StateFile {
            gpus: gpus
                .iter()
                .map(|(a, g)| GpuState {
                    address: a.to_string(),
                    product: g.product.clone(),
                    enabled: g.enabled,
                    instances: g
                        .instances
                        .iter()
                        .map(|i| InstanceState {
                            gi: i.gi,
                            profile: i.profile.to_owned(),
                            start: i.start,
                            by_xpu: i.by_xpu,
                        })
                        .collect(),
                })
                .collect(),
        };
        let json =
            serde_json::to_vec_pretty(&state).map_err(|e| MigControlError::Nvml(e.to_string()))?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| MigControlError::Nvml(format!("fake MIG state {}: {e}", path.display())))
    }

    /// An instance made behind xpu's back (by `nvidia-smi`, or another tool).
    pub fn create_outside(
        &self,
        gpu: PciAddress,
        profile: &str,
        start: u8,
    ) -> Result<Instance, MigControlError> {
        self.make(gpu, profile, start, false)
    }

    /// Destroys any instance, as `nvidia-smi mig -dgi` would behind xpu's back.
    pub fn destroy_outside(&self, gpu: PciAddress, gi: u32) -> Result<(), MigControlError> {
        self.remove(gpu, gi, false)
    }

    /// Removes instance `gi` of `gpu`; `ours_only`: refuse one xpu did not make.
    fn remove(&self, gpu: PciAddress, gi: u32, ours_only: bool) -> Result<(), MigControlError> {
        let mut gpus = self.gpus.lock().unwrap_or_else(PoisonError::into_inner);
        self.reload(&mut gpus)?;
        let g = gpus.get_mut(&gpu).ok_or(MigControlError::NoGpu(gpu))?;
        let i = g
            .instances
            .iter()
            .position(|i| i.gi == gi)
            .ok_or(MigControlError::NoInstance { gpu, gi })?;
        if ours_only && !g.instances[i].by_xpu {
            return Err(MigControlError::NotOurs { gpu, gi });
        }
        g.instances.remove(i);
        self.save(&gpus)
    }

    fn make(
        &self,
        gpu: PciAddress,
        profile: &str,
        start: u8,
        by_xpu: bool,
    ) -> Result<Instance, MigControlError> {
        let mut gpus = self.gpus.lock().unwrap_or_else(PoisonError::into_inner);
        self.reload(&mut gpus)?;
        let g = gpus.get_mut(&gpu).ok_or(MigControlError::NoGpu(gpu))?;
        let p = check_create(gpu, &g.product, g.enabled, &g.instances, profile, start)?;
        let gi = (0..=MAX_GI)
            .find(|id| !g.instances.iter().any(|i| i.gi == *id))
            .ok_or_else(|| MigControlError::Nvml("no free GPU instance id".into()))?;
        let i =
            Instance { gi, ci: 0, profile: p.name, start, uuid: Some(mig_uuid(gpu, gi)), by_xpu };
        g.instances.push(i.clone());
        self.save(&gpus)?;
        Ok(i)
    }
}

/// The profile to make at memory slice `start` on the GPU at `gpu` (NVML's `product`, MIG mode
/// `enabled`, holding `instances`), if NVIDIA's tables allow it there: checked before any
/// instance is made, so that what the driver would refuse is refused naming why.
pub fn check_create(
    gpu: PciAddress,
    product: &str,
    enabled: bool,
    instances: &[Instance],
    profile: &str,
    start: u8,
) -> Result<&'static xpu_core::mig::Profile, MigControlError> {
    if !enabled {
        return Err(MigControlError::Disabled(gpu));
    }
    let geometry = |source| MigControlError::Geometry { gpu, source };
    let model = Model::of(product).map_err(geometry)?;
    let p = model.profile(profile).map_err(geometry)?;
    layout(model, instances).check(model, p, start).map_err(geometry)?;
    Ok(p)
}

/// A GPU's MIG state as `xpu discover --mig` reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    pub address: String,
    pub product: String,
    /// `enabled` or `disabled`.
    pub mig_mode: &'static str,
    pub instances: Vec<InstanceReport>,
}

/// One instance of a [`GpuReport`], with its capability nodes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceReport {
    pub gpu_instance: u32,
    pub compute_instance: u32,
    pub profile: &'static str,
    pub start: u8,
    pub uuid: Option<String>,
    pub by_xpu: bool,
    /// `/dev/nvidia-caps/nvidia-cap<N>` of the GPU instance's and the compute instance's
    /// `access` (empty when the host's `mig-minors` does not list them).
    pub capability_nodes: Vec<String>,
}

/// Each GPU of `gpus` with its instances and their capability nodes (from `root`'s
/// `/proc/driver/nvidia-caps/mig-minors` and the GPU's minor in `inv`), and why any were not
/// found.
pub fn report(root: &Root, inv: &Inventory, gpus: &[MigGpu]) -> (Vec<GpuReport>, Vec<String>) {
    let mut warnings = Vec::new();
    let caps = match MigCaps::read(root) {
        Ok(c) => Some(c),
        Err(e) if gpus.iter().any(|g| !g.instances.is_empty()) => {
            warnings.push(format!("MIG capability nodes not listed: {e}"));
            None
        }
        Err(_) => None,
    };
    let reports = gpus
        .iter()
        .map(|g| {
            let minor = inv.device(&g.address).and_then(PciDevice::nvidia_minor);
            let instances = g
                .instances
                .iter()
                .map(|i| {
                    let capability_nodes = match (&caps, minor) {
                        (Some(c), Some(m)) => match c.instance(m, i.gi, i.ci) {
                            Ok(n) => n.into_iter().map(|n| n.path).collect(),
                            Err(e) => {
                                warnings.push(format!("{} GPU instance {}: {e}", g.address, i.gi));
                                Vec::new()
                            }
                        },
                        _ => Vec::new(),
                    };
                    InstanceReport {
                        gpu_instance: i.gi,
                        compute_instance: i.ci,
                        profile: i.profile,
                        start: i.start,
                        uuid: i.uuid.clone(),
                        by_xpu: i.by_xpu,
                        capability_nodes,
                    }
                })
                .collect();
            GpuReport {
                address: g.address.to_string(),
                product: g.product.clone(),
                mig_mode: if g.enabled { "enabled" } else { "disabled" },
                instances,
            }
        })
        .collect();
    (reports, warnings)
}

/// `instances` (all of a GPU's, or some of them) as a [`Layout`]. One NVML reports that the
/// tables refuse (a profile the model lacks, a clash) is left out, with a warning: what is
/// published from the layout then never hands out more than the tables allow.
pub fn layout<'a>(model: &Model, instances: impl IntoIterator<Item = &'a Instance>) -> Layout {
    let mut l = Layout::default();
    for i in instances {
        if let Err(e) = model.profile(i.profile).and_then(|p| l.place(model, p, i.start)) {
            tracing::warn!(gi = i.gi, error = %e, "a MIG instance NVML reports is not in xpu's tables");
        }
    }
    l
}

/// A stable MIG UUID for the fake: the GPU's address and the instance id.
fn mig_uuid(gpu: PciAddress, gi: u32) -> String {
    format!(
        "MIG-{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        u32::from(gpu.bus) << 16 | u32::from(gpu.device) << 8 | u32::from(gpu.function),
        gpu.domain,
        gi,
        0,
        u64::from(gi)
    )
}

impl MigControl for FakeMig {
    fn gpus(&self) -> Result<Vec<MigGpu>, MigControlError> {
        let mut gpus = self.gpus.lock().unwrap_or_else(PoisonError::into_inner);
        self.reload(&mut gpus)?;
        Ok(gpus
            .iter()
            .map(|(a, g)| MigGpu {
                address: *a,
                product: g.product.clone(),
                enabled: g.enabled,
                instances: g.instances.clone(),
            })
            .collect())
    }

    fn create(
        &self,
        gpu: PciAddress,
        profile: &str,
        start: u8,
    ) -> Result<Instance, MigControlError> {
        self.make(gpu, profile, start, true)
    }

    fn destroy(&self, gpu: PciAddress, gi: u32) -> Result<(), MigControlError> {
        self.remove(gpu, gi, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(bus: u8) -> PciAddress {
        PciAddress { domain: 0, bus, device: 0, function: 0 }
    }

    #[test]
    fn instances_are_made_at_valid_placements_and_destroyed_exactly() {
        let (h200, off) = (addr(0x18), addr(0x2a));
        let mig = FakeMig::new([(h200, "NVIDIA H200", true), (off, "NVIDIA H200", false)]);
        let small = mig.create(h200, "1g.18gb", 0).unwrap();
        let big = mig.create(h200, "3g.71gb", 4).unwrap();
        assert_eq!((small.gi, big.gi), (0, 1));
        assert_ne!(small.uuid, big.uuid);
        assert!(small.uuid.as_deref().unwrap().starts_with("MIG-"));
        // What does not fit the free slices is refused, naming why.
        let e = mig.create(h200, "4g.71gb", 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the GPU at 0000:18:00.0: MIG profile 4g.71gb at memory slice 0 overlaps the 1g.18gb instance at slice 0"
        );
        let e = mig.create(h200, "3g.40gb", 0).unwrap_err();
        assert!(e.to_string().contains("no MIG profile \"3g.40gb\" on the H200"), "{e}");
        let e = mig.create(off, "1g.18gb", 0).unwrap_err();
        assert!(e.to_string().contains("MIG mode is off on the GPU at 0000:2a:00.0"), "{e}");
        // Destroying one leaves the other.
        mig.destroy(h200, big.gi).unwrap();
        let gpus = mig.gpus().unwrap();
        let g = gpus.iter().find(|g| g.address == h200).unwrap();
        assert_eq!(g.instances, std::slice::from_ref(&small));
        assert_eq!(
            mig.destroy(h200, big.gi).unwrap_err(),
            MigControlError::NoInstance { gpu: h200, gi: 1 }
        );
    }

    #[test]
    fn instances_made_outside_are_reported_and_never_destroyed() {
        let gpu = addr(0x18);
        let mig = FakeMig::new([(gpu, "NVIDIA H100 80GB HBM3", true)]);
        let theirs = mig.create_outside(gpu, "2g.20gb", 0).unwrap();
        assert!(!theirs.by_xpu);
        // Their slices are taken.
        assert!(mig.create(gpu, "1g.10gb", 1).is_err());
        let ours = mig.create(gpu, "1g.10gb", 2).unwrap();
        assert_eq!(
            mig.destroy(gpu, theirs.gi).unwrap_err(),
            MigControlError::NotOurs { gpu, gi: theirs.gi }
        );
        mig.destroy_outside(gpu, theirs.gi).unwrap();
        assert_eq!(mig.gpus().unwrap()[0].instances, [ours]);
    }

    #[test]
    fn the_state_file_keeps_instances_across_opens_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mig.json");
        std::fs::write(
            &path,
            r#"{"gpus":[{"address":"0000:25:00.0","product":"NVIDIA H200","enabled":true,
               "instances":[{"gi":3,"profile":"1g.18gb","start":6,"byXpu":false}]}]}"#,
        )
        .unwrap();
        let a = FakeMig::open(&path).unwrap();
        let made = a.create(addr(0x25), "3g.71gb", 0).unwrap();
        let b = FakeMig::open(&path).unwrap();
        let seen = b.gpus().unwrap().remove(0).instances;
        assert_eq!(seen.len(), 2);
        assert!(seen.contains(&made), "{seen:?}");
        b.destroy(addr(0x25), made.gi).unwrap();
        assert_eq!(FakeMig::open(&path).unwrap().gpus().unwrap()[0].instances.len(), 1);

        for bad in [
            r#"{"gpus":[{"address":"25","product":"NVIDIA H200","enabled":true}]}"#,
            r#"{"gpus":[{"address":"0000:25:00.0","product":"NVIDIA T4","enabled":true}]}"#,
            r#"{"gpus":[{"address":"0000:25:00.0","product":"NVIDIA H200","enabled":true,"instances":[{"gi":1,"profile":"9g","start":0,"byXpu":true}]}]}"#,
        ] {
            std::fs::write(&path, bad).unwrap();
            let e = FakeMig::open(&path).unwrap_err();
            assert!(e.to_string().contains("mig.json"), "{e}");
        }
    }
}
