//! The front as the package installs it, end to end: `scripts/build-shim` builds it without libc
//! (and the full shim beside it), and Debian's runc runs busybox containers through it on the
//! 8xA100 fixture. A container that asks for nothing goes straight to runc; one that asks for
//! GPUs 1 and 3 is handed to the full shim and gets exactly those; errors are the full shim's,
//! and a runtime config naming the front itself ends in that error, not in a loop. Needs root
//! and runc for the containers; skips them, saying why, only where they are absent.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use xpu_testkit::bundle::{
    self, Bundle, ContainerView, RuncState, TestHost, container_id, probe_script,
};
use xpu_testkit::hosts;

/// `scripts/build-shim`, once per test binary: the front without libc and the full shim, in
/// `<target>/shim/`.
fn built() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let out = Command::new(root.join("scripts/build-shim")).output().unwrap();
        assert!(
            out.status.success(),
            "scripts/build-shim: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let target =
            std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
        (target.join("shim/xpu-container-runtime"), target.join("shim/xpu-shim-std"))
    })
}

#[test]
fn the_front_links_no_libc() {
    let (front, _) = built();
    let image = std::fs::read(front).unwrap();
    // An ELF executable with no interpreter, and none of glibc's start-up in it.
    assert_eq!(&image[..4], b"\x7fELF");
    for needle in [&b"/lib64/ld-linux"[..], b"__libc_start_main", b"GLIBC_", b"intel_check_word"] {
        assert!(
            !image.windows(needle.len()).any(|w| w == needle),
            "{} contains {:?}",
            front.display(),
            String::from_utf8_lossy(needle)
        );
    }
    let out = Command::new(front).arg("--version").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("xpu-container-runtime version "), "{stdout}");
}

/// The full shim as `scripts/build-shim` builds it: std linked with musl, none of glibc in it;
/// and with backtraces asked for (`RUST_BACKTRACE`, `RUST_LIB_BACKTRACE`: an error then captures
/// one, through gcc's unwinder and the `_dl_find_object` the binary provides) an error is still
/// reported, exit status 1, rather than the process aborting in the unwinder.
#[test]
fn the_full_shim_links_musl_and_reports_errors_with_backtraces_on() {
    let (_, full) = built();
    let image = std::fs::read(full).unwrap();
    assert_eq!(&image[..4], b"\x7fELF");
    for needle in [&b"/lib64/ld-linux"[..], b"GLIBC_", b"intel_check_word", b"GNU C Library"] {
        assert!(
            !image.windows(needle.len()).any(|w| w == needle),
            "{} contains {:?}",
            full.display(),
            String::from_utf8_lossy(needle)
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("runtime.toml");
    std::fs::write(&cfg, "runtime = \"/nonexistent/runc\"\n").unwrap();
    for backtrace in ["0", "1", "full"] {
        let out = Command::new(full)
            .args(["state", "x"])
            .env("XPU_RUNTIME_CONFIG", &cfg)
            .env("RUST_BACKTRACE", backtrace)
            .env("RUST_LIB_BACKTRACE", backtrace)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "RUST_BACKTRACE={backtrace}: {stderr}");
        assert!(stderr.contains("\"/nonexistent/runc\" was not found"), "{stderr}");
    }
}

#[test]
fn front_runs_containers_and_hands_requests_to_the_full_shim_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let (front, _) = built();
    let host = TestHost::new(&hosts::a100_8x());
    let cdi = host.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let root = xpu_host::Root::new(host.fixture.root()).unwrap();
    let snap = xpu_shim::host_snapshot(&root, xpu_host::host_key(&root)).unwrap();
    std::fs::write(cdi.join(xpu_container::snapshot::FILE_NAME), snap.to_json()).unwrap();
    let cfg = host.config.to_str().unwrap();
    let env = [("XPU_RUNTIME_CONFIG", cfg)];

    // Nothing asked for: runc runs it, and the full shim logs nothing.
    let plain = Bundle::busybox("echo plain-ok");
    let state = RuncState::new();
    let out = state.run(front, &[], &plain, &container_id("front-plain"), &env);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "plain-ok");
    assert_eq!(host.log(), "", "a container asking for nothing never reaches the full shim");

    // GPUs 1 and 3: the full shim's work, from the snapshot.
    let b = Bundle::busybox(&probe_script("cat /usr/lib/x86_64-linux-gnu/libcuda.so.1"));
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let out = state.run(front, &[], &b, &container_id("front13"), &env);
    let v = ContainerView::of(&out);
    assert_eq!(v.accel_nodes(), bundle::a100_gpus_1_and_3_nodes());
    assert_eq!(v.env["XPU_DEVICES"], "nvidia.com/gpu=1,nvidia.com/gpu=3");
    let log = host.log();
    assert!(log.contains("nvidia.com/gpu=1,nvidia.com/gpu=3: 5 nodes"), "{log}");
    assert!(log.contains("(host snapshot)"), "{log}");

    // runc's own answer for a command it refuses comes through unchanged.
    let out = Command::new(front)
        .args(["--root"])
        .arg(state.path())
        .args(["state", "no-such-container"])
        .env("XPU_RUNTIME_CONFIG", cfg)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("container does not exist"));
}

#[test]
fn errors_are_the_full_shims_and_a_runtime_naming_a_shim_does_not_loop() {
    let (front, full) = built();
    let dir = tempfile::tempdir().unwrap();
    let run = |config: &str| {
        let p = dir.path().join("runtime.toml");
        std::fs::write(&p, config).unwrap();
        let out = Command::new(front)
            .args(["state", "x"])
            .env("XPU_RUNTIME_CONFIG", &p)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{config}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run("runtim = \"runc\"\n");
    assert!(e.contains("unknown field `runtim`"), "{e}");
    for shim in [front, full] {
        let e = run(&format!("runtime = \"{}\"\n", shim.display()));
        assert!(e.contains("is this shim itself"), "{e}");
    }
}

/// What the runtime starts with is the same through the front as through the full shim: the
/// signal mask, ignored signals (std's exec resets SIGPIPE; the caller here ignores it) and a
/// standard input the caller closed (std reopens it on /dev/null).
#[test]
fn runc_starts_in_the_same_process_state_through_either_binary() {
    let (front, full) = built();
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("probe");
    std::fs::write(
        &probe,
        "#!/bin/sh\ngrep -E '^(SigBlk|SigIgn)' /proc/self/status\nreadlink /proc/self/fd/0 || echo closed\n",
    )
    .unwrap();
    std::fs::set_permissions(&probe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = dir.path().join("runtime.toml");
    std::fs::write(&config, format!("runtime = \"{}\"\n", probe.display())).unwrap();
    let state = |shim: &Path| {
        // SIGPIPE ignored and stdin closed by the caller, as a careless engine might leave them.
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("trap '' PIPE; exec '{}' state x <&-", shim.display()))
            .env("XPU_RUNTIME_CONFIG", &config)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            shim.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (through_front, through_full) = (state(front), state(full));
    assert_eq!(through_front, through_full);
    assert!(through_front.contains("/dev/null"), "{through_front}");
}
