//! Binding PCI devices to `vfio-pci` and back, safely: `xpu vfio bind|unbind|status`.
//!
//! The kernel interface (Documentation/ABI/testing/sysfs-bus-pci, and the sequence libvirt
//! uses): write `vfio-pci` to the device's `driver_override`, write the address to the current
//! driver's `unbind`, write it to `/sys/bus/pci/drivers_probe`, which offers the device to the
//! override driver only. Every write goes through [`Kernel`]; every step is verified by reading
//! the `driver` link back under the [`Root`].
//!
//! Safety rules:
//! - IOMMU group viability (kernel Documentation/driver-api/vfio.rst, "Groups, Devices, and
//!   IOMMUs"): a group can be given to a guest only when every endpoint in it is on `vfio-pci`,
//!   `pci-stub` or no driver; bridges are exempt. A bind that would leave a peer endpoint on a
//!   host driver is refused unless `--group` asks to bind the whole group.
//! - The previous driver and `driver_override` of every device moved are recorded in
//!   `/var/lib/xpu/vfio-state.json` under the root; `unbind` restores them (a device with no
//!   record goes back to the kernel's normal matching: override cleared, device reprobed).
//! - If any step fails, every device touched so far is moved back to its exact starting
//!   driver and override, in reverse order, and the error says so. Loading `vfio-pci` is not
//!   undone (a loaded, unused module changes nothing).
//! - Re-binding a device already on `vfio-pci` makes no write at all.
//!
//! Devices come from the [`Inventory`] (discovered with every PCI function, so group peers
//! are known); only the `driver` link and `driver_override` are re-read, to verify.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use xpu_core::kernel::{Kernel, KernelError, KernelOp};
use xpu_core::{Inventory, PciAddress, PciDevice};

use crate::profile::Profile;
use crate::provision::{self, BIND_SCRIPT, FileChange, MODULES_LOAD_VFIO, ProvisionError};
use crate::{Root, devnode};

pub const VFIO_DRIVER: &str = "vfio-pci";
/// Drivers that keep a group viable (plus no driver at all).
pub const VIABLE_DRIVERS: [&str; 2] = ["vfio-pci", "pci-stub"];
pub const STATE_FILE: &str = "/var/lib/xpu/vfio-state.json";
pub const PERSIST_RULES: &str = "/etc/udev/rules.d/98-xpu-vfio-bind.rules";

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("no devices given; pass PCI addresses (dddd:bb:dd.f) or --all-accelerators")]
    NoTargets,
    #[error(
        "device {0} does not exist under /sys/bus/pci/devices; check the address with xpu discover --all"
    )]
    NotFound(PciAddress),
    #[error("device {0} is a PCI bridge; bridges stay with the host, pass the endpoints behind it")]
    Bridge(PciAddress),
    #[error(
        "device {0} has no IOMMU group, so it cannot be passed through; enable the IOMMU (xpu host apply --profile vfio-host, then reboot) and check with xpu doctor"
    )]
    NoIommuGroup(PciAddress),
    #[error("device {address} is in IOMMU group {group} with {peers}; {action} or pass --group")]
    GroupNotViable { address: PciAddress, group: u32, peers: String, action: &'static str },
    #[error("{action} {address}: {step}; {rollback}")]
    Failed { action: &'static str, address: String, step: String, rollback: String },
    #[error("cannot use the VFIO state file {path}: {reason}; fix or remove it")]
    State { path: String, reason: String },
    #[error(transparent)]
    Persist(#[from] ProvisionError),
}

impl VfioError {
    /// Errors caused by what the user typed (exit 2), as opposed to host state (exit 1).
    pub fn is_input(&self) -> bool {
        match self {
            VfioError::NoTargets | VfioError::NotFound(_) | VfioError::Bridge(_) => true,
            // A link out of the root, a FIFO where a rule file should be: the tree given.
            VfioError::Persist(ProvisionError::Path(p)) => !p.is_io(),
            _ => false,
        }
    }
}

/// What to bind or unbind.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub addresses: Vec<PciAddress>,
    pub all_accelerators: bool,
    /// Include the other endpoints of each device's IOMMU group.
    pub group: bool,
    /// Write the udev rule and module load entry that redo the bind at boot.
    pub persist: bool,
    /// Plan only: report the kernel writes and file changes without making them.
    pub dry_run: bool,
}

/// What happened to one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Moved {
    pub address: PciAddress,
    pub before: Option<String>,
    pub after: Option<String>,
    /// `false` when the device already was where it had to be.
    pub changed: bool,
}

