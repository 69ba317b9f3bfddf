//! Lays a [`HostSpec`] out on disk the way the kernel presents it.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use crate::{DevSpec, HostSpec, NodeSpec};

/// How to build a fixture.
#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// Make real character devices with `mknod` (needs root / CAP_MKNOD) instead of placeholder
    /// files, for tests that hand the nodes to a real container runtime.
    pub char_devices: bool,
    /// Build under this directory instead of a new temporary one.
    pub dir: Option<PathBuf>,
}

/// A built host tree. The temporary directory lives as long as this value.
#[derive(Debug)]
pub struct Fixture {
    root: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub spec: HostSpec,
}

/// Fake majors for the fixture's device nodes. Real hosts allocate most of these dynamically;
/// tests compare what discovery reports with what the node on disk says, never with constants.
pub const MAJOR_NVIDIA: u32 = 195;
pub const MAJOR_NVIDIA_UVM: u32 = 508;
pub const MAJOR_VFIO_GROUP: u32 = 509;
/// `nvidia-caps` (MIG capability nodes, `/dev/nvidia-caps/nvidia-cap<minor>`): dynamic, as here.
pub const MAJOR_NVIDIA_CAPS: u32 = 507;
pub const MAJOR_MISC: u32 = 10;
pub const MINOR_VFIO_CONTAINER: u32 = 196;
pub const MAJOR_ACCEL: u32 = 261;
pub const MAJOR_DRM: u32 = 226;
pub const MAJOR_KFD: u32 = 235;

impl Fixture {
    /// The fixture's root: pass it as `--root`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `ROOT/sys/bus/pci/devices/<addr>`
    pub fn device_dir(&self, addr: &str) -> PathBuf {
        self.root.join("sys/bus/pci/devices").join(addr)
    }

    pub(crate) fn build(spec: &HostSpec, opts: &BuildOptions) -> Fixture {
        let (root, tmp) = match &opts.dir {
            Some(d) => {
                fs::create_dir_all(d).unwrap();
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix(&format!("xpu-{}-", spec.name))
                    .tempdir()
                    .unwrap();
                (t.path().to_path_buf(), Some(t))
            }
        };
        let b = Builder { root: &root, opts };
        b.host(spec);
        for d in &spec.devices {
            b.device(d);
        }
        for d in &spec.devices {
            b.links(d, spec);
        }
        Fixture { root, _tmp: tmp, spec: spec.clone() }
    }
}

struct Builder<'a> {
    root: &'a Path,
    opts: &'a BuildOptions,
}

fn write(path: &Path, content: impl AsRef<[u8]>) {
    if let Some(p) = path.parent() {
        fs::create_dir_all(p).unwrap();
    }
    fs::write(path, content).unwrap();
}

fn link(target: impl AsRef<Path>, at: &Path) {
    if let Some(p) = at.parent() {
        fs::create_dir_all(p).unwrap();
    }
    let _ = fs::remove_file(at);
    symlink(target, at).unwrap();
}

