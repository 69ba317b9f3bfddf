//! `host apply` on fixture roots (idempotent, grub merged in place, backups, dry run) and
//! `host render` as files and as cloud-init.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;

use serde_norway::Value;
use xpu_core::Inventory;
use xpu_host::profile::{CpuVendor, Profile};
use xpu_host::provision::{self, ApplyOptions, ProvisionError, RenderOptions};
use xpu_host::{DiscoverOptions, Root, Scope};
use xpu_testkit::fake_kernel::snapshot;
use xpu_testkit::readiness::{Readiness, grub_file};
use xpu_testkit::{Fixture, HostSpec, hosts};

fn build(spec: &HostSpec, grub: Option<String>) -> (Fixture, Root, Inventory) {
    let fx = spec.build();
    let mut r = Readiness::bare();
    r.grub = grub;
    r.write(fx.root());
    let root = Root::new(fx.root()).unwrap();
    let inv = xpu_host::discover(
        &root,
        &DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true },
    )
    .unwrap();
    (fx, root, inv)
}

fn opts(profile: Profile) -> ApplyOptions {
    ApplyOptions { profile, devices: Vec::new(), cpu_vendor: None, hugepages: None, dry_run: false }
}

fn read(fx: &Fixture, p: &str) -> String {
    std::fs::read_to_string(fx.root().join(p.trim_start_matches('/'))).unwrap()
}

