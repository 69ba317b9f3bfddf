//! What a peer of any gRPC server xpu runs may make it hold: the kubelet device plugin
//! ([`crate::deviceplugin`]), the DRA plugin and its registration server (`xpu-kube`'s
//! `dra::plugin`), and the test kubelets here. One set of numbers for all of them, used in two
//! places that must agree: [`server`], tonic's HTTP/2 settings and per-service message bounds,
//! and [`crate::h2authority`], the proxy in front of every plugin socket, which enforces the same
//! bounds itself (it counts streams, reads each gRPC length prefix, and refuses what is over
//! before the server sees it) and [`crate::transport::bind`]'s cap on connections.
//!
//! Each bound is far above anything a kubelet sends and far below what would let someone who
//! can connect to a plugin socket make the plugin hold much memory. Without them, tonic
//! advertises no `SETTINGS_MAX_CONCURRENT_STREAMS` at all, and eight connections of HEADERS-only
//! streams held 3.7 GB of a plugin (issue 13). With them, one socket holds at most about
//! [`MAX_CONNECTIONS`] × ([`MAX_BUFFERED`] + [`CONNECTION_WINDOW`] + [`MAX_CONCURRENT_STREAMS`] ×
//! [`MAX_HEADER_LIST`]): 16 × (8 + 1 + 1) MiB, about 160 MiB.

use std::time::Duration;

/// `SETTINGS_MAX_CONCURRENT_STREAMS` (RFC 9113, section 6.5.2), per connection. A kubelet keeps
/// one `ListAndWatch` open per device plugin and makes its other calls (`Allocate`,
/// `GetPreferredAllocation`, `NodePrepareResources`, `GetInfo`) a pod admission at a time: a
/// handful of streams. grpc-go, which the kubelet is built on, queues calls beyond the peer's
/// setting rather than sending them, so a kubelet is never refused; a client that sends more
/// anyway has the extra streams refused with `REFUSED_STREAM`, which leaves no state behind.
pub const MAX_CONCURRENT_STREAMS: u32 = 64;

/// The largest gRPC message taken or sent, by its 5-octet length prefix: gRPC's own default
/// receive limit (4 MiB). The kubelet's largest are a `ListAndWatch` answer of a few hundred
/// devices and a `NodePrepareResources` of a pod's claims, tens of KiB. A prefix over this is
/// refused when its five octets arrive, before any of the message is held.
pub const MAX_MESSAGE: usize = 4 << 20;

/// The most message octets one connection may have announced and not finished, over all its
/// streams (the server holds a message whole before it decodes it): two messages of
/// [`MAX_MESSAGE`] at once. A prefix that would go over it is refused as one over
/// [`MAX_MESSAGE`] is; a kubelet's calls are small and few.
pub const MAX_BUFFERED: usize = 2 * MAX_MESSAGE;

/// `SETTINGS_MAX_HEADER_LIST_SIZE` (RFC 9113, section 6.5.2), names and values with 32 octets
/// each (RFC 7541, section 4.1): hyper's and gRPC C's default. A kubelet's requests carry a few
/// hundred octets of headers.
pub const MAX_HEADER_LIST: u32 = 16 << 10;

/// `SETTINGS_MAX_FRAME_SIZE`: its initial value, the smallest a peer may choose (RFC 9113,
/// section 6.5.2), so every client's frames already fit and none is held larger.
pub const MAX_FRAME: u32 = 16_384;

/// `SETTINGS_INITIAL_WINDOW_SIZE` for each stream and the connection's own window (RFC 9113,
/// section 6.9): what a client may send before the server has taken it. hyper's defaults, made
/// explicit: the connection's window bounds what h2 buffers for all streams together.
pub const STREAM_WINDOW: u32 = 1 << 20;
/// See [`STREAM_WINDOW`].
pub const CONNECTION_WINDOW: u32 = 1 << 20;

/// Connections served at once on one socket; more are closed as they are accepted. A kubelet
/// holds one per plugin socket (two for a moment when it reconnects).
pub const MAX_CONNECTIONS: usize = 16;

/// HTTP/2 PINGs to a connection idle this long, which is closed when the answer takes longer
/// than [`KEEPALIVE_TIMEOUT`]: a client that stopped (a frozen process) frees its connection.
/// grpc-go answers PINGs on its own; its defaults are 2 hours and 20 seconds.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(120);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Streams a client may open and reset before the server accepts them (the "rapid reset"
/// attack, CVE-2023-44487): h2's default, made explicit.
pub const MAX_PENDING_ACCEPT_RESETS: usize = 20;
/// Streams the server may reset for a client's protocol errors before it ends the connection
/// ("MadeYouReset", CVE-2025-8671): hyper's default, which tonic turns off unless given one.
pub const MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// A tonic server with every connection-level bound above. Each service added to it still needs
/// its message bounds: `.max_decoding_message_size(MAX_MESSAGE)` and
/// `.max_encoding_message_size(MAX_MESSAGE)` (tonic's generated servers take them one by one).
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .http2_max_header_list_size(MAX_HEADER_LIST)
        .max_frame_size(MAX_FRAME)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESETS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
}
