//! [`MigControl`] through `nvidia-smi mig`, the driver's own tool (NVML's GPU-instance calls
//! are not in `nvml-wrapper`, and this workspace does not call C itself).
//!
//! What it runs, per GPU (`-i` takes the PCI bus id):
//! - `nvidia-smi --query-gpu=pci.bus_id,name,mig.mode.current --format=csv,noheader`: the GPUs
//!   and whether MIG mode is on now (`Enabled`; a pending change is not current);
//! - `nvidia-smi mig -i BUS -lgi` and `-lci`: the GPU instances (profile, id, `start:size`) and
//!   their compute instances;
//! - `nvidia-smi mig -i BUS -cgi ID:START -C`: a GPU instance of profile `ID` at memory slice
//!   `START` and a compute instance spanning it (`-C`, the default compute profile);
//! - `nvidia-smi mig -i BUS -gi N -dci`, then `-dgi`: destroys it.
//!
//! `nvidia-smi` exits 0 when it did nothing (`No MIG-enabled devices found.`, seen on an H200
//! with MIG off, driver 580), so success is read from what it prints (`Successfully created GPU
//! instance ID 7 ...`), never from its status alone. Each run has its environment cleared,
//! no standard input, a time limit and a bound on what it may print.
//!
//! Which instances xpu made is kept in a ledger file (GPU, instance id, profile, start): one
//! found there is `by_xpu`; any other (the admin's `nvidia-smi`, a MIG manager) is reported and
//! never destroyed. An entry whose instance is gone, or was replaced by another at the same
//! id, is dropped. MIG UUIDs are not printed by these commands against an instance id, so
//! instances carry none; a container reaches its instance through the capability nodes it is
//! given, which are what CUDA enumerates.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use xpu_core::PciAddress;
use xpu_core::mig::Model;

use super::{Instance, MigControl, MigControlError, MigGpu, check_create};

/// How long one `nvidia-smi` run may take (making an instance takes a second or two).
const RUN_LIMIT: Duration = Duration::from_secs(60);
/// The most one run may print.
const MAX_OUTPUT: u64 = 1 << 20;
/// Ledger files larger than this are refused.
const MAX_LEDGER: u64 = 1 << 20;

/// MIG through the `nvidia-smi` at `smi`, with xpu's instances recorded in `ledger`.
#[derive(Debug)]
pub struct SmiMig {
    smi: PathBuf,
    /// `None`: reads only (the device plugin's): instances are neither made nor destroyed.
    ledger: Option<PathBuf>,
    limit: Duration,
    /// One change at a time: the ledger is read, changed and written under it.
    lock: Mutex<()>,
}

/// An instance xpu made.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Made {
    gpu: PciAddress,
    gi: u32,
    profile: String,
    start: u8,
}

#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Ledger {
    made: Vec<Made>,
}

/// A GPU instance as `nvidia-smi mig -lgi` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedGi {
    pub gpu_index: u32,
    /// `1g.18gb` (without the `MIG ` nvidia-smi puts before it).
    pub profile: String,
    pub profile_id: u32,
    pub gi: u32,
    pub start: u8,
    pub size: u8,
}

/// A compute instance as `nvidia-smi mig -lci` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedCi {
    pub gpu_index: u32,
    pub gi: u32,
    pub ci: u32,
}

fn read_only() -> MigControlError {
    nvml("this MIG control only reads (instances are made by the DRA driver's --mig or the admin)")
}

fn nvml(why: impl Into<String>) -> MigControlError {
    MigControlError::Nvml(why.into())
}

/// `00000000:18:00.0` as `nvidia-smi` prints and takes bus ids.
fn bus_id(a: PciAddress) -> String {
    format!("{:08x}:{:02x}:{:02x}.{:x}", a.domain, a.bus, a.device, a.function)
}

