//! NVIDIA Multi-Instance GPU geometry: the GPU instance profiles of the A100 (40 GB and 80 GB),
//! H100 (80 GB) and H200 (141 GB), each with its NVML profile id, compute slices, memory, the
//! most instances of it a GPU holds and the placements NVML reports for it (a start and a size
//! in the GPU's eight memory slices), from NVIDIA's MIG User Guide ("Supported MIG Profiles"):
//!
//! | profile (A100 40GB / A100 80GB, H100 / H200) | id | compute | placements {start}:size | max |
//! |---|---|---|---|---|
//! | 1g.5gb / 1g.10gb / 1g.18gb | 19 | 1 | {0,1,2,3,4,5,6}:1 | 7 |
//! | 1g.5gb+me / 1g.10gb+me / 1g.18gb+me | 20 | 1 | {0,1,2,3,4,5,6}:1 | 1 |
//! | 1g.10gb / 1g.20gb / 1g.35gb | 15 | 1 | {0,2,4,6}:2 | 4 |
//! | 2g.10gb / 2g.20gb / 2g.35gb | 14 | 2 | {0,2,4}:2 | 3 |
//! | 3g.20gb / 3g.40gb / 3g.71gb | 9 | 3 | {0,4}:4 | 2 |
//! | 4g.20gb / 4g.40gb / 4g.71gb | 5 | 4 | {0}:4 | 1 |
//! | 7g.40gb / 7g.80gb / 7g.141gb | 0 | 7 | {0}:8 | 1 |
//!
//! A [`Layout`] is one GPU's instances: a placement is free when none of its memory slices is
//! taken, the GPU's seven compute slices are not over-drawn and the profile is under its
//! maximum. No I/O: the NVML calls that make and destroy instances are behind
//! `xpu_telemetry::mig`, whose fake uses these tables.

/// Memory slices of a MIG-capable GPU (placements are counted in them).
pub const MEMORY_SLICES: u8 = 8;
/// Compute slices (GPCs) a GPU gives its instances.
pub const COMPUTE_SLICES: u8 = 7;

/// A GPU instance profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    /// NVIDIA's name, `1g.18gb`.
    pub name: &'static str,
    /// NVML's GPU instance profile id (`NVML_GPU_INSTANCE_PROFILE_*`).
    pub id: u32,
    /// Compute slices.
    pub compute: u8,
    /// Memory slices a placement spans.
    pub size: u8,
    /// Its memory, in GB as the name says.
    pub memory_gb: u16,
    /// Its memory as NVML reports it (`memorySizeMB`, MiB), where measured on a real GPU: less
    /// than the name says (an H200's `1g.18gb` has 16,384 MiB). `None`: not measured here.
    pub memory_mib: Option<u32>,
    /// The memory slices a placement may start at.
    pub starts: &'static [u8],
    /// The most instances of this profile one GPU holds.
    pub max: u8,
}

/// A MIG-capable GPU model: its profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Model {
    /// What the product name contains (`H200`, `A100-SXM4-80GB`).
    pub name: &'static str,
    pub memory_gb: u16,
    pub profiles: [Profile; 7],
}

const ALL: &[u8] = &[0, 1, 2, 3, 4, 5, 6];

const fn profile(
    name: &'static str,
    id: u32,
    compute: u8,
    size: u8,
    memory_gb: u16,
    starts: &'static [u8],
    max: u8,
) -> Profile {
    Profile { name, id, compute, size, memory_gb, memory_mib: None, starts, max }
}

