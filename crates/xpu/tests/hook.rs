//! `xpu hook` end to end: Debian's runc runs a busybox container whose `config.json` names
//! `xpu hook` as a `createRuntime` (or `prestart`) hook, on fixture hosts with real character
//! device nodes. Needs root and runc; skips with the reason printed only where they are absent.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::Path;
use std::process::Output;

use xpu_testkit::bundle::{
    self, Bundle, ContainerView, RUNC, RuncState, TestHost, container_id, probe_script, snapshot,
};
use xpu_testkit::hosts;
use xpu_testkit::sysfs::{MAJOR_MISC, MAJOR_VFIO_GROUP};

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

/// Adds `xpu hook STAGE` to the bundle and runs it with plain runc.
fn run_hooked(host: &TestHost, b: &Bundle, stage: &str, test: &str) -> (Output, RuncState) {
    let env = vec![format!("XPU_RUNTIME_CONFIG={}", host.config.display())];
    b.add_hook(stage, Path::new(XPU), &["xpu", "hook", stage], &env);
    let state = RuncState::new();
    let out = state.run(Path::new(RUNC), &[], b, &container_id(test), &[]);
    (out, state)
}

#[test]
fn hook_visible_devices_1_3_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let extra = "cat /usr/lib/x86_64-linux-gnu/libcuda.so.1; nvidia-smi; \
                 cat /dev/nvidia1 2>&1 | head -n1; \
                 touch /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>&1 | head -n1";
    let b = Bundle::busybox(&probe_script(extra));
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let spec_before = b.config();
    let (out, _state) = run_hooked(&host, &b, "createRuntime", "hk13");
    let v = ContainerView::of(&out);
    assert_eq!(v.accel_nodes(), bundle::a100_gpus_1_and_3_nodes());
    assert_eq!(v.env["NVIDIA_VISIBLE_DEVICES"], "1,3");
    assert!(v.extra.contains("fake libcuda.so.535.104.05"), "{}", v.extra);
    assert!(v.extra.contains("NVIDIA-SMI 535.104.05 (xpu fixture)"), "{}", v.extra);
    assert!(v.extra.contains("Read-only file system"), "{}", v.extra);
    // devices.allow was written: ENXIO from the missing driver, not EPERM from the cgroup.
    assert!(v.extra.contains("No such device or address"), "{}", v.extra);
    let mut spec_after = b.config();
    spec_after.as_object_mut().unwrap().remove("hooks");
    assert!(spec_after == spec_before, "a hook never edits the spec (beyond the hook entry)");
    assert!(host.log().contains("createRuntime"), "{}", host.log());
}

#[test]
fn hook_void_and_unset_add_nothing_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    for (i, env) in [None, Some("NVIDIA_VISIBLE_DEVICES=void")].into_iter().enumerate() {
        let b = Bundle::busybox(&probe_script(""));
        if let Some(e) = env {
            b.add_env(&[e]);
        }
        let (out, _state) = run_hooked(&host, &b, "createRuntime", &format!("hkvoid{i}"));
        let v = ContainerView::of(&out);
        assert!(v.accel_nodes().is_empty(), "{env:?}: {:?}", v.accel_nodes());
    }
}

#[test]
fn hook_tpu_container_sees_its_vfio_nodes_as_prestart_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::tpu_v5p());
    let b = Bundle::busybox(&probe_script(""));
    b.add_env(&["XPU_VISIBLE_DEVICES=tpu:1,tpu:3"]);
    let (out, _state) = run_hooked(&host, &b, "prestart", "hktpu");
    let v = ContainerView::of(&out);
    assert_eq!(
        v.accel_nodes(),
        bundle::char_nodes(&[
            ("/dev/vfio/1", MAJOR_VFIO_GROUP, 1),
            ("/dev/vfio/3", MAJOR_VFIO_GROUP, 3),
            ("/dev/vfio/vfio", MAJOR_MISC, 196),
        ])
    );
}

#[test]
fn hook_refuses_malicious_rootfs_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let canary = tempfile::Builder::new().prefix("xpu-canary-").tempdir().unwrap();
    std::fs::write(canary.path().join("keep"), b"canary").unwrap();
    let canary_before = snapshot(canary.path());
    let canary_s = canary.path().to_str().unwrap().to_owned();
    for (at, target, test) in [
        ("/usr/lib/x86_64-linux-gnu", "/", "hkevil1"),
        ("/usr/lib/x86_64-linux-gnu", canary_s.as_str(), "hkevil2"),
        ("/dev", "/etc", "hkevil3"),
    ] {
        let b = Bundle::busybox("true");
        b.add_env(&["NVIDIA_VISIBLE_DEVICES=all"]);
        b.plant_symlink(at, target);
        let etc_before = snapshot(&b.rootfs().join("etc"));
        let (out, state) = run_hooked(&host, &b, "createRuntime", test);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{at} -> {target}: the container must not start");
        assert!(
            stderr.contains(&format!("{at} in the container rootfs"))
                && stderr.contains("which points outside the rootfs"),
            "{at}: {stderr}"
        );
        assert_eq!(snapshot(&b.rootfs().join("etc")), etc_before, "{at}");
        drop(state);
    }
    assert_eq!(snapshot(canary.path()), canary_before, "nothing outside the rootfs changed");
    assert!(!Path::new("/libcuda.so.1").exists() && !Path::new("/libnvidia-ml.so.1").exists());
}

#[test]
fn hook_rejects_bad_state_and_bad_values_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    // Not from a runtime: stdin is not a state.
    let out = std::process::Command::new(XPU)
        .args(["hook", "createRuntime"])
        .env("XPU_RUNTIME_CONFIG", &host.config)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the container state on stdin is not valid")
    );
    // A bad value fails the container with the variable named.
    let b = Bundle::busybox("true");
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=12"]);
    let (out, _state) = run_hooked(&host, &b, "createRuntime", "hkbad");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("NVIDIA_VISIBLE_DEVICES=\\\"12\\\": GPU index 12 does not exist")
            || stderr.contains("NVIDIA_VISIBLE_DEVICES=\"12\": GPU index 12 does not exist"),
        "{stderr}"
    );
}
