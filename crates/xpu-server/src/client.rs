//! The client of the daemon's API: hyper's HTTP/1 client connection over the daemon's Unix
//! socket or TCP, driven by a current-thread tokio runtime the client owns, so its callers (the
//! CLI, tests, the benchmark) stay synchronous. The connection is kept between requests while
//! the daemon keeps it open.
//!
//! Typed calls ([`Client::submit`], [`Client::jobs`], [`Client::job`]...) send the parameters of
//! [`crate::wire`], with their query strings encoded by serde_urlencoded, and read back the
//! response types the handlers answer with; a refusal becomes [`ClientError::Refused`] with the
//! daemon's own message. [`Client::request`] sends anything and returns the raw answer. A
//! request that changes something is sent with a JSON or YAML content type unless the caller
//! names one (the daemon refuses others: see [`crate::api`]).

use std::path::PathBuf;

use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::wire::{
    CancelAccepted, DeviceList, ErrorBody, EventList, EventParams, JobDetail, JobList, ListParams,
    LogParams, Queue, Status, Submitted,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("server {0:?} is not understood; use unix:///path/to/xpu.sock or http://host:port")]
    BadUrl(String),
    #[error("connecting to {target}: {error}; is xpu serve running? (pass --server or start it)")]
    Connect { target: String, error: std::io::Error },
    #[error("talking to {target}: {error}")]
    Http { target: String, error: String },
    #[error("a request to {target} cannot be sent: {what}")]
    Request { target: String, what: String },
    #[error("starting the client's I/O runtime: {0}")]
    Runtime(std::io::Error),
    /// The daemon refused the request (4xx) or failed it (5xx); `message` is its own words.
    #[error("{message}")]
    Refused { status: u16, message: String, field: Option<String> },
    #[error(
        "{target} answered {what} that is not what this xpu expects ({error}); is the daemon another version of xpu?"
    )]
    Decode { target: String, what: &'static str, error: serde_json::Error },
}

impl ClientError {
    /// Whether the daemon found fault with the request itself (4xx): usage, not failure.
    pub fn is_refusal(&self) -> bool {
        matches!(self, ClientError::Refused { status, .. } if *status < 500)
    }
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

    /// The `Host` header: the address for TCP; a name for the socket, which has no host.
    fn host(&self) -> &str {
        match self {
            Target::Tcp(h) => h,
            Target::Unix(_) => "localhost",
        }
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

    /// The daemon's [`ErrorBody`]; for a body that is not one (a proxy's page), its text.
    pub fn error_body(&self) -> ErrorBody {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| {
            ErrorBody::new(String::from_utf8_lossy(&self.body).trim().to_owned())
        })
    }

    /// The `error` field of an error body, else the body as text.
    pub fn error_message(&self) -> String {
        self.error_body().error
    }
}

/// A connection to the daemon, reused across requests while the server keeps it open.
pub struct Client {
    target: Target,
    token: Option<String>,
    /// Started on the first request, so that making a client cannot fail.
    rt: Option<tokio::runtime::Runtime>,
    conn: Option<SendRequest<Full<Bytes>>>,
}

/// What one attempt at a request came to.
enum Failure {
    /// Nothing of the request left this client: it may be sent again on a new connection.
    Unsent(ClientError),
    /// The request may have reached the daemon.
    Sent(ClientError),
}

impl Client {
    pub fn new(target: Target, token: Option<String>) -> Client {
        Client { target, token, rt: None, conn: None }
    }