impl Builder<'_> {
    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    /// `sys/devices/pci0000:00/<addr>`: one flat root complex per domain keeps links simple.
    fn real_dir_rel(d: &DevSpec) -> String {
        format!("devices/pci{:04x}:00/{}", d.address.domain, d.address)
    }

    fn host(&self, spec: &HostSpec) {
        write(&self.p("proc/sys/kernel/osrelease"), format!("{}\n", spec.kernel_release));
        write(&self.p("proc/sys/kernel/hostname"), format!("{}\n", spec.hostname));
        write(&self.p("etc/hostname"), format!("{}\n", spec.hostname));
        write(&self.p("proc/cmdline"), format!("{}\n", spec.cmdline));
        let mut cpuinfo = String::new();
        for cpu in 0..2 {
            cpuinfo.push_str(&format!(
                "processor\t: {cpu}\nvendor_id\t: {}\nmodel name\t: Fixture CPU\nflags\t\t: {}\n\n",
                spec.cpu_vendor,
                spec.cpu_flags.join(" ")
            ));
        }
        write(&self.p("proc/cpuinfo"), cpuinfo);
        let modules: String = spec
            .loaded_modules
            .iter()
            .map(|m| format!("{m} 16384 0 - Live 0x0000000000000000\n"))
            .collect();
        write(&self.p("proc/modules"), modules);
        for m in &spec.loaded_modules {
            fs::create_dir_all(self.p(&format!("sys/module/{m}"))).unwrap();
        }
        fs::create_dir_all(self.p("sys/bus/pci/devices")).unwrap();
        fs::create_dir_all(self.p("sys/bus/pci/drivers")).unwrap();
        fs::create_dir_all(self.p("sys/kernel/iommu_groups")).unwrap();
        write(&self.p("sys/bus/pci/drivers_probe"), "");
        if let Some(alias) = &spec.modules_alias {
            write(&self.p(&format!("lib/modules/{}/modules.alias", spec.kernel_release)), alias);
        }
        if let Some(v) = &spec.nvidia_driver {
            write(
                &self.p("proc/driver/nvidia/version"),
                format!(
                    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {v}  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
                ),
            );
        }
        for n in &spec.control_nodes {
            self.node(n);
        }
        if let Some(caps) = spec.nvidia_caps {
            write(
                &self.p("proc/devices"),
                format!(
                    "Character devices:\n  1 mem\n{MAJOR_NVIDIA} nvidia-frontend\n{MAJOR_NVIDIA_UVM} nvidia-uvm\n{caps} nvidia-caps\n\nBlock devices:\n  8 sd\n"
                ),
            );
            write(&self.p("proc/driver/nvidia-caps/mig-minors"), mig_minors());
        }
    }

    fn node(&self, n: &NodeSpec) {
        let path = self.p(&n.path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).unwrap();
        }
        let _ = fs::remove_file(&path);
        if self.opts.char_devices {
            use rustix::fs::{CWD, FileType, Mode, makedev, mknodat};
            mknodat(
                CWD,
                &path,
                FileType::CharacterDevice,
                Mode::from_raw_mode(n.mode),
                makedev(n.major, n.minor),
            )
            .unwrap_or_else(|e| panic!("mknod {} (char_devices needs root): {e}", path.display()));
            // mknod is subject to the umask; set the mode the spec asks for.
            rustix::fs::chmod(&path, Mode::from_raw_mode(n.mode)).unwrap();
        } else {
            write(&path, "");
            fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(n.mode))
                .unwrap();
        }
    }

    fn device(&self, d: &DevSpec) {
        let dir = self.p(&format!("sys/{}", Self::real_dir_rel(d)));
        fs::create_dir_all(&dir).unwrap();
        let hex = |v: u32, w: usize| format!("0x{v:0w$x}\n");
        write(&dir.join("vendor"), hex(d.vendor.into(), 4));
        write(&dir.join("device"), hex(d.device.into(), 4));
        write(&dir.join("subsystem_vendor"), hex(d.subsystem_vendor.into(), 4));
        write(&dir.join("subsystem_device"), hex(d.subsystem_device.into(), 4));
        write(&dir.join("class"), hex(d.class, 6));
        write(&dir.join("revision"), hex(d.revision.into(), 2));
        write(&dir.join("config"), d.config_space());
        write(&dir.join("modalias"), format!("{}\n", d.modalias()));
        write(&dir.join("numa_node"), format!("{}\n", d.numa_node));
        write(&dir.join("irq"), "0\n");
        write(&dir.join("enable"), "1\n");
        write(&dir.join("driver_override"), "(null)\n");
        if d.boot_vga {
            write(&dir.join("boot_vga"), "1\n");
        }
        write(
            &dir.join("resource"),
            "0x0000000000000000 0x0000000000000000 0x0000000000000000\n".repeat(13),
        );
        if let Some((speed, width)) = &d.link {
            write(&dir.join("current_link_speed"), format!("{speed}\n"));
            write(&dir.join("max_link_speed"), format!("{speed}\n"));
            write(&dir.join("current_link_width"), format!("{width}\n"));
            write(&dir.join("max_link_width"), format!("{width}\n"));
        }
        if let Some(t) = d.sriov_totalvfs {
            write(&dir.join("sriov_totalvfs"), format!("{t}\n"));
            write(&dir.join("sriov_numvfs"), format!("{}\n", d.sriov_numvfs.unwrap_or(0)));
        }
        if let Some(hive) = &d.xgmi_hive {
            write(&dir.join("xgmi_hive_info/xgmi_hive_id"), format!("{hive}\n"));
        }
        link(
            format!("../../../{}", Self::real_dir_rel(d)),
            &self.p(&format!("sys/bus/pci/devices/{}", d.address)),
        );
    }

    fn links(&self, d: &DevSpec, spec: &HostSpec) {
        let rel = Self::real_dir_rel(d);
        let dir = self.p(&format!("sys/{rel}"));
        if let Some(drv) = &d.driver {
            let drv_dir = self.p(&format!("sys/bus/pci/drivers/{drv}"));
            for f in ["bind", "unbind", "new_id", "remove_id"] {
                if !drv_dir.join(f).exists() {
                    write(&drv_dir.join(f), "");
                }
            }
            link(format!("../../../bus/pci/drivers/{drv}"), &dir.join("driver"));
            link(format!("../../../../{rel}"), &drv_dir.join(d.address.to_string()));
        }
        if let Some(g) = d.iommu_group {
            let gdir = self.p(&format!("sys/kernel/iommu_groups/{g}"));
            fs::create_dir_all(gdir.join("devices")).unwrap();
            write(&gdir.join("type"), "DMA\n");
            link(format!("../../../kernel/iommu_groups/{g}"), &dir.join("iommu_group"));
            link(format!("../../../../{rel}"), &gdir.join(format!("devices/{}", d.address)));
            if d.driver.as_deref() == Some("vfio-pci") {
                self.node(&NodeSpec::new(format!("/dev/vfio/{g}"), MAJOR_VFIO_GROUP, g));
            }
        }
        if let Some(pf) = d.physfn {
            let pf_spec =
                spec.devices.iter().find(|x| x.address == pf).expect("physfn is in the spec");
            link(format!("../{}", pf_spec.address), &dir.join("physfn"));
            let pf_dir = self.p(&format!("sys/{}", Self::real_dir_rel(pf_spec)));
            let n = fs::read_dir(&pf_dir)
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("virtfn"))
                .count();
            link(format!("../{}", d.address), &pf_dir.join(format!("virtfn{n}")));
        }
        if let (Some(minor), true) = (d.nvidia_minor, d.driver.as_deref() == Some("nvidia")) {
            let info = format!(
                "Model: \t\t NVIDIA {}\nIRQ:   \t\t 0\nGPU UUID: \t {}\nVideo BIOS: \t 92.00.19.00.01\nBus Type: \t PCIe\nDMA Size: \t 47 bits\nDMA Mask: \t 0x7fffffffffff\nBus Location: \t {}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n",
                xpu_core::accel::lookup(d.vendor, d.device).map_or("GPU", |a| a.product),
                d.uuid.as_deref().unwrap_or("GPU-00000000-0000-0000-0000-000000000000"),
                d.address
            );
            write(&self.p(&format!("proc/driver/nvidia/gpus/{}/information", d.address)), info);
            self.node(&NodeSpec::new(format!("/dev/nvidia{minor}"), MAJOR_NVIDIA, minor));
        }
        if let Some(minor) = d.accel_minor {
            fs::create_dir_all(dir.join(format!("accel/accel{minor}"))).unwrap();
            write(&dir.join(format!("accel/accel{minor}/dev")), format!("{MAJOR_ACCEL}:{minor}\n"));
            self.node(&NodeSpec::new(format!("/dev/accel{minor}"), MAJOR_ACCEL, minor));
        }
        if let Some(minor) = d.drm_minor {
            for (name, m) in
                [(format!("card{minor}"), minor), (format!("renderD{}", 128 + minor), 128 + minor)]
            {
                fs::create_dir_all(dir.join(format!("drm/{name}"))).unwrap();
                write(&dir.join(format!("drm/{name}/dev")), format!("{MAJOR_DRM}:{m}\n"));
                self.node(&NodeSpec::new(format!("/dev/dri/{name}"), MAJOR_DRM, m));
            }
        }
        if let (Some(p), Some(minor)) = (&d.partitions, d.drm_minor) {
            for (file, value) in [
                ("current_compute_partition", &p.compute),
                ("available_compute_partition", &p.available_compute),
                ("current_memory_partition", &p.memory),
                ("available_memory_partition", &p.available_memory),
            ] {
                write(&dir.join(file), format!("{value}\n"));
            }
            // One KFD node per partition, numbered after those already there (CPU nodes
            // first on a real host; none here). The first partition's render node is the
            // function's own; the others' are `amdgpu_xcp` platform devices'.
            let nodes = self.p("sys/class/kfd/kfd/topology/nodes");
            fs::create_dir_all(&nodes).unwrap();
            let first = fs::read_dir(&nodes).unwrap().count();
            let location = u32::from(d.address.bus) << 8
                | u32::from(d.address.device) << 3
                | u32::from(d.address.function);
            for i in 0..p.count {
                let render = 128 + minor + i;
                if i > 0 {
                    let xcp = self.p(&format!(
                        "sys/devices/platform/amdgpu_xcp.{}/drm/renderD{render}",
                        minor + i
                    ));
                    fs::create_dir_all(&xcp).unwrap();
                    write(&xcp.join("dev"), format!("{MAJOR_DRM}:{render}\n"));
                    self.node(&NodeSpec::new(
                        format!("/dev/dri/renderD{render}"),
                        MAJOR_DRM,
                        render,
                    ));
                }
                let node = nodes.join((first + i as usize).to_string());
                fs::create_dir_all(node.join("mem_banks/0")).unwrap();
                write(
                    &node.join("properties"),
                    format!(
                        "cpu_cores_count 0\nsimd_count {}\nvendor_id {}\ndevice_id {}\nlocation_id {location}\ndomain {}\ndrm_render_minor {render}\nnum_xcc {}\n",
                        p.xcc * 152,
                        d.vendor,
                        d.device,
                        d.address.domain,
                        p.xcc
                    ),
                );
                write(
                    &node.join("mem_banks/0/properties"),
                    format!("heap_type 1\nsize_in_bytes {}\n", p.memory_bytes),
                );
            }
        }
    }
}