#[test]
fn apply_twice_changes_nothing_the_second_time() {
    let grub = grub_file("console=ttyS0,115200 net.ifnames=0", "quiet splash");
    let (fx, root, inv) = build(&hosts::tpu_v5p(), Some(grub.clone()));
    let first = provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    assert!(first.changed());
    let g = first.files.iter().find(|f| f.path == "/etc/default/grub").unwrap();
    assert_eq!(g.action, "modified");
    assert_eq!(g.backup.as_deref(), Some("/etc/default/grub.xpu-bak"));
    assert!(
        g.diff.contains("-GRUB_CMDLINE_LINUX=\"console=ttyS0,115200 net.ifnames=0\""),
        "{}",
        g.diff
    );
    assert!(
        g.diff.contains("+GRUB_CMDLINE_LINUX=\"console=ttyS0,115200 net.ifnames=0 idle=poll intel_iommu=on,sm_on transparent_hugepage=always\""),
        "{}",
        g.diff
    );
    // The existing line's other parameters are kept, in order; the rest of the file too.
    let new_grub = read(&fx, "/etc/default/grub");
    assert_eq!(
        new_grub,
        grub.replace(
            "net.ifnames=0\"",
            "net.ifnames=0 idle=poll intel_iommu=on,sm_on transparent_hugepage=always\""
        )
    );
    assert_eq!(read(&fx, "/etc/default/grub.xpu-bak"), grub);
    // The seed's TPU ids are in the udev rule (the fixture's chips are v5p).
    assert!(read(&fx, provision::UDEV_RULES).contains("ATTR{device}==\"0x0062\", ATTR{subsystem_vendor}==\"0x1ae0\", ATTR{subsystem_device}==\"0x00ad\""));
    let mode = std::fs::metadata(fx.root().join("lib/udev/xpu-bind-vfio-pci.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);

    let before = snapshot(fx.root());
    let second = provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    assert!(!second.changed(), "{second:#?}");
    assert!(
        second
            .files
            .iter()
            .all(|f| f.action == "unchanged" && f.diff.is_empty() && f.backup.is_none())
    );
    assert_eq!(snapshot(fx.root()), before, "the second run wrote nothing, not even a backup");
}

#[test]
fn dry_run_writes_nothing_and_shows_the_diff() {
    let (fx, root, inv) = build(&hosts::a100_8x(), Some(grub_file("", "quiet")));
    let before = snapshot(fx.root());
    let r =
        provision::apply(&root, &inv, &ApplyOptions { dry_run: true, ..opts(Profile::VfioHost) })
            .unwrap();
    assert!(r.dry_run && r.changed());
    assert_eq!(snapshot(fx.root()), before);
    let m = r.files.iter().find(|f| f.path == provision::MODPROBE_VFIO).unwrap();
    assert_eq!(m.action, "created");
    // Every accelerator of the host (GPUs and NVSwitches) by id, softdeps from modules.alias.
    assert!(m.diff.contains("+options vfio-pci ids=10de:1af1,10de:20b0"), "{}", m.diff);
    assert!(m.diff.contains("+softdep nvidia_drm pre: vfio-pci"), "{}", m.diff);
    let g = r.files.iter().find(|f| f.path == "/etc/default/grub").unwrap();
    assert!(g.diff.contains("+GRUB_CMDLINE_LINUX=\"intel_iommu=on iommu=pt\""), "{}", g.diff);
    assert!(r.commands.iter().any(|c| c.contains("update-grub")));
}

#[test]
fn conflicting_and_partial_parameters_are_fixed_in_place() {
    let (fx, root, inv) = build(
        &hosts::tpu_v5p(),
        Some(grub_file("intel_iommu=on console=ttyS0", "quiet transparent_hugepage=madvise")),
    );
    provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    let g = read(&fx, "/etc/default/grub");
    assert!(
        g.contains("GRUB_CMDLINE_LINUX=\"intel_iommu=on,sm_on console=ttyS0 idle=poll\""),
        "{g}"
    );
    assert!(g.contains("GRUB_CMDLINE_LINUX_DEFAULT=\"quiet transparent_hugepage=always\""), "{g}");
    assert_eq!(g.matches("intel_iommu").count(), 1);
}

#[test]
fn amd_hosts_get_the_amd_variant_and_unknown_vendors_must_say() {
    let (fx, root, inv) = build(&hosts::mi300x(), None);
    let r = provision::apply(&root, &inv, &opts(Profile::VfioHost)).unwrap();
    assert_eq!(r.kernel_params, ["iommu=pt"]);
    let g = read(&fx, "/etc/default/grub");
    assert_eq!(g, "GRUB_CMDLINE_LINUX=\"iommu=pt\"\n", "created when missing");
    assert!(read(&fx, provision::MODPROBE_VFIO).contains("softdep amdgpu pre: vfio-pci"));

    let mut spec = hosts::a100_8x();
    spec.cpu_vendor = "SomeNewVendor".into();
    let (_fx, root, inv) = build(&spec, None);
    let e = provision::apply(&root, &inv, &opts(Profile::VfioHost)).unwrap_err();
    assert!(matches!(e, ProvisionError::UnknownCpuVendor), "{e}");
    let r = provision::apply(
        &root,
        &inv,
        &ApplyOptions { cpu_vendor: Some(CpuVendor::Intel), ..opts(Profile::VfioHost) },
    )
    .unwrap();
    assert_eq!(r.kernel_params, ["intel_iommu=on", "iommu=pt"]);
}

#[test]
fn each_change_keeps_the_first_original_as_backup() {
    let (fx, root, inv) = build(&hosts::tpu_v5p(), Some(grub_file("a", "")));
    provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    // Someone edits the grub line again; the next apply fixes it and keeps both backups.
    let edited = read(&fx, "/etc/default/grub").replace(" idle=poll", "");
    std::fs::write(fx.root().join("etc/default/grub"), &edited).unwrap();
    let r = provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    let g = r.files.iter().find(|f| f.path == "/etc/default/grub").unwrap();
    assert_eq!(g.backup.as_deref(), Some("/etc/default/grub.xpu-bak.1"));
    assert_eq!(read(&fx, "/etc/default/grub.xpu-bak"), grub_file("a", ""));
    assert_eq!(read(&fx, "/etc/default/grub.xpu-bak.1"), edited);
}

#[test]
fn cloud_init_carries_the_same_files_and_commands() {
    for profile in [Profile::TpuVm, Profile::VfioHost, Profile::ContainerHost] {
        let mut o = RenderOptions::new(profile);
        o.devices = vec!["10de:2330".parse().unwrap(), "10de:22a3".parse().unwrap()];
        o.hugepages = Some(2048);
        let rendered = provision::render(&o).unwrap();
        let dir = tempfile::tempdir().unwrap();
        provision::write_tree(&rendered, dir.path()).unwrap();

        let doc = provision::cloud_init(&rendered).unwrap();
        assert!(doc.starts_with("#cloud-config\n"));
        let v: Value = serde_norway::from_str(&doc).unwrap();
        let files = v["write_files"].as_sequence().unwrap();
        assert_eq!(files.len(), rendered.files.len());
        for f in files {
            let path = f["path"].as_str().unwrap();
            let on_disk =
                std::fs::read_to_string(dir.path().join(path.trim_start_matches('/'))).unwrap();
            assert_eq!(f["content"].as_str().unwrap(), on_disk, "{profile}: {path}");
            let mode = std::fs::metadata(dir.path().join(path.trim_start_matches('/')))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777;
            assert_eq!(f["permissions"].as_str().unwrap(), format!("{mode:04o}"), "{path}");
            assert_eq!(f["owner"].as_str().unwrap(), "root:root");
        }
        let runcmd: Vec<&str> =
            v["runcmd"].as_sequence().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
        assert_eq!(runcmd, rendered.commands);
        assert!(runcmd.contains(&"sysctl --system"));
    }
}

#[test]
fn the_grub_dropin_appends_once_and_picks_the_vendor_at_update_grub_time() {
    let rendered = provision::render(&RenderOptions::new(Profile::TpuVm)).unwrap();
    let dropin = &rendered.file(provision::GRUB_DROPIN).unwrap().content;
    // Run the drop-in the way update-grub sources it, twice, with a line that already has one
    // of the parameters.
    let script = format!(
        "GRUB_CMDLINE_LINUX='console=ttyS0 idle=poll'\nGRUB_CMDLINE_LINUX_DEFAULT='quiet'\n{dropin}\n{dropin}\necho \"$GRUB_CMDLINE_LINUX|$GRUB_CMDLINE_LINUX_DEFAULT\"\n"
    );
    let out = std::process::Command::new("sh").arg("-c").arg(&script).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = String::from_utf8(out.stdout).unwrap();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let expected = if cpuinfo.contains("AuthenticAMD") {
        "console=ttyS0 idle=poll|quiet transparent_hugepage=always\n"
    } else {
        "console=ttyS0 idle=poll|quiet intel_iommu=on,sm_on transparent_hugepage=always\n"
    };
    assert_eq!(line, expected);
}

#[test]
fn the_bind_script_is_valid_shell_and_rejects_bad_addresses() {
    for p in [Profile::VfioHost, Profile::TpuVm] {
        let mut o = RenderOptions::new(p);
        o.devices = vec!["1ae0:0062".parse().unwrap()];
        let r = provision::render(&o).unwrap();
        let script = &r.file(provision::BIND_SCRIPT).unwrap().content;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bind.sh");
        std::fs::write(&path, script).unwrap();
        let check = std::process::Command::new("sh").arg("-n").arg(&path).output().unwrap();
        assert!(check.status.success(), "{p}: {}", String::from_utf8_lossy(&check.stderr));
        for bad in ["../../etc/passwd", "", "0000:25:00.0;reboot"] {
            let out = std::process::Command::new("sh").arg(&path).arg(bad).output().unwrap();
            assert!(!out.status.success());
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("is not a PCI address"),
                "{bad:?}"
            );
        }
    }
}

/// A directory beside the fixture (as on the host, outside the root) and its snapshot.
fn outside() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("outside");
    std::fs::create_dir(&p).unwrap();
    (dir, p)
}

