//! The proxy in front of every plugin socket ([`crate::transport::bind`]): it accepts any HTTP/2
//! `:authority` a kubelet sends, and holds each client to [`crate::limits`] before the gRPC
//! server sees what it sent.
//!
//! Kubelets built with grpc-go before 1.26's change send the socket's path as `:authority`
//! (`/var/lib/kubelet/device-plugins/xpu.sock`). That is not an authority by RFC 3986, and the
//! HTTP/2 server under tonic (`h2`) answers such a request with `RST_STREAM(PROTOCOL_ERROR)`:
//! the kubelet registers the plugin, its first `ListAndWatch` fails, and the resource never
//! appears. The authority of a request on a Unix socket means nothing to a gRPC server, so each
//! connection is passed through [`proxy`], which rewrites an `:authority` that is not a valid
//! authority to `localhost` (what newer kubelets send) and leaves everything else as it was.
//!
//! Only the client's header blocks are rewritten (RFC 9113 and RFC 7541): the frames are read as
//! they come (a 9-octet header, then the payload), `HEADERS` and its `CONTINUATION`s are joined
//! into one block, decoded with the client's HPACK context, and encoded again with a context of
//! our own towards the server, so the two dynamic tables stay consistent on either side. Padding
//! is dropped, priority kept. Every other frame, and everything the server sends, goes through
//! byte for byte, but for the server's first SETTINGS, which is made to state the limits below.
//!
//! Bounded (issue 13), with the numbers of [`crate::limits`], whatever the server behind it
//! enforces itself:
//! - a frame over [`limits::MAX_FRAME`], a header block over [`MAX_HEADER_BLOCK`] or decoding to
//!   more than [`MAX_HEADER_LIST`] (HPACK lets a few octets name a long table entry again and
//!   again), a dynamic table over 4096 octets (what the server allows, h2's default), or a block
//!   that does not decode ends the connection;
//! - a stream opened while [`limits::MAX_CONCURRENT_STREAMS`] are open is refused
//!   (`RST_STREAM(REFUSED_STREAM)`, RFC 9113 section 5.1.2) and never reaches the server; the
//!   server's SETTINGS tell the client the cap;
//! - each DATA frame's gRPC messages are followed by their 5-octet length prefixes (gRPC over
//!   HTTP/2, "Length-Prefixed-Message"): a prefix over [`limits::MAX_MESSAGE`], or one that
//!   would take the connection's announced and unfinished messages over
//!   [`limits::MAX_BUFFERED`], resets the stream at once, on its five octets: `CANCEL` to the
//!   server and `ENHANCE_YOUR_CALM` to the client, which gRPC reports as `RESOURCE_EXHAUSTED`.
//!
//! Frames the server must not see (those of a stream refused or reset here) are dropped, and a
//! dropped DATA frame's octets are given back to the client's connection window, as the server
//! would have done (RFC 9113, section 6.9).

use std::collections::HashMap;
use std::io;
use std::sync::{Mutex, PoisonError};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::limits;

/// The client connection preface (RFC 9113, section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Error codes (RFC 9113, section 7).
const REFUSED_STREAM: u32 = 0x7;
const CANCEL: u32 = 0x8;
const ENHANCE_YOUR_CALM: u32 = 0xb;
/// SETTINGS identifiers (RFC 9113, section 6.5.2).
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;
const SETTINGS_MAX_HEADER_LIST_SIZE: u16 = 0x6;
/// The largest frame payload read from the client, and the size rewritten blocks are cut into:
/// `SETTINGS_MAX_FRAME_SIZE`'s initial value, which the server's SETTINGS are held to.
const MAX_FRAME: usize = limits::MAX_FRAME as usize;
/// Largest header block (HEADERS and its CONTINUATIONs) taken: HPACK never encodes a list
/// longer than its size, which counts 32 octets for each entry.
pub const MAX_HEADER_BLOCK: usize = MAX_HEADER_LIST;
/// Largest decoded header list, as RFC 7541 counts it ([`limits::MAX_HEADER_LIST`]).
pub const MAX_HEADER_LIST: usize = limits::MAX_HEADER_LIST as usize;
/// The dynamic table size the client may use: `SETTINGS_HEADER_TABLE_SIZE`'s initial value,
/// which h2 does not change.
const MAX_TABLE: usize = 4096;

/// What the peer sent that cannot be passed on.
fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("HTTP/2 from the client: {what}"))
}

/// Serves one connection: the client's octets from `client` to `server` (the gRPC server),
/// rewritten and bounded as the module says, and the server's back. Returns when either side
/// closes, or when the client sends what cannot be passed on.
pub async fn proxy<C, S>(client: C, server: S) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite,
    S: AsyncRead + AsyncWrite,
{
    let (client_read, client_write) = tokio::io::split(client);
    let (server_read, server_write) = tokio::io::split(server);
    let back = Back::new(client_write);
    // Either direction ending ends the connection: a client that sent what cannot be passed on
    // is dropped, as the server would drop it.
    tokio::select! {
        r = up(client_read, server_write, &back) => r,
        r = down(server_read, &back) => r,
    }
}

