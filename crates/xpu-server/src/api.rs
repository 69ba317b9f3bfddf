//! The HTTP API, the dashboard at `/` and Prometheus metrics at `/metrics`. Handlers answer
//! with the types of [`crate::wire`] and read their parameters into them; the OpenAPI document
//! served at `/openapi.json` is generated from those types and from each handler's
//! `#[utoipa::path]` ([`crate::wire::ApiDoc`]). Every refusal, from a handler or from the
//! middleware below, is a [`Refusal`]: a status and an [`ErrorBody`].
//!
//! Who may do what: every request that changes something (a submit, a cancel) or reads a
//! job's output (its logs) must prove who sends it ([`Caller`]): on the Unix socket (mode 0660)
//! the kernel's peer credentials, over TCP (loopback included) a bearer token, the daemon's own
//! (`<data-dir>/token`) or a user's (`<data-dir>/tokens`). A job belongs to, and runs as, the
//! user who submitted it; only its owner, root and the daemon's user may cancel it or read its
//! output. The overview (dashboard, status, job list and details, queue, devices, events,
//! metrics) needs no token on the socket and on loopback TCP; TCP bound to any other address
//! requires a token for everything.
//! Because loopback TCP answers whoever connects, and a browser on the host connects for any web
//! page it shows, every request first passes [`host_guard`]: on loopback TCP its `Host` must be
//! the daemon's own address (a DNS-rebound name is refused); and every route that changes
//! something is made with [`change`], so its requests pass [`refuse_cross_site`]: they must not
//! come from another origin and must carry a JSON or YAML content type, which a page can only
//! send to another origin after a CORS preflight the daemon never grants
//! (<https://fetch.spec.whatwg.org/#cors-safelisted-request-header>).
//! Request bodies are limited to [`MAX_BODY`]; manifests are validated by
//! [`xpu_core::job::parse`] and a bad one gets 400 with the field path in `error` and `field`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Extension, FromRequestParts, Path, Request, State};
use axum::handler::Handler;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use serde::de::DeserializeOwned;
use std::sync::OnceLock;
use utoipa::OpenApi as _;

use crate::Shared;
use crate::engine::Msg;
use crate::listen::{ConnStats, Peer};
use crate::metrics::DeviceSample;
use crate::store::{ListQuery, NewJob, Outcome, Owner, Write, now_ms};
use crate::wire::{
    self, ApiDoc, Bounded, CancelAccepted, DeviceList, DeviceTelemetry, DeviceView, ErrorBody,
    EventList, EventParams, JobDetail, JobList, JobState, ListParams, LogParams, LoginParams,
    ParamRefusals, Queue, Status, SubmitParams, Submitted, SubmittedJob, TaskRow,
};
use xpu_telemetry::collect::Holder;

/// Largest accepted request body (a manifest).
pub const MAX_BODY: usize = 1 << 20;

const DASHBOARD: &str = include_str!("dashboard.html");

type S = State<Arc<Shared>>;

/// What the routes need to know about the listener they serve.
#[derive(Debug, Clone)]
pub struct ApiOptions {
    /// The TCP address served; `None` for the Unix socket.
    pub tcp: Option<SocketAddr>,
    /// For a request's body to arrive whole once its head has ([`read_body`]).
    pub body_timeout: Duration,
    /// The listeners' connection counters, shown in `/metrics`.
    pub conn_stats: Arc<ConnStats>,
}

impl ApiOptions {
    /// TCP off loopback asks for the token.
    fn require_token(&self) -> bool {
        self.tcp.is_some_and(|a| !a.ip().is_loopback())
    }
}

/// The routes for one listener.
pub fn router(shared: Arc<Shared>, opts: &ApiOptions) -> Router {
    let mut r = Router::new()
        .route("/", get(dashboard))
        .route("/login", get(login))
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .route("/v1/jobs", change(submit).get(list))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/cancel", change(cancel))
        .route("/v1/jobs/{id}/logs", get(logs))
        .route("/v1/devices", get(devices))
        .route("/v1/queue", get(queue))
        .route("/v1/events", get(events))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(opts.body_timeout, read_body))
        .layer(Extension(opts.conn_stats.clone()));
    // Before reading a body, so only a client with the token can make the daemon hold one.
    if opts.require_token() {
        r = r.layer(middleware::from_fn_with_state(shared.clone(), auth));
    }
    // Outermost: a request for another host name is refused before anything else looks at it.
    let guard = Arc::new(HostGuard::new(opts));
    r.layer(middleware::from_fn_with_state(guard, host_guard)).with_state(shared)
}

/// `POST` to `handler`, behind [`refuse_cross_site`]: every route that changes something is
/// made with this. It wraps the handler alone, so that another method on the route still gets
/// the router's 405.
fn change<H, T>(handler: H) -> MethodRouter<Arc<Shared>>
where
    H: Handler<T, Arc<Shared>>,
    T: 'static,
{
    post(handler).route_layer(middleware::from_fn(refuse_cross_site))
}

/// The `Host` check of [`host_guard`] for one listener.
#[derive(Debug)]
struct HostGuard {
    /// The `Host` values accepted; `None`: any (the Unix socket, which no browser reaches, and
    /// TCP off loopback, where the token is the defence: a rebound page cannot send it).
    hosts: Option<Vec<String>>,
}

/// Media types a manifest (or an empty body) may be sent as. None of them is a CORS-safelisted
/// `Content-Type`, so a browser sends such a request to another origin only after a preflight.
const BODY_TYPES: [&str; 4] =
    ["application/json", "application/yaml", "application/x-yaml", "text/yaml"];

