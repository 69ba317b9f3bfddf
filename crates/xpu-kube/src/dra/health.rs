//! The kubelet's DRA device health service (`v1alpha1.DRAResourceHealth`, KEP 4680), served on
//! the driver's socket beside `DRAPlugin`: a stream of the health of every device the node's
//! pool publishes, which the kubelet (`ResourceHealthStatus`, beta and on in 1.37) writes into
//! the `allocatedResourcesStatus` of each container whose claim holds the device
//! (`claim:<claim>/<request>`, resource `<driver>/<pool>/<device>`).
//!
//! A device is unhealthy while the published pool taints it `xpu.dev/unhealthy` (telemetry's
//! XIDs, uncorrectable memory errors, a device that vanished: [`super::slices::taint_unhealthy`]),
//! with the taint's reason as the message; every other published device is healthy. Each
//! message holds the whole pool (a device left out turns Unknown after its timeout), sent when
//! anything changes and at least every [`REFRESH`], each report good for [`TIMEOUT`].

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use k8s_openapi::api::resource::v1::Device;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use xpu_integrations::drapb::health as pb;

use super::slices::UNHEALTHY_TAINT;

/// How often the whole pool is sent again when nothing changed.
pub const REFRESH: Duration = Duration::from_secs(20);
/// How long the kubelet trusts one report (three refreshes).
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// One published device and why it is unhealthy, if it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    pub device: String,
    pub unhealthy: Option<String>,
}

/// The health of every device of `devices` (the pool as published).
pub fn of(devices: &[Device]) -> Vec<DeviceHealth> {
    devices
        .iter()
        .map(|d| DeviceHealth {
            device: d.name.clone(),
            unhealthy: d
                .taints
                .iter()
                .flatten()
                .find(|t| t.key == UNHEALTHY_TAINT)
                .map(|t| t.value.clone().unwrap_or_default()),
        })
        .collect()
}

/// The service: the node's pool name and the pool's health as the slice loop last saw it.
pub struct Service {
    pub pool: String,
    pub health: watch::Receiver<Arc<Vec<DeviceHealth>>>,
}

fn message(pool: &str, health: &[DeviceHealth]) -> pb::NodeWatchResourcesResponse {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    pb::NodeWatchResourcesResponse {
        devices: health
            .iter()
            .map(|h| pb::DeviceHealth {
                device: Some(pb::DeviceIdentifier {
                    pool_name: pool.to_owned(),
                    device_name: h.device.clone(),
                }),
                health: if h.unhealthy.is_some() {
                    pb::HealthStatus::Unhealthy
                } else {
                    pb::HealthStatus::Healthy
                } as i32,
                last_updated_time: now,
                health_check_timeout_seconds: TIMEOUT.as_secs() as i64,
                message: h.unhealthy.clone().unwrap_or_default().chars().take(1024).collect(),
            })
            .collect(),
    }
}

type HealthStream =
    Pin<Box<dyn Stream<Item = Result<pb::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::dra_resource_health_server::DraResourceHealth for Service {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<pb::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let pool = self.pool.clone();
        let rx = self.health.clone();
        // The first message at once, then one per change or refresh; ends with the driver.
        let stream = futures_util::stream::unfold((rx, true), move |(mut rx, first)| {
            let pool = pool.clone();
            async move {
                if !first {
                    tokio::select! {
                        changed = rx.changed() => changed.ok()?,
                        () = tokio::time::sleep(REFRESH) => {}
                    }
                }
                let now = rx.borrow_and_update().clone();
                Some((Ok(message(&pool, &now)), (rx, false)))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use pb::dra_resource_health_server::DraResourceHealth;

    #[tokio::test]
    async fn the_stream_sends_the_whole_pool_at_once_and_again_on_a_change() {
        let healthy = |d: &str| DeviceHealth { device: d.into(), unhealthy: None };
        let (tx, rx) = watch::channel(Arc::new(vec![healthy("gpu-a"), healthy("gpu-b")]));
        let s = Service { pool: "node-a".into(), health: rx };
        let mut stream = s
            .node_watch_resources(Request::new(pb::NodeWatchResourcesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(first.devices.len(), 2);
        assert!(first.devices.iter().all(|d| d.health == pb::HealthStatus::Healthy as i32));
        assert_eq!(first.devices[0].device.as_ref().unwrap().pool_name, "node-a");
        assert_eq!(first.devices[0].health_check_timeout_seconds, 60);
        tx.send_replace(Arc::new(vec![
            DeviceHealth { device: "gpu-a".into(), unhealthy: Some("xid-79".into()) },
            healthy("gpu-b"),
        ]));
        let next = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.unwrap();
        let next = next.unwrap().unwrap();
        assert_eq!(next.devices[0].health, pb::HealthStatus::Unhealthy as i32);
        assert_eq!(next.devices[0].message, "xid-79");
        drop(tx);
        assert!(stream.next().await.is_none(), "the stream ends with the driver");
    }
}
