//! `NVIDIA_REQUIRE_*` constraints, as NVIDIA documents them for its container runtime
//! (<https://docs.nvidia.com/datacenter/cloud-native/container-toolkit/latest/docker-specialized.html>):
//! within one variable, space-separated constraints are ORed and comma-separated constraints are
//! ANDed; separate `NVIDIA_REQUIRE_*` variables are ANDed; `NVIDIA_DISABLE_REQUIRE` turns them
//! all off. So CUDA images' `cuda>=12.2 brand=tesla,driver>=470,driver<471` means "a driver
//! for CUDA 12.2, or a Tesla on the 470 branch (forward compatibility)".
//!
//! Constraints: `cuda` (the CUDA driver API version, from NVML), `driver` (the kernel driver
//! version), `arch` (compute capability of every selected GPU), `brand` (every selected GPU's
//! brand). Operators: `=`, `==`, `!=`, `<`, `<=`, `>`, `>=`.
//!
//! A fact that cannot be known (no NVML answer) makes a constraint unknown; an expression that
//! is still unknown after the ORs and ANDs is an error saying what to configure, never a silent
//! pass.

use std::cmp::Ordering;

use xpu_core::PciDevice;

use crate::nvml::{Nvml, Version};
use crate::request::{Env, NVIDIA_REQUIRE_PREFIX};

/// A failed or uncheckable requirement, naming the variable and value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {reason}")]
pub struct RequireError {
    pub var: String,
    pub value: String,
    pub reason: String,
}

/// The host facts constraints are checked against.
pub struct Facts<'a> {
    pub driver_version: Option<Version>,
    pub nvml: &'a dyn Nvml,
    /// The NVIDIA GPUs the container gets.
    pub gpus: Vec<&'a PciDevice>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Op {
    fn holds(self, o: Ordering) -> bool {
        match self {
            Op::Eq => o.is_eq(),
            Op::Ne => o.is_ne(),
            Op::Lt => o.is_lt(),
            Op::Le => o.is_le(),
            Op::Gt => o.is_gt(),
            Op::Ge => o.is_ge(),
        }
    }
}

/// Three-valued truth: a constraint on a fact nobody knows is `Unknown(why)`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Truth {
    True,
    False(String),
    Unknown(String),
}

fn parse_constraint(c: &str) -> Result<(&str, Op, &str), String> {
    let pos = c.find(['=', '!', '<', '>']).ok_or_else(|| {
        format!("constraint {c:?} has no operator; write e.g. cuda>=12.0 or brand=tesla")
    })?;
    let (name, rest) = c.split_at(pos);
    let (op, value) = [
        ("==", Op::Eq),
        ("!=", Op::Ne),
        ("<=", Op::Le),
        (">=", Op::Ge),
        ("=", Op::Eq),
        ("<", Op::Lt),
        (">", Op::Gt),
    ]
    .into_iter()
    .find_map(|(s, op)| rest.strip_prefix(s).map(|v| (op, v)))
    .ok_or_else(|| format!("constraint {c:?} has an unknown operator"))?;
    if name.is_empty() || value.is_empty() {
        return Err(format!("constraint {c:?} needs a name and a value"));
    }
    Ok((name, op, value))
}

fn version_truth(what: &str, have: Option<Version>, op: Op, want: &str) -> Result<Truth, String> {
    let want_v = Version::parse(want).ok_or_else(|| format!("{want:?} is not a version"))?;
    Ok(match have {
        None => Truth::Unknown(format!("the host's {what} version is unknown")),
        Some(h) if op.holds(h.cmp_padded(&want_v)) => Truth::True,
        Some(h) => Truth::False(format!("{what} {h} does not satisfy {what}{}{want}", op_str(op))),
    })
}

fn op_str(op: Op) -> &'static str {
    match op {
        Op::Eq => "=",
        Op::Ne => "!=",
        Op::Lt => "<",
        Op::Le => "<=",
        Op::Gt => ">",
        Op::Ge => ">=",
    }
}

fn eval_constraint(c: &str, facts: &Facts<'_>) -> Result<Truth, String> {
    let (name, op, value) = parse_constraint(c)?;
    match name {
        "cuda" => version_truth("cuda", facts.nvml.cuda_driver_version(), op, value),
        "driver" => version_truth("driver", facts.driver_version.clone(), op, value),
        "arch" => {
            let want = Version::parse(value).ok_or_else(|| format!("{value:?} is not an arch"))?;
            for g in &facts.gpus {
                match facts.nvml.compute_capability(g) {
                    None => {
                        return Ok(Truth::Unknown(format!(
                            "the compute capability of {} is unknown",
                            g.address
                        )));
                    }
                    Some((ma, mi)) => {
                        let have = Version(vec![ma.into(), mi.into()]);
                        if !op.holds(have.cmp_padded(&want)) {
                            return Ok(Truth::False(format!(
                                "GPU {} has arch {have}, not arch{}{value}",
                                g.address,
                                op_str(op)
                            )));
                        }
                    }
                }
            }
            Ok(Truth::True)
        }
        "brand" => {
            if !matches!(op, Op::Eq | Op::Ne) {
                return Err(format!("brand takes = or !=, not {}", op_str(op)));
            }
            for g in &facts.gpus {
                match facts.nvml.brand(g) {
                    None => {
                        return Ok(Truth::Unknown(format!(
                            "the brand of {} is unknown",
                            g.address
                        )));
                    }
                    Some(b) => {
                        if op.holds(b.as_str().cmp(value.to_ascii_lowercase().as_str())) {
                            continue;
                        }
                        return Ok(Truth::False(format!("GPU {} is brand {b}", g.address)));
                    }
                }
            }
            Ok(Truth::True)
        }
        other => Err(format!("unknown constraint {other:?}; use cuda, driver, arch or brand")),
    }
}