impl HostGuard {
    fn new(opts: &ApiOptions) -> Self {
        let hosts = opts.tcp.filter(|_| !opts.require_token()).map(|addr| {
            let ip = match addr.ip() {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            let names = [ip, "localhost".to_owned()];
            let mut hosts: Vec<String> =
                names.iter().map(|n| format!("{n}:{}", addr.port())).collect();
            // A browser leaves the default port out of Host.
            if addr.port() == 80 {
                hosts.extend(names);
            }
            hosts
        });
        Self { hosts }
    }

    /// `Err((status, message))` for a request under another name than the daemon's (a
    /// DNS-rebinding page's).
    fn check(&self, uri: &Uri, headers: &HeaderMap) -> Result<(), (StatusCode, String)> {
        let Some(allowed) = &self.hosts else { return Ok(()) };
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        // An absolute-form target names the host in place of Host (RFC 9112 section 3.2.2).
        let named = uri.authority().map(|a| a.as_str()).or(host);
        if named.is_some_and(|h| allowed.iter().any(|a| a.eq_ignore_ascii_case(h))) {
            return Ok(());
        }
        Err((
            StatusCode::FORBIDDEN,
            format!(
                "Host {:?} is not this daemon's address; use http://{}/ (a request for another name may be a DNS-rebinding page)",
                named.unwrap_or_default(),
                allowed.first().map_or("", String::as_str),
            ),
        ))
    }
}

/// `Err((status, message))` for a request that changes something and that a browser may have
/// been made to send by another site.
fn check_change(headers: &HeaderMap) -> Result<(), (StatusCode, String)> {
    // Fetch metadata (https://w3c.github.io/webappsec-fetch-metadata/): `none` is the user
    // acting directly, `same-origin` the dashboard itself.
    if let Some(site) = headers.get("sec-fetch-site")
        && !matches!(site.as_bytes(), b"same-origin" | b"none")
    {
        return Err((
            StatusCode::FORBIDDEN,
            format!(
                "Sec-Fetch-Site {:?}: requests from other sites may not change anything",
                String::from_utf8_lossy(site.as_bytes())
            ),
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or_default();
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        let same = host.is_some_and(|h| {
            ["http", "https"]
                .iter()
                .any(|scheme| origin.eq_ignore_ascii_case(&format!("{scheme}://{h}")))
        });
        if !same {
            return Err((
                StatusCode::FORBIDDEN,
                format!(
                    "Origin {origin:?} is not this daemon's: requests from other sites may not change anything"
                ),
            ));
        }
    }
    let media = headers.get(header::CONTENT_TYPE).map(|v| {
        let v = String::from_utf8_lossy(v.as_bytes());
        v.split(';').next().unwrap_or_default().trim().to_ascii_lowercase()
    });
    match media {
        Some(m) if BODY_TYPES.contains(&m.as_str()) => Ok(()),
        other => Err((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "Content-Type {}: send application/json or application/yaml, also with an empty body (form and text/plain posts are refused: any web page can send those)",
                other.map_or_else(|| "missing".to_owned(), |m| format!("{m:?}")),
            ),
        )),
    }
}

/// Refuses a read of the API under a rebound name: loopback needs no token, so a page a
/// browser on the host shows could otherwise read it.
async fn host_guard(State(g): State<Arc<HostGuard>>, req: Request, next: Next) -> Response {
    match g.check(req.uri(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err((status, message)) => error(status, message),
    }
}

/// Refuses a change (a job posted, which runs as the daemon's user) that another site may
/// have made a browser on the host send with loopback's tokenless access.
async fn refuse_cross_site(req: Request, next: Next) -> Response {
    match check_change(req.headers()) {
        Ok(()) => next.run(req).await,
        Err((status, message)) => error(status, message),
    }
}

/// How much of a body over [`MAX_BODY`] is still read, and dropped, before the 413: an HTTP/1
/// client sends its whole body before it reads the answer, and a connection closed with a body
/// left unread is reset, which loses the answer on the way (nginx's lingering close reads on for
/// the same reason). Bodies declared larger than this are refused at once.
const DRAIN: u64 = 8 * MAX_BODY as u64;

/// Reads a request's body whole before its handler runs, within `limit` of the head: a client
/// that stalls mid-body gets 408 and loses the connection instead of holding it (hyper bounds
/// only the head's time). Bodies are at most [`MAX_BODY`] anyway; a larger one gets 413 once
/// it has been read (up to [`DRAIN`]).
async fn read_body(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    use axum::body::HttpBody as _;
    use futures_util::StreamExt as _;
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let too_big =
        || error(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: over {MAX_BODY} bytes"));
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > DRAIN) {
        return too_big();
    }
    let mut over = declared.is_some_and(|n| n > MAX_BODY as u64);
    let (parts, body) = req.into_parts();
    let deadline = tokio::time::Instant::now() + limit;
    let mut frames = body.into_data_stream();
    let mut buf = Vec::new();
    let mut read = 0u64;
    loop {
        match tokio::time::timeout_at(deadline, frames.next()).await {
            // Refused already; whatever else happens, that is the answer.
            Err(_) | Ok(Some(Err(_))) if over => return too_big(),
            Err(_) => {
                return error(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "request body: not received within {} s of the request head; send it whole",
                        limit.as_secs_f64()
                    ),
                );
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return error(StatusCode::BAD_REQUEST, format!("request body: {e}"));
            }
            Ok(Some(Ok(chunk))) => {
                read += chunk.len() as u64;
                if read > DRAIN {
                    return too_big();
                }
                if read > MAX_BODY as u64 {
                    over = true;
                    buf = Vec::new();
                } else {
                    buf.extend_from_slice(&chunk);
                }
            }
        }
    }
    if over {
        return too_big();
    }
    next.run(Request::from_parts(parts, Body::from(buf))).await
}

/// A refusal: its status and the [`ErrorBody`] every refusal of the API carries.
#[derive(Debug)]
pub(crate) struct Refusal(StatusCode, ErrorBody);

impl Refusal {
    fn new(status: StatusCode, msg: impl Into<String>) -> Self {
        Refusal(status, ErrorBody::new(msg))
    }

    /// 400 for a bad request parameter, naming it in `field`.
    fn param(name: &str, msg: impl std::fmt::Display) -> Self {
        Refusal::field(StatusCode::BAD_REQUEST, name, format!("{name}: {msg}"))
    }

    fn field(status: StatusCode, field: &str, msg: impl Into<String>) -> Self {
        Refusal(status, ErrorBody::new(msg).with_field(field))
    }

    /// 503: the store failed; the request may succeed when retried.
    fn unavailable(e: impl std::fmt::Display) -> Self {
        Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store: {e}; retry, or check the database"),
        )
    }

    fn no_job(id: i64) -> Self {
        Refusal::new(
            StatusCode::NOT_FOUND,
            format!("job {id} does not exist; list jobs with xpu jobs"),
        )
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Json(self.1)).into_response()
    }
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    Refusal::new(status, msg).into_response()
}

/// A handler's answer: a typed body, or a refusal.
type Answer<T> = Result<Json<T>, Refusal>;

/// Query parameters read into `T` (a [`crate::wire`] type) and checked against the bounds the
/// document declares; a bad one is refused with 400 naming it, as JSON like every refusal.
pub(crate) struct Params<T>(T);

impl<T, St> FromRequestParts<St> for Params<T>
where
    T: DeserializeOwned + Bounded,
    St: Send + Sync,
{
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, Refusal> {
        let p: T = parse_query(parts.uri.query().unwrap_or_default())?;
        p.check().map_err(|(name, msg)| Refusal::param(name, msg))?;
        Ok(Params(p))
    }
}

/// `query` as `T`. serde_urlencoded's errors do not say which parameter they are about, so on
/// an error each parameter is read alone to find the first that fails.
fn parse_query<T: DeserializeOwned>(query: &str) -> Result<T, Refusal> {
    serde_urlencoded::from_str(query).map_err(|e| {
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query).unwrap_or_default();
        let culprit = pairs.iter().find(|pair| {
            serde_urlencoded::to_string([pair])
                .is_ok_and(|alone| serde_urlencoded::from_str::<T>(&alone).is_err())
        });
        match culprit {
            Some((name, value)) => {
                Refusal::field(StatusCode::BAD_REQUEST, name, format!("{name} {value:?}: {e}"))
            }
            None => Refusal::new(StatusCode::BAD_REQUEST, format!("query string: {e}")),
        }
    })
}

/// The `{id}` of a job's routes: a positive integer, else 400 naming it.
pub(crate) struct JobId(i64);

impl<St: Send + Sync> FromRequestParts<St> for JobId {
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, state: &St) -> Result<Self, Refusal> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| Refusal::param("id", e.body_text()))?;
        raw.parse::<i64>().ok().filter(|n| *n > 0).map(JobId).ok_or_else(|| {
            Refusal::field(
                StatusCode::BAD_REQUEST,
                "id",
                format!("job id {raw:?}: must be a positive integer"),
            )
        })
    }
}

/// Who sent a request, proven: the Unix socket's peer (`SO_PEERCRED`), or over TCP the user
/// whose token came with it (the daemon's own for `<data-dir>/token`, another for a line of
/// `<data-dir>/tokens`). Every route that changes something or reads a job's output takes one;
/// a request that cannot prove who sent it gets 401, on every listener, loopback included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caller(pub(crate) Owner);

