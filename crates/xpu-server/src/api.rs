//! The HTTP API (documented in `openapi.json`, served at `/openapi.json`), the dashboard at `/`
//! and Prometheus metrics at `/metrics`.
//!
//! Over the Unix socket (mode 0660) and loopback TCP no token is asked; TCP bound to any other
//! address requires `Authorization: Bearer <token>` with the token from `<data-dir>/token`.
//! Because loopback TCP trusts whoever connects, and a browser on the host connects for any web
//! page it shows, every request first passes [`browser_guard`]: on loopback TCP its `Host` must
//! be the daemon's own address (a DNS-rebound name is refused), and a request that changes
//! something must not come from another origin and must carry a JSON or YAML content type,
//! which a page can only send to another origin after a CORS preflight the daemon never
//! grants (<https://fetch.spec.whatwg.org/#cors-safelisted-request-header>).
//! Request bodies are limited to [`MAX_BODY`]; manifests are validated by
//! [`xpu_core::job::parse`] and a bad one gets 400 with the field path in `error` and `field`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Extension, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Shared;
use crate::engine::Msg;
use crate::listen::ConnStats;
use crate::metrics::DeviceSample;
use crate::store::{JobState, ListQuery, NewJob, Outcome, TaskRow, Write, now_ms};
use xpu_telemetry::collect::Holder;

/// Largest accepted request body (a manifest).
pub const MAX_BODY: usize = 1 << 20;
/// Largest page of `GET /v1/jobs`.
pub const MAX_PAGE: u32 = 1000;

const DASHBOARD: &str = include_str!("dashboard.html");
const OPENAPI: &str = include_str!("openapi.json");

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
        .route("/v1/jobs", post(submit).get(list))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/cancel", post(cancel))
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
    // Outermost: a browser's cross-site request is refused before anything else looks at it.
    let guard = Arc::new(BrowserGuard::new(opts));
    r.layer(middleware::from_fn_with_state(guard, browser_guard)).with_state(shared)
}

/// The checks of [`browser_guard`] for one listener.
#[derive(Debug)]
struct BrowserGuard {
    /// The `Host` values accepted; `None`: any (the Unix socket, which no browser reaches, and
    /// TCP off loopback, where the token is the defence: a rebound page cannot send it).
    hosts: Option<Vec<String>>,
}

/// Media types a manifest (or an empty body) may be sent as. None of them is a CORS-safelisted
/// `Content-Type`, so a browser sends such a request to another origin only after a preflight.
const BODY_TYPES: [&str; 4] =
    ["application/json", "application/yaml", "application/x-yaml", "text/yaml"];

impl BrowserGuard {
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

    /// `Err((status, message))` for a request a browser may have been made to send.
    fn check(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Result<(), (StatusCode, String)> {
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        if let Some(allowed) = &self.hosts {
            // An absolute-form target names the host in place of Host (RFC 9112 section 3.2.2).
            let named = uri.authority().map(|a| a.as_str()).or(host);
            if !named.is_some_and(|h| allowed.iter().any(|a| a.eq_ignore_ascii_case(h))) {
                return Err((
                    StatusCode::FORBIDDEN,
                    format!(
                        "Host {:?} is not this daemon's address; use http://{}/ (a request for another name may be a DNS-rebinding page)",
                        named.unwrap_or_default(),
                        allowed.first().map_or("", String::as_str),
                    ),
                ));
            }
        }
        if method.is_safe() {
            return Ok(());
        }
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
}

/// Refuses what a web page open in a browser on the host could otherwise do with loopback's
/// tokenless access: read the API under a rebound name, or post a job (which runs as the
/// daemon's user) from another origin.
async fn browser_guard(State(g): State<Arc<BrowserGuard>>, req: Request, next: Next) -> Response {
    match g.check(req.method(), req.uri(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err((status, message)) => error(status, message),
    }
}

/// Reads a request's body whole before its handler runs, within `limit` of the head: a client
/// that stalls mid-body gets 408 and loses the connection instead of holding it (hyper bounds
/// only the head's time). Bodies are at most [`MAX_BODY`] anyway.
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
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return too_big();
    }
    let (parts, body) = req.into_parts();
    let deadline = tokio::time::Instant::now() + limit;
    let mut frames = body.into_data_stream();
    let mut buf = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, frames.next()).await {
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
                if buf.len() + chunk.len() > MAX_BODY {
                    return too_big();
                }
                buf.extend_from_slice(&chunk);
            }
        }
    }
    next.run(Request::from_parts(parts, Body::from(buf))).await
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into() }))).into_response()
}

