//! The daemon's durable store: jobs, their tasks (one row per attempt), and an event log, in
//! SQLite (the embedded default, `sqlite://<data-dir>/xpu.db`) or PostgreSQL (`postgres://...`,
//! shared by several daemons). Both backends run the same migrations (embedded, applied at
//! start) and answer the same queries.
//!
//! Durability: every change goes through one writer that batches whatever is waiting into a
//! single transaction (group commit) and answers each caller only after that transaction has
//! committed; SQLite runs in WAL mode with `synchronous=FULL`, PostgreSQL with its default
//! `synchronous_commit=on`. So when the API answers 2xx, the change survives `kill -9` and a
//! power cut. One failing change in a batch does not fail the others: each runs in its own
//! savepoint.
//!
//! This module owns the SQL; it does not decide anything about jobs.

mod postgres;
mod sqlite;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use utoipa::ToSchema;

pub use postgres::PgLeader;

/// A store failure, with the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error(
        "database url {0:?} is not understood; use sqlite:///path/xpu.db or postgres://user@host:port/db"
    )]
    BadUrl(String),
    #[error("opening {path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("the store's writer has stopped; restart the daemon")]
    WriterGone,
    #[error("{0}")]
    Corrupt(String),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A job's state. Terminal states never change again.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 5] = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Failed | JobState::Cancelled)
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| {
            format!(
                "unknown job state {s:?}; expected queued, running, succeeded, failed or cancelled"
            )
        })
    }
}

/// A task attempt's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// Recorded before the process is spawned, so a crash in between is noticed at restart.
    Starting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl TaskState {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Starting => "starting",
            TaskState::Running => "running",
            TaskState::Succeeded => "succeeded",
            TaskState::Failed => "failed",
            TaskState::Cancelled => "cancelled",
        }
    }

    pub fn is_active(self) -> bool {
        matches!(self, TaskState::Starting | TaskState::Running)
    }
}

impl FromStr for TaskState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [
            TaskState::Starting,
            TaskState::Running,
            TaskState::Succeeded,
            TaskState::Failed,
            TaskState::Cancelled,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
        .ok_or_else(|| format!("unknown task state {s:?}"))
    }
}

/// The user a job belongs to and runs as: the Unix socket peer that submitted it, or the user
/// of the token it was sent with (see [`crate::api`]). Jobs stored before owners were recorded
/// have none and run as the daemon's own user, as they did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// One job row. `spec` is the JSON of [`xpu_core::job::JobSpec`]; list queries leave it empty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobRow {
    pub id: i64,
    pub key: Option<String>,
    pub name: String,
    pub queue: String,
    pub priority: i64,
    pub state: JobState,
    #[serde(skip)]
    pub spec: String,
    pub submitted_at_ms: i64,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub failures: i64,
    pub cancel_requested: bool,
    pub message: Option<String>,
    /// Who submitted it, and so whose job it runs as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
}

/// One task attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TaskRow {
    pub job_id: i64,
    pub idx: i64,
    pub attempt: i64,
    pub state: TaskState,
    /// The daemon (node) that runs it.
    pub node: String,
    /// Device ids (node-local indices) it holds, as JSON `[0,1]`.
    pub devices: Vec<u32>,
    pub pid: Option<i64>,
    pub started_at_ms: i64,
    pub finished_at_ms: Option<i64>,
    pub exit_code: Option<i64>,
    /// Working directory, holding `output.log`, `pid` and `exit`.
    pub dir: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EventRow {
    pub id: i64,
    pub at_ms: i64,
    pub job_id: Option<i64>,
    pub kind: String,
    pub message: String,
}

/// A new job to insert.
#[derive(Debug, Clone)]
pub struct NewJob {
    /// Client-chosen idempotency key: a second submit with the same key returns the first job.
    pub key: Option<String>,
    pub name: String,
    pub queue: String,
    pub priority: i64,
    pub spec: String,
    pub at_ms: i64,
    pub owner: Owner,
}

