//! The SQLite backend: one writer thread that group-commits batches (WAL, `synchronous=FULL`),
//! and a small pool of reader connections used from blocking tasks (WAL lets them read while
//! the writer commits).

use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension, Row, params};
use tokio::sync::mpsc;

use super::{
    ActiveRef, EventRow, JOB_COLS, JobRow, JobState, ListQuery, MIGRATIONS, NewJob, Outcome, Reply,
    Result, StoreError, TASK_COLS, TaskRow, Write, list_sql, parse_devices, parse_state,
};

/// Converts the shared `$n` placeholders to SQLite's `?n`.
fn q(sql: &str) -> String {
    sql.replace('$', "?")
}

pub(super) struct Sqlite {
    path: String,
    readers: Arc<Mutex<Vec<Connection>>>,
}

fn connect(path: &str) -> Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(std::time::Duration::from_secs(10))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // FULL: the WAL is synced at every commit, so an acknowledged change survives power loss,
    // not only a process crash.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    Ok(conn)
}

/// Creates the database file, readable by the daemon's user only, unless it exists: it holds
/// every job's manifest and environment, and SQLite gives the WAL and shared-memory files it
/// creates next to it the same mode.
fn create_private(path: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if path == ":memory:" || path.starts_with("file:") {
        return Ok(());
    }
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(StoreError::Io { path: path.to_owned(), error: source }),
    }
}

/// The file that records that a store was created at `path` (`xpu.db.created` next to
/// `xpu.db`): a store that is later missing, empty or not a database is then refused instead of
/// being started afresh, which would count job ids from 1 again and mix new jobs with old ones.
pub(super) fn marker_path(path: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("{path}.created"))
}

/// Refuses a store that cannot be trusted, before anything writes to it: one that was created
/// (its marker is there) and is now missing or holds no xpu tables (truncated to 0 bytes,
/// replaced), and one that is not a database or fails SQLite's `PRAGMA quick_check`
/// (<https://sqlite.org/pragma.html#pragma_quick_check>). Each message names the file and what
/// to do.
fn check_existing(path: &str) -> Result<()> {
    if path == ":memory:" || path.starts_with("file:") {
        return Ok(());
    }
    let marker = marker_path(path);
    let created = std::fs::symlink_metadata(&marker).is_ok();
    let restore = |what: &str| {
        StoreError::Corrupt(format!(
            "store {path} {what}, but {} records that a store was created there: restore {path} from a backup (with its -wal file, if any), or, to start a new store with job ids from 1, remove {0} first",
            marker.display()
        ))
    };
    match std::fs::metadata(path) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return if created { Err(restore("is missing")) } else { Ok(()) };
        }
        Err(source) => return Err(StoreError::Io { path: path.to_owned(), error: source }),
    }
    let damaged = |why: String| {
        StoreError::Corrupt(format!(
            "store {path} is damaged ({why}): restore it from a backup, or salvage what is left with `sqlite3 {path} .recover`; xpu serve does not start on a damaged store"
        ))
    };
    // Opened without setting anything: reading a 0-byte file leaves it as it is.
    let conn = Connection::open(path)?;
    let problems: Vec<String> = conn
        .prepare("PRAGMA quick_check(5)")
        .and_then(|mut st| st.query_map([], |r| r.get::<_, String>(0))?.collect())
        .map_err(|e| damaged(e.to_string()))?;
    if problems != ["ok"] {
        return Err(damaged(format!("quick_check: {}", problems.join("; "))));
    }
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'xpu_schema'",
            [],
            |r| r.get(0),
        )
        .map_err(|e| damaged(e.to_string()))?;
    if tables == 0 && created {
        return Err(restore("is empty"));
    }
    Ok(())
}

/// Writes the marker of [`marker_path`] once the store has its tables.
fn mark_created(path: &str) -> Result<()> {
    if path == ":memory:" || path.starts_with("file:") {
        return Ok(());
    }
    let marker = marker_path(path);
    if marker.exists() {
        return Ok(());
    }
    let text = format!(
        "xpu serve created the store {path} at {} ms since the epoch; remove this file only to start a new store\n",
        super::now_ms()
    );
    let write = || {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&marker)?;
        std::io::Write::write_all(&mut f, text.as_bytes())
    };
    write().map_err(|source| StoreError::Io { path: marker.display().to_string(), error: source })
}

