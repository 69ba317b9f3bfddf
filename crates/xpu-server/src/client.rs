//! A small blocking HTTP/1.1 client for the daemon's API, over its Unix socket or TCP, so the
//! CLI needs no HTTP stack of its own. It speaks exactly what the daemon answers: fixed-length
//! and chunked bodies, keep-alive when the server allows it. A request that changes something
//! is sent with a JSON or YAML content type unless the caller names one.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("server {0:?} is not understood; use unix:///path/to/xpu.sock or http://host:port")]
    BadUrl(String),
    #[error("connecting to {target}: {error}; is xpu serve running? (pass --server or start it)")]
    Connect { target: String, error: std::io::Error },
    #[error("talking to {target}: {error}")]
    Io { target: String, error: std::io::Error },
    #[error("{target} sent a malformed HTTP response: {what}")]
    Protocol { target: String, what: String },
}

/// Where the daemon is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Unix(PathBuf),
    Tcp(String),
}

impl Target {
    /// `unix:///run/xpu.sock`, a bare path, or `http://127.0.0.1:8470`.
    pub fn parse(s: &str) -> Result<Target, ClientError> {
        if let Some(p) = s.strip_prefix("unix://") {
            return Ok(Target::Unix(PathBuf::from(p)));
        }
        if s.starts_with('/') {
            return Ok(Target::Unix(PathBuf::from(s)));
        }
        if let Some(rest) = s.strip_prefix("http://") {
            let host = rest.trim_end_matches('/');
            if host.is_empty() || host.contains('/') {
                return Err(ClientError::BadUrl(s.to_owned()));
            }
            return Ok(Target::Tcp(host.to_owned()));
        }
        Err(ClientError::BadUrl(s.to_owned()))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Unix(p) => write!(f, "unix://{}", p.display()),
            Target::Tcp(h) => write!(f, "http://{h}"),
        }
    }
}

/// A response with its whole body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The `error` field of an error body, else the body as text.
    pub fn error_message(&self) -> String {
        self.json()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).trim().to_owned())
    }
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// A connection to the daemon, reused across requests while the server keeps it open.
pub struct Client {
    target: Target,
    token: Option<String>,
    conn: Option<BufReader<Box<dyn Stream>>>,
}