fn unavailable(e: impl std::fmt::Display) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, format!("store: {e}; retry, or check the database"))
}

/// The cookie a browser holds after `/login?token=...`: `fetch` and page loads send it on
/// their own, which a bearer header cannot do for a dashboard.
const COOKIE: &str = "xpu_token";

async fn auth(State(s): S, req: Request, next: Next) -> Response {
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let cookie = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='));
    let ok = [bearer, cookie]
        .into_iter()
        .flatten()
        .any(|t| constant_time_eq(t.as_bytes(), s.token.as_bytes()));
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

#[derive(Deserialize)]
struct LoginQuery {
    token: Option<String>,
}

/// `GET /login?token=T`: with the daemon's token, sets the dashboard's cookie (HttpOnly,
/// SameSite=Strict, so other sites cannot ride on it) and redirects to `/`.
async fn login(State(s): S, Query(q): Query<LoginQuery>) -> Response {
    let Some(token) = q.token.filter(|t| constant_time_eq(t.trim().as_bytes(), s.token.as_bytes()))
    else {
        return error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong token; open /login?token=<contents of <data-dir>/token>",
        );
    };
    let cookie = format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict", token.trim());
    match HeaderValue::from_str(&cookie) {
        Ok(v) => (
            StatusCode::SEE_OTHER,
            [(header::SET_COOKIE, v), (header::LOCATION, HeaderValue::from_static("/"))],
        )
            .into_response(),
        Err(_) => error(StatusCode::BAD_REQUEST, "token: not a valid header value"),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "no such route; see /openapi.json")
}

async fn dashboard() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], DASHBOARD).into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn metrics(State(s): S, Extension(conns): Extension<Arc<ConnStats>>) -> Response {
    let counts = match s.store.counts().await {
        Ok(c) => c,
        Err(e) => return unavailable(e),
    };
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
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
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

async fn status(State(s): S) -> Response {
    Json(json!({
        "node": s.node.name,
        "hostname": s.node.hostname,
        "leader": s.leader.load(Ordering::Relaxed),
        "store": s.store.url(),
        "version": env!("CARGO_PKG_VERSION"),
        "started_at_ms": s.started_ms,
        "devices": s.node.devices.len(),
        "labels": s.node.labels,
    }))
    .into_response()
}

#[derive(Debug, Deserialize)]
struct SubmitQuery {
    key: Option<String>,
}

async fn submit(
    State(s): S,
    headers: HeaderMap,
    Query(q): Query<SubmitQuery>,
    body: Bytes,
) -> Response {
    // Bodies past this size are parsed on the blocking pool: parsing costs time in the body's
    // size (up to MAX_BODY and its bounded YAML expansion), and an async worker spending it
    // would hold up every other request it serves, `/v1/status` included.
    const PARSE_INLINE: usize = 16 * 1024;
    let Ok(text) = std::str::from_utf8(&body) else {
        return error(StatusCode::BAD_REQUEST, "manifest: not UTF-8 text; send YAML or JSON");
    };
    let parsed = if text.len() <= PARSE_INLINE {
        xpu_core::job::parse_all(text)
    } else {
        let text = text.to_owned();
        match tokio::task::spawn_blocking(move || xpu_core::job::parse_all(&text)).await {
            Ok(r) => r,
            Err(e) => {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("parsing the manifest: {e}"),
                );
            }
        }
    };
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": e.to_string(), "field": e.path })),
            )
                .into_response();
        }
    };
    // All or nothing: one job the node cannot run refuses the whole file.
    let multi = parsed.jobs.len() > 1;
    for (i, spec) in parsed.jobs.iter().enumerate() {
        if let Err((field, message)) = check_runnable(&s, spec) {
            let field = if multi { format!("job[{i}] ({}).{field}", spec.name) } else { field };
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({ "error": format!("{field}: {message}"), "field": field })),
            )
                .into_response();
        }
    }
    let key =
        headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned).or(q.key);
    if let Some(k) = &key
        && (k.is_empty() || k.len() > 200)
    {
        return error(StatusCode::BAD_REQUEST, "idempotency key: must be 1 to 200 characters");
    }
    let at_ms = now_ms();
    let mut news = Vec::with_capacity(parsed.jobs.len());
    for (i, spec) in parsed.jobs.iter().enumerate() {
        let spec_json = match serde_json::to_string(spec) {
            Ok(j) => j,
            Err(e) => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding spec: {e}"));
            }
        };
        news.push(NewJob {
            // The file's key names its first job; the others get `<key>#<n>`, so a retry of
            // the file finds every one of them.
            key: key.as_ref().map(|k| if i == 0 { k.clone() } else { format!("{k}#{i}") }),
            name: spec.name.clone(),
            queue: spec.queue.clone(),
            priority: i64::from(spec.priority),
            spec: spec_json,
            at_ms,
        });
    }
    let write = if multi { Write::SubmitAll(news.clone()) } else { Write::Submit(news[0].clone()) };
    let ids = match s.store.write(write).await {
        Ok(Outcome::Submitted { id, created }) => vec![(id, created)],
        Ok(Outcome::SubmittedAll(ids)) if ids.len() == news.len() => ids,
        Ok(_) => return error(StatusCode::INTERNAL_SERVER_ERROR, "store answered a submit oddly"),
        Err(e) => return unavailable(e),
    };
    let mut answers = Vec::with_capacity(ids.len());
    for ((spec, new), (id, created)) in parsed.jobs.into_iter().zip(news).zip(ids) {
        match submitted(&s, spec, new, id, created).await {
            Ok(a) => answers.push(a),
            Err(resp) => return resp,
        }
    }
    let any_created = answers.iter().any(|a| a["created"] == true);
    let code = if any_created { StatusCode::CREATED } else { StatusCode::OK };
    let first = answers[0].clone();
    let mut body = json!({
        "id": first["id"],
        "name": first["name"],
        "state": first["state"],
        "created": first["created"],
        "notes": parsed.notes,
    });
    body["jobs"] = Value::Array(answers);
    let mut resp = (code, Json(body)).into_response();
    if !multi && let Ok(v) = HeaderValue::from_str(&format!("/v1/jobs/{}", first["id"])) {
        resp.headers_mut().insert(header::LOCATION, v);
    }
    resp
}