impl SmiMig {
    /// `smi`: the `nvidia-smi` binary (absolute, or found on `PATH`); `ledger`: the file that
    /// records xpu's instances (made with its directory when first written).
    pub fn new(smi: PathBuf, ledger: PathBuf) -> SmiMig {
        SmiMig { smi, ledger: Some(ledger), limit: RUN_LIMIT, lock: Mutex::new(()) }
    }

    /// Reads MIG state only: every instance is reported as not xpu's, and making or destroying
    /// one is refused.
    pub fn read_only(smi: PathBuf) -> SmiMig {
        SmiMig { smi, ledger: None, limit: RUN_LIMIT, lock: Mutex::new(()) }
    }

    /// How long one `nvidia-smi` run may take (60 s unless told).
    pub fn with_limit(mut self, limit: Duration) -> SmiMig {
        self.limit = limit;
        self
    }

    /// Runs `nvidia-smi ARGS`: its standard output, or why it failed.
    fn run(&self, args: &[&str]) -> Result<String, MigControlError> {
        let what = || format!("{} {}", self.smi.display(), args.join(" "));
        let mut child = Command::new(&self.smi)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| nvml(format!("{}: {e}", what())))?;
        let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
            stop(&mut child);
            return Err(nvml(format!("{}: no output pipes", what())));
        };
        let read = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
                let mut buf = Vec::new();
                r.by_ref().take(MAX_OUTPUT + 1).read_to_end(&mut buf)?;
                // Drain the rest so that a chatty child never blocks on a full pipe; what is
                // past the bound is refused below whatever this read gives.
                std::io::copy(&mut r, &mut std::io::sink())?;
                Ok(buf)
            })
        };
        let (out, err) = (read(Box::new(out)), read(Box::new(err)));
        let deadline = Instant::now() + self.limit;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => {
                    stop(&mut child);
                    return Err(nvml(format!("{}: no answer in {:?}; killed", what(), self.limit)));
                }
                Err(e) => return Err(nvml(format!("{}: {e}", what()))),
            }
        };
        let joined = |h: std::thread::JoinHandle<std::io::Result<Vec<u8>>>, which: &str| {
            h.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the reader panicked")))
                .map_err(|e| nvml(format!("{}: reading its {which}: {e}", what())))
        };
        let out = joined(out, "output")?;
        let err = joined(err, "errors")?;
        if out.len() as u64 > MAX_OUTPUT {
            return Err(nvml(format!("{}: printed more than {MAX_OUTPUT} bytes", what())));
        }
        let text = String::from_utf8_lossy(&out).into_owned();
        if !status.success() {
            let why = String::from_utf8_lossy(&err);
            let why = if why.trim().is_empty() { text.trim() } else { why.trim() };
            return Err(nvml(format!("{} ({status}): {why}", what())));
        }
        Ok(text)
    }

    fn read_ledger(&self) -> Result<Ledger, MigControlError> {
        let Some(path) = &self.ledger else { return Ok(Ledger::default()) };
        let bad = |why: String| nvml(format!("MIG ledger {}: {why}", path.display()));
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ledger::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        let mut bytes = Vec::new();
        f.take(MAX_LEDGER + 1).read_to_end(&mut bytes).map_err(|e| bad(e.to_string()))?;
        if bytes.len() as u64 > MAX_LEDGER {
            return Err(bad(format!("larger than {MAX_LEDGER} bytes")));
        }
        serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))
    }

    fn write_ledger(&self, l: &Ledger) -> Result<(), MigControlError> {
        let Some(path) = &self.ledger else { return Err(read_only()) };
        let bad = |why: String| nvml(format!("MIG ledger {}: {why}", path.display()));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| bad(e.to_string()))?;
        }
        let json = serde_json::to_vec_pretty(l).map_err(|e| bad(e.to_string()))?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| bad(e.to_string()))
    }

    /// The GPUs with their instances, and the ledger with what is gone dropped.
    fn scan(&self) -> Result<(Vec<MigGpu>, Ledger), MigControlError> {
        let query =
            self.run(&["--query-gpu=pci.bus_id,name,mig.mode.current", "--format=csv,noheader"])?;
        let mut ledger = self.read_ledger()?;
        let mut gpus = Vec::new();
        for (address, product, enabled) in parse_query(&query)? {
            let mut instances = Vec::new();
            if enabled {
                let bus = bus_id(address);
                let gis = parse_gi_list(&self.run(&["mig", "-i", &bus, "-lgi"])?)?;
                let cis = parse_ci_list(&self.run(&["mig", "-i", &bus, "-lci"])?)?;
                let model = Model::of(&product).ok();
                for g in gis {
                    // A profile outside xpu's tables is still reported, under nvidia-smi's
                    // name; `layout` leaves it out of what is published.
                    let profile = model
                        .and_then(|m| m.profile(&g.profile).ok())
                        .map(|p| p.name)
                        .unwrap_or("unknown");
                    let ci = cis.iter().find(|c| c.gi == g.gi).map(|c| c.ci).unwrap_or(0);
                    let by_xpu = ledger.made.iter().any(|m| {
                        m.gpu == address
                            && m.gi == g.gi
                            && m.profile == g.profile
                            && m.start == g.start
                    });
                    instances.push(Instance {
                        gi: g.gi,
                        ci,
                        profile,
                        start: g.start,
                        uuid: None,
                        by_xpu,
                    });
                }
            }
            gpus.push(MigGpu { address, product, enabled, instances });
        }
        ledger.made.retain(|m| {
            gpus.iter().any(|g| {
                g.address == m.gpu
                    && g.instances.iter().any(|i| i.by_xpu && i.gi == m.gi && i.start == m.start)
            })
        });
        Ok((gpus, ledger))
    }
}

