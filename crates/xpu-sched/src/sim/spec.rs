//! The `--cluster` grammar of `xpu sim replay`: one or more pools separated by `;` (or given as
//! several flags), each a `:`-separated list of `key=value` settings:
//!
//! ```text
//! pool=a100:nodes=64:gpus=8                      64 nodes × 8 GPUs of model "a100"
//! pool=h100:nodes=16:gpus=8:model=H100:cpu=96:mem=1024G
//! pool=v5p:nodes=16:gpus=4:kind=tpu:model=TPU-v5p:flex:delay=300:idle=10m:max-run=7d
//! ```
//!
//! `nodes` and `gpus` are required; `model` defaults to the pool name, `cpu` (cores) to 8 per
//! device, `mem` to 64 GiB per device (`G`/`M` suffixes, MiB without), `kind` to `gpu`. `flex`
//! makes the pool a flex-start pool scaled from zero with `nodes` as its maximum; `delay`,
//! `idle` and `max-run` take seconds or `s`/`m`/`h`/`d` suffixes.

use serde::Serialize;
use xpu_core::DeviceKind;

use crate::cluster::{Cluster, ClusterError, NodeSpec};
use crate::pool::FlexPool;
use crate::request::{FLEX_MAX_RUN, Time};

/// One pool of identical nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolSpec {
    pub name: String,
    pub nodes: u32,
    pub devices: u16,
    pub kind: DeviceKind,
    pub model: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub flex: Option<FlexSettings>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FlexSettings {
    pub delay: Time,
    pub idle: Time,
    pub max_run: Time,
}

/// What is wrong with a `--cluster` value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--cluster {spec:?}: {reason}")]
pub struct SpecError {
    pub spec: String,
    pub reason: String,
}

/// Parses one or more pools (`;`-separated).
pub fn parse_cluster(s: &str) -> Result<Vec<PoolSpec>, SpecError> {
    let pools: Vec<PoolSpec> =
        s.split(';').filter(|p| !p.trim().is_empty()).map(parse_pool).collect::<Result<_, _>>()?;
    if pools.is_empty() {
        return Err(SpecError {
            spec: s.into(),
            reason: "no pool given; write pool=NAME:nodes=N:gpus=G".into(),
        });
    }
    Ok(pools)
}

fn parse_pool(s: &str) -> Result<PoolSpec, SpecError> {
    let err = |reason: String| SpecError { spec: s.trim().into(), reason };
    let mut name = None;
    let mut nodes = None;
    let mut devices = None;
    let mut kind = DeviceKind::Gpu;
    let mut model = None;
    let mut cpu = None;
    let mut mem = None;
    let mut flex = false;
    let mut delay = 300;
    let mut idle = 600;
    let mut max_run = FLEX_MAX_RUN;
    for part in s.trim().split(':') {
        let (k, v) = match part.split_once('=') {
            Some((k, v)) => (k.trim(), v.trim()),
            None => (part.trim(), ""),
        };
        let num =
            |v: &str| v.parse::<u64>().map_err(|_| err(format!("{k}={v:?} is not a whole number")));
        match k {
            "pool" => name = Some(v.to_owned()),
            "nodes" => nodes = Some(num(v)? as u32),
            "gpus" | "devices" | "chips" => devices = Some(num(v)?),
            "kind" => kind = v.parse().map_err(err)?,
            "model" => model = Some(v.to_owned()),
            "cpu" => cpu = Some(num(v)? * 1000),
            "mem" => {
                mem = Some(parse_mib(v).ok_or_else(|| {
                    err(format!("mem={v:?}: use MiB or a G/M suffix, e.g. 1024G"))
                })?)
            }
            "flex" => flex = true,
            "delay" => {
                delay = parse_secs(v)
                    .ok_or_else(|| err(format!("delay={v:?}: use seconds or s/m/h/d")))?
            }
            "idle" => {
                idle = parse_secs(v)
                    .ok_or_else(|| err(format!("idle={v:?}: use seconds or s/m/h/d")))?
            }
            "max-run" => {
                max_run = parse_secs(v)
                    .ok_or_else(|| err(format!("max-run={v:?}: use seconds or s/m/h/d")))?
            }
            "" => {}
            other => {
                return Err(err(format!(
                    "unknown setting {other:?}; use pool, nodes, gpus, kind, model, cpu, mem, flex, delay, idle, max-run"
                )));
            }
        }
    }
    let name = name.filter(|n| !n.is_empty()).ok_or_else(|| err("missing pool=NAME".into()))?;
    let nodes =
        nodes.filter(|&n| n > 0).ok_or_else(|| err("missing nodes=N (at least 1)".into()))?;
    let devices = devices.ok_or_else(|| err("missing gpus=G".into()))?;
    if devices > crate::cluster::MAX_DEVICES as u64 {
        return Err(err(format!(
            "gpus={devices} is more than {} per node",
            crate::cluster::MAX_DEVICES
        )));
    }
    if nodes > 1_000_000 {
        return Err(err(format!("nodes={nodes} is more than a million")));
    }
    let per = devices.max(1);
    Ok(PoolSpec {
        model: model.unwrap_or_else(|| name.clone()),
        name,
        nodes,
        devices: devices as u16,
        kind,
        cpu_milli: cpu.unwrap_or(8_000 * per),
        memory_mib: mem.unwrap_or(65_536 * per),
        flex: flex.then_some(FlexSettings { delay, idle, max_run }),
    })
}

