//! Discovery on the named fixture hosts, and on broken ones.

#![allow(clippy::unwrap_used)]

use std::fs;
use std::os::unix::fs::symlink;

use xpu_core::accel::DeviceKind;
use xpu_core::inventory::{Inventory, NodeType, SriovType};
use xpu_host::{DiscoverOptions, Root, Scope, discover};
use xpu_testkit::{BuildOptions, Fixture, hosts};

fn run(f: &Fixture, scope: Scope) -> Inventory {
    let root = Root::new(f.root()).unwrap();
    discover(&root, &DiscoverOptions { scope, ..Default::default() }).unwrap()
}

fn addr(s: &str) -> xpu_core::PciAddress {
    s.parse().unwrap()
}

#[test]
fn a100_default_view_is_gpus_and_nvswitches() {
    let f = hosts::a100_8x().build();
    let inv = run(&f, Scope::Accelerators);
    assert!(inv.warnings.is_empty(), "{:?}", inv.warnings);
    assert_eq!(inv.of_kind(DeviceKind::Gpu).count(), 8);
    assert_eq!(inv.of_kind(DeviceKind::Nvswitch).count(), 6);
    assert_eq!(inv.devices.len(), 14);

    let gpu = inv.device(&addr("0000:25:00.0")).unwrap();
    assert_eq!(gpu.vendor_id, Some(0x10de));
    assert_eq!(gpu.device_id, Some(0x20b0));
    assert_eq!(gpu.subsystem_device_id, Some(0x134f));
    assert_eq!(gpu.class, Some(0x0302));
    assert_eq!(gpu.revision, Some(0xa1));
    assert_eq!(gpu.driver.as_deref(), Some("nvidia"));
    assert_eq!(gpu.iommu_group, Some(47));
    assert_eq!(gpu.numa_node, Some(0));
    assert_eq!(gpu.product.as_deref(), Some("A100-SXM4-40GB"));
    assert_eq!(gpu.generation.as_deref(), Some("ampere"));
    assert_eq!(gpu.sriov.kind, SriovType::Pci);
    assert_eq!(gpu.link.speed.as_deref(), Some("16.0 GT/s"));
    assert_eq!(gpu.link.width, Some(16));
    assert_eq!(gpu.uuid.as_deref(), Some(hosts::gpu_uuid(0).as_str()));
    assert_eq!(gpu.interconnect_domain.as_deref(), Some("nvswitch-0"));
    assert_eq!(gpu.kernel_modules.as_deref().unwrap(), ["nvidia", "nouveau", "nvidia_drm"]);
    let nodes: Vec<&str> = gpu.dev_nodes.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(nodes, ["/dev/nvidia0"]);
    // Placeholder files are not device nodes: no numbers are invented for them.
    assert_eq!(gpu.dev_nodes[0].major, None);

    assert_eq!(inv.host.nvidia_driver_version.as_deref(), Some("535.104.05"));
    assert_eq!(inv.host.cpu_vendor.as_deref(), Some("intel"));
    assert_eq!(inv.host.control_nodes.len(), 4);

    let all = run(&f, Scope::All);
    assert_eq!(all.devices.len(), 18);
    let vga = all.device(&addr("0000:03:00.0")).unwrap();
    assert_eq!(vga.kind, DeviceKind::Other, "a BMC's VGA is not an accelerator");
}

#[test]
fn char_device_numbers_come_from_the_node() {
    if !rustix_is_root() {
        eprintln!("skipping char_device_numbers_come_from_the_node: mknod needs root");
        return;
    }
    let f = hosts::a100_8x().build_with(&BuildOptions { char_devices: true, dir: None });
    let inv = run(&f, Scope::Accelerators);
    let gpu = inv.device(&addr("0000:4d:00.0")).unwrap();
    let n = &gpu.dev_nodes[0];
    assert_eq!(
        (n.path.as_str(), n.node_type, n.major, n.minor),
        ("/dev/nvidia3", Some(NodeType::Char), Some(195), Some(3))
    );
    let ctl = inv.host.control_nodes.iter().find(|n| n.path == "/dev/nvidiactl").unwrap();
    assert_eq!((ctl.major, ctl.minor), (Some(195), Some(255)));
}

