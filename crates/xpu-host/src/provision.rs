//! Host provisioning: the files that make a host ready for a [`Profile`], rendered
//! ([`render`]), emitted as one cloud-init document ([`cloud_init`]), or written under a root
//! ([`apply`]) idempotently, with backups and a unified diff.
//!
//! What the seeds do by hand, and what is rendered instead:
//!
//! | seed step | file |
//! |---|---|
//! | udev rule tagging TPU ids + `bind_to_vfio_pci.sh` (custom-image seed) | `/etc/udev/rules.d/99-xpu-vfio.rules`, `/lib/udev/xpu-bind-vfio-pci.sh`, for any ids |
//! | `chmod 0666 /dev/vfio/N`, `KERNEL=="accel*" MODE="0666"` (tpu-vm) | udev `MODE` rules |
//! | `options vfio-pci ids=10de:20b0`, `/etc/modules-load.d` (OpenStack seed) | `/etc/modprobe.d/xpu-vfio.conf` (+ `softdep <driver> pre: vfio-pci`), `/etc/modules-load.d/xpu-vfio.conf` |
//! | `blacklist nouveau` | `/etc/modprobe.d/xpu-blacklist.conf` (vfio-host with NVIDIA devices) |
//! | memlock unlimited, nofile 100000 appended to limits.conf | `/etc/security/limits.d/90-xpu.conf` (with the `root` lines pam_limits needs) |
//! | `sed` on `GRUB_CMDLINE_LINUX` | render: `/etc/default/grub.d/90-xpu.cfg`; apply: merged into `/etc/default/grub` ([`crate::grub`]) |
//! | THP, `idle=poll` | kernel parameters, and `/etc/tmpfiles.d/xpu-thp.conf` |
//! | cloud-init `configure-env-vars.sh`, GCS timeouts appended to `/etc/environment` | `/var/scripts/xpu-tpu-env.sh` + `xpu-tpu-env.service` (idempotent, `xpu host metadata-env`) |
//!
//! Rendering is pure (no host access). [`apply`] reads only the files it may change and takes
//! devices and the CPU vendor from the [`Inventory`] when not given. It never runs the
//! activation commands (`update-grub`, `udevadm trigger`...); it lists them.

use std::collections::BTreeSet;
use std::fmt;
use std::fmt::Write as _;
use std::path::Path;
use std::str::FromStr;

use serde::Serialize;
use xpu_core::Inventory;
use xpu_core::accel::{DeviceKind, VENDOR_AMD, VENDOR_GOOGLE, VENDOR_HABANA, VENDOR_NVIDIA};

use crate::grub::{self, GRUB_DEFAULT, GrubError};
use crate::profile::{CpuVendor, Profile};
use crate::root::PathError;
use crate::{Root, textdiff};

/// A device id to match: `VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE]`, hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceMatch {
    pub vendor: u16,
    pub device: u16,
    pub subsystem: Option<(u16, u16)>,
}

/// Why a `--devices` entry is not a device id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid device id {0:?}; expected VENDOR:DEVICE[:SUBVENDOR:SUBDEVICE] in hex (e.g. 10de:20b0 or 1ae0:0062:1ae0:00ad)"
)]
pub struct DeviceMatchError(pub String);

impl FromStr for DeviceMatch {
    type Err = DeviceMatchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || DeviceMatchError(s.to_owned());
        let parts: Vec<u16> = s
            .split(':')
            .map(|p| {
                let p = p.strip_prefix("0x").unwrap_or(p);
                if p.is_empty() || p.len() > 4 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(err());
                }
                u16::from_str_radix(p, 16).map_err(|_| err())
            })
            .collect::<Result<_, _>>()?;
        match parts[..] {
            [vendor, device] => Ok(Self { vendor, device, subsystem: None }),
            [vendor, device, sv, sd] => Ok(Self { vendor, device, subsystem: Some((sv, sd)) }),
            _ => Err(err()),
        }
    }
}

impl fmt::Display for DeviceMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:04x}", self.vendor, self.device)?;
        if let Some((sv, sd)) = self.subsystem {
            write!(f, ":{sv:04x}:{sd:04x}")?;
        }
        Ok(())
    }
}

impl DeviceMatch {
    pub fn matches(&self, d: &xpu_core::PciDevice) -> bool {
        d.vendor_id == Some(self.vendor)
            && d.device_id == Some(self.device)
            && self.subsystem.is_none_or(|(sv, sd)| {
                d.subsystem_vendor_id == Some(sv) && d.subsystem_device_id == Some(sd)
            })
    }
}

