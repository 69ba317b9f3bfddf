//! Issue 11 at the command line: `xpu discover`, `xpu doctor` and `xpu cdi generate --root` on
//! a fixture tree where a sysfs attribute, a `/proc` file and the linker cache are a FIFO, a
//! link to `/dev/zero` or a sparse 3 GB file. Each command exits at once, with the usual exit
//! status, and prints a warning naming each such file and what it is, where it used to block
//! for ever or abort ("memory allocation of 1073741824 bytes failed"). `cdi generate` needs
//! device nodes with numbers (`mknod`, root): that part is skipped, saying why, without root.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::process::{Command, Output, Stdio};

use xpu_testkit::readiness::Readiness;
use xpu_testkit::traps::{Trap, exits};
use xpu_testkit::{BuildOptions, Fixture, hosts};

/// `xpu args`, killed (and the test failed) if it has not exited within a minute.
fn xpu(args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    exits(child, &format!("xpu {args:?}"))
}

/// Plants `trap` at `host_path` in the fixture's tree.
fn plant(trap: Trap, f: &Fixture, host_path: &str) {
    trap.plant(&f.root().join(host_path.trim_start_matches('/')));
}

fn assert_warned(out: &Output, what: &str, paths: &[&str], trap: Trap) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    for p in paths {
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with("warning: ") && l.contains(p) && l.contains(trap.said())),
            "{what} with {trap:?}: no warning naming {p}:\n{stderr}"
        );
    }
}

fn root_of(f: &Fixture) -> &str {
    f.root().to_str().unwrap()
}

#[test]
fn discover_and_doctor_warn_about_fifos_device_links_and_huge_files_and_exit() {
    let attrs = [
        "/sys/bus/pci/devices/0000:25:00.0/vendor",
        "/sys/bus/pci/devices/0000:2b:00.0/numa_node",
        "/proc/driver/nvidia/version",
        "/proc/cpuinfo",
    ];
    // Read only for a GPU on the NVIDIA driver: planted on the host whose GPUs are on it.
    let info = "/proc/driver/nvidia/gpus/0000:48:00.0/information";
    let host_files = ["/proc/cmdline", "/proc/modules", "/proc/meminfo", "/proc/self/limits"];
    for trap in Trap::ALL {
        let f = hosts::a100_8x_vfio().build();
        Readiness::ready_vfio_host().write(f.root());
        for p in attrs.iter().chain(&host_files) {
            plant(trap, &f, p);
        }
        let out = xpu(&["discover", "--root", root_of(&f), "--format", "json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_warned(&out, "xpu discover", &attrs, trap);
        let inv: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(!inv["devices"].as_array().unwrap().is_empty());

        let out = xpu(&["doctor", "--root", root_of(&f), "--profile", "vfio-host"]);
        // The checks' verdicts (exit 0 or 1), not a hang, an abort or an input error.
        let code = out.status.code();
        assert!(matches!(code, Some(0 | 1)), "{code:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert_warned(&out, "xpu doctor", &host_files, trap);

        let g = hosts::a100_8x().build();
        plant(trap, &g, info);
        let out = xpu(&["discover", "--root", root_of(&g), "--format", "json"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_warned(&out, "xpu discover", &[info], trap);
    }
}

#[test]
fn doctor_names_a_limits_file_that_is_a_fifo_a_device_link_or_huge_and_fails() {
    for trap in Trap::ALL {
        let f = hosts::a100_8x_vfio().build();
        Readiness::ready_vfio_host().write(f.root());
        plant(trap, &f, "/etc/security/limits.conf");
        let out = xpu(&["doctor", "--root", root_of(&f), "--profile", "vfio-host"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{stderr}");
        assert!(
            stderr.contains("/etc/security/limits.conf") && stderr.contains(trap.said()),
            "{trap:?}: {stderr}"
        );
    }
}

#[test]
fn cdi_generate_warns_about_fifos_device_links_and_huge_files_and_exits_needs_root() {
    if !xpu_testkit::is_root() {
        eprintln!("skipping: cdi generate needs device nodes with numbers (mknod needs root)");
        return;
    }
    let files = [
        "/sys/bus/pci/devices/0000:2b:00.0/numa_node",
        "/proc/driver/nvidia/gpus/0000:c5:00.0/information",
        "/etc/ld.so.cache",
    ];
    for trap in Trap::ALL {
        let f =
            hosts::a100_8x().build_with(&BuildOptions { char_devices: true, ..Default::default() });
        xpu_testkit::driver::install_nvidia(f.root(), "535.104.05");
        for p in files {
            plant(trap, &f, p);
        }
        let out_dir = tempfile::tempdir().unwrap();
        let out = xpu(&[
            "cdi",
            "generate",
            "--root",
            root_of(&f),
            "--output",
            out_dir.path().to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_warned(&out, "xpu cdi generate", &files, trap);
        assert!(out_dir.path().join("xpu-nvidia.com-gpu.yaml").is_file());
        // A FIFO where the next run will look for the host snapshot: generation replaces it.
        let snapshot = out_dir.path().join("xpu-host.snapshot");
        std::fs::remove_file(&snapshot).unwrap();
        let made = Command::new("mkfifo").arg(&snapshot).status().unwrap();
        assert!(made.success());
        let again = xpu(&[
            "cdi",
            "generate",
            "--root",
            root_of(&f),
            "--output",
            out_dir.path().to_str().unwrap(),
        ]);
        assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
        assert!(std::fs::symlink_metadata(&snapshot).unwrap().is_file());
    }
}