impl Caller {
    /// Root, or the daemon's own user, may act on any job; others on their own.
    fn may_act_on(&self, s: &Shared, owner: Option<Owner>) -> bool {
        let me = self.0;
        me.uid == 0 || me.uid == s.me.uid || owner.is_some_and(|o| o.uid == me.uid)
    }
}

impl FromRequestParts<Arc<Shared>> for Caller {
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, s: &Arc<Shared>) -> Result<Self, Refusal> {
        match parts.extensions.get::<Peer>() {
            Some(Peer::Unix { uid, gid }) => return Ok(Caller(Owner { uid: *uid, gid: *gid })),
            Some(Peer::UnixUnknown) => {
                return Err(Refusal::new(
                    StatusCode::UNAUTHORIZED,
                    "the socket peer's credentials could not be read; connect again",
                ));
            }
            Some(Peer::Tcp(_)) | None => {}
        }
        let token = presented_tokens(&parts.headers).find_map(|t| token_owner(s, t));
        token.map(Caller).ok_or_else(|| {
            Refusal::new(
                StatusCode::UNAUTHORIZED,
                "this request needs to know who sends it: over TCP (loopback too) send Authorization: Bearer <your token> (the daemon's user: <data-dir>/token; others: their line of <data-dir>/tokens), or use the Unix socket, where your user is known",
            )
        })
    }
}

/// The user `token` belongs to: the daemon's own for its token, a user's for a line of
/// `<data-dir>/tokens`; `None` for any other string. Compared in constant time.
fn token_owner(s: &Shared, token: &str) -> Option<Owner> {
    if constant_time_eq(token.as_bytes(), s.token.as_bytes()) {
        return Some(s.me);
    }
    s.user_tokens
        .iter()
        .find(|(k, _)| constant_time_eq(token.as_bytes(), k.as_bytes()))
        .map(|(_, o)| *o)
}

/// The tokens a request presents: its bearer token and the dashboard's cookie.
fn presented_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let cookies = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='));
    bearer.into_iter().chain(cookies)
}

/// The cookie a browser holds after `/login?token=...`: `fetch` and page loads send it on
/// their own, which a bearer header cannot do for a dashboard.
const COOKIE: &str = "xpu_token";

async fn auth(State(s): S, req: Request, next: Next) -> Response {
    let ok = presented_tokens(req.headers()).any(|t| token_owner(&s, t).is_some());
    // `/login` checks the token it is given itself.
    if ok || req.uri().path() == "/login" {
        next.run(req).await
    } else {
        error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token; send Authorization: Bearer <contents of <data-dir>/token>, or in a browser open /login?token=<contents of <data-dir>/token> once",
        )
    }
}

/// Sets the dashboard's cookie and redirects to it.
///
/// For browsers when the daemon listens off loopback: with the daemon's token
/// (`<data-dir>/token`) sets an HttpOnly, SameSite=Strict cookie (so other sites cannot ride on
/// it) that stands in for the bearer token, and redirects to `/`.
#[utoipa::path(
    get,
    path = "/login",
    params(LoginParams),
    responses(
        (status = 303, description = "cookie set; see /", headers(("Location" = String), ("Set-Cookie" = String))),
        (status = 400, description = "a parameter is malformed, or the token is not a valid header value", body = ErrorBody),
        (status = 401, description = "missing or wrong token", body = ErrorBody),
    ),
)]
pub(crate) async fn login(
    State(s): S,
    Params(q): Params<LoginParams>,
) -> Result<Response, Refusal> {
    let Some(token) = q.token.filter(|t| token_owner(&s, t.trim()).is_some()) else {
        return Err(Refusal::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong token; open /login?token=<contents of <data-dir>/token>",
        ));
    };
    let cookie = format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict", token.trim());
    let v = HeaderValue::from_str(&cookie)
        .map_err(|_| Refusal::param("token", "not a valid header value"))?;
    Ok((
        StatusCode::SEE_OTHER,
        [(header::SET_COOKIE, v), (header::LOCATION, HeaderValue::from_static("/"))],
    )
        .into_response())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> Refusal {
    Refusal::new(StatusCode::NOT_FOUND, "no such route; see /openapi.json")
}

/// The dashboard.
///
/// Devices and their holders, the queue with each job's reason to wait, running and recent
/// jobs, allocation over time; it reads the API below.
#[utoipa::path(get, path = "/", responses((status = 200, description = "HTML page", body = String, content_type = "text/html")))]
pub(crate) async fn dashboard() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], DASHBOARD).into_response()
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", responses((status = 200, description = "OpenAPI document", body = Object)))]
pub(crate) async fn openapi() -> Result<Response, Refusal> {
    static DOC: OnceLock<Result<Bytes, String>> = OnceLock::new();
    let doc = DOC
        .get_or_init(|| ApiDoc::openapi().to_json().map(Bytes::from).map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| {
            Refusal::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("encoding the OpenAPI document: {e}"),
            )
        })?;
    Ok(([(header::CONTENT_TYPE, "application/json")], doc).into_response())
}