/// The TPU ids of the custom-image seed's udev rule (v5p, v6e, TPU7x), used for `tpu-vm` when
/// neither `--devices` nor the host names any.
pub const SEED_TPU_IDS: [DeviceMatch; 3] = [
    DeviceMatch { vendor: VENDOR_GOOGLE, device: 0x0062, subsystem: Some((VENDOR_GOOGLE, 0x00ad)) },
    DeviceMatch { vendor: VENDOR_GOOGLE, device: 0x006f, subsystem: Some((VENDOR_GOOGLE, 0x00d1)) },
    DeviceMatch { vendor: VENDOR_GOOGLE, device: 0x0076, subsystem: Some((VENDOR_GOOGLE, 0x00f2)) },
];

/// Host drivers that claim a vendor's accelerators and must load after `vfio-pci`.
fn vendor_drivers(vendor: u16) -> &'static [&'static str] {
    match vendor {
        VENDOR_NVIDIA => &["nouveau", "nvidia"],
        VENDOR_AMD => &["amdgpu", "radeon"],
        VENDOR_HABANA => &["habanalabs"],
        _ => &[],
    }
}

/// What to render.
#[derive(Debug, Clone)]
pub struct RenderOptions {
    pub profile: Profile,
    pub devices: Vec<DeviceMatch>,
    /// `None`: the grub drop-in picks the variant from `/proc/cpuinfo` when `update-grub` runs.
    pub cpu_vendor: Option<CpuVendor>,
    /// `vm.nr_hugepages` to reserve at boot.
    pub hugepages: Option<u64>,
    /// More drivers to order after `vfio-pci` (apply adds those `modules.alias` names for the
    /// host's devices).
    pub extra_drivers: Vec<String>,
}

impl RenderOptions {
    pub fn new(profile: Profile) -> Self {
        Self {
            profile,
            devices: Vec::new(),
            cpu_vendor: None,
            hugepages: None,
            extra_drivers: Vec::new(),
        }
    }
}

/// One file to write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostFile {
    /// Host path (`/etc/modprobe.d/xpu-vfio.conf`).
    pub path: String,
    pub content: String,
    /// Permission bits, written as an octal string (`"0644"`).
    #[serde(serialize_with = "octal")]
    pub mode: u32,
    pub owner: String,
}

fn octal<S: serde::Serializer>(mode: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{mode:04o}"))
}

impl HostFile {
    fn new(path: &str, mode: u32, content: String) -> Self {
        Self { path: path.to_owned(), content, mode, owner: "root:root".to_owned() }
    }
}

/// The rendered files and the commands that activate them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rendered {
    pub profile: String,
    pub files: Vec<HostFile>,
    /// Shell commands, in order, that make the files take effect without waiting for a reboot
    /// (kernel parameters still need one).
    pub commands: Vec<String>,
}

impl Rendered {
    pub fn file(&self, path: &str) -> Option<&HostFile> {
        self.files.iter().find(|f| f.path == path)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    #[error(
        "profile all is for xpu doctor only; pick vfio-host, tpu-vm or container-host to render or apply"
    )]
    AllProfile,
    #[error(
        "profile vfio-host needs the devices to pass through; add --devices VENDOR:DEVICE (see xpu discover)"
    )]
    NeedsDevices,
    #[error(
        "cannot tell the CPU vendor from /proc/cpuinfo; pass --cpu-vendor intel or --cpu-vendor amd"
    )]
    UnknownCpuVendor,
    #[error(transparent)]
    Grub(#[from] GrubError),
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("{action} {path}: {error}")]
    Io { action: &'static str, path: String, error: std::io::Error },
}

fn header(profile: Profile, why: &str) -> String {
    format!(
        "# Written by xpu (profile {profile}); changes here are overwritten by xpu host apply.\n# {why}\n"
    )
}

pub const MODULES_LOAD_VFIO: &str = "/etc/modules-load.d/xpu-vfio.conf";
pub const MODPROBE_VFIO: &str = "/etc/modprobe.d/xpu-vfio.conf";
pub const MODPROBE_BLACKLIST: &str = "/etc/modprobe.d/xpu-blacklist.conf";
pub const UDEV_RULES: &str = "/etc/udev/rules.d/99-xpu-vfio.rules";
pub const BIND_SCRIPT: &str = "/lib/udev/xpu-bind-vfio-pci.sh";
pub const LIMITS_FILE: &str = "/etc/security/limits.d/90-xpu.conf";
pub const GRUB_DROPIN: &str = "/etc/default/grub.d/90-xpu.cfg";
pub const SYSCTL_FILE: &str = "/etc/sysctl.d/90-xpu.conf";
pub const THP_TMPFILES: &str = "/etc/tmpfiles.d/xpu-thp.conf";
pub const TPU_ENV_SCRIPT: &str = "/var/scripts/xpu-tpu-env.sh";
pub const TPU_ENV_UNIT: &str = "/etc/systemd/system/xpu-tpu-env.service";
pub const MODULES_LOAD_CONTAINER: &str = "/etc/modules-load.d/xpu-container.conf";

/// The memlock and nofile limits every profile wants (the custom-image seed's values).
pub const NOFILE_WANTED: u64 = 100_000;