/// The client's side of a connection, shared by both directions: what is known of its streams,
/// and the writer towards it, where the proxy's own frames go between the server's.
struct Back<W> {
    streams: Mutex<Streams>,
    to: tokio::sync::Mutex<W>,
}

impl<W: AsyncWrite + Unpin> Back<W> {
    fn new(to: W) -> Back<W> {
        Back { streams: Mutex::new(Streams::default()), to: tokio::sync::Mutex::new(to) }
    }

    /// The streams; the lock is never held across an await.
    fn streams(&self) -> std::sync::MutexGuard<'_, Streams> {
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes whole frames of the proxy's own to the client.
    async fn send(&self, frames: &[u8]) -> io::Result<()> {
        self.to.lock().await.write_all(frames).await
    }
}

/// One frame as octets.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn rst(stream: u32, code: u32) -> Vec<u8> {
    frame(RST_STREAM, 0, stream, &code.to_be_bytes())
}

/// A connection WINDOW_UPDATE giving back `credit` octets (none when there are none).
fn credit(octets: u32) -> Vec<u8> {
    if octets == 0 { Vec::new() } else { frame(WINDOW_UPDATE, 0, 0, &octets.to_be_bytes()) }
}

/// A frame's 9-octet header (RFC 9113 section 4.1), as read and as parsed.
struct FrameHead {
    raw: [u8; 9],
    len: usize,
    kind: u8,
    flags: u8,
    /// The reserved bit cleared.
    stream: u32,
}

/// The next frame's header, or `None` when the connection ended between frames.
async fn read_head(from: &mut (impl AsyncRead + Unpin)) -> io::Result<Option<FrameHead>> {
    let mut raw = [0u8; 9];
    match from.read_exact(&mut raw).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    Ok(Some(FrameHead {
        len: usize::from(raw[0]) << 16 | usize::from(raw[1]) << 8 | usize::from(raw[2]),
        kind: raw[3],
        flags: raw[4],
        stream: u32::from_be_bytes([raw[5], raw[6], raw[7], raw[8]]) & 0x7fff_ffff,
        raw,
    }))
}

/// The client's frames towards the server.
async fn up<R, W, B>(mut from: R, mut to: W, back: &Back<B>) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    B: AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    if &preface != PREFACE {
        // Not HTTP/2 with prior knowledge: the server says so; nothing here to rewrite.
        tokio::io::copy(&mut from, &mut to).await?;
        return Ok(());
    }
    let mut decoder = fluke_hpack::Decoder::new();
    decoder.set_max_allowed_table_size(MAX_TABLE);
    let mut encoder = fluke_hpack::Encoder::new();
    // A header block being joined: its stream, the HEADERS flags, priority octets, fragments.
    let mut pending: Option<(u32, u8, Vec<u8>, Vec<u8>)> = None;
    let mut told = Told::default();
    loop {
        let Some(FrameHead { raw: head, len, kind, flags, stream }) = read_head(&mut from).await?
        else {
            break;
        };
        if len > MAX_FRAME {
            return Err(bad(&format!(
                "a frame of {len} octets, over the {MAX_FRAME} the server accepts"
            )));
        }
        let mut payload = vec![0u8; len];
        from.read_exact(&mut payload).await?;
        match kind {
            HEADERS => {
                if pending.is_some() {
                    return Err(bad("HEADERS inside a header block"));
                }
                let mut body = payload.as_slice();
                if flags & PADDED != 0 {
                    body = unpad(body)?;
                }
                let mut priority = Vec::new();
                if flags & PRIORITY != 0 {
                    if body.len() < 5 {
                        return Err(bad("HEADERS too short for its priority"));
                    }
                    priority = body[..5].to_vec();
                    body = &body[5..];
                }
                if body.len() > MAX_HEADER_BLOCK {
                    return Err(bad(&format!("a header block over {MAX_HEADER_BLOCK} octets")));
                }
                pending = Some((stream, flags, priority, body.to_vec()));
            }
            CONTINUATION => match &mut pending {
                Some((s, _, _, block)) if *s == stream => {
                    if block.len() + payload.len() > MAX_HEADER_BLOCK {
                        return Err(bad(&format!("a header block over {MAX_HEADER_BLOCK} octets")));
                    }
                    block.extend_from_slice(&payload);
                }
                _ => return Err(bad("CONTINUATION outside a header block")),
            },
            _ => {
                if pending.is_some() {
                    return Err(bad("a frame inside a header block"));
                }
                let verdict = match kind {
                    DATA => {
                        let body = if flags & PADDED != 0 { unpad(&payload)? } else { &payload };
                        // A frame is at most MAX_FRAME octets.
                        let octets = u32::try_from(len).unwrap_or(u32::MAX);
                        back.streams().data(stream, octets, body, flags & END_STREAM != 0)
                    }
                    _ => back.streams().other(kind, stream),
                };
                match verdict {
                    Verdict::Forward => {
                        to.write_all(&head).await?;
                        to.write_all(&payload).await?;
                    }
                    Verdict::Drop { credit: c } => back.send(&credit(c)).await?,
                    Verdict::Reset { credit: c, declared } => {
                        told.reset(stream, declared);
                        to.write_all(&rst(stream, CANCEL)).await?;
                        let mut out = rst(stream, ENHANCE_YOUR_CALM);
                        out.extend(credit(c));
                        back.send(&out).await?;
                    }
                    Verdict::Refuse => back.send(&rst(stream, REFUSED_STREAM)).await?,
                }
                continue;
            }
        }
        let done = match (&pending, kind) {
            (Some((_, f, _, _)), HEADERS) => f & END_HEADERS != 0,
            _ => flags & END_HEADERS != 0,
        };
        if !done {
            continue;
        }
        let Some((stream, flags, priority, block)) = pending.take() else { continue };
        // Every block is decoded, forwarded or not: the client's HPACK context moves with it.
        let (headers, replaced) = decode(&mut decoder, &block)?;
        if let Some(authority) = replaced {
            told.authority(&authority);
        }
        let verdict = back.streams().headers(stream, flags & END_STREAM != 0)?;
        match verdict {
            Verdict::Forward => {}
            Verdict::Refuse => {
                told.refused(stream);
                back.send(&rst(stream, REFUSED_STREAM)).await?;
                continue;
            }
            Verdict::Drop { .. } | Verdict::Reset { .. } => continue,
        }
        let encoded = encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        write_block(&mut to, stream, flags & (END_STREAM | PRIORITY), &priority, &encoded).await?;
    }
    to.shutdown().await
}

