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
//! - [`drapb`]: the kubelet's DRA plugin service (`dra/v1`, `dra/v1beta1`) and plugin
//!   registration (`pluginregistration/v1`) generated from their protos, and
//!   [`drakubelet`], the kubelet's side of both for tests and benchmarks (the driver itself,
//!   which needs the API server, is `xpu-kube`'s `dra`).
//! - [`exporter`]: `xpu exporter`, the Prometheus endpoint over `xpu-telemetry`, with pod
//!   attribution from the kubelet's PodResources API ([`podresources`], `v1`, and its test kubelet).
//! - [`tpuruntime`]: TPU chips' utilisation and HBM from the TPU runtime's metrics service
//!   (localhost:8431), as an `xpu-telemetry` source.
//! - [`cdi`]: the CDI device names `Allocate` returns, from `xpu-container`'s naming convention.
//! - [`transport`] and [`h2authority`]: every plugin socket (the DRA driver's too), served through
//!   a proxy that rewrites older kubelets' `:authority` and holds each client to [`limits`], the
//!   bounds (streams, header lists, messages, connections) every gRPC server here is built with;
//!   [`h2probe`], a raw HTTP/2 client that tests them.

pub mod cdi;
pub mod deviceplugin;
pub mod drakubelet;
pub mod exporter;
pub mod h2authority;
pub mod h2probe;
pub mod limits;
pub mod mps;
pub mod nfd;
pub mod novaconf;
pub mod numa;
pub mod podresources;
pub mod preferred;
pub mod selector;
pub mod testkubelet;
pub mod tpuruntime;
pub mod transport;

/// Code generated from `proto/deviceplugin/v1beta1/api.proto` (package `v1beta1`).
#[allow(clippy::all, clippy::pedantic, missing_docs, unused_qualifications, clippy::unwrap_used)]
pub mod pb {
    tonic::include_proto!("v1beta1");
}

/// Code generated from the kubelet's DRA and plugin registration protos.
pub mod drapb {
    /// `proto/dra/v1/api.proto` (package `k8s.io.kubelet.pkg.apis.dra.v1`, registered as
    /// `v1.DRAPlugin`).
    #[allow(
        clippy::all,
        clippy::pedantic,
        missing_docs,
        unused_qualifications,
        clippy::unwrap_used
    )]
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/dra_v1/k8s.io.kubelet.pkg.apis.dra.v1.rs"));
    }
    /// `proto/dra/v1beta1/api.proto` (package `k8s.io.kubelet.pkg.apis.dra.v1beta1`, registered
    /// as `v1beta1.DRAPlugin`).
    #[allow(
        clippy::all,
        clippy::pedantic,
        missing_docs,
        unused_qualifications,
        clippy::unwrap_used
    )]
    pub mod v1beta1 {
        include!(concat!(env!("OUT_DIR"), "/dra_v1beta1/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"));
    }
    /// `proto/drahealth/v1alpha1/api.proto` (package `v1alpha1`, `v1alpha1.DRAResourceHealth`).
    #[allow(
        clippy::all,
        clippy::pedantic,
        missing_docs,
        unused_qualifications,
        clippy::unwrap_used
    )]
    pub mod health {
        include!(concat!(env!("OUT_DIR"), "/drahealth_v1alpha1/v1alpha1.rs"));
    }
    /// `proto/pluginregistration/v1/api.proto` (package `pluginregistration`).
    #[allow(
        clippy::all,
        clippy::pedantic,
        missing_docs,
        unused_qualifications,
        clippy::unwrap_used
    )]
    pub mod registration {
        include!(concat!(env!("OUT_DIR"), "/pluginregistration_v1/pluginregistration.rs"));
    }

    /// What a DRA plugin lists in `PluginInfo.supported_versions` for each service it serves
    /// (`k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService` and its v1beta1 twin).
    pub const SERVICE_V1: &str = "v1.DRAPlugin";
    pub const SERVICE_V1BETA1: &str = "v1beta1.DRAPlugin";
    /// The device health service's name (`v1alpha1.DRAResourceHealth`).
    pub const SERVICE_HEALTH_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";
    /// `PluginInfo.type` of a DRA plugin (`pluginregistration.DRAPlugin`).
    pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
}

/// Code generated from `proto/podresources/v1/api.proto` (package `v1`, service
/// `v1.PodResourcesLister`).
#[allow(clippy::all, clippy::pedantic, missing_docs, unused_qualifications, clippy::unwrap_used)]
pub mod podresourcespb {
    include!(concat!(env!("OUT_DIR"), "/podresources_v1/v1.rs"));
}

/// Code generated from `proto/tpuruntime/metrics.proto` (package `tpu.monitoring.runtime`).
#[allow(clippy::all, clippy::pedantic, missing_docs, unused_qualifications, clippy::unwrap_used)]
pub mod tpuruntimepb {
    include!(concat!(env!("OUT_DIR"), "/tpuruntime/tpu.monitoring.runtime.rs"));
}