/// The result of a bind or unbind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub action: &'static str,
    pub dry_run: bool,
    pub devices: Vec<Moved>,
    /// Kernel operations made (or, in a dry run, planned), in their shell form, in order.
    pub operations: Vec<String>,
    pub persisted: Vec<FileChange>,
}

impl Outcome {
    pub fn changed(&self) -> bool {
        !self.operations.is_empty() || self.persisted.iter().any(|f| f.action != "unchanged")
    }
}

/// The recorded previous state of devices xpu moved to `vfio-pci`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub devices: BTreeMap<String, DevState>,
    /// When xpu moved each device to `vfio-pci`, Unix seconds (`xpu vfio status` says since
    /// when); absent in files written before it was recorded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub since: BTreeMap<String, u64>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A device's binding: its driver and its `driver_override` (`None` for the kernel's
/// `(null)`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DevState {
    pub driver: Option<String>,
    pub driver_override: Option<String>,
}

fn dev_dir(addr: &PciAddress) -> String {
    format!("/sys/bus/pci/devices/{addr}")
}

/// Whether the kernel marks `addr` as the boot VGA device (its `boot_vga` reads `1`): the
/// console's framebuffer lives on it, so it stays with the host.
pub fn boot_vga(root: &Root, addr: &PciAddress) -> bool {
    root.read_bounded(&root.path(format!("{}/boot_vga", dev_dir(addr))), crate::root::ATTR_MAX)
        .is_ok_and(|b| String::from_utf8_lossy(&b).trim() == "1")
}

/// Reads a device's driver link and override now.
pub fn read_dev_state(root: &Root, addr: &PciAddress) -> DevState {
    let dir = dev_dir(addr);
    let driver = std::fs::read_link(root.path(format!("{dir}/driver")))
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()));
    let driver_override = root
        .read_bounded(&root.path(format!("{dir}/driver_override")), crate::root::ATTR_MAX)
        .ok()
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .filter(|s| !s.is_empty() && s != "(null)");
    DevState { driver, driver_override }
}

fn driver_loaded(root: &Root, driver: &str) -> bool {
    root.path(format!("/sys/bus/pci/drivers/{driver}")).is_dir()
}

pub fn load_state(root: &Root) -> Result<State, VfioError> {
    let err = |reason: String| VfioError::State { path: STATE_FILE.to_owned(), reason };
    match root.read_file(STATE_FILE).map_err(ProvisionError::from)? {
        Some(f) => serde_json::from_slice(&f.bytes).map_err(|e| err(e.to_string())),
        None => Ok(State::default()),
    }
}

fn save_state(root: &Root, state: &State) -> Result<(), VfioError> {
    let text = serde_json::to_string_pretty(state)
        .map_err(|e| VfioError::State { path: STATE_FILE.to_owned(), reason: e.to_string() })?;
    root.write_file(STATE_FILE, (text + "\n").as_bytes(), 0o644).map_err(ProvisionError::from)?;
    Ok(())
}

/// Where a device should end up.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Driver(String),
    /// No driver.
    Unbound,
    /// The kernel's normal matching (override cleared, reprobed): any driver but vfio-pci.
    Natural,
}

fn resolve<'a>(inv: &'a Inventory, req: &Request) -> Result<Vec<&'a PciDevice>, VfioError> {
    let mut set: BTreeSet<PciAddress> = req.addresses.iter().copied().collect();
    if req.all_accelerators {
        set.extend(inv.accelerators().map(|d| d.address));
    }
    if set.is_empty() {
        return Err(VfioError::NoTargets);
    }
    set.into_iter()
        .map(|a| {
            let d = inv.device(&a).ok_or(VfioError::NotFound(a))?;
            if d.is_bridge() {
                return Err(VfioError::Bridge(a));
            }
            Ok(d)
        })
        .collect()
}