fn rustix_is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

#[test]
fn vfio_host_has_group_nodes() {
    let f = hosts::a100_8x_vfio().build();
    let inv = run(&f, Scope::Accelerators);
    let gpu = inv.device(&addr("0000:25:00.0")).unwrap();
    assert_eq!(gpu.driver.as_deref(), Some("vfio-pci"));
    let nodes: Vec<&str> = gpu.dev_nodes.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(nodes, ["/dev/vfio/47"]);
    assert!(inv.host.nvidia_driver_version.is_none());
    assert!(inv.host.control_nodes.iter().any(|n| n.path == "/dev/vfio/vfio"));
}

#[test]
fn tpu_hosts() {
    for (spec, chips, generation) in [(hosts::tpu_v5p(), 4, "v5p"), (hosts::tpu_v6e_8(), 8, "v6e")]
    {
        let f = spec.build();
        let inv = run(&f, Scope::Accelerators);
        let tpus: Vec<_> = inv.of_kind(DeviceKind::Tpu).collect();
        assert_eq!(tpus.len(), chips);
        // The gVNIC has its own group, so only the chips are listed.
        assert_eq!(inv.devices.len(), chips);
        for (i, t) in tpus.iter().enumerate() {
            assert_eq!(t.generation.as_deref(), Some(generation));
            assert_eq!(t.iommu_group, Some(i as u32));
            assert_eq!(t.driver.as_deref(), Some("vfio-pci"));
            assert_eq!(t.dev_nodes[0].path, format!("/dev/vfio/{i}"));
            assert_eq!(t.interconnect_domain.as_deref(), Some("ici-0"));
        }
    }
}

#[test]
fn sriov_roles() {
    let f = hosts::sriov().build();
    let inv = run(&f, Scope::Accelerators);
    let pf = inv.device(&addr("0000:41:00.0")).unwrap();
    assert_eq!(pf.sriov.kind, SriovType::Pf);
    assert_eq!((pf.sriov.total_vfs, pf.sriov.num_vfs), (Some(16), Some(4)));
    let vfs: Vec<_> = inv.devices.iter().filter(|d| d.sriov.kind == SriovType::Vf).collect();
    assert_eq!(vfs.len(), 4);
    for vf in vfs {
        assert_eq!(vf.sriov.physfn, Some(addr("0000:41:00.0")));
    }
}

#[test]
fn mi300x_host() {
    let f = hosts::mi300x().build();
    let inv = run(&f, Scope::Accelerators);
    let gpus: Vec<_> = inv.of_kind(DeviceKind::Gpu).collect();
    assert_eq!(gpus.len(), 8);
    let g = gpus[1];
    assert_eq!(g.product.as_deref(), Some("MI300X"));
    assert_eq!(g.driver.as_deref(), Some("amdgpu"));
    let nodes: Vec<&str> = g.dev_nodes.iter().map(|n| n.path.as_str()).collect();
    assert_eq!(nodes, ["/dev/dri/card1", "/dev/dri/renderD129"]);
    assert_eq!(g.interconnect_domain.as_deref(), Some("xgmi-7786335925049349010"));
    assert_eq!(g.link.speed.as_deref(), Some("32.0 GT/s"));
    assert!(inv.host.control_nodes.iter().any(|n| n.path == "/dev/kfd"));
    assert_eq!(inv.host.cpu_vendor.as_deref(), Some("amd"));
}

#[test]
fn group_peers_of_a_gpu_are_listed() {
    let f = hosts::gpu_with_audio().build();
    let inv = run(&f, Scope::Accelerators);
    let addrs: Vec<String> = inv.devices.iter().map(|d| d.address.to_string()).collect();
    assert_eq!(addrs, ["0000:00:01.0", "0000:01:00.0", "0000:01:00.1"]);
    let audio = inv.device(&addr("0000:01:00.1")).unwrap();
    assert_eq!(audio.driver.as_deref(), Some("snd_hda_intel"));
    assert_eq!(audio.kind, DeviceKind::Other);
    assert!(inv.device(&addr("0000:00:01.0")).unwrap().is_bridge());
}

