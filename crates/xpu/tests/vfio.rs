//! `xpu vfio` as a process on fixture hosts: status, dry runs, refusals and idempotence.
//! Binding for real needs the kernel's reaction, which the library tests model with the fake
//! kernel (crates/xpu-host/tests/vfio_fake_kernel.rs); here the binary runs its real sysfs
//! kernel, so only paths that make no write (or are caught and rolled back) are exercised.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

use serde_json::Value;
use xpu_testkit::fake_kernel::snapshot;
use xpu_testkit::hosts;

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

#[test]
fn status_reports_driver_group_viability_and_node() {
    let fx = hosts::gpu_with_audio().build();
    let root = fx.root().to_str().unwrap();
    let out = xpu(&["vfio", "status", "--root", root, "--format", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpu = v.as_array().unwrap().iter().find(|d| d["address"] == "0000:01:00.0").unwrap();
    assert_eq!(gpu["driver"], "vfio-pci");
    assert_eq!(gpu["iommu_group"], 1);
    assert_eq!(gpu["group_viable"], false);
    assert_eq!(gpu["blockers"][0]["address"], "0000:01:00.1");
    assert_eq!(gpu["blockers"][0]["driver"], "snd_hda_intel");
    assert_eq!(gpu["vfio_node"]["path"], "/dev/vfio/1");
    assert_eq!(gpu["vfio_node"]["exists"], true);

    let out = xpu(&["vfio", "status", "01:00.0", "--root", root]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("ADDRESS "), "{text}");
    assert!(text.contains("no: 0000:01:00.1 (snd_hda_intel)"), "{text}");
    assert!(text.contains("/dev/vfio/1 (0666)"), "{text}");
}

/// Which use holds each device and since when: a DRA claim's passthrough (from the driver's
/// checkpoint), the list of devices kept for Nova, xpu's own bind (its state file), the host.
#[test]
fn status_says_which_use_holds_each_device_and_since_when() {
    let fx = hosts::a100_8x_vfio().build();
    let root = fx.root().to_str().unwrap();
    let rows = |extra: &[&str]| -> Vec<Value> {
        let mut args =
            vec!["vfio", "status", "--all-accelerators", "--root", root, "--format", "json"];
        args.extend(extra);
        let out = xpu(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap().as_array().unwrap().clone()
    };
    let all = rows(&[]);
    let gpus: Vec<String> = all
        .iter()
        .filter(|d| d["kind"] == "gpu")
        .map(|d| d["address"].as_str().unwrap().to_owned())
        .collect();
    assert!(all.iter().all(|d| d["held_by"] == "vfio-pci: bound outside xpu"), "{all:?}");
    let put = |path: &str, text: &str| {
        let p = fx.root().join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    let name = |a: &str| format!("gpu-{}", a.replace([':', '.'], "-"));
    put(
        "var/lib/kubelet/plugins/xpu.dev/checkpoint.json",
        &serde_json::json!({ "version": 1, "claims": { "u1": {
            "namespace": "vms", "name": "win11", "spec_file": "x.json",
            "devices": [{ "requests": ["gpu"], "pool": "n", "device": name(&gpus[0]), "cdi_ids": [] }],
            "vfio": [gpus[0]], "since": "2026-11-29T18:00:00Z" } } })
        .to_string(),
    );
    put("etc/xpu/vm-devices", &format!("{}\n", gpus[1]));
    put(
        "var/lib/xpu/vfio-state.json",
        &serde_json::json!({ "devices": { gpus[2].clone(): { "driver": "nvidia", "driver_override": null } },
                             "since": { gpus[2].clone(): 1_764_432_000u64 } })
        .to_string(),
    );
    let now = rows(&[]);
    let row = |a: &str| now.iter().find(|d| d["address"] == a).unwrap().clone();
    assert_eq!(row(&gpus[0])["held_by"], "vm: claim vms/win11");
    assert_eq!(row(&gpus[0])["since"], "2026-11-29T18:00:00Z");
    assert_eq!(row(&gpus[1])["held_by"], "nova: listed in /etc/xpu/vm-devices");
    assert_eq!(row(&gpus[2])["held_by"], "vfio-pci: xpu vfio bind");
    assert_eq!(row(&gpus[2])["since"], "2025-11-29T16:00:00Z");
    assert_eq!(row(&gpus[2])["previous_driver"], "nvidia");
    assert_eq!(row(&gpus[3])["held_by"], "vfio-pci: bound outside xpu");
    let out = xpu(&["vfio", "status", &gpus[0], "--root", root]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("HELD BY") && text.contains("vm: claim vms/win11"), "{text}");
    // A checkpoint that is not one is an input error naming it and the flag.
    put("var/lib/kubelet/plugins/xpu.dev/checkpoint.json", "{");
    let out = xpu(&["vfio", "status", "--root", root]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("checkpoint.json") && e.contains("--dra-checkpoint"), "{e}");
}

#[test]
fn bind_dry_run_prints_the_writes_and_makes_none() {
    let fx = hosts::a100_8x().build();
    let before = snapshot(fx.root());
    let out = xpu(&[
        "vfio",
        "bind",
        "25:00.0",
        "--dry-run",
        "--persist",
        "--root",
        fx.root().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("0000:25:00.0: would move nvidia -> vfio-pci"), "{text}");
    assert!(text.contains("  modprobe vfio-pci\n  echo vfio-pci > /sys/bus/pci/devices/0000:25:00.0/driver_override\n  echo 0000:25:00.0 > /sys/bus/pci/drivers/nvidia/unbind\n  echo 0000:25:00.0 > /sys/bus/pci/drivers_probe\n"), "{text}");
    assert!(text.contains("would create /etc/udev/rules.d/98-xpu-vfio-bind.rules"), "{text}");
    assert_eq!(snapshot(fx.root()), before);
}

#[test]
fn group_refusal_exits_1_and_touches_nothing() {
    let mut spec = hosts::gpu_with_audio();
    spec.devices[1].driver = Some("nouveau".into());
    let fx = spec.build();
    let before = snapshot(fx.root());
    let out = xpu(&["vfio", "bind", "0000:01:00.0", "--root", fx.root().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: device 0000:01:00.0 is in IOMMU group 1 with 0000:01:00.1 (snd_hda_intel); bind both or pass --group\n"
    );
    assert_eq!(snapshot(fx.root()), before);
}

#[test]
fn rebinding_bound_devices_is_a_no_op() {
    let fx = hosts::tpu_v5p().build();
    let before = snapshot(fx.root());
    let out = xpu(&["vfio", "bind", "--all-accelerators", "--root", fx.root().to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.matches("already on vfio-pci, nothing to do").count(), 4, "{text}");
    assert!(text.ends_with("no changes\n"), "{text}");
    assert_eq!(snapshot(fx.root()), before);
}

#[test]
fn a_kernel_that_does_not_react_fails_and_is_rolled_back() {
    // The binary's real sysfs kernel on a fixture: the writes land in plain files and no driver
    // moves, so verification fails and the override is put back.
    let mut spec = hosts::a100_8x();
    spec.loaded_modules.push("vfio_pci".into());
    let fx = spec.build();
    std::fs::create_dir_all(fx.root().join("sys/bus/pci/drivers/vfio-pci")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["vfio", "bind", "25:00.0", "--root", fx.root().to_str().unwrap()])
        .env("XPU_LOG", "debug")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "debug: kernel: echo vfio-pci > /sys/bus/pci/devices/0000:25:00.0/driver_override"
        ),
        "{err}"
    );
    assert!(
        err.contains("error: bind 0000:25:00.0: 0000:25:00.0 is still bound to nvidia"),
        "{err}"
    );
    assert!(err.contains("rolled back: 1 device left exactly as it was"), "{err}");
    let link = std::fs::read_link(fx.device_dir("0000:25:00.0").join("driver")).unwrap();
    assert!(link.ends_with("nvidia"));
}

#[test]
fn bad_addresses_exit_2() {
    let fx = hosts::a100_8x().build();
    let root = fx.root().to_str().unwrap();
    for (bad, why) in [
        ("25:00", "missing .function"),
        ("0000:25:00.8", "function must be 0-7"),
        ("0000:25:20.0", "device must be 00-1f"),
        ("gg:00.0", "bus is not 1-2 hex digits"),
    ] {
        let out = xpu(&["vfio", "bind", bad, "--root", root]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("invalid PCI address \"{bad}\": {why}; expected dddd:bb:dd.f")),
            "{bad}: {err}"
        );
    }
    let out = xpu(&["vfio", "bind", "0000:99:00.0", "--root", root]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("device 0000:99:00.0 does not exist"));
    let out = xpu(&["vfio", "unbind", "--root", root]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no devices given"));
    let out = xpu(&["vfio", "status", "0000:99:00.0", "--root", root]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn persist_never_follows_a_link_out_of_the_root() {
    // All four TPUs are already on vfio-pci, so the only writes are the --persist files.
    let fx = hosts::tpu_v5p().build();
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("etc");
    std::fs::create_dir_all(fx.root().join("etc")).unwrap();
    std::fs::rename(fx.root().join("etc"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, fx.root().join("etc")).unwrap();
    let before = snapshot(dir.path());
    let root = fx.root().to_str().unwrap();
    for extra in [&["--dry-run"][..], &[]] {
        let mut args = vec!["vfio", "bind", "--all-accelerators", "--persist", "--root", root];
        args.extend(extra);
        let out = xpu(&args);
        assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stdout));
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            e.contains(&format!(
                "{root}/etc is a symlink to {}, outside the root",
                outside.display()
            )),
            "{e}"
        );
        assert_eq!(snapshot(dir.path()), before, "{extra:?}");
    }

    // The same tree with /etc a directory: the rule is written inside the root.
    std::fs::remove_file(fx.root().join("etc")).unwrap();
    std::fs::create_dir(fx.root().join("etc")).unwrap();
    let out = xpu(&["vfio", "bind", "--all-accelerators", "--persist", "--root", root]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(fx.root().join("etc/udev/rules.d/98-xpu-vfio-bind.rules").is_file());
}