/// One variable's expression: alternatives (space) of conjunctions (comma).
fn eval_expr(expr: &str, facts: &Facts<'_>) -> Result<Truth, String> {
    let mut any_unknown = None;
    let mut last_false = None;
    let mut alternatives = 0;
    for alt in expr.split_whitespace() {
        alternatives += 1;
        let mut alt_truth = Truth::True;
        for c in alt.split(',').filter(|c| !c.is_empty()) {
            match eval_constraint(c, facts)? {
                Truth::True => {}
                f @ Truth::False(_) => {
                    alt_truth = f;
                    break;
                }
                u @ Truth::Unknown(_) => {
                    if alt_truth == Truth::True {
                        alt_truth = u;
                    }
                }
            }
        }
        match alt_truth {
            Truth::True => return Ok(Truth::True),
            Truth::False(why) => last_false = Some(why),
            Truth::Unknown(why) => any_unknown = Some(why),
        }
    }
    if alternatives == 0 {
        return Ok(Truth::True);
    }
    Ok(match (any_unknown, last_false) {
        (Some(why), _) => Truth::Unknown(why),
        (None, Some(why)) => Truth::False(why),
        (None, None) => Truth::True,
    })
}

/// Checks every `NVIDIA_REQUIRE_*` variable of `env` (in name order) against `facts`.
pub fn check(env: &Env, facts: &Facts<'_>) -> Result<(), RequireError> {
    for (var, value) in env.iter().filter(|(k, _)| k.starts_with(NVIDIA_REQUIRE_PREFIX)) {
        let e =
            |reason: String| RequireError { var: var.to_owned(), value: value.to_owned(), reason };
        match eval_expr(value, facts).map_err(e)? {
            Truth::True => {}
            Truth::False(why) => {
                return Err(e(format!(
                    "requirement not met: {why}; run on a host that meets it or set NVIDIA_DISABLE_REQUIRE=true"
                )));
            }
            Truth::Unknown(why) => {
                return Err(e(format!(
                    "cannot check the requirement: {why}; set cuda_version in the runtime config, or NVIDIA_DISABLE_REQUIRE=true"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvml::FakeNvml;

    fn gpu() -> PciDevice {
        PciDevice::new("0000:25:00.0".parse().unwrap())
    }

    fn run(expr: &str, nvml: &FakeNvml, g: &PciDevice) -> Result<(), RequireError> {
        let facts = Facts { driver_version: Version::parse("535.104.05"), nvml, gpus: vec![g] };
        check(&Env::from_entries([format!("NVIDIA_REQUIRE_CUDA={expr}").as_str()]), &facts)
    }

    #[test]
    fn space_is_or_and_comma_is_and() {
        let g = gpu();
        let mut nvml = FakeNvml { cuda: Version::parse("12.2"), ..Default::default() };
        nvml.brands.insert(g.address, "tesla".into());
        nvml.compute.insert(g.address, (8, 0));
        assert!(run("cuda>=12.0", &nvml, &g).is_ok());
        assert!(run("cuda>=12.4", &nvml, &g).is_err());
        // CUDA 12.4 is too new, but a Tesla on driver 535 is accepted by the second alternative.
        assert!(run("cuda>=12.4 brand=tesla,driver>=535,driver<536", &nvml, &g).is_ok());
        assert!(run("cuda>=12.4 brand=tesla,driver>=470,driver<471", &nvml, &g).is_err());
        assert!(run("arch>=8.0,driver>=530", &nvml, &g).is_ok());
        assert!(run("arch=9.0", &nvml, &g).is_err());
        let e = run("cuda>=12.4", &nvml, &g).unwrap_err().to_string();
        assert!(e.starts_with("NVIDIA_REQUIRE_CUDA=\"cuda>=12.4\": requirement not met"), "{e}");
    }

    #[test]
    fn unknown_facts_and_bad_syntax_are_errors() {
        let g = gpu();
        let nvml = FakeNvml::default();
        let e = run("cuda>=12.0", &nvml, &g).unwrap_err().to_string();
        assert!(e.contains("cannot check the requirement"), "{e}");
        // Unknown in one alternative, true in another: true.
        assert!(run("cuda>=12.0 driver>=500", &nvml, &g).is_ok());
        let e = run("gpus>=2", &nvml, &g).unwrap_err().to_string();
        assert!(e.contains("unknown constraint \"gpus\""), "{e}");
        assert!(run("cuda12", &nvml, &g).unwrap_err().to_string().contains("no operator"));
        assert!(run("driver>=abc", &nvml, &g).unwrap_err().to_string().contains("not a version"));
    }
}
