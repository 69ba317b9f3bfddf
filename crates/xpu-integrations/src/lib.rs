//! Adapters between xpu and the engines users already run. Each consumes an
//! [`xpu_core::Inventory`] (never sysfs directly, except through `xpu-host` under a `Root`):
//!
//! - [`deviceplugin`]: the kubelet device plugin API v1beta1 over gRPC on a Unix socket, one
//!   plugin per resource (`nvidia.com/gpu`, `google.com/tpu`, `amd.com/gpu`), with health,
//!   NUMA topology, topology-aware preferred allocation and CDI device names.
//! - [`testkubelet`]: the kubelet's side of that API (its `Registration` service and a
//!   `DevicePlugin` client), small enough for tests and the benchmark to drive a plugin exactly
//!   as a kubelet would.
//! - [`nfd`]: Node Feature Discovery local feature files.
//! - [`novaconf`]: the `nova.conf` `[pci]` entries, scheduler filters and flavor commands for this
//!   host, and `nova.conf` parsing for the "does this flavor fit" check.
//! - [`cdi`]: the CDI device names `Allocate` returns, from `xpu-container`'s naming convention.

pub mod cdi;
pub mod deviceplugin;
pub mod nfd;
pub mod novaconf;
pub mod numa;
pub mod preferred;
pub mod selector;
pub mod testkubelet;
pub mod transport;

/// Code generated from `proto/deviceplugin/v1beta1/api.proto` (package `v1beta1`).
#[allow(clippy::all, clippy::pedantic, missing_docs, unused_qualifications, clippy::unwrap_used)]
pub mod pb {
    tonic::include_proto!("v1beta1");
}
