//! Accepts any HTTP/2 `:authority` a kubelet sends on a plugin's Unix socket.
//!
//! Kubelets built with grpc-go before 1.26's change send the socket's path as `:authority`
//! (`/var/lib/kubelet/device-plugins/xpu.sock`). That is not an authority by RFC 3986, and the
//! HTTP/2 server under tonic (`h2`) answers such a request with `RST_STREAM(PROTOCOL_ERROR)`:
//! the kubelet registers the plugin, its first `ListAndWatch` fails, and the resource never
//! appears. The authority of a request on a Unix socket means nothing to a gRPC server, so each
//! connection is passed through [`normalize`], which rewrites an `:authority` that is not a
//! valid authority to `localhost` (what newer kubelets send) and leaves everything else as it
//! was.
//!
//! Only the client's header blocks are touched (RFC 9113 and RFC 7541): the frames are read as
//! they come (a 9-octet header, then the payload), `HEADERS` and its `CONTINUATION`s are joined
//! into one block, decoded with the client's HPACK context, and encoded again with a context of
//! our own towards the server, so the two dynamic tables stay consistent on either side. Padding
//! is dropped, priority kept. Every other frame, and everything the server sends, goes through
//! byte for byte. Bounded: a frame over [`MAX_BLOCK`], a header block over [`MAX_HEADER_BLOCK`]
//! or decoding to more than [`MAX_HEADER_LIST`] (HPACK lets a few octets name a long table
//! entry again and again), a dynamic table over 4096 octets (what the server allows, h2's
//! default), or a block that does not decode ends the connection.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The client connection preface (RFC 9113, section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame payload every HTTP/2 peer accepts (`SETTINGS_MAX_FRAME_SIZE`'s initial
/// value): rewritten blocks are cut into frames of at most this.
const MAX_FRAME: usize = 16_384;
/// Largest frame or header block read: far above what a kubelet sends (a few hundred octets of
/// headers), far below what would let a peer make the plugin hold much memory.
pub const MAX_BLOCK: usize = 1 << 20;
/// Largest header block (HEADERS and its CONTINUATIONs) taken: a kubelet's are a few hundred
/// octets.
pub const MAX_HEADER_BLOCK: usize = 64 << 10;
/// Largest decoded header list, names and values together.
pub const MAX_HEADER_LIST: usize = 64 << 10;
/// The dynamic table size the client may use: `SETTINGS_HEADER_TABLE_SIZE`'s initial value,
/// which h2 does not change.
const MAX_TABLE: usize = 4096;

/// What the peer sent that cannot be passed on.
fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("HTTP/2 from the client: {what}"))
}

/// Copies the client's bytes from `from` to `to` (the gRPC server), rewriting `:authority`
/// where it is not an authority; returns when the client closes or sends what cannot be read.
pub async fn normalize<R, W>(mut from: R, mut to: W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
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
    let mut told = false;
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if len > MAX_BLOCK {
            return Err(bad(&format!("a frame of {len} octets")));
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
                    let pad =
                        usize::from(*body.first().ok_or_else(|| bad("empty padded HEADERS"))?);
                    if pad + 1 > body.len() {
                        return Err(bad("padding longer than the frame"));
                    }
                    body = &body[1..body.len() - pad];
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
                    return Err(bad("a header block over 64 KiB"));
                }
                pending = Some((stream, flags, priority, body.to_vec()));
            }
            CONTINUATION => match &mut pending {
                Some((s, _, _, block)) if *s == stream => {
                    if block.len() + payload.len() > MAX_HEADER_BLOCK {
                        return Err(bad("a header block over 64 KiB"));
                    }
                    block.extend_from_slice(&payload);
                }
                _ => return Err(bad("CONTINUATION outside a header block")),
            },
            _ => {
                if pending.is_some() {
                    return Err(bad("a frame inside a header block"));
                }
                to.write_all(&head).await?;
                to.write_all(&payload).await?;
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
        let (headers, replaced) = decode(&mut decoder, &block)?;
        if let Some(authority) = replaced
            && !told
        {
            // Once per connection: which kubelet this is shows in the plugin's log.
            told = true;
            tracing::info!(
                authority = %String::from_utf8_lossy(&authority),
                "the client sent a socket path as :authority, as kubelets before 1.26 do; served as localhost"
            );
        }
        let encoded = encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        write_block(&mut to, stream, flags & (END_STREAM | PRIORITY), &priority, &encoded).await?;
    }
    to.shutdown().await
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
        Ok(Ok(())) => Err(bad("a header list over 64 KiB")),
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

    /// One frame as octets.
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

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

    async fn through(input: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        normalize(input.as_slice(), &mut out).await?;
        Ok(out)
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
        assert!(e.to_string().contains("a header list over 64 KiB"), "{e}");
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
            {
                let mut f = frame(0x0, 0, 1, &[]);
                f[0] = 0x20; // 2 MiB
                f
            },
        ] {
            let mut input = PREFACE.to_vec();
            input.extend(bad);
            assert!(through(input).await.is_err());
        }
        // Not HTTP/2: passed through for the server to refuse.
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(through(http1.clone()).await.unwrap(), http1);
    }
}