/// One job the store took: a new one goes to the engine; one whose idempotency key was seen
/// before must be the same job (however the manifest is written), or the request is refused
/// with 422 as the IETF Idempotency-Key draft says (section 2.7) and the first job stays as it
/// was. The job's line of the answer: id, name, state, created.
async fn submitted(
    s: &Shared,
    spec: xpu_core::job::JobSpec,
    new: NewJob,
    id: i64,
    created: bool,
) -> Result<Value, Response> {
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
        };
        // The engine is gone only while the daemon stops; the job is stored and the next
        // start picks it up.
        let _ = s.engine.send(Msg::Submitted { row, spec: Box::new(spec) });
        return Ok(json!({ "id": id, "name": name, "state": JobState::Queued, "created": true }));
    }
    let row = match s.store.job(id).await {
        Ok(Some(row)) => row,
        Ok(None) => {
            let msg = format!("store: job {id}, which holds the idempotency key, is missing");
            return Err(error(StatusCode::INTERNAL_SERVER_ERROR, msg));
        }
        Err(e) => return Err(unavailable(e)),
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
    };
    if !same {
        let key = new.key.unwrap_or_default();
        return Err((
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({
                "error": format!(
                    "idempotency key {key:?}: already used for job {id} with a different manifest; resend that manifest to get job {id}, or use a new key for a new job"
                ),
                "field": "Idempotency-Key",
                "id": id,
            })),
        )
            .into_response());
    }
    Ok(json!({ "id": id, "name": row.name, "state": row.state, "created": false }))
}

/// What the parser cannot know: whether the scheduler can take the task's request, and
/// whether a container's rootfs or bundle exists on this host. `Err((field, message))`.
fn check_runnable(s: &Shared, spec: &xpu_core::job::JobSpec) -> Result<(), (String, String)> {
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
    // What runc would refuse when the task starts is refused now, naming the field.
    let c = &spec.container;
    let (field, problem) = match (&c.rootfs, &c.bundle) {
        (Some(r), _) => (
            if k8s { "metadata.annotations.xpu.dev/rootfs" } else { "rootfs" },
            crate::container::root_problem(std::path::Path::new(r)),
        ),
        (None, Some(b)) => (
            if k8s { "metadata.annotations.xpu.dev/bundle" } else { "bundle" },
            crate::container::bundle_problem(std::path::Path::new(b)),
        ),
        (None, None) => return Ok(()),
    };
    match problem {
        Some(message) => Err((field.to_owned(), message)),
        None => Ok(()),
    }
}

#[derive(Debug, Deserialize)]
struct ListParams {
    state: Option<String>,
    before: Option<i64>,
    limit: Option<u32>,
}