/// The seven profiles of a model, named `names` with memory `mem` (GB), in the table's order:
/// only names and memory differ between the models.
const fn profiles(names: [&'static str; 7], mem: [u16; 7]) -> [Profile; 7] {
    [
        profile(names[0], 19, 1, 1, mem[0], ALL, 7),
        profile(names[1], 20, 1, 1, mem[1], ALL, 1),
        profile(names[2], 15, 1, 2, mem[2], &[0, 2, 4, 6], 4),
        profile(names[3], 14, 2, 2, mem[3], &[0, 2, 4], 3),
        profile(names[4], 9, 3, 4, mem[4], &[0, 4], 2),
        profile(names[5], 5, 4, 4, mem[5], &[0], 1),
        profile(names[6], 0, 7, 8, mem[6], &[0], 1),
    ]
}

/// The profiles of the 80 GB parts (A100 80GB, H100 80GB): the same names and memory.
const PROFILES_80GB: [Profile; 7] = profiles(
    ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    [10, 10, 20, 20, 40, 40, 80],
);

/// `profiles` with NVML's memory sizes (MiB, the table's order).
const fn measured(mut p: [Profile; 7], mib: [u32; 7]) -> [Profile; 7] {
    let mut i = 0;
    while i < 7 {
        p[i].memory_mib = Some(mib[i]);
        i += 1;
    }
    p
}

/// The MIG-capable models xpu knows, most specific name first.
pub const MODELS: &[Model] = &[
    Model {
        name: "H200",
        memory_gb: 141,
        // Memory as NVML reported it on an H200 with driver 580.159.04
        // (src/testdata/nvml-mig-h200.json).
        profiles: measured(
            profiles(
                ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
                [18, 18, 35, 35, 71, 71, 141],
            ),
            [16384, 16384, 33280, 33280, 71424, 71424, 143360],
        ),
    },
    Model { name: "H100", memory_gb: 80, profiles: PROFILES_80GB },
    Model { name: "A100-SXM4-80GB", memory_gb: 80, profiles: PROFILES_80GB },
    Model {
        name: "A100",
        memory_gb: 40,
        profiles: profiles(
            ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
            [5, 5, 10, 10, 20, 20, 40],
        ),
    },
];

/// What is wrong with a MIG request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    #[error(
        "{0:?} is not a MIG-capable GPU xpu knows; MIG profiles are known for the A100 (40 and 80 GB), H100 80GB and H200"
    )]
    UnknownModel(String),
    #[error("no MIG profile {profile:?} on the {model}; it offers {offered}")]
    UnknownProfile { profile: String, model: &'static str, offered: String },
    #[error(
        "MIG profile {profile} cannot start at memory slice {start}; its placements start at {starts:?}"
    )]
    BadPlacement { profile: &'static str, start: u8, starts: &'static [u8] },
    #[error("MIG profile {profile} at memory slice {start} overlaps {by}")]
    Occupied { profile: &'static str, start: u8, by: String },
    #[error(
        "MIG profile {profile} needs {need} compute slices; only {free} of the GPU's {COMPUTE_SLICES} are free"
    )]
    NoCompute { profile: &'static str, need: u8, free: u8 },
    #[error("the GPU already holds {max} instance(s) of MIG profile {profile}, its most")]
    AtMax { profile: &'static str, max: u8 },
    #[error("no MIG instance of profile {profile} starts at memory slice {start} on this GPU")]
    NotPlaced { profile: &'static str, start: u8 },
}

/// A profile's name as a DNS label: `1g.18gb+me` → `1g-18gb-me`.
pub fn label(profile: &str) -> String {
    profile.replace(['.', '+'], "-")
}

/// The device of `profile` at memory slice `start` of the GPU named `gpu`, as xpu's DRA driver
/// names partitions: `gpu-0000-18-00-0-mig-3g-71gb-4`.
pub fn device_name(gpu: &str, profile: &str, start: u8) -> String {
    format!("{gpu}-mig-{}-{start}", label(profile))
}

/// The GPU's name, the profile's label and the placement of a partition's [`device_name`]:
/// `gpu-0000-18-00-0-mig-3g-71gb-4` → (`gpu-0000-18-00-0`, `3g-71gb`, 4).
pub fn parse_device_name(name: &str) -> Option<(&str, &str, u8)> {
    let (rest, start) = name.rsplit_once('-')?;
    let (gpu, profile) = rest.split_once("-mig-")?;
    Some((gpu, profile, start.parse().ok()?))
}

impl Model {
    /// The profile whose [`label`] is `label` (`1g-18gb-me` → `1g.18gb+me`).
    pub fn profile_by_label(&self, l: &str) -> Option<&Profile> {
        self.profiles.iter().find(|p| label(p.name) == l)
    }

    /// The model whose name the GPU's product name (`NVIDIA H200`, `A100-SXM4-40GB`) contains.
    pub fn of(product: &str) -> Result<&'static Model, MigError> {
        let p = product.to_ascii_uppercase();
        MODELS
            .iter()
            .find(|m| p.contains(m.name))
            .ok_or_else(|| MigError::UnknownModel(product.to_owned()))
    }

    /// The profile named `name` (`3g.71gb`).
    pub fn profile(&self, name: &str) -> Result<&Profile, MigError> {
        self.profiles.iter().find(|p| p.name == name).ok_or_else(|| MigError::UnknownProfile {
            profile: name.to_owned(),
            model: self.name,
            offered: self.profiles.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        })
    }
}

/// An instance of a layout: its profile and first memory slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Placed {
    pub profile: &'static str,
    pub start: u8,
}

