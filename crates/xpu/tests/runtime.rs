//! `xpu-container-runtime` end to end: Debian's runc runs a busybox container through the shim
//! on fixture hosts whose device nodes are real character devices (`mknod`). Needs root and
//! runc (installed by scripts/install-test-deps); each test says so and skips, with the reason
//! printed, only where they are truly absent.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use xpu_testkit::bundle::{
    self, Bundle, ContainerView, RUNC, RuncState, TestHost, container_id, probe_script, snapshot,
};
use xpu_testkit::hosts;
use xpu_testkit::sysfs::{MAJOR_MISC, MAJOR_NVIDIA, MAJOR_VFIO_GROUP};

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

/// `xpu-container-runtime`: a symlink to the xpu binary, so argv[0] dispatch is what runs.
fn shim_link(dir: &Path) -> PathBuf {
    let link = dir.join("xpu-container-runtime");
    if !link.exists() {
        std::os::unix::fs::symlink(XPU, &link).unwrap();
    }
    link
}

/// Runs `bundle` through the shim and returns the output.
fn run_shim(host: &TestHost, bundle: &Bundle, test: &str) -> (Output, RuncState) {
    run_program(&shim_link(host.dir.path()), host, bundle, test)
}

/// Runs `bundle` through `shim` (the `xpu` symlink or another shim binary).
fn run_program(shim: &Path, host: &TestHost, bundle: &Bundle, test: &str) -> (Output, RuncState) {
    let state = RuncState::new();
    let cfg = host.config.to_str().unwrap();
    let out = state.run(shim, &[], bundle, &container_id(test), &[("XPU_RUNTIME_CONFIG", cfg)]);
    (out, state)
}

#[test]
fn runtime_visible_devices_1_3_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let extra = "cat /usr/lib/x86_64-linux-gnu/libcuda.so.1; nvidia-smi; \
                 cat /dev/nvidia1 2>&1 | head -n1; \
                 touch /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>&1 | head -n1";
    // Through `xpu` called xpu-container-runtime; the packaged binary's own tests are in the
    // xpu-shim package (`tests/lean.rs`, `tests/installed.rs`).
    let b = Bundle::busybox(&probe_script(extra));
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let (out, _state) = run_shim(&host, &b, "rt13");
    check_gpus_1_and_3(&ContainerView::of(&out));
    let logged = host.log().matches("nvidia.com/gpu=1,nvidia.com/gpu=3: 5 nodes").count();
    assert_eq!(logged, 1, "{}", host.log());
}

/// What a container given `NVIDIA_VISIBLE_DEVICES=1,3` on the 8xA100 fixture sees.
fn check_gpus_1_and_3(v: &ContainerView) {
    assert_eq!(
        v.accel_nodes(),
        bundle::a100_gpus_1_and_3_nodes(),
        "exactly GPUs 1 and 3 plus the control nodes"
    );
    assert_eq!(v.env["NVIDIA_VISIBLE_DEVICES"], "1,3");
    assert_eq!(v.env["XPU_DEVICES"], "nvidia.com/gpu=1,nvidia.com/gpu=3");
    // The driver's files, read-only, and nvidia-smi runs.
    assert!(v.extra.contains("fake libcuda.so.535.104.05"), "{}", v.extra);
    assert!(v.extra.contains("NVIDIA-SMI 535.104.05 (xpu fixture)"), "{}", v.extra);
    assert!(v.extra.contains("Read-only file system"), "{}", v.extra);
    // The cgroup allows the device: opening it reaches the (absent) driver, ENXIO, not EPERM.
    assert!(v.extra.contains("No such device or address"), "{}", v.extra);
}

#[test]
fn runtime_void_and_unset_add_nothing_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    for (i, env) in [None, Some("NVIDIA_VISIBLE_DEVICES=void"), Some("NVIDIA_VISIBLE_DEVICES=")]
        .into_iter()
        .enumerate()
    {
        let b = Bundle::busybox(&probe_script(""));
        if let Some(e) = env {
            b.add_env(&[e]);
        }
        let before = std::fs::read(b.config_path()).unwrap();
        let (out, _state) = run_shim(&host, &b, &format!("rtvoid{i}"));
        let v = ContainerView::of(&out);
        assert!(v.accel_nodes().is_empty(), "{env:?}: {:?}", v.accel_nodes());
        assert!(!v.env.contains_key("XPU_DEVICES"));
        assert_eq!(std::fs::read(b.config_path()).unwrap(), before, "{env:?}: spec untouched");
    }
}