impl Sqlite {
    pub(super) fn open(path: &str, rx: mpsc::Receiver<(Write, Reply)>) -> Result<Sqlite> {
        if let Some(dir) = std::path::Path::new(path).parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
                path: dir.display().to_string(),
                error: source,
            })?;
        }
        check_existing(path)?;
        create_private(path)?;
        let mut conn = connect(path)?;
        migrate(&mut conn)?;
        mark_created(path)?;
        std::thread::Builder::new()
            .name("xpu-store-writer".to_owned())
            .spawn(move || writer(conn, rx))
            .map_err(|source| StoreError::Io { path: path.to_owned(), error: source })?;
        Ok(Sqlite { path: path.to_owned(), readers: Arc::new(Mutex::new(Vec::new())) })
    }

    /// Runs `f` on a pooled reader connection in a blocking task.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let pool = self.readers.clone();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let taken = pool.lock().ok().and_then(|mut p| p.pop());
            let conn = match taken {
                Some(c) => c,
                None => connect(&path)?,
            };
            let out = f(&conn);
            if let Ok(mut p) = pool.lock()
                && p.len() < 8
            {
                p.push(conn);
            }
            out
        })
        .await
        .map_err(|e| StoreError::Corrupt(format!("reader task failed: {e}")))?
    }

    /// Moves everything in the WAL into the database file and empties the WAL.
    pub(super) async fn checkpoint(&self) -> Result<()> {
        self.read(|c| {
            c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
            Ok(())
        })
        .await
    }

    pub(super) async fn job(&self, id: i64) -> Result<Option<JobRow>> {
        self.read(move |c| {
            let sql = format!("SELECT {JOB_COLS} FROM jobs WHERE id = ?1");
            c.prepare_cached(&sql)?.query_row([id], |r| Ok(job_row(r))).optional()?.transpose()
        })
        .await
    }

    pub(super) async fn list(&self, query: ListQuery) -> Result<Vec<JobRow>> {
        self.read(move |c| {
            let sql = q(&list_sql(&query));
            let mut stmt = c.prepare_cached(&sql)?;
            let mut p: Vec<rusqlite::types::Value> = Vec::new();
            if let Some(s) = query.state {
                p.push(s.as_str().to_owned().into());
            }
            if let Some(b) = query.before {
                p.push(b.into());
            }
            p.push(i64::from(query.limit).into());
            let rows = stmt.query_map(rusqlite::params_from_iter(p), |r| Ok(job_row(r)))?;
            rows.map(|r| r?).collect()
        })
        .await
    }

    pub(super) async fn counts(&self) -> Result<Vec<(JobState, i64)>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached("SELECT state, count(*) FROM jobs GROUP BY state")?;
            let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            rows.map(|r| {
                let (s, n) = r?;
                Ok((parse_state(&s)?, n))
            })
            .collect()
        })
        .await
    }

    pub(super) async fn active(&self) -> Result<Vec<ActiveRef>> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(
                "SELECT id, state, cancel_requested FROM jobs WHERE state IN ('queued', 'running') ORDER BY id",
            )?;
            let rows = stmt.query_map([], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))
            })?;
            rows.map(|r| {
                let (id, s, c) = r?;
                Ok(ActiveRef { id, state: parse_state(&s)?, cancel_requested: c != 0 })
            })
            .collect()
        })
        .await
    }

    pub(super) async fn tasks(&self, job_id: Option<i64>) -> Result<Vec<TaskRow>> {
        self.read(move |c| {
            let (sql, p): (String, Vec<i64>) = match job_id {
                Some(id) => (
                    format!("SELECT {TASK_COLS} FROM tasks WHERE job_id = ?1 ORDER BY idx, attempt"),
                    vec![id],
                ),
                None => (
                    format!(
                        "SELECT {TASK_COLS} FROM tasks WHERE state IN ('starting', 'running') ORDER BY job_id, idx, attempt"
                    ),
                    vec![],
                ),
            };
            let mut stmt = c.prepare_cached(&sql)?;
            let rows = stmt.query_map(rusqlite::params_from_iter(p), |r| Ok(task_row(r)))?;
            rows.map(|r| r?).collect()
        })
        .await
    }

    pub(super) async fn events(
        &self,
        after: i64,
        job_id: Option<i64>,
        limit: u32,
    ) -> Result<Vec<EventRow>> {
        self.read(move |c| {
            let map = |r: &Row<'_>| -> rusqlite::Result<EventRow> {
                Ok(EventRow {
                    id: r.get(0)?,
                    at_ms: r.get(1)?,
                    job_id: r.get(2)?,
                    kind: r.get(3)?,
                    message: r.get(4)?,
                })
            };
            let out = match job_id {
                Some(j) => c
                    .prepare_cached(
                        "SELECT id, at_ms, job_id, kind, message FROM events WHERE job_id = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
                    )?
                    .query_map(params![j, after, i64::from(limit)], map)?
                    .collect::<rusqlite::Result<Vec<_>>>()?,
                None => c
                    .prepare_cached(
                        "SELECT id, at_ms, job_id, kind, message FROM events WHERE id > ?1 ORDER BY id LIMIT ?2",
                    )?
                    .query_map(params![after, i64::from(limit)], map)?
                    .collect::<rusqlite::Result<Vec<_>>>()?,
            };
            Ok(out)
        })
        .await
    }
}