/// `/proc/driver/nvidia-caps/mig-minors` as the NVIDIA driver writes it: `config` and
/// `monitor`, then for each of 32 GPUs and 15 GPU instances the instance's `access` minor
/// followed by its 8 compute instances'.
pub fn mig_minors() -> String {
    let mut out = String::from("config 1\nmonitor 2\n");
    let mut minor = 3;
    for gpu in 0..32 {
        for gi in 0..15 {
            out.push_str(&format!("gpu{gpu}/gi{gi}/access {minor}\n"));
            minor += 1;
            for ci in 0..8 {
                out.push_str(&format!("gpu{gpu}/gi{gi}/ci{ci}/access {minor}\n"));
                minor += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// The file as the driver wrote it on a lent H200 (driver 580.159.04, MIG mode off;
    /// `cat /proc/driver/nvidia-caps/mig-minors`, 2026-11-29): 4,322 lines, 109,408 bytes
    /// (sha256 bf95c04e…3a9b), equal byte for byte to this generator's. The lines below are
    /// taken from it.
    #[test]
    fn mig_minors_is_what_the_driver_writes() {
        let m = super::mig_minors();
        assert_eq!((m.len(), m.lines().count()), (109_408, 4_322));
        for line in [
            "config 1",
            "monitor 2",
            "gpu0/gi0/access 3",
            "gpu0/gi2/ci0/access 22",
            "gpu0/gi14/access 129",
            "gpu1/gi2/ci0/access 157",
            "gpu4/gi14/access 669",
            "gpu31/gi14/ci7/access 4322",
        ] {
            assert!(m.lines().any(|l| l == line), "{line}");
        }
        assert_eq!(m.lines().last(), Some("gpu31/gi14/ci7/access 4322"));
    }
}
