//! The named hosts xpu is tested against, modelled on real machines:
//!
//! - [`a100_8x`]: an HGX A100 8-GPU host with 6 NVSwitches, bus numbers, ids and the `nvidia`
//!   driver as in the OpenStack seed's `lspci -nn` listing (GPU `25:00.0` in IOMMU group 47).
//! - [`a100_8x_vfio`]: the same host prepared for passthrough: every GPU and NVSwitch on
//!   `vfio-pci`, `/dev/vfio/<group>` nodes, no NVIDIA driver loaded.
//! - [`tpu_v5p`]: a TPU v5p VM: 4 chips `1ae0:0062` on `vfio-pci`, one IOMMU group each.
//! - [`tpu_v6e_8`]: a TPU v6e (Trillium) VM with 8 chips.
//! - [`sriov`]: an A100 PCIe PF with 4 VFs (`physfn`/`virtfnN` links) on `vfio-pci`.
//! - [`mi300x`]: an 8×AMD Instinct MI300X host (`amdgpu`, `/dev/dri`, `/dev/kfd`, XGMI hive).
//! - [`gpu_with_audio`]: a workstation GPU on `vfio-pci` whose HDMI audio function is still on
//!   `snd_hda_intel` in the same IOMMU group (with the root port, a bridge, in it too).
//!
//! [`all`] lists them for tests that run over every fixture.

use crate::sysfs::{MAJOR_KFD, MAJOR_MISC, MAJOR_NVIDIA, MAJOR_NVIDIA_UVM, MINOR_VFIO_CONTAINER};
use crate::{DevSpec, HostSpec, NodeSpec};

/// A small `modules.alias` with the lines that matter for the fixtures' devices, in the kernel's
/// format.
pub const MODULES_ALIAS: &str = "\
# Aliases extracted from modules themselves.
alias pci:v000010DEd*sv*sd*bc03sc00i00* nvidia
alias pci:v000010DEd*sv*sd*bc03sc02i00* nvidia
alias pci:v000010DEd*sv*sd*bc06sc80i00* nvidia
alias pci:v000010DEd*sv*sd*bc03sc*i* nouveau
alias pci:v000010DEd*sv*sd*bc03sc*i* nvidia_drm
alias pci:v00001002d000074A1sv*sd*bc*sc*i* amdgpu
alias pci:v00001002d*sv*sd*bc03sc*i* amdgpu
alias pci:v00001DA3d00001020sv*sd*bc*sc*i* habanalabs
alias pci:v*d*sv*sd*bc04sc03i00* snd_hda_intel
alias pci:v000015B3d0000101Bsv*sd*bc*sc*i* mlx5_core
alias pci:v*d*sv*sd*bc01sc08i02* nvme
alias pci:v00001A03d00002000sv*sd*bc*sc*i* ast
alias pci:v00008086d000015F3sv*sd*bc*sc*i* igc
alias pci:v00001AE0d00000042sv*sd*bc*sc*i* gve
alias usb:v*p*d*dc*dsc*dp*ic09isc*ip*in* usbcore
";

/// The seed's GPU buses, in order, and NVSwitch buses.
pub const A100_GPU_BUSES: [u8; 8] = [0x25, 0x2b, 0x48, 0x4d, 0x8c, 0x91, 0xc5, 0xcb];
pub const A100_NVSWITCH_BUSES: [u8; 6] = [0xb7, 0xb8, 0xb9, 0xba, 0xbb, 0xbc];
/// IOMMU groups of the GPUs (`25:00.0` is group 47 in the seed's `virsh nodedev-dumpxml`).
pub const A100_GPU_GROUPS: [u32; 8] = [47, 52, 65, 70, 104, 109, 150, 155];

/// The UUID the fixture gives GPU `index`.
pub fn gpu_uuid(index: usize) -> String {
    format!("GPU-{:08x}-a100-4000-8000-{:012x}", 0x5eed_0000 + index, index)
}