/// Prometheus metrics.
///
/// Text format 0.0.4: `xpu_jobs{state}`, `xpu_queue_wait_seconds`,
/// `xpu_scheduling_latency_seconds`, `xpu_device_allocated`; per listener (unix, tcp)
/// `xpu_http_connections` (open), `xpu_http_connections_accepted_total`,
/// `xpu_http_connections_timed_out_total`; and the exporter's per-device series labelled with
/// the job and task holding each device.
#[utoipa::path(
    get,
    path = "/metrics",
    responses(
        (status = 200, description = "metrics", body = String, content_type = "text/plain"),
        (status = 503, description = "the store failed; retry", body = ErrorBody),
    ),
)]
pub(crate) async fn metrics(
    State(s): S,
    Extension(conns): Extension<Arc<ConnStats>>,
) -> Result<Response, Refusal> {
    let counts = s.store.counts().await.map_err(Refusal::unavailable)?;
    let jobs: Vec<(&str, i64)> = JobState::ALL
        .iter()
        .map(|st| (st.as_str(), counts.iter().find(|(c, _)| c == st).map_or(0, |(_, n)| *n)))
        .collect();
    // Per device, the share held (1.0 for a whole device).
    let holders = s
        .view
        .read()
        .map(|v| {
            v.holders
                .iter()
                .map(|h| h.iter().map(|x| f64::from(x.milli)).sum::<f64>().min(1000.0) / 1000.0)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let samples: Vec<DeviceSample<'_>> = s
        .node
        .devices
        .iter()
        .map(|d| DeviceSample {
            id: d.id,
            kind: d.kind.as_str(),
            vendor: &d.vendor,
            product: &d.product,
            allocated: holders.get(d.id as usize).copied().unwrap_or(0.0),
        })
        .collect();
    let mut text = s.metrics.render(&jobs, &samples, s.leader.load(Ordering::Relaxed));
    conns.render(&mut text);
    if let Some(t) = &s.telemetry {
        // The exporter's per-device series, labelled with the job and task holding each device.
        t.set_holders(task_holders(&s));
        text.push_str(&xpu_telemetry::render::render_collector_families(t));
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// The first task holding each device, by PCI address, for the telemetry labels.
fn task_holders(s: &Shared) -> std::collections::BTreeMap<xpu_core::PciAddress, Holder> {
    let view = s.view.read().map(|v| v.holders.clone()).unwrap_or_default();
    s.node
        .devices
        .iter()
        .filter_map(|d| {
            let h = view.get(d.id as usize)?.first()?;
            let addr = d.address.parse().ok()?;
            Some((addr, Holder::Task { job: h.job.to_string(), task: h.task.to_string() }))
        })
        .collect()
}

/// The daemon: node, leadership, store.
#[utoipa::path(get, path = "/v1/status", responses((status = 200, description = "status", body = Status)))]
pub(crate) async fn status(State(s): S) -> Json<Status> {
    Json(Status {
        node: s.node.name.clone(),
        hostname: s.node.hostname.clone(),
        leader: s.leader.load(Ordering::Relaxed),
        store: s.store.url().to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at_ms: s.started_ms,
        devices: s.node.devices.len(),
        labels: s.node.labels.clone(),
    })
}

/// Submits jobs.
///
/// A Kubernetes `batch/v1` Job or `v1` Pod in YAML or JSON (several in one file, as `kubectl
/// apply -f` takes them: all or none), or xpu's short form (`command`, `gpus`, `gpuMilli`,
/// `name`, `queue`, `priority`, `rootfs`, `bundle`, `env`...). Annotations: `xpu.dev/queue`,
/// `xpu.dev/priority`, `xpu.dev/gpu-milli` (a share of one GPU), `xpu.dev/rootfs` or
/// `xpu.dev/bundle` (run as a runc container through `xpu runtime`).
#[utoipa::path(
    post,
    path = "/v1/jobs",
    params(
        SubmitParams,
        ("Idempotency-Key" = Option<String>, Header, description = "The idempotency key (see `key`); wins over the query's"),
    ),
    request_body(
        description = "The manifest, at most 1 MiB",
        content(
            (String = "application/yaml", example = "command: [\"true\"]\n"),
            (Object = "application/json", example = json!({"command": ["true"], "gpus": 0})),
        ),
    ),
    responses(
        (status = 201, description = "accepted and durable", body = Submitted,
            headers(("Location" = String, description = "the job (one job only)")),
            links(
                ("job" = (operation_id = "job", parameters(("id" = "$response.body#/id")))),
                ("logs" = (operation_id = "logs", parameters(("id" = "$response.body#/id")))),
                ("cancel" = (operation_id = "cancel", parameters(("id" = "$response.body#/id")))),
            ),
        ),
        (status = 200, description = "the idempotency key was seen before with the same jobs: the existing jobs", body = Submitted),
        (status = 400, description = "bad manifest: `error` names the field and `field` is its path; `field` is `manifest` for YAML whose aliases expand it past 4 times its size (at least 64 KiB), flow collections nested more than 64 deep, or a spec over 1.5 MiB as JSON", body = ErrorBody),
        (status = 401, description = "the request does not say who sends it: over TCP send a token (the Unix socket knows its peer)", body = ErrorBody),
        (status = 403, description = "a daemon that is not root can run jobs only as its own user", body = ErrorBody),
        (status = 422, description = "the idempotency key was used before for a different job (IETF Idempotency-Key draft, section 2.7); `field` is `Idempotency-Key` and `id` the first job, which is kept", body = ErrorBody),
        (status = 503, description = "the store failed; retry (with the idempotency key, safely)", body = ErrorBody),
    ),
)]
pub(crate) async fn submit(
    State(s): S,
    Caller(owner): Caller,
    headers: HeaderMap,
    Params(q): Params<SubmitParams>,
    body: Bytes,
) -> Result<Response, Refusal> {
    // Jobs run as whoever submits them; a daemon that is not root can run them only as itself.
    if s.me.uid != 0 && owner.uid != s.me.uid {
        return Err(Refusal::new(
            StatusCode::FORBIDDEN,
            format!(
                "uid {}: this daemon runs as uid {} and can run jobs only as that user; submit as it, or run the daemon as root",
                owner.uid, s.me.uid
            ),
        ));
    }
    // Bodies past this size are parsed on the blocking pool: parsing costs time in the body's
    // size (up to MAX_BODY and its bounded YAML expansion), and an async worker spending it
    // would hold up every other request it serves, `/v1/status` included.
    const PARSE_INLINE: usize = 16 * 1024;
    let Ok(text) = std::str::from_utf8(&body) else {
        return Err(Refusal::field(
            StatusCode::BAD_REQUEST,
            "manifest",
            "manifest: not UTF-8 text; send YAML or JSON",
        ));
    };
    let parsed = if text.len() <= PARSE_INLINE {
        xpu_core::job::parse_all(text)
    } else {
        let text = text.to_owned();
        tokio::task::spawn_blocking(move || xpu_core::job::parse_all(&text)).await.map_err(|e| {
            Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, format!("parsing the manifest: {e}"))
        })?
    };
    let parsed =
        parsed.map_err(|e| Refusal::field(StatusCode::BAD_REQUEST, &e.path, e.to_string()))?;
    // All or nothing: one job the node cannot run refuses the whole file. The check opens the
    // files the jobs name (a bundle's config.json): on the blocking pool, never here.
    let multi = parsed.jobs.len() > 1;
    // As the executor decides ([`crate::executor::RunAs::for_owner`]): by the user alone, so a
    // bundle is checked at submit against the same rules its start applies.
    let run_as = (owner.uid != s.me.uid).then_some((owner.uid, owner.gid));
    let (parsed, checked) = {
        let s = s.clone();
        tokio::task::spawn_blocking(move || {
            let checked = parsed
                .jobs
                .iter()
                .enumerate()
                .find_map(|(i, spec)| check_runnable(&s, spec, run_as).err().map(|e| (i, e)));
            (parsed, checked)
        })
        .await
        .map_err(|e| {
            Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, format!("checking the jobs: {e}"))
        })?
    };
    if let Some((i, (field, message))) = checked {
        let name = &parsed.jobs[i].name;
        let field = if multi { format!("job[{i}] ({name}).{field}") } else { field };
        return Err(Refusal::field(StatusCode::BAD_REQUEST, &field, format!("{field}: {message}")));
    }
    let key = match headers.get("idempotency-key") {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| {
                    Refusal::field(
                        StatusCode::BAD_REQUEST,
                        "Idempotency-Key",
                        "Idempotency-Key: not visible ASCII text",
                    )
                })?
                .to_owned(),
        ),
        None => q.key,
    };
    wire::check_key(key.as_deref()).map_err(|e| {
        Refusal::field(StatusCode::BAD_REQUEST, "Idempotency-Key", format!("idempotency key: {e}"))
    })?;
    let at_ms = now_ms();
    let mut news = Vec::with_capacity(parsed.jobs.len());
    for (i, spec) in parsed.jobs.iter().enumerate() {
        let spec_json = serde_json::to_string(spec).map_err(|e| {
            Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding spec: {e}"))
        })?;
        news.push(NewJob {
            // The file's key names its first job; the others get `<key>#<n>`, so a retry of
            // the file finds every one of them.
            key: key.as_ref().map(|k| if i == 0 { k.clone() } else { format!("{k}#{i}") }),
            name: spec.name.clone(),
            queue: spec.queue.clone(),
            priority: i64::from(spec.priority),
            spec: spec_json,
            at_ms,
            owner,
        });
    }
    let write = match news.as_slice() {
        [one] => Write::Submit(one.clone()),
        _ => Write::SubmitAll(news.clone()),
    };
    let ids = match s.store.write(write).await.map_err(Refusal::unavailable)? {
        Outcome::Submitted { id, created } => vec![(id, created)],
        Outcome::SubmittedAll(ids) if ids.len() == news.len() => ids,
        _ => {
            return Err(Refusal::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "store answered a submit oddly",
            ));
        }
    };
    let mut jobs = Vec::with_capacity(ids.len());
    for ((spec, new), (id, created)) in parsed.jobs.into_iter().zip(news).zip(ids) {
        jobs.push(submitted(&s, spec, new, id, created).await?);
    }
    let Some(first) = jobs.first().cloned() else {
        return Err(Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, "store submitted no job"));
    };
    let code = if jobs.iter().any(|j| j.created) { StatusCode::CREATED } else { StatusCode::OK };
    let location = (!multi).then(|| HeaderValue::from_str(&format!("/v1/jobs/{}", first.id)));
    let mut resp = (code, Json(Submitted { first, notes: parsed.notes, jobs })).into_response();
    if let Some(Ok(v)) = location {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    Ok(resp)
}

