//! Which devices a device plugin advertises: `--resource NAME=SELECTOR`.
//!
//! Grammar (documented in docs/containers.md):
//!
//! ```text
//! RESOURCE = NAME "=" TERM { "," TERM }
//! NAME     = DOMAIN "/" RESOURCE-NAME          e.g. nvidia.com/gpu (a Kubernetes extended resource)
//! TERM     = "vendor:" HEX4                    PCI vendor id, e.g. vendor:10de
//!          | "device:" HEX4                    PCI device id, e.g. device:20b0
//!          | "kind:" (gpu|tpu|npu|nvswitch|other)
//!          | "driver:" NAME                    bound kernel driver, e.g. driver:vfio-pci
//!          | "driver:!" NAME                   any driver but NAME, e.g. driver:!vfio-pci
//! ```
//!
//! A resource whose terms include `driver:vfio-pci` is a VFIO resource: its devices go to VMs,
//! and `Allocate` answers as KubeVirt's `permittedHostDevices` with `externalResourceProvider`
//! expects ([`kubevirt_env`]). `--vfio` adds one per GPU model ([`Resource::vfio_for`]):
//! `xpu.dev/<model>-vfio`.
//!
//! A device is selected when every term matches. The defaults are `nvidia.com/gpu=vendor:10de,kind:gpu`,
//! `google.com/tpu=vendor:1ae0,kind:tpu` and `amd.com/gpu=vendor:1002,kind:gpu`.

use std::fmt;
use std::str::FromStr;

use xpu_core::{DeviceKind, PciDevice};

/// One selector term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Term {
    Vendor(u16),
    Device(u16),
    Kind(DeviceKind),
    Driver(String),
    NotDriver(String),
}

/// A resource to advertise and the devices that make it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub name: String,
    pub terms: Vec<Term>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid --resource {input:?}: {reason}; expected NAME=TERM[,TERM...] such as nvidia.com/gpu=vendor:10de,kind:gpu (terms: vendor:HEX4, device:HEX4, kind:KIND, driver:NAME)"
)]
pub struct SelectorError {
    pub input: String,
    pub reason: String,
}

impl Resource {
    /// [`Resource::defaults`] with GPUs offered as shares ([`crate::deviceplugin::SHARE_RESOURCE`],
    /// every GPU whatever its vendor) instead of whole (`nvidia.com/gpu`, `amd.com/gpu`).
    pub fn share_defaults() -> Vec<Resource> {
        let mut r = Self::defaults();
        r.retain(|r| !r.name.ends_with("/gpu"));
        r.extend(format!("{}=kind:gpu", crate::deviceplugin::SHARE_RESOURCE).parse().ok());
        r
    }

    pub fn matches(&self, d: &PciDevice) -> bool {
        self.terms.iter().all(|t| match t {
            Term::Vendor(v) => d.vendor_id == Some(*v),
            Term::Device(v) => d.device_id == Some(*v),
            Term::Kind(k) => d.kind == *k,
            Term::Driver(n) => d.driver.as_deref() == Some(n.as_str()),
            Term::NotDriver(n) => d.driver.as_deref() != Some(n.as_str()),
        })
    }

    /// Whether the resource's devices are on `vfio-pci`, for VMs.
    pub fn is_vfio(&self) -> bool {
        self.terms.iter().any(|t| matches!(t, Term::Driver(n) if n == VFIO_DRIVER))
    }

