//! TPU slice topology math: parse a GKE `cloud.google.com/gke-tpu-topology` value (`2x2x4`,
//! `4x4`), check it against the generation's dimensionality, and work out how many chips and
//! hosts (Kubernetes nodes, one TPU VM each) the slice has.
//!
//! The rules follow GKE's "Plan TPUs in GKE" page: v4, v5p and TPU7x use 3-D topologies and four
//! chips per VM; v5e and v6e use 2-D topologies, and their single-host shapes (`1x1`, `2x2`,
//! `2x4`) fit on one VM of 1, 4 or 8 chips, while larger shapes are built from 4-chip VMs
//! (`4x4` = 16 chips = 4 VMs, as in the flex-start guide's `--max-nodes=4`). This module does no
//! I/O and knows nothing of nodes; the scheduler turns a [`SliceShape`] into a gang of tasks.

use crate::accel::{Accelerator, TpuFacts, tpu_by_name};

/// What is wrong with a TPU accelerator/topology pair.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TpuError {
    #[error(
        "unknown TPU accelerator {0:?}; use a GKE accelerator label such as tpu-v5p-slice, \
         tpu-v5-lite-podslice, tpu-v6e-slice, tpu-v4-podslice or tpu7x"
    )]
    UnknownAccelerator(String),
    #[error(
        "TPU topology {topology:?} is malformed: {reason}; write it as AxB or AxBxC, e.g. 2x2x4"
    )]
    Malformed { topology: String, reason: &'static str },
    #[error(
        "TPU topology {topology:?} has {got} dimensions but {accelerator} slices are {want}-D; \
         use a topology like {example}"
    )]
    WrongDimensions {
        topology: String,
        accelerator: String,
        got: usize,
        want: u8,
        example: &'static str,
    },
    #[error(
        "TPU topology {topology:?} has {chips} chips, which is neither a single-host shape of \
         {accelerator} ({single:?} chips) nor a multiple of its {per_host} chips per host"
    )]
    NotHostMultiple {
        topology: String,
        accelerator: String,
        chips: u32,
        single: &'static [u8],
        per_host: u8,
    },
}

/// A parsed topology: 2 or 3 dimensions, each at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    dims: [u16; 3],
    len: u8,
}