/// Renders the files of `opts.profile`.
pub fn render(opts: &RenderOptions) -> Result<Rendered, ProvisionError> {
    let p = opts.profile;
    if p == Profile::All {
        return Err(ProvisionError::AllProfile);
    }
    let mut devices: Vec<DeviceMatch> = opts.devices.clone();
    if p == Profile::TpuVm && devices.is_empty() {
        devices = SEED_TPU_IDS.to_vec();
    }
    if p == Profile::VfioHost && devices.is_empty() {
        return Err(ProvisionError::NeedsDevices);
    }
    devices.sort();
    devices.dedup();

    let mut files = Vec::new();
    if p.wants_vfio() {
        vfio_files(p, &devices, &opts.extra_drivers, &mut files);
    }
    if p == Profile::ContainerHost {
        let mut modules = BTreeSet::new();
        for d in &devices {
            match d.vendor {
                // nvidia-uvm makes /dev/nvidia-uvm, which CUDA needs and which otherwise appears
                // only after the first CUDA call on the host.
                VENDOR_NVIDIA => modules.extend(["nvidia", "nvidia_uvm"]),
                VENDOR_AMD => modules.extend(["amdgpu"]),
                VENDOR_HABANA => modules.extend(["habanalabs"]),
                _ => {}
            }
        }
        if !modules.is_empty() {
            let mut c = header(
                p,
                "Load the accelerator drivers at boot so their device nodes exist for containers.",
            );
            for m in modules {
                let _ = writeln!(c, "{m}");
            }
            files.push(HostFile::new(MODULES_LOAD_CONTAINER, 0o644, c));
        }
    }
    files.push(limits_file(p));
    let params_intel = p.kernel_params(CpuVendor::Intel);
    if !params_intel.is_empty() {
        files.push(HostFile::new(GRUB_DROPIN, 0o644, grub_dropin(p, opts.cpu_vendor)));
    }
    if let Some(n) = opts.hugepages {
        let mut c = header(
            p,
            "Reserve huge pages at boot: guest RAM backed by them is pinned once, not page by page.",
        );
        let _ = writeln!(c, "vm.nr_hugepages = {n}");
        files.push(HostFile::new(SYSCTL_FILE, 0o644, c));
    }
    if p == Profile::TpuVm {
        let mut c = header(
            p,
            "Transparent huge pages always on, now and at every boot (the kernel parameter covers the next boot).",
        );
        c.push_str("w /sys/kernel/mm/transparent_hugepage/enabled - - - - always\n");
        files.push(HostFile::new(THP_TMPFILES, 0o644, c));
        files.push(HostFile::new(TPU_ENV_SCRIPT, 0o755, tpu_env_script()));
        files.push(HostFile::new(TPU_ENV_UNIT, 0o644, tpu_env_unit()));
    }
    let commands = commands_for(&files);
    Ok(Rendered { profile: p.to_string(), files, commands })
}

fn vfio_files(p: Profile, devices: &[DeviceMatch], extra: &[String], files: &mut Vec<HostFile>) {
    let mut c =
        header(p, "Load VFIO at boot so vfio-pci can claim the devices before anything else does.");
    c.push_str("vfio\nvfio_iommu_type1\nvfio_pci\n");
    files.push(HostFile::new(MODULES_LOAD_VFIO, 0o644, c));

    if !devices.is_empty() {
        let mut drivers: BTreeSet<String> = BTreeSet::new();
        for d in devices {
            drivers.extend(vendor_drivers(d.vendor).iter().map(|s| (*s).to_owned()));
        }
        drivers.extend(
            extra
                .iter()
                .map(|m| xpu_core::kernel::module_name(m))
                .filter(|m| m != "vfio_pci" && m != "pci_stub"),
        );
        let mut c = header(
            p,
            if drivers.is_empty() {
                "vfio-pci claims these devices when it loads."
            } else {
                "vfio-pci claims these devices when it loads; the softdeps load it before the drivers that would claim them first."
            },
        );
        let ids: Vec<String> = devices.iter().map(ToString::to_string).collect();
        let _ = writeln!(c, "options vfio-pci ids={}", ids.join(","));
        for d in drivers {
            let _ = writeln!(c, "softdep {d} pre: vfio-pci");
        }
        files.push(HostFile::new(MODPROBE_VFIO, 0o644, c));
    }
    if p == Profile::VfioHost && devices.iter().any(|d| d.vendor == VENDOR_NVIDIA) {
        let mut c = header(
            p,
            "nouveau binds NVIDIA GPUs from the initramfs and does not let go cleanly; keep it off a passthrough host.",
        );
        c.push_str("blacklist nouveau\noptions nouveau modeset=0\n");
        files.push(HostFile::new(MODPROBE_BLACKLIST, 0o644, c));
    }
    if !devices.is_empty() {
        files.push(HostFile::new(UDEV_RULES, 0o644, udev_rules(p, devices)));
        files.push(HostFile::new(BIND_SCRIPT, 0o755, bind_script(p)));
    }
}

