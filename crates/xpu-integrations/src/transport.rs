//! gRPC over Unix sockets: the kubelet and its device plugins talk only through sockets in
//! `/var/lib/kubelet/device-plugins/`. Tonic's client speaks HTTP/2 over any connector, so the
//! connector here ignores the URI and opens the socket.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::Semaphore;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::limits;

/// A channel to the gRPC server listening on `socket`.
pub async fn connect(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket: PathBuf = socket.to_owned();
    // The authority is never resolved: the connector below decides where bytes go.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { UnixStream::connect(socket).await.map(TokioIo::new) }
        }))
        .await
}

/// The connections of a socket served through [`bind`]: each is the server's end of an
/// in-memory pipe whose other end [`crate::h2authority::proxy`] feeds from the client.
pub type Incoming =
    tokio_stream::wrappers::ReceiverStream<std::io::Result<tokio::io::DuplexStream>>;

/// Binds a gRPC server's socket at `socket`, replacing a file an earlier run left there (bind
/// fails on an existing path). Any error but "not there" while removing it is returned: a socket
/// that cannot be replaced would be served by nobody.
///
/// Every connection goes through [`crate::h2authority`], so a kubelet that sends the socket's
/// path as its HTTP/2 `:authority` (those built with grpc-go before Kubernetes 1.26) is served
/// like one that sends `localhost`, and every client is held to [`crate::limits`] before the
/// server reads what it sent. At most [`limits::MAX_CONNECTIONS`] are served at once; one more
/// is closed as it is accepted. Accepting stops when the server drops the stream.
pub fn bind(socket: &Path) -> std::io::Result<Incoming> {
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(socket)?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let slots = Arc::new(Semaphore::new(limits::MAX_CONNECTIONS));
    let path = socket.to_owned();
    tokio::spawn(async move {
        // Whether the refusal of a connection past the cap has been logged since a slot was
        // last free: one line per episode, however many connections a client makes.
        let mut told = false;
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => a,
            };
            let conn = match accepted {
                Ok((conn, _)) => conn,
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    // Out of file descriptors and the like: not a busy loop.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                if !std::mem::replace(&mut told, true) {
                    tracing::warn!(
                        socket = %path.display(),
                        max = limits::MAX_CONNECTIONS,
                        "plugin socket: connections at the cap; closing new ones until one ends"
                    );
                }
                drop(conn);
                continue;
            };
            told = false;
            let (ours, theirs) = tokio::io::duplex(64 << 10);
            if tx.send(Ok(theirs)).await.is_err() {
                return;
            }
            tokio::spawn(async move {
                if let Err(e) = crate::h2authority::proxy(conn, ours).await {
                    tracing::debug!(error = %e, "plugin socket: connection ended");
                }
                drop(slot);
            });
        }
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Removes a served socket at shutdown; the kubelet's plugin watcher unregisters a plugin whose
/// socket is gone. `Err` for anything but "already gone".
pub fn unbind(socket: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The identity of a socket file, to notice when it is deleted and made again: the kubelet
/// recreates `kubelet.sock` when it restarts. The inode alone is not enough (a file system
/// reuses a freed inode at once), so the change time is part of it.
pub fn identity(path: &Path) -> Option<SocketId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(SocketId { dev: m.dev(), ino: m.ino(), ctime: m.ctime(), ctime_nsec: m.ctime_nsec() })
}

/// See [`identity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}