/// One job the store took: a new one goes to the engine; one whose idempotency key was seen
/// before must be the same job (however the manifest is written), or the request is refused
/// with 422 as the IETF Idempotency-Key draft says (section 2.7) and the first job stays as it
/// was.
async fn submitted(
    s: &Shared,
    spec: xpu_core::job::JobSpec,
    new: NewJob,
    id: i64,
    created: bool,
) -> Result<SubmittedJob, Refusal> {
    if created {
        s.metrics.submitted.fetch_add(1, Ordering::Relaxed);
        let name = new.name.clone();
        tracing::info!(job_id = id, state = "queued", name = %name, queue = %new.queue, "job state");
        let row = crate::store::JobRow {
            id,
            key: new.key,
            name: new.name,
            queue: new.queue,
            priority: new.priority,
            state: JobState::Queued,
            spec: new.spec,
            submitted_at_ms: new.at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            failures: 0,
            cancel_requested: false,
            message: None,
            owner: Some(new.owner),
        };
        // The engine is gone only while the daemon stops; the job is stored and the next
        // start picks it up.
        let _ = s.engine.send(Msg::Submitted { row, spec: Box::new(spec) });
        return Ok(SubmittedJob { id, name, state: JobState::Queued, created: true });
    }
    let row = match s.store.job(id).await.map_err(Refusal::unavailable)? {
        Some(row) => row,
        None => {
            let msg = format!("store: job {id}, which holds the idempotency key, is missing");
            return Err(Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, msg));
        }
    };
    // Compared as specs, so a spec stored by an older version (a field it lacked takes its
    // default) still matches; as text when it no longer reads as one.
    let same = match serde_json::from_str::<xpu_core::job::JobSpec>(&row.spec) {
        Ok(mut first) => {
            // A generated name differs on every draw; the manifest is what must match.
            if first.pod.generate_name.is_some()
                && first.pod.generate_name == spec.pod.generate_name
            {
                first.name.clone_from(&spec.name);
            }
            first == spec
        }
        Err(_) => row.spec == new.spec,
    } && row.owner == Some(new.owner);
    if !same {
        let key = new.key.unwrap_or_default();
        let mut body = ErrorBody::new(format!(
            "idempotency key {key:?}: already used for job {id} with a different manifest; resend that manifest to get job {id}, or use a new key for a new job"
        ))
        .with_field("Idempotency-Key");
        body.id = Some(id);
        return Err(Refusal(StatusCode::UNPROCESSABLE_ENTITY, body));
    }
    Ok(SubmittedJob { id, name: row.name, state: row.state, created: false })
}

/// What the parser cannot know: whether the scheduler can take the task's request, and
/// whether a container's rootfs or bundle exists on this host. `Err((field, message))`.
fn check_runnable(
    s: &Shared,
    spec: &xpu_core::job::JobSpec,
    run_as: Option<(u32, u32)>,
) -> Result<(), (String, String)> {
    use xpu_core::job::Source;
    let k8s = spec.source == Source::Kubernetes;
    if let Err(e) = xpu_sched::job_from_spec(spec, &|v, k| s.node.models(v, k)) {
        let field = match (e.resource(), k8s) {
            (Some(r), true) => format!("spec.template.spec.containers[0].resources.limits.{r}"),
            (Some("gpu"), false) => "gpus".to_owned(),
            (Some(r), false) => format!("devices.{r}"),
            (None, true) => "spec.template.spec.containers[0].resources.limits".to_owned(),
            (None, false) => "devices".to_owned(),
        };
        return Err((field, e.to_string()));
    }
    if let Some(why) = spec.never_fits(&s.node.name, &s.node.labels) {
        let field = if k8s { "spec.template.spec.affinity" } else { "affinity" };
        return Err((field.to_owned(), why));
    }
    if let Some((field, message)) = crate::engine::too_big_for_host(spec) {
        let field = if k8s { field.to_owned() } else { "completions".to_owned() };
        return Err((field, message));
    }
    // What runc would refuse when the task starts is refused now, naming the field.
    let c = &spec.container;
    let (field, problem) = match (&c.rootfs, &c.bundle) {
        (Some(r), _) => (
            if k8s { "metadata.annotations.xpu.dev/rootfs" } else { "rootfs" },
            crate::container::root_problem(std::path::Path::new(r)),
        ),
        (None, Some(b)) => (
            if k8s { "metadata.annotations.xpu.dev/bundle" } else { "bundle" },
            crate::container::bundle_problem(std::path::Path::new(b), run_as),
        ),
        (None, None) => return Ok(()),
    };
    match problem {
        Some(message) => Err((field.to_owned(), message)),
        None => Ok(()),
    }
}

/// Lists jobs, newest first, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/jobs",
    params(ListParams),
    responses(
        (status = 200, description = "a page", body = JobList),
        ParamRefusals,
    ),
)]
pub(crate) async fn list(State(s): S, Params(p): Params<ListParams>) -> Answer<JobList> {
    let limit = p.limit.unwrap_or(wire::DEFAULT_PAGE);
    let rows = s
        .store
        .list(ListQuery { state: p.state, before: p.before, limit })
        .await
        .map_err(Refusal::unavailable)?;
    let next = if rows.len() == limit as usize { rows.last().map(|r| r.id) } else { None };
    Ok(Json(JobList { jobs: rows, next }))
}

/// One job with its spec and task attempts.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    operation_id = "job",
    params(("id" = i64, Path, minimum = 1, example = 1, description = "The job's id")),
    responses(
        (status = 200, description = "the job", body = JobDetail),
        (status = 400, description = "the id is not a positive integer", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody),
        (status = 503, description = "the store failed; retry", body = ErrorBody),
    ),
)]
pub(crate) async fn job(State(s): S, JobId(id): JobId) -> Answer<JobDetail> {
    let row = s.store.job(id).await.map_err(Refusal::unavailable)?.ok_or(Refusal::no_job(id))?;
    let tasks = s.store.tasks(id).await.map_err(Refusal::unavailable)?;
    let spec = serde_json::from_str(&row.spec).ok();
    let (queue_position, reason) = s
        .view
        .read()
        .ok()
        .and_then(|v| v.queued.iter().find(|q| q.id == id).map(|q| (q.position, q.reason.clone())))
        .unzip();
    Ok(Json(JobDetail { job: row, spec, tasks, queue_position, reason }))
}