/// `90`, `90s`, `15m`, `2h`, `7d`.
pub fn parse_secs(v: &str) -> Option<Time> {
    let (n, mult) = match v.as_bytes().last()? {
        b's' => (&v[..v.len() - 1], 1),
        b'm' => (&v[..v.len() - 1], 60),
        b'h' => (&v[..v.len() - 1], 3600),
        b'd' => (&v[..v.len() - 1], 86_400),
        _ => (v, 1),
    };
    n.parse::<u64>().ok()?.checked_mul(mult)
}

fn parse_mib(v: &str) -> Option<u64> {
    let (n, mult) = match v.as_bytes().last()? {
        b'G' | b'g' => (&v[..v.len() - 1], 1024),
        b'M' | b'm' => (&v[..v.len() - 1], 1),
        _ => (v, 1),
    };
    n.parse::<u64>().ok()?.checked_mul(mult)
}

impl PoolSpec {
    pub fn node(&self, i: u32) -> NodeSpec {
        NodeSpec::new(format!("{}-{i}", self.name), self.cpu_milli, self.memory_mib)
            .pool(self.name.clone())
            .devices(usize::from(self.devices), self.kind, &self.model)
    }
}

/// The static part of the cluster and the flex-start pools.
pub fn build(pools: &[PoolSpec]) -> Result<(Cluster, Vec<FlexPool>), ClusterError> {
    let mut c = Cluster::new();
    let mut flex = Vec::new();
    for p in pools {
        match p.flex {
            None => {
                for i in 0..p.nodes {
                    c.add_node(p.node(i))?;
                }
            }
            Some(f) => {
                let mut template = p.node(0);
                template.name = p.name.clone();
                flex.push(FlexPool {
                    name: p.name.clone(),
                    node: template,
                    max_nodes: p.nodes,
                    provisioning_delay: f.delay,
                    idle_release: f.idle,
                    max_run_duration: f.max_run,
                });
            }
        }
    }
    Ok((c, flex))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_parse_with_defaults_and_flex_settings() {
        let p = parse_cluster("pool=a100:nodes=250:gpus=8; pool=v5p:nodes=16:chips=4:kind=tpu:model=TPU-v5p:flex:delay=5m:idle=10m:max-run=7d").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].nodes, p[0].devices, p[0].model.as_str(), p[0].cpu_milli),
            (250, 8, "a100", 64_000)
        );
        assert!(p[0].flex.is_none());
        assert_eq!(p[1].kind, DeviceKind::Tpu);
        assert_eq!(p[1].flex, Some(FlexSettings { delay: 300, idle: 600, max_run: 7 * 86_400 }));
        let (c, flex) = build(&p).unwrap();
        assert_eq!((c.len(), flex.len(), flex[0].max_nodes), (250, 1, 16));
    }

    #[test]
    fn bad_pools_say_what_to_write() {
        for (s, want) in [
            ("pool=a:gpus=8", "missing nodes"),
            ("nodes=2:gpus=8", "missing pool"),
            ("pool=a:nodes=x:gpus=8", "not a whole number"),
            ("pool=a:nodes=2:gpus=8:color=red", "unknown setting"),
            ("pool=a:nodes=2:gpus=64", "more than"),
            ("pool=a:nodes=2:gpus=8:mem=lots", "mem="),
            ("", "no pool"),
        ] {
            let e = parse_cluster(s).unwrap_err().to_string();
            assert!(e.contains(want), "{s}: {e}");
        }
    }
}
