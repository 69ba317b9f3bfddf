//! gRPC over Unix sockets: the kubelet and its device plugins talk only through sockets in
//! `/var/lib/kubelet/device-plugins/`. Tonic's client speaks HTTP/2 over any connector, so the
//! connector here ignores the URI and opens the socket.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

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
/// in-memory pipe whose other end [`crate::h2authority::normalize`] feeds from the client.
pub type Incoming =
    tokio_stream::wrappers::ReceiverStream<std::io::Result<tokio::io::DuplexStream>>;

/// Binds a gRPC server's socket at `socket`, replacing a file an earlier run left there (bind
/// fails on an existing path). Any error but "not there" while removing it is returned: a socket
/// that cannot be replaced would be served by nobody.
///
/// Every connection goes through [`crate::h2authority`], so a kubelet that sends the socket's
/// path as its HTTP/2 `:authority` (those built with grpc-go before Kubernetes 1.26) is served
/// like one that sends `localhost`. Accepting stops when the server drops the stream.
pub fn bind(socket: &Path) -> std::io::Result<Incoming> {
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(socket)?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
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
            let (ours, theirs) = tokio::io::duplex(64 << 10);
            if tx.send(Ok(theirs)).await.is_err() {
                return;
            }
            tokio::spawn(async move {
                let (client_read, mut client_write) = conn.into_split();
                let (server_read, server_write) = tokio::io::split(ours);
                let mut server_read = server_read;
                let up = crate::h2authority::normalize(client_read, server_write);
                let down = tokio::io::copy(&mut server_read, &mut client_write);
                // Either direction ending ends the connection: a client that sent what cannot
                // be passed on is dropped, as the server would drop it.
                tokio::select! {
                    r = up => if let Err(e) = r {
                        tracing::debug!(error = %e, "plugin socket: connection ended");
                    },
                    r = down => if let Err(e) = r {
                        tracing::debug!(error = %e, "plugin socket: connection ended");
                    },
                }
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
