//! The embedded SQLite store, for a single instance: no database server to install, the data in
//! one file. It keeps the same contract as the PostgreSQL store with SQLite's own means:
//!
//! - **One writer.** Every change runs in a `BEGIN IMMEDIATE` transaction on the one writer
//!   connection, so it holds the database's write lock from its first read to its commit: the
//!   read, the decision (the domain's own functions, [`claim_action`] and friends) and the write
//!   are atomic, and concurrent callers are served one after another. Reads (Lookup, health)
//!   use a pool of their own and never wait for the writer (WAL mode).
//! - **One clock.** Instants come from SQLite's clock (`julianday('now')`, millisecond
//!   resolution), read inside the write transaction, once the lock is held.
//! - **Durability.** `synchronous = FULL`: a completion that was acknowledged survives a power
//!   loss, not only a crash of the process.
//! - **Bounded waits**, shared out like PostgreSQL's ([`Budget`]): the wait for the writer,
//!   then `busy_timeout`; a write whose operation has used up both by its commit is rolled back
//!   instead, so a timeout leaves nothing written.
//!
//! Several processes on one file would each believe they are the only writer of their own
//! pool; the store is for one instance only (PostgreSQL is the store for replicas).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{FromRow, SqliteConnection, SqlitePool};

use super::{Budget, Store, StoreError};
use crate::domain::{
    ClaimAction, CompleteCommand, Completion, ExtendLeaseCommand, GuardedKey, Instant, KeyRecord,
    KeyState, LeaseToken, LookupQuery, MarkProcessedCommand, ProcessedEvent, Rejection,
    ReleaseCommand, TryStartCommand, TryStartOutcome, claim_action, claimed_record,
    classify_refusal,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// Where the embedded store keeps its data when nothing else is configured.
pub const DEFAULT_PATH: &str = "./data/coordinator.db";

#[derive(Debug, Clone)]
pub struct SqliteSettings {
    pub path: PathBuf,
    /// Connections for reads; writes always go through the one writer.
    pub pool_size: u32,
    /// The budget of one operation, shared out by [`Budget`].
    pub operation_timeout: Duration,
}

#[derive(Clone)]
pub struct SqliteStore {
    writer: SqlitePool,
    readers: SqlitePool,
    /// One reader of its own for health probes, so that reads keeping the pool busy do not look
    /// like an unreachable file.
    probe_reader: SqlitePool,
    operation_timeout: Duration,
    /// Set once the schema is known to be current, so that an operation on an unmigrated file
    /// is told apart from other failures without reading error texts.
    schema_ready: Arc<AtomicBool>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").finish_non_exhaustive()
    }
}

/// Now, from SQLite's clock, in whole microseconds (SQLite reads the clock to the millisecond;
/// `julianday` works on every SQLite version, unlike `unixepoch('subsec')`).
macro_rules! now_us {
    () => {
        "(CAST(round((julianday('now') - 2440587.5) * 86400000) AS INTEGER) * 1000)"
    };
}