/// The custom-image seed's rules, for any ids: tag matching devices, then run the bind script
/// for tagged ones. tpu-vm also opens the VFIO group nodes and `/dev/accel*` to every user.
pub fn udev_rules(p: Profile, devices: &[DeviceMatch]) -> String {
    let mut c = header(p, "Bind matching PCI devices to vfio-pci when they appear.");
    for d in devices {
        let _ = write!(
            c,
            "SUBSYSTEM==\"pci\", ACTION==\"add\", ATTR{{vendor}}==\"0x{:04x}\", ATTR{{device}}==\"0x{:04x}\"",
            d.vendor, d.device
        );
        if let Some((sv, sd)) = d.subsystem {
            let _ = write!(
                c,
                ", ATTR{{subsystem_vendor}}==\"0x{sv:04x}\", ATTR{{subsystem_device}}==\"0x{sd:04x}\""
            );
        }
        c.push_str(", DRIVER!=\"vfio-pci\", TAG+=\"xpu_vfio_pci\"\n");
    }
    let _ = writeln!(c, "TAG==\"xpu_vfio_pci\", RUN+=\"{BIND_SCRIPT} $kernel\"");
    if let Some(mode) = p.vfio_node_mode() {
        let _ = writeln!(c, "SUBSYSTEM==\"vfio\", MODE=\"{mode:04o}\"");
        let _ = writeln!(c, "KERNEL==\"accel*\", MODE=\"{mode:04o}\"");
    }
    c
}

/// The seed's `bind_to_vfio_pci.sh`, generalised and made strict: it checks the address,
/// binds through `driver_override` as `xpu vfio bind` does, verifies the result, and (tpu-vm)
/// opens the group node and allows unsafe interrupts on x86 as the seed does.
pub fn bind_script(p: Profile) -> String {
    let mut s = String::from("#!/bin/sh\n");
    s.push_str(&header(
        p,
        "Run by udev as: xpu-bind-vfio-pci.sh <dddd:bb:dd.f>. Binds the device to vfio-pci.",
    ));
    s.push_str(
        r#"set -eu
bdf="${1:-}"
fail() { echo "xpu-bind-vfio-pci: $*" >&2; exit 1; }
case "$bdf" in
  ""|*[!0-9a-f:.]*) fail "$bdf is not a PCI address (dddd:bb:dd.f)" ;;
esac
dev="/sys/bus/pci/devices/$bdf"
[ -e "$dev" ] || fail "$dev does not exist"
modprobe vfio-pci
echo vfio-pci > "$dev/driver_override"
if [ -e "$dev/driver" ]; then
  current=$(basename "$(readlink "$dev/driver")")
  if [ "$current" != vfio-pci ]; then
    echo "$bdf" > "$dev/driver/unbind"
    [ ! -e "$dev/driver" ] || fail "$bdf is still bound to $current"
  fi
fi
[ -e "$dev/driver" ] || echo "$bdf" > /sys/bus/pci/drivers_probe
[ "$(basename "$(readlink "$dev/driver")")" = vfio-pci ] || fail "$bdf did not bind to vfio-pci"
"#,
    );
    if let Some(mode) = p.vfio_node_mode() {
        let _ = write!(
            s,
            r#"group=$(basename "$(readlink "$dev/iommu_group")")
[ -c "/dev/vfio/$group" ] || fail "/dev/vfio/$group does not exist"
chmod {mode:04o} "/dev/vfio/$group"
# As the TPU image seed does: TPU VMs have no interrupt remapping behind their vIOMMU.
if [ "$(uname -m)" = x86_64 ] && [ -w /sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts ]; then
  echo 1 > /sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts
fi
"#
        );
    }
    s
}

fn limits_file(p: Profile) -> HostFile {
    let mut c = header(
        p,
        "VFIO and RDMA pin memory for DMA (no memlock cap); accelerator runtimes open many files.\n# pam_limits does not apply * lines to root, hence the root lines.",
    );
    for (item, value) in
        [("memlock", "unlimited".to_owned()), ("nofile", NOFILE_WANTED.to_string())]
    {
        for domain in ["*", "root"] {
            for kind in ["soft", "hard"] {
                let _ = writeln!(c, "{domain:<5} {kind:<5} {item:<8} {value}");
            }
        }
    }
    HostFile::new(LIMITS_FILE, 0o644, c)
}