impl Client {
    pub fn new(target: Target, token: Option<String>) -> Client {
        Client { target, token, conn: None }
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    fn connect(&self) -> Result<BufReader<Box<dyn Stream>>, ClientError> {
        let err = |source| ClientError::Connect { target: self.target.to_string(), error: source };
        let stream: Box<dyn Stream> = match &self.target {
            Target::Unix(p) => Box::new(UnixStream::connect(p).map_err(err)?),
            Target::Tcp(h) => {
                let s = TcpStream::connect(h).map_err(err)?;
                let _ = s.set_nodelay(true);
                Box::new(s)
            }
        };
        Ok(BufReader::new(stream))
    }

    fn io(&self, source: std::io::Error) -> ClientError {
        ClientError::Io { target: self.target.to_string(), error: source }
    }

    fn proto(&self, what: impl Into<String>) -> ClientError {
        ClientError::Protocol { target: self.target.to_string(), what: what.into() }
    }

    /// Polls `/v1/status` until the daemon answers (with any status) or `timeout` passes, for
    /// callers that have just started it; the last connection error when it never does.
    pub fn wait_until_answering(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<(), ClientError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.request("GET", "/v1/status", None, &[]) {
                Ok(_) => return Ok(()),
                Err(e) if std::time::Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(50)),
            }
        }
    }

    /// Sends a request and reads the whole response.
    pub fn request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> Result<Response, ClientError> {
        let mut out = Vec::new();
        let status = self.request_streaming(method, path, body, headers, &mut |_, chunk| {
            out.extend_from_slice(chunk);
        })?;
        Ok(Response { status, body: out })
    }

    /// Sends a request and hands the status and the body to `sink` as the body arrives (for
    /// `logs -f`).
    pub fn request_streaming(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<u16, ClientError> {
        // A kept-alive connection the server closed meanwhile fails on first use: retry once
        // on a fresh one, but only when nothing of the response was read.
        let reused = self.conn.is_some();
        match self.try_request(method, path, body, headers, sink) {
            Err(ClientError::Io { .. } | ClientError::Protocol { .. })
                if reused && method == "GET" =>
            {
                self.conn = None;
                self.try_request(method, path, body, headers, sink)
            }
            other => other,
        }
    }

    fn try_request(
        &mut self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
        sink: &mut dyn FnMut(u16, &[u8]),
    ) -> Result<u16, ClientError> {
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => self.connect()?,
        };
        let host = match &self.target {
            Target::Tcp(h) => h.as_str(),
            Target::Unix(_) => "localhost",
        };
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
        if let Some(t) = &self.token {
            req.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        let body = body.unwrap_or_default();
        // The daemon takes a change only with a JSON or YAML content type (what a browser
        // cannot send cross-site without asking first); a manifest is YAML, and JSON is YAML.
        let typed = headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type"));
        if !typed && !matches!(method, "GET" | "HEAD") {
            let media = if body.is_empty() { "application/json" } else { "application/yaml" };
            req.push_str(&format!("Content-Type: {media}\r\n"));
        }
        if !body.is_empty() || method == "POST" {
            req.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        req.push_str("\r\n");
        let mut bytes = req.into_bytes();
        bytes.extend_from_slice(body);
        // A daemon that refuses a request early (a body over its limit: 413) answers and closes
        // while the body is still being sent: the write fails, but its answer is there to read.
        // With no answer, the write's error is the one to report.
        let write_err = match conn.get_mut().write_all(&bytes) {
            Ok(()) => None,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Some(e)
            }
            Err(e) => return Err(self.io(e)),
        };

        let mut line = String::new();
        match (conn.read_line(&mut line), write_err) {
            (Ok(n), _) if n > 0 => {}
            (_, Some(e)) => return Err(self.io(e)),
            (Err(e), None) => return Err(self.io(e)),
            (Ok(_), None) => return Err(self.proto("connection closed before the status line")),
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| self.proto(format!("status line {:?}", line.trim())))?;
        let mut length: Option<usize> = None;
        let mut chunked = false;
        let mut close = false;
        loop {
            line.clear();
            conn.read_line(&mut line).map_err(|e| self.io(e))?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                match k.as_str() {
                    "content-length" => length = v.parse().ok(),
                    "transfer-encoding" => chunked = v.eq_ignore_ascii_case("chunked"),
                    "connection" => close = v.eq_ignore_ascii_case("close"),
                    _ => {}
                }
            }
        }
        if chunked {
            loop {
                line.clear();
                conn.read_line(&mut line).map_err(|e| self.io(e))?;
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                    .map_err(|_| self.proto(format!("chunk size {:?}", line.trim())))?;
                if size == 0 {
                    line.clear();
                    conn.read_line(&mut line).map_err(|e| self.io(e))?;
                    break;
                }
                let mut buf = vec![0u8; size];
                conn.read_exact(&mut buf).map_err(|e| self.io(e))?;
                sink(status, &buf);
                let mut crlf = [0u8; 2];
                conn.read_exact(&mut crlf).map_err(|e| self.io(e))?;
            }
        } else if let Some(n) = length {
            let mut buf = vec![0u8; n];
            conn.read_exact(&mut buf).map_err(|e| self.io(e))?;
            sink(status, &buf);
        } else {
            let mut buf = Vec::new();
            conn.read_to_end(&mut buf).map_err(|e| self.io(e))?;
            sink(status, &buf);
            close = true;
        }
        if !close {
            self.conn = Some(conn);
        }
        Ok(status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(Target::parse("unix:///a/b.sock").ok(), Some(Target::Unix("/a/b.sock".into())));
        assert_eq!(Target::parse("/a/b.sock").ok(), Some(Target::Unix("/a/b.sock".into())));
        assert_eq!(
            Target::parse("http://127.0.0.1:8470/").ok(),
            Some(Target::Tcp("127.0.0.1:8470".into()))
        );
        assert!(Target::parse("ftp://x").is_err());
    }
}
