//! `vfio` bind/unbind against the fake kernel (xpu-testkit) on fixture hosts: the kernel's
//! reaction is modelled (unbind removes the driver link, probe binds per `driver_override`),
//! every write is recorded, and a write can be made to fail.

#![allow(clippy::unwrap_used)]

use xpu_core::kernel::KernelOp;
use xpu_core::{Inventory, PciAddress};
use xpu_host::vfio::{self, Request, VfioError};
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_testkit::fake_kernel::{FakeKernel, Node, snapshot};

type Snapshot = std::collections::BTreeMap<std::path::PathBuf, Node>;
use xpu_testkit::sysfs::{MAJOR_MISC, MINOR_VFIO_CONTAINER};
use xpu_testkit::{Fixture, NodeSpec, hosts};

fn inv(root: &Root) -> Inventory {
    let opts = DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true };
    xpu_host::discover(root, &opts).unwrap()
}

/// Asserts two snapshots are equal, printing only the paths that differ.
fn same_tree(before: &Snapshot, after: &Snapshot, ctx: &str) {
    let mut diff = Vec::new();
    for (p, n) in before {
        match after.get(p) {
            None => diff.push(format!("removed {}", p.display())),
            Some(m) if m != n => diff.push(format!("changed {}: {n:?} -> {m:?}", p.display())),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        diff.push(format!("added {}", p.display()));
    }
    assert!(diff.is_empty(), "{ctx}: tree differs:\n{}", diff.join("\n"));
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn req(addrs: &[&str]) -> Request {
    Request { addresses: addrs.iter().map(|a| addr(a)).collect(), ..Default::default() }
}

fn driver(fx: &Fixture, a: &str) -> Option<String> {
    std::fs::read_link(fx.device_dir(a).join("driver"))
        .ok()
        .map(|t| t.file_name().unwrap().to_string_lossy().into_owned())
}

fn override_of(fx: &Fixture, a: &str) -> String {
    std::fs::read_to_string(fx.device_dir(a).join("driver_override")).unwrap().trim().to_owned()
}

/// The A100 host with vfio-pci loaded, so only device state differs between runs.
fn a100_with_vfio_loaded() -> Fixture {
    let mut spec = hosts::a100_8x();
    spec.loaded_modules.extend(["vfio", "vfio_pci", "vfio_iommu_type1"].map(str::to_owned));
    spec.control_nodes.push(NodeSpec::new("/dev/vfio/vfio", MAJOR_MISC, MINOR_VFIO_CONTAINER));
    let fx = spec.build();
    let d = fx.root().join("sys/bus/pci/drivers/vfio-pci");
    std::fs::create_dir_all(&d).unwrap();
    for f in ["bind", "unbind", "new_id", "remove_id"] {
        std::fs::write(d.join(f), "").unwrap();
    }
    fx
}

#[test]
fn bind_writes_override_unbind_probe_and_verifies() {
    let fx = a100_with_vfio_loaded();
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    let out = vfio::bind(&root, &inv(&root), &mut k, &req(&["25:00.0"])).unwrap();
    let a = addr("0000:25:00.0");
    assert_eq!(
        k.ops(),
        [
            KernelOp::DriverOverride { device: a, driver: Some("vfio-pci".into()) },
            KernelOp::Unbind { device: a, driver: "nvidia".into() },
            KernelOp::Probe { device: a },
        ]
    );
    assert_eq!(out.operations, k.log());
    assert_eq!(driver(&fx, "0000:25:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(override_of(&fx, "0000:25:00.0"), "vfio-pci");
    assert!(fx.root().join("dev/vfio/47").exists(), "the group node appears");
    assert!(!fx.root().join("sys/bus/pci/drivers/nvidia/0000:25:00.0").exists());
    // The other GPUs are untouched.
    assert_eq!(driver(&fx, "0000:2b:00.0").as_deref(), Some("nvidia"));
    let state = vfio::load_state(&root).unwrap();
    assert_eq!(state.devices["0000:25:00.0"].driver.as_deref(), Some("nvidia"));
}

#[test]
fn unbind_restores_the_previous_driver_and_override() {
    let fx = a100_with_vfio_loaded();
    let before = snapshot(fx.root());
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    vfio::bind(&root, &inv(&root), &mut k, &req(&["0000:25:00.0", "0000:2b:00.0"])).unwrap();
    let out =
        vfio::unbind(&root, &inv(&root), &mut k, &req(&["0000:25:00.0", "0000:2b:00.0"])).unwrap();
    assert!(out.devices.iter().all(|d| d.after.as_deref() == Some("nvidia")), "{out:?}");
    assert_eq!(driver(&fx, "0000:25:00.0").as_deref(), Some("nvidia"));
    assert_eq!(override_of(&fx, "0000:25:00.0"), "(null)");
    assert!(!fx.root().join("dev/vfio/47").exists());
    // Everything but the (now empty) state file is as it was.
    let mut after = snapshot(fx.root());
    after.retain(|p, _| !p.starts_with("var"));
    same_tree(&before, &after, "after unbind");
    assert!(vfio::load_state(&root).unwrap().devices.is_empty());
}

#[test]
fn bind_refuses_to_break_group_viability() {
    // The GPU's audio function 01:00.1 is on snd_hda_intel in the same group.
    let mut spec = hosts::gpu_with_audio();
    spec.devices[1].driver = Some("nvidia".into());
    let fx = spec.build();
    let d = fx.root().join("sys/bus/pci/drivers/vfio-pci");
    std::fs::create_dir_all(&d).unwrap();
    let before = snapshot(fx.root());
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    let e = vfio::bind(&root, &inv(&root), &mut k, &req(&["01:00.0"])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "device 0000:01:00.0 is in IOMMU group 1 with 0000:01:00.1 (snd_hda_intel); bind both or pass --group"
    );
    assert!(!e.is_input());
    assert!(k.ops().is_empty(), "nothing written: {:?}", k.log());
    same_tree(&before, &snapshot(fx.root()), "");
}

#[test]
fn group_binds_every_endpoint_and_leaves_the_bridge() {
    let mut spec = hosts::gpu_with_audio();
    spec.devices[1].driver = Some("nvidia".into());
    let fx = spec.build();
    let root = Root::new(fx.root()).unwrap();
    // vfio-pci not loaded yet: the bind loads it first.
    let mut k = FakeKernel::new(fx.root());
    let r = Request { group: true, ..req(&["01:00.0"]) };
    let out = vfio::bind(&root, &inv(&root), &mut k, &r).unwrap();
    assert_eq!(k.ops()[0], KernelOp::Modprobe { module: "vfio-pci".into() });
    assert_eq!(driver(&fx, "0000:01:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(&fx, "0000:01:00.1").as_deref(), Some("vfio-pci"));
    assert_eq!(driver(&fx, "0000:00:01.0").as_deref(), Some("pcieport"), "bridges stay");
    let moved: Vec<String> = out.devices.iter().map(|d| d.address.to_string()).collect();
    assert_eq!(moved, ["0000:01:00.0", "0000:01:00.1"]);
    let status = vfio::status(&root, &inv(&root), &[addr("01:00.0")], false).unwrap();
    assert!(status[0].group_viable);
    assert!(status[0].vfio_node.as_ref().unwrap().exists);

    // Unbinding one of them alone would leave its peer on vfio-pci beside a host driver.
    let e = vfio::unbind(&root, &inv(&root), &mut k, &req(&["01:00.1"])).unwrap_err();
    assert!(
        e.to_string().contains(
            "0000:01:00.0 (vfio-pci), which would stay on vfio-pci; unbind both or pass --group"
        ),
        "{e}"
    );
    let r = Request { group: true, ..req(&["01:00.1"]) };
    vfio::unbind(&root, &inv(&root), &mut k, &r).unwrap();
    assert_eq!(driver(&fx, "0000:01:00.0").as_deref(), Some("nvidia"));
    assert_eq!(driver(&fx, "0000:01:00.1").as_deref(), Some("snd_hda_intel"));
}

#[test]
fn failure_mid_way_rolls_back_to_the_exact_starting_state() {
    // Three GPUs, 3 writes each; every possible failing write from the 2nd device's first
    // through the 3rd device's last must leave the tree exactly as it was.
    for fail_at in 1..=9 {
        let fx = a100_with_vfio_loaded();
        let before = snapshot(fx.root());
        let root = Root::new(fx.root()).unwrap();
        let mut k = FakeKernel::new(fx.root()).fail_at(fail_at);
        let e = vfio::bind(&root, &inv(&root), &mut k, &req(&["25:00.0", "2b:00.0", "48:00.0"]))
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, VfioError::Failed { .. }), "{msg}");
        assert!(msg.contains("injected failure"), "{msg}");
        assert!(msg.contains("rolled back"), "{msg}");
        same_tree(
            &before,
            &snapshot(fx.root()),
            &format!("fail_at {fail_at}: {msg}\n{:#?}", k.log()),
        );
    }
}

#[test]
fn a_kernel_that_does_not_react_is_caught_by_verification_and_rolled_back() {
    // The real sysfs kernel writing into a plain fixture tree: the writes land, nothing reacts,
    // so the device is still on nvidia after the unbind write. xpu must notice and undo.
    let fx = a100_with_vfio_loaded();
    let root = Root::new(fx.root()).unwrap();
    let start = vfio::read_dev_state(&root, &addr("25:00.0"));
    let mut k = xpu_host::kernel::SysfsKernel::new(root.clone());
    let e = vfio::bind(&root, &inv(&root), &mut k, &req(&["25:00.0"])).unwrap_err();
    assert!(e.to_string().contains("is still bound to nvidia"), "{e}");
    assert!(e.to_string().contains("rolled back"), "{e}");
    assert_eq!(vfio::read_dev_state(&root, &addr("25:00.0")), start);
    assert_eq!(
        k.log(),
        [
            "echo vfio-pci > /sys/bus/pci/devices/0000:25:00.0/driver_override",
            "echo 0000:25:00.0 > /sys/bus/pci/drivers/nvidia/unbind",
            "echo > /sys/bus/pci/devices/0000:25:00.0/driver_override",
        ]
    );

    // The fake kernel failing the module load: nothing is touched.
    let fx = hosts::a100_8x().build();
    let before = snapshot(fx.root());
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root()).fail_at(1);
    let e = vfio::bind(&root, &inv(&root), &mut k, &req(&["25:00.0"])).unwrap_err();
    assert!(e.to_string().contains("no device was touched"), "{e}");
    same_tree(&before, &snapshot(fx.root()), "failed modprobe");
}

#[test]
fn rebinding_a_bound_device_writes_nothing() {
    let fx = hosts::a100_8x_vfio().build();
    let before = snapshot(fx.root());
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    let out = vfio::bind(
        &root,
        &inv(&root),
        &mut k,
        &Request { all_accelerators: true, ..Default::default() },
    )
    .unwrap();
    assert!(k.ops().is_empty(), "{:?}", k.log());
    assert!(!out.changed());
    assert_eq!(out.devices.len(), 14);
    assert!(out.devices.iter().all(|d| !d.changed));
    same_tree(&before, &snapshot(fx.root()), "");

    // And a second bind after a real one is also a no-op.
    let fx = a100_with_vfio_loaded();
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    vfio::bind(&root, &inv(&root), &mut k, &req(&["25:00.0"])).unwrap();
    let n = k.ops().len();
    let after_first = snapshot(fx.root());
    vfio::bind(&root, &inv(&root), &mut k, &req(&["25:00.0"])).unwrap();
    assert_eq!(k.ops().len(), n);
    same_tree(&after_first, &snapshot(fx.root()), "second bind");
}

#[test]
fn dry_run_plans_the_writes_and_makes_none() {
    let fx = hosts::a100_8x().build();
    let before = snapshot(fx.root());
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    let r = Request { dry_run: true, persist: true, ..req(&["25:00.0"]) };
    let out = vfio::bind(&root, &inv(&root), &mut k, &r).unwrap();
    assert!(k.ops().is_empty());
    assert_eq!(
        out.operations,
        [
            "modprobe vfio-pci",
            "echo vfio-pci > /sys/bus/pci/devices/0000:25:00.0/driver_override",
            "echo 0000:25:00.0 > /sys/bus/pci/drivers/nvidia/unbind",
            "echo 0000:25:00.0 > /sys/bus/pci/drivers_probe",
        ]
    );
    assert!(
        out.persisted
            .iter()
            .any(|f| f.path == vfio::PERSIST_RULES && f.diff.contains("KERNEL==\"0000:25:00.0\""))
    );
    same_tree(&before, &snapshot(fx.root()), "");
}

#[test]
fn persist_writes_the_boot_rule_and_unbind_removes_it() {
    let fx = a100_with_vfio_loaded();
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    let r = Request { persist: true, ..req(&["25:00.0", "2b:00.0"]) };
    vfio::bind(&root, &inv(&root), &mut k, &r).unwrap();
    let rules =
        std::fs::read_to_string(fx.root().join(vfio::PERSIST_RULES.trim_start_matches('/')))
            .unwrap();
    assert!(rules.contains("KERNEL==\"0000:25:00.0\", DRIVER!=\"vfio-pci\", RUN+=\"/lib/udev/xpu-bind-vfio-pci.sh $kernel\""), "{rules}");
    assert!(rules.contains("KERNEL==\"0000:2b:00.0\""));
    assert!(fx.root().join("lib/udev/xpu-bind-vfio-pci.sh").exists());
    assert!(fx.root().join("etc/modules-load.d/xpu-vfio.conf").exists());
    let r = Request { persist: true, ..req(&["25:00.0"]) };
    vfio::unbind(&root, &inv(&root), &mut k, &r).unwrap();
    let rules =
        std::fs::read_to_string(fx.root().join(vfio::PERSIST_RULES.trim_start_matches('/')))
            .unwrap();
    assert!(!rules.contains("0000:25:00.0"), "{rules}");
    assert!(rules.contains("0000:2b:00.0"));
}

#[test]
fn unknown_and_bridge_addresses_are_input_errors() {
    let fx = hosts::gpu_with_audio().build();
    let root = Root::new(fx.root()).unwrap();
    let mut k = FakeKernel::new(fx.root());
    let e = vfio::bind(&root, &inv(&root), &mut k, &req(&["0000:99:00.0"])).unwrap_err();
    assert!(e.is_input());
    assert_eq!(
        e.to_string(),
        "device 0000:99:00.0 does not exist under /sys/bus/pci/devices; check the address with xpu discover --all"
    );
    let e = vfio::bind(&root, &inv(&root), &mut k, &req(&["00:01.0"])).unwrap_err();
    assert!(e.is_input() && e.to_string().contains("is a PCI bridge"), "{e}");
    let e = vfio::bind(&root, &inv(&root), &mut k, &Request::default()).unwrap_err();
    assert!(e.is_input() && e.to_string().contains("--all-accelerators"), "{e}");
    assert!(k.ops().is_empty());
}

#[test]
fn status_reports_driver_group_viability_and_node() {
    let fx = hosts::gpu_with_audio().build();
    let root = Root::new(fx.root()).unwrap();
    let st = vfio::status(&root, &inv(&root), &[], false).unwrap();
    let addrs: Vec<String> = st.iter().map(|s| s.address.to_string()).collect();
    assert_eq!(addrs, ["0000:00:01.0", "0000:01:00.0", "0000:01:00.1"]);
    let gpu = &st[1];
    assert_eq!(gpu.driver.as_deref(), Some("vfio-pci"));
    assert_eq!(gpu.iommu_group, Some(1));
    assert!(!gpu.group_viable);
    assert_eq!(gpu.blockers.len(), 1);
    assert_eq!(gpu.blockers[0].driver.as_deref(), Some("snd_hda_intel"));
    let node = gpu.vfio_node.as_ref().unwrap();
    assert_eq!((node.path.as_str(), node.exists), ("/dev/vfio/1", true));
}
