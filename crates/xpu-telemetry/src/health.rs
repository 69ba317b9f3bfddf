//! When a device stops being fit for work, and when it is fit again.
//!
//! A device becomes unhealthy, with a reason, on:
//! - an XID listed in [`RESET_XIDS`];
//! - new uncorrectable memory errors (NVML volatile DBE count, amdgpu RAS `ue`) since the
//!   previous read;
//! - the source losing it (NVML `GPU_IS_LOST`);
//! - the device vanishing from the inventory.
//!
//! It recovers only when the source says so: a reset reported by the source (for XIDs and ECC
//! errors), the source reaching it again (lost), or the device coming back (vanished). A device
//! that merely reads normally after an XID stays unhealthy: NVIDIA's guidance for those XIDs is
//! a reset before further use.

use std::collections::BTreeMap;

use xpu_core::PciAddress;

use crate::Reading;

/// XIDs after which a GPU must not take new work until it is reset, with NVIDIA's description.
///
/// Source: NVIDIA's Xid catalog ("Analyzing Xid Errors with the Xid Catalog",
/// docs.nvidia.com/deploy/xid-errors), the entries whose immediate action is a GPU reset or a
/// node reboot. XIDs whose action is restarting the application (13, 31, 43, 45 and the like:
/// faults of one program) are not here: the GPU itself is fine.
pub const RESET_XIDS: &[(u64, &str)] = &[
    (48, "double-bit ECC error"),
    (62, "internal micro-controller halt"),
    (64, "ECC page retirement or row remapper recording failure"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
    (140, "unrecovered ECC error"),
];

/// The reason an XID makes a device unhealthy, or `None` for XIDs that do not.
pub fn xid_reason(xid: u64) -> Option<String> {
    RESET_XIDS.iter().find(|(x, _)| *x == xid).map(|(x, what)| format!("xid {x}: {what}"))
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct DeviceHealth {
    /// Set by an XID or ECC error; cleared only by a reset.
    sticky: Option<String>,
    /// The source cannot reach the device right now.
    lost: bool,
    last_uncorrected: Option<u64>,
    /// Cumulative XID count and the last XID (DCGM's `DCGM_FI_DEV_XID_ERRORS` is the last one).
    xid_count: u64,
    last_xid: Option<u64>,
}

/// Health of every device ever seen on this node.
#[derive(Debug, Clone, Default)]
pub struct HealthBook {
    devices: BTreeMap<PciAddress, DeviceHealth>,
}

impl HealthBook {
    /// Folds one reading in. Returns the new reason when the device just became unhealthy.
    pub fn observe(&mut self, addr: PciAddress, r: &Reading) -> Option<String> {
        let h = self.devices.entry(addr).or_default();
        let was = reason_of(h);
        if r.reset {
            h.sticky = None;
            h.last_uncorrected = None;
        }
        h.lost = r.lost;
        for &xid in &r.xids {
            h.xid_count += 1;
            h.last_xid = Some(xid);
            if let Some(reason) = xid_reason(xid) {
                h.sticky = Some(reason);
            }
        }
        if let Some(now) = r.ecc_uncorrected {
            match h.last_uncorrected {
                Some(before) if now > before => {
                    h.sticky = Some(format!("{} new uncorrectable memory errors", now - before));
                }
                // A lower count means the volatile counters were cleared: a driver reload or
                // reset; the baseline starts again.
                _ => {}
            }
            h.last_uncorrected = Some(now);
        }
        let is = reason_of(h);
        if is.is_some() && is != was { is } else { None }
    }

    /// `None` when healthy, else why not. `present` is whether the inventory still has it.
    pub fn reason(&self, addr: &PciAddress, present: bool) -> Option<String> {
        if !present {
            return Some("vanished from the PCI bus".to_owned());
        }
        self.devices.get(addr).and_then(reason_of)
    }

    /// Every device a source reported that is unhealthy now, with why (vanished devices are
    /// the collector's to add: it knows the inventory).
    pub fn unhealthy(&self) -> BTreeMap<PciAddress, String> {
        self.devices.iter().filter_map(|(a, h)| reason_of(h).map(|r| (*a, r))).collect()
    }

    /// (number of XIDs seen, last XID).
    pub fn xids(&self, addr: &PciAddress) -> (u64, Option<u64>) {
        self.devices.get(addr).map(|h| (h.xid_count, h.last_xid)).unwrap_or((0, None))
    }
}

fn reason_of(h: &DeviceHealth) -> Option<String> {
    if h.lost {
        return Some("lost: the driver cannot reach it".to_owned());
    }
    h.sticky.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> PciAddress {
        PciAddress { domain: 0, bus: 0x25, device: 0, function: 0 }
    }

    #[test]
    fn xid_79_sticks_until_the_source_reports_a_reset() {
        let mut b = HealthBook::default();
        let a = addr();
        assert_eq!(b.observe(a, &Reading::default()), None);
        let r = Reading { xids: vec![13], ..Reading::default() };
        assert_eq!(b.observe(a, &r), None, "an application fault leaves the GPU healthy");
        let r = Reading { xids: vec![79], ..Reading::default() };
        assert_eq!(b.observe(a, &r).as_deref(), Some("xid 79: GPU has fallen off the bus"));
        assert!(b.reason(&a, true).is_some());
        b.observe(a, &Reading::default());
        assert!(b.reason(&a, true).is_some(), "a normal read is not a recovery");
        b.observe(a, &Reading { reset: true, ..Reading::default() });
        assert_eq!(b.reason(&a, true), None);
        assert_eq!(b.xids(&a), (2, Some(79)));
    }

    #[test]
    fn new_uncorrectable_errors_count_from_the_first_read() {
        let mut b = HealthBook::default();
        let a = addr();
        let r = |n| Reading { ecc_uncorrected: Some(n), ..Reading::default() };
        assert_eq!(b.observe(a, &r(5)), None, "errors before the exporter started are history");
        assert_eq!(b.observe(a, &r(5)), None);
        assert_eq!(b.observe(a, &r(7)).as_deref(), Some("2 new uncorrectable memory errors"));
        assert!(b.reason(&a, false).is_some_and(|r| r.contains("vanished")));
    }
}
