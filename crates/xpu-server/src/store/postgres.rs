//! The PostgreSQL backend: a writer connection that group-commits batches, a reader connection
//! (tokio-postgres pipelines concurrent queries on it), and [`PgLeader`], the session that holds
//! the scheduling leadership as an advisory lock.
//!
//! Leadership follows PostgreSQL's session-level advisory locks
//! (<https://www.postgresql.org/docs/15/explicit-locking.html#ADVISORY-LOCKS>): the lock is held
//! until the session ends, and a session ends when its daemon dies (the kernel closes the
//! socket), so a follower's next `pg_try_advisory_lock` succeeds.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient, NoTls, Row};

use super::sqlite::{SET_JOB_SQL, UPSERT_TASK_SQL};
use super::{
    ActiveRef, EventRow, JOB_COLS, JobRow, JobState, ListQuery, MIGRATIONS, NewJob, Outcome, Reply,
    Result, StoreError, TASK_COLS, TaskRow, Write, list_sql, parse_devices, parse_state,
};

/// The advisory lock key of scheduling leadership ("xpu" in ASCII).
const LEADER_KEY: i64 = 0x0078_7075;
/// Serialises migrations of daemons starting together.
const MIGRATE_KEY: i64 = 0x0078_7076;

async fn connect(url: &str) -> Result<Client> {
    let (client, conn) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        // The connection ends when the client is dropped or the server goes away; callers see
        // the latter as errors on their next query.
        let _ = conn.await;
    });
    Ok(client)
}

pub(super) struct Pg {
    reader: Arc<Client>,
}

type Params<'a> = Vec<&'a (dyn ToSql + Sync)>;

impl Pg {
    pub(super) async fn open(url: &str, rx: mpsc::Receiver<(Write, Reply)>) -> Result<Pg> {
        let mut writer_client = connect(url).await?;
        migrate(&mut writer_client).await?;
        let reader = connect(url).await?;
        tokio::spawn(writer(url.to_owned(), writer_client, rx));
        Ok(Pg { reader: Arc::new(reader) })
    }

    pub(super) async fn job(&self, id: i64) -> Result<Option<JobRow>> {
        let sql = format!("SELECT {JOB_COLS} FROM jobs WHERE id = $1");
        self.reader.query_opt(&sql, &[&id]).await?.map(|r| job_row(&r)).transpose()
    }

    pub(super) async fn list(&self, q: ListQuery) -> Result<Vec<JobRow>> {
        let sql = list_sql(&q);
        let state = q.state.map(|s| s.as_str().to_owned());
        let limit = i64::from(q.limit);
        let mut p: Params<'_> = Vec::new();
        if let Some(s) = &state {
            p.push(s);
        }
        if let Some(b) = &q.before {
            p.push(b);
        }
        p.push(&limit);
        self.reader.query(&sql, &p).await?.iter().map(job_row).collect()
    }

    pub(super) async fn counts(&self) -> Result<Vec<(JobState, i64)>> {
        let rows =
            self.reader.query("SELECT state, count(*) FROM jobs GROUP BY state", &[]).await?;
        rows.iter()
            .map(|r| Ok((parse_state(r.try_get::<_, &str>(0)?)?, r.try_get::<_, i64>(1)?)))
            .collect()
    }

    pub(super) async fn active(&self) -> Result<Vec<ActiveRef>> {
        let rows = self
            .reader
            .query(
                "SELECT id, state, cancel_requested FROM jobs WHERE state IN ('queued', 'running') ORDER BY id",
                &[],
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ActiveRef {
                    id: r.try_get(0)?,
                    state: parse_state(r.try_get::<_, &str>(1)?)?,
                    cancel_requested: r.try_get::<_, i64>(2)? != 0,
                })
            })
            .collect()
    }

    pub(super) async fn tasks(&self, job_id: Option<i64>) -> Result<Vec<TaskRow>> {
        let rows = match job_id {
            Some(id) => {
                let sql = format!(
                    "SELECT {TASK_COLS} FROM tasks WHERE job_id = $1 ORDER BY idx, attempt"
                );
                self.reader.query(&sql, &[&id]).await?
            }
            None => {
                let sql = format!(
                    "SELECT {TASK_COLS} FROM tasks WHERE state IN ('starting', 'running') ORDER BY job_id, idx, attempt"
                );
                self.reader.query(&sql, &[]).await?
            }
        };
        rows.iter().map(task_row).collect()
    }

    pub(super) async fn events(
        &self,
        after: i64,
        job_id: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        let limit = i64::from(limit);
        let rows = match job_id {
            Some(j) => {
                self.reader
                    .query(
                        "SELECT id, at_ms, job_id, kind, message FROM events WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3",
                        &[&j, &after, &limit],
                    )
                    .await?
            }
            None => {
                self.reader
                    .query(
                        "SELECT id, at_ms, job_id, kind, message FROM events WHERE id > $1 ORDER BY id LIMIT $2",
                        &[&after, &limit],
                    )
                    .await?
            }
        };
        rows.iter()
            .map(|r| {
                Ok(EventRow {
                    id: r.try_get(0)?,
                    at_ms: r.try_get(1)?,
                    job_id: r.try_get(2)?,
                    kind: r.try_get(3)?,
                    message: r.try_get(4)?,
                })
            })
            .collect()
    }
}