impl SqliteStore {
    /// Prepares the pools without opening the file; the folder is created if missing, the file
    /// when the writer first connects.
    pub fn open_lazy(settings: &SqliteSettings) -> Result<Self, std::io::Error> {
        if let Some(folder) = settings.path.parent()
            && !folder.as_os_str().is_empty()
        {
            std::fs::create_dir_all(folder)?;
        }
        let budget = Budget::of(settings.operation_timeout);
        let options = SqliteConnectOptions::new()
            .filename(&settings.path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(budget.statement);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(options.clone().create_if_missing(true));
        let readers = SqlitePoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(options.clone());
        let probe_reader = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(options);
        Ok(Self {
            writer,
            readers,
            probe_reader,
            operation_timeout: settings.operation_timeout,
            schema_ready: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The file a `sqlite://` URL names (`sqlite://./data/x.db`, `sqlite:///var/lib/x.db`).
    /// Options after `?` and in-memory databases are refused: the service's settings say how it
    /// opens the file, and its data must outlive the process.
    pub fn path_from_url(url: &str) -> Result<PathBuf, String> {
        let path = url.strip_prefix("sqlite://").unwrap_or(url);
        if path.is_empty() {
            return Err(
                "a sqlite:// URL needs a file path, e.g. sqlite://./data/coordinator.db".into(),
            );
        }
        if path.contains('?') {
            return Err("a sqlite:// URL takes a file path only, without ?options".into());
        }
        if path == ":memory:" || path.starts_with("file:") {
            return Err("the embedded store needs a file: its data must survive a restart".into());
        }
        Ok(PathBuf::from(path))
    }

    /// Fails with [`StoreError::NotMigrated`] until the schema has been seen current.
    async fn ensure_schema(&self) -> Result<(), StoreError> {
        if self.schema_ready.load(Ordering::Acquire) {
            return Ok(());
        }
        self.probe().await
    }

    /// Takes the write lock for one operation, which must commit within its budget.
    async fn begin_write(&self) -> Result<Write, StoreError> {
        let budget = Budget::of(self.operation_timeout);
        let deadline = tokio::time::Instant::now() + budget.connection_wait + budget.statement;
        self.ensure_schema().await?;
        let tx = self
            .writer
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(classify)?;
        Ok(Write {
            tx,
            deadline,
            budget: self.operation_timeout,
        })
    }

    /// Deletes at most `limit` rows that `sql` selects as expired, in one statement on the
    /// writer (so it runs between writes, never inside one).
    async fn reap(&self, sql: &'static str, limit: u32) -> Result<u64, StoreError> {
        self.ensure_schema().await?;
        let deleted = sqlx::query(sql)
            .bind(i64::from(limit))
            .execute(&self.writer)
            .await
            .map_err(classify)?;
        Ok(deleted.rows_affected())
    }
}

/// A write transaction and the deadline of its operation.
struct Write {
    tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    deadline: tokio::time::Instant,
    budget: Duration,
}

impl Write {
    /// Commits, unless the operation ran out of time on the way: then it rolls back and says
    /// so, because an answer of UNAVAILABLE must mean that nothing was written.
    async fn commit(self) -> Result<(), StoreError> {
        if tokio::time::Instant::now() > self.deadline {
            self.tx.rollback().await.map_err(classify)?;
            return Err(StoreError::TimedOut(self.budget));
        }
        self.tx.commit().await.map_err(classify)
    }
}

/// Sorts a driver error by SQLite's result code (never by message text).
fn classify(error: sqlx::Error) -> StoreError {
    let unavailable = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let code: i32 = db.code().and_then(|c| c.parse().ok()).unwrap_or(0);
            // The primary code is the low byte of an extended one. BUSY, LOCKED, NOMEM,
            // READONLY, IOERR, FULL, CANTOPEN, PROTOCOL: the file is busy or unreachable.
            matches!(code & 0xff, 5 | 6 | 7 | 8 | 10 | 13 | 14 | 15)
        }
        _ => false,
    };
    if unavailable {
        StoreError::Unavailable(error)
    } else {
        StoreError::Internal(error)
    }
}

fn instant(micros: i64) -> Instant {
    DateTime::from_timestamp_micros(micros).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

fn micros(instant: Instant) -> i64 {
    instant.timestamp_micros()
}

fn duration_micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

async fn now(connection: &mut SqliteConnection) -> Result<Instant, StoreError> {
    let (now,): (i64,) = sqlx::query_as(concat!("SELECT ", now_us!()))
        .fetch_one(connection)
        .await
        .map_err(classify)?;
    Ok(instant(now))
}

#[derive(FromRow)]
struct KeyRow {
    fingerprint: Vec<u8>,
    lease_token: i64,
    attempt: i64,
    attempt_id: Option<String>,
    lease_expires_at: i64,
    checkpoint: Option<Vec<u8>>,
    response: Option<Vec<u8>>,
    completed_at: Option<i64>,
    retention_us: i64,
    expires_at: i64,
}

impl From<KeyRow> for KeyRecord {
    fn from(row: KeyRow) -> Self {
        Self {
            fingerprint: row.fingerprint,
            lease_token: LeaseToken::from_stored(row.lease_token),
            attempt: u32::try_from(row.attempt).unwrap_or(0),
            attempt_id: row.attempt_id,
            lease_expires_at: instant(row.lease_expires_at),
            checkpoint: row.checkpoint,
            response: row.response,
            completed_at: row.completed_at.map(instant),
            retention: Duration::from_micros(row.retention_us.unsigned_abs()),
            expires_at: instant(row.expires_at),
        }
    }
}

macro_rules! select_key {
    () => {
        "SELECT fingerprint, lease_token, attempt, attempt_id, lease_expires_at, checkpoint,
                response, completed_at, retention_us, expires_at
         FROM idempotency_keys
         WHERE namespace = ?1 AND key = ?2"
    };
}

const SELECT_KEY: &str = select_key!();

/// A key's row if it is live by SQLite's clock at the moment of the read.
const LOOKUP_LIVE_KEY: &str = concat!(select_key!(), " AND expires_at > ", now_us!());

/// Writes a key's whole state, replacing whatever row (live or expired) the key had.
const UPSERT_KEY: &str = "
INSERT INTO idempotency_keys
    (namespace, key, fingerprint, lease_token, attempt, attempt_id, lease_expires_at,
     checkpoint, response, completed_at, retention_us, expires_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
ON CONFLICT (namespace, key) DO UPDATE SET
    fingerprint = excluded.fingerprint, lease_token = excluded.lease_token,
    attempt = excluded.attempt, attempt_id = excluded.attempt_id,
    lease_expires_at = excluded.lease_expires_at, checkpoint = excluded.checkpoint,
    response = excluded.response, completed_at = excluded.completed_at,
    retention_us = excluded.retention_us, expires_at = excluded.expires_at";

const NEXT_TOKEN: &str = "UPDATE lease_token_seq SET last_value = last_value + 1 WHERE only_row = 1 RETURNING last_value";

async fn select_key(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
) -> Result<Option<KeyRecord>, StoreError> {
    let row: Option<KeyRow> = sqlx::query_as(SELECT_KEY)
        .bind(namespace)
        .bind(key)
        .fetch_optional(connection)
        .await
        .map_err(classify)?;
    Ok(row.map(KeyRecord::from))
}

async fn write_key(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
    record: &KeyRecord,
) -> Result<(), StoreError> {
    sqlx::query(UPSERT_KEY)
        .bind(namespace)
        .bind(key)
        .bind(&record.fingerprint)
        .bind(record.lease_token.get())
        .bind(i64::from(record.attempt))
        .bind(record.attempt_id.as_deref())
        .bind(micros(record.lease_expires_at))
        .bind(record.checkpoint.as_deref())
        .bind(record.response.as_deref())
        .bind(record.completed_at.map(micros))
        .bind(duration_micros(record.retention))
        .bind(micros(record.expires_at))
        .execute(connection)
        .await
        .map_err(classify)?;
    Ok(())
}

/// The key's record and the verdict of a guarded write on it, inside a write transaction.
struct Guard {
    now: Instant,
    record: Option<KeyRecord>,
    /// `Ok(None)`: the caller holds the in-progress key, the write applies.
    verdict: Result<Option<Completion>, Rejection>,
}

async fn judge(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
    token: LeaseToken,
    offered_response: Option<&[u8]>,
) -> Result<Guard, StoreError> {
    let now = now(&mut *connection).await?;
    let record = select_key(&mut *connection, namespace, key).await?;
    let verdict = classify_refusal(
        GuardedKey::judge(record.as_ref(), now, offered_response),
        token,
    );
    Ok(Guard {
        now,
        record,
        verdict,
    })
}

fn plus(instant: Instant, duration: Duration) -> Instant {
    chrono::Duration::from_std(duration)
        .ok()
        .and_then(|d| instant.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

const REAP_KEYS: &str = concat!(
    "DELETE FROM idempotency_keys WHERE rowid IN (
         SELECT rowid FROM idempotency_keys WHERE expires_at <= ",
    now_us!(),
    " ORDER BY expires_at LIMIT ?1)"
);

const REAP_EVENTS: &str = concat!(
    "DELETE FROM processed_events WHERE (consumer, event_id) IN (
         SELECT consumer, event_id FROM processed_events WHERE expires_at <= ",
    now_us!(),
    " ORDER BY expires_at LIMIT ?1)"
);

#[derive(FromRow)]
struct EventRow {
    processed_at: i64,
    expires_at: i64,
}

/// TryStart inside a write transaction, at `now`.
async fn claim_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &TryStartCommand,
) -> Result<TryStartOutcome, StoreError> {
    let namespace = command.namespace.as_str();
    let key = command.key.as_str();
    let existing = select_key(tx, namespace, key).await?;
    let action = claim_action(existing.as_ref(), now, command);
    let newly_claimed = matches!(action, ClaimAction::Fresh | ClaimAction::Takeover);
    let record = match (action, existing) {
        (ClaimAction::Answer, Some(unchanged)) => unchanged,
        (ClaimAction::Reenter, Some(held)) => {
            let token = held.lease_token;
            let renewed = claimed_record(Some(held), action, now, command, token)
                .ok_or(StoreError::Inconsistent("re-entry produced no key"))?;
            write_key(tx, namespace, key, &renewed).await?;
            renewed
        }
        (_, existing) => {
            let (token,): (i64,) = sqlx::query_as(NEXT_TOKEN)
                .fetch_one(&mut *tx)
                .await
                .map_err(classify)?;
            let claimed = claimed_record(
                existing,
                action,
                now,
                command,
                LeaseToken::from_stored(token),
            )
            .ok_or(StoreError::Inconsistent("a claim produced no key"))?;
            write_key(tx, namespace, key, &claimed).await?;
            claimed
        }
    };
    Ok(TryStartOutcome::from_record(record, newly_claimed, command))
}

/// Complete inside a write transaction: judged, then written if the caller holds the key.
async fn complete_in(
    tx: &mut SqliteConnection,
    command: &CompleteCommand,
) -> Result<Result<Completion, Rejection>, StoreError> {
    let namespace = command.namespace.as_str();
    let key = command.key.as_str();
    let guard = judge(
        tx,
        namespace,
        key,
        command.lease_token,
        Some(command.response.as_bytes()),
    )
    .await?;
    let held = match (guard.verdict, guard.record) {
        (Err(rejection), _) => return Ok(Err(rejection)),
        // Repeated by the holder with the same response: the same completion again.
        (Ok(Some(earlier)), _) => return Ok(Ok(earlier)),
        (Ok(None), Some(held)) => held,
        (Ok(None), None) => return Err(StoreError::Inconsistent("a guard passed on no key")),
    };
    let retention = command.retention.map_or(held.retention, |r| r.get());
    let completion = Completion {
        completed_at: guard.now,
        expires_at: plus(guard.now, retention),
    };
    let completed = KeyRecord {
        response: Some(command.response.as_bytes().to_vec()),
        completed_at: Some(completion.completed_at),
        checkpoint: None,
        retention,
        expires_at: completion.expires_at,
        ..held
    };
    write_key(tx, namespace, key, &completed).await?;
    Ok(Ok(completion))
}

/// MarkProcessed inside a write transaction, at `now`.
async fn mark_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &MarkProcessedCommand,
) -> Result<Vec<ProcessedEvent>, StoreError> {
    let consumer = command.consumer.as_str();
    let expires_at = micros(plus(now, command.retention.get()));
    // The first processing of each id, as this call finds or records it.
    let mut first: std::collections::HashMap<&str, Instant> = std::collections::HashMap::new();
    let mut results = Vec::with_capacity(command.event_ids.len());
    for event_id in &command.event_ids {
        let id = event_id.as_str();
        if let Some(processed_at) = first.get(id) {
            results.push(ProcessedEvent {
                event_id: id.to_owned(),
                already_processed: true,
                processed_at: *processed_at,
            });
            continue;
        }
        let existing: Option<EventRow> = sqlx::query_as(
            "SELECT processed_at, expires_at FROM processed_events
                 WHERE consumer = ?1 AND event_id = ?2",
        )
        .bind(consumer)
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(classify)?;
        let live = existing.filter(|row| instant(row.expires_at) > now);
        let (already_processed, processed_at) = match live {
            Some(row) => (true, instant(row.processed_at)),
            None => {
                sqlx::query(
                    "INSERT INTO processed_events (consumer, event_id, processed_at, expires_at)
                         VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT (consumer, event_id) DO UPDATE SET
                             processed_at = excluded.processed_at,
                             expires_at = excluded.expires_at",
                )
                .bind(consumer)
                .bind(id)
                .bind(micros(now))
                .bind(expires_at)
                .execute(&mut *tx)
                .await
                .map_err(classify)?;
                (false, now)
            }
        };
        first.insert(id, processed_at);
        results.push(ProcessedEvent {
            event_id: id.to_owned(),
            already_processed,
            processed_at,
        });
    }
    Ok(results)
}

impl Store for SqliteStore {
    async fn try_start(&self, command: TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        let mut write = self.begin_write().await?;
        let now = now(&mut write.tx).await?;
        let outcome = claim_in(&mut write.tx, now, &command).await?;
        write.commit().await?;
        Ok(outcome)
    }

    /// The whole batch in one write transaction, one command after another (so duplicates
    /// resolve as if they came one after another), with one commit: one `fsync` for all.
    async fn try_start_batch(
        &self,
        commands: Vec<TryStartCommand>,
    ) -> Vec<Result<TryStartOutcome, StoreError>> {
        let count = commands.len();
        let applied = async {
            let mut write = self.begin_write().await?;
            let now = now(&mut write.tx).await?;
            let mut outcomes = Vec::with_capacity(count);
            for command in &commands {
                outcomes.push(claim_in(&mut write.tx, now, command).await?);
            }
            write.commit().await?;
            Ok::<_, StoreError>(outcomes)
        };
        match applied.await {
            Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
            Err(error) => error.for_each_of(count).into_iter().map(Err).collect(),
        }
    }

    async fn complete(
        &self,
        command: CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        let mut write = self.begin_write().await?;
        let answer = complete_in(&mut write.tx, &command).await?;
        write.commit().await?;
        Ok(answer)
    }

    /// Like [`Self::try_start_batch`]: one transaction, one commit.
    async fn complete_batch(
        &self,
        commands: Vec<CompleteCommand>,
    ) -> Vec<Result<Result<Completion, Rejection>, StoreError>> {
        let count = commands.len();
        let applied = async {
            let mut write = self.begin_write().await?;
            let mut answers = Vec::with_capacity(count);
            for command in &commands {
                answers.push(complete_in(&mut write.tx, command).await?);
            }
            write.commit().await?;
            Ok::<_, StoreError>(answers)
        };
        match applied.await {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(error) => error.for_each_of(count).into_iter().map(Err).collect(),
        }
    }

    async fn release(&self, command: ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        let mut write = self.begin_write().await?;
        let tx = &mut write.tx;
        let namespace = command.namespace.as_str();
        let key = command.key.as_str();
        let guard = judge(tx, namespace, key, command.lease_token, None).await?;
        match guard.verdict {
            Err(rejection) => Ok(Err(rejection)),
            // Without an offered response, a completed key is always ALREADY_COMPLETED.
            Ok(Some(_)) => Ok(Err(Rejection::AlreadyCompleted)),
            Ok(None) => {
                sqlx::query("DELETE FROM idempotency_keys WHERE namespace = ?1 AND key = ?2")
                    .bind(namespace)
                    .bind(key)
                    .execute(&mut **tx)
                    .await
                    .map_err(classify)?;
                write.commit().await?;
                Ok(Ok(()))
            }
        }
    }

    async fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        let mut write = self.begin_write().await?;
        let tx = &mut write.tx;
        let namespace = command.namespace.as_str();
        let key = command.key.as_str();
        let guard = judge(tx, namespace, key, command.lease_token, None).await?;
        let held = match (guard.verdict, guard.record) {
            (Err(rejection), _) => return Ok(Err(rejection)),
            (Ok(Some(_)), _) => return Ok(Err(Rejection::AlreadyCompleted)),
            (Ok(None), Some(held)) => held,
            (Ok(None), None) => return Err(StoreError::Inconsistent("a guard passed on no key")),
        };
        let lease_expires_at = plus(guard.now, command.lease_ttl.get());
        let extended = KeyRecord {
            lease_expires_at,
            // Retention is stretched to cover the lease.
            expires_at: held.expires_at.max(lease_expires_at),
            checkpoint: match command.checkpoint {
                Some(checkpoint) => Some(checkpoint.as_bytes().to_vec()),
                None => held.checkpoint.clone(),
            },
            ..held
        };
        write_key(tx, namespace, key, &extended).await?;
        write.commit().await?;
        Ok(Ok(lease_expires_at))
    }

    async fn lookup(&self, query: LookupQuery) -> Result<KeyState, StoreError> {
        self.ensure_schema().await?;
        // One statement, so that the clock and the row are read in one snapshot.
        let row: Option<KeyRow> = sqlx::query_as(LOOKUP_LIVE_KEY)
            .bind(query.namespace.as_str())
            .bind(query.key.as_str())
            .fetch_optional(&self.readers)
            .await
            .map_err(classify)?;
        Ok(KeyState::of(row.map(KeyRecord::from)))
    }

    async fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        let mut write = self.begin_write().await?;
        let now = now(&mut write.tx).await?;
        let results = mark_in(&mut write.tx, now, &command).await?;
        write.commit().await?;
        Ok(results)
    }

    /// Like [`Self::try_start_batch`]: one transaction, one commit.
    async fn mark_processed_batch(
        &self,
        commands: Vec<MarkProcessedCommand>,
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        let count = commands.len();
        let applied = async {
            let mut write = self.begin_write().await?;
            let now = now(&mut write.tx).await?;
            let mut all = Vec::with_capacity(count);
            for command in &commands {
                all.push(mark_in(&mut write.tx, now, command).await?);
            }
            write.commit().await?;
            Ok::<_, StoreError>(all)
        };
        match applied.await {
            Ok(all) => all.into_iter().map(Ok).collect(),
            Err(error) => error.for_each_of(count).into_iter().map(Err).collect(),
        }
    }

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        self.reap(REAP_KEYS, limit).await
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        self.reap(REAP_EVENTS, limit).await
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        MIGRATOR
            .run(&self.writer)
            .await
            .map_err(|error| match error {
                sqlx::migrate::MigrateError::Execute(inner) => classify(inner),
                other => StoreError::Migration(other),
            })?;
        self.schema_ready.store(true, Ordering::Release);
        Ok(())
    }

    async fn probe(&self) -> Result<(), StoreError> {
        let found: Result<(i64,), sqlx::Error> =
            sqlx::query_as("SELECT coalesce(max(version), 0) FROM _sqlx_migrations WHERE success")
                .fetch_one(&self.probe_reader)
                .await;
        let version = match found {
            Ok((version,)) => version,
            // A file without the migrations table (result code 1, SQLITE_ERROR), or no file at
            // all (14, SQLITE_CANTOPEN: readers do not create it), has not been migrated yet.
            Err(sqlx::Error::Database(db)) if matches!(db.code().as_deref(), Some("1" | "14")) => 0,
            Err(other) => return Err(classify(other)),
        };
        let required = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
        if version < required {
            return Err(StoreError::NotMigrated(format!(
                "schema version {version}, this build needs {required}"
            )));
        }
        self.schema_ready.store(true, Ordering::Release);
        Ok(())
    }

    async fn close(&self) {
        self.probe_reader.close().await;
        self.readers.close().await;
        self.writer.close().await;
    }
}