fn dry(profile: Profile) -> ApplyOptions {
    ApplyOptions { dry_run: true, ..opts(profile) }
}

#[test]
fn apply_never_follows_a_link_out_of_the_root() {
    // An image whose /etc is a link to another directory of the machine building it: the
    // files xpu would write (8 for tpu-vm) must not land there, in a real run or a dry run.
    let (fx, root, inv) = build(&hosts::tpu_v5p(), Some(grub_file("quiet", "")));
    let (_keep, out) = outside();
    std::fs::rename(fx.root().join("etc"), out.join("etc")).unwrap();
    std::os::unix::fs::symlink(out.join("etc"), fx.root().join("etc")).unwrap();
    let before = snapshot(&out);
    for o in [dry(Profile::TpuVm), opts(Profile::TpuVm)] {
        let e = provision::apply(&root, &inv, &o).unwrap_err();
        assert!(matches!(e, ProvisionError::Path(_)), "{e:?}");
        let want = format!(
            "{}/etc is a symlink to {}/etc, outside the root, and {}{}/etc does not exist inside the root",
            fx.root().display(),
            out.display(),
            fx.root().display(),
            out.display()
        );
        assert!(e.to_string().starts_with(&want), "{e}");
        assert_eq!(snapshot(&out), before, "nothing written outside the root");
    }

    // `etc -> /etc`, the image-build case: never the building host's /etc. Inside the root
    // the link points at itself.
    std::fs::remove_file(fx.root().join("etc")).unwrap();
    std::os::unix::fs::symlink("/etc", fx.root().join("etc")).unwrap();
    for o in [dry(Profile::TpuVm), dry(Profile::VfioHost)] {
        let e = provision::apply(&root, &inv, &o).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}/etc is a symlink to /etc, outside the root, which inside the root leads back to itself"
            , fx.root().display())),
            "{e}"
        );
    }
}