fn job_row(r: &Row) -> Result<JobRow> {
    Ok(JobRow {
        id: r.try_get(0)?,
        key: r.try_get(1)?,
        name: r.try_get(2)?,
        queue: r.try_get(3)?,
        priority: r.try_get(4)?,
        state: parse_state(r.try_get::<_, &str>(5)?)?,
        spec: r.try_get(6)?,
        submitted_at_ms: r.try_get(7)?,
        started_at_ms: r.try_get(8)?,
        finished_at_ms: r.try_get(9)?,
        failures: r.try_get(10)?,
        cancel_requested: r.try_get::<_, i64>(11)? != 0,
        message: r.try_get(12)?,
        owner: super::owner(r.try_get(13)?, r.try_get(14)?),
    })
}

fn task_row(r: &Row) -> Result<TaskRow> {
    Ok(TaskRow {
        job_id: r.try_get(0)?,
        idx: r.try_get(1)?,
        attempt: r.try_get(2)?,
        state: parse_state(r.try_get::<_, &str>(3)?)?,
        node: r.try_get(4)?,
        devices: parse_devices(r.try_get::<_, &str>(5)?)?,
        pid: r.try_get(6)?,
        started_at_ms: r.try_get(7)?,
        finished_at_ms: r.try_get(8)?,
        exit_code: r.try_get(9)?,
        dir: r.try_get(10)?,
    })
}