/// A `/etc/default/grub.d` drop-in (sourced by `update-grub` after `/etc/default/grub`) that
/// appends each parameter once. It appends to `GRUB_CMDLINE_LINUX_DEFAULT`, which GRUB puts
/// last on the kernel line, so a conflicting value elsewhere is overridden (the kernel lets the
/// last occurrence win). `xpu host apply` edits `/etc/default/grub` itself instead.
fn grub_dropin(p: Profile, vendor: Option<CpuVendor>) -> String {
    let mut c = header(
        p,
        "Kernel parameters, each added once; update-grub reads this after /etc/default/grub.",
    );
    let intel = p.kernel_params(CpuVendor::Intel).join(" ");
    let amd = p.kernel_params(CpuVendor::Amd).join(" ");
    match vendor {
        Some(v) => {
            let _ = writeln!(c, "xpu_params=\"{}\"", p.kernel_params(v).join(" "));
        }
        None => {
            let _ = write!(
                c,
                "case \"$(grep -m1 '^vendor_id' /proc/cpuinfo 2>/dev/null)\" in\n  *AuthenticAMD*|*HygonGenuine*) xpu_params=\"{amd}\" ;;\n  *) xpu_params=\"{intel}\" ;;\nesac\n"
            );
        }
    }
    c.push_str(
        r#"for xpu_p in $xpu_params; do
  case " $GRUB_CMDLINE_LINUX $GRUB_CMDLINE_LINUX_DEFAULT " in
    *" $xpu_p "*) ;;
    *) GRUB_CMDLINE_LINUX_DEFAULT="${GRUB_CMDLINE_LINUX_DEFAULT:+$GRUB_CMDLINE_LINUX_DEFAULT }$xpu_p" ;;
  esac
done
unset xpu_p xpu_params
"#,
    );
    c
}

/// The custom-image seed's boot-time environment, made idempotent: `/etc/environment` lines are
/// added once (the seed appends the GCS timeouts again on every boot), and the `tpu-env`
/// metadata becomes a shell-safe file through `xpu host metadata-env` instead of `eval`ing a
/// Python one-liner's output.
fn tpu_env_script() -> String {
    let mut s = String::from("#!/bin/sh\n");
    s.push_str(&header(
        Profile::TpuVm,
        "The TPU runtime's environment, at every boot (xpu-tpu-env.service).",
    ));
    s.push_str(
        r#"set -eu
ensure() { grep -qxF "$1" /etc/environment 2>/dev/null || echo "$1" >> /etc/environment; }
ensure CLOUDSDK_PYTHON=/usr/bin/python3
ensure GCS_RESOLVE_REFRESH_SECS=60
ensure GCS_REQUEST_CONNECTION_TIMEOUT_SECS=300
ensure GCS_METADATA_REQUEST_TIMEOUT_SECS=300
ensure GCS_READ_REQUEST_TIMEOUT_SECS=300
ensure GCS_WRITE_REQUEST_TIMEOUT_SECS=600
home=/home/tpu-runtime
mkdir -p "$home"
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
curl -sSf -H 'Metadata-Flavor: Google' \
  'http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env' -o "$tmp"
xpu host metadata-env --input "$tmp" --output "$home/tpu-env"
"#,
    );
    s
}

/// The unit that runs [`tpu_env_script`]. The Debian package ships the same text
/// (`packaging/systemd/xpu-tpu-env.service`, compared by xpu's packaging test); the condition
/// makes it a no-op where `xpu host apply --profile tpu-vm` has not written the script.
fn tpu_env_unit() -> String {
    format!(
        "# Written by xpu (profile tpu-vm).\n[Unit]\nDescription=TPU runtime environment from the tpu-env metadata (xpu)\nWants=network-online.target\nAfter=network-online.target\nConditionFileIsExecutable={TPU_ENV_SCRIPT}\n\n[Service]\nType=oneshot\nExecStart={TPU_ENV_SCRIPT}\n\n[Install]\nWantedBy=multi-user.target\n"
    )
}

/// Activation commands for the rendered files, in a safe order.
fn commands_for(files: &[HostFile]) -> Vec<String> {
    let has = |p: &str| files.iter().any(|f| f.path == p);
    let mut c = Vec::new();
    if has(MODULES_LOAD_VFIO) {
        c.push("modprobe -a vfio vfio_iommu_type1 vfio_pci".to_owned());
    }
    if has(MODULES_LOAD_CONTAINER) {
        c.push(format!("sh -c 'grep -v \"^#\" {MODULES_LOAD_CONTAINER} | xargs -r modprobe -a'"));
    }
    if has(UDEV_RULES) {
        c.push("udevadm control --reload-rules".to_owned());
        c.push("udevadm trigger --subsystem-match=pci --action=add".to_owned());
    }
    if has(SYSCTL_FILE) {
        c.push("sysctl --system".to_owned());
    }
    if has(THP_TMPFILES) {
        c.push(format!("systemd-tmpfiles --create {THP_TMPFILES}"));
    }
    if has(TPU_ENV_UNIT) {
        c.push("systemctl daemon-reload".to_owned());
        c.push("systemctl enable --now xpu-tpu-env.service".to_owned());
    }
    if has(MODPROBE_VFIO) || has(MODPROBE_BLACKLIST) {
        c.push("sh -c 'if command -v update-initramfs >/dev/null; then update-initramfs -u; else dracut -f; fi'".to_owned());
    }
    if has(GRUB_DROPIN) || has(GRUB_DEFAULT) {
        c.push("sh -c 'if command -v update-grub >/dev/null; then update-grub; else grub2-mkconfig -o /boot/grub2/grub.cfg; fi'".to_owned());
    }
    c
}

