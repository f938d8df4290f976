//! The PostgreSQL store. Each state change is one guarded statement (`INSERT … ON CONFLICT …
//! RETURNING`, `UPDATE … WHERE lease_token = $n RETURNING`), so no window opens between a read
//! and a write, and no transaction stays open while a caller works: leases, not row locks.
//! Every instant is `now()` of the database.

use std::time::Duration;

use sqlx::migrate::{MigrateDatabase, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{FromRow, PgPool, Postgres};

use super::{Store, StoreError};
use crate::domain::{
    ClaimedRecord, CompleteCommand, Completion, ExtendLeaseCommand, GuardedKey, Instant, KeyState,
    LeaseToken, LookupQuery, MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand,
    TryStartCommand, TryStartOutcome, classify_refusal,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// How the store connects.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub pool_size: u32,
    /// Bounds every statement on the server too (`statement_timeout`) and every wait for a
    /// pooled connection, so a stuck database cannot hold a call beyond it.
    pub operation_timeout: Duration,
}

#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    url: String,
}

impl std::fmt::Debug for PgStore {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

/// How often a statement that hit a serialization failure or deadlock is tried in all.
const ATTEMPTS_ON_CONFLICT: usize = 3;

impl PgStore {
    /// Builds the pool without connecting, so the service can start (and report NOT_SERVING)
    /// while the database is still unreachable.
    pub fn connect_lazy(settings: &PgSettings) -> Result<Self, sqlx::Error> {
        let statement_timeout_ms = settings.operation_timeout.as_millis().to_string();
        let options: PgConnectOptions = settings
            .url
            .parse::<PgConnectOptions>()?
            .application_name("idempotency-coordinator")
            .options([("statement_timeout", statement_timeout_ms.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(settings.operation_timeout)
            .connect_lazy_with(options);
        Ok(Self {
            pool,
            url: settings.url.clone(),
        })
    }

    /// The pool, for tests and tools that inspect the database directly.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The newest migration this build carries: the schema version `probe` requires.
    fn required_schema_version() -> i64 {
        MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
    }
}

/// Sorts a driver error into what a caller can act on, by SQLSTATE, never by message text.
fn classify(error: sqlx::Error) -> StoreError {
    let unavailable = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                // undefined_table, undefined_column, undefined_object, undefined_function,
                // invalid_schema_name: the schema is not (fully) migrated yet.
                "42P01" | "42703" | "42704" | "42883" | "3F000" => {
                    return StoreError::NotMigrated(db.message().to_owned());
                }
                // query_canceled (our statement_timeout), serialization_failure,
                // deadlock_detected, lock_not_available, invalid_catalog_name (the database
                // is not created yet), authentication failures.
                "57014" | "40001" | "40P01" | "55P03" | "3D000" | "28000" | "28P01" => true,
                // connection_exception, insufficient_resources, operator_intervention
                // (admin_shutdown, crash_shutdown, cannot_connect_now).
                other => {
                    other.starts_with("08") || other.starts_with("53") || other.starts_with("57P")
                }
            }
        }
        _ => false,
    };
    if unavailable {
        StoreError::Unavailable(error)
    } else {
        StoreError::Internal(error)
    }
}

/// Whether a statement failed only because it lost a race that a second try resolves:
/// a serialization failure or a deadlock broken by PostgreSQL.
fn lost_a_race(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("40001" | "40P01")),
        _ => false,
    }
}

/// Runs a statement, retrying it when PostgreSQL aborted it to break a deadlock or a
/// serialization conflict. Each try is a whole statement, so a retry never sees half a write.
async fn with_retries<T, F, Fut>(mut statement: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut attempt = 1;
    loop {
        match statement().await {
            Ok(value) => return Ok(value),
            Err(error) if attempt < ATTEMPTS_ON_CONFLICT && lost_a_race(&error) => {
                tracing::debug!(attempt, error = %error, "statement lost a race; retrying");
                attempt += 1;
            }
            Err(error) => return Err(classify(error)),
        }
    }
}

#[derive(FromRow)]
struct TryStartRow {
    newly_claimed: bool,
    lease_token: i64,
    attempt: i32,
    attempt_id: Option<String>,
    lease_expires_at: Instant,
    fingerprint: Vec<u8>,
    checkpoint: Option<Vec<u8>>,
    response: Option<Vec<u8>>,
    completed_at: Option<Instant>,
    expires_at: Instant,
}