fn peer_list(peers: &[&PciDevice]) -> String {
    let items: Vec<String> = peers
        .iter()
        .map(|p| format!("{} ({})", p.address, p.driver.as_deref().unwrap_or("no driver")))
        .collect();
    match items.len() {
        0 => String::new(),
        1 => items[0].clone(),
        n => format!("{} and {}", items[..n - 1].join(", "), items[n - 1]),
    }
}

/// Carries out the moves, rolling everything back on the first failure.
struct Mover<'a, K: Kernel + ?Sized> {
    root: &'a Root,
    kernel: &'a mut K,
    ops: Vec<String>,
}

impl<K: Kernel + ?Sized> Mover<'_, K> {
    fn apply(&mut self, op: KernelOp) -> Result<(), KernelError> {
        self.ops.push(op.to_string());
        self.kernel.apply(&op)
    }

    /// Moves one device from its current state to `to`, ending with `final_override`.
    fn move_one(
        &mut self,
        addr: PciAddress,
        to: &Target,
        final_override: Option<&str>,
    ) -> Result<(), String> {
        let now = read_dev_state(self.root, &addr);
        let mut current_override = now.driver_override.clone();
        let set_override = |m: &mut Self, d: Option<&str>| {
            m.apply(KernelOp::DriverOverride { device: addr, driver: d.map(str::to_owned) })
                .map_err(|e| e.to_string())
        };
        let wanted_driver = match to {
            Target::Driver(d) => Some(d.as_str()),
            Target::Unbound | Target::Natural => None,
        };
        if let Target::Driver(d) = to
            && now.driver.as_deref() == Some(d.as_str())
        {
            if current_override.as_deref() != final_override {
                set_override(self, final_override)?;
            }
            return Ok(());
        }
        if current_override.as_deref() != wanted_driver {
            set_override(self, wanted_driver)?;
            current_override = wanted_driver.map(str::to_owned);
        }
        if let Some(cur) = &now.driver {
            self.apply(KernelOp::Unbind { device: addr, driver: cur.clone() })
                .map_err(|e| e.to_string())?;
            let after = read_dev_state(self.root, &addr);
            if let Some(still) = after.driver {
                return Err(format!(
                    "{addr} is still bound to {still} after writing to {cur}'s unbind"
                ));
            }
        }
        if *to != Target::Unbound {
            self.apply(KernelOp::Probe { device: addr }).map_err(|e| e.to_string())?;
            let after = read_dev_state(self.root, &addr);
            let ok = match to {
                Target::Driver(d) => after.driver.as_deref() == Some(d.as_str()),
                _ => after.driver.as_deref() != Some(VFIO_DRIVER),
            };
            if !ok {
                return Err(format!(
                    "{addr} is on {} after drivers_probe, expected {}",
                    after.driver.as_deref().unwrap_or("no driver"),
                    wanted_driver.unwrap_or("any driver but vfio-pci")
                ));
            }
        }
        if current_override.as_deref() != final_override {
            set_override(self, final_override)?;
        }
        Ok(())
    }

    /// Puts every touched device back to its starting state, newest first. Returns a sentence
    /// for the error message.
    fn rollback(&mut self, touched: &[(PciAddress, DevState)]) -> String {
        let mut failed = Vec::new();
        for (addr, start) in touched.iter().rev() {
            if read_dev_state(self.root, addr) == *start {
                continue;
            }
            let to = match &start.driver {
                Some(d) => Target::Driver(d.clone()),
                None => Target::Unbound,
            };
            if let Err(e) = self.move_one(*addr, &to, start.driver_override.as_deref()) {
                let now = read_dev_state(self.root, addr);
                failed.push(format!(
                    "{addr} could not be restored to {} ({e}); it is now on {}",
                    start.driver.as_deref().unwrap_or("no driver"),
                    now.driver.as_deref().unwrap_or("no driver")
                ));
            }
        }
        if failed.is_empty() {
            let n = touched.len();
            format!(
                "rolled back: {n} device{} left exactly as {} {}",
                if n == 1 { "" } else { "s" },
                if n == 1 { "it" } else { "they" },
                if n == 1 { "was" } else { "were" }
            )
        } else {
            format!(
                "rollback incomplete: {}; restore them by hand (xpu vfio status)",
                failed.join("; ")
            )
        }
    }

    /// Runs `moves` in order; on failure rolls back and returns the error.
    fn run(
        &mut self,
        action: &'static str,
        moves: &[(PciAddress, Target, Option<String>)],
    ) -> Result<Vec<(PciAddress, DevState)>, VfioError> {
        let mut touched: Vec<(PciAddress, DevState)> = Vec::new();
        for (addr, to, final_override) in moves {
            touched.push((*addr, read_dev_state(self.root, addr)));
            if let Err(step) = self.move_one(*addr, to, final_override.as_deref()) {
                let rollback = self.rollback(&touched);
                return Err(VfioError::Failed {
                    action,
                    address: addr.to_string(),
                    step,
                    rollback,
                });
            }
        }
        Ok(touched)
    }
}