impl MigControl for SmiMig {
    fn gpus(&self) -> Result<Vec<MigGpu>, MigControlError> {
        let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(self.scan()?.0)
    }

    fn create(
        &self,
        gpu: PciAddress,
        profile: &str,
        start: u8,
    ) -> Result<Instance, MigControlError> {
        let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        if self.ledger.is_none() {
            return Err(read_only());
        }
        let (gpus, mut ledger) = self.scan()?;
        let g = gpus.iter().find(|g| g.address == gpu).ok_or(MigControlError::NoGpu(gpu))?;
        let p = check_create(gpu, &g.product, g.enabled, &g.instances, profile, start)?;
        let bus = bus_id(gpu);
        let out = self.run(&["mig", "-i", &bus, "-cgi", &format!("{}:{start}", p.id), "-C"])?;
        let (gi, ci) = parse_created(&out)?;
        ledger.made.push(Made { gpu, gi, profile: p.name.to_owned(), start });
        if let Err(e) = self.write_ledger(&ledger) {
            // Unrecorded, it would be nobody's: take it down again.
            let gi_arg = gi.to_string();
            for step in ["-dci", "-dgi"] {
                if let Err(undo) = self.run(&["mig", "-i", &bus, "-gi", &gi_arg, step]) {
                    tracing::warn!(gpu = %gpu, gi, error = %undo, "a MIG instance made but not recorded was not destroyed; destroy it with nvidia-smi mig -dci/-dgi");
                }
            }
            return Err(e);
        }
        Ok(Instance { gi, ci, profile: p.name, start, uuid: None, by_xpu: true })
    }

    fn destroy(&self, gpu: PciAddress, gi: u32) -> Result<(), MigControlError> {
        let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let (gpus, mut ledger) = self.scan()?;
        let g = gpus.iter().find(|g| g.address == gpu).ok_or(MigControlError::NoGpu(gpu))?;
        let i = g
            .instances
            .iter()
            .find(|i| i.gi == gi)
            .ok_or(MigControlError::NoInstance { gpu, gi })?;
        if !i.by_xpu {
            return Err(MigControlError::NotOurs { gpu, gi });
        }
        let bus = bus_id(gpu);
        let gi_arg = gi.to_string();
        let out = self.run(&["mig", "-i", &bus, "-gi", &gi_arg, "-dci"])?;
        expect_success(&out, "destroyed compute instance")?;
        let out = self.run(&["mig", "-i", &bus, "-gi", &gi_arg, "-dgi"])?;
        expect_success(&out, "destroyed GPU instance")?;
        ledger.made.retain(|m| !(m.gpu == gpu && m.gi == gi));
        self.write_ledger(&ledger)
    }
}

