//! The generated CDI specs against the reference: they load and validate with the
//! `container-device-interface` crate from crates.io (schema, name rules, minimum cdiVersion),
//! and a container started with Debian's runc from an OCI spec edited by that crate sees the
//! devices (needs root and runc; skipped with the reason printed where they are absent).

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};

use container_device_interface as cdi_ref;
use xpu_container::cdi::{self, CdiKind, GenerateOptions};
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_testkit::bundle::{
    self, Bundle, ContainerView, RUNC, RuncState, container_id, probe_script,
};
use xpu_testkit::sysfs::{MAJOR_NVIDIA, MAJOR_NVIDIA_UVM};
use xpu_testkit::{BuildOptions, HostSpec, hosts};

fn generate(root: &Path) -> Vec<cdi::Spec> {
    let root = Root::new(root).unwrap();
    let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
    let inv = xpu_host::discover(&root, &opts).unwrap();
    let files = xpu_host::driver_files::find(&root, inv.host.nvidia_driver_version.as_deref());
    let opts = GenerateOptions {
        kinds: CdiKind::ALL.to_vec(),
        strict: false,
        host_root: root.base().to_path_buf(),
    };
    cdi::generate(&inv, &files, &opts).unwrap().specs
}

fn fixture(spec: &HostSpec, char_devices: bool) -> xpu_testkit::Fixture {
    let f = spec.build_with(&BuildOptions { char_devices, ..Default::default() });
    if let Some(v) = &spec.nvidia_driver {
        xpu_testkit::driver::install_nvidia(f.root(), v);
    }
    f
}

/// Writes the spec in both formats and loads each with the reference crate.
fn load_with_reference(spec: &cdi::Spec, dir: &Path) -> Vec<cdi_ref::spec::Spec> {
    let mut loaded = Vec::new();
    for json in [false, true] {
        let path = dir.join(cdi::file_name(spec, json));
        let text = if json { cdi::to_json(spec) } else { cdi::to_yaml(spec) };
        cdi::write(&path, text.as_bytes()).unwrap();
        let s = cdi_ref::spec::read_spec(&PathBuf::from(&path), 0)
            .unwrap_or_else(|e| panic!("{}: {e:#}\n{text}", path.display()));
        loaded.push(s);
    }
    loaded
}

#[test]
fn generated_specs_load_and_validate_with_the_reference_crate() {
    let dir = tempfile::tempdir().unwrap();
    // Device nodes need numbers: the fixtures' placeholders would be left out, so only hosts
    // whose nodes are real can be checked without root; the rest run when root is available.
    let root = bundle::container_tests_unavailable().is_none();
    if !root {
        eprintln!("skipping the fixtures with device nodes: not root (mknod needs it)");
        return;
    }
    let mut kinds = Vec::new();
    for host in
        [hosts::a100_8x(), hosts::a100_8x_vfio(), hosts::tpu_v5p(), hosts::mi300x(), hosts::sriov()]
    {
        let f = fixture(&host, true);
        for spec in generate(f.root()) {
            assert_eq!(spec.cdi_version, "0.5.0");
            for mut s in load_with_reference(&spec, dir.path()) {
                assert_eq!(s.get_vendor() + "/" + &s.get_class(), spec.kind);
                let names: Vec<String> = s.get_devices().keys().cloned().collect();
                assert!(names.contains(&"0".to_owned()) && names.contains(&"all".to_owned()));
                s.validate().unwrap();
            }
            kinds.push(format!("{}:{}", host.name, spec.kind));
        }
    }
    for want in ["a100-8x:nvidia.com/gpu", "tpu-v5p:google.com/tpu", "mi300x:amd.com/gpu"] {
        assert!(kinds.iter().any(|k| k == want), "{want} in {kinds:?}");
    }
    // The reference crate and xpu agree on the names (`device_names` is what the plugin uses).
    let f = fixture(&hosts::a100_8x(), true);
    let spec = generate(f.root()).remove(0);
    let loaded = load_with_reference(&spec, dir.path()).remove(0);
    let root = Root::new(f.root()).unwrap();
    let inv = xpu_host::discover(&root, &DiscoverOptions::default()).unwrap();
    let mut ours: Vec<String> = cdi::device_names(&inv).iter().map(|d| d.name.clone()).collect();
    ours.sort();
    let theirs: Vec<String> = loaded.get_devices().keys().cloned().collect();
    assert_eq!(ours, theirs);
    assert_eq!(ours.len(), 8 + 8 + 1);
}

#[test]
fn container_from_a_spec_edited_by_the_reference_crate_sees_the_devices_needs_root_and_runc() {
    if let Some(why) = bundle::container_tests_unavailable() {
        eprintln!("skipping: {why}");
        return;
    }
    let f = fixture(&hosts::a100_8x(), true);
    let spec = generate(f.root()).remove(0);
    let dir = tempfile::tempdir().unwrap();
    let mut loaded = load_with_reference(&spec, dir.path()).remove(0);

    let b = Bundle::busybox(&probe_script("cat /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"));
    let mut oci = oci_spec::runtime::Spec::load(b.config_path()).unwrap();
    let mut dev = loaded.get_device("2").unwrap().clone();
    dev.apply_edits(&mut oci).unwrap();
    loaded.apply_edits(&mut oci).unwrap();
    oci.save(b.config_path()).unwrap();

    let state = RuncState::new();
    let out = state.run(Path::new(RUNC), &[], &b, &container_id("cdiref"), &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = ContainerView::parse(&String::from_utf8_lossy(&out.stdout));
    let nodes = v.accel_nodes();
    assert_eq!(nodes.get("/dev/nvidia2"), Some(&('c', MAJOR_NVIDIA, 2)));
    assert_eq!(nodes.get("/dev/nvidiactl"), Some(&('c', MAJOR_NVIDIA, 255)));
    assert_eq!(nodes.get("/dev/nvidia-uvm"), Some(&('c', MAJOR_NVIDIA_UVM, 0)));
    assert!(!nodes.contains_key("/dev/nvidia0") && !nodes.contains_key("/dev/nvidia1"));
    assert_eq!(v.env["NVIDIA_VISIBLE_DEVICES"], "void");
    assert!(v.extra.contains("fake libnvidia-ml.so.535.104.05"), "{}", v.extra);
}
