//! `xpu host render|apply|metadata-env` as a process: cloud-init equals the files output,
//! apply is idempotent and dry runs write nothing, and malformed input exits 2.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use xpu_testkit::fake_kernel::snapshot;
use xpu_testkit::hosts;
use xpu_testkit::readiness::{Readiness, grub_file};

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn err2(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(2), "stdout: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every file under `dir`, as (host path, content, mode).
fn tree(dir: &Path) -> Vec<(String, String, u32)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = format!("/{}", p.strip_prefix(dir).unwrap().display());
                let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
                out.push((rel, std::fs::read_to_string(&p).unwrap(), mode));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn cloud_init_is_one_document_with_the_files_output() {
    for profile in ["tpu-vm", "vfio-host", "container-host"] {
        let dir = tempfile::tempdir().unwrap();
        let files_dir = dir.path().join("files");
        let args = [
            "host",
            "render",
            "--profile",
            profile,
            "--devices",
            "10de:20b0,10de:1aef",
            "--hugepages",
            "512",
        ];
        let mut with_out = args.to_vec();
        with_out.extend(["--out", files_dir.to_str().unwrap()]);
        ok(&xpu(&with_out));
        let mut ci = args.to_vec();
        ci.extend(["--format", "cloud-init"]);
        let doc = ok(&xpu(&ci));
        assert!(doc.starts_with("#cloud-config\n"), "{doc}");
        assert_eq!(doc.matches("\n---").count(), 0, "one document");
        let v: serde_norway::Value = serde_norway::from_str(&doc).unwrap();
        let mut from_ci: Vec<(String, String, u32)> = v["write_files"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|f| {
                (
                    f["path"].as_str().unwrap().to_owned(),
                    f["content"].as_str().unwrap().to_owned(),
                    u32::from_str_radix(f["permissions"].as_str().unwrap(), 8).unwrap(),
                )
            })
            .collect();
        from_ci.sort();
        assert_eq!(from_ci, tree(&files_dir), "{profile}");
        assert!(!v["runcmd"].as_sequence().unwrap().is_empty());
    }
}

#[test]
fn apply_twice_is_a_no_op_the_second_time_and_keeps_grub_parameters() {
    let fx = hosts::tpu_v6e_8().build();
    let mut r = Readiness::bare();
    r.grub = Some(grub_file("console=ttyS0 earlyprintk=ttyS0", "quiet"));
    r.write(fx.root());
    let root = fx.root().to_str().unwrap();
    let first = ok(&xpu(&["host", "apply", "--profile", "tpu-vm", "--root", root]));
    assert!(
        first.contains("modified /etc/default/grub (backup /etc/default/grub.xpu-bak)"),
        "{first}"
    );
    assert!(first.contains("+GRUB_CMDLINE_LINUX=\"console=ttyS0 earlyprintk=ttyS0 idle=poll intel_iommu=on,sm_on transparent_hugepage=always\""), "{first}");
    assert!(first.contains("created /etc/udev/rules.d/99-xpu-vfio.rules"), "{first}");
    let before = snapshot(fx.root());
    let second = ok(&xpu(&["host", "apply", "--profile", "tpu-vm", "--root", root]));
    assert!(second.starts_with("no changes: all "), "{second}");
    assert_eq!(snapshot(fx.root()), before);

    let json =
        ok(&xpu(&["host", "apply", "--profile", "tpu-vm", "--root", root, "--format", "json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["files"].as_array().unwrap().iter().all(|f| f["action"] == "unchanged"));
}

#[test]
fn dry_run_writes_nothing() {
    let fx = hosts::a100_8x().build();
    let mut r = Readiness::bare();
    r.grub = Some(grub_file("", "quiet splash"));
    r.write(fx.root());
    let before = snapshot(fx.root());
    let out = ok(&xpu(&[
        "host",
        "apply",
        "--profile",
        "vfio-host",
        "--root",
        fx.root().to_str().unwrap(),
        "--dry-run",
    ]));
    assert!(out.contains("would create /etc/modprobe.d/xpu-vfio.conf"), "{out}");
    assert!(out.contains("would modify /etc/default/grub"), "{out}");
    assert!(out.contains("dry run: nothing written"), "{out}");
    assert_eq!(snapshot(fx.root()), before);
}

#[test]
fn metadata_env_writes_a_shell_safe_file() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("tpu-env.yaml");
    let output = dir.path().join("tpu-env");
    std::fs::write(
        &input,
        "ACCELERATOR_TYPE: 'v5p-8'\nWORKER_ID: '0'\nEVIL: '$(touch /tmp/pwned) \"q\" `x`'\n",
    )
    .unwrap();
    let out = ok(&xpu(&[
        "host",
        "metadata-env",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]));
    assert_eq!(out, format!("wrote 3 variables to {}\n", output.display()));
    let env = std::fs::read_to_string(&output).unwrap();
    // Sourcing it in a shell gives the values back literally.
    let script = format!(
        ". {}; printf '%s|%s|%s' \"$ACCELERATOR_TYPE\" \"$WORKER_ID\" \"$EVIL\"",
        output.display()
    );
    let sh = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&sh.stdout),
        "v5p-8|0|$(touch /tmp/pwned) \"q\" `x`",
        "{env}"
    );
}

#[test]
fn malformed_input_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("env");
    let cases: Vec<(&str, &str)> = vec![
        ("- a\n- b\n", "is a YAML list, not a map"),
        ("A:\n  B: 1\n", "value of A is a map; expected a flat map of scalars"),
        ("bad-key: 1\n", "key \"bad-key\" is not a shell variable name"),
        ("A: \"x\\ny\"\n", "value of A contains a newline"),
        ("A: [\n", "is not valid YAML"),
    ];
    for (yaml, want) in cases {
        let input = dir.path().join("in.yaml");
        std::fs::write(&input, yaml).unwrap();
        let e = err2(&xpu(&[
            "host",
            "metadata-env",
            "--input",
            input.to_str().unwrap(),
            "--output",
            out_file.to_str().unwrap(),
        ]));
        assert!(e.contains(want), "{yaml:?}: {e}");
        assert!(!out_file.exists(), "nothing written for {yaml:?}");
    }
    let e = err2(&xpu(&[
        "host",
        "metadata-env",
        "--input",
        "/definitely/missing.yaml",
        "--output",
        out_file.to_str().unwrap(),
    ]));
    assert!(e.contains("cannot read /definitely/missing.yaml"), "{e}");

    let e = err2(&xpu(&["host", "render", "--profile", "gpu-box"]));
    assert!(e.contains("invalid value 'gpu-box' for '--profile <PROFILE>'"), "{e}");
    let e = err2(&xpu(&["host", "render", "--profile", "all"]));
    assert!(e.contains("profile all is for xpu doctor only"), "{e}");
    let e = err2(&xpu(&["host", "render", "--profile", "vfio-host"]));
    assert!(e.contains("needs the devices to pass through; add --devices"), "{e}");
    let e =
        err2(&xpu(&["host", "render", "--profile", "vfio-host", "--devices", "10de:20b0,nvidia"]));
    assert!(
        e.contains("invalid device id \"nvidia\"; expected VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE]"),
        "{e}"
    );

    let fx = hosts::tpu_v5p().build();
    let mut r = Readiness::bare();
    r.grub = Some("GRUB_CMDLINE_LINUX=\"quiet\n splash\"\n".into());
    r.write(fx.root());
    let before = snapshot(fx.root());
    let e = err2(&xpu(&[
        "host",
        "apply",
        "--profile",
        "tpu-vm",
        "--root",
        fx.root().to_str().unwrap(),
    ]));
    assert!(e.contains("cannot parse GRUB_CMDLINE_LINUX at /etc/default/grub:1"), "{e}");
    assert_eq!(snapshot(fx.root()), before, "nothing written when the grub file cannot be merged");
}