/// Kills a child and reaps it. Both may fail only when it has exited already (kill) or been
/// reaped (wait): nothing is left to stop either way.
fn stop(child: &mut std::process::Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// `nvidia-smi`'s own message when it did nothing (it still exits 0).
fn said_nothing_done(out: &str) -> Option<&str> {
    out.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("Successfully"))
        .filter(|_| !out.contains("Successfully"))
}

fn expect_success(out: &str, what: &str) -> Result<(), MigControlError> {
    if out.contains("Successfully") {
        Ok(())
    } else {
        Err(nvml(format!(
            "nvidia-smi {what}: not done: {}",
            said_nothing_done(out).unwrap_or("it printed nothing")
        )))
    }
}

/// `00000000:00:06.0, NVIDIA H200, Disabled` lines.
pub fn parse_query(out: &str) -> Result<Vec<(PciAddress, String, bool)>, MigControlError> {
    let mut gpus = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let bad = || nvml(format!("nvidia-smi --query-gpu printed {line:?}"));
        let mut f = line.rsplitn(2, ',');
        let (Some(mode), Some(rest)) = (f.next(), f.next()) else { return Err(bad()) };
        let (bus, name) = rest.split_once(',').ok_or_else(bad)?;
        let address: PciAddress = bus.trim().parse().map_err(|_| bad())?;
        // `[N/A]` on GPUs without MIG.
        gpus.push((address, name.trim().to_owned(), mode.trim() == "Enabled"));
    }
    Ok(gpus)
}

/// The table rows of `nvidia-smi mig -lgi`: `|   0  MIG 1g.18gb   19   7   0:1   |`.
pub fn parse_gi_list(out: &str) -> Result<Vec<ListedGi>, MigControlError> {
    let mut list = Vec::new();
    for cells in table_rows(out) {
        let bad = || nvml(format!("nvidia-smi mig -lgi row {cells:?}"));
        // GPU, "MIG", name, profile id, instance id, start:size
        let [gpu, mig, name, profile_id, gi, placement] = cells.as_slice() else {
            return Err(bad());
        };
        if *mig != "MIG" {
            return Err(bad());
        }
        let (start, size) = placement.split_once(':').ok_or_else(bad)?;
        list.push(ListedGi {
            gpu_index: gpu.parse().map_err(|_| bad())?,
            profile: (*name).to_owned(),
            profile_id: profile_id.parse().map_err(|_| bad())?,
            gi: gi.parse().map_err(|_| bad())?,
            start: start.parse().map_err(|_| bad())?,
            size: size.parse().map_err(|_| bad())?,
        });
    }
    Ok(list)
}

/// The table rows of `nvidia-smi mig -lci`:
/// `|   0      7       MIG 1g.18gb          0        0          0:1     |`
/// (GPU, GPU instance id, name, profile id, compute instance id, placement).
pub fn parse_ci_list(out: &str) -> Result<Vec<ListedCi>, MigControlError> {
    let mut list = Vec::new();
    for cells in table_rows(out) {
        let bad = || nvml(format!("nvidia-smi mig -lci row {cells:?}"));
        let [gpu, gi, mig, _name, _profile_id, ci, _placement] = cells.as_slice() else {
            return Err(bad());
        };
        if *mig != "MIG" {
            return Err(bad());
        }
        list.push(ListedCi {
            gpu_index: gpu.parse().map_err(|_| bad())?,
            gi: gi.parse().map_err(|_| bad())?,
            ci: ci.parse().map_err(|_| bad())?,
        });
    }
    Ok(list)
}