/// Cancels a job.
///
/// Queued jobs never start; running tasks get SIGTERM, then SIGKILL after the grace period.
/// The request has no body; its Content-Type is still required (application/json).
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/cancel",
    operation_id = "cancel",
    params(("id" = i64, Path, minimum = 1, example = 1, description = "The job's id")),
    request_body(description = "None; send Content-Type: application/json", content(("application/json"))),
    responses(
        (status = 202, description = "cancellation recorded", body = CancelAccepted),
        (status = 400, description = "the id is not a positive integer", body = ErrorBody),
        (status = 404, description = "no such job", body = ErrorBody),
        (status = 401, description = "the request does not say who sends it: over TCP send a token (the Unix socket knows its peer)", body = ErrorBody),
        (status = 403, description = "the job is another user's", body = ErrorBody),
        (status = 409, description = "the job already ended", body = ErrorBody),
        (status = 503, description = "the store failed; retry", body = ErrorBody),
    ),
)]
pub(crate) async fn cancel(
    State(s): S,
    caller: Caller,
    JobId(id): JobId,
) -> Result<Response, Refusal> {
    owned(&s, caller, id, "cancel").await?;
    match s.store.write(Write::RequestCancel { id }).await.map_err(Refusal::unavailable)? {
        Outcome::CancelRequested(None) => Err(Refusal::no_job(id)),
        Outcome::CancelRequested(Some(state)) if state.is_terminal() => Err(Refusal::new(
            StatusCode::CONFLICT,
            format!("job {id} already {state}; nothing to cancel"),
        )),
        Outcome::CancelRequested(Some(_)) => {
            // The engine is gone only while the daemon stops; the request is stored and the
            // next start carries it out.
            let _ = s.engine.send(Msg::Cancel(id));
            let body = CancelAccepted { id, state: JobState::Cancelled };
            Ok((StatusCode::ACCEPTED, Json(body)).into_response())
        }
        _ => Err(Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, "store answered a cancel oddly")),
    }
}

/// Refuses `caller` a job that is another user's (root and the daemon's user may act on any):
/// 403 naming the owner, or 404 when there is no such job.
async fn owned(s: &Shared, caller: Caller, id: i64, what: &str) -> Result<(), Refusal> {
    let row = s.store.job(id).await.map_err(Refusal::unavailable)?.ok_or(Refusal::no_job(id))?;
    if caller.may_act_on(s, row.owner) {
        return Ok(());
    }
    let owner =
        row.owner.map_or_else(|| "the daemon's user".to_owned(), |o| format!("uid {}", o.uid));
    Err(Refusal::new(
        StatusCode::FORBIDDEN,
        format!(
            "job {id} belongs to {owner}; uid {} may not {what} it (only its owner and root may)",
            caller.0.uid
        ),
    ))
}

/// How many log followers (`logs?follow=true`) may stream at once, in all and per user. A
/// follower holds its connection for as long as the task runs, exempt from the timeouts that
/// end idle connections, so without a bound followers alone could take every connection slot
/// of a listener ([`crate::listen::HttpLimits::max_connections`], 256) and leave none for
/// `/v1/status` and the CLI. With these, at least 192 of the 256 stay for short requests, and
/// one user's followers leave room for 3 other users'.
#[derive(Debug)]
pub struct Followers {
    total: Arc<tokio::sync::Semaphore>,
    per_user: std::sync::Mutex<std::collections::HashMap<u32, u32>>,
    per_user_max: u32,
}

impl Default for Followers {
    fn default() -> Self {
        Followers::new(64, 16)
    }
}

impl Followers {
    pub fn new(total: usize, per_user: u32) -> Self {
        Followers {
            total: Arc::new(tokio::sync::Semaphore::new(total)),
            per_user: std::sync::Mutex::new(std::collections::HashMap::new()),
            per_user_max: per_user,
        }
    }

    /// A place for one more follower of `uid`, or 429 saying which bound is reached.
    fn take(self: &Arc<Self>, uid: u32) -> Result<FollowPermit, Refusal> {
        let busy = |what: String| {
            Refusal::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!("{what}; stop another `xpu logs -f`, or read the log without follow"),
            )
        };
        let mut per = self.per_user.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = per.entry(uid).or_insert(0);
        if *n >= self.per_user_max {
            return Err(busy(format!(
                "uid {uid} already follows {} logs, the most one user may",
                self.per_user_max
            )));
        }
        let Ok(total) = self.total.clone().try_acquire_owned() else {
            return Err(busy("the daemon already streams as many followed logs as it may".into()));
        };
        *n += 1;
        Ok(FollowPermit { _total: total, uid, of: self.clone() })
    }
}

/// One follower's place ([`Followers::take`]), given back when its stream ends.
#[derive(Debug)]
pub(crate) struct FollowPermit {
    _total: tokio::sync::OwnedSemaphorePermit,
    uid: u32,
    of: Arc<Followers>,
}

impl Drop for FollowPermit {
    fn drop(&mut self) {
        let mut per = self.of.per_user.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = per.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.uid);
            }
        }
    }
}

/// Which part of a log to send.
#[derive(Debug, Clone, Copy)]
struct LogWindow {
    tail: Option<u64>,
    limit: u64,
}

/// A log is read and sent in pieces of this size: memory per reader stays this, whatever
/// the log's size.
const LOG_CHUNK: usize = 64 * 1024;

fn text_plain(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

/// A task's output.
///
/// Its stdout and stderr, streamed from its file (chunked), as `kubectl logs` gives it.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/logs",
    operation_id = "logs",
    params(("id" = i64, Path, minimum = 1, example = 1, description = "The job's id"), LogParams),
    responses(
        (status = 200, description = "log text", body = String, content_type = "text/plain"),
        (status = 401, description = "the request does not say who sends it: over TCP send a token (the Unix socket knows its peer)", body = ErrorBody),
        (status = 403, description = "the job is another user's", body = ErrorBody),
        (status = 404, description = "no such job, or the task has not started (without follow)", body = ErrorBody),
        (status = 429, description = "with follow: the caller, or the daemon, follows as many logs as it may", body = ErrorBody),
        (status = 500, description = "the log file cannot be read", body = ErrorBody),
        (status = 504, description = "with follow: the task did not start within a minute", body = ErrorBody),
        ParamRefusals,
    ),
)]
pub(crate) async fn logs(
    State(s): S,
    caller: Caller,
    JobId(id): JobId,
    Params(p): Params<LogParams>,
) -> Result<Response, Refusal> {
    owned(&s, caller, id, "read the output of").await?;
    // Both are checked not negative ([`LogParams`]'s bounds).
    let window = LogWindow {
        tail: p.tail.map(|t| t.unsigned_abs()),
        limit: p.limit_bytes.map_or(u64::MAX, i64::unsigned_abs),
    };
    let tasks = s.store.tasks(id).await.map_err(Refusal::unavailable)?;
    let idx = p.task.unwrap_or(0);
    let pick: Option<&TaskRow> = tasks
        .iter()
        .filter(|t| t.idx == idx && p.attempt.is_none_or(|a| a == t.attempt))
        .max_by_key(|t| t.attempt);
    let follow = p.follow.unwrap_or(false);
    let Some(task) = pick.cloned() else {
        s.store.job(id).await.map_err(Refusal::unavailable)?.ok_or(Refusal::no_job(id))?;
        if follow {
            let permit = s.followers.take(caller.0.uid)?;
            return Ok(follow_pending(s, id, idx, window, permit).await);
        }
        return Err(Refusal::new(
            StatusCode::NOT_FOUND,
            format!("job {id} task {idx} has not started yet; use -f to wait for it"),
        ));
    };
    if follow {
        let permit = s.followers.take(caller.0.uid)?;
        return Ok(follow_response(s, task, window, permit).await);
    }
    let path = std::path::Path::new(&task.dir).join("output.log");
    let read = async {
        let start = log_start(&path, window.tail).await?;
        let mut f = tokio::fs::File::open(&path).await?;
        tokio::io::AsyncSeekExt::seek(&mut f, std::io::SeekFrom::Start(start)).await?;
        Ok::<_, std::io::Error>(f)
    };
    match read.await {
        Ok(f) => Ok(text_plain(stream_file(f, window.limit))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(text_plain(Body::empty())),
        Err(e) => Err(Refusal::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading {}: {e}", path.display()),
        )),
    }
}

