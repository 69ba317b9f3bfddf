//! The HTTP API's bodies and parameters, typed once: the handlers in [`crate::api`] answer with
//! these types and read their parameters into them, [`crate::client`] and the CLI read the same
//! types back, and the OpenAPI document served at `/openapi.json` ([`ApiDoc`]) is derived from
//! them and from the handlers' `#[utoipa::path]` attributes, so the three cannot drift apart.
//!
//! It owns the shapes and the bounds of parameters ([`ListParams::check`] and friends); it does
//! not read the store or the engine's view. Rows the store returns ([`JobRow`], [`TaskRow`],
//! [`EventRow`]) and the engine's view ([`crate::view`]) are sent as they are.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, RefOr, ResponseBuilder};
use utoipa::{IntoParams, IntoResponses, Modify, OpenApi, ToSchema};

pub use crate::store::{EventRow, JobRow, JobState, TaskRow, TaskState};
pub use crate::view::{Holder, QueuedView, RunningView, TaskView};

/// Largest page of `GET /v1/jobs` and `GET /v1/events`.
pub const MAX_PAGE: u32 = 1000;
/// The page size when none is asked for.
pub const DEFAULT_PAGE: u32 = 100;
/// Longest `Idempotency-Key`.
pub const MAX_KEY: usize = 200;

/// Every refusal: what went wrong, on which input, and what to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: String,
    /// The offending field: a manifest path (`spec.template.spec.containers[0].image`), a query
    /// parameter, or `Idempotency-Key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// With 422 for a reused idempotency key: the job that holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<i64>,
}

impl ErrorBody {
    pub fn new(error: impl Into<String>) -> Self {
        Self { error: error.into(), field: None, id: None }
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
}

/// `GET /v1/status`: the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Status {
    /// The node's name (`--node-name`, else the host name).
    pub node: String,
    pub hostname: String,
    /// Whether this daemon runs tasks (always with SQLite; one of several with PostgreSQL).
    pub leader: bool,
    /// The store's URL.
    pub store: String,
    /// xpu's version.
    pub version: String,
    pub started_at_ms: i64,
    /// How many devices the node has.
    pub devices: usize,
    /// Node labels, matched by `nodeSelector`.
    pub labels: BTreeMap<String, String>,
}

/// `POST /v1/jobs` query.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SubmitParams {
    /// Idempotency key (also the `Idempotency-Key` header, which wins), 1 to 200 characters: a
    /// repeated submit of the same job returns the first job with 200; a different job under a
    /// used key is refused with 422. Jobs are the same when their parsed specs are (formatting
    /// and fields xpu ignores do not count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(min_length = 1, max_length = 200)]
    pub key: Option<String>,
}

/// One job a submission named.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SubmittedJob {
    pub id: i64,
    pub name: String,
    pub state: JobState,
    /// False when the idempotency key was seen before: the job is the first one.
    pub created: bool,
}

/// `POST /v1/jobs`: the first job (`id`, `name`, `state`, `created`), every job the file
/// submitted in document order (`jobs`), and what the parser skipped or assumed (`notes`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Submitted {
    #[serde(flatten)]
    pub first: SubmittedJob,
    pub notes: Vec<String>,
    pub jobs: Vec<SubmittedJob>,
}

/// `GET /v1/jobs` query: newest first, a page at a time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Only jobs in this state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<JobState>,
    /// Continue below this id (the previous page's `next`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 1)]
    pub before: Option<i64>,
    /// Page size [default: 100].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

impl Bounded for ListParams {
    fn check(&self) -> Result<(), (&'static str, String)> {
        positive("before", self.before)?;
        page_limit(self.limit)
    }
}

/// `GET /v1/jobs`: a page of jobs, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobList {
    /// Without their specs (see `GET /v1/jobs/{id}`).
    pub jobs: Vec<JobRow>,
    /// The `before` of the next page; null on the last one.
    pub next: Option<i64>,
}

