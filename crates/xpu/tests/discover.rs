//! `xpu discover` as a process: output formats, exit codes, and agreement with `lspci -D -nnk`
//! on the real machine and on every fixture host.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use xpu_testkit::{hosts, lspci};

fn xpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xpu")).args(args).output().unwrap()
}

fn json(args: &[&str]) -> Value {
    let out = xpu(args);
    assert!(out.status.success(), "xpu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every device both list agrees on address, ids, subsystem ids, class and driver.
fn compare_with_lspci(root: Option<&Path>) -> usize {
    let listed = lspci::run(root).unwrap();
    let mut args = vec!["discover", "--all", "--format", "json"];
    let root_s;
    if let Some(r) = root {
        root_s = r.display().to_string();
        args.extend(["--root", &root_s]);
    }
    let inv = json(&args);
    let devices = inv["devices"].as_array().unwrap();
    let mut compared = 0;
    for d in devices {
        let addr = d["address"].as_str().unwrap();
        let Some(l) = listed.get(addr) else { continue };
        let ctx = format!("{addr} (root {root:?})");
        assert_eq!(d["vendor_id"], l.vendor.as_str(), "{ctx}: vendor");
        assert_eq!(d["device_id"], l.device.as_str(), "{ctx}: device");
        assert_eq!(d["class"], l.class.as_str(), "{ctx}: class");
        match &l.subsystem {
            Some((sv, sd)) => {
                assert_eq!(d["subsystem_vendor_id"], sv.as_str(), "{ctx}: subsystem vendor");
                assert_eq!(d["subsystem_device_id"], sd.as_str(), "{ctx}: subsystem device");
            }
            // lspci omits the line when the ids are zero (or the header has none).
            None => assert!(
                matches!(d["subsystem_vendor_id"].as_str(), None | Some("0000") | Some("ffff")),
                "{ctx}: lspci shows no subsystem but xpu has {}",
                d["subsystem_vendor_id"]
            ),
        }
        assert_eq!(d["driver"].as_str(), l.driver.as_deref(), "{ctx}: driver");
        if let Some(rev) = &l.revision {
            assert_eq!(d["revision"], rev.as_str(), "{ctx}: revision");
        }
        compared += 1;
    }
    assert_eq!(compared, listed.len(), "xpu --all lists every device lspci lists");
    assert_eq!(compared, devices.len(), "lspci lists every device xpu lists");
    compared
}

#[test]
fn agrees_with_lspci_on_this_machine() {
    if !lspci::available() {
        eprintln!(
            "skipping agrees_with_lspci_on_this_machine: lspci is not installed (the README's test command installs pciutils)"
        );
        return;
    }
    let n = compare_with_lspci(None);
    eprintln!("compared {n} devices with lspci on this machine");
}

#[test]
fn agrees_with_lspci_on_every_fixture() {
    if !lspci::available() {
        eprintln!(
            "skipping agrees_with_lspci_on_every_fixture: lspci is not installed (the README's test command installs pciutils)"
        );
        return;
    }
    for spec in hosts::all() {
        let f = spec.build();
        let n = compare_with_lspci(Some(f.root()));
        assert_eq!(n, spec.devices.len(), "{}", spec.name);
    }
}

#[test]
fn json_shape_is_the_documented_one() {
    let f = hosts::a100_8x().build();
    let inv = json(&["discover", "--root", f.root().to_str().unwrap(), "--format", "json"]);
    let keys = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&inv), ["devices", "host", "warnings"]);
    let d = &inv["devices"][0];
    let mut want = vec![
        "address",
        "vendor_id",
        "device_id",
        "subsystem_vendor_id",
        "subsystem_device_id",
        "class",
        "prog_if",
        "revision",
        "class_name",
        "vendor_name",
        "device_name",
        "kind",
        "product",
        "generation",
        "driver",
        "kernel_modules",
        "iommu_group",
        "numa_node",
        "sriov",
        "link",
        "uuid",
        "interconnect_domain",
        "dev_nodes",
    ];
    want.sort();
    assert_eq!(keys(d), want);
    assert_eq!(keys(&d["sriov"]), ["num_vfs", "physfn", "total_vfs", "type"]);
    assert_eq!(keys(&d["link"]), ["max_speed", "max_width", "speed", "width"]);
    assert_eq!(keys(&d["dev_nodes"][0]), ["gid", "major", "minor", "mode", "path", "type", "uid"]);
    assert_eq!(
        keys(&inv["host"]),
        [
            "control_nodes",
            "cpu_vendor",
            "hostname",
            "iommu_groups",
            "kernel_release",
            "nvidia_driver_version"
        ]
    );
    assert_eq!(d["address"], "0000:25:00.0");
    assert_eq!(d["iommu_group"], 47);
    assert_eq!(d["kind"], "gpu");
    assert_eq!(inv["devices"].as_array().unwrap().len(), 14);
}