fn job_row(r: &Row<'_>) -> Result<JobRow> {
    let state: String = r.get(5)?;
    Ok(JobRow {
        id: r.get(0)?,
        key: r.get(1)?,
        name: r.get(2)?,
        queue: r.get(3)?,
        priority: r.get(4)?,
        state: parse_state(&state)?,
        spec: r.get(6)?,
        submitted_at_ms: r.get(7)?,
        started_at_ms: r.get(8)?,
        finished_at_ms: r.get(9)?,
        failures: r.get(10)?,
        cancel_requested: r.get::<_, i64>(11)? != 0,
        message: r.get(12)?,
        owner: super::owner(r.get(13)?, r.get(14)?),
    })
}

fn task_row(r: &Row<'_>) -> Result<TaskRow> {
    let state: String = r.get(3)?;
    let devices: String = r.get(5)?;
    Ok(TaskRow {
        job_id: r.get(0)?,
        idx: r.get(1)?,
        attempt: r.get(2)?,
        state: parse_state(&state)?,
        node: r.get(4)?,
        devices: parse_devices(&devices)?,
        pid: r.get(6)?,
        started_at_ms: r.get(7)?,
        finished_at_ms: r.get(8)?,
        exit_code: r.get(9)?,
        dir: r.get(10)?,
    })
}

fn migrate(conn: &mut Connection) -> Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS xpu_schema (version INTEGER PRIMARY KEY, applied_at_ms INTEGER NOT NULL)",
    )?;
    let have: i64 =
        tx.query_row("SELECT COALESCE(MAX(version), 0) FROM xpu_schema", [], |r| r.get(0))?;
    for (version, sql, _) in MIGRATIONS {
        if *version > have {
            tx.execute_batch(sql)?;
            tx.execute(
                "INSERT INTO xpu_schema (version, applied_at_ms) VALUES (?1, ?2)",
                params![version, super::now_ms()],
            )?;
        }
    }
    tx.commit()?;
    Ok(())
}