fn platform(h: HostSpec) -> HostSpec {
    h.device(
        DevSpec::new("0000:00:00.0", 0x8086, 0x09a2, 0x060000)
            .subsystem(0x8086, 0x0000)
            .revision(0x04)
            .group(1)
            .numa(0),
    )
    .device(
        DevSpec::new("0000:03:00.0", 0x1a03, 0x2000, 0x030000)
            .subsystem(0x1a03, 0x2000)
            .revision(0x41)
            .driver("ast")
            .group(10)
            .numa(0),
    )
    .device(
        DevSpec::new("0000:0c:00.0", 0x15b3, 0x101b, 0x020700)
            .subsystem(0x15b3, 0x0006)
            .driver("mlx5_core")
            .group(20)
            .numa(0)
            .link("16.0 GT/s PCIe", 16),
    )
    .device(
        DevSpec::new("0000:e3:00.0", 0x144d, 0xa80a, 0x010802)
            .subsystem(0x144d, 0xa812)
            .driver("nvme")
            .group(80)
            .numa(1)
            .link("16.0 GT/s PCIe", 4),
    )
}

fn hgx_a100(name: &str, vfio: bool) -> HostSpec {
    let mut h = platform(HostSpec::new(name));
    for (i, (&bus, &group)) in A100_GPU_BUSES.iter().zip(&A100_GPU_GROUPS).enumerate() {
        let mut d = DevSpec::new(&format!("0000:{bus:02x}:00.0"), 0x10de, 0x20b0, 0x030200)
            .subsystem(0x10de, 0x134f)
            .revision(0xa1)
            .group(group)
            .numa(if i < 4 { 0 } else { 1 })
            .link("16.0 GT/s PCIe", 16);
        d = if vfio {
            d.driver("vfio-pci")
        } else {
            d.driver("nvidia").nvidia(i as u32, &gpu_uuid(i))
        };
        h = h.device(d);
    }
    for (i, &bus) in A100_NVSWITCH_BUSES.iter().enumerate() {
        let d = DevSpec::new(&format!("0000:{bus:02x}:00.0"), 0x10de, 0x1af1, 0x068000)
            .subsystem(0x10de, 0x1492)
            .revision(0xa1)
            .group(130 + i as u32)
            .numa(1)
            .link("16.0 GT/s PCIe", 2)
            .driver(if vfio { "vfio-pci" } else { "nvidia" });
        h = h.device(d);
    }
    h
}

/// 8×A100 SXM4 40GB with 6 NVSwitches on the `nvidia` driver (driver 535.104.05).
pub fn a100_8x() -> HostSpec {
    let mut h = hgx_a100("a100-8x", false);
    h.nvidia_driver = Some("535.104.05".to_owned());
    h.loaded_modules =
        ["nvidia", "nvidia_uvm", "nvidia_modeset", "kvm", "kvm_intel"].map(str::to_owned).to_vec();
    h.control_nodes = vec![
        NodeSpec::new("/dev/nvidiactl", MAJOR_NVIDIA, 255),
        NodeSpec::new("/dev/nvidia-modeset", MAJOR_NVIDIA, 254),
        NodeSpec::new("/dev/nvidia-uvm", MAJOR_NVIDIA_UVM, 0),
        NodeSpec::new("/dev/nvidia-uvm-tools", MAJOR_NVIDIA_UVM, 1),
    ];
    h
}

/// The 8×A100 host with its first four GPUs (and the NVSwitches, which are not GPUs): the
/// GPU node of the real-kubelet tests.
pub fn a100_4x() -> HostSpec {
    let mut h = a100_8x();
    h.name = "a100-4x".into();
    h.devices.retain(|d| d.nvidia_minor.is_none_or(|m| m < 4));
    h
}

/// Four H200 SXM 141GB on the `nvidia` driver (550.90.07) with MIG's capability nodes
/// (`/proc/driver/nvidia-caps/mig-minors`, the `nvidia-caps` major): the MIG host. The GPUs'
/// addresses, minors and UUIDs are those of [`a100_4x`]; MIG mode is NVML's (the fake's).
pub fn h200_4x() -> HostSpec {
    let mut h = a100_4x();
    h.name = "h200-4x".into();
    h.hostname = h.name.clone();
    h.nvidia_driver = Some("550.90.07".to_owned());
    for d in h.devices.iter_mut().filter(|d| d.nvidia_minor.is_some()) {
        d.device = 0x2335;
        d.subsystem_device = 0x18be;
    }
    h.nvidia_caps = Some(crate::sysfs::MAJOR_NVIDIA_CAPS);
    h
}