async fn migrate(client: &mut Client) -> Result<()> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATE_KEY]).await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS xpu_schema (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL)",
    )
    .await?;
    let have: i64 = tx
        .query_one("SELECT COALESCE(MAX(version), 0)::BIGINT FROM xpu_schema", &[])
        .await?
        .try_get(0)?;
    for (version, _, sql) in MIGRATIONS {
        if *version > have {
            tx.batch_execute(sql).await?;
            tx.execute(
                "INSERT INTO xpu_schema (version, applied_at_ms) VALUES ($1, $2)",
                &[version, &super::now_ms()],
            )
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// The group-commit loop (see [`super::sqlite`]'s), reconnecting when the server went away.
async fn writer(url: String, mut client: Client, mut rx: mpsc::Receiver<(Write, Reply)>) {
    let mut batch = Vec::with_capacity(1024);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < 1024 {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        if client.is_closed()
            && let Ok(c) = connect(&url).await
        {
            client = c;
        }
        match apply_batch(&mut client, &batch).await {
            Ok(outcomes) => {
                for ((_, reply), out) in batch.drain(..).zip(outcomes) {
                    if let Err(e) = &out {
                        super::trace_failure(e);
                    }
                    // The caller may have gone (write_later never waits): logged above.
                    let _ = reply.send(out);
                }
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::error!(error = %msg, changes = batch.len(), "store: a commit failed; its changes are lost");
                for (_, reply) in batch.drain(..) {
                    let _ = reply.send(Err(StoreError::Corrupt(format!("commit failed: {msg}"))));
                }
            }
        }
    }
}

async fn apply_batch(
    client: &mut Client,
    batch: &[(Write, Reply)],
) -> Result<Vec<Result<Outcome>>> {
    let mut tx = client.transaction().await?;
    let mut out = Vec::with_capacity(batch.len());
    for (w, _) in batch {
        let sp = tx.savepoint("w").await?;
        match apply(&sp, w).await {
            Ok(o) => {
                sp.commit().await?;
                out.push(Ok(o));
            }
            Err(e) => {
                sp.rollback().await?;
                out.push(Err(e));
            }
        }
    }
    tx.commit().await?;
    Ok(out)
}

async fn apply(c: &impl GenericClient, w: &Write) -> Result<Outcome> {
    match w {
        Write::Submit(j) => {
            let (id, created) = submit(c, j).await?;
            Ok(Outcome::Submitted { id, created })
        }
        Write::SubmitAll(jobs) => {
            let mut ids = Vec::with_capacity(jobs.len());
            for j in jobs {
                ids.push(submit(c, j).await?);
            }
            Ok(Outcome::SubmittedAll(ids))
        }
        Write::RequestCancel { id } => {
            let row = c.query_opt("SELECT state FROM jobs WHERE id = $1", &[id]).await?;
            let Some(row) = row else { return Ok(Outcome::CancelRequested(None)) };
            let state: JobState = parse_state(row.try_get::<_, &str>(0)?)?;
            if !state.is_terminal() {
                c.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = $1", &[id]).await?;
            }
            Ok(Outcome::CancelRequested(Some(state)))
        }
        Write::SetJob { id, state, at_ms, failures, message } => {
            c.execute(SET_JOB_SQL, &[id, &state.as_str(), failures, message, at_ms]).await?;
            Ok(Outcome::Done)
        }
        Write::Task(t) => {
            let devices = serde_json::to_string(&t.devices)
                .map_err(|e| StoreError::Corrupt(format!("devices: {e}")))?;
            c.execute(
                UPSERT_TASK_SQL,
                &[
                    &t.job_id,
                    &t.idx,
                    &t.attempt,
                    &t.state.as_str(),
                    &t.node,
                    &devices,
                    &t.pid,
                    &t.started_at_ms,
                    &t.finished_at_ms,
                    &t.exit_code,
                    &t.dir,
                ],
            )
            .await?;
            Ok(Outcome::Done)
        }
        Write::Event { at_ms, job_id, kind, message } => {
            c.execute(
                "INSERT INTO events (at_ms, job_id, kind, message) VALUES ($1, $2, $3, $4)",
                &[at_ms, job_id, kind, message],
            )
            .await?;
            Ok(Outcome::Done)
        }
    }
}

/// A dedicated session that tries to hold the leadership lock.
pub struct PgLeader {
    url: String,
    client: Option<Client>,
}

impl PgLeader {
    pub fn new(url: &str) -> PgLeader {
        PgLeader { url: url.to_owned(), client: None }
    }

    /// True when this daemon holds leadership after the call. Holding is re-checked cheaply:
    /// the lock lives as long as the session, so a live session that once won still holds it.
    pub async fn try_acquire(&mut self) -> bool {
        if let Some(c) = &self.client
            && !c.is_closed()
            && c.simple_query("SELECT 1").await.is_ok()
        {
            return true;
        }
        self.client = None;
        let Ok(c) = connect(&self.url).await else { return false };
        match c.query_one("SELECT pg_try_advisory_lock($1)", &[&LEADER_KEY]).await {
            Ok(row) if row.try_get::<_, bool>(0).unwrap_or(false) => {
                self.client = Some(c);
                true
            }
            _ => false,
        }
    }
}

/// Inserts one job unless its idempotency key is taken: its id, and whether it is new.
async fn submit(c: &impl GenericClient, j: &NewJob) -> Result<(i64, bool)> {
    let row = c
        .query_opt(
            "INSERT INTO jobs (key, name, queue, priority, state, spec, submitted_at_ms, owner_uid, owner_gid) VALUES ($1, $2, $3, $4, 'queued', $5, $6, $7, $8) ON CONFLICT (key) DO NOTHING RETURNING id",
            &[
                &j.key,
                &j.name,
                &j.queue,
                &j.priority,
                &j.spec,
                &j.at_ms,
                &i64::from(j.owner.uid),
                &i64::from(j.owner.gid),
            ],
        )
        .await?;
    match row {
        Some(r) => {
            let id: i64 = r.try_get(0)?;
            let msg = format!("job {id} ({}) queued in {}", j.name, j.queue);
            c.execute(
                "INSERT INTO events (at_ms, job_id, kind, message) VALUES ($1, $2, 'submitted', $3)",
                &[&j.at_ms, &id, &msg],
            )
            .await?;
            Ok((id, true))
        }
        None => {
            let id: i64 =
                c.query_one("SELECT id FROM jobs WHERE key = $1", &[&j.key]).await?.try_get(0)?;
            Ok((id, false))
        }
    }
}