/// The rendered files as one `#cloud-config` document: `write_files` with the same paths,
/// contents, permissions and owners, and the activation commands as `runcmd`.
pub fn cloud_init(r: &Rendered) -> Result<String, serde_norway::Error> {
    #[derive(Serialize)]
    struct WriteFile<'a> {
        path: &'a str,
        content: &'a str,
        permissions: String,
        owner: &'a str,
    }
    #[derive(Serialize)]
    struct CloudConfig<'a> {
        write_files: Vec<WriteFile<'a>>,
        runcmd: &'a [String],
    }
    let doc = CloudConfig {
        write_files: r
            .files
            .iter()
            .map(|f| WriteFile {
                path: &f.path,
                content: &f.content,
                permissions: format!("{:04o}", f.mode),
                owner: &f.owner,
            })
            .collect(),
        runcmd: &r.commands,
    };
    Ok(format!(
        "#cloud-config\n# Rendered by xpu host render --profile {}\n{}",
        r.profile,
        serde_norway::to_string(&doc)?
    ))
}

/// Writes the rendered files under `dir` (`dir/etc/...`), with their modes.
pub fn write_tree(r: &Rendered, dir: &Path) -> Result<(), ProvisionError> {
    let root = Root::new(dir).map_err(|e| ProvisionError::Io {
        action: "use output directory",
        path: dir.display().to_string(),
        error: std::io::Error::new(std::io::ErrorKind::NotFound, e.to_string()),
    })?;
    for f in &r.files {
        root.write_file(&f.path, f.content.as_bytes(), f.mode)?;
    }
    Ok(())
}

/// What happened (or, in a dry run, would happen) to one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileChange {
    pub path: String,
    /// `created`, `modified` or `unchanged`.
    pub action: &'static str,
    /// Host path of the backup of the previous content, when one was (or would be) made.
    pub backup: Option<String>,
    /// Unified diff of the change (empty when unchanged).
    pub diff: String,
}

/// The result of [`apply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApplyReport {
    pub profile: String,
    pub dry_run: bool,
    /// Kernel parameters merged into `/etc/default/grub`.
    pub kernel_params: Vec<String>,
    /// Those of `kernel_params` written for either CPU vendor because the vendor is unknown
    /// (an image root without `/proc`): the kernel applies them at boot on Intel only
    /// (`intel_iommu=...`) and ignores them on AMD.
    pub decided_at_boot: Vec<String>,
    pub files: Vec<FileChange>,
    pub commands: Vec<String>,
}

impl ApplyReport {
    pub fn changed(&self) -> bool {
        self.files.iter().any(|f| f.action != "unchanged")
    }
}

/// What to apply.
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    pub profile: Profile,
    /// Empty: the devices the profile is about on this host (see [`apply`]).
    pub devices: Vec<DeviceMatch>,
    pub cpu_vendor: Option<CpuVendor>,
    pub hugepages: Option<u64>,
    pub dry_run: bool,
}

/// The ids `apply` binds when none are given: on a vfio-host every accelerator plus the
/// non-bridge functions in their IOMMU groups (a GPU's audio function must go with it); on a
/// tpu-vm the TPUs with their subsystem ids (as the seed's rules match them), or the seed's ids
/// when the host shows none; on a container-host the accelerators (for their drivers).
pub fn devices_from_inventory(profile: Profile, inv: &Inventory) -> Vec<DeviceMatch> {
    let id = |d: &xpu_core::PciDevice, sub: bool| {
        Some(DeviceMatch {
            vendor: d.vendor_id?,
            device: d.device_id?,
            subsystem: if sub {
                Some((d.subsystem_vendor_id?, d.subsystem_device_id?))
            } else {
                None
            },
        })
    };
    let mut out: BTreeSet<DeviceMatch> = BTreeSet::new();
    match profile {
        Profile::VfioHost => {
            let groups: BTreeSet<u32> = inv.accelerators().filter_map(|d| d.iommu_group).collect();
            for d in &inv.devices {
                let peer = !d.is_bridge() && d.iommu_group.is_some_and(|g| groups.contains(&g));
                if d.kind.is_accelerator() || peer {
                    out.extend(id(d, false));
                }
            }
        }
        Profile::TpuVm => {
            out.extend(inv.of_kind(DeviceKind::Tpu).filter_map(|d| id(d, true)));
            if out.is_empty() {
                out.extend(SEED_TPU_IDS);
            }
        }
        Profile::ContainerHost | Profile::All => {
            out.extend(inv.accelerators().filter_map(|d| id(d, false)));
        }
    }
    out.into_iter().collect()
}

