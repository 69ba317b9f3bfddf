//! `xpu cdi generate` as a process: formats, output files written atomically, exit codes, and
//! errors for hosts whose device nodes cannot be described.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::process::{Command, Output};

use serde_json::Value;
use xpu_testkit::{BuildOptions, hosts};

const XPU: &str = env!("CARGO_BIN_EXE_xpu");

fn xpu(args: &[&str]) -> Output {
    Command::new(XPU).args(args).output().unwrap()
}

fn is_root() -> bool {
    xpu_testkit::bundle::container_tests_unavailable().is_none()
}

#[test]
fn generates_nvidia_spec_as_json_and_yaml_needs_root() {
    if !is_root() {
        eprintln!("skipping: mknod of the fixture's device nodes needs root");
        return;
    }
    let f = hosts::a100_8x().build_with(&BuildOptions { char_devices: true, ..Default::default() });
    xpu_testkit::driver::install_nvidia(f.root(), "535.104.05");
    let root = f.root().to_str().unwrap();
    let out = xpu(&["cdi", "generate", "--root", root, "--vendor", "nvidia", "--format", "json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cdiVersion"], "0.5.0");
    assert_eq!(v["kind"], "nvidia.com/gpu");
    let names: Vec<&str> =
        v["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(&names[..8], ["0", "1", "2", "3", "4", "5", "6", "7"]);
    assert_eq!(names[8], hosts::gpu_uuid(0));
    assert_eq!(names.last(), Some(&"all"));
    let node = &v["devices"][3]["containerEdits"]["deviceNodes"][0];
    assert_eq!(
        (
            node["path"].as_str(),
            node["type"].as_str(),
            node["major"].as_u64(),
            node["minor"].as_u64()
        ),
        (Some("/dev/nvidia3"), Some("c"), Some(195), Some(3))
    );
    let common = &v["containerEdits"];
    let paths: Vec<&str> = common["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    for p in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"] {
        assert!(paths.contains(&p), "{p} in {paths:?}");
    }
    let mounts = common["mounts"].as_array().unwrap();
    let libcuda = mounts
        .iter()
        .find(|m| m["containerPath"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1")
        .unwrap();
    assert_eq!(
        libcuda["hostPath"],
        format!("{root}/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05")
    );
    assert_eq!(libcuda["options"], serde_json::json!(["ro", "nosuid", "nodev", "bind"]));
    assert!(mounts.iter().any(|m| m["containerPath"] == "/usr/bin/nvidia-smi"));
    assert_eq!(common["env"], serde_json::json!(["NVIDIA_VISIBLE_DEVICES=void"]));

    // YAML is the default, and says the same.
    let out = xpu(&["cdi", "generate", "--root", root, "--vendor", "nvidia"]);
    let y: Value = serde_norway::from_slice(&out.stdout).unwrap();
    assert_eq!(y, v);
}

#[test]
fn writes_into_a_cdi_directory_atomically_needs_root() {
    if !is_root() {
        eprintln!("skipping: mknod of the fixture's device nodes needs root");
        return;
    }
    let f = hosts::tpu_v5p().build_with(&BuildOptions { char_devices: true, ..Default::default() });
    let dir = tempfile::tempdir().unwrap();
    let root = f.root().to_str().unwrap();
    let cdi_dir = dir.path().to_str().unwrap();
    let dry = xpu(&["cdi", "generate", "--root", root, "--output", cdi_dir, "--dry-run"]);
    assert!(dry.status.success());
    assert!(String::from_utf8_lossy(&dry.stdout).starts_with("# would write "));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "dry run writes nothing");

    let out = xpu(&["cdi", "generate", "--root", root, "--output", cdi_dir]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut files: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["xpu-google.com-tpu.yaml", "xpu-host.snapshot"],
        "one spec and the runtime shim's host snapshot (not *.json: CDI loaders would read it), no temporary file left"
    );
    let snap: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join(&files[1])).unwrap()).unwrap();
    assert_eq!(snap["format"], 1);
    assert_eq!(snap["inventory"]["devices"].as_array().unwrap().len(), 4, "{snap}");
    let y: Value =
        serde_norway::from_slice(&std::fs::read(dir.path().join(&files[0])).unwrap()).unwrap();
    assert_eq!(y["kind"], "google.com/tpu");
    assert_eq!(y["devices"].as_array().unwrap().len(), 5, "4 chips and all");
    assert_eq!(y["containerEdits"]["deviceNodes"][0]["path"], "/dev/vfio/vfio");

    // A file path with an extension picks the format.
    let file = dir.path().join("tpu.json");
    let out = xpu(&[
        "cdi",
        "generate",
        "--root",
        root,
        "--vendor",
        "google",
        "--output",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let j: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(j["devices"][4]["name"], "all");
}

#[test]
fn errors_name_what_is_missing() {
    // Placeholder nodes (regular files): type/major/minor unknown.
    let f = hosts::a100_8x().build();
    let root = f.root().to_str().unwrap();
    let out = xpu(&["cdi", "generate", "--root", root, "--vendor", "nvidia"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("device node /dev/nvidia0 of 0000:25:00.0 is not a character or block device"),
        "{err}"
    );
    let out = xpu(&["cdi", "generate", "--root", root]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warning: nvidia.com/gpu=0 left out: device node /dev/nvidia0"), "{err}");
    assert!(err.contains("nothing to generate"), "{err}");
    let out = xpu(&["cdi", "generate", "--root", root, "--vendor", "amd"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no amd.com/gpu devices on this host"));
    let out = xpu(&["cdi", "generate", "--root", "/definitely/not/here"]);
    assert_eq!(out.status.code(), Some(2));
}
