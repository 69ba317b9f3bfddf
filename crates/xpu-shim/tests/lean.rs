//! The shim binary `xpu-container-runtime` as cargo builds it (glibc, the test profile), end to
//! end: Debian's runc runs a busybox container through it on the 8xA100 fixture, from the host
//! snapshot. The binary as the package builds it (musl, `scripts/build-shim`) has its own tests
//! (`tests/installed.rs`); the shim's behaviour in every other case is tested through `xpu`
//! (`crates/xpu/tests/runtime.rs`), which runs the same code (`xpu_shim::run`). Needs root and
//! runc: skips, saying why, without root; fails, naming the install command, without runc or
//! busybox.

#![allow(clippy::unwrap_used)]

use std::path::Path;

#[path = "shim_support/mod.rs"]
mod shim_support;

use xpu_testkit::bundle::{self, Bundle, ContainerView, RuncState, container_id, probe_script};

const LEAN: &str = env!("CARGO_BIN_EXE_xpu-container-runtime");

#[test]
fn lean_shim_gives_gpus_1_and_3_from_the_host_snapshot_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = shim_support::a100_host_with_snapshot();

    let b = Bundle::busybox(&probe_script("cat /usr/lib/x86_64-linux-gnu/libcuda.so.1"));
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let state = RuncState::new();
    let cfg = host.config.to_str().unwrap();
    let id = container_id("lean13");
    let out = state.run(Path::new(LEAN), &[], &b, &id, &[("XPU_RUNTIME_CONFIG", cfg)]);
    let v = ContainerView::of(&out);
    assert_eq!(
        v.accel_nodes(),
        bundle::a100_gpus_1_and_3_nodes(),
        "exactly GPUs 1 and 3 plus the control nodes"
    );
    assert_eq!(v.env["XPU_DEVICES"], "nvidia.com/gpu=1,nvidia.com/gpu=3");
    assert!(v.extra.contains("fake libcuda.so.535.104.05"), "{}", v.extra);
    let log = host.log();
    assert!(log.contains("nvidia.com/gpu=1,nvidia.com/gpu=3: 5 nodes"), "{log}");
    assert!(log.contains("(host snapshot)"), "the snapshot answered: {log}");
}