#[test]
fn runtime_tpu_container_sees_its_vfio_nodes_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::tpu_v5p());
    let b = Bundle::busybox(&probe_script(""));
    b.add_env(&["XPU_VISIBLE_DEVICES=google.com/tpu=0,tpu:2"]);
    let (out, _state) = run_shim(&host, &b, "rttpu");
    let v = ContainerView::of(&out);
    assert_eq!(
        v.accel_nodes(),
        bundle::char_nodes(&[
            ("/dev/vfio/0", MAJOR_VFIO_GROUP, 0),
            ("/dev/vfio/2", MAJOR_VFIO_GROUP, 2),
            ("/dev/vfio/vfio", MAJOR_MISC, 196),
        ])
    );
    assert_eq!(v.env["XPU_DEVICES"], "google.com/tpu=0,google.com/tpu=2");
}

#[test]
fn runtime_cdi_annotation_and_none_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    // A CDI annotation (as a device plugin's Allocate leaves it), another vendor's name ignored.
    let b = Bundle::busybox(&probe_script(""));
    let mut c = b.config();
    c["annotations"] = serde_json::json!({
        "cdi.k8s.io/xpu": "nvidia.com/gpu=GPU-5eed0007-a100-4000-8000-000000000007,vendor.example/fpga=0"
    });
    b.set_config(&c);
    let (out, _state) = run_shim(&host, &b, "rtcdi");
    let v = ContainerView::of(&out);
    assert!(v.accel_nodes().contains_key("/dev/nvidia7"), "{:?}", v.accel_nodes());
    assert_eq!(v.env["XPU_DEVICES"], "nvidia.com/gpu=7");

    // `none`: the driver without a GPU; utility only, so no UVM.
    let b = Bundle::busybox(&probe_script("nvidia-smi"));
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_DRIVER_CAPABILITIES=utility"]);
    let (out, _state) = run_shim(&host, &b, "rtnone");
    let v = ContainerView::of(&out);
    assert_eq!(v.accel_nodes(), bundle::char_nodes(&[("/dev/nvidiactl", MAJOR_NVIDIA, 255)]));
    assert!(v.extra.contains("NVIDIA-SMI"), "{}", v.extra);
}

/// Runs `create` through `xpu runtime` for a request that must fail; returns stderr after
/// checking that the engine saw a failure and nothing changed.
fn refused(host: &TestHost, b: &Bundle, test: &str) -> String {
    let before = std::fs::read(b.config_path()).unwrap();
    let state = RuncState::new();
    let out = Command::new(XPU)
        .args(["runtime", "--root"])
        .arg(state.path())
        .args(["create", "--bundle"])
        .arg(b.dir())
        .arg(container_id(test))
        .env("XPU_RUNTIME_CONFIG", &host.config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{test}: create should fail");
    assert_eq!(std::fs::read(b.config_path()).unwrap(), before, "{test}: spec untouched");
    assert!(state.containers().is_empty(), "{test}: runc never ran");
    let leftovers: Vec<_> = std::fs::read_dir(b.dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{test}: {leftovers:?}");
    stderr
}

#[test]
fn runtime_bad_input_fails_create_naming_it_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let cases: [(&[&str], &str); 7] = [
        (
            &["NVIDIA_VISIBLE_DEVICES=1,9"],
            "NVIDIA_VISIBLE_DEVICES=\"1,9\": GPU index 9 does not exist; this host has 8 NVIDIA GPUs (indices 0-7)",
        ),
        (
            &["NVIDIA_VISIBLE_DEVICES=GPU-nope"],
            "NVIDIA_VISIBLE_DEVICES=\"GPU-nope\": no NVIDIA GPU has UUID GPU-nope",
        ),
        (&["NVIDIA_VISIBLE_DEVICES=MIG-1234"], "MIG devices are not supported yet"),
        (&["NVIDIA_VISIBLE_DEVICES=0:1"], "MIG devices are not supported yet"),
        (
            &["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,gpu"],
            "NVIDIA_DRIVER_CAPABILITIES=\"compute,gpu\": unknown capability \"gpu\"",
        ),
        (
            &[
                "NVIDIA_VISIBLE_DEVICES=0",
                "NVIDIA_REQUIRE_CUDA=cuda>=12.4 brand=tesla,driver>=470,driver<471",
            ],
            "NVIDIA_REQUIRE_CUDA=\"cuda>=12.4 brand=tesla,driver>=470,driver<471\": requirement not met",
        ),
        (
            &["XPU_VISIBLE_DEVICES=example.com/fpga=0"],
            "XPU_VISIBLE_DEVICES=\"example.com/fpga=0\": unknown CDI kind example.com/fpga",
        ),
    ];
    for (i, (env, want)) in cases.iter().enumerate() {
        let b = Bundle::busybox("true");
        b.add_env(env);
        let stderr = refused(&host, &b, &format!("rtbad{i}"));
        assert!(stderr.contains(want), "{env:?}: {stderr}");
        assert!(stderr.starts_with("xpu-container-runtime: error:"), "{stderr}");
    }

    let b = Bundle::busybox("true");
    std::fs::write(b.config_path(), b"{\"process\": {\"env\": [\"NVIDIA_VISIBLE_DEVICES=0\"]")
        .unwrap();
    let stderr = refused(&host, &b, "rtbadjson");
    assert!(stderr.contains("config.json: not valid JSON"), "{stderr}");

    let b = Bundle::busybox("true");
    let mut c = b.config();
    c["process"]["env"] = serde_json::json!("NVIDIA_VISIBLE_DEVICES=0");
    b.set_config(&c);
    let stderr = refused(&host, &b, "rtbadenv");
    assert!(stderr.contains("process.env is not an array of strings"), "{stderr}");
}

#[test]
fn runtime_require_is_checked_and_can_be_disabled_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    // CUDA 12.2 (runtime.toml) meets cuda>=12.0.
    let b = Bundle::busybox(&probe_script(""));
    b.add_env(&[
        "NVIDIA_VISIBLE_DEVICES=0",
        "NVIDIA_REQUIRE_CUDA=cuda>=12.0 brand=tesla,driver>=470,driver<471",
    ]);
    let (out, _state) = run_shim(&host, &b, "rtreq");
    assert!(ContainerView::of(&out).accel_nodes().contains_key("/dev/nvidia0"));
    // Not met, but disabled.
    let b = Bundle::busybox(&probe_script(""));
    b.add_env(&[
        "NVIDIA_VISIBLE_DEVICES=0",
        "NVIDIA_REQUIRE_CUDA=cuda>=13.0",
        "NVIDIA_DISABLE_REQUIRE=true",
    ]);
    let (out, _state) = run_shim(&host, &b, "rtreqoff");
    assert!(ContainerView::of(&out).accel_nodes().contains_key("/dev/nvidia0"));
}