async fn list(State(s): S, Query(p): Query<ListParams>) -> Response {
    let state = match p.state.as_deref().map(str::parse::<JobState>).transpose() {
        Ok(st) => st,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("state: {e}")),
    };
    let limit = p.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    match s.store.list(ListQuery { state, before: p.before, limit }).await {
        Ok(rows) => {
            let next = if rows.len() == limit as usize { rows.last().map(|r| r.id) } else { None };
            Json(json!({ "jobs": rows, "next": next })).into_response()
        }
        Err(e) => unavailable(e),
    }
}

fn parse_id(id: &str) -> Result<i64, Box<Response>> {
    id.parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            format!("job id {id:?}: must be a positive integer"),
        ))
    })
}

async fn job(State(s): S, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    let row = match s.store.job(id).await {
        Ok(Some(r)) => r,
        Ok(None) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("job {id} does not exist; list jobs with xpu jobs"),
            );
        }
        Err(e) => return unavailable(e),
    };
    let tasks = match s.store.tasks(id).await {
        Ok(t) => t,
        Err(e) => return unavailable(e),
    };
    let spec: Value = serde_json::from_str(&row.spec).unwrap_or(Value::Null);
    let reason =
        s.view.read().ok().and_then(|v| {
            v.queued.iter().find(|q| q.id == id).map(|q| (q.position, q.reason.clone()))
        });
    let mut v = serde_json::to_value(&row).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("spec".into(), spec);
        m.insert("tasks".into(), serde_json::to_value(&tasks).unwrap_or(Value::Null));
        if let Some((pos, why)) = reason {
            m.insert("queue_position".into(), json!(pos));
            m.insert("reason".into(), json!(why));
        }
    }
    Json(v).into_response()
}

async fn cancel(State(s): S, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    match s.store.write(Write::RequestCancel { id }).await {
        Ok(Outcome::CancelRequested(None)) => error(
            StatusCode::NOT_FOUND,
            format!("job {id} does not exist; list jobs with xpu jobs"),
        ),
        Ok(Outcome::CancelRequested(Some(state))) if state.is_terminal() => {
            error(StatusCode::CONFLICT, format!("job {id} already {state}; nothing to cancel"))
        }
        Ok(Outcome::CancelRequested(Some(_))) => {
            let _ = s.engine.send(Msg::Cancel(id));
            (StatusCode::ACCEPTED, Json(json!({ "id": id, "state": "cancelled" }))).into_response()
        }
        Ok(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "store answered a cancel oddly"),
        Err(e) => unavailable(e),
    }
}

