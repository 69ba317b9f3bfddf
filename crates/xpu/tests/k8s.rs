//! `xpu k8s device-plugin` and `xpu k8s nfd-features` as processes: the device plugin registers
//! with a test kubelet (same v1beta1 protobuf, same Unix sockets), serves Allocate, and cleans up
//! on SIGTERM; the NFD feature file is written atomically where NFD reads it.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use xpu_integrations::pb;
use xpu_integrations::testkubelet::TestKubelet;
use xpu_testkit::hosts;

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test]
async fn device_plugin_process_registers_allocates_and_stops_on_sigterm() {
    let fx = hosts::a100_8x().build();
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = TestKubelet::start(dir.path()).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_xpu"))
        .args(["k8s", "device-plugin", "--interval-ms", "50", "--root"])
        .arg(fx.root())
        .arg("--plugin-dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let reg = kubelet.next_registration(Duration::from_secs(20)).await.expect("registration");
    assert_eq!(reg.resource_name, "nvidia.com/gpu");
    let mut client = kubelet.plugin(&reg.endpoint).await.unwrap();
    let resp = client
        .allocate(pb::AllocateRequest {
            container_requests: vec![pb::ContainerAllocateRequest {
                devices_ids: vec!["0000:25:00.0".to_owned()],
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.container_responses[0].cdi_devices[0].name, "nvidia.com/gpu=0");

    let kill = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("nvidia.com/gpu: serving 8 device(s) on"), "{err}");
    assert!(err.contains("nvidia.com/gpu: registered with the kubelet"), "{err}");
    assert!(err.contains("google.com/tpu: no matching device on this host; not served"), "{err}");
    assert!(!dir.path().join(&reg.endpoint).exists(), "socket removed on exit");
    kubelet.stop().await;
}

#[test]
fn device_plugin_rejects_bad_selectors_and_directories() {
    let fx = hosts::a100_8x().build();
    let root = fx.root().to_str().unwrap();
    let o = xpu(&[
        "k8s",
        "device-plugin",
        "--root",
        root,
        "--resource",
        "nvidia.com/gpu=vendor:nvidia",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("vendor \"nvidia\" is not 4 hex digits"), "{}", stderr(&o));
    let o = xpu(&["k8s", "device-plugin", "--root", root, "--plugin-dir", "/nonexistent/xpu"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("plugin directory /nonexistent/xpu does not exist"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn nfd_features_file_is_written_atomically_under_the_root() {
    let fx = hosts::a100_8x().build();
    let root = fx.root().to_str().unwrap();
    // No features.d yet: an input error naming the directory.
    let o = xpu(&["k8s", "nfd-features", "--root", root]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("features.d does not exist"), "{}", stderr(&o));

    let dir = fx.root().join("etc/kubernetes/node-feature-discovery/features.d");
    std::fs::create_dir_all(&dir).unwrap();
    let o = xpu(&["k8s", "nfd-features", "--root", root, "--dry-run"]);
    assert!(o.status.success());
    let preview = String::from_utf8(o.stdout).unwrap();
    assert!(!dir.join("xpu").exists(), "--dry-run writes nothing");
    assert!(
        preview.contains("feature.node.kubernetes.io/pci-0302_10de.present=true\n"),
        "{preview}"
    );
    assert!(preview.contains("xpu.dev/gpu.count=8\n"), "{preview}");

    let o = xpu(&["k8s", "nfd-features", "--root", root]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("wrote "), "{:?}", o.stdout);
    let written = std::fs::read_to_string(dir.join("xpu")).unwrap();
    assert_eq!(written, preview);
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["xpu"], "no temporary dot-file left");
    // Every line is a comment or name=value, as NFD's local source parses it.
    for line in written.lines() {
        assert!(line.starts_with('#') || line.split_once('=').is_some(), "{line}");
    }

    let o = xpu(&["k8s", "nfd-features", "--root", root, "--output", "-", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["written"], false);
    assert_eq!(v["labels"]["xpu.dev/gpu.product"], "A100-SXM4-40GB");
    // What NVIDIA's GPU feature discovery writes for these GPUs, key for key.
    for (key, value) in [
        ("nvidia.com/gpu.present", "true"),
        ("nvidia.com/gpu.count", "8"),
        ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
        ("nvidia.com/gpu.memory", "40960"),
        ("nvidia.com/gpu.family", "ampere"),
        ("nvidia.com/gpu.compute.major", "8"),
        ("nvidia.com/gpu.compute.minor", "0"),
        ("nvidia.com/mig.capable", "true"),
        ("nvidia.com/cuda.driver.major", "535"),
        ("nvidia.com/cuda.driver.minor", "104"),
        ("nvidia.com/cuda.driver.rev", "05"),
    ] {
        assert_eq!(v["labels"][key], value, "{key}: {}", v["labels"]);
    }
}

/// On an MI300X host the labels are those AMD's node labeller writes (its documented example
/// for this part), in both its current and its legacy `beta.amd.com` form.
#[test]
fn nfd_features_write_the_amd_labellers_labels() {
    let fx = hosts::mi300x().build();
    let root = fx.root().to_str().unwrap();
    let o = xpu(&["k8s", "nfd-features", "--root", root, "--output", "-", "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let labels = &v["labels"];
    for (key, value) in [
        ("amd.com/gpu.cu-count", "304"),
        ("amd.com/gpu.device-id", "74a1"),
        ("amd.com/gpu.family", "AI"),
        ("amd.com/gpu.product-name", "AMD_Instinct_MI300X_OAM"),
        ("amd.com/gpu.simd-count", "1216"),
        ("amd.com/gpu.vram", "192G"),
        ("beta.amd.com/gpu.family.AI", "8"),
        ("beta.amd.com/gpu.vram.192G", "8"),
    ] {
        assert_eq!(labels[key], value, "{key}: {labels}");
    }
    assert!(labels.get("nvidia.com/gpu.count").is_none(), "{labels}");
}