/// The server's frames towards the client, as they are, but for its first SETTINGS (held to
/// [`limits`]) and for what they tell of the streams' ends.
async fn down<R, W>(mut from: R, back: &Back<W>) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut first_settings = true;
    let mut buf = vec![0u8; MAX_FRAME];
    loop {
        let Some(FrameHead { raw: head, len, kind, flags, stream }) = read_head(&mut from).await?
        else {
            break;
        };
        if kind == SETTINGS && flags & ACK == 0 && stream == 0 && len <= MAX_FRAME {
            let payload = &mut buf[..len];
            from.read_exact(payload).await?;
            let settings = bounded_settings(payload, first_settings);
            first_settings = false;
            back.send(&frame(SETTINGS, flags, 0, &settings)).await?;
            continue;
        }
        back.streams().server(kind, flags, stream);
        // The frame is passed on as it comes, never held whole: the client chose how large the
        // server's frames may be.
        let mut to = back.to.lock().await;
        to.write_all(&head).await?;
        let mut left = len;
        while left > 0 {
            let n = from.read(&mut buf[..left.min(MAX_FRAME)]).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            to.write_all(&buf[..n]).await?;
            left -= n;
        }
    }
    back.to.lock().await.shutdown().await
}

/// A SETTINGS payload with the server's stream cap, header list size and frame size held to
/// [`limits`]; the first one the server sends also states the first two when it left them out
/// (each has no limit by default, RFC 9113 section 6.5.2).
fn bounded_settings(payload: &[u8], first: bool) -> Vec<u8> {
    if !payload.len().is_multiple_of(6) {
        // Malformed: the client refuses it as the server sent it.
        return payload.to_vec();
    }
    let caps = [
        (SETTINGS_MAX_CONCURRENT_STREAMS, limits::MAX_CONCURRENT_STREAMS, true),
        (SETTINGS_MAX_HEADER_LIST_SIZE, limits::MAX_HEADER_LIST, true),
        (SETTINGS_MAX_FRAME_SIZE, limits::MAX_FRAME, false),
    ];
    let mut out = Vec::with_capacity(payload.len() + 12);
    let mut seen = [false; 3];
    for entry in payload.chunks_exact(6) {
        let id = u16::from_be_bytes([entry[0], entry[1]]);
        let mut value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
        if let Some(i) = caps.iter().position(|(c, _, _)| *c == id) {
            value = value.min(caps[i].1);
            seen[i] = true;
        }
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&value.to_be_bytes());
    }
    for (i, (id, value, state)) in caps.iter().enumerate() {
        if first && *state && !seen[i] {
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&value.to_be_bytes());
        }
    }
    out
}

/// A padded frame's payload without its padding (RFC 9113, section 6.1).
fn unpad(payload: &[u8]) -> io::Result<&[u8]> {
    let pad = usize::from(*payload.first().ok_or_else(|| bad("an empty padded frame"))?);
    if pad + 1 > payload.len() {
        return Err(bad("padding longer than the frame"));
    }
    Ok(&payload[1..payload.len() - pad])
}

/// What becomes of a client frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// To the server as it came.
    Forward,
    /// Not for the server: its stream was refused or has ended. DATA's octets are given back
    /// to the client's connection window.
    Drop { credit: u32 },
    /// A stream past the cap: `REFUSED_STREAM` to the client, nothing to the server.
    Refuse,
    /// A message over the cap (`declared` octets): `CANCEL` to the server, `ENHANCE_YOUR_CALM`
    /// to the client, and the frame's octets given back.
    Reset { credit: u32, declared: u32 },
}

