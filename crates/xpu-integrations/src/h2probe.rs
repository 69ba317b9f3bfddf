//! A raw HTTP/2 client for tests of what xpu's gRPC servers bound ([`crate::limits`]): it writes
//! frames exactly as asked, including what a client library will not send (HEADERS-only
//! streams past the server's `SETTINGS_MAX_CONCURRENT_STREAMS`, a gRPC length prefix with no
//! message behind it), and reads the server's answer frame by frame. Shared by this crate's
//! tests and `xpu-kube`'s DRA plugin tests. It trusts the server: not for production.

use std::io;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const WINDOW_UPDATE: u8 = 0x8;
pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

/// `SETTINGS_MAX_CONCURRENT_STREAMS`.
pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// `SETTINGS_MAX_FRAME_SIZE`.
pub const MAX_FRAME_SIZE: u16 = 0x5;
/// `SETTINGS_MAX_HEADER_LIST_SIZE`.
pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;

/// RST_STREAM codes (RFC 9113, section 7).
pub const CANCEL: u32 = 0x8;
pub const REFUSED_STREAM: u32 = 0x7;
pub const ENHANCE_YOUR_CALM: u32 = 0xb;

/// One frame as read, with a HEADERS block decoded.
#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
    /// The decoded header list of a HEADERS frame (END_HEADERS is expected on it).
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Frame {
    /// The error code of a RST_STREAM or GOAWAY.
    pub fn code(&self) -> Option<u32> {
        let at = match self.kind {
            RST_STREAM => 0,
            GOAWAY => 4,
            _ => return None,
        };
        let b = self.payload.get(at..at + 4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// One frame as octets.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A client connection to a gRPC server on a Unix socket.
pub struct Probe {
    conn: UnixStream,
    enc: fluke_hpack::Encoder<'static>,
    dec: fluke_hpack::Decoder<'static>,
    next: u32,
    settings: Vec<(u16, u32)>,
    /// The `:authority` of the requests [`Probe::open`] sends: `localhost` unless changed (a
    /// kubelet before 1.26 sends the socket's path).
    pub authority: Vec<u8>,
}

impl Probe {
    /// Connects, sends the preface and empty SETTINGS, and waits (at most `wait`) for the
    /// server's SETTINGS, which it acknowledges. An error when the server closes first.
    pub async fn connect(socket: &Path, wait: Duration) -> io::Result<Probe> {
        let conn = UnixStream::connect(socket).await?;
        let mut p = Probe {
            conn,
            enc: fluke_hpack::Encoder::new(),
            dec: fluke_hpack::Decoder::new(),
            next: 1,
            settings: Vec::new(),
            authority: b"localhost".to_vec(),
        };
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        p.conn.write_all(&hello).await?;
        let settings = async {
            loop {
                match p.read().await? {
                    Some(f) if f.kind == SETTINGS && f.flags & ACK == 0 => return Ok(()),
                    Some(_) => {}
                    None => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the server closed the connection before its SETTINGS",
                        ));
                    }
                }
            }
        };
        tokio::time::timeout(wait, settings).await.map_err(|_| {
            io::Error::new(io::ErrorKind::TimedOut, "no SETTINGS from the server")
        })??;
        Ok(p)
    }

    /// The value the server gave a setting, if it sent one.
    pub fn setting(&self, id: u16) -> Option<u32> {
        self.settings.iter().rev().find(|(i, _)| *i == id).map(|(_, v)| *v)
    }

    /// Writes octets as they are.
    pub async fn send(&mut self, octets: &[u8]) -> io::Result<()> {
        self.conn.write_all(octets).await
    }

    /// Opens the next stream with a gRPC request's HEADERS for `path` (no END_STREAM) and
    /// returns its id.
    pub async fn open(&mut self, path: &str) -> io::Result<u32> {
        let stream = self.next;
        self.next += 2;
        let block = self.enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", path.as_bytes()),
            (b":authority", self.authority.as_slice()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]);
        self.send(&frame(HEADERS, END_HEADERS, stream, &block)).await?;
        Ok(stream)
    }

    /// DATA on `stream`.
    pub async fn data(&mut self, stream: u32, payload: &[u8], end: bool) -> io::Result<()> {
        self.send(&frame(DATA, if end { END_STREAM } else { 0 }, stream, payload)).await
    }

    /// RST_STREAM on `stream`.
    pub async fn reset(&mut self, stream: u32, code: u32) -> io::Result<()> {
        self.send(&frame(RST_STREAM, 0, stream, &code.to_be_bytes())).await
    }

    /// Sends a PING and reads until its answer; returns the frames read before it. A server
    /// handles frames in order, so what it did with the frames sent before the PING has been
    /// written by then, as far as the answer to each needs nothing but those frames.
    pub async fn ping_pong(&mut self, wait: Duration) -> io::Result<Vec<Frame>> {
        let token = *b"xpuprobe";
        self.send(&frame(PING, 0, 0, &token)).await?;
        let mut seen = Vec::new();
        let read = async {
            loop {
                match self.read().await? {
                    Some(f) if f.kind == PING && f.flags & ACK != 0 && f.payload == token => {
                        return Ok(seen);
                    }
                    Some(f) => seen.push(f),
                    None => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the server closed the connection before answering the PING",
                        ));
                    }
                }
            }
        };
        tokio::time::timeout(wait, read)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer to the PING"))?
    }

    /// The next frame (`None` once the server closed), answering SETTINGS and PING as a client
    /// must.
    pub async fn read(&mut self) -> io::Result<Option<Frame>> {
        let mut head = [0u8; 9];
        match self.conn.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut f = Frame {
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
            payload: vec![0u8; len],
            headers: Vec::new(),
        };
        self.conn.read_exact(&mut f.payload).await?;
        match f.kind {
            SETTINGS if f.flags & ACK == 0 => {
                for s in f.payload.chunks_exact(6) {
                    let id = u16::from_be_bytes([s[0], s[1]]);
                    self.settings.push((id, u32::from_be_bytes([s[2], s[3], s[4], s[5]])));
                }
                self.send(&frame(SETTINGS, ACK, 0, &[])).await?;
            }
            PING if f.flags & ACK == 0 => {
                let echo = frame(PING, ACK, 0, &f.payload);
                self.send(&echo).await?;
            }
            HEADERS => {
                f.headers = self.dec.decode(&f.payload).map_err(|e| {
                    io::Error::new(io::ErrorKind::InvalidData, format!("HPACK: {e:?}"))
                })?;
            }
            _ => {}
        }
        Ok(Some(f))
    }
}

