//! MIG partitions as partitionable DRA devices (`sharedCounters` / `consumesCounters`, GA in
//! Kubernetes 1.37): a GPU in MIG mode is published as one counter set and one device per
//! profile and placement NVIDIA's tables allow (`xpu_core::mig`), so that kube-scheduler and
//! xpu's allocator can both allocate them and no two allocations overlap.
//!
//! The counter set of GPU `gpu-0000-18-00-0` is `gpu-0000-18-00-0-mig`, with one counter per
//! memory slice (`memory-slice-0` ... `memory-slice-7`, each 1), `compute-slices` (7) and
//! `media-extensions` (1, the one `+me` instance). The device `gpu-0000-18-00-0-mig-3g-71gb-4`
//! (profile `3g.71gb` at memory slice 4) consumes `memory-slice-4` ... `memory-slice-7` and 3
//! compute slices; it carries the GPU's attributes with `kind: mig`, `profile`,
//! `placementStart`, `parentUUID`, and its memory as capacity. Instances on the GPU that xpu
//! did not make are published as they are: their memory slices, compute and media extension
//! are taken, and no device that needs them is published. A GPU in MIG mode is not offered
//! whole (only `7g` takes all of it).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use xpu_core::mig::{COMPUTE_SLICES, MEMORY_SLICES, MigError, Model, Profile};
use xpu_telemetry::mig::{MigGpu, layout};

/// The `kind` attribute of a MIG device (a whole GPU's is `gpu`).
pub const KIND: &str = "mig";

/// The counter set of the GPU published as `gpu`.
pub fn counter_set_name(gpu: &str) -> String {
    format!("{gpu}-mig")
}

/// Partition names (`<gpu>-mig-<profile label>-<start>`), shared with `xpu sim dra --mig`.
pub use xpu_core::mig::{device_name, parse_device_name};

fn counter(n: u64) -> Counter {
    Counter { value: Quantity(n.to_string()) }
}

fn media(p: &Profile) -> bool {
    p.name.ends_with("+me")
}

