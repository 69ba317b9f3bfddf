//! The kubelet's half of the device plugin API, for tests and benchmarks: a `Registration`
//! server on `kubelet.sock` that records what plugins register (and refuses versions other than
//! v1beta1, as the kubelet does), and a `DevicePlugin` client to a registered plugin's socket.
//! It speaks the same protobuf definition as the plugin, over the same Unix sockets a real
//! kubelet uses.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::deviceplugin::{API_VERSION, KUBELET_SOCKET};
use crate::{limits, pb, transport};

struct Registrar {
    seen: mpsc::UnboundedSender<pb::RegisterRequest>,
    /// Open the plugin's `ListAndWatch` (and read its first answer) before answering
    /// `Register`, as a real kubelet may: the plugin's directory, and the streams kept open.
    watch_first:
        Option<(PathBuf, std::sync::Mutex<Vec<tonic::Streaming<pb::ListAndWatchResponse>>>)>,
}

#[tonic::async_trait]
impl pb::registration_server::Registration for Registrar {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let r = request.into_inner();
        if r.version != API_VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported device plugin API version {:?}; this kubelet speaks {API_VERSION}",
                r.version
            )));
        }
        if let Some((dir, streams)) = &self.watch_first {
            let channel = transport::connect(&dir.join(&r.endpoint))
                .await
                .map_err(|e| Status::unavailable(format!("cannot reach the plugin: {e}")))?;
            let mut client = pb::device_plugin_client::DevicePluginClient::new(channel);
            let mut stream = client.list_and_watch(pb::Empty {}).await?.into_inner();
            stream.message().await?;
            streams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(stream);
        }
        let _ = self.seen.send(r);
        Ok(Response::new(pb::Empty {}))
    }
}

/// A kubelet listening on `DIR/kubelet.sock`.
pub struct TestKubelet {
    dir: PathBuf,
    registrations: mpsc::UnboundedReceiver<pb::RegisterRequest>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl TestKubelet {
    /// Starts serving `Registration` on `dir/kubelet.sock`.
    pub fn start(dir: &Path) -> std::io::Result<TestKubelet> {
        Self::serve(dir, false)
    }

    /// Like [`TestKubelet::start`], but this kubelet opens each plugin's `ListAndWatch` (and
    /// reads its first list) before it answers the plugin's `Register`, and keeps it open.
    pub fn start_watching_first(dir: &Path) -> std::io::Result<TestKubelet> {
        Self::serve(dir, true)
    }

    fn serve(dir: &Path, watch_first: bool) -> std::io::Result<TestKubelet> {
        let socket = dir.join(KUBELET_SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)?;
        let (seen, registrations) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            limits::server()
                .add_service(
                    pb::registration_server::RegistrationServer::new(Registrar {
                        seen,
                        watch_first: watch_first.then(|| (dir.to_owned(), Default::default())),
                    })
                    .max_decoding_message_size(limits::MAX_MESSAGE)
                    .max_encoding_message_size(limits::MAX_MESSAGE),
                )
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                }),
        );
        Ok(TestKubelet { dir: dir.to_owned(), registrations, stop: Some(stop), task })
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join(KUBELET_SOCKET)
    }

    /// The next registration, waiting at most `timeout`.
    pub async fn next_registration(&mut self, timeout: Duration) -> Option<pb::RegisterRequest> {
        tokio::time::timeout(timeout, self.registrations.recv()).await.ok().flatten()
    }

    /// Registrations received so far and not yet taken.
    pub fn pending_registrations(&mut self) -> Vec<pb::RegisterRequest> {
        let mut out = Vec::new();
        while let Ok(r) = self.registrations.try_recv() {
            out.push(r);
        }
        out
    }

    /// A `DevicePlugin` client to the plugin that registered `endpoint`.
    pub async fn plugin(
        &self,
        endpoint: &str,
    ) -> Result<pb::device_plugin_client::DevicePluginClient<Channel>, tonic::transport::Error>
    {
        let channel = transport::connect(&self.dir.join(endpoint)).await?;
        Ok(pb::device_plugin_client::DevicePluginClient::new(channel))
    }

    /// Stops, as a kubelet going down does, and deletes `kubelet.sock`.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(Duration::from_millis(200), &mut self.task).await.is_err() {
            self.task.abort();
        }
        let _ = std::fs::remove_file(self.socket());
    }
}
