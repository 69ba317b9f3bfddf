//! `doctor` on fixture hosts: ready hosts pass, each missing piece fails with its fix, and an
//! unreadable limits.conf is an error naming the file.

#![allow(clippy::unwrap_used)]

use xpu_host::doctor::{self, Report, Status};
use xpu_host::profile::Profile;
use xpu_host::{DiscoverOptions, Root};
use xpu_testkit::readiness::{CgroupLayout, Readiness, proc_limits};
use xpu_testkit::{Fixture, HostSpec, hosts};

fn build(spec: &HostSpec, r: &Readiness) -> Fixture {
    let fx = spec.build();
    r.write(fx.root());
    fx
}

fn run(fx: &Fixture, profile: Profile) -> Report {
    let root = Root::new(fx.root()).unwrap();
    let inv =
        xpu_host::discover(&root, &DiscoverOptions { skip_names: true, ..Default::default() })
            .unwrap();
    doctor::run(&root, &inv, profile).unwrap()
}

fn status(r: &Report, id: &str) -> Status {
    r.checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no check {id} in {:#?}", ids(r)))
        .status
}

fn ids(r: &Report) -> Vec<String> {
    r.checks.iter().map(|c| format!("{} {:?}", c.id, c.status)).collect()
}

fn not_passing(r: &Report) -> Vec<String> {
    r.checks
        .iter()
        .filter(|c| c.status != Status::Pass)
        .map(|c| format!("{} {:?}: {:?} / {:?}", c.id, c.status, c.detail, c.fix))
        .collect()
}

#[test]
fn a_prepared_passthrough_host_passes_everything() {
    let fx = build(&hosts::a100_8x_vfio(), &Readiness::ready_vfio_host());
    let r = run(&fx, Profile::VfioHost);
    assert!(not_passing(&r).is_empty(), "{:#?}", not_passing(&r));
    assert!(!r.failed());
    // Every accelerator (8 GPUs, 6 NVSwitches) got driver, group and node checks.
    assert_eq!(r.checks.iter().filter(|c| c.id.ends_with(".vfio-node")).count(), 14);
    assert_eq!(r.summary.pass, r.checks.len());
}

#[test]
fn a_bare_gpu_host_fails_with_a_fix_for_each_gap() {
    let fx = build(&hosts::a100_8x(), &Readiness::bare());
    let r = run(&fx, Profile::VfioHost);
    assert!(r.failed());
    for id in [
        "kvm.dev",
        "kvm.tun",
        "kernel.param.intel_iommu",
        "kernel.param.iommu",
        "vfio.module.vfio_pci",
        "device.0000:25:00.0.driver",
        "device.0000:25:00.0.group",
        "limits.memlock.config",
        "limits.nofile.config",
    ] {
        assert_eq!(status(&r, id), Status::Fail, "{id}");
    }
    for id in [
        "kvm.vhost-net",
        "cgroup.memory",
        "iommu.support",
        "vfio.blacklist.nouveau",
        "memory.hugepages",
        "limits.memlock.effective",
    ] {
        assert_eq!(status(&r, id), Status::Warn, "{id}");
    }
    // The fixture's CPU has vmx and the IOMMU groups are populated.
    assert_eq!(status(&r, "kvm.hw-virt"), Status::Pass);
    assert_eq!(status(&r, "iommu.enabled"), Status::Pass);
    for c in r.checks.iter().filter(|c| c.status != Status::Pass) {
        let fix = c.fix.as_deref().unwrap_or("");
        assert!(!fix.is_empty() && !fix.contains('\n'), "{}: one-line fix, got {fix:?}", c.id);
    }
    let d = r.checks.iter().find(|c| c.id == "device.0000:25:00.0.driver").unwrap();
    assert_eq!(d.fix.as_deref(), Some("xpu vfio bind 0000:25:00.0"));
    assert_eq!(d.detail.as_deref(), Some("driver: nvidia"));
    let p = r.checks.iter().find(|c| c.id == "kernel.param.intel_iommu").unwrap();
    assert_eq!(p.check, "for kernel parameter intel_iommu=on");
}

#[test]
fn an_audio_function_on_the_host_driver_makes_the_group_fail() {
    let fx = build(&hosts::gpu_with_audio(), &Readiness::ready_vfio_host());
    let r = run(&fx, Profile::VfioHost);
    let g = r.checks.iter().find(|c| c.id == "device.0000:01:00.0.group").unwrap();
    assert_eq!(g.status, Status::Fail);
    assert_eq!(g.detail.as_deref(), Some("group 1 also holds 0000:01:00.1 (snd_hda_intel)"));
    assert_eq!(g.fix.as_deref(), Some("xpu vfio bind 0000:01:00.0 --group"));
    // The root port in the group is a bridge and exempt; the GPU itself is on vfio-pci.
    assert_eq!(status(&r, "device.0000:01:00.0.driver"), Status::Pass);
    assert_eq!(status(&r, "device.0000:01:00.0.vfio-node"), Status::Pass);
}

fn tpu_spec() -> HostSpec {
    let mut spec = hosts::tpu_v5p();
    spec.cmdline = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro idle=poll intel_iommu=on,sm_on transparent_hugepage=always".into();
    spec
}

#[test]
fn a_prepared_tpu_vm_passes_and_a_closed_vfio_node_fails() {
    let fx = build(&tpu_spec(), &Readiness::ready_tpu_vm());
    let r = run(&fx, Profile::TpuVm);
    assert!(not_passing(&r).is_empty(), "{:#?}", not_passing(&r));
    let node = r.checks.iter().find(|c| c.id == "device.0000:00:04.0.vfio-node").unwrap();
    assert_eq!(node.check, "if device /dev/vfio/0 exists with mode 0666");
    // No KVM checks in a guest profile.
    assert!(r.checks.iter().all(|c| !c.id.starts_with("kvm.")));

    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(fx.root().join("dev/vfio/0"), std::fs::Permissions::from_mode(0o600))
        .unwrap();
    std::fs::write(
        fx.root().join("sys/kernel/mm/transparent_hugepage/enabled"),
        "always [madvise] never\n",
    )
    .unwrap();
    let r = run(&fx, Profile::TpuVm);
    let node = r.checks.iter().find(|c| c.id == "device.0000:00:04.0.vfio-node").unwrap();
    assert_eq!((node.status, node.detail.as_deref()), (Status::Fail, Some("mode 0600")));
    assert!(node.fix.as_deref().unwrap().starts_with("chmod 0666 /dev/vfio/0"));
    assert_eq!(status(&r, "memory.thp"), Status::Fail);
}

#[test]
fn a_tpu_vm_without_its_kernel_parameters_fails_each_one() {
    let mut spec = hosts::tpu_v5p();
    spec.cmdline = "ro intel_iommu=on quiet".into();
    let fx = build(&spec, &Readiness::ready_tpu_vm());
    let r = run(&fx, Profile::TpuVm);
    assert_eq!(status(&r, "kernel.param.idle"), Status::Fail);
    // intel_iommu=on does not satisfy intel_iommu=on,sm_on.
    assert_eq!(status(&r, "kernel.param.intel_iommu"), Status::Fail);
    assert_eq!(status(&r, "kernel.param.transparent_hugepage"), Status::Fail);
}

#[test]
fn a_container_host_checks_vendor_drivers_nodes_and_cgroups() {
    let mut ready = Readiness::ready_vfio_host();
    ready.cgroups =
        CgroupLayout::V2(["cpuset", "cpu", "io", "memory", "pids"].map(str::to_owned).to_vec());
    let fx = build(&hosts::a100_8x(), &ready);
    let r = run(&fx, Profile::ContainerHost);
    assert!(not_passing(&r).is_empty(), "{:#?}", not_passing(&r));
    assert_eq!(status(&r, "nvidia.driver"), Status::Pass);
    assert_eq!(
        r.checks.iter().find(|c| c.id == "nvidia.driver").unwrap().detail.as_deref(),
        Some("driver 535.104.05")
    );
    assert_eq!(status(&r, "device.0000:25:00.0.nodes"), Status::Pass);

    // The same GPUs on vfio-pci are wrong for containers; missing pids fails for them.
    let mut ready = Readiness::ready_vfio_host();
    ready.cgroups = CgroupLayout::V1(
        ["cpu", "cpuacct", "cpuset", "memory", "devices", "blkio"].map(str::to_owned).to_vec(),
    );
    let fx = build(&hosts::a100_8x_vfio(), &ready);
    let r = run(&fx, Profile::ContainerHost);
    assert_eq!(status(&r, "device.0000:25:00.0.driver"), Status::Fail);
    assert_eq!(status(&r, "cgroup.pids"), Status::Fail);
    assert_eq!(status(&r, "nvidia.driver"), Status::Fail);
}

#[test]
fn all_adds_tpu_checks_only_where_there_are_tpus() {
    let fx = build(&tpu_spec(), &Readiness::ready_tpu_vm());
    let r = run(&fx, Profile::All);
    assert!(r.checks.iter().any(|c| c.id == "memory.thp"));
    assert!(r.checks.iter().any(|c| c.id == "kernel.param.idle"));
    let fx = build(&hosts::a100_8x_vfio(), &Readiness::ready_vfio_host());
    let r = run(&fx, Profile::All);
    assert!(
        r.checks.iter().all(|c| c.id != "memory.thp" && c.id != "kernel.param.idle"),
        "{:#?}",
        ids(&r)
    );
    // Devices are checked for what they are set up as: these are on vfio-pci.
    assert_eq!(status(&r, "device.0000:25:00.0.driver"), Status::Pass);
    assert!(r.checks.iter().any(|c| c.id == "device.0000:25:00.0.vfio-node"));
}

#[test]
fn limits_come_from_limits_d_with_pam_precedence() {
    let mut ready = Readiness::ready_vfio_host();
    // limits.conf says unlimited for *, but root has only a wildcard line: not enough for root.
    ready.limits_conf = Some("* - memlock unlimited\n* - nofile 100000\n".into());
    ready.limits_d.clear();
    ready.proc_limits = Some(proc_limits(Some(65536), 1024));
    let fx = build(&hosts::a100_8x_vfio(), &ready);
    let r = run(&fx, Profile::VfioHost);
    let c = r.checks.iter().find(|c| c.id == "limits.memlock.config").unwrap();
    assert_eq!(c.status, Status::Fail);
    assert_eq!(
        c.detail.as_deref(),
        Some("root: soft unset, hard unset; other users (*): soft unlimited, hard unlimited")
    );
    assert_eq!(status(&r, "limits.memlock.effective"), Status::Warn);
    assert_eq!(status(&r, "limits.nofile.effective"), Status::Warn);
}

#[test]
fn an_unreadable_limits_conf_is_an_error_naming_it() {
    let fx = build(&hosts::a100_8x_vfio(), &Readiness::ready_vfio_host());
    std::fs::remove_file(fx.root().join("etc/security/limits.conf")).unwrap();
    std::fs::create_dir(fx.root().join("etc/security/limits.conf")).unwrap();
    let root = Root::new(fx.root()).unwrap();
    let inv = xpu_host::discover(&root, &DiscoverOptions::default()).unwrap();
    let e = doctor::run(&root, &inv, Profile::VfioHost).unwrap_err();
    assert!(e.to_string().starts_with("cannot read /etc/security/limits.conf: "), "{e}");
}

#[test]
fn no_accelerators_is_a_warning_not_a_failure_of_its_own() {
    let fx = build(&HostSpec::new("empty"), &Readiness::ready_vfio_host());
    let r = run(&fx, Profile::VfioHost);
    assert_eq!(status(&r, "accel.none"), Status::Warn);
}