/// `GET /v1/jobs/{id}`: a job with its spec and task attempts, and, while it waits, where it
/// stands in its queue and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobDetail {
    #[serde(flatten)]
    pub job: JobRow,
    /// The job as xpu parsed it (`xpu_core::job::JobSpec`); null for a stored spec this version
    /// of xpu cannot read.
    #[schema(value_type = Option<Object>)]
    pub spec: Option<xpu_core::job::JobSpec>,
    /// Every attempt of every task.
    pub tasks: Vec<TaskRow>,
    /// Position in its queue (1 is next), while queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// Why it waits, as kube-scheduler says it (`0/1 nodes are available: 1 Insufficient gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /v1/jobs/{id}/cancel`: the cancellation is recorded; tasks stop within the grace period.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CancelAccepted {
    pub id: i64,
    pub state: JobState,
}

/// `GET /v1/jobs/{id}/logs` query, as `kubectl logs` takes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogParams {
    /// Task (completion index) [default: 0].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 0)]
    pub task: Option<i64>,
    /// Attempt [default: the latest].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 0)]
    pub attempt: Option<i64>,
    /// Stream until the attempt ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<bool>,
    /// Only the last N lines (as they are when the request arrives, with follow); a final newline
    /// ends the last line. Also accepted as `tailLines`, the Kubernetes name.
    #[serde(default, alias = "tailLines", skip_serializing_if = "Option::is_none")]
    #[param(minimum = 0)]
    pub tail: Option<i64>,
    /// At most N bytes, counted from where the output starts (after tail); the last line may be
    /// cut.
    #[serde(default, rename = "limitBytes", skip_serializing_if = "Option::is_none")]
    #[param(minimum = 1)]
    pub limit_bytes: Option<i64>,
}

impl Bounded for LogParams {
    fn check(&self) -> Result<(), (&'static str, String)> {
        at_least("task", self.task, 0)?;
        at_least("attempt", self.attempt, 0)?;
        at_least("tail", self.tail, 0)?;
        at_least("limitBytes", self.limit_bytes, 1)
    }
}

/// A device's telemetry, when a source reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DeviceTelemetry {
    pub utilization_percent: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub power_watts: Option<f64>,
    pub temperature_celsius: Option<f64>,
}

/// One of the node's devices and the tasks holding it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DeviceView {
    #[serde(flatten)]
    pub device: crate::node::Device,
    /// The first task holding it (the only one unless it is shared).
    pub holder: Option<Holder>,
    /// Every task holding it, each with the thousandths it holds.
    pub holders: Vec<Holder>,
    /// Thousandths of the device held in all (1000: all of it).
    pub allocated_milli: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<DeviceTelemetry>,
    /// Why the device is held out of placement, while it is.
    pub unhealthy: Option<String>,
    /// The use that holds it outside xpu serve's jobs, as `xpu vfio status` says it:
    /// `nova: listed in /etc/xpu/vm-devices`, `vfio-pci: xpu vfio bind` (a VM's), `vfio-pci:
    /// bound outside xpu`, `host: <driver>`; `None` when the node was not read yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
    /// Since when that use holds it (Unix milliseconds), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_since_ms: Option<i64>,
}

impl DeviceView {
    /// The use outside the host's own driver that holds the device (a VM's, Nova's), when one
    /// does: what the device list shows for a device no job holds.
    pub fn outside_use(&self) -> Option<&str> {
        self.held_by.as_deref().filter(|u| !u.starts_with("host:") && *u != "free")
    }
}

/// `GET /v1/devices`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DeviceList {
    pub node: String,
    pub leader: bool,
    pub devices: Vec<DeviceView>,
}

/// `GET /v1/queue`: what the scheduling loop last published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Queue {
    pub leader: bool,
    /// Queued jobs in queue order, the first 1,000 of them.
    pub queued: Vec<QueuedView>,
    /// Queued jobs in all.
    pub queued_total: usize,
    pub running: Vec<RunningView>,
    /// `[time in ms, devices allocated]`, one sample per change and at most one per second.
    pub allocation_history: Vec<(i64, u32)>,
    /// How many devices the node has.
    pub devices: usize,
}

/// `GET /v1/events` query: oldest first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventParams {
    /// Only events after this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// Only this job's events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 1)]
    pub job: Option<i64>,
    /// Page size [default: 100].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
}

