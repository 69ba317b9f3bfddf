//! Which pod holds which device, from the kubelet's PodResources API (`v1`, gRPC on
//! `/var/lib/kubelet/pod-resources/kubelet.sock`), for the exporter's `pod`/`namespace`/
//! `container` labels.
//!
//! Device plugin devices are matched by id (xpu's device plugin uses the PCI address); DRA
//! devices of xpu's driver `xpu.dev` by device name (`gpu-0000-25-00-0`, the PCI address with
//! `-` for `:` and `.`). Other drivers' devices are not xpu's to label.
//!
//! [`TestKubelet`] is the kubelet's side, for tests: it serves `List` with pods the test sets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use xpu_core::PciAddress;
use xpu_telemetry::collect::{Collector, Holder};

use crate::podresourcespb::pod_resources_lister_client::PodResourcesListerClient;
use crate::podresourcespb::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use crate::podresourcespb::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, GetPodResourcesRequest,
    GetPodResourcesResponse, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use crate::transport;

/// The DRA driver name whose devices are xpu's.
const XPU_DRA_DRIVER: &str = "xpu.dev";
/// A kubelet answers `List` in milliseconds; one that does not within this is treated as down
/// for this round.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest `List` answer read (a node runs a few hundred pods at most).
const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// `0000:25:00.0` from a device plugin id, or from an `xpu.dev` DRA device name.
fn address_of(id: &str) -> Option<PciAddress> {
    id.parse().ok().or_else(|| PciAddress::from_dns_label_suffix(id))
}

/// The holders in a `List` answer, by device.
pub fn holders(resp: &ListPodResourcesResponse) -> BTreeMap<PciAddress, Holder> {
    let mut out = BTreeMap::new();
    for pod in &resp.pod_resources {
        for c in &pod.containers {
            let holder = || Holder::Pod {
                namespace: pod.namespace.clone(),
                pod: pod.name.clone(),
                container: c.name.clone(),
            };
            for d in &c.devices {
                for id in &d.device_ids {
                    if let Some(a) = address_of(id) {
                        out.insert(a, holder());
                    }
                }
            }
            for dr in &c.dynamic_resources {
                for cr in dr.claim_resources.iter().filter(|cr| cr.driver_name == XPU_DRA_DRIVER) {
                    if let Some(a) = address_of(&cr.device_name) {
                        out.insert(a, holder());
                    }
                }
            }
        }
    }
    out
}

/// One `List` call.
pub async fn list(socket: &Path) -> Result<ListPodResourcesResponse, String> {
    let call = async {
        let channel = transport::connect(socket).await.map_err(|e| e.to_string())?;
        let mut client =
            PodResourcesListerClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
        client
            .list(ListPodResourcesRequest {})
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| s.message().to_owned())
    };
    tokio::time::timeout(LIST_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {LIST_TIMEOUT:?}"))?
}

/// Polls `socket` every collector interval and hands the holders to `collector`. A missing
/// socket (not a Kubernetes node) is checked again each round without a warning; a failing
/// kubelet is warned about once until it answers again.
pub async fn poll(socket: PathBuf, collector: Collector) {
    let mut warned = false;
    loop {
        if socket.exists() {
            match list(&socket).await {
                Ok(resp) => {
                    collector.set_holders(holders(&resp));
                    warned = false;
                }
                Err(e) => {
                    if !warned {
                        tracing::warn!(
                            "pod-resources {}: {e}; devices are exported without their pods",
                            socket.display()
                        );
                        warned = true;
                    }
                    collector.set_holders(BTreeMap::new());
                }
            }
        }
        tokio::time::sleep(collector.interval()).await;
    }
}

/// The kubelet's PodResources service with pods a test sets.
#[derive(Debug, Clone, Default)]
pub struct TestKubelet {
    pub pods: Arc<Mutex<Vec<PodResources>>>,
}

#[tonic::async_trait]
impl PodResourcesLister for TestKubelet {
    async fn list(
        &self,
        _req: tonic::Request<ListPodResourcesRequest>,
    ) -> Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
        let pods = self.pods.lock().unwrap_or_else(PoisonError::into_inner).clone();
        Ok(tonic::Response::new(ListPodResourcesResponse { pod_resources: pods }))
    }

    async fn get_allocatable_resources(
        &self,
        _req: tonic::Request<AllocatableResourcesRequest>,
    ) -> Result<tonic::Response<AllocatableResourcesResponse>, tonic::Status> {
        Ok(tonic::Response::new(AllocatableResourcesResponse::default()))
    }

    async fn get(
        &self,
        req: tonic::Request<GetPodResourcesRequest>,
    ) -> Result<tonic::Response<GetPodResourcesResponse>, tonic::Status> {
        let r = req.into_inner();
        let pods = self.pods.lock().unwrap_or_else(PoisonError::into_inner);
        let pod = pods.iter().find(|p| p.name == r.pod_name && p.namespace == r.pod_namespace);
        match pod {
            Some(p) => {
                Ok(tonic::Response::new(GetPodResourcesResponse { pod_resources: Some(p.clone()) }))
            }
            None => Err(tonic::Status::not_found(format!(
                "pod {}/{} not found",
                r.pod_namespace, r.pod_name
            ))),
        }
    }
}

impl TestKubelet {
    /// Serves on `socket` until the task is dropped or aborted.
    pub fn serve(&self, socket: &Path) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let incoming = transport::bind(socket)?;
        // Answers as large as the client reads: the test kubelet plays a node with many pods.
        let svc = PodResourcesListerServer::new(self.clone())
            .max_decoding_message_size(crate::limits::MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        Ok(tokio::spawn(async move {
            if let Err(e) =
                crate::limits::server().add_service(svc).serve_with_incoming(incoming).await
            {
                tracing::warn!("test kubelet pod-resources: {e}");
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ids_and_dra_names_map_to_addresses() {
        let a: PciAddress = "0000:25:00.0".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(address_of("0000:25:00.0"), Some(a));
        assert_eq!(address_of("gpu-0000-25-00-0"), Some(a));
        assert_eq!(address_of("tpu-0000-25-00-0"), Some(a));
        assert_eq!(address_of("GPU-6f2b"), None);
        assert_eq!(address_of("gpu-0"), None);
    }
}