#[test]
fn apply_refuses_links_out_of_the_root_and_writes_nothing_there() {
    // A mounted image whose /etc links to a directory of the building host.
    let fx = hosts::tpu_v5p().build();
    let mut r = Readiness::bare();
    r.grub = Some(grub_file("quiet", ""));
    r.write(fx.root());
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("etc");
    std::fs::rename(fx.root().join("etc"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, fx.root().join("etc")).unwrap();
    let before = snapshot(dir.path());
    let root = fx.root().to_str().unwrap();
    for extra in [&["--dry-run"][..], &[]] {
        let mut args = vec!["host", "apply", "--profile", "tpu-vm", "--root", root];
        args.extend(extra);
        let e = err2(&xpu(&args));
        assert!(
            e.starts_with(&format!(
                "error: {root}/etc is a symlink to {}, outside the root, and {root}{} does not exist inside the root;",
                outside.display(),
                outside.display()
            )),
            "{e}"
        );
        assert_eq!(snapshot(dir.path()), before, "{extra:?}");
    }
    // `etc -> /etc`: never the real /etc, not even in a dry run's diff.
    std::fs::remove_file(fx.root().join("etc")).unwrap();
    std::os::unix::fs::symlink("/etc", fx.root().join("etc")).unwrap();
    let out = xpu(&["host", "apply", "--profile", "tpu-vm", "--root", root, "--dry-run"]);
    let e = err2(&out);
    assert!(e.contains(&format!("{root}/etc is a symlink to /etc, outside the root")), "{e}");
    assert!(out.stdout.is_empty(), "no plan printed: {}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn apply_on_an_image_tree_without_proc_decides_the_iommu_parameter_at_boot() {
    for (profile, devices, line, boot) in [
        (
            "tpu-vm",
            None,
            "idle=poll intel_iommu=on,sm_on transparent_hugepage=always",
            "intel_iommu=on,sm_on",
        ),
        ("vfio-host", Some("10de:20b0"), "intel_iommu=on iommu=pt", "intel_iommu=on"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc/default")).unwrap();
        std::fs::write(dir.path().join("etc/default/grub"), grub_file("quiet", "")).unwrap();
        let root = dir.path().to_str().unwrap();
        let mut args = vec!["host", "apply", "--profile", profile, "--root", root];
        if let Some(d) = devices {
            args.extend(["--devices", d]);
        }
        let plan = ok(&xpu(&[&args[..], &["--dry-run"]].concat()));
        assert!(
            plan.contains(&format!(
                "note: {boot} is decided at boot: the CPU vendor is unknown under this root"
            )),
            "{profile}: {plan}"
        );
        let done = ok(&xpu(&args));
        assert!(done.contains(&format!("+GRUB_CMDLINE_LINUX=\"quiet {line}\"")), "{done}");
        let grub = std::fs::read_to_string(dir.path().join("etc/default/grub")).unwrap();
        assert!(grub.contains(&format!("GRUB_CMDLINE_LINUX=\"quiet {line}\"")), "{grub}");
        let json = ok(&xpu(&[&args[..], &["--format", "json"]].concat()));
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["decided_at_boot"], serde_json::json!([boot]), "{profile}");
    }
}

#[test]
fn metadata_env_never_writes_through_a_planted_temporary_link() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("tpu-env.yaml");
    std::fs::write(&input, "WORKER_ID: '0'\n").unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "victim\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out_dir = dir.path().join("home");
    std::fs::create_dir(&out_dir).unwrap();
    std::os::unix::fs::symlink(&victim, out_dir.join(".tpu-env.xpu-tmp")).unwrap();
    let output = out_dir.join("tpu-env");
    ok(&xpu(&[
        "host",
        "metadata-env",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]));
    assert_eq!(std::fs::read_to_string(&output).unwrap(), "WORKER_ID=\"0\"\n");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim\n");
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
    assert!(std::fs::symlink_metadata(out_dir.join(".tpu-env.xpu-tmp")).is_err());
}
