//! Serving the API on a listener (the Unix socket, TCP): one hyper HTTP/1.1 connection per
//! accepted stream, under the limits an untrusted client must not be able to lift
//! (`axum::serve` sets none of them: hyper's head timeout needs a timer it does not give):
//!
//! - at most [`HttpLimits::max_connections`] connections open per listener; more wait in the
//!   kernel's accept queue until one closes, so a flood of slow clients delays a well-formed
//!   request but cannot hold the daemon's memory or file descriptors;
//! - the request head must arrive within [`HttpLimits::request_timeout`] of the connection
//!   opening or of its previous response (hyper's `header_read_timeout`, which is therefore
//!   also the keep-alive idle timeout); the body's own deadline is [`crate::api`]'s;
//! - a client that accepts no byte of a response for [`HttpLimits::send_timeout`] is dropped.
//!
//! Routing, authentication and the browser checks are [`crate::api`]'s, not this module's.

use std::fmt::Write as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// The limits of [`serve`], per listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// For the request head (from the connection opening or its previous response), and again
    /// for the body.
    pub request_timeout: Duration,
    /// For a response the client has stopped reading.
    pub send_timeout: Duration,
}

impl Default for HttpLimits {
    /// 256 connections (the CLI, a few dashboards and scripts need a handful; each costs a
    /// descriptor and up to a 1 MiB body); 10 s for a head, which a client sends in one
    /// write; 60 s for a stalled reader, the usual proxy send timeout (nginx `send_timeout`).
    fn default() -> Self {
        Self {
            max_connections: 256,
            request_timeout: Duration::from_secs(10),
            send_timeout: Duration::from_secs(60),
        }
    }
}

/// Which listener; the label of its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unix,
    Tcp,
}

impl Kind {
    const ALL: [Kind; 2] = [Kind::Unix, Kind::Tcp];

    fn as_str(self) -> &'static str {
        match self {
            Kind::Unix => "unix",
            Kind::Tcp => "tcp",
        }
    }
}

/// Connection counters per listener, rendered into `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    open: [AtomicU64; 2],
    accepted: [AtomicU64; 2],
    timed_out: [AtomicU64; 2],
}

impl ConnStats {
    fn at(a: &[AtomicU64; 2], kind: Kind) -> &AtomicU64 {
        &a[kind as usize]
    }

    /// Prometheus text for the counters.
    pub fn render(&self, out: &mut String) {
        let series: [(&str, &str, &str, &[AtomicU64; 2]); 3] = [
            ("xpu_http_connections", "gauge", "HTTP connections open.", &self.open),
            (
                "xpu_http_connections_accepted_total",
                "counter",
                "HTTP connections accepted.",
                &self.accepted,
            ),
            (
                "xpu_http_connections_timed_out_total",
                "counter",
                "HTTP connections closed because a request head, or the client's reading of a response, did not progress in time.",
                &self.timed_out,
            ),
        ];
        for (name, kind, help, values) in series {
            // Writing to a String cannot fail.
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for k in Kind::ALL {
                let v = Self::at(values, k).load(Ordering::Relaxed);
                let _ = writeln!(out, "{name}{{listener=\"{}\"}} {v}", k.as_str());
            }
        }
    }
}

/// Who is at the other end of a connection, as the kernel says: every request on it carries
/// this as an extension, and [`crate::api`] decides from it (and the token) who the caller is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// A Unix socket peer, by `SO_PEERCRED` at connect time: its user and group.
    Unix { uid: u32, gid: u32 },
    /// A Unix socket peer whose credentials could not be read: nobody, for every check.
    UnixUnknown,
    /// A TCP client: only its address; who it is comes from the token it sends.
    Tcp(std::net::SocketAddr),
}

/// A listener [`serve`] accepts from.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<(Self::Io, Peer)>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> io::Result<(Self::Io, Peer)> {
        let (s, addr) = tokio::net::TcpListener::accept(self).await?;
        // Responses are small and written whole; do not wait for more to fill a segment. A
        // failure only costs latency.
        let _ = s.set_nodelay(true);
        Ok((s, Peer::Tcp(addr)))
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&mut self) -> io::Result<(Self::Io, Peer)> {
        let s = tokio::net::UnixListener::accept(self).await?.0;
        // The credentials the peer had when it connected (`SO_PEERCRED`): they cannot be
        // forged by the client and do not change with what it sends.
        let peer = match s.peer_cred() {
            Ok(c) => Peer::Unix { uid: c.uid(), gid: c.gid() },
            Err(_) => Peer::UnixUnknown,
        };
        Ok((s, peer))
    }
}

/// Serves `app` on `listener` under `limits` until the task is dropped.
pub async fn serve<L: Accept>(
    mut listener: L,
    app: Router,
    limits: HttpLimits,
    kind: Kind,
    stats: Arc<ConnStats>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        // Take a slot before accepting: what is over the cap stays in the accept queue.
        let slot = slots.clone().acquire_owned().await.expect("the slot semaphore is never closed");
        let (io, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(_) => {
                // Out of descriptors or a connection reset before it was accepted: retry
                // after a pause rather than spin (what axum::serve does too).
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        ConnStats::at(&stats.accepted, kind).fetch_add(1, Ordering::Relaxed);
        ConnStats::at(&stats.open, kind).fetch_add(1, Ordering::Relaxed);
        // Each request of the connection carries its peer; the router is shared, not rebuilt.
        let app = tower::ServiceExt::map_request(
            app.clone(),
            move |mut req: axum::http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(peer);
                req
            },
        );
        let stats = stats.clone();
        tokio::spawn(async move {
            let io = TokioIo::new(SendTimeout::new(io, limits.send_timeout));
            let result = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.request_timeout)
                .serve_connection(io, TowerToHyperService::new(app))
                .await;
            if let Err(e) = result {
                let send = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<io::Error>())
                    .is_some_and(|e| e.kind() == io::ErrorKind::TimedOut);
                if e.is_timeout() || send {
                    ConnStats::at(&stats.timed_out, kind).fetch_add(1, Ordering::Relaxed);
                }
            }
            // The connection (and its socket) is closed by now; only then free the slot.
            ConnStats::at(&stats.open, kind).fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
}

/// A stream whose writes fail with `TimedOut` once one has waited `limit` for the peer to
/// read.
struct SendTimeout<T> {
    io: T,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> SendTimeout<T> {
    fn new(io: T, limit: Duration) -> Self {
        Self { io, limit, stalled: None }
    }

    fn watch<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let limit = self.limit;
        let timer = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {} s", limit.as_secs_f64()),
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimeout<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimeout<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, r)
    }
}