/// One GPU's instances.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    placed: Vec<Placed>,
}

impl Layout {
    pub fn instances(&self) -> &[Placed] {
        &self.placed
    }

    /// Compute slices the instances use.
    pub fn compute_used(&self, model: &Model) -> u8 {
        self.placed.iter().map(|q| Self::span(model, q).2).sum()
    }

    /// Per memory slice, whether an instance spans it.
    pub fn taken(&self, model: &Model) -> [bool; MEMORY_SLICES as usize] {
        let mut taken = [false; MEMORY_SLICES as usize];
        for q in &self.placed {
            let (lo, hi, _) = Self::span(model, q);
            for s in lo..hi.min(MEMORY_SLICES) {
                taken[s as usize] = true;
            }
        }
        taken
    }

    /// Whether an instance holds the GPU's media extension (a `+me` profile).
    pub fn media_taken(&self) -> bool {
        self.placed.iter().any(|q| q.profile.ends_with("+me"))
    }

    fn span(model: &Model, p: &Placed) -> (u8, u8, u8) {
        let size = model.profile(p.profile).map_or(0, |x| x.size);
        let compute = model.profile(p.profile).map_or(0, |x| x.compute);
        (p.start, p.start.saturating_add(size), compute)
    }

    /// Whether `profile` may be placed at `start` now; the reason when not.
    pub fn check(&self, model: &Model, profile: &Profile, start: u8) -> Result<(), MigError> {
        if !profile.starts.contains(&start) {
            return Err(MigError::BadPlacement {
                profile: profile.name,
                start,
                starts: profile.starts,
            });
        }
        let (lo, hi) = (start, start + profile.size);
        if let Some(by) = self.placed.iter().find(|q| {
            let (a, b, _) = Self::span(model, q);
            a < hi && lo < b
        }) {
            return Err(MigError::Occupied {
                profile: profile.name,
                start,
                by: format!("the {} instance at slice {}", by.profile, by.start),
            });
        }
        let free = COMPUTE_SLICES.saturating_sub(self.compute_used(model));
        if profile.compute > free {
            return Err(MigError::NoCompute { profile: profile.name, need: profile.compute, free });
        }
        if self.placed.iter().filter(|q| q.profile == profile.name).count() >= profile.max as usize
        {
            return Err(MigError::AtMax { profile: profile.name, max: profile.max });
        }
        Ok(())
    }

    /// Places `profile` at `start`.
    pub fn place(&mut self, model: &Model, profile: &Profile, start: u8) -> Result<(), MigError> {
        self.check(model, profile, start)?;
        self.placed.push(Placed { profile: profile.name, start });
        self.placed.sort();
        Ok(())
    }

    /// Removes the instance of `profile` at `start`.
    pub fn remove(&mut self, profile: &Profile, start: u8) -> Result<(), MigError> {
        let i = self
            .placed
            .iter()
            .position(|q| q.profile == profile.name && q.start == start)
            .ok_or(MigError::NotPlaced { profile: profile.name, start })?;
        self.placed.remove(i);
        Ok(())
    }