/// Stored attempts start at 1 and grow by one per takeover; the column is an `integer`.
fn attempt_number(stored: i32) -> u32 {
    u32::try_from(stored).unwrap_or(0)
}

impl From<TryStartRow> for ClaimedRecord {
    fn from(row: TryStartRow) -> Self {
        Self {
            newly_claimed: row.newly_claimed,
            lease_token: LeaseToken::from_stored(row.lease_token),
            attempt: attempt_number(row.attempt),
            attempt_id: row.attempt_id,
            lease_expires_at: row.lease_expires_at,
            fingerprint: row.fingerprint,
            checkpoint: row.checkpoint,
            response: row.response,
            completed_at: row.completed_at,
            expires_at: row.expires_at,
        }
    }
}

/// TryStart as one statement. The proposed row always carries a freshly drawn token; on
/// conflict, `action` applies the contract's order to the existing row:
///
/// - `fresh`: the row's retention is over, so the key is absent: claim it anew (attempt 1).
/// - `none`: another fingerprint, a completed key, or a lease still running: change nothing.
/// - `reenter`: the holder's own attempt_id: same token, lease renewed to the later expiry.
/// - `takeover`: the lease ran out: new token, attempt + 1, checkpoint handed over.
///
/// The update always happens (even for `none`, as a no-op) so that RETURNING reports the row as
/// it stands once the row lock is held, never a stale snapshot; the caller got a new claim
/// exactly when the returned token is the one this statement drew.
const TRY_START: &str = r#"
WITH new_token AS (SELECT nextval('lease_token_seq') AS value)
INSERT INTO idempotency_keys AS k
    (namespace, key, fingerprint, lease_token, attempt, attempt_id, lease_expires_at,
     checkpoint, response, completed_at, retention_us, expires_at)
SELECT $1, $2, $3, new_token.value, 1, $6,
       now() + $4 * interval '1 microsecond',
       NULL, NULL, NULL, $5,
       now() + greatest($4, $5) * interval '1 microsecond'
FROM new_token
ON CONFLICT (namespace, key) DO UPDATE SET
    (fingerprint, lease_token, attempt, attempt_id, lease_expires_at, checkpoint, response,
     completed_at, retention_us, expires_at) =
    (SELECT
        CASE t.action WHEN 'fresh' THEN excluded.fingerprint ELSE k.fingerprint END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.lease_token
             ELSE k.lease_token END,
        CASE t.action WHEN 'fresh' THEN 1 WHEN 'takeover' THEN k.attempt + 1
             ELSE k.attempt END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.attempt_id
             ELSE k.attempt_id END,
        CASE t.action
             WHEN 'reenter' THEN greatest(k.lease_expires_at, excluded.lease_expires_at)
             WHEN 'none' THEN k.lease_expires_at
             ELSE excluded.lease_expires_at END,
        CASE t.action WHEN 'fresh' THEN NULL ELSE k.checkpoint END,
        CASE t.action WHEN 'fresh' THEN NULL ELSE k.response END,
        CASE t.action WHEN 'fresh' THEN NULL ELSE k.completed_at END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.retention_us
             ELSE k.retention_us END,
        CASE t.action
             WHEN 'fresh' THEN excluded.expires_at
             WHEN 'takeover' THEN greatest(k.expires_at, excluded.expires_at)
             WHEN 'reenter' THEN greatest(k.expires_at, excluded.lease_expires_at)
             ELSE k.expires_at END
     FROM (SELECT CASE
              WHEN k.expires_at <= now() THEN 'fresh'
              WHEN k.fingerprint <> excluded.fingerprint THEN 'none'
              WHEN k.completed_at IS NOT NULL THEN 'none'
              WHEN k.attempt_id = excluded.attempt_id THEN 'reenter'
              WHEN k.lease_expires_at > now() THEN 'none'
              ELSE 'takeover'
           END AS action) AS t)
RETURNING k.lease_token = (SELECT value FROM new_token) AS newly_claimed,
          k.lease_token, k.attempt, k.attempt_id, k.lease_expires_at, k.fingerprint,
          k.checkpoint, k.response, k.completed_at, k.expires_at