impl Bounded for EventParams {
    fn check(&self) -> Result<(), (&'static str, String)> {
        at_least("after", self.after, 0)?;
        positive("job", self.job)?;
        page_limit(self.limit)
    }
}

/// `GET /v1/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EventList {
    pub events: Vec<EventRow>,
}

/// `GET /login` query.
#[derive(Debug, Clone, Default, Serialize, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LoginParams {
    /// The daemon's token (`<data-dir>/token`).
    #[serde(default)]
    pub token: Option<String>,
}

impl Bounded for SubmitParams {
    fn check(&self) -> Result<(), (&'static str, String)> {
        check_key(self.key.as_deref()).map_err(|e| ("key", e))
    }
}

impl Bounded for LoginParams {}

/// Query parameters with bounds beyond their types: the ones the document declares with
/// `#[param(minimum = ..)]` and the like, checked where the parameters are read.
pub trait Bounded {
    /// `Err((parameter, message))` for the first parameter out of bounds.
    fn check(&self) -> Result<(), (&'static str, String)> {
        Ok(())
    }
}

/// An idempotency key's bounds (from the query or the `Idempotency-Key` header).
pub fn check_key(key: Option<&str>) -> Result<(), String> {
    match key {
        Some(k) if k.is_empty() || k.len() > MAX_KEY => {
            Err(format!("must be 1 to {MAX_KEY} characters, not {}", k.len()))
        }
        _ => Ok(()),
    }
}

fn at_least(name: &'static str, v: Option<i64>, min: i64) -> Result<(), (&'static str, String)> {
    match v {
        Some(n) if n < min => Err((name, format!("{n} is below the least value, {min}"))),
        _ => Ok(()),
    }
}

fn positive(name: &'static str, v: Option<i64>) -> Result<(), (&'static str, String)> {
    at_least(name, v, 1)
}

fn page_limit(limit: Option<u32>) -> Result<(), (&'static str, String)> {
    match limit {
        Some(n) if n == 0 || n > MAX_PAGE => {
            Err(("limit", format!("{n} is not a page size; give 1 to {MAX_PAGE}")))
        }
        _ => Ok(()),
    }
}

/// What a route that reads query parameters and the store may answer besides its own answers
/// and [`Refusals`]' ones.
#[derive(IntoResponses)]
pub enum ParamRefusals {
    /// A parameter is malformed or out of its bounds; `field` names it.
    #[response(status = 400)]
    BadParameter(ErrorBody),
    /// The store failed; retry.
    #[response(status = 503)]
    StoreFailed(ErrorBody),
}

/// The OpenAPI document of the API, built from the handlers' attributes and the types above.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "xpu serve",
        version = "1",
        description = "The xpu accelerator job daemon.\n\n\
Over the Unix socket and loopback TCP no token is needed; TCP on other addresses needs \
`Authorization: Bearer <contents of <data-dir>/token>` (a browser opens `/login?token=...` once \
and then holds a cookie).\n\n\
Browser defences, on every listener: on loopback TCP the `Host` must be the daemon's address \
(the bound IP or `localhost`, with the port), else 403; a POST with an `Origin` other than the \
daemon's own or with `Sec-Fetch-Site` other than `same-origin`/`none` gets 403, and one without \
`Content-Type` application/json, application/yaml, application/x-yaml or text/yaml (also when it \
has no body) gets 415.\n\n\
Limits per listener (xpu serve flags): at most --max-connections (256) open, more wait to be \
accepted; a request head must arrive within --request-timeout-seconds (10) of connecting or of \
the previous response, else the connection is closed, and its body within as long again, else \
408; a request body is at most 1 MiB (413); a client that leaves a response unread for \
--send-timeout-seconds (60) is disconnected.\n\n\
Every refusal is an `Error`: `error` says what is wrong and what to do, `field` names the input \
when there is one (a manifest's field path, a query parameter)."
    ),
    paths(
        crate::api::status,
        crate::api::submit,
        crate::api::list,
        crate::api::job,
        crate::api::cancel,
        crate::api::logs,
        crate::api::devices,
        crate::api::queue,
        crate::api::events,
        crate::api::openapi,
        crate::api::metrics,
        crate::api::dashboard,
        crate::api::login,
    ),
    components(schemas(ErrorBody, TaskState)),
    modifiers(&Refusals),
    security((), ("bearer" = [])),
)]
pub struct ApiDoc;

