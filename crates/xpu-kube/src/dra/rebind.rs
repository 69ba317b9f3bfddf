//! A device published once, for containers or for VMs, chosen per claim: a claim in
//! `passthrough` mode for a device on its vendor driver moves the device, with every other
//! endpoint of its IOMMU group (bridges stay), to `vfio-pci` in `NodePrepareResources`, and
//! `NodeUnprepareResources` returns each function to the driver it had.
//!
//! The moves are `xpu vfio bind --group` and `xpu vfio unbind` ([`xpu_host::vfio`]): every
//! kernel write goes through [`Kernel`], each step is verified by reading the `driver` link
//! back, a failure at any write returns every device touched to its starting driver and
//! override, and the previous drivers are recorded in the VFIO state file under the root. What
//! is checked here first, so that a move is never started that the kernel would allow but the
//! node must not: a device with no IOMMU group at all, a group that holds the host's boot GPU
//! (the console's framebuffer lives on it) or a function that is no part of an accelerator (a
//! NIC sharing a GPU's group on a board without ACS), and a group with a device another claim
//! holds (in a container, or passed through already) or Nova keeps. Each refusal names the group
//! and its members.

use std::collections::BTreeMap;

use xpu_core::kernel::Kernel;
use xpu_core::{Inventory, PciAddress, PciDevice};
use xpu_host::{Root, vfio, vm_devices};

/// Why a claim's devices are not moved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RebindError {
    #[error(
        "device {address} has no IOMMU group, so it cannot be passed through; enable the IOMMU on this node (xpu host apply --profile vfio-host, then reboot)"
    )]
    NoGroup { address: PciAddress },
    #[error("device {address} is in IOMMU group {group} ({members}), {why}")]
    Group { address: PciAddress, group: u32, members: String, why: String },
    #[error("{0}; no device is passed through until it reads")]
    List(String),
    #[error("moving the devices of IOMMU group {groups} to vfio-pci: {reason}")]
    Bind { groups: String, reason: String },
    #[error("returning {devices} from vfio-pci: {reason}")]
    Unbind { devices: String, reason: String },
}

/// The endpoints of IOMMU group `group` (bridges left out).
fn endpoints(inv: &Inventory, group: u32) -> Vec<&PciDevice> {
    inv.iommu_group(group).filter(|p| !p.is_bridge()).collect()
}

/// A member of a group that must not go to a VM with it: the host's boot GPU, or a function
/// that is not part of an accelerator (neither one itself nor a function of an accelerator's
/// slot, as a GPU's HDMI audio function is): a NIC or a disk controller sharing the group of a
/// GPU on a board without ACS would reach the claim's VM.
fn host_member(root: &Root, members: &[&PciDevice]) -> Option<(PciAddress, String)> {
    let slot = |a: &PciAddress| (a.domain, a.bus, a.device);
    let accelerators: Vec<_> =
        members.iter().filter(|m| m.kind.is_accelerator()).map(|m| slot(&m.address)).collect();
    members.iter().find_map(|m| {
        if vfio::boot_vga(root, &m.address) {
            Some((
                m.address,
                format!(
                    "which holds the host's boot GPU {}: it stays with the host; pass through a device of another group",
                    m.address
                ),
            ))
        } else if !accelerators.contains(&slot(&m.address)) {
            Some((
                m.address,
                format!(
                    "and {} ({}) in it is not part of an accelerator: passing the group through would give it to the VM",
                    m.address,
                    m.driver.as_deref().unwrap_or("no driver")
                ),
            ))
        } else {
            None
        }
    })
}

/// Whether `d` can be passed through: on `vfio-pci` already, or in an IOMMU group whose every
/// member may go to a VM with it (what [`check`] refuses whoever holds what).
pub fn capable(root: &Root, inv: &Inventory, d: &PciDevice) -> bool {
    d.driver.as_deref() == Some(vfio::VFIO_DRIVER)
        || d.iommu_group.is_some_and(|g| host_member(root, &endpoints(inv, g)).is_none())
}

fn member_list(members: &[&PciDevice]) -> String {
    let items: Vec<String> = members
        .iter()
        .map(|p| format!("{} ({})", p.address, p.driver.as_deref().unwrap_or("no driver")))
        .collect();
    items.join(", ")
}