#[test]
fn runtime_refuses_malicious_rootfs_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let canary = tempfile::Builder::new().prefix("xpu-canary-").tempdir().unwrap();
    std::fs::write(canary.path().join("keep"), b"canary").unwrap();
    let canary_before = snapshot(canary.path());
    let canary_s = canary.path().to_str().unwrap().to_owned();
    let cases = [
        ("/usr/lib/x86_64-linux-gnu", "/", "rtevil1"),
        ("/usr/lib/x86_64-linux-gnu", canary_s.as_str(), "rtevil2"),
        ("/dev", "/etc", "rtevil3"),
        ("/usr/bin", "../../..", "rtevil4"),
    ];
    for (at, target, test) in cases {
        let b = Bundle::busybox("true");
        b.add_env(&["NVIDIA_VISIBLE_DEVICES=all"]);
        b.plant_symlink(at, target);
        let etc_before = snapshot(&b.rootfs().join("etc"));
        let stderr = refused(&host, &b, test);
        assert!(stderr.contains(&format!("{at} in the container rootfs")), "{at}: {stderr}");
        assert!(
            stderr.contains(&format!("is a symlink to {target}, which points outside the rootfs")),
            "{stderr}"
        );
        assert_eq!(snapshot(&b.rootfs().join("etc")), etc_before);
    }
    assert_eq!(snapshot(canary.path()), canary_before, "nothing outside the rootfs changed");
    assert!(!Path::new("/libcuda.so.1").exists() && !Path::new("/libnvidia-ml.so.1").exists());
    assert!(host.log().contains("refused"), "{}", host.log());
}