/// What every route may answer before its handler runs (the token check, the browser guard, the
/// body reader: [`crate::api`]'s middleware), and the bearer scheme itself.
struct Refusals;

impl Modify for Refusals {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        let error = |description: &str| {
            let content =
                Content::new(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name("ErrorBody"))));
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content("application/json", content)
                    .build(),
            )
        };
        for item in doc.paths.paths.values_mut() {
            let ops = [
                (&mut item.get, false),
                (&mut item.post, true),
                (&mut item.put, true),
                (&mut item.delete, true),
                (&mut item.patch, true),
            ];
            for (op, changes) in ops {
                let Some(op) = op.as_mut() else { continue };
                let mut refusals = vec![
                    ("401", "missing or wrong bearer token (TCP off loopback only)"),
                    ("403", "a foreign Host, Origin or Sec-Fetch-Site (a browser on another site)"),
                ];
                if changes {
                    refusals.extend([
                        ("408", "the body did not arrive within the request timeout"),
                        ("413", "body over 1 MiB"),
                        ("415", "Content-Type missing or not JSON/YAML"),
                    ]);
                }
                for (status, description) in refusals {
                    op.responses
                        .responses
                        .entry(status.to_owned())
                        .or_insert_with(|| error(description));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_round_trip_through_a_query_string() {
        let p = LogParams {
            task: Some(2),
            follow: Some(true),
            tail: Some(10),
            limit_bytes: Some(5),
            ..LogParams::default()
        };
        let q = serde_urlencoded::to_string(&p).expect("flat params encode");
        assert_eq!(q, "task=2&follow=true&tail=10&limitBytes=5");
        assert_eq!(serde_urlencoded::from_str::<LogParams>(&q).ok(), Some(p));
        let k8s: LogParams = serde_urlencoded::from_str("tailLines=3").expect("the alias");
        assert_eq!(k8s.tail, Some(3));
        let l = ListParams { state: Some(JobState::Failed), ..ListParams::default() };
        assert_eq!(serde_urlencoded::to_string(&l).ok().as_deref(), Some("state=failed"));
    }

    #[test]
    fn bounds_name_the_parameter() {
        let l = ListParams { limit: Some(0), ..ListParams::default() };
        assert_eq!(l.check().map_err(|(p, _)| p), Err("limit"));
        let l = ListParams { limit: Some(MAX_PAGE), before: Some(1), ..ListParams::default() };
        assert_eq!(l.check(), Ok(()));
        let e = EventParams { job: Some(0), ..EventParams::default() };
        assert_eq!(e.check().map_err(|(p, _)| p), Err("job"));
        let g = LogParams { limit_bytes: Some(0), ..LogParams::default() };
        assert_eq!(g.check().map_err(|(p, _)| p), Err("limitBytes"));
    }

    #[test]
    fn the_document_declares_every_route_and_the_refusals() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("the document serializes");
        let paths = doc["paths"].as_object().expect("paths");
        for p in ["/v1/jobs", "/v1/jobs/{id}", "/v1/jobs/{id}/logs", "/v1/events", "/metrics"] {
            assert!(paths.contains_key(p), "{p} missing");
        }
        let post = &doc["paths"]["/v1/jobs"]["post"]["responses"];
        for status in ["201", "200", "400", "403", "413", "415", "422"] {
            assert!(post.get(status).is_some(), "POST /v1/jobs: {status} not declared");
        }
        assert_eq!(doc["components"]["securitySchemes"]["bearer"]["scheme"], "bearer");
        let limit = doc["paths"]["/v1/jobs"]["get"]["parameters"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == "limit"))
            .expect("limit declared");
        assert_eq!(limit["schema"]["maximum"], 1000);
    }
}