/// One change, applied by the writer in a batch.
#[derive(Debug, Clone)]
pub enum Write {
    Submit(NewJob),
    /// Several jobs from one manifest file, inserted together or not at all.
    SubmitAll(Vec<NewJob>),
    /// Marks an active job for cancellation; the scheduling loop carries it out.
    RequestCancel {
        id: i64,
    },
    /// Sets state (and the timestamps that go with it) and failure count.
    SetJob {
        id: i64,
        state: JobState,
        at_ms: i64,
        failures: i64,
        message: Option<String>,
    },
    /// Inserts or replaces a task attempt.
    Task(TaskRow),
    Event {
        at_ms: i64,
        job_id: Option<i64>,
        kind: String,
        message: String,
    },
}

/// What a write produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The job's id and whether it is new (false: the key was seen before).
    Submitted {
        id: i64,
        created: bool,
    },
    /// Per job of a [`Write::SubmitAll`], in order: its id and whether it is new.
    SubmittedAll(Vec<(i64, bool)>),
    /// The job's state before the request; `None` when there is no such job.
    CancelRequested(Option<JobState>),
    Done,
}

/// Paging for job listings: newest first, `before` an id to continue from.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub state: Option<JobState>,
    pub before: Option<i64>,
    pub limit: u32,
}

/// Active jobs' ids with their state and whether cancellation was asked, for the scheduling
/// loop's poll (it also finds jobs submitted through other daemons this way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActiveRef {
    pub id: i64,
    pub state: JobState,
    pub cancel_requested: bool,
}

type Reply = oneshot::Sender<Result<Outcome>>;

enum Backend {
    Sqlite(sqlite::Sqlite),
    Postgres(postgres::Pg),
}

/// The store: a group-commit writer plus read access.
pub struct Store {
    backend: Backend,
    writes: mpsc::Sender<(Write, Reply)>,
    url: String,
}

impl Store {
    /// Opens (creating if needed) the database at `url` and applies the migrations.
    pub async fn open(url: &str) -> Result<Store> {
        let (tx, rx) = mpsc::channel(8192);
        let backend = if let Some(path) = url.strip_prefix("sqlite://") {
            Backend::Sqlite(sqlite::Sqlite::open(path, rx)?)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres(postgres::Pg::open(url, rx).await?)
        } else {
            return Err(StoreError::BadUrl(url.to_owned()));
        };
        Ok(Store { backend, writes: tx, url: redact(url) })
    }

    /// The URL without its password, for logs and `/v1/status`.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn is_postgres(&self) -> bool {
        matches!(self.backend, Backend::Postgres(_))
    }

    /// Applies one change and returns once it is durable.
    pub async fn write(&self, w: Write) -> Result<Outcome> {
        trace_write(&w);
        let (tx, rx) = oneshot::channel();
        self.writes.send((w, tx)).await.map_err(|_| StoreError::WriterGone)?;
        rx.await.map_err(|_| StoreError::WriterGone)?
    }

    /// Queues a change without waiting for it; changes from one caller keep their order.
    pub fn write_later(&self, w: Write) {
        trace_write(&w);
        let (tx, _rx) = oneshot::channel();
        if let Err(mpsc::error::TrySendError::Full(item)) = self.writes.try_send((w, tx)) {
            // Full: wait in a task so the change is not lost.
            let writes = self.writes.clone();
            tokio::spawn(async move {
                let _ = writes.send(item).await;
            });
        }
    }

    /// Leaves the whole SQLite store in its database file (WAL checkpointed and emptied), as a
    /// daemon that stops cleanly does, so that a backup copies one file; PostgreSQL keeps its own.
    pub async fn checkpoint(&self) -> Result<()> {
        match &self.backend {
            Backend::Sqlite(s) => s.checkpoint().await,
            Backend::Postgres(_) => Ok(()),
        }
    }

    pub async fn job(&self, id: i64) -> Result<Option<JobRow>> {
        match &self.backend {
            Backend::Sqlite(s) => s.job(id).await,
            Backend::Postgres(p) => p.job(id).await,
        }
    }

    pub async fn list(&self, q: ListQuery) -> Result<Vec<JobRow>> {
        match &self.backend {
            Backend::Sqlite(s) => s.list(q).await,
            Backend::Postgres(p) => p.list(q).await,
        }
    }

    /// Jobs in each state.
    pub async fn counts(&self) -> Result<Vec<(JobState, i64)>> {
        match &self.backend {
            Backend::Sqlite(s) => s.counts().await,
            Backend::Postgres(p) => p.counts().await,
        }
    }

    pub async fn active(&self) -> Result<Vec<ActiveRef>> {
        match &self.backend {
            Backend::Sqlite(s) => s.active().await,
            Backend::Postgres(p) => p.active().await,
        }
    }

    pub async fn tasks(&self, job_id: i64) -> Result<Vec<TaskRow>> {
        match &self.backend {
            Backend::Sqlite(s) => s.tasks(Some(job_id)).await,
            Backend::Postgres(p) => p.tasks(Some(job_id)).await,
        }
    }

    /// Every task still starting or running, in any job.
    pub async fn active_tasks(&self) -> Result<Vec<TaskRow>> {
        match &self.backend {
            Backend::Sqlite(s) => s.tasks(None).await,
            Backend::Postgres(p) => p.tasks(None).await,
        }
    }

    /// Events after `after` (an event id), oldest first.
    pub async fn events(
        &self,
        after: i64,
        job_id: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        match &self.backend {
            Backend::Sqlite(s) => s.events(after, job_id, limit).await,
            Backend::Postgres(p) => p.events(after, job_id, limit).await,
        }
    }
}