/// The kernel operations a move would make from the device's state as the inventory shows it,
/// for dry runs.
fn plan_move(
    addr: PciAddress,
    now: &DevState,
    to: &Target,
    final_override: Option<&str>,
) -> Vec<KernelOp> {
    let mut ops = Vec::new();
    let wanted = match to {
        Target::Driver(d) => Some(d.clone()),
        _ => None,
    };
    let mut ov = now.driver_override.clone();
    if ov != wanted {
        ops.push(KernelOp::DriverOverride { device: addr, driver: wanted.clone() });
        ov = wanted;
    }
    if let Some(cur) = &now.driver {
        ops.push(KernelOp::Unbind { device: addr, driver: cur.clone() });
    }
    if *to != Target::Unbound {
        ops.push(KernelOp::Probe { device: addr });
    }
    if ov.as_deref() != final_override {
        ops.push(KernelOp::DriverOverride {
            device: addr,
            driver: final_override.map(str::to_owned),
        });
    }
    ops
}

/// Binds the requested devices to `vfio-pci`.
pub fn bind<K: Kernel + ?Sized>(
    root: &Root,
    inv: &Inventory,
    kernel: &mut K,
    req: &Request,
) -> Result<Outcome, VfioError> {
    let targets = resolve(inv, req)?;
    let mut set: BTreeSet<PciAddress> = targets.iter().map(|d| d.address).collect();
    for d in &targets {
        let group = d.iommu_group.ok_or(VfioError::NoIommuGroup(d.address))?;
        let endpoints: Vec<&PciDevice> = inv
            .iommu_group(group)
            .filter(|p| p.address != d.address && !p.is_bridge() && !set.contains(&p.address))
            .collect();
        if req.group {
            // The whole group goes to vfio-pci; functions parked on pci-stub may stay there.
            set.extend(
                endpoints
                    .iter()
                    .filter(|p| p.driver.as_deref() != Some("pci-stub"))
                    .map(|p| p.address),
            );
            continue;
        }
        let blockers: Vec<&PciDevice> = endpoints
            .into_iter()
            .filter(|p| p.driver.as_deref().is_some_and(|drv| !VIABLE_DRIVERS.contains(&drv)))
            .collect();
        if !blockers.is_empty() {
            return Err(VfioError::GroupNotViable {
                address: d.address,
                group,
                peers: peer_list(&blockers),
                action: if blockers.len() == 1 { "bind both" } else { "bind them all" },
            });
        }
    }

    let mut devices = Vec::new();
    let mut moves = Vec::new();
    for addr in &set {
        let now = read_dev_state(root, addr);
        let changed = now.driver.as_deref() != Some(VFIO_DRIVER);
        devices.push(Moved {
            address: *addr,
            before: now.driver.clone(),
            after: Some(VFIO_DRIVER.to_owned()),
            changed,
        });
        if changed {
            moves.push((
                *addr,
                Target::Driver(VFIO_DRIVER.to_owned()),
                Some(VFIO_DRIVER.to_owned()),
                now,
            ));
        }
    }
    let mut outcome = Outcome {
        action: "bind",
        dry_run: req.dry_run,
        devices,
        operations: Vec::new(),
        persisted: Vec::new(),
    };
    let need_module = !moves.is_empty() && !driver_loaded(root, VFIO_DRIVER);

    if req.dry_run {
        if need_module {
            outcome
                .operations
                .push(KernelOp::Modprobe { module: VFIO_DRIVER.to_owned() }.to_string());
        }
        for (addr, to, fo, now) in &moves {
            outcome
                .operations
                .extend(plan_move(*addr, now, to, fo.as_deref()).iter().map(ToString::to_string));
        }
    } else if !moves.is_empty() {
        let mut m = Mover { root, kernel, ops: Vec::new() };
        if need_module {
            let op = KernelOp::Modprobe { module: VFIO_DRIVER.to_owned() };
            let loaded = m.apply(op).map_err(|e| e.to_string());
            if let Err(step) = loaded.clone().and_then(|()| {
                if driver_loaded(root, VFIO_DRIVER) {
                    Ok(())
                } else {
                    Err("modprobe vfio-pci succeeded but /sys/bus/pci/drivers/vfio-pci did not appear".to_owned())
                }
            }) {
                return Err(VfioError::Failed {
                    action: "bind",
                    address: "vfio-pci".to_owned(),
                    step,
                    rollback: "no device was touched".to_owned(),
                });
            }
        }
        let plan: Vec<(PciAddress, Target, Option<String>)> =
            moves.iter().map(|(a, t, f, _)| (*a, t.clone(), f.clone())).collect();
        let result = m.run("bind", &plan);
        outcome.operations = m.ops;
        let touched = result?;
        let mut state = load_state(root)?;
        let now = unix_now();
        for (addr, start) in touched {
            state.devices.entry(addr.to_string()).or_insert(start);
            state.since.entry(addr.to_string()).or_insert(now);
        }
        save_state(root, &state)?;
    }
    if req.persist {
        outcome.persisted = persist(root, &set, &BTreeSet::new(), req.dry_run)?;
    }
    Ok(outcome)
}

