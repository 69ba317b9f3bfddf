//! Issue 12, end to end: the shim binary `xpu-container-runtime` (as cargo builds it) creating a
//! container that asks for GPUs 1 and 3 on the 8xA100 fixture, while `xpu-host.snapshot` in its
//! CDI directory is a FIFO, a link to `/dev/zero` or a sparse 3 GB file. Each start returns at
//! once with the devices (discovered), and says on stderr and in the log which file it passed
//! over. The real runtime is `/bin/true`: nothing runs. Needs root (the fixture's device nodes
//! are made with `mknod`): skips, saying why, without.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::Path;
use std::process::{Command, Stdio};

use xpu_testkit::bundle::TestHost;
use xpu_testkit::hosts;
use xpu_testkit::traps::{Trap, exits};

const LEAN: &str = env!("CARGO_BIN_EXE_xpu-container-runtime");

/// A bundle whose container asks for `NVIDIA_VISIBLE_DEVICES=1,3`: `config.json` as runc's
/// `spec` writes the members the shim reads, and an empty rootfs.
fn bundle(dir: &Path) {
    std::fs::create_dir_all(dir.join("rootfs")).unwrap();
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["true"],
            "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=1,3"],
            "cwd": "/"
        },
        "root": {"path": "rootfs"},
        "linux": {"namespaces": [{"type": "mount"}]}
    });
    std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
}

#[test]
fn lean_shim_passes_over_a_snapshot_that_is_a_fifo_a_device_link_or_huge_needs_root() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipping: the fixture's device nodes need mknod, which needs root");
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let cdi = host.dir.path().join("cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    let snapshot = cdi.join(xpu_container::snapshot::FILE_NAME);
    // The fixture's runtime.toml (root, log, cdi_dirs), with /bin/true for runc.
    let text = std::fs::read_to_string(&host.config).unwrap();
    let config = host.dir.path().join("runtime-true.toml");
    let runtime = text.lines().find(|l| l.starts_with("runtime =")).unwrap();
    std::fs::write(&config, text.replace(runtime, "runtime = \"/bin/true\"")).unwrap();

    for (i, trap) in Trap::ALL.into_iter().enumerate() {
        let said = trap.said();
        trap.plant(&snapshot);
        let b = host.dir.path().join(format!("bundle-{i}"));
        bundle(&b);
        let child = Command::new(LEAN)
            .args(["create", "--bundle"])
            .arg(&b)
            .arg(format!("snapshot-trap-{i}"))
            .env("XPU_RUNTIME_CONFIG", &config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = exits(child, &format!("the shim with {} ({said})", snapshot.display()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}: {stderr}");
        let warning = format!("host snapshot {}: {said}", snapshot.display());
        assert!(stderr.contains(&warning), "{said}: {stderr}");
        let log = host.log();
        assert!(log.contains(&warning), "{said}: {log}");
        let edited = std::fs::read_to_string(b.join("config.json")).unwrap();
        for node in ["/dev/nvidia1", "/dev/nvidia3"] {
            assert!(edited.contains(node), "{said}: {node} in {edited}");
        }
        assert!(!edited.contains("/dev/nvidia2"), "{said}: only GPUs 1 and 3");
    }
    assert!(!host.log().contains("(host snapshot)"), "discovered each time: {}", host.log());
}