/// The 8×A100 host with every GPU and NVSwitch bound to `vfio-pci` for passthrough.
pub fn a100_8x_vfio() -> HostSpec {
    let mut h = hgx_a100("a100-8x-vfio", true);
    h.loaded_modules =
        ["vfio", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "kvm", "kvm_intel"]
            .map(str::to_owned)
            .to_vec();
    h.cmdline = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro intel_iommu=on iommu=pt".to_owned();
    h.control_nodes = vec![NodeSpec::new("/dev/vfio/vfio", MAJOR_MISC, MINOR_VFIO_CONTAINER)];
    h
}

fn tpu_vm(name: &str, device: u16, subsystem: u16, chips: u8) -> HostSpec {
    let mut h = HostSpec::new(name).device(
        DevSpec::new("0000:00:03.0", 0x1ae0, 0x0042, 0x020000)
            .subsystem(0x1ae0, 0x0058)
            .driver("gve")
            .group(chips.into())
            .numa(0),
    );
    for i in 0..chips {
        h = h.device(
            DevSpec::new(&format!("0000:00:{:02x}.0", 4 + i), 0x1ae0, device, 0xff0000)
                .subsystem(0x1ae0, subsystem)
                .revision(0x01)
                .driver("vfio-pci")
                .group(i.into())
                .numa(if i < chips.div_ceil(2) || chips <= 4 { 0 } else { 1 }),
        );
    }
    h.loaded_modules =
        ["vfio", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1"].map(str::to_owned).to_vec();
    h.control_nodes = vec![NodeSpec::new("/dev/vfio/vfio", MAJOR_MISC, MINOR_VFIO_CONTAINER)];
    h
}

/// A TPU v5p VM: 4 chips on `vfio-pci`, one IOMMU group each.
pub fn tpu_v5p() -> HostSpec {
    tpu_vm("tpu-v5p", 0x0062, 0x00ad, 4)
}

/// A TPU v6e VM with 8 chips (ct6e-standard-8t).
pub fn tpu_v6e_8() -> HostSpec {
    tpu_vm("tpu-v6e-8", 0x006f, 0x00d1, 8)
}

/// An A100 PCIe physical function with 4 of its 16 virtual functions enabled, the VFs on
/// `vfio-pci` for passthrough.
pub fn sriov() -> HostSpec {
    let mut h = HostSpec::new("sriov")
        .device(
            DevSpec::new("0000:00:00.0", 0x8086, 0x09a2, 0x060000)
                .subsystem(0x8086, 0)
                .group(1)
                .numa(0),
        )
        .device(
            DevSpec::new("0000:41:00.0", 0x10de, 0x20f1, 0x030200)
                .subsystem(0x10de, 0x145f)
                .revision(0xa1)
                .driver("nvidia")
                .nvidia(0, &gpu_uuid(0))
                .group(30)
                .numa(0)
                .sriov(16, 4)
                .link("16.0 GT/s PCIe", 16),
        );
    for (i, f) in [4u8, 5, 6, 7].iter().enumerate() {
        h = h.device(
            DevSpec::new(&format!("0000:41:00.{f}"), 0x10de, 0x20f1, 0x030200)
                .subsystem(0x10de, 0x145f)
                .revision(0xa1)
                .driver("vfio-pci")
                .group(31 + i as u32)
                .numa(0)
                .physfn("0000:41:00.0"),
        );
    }
    h.nvidia_driver = Some("535.104.05".to_owned());
    h.loaded_modules = ["nvidia", "vfio", "vfio_pci", "vfio_iommu_type1", "kvm", "kvm_intel"]
        .map(str::to_owned)
        .to_vec();
    h.control_nodes = vec![
        NodeSpec::new("/dev/nvidiactl", MAJOR_NVIDIA, 255),
        NodeSpec::new("/dev/vfio/vfio", MAJOR_MISC, MINOR_VFIO_CONTAINER),
    ];
    h
}

/// The buses of the MI300X fixture's GPUs.
pub const MI300X_BUSES: [u8; 8] = [0x05, 0x26, 0x46, 0x65, 0x85, 0xa6, 0xc6, 0xe5];

/// 8×AMD Instinct MI300X on `amdgpu`, all in one XGMI hive, on an AMD EPYC host.
pub fn mi300x() -> HostSpec {
    let mut h = HostSpec::new("mi300x");
    h.cpu_vendor = "AuthenticAMD".to_owned();
    h.cpu_flags = ["fpu", "lm", "svm", "avx2"].map(str::to_owned).to_vec();
    for (i, &bus) in MI300X_BUSES.iter().enumerate() {
        h = h.device(
            DevSpec::new(&format!("0000:{bus:02x}:00.0"), 0x1002, 0x74a1, 0x120000)
                .subsystem(0x1002, 0x74a1)
                .driver("amdgpu")
                .group(10 + i as u32)
                .numa(if i < 4 { 0 } else { 1 })
                .link("32.0 GT/s PCIe", 16)
                .drm(i as u32)
                .xgmi("7786335925049349010"),
        );
    }
    h.loaded_modules = ["amdgpu", "kvm", "kvm_amd"].map(str::to_owned).to_vec();
    h.control_nodes = vec![NodeSpec::new("/dev/kfd", MAJOR_KFD, 0)];
    h
}

/// [`mi300x`] with every GPU in CPX compute and NPS1 memory partitioning: eight partitions of one
/// XCD each per GPU, each with a render node of its own (`renderD(128+8g+i)`: GPU g's DRM
/// minors are spaced by eight, as amdgpu allocates them), 24 GiB each (a fixture's choice).
pub fn mi300x_cpx() -> HostSpec {
    let mut h = mi300x();
    h.name = "mi300x-cpx".into();
    h.hostname = h.name.clone();
    for (i, d) in h.devices.iter_mut().enumerate() {
        d.drm_minor = Some(8 * i as u32);
        d.partitions = Some(crate::Partitions {
            compute: "CPX".into(),
            memory: "NPS1".into(),
            available_compute: "SPX, DPX, QPX, CPX".into(),
            available_memory: "NPS1, NPS4".into(),
            count: 8,
            xcc: 1,
            memory_bytes: 24 << 30,
        });
    }
    h
}

/// A workstation GPU (RTX A6000) bound to `vfio-pci` whose audio function `01:00.1` is still on
/// `snd_hda_intel` in the same IOMMU group 1, together with the root port above them.
pub fn gpu_with_audio() -> HostSpec {
    let mut h = HostSpec::new("gpu-audio")
        .device(
            DevSpec::new("0000:00:01.0", 0x8086, 0x1901, 0x060400)
                .revision(0x05)
                .driver("pcieport")
                .group(1)
                .numa(-1),
        )
        .device(
            DevSpec::new("0000:01:00.0", 0x10de, 0x2230, 0x030000)
                .subsystem(0x10de, 0x1459)
                .revision(0xa1)
                .driver("vfio-pci")
                .group(1)
                .link("16.0 GT/s PCIe", 16),
        )
        .device(
            DevSpec::new("0000:01:00.1", 0x10de, 0x1aef, 0x040300)
                .subsystem(0x10de, 0x1459)
                .revision(0xa1)
                .driver("snd_hda_intel")
                .group(1),
        )
        .device(
            DevSpec::new("0000:05:00.0", 0x8086, 0x15f3, 0x020000)
                .revision(0x03)
                .driver("igc")
                .group(12),
        );
    h.loaded_modules =
        ["vfio", "vfio_pci", "vfio_iommu_type1", "snd_hda_intel", "kvm", "kvm_intel"]
            .map(str::to_owned)
            .to_vec();
    h.control_nodes = vec![NodeSpec::new("/dev/vfio/vfio", MAJOR_MISC, MINOR_VFIO_CONTAINER)];
    h
}

/// Every named host.
pub fn all() -> Vec<HostSpec> {
    vec![
        a100_8x(),
        a100_8x_vfio(),
        tpu_v5p(),
        tpu_v6e_8(),
        sriov(),
        mi300x(),
        mi300x_cpx(),
        gpu_with_audio(),
    ]
}