/// The group-commit loop: takes everything waiting (up to a bound), applies it in one
/// transaction, and answers each request after the commit.
fn writer(mut conn: Connection, mut rx: mpsc::Receiver<(Write, Reply)>) {
    let mut batch = Vec::with_capacity(1024);
    while let Some(first) = rx.blocking_recv() {
        batch.push(first);
        while batch.len() < 1024 {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let results = apply_batch(&mut conn, &batch);
        match results {
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

fn apply_batch(conn: &mut Connection, batch: &[(Write, Reply)]) -> Result<Vec<Result<Outcome>>> {
    let mut tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let mut out = Vec::with_capacity(batch.len());
    for (w, _) in batch {
        let mut sp = tx.savepoint()?;
        match apply(&sp, w) {
            Ok(o) => {
                sp.commit()?;
                out.push(Ok(o));
            }
            Err(e) => {
                sp.rollback()?;
                drop(sp);
                out.push(Err(e));
            }
        }
    }
    tx.commit()?;
    Ok(out)
}

fn apply(c: &Connection, w: &Write) -> Result<Outcome> {
    match w {
        Write::Submit(j) => {
            let (id, created) = submit(c, j)?;
            Ok(Outcome::Submitted { id, created })
        }
        Write::SubmitAll(jobs) => {
            let ids = jobs.iter().map(|j| submit(c, j)).collect::<Result<Vec<_>>>()?;
            Ok(Outcome::SubmittedAll(ids))
        }
        Write::RequestCancel { id } => {
            let state: Option<String> = c
                .prepare_cached("SELECT state FROM jobs WHERE id = ?1")?
                .query_row([id], |r| r.get(0))
                .optional()?;
            let Some(state) = state else { return Ok(Outcome::CancelRequested(None)) };
            let state: JobState = parse_state(&state)?;
            if !state.is_terminal() {
                c.prepare_cached("UPDATE jobs SET cancel_requested = 1 WHERE id = ?1")?
                    .execute([id])?;
            }
            Ok(Outcome::CancelRequested(Some(state)))
        }
        Write::SetJob { id, state, at_ms, failures, message } => {
            c.prepare_cached(&q(SET_JOB_SQL))?.execute(params![
                id,
                state.as_str(),
                failures,
                message,
                at_ms
            ])?;
            Ok(Outcome::Done)
        }
        Write::Task(t) => {
            let devices = serde_json::to_string(&t.devices)
                .map_err(|e| StoreError::Corrupt(format!("devices: {e}")))?;
            c.prepare_cached(&q(UPSERT_TASK_SQL))?.execute(params![
                t.job_id,
                t.idx,
                t.attempt,
                t.state.as_str(),
                t.node,
                devices,
                t.pid,
                t.started_at_ms,
                t.finished_at_ms,
                t.exit_code,
                t.dir
            ])?;
            Ok(Outcome::Done)
        }
        Write::Event { at_ms, job_id, kind, message } => {
            c.prepare_cached(
                "INSERT INTO events (at_ms, job_id, kind, message) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![at_ms, job_id, kind, message])?;
            Ok(Outcome::Done)
        }
    }
}

/// `$1` id, `$2` state, `$3` failures, `$4` message (NULL keeps it), `$5` time.
pub(super) const SET_JOB_SQL: &str = "UPDATE jobs SET state = $2, failures = $3, message = COALESCE($4, message), \
     started_at_ms = CASE WHEN $2 = 'running' AND started_at_ms IS NULL THEN $5 ELSE started_at_ms END, \
     finished_at_ms = CASE WHEN $2 IN ('succeeded', 'failed', 'cancelled') THEN $5 ELSE finished_at_ms END, \
     cancel_requested = CASE WHEN $2 IN ('succeeded', 'failed', 'cancelled') THEN 0 ELSE cancel_requested END \
     WHERE id = $1";

pub(super) const UPSERT_TASK_SQL: &str = "INSERT INTO tasks (job_id, idx, attempt, state, node, devices, pid, started_at_ms, finished_at_ms, exit_code, dir) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
     ON CONFLICT (job_id, idx, attempt) DO UPDATE SET state = excluded.state, node = excluded.node, \
     devices = excluded.devices, pid = excluded.pid, finished_at_ms = excluded.finished_at_ms, \
     exit_code = excluded.exit_code, dir = excluded.dir";

/// Inserts one job unless its idempotency key is taken: its id, and whether it is new.
fn submit(c: &Connection, j: &NewJob) -> Result<(i64, bool)> {
    let id: Option<i64> = c
        .prepare_cached(
            "INSERT INTO jobs (key, name, queue, priority, state, spec, submitted_at_ms, owner_uid, owner_gid) VALUES (?1, ?2, ?3, ?4, 'queued', ?5, ?6, ?7, ?8) ON CONFLICT (key) DO NOTHING RETURNING id",
        )?
        .query_row(
            params![j.key, j.name, j.queue, j.priority, j.spec, j.at_ms, j.owner.uid, j.owner.gid],
            |r| r.get(0),
        )
        .optional()?;
    match id {
        Some(id) => {
            c.prepare_cached(
                "INSERT INTO events (at_ms, job_id, kind, message) VALUES (?1, ?2, 'submitted', ?3)",
            )?
            .execute(params![j.at_ms, id, format!("job {id} ({}) queued in {}", j.name, j.queue)])?;
            Ok((id, true))
        }
        None => {
            let id: i64 = c
                .prepare_cached("SELECT id FROM jobs WHERE key = ?1")?
                .query_row([&j.key], |r| r.get(0))?;
            Ok((id, false))
        }
    }
}