/// Writes the profile's files under `root` (the grub parameters merged into
/// `/etc/default/grub` rather than a drop-in), backing up every file it changes. Unchanged
/// files are not touched, so a second run reports no changes.
pub fn apply(
    root: &Root,
    inv: &Inventory,
    opts: &ApplyOptions,
) -> Result<ApplyReport, ProvisionError> {
    let p = opts.profile;
    if p == Profile::All {
        return Err(ProvisionError::AllProfile);
    }
    let devices =
        if opts.devices.is_empty() { devices_from_inventory(p, inv) } else { opts.devices.clone() };
    let vendor =
        opts.cpu_vendor.or_else(|| CpuVendor::from_inventory(inv.host.cpu_vendor.as_deref()));
    let (intel, amd) = (p.kernel_params(CpuVendor::Intel), p.kernel_params(CpuVendor::Amd));
    let (params, decided_at_boot): (Vec<&str>, Vec<String>) = match vendor {
        Some(v) => (p.kernel_params(v), Vec::new()),
        None if intel == amd => (intel, Vec::new()),
        // No vendor and nothing to ask (an image being built has no /proc; an error reading
        // it counts as having one), or tpu-vm, whose seed writes the same line on every host:
        // the Intel set, which is the AMD set plus `intel_iommu=...` only. That option is read
        // only by the VT-d driver (drivers/iommu/intel/iommu.c), which does nothing on a
        // machine without a DMAR table, so an AMD host boots with it ignored and its IOMMU
        // enabled by default (IVRS); `amd_iommu=on` is not written, the kernel has no such
        // value (kernel-parameters.txt). Which of them takes effect is decided at boot.
        None if p == Profile::TpuVm || !root.exists("/proc/cpuinfo").unwrap_or(true) => {
            let boot = intel.iter().filter(|q| !amd.contains(q)).map(|q| (*q).to_owned());
            let boot = boot.collect();
            (intel, boot)
        }
        None => return Err(ProvisionError::UnknownCpuVendor),
    };
    // Drivers the host's own devices would be claimed by (modules.alias), so vfio-pci loads
    // before each of them.
    let extra_drivers: Vec<String> = inv
        .devices
        .iter()
        .filter(|d| devices.iter().any(|m| m.matches(d)))
        .flat_map(|d| d.kernel_modules.clone().unwrap_or_default())
        .collect();
    if p == Profile::VfioHost && devices.is_empty() {
        return Err(ProvisionError::NeedsDevices);
    }
    let rendered = render(&RenderOptions {
        profile: p,
        devices,
        cpu_vendor: vendor,
        hugepages: opts.hugepages,
        extra_drivers,
    })?;

    let mut report = ApplyReport {
        profile: p.to_string(),
        dry_run: opts.dry_run,
        kernel_params: params.iter().map(|s| (*s).to_owned()).collect(),
        decided_at_boot,
        files: Vec::new(),
        commands: Vec::new(),
    };
    let mut staged: Vec<(String, String, u32)> = Vec::new();
    for f in rendered.files.iter().filter(|f| f.path != GRUB_DROPIN) {
        staged.push((f.path.clone(), f.content.clone(), f.mode));
    }
    if !params.is_empty() {
        let existing = read_existing(root, GRUB_DEFAULT)?;
        let (text, mode) = existing.as_ref().map_or(("", 0o644), |(t, m)| (t.as_str(), *m));
        let merged = grub::merge(text, &params, GRUB_DEFAULT)?;
        staged.push((GRUB_DEFAULT.to_owned(), merged.content, mode));
    }
    let mut written: Vec<HostFile> = Vec::new();
    for (path, content, mode) in staged {
        report.files.push(stage_and_write(root, &path, &content, mode, opts.dry_run)?);
        written.push(HostFile::new(&path, mode, content));
    }
    report.commands = commands_for(&written);
    Ok(report)
}

/// The file at `path` under `root` as text with its mode, read without following a link out
/// of the root ([`Root::read_file`]).
fn read_existing(root: &Root, path: &str) -> Result<Option<(String, u32)>, ProvisionError> {
    let Some(f) = root.read_file(path)? else { return Ok(None) };
    let text = String::from_utf8(f.bytes).map_err(|e| ProvisionError::Io {
        action: "read",
        path: path.to_owned(),
        error: std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()),
    })?;
    Ok(Some((text, f.mode)))
}