    pub fn target(&self) -> &Target {
        &self.target
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

    /// `GET /v1/status`.
    pub fn status(&mut self) -> Result<Status, ClientError> {
        self.call(Method::GET, "/v1/status", None, &[], "a status")
    }

    /// `POST /v1/jobs` with a manifest (YAML or JSON) and, for safe retries, an idempotency key.
    pub fn submit(&mut self, manifest: &[u8], key: Option<&str>) -> Result<Submitted, ClientError> {
        let mut headers = vec![("Content-Type", "application/yaml")];
        headers.extend(key.map(|k| ("Idempotency-Key", k)));
        self.call(Method::POST, "/v1/jobs", Some(manifest), &headers, "a submission's answer")
    }

    /// `GET /v1/jobs`: a page of jobs, newest first.
    pub fn jobs(&mut self, params: &ListParams) -> Result<JobList, ClientError> {
        let path = self.with_query("/v1/jobs", params)?;
        self.call(Method::GET, &path, None, &[], "a job list")
    }

    /// `GET /v1/jobs/{id}`.
    pub fn job(&mut self, id: i64) -> Result<JobDetail, ClientError> {
        self.call(Method::GET, &format!("/v1/jobs/{id}"), None, &[], "a job")
    }

    /// `POST /v1/jobs/{id}/cancel`.
    pub fn cancel(&mut self, id: i64) -> Result<CancelAccepted, ClientError> {
        let path = format!("/v1/jobs/{id}/cancel");
        self.call(Method::POST, &path, None, &[], "a cancellation's answer")
    }

    /// `GET /v1/devices`.
    pub fn devices(&mut self) -> Result<DeviceList, ClientError> {
        self.call(Method::GET, "/v1/devices", None, &[], "a device list")
    }

    /// `GET /v1/queue`.
    pub fn queue(&mut self) -> Result<Queue, ClientError> {
        self.call(Method::GET, "/v1/queue", None, &[], "a queue")
    }

    /// `GET /v1/events`.
    pub fn events(&mut self, params: &EventParams) -> Result<EventList, ClientError> {
        let path = self.with_query("/v1/events", params)?;
        self.call(Method::GET, &path, None, &[], "an event list")
    }

    /// `GET /v1/jobs/{id}/logs`, handing the log to `sink` as it arrives (with `follow`, until
    /// the attempt ends).
    pub fn logs(
        &mut self,
        id: i64,
        params: &LogParams,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), ClientError> {
        let path = self.with_query(&format!("/v1/jobs/{id}/logs"), params)?;
        let mut refusal = Vec::new();
        let status = self.request_streaming("GET", &path, None, &[], &mut |status, chunk| {
            if status < 400 {
                sink(chunk);
            } else {
                refusal.extend_from_slice(chunk);
            }
        })?;
        if status >= 400 {
            return Err(refused(&Response { status, body: refusal }));
        }
        Ok(())
    }

    /// `path?query` with `params` encoded (none: `path` alone).
    fn with_query(&self, path: &str, params: &impl Serialize) -> Result<String, ClientError> {
        let query = serde_urlencoded::to_string(params).map_err(|e| ClientError::Request {
            target: self.target.to_string(),
            what: format!("encoding the query string of {path}: {e}"),
        })?;
        Ok(if query.is_empty() { path.to_owned() } else { format!("{path}?{query}") })
    }

    /// Sends a request and reads a 2xx answer as `T` (`what` names it in errors).
    fn call<T: DeserializeOwned>(
        &mut self,
        method: Method,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
        what: &'static str,
    ) -> Result<T, ClientError> {
        let r = self.request(method.as_str(), path, body, headers)?;
        if r.status >= 400 {
            return Err(refused(&r));
        }
        serde_json::from_slice(&r.body).map_err(|error| ClientError::Decode {
            target: self.target.to_string(),
            what,
            error,
        })
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
        let method = Method::from_bytes(method.as_bytes()).map_err(|e| ClientError::Request {
            target: self.target.to_string(),
            what: format!("method {method:?}: {e}"),
        })?;
        let body = Bytes::copy_from_slice(body.unwrap_or_default());
        let rt = match self.rt.take() {
            Some(rt) => rt,
            None => tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .map_err(ClientError::Runtime)?,
        };
        let Client { target, token, conn, .. } = self;
        let build = || build_request(target, token.as_deref(), &method, path, &body, headers);
        let result = rt.block_on(async {
            // A kept-alive connection the daemon closed meanwhile fails on first use: send again
            // on a fresh one when the request never left, or when it is a GET (safe to repeat)
            // and nothing of the response was read.
            let reused = conn.is_some();
            match exchange(target, conn, build()?, sink).await {
                Ok(status) => Ok(status),
                Err(Failure::Unsent(_)) if reused => {
                    *conn = None;
                    exchange(target, conn, build()?, sink).await.map_err(Failure::into_error)
                }
                Err(Failure::Sent(ClientError::Http { .. })) if reused && method == Method::GET => {
                    *conn = None;
                    exchange(target, conn, build()?, sink).await.map_err(Failure::into_error)
                }
                Err(f) => Err(f.into_error()),
            }
        });
        self.rt = Some(rt);
        result
    }
}

impl Failure {
    fn into_error(self) -> ClientError {
        match self {
            Failure::Unsent(e) | Failure::Sent(e) => e,
        }
    }
}

/// The error for a 4xx or 5xx answer, in the daemon's words.
fn refused(r: &Response) -> ClientError {
    let body = r.error_body();
    let message = if r.status >= 500 {
        format!("the daemon failed (HTTP {}): {}", r.status, body.error)
    } else {
        body.error
    };
    ClientError::Refused { status: r.status, message, field: body.field }
}

fn build_request(
    target: &Target,
    token: Option<&str>,
    method: &Method,
    path: &str,
    body: &Bytes,
    headers: &[(&str, &str)],
) -> Result<Request<Full<Bytes>>, ClientError> {
    let bad = |what: String| ClientError::Request { target: target.to_string(), what };
    let mut req = Request::builder().method(method.clone()).uri(path);
    req = req.header(header::HOST, target.host());
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    // The daemon takes a change only with a JSON or YAML content type (what a browser cannot
    // send cross-site without asking first); a manifest is YAML, and JSON is YAML.
    let typed = headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type"));
    if !typed && !matches!(*method, Method::GET | Method::HEAD) {
        let media = if body.is_empty() { "application/json" } else { "application/yaml" };
        req = req.header(header::CONTENT_TYPE, HeaderValue::from_static(media));
    }
    if !body.is_empty() || *method == Method::POST {
        req = req.header(header::CONTENT_LENGTH, body.len());
    }
    req.body(Full::new(body.clone())).map_err(|e| bad(format!("{method} {path}: {e}")))
}

/// One request and its whole response on `conn` (a new connection when there is none or the
/// daemon closed it), leaving the connection in `conn` for the next request.
async fn exchange(
    target: &Target,
    conn: &mut Option<SendRequest<Full<Bytes>>>,
    req: Request<Full<Bytes>>,
    sink: &mut dyn FnMut(u16, &[u8]),
) -> Result<u16, Failure> {
    let http = |e: hyper::Error| ClientError::Http {
        target: target.to_string(),
        error: xpu_core::error::chain_once(&e),
    };
    let mut sender = match conn.take() {
        Some(s) if !s.is_closed() => s,
        _ => connect(target).await.map_err(Failure::Sent)?,
    };
    sender.ready().await.map_err(|e| Failure::Unsent(http(e)))?;
    let resp = sender.try_send_request(req).await.map_err(|mut e| {
        let unsent = e.take_message().is_some();
        let error = http(e.into_error());
        if unsent { Failure::Unsent(error) } else { Failure::Sent(error) }
    })?;
    let status = resp.status().as_u16();
    read_body(resp.into_body(), status, sink).await.map_err(|e| Failure::Sent(http(e)))?;
    *conn = Some(sender);
    Ok(status)
}

async fn read_body(
    mut body: Incoming,
    status: u16,
    sink: &mut dyn FnMut(u16, &[u8]),
) -> Result<(), hyper::Error> {
    let mut any = false;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame?.data_ref() {
            any = true;
            sink(status, data);
        }
    }
    // A caller that only looks at what the sink got still learns the status of an empty answer.
    if !any {
        sink(status, &[]);
    }
    Ok(())
}

