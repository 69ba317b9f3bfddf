//! The shim as the package installs it, end to end: `scripts/build-shim` builds
//! `xpu-container-runtime` linked statically with musl, and Debian's runc runs busybox containers
//! through it on the 8xA100 fixture. A container that asks for nothing reaches runc untouched;
//! one that asks for GPUs 1 and 3 gets exactly those, from the host snapshot; errors are
//! reported (with backtraces asked for too), and a runtime config naming the shim itself ends in
//! that error, not in a loop. Needs root and runc for the containers: skips them, saying why,
//! without root; fails, naming the install command, without runc or busybox.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

#[path = "shim_support/mod.rs"]
mod shim_support;

use xpu_testkit::bundle::{self, Bundle, ContainerView, RuncState, container_id, probe_script};

/// `scripts/build-shim`, once per test binary: `<target>/shim/xpu-container-runtime`.
fn built() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(shim_support::build_shim)
}

/// std linked with musl, none of glibc in it (no dynamic loader, no symbol versions, none of
/// its `cpuid` cache probing); and with backtraces asked for (`RUST_BACKTRACE`,
/// `RUST_LIB_BACKTRACE`: an error then captures one, through gcc's unwinder and the
/// `_dl_find_object` the binary provides) an error is still reported, exit status 1, rather than
/// the process aborting in the unwinder.
#[test]
fn the_shim_links_musl_and_reports_errors_with_backtraces_on() {
    let shim = built();
    let image = std::fs::read(shim).unwrap();
    assert_eq!(&image[..4], b"\x7fELF");
    for needle in [&b"/lib64/ld-linux"[..], b"GLIBC_", b"intel_check_word", b"GNU C Library"] {
        assert!(
            !image.windows(needle.len()).any(|w| w == needle),
            "{} contains {:?}",
            shim.display(),
            String::from_utf8_lossy(needle)
        );
    }
    let out = Command::new(shim).arg("--version").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("xpu-container-runtime version "), "{stdout}");

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("runtime.toml");
    std::fs::write(&cfg, "runtime = \"/nonexistent/runc\"\n").unwrap();
    for backtrace in ["0", "1", "full"] {
        let out = Command::new(shim)
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
fn runs_containers_asking_for_nothing_and_for_gpus_1_and_3_needs_root_and_runc() {
    if bundle::skip_container_tests() {
        return;
    }
    let shim = built();
    let host = shim_support::a100_host_with_snapshot();
    let cfg = host.config.to_str().unwrap();
    let env = [("XPU_RUNTIME_CONFIG", cfg)];

    // Nothing asked for: runc runs it, with the spec as it was, and nothing is logged.
    let plain = Bundle::busybox("echo plain-ok");
    let before = std::fs::read(plain.config_path()).unwrap();
    let state = RuncState::new();
    let out = state.run(shim, &[], &plain, &container_id("inst-plain"), &env);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "plain-ok");
    assert_eq!(std::fs::read(plain.config_path()).unwrap(), before, "the spec is untouched");
    assert_eq!(host.log(), "", "a container asking for nothing is not logged");

    // GPUs 1 and 3, from the snapshot.
    let b = Bundle::busybox(&probe_script("cat /usr/lib/x86_64-linux-gnu/libcuda.so.1"));
    b.add_env(&["NVIDIA_VISIBLE_DEVICES=1,3"]);
    let out = state.run(shim, &[], &b, &container_id("inst13"), &env);
    let v = ContainerView::of(&out);
    assert_eq!(v.accel_nodes(), bundle::a100_gpus_1_and_3_nodes());
    assert_eq!(v.env["XPU_DEVICES"], "nvidia.com/gpu=1,nvidia.com/gpu=3");
    assert!(v.extra.contains("fake libcuda.so.535.104.05"), "{}", v.extra);
    let log = host.log();
    assert!(log.contains("nvidia.com/gpu=1,nvidia.com/gpu=3: 5 nodes"), "{log}");
    assert!(log.contains("(host snapshot)"), "{log}");

    // runc's own answer for a command it refuses comes through unchanged.
    let out = Command::new(shim)
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
fn config_errors_are_reported_and_a_runtime_naming_the_shim_does_not_loop() {
    let shim = built();
    let dir = tempfile::tempdir().unwrap();
    let run_as = |program: &Path, cwd: &Path, config: &str| {
        let p = dir.path().join("runtime.toml");
        std::fs::write(&p, config).unwrap();
        let out = Command::new(program)
            .args(["state", "x"])
            .current_dir(cwd)
            .env("XPU_RUNTIME_CONFIG", &p)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{config}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let run = |config: &str| run_as(shim, dir.path(), config);
    let e = run("runtim = \"runc\"\n");
    assert!(e.contains("unknown field `runtim`"), "{e}");
    let named = format!("runtime = \"{}\"\n", shim.display());
    let e = run(&named);
    assert!(e.contains("is this shim itself"), "{e}");
    // Through a symlink too: the same file.
    let link = dir.path().join("runc");
    std::os::unix::fs::symlink(shim, &link).unwrap();
    let e = run(&format!("runtime = \"{}\"\n", link.display()));
    assert!(e.contains("is this shim itself"), "{e}");
    // Started through the symlink, or by a path relative to its directory: the shim knows
    // itself by the path it was started by (`AT_EXECFN`).
    let e = run_as(&link, dir.path(), &named);
    assert!(e.contains("is this shim itself"), "{e}");
    let e = run_as(Path::new("./runc"), dir.path(), &named);
    assert!(e.contains("is this shim itself"), "{e}");
}

/// runc starts in the state std's `exec` gives, whatever the engine left: SIGPIPE back to its
/// default, no signal blocked, and a standard input the caller closed reopened on /dev/null. The
/// negative control runs the same probe without the shim and sees SIGPIPE ignored and stdin
/// closed.
#[test]
fn runc_starts_with_sigpipe_default_and_standard_descriptors_open() {
    let shim = built();
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
    // SIGPIPE ignored and stdin closed by the caller, as a careless engine might leave them.
    let state = |program: &Path| {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("trap '' PIPE; exec '{}' state x <&-", program.display()))
            .env("XPU_RUNTIME_CONFIG", &config)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mask = |name: &str| {
            let line = text.lines().find(|l| l.starts_with(name)).unwrap();
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        let stdin = text.lines().last().unwrap_or_default().to_owned();
        (mask("SigBlk:"), mask("SigIgn:"), stdin)
    };
    const SIGPIPE: u64 = 1 << (13 - 1);
    let (blocked, ignored, stdin) = state(shim);
    assert_eq!(blocked, 0);
    assert_eq!(ignored & SIGPIPE, 0, "SIGPIPE is back to its default");
    assert_eq!(stdin, "/dev/null");
    let (_, ignored, stdin) = state(&probe);
    assert_ne!(ignored & SIGPIPE, 0, "the negative control: SIGPIPE ignored");
    assert_eq!(stdin, "closed");
}

/// The functions a container start runs come first in the binary, in the order of
/// `crates/xpu-shim/hot-functions.txt` (`scripts/build-shim` has LLD lay them out), and that
/// list still names the shim's own functions: after a change that renames or replaces many of
/// them, this fails until the list is written again.
#[test]
fn the_functions_a_start_runs_are_laid_out_first() {
    let shim = built();
    let comment = Command::new("readelf").args(["-p", ".comment"]).arg(shim).output().unwrap();
    assert!(
        String::from_utf8_lossy(&comment.stdout).contains("Linker: LLD"),
        "{} was not linked by LLD, which alone lays functions out: build with the Rust toolchain \
         this project names (its x86_64 Linux target links with rust-lld), or give rustc \
         `-C link-arg=-fuse-ld=lld`",
        shim.display()
    );
    let root = shim_support::repo();
    let symbols = shim_support::symbol_names(shim);
    let list = std::fs::read_to_string(root.join("crates/xpu-shim/hot-functions.txt")).unwrap();
    let listed: HashSet<&str> =
        list.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let names: HashSet<&str> = symbols.iter().map(|(_, n)| n.as_str()).collect();
    let own: Vec<&&str> = listed.iter().filter(|n| n.contains("xpu_")).collect();
    let missing: Vec<&&&str> = own.iter().filter(|n| !names.contains(***n)).collect();
    assert!(
        own.len() > 30 && missing.len() * 10 <= own.len(),
        "{} of the {} xpu functions in hot-functions.txt are not in the shim any more, e.g. {:?}: \
         write the list again with `cargo run -p xpu-shim --example hot-functions` (root, gdb)",
        missing.len(),
        own.len(),
        missing.iter().take(5).collect::<Vec<_>>()
    );

    // In address order, the first functions are the listed ones (a few others come with them:
    // aliases, and musl functions that share a section with a listed one). Laid out as the
    // linker does, a fifth of them are.
    let hot: HashSet<&str> = symbols
        .iter()
        .filter(|(_, n)| listed.contains(n.as_str()))
        .map(|(s, _)| s.as_str())
        .collect();
    let by_address = shim_support::functions(shim, "-n");
    let first = by_address.iter().take(hot.len()).filter(|(_, s)| hot.contains(s.as_str())).count();
    assert!(
        first * 10 >= hot.len() * 8,
        "only {first} of the first {} functions in {} are listed ones",
        hot.len(),
        shim.display()
    );
}