impl Topology {
    /// Parses `AxB` or `AxBxC`.
    pub fn parse(s: &str) -> Result<Self, TpuError> {
        let bad = |reason| TpuError::Malformed { topology: s.to_owned(), reason };
        let mut dims = [1u16; 3];
        let mut len = 0usize;
        for part in s.split('x') {
            if len == 3 {
                return Err(bad("more than three dimensions"));
            }
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad("each dimension must be a positive integer"));
            }
            let v: u16 = part.parse().map_err(|_| bad("a dimension is too large"))?;
            if v == 0 {
                return Err(bad("a dimension is zero"));
            }
            dims[len] = v;
            len += 1;
        }
        if len < 2 {
            return Err(bad("fewer than two dimensions"));
        }
        Ok(Self { dims, len: len as u8 })
    }

    pub fn dims(&self) -> &[u16] {
        &self.dims[..usize::from(self.len)]
    }

    /// Number of chips: the product of the dimensions.
    pub fn chips(&self) -> u32 {
        self.dims().iter().map(|&d| u32::from(d)).product()
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, d) in self.dims().iter().enumerate() {
            if i > 0 {
                f.write_str("x")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// A TPU slice request resolved against the generation table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceShape {
    pub accelerator: &'static Accelerator,
    pub facts: TpuFacts,
    pub topology: Topology,
    pub chips: u32,
    /// TPU VMs (Kubernetes nodes) in the slice; all of them are needed at once.
    pub hosts: u32,
    /// Chips each host contributes.
    pub chips_per_host: u32,
}

impl SliceShape {
    pub fn is_multi_host(&self) -> bool {
        self.hosts > 1
    }
}

/// Resolves `accelerator` (a GKE accelerator label like `tpu-v5p-slice`, or a generation like
/// `v5p`) and `topology` into chips and hosts.
pub fn slice(accelerator: &str, topology: &str) -> Result<SliceShape, TpuError> {
    let acc =
        tpu_by_name(accelerator).ok_or_else(|| TpuError::UnknownAccelerator(accelerator.into()))?;
    let Some(facts) = acc.tpu else {
        return Err(TpuError::UnknownAccelerator(accelerator.into()));
    };
    let topo = Topology::parse(topology)?;
    if topo.dims().len() != usize::from(facts.topology_dims) {
        return Err(TpuError::WrongDimensions {
            topology: topology.to_owned(),
            accelerator: facts.gke_accelerator.to_owned(),
            got: topo.dims().len(),
            want: facts.topology_dims,
            example: if facts.topology_dims == 3 { "2x2x4" } else { "4x4" },
        });
    }
    let chips = topo.chips();
    let single = facts.single_host_chips.iter().any(|&c| u32::from(c) == chips)
        && chips <= u32::from(acc.chips_per_host);
    let (hosts, per_host) = if single {
        (1, chips)
    } else if chips % u32::from(facts.chips_per_host_multi) == 0 {
        (chips / u32::from(facts.chips_per_host_multi), u32::from(facts.chips_per_host_multi))
    } else {
        return Err(TpuError::NotHostMultiple {
            topology: topology.to_owned(),
            accelerator: facts.gke_accelerator.to_owned(),
            chips,
            single: facts.single_host_chips,
            per_host: facts.chips_per_host_multi,
        });
    };
    Ok(SliceShape {
        accelerator: acc,
        facts,
        topology: topo,
        chips,
        hosts,
        chips_per_host: per_host,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(acc: &str, topo: &str) -> (u32, u32, u32) {
        let s = slice(acc, topo).unwrap_or_else(|e| panic!("{acc} {topo}: {e}"));
        (s.chips, s.hosts, s.chips_per_host)
    }

    #[test]
    fn three_d_generations_use_four_chip_hosts() {
        for acc in ["tpu-v4-podslice", "tpu-v5p-slice", "tpu7x", "v5p"] {
            assert_eq!(hosts(acc, "2x2x1"), (4, 1, 4), "{acc}");
            assert_eq!(hosts(acc, "2x2x2"), (8, 2, 4), "{acc}");
            assert_eq!(hosts(acc, "2x2x4"), (16, 4, 4), "{acc}");
            assert_eq!(hosts(acc, "4x4x4"), (64, 16, 4), "{acc}");
            assert_eq!(hosts(acc, "4x4x8"), (128, 32, 4), "{acc}");
        }
    }

    #[test]
    fn two_d_generations_have_single_host_shapes() {
        for acc in ["tpu-v5-lite-podslice", "tpu-v6e-slice", "v6e"] {
            assert_eq!(hosts(acc, "1x1"), (1, 1, 1), "{acc}");
            assert_eq!(hosts(acc, "2x2"), (4, 1, 4), "{acc}");
            assert_eq!(hosts(acc, "2x4"), (8, 1, 8), "{acc}");
            // The flex-start guide: 4x4 is 16 chips on 4 VMs of 4 chips.
            assert_eq!(hosts(acc, "4x4"), (16, 4, 4), "{acc}");
            assert_eq!(hosts(acc, "8x16"), (128, 32, 4), "{acc}");
            assert_eq!(hosts(acc, "16x16"), (256, 64, 4), "{acc}");
        }
    }

    #[test]
    fn wrong_shapes_are_rejected_with_the_fix() {
        let e = slice("tpu-v5p-slice", "4x4").unwrap_err();
        assert!(matches!(e, TpuError::WrongDimensions { got: 2, want: 3, .. }), "{e}");
        assert!(e.to_string().contains("2x2x4"), "{e}");
        let e = slice("tpu-v6e-slice", "2x2x2").unwrap_err();
        assert!(matches!(e, TpuError::WrongDimensions { got: 3, want: 2, .. }), "{e}");
        assert!(matches!(
            slice("tpu-v5p-slice", "1x1x1").unwrap_err(),
            TpuError::NotHostMultiple { chips: 1, .. }
        ));
        assert!(matches!(
            slice("tpu-v6e-slice", "1x3").unwrap_err(),
            TpuError::NotHostMultiple { chips: 3, .. }
        ));
        assert!(matches!(slice("a100", "2x2").unwrap_err(), TpuError::UnknownAccelerator(_)));
        for bad in ["", "4", "2x", "x2", "2x0", "2x-1", "2x2x2x2", "axb", "99999x2"] {
            assert!(
                matches!(Topology::parse(bad), Err(TpuError::Malformed { .. })),
                "{bad:?} should be malformed"
            );
        }
    }

    #[test]
    fn topology_round_trips() {
        let t = Topology::parse("2x2x4").unwrap();
        assert_eq!(t.dims(), &[2, 2, 4]);
        assert_eq!(t.chips(), 16);
        assert_eq!(t.to_string(), "2x2x4");
    }
}