/// Checks that the groups of `targets` may be moved: each has an IOMMU group, none holds the
/// boot GPU, a function that is not part of an accelerator or a device kept for Nova
/// ([`vm_devices`]), and no member is held by anyone but the claim (`held`: address → who holds
/// it).
pub fn check(
    root: &Root,
    inv: &Inventory,
    targets: &[PciAddress],
    held: &BTreeMap<PciAddress, String>,
) -> Result<(), RebindError> {
    let kept = vm_devices::read(root, vm_devices::VM_DEVICES)
        .map_err(|e| RebindError::List(e.to_string()))?
        .unwrap_or_default();
    for address in targets {
        let Some(d) = inv.device(address) else { continue };
        let group = d.iommu_group.ok_or(RebindError::NoGroup { address: *address })?;
        let members = endpoints(inv, group);
        let refuse = |why: String| RebindError::Group {
            address: *address,
            group,
            members: member_list(&members),
            why,
        };
        if let Some((_, why)) = host_member(root, &members) {
            return Err(refuse(why));
        }
        if let Some(m) = members.iter().find(|m| kept.contains(&m.address)) {
            return Err(refuse(format!(
                "and {} in it is kept for OpenStack Nova's VMs (listed in {})",
                m.address,
                vm_devices::VM_DEVICES
            )));
        }
        if let Some((m, who)) =
            members.iter().find_map(|m| held.get(&m.address).map(|who| (m.address, who)))
        {
            return Err(refuse(format!(
                "and {m} in it is held by {who}; a group goes to one VM whole, so this claim waits until it is released"
            )));
        }
    }
    Ok(())
}

/// Moves `targets` and the other endpoints of their groups to `vfio-pci`. Returns the devices
/// that moved (those already there are not returned by [`give_back`]). On failure nothing has
/// moved.
pub fn take<K: Kernel + ?Sized>(
    root: &Root,
    inv: &Inventory,
    kernel: &mut K,
    targets: &[PciAddress],
) -> Result<Vec<PciAddress>, RebindError> {
    let req = vfio::Request { addresses: targets.to_vec(), group: true, ..Default::default() };
    let out = vfio::bind(root, inv, kernel, &req).map_err(|e| {
        let mut groups: Vec<String> = targets
            .iter()
            .filter_map(|a| inv.device(a)?.iommu_group)
            .map(|g| g.to_string())
            .collect();
        groups.dedup();
        RebindError::Bind { groups: groups.join(", "), reason: e.to_string() }
    })?;
    Ok(out.devices.iter().filter(|m| m.changed).map(|m| m.address).collect())
}