/// The file from where it stands to its end (as it is when reached), at most `limit` bytes,
/// [`LOG_CHUNK`] at a time.
fn stream_file(file: tokio::fs::File, limit: u64) -> Body {
    use tokio::io::AsyncReadExt;
    let stream = futures_util::stream::try_unfold((file, limit), |(mut f, left)| async move {
        if left == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; usize::try_from(left).map_or(LOG_CHUNK, |l| l.min(LOG_CHUNK))];
        let n = f.read(&mut buf).await?;
        if n == 0 {
            return Ok::<_, std::io::Error>(None);
        }
        buf.truncate(n);
        Ok(Some((Bytes::from(buf), (f, left - n as u64))))
    });
    Body::from_stream(stream)
}

/// Where the log's last `tail` lines start (all of it for `None`): after the `tail`-th
/// newline from the end, a final newline ending the last line rather than starting an empty
/// one, as `kubectl logs --tail` and `tail -n` count. Reads backwards [`LOG_CHUNK`] at a time.
async fn log_start(path: &std::path::Path, tail: Option<u64>) -> std::io::Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let Some(tail) = tail else { return Ok(0) };
    let mut f = tokio::fs::File::open(path).await?;
    let len = f.metadata().await?.len();
    if tail == 0 {
        return Ok(len);
    }
    let mut buf = vec![0u8; LOG_CHUNK];
    let mut seen = 0;
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(LOG_CHUNK as u64);
        // At most LOG_CHUNK, so it fits.
        let chunk = &mut buf[..(end - start) as usize];
        f.seek(std::io::SeekFrom::Start(start)).await?;
        f.read_exact(chunk).await?;
        let mut upto = chunk.len();
        if end == len && chunk.last() == Some(&b'\n') {
            upto -= 1;
        }
        while let Some(i) = chunk[..upto].iter().rposition(|b| *b == b'\n') {
            seen += 1;
            if seen == tail {
                return Ok(start + i as u64 + 1);
            }
            upto = i;
        }
        end = start;
    }
    Ok(0)
}

/// Waits (up to a minute) for the task to start, then follows it.
async fn follow_pending(
    s: Arc<Shared>,
    id: i64,
    idx: i64,
    window: LogWindow,
    permit: FollowPermit,
) -> Response {
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(tasks) = s.store.tasks(id).await
            && let Some(t) = tasks.iter().filter(|t| t.idx == idx).max_by_key(|t| t.attempt)
        {
            return follow_response(s, t.clone(), window, permit).await;
        }
        if let Ok(Some(row)) = s.store.job(id).await
            && row.state.is_terminal()
        {
            return text_plain(Body::empty());
        }
    }
    error(StatusCode::GATEWAY_TIMEOUT, format!("job {id} task {idx} did not start within a minute"))
}

/// Streams the log as it grows until the attempt has ended and everything was sent, starting
/// `window.tail` lines from the end as it is now and stopping after `window.limit` bytes.
async fn follow_response(
    s: Arc<Shared>,
    task: TaskRow,
    window: LogWindow,
    permit: FollowPermit,
) -> Response {
    let path = std::path::Path::new(&task.dir).join("output.log");
    let offset = match log_start(&path, window.tail).await {
        Ok(o) => o,
        // Not written yet: it starts at its beginning.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading {}: {e}", path.display()),
            );
        }
    };
    struct St {
        s: Arc<Shared>,
        task: TaskRow,
        path: std::path::PathBuf,
        offset: u64,
        left: u64,
        finished: bool,
        /// Held while the stream lives: its place among the followers.
        _permit: FollowPermit,
    }
    let init = St { s, task, path, offset, left: window.limit, finished: false, _permit: permit };
    let stream = futures_util::stream::unfold(init, |mut st| async move {
        loop {
            if st.left == 0 {
                return None;
            }
            let data = read_from(&st.path, st.offset, st.left).await;
            if !data.is_empty() {
                st.offset += data.len() as u64;
                st.left -= data.len() as u64;
                return Some((Ok::<Bytes, std::io::Error>(Bytes::from(data)), st));
            }
            if st.finished {
                return None;
            }
            // Check after reading, so output written just before exit is still sent.
            let active = match st.s.store.tasks(st.task.job_id).await {
                Ok(ts) => ts.iter().any(|t| {
                    t.idx == st.task.idx && t.attempt == st.task.attempt && t.state.is_active()
                }),
                Err(_) => false,
            };
            if !active {
                st.finished = true;
                continue;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    text_plain(Body::from_stream(stream))
}

/// Up to [`LOG_CHUNK`] (and `max`) bytes of the file from `offset`; none when there are none
/// or it cannot be read.
async fn read_from(path: &std::path::Path, offset: u64, max: u64) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let Ok(mut f) = tokio::fs::File::open(path).await else { return Vec::new() };
    if f.seek(std::io::SeekFrom::Start(offset)).await.is_err() {
        return Vec::new();
    }
    let mut buf = vec![0u8; usize::try_from(max).map_or(LOG_CHUNK, |m| m.min(LOG_CHUNK))];
    match f.read(&mut buf).await {
        Ok(n) => {
            buf.truncate(n);
            buf
        }
        Err(_) => Vec::new(),
    }
}

/// The node's devices and the tasks holding each.
///
/// `holder` is the first task, `holders` every one (several when a GPU is shared, each with
/// `milli`, the thousandths it holds), `allocated_milli` their sum.
#[utoipa::path(get, path = "/v1/devices", responses((status = 200, description = "devices", body = DeviceList)))]
pub(crate) async fn devices(State(s): S) -> Json<DeviceList> {
    let holders = s.view.read().map(|v| v.holders.clone()).unwrap_or_default();
    let uses = host_uses(&s).await;
    let telemetry = s.telemetry.as_ref().map(|t| t.snapshot().devices).unwrap_or_default();
    let unhealthy: std::collections::BTreeMap<String, String> = s
        .telemetry
        .as_ref()
        .map(|t| t.unhealthy().into_iter().map(|(a, r)| (a.to_string(), r)).collect())
        .unwrap_or_default();
    let devices = s
        .node
        .devices
        .iter()
        .map(|d| {
            let held = holders.get(d.id as usize).cloned().unwrap_or_default();
            let telemetry =
                telemetry.iter().find(|t| t.address.to_string() == d.address).map(|t| {
                    let r = &t.reading;
                    DeviceTelemetry {
                        utilization_percent: r.utilization_percent,
                        memory_used_bytes: r.memory_used_bytes,
                        memory_total_bytes: r.memory_total_bytes,
                        power_watts: r.power_watts,
                        temperature_celsius: r.temperature_celsius,
                    }
                });
            DeviceView {
                device: d.clone(),
                holder: held.first().cloned(),
                allocated_milli: held.iter().map(|h| u32::from(h.milli)).sum(),
                holders: held,
                telemetry,
                unhealthy: unhealthy.get(&d.address).cloned(),
                held_by: uses.get(&d.address).map(|u| u.0.clone()),
                held_since_ms: uses.get(&d.address).and_then(|u| u.1),
            }
        })
        .collect();
    Json(DeviceList {
        node: s.node.name.clone(),
        leader: s.leader.load(Ordering::Relaxed),
        devices,
    })
}

/// Which use outside the daemon's jobs holds each device (by PCI address), read from the host
/// as the telemetry's last discovery found it (`xpu_host::vfio::held_by`); empty before the
/// first discovery or when the host does not read.
async fn host_uses(s: &Shared) -> std::collections::BTreeMap<String, (String, Option<i64>)> {
    let Some(inv) = s.telemetry.as_ref().and_then(|t| t.inventory()) else {
        return Default::default();
    };
    let root = s.root.clone();
    let read = tokio::task::spawn_blocking(move || {
        let kept = match xpu_host::vm_devices::read(&root, xpu_host::vm_devices::VM_DEVICES) {
            Ok(k) => k.unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "devices kept for Nova not read; not shown as Nova's");
                Default::default()
            }
        };
        let list = match xpu_host::vfio::status(&root, &inv, &[], true) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "which use holds each device not read");
                return None;
            }
        };
        Some(
            list.iter()
                .map(|st| {
                    let (by, since) = xpu_host::vfio::held_by(st, &kept);
                    let since = since.and_then(|t| i64::try_from(t).ok()).map(|t| t * 1000);
                    (st.address.to_string(), (by, since))
                })
                .collect(),
        )
    })
    .await;
    match read {
        Ok(uses) => uses.unwrap_or_default(),
        Err(e) => {
            tracing::warn!(error = %e, "which use holds each device not read");
            Default::default()
        }
    }
}