/// The counter set and the devices of the GPU `whole` (its device as published whole) that
/// NVML reports as `mig`, in MIG mode. `Err` for a GPU whose model has no MIG table.
pub fn partitions(whole: &Device, mig: &MigGpu) -> Result<(CounterSet, Vec<Device>), MigError> {
    let model = Model::of(&mig.product)?;
    let set = counter_set_name(&whole.name);
    // What instances xpu did not make hold: never handed out again.
    let foreign = layout(model, mig.instances.iter().filter(|i| !i.by_xpu));
    let taken = foreign.taken(model);
    let mut counters: BTreeMap<String, Counter> = (0..MEMORY_SLICES)
        .map(|s| (format!("memory-slice-{s}"), counter(u64::from(!taken[s as usize]))))
        .collect();
    let compute = COMPUTE_SLICES.saturating_sub(foreign.compute_used(model));
    counters.insert("compute-slices".into(), counter(u64::from(compute)));
    counters.insert("media-extensions".into(), counter(u64::from(!foreign.media_taken())));

    let parent_uuid =
        whole.attributes.as_ref().and_then(|a| a.get("uuid")).and_then(|u| u.string.clone());
    let mut devices = Vec::new();
    for p in &model.profiles {
        for &start in p.starts {
            if foreign.check(model, p, start).is_err() {
                continue;
            }
            let mut attributes = whole.attributes.clone().unwrap_or_default();
            attributes.remove("uuid");
            let s = |v: &str| DeviceAttribute { string: Some(v.to_owned()), ..Default::default() };
            let int = |v: i64| DeviceAttribute { int: Some(v), ..Default::default() };
            attributes.insert("kind".into(), s(KIND));
            attributes.insert("profile".into(), s(p.name));
            attributes.insert("placementStart".into(), int(i64::from(start)));
            attributes.insert("placementSize".into(), int(i64::from(p.size)));
            attributes.insert("computeSlices".into(), int(i64::from(p.compute)));
            if let Some(u) = &parent_uuid {
                attributes.insert("parentUUID".into(), s(u));
            }
            let mut draws: BTreeMap<String, Counter> = (start..start + p.size)
                .map(|m| (format!("memory-slice-{m}"), counter(1)))
                .collect();
            draws.insert("compute-slices".into(), counter(u64::from(p.compute)));
            if media(p) {
                draws.insert("media-extensions".into(), counter(1));
            }
            let capacity = BTreeMap::from([(
                "memory".to_owned(),
                DeviceCapacity {
                    // NVML's size where measured (an H200's 1g.18gb has 16 GiB), else the name's.
                    value: Quantity(match p.memory_mib {
                        Some(mib) => format!("{mib}Mi"),
                        None => format!("{}G", p.memory_gb),
                    }),
                    ..Default::default()
                },
            )]);
            devices.push(Device {
                name: device_name(&whole.name, p.name, start),
                attributes: Some(attributes),
                capacity: Some(capacity),
                consumes_counters: Some(vec![DeviceCounterConsumption {
                    counter_set: set.clone(),
                    counters: draws,
                    ..Default::default()
                }]),
                ..Default::default()
            });
        }
    }
    Ok((CounterSet { name: set, counters }, devices))
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use crate::dra::slices;
    use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
    use serde_json::json;
    use xpu_core::PciAddress;
    use xpu_sched::dra::{self, Limits};
    use xpu_telemetry::mig::{FakeMig, MigControl};

    use super::*;
    use crate::claims;

    const GPU: &str = "gpu-0000-18-00-0";

    fn whole() -> Device {
        let s = |v: &str| DeviceAttribute { string: Some(v.to_owned()), ..Default::default() };
        Device {
            name: GPU.into(),
            attributes: Some(BTreeMap::from([
                ("kind".to_owned(), s("gpu")),
                ("model".to_owned(), s("H200")),
                ("uuid".to_owned(), s("GPU-1234")),
            ])),
            ..Default::default()
        }
    }

    fn addr() -> PciAddress {
        PciAddress::new(0, 0x18, 0, 0)
    }

    /// The pool as the driver publishes it ([`slices::slices`]: counter sets in a slice of
    /// their own, then the devices), read back through JSON as the API server returns it.
    fn pool(sets: &[CounterSet], devices: &[Device]) -> Vec<dra::Slice> {
        slices::slices("n1", devices, sets, 1)
            .iter()
            .map(|s| {
                let back: ResourceSlice =
                    serde_json::from_value(serde_json::to_value(s).unwrap()).unwrap();
                claims::slice(&back).unwrap()
            })
            .collect()
    }

    fn mig_claim(name: &str, profile: &str, compiled: &claims::Compiled) -> dra::Claim {
        let c: ResourceClaim = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": "default" },
            "spec": { "devices": { "requests": [{ "name": "mig", "exactly": {
                "deviceClassName": "mig.xpu.dev",
                "selectors": [{ "cel": {
                    "expression": format!("device.attributes[\"xpu.dev\"].profile == \"{profile}\"") } }],
            } }] } },
        }))
        .unwrap();
        claims::claim(&c, compiled).unwrap()
    }

    fn classes(compiled: &claims::Compiled) -> HashMap<String, dra::Class> {
        let c: DeviceClass = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": { "name": "mig.xpu.dev" },
            "spec": { "selectors": [{ "cel": { "expression":
                "device.driver == \"xpu.dev\" && device.attributes[\"xpu.dev\"].kind == \"mig\"" } }] },
        }))
        .unwrap();
        HashMap::from([("mig.xpu.dev".to_owned(), claims::class(&c, compiled).unwrap())])
    }

    /// (profile, start) of an allocated MIG device.
    fn placed(slices: &[dra::Slice], a: &dra::Allocation) -> (String, i64) {
        let by_id = dra::devices_by_id(slices);
        let d = by_id[&a.devices[0].id];
        let profile = match &d.attributes["xpu.dev/profile"] {
            dra::Value::String(s) => s.clone(),
            v => panic!("{v:?}"),
        };
        let start = match d.attributes["xpu.dev/placementStart"] {
            dra::Value::Int(i) => i,
            ref v => panic!("{v:?}"),
        };
        (profile, start)
    }

    #[test]
    fn an_h200_publishes_every_placement_and_allocates_a_1g_and_a_3g_without_overlap() {
        let mig = FakeMig::new([(addr(), "NVIDIA H200", true)]);
        let gpu = &mig.gpus().unwrap()[0];
        let (set, devices) = partitions(&whole(), gpu).unwrap();
        // 7 + 7 + 4 + 3 + 2 + 1 + 1 placements.
        assert_eq!(devices.len(), 25);
        assert_eq!(set.name, "gpu-0000-18-00-0-mig");
        assert_eq!(set.counters["compute-slices"].value.0, "7");
        let d = devices.iter().find(|d| d.name == "gpu-0000-18-00-0-mig-3g-71gb-4").unwrap();
        let draws = &d.consumes_counters.as_ref().unwrap()[0].counters;
        let keys: Vec<&str> = draws.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "compute-slices",
                "memory-slice-4",
                "memory-slice-5",
                "memory-slice-6",
                "memory-slice-7"
            ]
        );
        assert_eq!(draws["compute-slices"].value.0, "3");
        let a = d.attributes.as_ref().unwrap();
        assert_eq!(a["kind"].string.as_deref(), Some("mig"));
        assert_eq!(a["parentUUID"].string.as_deref(), Some("GPU-1234"));
        assert!(!a.contains_key("uuid"));
        assert!(devices.iter().all(|d| d.name.len() <= 63 && !d.name.contains(['.', '+'])));

        let slices = pool(&[set], &devices);
        let refs: Vec<&dra::Slice> = slices.iter().collect();
        let compiled = claims::Compiled::default();
        let classes = classes(&compiled);
        let labels = BTreeMap::new();
        let mut in_use = dra::InUse::default();
        let mut got = Vec::new();
        for (name, profile) in [("small", "1g.18gb"), ("large", "3g.71gb")] {
            let claim = mig_claim(name, profile, &compiled);
            let a =
                dra::allocate(&[claim], &classes, &refs, &in_use, "n1", &labels, Limits::default())
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            in_use.add(&a[0]);
            got.push(placed(&slices, &a[0]));
        }
        let (small, large) = (&got[0], &got[1]);
        assert_eq!(small.0, "1g.18gb");
        assert_eq!(large.0, "3g.71gb");
        let (s0, l0) = (small.1, large.1);
        assert!(!(l0..l0 + 4).contains(&s0), "no overlap: {got:?}");
        assert_eq!((s0, l0), (6, 0), "the highest placements free: {got:?}");
        assert!([0, 4].contains(&l0) && (0..7).contains(&s0));
        // What does not fit the free slices is not allocated: a 7g, and a 4g (slices 0-3 are
        // not all free when the 1g took one of them or the 3g took 0-3).
        for (name, profile) in [("all", "7g.141gb"), ("four", "4g.71gb")] {
            let claim = mig_claim(name, profile, &compiled);
            let r =
                dra::allocate(&[claim], &classes, &refs, &in_use, "n1", &labels, Limits::default());
            assert!(r.is_err(), "{name} must not fit: {r:?}");
        }
        // Seven 1g at most on the GPU: the 3g's 3 compute slices leave room for 3 more 1g.
        let mut ones = 0;
        for i in 0..7 {
            let claim = mig_claim(&format!("one-{i}"), "1g.18gb", &compiled);
            match dra::allocate(
                &[claim],
                &classes,
                &refs,
                &in_use,
                "n1",
                &labels,
                Limits::default(),
            ) {
                Ok(a) => {
                    in_use.add(&a[0]);
                    ones += 1;
                }
                Err(_) => break,
            }
        }
        // xpu's order put the 1g at slice 6 and the 3g at 0: slices 4 and 5 take two more 1g,
        // and slice 7 (no 1g starts there) is left to a 1g.35gb that no longer fits (compute).
        // First fit (1g at 0, 3g at 4) would have taken three: a greedy rule, which wins on
        // churned streams (the packing test below) and loses this one.
        assert_eq!(ones, 2, "1g at 6, 3g at 0: 1g at 4 and 5");
        let ids: Vec<&dra::DeviceId> = in_use.devices.iter().collect();
        let unique: HashSet<&&dra::DeviceId> = ids.iter().collect();
        assert_eq!(unique.len(), 4);
    }

    #[test]
    fn instances_xpu_did_not_make_take_their_slices_and_are_never_offered() {
        let mig = FakeMig::new([(addr(), "NVIDIA H200", true)]);
        mig.create_outside(addr(), "4g.71gb", 0).unwrap();
        mig.create_outside(addr(), "1g.18gb+me", 4).unwrap();
        let gpu = &mig.gpus().unwrap()[0];
        let (set, devices) = partitions(&whole(), gpu).unwrap();
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        // Slices 0-4 taken, 5 compute slices used, the media extension taken: 1g at 5 and 6,
        // 1g.35gb at 6 (slices 6-7), nothing larger.
        assert_eq!(
            names,
            [
                "gpu-0000-18-00-0-mig-1g-18gb-5",
                "gpu-0000-18-00-0-mig-1g-18gb-6",
                "gpu-0000-18-00-0-mig-1g-35gb-6",
            ]
        );
        assert_eq!(set.counters["compute-slices"].value.0, "2");
        assert_eq!(set.counters["media-extensions"].value.0, "0");
        assert_eq!(set.counters["memory-slice-0"].value.0, "0");
        assert_eq!(set.counters["memory-slice-7"].value.0, "1");
    }

    #[test]
    fn a_gpu_without_a_mig_table_is_refused_naming_it() {
        let mut gpu = FakeMig::new([(addr(), "Tesla V100", true)]).gpus().unwrap().remove(0);
        gpu.instances.clear();
        let e = partitions(&whole(), &gpu).unwrap_err();
        assert!(e.to_string().contains("\"Tesla V100\" is not a MIG-capable GPU"), "{e}");
    }

    /// The pool the publisher writes for an 8-GPU host all in MIG mode (a slice of counter sets,
    /// devices 64 to a slice) is allocated by xpu's allocator as the API server hands it back.
    #[test]
    fn xpus_allocator_places_mig_claims_on_the_pool_as_published() {
        let fx = xpu_testkit::hosts::a100_8x().build();
        let root = xpu_host::Root::new(fx.root()).unwrap();
        let inv = xpu_host::discover(&root, &Default::default()).unwrap();
        let mig =
            FakeMig::new(inv.accelerators().map(|d| (d.address, "NVIDIA A100-SXM4-40GB", true)));
        let (devices, counters) =
            slices::with_mig(slices::devices(&root, &inv), &inv, &mig.gpus().unwrap());
        let converted = pool(&counters, &devices);
        let refs: Vec<&dra::Slice> = converted.iter().collect();
        let compiled = claims::Compiled::default();
        let claim = mig_claim("c", "1g.5gb", &compiled);
        let r = dra::allocate(
            &[claim],
            &classes(&compiled),
            &refs,
            &dra::InUse::default(),
            "n1",
            &BTreeMap::new(),
            Limits::default(),
        );
        assert!(r.is_ok(), "{r:?}");
    }

    /// The profile mix of the packing streams, weighted to small partitions.
    const PROFILES: [(&str, u32); 7] = [
        ("1g.18gb", 30),
        ("1g.35gb", 10),
        ("2g.35gb", 15),
        ("3g.71gb", 15),
        ("4g.71gb", 10),
        ("7g.141gb", 10),
        ("1g.18gb+me", 2),
    ];

    /// Claims of a random stream placed, in order, on `gpus` H200s in MIG mode; each claim that
    /// does not fit is skipped. Returns the compute slices the placed claims use.
    fn stream(seed: u64, gpus: u8, claims_n: usize, churn: u64, pack: bool) -> usize {
        let mig = FakeMig::new(
            (0..gpus).map(|i| (PciAddress::new(0, 0x10 + i, 0, 0), "NVIDIA H200", true)),
        );
        let mut devices = Vec::new();
        let mut sets = Vec::new();
        for g in mig.gpus().unwrap() {
            let whole =
                Device { name: format!("gpu-{}", g.address.dns_label()), ..Default::default() };
            let (set, d) = partitions(&whole, &g).unwrap();
            sets.push(set);
            devices.extend(d);
        }
        let converted = pool(&sets, &devices);
        let refs: Vec<&dra::Slice> = converted.iter().collect();
        let compiled = claims::Compiled::default();
        let classes = classes(&compiled);
        let total: u32 = PROFILES.iter().map(|p| p.1).sum();
        let mut rng = xpu_sched::rng::Rng::new(seed);
        let mut in_use = dra::InUse::default();
        let mut held: Vec<dra::Allocation> = Vec::new();
        let mut n = 0;
        for i in 0..claims_n {
            // Churn: a placed claim ends now and then, as jobs do.
            if !held.is_empty() && rng.next_u64() % 100 < churn {
                let gone = held.swap_remove((rng.next_u64() % held.len() as u64) as usize);
                in_use.remove(&gone);
            }
            let mut pick = (rng.next_u64() % u64::from(total)) as u32;
            let profile = PROFILES
                .iter()
                .find(|p| {
                    let hit = pick < p.1;
                    pick = pick.saturating_sub(p.1);
                    hit
                })
                .unwrap()
                .0;
            let claim = mig_claim(&format!("c{i}"), profile, &compiled);
            let limits = Limits { pack, ..Limits::default() };
            if let Ok(a) =
                dra::allocate(&[claim], &classes, &refs, &in_use, "n1", &BTreeMap::new(), limits)
            {
                in_use.add(&a[0]);
                held.push(a[0].clone());
                // Compute slices: what of the GPUs the placed claims use.
                n += usize::from(profile.as_bytes()[0] - b'0');
            }
        }
        n
    }

    /// With churn (claims end as others arrive), xpu's order (the fullest GPU first, the
    /// highest placement in it) keeps room for the large partitions and places more of the
    /// GPUs' compute than upstream's first fit over the same streams; it loses on some streams
    /// (a greedy rule), so the sum is what is held. Figures:
    /// `XPU_MIG_PACK_SEEDS=20 cargo test -p xpu-kube --lib packing -- --nocapture`.
    #[test]
    fn packing_places_more_than_first_fit_over_churned_streams() {
        let (mut ours, mut theirs) = (0, 0);
        // Ten streams in the suite; XPU_MIG_PACK_SEEDS=20 for the figure in the docs.
        let seeds: u64 =
            std::env::var("XPU_MIG_PACK_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
        for seed in 1..=seeds {
            let a = stream(seed, 4, 200, 45, true);
            let b = stream(seed, 4, 200, 45, false);
            eprintln!("seed {seed}: xpu {a}, first fit {b}");
            ours += a;
            theirs += b;
        }
        eprintln!(
            "MIG compute slices placed, {seeds} streams of 200 claims with churn on 4 H200s: xpu {ours}, first fit {theirs}"
        );
        assert!(ours > theirs, "xpu {ours} vs first fit {theirs}");
    }
}