#[test]
fn runtime_passes_other_subcommands_through_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let shim = shim_link(host.dir.path());
    let state = RuncState::new();
    let run = |program: &Path, args: &[&str]| {
        Command::new(program).args(args).env("XPU_RUNTIME_CONFIG", &host.config).output().unwrap()
    };
    let root = state.path().to_str().unwrap();
    // `--version` prints the shim's own version first, then runc's unchanged (as NVIDIA's runtime
    // does, so `docker info` still reads runc's).
    let via_shim = run(&shim, &["--version"]);
    let direct = run(Path::new(RUNC), &["--version"]);
    assert!(via_shim.status.success() && direct.status.success());
    assert!(via_shim.stdout.starts_with(b"xpu-container-runtime version "));
    assert!(via_shim.stdout.ends_with(&direct.stdout), "runc's own lines follow");
    for args in [&["--root", root, "list"][..], &["--root", root, "list", "--format", "json"]] {
        let via_shim = run(&shim, args);
        let direct = run(Path::new(RUNC), args);
        assert_eq!(via_shim.status.code(), direct.status.code(), "{args:?}");
        assert_eq!(via_shim.stdout, direct.stdout, "{args:?}");
    }
    // A detached create/start/delete cycle through the shim.
    let b = Bundle::busybox("sleep 10");
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=2"]);
    let id = container_id("rtcycle");
    let ok = |o: Output| assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let bundle_dir = b.dir().to_str().unwrap();
    // The created container keeps its stdio until it runs: give it files, not our pipes.
    let log = host.dir.path().join("create.out");
    let created = Command::new(&shim)
        .args(["--root", root, "create", "--bundle", bundle_dir, &id])
        .env("XPU_RUNTIME_CONFIG", &host.config)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(host.dir.path().join("create.err")).unwrap())
        .status()
        .unwrap();
    assert!(
        created.success(),
        "{}",
        std::fs::read_to_string(host.dir.path().join("create.err")).unwrap_or_default()
    );
    ok(run(&shim, &["--root", root, "start", &id]));
    let st = run(&shim, &["--root", root, "state", &id]);
    assert!(String::from_utf8_lossy(&st.stdout).contains("\"status\": \"running\""));
    ok(run(&shim, &["--root", root, "delete", "-f", &id]));
    assert!(b.config().to_string().contains("/dev/nvidia2"), "create edited the spec");
}