    /// The starts at which `profile` may be placed now.
    pub fn free_starts(&self, model: &Model, profile: &Profile) -> Vec<u8> {
        profile.starts.iter().copied().filter(|s| self.check(model, profile, *s).is_ok()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_model_is_found_by_its_product_name_and_has_nvidias_profiles() {
        let h200 = Model::of("NVIDIA H200").unwrap();
        assert_eq!(h200.name, "H200");
        let names: Vec<&str> = h200.profiles.iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
        );
        assert_eq!(Model::of("NVIDIA A100-SXM4-80GB").unwrap().profiles[6].name, "7g.80gb");
        assert_eq!(Model::of("A100-SXM4-40GB").unwrap().profiles[0].name, "1g.5gb");
        assert_eq!(Model::of("NVIDIA H100 80GB HBM3").unwrap().profiles[4].name, "3g.40gb");
        let e = Model::of("Tesla V100-SXM2-16GB").unwrap_err();
        assert!(e.to_string().contains("V100") && e.to_string().contains("H200"), "{e}");
        for m in MODELS {
            let ids: Vec<u32> = m.profiles.iter().map(|p| p.id).collect();
            assert_eq!(ids, [19, 20, 15, 14, 9, 5, 0], "{}", m.name);
            for p in &m.profiles {
                assert!(p.starts.iter().all(|s| s + p.size <= MEMORY_SLICES), "{}", p.name);
                assert!(p.compute <= COMPUTE_SLICES);
                let gb: u16 = p
                    .name
                    .split('.')
                    .nth(1)
                    .unwrap()
                    .trim_end_matches("+me")
                    .trim_end_matches("gb")
                    .parse()
                    .unwrap();
                assert_eq!(gb, p.memory_gb, "{}", p.name);
            }
        }
    }

    /// The H200's table against what NVML reported on a real H200 (driver 580.159.04, MIG
    /// mode off: NVML lists profiles and placements whatever the mode): every profile NVML
    /// offers is in the table with its id, compute slices, most instances, memory and exactly
    /// its placements, and the table has nothing NVML does not offer.
    #[test]
    fn the_h200_table_is_what_nvml_reports_on_a_real_h200() {
        let nvml: serde_json::Value =
            serde_json::from_str(include_str!("testdata/nvml-mig-h200.json")).unwrap();
        let m = Model::of(nvml["name"].as_str().unwrap()).unwrap();
        let offered = nvml["profiles"].as_array().unwrap();
        assert_eq!(offered.len(), m.profiles.len());
        for n in offered {
            let label = n["name"].as_str().unwrap().strip_prefix("MIG ").unwrap();
            let p = m.profile(label).unwrap_or_else(|e| panic!("{label}: {e}"));
            let num = |k: &str| n[k].as_u64().unwrap();
            assert_eq!(u64::from(p.id), num("id"), "{label}");
            assert_eq!(u64::from(p.compute), num("sliceCount"), "{label}");
            assert_eq!(u64::from(p.max), num("instanceCount"), "{label}");
            assert_eq!(p.memory_mib.map(u64::from), Some(num("memorySizeMB")), "{label}");
            let placements: Vec<(u8, u8)> = n["placements"]
                .as_array()
                .unwrap()
                .iter()
                .map(|pl| (pl[0].as_u64().unwrap() as u8, pl[1].as_u64().unwrap() as u8))
                .collect();
            let ours: Vec<(u8, u8)> = p.starts.iter().map(|&s| (s, p.size)).collect();
            assert_eq!(placements, ours, "{label}");
        }
    }

    #[test]
    fn an_h200_takes_a_1g_and_a_3g_at_valid_placements_and_refuses_what_does_not_fit() {
        let m = Model::of("NVIDIA H200").unwrap();
        let (g1, g3, g4, g7) = (
            m.profile("1g.18gb").unwrap(),
            m.profile("3g.71gb").unwrap(),
            m.profile("4g.71gb").unwrap(),
            m.profile("7g.141gb").unwrap(),
        );
        let mut l = Layout::default();
        l.place(m, g3, 4).unwrap();
        assert_eq!(l.free_starts(m, g1), [0, 1, 2, 3]);
        l.place(m, g1, 0).unwrap();
        assert_eq!(l.free_starts(m, g3), Vec::<u8>::new(), "slices 0-3 are not all free");
        assert_eq!(l.free_starts(m, g7), Vec::<u8>::new());
        assert!(matches!(l.check(m, g4, 0), Err(MigError::Occupied { .. })));
        let e = l.place(m, g1, 5).unwrap_err();
        assert_eq!(
            e.to_string(),
            "MIG profile 1g.18gb at memory slice 5 overlaps the 3g.71gb instance at slice 4"
        );
        let e = l.place(m, g3, 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "MIG profile 3g.71gb cannot start at memory slice 2; its placements start at [0, 4]"
        );
        let e = m.profile("3g.40gb").unwrap_err();
        assert!(
            e.to_string().contains("no MIG profile \"3g.40gb\" on the H200; it offers 1g.18gb,"),
            "{e}"
        );
        l.remove(g3, 4).unwrap();
        assert_eq!(l.instances(), [Placed { profile: "1g.18gb", start: 0 }]);
        assert!(l.remove(g3, 4).is_err());
    }

    #[test]
    fn compute_and_per_profile_limits_hold() {
        let m = Model::of("A100-SXM4-40GB").unwrap();
        let g1 = m.profile("1g.5gb").unwrap();
        let me = m.profile("1g.5gb+me").unwrap();
        let big1 = m.profile("1g.10gb").unwrap();
        let mut l = Layout::default();
        for s in 0..6 {
            l.place(m, g1, s).unwrap();
        }
        l.place(m, me, 6).unwrap();
        // Seven compute slices drawn: nothing more fits, whatever the memory.
        assert_eq!(l.free_starts(m, big1), Vec::<u8>::new());
        let mut l = Layout::default();
        l.place(m, me, 0).unwrap();
        assert_eq!(
            l.place(m, me, 1).unwrap_err(),
            MigError::AtMax { profile: "1g.5gb+me", max: 1 }
        );
        // 4g + 3g: the whole GPU in two.
        let mut l = Layout::default();
        l.place(m, m.profile("4g.20gb").unwrap(), 0).unwrap();
        l.place(m, m.profile("3g.20gb").unwrap(), 4).unwrap();
        assert_eq!(l.free_starts(m, g1), Vec::<u8>::new());
    }

    /// Random place/remove sequences: a placement is accepted exactly when no accepted one
    /// overlaps it, compute stays within seven, and each profile within its maximum.
    #[test]
    fn random_layouts_never_overlap_or_overdraw() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for m in MODELS {
            let mut l = Layout::default();
            for _ in 0..2000 {
                let p = &m.profiles[(next() % 7) as usize];
                let start = (next() % 8) as u8;
                if next() % 3 == 0 && !l.instances().is_empty() {
                    let q = l.instances()[(next() % l.instances().len() as u64) as usize];
                    l.remove(m.profile(q.profile).unwrap(), q.start).unwrap();
                    continue;
                }
                // Most random placements are refused; the invariants below are what is checked.
                let _ = l.place(m, p, start);
                let mut mem = [0u8; 8];
                let mut compute = 0;
                for q in l.instances() {
                    let qp = m.profile(q.profile).unwrap();
                    assert!(qp.starts.contains(&q.start));
                    for s in q.start..q.start + qp.size {
                        mem[s as usize] += 1;
                    }
                    compute += qp.compute;
                }
                assert!(mem.iter().all(|&n| n <= 1), "{:?}", l.instances());
                assert!(compute <= COMPUTE_SLICES);
                for qp in &m.profiles {
                    let n = l.instances().iter().filter(|q| q.profile == qp.name).count();
                    assert!(n <= qp.max as usize);
                }
            }
        }
    }
}