/// What the server did with a flood of HEADERS-only streams on one connection.
#[derive(Debug, Default)]
pub struct Flood {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` as the client was told it.
    pub advertised: Option<u32>,
    /// Streams reset with `REFUSED_STREAM`.
    pub refused: Vec<u32>,
    /// Streams reset with another code, and the code.
    pub reset: Vec<(u32, u32)>,
    /// The streams opened, in order.
    pub opened: Vec<u32>,
    /// Whether the server closed the connection (or sent GOAWAY).
    pub closed: bool,
}

impl Flood {
    /// The counts, for an assertion's message.
    pub fn summary(&self) -> String {
        format!(
            "{} streams opened, SETTINGS_MAX_CONCURRENT_STREAMS {:?}, {} refused, {} reset \
             otherwise {:?}, connection closed: {}",
            self.opened.len(),
            self.advertised,
            self.refused.len(),
            self.reset.len(),
            self.reset.first(),
            self.closed
        )
    }
}

/// Opens `n` streams calling `path` on `probe`, each with its HEADERS only (no message, no end
/// of stream), as issue 13's attacker did, and collects what the server says about them until
/// `expect_refused` streams are refused, the connection ends, or `wait` passes.
pub async fn flood(
    probe: &mut Probe,
    path: &str,
    n: usize,
    expect_refused: usize,
    wait: Duration,
) -> io::Result<Flood> {
    let mut out = Flood { advertised: probe.setting(MAX_CONCURRENT_STREAMS), ..Flood::default() };
    for _ in 0..n {
        out.opened.push(probe.open(path).await?);
    }
    let collect = async {
        while out.refused.len() < expect_refused {
            match probe.read().await? {
                None => {
                    out.closed = true;
                    break;
                }
                Some(f) if f.kind == GOAWAY => {
                    out.closed = true;
                    break;
                }
                Some(f) if f.kind == RST_STREAM => match f.code() {
                    Some(REFUSED_STREAM) => out.refused.push(f.stream),
                    Some(c) => out.reset.push((f.stream, c)),
                    None => {}
                },
                Some(_) => {}
            }
        }
        io::Result::Ok(())
    };
    // Today's server refuses nothing: the deadline only ends the wait for what never comes.
    if let Ok(r) = tokio::time::timeout(wait, collect).await {
        r?;
    }
    out.advertised = probe.setting(MAX_CONCURRENT_STREAMS);
    Ok(out)
}

/// How the server ended a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// RST_STREAM with this code.
    Reset(u32),
    /// Trailers with this `grpc-status` (and `grpc-message`).
    Status(String, String),
    /// GOAWAY or the connection closed.
    Closed,
    /// Nothing within the wait.
    Nothing,
}

impl Answer {
    /// Whether this is the answer to a message over the limit: `RESOURCE_EXHAUSTED` (8) as a
    /// status, or a reset with `ENHANCE_YOUR_CALM`, which gRPC maps to it.
    pub fn is_resource_exhausted(&self) -> bool {
        matches!(self, Answer::Reset(ENHANCE_YOUR_CALM))
            || matches!(self, Answer::Status(code, _) if code == "8")
    }
}

/// Waits (at most `wait`) for the end of `stream`: its reset, or trailers.
pub async fn answer(probe: &mut Probe, stream: u32, wait: Duration) -> io::Result<Answer> {
    let mut status = None;
    let mut message = String::new();
    let read = async {
        loop {
            let Some(f) = probe.read().await? else { return Ok(Answer::Closed) };
            match f.kind {
                GOAWAY => return Ok(Answer::Closed),
                RST_STREAM if f.stream == stream => {
                    return Ok(Answer::Reset(f.code().unwrap_or(u32::MAX)));
                }
                HEADERS if f.stream == stream => {
                    for (n, v) in &f.headers {
                        match n.as_slice() {
                            b"grpc-status" => status = Some(String::from_utf8_lossy(v).into()),
                            b"grpc-message" => message = String::from_utf8_lossy(v).into(),
                            _ => {}
                        }
                    }
                    if f.flags & END_STREAM != 0 {
                        let s = status.take().unwrap_or_default();
                        return Ok(Answer::Status(s, std::mem::take(&mut message)));
                    }
                }
                _ => {}
            }
        }
    };
    match tokio::time::timeout(wait, read).await {
        Ok(r) => r,
        Err(_) => Ok(Answer::Nothing),
    }
}

/// Opens a call to `path` and sends a gRPC length prefix declaring `declared` octets followed
/// by 16 of them, without ending the stream, and waits (at most `wait`) for the server to end
/// the call. A server that waits for the rest answers [`Answer::Nothing`].
pub async fn oversized(
    probe: &mut Probe,
    path: &str,
    declared: u32,
    wait: Duration,
) -> io::Result<Answer> {
    let stream = probe.open(path).await?;
    let mut data = vec![0u8];
    data.extend_from_slice(&declared.to_be_bytes());
    data.extend_from_slice(&[0u8; 16]);
    probe.data(stream, &data, false).await?;
    answer(probe, stream, wait).await
}

/// A unary call of `path` with `message` (already encoded) as its request.
pub async fn call(
    probe: &mut Probe,
    path: &str,
    message: &[u8],
    wait: Duration,
) -> io::Result<Answer> {
    let stream = probe.open(path).await?;
    let len = u32::try_from(message.len()).map_err(io::Error::other)?;
    let mut data = vec![0u8];
    data.extend_from_slice(&len.to_be_bytes());
    data.extend_from_slice(message);
    probe.data(stream, &data, true).await?;
    answer(probe, stream, wait).await
}
