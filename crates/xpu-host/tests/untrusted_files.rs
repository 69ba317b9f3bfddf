//! Issue 11: a fixture or image root is untrusted. A sysfs attribute, a `/proc` file or a host
//! database that is a FIFO, a link to `/dev/zero` or a sparse 3 GB file makes discovery, the
//! narrow read the runtime shim does, the host key and `doctor` return promptly, with a warning
//! (or an error) naming the file and saying what it is, instead of blocking for ever or
//! aborting on a 1 GiB allocation.
//!
//! Each call runs on a thread and the test fails when it has not returned within a minute: not
//! a timing assertion, a hang detector (the calls take milliseconds).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use xpu_host::doctor::{self, Report};
use xpu_host::profile::Profile;
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_testkit::readiness::Readiness;
use xpu_testkit::traps::{Trap, returns};
use xpu_testkit::{Fixture, hosts};

/// Files discovery reads on the 8xA100 fixture, as warnings show them (host paths).
const DISCOVERY_FILES: [&str; 8] = [
    // Read for every function (the narrow read too).
    "/sys/bus/pci/devices/0000:25:00.0/vendor",
    "/sys/bus/pci/devices/0000:4d:00.0/class",
    // Read for the functions shown.
    "/sys/bus/pci/devices/0000:25:00.0/numa_node",
    "/sys/bus/pci/devices/0000:4d:00.0/current_link_speed",
    "/proc/driver/nvidia/gpus/0000:91:00.0/information",
    "/proc/driver/nvidia/version",
    "/proc/cpuinfo",
    "/proc/sys/kernel/hostname",
];

fn at(f: &Fixture, host_path: &str) -> PathBuf {
    f.root().join(host_path.trim_start_matches('/'))
}

fn assert_named(warnings: &[String], path: &str, trap: Trap) {
    assert!(
        warnings.iter().any(|w| w.contains(path) && w.contains(trap.said())),
        "no warning naming {path} and saying {:?} in {warnings:#?}",
        trap.said()
    );
}

#[test]
fn discovery_warns_about_fifos_device_links_and_huge_files_and_returns() {
    let release = hosts::a100_8x().kernel_release;
    for trap in Trap::ALL {
        let f = hosts::a100_8x().build();
        for p in DISCOVERY_FILES {
            trap.plant(&at(&f, p));
        }
        let aliases = format!("/lib/modules/{release}/modules.alias");
        trap.plant(&at(&f, &aliases));
        let root = Root::new(f.root()).unwrap();

        let r = root.clone();
        let inv = returns(&format!("discover with {trap:?}"), move || {
            xpu_host::discover(&r, &DiscoverOptions { scope: Scope::All, ..Default::default() })
        })
        .unwrap();
        for p in DISCOVERY_FILES {
            assert_named(&inv.warnings, p, trap);
        }
        assert_named(&inv.warnings, &aliases, trap);
        // The host is still listed: the GPU without a vendor and the one without a class are
        // told by what they have left.
        assert_eq!(inv.of_kind(xpu_core::DeviceKind::Gpu).count(), 8, "{trap:?}");
        assert!(inv.host.nvidia_driver_version.is_none());

        // The runtime shim's reads: the narrow discovery and the host key.
        let r = root.clone();
        let narrow = returns(&format!("discover_nodes with {trap:?}"), move || {
            xpu_host::discover_nodes(&r, None)
        })
        .unwrap();
        assert_named(&narrow.warnings, DISCOVERY_FILES[0], trap);
        assert_named(&narrow.warnings, "/proc/driver/nvidia/gpus/0000:91:00.0/information", trap);
        let r = root.clone();
        returns(&format!("host_key with {trap:?}"), move || xpu_host::host_key(&r));
        // /etc/hostname answers instead.
        let r = root.clone();
        let name = returns("hostname", move || xpu_host::discover::hostname(&r));
        assert_eq!(name.as_deref(), Some(f.spec.hostname.as_str()));
    }
}

/// `pci.ids`, named or found under the root, and amdgpu's values for telemetry.
#[test]
fn names_and_amdgpu_values_warn_and_return() {
    for trap in Trap::ALL {
        let f = hosts::a100_8x().build();
        let ids = at(&f, "/usr/share/misc/pci.ids");
        trap.plant(&ids);
        let root = Root::new(f.root()).unwrap();
        // Named with --pci-ids, and found under the root.
        for named in [Some(ids.clone()), None] {
            let r = root.clone();
            let inv = returns(&format!("discover with pci.ids {trap:?}"), move || {
                xpu_host::discover(&r, &DiscoverOptions { pci_ids: named, ..Default::default() })
            })
            .unwrap();
            assert_named(&inv.warnings, "usr/share/misc/pci.ids", trap);
        }

        let f = hosts::mi300x().build();
        let addr = f.spec.devices.iter().find(|d| d.vendor == 0x1002).unwrap().address;
        let dev = format!("/sys/bus/pci/devices/{addr}");
        for name in ["gpu_busy_percent", "ras/umc_err_count"] {
            trap.plant(&at(&f, &format!("{dev}/{name}")));
        }
        let root = Root::new(f.root()).unwrap();
        let (stats, warnings) = returns(&format!("amdgpu::read with {trap:?}"), move || {
            let mut w = Vec::new();
            (xpu_host::amdgpu::read(&root, &addr, &mut w), w)
        });
        assert_eq!(stats.busy_percent, None);
        for name in ["gpu_busy_percent", "ras/umc_err_count"] {
            assert_named(&warnings, &format!("{dev}/{name}"), trap);
        }
    }
}