/// The client's open streams as the proxy knows them from both directions: the decisions, with
/// no I/O. A stream is open from the client's HEADERS until both sides ended it or either reset
/// it, as RFC 9113's state machine counts it towards `SETTINGS_MAX_CONCURRENT_STREAMS`.
#[derive(Debug, Default)]
struct Streams {
    open: HashMap<u32, Stream>,
    /// The highest stream the client opened or had refused: a stream at or below it that is not
    /// open is over.
    last: u32,
    /// Octets of the messages announced by their prefixes and not yet whole, over all streams:
    /// the server holds a message until the last of it arrives.
    buffered: usize,
}

#[derive(Debug, Default)]
struct Stream {
    client_ended: bool,
    server_ended: bool,
    /// The current message's length prefix, as far as it has come.
    prefix: [u8; 5],
    have: usize,
    /// The current message's length (counted in `buffered` until it is whole) and the octets
    /// of it still to come.
    declared: usize,
    left: usize,
}

impl Streams {
    /// A client's header block on `stream`.
    fn headers(&mut self, stream: u32, end_stream: bool) -> io::Result<Verdict> {
        if stream.is_multiple_of(2) {
            return Err(bad(&format!("HEADERS on stream {stream}, which a client cannot open")));
        }
        if let Some(s) = self.open.get_mut(&stream) {
            // Trailers.
            if end_stream {
                s.client_ended = true;
                self.close_if_ended(stream);
            }
            return Ok(Verdict::Forward);
        }
        if stream <= self.last {
            return Ok(Verdict::Drop { credit: 0 });
        }
        self.last = stream;
        if self.open.len() >= limits::MAX_CONCURRENT_STREAMS as usize {
            return Ok(Verdict::Refuse);
        }
        self.open.insert(stream, Stream { client_ended: end_stream, ..Stream::default() });
        Ok(Verdict::Forward)
    }

    /// A client's DATA frame of `octets` on `stream`, `body` without its padding.
    fn data(&mut self, stream: u32, octets: u32, body: &[u8], end_stream: bool) -> Verdict {
        let Some(s) = self.open.get_mut(&stream) else {
            return if stream != 0 && stream <= self.last {
                Verdict::Drop { credit: octets }
            } else {
                // On stream 0 or one never opened: the server's protocol error to answer.
                Verdict::Forward
            };
        };
        if s.client_ended {
            // After its END_STREAM: the server answers STREAM_CLOSED.
            return Verdict::Forward;
        }
        let mut rest = body;
        while !rest.is_empty() {
            if s.left > 0 {
                let n = s.left.min(rest.len());
                s.left -= n;
                rest = &rest[n..];
                if s.left == 0 {
                    self.buffered -= std::mem::take(&mut s.declared);
                }
                continue;
            }
            let n = (5 - s.have).min(rest.len());
            s.prefix[s.have..s.have + n].copy_from_slice(&rest[..n]);
            s.have += n;
            rest = &rest[n..];
            if s.have < 5 {
                break;
            }
            s.have = 0;
            let declared = u32::from_be_bytes([s.prefix[1], s.prefix[2], s.prefix[3], s.prefix[4]]);
            let size = declared as usize;
            if size > limits::MAX_MESSAGE || self.buffered + size > limits::MAX_BUFFERED {
                self.close(stream);
                return Verdict::Reset { credit: octets, declared };
            }
            (s.declared, s.left) = (size, size);
            self.buffered += size;
        }
        if end_stream {
            s.client_ended = true;
            self.close_if_ended(stream);
        }
        Verdict::Forward
    }

    /// Any other client frame on `stream`.
    fn other(&mut self, kind: u8, stream: u32) -> Verdict {
        let over = stream != 0 && stream <= self.last && !self.open.contains_key(&stream);
        match kind {
            // Frames a server takes on a stream it never saw would end the connection (an
            // idle stream's) or say nothing.
            RST_STREAM | WINDOW_UPDATE if over => Verdict::Drop { credit: 0 },
            RST_STREAM => {
                self.close(stream);
                Verdict::Forward
            }
            // PRIORITY is allowed on any stream; the rest is the connection's.
            _ => Verdict::Forward,
        }
    }

    /// A server frame: the end of its side of a stream, or a reset.
    fn server(&mut self, kind: u8, flags: u8, stream: u32) {
        match kind {
            HEADERS | DATA if flags & END_STREAM != 0 => {
                if let Some(s) = self.open.get_mut(&stream) {
                    s.server_ended = true;
                    self.close_if_ended(stream);
                }
            }
            RST_STREAM => self.close(stream),
            _ => {}
        }
    }

    fn close_if_ended(&mut self, stream: u32) {
        if self.open.get(&stream).is_some_and(|s| s.client_ended && s.server_ended) {
            self.close(stream);
        }
    }

    fn close(&mut self, stream: u32) {
        if let Some(s) = self.open.remove(&stream) {
            self.buffered -= s.declared;
        }
    }
}

/// What a connection's log has said already: once each, so that a client cannot fill the log.
#[derive(Debug, Default)]
struct Told {
    authority: bool,
    refused: bool,
    reset: bool,
}

impl Told {
    fn authority(&mut self, authority: &[u8]) {
        if !std::mem::replace(&mut self.authority, true) {
            // Which kubelet this is shows in the plugin's log.
            tracing::info!(
                authority = %String::from_utf8_lossy(authority),
                "the client sent a socket path as :authority, as kubelets before 1.26 do; served as localhost"
            );
        }
    }