#[derive(Debug, Deserialize)]
struct LogParams {
    task: Option<i64>,
    attempt: Option<i64>,
    follow: Option<bool>,
    /// The last N lines only (`kubectl logs --tail`; `tailLines` in the Kubernetes API).
    #[serde(alias = "tailLines")]
    tail: Option<u64>,
    /// At most N bytes, from where the output starts (`kubectl logs --limit-bytes`).
    #[serde(rename = "limitBytes")]
    limit_bytes: Option<u64>,
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

async fn logs(State(s): S, Path(id): Path<String>, Query(p): Query<LogParams>) -> Response {
    let id = match parse_id(&id) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    if p.limit_bytes == Some(0) {
        return error(StatusCode::BAD_REQUEST, "limitBytes: must be at least 1");
    }
    let window = LogWindow { tail: p.tail, limit: p.limit_bytes.unwrap_or(u64::MAX) };
    let tasks = match s.store.tasks(id).await {
        Ok(t) => t,
        Err(e) => return unavailable(e),
    };
    let idx = p.task.unwrap_or(0);
    let pick: Option<&TaskRow> = tasks
        .iter()
        .filter(|t| t.idx == idx && p.attempt.is_none_or(|a| a == t.attempt))
        .max_by_key(|t| t.attempt);
    let Some(task) = pick.cloned() else {
        return match s.store.job(id).await {
            Ok(Some(_)) if p.follow.unwrap_or(false) => follow_pending(s, id, idx, window).await,
            Ok(Some(_)) => error(
                StatusCode::NOT_FOUND,
                format!("job {id} task {idx} has not started yet; use -f to wait for it"),
            ),
            Ok(None) => error(StatusCode::NOT_FOUND, format!("job {id} does not exist")),
            Err(e) => unavailable(e),
        };
    };
    if p.follow.unwrap_or(false) {
        return follow_response(s, task, window).await;
    }
    let path = std::path::Path::new(&task.dir).join("output.log");
    let read = async {
        let start = log_start(&path, window.tail).await?;
        let mut f = tokio::fs::File::open(&path).await?;
        tokio::io::AsyncSeekExt::seek(&mut f, std::io::SeekFrom::Start(start)).await?;
        Ok::<_, std::io::Error>(f)
    };
    match read.await {
        Ok(f) => text_plain(stream_file(f, window.limit)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => text_plain(Body::empty()),
        Err(e) => {
            error(StatusCode::INTERNAL_SERVER_ERROR, format!("reading {}: {e}", path.display()))
        }
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
async fn follow_pending(s: Arc<Shared>, id: i64, idx: i64, window: LogWindow) -> Response {
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Ok(tasks) = s.store.tasks(id).await
            && let Some(t) = tasks.iter().filter(|t| t.idx == idx).max_by_key(|t| t.attempt)
        {
            return follow_response(s, t.clone(), window).await;
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
async fn follow_response(s: Arc<Shared>, task: TaskRow, window: LogWindow) -> Response {
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
    }
    let init = St { s, task, path, offset, left: window.limit, finished: false };
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

async fn devices(State(s): S) -> Response {
    let holders = s.view.read().map(|v| v.holders.clone()).unwrap_or_default();
    let telemetry = s.telemetry.as_ref().map(|t| t.snapshot().devices).unwrap_or_default();
    let unhealthy: std::collections::BTreeMap<String, String> = s
        .telemetry
        .as_ref()
        .map(|t| t.unhealthy().into_iter().map(|(a, r)| (a.to_string(), r)).collect())
        .unwrap_or_default();
    let devs: Vec<Value> = s
        .node
        .devices
        .iter()
        .map(|d| {
            let mut v = serde_json::to_value(d).unwrap_or(Value::Null);
            let held = holders.get(d.id as usize).cloned().unwrap_or_default();
            if let Value::Object(m) = &mut v {
                // `holder`: the first task holding it (the only one unless it is shared).
                m.insert(
                    "holder".into(),
                    serde_json::to_value(held.first()).unwrap_or(Value::Null),
                );
                m.insert(
                    "allocated_milli".into(),
                    json!(held.iter().map(|h| u32::from(h.milli)).sum::<u32>()),
                );
                m.insert("holders".into(), serde_json::to_value(&held).unwrap_or(Value::Null));
                if let Some(t) = telemetry.iter().find(|t| t.address.to_string() == d.address) {
                    let r = &t.reading;
                    m.insert(
                        "telemetry".into(),
                        json!({
                            "utilization_percent": r.utilization_percent,
                            "memory_used_bytes": r.memory_used_bytes,
                            "memory_total_bytes": r.memory_total_bytes,
                            "power_watts": r.power_watts,
                            "temperature_celsius": r.temperature_celsius,
                        }),
                    );
                }
                m.insert("unhealthy".into(), json!(unhealthy.get(&d.address)));
            }
            v
        })
        .collect();
    Json(
        json!({ "node": s.node.name, "leader": s.leader.load(Ordering::Relaxed), "devices": devs }),
    )
    .into_response()
}

async fn queue(State(s): S) -> Response {
    let v = s
        .view
        .read()
        .map(|v| (v.queued.clone(), v.queued_total, v.running.clone(), v.history.clone()));
    match v {
        Ok((queued, queued_total, running, history)) => Json(json!({
            "leader": s.leader.load(Ordering::Relaxed),
            "queued": queued,
            "queued_total": queued_total,
            "running": running,
            "allocation_history": history.iter().map(|(t, n)| json!([t, n])).collect::<Vec<_>>(),
            "devices": s.node.devices.len(),
        }))
        .into_response(),
        Err(_) => {
            error(StatusCode::INTERNAL_SERVER_ERROR, "view lock poisoned; restart the daemon")
        }
    }
}

#[derive(Debug, Deserialize)]
struct EventParams {
    after: Option<i64>,
    job: Option<i64>,
    limit: Option<u32>,
}

async fn events(State(s): S, Query(p): Query<EventParams>) -> Response {
    let limit = p.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    match s.store.events(p.after.unwrap_or(0), p.job, limit).await {
        Ok(ev) => Json(json!({ "events": ev })).into_response(),
        Err(e) => unavailable(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(tcp: &str, method: Method, headers: &[(&str, &str)]) -> Option<StatusCode> {
        let g = BrowserGuard::new(&ApiOptions {
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
        g.check(&method, &Uri::from_static("/v1/jobs"), &h).err().map(|(s, _)| s)
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
            check("127.0.0.1:8470", Method::DELETE, &[host, yaml, site]),
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
