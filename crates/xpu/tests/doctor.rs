//! `xpu doctor` as a process: agreement with `virt-host-validate` on this real machine, the
//! table layout, JSON shape and exit codes on fixture hosts.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::process::{Command, Output};

use serde_json::Value;
use xpu_testkit::hosts;
use xpu_testkit::readiness::Readiness;

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

/// `  QEMU: Checking for hardware virtualization      : FAIL (hint)` → (title, status) pairs.
fn parse_vhv(text: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((area, rest)) = line.trim_start().split_once(": Checking ") else { continue };
        for status in ["PASS", "WARN", "FAIL"] {
            let marker = format!(": {status}");
            if let Some(i) = rest.find(&marker) {
                let after = &rest[i + marker.len()..];
                if after.is_empty() || after.starts_with(" (") {
                    out.push((area.to_owned(), rest[..i].trim_end().to_owned(), status.to_owned()));
                    break;
                }
            }
        }
    }
    out
}

#[test]
fn agrees_with_virt_host_validate_on_this_machine() {
    let vhv = match Command::new("virt-host-validate").output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!(
                "skipping agrees_with_virt_host_validate_on_this_machine: virt-host-validate cannot run ({e}); the README's test command installs libvirt-clients"
            );
            return;
        }
    };
    let theirs = parse_vhv(&String::from_utf8_lossy(&vhv.stdout));
    assert!(
        !theirs.is_empty(),
        "no checks parsed from virt-host-validate:\n{}",
        String::from_utf8_lossy(&vhv.stdout)
    );

    let out = xpu(&["doctor", "--format", "json"]);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ours: BTreeMap<String, String> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (c["check"].as_str().unwrap().to_owned(), c["status"].as_str().unwrap().to_uppercase())
        })
        .collect();

    // The same title may appear under QEMU and LXC with different levels for a missing
    // controller; xpu must agree with one of them, and on a PASS with both.
    let mut by_title: BTreeMap<&str, Vec<(&str, &str)>> = BTreeMap::new();
    for (area, title, status) in &theirs {
        by_title.entry(title).or_default().push((area, status));
    }
    let mut compared = Vec::new();
    for (title, verdicts) in &by_title {
        let Some(mine) = ours.get(*title) else { continue };
        assert!(
            verdicts.iter().any(|(_, s)| s == mine),
            "{title}: xpu says {mine}, virt-host-validate says {verdicts:?}"
        );
        compared.push(format!("{title}: {mine}"));
    }
    eprintln!(
        "agreed with virt-host-validate on {} checks:\n  {}",
        compared.len(),
        compared.join("\n  ")
    );
    // The checks the issue names must all have been compared (virt-host-validate checks
    // /dev/kvm only on hosts with hardware virtualization, so it is compared only there).
    let mut required = vec![
        "for hardware virtualization".to_owned(),
        "if device /dev/vhost-net exists".to_owned(),
        "if device /dev/net/tun exists".to_owned(),
        "for device assignment IOMMU support".to_owned(),
    ];
    for c in ["cpu", "cpuacct", "cpuset", "memory", "devices", "blkio"] {
        required.push(format!("for cgroup '{c}' controller support"));
    }
    if by_title.contains_key("if device /dev/kvm exists") {
        required.push("if device /dev/kvm exists".to_owned());
    }
    for r in &required {
        assert!(by_title.contains_key(r.as_str()), "virt-host-validate did not make {r:?}");
        assert!(ours.contains_key(r), "xpu doctor did not make {r:?}");
    }
}

#[test]
fn table_mirrors_virt_host_validate_layout() {
    let fx = hosts::gpu_with_audio().build();
    Readiness::ready_vfio_host().write(fx.root());
    let out = xpu(&["doctor", "--root", fx.root().to_str().unwrap(), "--profile", "vfio-host"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "   KVM: Checking for hardware virtualization                                 : PASS"
    );
    // Every check line has the status column at the same place, as virt-host-validate does.
    for l in lines.iter().filter(|l| l.contains(": Checking ")) {
        assert_eq!(&l[6..17], ": Checking ", "{l}");
        let status = &l[77..83];
        assert!(matches!(status, ": PASS" | ": WARN" | ": FAIL"), "{l}");
    }
    let group = lines.iter().find(|l| l.contains("0000:01:00.0 IOMMU group 1 is viable")).unwrap();
    assert!(
        group.ends_with(": FAIL (group 1 also holds 0000:01:00.1 (snd_hda_intel); fix: xpu vfio bind 0000:01:00.0 --group)"),
        "{group}"
    );
    assert!(text.ends_with("FAIL\n"), "summary last: {text}");
}

#[test]
fn exit_codes_and_json_shape() {
    let fx = hosts::a100_8x_vfio().build();
    Readiness::ready_vfio_host().write(fx.root());
    let root = fx.root().to_str().unwrap();
    let out = xpu(&["doctor", "--root", root, "--profile", "vfio-host", "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["profile"], "vfio-host");
    assert_eq!(v["summary"]["fail"], 0);
    let c = &v["checks"][0];
    for key in ["id", "area", "check", "status", "detail", "fix"] {
        assert!(c.get(key).is_some(), "missing {key} in {c}");
    }

    let bare = hosts::a100_8x().build();
    Readiness::bare().write(bare.root());
    let out = xpu(&["doctor", "--root", bare.root().to_str().unwrap(), "--profile", "vfio-host"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let out = xpu(&["doctor", "--profile", "gpu-host"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid value 'gpu-host' for '--profile <PROFILE>'"), "{err}");
    assert!(err.contains("vfio-host, tpu-vm, container-host, all"), "{err}");

    let fx = hosts::a100_8x_vfio().build();
    Readiness::ready_vfio_host().write(fx.root());
    std::fs::remove_file(fx.root().join("etc/security/limits.conf")).unwrap();
    std::fs::create_dir(fx.root().join("etc/security/limits.conf")).unwrap();
    let out = xpu(&["doctor", "--root", fx.root().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: cannot read /etc/security/limits.conf: "), "{err}");

    let out = xpu(&["doctor", "--root", "/definitely/not/here"]);
    assert_eq!(out.status.code(), Some(2));
}