#[test]
fn a_dry_run_never_shows_a_file_outside_the_root() {
    let (fx, root, inv) = build(&hosts::a100_8x(), Some(grub_file("", "quiet")));
    let (_keep, out) = outside();
    let secret = "GRUB_CMDLINE_LINUX=\"SECRET-FROM-OUTSIDE\"\n";
    std::fs::write(out.join("grub"), secret).unwrap();
    std::fs::create_dir(out.join("modprobe.d")).unwrap();
    std::fs::write(out.join("modprobe.d/xpu-vfio.conf"), secret).unwrap();
    let grub = fx.root().join("etc/default/grub");
    std::fs::remove_file(&grub).unwrap();
    std::os::unix::fs::symlink(out.join("grub"), &grub).unwrap();
    let e = provision::apply(&root, &inv, &dry(Profile::VfioHost)).unwrap_err().to_string();
    assert!(e.contains(&format!("{} is a symlink to ", grub.display())), "{e}");
    assert!(!e.contains("SECRET"), "{e}");

    std::fs::remove_file(&grub).unwrap();
    std::fs::write(&grub, grub_file("", "quiet")).unwrap();
    std::os::unix::fs::symlink(out.join("modprobe.d"), fx.root().join("etc/modprobe.d")).unwrap();
    let e = provision::apply(&root, &inv, &dry(Profile::VfioHost)).unwrap_err().to_string();
    assert!(e.contains("/etc/modprobe.d is a symlink to "), "{e}");
    assert!(!e.contains("SECRET"), "{e}");
}

#[test]
fn a_planted_temporary_file_link_is_never_written_through() {
    let (fx, root, inv) = build(&hosts::tpu_v5p(), Some(grub_file("quiet", "")));
    let (_keep, out) = outside();
    let victim = out.join("victim");
    std::fs::write(&victim, "victim\n").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&victim, fx.root().join("etc/default/grub.xpu-tmp")).unwrap();
    provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim\n");
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o600, "the target's mode is untouched");
    assert!(read(&fx, "/etc/default/grub").contains("idle=poll"));
    assert!(!fx.root().join("etc/default/grub.xpu-tmp").exists());
}

#[test]
fn a_dangling_backup_link_is_skipped_not_followed() {
    let (fx, root, inv) = build(&hosts::tpu_v5p(), Some(grub_file("quiet", "")));
    let (_keep, out) = outside();
    let bak = fx.root().join("etc/default/grub.xpu-bak");
    std::os::unix::fs::symlink(out.join("created-by-xpu"), &bak).unwrap();
    let dry_run = provision::apply(&root, &inv, &dry(Profile::TpuVm)).unwrap();
    let r = provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    for r in [dry_run, r] {
        let g = r.files.iter().find(|f| f.path == "/etc/default/grub").unwrap();
        assert_eq!(g.backup.as_deref(), Some("/etc/default/grub.xpu-bak.1"));
    }
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "nothing created outside the root");
    assert!(std::fs::symlink_metadata(&bak).unwrap().file_type().is_symlink());
    assert_eq!(read(&fx, "/etc/default/grub.xpu-bak.1"), grub_file("quiet", ""));
}