#[test]
fn labels_format() {
    let f = hosts::a100_8x().build();
    let out = xpu(&["discover", "--root", f.root().to_str().unwrap(), "--format", "labels"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for want in [
        "feature.node.kubernetes.io/pci-0300_1a03.present=true",
        "feature.node.kubernetes.io/pci-0302_10de.present=true",
        "xpu.dev/gpu.count=8",
        "xpu.dev/gpu.generation=ampere",
        "xpu.dev/gpu.product=A100-SXM4-40GB",
        "xpu.dev/nvswitch.count=6",
    ] {
        assert!(lines.contains(&want), "{want} not in\n{text}");
    }
    assert!(!text.contains("pci-0680"), "NVSwitch class is not in NFD's default whitelist");
}

#[test]
fn table_format_summarises() {
    let f = hosts::tpu_v5p().build();
    let out = xpu(&["discover", "--root", f.root().to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("ADDRESS"), "{text}");
    assert!(text.contains("0000:00:04.0  tpu   1ae0:0062  TPU-v5p"), "{text}");
    assert!(text.contains("4 tpu"), "{text}");
}

#[test]
fn missing_root_is_a_usage_error() {
    let out = xpu(&["discover", "--root", "/no/such/root"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/no/such/root does not exist; pass an existing directory to --root"),
        "{err}"
    );
    let out = xpu(&["discover", "--format", "yaml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn garbage_does_not_abort_the_listing() {
    let f = hosts::gpu_with_audio().build();
    std::fs::write(f.device_dir("0000:01:00.0").join("device"), "garbage").unwrap();
    let out = xpu(&["discover", "--root", f.root().to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success());
    let inv: Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpu =
        inv["devices"].as_array().unwrap().iter().find(|d| d["address"] == "0000:01:00.0").unwrap();
    assert_eq!(gpu["device_id"], Value::Null);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning: /sys/bus/pci/devices/0000:01:00.0/device: not a hex value"),
        "{err}"
    );
}

/// `--mig`: each GPU's MIG mode and instances (a fake NVML's here), with the capability nodes
/// of each instance from the host's `mig-minors`, in JSON and in the table.
#[test]
fn mig_lists_modes_instances_and_their_capability_nodes() {
    let fx = hosts::h200_4x()
        .build_with(&xpu_testkit::BuildOptions { char_devices: true, ..Default::default() });
    let state = fx.root().join("mig-state.json");
    std::fs::write(
        &state,
        r#"{"gpus": [
            {"address": "0000:25:00.0", "product": "NVIDIA H200", "enabled": true, "instances": [
                {"gi": 2, "profile": "3g.71gb", "start": 4, "byXpu": true},
                {"gi": 7, "profile": "1g.18gb", "start": 0, "byXpu": false}]},
            {"address": "0000:2b:00.0", "product": "NVIDIA H200", "enabled": false}]}"#,
    )
    .unwrap();
    let root = fx.root().display().to_string();
    let state_s = state.display().to_string();
    let args = ["discover", "--root", &root, "--mig", "--fake-mig", &state_s];
    let mut json_args = args.to_vec();
    json_args.extend(["--format", "json"]);
    let v = json(&json_args);
    let mig = v["mig"].as_array().unwrap();
    assert_eq!(mig.len(), 2, "{mig:?}");
    assert_eq!(mig[0]["migMode"], "enabled");
    assert_eq!(mig[1]["migMode"], "disabled");
    let big = &mig[0]["instances"][0];
    assert_eq!((big["profile"].as_str(), big["gpuInstance"].as_u64()), (Some("3g.71gb"), Some(2)));
    assert_eq!(big["byXpu"], true);
    let caps = big["capabilityNodes"].as_array().unwrap();
    assert_eq!(caps.len(), 2, "the GPU instance's and the compute instance's access: {big}");
    assert!(caps.iter().all(|c| c.as_str().unwrap().starts_with("/dev/nvidia-caps/nvidia-cap")));
    assert!(v["devices"].as_array().is_some(), "the inventory is still there");

    let out = xpu(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("PROFILE") && text.contains("3g.71gb") && text.contains("2/0"), "{text}");
    // A state file that is not one is an error naming it.
    std::fs::write(&state, "{").unwrap();
    let out = xpu(&args);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("mig-state.json"));
}

/// An MI300X host in CPX/NPS1: each GPU's partitioning in JSON (`partitioning`) and the table.
#[test]
fn amd_partitions_are_listed() {
    let fx = hosts::mi300x_cpx()
        .build_with(&xpu_testkit::BuildOptions { char_devices: true, ..Default::default() });
    let root = fx.root().display().to_string();
    let v = json(&["discover", "--root", &root, "--format", "json"]);
    let gpu = v["devices"].as_array().unwrap().iter().find(|d| d["kind"] == "gpu").unwrap();
    let p = &gpu["partitioning"];
    assert_eq!((p["compute"].as_str(), p["memory"].as_str()), (Some("CPX"), Some("NPS1")));
    assert_eq!(p["partitions"].as_array().unwrap().len(), 8, "{p}");
    assert_eq!(p["partitions"][1]["render_node"]["path"], "/dev/dri/renderD129");
    let out = xpu(&["discover", "--root", &root]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("CPX/NPS1, 8 partition(s): renderD128,renderD129"), "{text}");
}

/// `xpu exporter --once --mig`: each MIG instance under DCGM's instance labels, with its
/// memory by the profile (NVML's size for an H200).
#[test]
fn the_exporter_lists_mig_instances_with_dcgm_labels() {
    let fx = hosts::h200_4x()
        .build_with(&xpu_testkit::BuildOptions { char_devices: true, ..Default::default() });
    let state = fx.root().join("mig-state.json");
    std::fs::write(
        &state,
        r#"{"gpus": [{"address": "0000:25:00.0", "product": "NVIDIA H200", "enabled": true,
            "instances": [{"gi": 2, "profile": "3g.71gb", "start": 4, "byXpu": true}]}]}"#,
    )
    .unwrap();
    let root = fx.root().display().to_string();
    let state_s = state.display().to_string();
    let out = xpu(&["exporter", "--root", &root, "--once", "--mig", "--fake-mig", &state_s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |name: &str| {
        text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name}\n{text}"))
    };
    let info = line("xpu_mig_instance_info{");
    for want in [
        "gpu=\"0\"",
        "pci_bus_id=\"00000000:25:00.0\"",
        "GPU_I_ID=\"2\"",
        "GPU_I_PROFILE=\"3g.71gb\"",
        "start=\"4\"",
        "made_by=\"xpu\"",
    ] {
        assert!(info.contains(want), "{want}: {info}");
    }
    assert!(info.ends_with(" 1"), "{info}");
    let memory = line("xpu_mig_instance_memory_bytes{");
    assert!(memory.ends_with(&format!(" {}", 71_424u64 << 20)), "{memory}");
}
