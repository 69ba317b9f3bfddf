//! CDI device names for the device plugin's `Allocate` answers, from the one naming convention
//! the project shares ([`xpu_container::cdi::device_names`], which `xpu cdi generate` writes
//! specs for): `nvidia.com/gpu`, `google.com/tpu` and `amd.com/gpu` devices named `0`..`N-1` in
//! PCI address order (container-device-interface `SPEC.md`: a fully qualified name is
//! `vendor.com/class=name`).
//!
//! The kubelet passes these names to the container runtime (`cdi_devices` in the `Allocate`
//! response), which resolves them against the spec files in `/etc/cdi` or `/var/run/cdi`.

use std::collections::HashMap;

use xpu_core::{Inventory, PciAddress};

/// The index name (`nvidia.com/gpu=3`) of every device that has one, by address.
pub fn names(inv: &Inventory) -> HashMap<PciAddress, String> {
    xpu_container::cdi::device_names(inv)
        .into_iter()
        // Index names only: `GPU-<uuid>` and `all` are aliases of the same devices.
        .filter(|d| d.name.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|d| Some((d.address?, d.qualified())))
        .collect()
}

#[cfg(test)]
mod tests {
    use xpu_container::cdi::{CdiKind, resolve};
    use xpu_host::{DiscoverOptions, Root};
    use xpu_testkit::hosts;

    #[test]
    fn names_resolve_back_to_their_device_in_the_cdi_specs() {
        for spec in [hosts::a100_8x(), hosts::tpu_v5p(), hosts::mi300x(), hosts::sriov()] {
            let fx = spec.build();
            let inv =
                xpu_host::discover(&Root::new(fx.root()).unwrap(), &DiscoverOptions::default())
                    .unwrap();
            let names = super::names(&inv);
            assert!(!names.is_empty(), "{}", spec.name);
            for (addr, name) in &names {
                let (kind, idx) = name.split_once('=').unwrap();
                let kind = CdiKind::from_kind(kind).unwrap();
                let devs = resolve(&inv, kind, idx).unwrap();
                assert_eq!(inv.devices[devs[0]].address, *addr, "{name}");
            }
        }
    }
}