/// The cells of a table's data rows: the `|`-framed lines after its `|===|` rule (a header's
/// second line and the frames are not data). No table (`No MIG-enabled devices found.`, `No
/// GPU instances found.`): no rows.
fn table_rows(out: &str) -> Vec<Vec<&str>> {
    let mut rows = Vec::new();
    let mut in_body = false;
    for line in out.lines().map(str::trim) {
        if line.starts_with("|=") {
            in_body = true;
            continue;
        }
        if !in_body || !line.starts_with('|') {
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split_whitespace().collect();
        if !cells.is_empty() {
            rows.push(cells);
        }
    }
    rows
}

/// The GPU and compute instance ids of `-cgi ... -C`'s `Successfully created GPU instance ID  7
/// on GPU  0 using profile MIG 1g.18gb (ID 19)` and `Successfully created compute instance ID  0
/// on GPU  0 GPU instance ID  7 using profile MIG 1g.18gb (ID  0)`.
pub fn parse_created(out: &str) -> Result<(u32, u32), MigControlError> {
    let id_after = |line: &str, key: &str| -> Option<u32> {
        let rest = &line[line.find(key)? + key.len()..];
        rest.split_whitespace().next()?.parse().ok()
    };
    let gi = out
        .lines()
        .find(|l| l.contains("Successfully created GPU instance ID"))
        .and_then(|l| id_after(l, "GPU instance ID"));
    let ci = out
        .lines()
        .find(|l| l.contains("Successfully created compute instance ID"))
        .and_then(|l| id_after(l, "compute instance ID"));
    match (gi, ci) {
        (Some(gi), Some(ci)) => Ok((gi, ci)),
        _ => Err(nvml(format!(
            "nvidia-smi mig -cgi: no instance made: {}",
            said_nothing_done(out).unwrap_or("it printed nothing")
        ))),
    }
}

/// Where a node agent keeps its ledger: `DIR/mig-instances.json`.
pub fn ledger_in(dir: &Path) -> PathBuf {
    dir.join("mig-instances.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nvidia-smi mig -lgip` on an H200 with MIG off (driver 580.159.04), as printed there.
    const NO_MIG: &str = "No MIG-enabled devices found.\n";

    const LGI: &str = "\
+-------------------------------------------------------+
| GPU instances:                                        |
| GPU   Name             Profile  Instance   Placement  |
|                          ID       ID       Start:Size |
|=======================================================|
|   0  MIG 1g.18gb         19        7          0:1     |
+-------------------------------------------------------+
|   0  MIG 3g.71gb          9        2          4:4     |
+-------------------------------------------------------+
";

    const LCI: &str = "\
+--------------------------------------------------------------------+
| Compute instances:                                                 |
| GPU     GPU       Name             Profile   Instance   Placement  |
|       Instance                       ID        ID       Start:Size |
|         ID                                                         |
|====================================================================|
|   0      7       MIG 1g.18gb          0         0          0:1     |
+--------------------------------------------------------------------+
|   0      2       MIG 3g.71gb          2         0          0:3     |
+--------------------------------------------------------------------+
";

    #[test]
    fn the_tables_are_read_and_no_mig_is_no_rows() {
        let gis = parse_gi_list(LGI).unwrap();
        assert_eq!(gis.len(), 2);
        assert_eq!(
            gis[1],
            ListedGi {
                gpu_index: 0,
                profile: "3g.71gb".into(),
                profile_id: 9,
                gi: 2,
                start: 4,
                size: 4
            }
        );
        let cis = parse_ci_list(LCI).unwrap();
        assert_eq!(
            cis,
            vec![ListedCi { gpu_index: 0, gi: 7, ci: 0 }, ListedCi { gpu_index: 0, gi: 2, ci: 0 }]
        );
        assert!(parse_gi_list(NO_MIG).unwrap().is_empty());
        assert!(parse_ci_list("No compute instances found.\n").unwrap().is_empty());
        // A row of another shape is an error naming it, not a guess.
        let e = parse_gi_list(&LGI.replace("0:1", "0-1")).unwrap_err();
        assert!(e.to_string().contains("-lgi row"), "{e}");
    }

    #[test]
    fn made_instances_are_read_and_nothing_done_is_an_error() {
        let out = "Successfully created GPU instance ID  7 on GPU  0 using profile MIG 1g.18gb (ID 19)\nSuccessfully created compute instance ID  0 on GPU  0 GPU instance ID  7 using profile MIG 1g.18gb (ID  0)\n";
        assert_eq!(parse_created(out).unwrap(), (7, 0));
        let e = parse_created(NO_MIG).unwrap_err();
        assert!(e.to_string().contains("No MIG-enabled devices found"), "{e}");
        let e = parse_created("").unwrap_err();
        assert!(e.to_string().contains("printed nothing"), "{e}");
    }

    /// An `nvidia-smi` that answers as the driver does for two H200s, one in MIG mode, from
    /// the instances listed in `gis` beside it (`gi profile-id name start size` lines).
    const FAKE_SMI: &str = r#"#!/bin/bash
d=$(dirname "$0"); st=$d/gis; touch "$st"; echo "$*" >> "$d/calls"
[ -e "$d/hang" ] && exec sleep 30
case "$*" in
"--query-gpu=pci.bus_id,name,mig.mode.current --format=csv,noheader")
  echo "00000000:18:00.0, NVIDIA H200, Enabled"; echo "00000000:19:00.0, NVIDIA H200, Disabled";;
"mig -i 00000000:19:00.0 "*) echo "No MIG-enabled devices found.";;
"mig -i 00000000:18:00.0 -lgi")
  [ -s "$st" ] || { echo "No GPU instances found."; exit 0; }
  echo "+----+"; echo "| GPU instances: |"; echo "| GPU Name Profile Instance Placement |"; echo "|  ID ID Start:Size |"; echo "|====|"
  while read -r gi id name start size; do echo "|   0  MIG $name   $id   $gi   $start:$size   |"; echo "+----+"; done < "$st";;