#[test]
fn garbage_in_sysfs_nulls_the_field_and_warns() {
    let f = hosts::a100_8x().build();
    let dev = |a: &str| f.device_dir(a);
    // Non-hex id.
    fs::write(dev("0000:25:00.0").join("vendor"), "0xzz\n").unwrap();
    // Missing file.
    fs::remove_file(dev("0000:2b:00.0").join("class")).unwrap();
    // Dangling links.
    let drv = dev("0000:48:00.0").join("driver");
    fs::remove_file(&drv).unwrap();
    symlink("../../../bus/pci/drivers/gone", &drv).unwrap();
    let grp = dev("0000:4d:00.0").join("iommu_group");
    fs::remove_file(&grp).unwrap();
    symlink("../../../kernel/iommu_groups/999", &grp).unwrap();
    // Unreadable file (a directory where a file should be; root can read any mode).
    let sub = dev("0000:8c:00.0").join("subsystem_vendor");
    fs::remove_file(&sub).unwrap();
    fs::create_dir(&sub).unwrap();
    // Garbled number and link speed.
    fs::write(dev("0000:91:00.0").join("numa_node"), "lots\n").unwrap();
    fs::write(dev("0000:91:00.0").join("current_link_speed"), "fast\n").unwrap();
    // A stray entry that is not an address, and a garbled nvidia information file.
    fs::create_dir(f.root().join("sys/bus/pci/devices/not-a-device")).unwrap();
    fs::write(
        f.root().join("proc/driver/nvidia/gpus/0000:c5:00.0/information"),
        "Device Minor: x\n",
    )
    .unwrap();

    let inv = run(&f, Scope::All);
    assert_eq!(inv.devices.len(), 18, "every device is still listed");
    let d = |a: &str| inv.device(&addr(a)).unwrap();
    assert_eq!(d("0000:25:00.0").vendor_id, None);
    assert_eq!(d("0000:25:00.0").device_id, Some(0x20b0));
    assert_eq!(d("0000:2b:00.0").class, None);
    assert_eq!(d("0000:48:00.0").driver, None);
    assert_eq!(d("0000:4d:00.0").iommu_group, None);
    assert_eq!(d("0000:8c:00.0").subsystem_vendor_id, None);
    assert_eq!(d("0000:8c:00.0").subsystem_device_id, Some(0x134f));
    assert_eq!(d("0000:91:00.0").numa_node, None);
    assert_eq!(d("0000:91:00.0").link.speed, None);
    assert!(d("0000:c5:00.0").dev_nodes.is_empty());

    let w = inv.warnings.join("\n");
    for needle in [
        "/sys/bus/pci/devices/0000:25:00.0/vendor: not a hex value",
        "/sys/bus/pci/devices/0000:2b:00.0/class: missing",
        "/sys/bus/pci/devices/0000:48:00.0/driver: dangling link",
        "/sys/bus/pci/devices/0000:4d:00.0/iommu_group: dangling link",
        "/sys/bus/pci/devices/0000:8c:00.0/subsystem_vendor:",
        "/sys/bus/pci/devices/0000:91:00.0/numa_node: not a number",
        "/sys/bus/pci/devices/0000:91:00.0/current_link_speed: unrecognised speed",
        "/sys/bus/pci/devices/not-a-device: not a PCI address",
        "/proc/driver/nvidia/gpus/0000:c5:00.0/information: Device Minor is not a number",
    ] {
        assert!(w.contains(needle), "missing warning {needle:?} in:\n{w}");
    }
}

#[test]
fn empty_root_lists_nothing_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let inv = discover(&Root::new(dir.path()).unwrap(), &DiscoverOptions::default()).unwrap();
    assert!(inv.devices.is_empty());
    assert!(inv.warnings[0].starts_with("/sys/bus/pci/devices:"), "{:?}", inv.warnings);
}
