//! Reading (and, in later modules, changing) a host. Every function takes a [`Root`]: `/` in
//! production, a fixture tree in tests, so both run the same code path.
//!
//! - [`root`]: the path prefix everything is read under.
//! - [`discover`]: PCI functions from sysfs into an [`xpu_core::Inventory`].
//! - [`pciids`]: vendor/device/class names from the PCI ID database, offline.
//! - [`modalias`]: which kernel modules claim a device (`modules.alias`).
//! - [`devnode`]: `stat` of `/dev` nodes (type, major, minor, mode).

pub mod devnode;
pub mod discover;
pub mod modalias;
pub mod pciids;
pub mod root;

pub use discover::{DiscoverError, DiscoverOptions, Scope, discover};
pub use root::{Root, RootError};