/// Returns the requested devices from `vfio-pci` to the drivers they had before xpu bound them.
pub fn unbind<K: Kernel + ?Sized>(
    root: &Root,
    inv: &Inventory,
    kernel: &mut K,
    req: &Request,
) -> Result<Outcome, VfioError> {
    let targets = resolve(inv, req)?;
    let state = load_state(root)?;
    let mut set: BTreeSet<PciAddress> = targets
        .iter()
        .filter(|d| d.driver.as_deref() == Some(VFIO_DRIVER))
        .map(|d| d.address)
        .collect();
    // A device leaving vfio-pci for a host driver breaks its group for any peer still on
    // vfio-pci (a guest could reach the host device through the shared IOMMU context).
    let leaving: Vec<&PciDevice> =
        targets.iter().copied().filter(|d| set.contains(&d.address)).collect();
    for d in leaving {
        let to_host = state.devices.get(&d.address.to_string()).is_none_or(|s| s.driver.is_some());
        let Some(group) = d.iommu_group else { continue };
        if !to_host {
            continue;
        }
        let peers: Vec<&PciDevice> = inv
            .iommu_group(group)
            .filter(|p| p.address != d.address && !p.is_bridge() && !set.contains(&p.address))
            .filter(|p| p.driver.as_deref() == Some(VFIO_DRIVER))
            .collect();
        if peers.is_empty() {
            continue;
        }
        if req.group {
            set.extend(peers.iter().map(|p| p.address));
        } else {
            return Err(VfioError::GroupNotViable {
                address: d.address,
                group,
                peers: format!("{}, which would stay on vfio-pci", peer_list(&peers)),
                action: if peers.len() == 1 { "unbind both" } else { "unbind them all" },
            });
        }
    }

    let mut devices = Vec::new();
    for d in &targets {
        if !set.contains(&d.address) {
            devices.push(Moved {
                address: d.address,
                before: d.driver.clone(),
                after: d.driver.clone(),
                changed: false,
            });
        }
    }
    let mut moves = Vec::new();
    for addr in &set {
        let now = read_dev_state(root, addr);
        let saved = state.devices.get(&addr.to_string());
        let (to, fo) = match saved {
            Some(s) => (
                s.driver.clone().map_or(Target::Unbound, Target::Driver),
                s.driver_override.clone(),
            ),
            None => (Target::Natural, None),
        };
        devices.push(Moved {
            address: *addr,
            before: now.driver.clone(),
            after: match &to {
                Target::Driver(d) => Some(d.clone()),
                _ => None,
            },
            changed: true,
        });
        moves.push((*addr, to, fo, now));
    }
    devices.sort_by_key(|m| m.address);
    let mut outcome = Outcome {
        action: "unbind",
        dry_run: req.dry_run,
        devices,
        operations: Vec::new(),
        persisted: Vec::new(),
    };
    if req.dry_run {
        for (addr, to, fo, now) in &moves {
            outcome
                .operations
                .extend(plan_move(*addr, now, to, fo.as_deref()).iter().map(ToString::to_string));
        }
    } else if !moves.is_empty() {
        let mut m = Mover { root, kernel, ops: Vec::new() };
        let plan: Vec<(PciAddress, Target, Option<String>)> =
            moves.iter().map(|(a, t, f, _)| (*a, t.clone(), f.clone())).collect();
        let result = m.run("unbind", &plan);
        outcome.operations = m.ops;
        result?;
        // Devices sent to the kernel's own matching report where they landed.
        for d in &mut outcome.devices {
            if d.changed {
                d.after = read_dev_state(root, &d.address).driver;
            }
        }
        let mut state = state;
        for addr in &set {
            state.devices.remove(&addr.to_string());
            state.since.remove(&addr.to_string());
        }
        save_state(root, &state)?;
    }
    if req.persist {
        let all: BTreeSet<PciAddress> =
            targets.iter().map(|d| d.address).chain(set.iter().copied()).collect();
        outcome.persisted = persist(root, &BTreeSet::new(), &all, req.dry_run)?;
    }
    Ok(outcome)
}