/// The queue, running jobs and allocation over time.
///
/// Queued jobs in queue order (the first 1,000; `queued_total` counts them all) with the reason
/// each waits (the scheduler's count of why the node cannot take it now, e.g. `0/1 nodes are
/// available: 1 Insufficient gpu`), running jobs, and allocation over time.
#[utoipa::path(
    get,
    path = "/v1/queue",
    responses(
        (status = 200, description = "queue", body = Queue),
        (status = 500, description = "the scheduling loop's view is unreadable; restart the daemon", body = ErrorBody),
    ),
)]
pub(crate) async fn queue(State(s): S) -> Answer<Queue> {
    let v = s.view.read().map_err(|_| {
        Refusal::new(StatusCode::INTERNAL_SERVER_ERROR, "view lock poisoned; restart the daemon")
    })?;
    Ok(Json(Queue {
        leader: s.leader.load(Ordering::Relaxed),
        queued: v.queued.clone(),
        queued_total: v.queued_total,
        running: v.running.clone(),
        allocation_history: v.history.iter().copied().collect(),
        devices: s.node.devices.len(),
    }))
}

/// The event log, oldest first.
#[utoipa::path(
    get,
    path = "/v1/events",
    params(EventParams),
    responses(
        (status = 200, description = "events", body = EventList),
        ParamRefusals,
    ),
)]
pub(crate) async fn events(State(s): S, Params(p): Params<EventParams>) -> Answer<EventList> {
    let limit = p.limit.unwrap_or(wire::DEFAULT_PAGE);
    let events =
        s.store.events(p.after.unwrap_or(0), p.job, limit).await.map_err(Refusal::unavailable)?;
    Ok(Json(EventList { events }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Method;

    /// What the guards answer a request to `/v1/jobs` on a listener at `tcp`: the host check,
    /// then, for a POST (what [`change`] routes), the checks of a change.
    fn check(tcp: &str, method: Method, headers: &[(&str, &str)]) -> Option<StatusCode> {
        let g = HostGuard::new(&ApiOptions {
            tcp: Some(tcp.parse().expect("an address")),
            body_timeout: Duration::from_secs(1),
            conn_stats: Arc::default(),
        });
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(
                header::HeaderName::from_bytes(k.as_bytes()).expect("a header name"),
                HeaderValue::from_str(v).expect("a header value"),
            );
        }
        let change = || if method == Method::POST { check_change(&h) } else { Ok(()) };
        g.check(&Uri::from_static("/v1/jobs"), &h).and_then(|()| change()).err().map(|(s, _)| s)
    }

    #[test]
    fn loopback_hosts_are_the_bound_address_and_localhost() {
        assert_eq!(check("[::1]:8470", Method::GET, &[("host", "[::1]:8470")]), None);
        assert_eq!(check("[::1]:8470", Method::GET, &[("host", "localhost:8470")]), None);
        let refused = Some(StatusCode::FORBIDDEN);
        assert_eq!(check("[::1]:8470", Method::GET, &[("host", "127.0.0.1:8470")]), refused);
        assert_eq!(check("127.0.0.1:8470", Method::GET, &[("host", "localhost:8471")]), refused);
        assert_eq!(check("127.0.0.1:8470", Method::GET, &[("host", "localhost")]), refused);
        assert_eq!(check("127.0.0.1:8470", Method::GET, &[]), refused);
        // The default port is left out by browsers.
        assert_eq!(check("127.0.0.1:80", Method::GET, &[("host", "localhost")]), None);
        // Off loopback the token guards, whatever the name.
        assert_eq!(check("0.0.0.0:8470", Method::GET, &[("host", "gpu-7.example:8470")]), None);
    }

    #[test]
    fn every_change_is_a_post() {
        let doc = ApiDoc::openapi();
        for (path, item) in &doc.paths.paths {
            for (method, op) in
                [("PUT", &item.put), ("DELETE", &item.delete), ("PATCH", &item.patch)]
            {
                assert!(
                    op.is_none(),
                    "{path} takes {method}: route it with a change() that refuses it cross-site"
                );
            }
        }
    }

    #[test]
    fn changes_need_same_origin_and_a_manifest_type() {
        let host = ("host", "127.0.0.1:8470");
        let yaml = ("content-type", "application/yaml; charset=utf-8");
        assert_eq!(check("127.0.0.1:8470", Method::POST, &[host, yaml]), None);
        let same = ("origin", "http://127.0.0.1:8470");
        assert_eq!(check("127.0.0.1:8470", Method::POST, &[host, yaml, same]), None);
        let other = ("origin", "http://127.0.0.1:3000");
        assert_eq!(
            check("127.0.0.1:8470", Method::POST, &[host, yaml, other]),
            Some(StatusCode::FORBIDDEN)
        );
        let site = ("sec-fetch-site", "same-site");
        assert_eq!(
            check("127.0.0.1:8470", Method::POST, &[host, yaml, site]),
            Some(StatusCode::FORBIDDEN)
        );
        let form = ("content-type", "multipart/form-data; boundary=x");
        assert_eq!(
            check("127.0.0.1:8470", Method::POST, &[host, form]),
            Some(StatusCode::UNSUPPORTED_MEDIA_TYPE)
        );
        // Safe methods carry no body to check.
        assert_eq!(check("127.0.0.1:8470", Method::GET, &[host, other]), None);
    }
}