    /// [`Resource::defaults`] with the GPU resources kept off devices on `vfio-pci` (those go
    /// to VMs), and one VFIO resource per GPU model of `inv` ([`vfio_name`]): `vendor`, `device`
    /// and `driver:vfio-pci`.
    pub fn vfio_for(inv: &xpu_core::Inventory) -> Vec<Resource> {
        let mut out = Self::defaults();
        // TPUs are on vfio-pci for containers too (their runtime opens the group): they stay.
        for r in out.iter_mut().filter(|r| r.terms.contains(&Term::Kind(DeviceKind::Gpu))) {
            r.terms.push(Term::NotDriver(VFIO_DRIVER.to_owned()));
        }
        let mut models: Vec<(u16, u16)> = inv
            .devices
            .iter()
            .filter(|d| d.kind == DeviceKind::Gpu)
            .filter_map(|d| d.vendor_id.zip(d.device_id))
            .collect();
        models.sort_unstable();
        models.dedup();
        for (vendor, device) in models {
            let name = vfio_name(vendor, device);
            if out.iter().all(|r| r.name != name) {
                out.push(Resource {
                    name,
                    terms: vec![
                        Term::Vendor(vendor),
                        Term::Device(device),
                        Term::Driver(VFIO_DRIVER.to_owned()),
                    ],
                });
            }
        }
        out
    }

    /// The socket file name in the plugin directory: `xpu-nvidia.com-gpu.sock`.
    pub fn socket_name(&self) -> String {
        format!("xpu-{}.sock", self.name.replace('/', "-"))
    }

    /// `nvidia.com/gpu`, `google.com/tpu`, `amd.com/gpu`.
    pub fn defaults() -> Vec<Resource> {
        [
            "nvidia.com/gpu=vendor:10de,kind:gpu",
            "google.com/tpu=vendor:1ae0,kind:tpu",
            "amd.com/gpu=vendor:1002,kind:gpu",
        ]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect()
    }
}

const VFIO_DRIVER: &str = "vfio-pci";

/// `xpu.dev/<model>-vfio`: the model as xpu's table names it, lower case
/// (`xpu.dev/h100-sxm5-80gb-vfio`), or the PCI ids of a model it does not know
/// (`xpu.dev/10de-2330-vfio`).
pub fn vfio_name(vendor: u16, device: u16) -> String {
    let model = match xpu_core::accel::lookup(vendor, device) {
        Some(a) => a
            .product
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
            .collect::<String>()
            .trim_matches('-')
            .to_owned(),
        None => format!("{vendor:04x}-{device:04x}"),
    };
    format!("xpu.dev/{model}-vfio")
}

/// The variable KubeVirt's virt-launcher reads a host-device resource's PCI addresses from:
/// `PCI_RESOURCE_` and the resource name upper-cased with `/` and `.` made `_`
/// (`xpu.dev/h100-sxm5-80gb-vfio` → `PCI_RESOURCE_XPU_DEV_H100-SXM5-80GB-VFIO`); the value is
/// the addresses joined by `,`.
pub fn kubevirt_env(resource: &str) -> String {
    format!("PCI_RESOURCE_{}", resource.to_ascii_uppercase().replace(['/', '.'], "_"))
}

fn hex4(s: &str) -> Option<u16> {
    (s.len() == 4).then(|| u16::from_str_radix(s, 16).ok()).flatten()
}

fn valid_name(name: &str) -> bool {
    let Some((domain, res)) = name.split_once('/') else { return false };
    let label_ok = |s: &str, extra: &[u8]| {
        !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || extra.contains(&b))
            && s.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
            && s.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric)
    };
    domain.len() <= 253
        && domain.bytes().all(|b| !b.is_ascii_uppercase())
        && label_ok(domain, b"-.")
        && res.len() <= 63
        && label_ok(res, b"-_.")
}