"mig -i 00000000:18:00.0 -lci")
  [ -s "$st" ] || { echo "No compute instances found."; exit 0; }
  echo "| Compute instances: |"; echo "|====|"
  while read -r gi id name start size; do echo "|   0   $gi   MIG $name   0   0   0:1   |"; done < "$st";;
"mig -i 00000000:18:00.0 -cgi "*" -C")
  t=${5%:*}; s=${5#*:}
  case $t in 19) n=1g.18gb; z=1;; 9) n=3g.71gb; z=4;; *) echo "Unable to create a GPU instance: Invalid Argument"; exit 0;; esac
  gi=$(( $(cut -d' ' -f1 "$st" | sort -n | tail -1) + 1 ))
  echo "$gi $t $n $s $z" >> "$st"
  echo "Successfully created GPU instance ID  $gi on GPU  0 using profile MIG $n (ID $t)"
  echo "Successfully created compute instance ID  0 on GPU  0 GPU instance ID  $gi using profile MIG $n (ID  0)";;
"mig -i 00000000:18:00.0 -gi "*" -dci") echo "Successfully destroyed compute instance ID  0 from GPU  0 GPU instance ID  $5";;
"mig -i 00000000:18:00.0 -gi "*" -dgi")
  grep -v "^$5 " "$st" > "$st.new"; mv "$st.new" "$st"; echo "Successfully destroyed GPU instance ID  $5 from GPU  0";;