#[test]
fn links_inside_an_image_are_followed_within_it() {
    // Merged /usr (`lib -> usr/lib`) and an absolute link meant for the image's own `/`.
    let (fx, root, inv) = build(&hosts::tpu_v5p(), Some(grub_file("quiet", "")));
    let t = fx.root();
    std::fs::create_dir_all(t.join("usr/lib")).unwrap();
    if t.join("lib").exists() {
        std::fs::remove_dir_all(t.join("lib")).unwrap();
    }
    std::os::unix::fs::symlink("usr/lib", t.join("lib")).unwrap();
    std::fs::create_dir_all(t.join("usr/etc/security")).unwrap();
    std::os::unix::fs::symlink("/usr/etc/security", t.join("etc/security")).unwrap();
    provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    assert!(t.join("usr/lib/udev/xpu-bind-vfio-pci.sh").is_file());
    assert!(t.join("usr/etc/security/limits.d/90-xpu.conf").is_file());
    let again = provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    assert!(!again.changed(), "{again:#?}");
}

/// An image tree being built: `/etc/default/grub` and nothing else, no /proc, no /sys.
fn image_tree() -> (tempfile::TempDir, Root, Inventory) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("etc/default")).unwrap();
    std::fs::write(dir.path().join("etc/default/grub"), grub_file("quiet", "")).unwrap();
    let root = Root::new(dir.path()).unwrap();
    let inv = xpu_host::discover(
        &root,
        &DiscoverOptions { scope: Scope::All, pci_ids: None, skip_names: true },
    )
    .unwrap();
    (dir, root, inv)
}

#[test]
fn an_image_without_proc_gets_the_parameters_for_either_vendor() {
    // tpu-vm: the seed's fixed line; intel_iommu=on,sm_on only acts on Intel, at boot.
    let (dir, root, inv) = image_tree();
    let r = provision::apply(&root, &inv, &opts(Profile::TpuVm)).unwrap();
    assert_eq!(
        r.kernel_params,
        ["idle=poll", "intel_iommu=on,sm_on", "transparent_hugepage=always"]
    );
    assert_eq!(r.decided_at_boot, ["intel_iommu=on,sm_on"]);
    let grub = std::fs::read_to_string(dir.path().join("etc/default/grub")).unwrap();
    assert!(grub.contains("GRUB_CMDLINE_LINUX=\"quiet idle=poll intel_iommu=on,sm_on transparent_hugepage=always\""), "{grub}");

    // vfio-host: iommu=pt for both, intel_iommu=on for Intel (ignored on AMD, whose IOMMU is
    // on by default); no amd_iommu=on, which the kernel does not know.
    let (dir, root, inv) = image_tree();
    let o = ApplyOptions { devices: vec!["10de:20b0".parse().unwrap()], ..opts(Profile::VfioHost) };
    let r = provision::apply(&root, &inv, &ApplyOptions { dry_run: true, ..o.clone() }).unwrap();
    assert_eq!(r.decided_at_boot, ["intel_iommu=on"]);
    let r = provision::apply(&root, &inv, &o).unwrap();
    assert_eq!(r.kernel_params, ["intel_iommu=on", "iommu=pt"]);
    assert_eq!(r.decided_at_boot, ["intel_iommu=on"]);
    let grub = std::fs::read_to_string(dir.path().join("etc/default/grub")).unwrap();
    assert!(grub.contains("GRUB_CMDLINE_LINUX=\"quiet intel_iommu=on iommu=pt\""), "{grub}");

    // A vendor given still wins.
    let (_dir, root, inv) = image_tree();
    let r = provision::apply(&root, &inv, &ApplyOptions { cpu_vendor: Some(CpuVendor::Amd), ..o })
        .unwrap();
    assert_eq!(r.kernel_params, ["iommu=pt"]);
    assert!(r.decided_at_boot.is_empty());
}
