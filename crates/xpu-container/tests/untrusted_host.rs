//! CDI generation (what `xpu cdi generate` runs: discovery, the driver files, the specs) on a
//! host tree someone else made. Issue 11: a FIFO, a link to `/dev/zero` or a sparse 3 GB file
//! where a sysfs attribute, a `/proc` file or the linker cache should be gives a warning naming
//! it, and the specs are still written, at once. Issue 15: a GPU UUID that is not a CDI device
//! name never becomes one, and the specs load with the reference crate. Device nodes need
//! numbers, so the fixtures are built with `mknod`: needs root, skipped (saying so) without.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::Path;

use container_device_interface as cdi_ref;
use xpu_container::cdi::{self, CdiKind, GenerateOptions, Generated};
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_testkit::traps::{Trap, returns};
use xpu_testkit::{BuildOptions, Fixture, hosts};

fn not_root() -> bool {
    if xpu_testkit::is_root() {
        return false;
    }
    eprintln!("skipping: the fixture's device nodes need mknod, which needs root");
    true
}

fn a100() -> Fixture {
    let f = hosts::a100_8x().build_with(&BuildOptions { char_devices: true, ..Default::default() });
    xpu_testkit::driver::install_nvidia(f.root(), "535.104.05");
    f
}

/// What `xpu cdi generate --root ROOT` computes, with every warning it prints, on a thread: the
/// test fails if it has not returned within a minute (it blocks) rather than hanging.
fn generate(root: &Path) -> (Generated, Vec<String>) {
    let root = Root::new(root).unwrap();
    returns("CDI generation", move || {
        let opts = DiscoverOptions { scope: Scope::Accelerators, pci_ids: None, skip_names: true };
        let inv = xpu_host::discover(&root, &opts).unwrap();
        let version = inv.host.nvidia_driver_version.clone();
        let files = xpu_host::driver_files::find(&root, version.as_deref());
        let opts = GenerateOptions {
            kinds: CdiKind::ALL.to_vec(),
            strict: false,
            host_root: root.base().to_path_buf(),
        };
        let g = cdi::generate(&inv, &files, &opts).unwrap();
        let mut warnings = inv.warnings;
        warnings.extend(files.warnings);
        warnings.extend(g.warnings.iter().cloned());
        (g, warnings)
    })
}

#[test]
fn cdi_generation_warns_about_fifos_device_links_and_huge_files_and_returns_needs_root() {
    if not_root() {
        return;
    }
    type Plant = fn(&Path);
    let traps: [(Plant, &str); 3] = [
        (|p| Trap::Fifo.plant(p), "is a FIFO, not a regular file"),
        (|p| Trap::DevZero.plant(p), "is a character device, not a regular file"),
        (|p| Trap::Huge.plant(p), "is too large"),
    ];
    let files = [
        "/sys/bus/pci/devices/0000:2b:00.0/numa_node",
        "/sys/bus/pci/devices/0000:48:00.0/current_link_width",
        "/proc/driver/nvidia/gpus/0000:c5:00.0/information",
        "/proc/driver/nvidia/version",
        "/etc/ld.so.cache",
    ];
    for (plant, said) in traps {
        let f = a100();
        for p in files {
            plant(&f.root().join(p.trim_start_matches('/')));
        }
        let (g, warnings) = generate(f.root());
        for p in files {
            assert!(
                warnings.iter().any(|w| w.contains(p) && w.contains(said)),
                "no warning naming {p} and saying {said:?} in {warnings:#?}"
            );
        }
        // Seven GPUs with their nodes; the one without its information file has no node.
        let spec = g.specs.iter().find(|s| s.kind == "nvidia.com/gpu").unwrap();
        let indices = spec.devices.iter().filter(|d| d.name.parse::<usize>().is_ok()).count();
        assert_eq!(indices, 7, "{said}");
    }
}

#[test]
fn gpu_uuids_that_are_not_cdi_names_are_left_out_needs_root() {
    if not_root() {
        return;
    }
    let f = a100();
    let evil = [
        ("0000:25:00.0", "GPU-x\",evil=\"1\"} 666"),
        ("0000:2b:00.0", "GPU-1 2"),
        ("0000:48:00.0", "GPU-a}b"),
    ];
    for (addr, uuid) in evil {
        let p = f.root().join(format!("proc/driver/nvidia/gpus/{addr}/information"));
        let text = std::fs::read_to_string(&p).unwrap();
        let line = text.lines().find(|l| l.starts_with("GPU UUID")).unwrap();
        std::fs::write(&p, text.replace(line, &format!("GPU UUID: \t {uuid}"))).unwrap();
    }
    let (g, warnings) = generate(f.root());
    for (addr, uuid) in evil {
        let p = format!("/proc/driver/nvidia/gpus/{addr}/information");
        assert!(
            warnings.iter().any(|w| w.contains(&p) && w.contains(&format!("{uuid:?}"))),
            "no warning naming {p} in {warnings:#?}"
        );
    }
    let spec = g.specs.iter().find(|s| s.kind == "nvidia.com/gpu").unwrap();
    let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    // Every GPU by index; by UUID the five whose UUIDs are names.
    assert_eq!(names.len(), 8 + 5 + 1, "{names:?}");
    assert!(names.iter().all(|n| cdi::is_device_name(n)), "{names:?}");
    let dir = tempfile::tempdir().unwrap();
    for json in [false, true] {
        let text = if json { cdi::to_json(spec) } else { cdi::to_yaml(spec) };
        assert!(!text.contains("evil") && !text.contains("GPU-1 2") && !text.contains("a}b"));
        let path = dir.path().join(cdi::file_name(spec, json));
        cdi::write(&path, text.as_bytes()).unwrap();
        let mut loaded = cdi_ref::spec::read_spec(&path.clone(), 0)
            .unwrap_or_else(|e| panic!("{}: {e:#}\n{text}", path.display()));
        loaded.validate().unwrap();
    }
}