"#;

const COMPLETE: &str = r#"
UPDATE idempotency_keys
SET response = $4,
    completed_at = now(),
    checkpoint = NULL,
    retention_us = coalesce($5, retention_us),
    expires_at = now() + coalesce($5, retention_us) * interval '1 microsecond'
WHERE namespace = $1 AND key = $2 AND lease_token = $3
  AND completed_at IS NULL AND expires_at > now()
RETURNING completed_at, expires_at
"#;

/// Read after a guarded write changed nothing, to say why. Tokens are never reused and a
/// completed key never returns to progress, so what this finds explains the refusal.
const GUARD_STATE: &str = r#"
SELECT lease_token, completed_at, expires_at,
       coalesce(response = $3, false) AS same_response
FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now()
"#;

const RELEASE: &str = r#"
DELETE FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND lease_token = $3
  AND completed_at IS NULL AND expires_at > now()
RETURNING lease_token
"#;

/// The lease becomes now + ttl (which may shorten it); retention stretches to cover it.
/// `$5` says whether a checkpoint was sent at all, so that an empty one still replaces.
const EXTEND_LEASE: &str = r#"
UPDATE idempotency_keys
SET lease_expires_at = now() + $4 * interval '1 microsecond',
    expires_at = greatest(expires_at, now() + $4 * interval '1 microsecond'),
    checkpoint = CASE WHEN $5 THEN $6 ELSE checkpoint END
WHERE namespace = $1 AND key = $2 AND lease_token = $3
  AND completed_at IS NULL AND expires_at > now()
RETURNING lease_expires_at
"#;

const LOOKUP: &str = r#"
SELECT fingerprint, lease_expires_at, attempt, response, completed_at, expires_at
FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now()
"#;

/// MarkProcessed as one statement. Distinct ids are inserted in sorted order (so concurrent
/// batches lock rows in the same order and do not deadlock); a live row is kept as it is, an
/// expired one is recorded anew. The update always happens so that RETURNING reports every id
/// with the row as it stands under its lock. `mark_batch` tells rows this call recorded from
/// rows it found; within the call, only an id's first position counts as new.
const MARK_PROCESSED: &str = r#"
WITH batch AS (SELECT nextval('mark_batch_seq') AS id),
requested AS (
    SELECT r.event_id COLLATE "C" AS event_id, r.position
    FROM unnest($2::text[]) WITH ORDINALITY AS r(event_id, position)
),
recorded AS (
    INSERT INTO processed_events AS e (consumer, event_id, processed_at, expires_at, mark_batch)
    SELECT $1, d.event_id, now(), now() + $3 * interval '1 microsecond', batch.id
    FROM (SELECT DISTINCT event_id FROM requested) AS d CROSS JOIN batch
    ORDER BY d.event_id
    ON CONFLICT (consumer, event_id) DO UPDATE SET
        processed_at = CASE WHEN e.expires_at <= now() THEN excluded.processed_at
                            ELSE e.processed_at END,
        expires_at = CASE WHEN e.expires_at <= now() THEN excluded.expires_at
                          ELSE e.expires_at END,
        mark_batch = CASE WHEN e.expires_at <= now() THEN excluded.mark_batch
                          ELSE e.mark_batch END
    RETURNING e.event_id, e.processed_at, e.mark_batch = (SELECT id FROM batch) AS recorded_now
)
SELECT r.event_id,
       rec.processed_at,
       NOT (rec.recorded_now
            AND r.position = min(r.position) OVER (PARTITION BY r.event_id))
           AS already_processed
FROM requested AS r
JOIN recorded AS rec ON rec.event_id = r.event_id
ORDER BY r.position
"#;

/// Deletes a bounded batch of expired keys, skipping rows another transaction holds (another
/// replica's reaper, or a TryStart reclaiming the key), oldest expiry first.
const REAP_KEYS: &str = r#"
WITH doomed AS (
    SELECT namespace, key FROM idempotency_keys
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM idempotency_keys AS k
    USING doomed AS d
    WHERE k.namespace = d.namespace AND k.key = d.key AND k.expires_at <= now()
    RETURNING 1
)
SELECT count(*) FROM deleted
"#;