impl FromStr for Resource {
    type Err = SelectorError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason: String| SelectorError { input: input.to_owned(), reason };
        let (name, sel) = input.split_once('=').ok_or_else(|| err("missing '='".to_owned()))?;
        if !valid_name(name) {
            return Err(err(format!(
                "resource name {name:?} is not DOMAIN/NAME (a Kubernetes extended resource name)"
            )));
        }
        let mut terms = Vec::new();
        for t in sel.split(',') {
            let (k, v) =
                t.split_once(':').ok_or_else(|| err(format!("term {t:?} is not KEY:VALUE")))?;
            terms.push(match k {
                "vendor" => Term::Vendor(
                    hex4(v).ok_or_else(|| err(format!("vendor {v:?} is not 4 hex digits")))?,
                ),
                "device" => Term::Device(
                    hex4(v).ok_or_else(|| err(format!("device {v:?} is not 4 hex digits")))?,
                ),
                "kind" => Term::Kind(v.parse().map_err(err)?),
                "driver" if v.len() > 1 && v.starts_with('!') => Term::NotDriver(v[1..].to_owned()),
                "driver" if !v.is_empty() && !v.starts_with('!') => Term::Driver(v.to_owned()),
                _ => return Err(err(format!("unknown term {t:?}"))),
            });
        }
        Ok(Resource { name: name.to_owned(), terms })
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let terms: Vec<String> = self
            .terms
            .iter()
            .map(|t| match t {
                Term::Vendor(v) => format!("vendor:{v:04x}"),
                Term::Device(v) => format!("device:{v:04x}"),
                Term::Kind(k) => format!("kind:{k}"),
                Term::Driver(d) => format!("driver:{d}"),
                Term::NotDriver(d) => format!("driver:!{d}"),
            })
            .collect();
        write!(f, "{}={}", self.name, terms.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_round_trips() {
        let r: Resource = "nvidia.com/gpu=vendor:10de,kind:gpu,driver:nvidia".parse().unwrap();
        assert_eq!(r.terms.len(), 3);
        assert_eq!(r.to_string(), "nvidia.com/gpu=vendor:10de,kind:gpu,driver:nvidia");
        assert_eq!(r.socket_name(), "xpu-nvidia.com-gpu.sock");
        assert_eq!(Resource::defaults().len(), 3);
        let shared: Vec<String> =
            Resource::share_defaults().iter().map(|r| r.name.clone()).collect();
        assert_eq!(shared, ["google.com/tpu", "xpu.dev/gpu-milli"]);
    }

    /// KubeVirt's rule for the variable (its `ResourceNameToEnvVar`): upper case, `/` and `.`
    /// to `_`, nothing else changed, after `PCI_RESOURCE_`.
    #[test]
    fn kubevirt_reads_the_addresses_under_its_own_name_for_the_resource() {
        assert_eq!(
            kubevirt_env("nvidia.com/GP102GL_Tesla_P40"),
            "PCI_RESOURCE_NVIDIA_COM_GP102GL_TESLA_P40"
        );
        assert_eq!(
            kubevirt_env(&vfio_name(0x10de, 0x2330)),
            format!("PCI_RESOURCE_XPU_DEV_{}-VFIO", "H100-SXM5-80GB")
        );
        assert_eq!(vfio_name(0x10de, 0x20b0), "xpu.dev/a100-sxm4-40gb-vfio");
        assert_eq!(vfio_name(0x1234, 0xabcd), "xpu.dev/1234-abcd-vfio");
        let r: Resource = "xpu.dev/x=vendor:10de,driver:vfio-pci".parse().unwrap();
        assert!(r.is_vfio());
        let r: Resource = "nvidia.com/gpu=vendor:10de,driver:!vfio-pci".parse().unwrap();
        assert!(!r.is_vfio());
        assert_eq!(r.to_string(), "nvidia.com/gpu=vendor:10de,driver:!vfio-pci");
        assert!("nvidia.com/gpu=driver:!".parse::<Resource>().is_err());
    }

    #[test]
    fn rejects_with_the_grammar() {
        for bad in [
            "nvidia.com/gpu",
            "gpu=vendor:10de",
            "Nvidia.com/gpu=vendor:10de",
            "nvidia.com/gpu=vendor:10d",
            "nvidia.com/gpu=kind:fpga",
            "nvidia.com/gpu=color:red",
            "nvidia.com/gpu=vendor",
        ] {
            let e = bad.parse::<Resource>().unwrap_err().to_string();
            assert!(e.contains("expected NAME=TERM"), "{bad}: {e}");
        }
    }
}