*) echo "unexpected: $*" >&2; exit 3;;
esac
"#;

    fn fake_smi(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let smi = dir.join("nvidia-smi");
        std::fs::write(&smi, FAKE_SMI).unwrap();
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
        smi
    }

    #[test]
    fn instances_are_made_listed_and_destroyed_through_nvidia_smi() {
        let tmp = tempfile::tempdir().unwrap();
        let smi = fake_smi(tmp.path());
        let mig = SmiMig::new(smi, ledger_in(&tmp.path().join("state")));
        let on: PciAddress = "0000:18:00.0".parse().unwrap();
        let off: PciAddress = "0000:19:00.0".parse().unwrap();
        // One instance the admin made: reported, never destroyed.
        std::fs::write(tmp.path().join("gis"), "1 19 1g.18gb 0 1\n").unwrap();
        let gpus = mig.gpus().unwrap();
        assert_eq!(gpus.len(), 2);
        assert!(gpus[0].enabled && !gpus[1].enabled);
        assert_eq!(gpus[0].instances.len(), 1);
        assert!(!gpus[0].instances[0].by_xpu);

        let small = mig.create(on, "1g.18gb", 3).unwrap();
        assert_eq!((small.gi, small.profile, small.start, small.by_xpu), (2, "1g.18gb", 3, true));
        let big = mig.create(on, "3g.71gb", 4).unwrap();
        assert_eq!(big.gi, 3);
        let calls = std::fs::read_to_string(tmp.path().join("calls")).unwrap();
        assert!(calls.contains("mig -i 00000000:18:00.0 -cgi 19:3 -C"), "{calls}");
        assert!(calls.contains("-cgi 9:4 -C"), "{calls}");
        // Refused by the tables before nvidia-smi runs: a taken slice, a profile no H200 has,
        // MIG off, a GPU that is not there.
        for (gpu, profile, start, want) in [
            (on, "1g.18gb", 0, "memory slice"),
            (on, "5g.99gb", 0, "5g.99gb"),
            (off, "1g.18gb", 0, "MIG mode is off"),
            ("0000:20:00.0".parse().unwrap(), "1g.18gb", 0, "no GPU at 0000:20:00.0"),
        ] {
            let e = mig.create(gpu, profile, start).unwrap_err().to_string();
            assert!(e.contains(want), "{profile}@{start}: {e}");
        }
        let made = mig.gpus().unwrap()[0].instances.iter().filter(|i| i.by_xpu).count();
        assert_eq!(made, 2);
        assert!(matches!(mig.destroy(on, 1), Err(MigControlError::NotOurs { .. })));
        mig.destroy(on, 2).unwrap();
        assert!(matches!(mig.destroy(on, 2), Err(MigControlError::NoInstance { .. })));
        let left: Vec<u32> = mig.gpus().unwrap()[0].instances.iter().map(|i| i.gi).collect();
        assert_eq!(left, vec![1, 3]);
        // A new control over the same ledger (a restarted driver) knows its instance.
        let again =
            SmiMig::new(tmp.path().join("nvidia-smi"), ledger_in(&tmp.path().join("state")));
        assert!(again.gpus().unwrap()[0].instances.iter().any(|i| i.gi == 3 && i.by_xpu));
        // The admin replaces xpu's instance 3 by one of their own under the same id: not ours.
        std::fs::write(tmp.path().join("gis"), "1 19 1g.18gb 0 1\n3 19 1g.18gb 5 1\n").unwrap();
        assert!(matches!(again.destroy(on, 3), Err(MigControlError::NotOurs { .. })));

        // A hung nvidia-smi is killed at the limit and said so.
        std::fs::write(tmp.path().join("hang"), "").unwrap();
        let slow = SmiMig::new(tmp.path().join("nvidia-smi"), ledger_in(tmp.path()))
            .with_limit(Duration::from_millis(300));
        let e = slow.gpus().unwrap_err().to_string();
        assert!(e.contains("no answer in"), "{e}");
    }

    #[test]
    fn the_query_names_gpus_and_their_mode() {
        let q = "00000000:00:06.0, NVIDIA H200, Disabled\n00000000:18:00.0, NVIDIA A100-SXM4-80GB, Enabled\n00000000:3b:00.0, Tesla T4, [N/A]\n";
        let g = parse_query(q).unwrap();
        assert_eq!(g.len(), 3);
        assert_eq!(g[0], ("0000:00:06.0".parse().unwrap(), "NVIDIA H200".to_owned(), false));
        assert!(g[1].2);
        assert!(!g[2].2);
        assert!(parse_query("garbage\n").is_err());
        assert_eq!(bus_id("0000:18:00.0".parse().unwrap()), "00000000:18:00.0");
    }
}