/// Files `doctor` reads on a prepared passthrough host.
const DOCTOR_FILES: [&str; 8] = [
    "/proc/cmdline",
    "/proc/modules",
    "/proc/meminfo",
    "/proc/self/limits",
    "/proc/self/cgroup",
    "/etc/modprobe.d/blacklist.conf",
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/fs/cgroup/unified/cgroup.controllers",
];

fn doctor(f: &Fixture, profile: Profile) -> Result<Report, doctor::DoctorError> {
    let root = Root::new(f.root()).unwrap();
    returns(&format!("doctor {profile}"), move || {
        let inv =
            xpu_host::discover(&root, &DiscoverOptions { skip_names: true, ..Default::default() })
                .unwrap();
        doctor::run(&root, &inv, profile)
    })
}

#[test]
fn doctor_warns_about_fifos_device_links_and_huge_files_and_returns() {
    for trap in Trap::ALL {
        let f = hosts::a100_8x_vfio().build();
        Readiness::ready_vfio_host().write(f.root());
        for p in DOCTOR_FILES {
            trap.plant(&at(&f, p));
        }
        let r = doctor(&f, Profile::VfioHost).unwrap();
        for p in DOCTOR_FILES.iter().filter(|p| !p.contains("transparent_hugepage")) {
            assert_named(&r.warnings, p, trap);
        }
        // What could not be read is not there: the command line has no IOMMU parameters.
        assert!(r.failed());
        let r = doctor(&f, Profile::TpuVm).unwrap();
        assert_named(&r.warnings, "/sys/kernel/mm/transparent_hugepage/enabled", trap);
        // The mount table, read before the cgroup files.
        trap.plant(&at(&f, "/proc/self/mounts"));
        let r = doctor(&f, Profile::VfioHost).unwrap();
        assert_named(&r.warnings, "/proc/self/mounts", trap);
    }
}

/// A limits file that cannot be read is an error naming it (as an unreadable one always was):
/// the limits the host has are unknown.
#[test]
fn doctor_names_a_limits_file_that_is_a_fifo_a_device_link_or_huge() {
    for trap in Trap::ALL {
        for p in ["/etc/security/limits.conf", "/etc/security/limits.d/90-xpu.conf"] {
            let f = hosts::a100_8x_vfio().build();
            Readiness::ready_vfio_host().write(f.root());
            trap.plant(&at(&f, p));
            let e = doctor(&f, Profile::VfioHost).unwrap_err().to_string();
            assert!(e.contains(p) && e.contains(trap.said()), "{trap:?} {p}: {e}");
        }
    }
    // A link to /dev/null is how a configuration file is masked: no entries, no error.
    let f = hosts::a100_8x_vfio().build();
    Readiness::ready_vfio_host().write(f.root());
    let masked = at(&f, "/etc/security/limits.d/90-xpu.conf");
    std::fs::remove_file(&masked).unwrap();
    std::os::unix::fs::symlink("/dev/null", &masked).unwrap();
    let r = doctor(&f, Profile::VfioHost).unwrap();
    assert!(r.warnings.iter().all(|w| !w.contains("90-xpu.conf")), "{:#?}", r.warnings);
}

/// The driver files `xpu cdi generate` and the shim look for: the linker cache and the
/// libraries' and tools' ELF headers.
#[test]
fn driver_files_warn_about_the_linker_cache_and_return() {
    for trap in Trap::ALL {
        let f = hosts::a100_8x().build();
        let driver = xpu_testkit::driver::install_nvidia(f.root(), "535.104.05");
        trap.plant(&at(&f, xpu_host::driver_files::LD_SO_CACHE));
        let root = Root::new(f.root()).unwrap();
        let files = returns(&format!("driver_files::find with {trap:?}"), move || {
            xpu_host::driver_files::find(&root, Some("535.104.05"))
        });
        assert_named(&files.warnings, xpu_host::driver_files::LD_SO_CACHE, trap);
        drop(driver);
    }
}