const REAP_EVENTS: &str = r#"
WITH doomed AS (
    SELECT consumer, event_id FROM processed_events
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
),
deleted AS (
    DELETE FROM processed_events AS e
    USING doomed AS d
    WHERE e.consumer = d.consumer AND e.event_id = d.event_id AND e.expires_at <= now()
    RETURNING 1
)
SELECT count(*) FROM deleted
"#;

const SCHEMA_VERSION: &str = r#"
SELECT coalesce(max(version), 0) FROM _sqlx_migrations WHERE success
"#;

#[derive(FromRow)]
struct GuardRow {
    lease_token: i64,
    completed_at: Option<Instant>,
    expires_at: Instant,
    same_response: bool,
}

impl From<GuardRow> for GuardedKey {
    fn from(row: GuardRow) -> Self {
        Self {
            lease_token: LeaseToken::from_stored(row.lease_token),
            completion: row.completed_at.map(|completed_at| Completion {
                completed_at,
                expires_at: row.expires_at,
            }),
            same_response: row.same_response,
        }
    }
}

#[derive(FromRow)]
struct LookupRow {
    fingerprint: Vec<u8>,
    lease_expires_at: Instant,
    attempt: i32,
    response: Option<Vec<u8>>,
    completed_at: Option<Instant>,
    expires_at: Instant,
}

#[derive(FromRow)]
struct MarkRow {
    event_id: String,
    processed_at: Instant,
    already_processed: bool,
}

impl PgStore {
    /// Why a guarded write on `token` changed nothing. `offered_response` is compared for
    /// Complete only; Release and ExtendLease pass `None`.
    async fn refusal(
        &self,
        namespace: &str,
        key: &str,
        token: LeaseToken,
        offered_response: Option<&[u8]>,
    ) -> Result<Result<Option<Completion>, Rejection>, StoreError> {
        let found: Option<GuardRow> = with_retries(|| {
            sqlx::query_as(GUARD_STATE)
                .bind(namespace)
                .bind(key)
                .bind(offered_response)
                .fetch_optional(&self.pool)
        })
        .await?;
        Ok(classify_refusal(found.map(GuardedKey::from), token))
    }
}

/// The guarded write found the caller to be the current holder of an in-progress key, yet did
/// not apply. Tokens are never reused and completed keys never reopen, so this cannot happen;
/// if it ever does, it is reported rather than guessed at.
fn inconsistent_guard() -> StoreError {
    StoreError::Inconsistent("a guarded write refused the current holder of an in-progress key")
}

impl Store for PgStore {
    async fn try_start(&self, command: TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        let row: TryStartRow = with_retries(|| {
            sqlx::query_as(TRY_START)
                .bind(command.namespace.as_str())
                .bind(command.key.as_str())
                .bind(command.fingerprint.as_bytes())
                .bind(command.lease_ttl.as_micros())
                .bind(command.retention.as_micros())
                .bind(command.attempt_id.as_ref().map(|a| a.as_str()))
                .fetch_one(&self.pool)
        })
        .await?;
        Ok(TryStartOutcome::from_record(row.into(), &command))
    }

    async fn complete(
        &self,
        command: CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        let retention = command.retention.map(|r| r.as_micros());
        let completed: Option<(Instant, Instant)> = with_retries(|| {
            sqlx::query_as(COMPLETE)
                .bind(command.namespace.as_str())
                .bind(command.key.as_str())
                .bind(command.lease_token.get())
                .bind(command.response.as_bytes())
                .bind(retention)
                .fetch_optional(&self.pool)
        })
        .await?;
        if let Some((completed_at, expires_at)) = completed {
            return Ok(Ok(Completion {
                completed_at,
                expires_at,
            }));
        }
        let refusal = self
            .refusal(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                Some(command.response.as_bytes()),
            )
            .await?;
        match refusal {
            Ok(Some(earlier_completion)) => Ok(Ok(earlier_completion)),
            Ok(None) => Err(inconsistent_guard()),
            Err(rejection) => Ok(Err(rejection)),
        }
    }