/// Compares `content` with the file at `path` under `root`; unless `dry_run`, backs the old
/// file up and writes the new one when they differ (or the mode does). Every read and write
/// stays inside the root (see [`crate::root`]); a dry run reads exactly what a real run would.
pub fn stage_and_write(
    root: &Root,
    path: &str,
    content: &str,
    mode: u32,
    dry_run: bool,
) -> Result<FileChange, ProvisionError> {
    let existing = read_existing(root, path)?;
    if existing.as_ref().is_some_and(|(text, m)| text == content && *m == mode) {
        return Ok(FileChange {
            path: path.to_owned(),
            action: "unchanged",
            backup: None,
            diff: String::new(),
        });
    }
    let diff = textdiff::unified(
        existing.as_ref().map(|(text, _)| text.as_str()),
        Some(content),
        &format!("a{path}"),
        &format!("b{path}"),
    );
    let backup = match &existing {
        Some(_) => Some(backup_name(root, path)?),
        None => None,
    };
    if !dry_run {
        if let (Some(b), Some((old, old_mode))) = (&backup, &existing) {
            // A new file (O_EXCL | O_NOFOLLOW) with the content just read, never a copy
            // through whatever link might sit at the backup's name.
            root.create_file(b, old.as_bytes(), *old_mode)?;
        }
        root.write_file(path, content.as_bytes(), mode)?;
    }
    let action = if backup.is_some() { "modified" } else { "created" };
    Ok(FileChange { path: path.to_owned(), action, backup, diff })
}

/// `<path>.xpu-bak` the first time (the original is kept for good), then `.xpu-bak.1`, `.2`...
/// A name taken by anything, a dangling link included, is skipped.
fn backup_name(root: &Root, path: &str) -> Result<String, ProvisionError> {
    let first = format!("{path}.xpu-bak");
    if !root.exists(&first)? {
        return Ok(first);
    }
    for n in 1u32.. {
        let p = format!("{first}.{n}");
        if !root.exists(&p)? {
            return Ok(p);
        }
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_parse_and_print() {
        let d: DeviceMatch = "10de:20B0".parse().unwrap();
        assert_eq!(d.to_string(), "10de:20b0");
        let t: DeviceMatch = "1ae0:0062:1ae0:00ad".parse().unwrap();
        assert_eq!(t.subsystem, Some((0x1ae0, 0x00ad)));
        for bad in ["10de", "10de:", "10de:20b0:1", "10de:2zb0", "10de:20b00", ""] {
            let e = bad.parse::<DeviceMatch>().unwrap_err();
            assert!(e.to_string().contains("expected VENDOR:DEVICE"), "{bad}: {e}");
        }
    }

    #[test]
    fn tpu_vm_renders_the_seed_rules_for_its_ids() {
        let r = render(&RenderOptions::new(Profile::TpuVm)).unwrap();
        let rules = &r.file(UDEV_RULES).unwrap().content;
        assert!(rules.contains("ATTR{vendor}==\"0x1ae0\", ATTR{device}==\"0x0062\", ATTR{subsystem_vendor}==\"0x1ae0\", ATTR{subsystem_device}==\"0x00ad\", DRIVER!=\"vfio-pci\", TAG+=\"xpu_vfio_pci\""), "{rules}");
        assert!(rules.contains("SUBSYSTEM==\"vfio\", MODE=\"0666\""));
        assert!(rules.contains("KERNEL==\"accel*\", MODE=\"0666\""));
        assert!(r.file(MODPROBE_BLACKLIST).is_none());
        let limits = &r.file(LIMITS_FILE).unwrap().content;
        assert!(limits.contains("root  hard  nofile   100000"), "{limits}");
        assert_eq!(r.file(BIND_SCRIPT).unwrap().mode, 0o755);
        let grub = &r.file(GRUB_DROPIN).unwrap().content;
        assert!(grub.contains("intel_iommu=on,sm_on"), "{grub}");
    }

    #[test]
    fn vfio_host_needs_devices_and_blacklists_nouveau_for_nvidia() {
        assert!(matches!(
            render(&RenderOptions::new(Profile::VfioHost)),
            Err(ProvisionError::NeedsDevices)
        ));
        assert!(matches!(
            render(&RenderOptions::new(Profile::All)),
            Err(ProvisionError::AllProfile)
        ));
        let mut o = RenderOptions::new(Profile::VfioHost);
        o.devices = vec!["10de:20b0".parse().unwrap(), "10de:1aef".parse().unwrap()];
        o.cpu_vendor = Some(CpuVendor::Amd);
        let r = render(&o).unwrap();
        let m = &r.file(MODPROBE_VFIO).unwrap().content;
        assert!(m.contains("options vfio-pci ids=10de:1aef,10de:20b0\n"), "{m}");
        assert!(m.contains("softdep nouveau pre: vfio-pci\nsoftdep nvidia pre: vfio-pci\n"), "{m}");
        assert!(r.file(MODPROBE_BLACKLIST).unwrap().content.contains("blacklist nouveau"));
        assert!(r.file(GRUB_DROPIN).unwrap().content.contains("xpu_params=\"iommu=pt\""));
        assert!(!r.file(UDEV_RULES).unwrap().content.contains("MODE="));
    }
}
