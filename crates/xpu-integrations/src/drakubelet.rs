//! The kubelet's half of Dynamic Resource Allocation, for tests and benchmarks: what the
//! kubelet's plugin watcher does with a socket in `plugins_registry` (`GetInfo`, check the
//! type, pick the newest DRA service the plugin lists, `NotifyRegistrationStatus`) and a client
//! of the chosen service on the plugin's endpoint. Built from the same protos a real kubelet
//! speaks, over the same Unix sockets.

use std::path::{Path, PathBuf};

use tonic::transport::Channel;

use crate::drapb::{self, registration as reg};
use crate::transport;

/// Why registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("connecting to registration socket {}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("GetInfo on {}: {status}", path.display())]
    GetInfo { path: PathBuf, status: tonic::Status },
    #[error("plugin {name} has type {kind:?}, not {}", drapb::DRA_PLUGIN_TYPE)]
    Type { name: String, kind: String },
    #[error("plugin {name} serves none of the DRA services this kubelet knows: {versions:?}")]
    Versions { name: String, versions: Vec<String> },
}

/// A registered DRA plugin.
#[derive(Debug, Clone)]
pub struct Registered {
    pub info: reg::PluginInfo,
    /// The service chosen, as listed: `v1.DRAPlugin` when offered.
    pub service: String,
}

/// Registers the plugin whose registration socket is `socket`, as the kubelet does.
pub async fn register(socket: &Path) -> Result<Registered, RegisterError> {
    let channel = transport::connect(socket)
        .await
        .map_err(|source| RegisterError::Connect { path: socket.to_owned(), source })?;
    let mut client = reg::registration_client::RegistrationClient::new(channel);
    let info = client
        .get_info(reg::InfoRequest {})
        .await
        .map_err(|status| RegisterError::GetInfo { path: socket.to_owned(), status })?
        .into_inner();
    let outcome = if info.r#type != drapb::DRA_PLUGIN_TYPE {
        Err(RegisterError::Type { name: info.name.clone(), kind: info.r#type.clone() })
    } else if let Some(s) = [drapb::SERVICE_V1, drapb::SERVICE_V1BETA1]
        .into_iter()
        .find(|s| info.supported_versions.iter().any(|v| v == s))
    {
        Ok(Registered { info: info.clone(), service: s.to_owned() })
    } else {
        Err(RegisterError::Versions {
            name: info.name.clone(),
            versions: info.supported_versions.clone(),
        })
    };
    let status = reg::RegistrationStatus {
        plugin_registered: outcome.is_ok(),
        error: outcome.as_ref().err().map(ToString::to_string).unwrap_or_default(),
    };
    // The kubelet ignores the plugin's answer to the notification as well.
    let _ = client.notify_registration_status(status).await;
    outcome
}

/// A `v1.DRAPlugin` client on a registered plugin's endpoint.
pub async fn client_v1(
    endpoint: &Path,
) -> Result<drapb::v1::dra_plugin_client::DraPluginClient<Channel>, tonic::transport::Error> {
    Ok(drapb::v1::dra_plugin_client::DraPluginClient::new(transport::connect(endpoint).await?))
}

/// A `v1beta1.DRAPlugin` client on a registered plugin's endpoint.
pub async fn client_v1beta1(
    endpoint: &Path,
) -> Result<drapb::v1beta1::dra_plugin_client::DraPluginClient<Channel>, tonic::transport::Error> {
    Ok(drapb::v1beta1::dra_plugin_client::DraPluginClient::new(transport::connect(endpoint).await?))
}