/// Hides the password in a URL.
fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://")
        && let Some((cred, host)) = rest.split_once('@')
        && let Some((user, _)) = cred.split_once(':')
    {
        return format!("{scheme}://{user}:***@{host}");
    }
    url.to_owned()
}

/// The migrations, in order. Each is (version, SQLite SQL, PostgreSQL SQL); the schemas differ
/// only in the id column type.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        key TEXT UNIQUE,
        name TEXT NOT NULL,
        queue TEXT NOT NULL,
        priority INTEGER NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        submitted_at_ms INTEGER NOT NULL,
        started_at_ms INTEGER,
        finished_at_ms INTEGER,
        failures INTEGER NOT NULL DEFAULT 0,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        message TEXT
    );
    CREATE INDEX jobs_state_id ON jobs (state, id);
    CREATE TABLE tasks (
        job_id INTEGER NOT NULL REFERENCES jobs (id),
        idx INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        state TEXT NOT NULL,
        node TEXT NOT NULL,
        devices TEXT NOT NULL,
        pid INTEGER,
        started_at_ms INTEGER NOT NULL,
        finished_at_ms INTEGER,
        exit_code INTEGER,
        dir TEXT NOT NULL,
        PRIMARY KEY (job_id, idx, attempt)
    );
    CREATE INDEX tasks_state ON tasks (state);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at_ms INTEGER NOT NULL,
        job_id INTEGER,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_job ON events (job_id, id);",
        "CREATE TABLE jobs (
        id BIGSERIAL PRIMARY KEY,
        key TEXT UNIQUE,
        name TEXT NOT NULL,
        queue TEXT NOT NULL,
        priority BIGINT NOT NULL,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        submitted_at_ms BIGINT NOT NULL,
        started_at_ms BIGINT,
        finished_at_ms BIGINT,
        failures BIGINT NOT NULL DEFAULT 0,
        cancel_requested BIGINT NOT NULL DEFAULT 0,
        message TEXT
    );
    CREATE INDEX jobs_state_id ON jobs (state, id);
    CREATE TABLE tasks (
        job_id BIGINT NOT NULL REFERENCES jobs (id),
        idx BIGINT NOT NULL,
        attempt BIGINT NOT NULL,
        state TEXT NOT NULL,
        node TEXT NOT NULL,
        devices TEXT NOT NULL,
        pid BIGINT,
        started_at_ms BIGINT NOT NULL,
        finished_at_ms BIGINT,
        exit_code BIGINT,
        dir TEXT NOT NULL,
        PRIMARY KEY (job_id, idx, attempt)
    );
    CREATE INDEX tasks_state ON tasks (state);
    CREATE TABLE events (
        id BIGSERIAL PRIMARY KEY,
        at_ms BIGINT NOT NULL,
        job_id BIGINT,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_job ON events (job_id, id);",
    ),
    (
        2,
        "ALTER TABLE jobs ADD COLUMN owner_uid INTEGER; ALTER TABLE jobs ADD COLUMN owner_gid INTEGER;",
        "ALTER TABLE jobs ADD COLUMN owner_uid BIGINT; ALTER TABLE jobs ADD COLUMN owner_gid BIGINT;",
    ),
];