/// Returns devices [`take`] moved to the drivers they had (as the VFIO state file records).
pub fn give_back<K: Kernel + ?Sized>(
    root: &Root,
    inv: &Inventory,
    kernel: &mut K,
    moved: &[PciAddress],
) -> Result<(), RebindError> {
    if moved.is_empty() {
        return Ok(());
    }
    let req = vfio::Request { addresses: moved.to_vec(), ..Default::default() };
    vfio::unbind(root, inv, kernel, &req).map(|_| ()).map_err(|e| {
        let list: Vec<String> = moved.iter().map(ToString::to_string).collect();
        RebindError::Unbind { devices: list.join(", "), reason: e.to_string() }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use xpu_core::DeviceKind;
    use xpu_host::DiscoverOptions;
    use xpu_testkit::fake_kernel::{FakeKernel, Node, snapshot};
    use xpu_testkit::{DevSpec, Fixture, NodeSpec, hosts};

    pub(crate) type Snapshot = BTreeMap<std::path::PathBuf, Node>;

    /// The 8×A100 host with `vfio-pci` loaded; GPU 0's IOMMU group also holds its audio
    /// function and a bridge, GPUs 2 and 3 share a group, GPU 5's group holds a NIC of the host,
    /// and GPU 7's group holds the host's boot VGA controller.
    fn host() -> Fixture {
        host_with(&xpu_testkit::BuildOptions::default())
    }

    /// [`host`] built with `opts` (character device nodes, for CDI specs).
    pub(crate) fn host_with(opts: &xpu_testkit::BuildOptions) -> Fixture {
        let mut h = hosts::a100_8x();
        h.loaded_modules.extend(["vfio", "vfio_pci", "vfio_iommu_type1"].map(str::to_owned));
        h.control_nodes.push(NodeSpec::new("/dev/vfio/vfio", 10, 196));
        let gpus: Vec<(PciAddress, u32)> = h
            .devices
            .iter()
            .filter(|d| d.nvidia_minor.is_some())
            .map(|d| (d.address, d.iommu_group.unwrap()))
            .collect();
        let (first, g0) = gpus[0];
        let g2 = gpus[2].1;
        let g5 = gpus[5].1;
        let g7 = gpus[7].1;
        for d in h.devices.iter_mut().filter(|d| d.address == gpus[3].0) {
            d.iommu_group = Some(g2);
        }
        let audio = format!("{:04x}:{:02x}:{:02x}.1", first.domain, first.bus, first.device);
        h.devices
            .push(DevSpec::new(&audio, 0x10de, 0x1aef, 0x040300).group(g0).driver("snd_hda_intel"));
        h.devices.push(DevSpec::new("0000:00:1c.0", 0x8086, 0xa110, 0x060400).group(g0));
        h.devices
            .push(DevSpec::new("0000:5e:00.0", 0x8086, 0x1592, 0x020000).group(g5).driver("ice"));
        h.devices.push(
            DevSpec::new("0000:00:02.0", 0x8086, 0x3e92, 0x030000)
                .group(g7)
                .driver("i915")
                .boot_vga(),
        );
        let fx = h.build_with(opts);
        let d = fx.root().join("sys/bus/pci/drivers/vfio-pci");
        std::fs::create_dir_all(&d).unwrap();
        for f in ["bind", "unbind", "new_id", "remove_id"] {
            std::fs::write(d.join(f), "").unwrap();
        }
        fx
    }

    fn discover(root: &Root) -> Inventory {
        xpu_host::discover(root, &DiscoverOptions::default()).unwrap()
    }

    pub(crate) fn gpus(inv: &Inventory) -> Vec<PciAddress> {
        inv.devices
            .iter()
            .filter(|d| d.kind == DeviceKind::Gpu && d.vendor_id == Some(0x10de))
            .map(|d| d.address)
            .collect()
    }

    /// The trees are the same but for the VFIO state file and its directories (a record, kept).
    pub(crate) fn same_tree(before: &Snapshot, after: &Snapshot, ctx: &str) {
        let state = std::path::Path::new(vfio::STATE_FILE.trim_start_matches('/'));
        let keys: BTreeSet<_> = before.keys().chain(after.keys()).collect();
        let diff: Vec<_> = keys
            .into_iter()
            .filter(|p| !p.starts_with(state) && !state.starts_with(p))
            .filter(|p| before.get(*p) != after.get(*p))
            .collect();
        assert!(diff.is_empty(), "{ctx}: tree differs at {diff:?}");
    }

    #[test]
    fn two_passthrough_claims_and_three_container_claims_on_one_node() {
        let fx = host();
        let root = Root::new(fx.root()).unwrap();
        let inv = discover(&root);
        let gpus = gpus(&inv);
        assert_eq!(gpus.len(), 8);
        let audio = inv.devices.iter().find(|d| d.class == Some(0x0403)).unwrap().address;
        let before = snapshot(fx.root());
        let mut k = FakeKernel::new(fx.root());
        // Three container claims hold GPUs 4, 5 and 6; two passthrough claims ask for GPUs 0
        // (with its audio function) and 1.
        let held: BTreeMap<PciAddress, String> =
            [4, 5, 6].map(|i| (gpus[i], format!("claim ns/c{i}"))).into();
        let mut moved = Vec::new();
        for g in [gpus[0], gpus[1]] {
            check(&root, &inv, &[g], &held).unwrap();
            moved.push(take(&root, &discover(&root), &mut k, &[g]).unwrap());
        }
        assert_eq!(moved, [vec![gpus[0], audio], vec![gpus[1]]]);
        let now = discover(&root);
        let driver = |a: &PciAddress| now.device(a).unwrap().driver.clone();
        for a in moved.iter().flatten() {
            assert_eq!(driver(a).as_deref(), Some("vfio-pci"), "{a}");
            let group = now.device(a).unwrap().iommu_group.unwrap();
            assert!(fx.root().join(format!("dev/vfio/{group}")).exists(), "{a}");
        }
        for a in &gpus[2..] {
            assert_eq!(driver(a).as_deref(), Some("nvidia"), "{a}");
        }
        let bridge: PciAddress = "0000:00:1c.0".parse().unwrap();
        assert_eq!(driver(&bridge), None, "the bridge is not moved");
        // Unprepare returns each function to the driver it had, in any order.
        for m in moved.iter().rev() {
            give_back(&root, &discover(&root), &mut k, m).unwrap();
        }
        same_tree(&before, &snapshot(fx.root()), "after unprepare");
        assert_eq!(
            discover(&root).device(&audio).unwrap().driver.as_deref(),
            Some("snd_hda_intel")
        );
    }

    #[test]
    fn a_failure_at_every_kernel_write_leaves_every_device_as_it_was() {
        // How many writes moving GPU 0's group makes.
        let writes = {
            let fx = host();
            let root = Root::new(fx.root()).unwrap();
            let mut k = FakeKernel::new(fx.root());
            take(&root, &discover(&root), &mut k, &gpus(&discover(&root))[..1]).unwrap();
            k.ops().len()
        };
        assert_eq!(writes, 6, "three writes for each of two functions");
        for n in 1..=writes {
            let fx = host();
            let root = Root::new(fx.root()).unwrap();
            let inv = discover(&root);
            let before = snapshot(fx.root());
            let mut k = FakeKernel::new(fx.root()).fail_at(n);
            let e = take(&root, &inv, &mut k, &gpus(&inv)[..1]).unwrap_err().to_string();
            assert!(e.contains("IOMMU group") && e.contains("rolled back"), "write {n}: {e}");
            same_tree(&before, &snapshot(fx.root()), &format!("write {n}: {e}"));
        }
    }

    #[test]
    fn groups_with_the_boot_gpu_or_a_held_device_are_refused_naming_the_members() {
        let fx = host();
        let root = Root::new(fx.root()).unwrap();
        let inv = discover(&root);
        let gpus = gpus(&inv);
        let none = BTreeMap::new();
        let e = check(&root, &inv, &gpus[7..8], &none).unwrap_err().to_string();
        assert!(e.contains("boot GPU 0000:00:02.0") && e.contains("(i915)"), "{e}");
        assert!(e.contains(&format!("{} (nvidia)", gpus[7])), "{e}");
        // GPUs 2 and 3 share a group: a container claim on 3 keeps 2 from a VM.
        let held: BTreeMap<PciAddress, String> = [(gpus[3], "claim ns/train".to_owned())].into();
        let e = check(&root, &inv, &gpus[2..3], &held).unwrap_err().to_string();
        assert!(e.contains(&format!("and {} in it is held by claim ns/train", gpus[3])), "{e}");
        assert!(e.contains(&gpus[2].to_string()), "{e}");
        // The device itself, held by a container claim.
        let held: BTreeMap<PciAddress, String> = [(gpus[0], "claim ns/c0".to_owned())].into();
        let e = check(&root, &inv, &gpus[..1], &held).unwrap_err().to_string();
        assert!(e.contains("held by claim ns/c0") && e.contains("snd_hda_intel"), "{e}");
        // The bridge neither blocks nor is listed.
        assert!(!e.contains("0000:00:1c.0"), "{e}");
        // A group with a device kept for Nova; a list that does not read stops every move.
        let list = fx.root().join("etc/xpu/vm-devices");
        std::fs::create_dir_all(list.parent().unwrap()).unwrap();
        std::fs::write(&list, format!("{}\n", gpus[3])).unwrap();
        let e = check(&root, &inv, &gpus[2..3], &none).unwrap_err().to_string();
        assert!(
            e.contains(&format!("and {} in it is kept for OpenStack Nova's VMs", gpus[3])),
            "{e}"
        );
        check(&root, &inv, &gpus[1..2], &none).unwrap();
        std::fs::write(&list, "gpu3\n").unwrap();
        let e = check(&root, &inv, &gpus[1..2], &none).unwrap_err().to_string();
        assert!(e.contains("vm-devices:1") && e.contains("no device is passed through"), "{e}");
        std::fs::remove_file(&list).unwrap();
        // A group with a host function that is no part of a GPU (a NIC without ACS between).
        let e = check(&root, &inv, &gpus[5..6], &none).unwrap_err().to_string();
        assert!(e.contains("0000:5e:00.0 (ice) in it is not part of an accelerator"), "{e}");
        let nic_gpu = inv.device(&gpus[5]).unwrap();
        assert!(!capable(&root, &inv, nic_gpu));
        assert!(capable(&root, &inv, inv.device(&gpus[0]).unwrap()), "an audio function is");
        // A device with no IOMMU group.
        let mut bare = inv.clone();
        bare.devices.iter_mut().for_each(|d| d.iommu_group = None);
        let e = check(&root, &bare, &gpus[1..2], &none).unwrap_err().to_string();
        assert!(e.contains("has no IOMMU group"), "{e}");
    }
}