/// Adds and removes addresses in the boot-time bind rule, and makes sure VFIO loads at boot.
fn persist(
    root: &Root,
    add: &BTreeSet<PciAddress>,
    remove: &BTreeSet<PciAddress>,
    dry_run: bool,
) -> Result<Vec<FileChange>, VfioError> {
    // Read inside the root, as the write will be: a link there is an error, not followed.
    let existing = root.read_file(PERSIST_RULES).map_err(ProvisionError::from)?;
    let existing = existing.map(|f| String::from_utf8_lossy(&f.bytes).into_owned());
    let existing = existing.unwrap_or_default();
    let mut addrs: BTreeSet<PciAddress> = existing
        .lines()
        .filter_map(|l| l.split("KERNEL==\"").nth(1)?.split('"').next()?.parse().ok())
        .collect();
    addrs.extend(add);
    addrs.retain(|a| !remove.contains(a));
    let mut rules = String::from(
        "# Written by xpu vfio bind --persist: bind these devices to vfio-pci at every boot.\n",
    );
    for a in &addrs {
        rules.push_str(&format!(
            "ACTION==\"add\", SUBSYSTEM==\"pci\", KERNEL==\"{a}\", DRIVER!=\"vfio-pci\", RUN+=\"{BIND_SCRIPT} $kernel\"\n"
        ));
    }
    let mut changes =
        vec![provision::stage_and_write(root, PERSIST_RULES, &rules, 0o644, dry_run)?];
    if !addrs.is_empty() {
        // A script written by `xpu host apply` (tpu-vm's opens the node too) is kept.
        if !root.exists(BIND_SCRIPT).map_err(ProvisionError::from)? {
            let script = provision::bind_script(Profile::VfioHost);
            changes.push(provision::stage_and_write(root, BIND_SCRIPT, &script, 0o755, dry_run)?);
        }
        if !root.exists(MODULES_LOAD_VFIO).map_err(ProvisionError::from)? {
            let content = "# Written by xpu vfio bind --persist: load VFIO at boot.\nvfio\nvfio_iommu_type1\nvfio_pci\n";
            changes.push(provision::stage_and_write(
                root,
                MODULES_LOAD_VFIO,
                content,
                0o644,
                dry_run,
            )?);
        }
    }
    Ok(changes)
}

/// A group peer that keeps the group from being passed through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Blocker {
    pub address: PciAddress,
    pub driver: Option<String>,
}

/// `/dev/vfio/<group>` as it is now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VfioNode {
    pub path: String,
    pub exists: bool,
    /// Permission bits as an octal string (`"0600"`), `null` when the node is absent.
    pub mode: Option<String>,
}