/// Columns of a job row, in the order the row mappers read them.
const JOB_COLS: &str = "id, key, name, queue, priority, state, spec, submitted_at_ms, started_at_ms, finished_at_ms, failures, cancel_requested, message, owner_uid, owner_gid";
/// The same without the spec (listings).
const JOB_COLS_NOSPEC: &str = "id, key, name, queue, priority, state, '' AS spec, submitted_at_ms, started_at_ms, finished_at_ms, failures, cancel_requested, message, owner_uid, owner_gid";
const TASK_COLS: &str = "job_id, idx, attempt, state, node, devices, pid, started_at_ms, finished_at_ms, exit_code, dir";

/// The SQL for a listing. Placeholders are numbered in order: the state when filtered, the
/// `before` id when given, then the limit.
fn list_sql(q: &ListQuery) -> String {
    let mut sql = format!("SELECT {JOB_COLS_NOSPEC} FROM jobs");
    let mut conds = Vec::new();
    let mut n = 0;
    if q.state.is_some() {
        n += 1;
        conds.push(format!("state = ${n}"));
    }
    if q.before.is_some() {
        n += 1;
        conds.push(format!("id < ${n}"));
    }
    if !conds.is_empty() {
        sql.push_str(" WHERE ");
        sql.push_str(&conds.join(" AND "));
    }
    n += 1;
    sql.push_str(&format!(" ORDER BY id DESC LIMIT ${n}"));
    sql
}

/// The owner columns of a row: both or neither (a job stored before they existed). An id out
/// of a `u32`'s range is no user: the job has no owner and runs as the daemon's user.
fn owner(uid: Option<i64>, gid: Option<i64>) -> Option<Owner> {
    Some(Owner { uid: u32::try_from(uid?).ok()?, gid: u32::try_from(gid?).ok()? })
}

fn parse_devices(s: &str) -> Result<Vec<u32>> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt(format!("tasks.devices {s:?}: {e}")))
}

fn parse_state<T: FromStr<Err = String>>(s: &str) -> Result<T> {
    s.parse().map_err(StoreError::Corrupt)
}

/// Milliseconds since the Unix epoch.
/// Every state change the daemon records is also a log event (`info`): jobs and tasks with
/// their ids, so `--log-format json` gives one parseable line per change. What is only
/// bookkeeping (a cancel request) is `debug`.
fn trace_write(w: &Write) {
    match w {
        Write::Submit(j) => {
            tracing::debug!(name = %j.name, queue = %j.queue, "storing a submitted job");
        }
        Write::SubmitAll(jobs) => {
            tracing::debug!(jobs = jobs.len(), "storing the jobs of one file");
        }
        Write::RequestCancel { id } => tracing::debug!(job_id = id, "cancel requested"),
        Write::SetJob { id, state, failures, message, .. } => tracing::info!(
            job_id = id,
            state = state.as_str(),
            failures,
            detail = message.as_deref().unwrap_or(""),
            "job state"
        ),
        Write::Task(t) => tracing::info!(
            job_id = t.job_id,
            task = t.idx,
            attempt = t.attempt,
            state = t.state.as_str(),
            pid = t.pid,
            exit_code = t.exit_code,
            devices = ?t.devices,
            "task state"
        ),
        Write::Event { job_id, kind, message, .. } => {
            tracing::info!(job_id, kind = %kind, "{message}");
        }
    }
}

/// A write that failed: `warn`, since a change queued with [`Store::write_later`] has nobody
/// else to tell.
pub(crate) fn trace_failure(e: &StoreError) {
    tracing::warn!(error = %e, "store: a change could not be written");
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