    fn refused(&mut self, stream: u32) {
        if !std::mem::replace(&mut self.refused, true) {
            tracing::warn!(
                stream,
                max = limits::MAX_CONCURRENT_STREAMS,
                "a client opened more concurrent streams than the plugin's SETTINGS allow; refusing the rest"
            );
        }
    }

    fn reset(&mut self, stream: u32, declared: u32) {
        if !std::mem::replace(&mut self.reset, true) {
            tracing::warn!(
                stream,
                declared,
                max = limits::MAX_MESSAGE,
                buffered_max = limits::MAX_BUFFERED,
                "a client announced a gRPC message over the plugin's bounds; stream reset"
            );
        }
    }
}

/// A decoded header list: names and values, in order.
type Headers = Vec<(Vec<u8>, Vec<u8>)>;

/// One header block, with a non-authority `:authority` replaced by `localhost` (and the value
/// it replaced); at most [`MAX_HEADER_LIST`] octets of headers are kept.
fn decode(
    decoder: &mut fluke_hpack::Decoder<'_>,
    block: &[u8],
) -> io::Result<(Headers, Option<Vec<u8>>)> {
    let mut headers: Headers = Vec::new();
    let mut replaced = None;
    let mut size = 0usize;
    let mut over = false;
    // fluke-hpack panics on some malformed size updates (an `unwrap` on a truncated
    // integer); a peer's bytes must end its connection, not unwind through the proxy.
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decoder.decode_with_cb(block, |name, value| {
            // RFC 7541's size of an entry: both lengths and 32.
            size += name.len() + value.len() + 32;
            if size > MAX_HEADER_LIST {
                over = true;
                return;
            }
            let value = if name.as_ref() == b":authority" && !is_authority(&value) {
                replaced = Some(value.into_owned());
                b"localhost".to_vec()
            } else {
                value.into_owned()
            };
            headers.push((name.into_owned(), value));
        })
    }));
    match decoded {
        Ok(Ok(())) if !over => Ok((headers, replaced)),
        Ok(Ok(())) => Err(bad(&format!("a header list over {MAX_HEADER_LIST} octets"))),
        Ok(Err(e)) => Err(bad(&format!("HPACK: {e:?}"))),
        Err(_) => Err(bad("HPACK: a malformed block")),
    }
}