    async fn release(&self, command: ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        let released: Option<(i64,)> = with_retries(|| {
            sqlx::query_as(RELEASE)
                .bind(command.namespace.as_str())
                .bind(command.key.as_str())
                .bind(command.lease_token.get())
                .fetch_optional(&self.pool)
        })
        .await?;
        if released.is_some() {
            return Ok(Ok(()));
        }
        let refusal = self
            .refusal(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                None,
            )
            .await?;
        match refusal {
            Err(rejection) => Ok(Err(rejection)),
            // Without an offered response, a completed key is always ALREADY_COMPLETED.
            Ok(Some(_)) => Ok(Err(Rejection::AlreadyCompleted)),
            Ok(None) => Err(inconsistent_guard()),
        }
    }

    async fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        let checkpoint = command.checkpoint.as_ref().map(|c| c.as_bytes());
        let extended: Option<(Instant,)> = with_retries(|| {
            sqlx::query_as(EXTEND_LEASE)
                .bind(command.namespace.as_str())
                .bind(command.key.as_str())
                .bind(command.lease_token.get())
                .bind(command.lease_ttl.as_micros())
                .bind(checkpoint.is_some())
                .bind(checkpoint)
                .fetch_optional(&self.pool)
        })
        .await?;
        if let Some((lease_expires_at,)) = extended {
            return Ok(Ok(lease_expires_at));
        }
        let refusal = self
            .refusal(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                None,
            )
            .await?;
        match refusal {
            Err(rejection) => Ok(Err(rejection)),
            Ok(Some(_)) => Ok(Err(Rejection::AlreadyCompleted)),
            Ok(None) => Err(inconsistent_guard()),
        }
    }

    async fn lookup(&self, query: LookupQuery) -> Result<KeyState, StoreError> {
        let row: Option<LookupRow> = with_retries(|| {
            sqlx::query_as(LOOKUP)
                .bind(query.namespace.as_str())
                .bind(query.key.as_str())
                .fetch_optional(&self.pool)
        })
        .await?;
        Ok(match row {
            None => KeyState::Absent,
            Some(LookupRow {
                fingerprint,
                response: Some(response),
                completed_at: Some(completed_at),
                expires_at,
                ..
            }) => KeyState::Completed {
                response,
                fingerprint,
                completion: Completion {
                    completed_at,
                    expires_at,
                },
            },
            Some(row) => KeyState::InProgress {
                lease_expires_at: row.lease_expires_at,
                attempt: attempt_number(row.attempt),
                fingerprint: row.fingerprint,
            },
        })
    }

    async fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        let ids: Vec<&str> = command.event_ids.iter().map(|id| id.as_str()).collect();
        let rows: Vec<MarkRow> = with_retries(|| {
            sqlx::query_as(MARK_PROCESSED)
                .bind(command.consumer.as_str())
                .bind(&ids)
                .bind(command.retention.as_micros())
                .fetch_all(&self.pool)
        })
        .await?;
        Ok(rows
            .into_iter()
            .map(|row| ProcessedEvent {
                event_id: row.event_id,
                already_processed: row.already_processed,
                processed_at: row.processed_at,
            })
            .collect())
    }

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = with_retries(|| {
            sqlx::query_as(REAP_KEYS)
                .bind(i64::from(limit))
                .fetch_one(&self.pool)
        })
        .await?;
        Ok(deleted.unsigned_abs())
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = with_retries(|| {
            sqlx::query_as(REAP_EVENTS)
                .bind(i64::from(limit))
                .fetch_one(&self.pool)
        })
        .await?;
        Ok(deleted.unsigned_abs())
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        // A database that does not exist yet is created, so a first start needs nothing by
        // hand; where the role may not create databases, the original error is reported.
        if let Ok(false) = Postgres::database_exists(&self.url).await {
            if let Err(error) = Postgres::create_database(&self.url).await {
                tracing::warn!(error = %error, "could not create the database");
            } else {
                tracing::info!("created the database");
            }
        }
        MIGRATOR.run(&self.pool).await.map_err(|error| match error {
            sqlx::migrate::MigrateError::Execute(inner) => classify(inner),
            other => StoreError::Migration(other),
        })
    }

    async fn probe(&self) -> Result<(), StoreError> {
        let (version,): (i64,) = sqlx::query_as(SCHEMA_VERSION)
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        let required = Self::required_schema_version();
        if version < required {
            return Err(StoreError::NotMigrated(format!(
                "schema version {version}, this build needs {required}"
            )));
        }
        Ok(())
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}