/// A new HTTP/1 connection to the daemon; a task on the client's runtime drives it.
async fn connect(target: &Target) -> Result<SendRequest<Full<Bytes>>, ClientError> {
    let err = |error| ClientError::Connect { target: target.to_string(), error };
    let handshake = match target {
        Target::Unix(p) => {
            let s = tokio::net::UnixStream::connect(p).await.map_err(err)?;
            drive(TokioIo::new(s)).await
        }
        Target::Tcp(h) => {
            let s = tokio::net::TcpStream::connect(h.as_str()).await.map_err(err)?;
            // Requests are small and answered at once: Nagle's delay would only add latency. A
            // socket that refuses the option still works.
            let _ = s.set_nodelay(true);
            drive(TokioIo::new(s)).await
        }
    };
    handshake.map_err(|e| ClientError::Http {
        target: target.to_string(),
        error: xpu_core::error::chain_once(&e),
    })
}

async fn drive<I>(io: I) -> hyper::Result<SendRequest<Full<Bytes>>>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(async move {
        // A failing connection fails the request on it, which reports the error; with none in
        // flight, the next request finds the connection closed and opens another.
        let _ = connection.await;
    });
    Ok(sender)
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

    #[test]
    fn query_strings_are_encoded() {
        let c = Client::new(Target::Tcp("127.0.0.1:1".into()), None);
        let p = ListParams { limit: Some(3), ..ListParams::default() };
        assert_eq!(c.with_query("/v1/jobs", &p).ok().as_deref(), Some("/v1/jobs?limit=3"));
        assert_eq!(
            c.with_query("/v1/jobs", &ListParams::default()).ok().as_deref(),
            Some("/v1/jobs")
        );
    }

    #[test]
    fn refusals_carry_the_daemons_words() {
        let r = Response { status: 400, body: br#"{"error":"limit: 0","field":"limit"}"#.to_vec() };
        let e = refused(&r);
        assert!(e.is_refusal());
        assert_eq!(e.to_string(), "limit: 0");
        let r = Response { status: 503, body: b"<html>busy</html>".to_vec() };
        let e = refused(&r);
        assert!(!e.is_refusal());
        assert_eq!(e.to_string(), "the daemon failed (HTTP 503): <html>busy</html>");
    }
}