/// Whether `value` is an authority as `h2` takes one.
fn is_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// A header block as one HEADERS frame and as many CONTINUATIONs as [`MAX_FRAME`] needs.
async fn write_block<W: AsyncWrite + Unpin>(
    to: &mut W,
    stream: u32,
    flags: u8,
    priority: &[u8],
    block: &[u8],
) -> io::Result<()> {
    let first = (MAX_FRAME - priority.len()).min(block.len());
    let mut chunks = vec![&block[..first]];
    chunks.extend(block[first..].chunks(MAX_FRAME));
    let last = chunks.len() - 1;
    for (i, chunk) in chunks.into_iter().enumerate() {
        let (kind, mut f, prio) =
            if i == 0 { (HEADERS, flags, priority) } else { (CONTINUATION, 0, &[][..]) };
        if i == last {
            f |= END_HEADERS;
        }
        let len = prio.len() + chunk.len();
        let mut head = [0u8; 9];
        head[0] = (len >> 16) as u8;
        head[1] = (len >> 8) as u8;
        head[2] = len as u8;
        head[3] = kind;
        head[4] = f;
        head[5..9].copy_from_slice(&stream.to_be_bytes());
        to.write_all(&head).await?;
        to.write_all(prio).await?;
        to.write_all(chunk).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits octets into (kind, flags, stream, payload) frames.
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while b.len() >= 9 {
            let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            out.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        out
    }

    /// What the client's `input` becomes towards the server.
    async fn through(input: Vec<u8>) -> io::Result<Vec<u8>> {
        Ok(both(input).await?.0)
    }

    /// What the client's `input` becomes towards the server, and what the proxy itself sent
    /// back to the client.
    async fn both(input: Vec<u8>) -> io::Result<(Vec<u8>, Vec<u8>)> {
        let mut out = Vec::new();
        let back = Back::new(Vec::new());
        up(input.as_slice(), &mut out, &back).await?;
        Ok((out, back.to.into_inner()))
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_the_rest_is_untouched() {
        let mut client = fluke_hpack::Encoder::new();
        let request = |path: &str| {
            vec![
                (b":method".to_vec(), b"POST".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), path.as_bytes().to_vec()),
                (b":authority".to_vec(), b"/var/lib/kubelet/device-plugins/xpu.sock".to_vec()),
                (b"content-type".to_vec(), b"application/grpc".to_vec()),
            ]
        };
        let enc = |e: &mut fluke_hpack::Encoder, h: &[(Vec<u8>, Vec<u8>)]| {
            e.encode(h.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
        };
        let first = enc(&mut client, &request("/v1beta1.DevicePlugin/ListAndWatch"));
        // The second request names the authority through the client's dynamic table.
        let second = enc(&mut client, &request("/v1beta1.DevicePlugin/Allocate"));
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        // The first block split over HEADERS (padded, with priority) and a CONTINUATION.
        let (a, b) = first.split_at(first.len() / 2);
        let mut padded = vec![3u8, 0, 0, 0, 0, 16];
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, b));
        input.extend(frame(0x0, END_STREAM, 1, b"\0\0\0\0\0")); // DATA
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &second));

        let out = through(input).await.unwrap();
        assert_eq!(&out[..24], PREFACE);
        let got = frames(&out[24..]);
        let kinds: Vec<(u8, u8, u32)> = got.iter().map(|(k, f, s, _)| (*k, *f, *s)).collect();
        assert_eq!(
            kinds,
            [
                (0x4, 0, 0),
                (HEADERS, PRIORITY | END_HEADERS, 1),
                (0x0, END_STREAM, 1),
                (HEADERS, END_STREAM | END_HEADERS, 3)
            ]
        );
        assert_eq!(&got[1].3[..5], &[0, 0, 0, 0, 16], "priority kept");
        assert_eq!(got[2].3, b"\0\0\0\0\0");
        // The server side decodes both blocks with one context, as the server does.
        let mut server = fluke_hpack::Decoder::new();
        for (n, block, path) in
            [(1, &got[1].3[5..], "ListAndWatch"), (3, &got[3].3[..], "Allocate")]
        {
            let h = server.decode(block).unwrap();
            let get = |k: &[u8]| h.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
            assert_eq!(get(b":authority").as_deref(), Some(&b"localhost"[..]), "stream {n}");
            assert!(get(b":path").unwrap().ends_with(path.as_bytes()));
            assert_eq!(get(b"content-type").as_deref(), Some(&b"application/grpc"[..]));
        }
    }

    #[tokio::test]
    async fn a_valid_authority_is_kept_and_bad_input_ends_the_connection() {
        let mut client = fluke_hpack::Encoder::new();
        let block = client.encode([(&b":authority"[..], &b"localhost:1234"[..])]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let out = through(input).await.unwrap();
        let got = frames(&out[24..]);
        let h = fluke_hpack::Decoder::new().decode(&got[0].3).unwrap();
        assert_eq!(h, vec![(b":authority".to_vec(), b"localhost:1234".to_vec())]);

        // A 4 KiB entry named 60,000 times by one octet each: 240 MB if decoded whole.
        let mut bomb = vec![0x40, 0x01, b'x', 0x7f, 0xa1, 0x1e];
        bomb.extend(std::iter::repeat_n(b'v', 4000));
        bomb.extend(std::iter::repeat_n(0xbe, 60_000));
        let mut d = fluke_hpack::Decoder::new();
        let e = decode(&mut d, &bomb).unwrap_err();
        assert!(e.to_string().contains("a header list over 16384 octets"), "{e}");
        let e = decode(&mut fluke_hpack::Decoder::new(), &[0x3f]).unwrap_err();
        assert!(e.to_string().contains("malformed"), "{e}");
        for bad in [
            frame(CONTINUATION, END_HEADERS, 1, b"x"),
            frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff, 0xff]),
            // A dynamic table size update cut short (the library would panic on it).
            frame(HEADERS, END_HEADERS, 1, &[0x3f]),
            // A table larger than the server allows.
            frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe1, 0xff, 0x03]),
            frame(HEADERS, END_HEADERS, 1, &bomb),
            // The same within one frame the server accepts: 10 MB decoded.
            frame(HEADERS, END_HEADERS, 1, &bomb[..6 + 4000 + 10_000]),
            {
                let mut f = frame(0x0, 0, 1, &[]);
                f[0] = 0x20; // 2 MiB
                f
            },
            // One octet over the frame size the server's SETTINGS state.
            frame(0x0, 0, 1, &[0; MAX_FRAME + 1]),
            // A stream a client cannot open.
            frame(HEADERS, END_HEADERS, 2, &block),
        ] {
            let mut input = PREFACE.to_vec();
            input.extend(bad);
            assert!(through(input).await.is_err());
        }
        // Not HTTP/2: passed through for the server to refuse.
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(through(http1.clone()).await.unwrap(), http1);
    }

    /// A gRPC request's HEADERS for stream `stream`, without END_STREAM.
    fn request(enc: &mut fluke_hpack::Encoder<'_>, stream: u32) -> Vec<u8> {
        let block = enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/v1beta1.DevicePlugin/Allocate"),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
        ]);
        frame(HEADERS, END_HEADERS, stream, &block)
    }

    fn kinds(octets: &[u8]) -> Vec<(u8, u32, Vec<u8>)> {
        frames(octets).into_iter().map(|(k, _, s, p)| (k, s, p)).collect()
    }

    #[tokio::test]
    async fn streams_past_the_cap_are_refused_and_never_reach_the_server() {
        let cap = limits::MAX_CONCURRENT_STREAMS;
        let mut enc = fluke_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(frame(SETTINGS, 0, 0, &[]));
        let ids: Vec<u32> = (0..cap + 2).map(|i| 2 * i + 1).collect();
        for &id in &ids {
            input.extend(request(&mut enc, id));
        }
        let (refused_a, refused_b) = (ids[cap as usize], ids[cap as usize + 1]);
        // On a refused stream: DATA (its octets given back), WINDOW_UPDATE and RST (dropped).
        input.extend(frame(DATA, 0, refused_a, &[0; 10]));
        input.extend(frame(WINDOW_UPDATE, 0, refused_b, &1u32.to_be_bytes()));
        input.extend(frame(RST_STREAM, 0, refused_a, &CANCEL.to_be_bytes()));
        // The client ends stream 1: a slot for the next.
        input.extend(frame(RST_STREAM, 0, 1, &CANCEL.to_be_bytes()));
        let next = refused_b + 2;
        input.extend(request(&mut enc, next));
        let (server, client) = both(input).await.unwrap();

        let server = kinds(&server[24..]);
        let headers: Vec<u32> =
            server.iter().filter(|(k, _, _)| *k == HEADERS).map(|(_, s, _)| *s).collect();
        let mut expect = ids[..cap as usize].to_vec();
        expect.push(next);
        assert_eq!(headers, expect, "only the streams within the cap reach the server");
        assert!(server.iter().all(|(_, s, _)| *s != refused_a && *s != refused_b), "{server:?}");
        // Every block the server got decodes in order with one context, though two were left out.
        let mut dec = fluke_hpack::Decoder::new();
        for (_, _, block) in server.iter().filter(|(k, _, _)| *k == HEADERS) {
            dec.decode(block).unwrap();
        }
        assert_eq!(
            kinds(&client),
            [
                (RST_STREAM, refused_a, REFUSED_STREAM.to_be_bytes().to_vec()),
                (RST_STREAM, refused_b, REFUSED_STREAM.to_be_bytes().to_vec()),
                (WINDOW_UPDATE, 0, 10u32.to_be_bytes().to_vec()),
            ]
        );
    }

    #[tokio::test]
    async fn a_length_prefix_over_the_cap_resets_the_stream_at_once() {
        let mut enc = fluke_hpack::Encoder::new();
        let mut input = PREFACE.to_vec();
        input.extend(request(&mut enc, 1));
        input.extend(request(&mut enc, 3));
        // Stream 1: a 2-octet message, then a prefix of 1 GiB and 3 octets of it.
        input.extend(frame(DATA, 0, 1, &[0, 0, 0, 0, 2, 0x0a, 0x00, 0, 0x40, 0, 0, 0, 1, 2, 3]));
        // More of it, in flight before the client saw the reset.
        input.extend(frame(DATA, 0, 1, &[0; 100]));
        // Stream 3: a message of the cap, cut over two frames.
        let cap = u32::try_from(limits::MAX_MESSAGE).unwrap().to_be_bytes();
        input.extend(frame(DATA, 0, 3, &[0, cap[0]]));
        input.extend(frame(DATA, 0, 3, &[cap[1], cap[2], cap[3], 7]));
        let (server, client) = both(input).await.unwrap();

        let server = kinds(&server[24..]);
        let on_1: Vec<(u8, Vec<u8>)> =
            server.iter().filter(|(_, s, _)| *s == 1).map(|(k, _, p)| (*k, p.clone())).collect();
        assert_eq!(on_1.len(), 2, "{on_1:?}");
        assert_eq!(on_1[0].0, HEADERS);
        assert_eq!(on_1[1], (RST_STREAM, CANCEL.to_be_bytes().to_vec()), "not the DATA");
        assert_eq!(server.iter().filter(|(k, s, _)| *k == DATA && *s == 3).count(), 2);
        assert_eq!(
            kinds(&client),
            [
                (RST_STREAM, 1, ENHANCE_YOUR_CALM.to_be_bytes().to_vec()),
                (WINDOW_UPDATE, 0, 15u32.to_be_bytes().to_vec()),
                (WINDOW_UPDATE, 0, 100u32.to_be_bytes().to_vec()),
            ]
        );
    }

    #[test]
    fn messages_are_counted_per_connection_until_whole() {
        let max = u32::try_from(limits::MAX_MESSAGE).unwrap();
        let prefix = |n: u32| {
            let mut p = vec![0];
            p.extend_from_slice(&n.to_be_bytes());
            p
        };
        let mut s = Streams::default();
        let per = limits::MAX_BUFFERED / limits::MAX_MESSAGE;
        let ids: Vec<u32> = (0..=per as u32).map(|i| 2 * i + 1).collect();
        for &id in &ids {
            assert_eq!(s.headers(id, false).unwrap(), Verdict::Forward);
        }
        for &id in &ids[..per] {
            assert_eq!(s.data(id, 5, &prefix(max), false), Verdict::Forward);
        }
        assert_eq!(s.buffered, limits::MAX_BUFFERED);
        let last = ids[per];
        assert_eq!(s.data(last, 5, &prefix(1), false), Verdict::Reset { credit: 5, declared: 1 });
        assert!(!s.open.contains_key(&last));
        // A message that arrives whole frees its share; so does a stream the server resets.
        let whole = vec![0u8; limits::MAX_MESSAGE];
        assert_eq!(s.data(ids[0], 0, &whole, false), Verdict::Forward);
        assert_eq!(s.buffered, limits::MAX_BUFFERED - limits::MAX_MESSAGE);
        s.server(RST_STREAM, 0, ids[1]);
        assert_eq!(s.buffered, limits::MAX_BUFFERED - 2 * limits::MAX_MESSAGE);
        // A prefix cut anywhere is read whole; a zero-length message is one.
        let mut split = prefix(0);
        split.extend(prefix(max + 1));
        assert_eq!(s.data(ids[0], 7, &split[..7], false), Verdict::Forward);
        assert_eq!(
            s.data(ids[0], 3, &split[7..], false),
            Verdict::Reset { credit: 3, declared: max + 1 }
        );
        assert!(s.open.is_empty(), "{s:?}");
        assert_eq!(s.buffered, 0);
    }

    #[test]
    fn a_stream_is_open_until_both_sides_end_it() {
        let mut s = Streams::default();
        assert_eq!(s.headers(1, false).unwrap(), Verdict::Forward);
        assert_eq!(s.data(1, 5, &[0, 0, 0, 0, 0], true), Verdict::Forward);
        s.server(HEADERS, 0, 1);
        assert!(s.open.contains_key(&1), "the response's headers do not end it");
        s.server(HEADERS, END_STREAM, 1);
        assert!(s.open.is_empty());
        // Trailers from the client end its side too; the server ending first counts as well.
        assert_eq!(s.headers(3, false).unwrap(), Verdict::Forward);
        s.server(DATA, END_STREAM, 3);
        assert_eq!(s.headers(3, true).unwrap(), Verdict::Forward);
        assert!(s.open.is_empty());
        // A stream id at or below the last is over: its frames are dropped.
        assert_eq!(s.headers(1, true).unwrap(), Verdict::Drop { credit: 0 });
        assert_eq!(s.data(3, 9, &[0; 9], false), Verdict::Drop { credit: 9 });
        assert_eq!(s.other(WINDOW_UPDATE, 3), Verdict::Drop { credit: 0 });
        // The connection's own frames and an idle stream's are the server's to judge.
        assert_eq!(s.other(WINDOW_UPDATE, 0), Verdict::Forward);
        assert_eq!(s.data(7, 1, &[0], false), Verdict::Forward);
        assert_eq!(s.other(0x2, 1), Verdict::Forward); // PRIORITY
    }

    #[test]
    fn the_servers_settings_state_the_limits() {
        let entry = |id: u16, v: u32| {
            let mut e = id.to_be_bytes().to_vec();
            e.extend_from_slice(&v.to_be_bytes());
            e
        };
        let parse = |p: &[u8]| -> Vec<(u16, u32)> {
            p.chunks_exact(6)
                .map(|e| {
                    (u16::from_be_bytes([e[0], e[1]]), u32::from_be_bytes([e[2], e[3], e[4], e[5]]))
                })
                .collect()
        };
        // tonic's defaults: an initial window, nothing else.
        let mut tonic = entry(0x4, 1 << 20);
        tonic.extend(entry(SETTINGS_MAX_FRAME_SIZE, 1 << 20));
        assert_eq!(
            parse(&bounded_settings(&tonic, true)),
            [
                (0x4, 1 << 20),
                (SETTINGS_MAX_FRAME_SIZE, limits::MAX_FRAME),
                (SETTINGS_MAX_CONCURRENT_STREAMS, limits::MAX_CONCURRENT_STREAMS),
                (SETTINGS_MAX_HEADER_LIST_SIZE, limits::MAX_HEADER_LIST),
            ]
        );
        // Lower values are kept; a later SETTINGS is only held down, not added to.
        let mut lower = entry(SETTINGS_MAX_CONCURRENT_STREAMS, 10);
        lower.extend(entry(SETTINGS_MAX_HEADER_LIST_SIZE, 1 << 30));
        assert_eq!(
            parse(&bounded_settings(&lower, true)),
            [
                (SETTINGS_MAX_CONCURRENT_STREAMS, 10),
                (SETTINGS_MAX_HEADER_LIST_SIZE, limits::MAX_HEADER_LIST)
            ]
        );
        assert_eq!(bounded_settings(&[], false), Vec::<u8>::new());
    }

    #[tokio::test]
    async fn the_server_side_passes_through_but_for_settings_and_tells_streams_ends() {
        let back = Back::new(Vec::new());
        back.streams().headers(1, true).unwrap();
        let mut from_server = frame(SETTINGS, 0, 0, &[]);
        from_server.extend(frame(SETTINGS, ACK, 0, &[]));
        from_server.extend(frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x88"));
        from_server.extend(frame(DATA, 0, 5, &vec![7; 40_000]));
        down(from_server.as_slice(), &back).await.unwrap();
        assert!(back.streams().open.is_empty(), "the server's END_STREAM closed stream 1");
        let got = frames(&back.to.into_inner());
        assert_eq!(got.len(), 4);
        assert_eq!((got[0].0, got[0].3.len()), (SETTINGS, 12), "the two limits stated");
        assert_eq!((got[1].0, got[1].1), (SETTINGS, ACK));
        assert_eq!(got[2].3, b"\x88");
        assert_eq!(got[3].3, vec![7; 40_000], "a frame larger than the buffer, whole");
    }
}