/// `runtime.toml` of `host` with `runtime` instead of runc and the host snapshot in `cdi`
/// (`None`: always discover).
fn config_with(host: &TestHost, runtime: &str, cdi: Option<&Path>) -> PathBuf {
    let text = std::fs::read_to_string(&host.config).unwrap();
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("runtime =") {
            out.push_str(&format!("runtime = \"{runtime}\"\n"));
        } else if line.starts_with("cdi_dirs =") {
            match cdi {
                Some(d) => out.push_str(&format!("cdi_dirs = [\"{}\"]\n", d.display())),
                None => out.push_str("cdi_dirs = []\n"),
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    let name = if cdi.is_some() { "runtime-snapshot.toml" } else { "runtime-discover.toml" };
    let path = host.dir.path().join(name);
    std::fs::write(&path, out).unwrap();
    path
}

/// `xpu cdi generate --output DIR` on the fixture: the specs and the host snapshot.
fn generate_snapshot(host: &TestHost) -> PathBuf {
    let dir = host.dir.path().join("cdi");
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(XPU)
        .args(["cdi", "generate", "--root", host.fixture.root().to_str().unwrap(), "--output"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(dir.join("xpu-host.snapshot").is_file(), "{}", String::from_utf8_lossy(&out.stdout));
    dir
}

/// The shim's `create` on a fresh bundle asking for `env`, through `config` (the real runtime
/// is `/bin/true`): the edited `config.json`, or the refusal.
fn edited(config: &Path, env: &[&str]) -> Result<serde_json::Value, String> {
    let b = Bundle::busybox("true");
    b.add_env(env);
    let shim = shim_link(config.parent().unwrap());
    let out = Command::new(shim)
        .args(["create", "--bundle"])
        .arg(b.dir())
        .arg("snapshot-check")
        .env("XPU_RUNTIME_CONFIG", config)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(b.config())
}

/// Requests of every form the shim takes, for the snapshot's equivalence with discovery.
const REQUESTS: [&[&str]; 12] = [
    &["NVIDIA_VISIBLE_DEVICES=all"],
    &["NVIDIA_VISIBLE_DEVICES=1,3"],
    &["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all"],
    &["NVIDIA_VISIBLE_DEVICES=2", "NVIDIA_DRIVER_CAPABILITIES=compat32,graphics"],
    &["NVIDIA_VISIBLE_DEVICES=none"],
    &["NVIDIA_VISIBLE_DEVICES=7"],
    &["XPU_VISIBLE_DEVICES=google.com/tpu=0,tpu:2"],
    &["XPU_VISIBLE_DEVICES=gpu:all"],
    &["XPU_VISIBLE_DEVICES=amd.com/gpu=1"],
    &["XPU_VISIBLE_DEVICES=nvidia.com/gpu=all,google.com/tpu=all"],
    &["NVIDIA_VISIBLE_DEVICES=void"],
    &["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"],
];

/// Issue 21: the shim's answer from the host snapshot `xpu cdi generate` writes is exactly its
/// answer from discovery, for every request form on every fixture host (refusals included).
#[test]
fn runtime_host_snapshot_answers_as_discovery_on_every_fixture_host_needs_root() {
    if bundle::skip_container_tests() {
        return;
    }
    // Each host on a thread of its own: some 300 shim runs, which one core takes a minute for.
    let compared: usize = std::thread::scope(|s| {
        let runs: Vec<_> = hosts::all()
            .into_iter()
            .map(|spec| {
                s.spawn(move || {
                    let host = TestHost::new(&spec);
                    let cdi = generate_snapshot(&host);
                    let discover = config_with(&host, "/bin/true", None);
                    let snapshot = config_with(&host, "/bin/true", Some(&cdi));
                    let (mut edits, mut compared) = (0, 0);
                    for env in REQUESTS {
                        let uuid = format!("NVIDIA_VISIBLE_DEVICES={}", hosts::gpu_uuid(0));
                        for env in [env.to_vec(), vec![uuid.as_str()]] {
                            let a = edited(&discover, &env);
                            let b = edited(&snapshot, &env);
                            assert_eq!(a, b, "host {} request {env:?}", spec.name);
                            edits += usize::from(a.is_ok());
                            compared += 1;
                        }
                    }
                    // The snapshot answered every request that asked for something the host has.
                    let from_snapshot = host.log().matches("(host snapshot)").count();
                    assert!(from_snapshot > 0 || edits == 0, "host {}: {}", spec.name, host.log());
                    compared
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).sum()
    });
    assert!(compared >= 150, "{compared}");
}

/// A snapshot that no longer describes the host is not used: a GPU removed (the host key
/// changes) or a device node renumbered (the key cannot see it) sends the shim back to
/// discovery, and the container gets what the host has now. A renumbered node of a device the
/// request does not select is not read.
#[test]
fn runtime_stale_host_snapshot_falls_back_to_discovery_needs_root() {
    if bundle::skip_container_tests() {
        return;
    }
    let host = TestHost::new(&hosts::a100_8x());
    let cdi = generate_snapshot(&host);
    let discover = config_with(&host, "/bin/true", None);
    let snapshot = config_with(&host, "/bin/true", Some(&cdi));
    let gpus = |cfg: &serde_json::Value| {
        cfg["linux"]["devices"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter(|n| {
                        let p = n["path"].as_str().unwrap_or("");
                        p.starts_with("/dev/nvidia") && p[11..].parse::<u32>().is_ok()
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    let all = ["NVIDIA_VISIBLE_DEVICES=all"];
    assert_eq!(gpus(&edited(&snapshot, &all).unwrap()), 8);
    assert_eq!(host.log().matches("(host snapshot)").count(), 1, "{}", host.log());

    // A node renumbered under the same key: /dev/nvidia7 now has another minor.
    let node = host.fixture.root().join("dev/nvidia7");
    std::fs::remove_file(&node).unwrap();
    let made =
        Command::new("mknod").arg(&node).args(["c", &MAJOR_NVIDIA.to_string(), "77"]).status();
    assert!(made.unwrap().success());
    let renumbered = edited(&snapshot, &all).unwrap();
    assert_eq!(host.log().matches("(host snapshot)").count(), 1, "discovery, not the snapshot");
    assert_eq!(Ok(renumbered), edited(&discover, &all));
    // The nodes checked are the selected devices' (and the control nodes): a request that does
    // not name GPU 7 does not read its node, and the snapshot still answers it, rightly.
    let some = ["NVIDIA_VISIBLE_DEVICES=1,3"];
    let answered = edited(&snapshot, &some).unwrap();
    assert_eq!(host.log().matches("(host snapshot)").count(), 2, "{}", host.log());
    assert_eq!(Ok(answered), edited(&discover, &some));

    // A GPU removed: its PCI function is gone from sysfs.
    let devices = host.fixture.root().join("sys/bus/pci/devices");
    let first = std::fs::read_dir(&devices)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_to_string(p.join("vendor")).is_ok_and(|v| v.trim() == "0x10de"))
        .min()
        .unwrap();
    std::fs::remove_file(&first).or_else(|_| std::fs::remove_dir_all(&first)).unwrap();
    let now = edited(&snapshot, &all).unwrap();
    assert_eq!(gpus(&now), 7, "the removed GPU is not given");
    assert_eq!(Ok(now), edited(&discover, &all));
    assert_eq!(host.log().matches("(host snapshot)").count(), 2, "{}", host.log());
}