/// One device, as `xpu vfio status` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceStatus {
    pub address: PciAddress,
    pub kind: String,
    /// `vvvv:dddd`
    pub ids: String,
    pub driver: Option<String>,
    pub driver_override: Option<String>,
    pub iommu_group: Option<u32>,
    /// Every endpoint of the group is on vfio-pci, pci-stub or no driver.
    pub group_viable: bool,
    /// Endpoints of the group (this device included) that are on another driver.
    pub blockers: Vec<Blocker>,
    pub vfio_node: Option<VfioNode>,
    /// The driver `xpu vfio unbind` will restore, when xpu bound the device.
    pub previous_driver: Option<String>,
    /// When xpu moved it to `vfio-pci`, Unix seconds.
    pub vfio_since: Option<u64>,
}

/// Which use holds a device that no prepared DRA claim holds, and since when (Unix seconds,
/// when known): Nova's when it is listed in `/etc/xpu/vm-devices` (`kept`), a VM's through
/// xpu's own `vfio bind` (its state file) or one bound outside xpu when on `vfio-pci`, else the
/// host's driver, or `free`. `xpu vfio status` and `xpu serve`'s devices both say it this way.
pub fn held_by(status: &DeviceStatus, kept: &BTreeSet<PciAddress>) -> (String, Option<u64>) {
    let on_vfio = status.driver.as_deref() == Some(VFIO_DRIVER);
    if kept.contains(&status.address) {
        return (format!("nova: listed in {}", crate::vm_devices::VM_DEVICES), status.vfio_since);
    }
    if on_vfio {
        let by = if status.previous_driver.is_some() || status.vfio_since.is_some() {
            "xpu vfio bind"
        } else {
            "bound outside xpu"
        };
        return (format!("vfio-pci: {by}"), status.vfio_since);
    }
    match &status.driver {
        Some(d) => (format!("host: {d}"), None),
        None => ("free".to_owned(), None),
    }
}

/// Whether `group` can be handed to a guest as it is, and what blocks it.
pub fn group_blockers(inv: &Inventory, group: u32) -> Vec<Blocker> {
    inv.iommu_group(group)
        .filter(|p| !p.is_bridge())
        .filter(|p| p.driver.as_deref().is_some_and(|d| !VIABLE_DRIVERS.contains(&d)))
        .map(|p| Blocker { address: p.address, driver: p.driver.clone() })
        .collect()
}

/// Status of the given devices, or (none given) of the accelerators and their group peers, or
/// (`all_accelerators`) of the accelerators.
pub fn status(
    root: &Root,
    inv: &Inventory,
    addresses: &[PciAddress],
    all_accelerators: bool,
) -> Result<Vec<DeviceStatus>, VfioError> {
    let state = load_state(root)?;
    let mut list: Vec<&PciDevice> = Vec::new();
    for a in addresses {
        list.push(inv.device(a).ok_or(VfioError::NotFound(*a))?);
    }
    if all_accelerators {
        list.extend(inv.accelerators());
    }
    if addresses.is_empty() && !all_accelerators {
        let groups: BTreeSet<u32> = inv.accelerators().filter_map(|d| d.iommu_group).collect();
        list.extend(inv.devices.iter().filter(|d| {
            d.kind.is_accelerator() || d.iommu_group.is_some_and(|g| groups.contains(&g))
        }));
    }
    list.sort_by_key(|d| d.address);
    list.dedup_by_key(|d| d.address);
    Ok(list
        .into_iter()
        .map(|d| {
            let now = read_dev_state(root, &d.address);
            let blockers = d.iommu_group.map(|g| group_blockers(inv, g)).unwrap_or_default();
            let vfio_node = d.iommu_group.map(|g| {
                let path = format!("/dev/vfio/{g}");
                let node = devnode::stat(root, &path);
                VfioNode {
                    exists: node.is_some(),
                    mode: node.and_then(|n| n.mode).map(|m| format!("{m:04o}")),
                    path,
                }
            });
            DeviceStatus {
                address: d.address,
                kind: d.kind.to_string(),
                ids: d.ids(),
                driver: now.driver,
                driver_override: now.driver_override,
                iommu_group: d.iommu_group,
                group_viable: d.iommu_group.is_some() && blockers.is_empty(),
                blockers,
                vfio_node,
                previous_driver: state
                    .devices
                    .get(&d.address.to_string())
                    .and_then(|s| s.driver.clone()),
                vfio_since: state.since.get(&d.address.to_string()).copied(),
            }
        })
        .collect())
}
