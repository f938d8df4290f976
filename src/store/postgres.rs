//! The PostgreSQL store. Each state change is one guarded statement (`INSERT … ON CONFLICT …
//! RETURNING`, `UPDATE … WHERE lease_token = $n RETURNING`), so no window opens between a read
//! and a write, and no transaction stays open while a caller works: leases, not row locks.
//!
//! Every instant comes from the database clock. A statement that changes a key locks the row
//! first and judges it, expiry included, by `clock_timestamp()` read once the lock is granted,
//! not by `now()` (the instant the statement began): a statement that waited for a row lock
//! must not act on the key as it was before the wait, or it could revive, or complete, a key
//! that expired, and that others saw absent, while it waited. Plain reads (Lookup) use `now()`,
//! the instant of their snapshot.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{MigrateDatabase, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{FromRow, PgPool, Postgres};

use super::{Budget, Store, StoreError};
use crate::coalesce::{Coalescible, rounds};
use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, GuardedKey, Instant, KeyRecord, KeyState,
    LeaseToken, LookupQuery, MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand,
    TryStartCommand, TryStartOutcome, classify_refusal, key_id,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// How the store connects.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    pub pool_size: u32,
    /// The budget of one operation, shared out by [`Budget`]: PostgreSQL itself stops a
    /// statement that runs too long (`statement_timeout`), so a timeout it reports means that
    /// nothing was written.
    pub operation_timeout: Duration,
}

#[derive(Clone)]
pub struct PgStore {
    /// Serves the RPCs and the reaper.
    pool: PgPool,
    /// One connection of its own for health probes, so that a pool busy with calls does not
    /// look like an unreachable database.
    probe_pool: PgPool,
    /// For migrations, which run on a connection of their own without a statement timeout.
    migration_options: Arc<PgConnectOptions>,
    url: String,
}

impl std::fmt::Debug for PgStore {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

impl PgStore {
    /// Builds the pool without connecting, so the service can start (and report NOT_SERVING)
    /// while the database is still unreachable.
    pub fn connect_lazy(settings: &PgSettings) -> Result<Self, sqlx::Error> {
        let budget = Budget::of(settings.operation_timeout);
        let migration_options: PgConnectOptions = settings
            .url
            .parse::<PgConnectOptions>()?
            .application_name("idempotency-coordinator");
        let statement_timeout_ms = budget.statement.as_millis().max(1).to_string();
        // Generic plans: every statement here is an index lookup or a walk over unnest()ed
        // arrays, whose best plan does not depend on the values, and re-planning the larger
        // statements for each call costs more than running them.
        let options = migration_options.clone().options([
            ("statement_timeout", statement_timeout_ms.as_str()),
            ("plan_cache_mode", "force_generic_plan"),
        ]);
        let pool = PgPoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(options.clone());
        let probe_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(options);
        Ok(Self {
            pool,
            probe_pool,
            migration_options: Arc::new(migration_options),
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
///
/// A statement PostgreSQL aborted (a deadlock it broke, its `statement_timeout`) wrote nothing
/// and is reported as such (UNAVAILABLE). No statement is tried again: a second one would need
/// a second budget and could commit after the caller was told it timed out. Every statement
/// that locks several rows locks them in one order, so deadlocks do not arise between them.
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

/// A key's row, as every statement that reads one returns it.
#[derive(FromRow)]
struct KeyRow {
    lease_token: i64,
    attempt: i32,
    attempt_id: Option<String>,
    lease_expires_at: Instant,
    fingerprint: Vec<u8>,
    checkpoint: Option<Vec<u8>>,
    response: Option<Vec<u8>>,
    completed_at: Option<Instant>,
    retention_us: i64,
    expires_at: Instant,
}

/// The columns of [`KeyRow`], for statements that return one.
macro_rules! key_columns {
    ($alias:literal) => {
        concat!(
            $alias,
            "lease_token, ",
            $alias,
            "attempt, ",
            $alias,
            "attempt_id, ",
            $alias,
            "lease_expires_at, ",
            $alias,
            "fingerprint, ",
            $alias,
            "checkpoint, ",
            $alias,
            "response, ",
            $alias,
            "completed_at, ",
            $alias,
            "retention_us, ",
            $alias,
            "expires_at"
        )
    };
}

#[derive(FromRow)]
struct TryStartRow {
    newly_claimed: bool,
    #[sqlx(flatten)]
    key: KeyRow,
}

/// A row of [`TRY_START_BATCH`]: which key it is, and the key as TryStart left it.
#[derive(FromRow)]
struct TryStartBatchRow {
    namespace: String,
    #[sqlx(rename = "key")]
    key_name: String,
    newly_claimed: bool,
    #[sqlx(flatten)]
    key: KeyRow,
}

/// Stored attempts start at 1 and grow by one per takeover; the column is an `integer`.
fn attempt_number(stored: i32) -> u32 {
    u32::try_from(stored).unwrap_or(0)
}

impl From<KeyRow> for KeyRecord {
    fn from(row: KeyRow) -> Self {
        Self {
            fingerprint: row.fingerprint,
            lease_token: LeaseToken::from_stored(row.lease_token),
            attempt: attempt_number(row.attempt),
            attempt_id: row.attempt_id,
            lease_expires_at: row.lease_expires_at,
            checkpoint: row.checkpoint,
            response: row.response,
            completed_at: row.completed_at,
            retention: std::time::Duration::from_micros(row.retention_us.unsigned_abs()),
            expires_at: row.expires_at,
        }
    }
}

/// The heart of TryStart's conflict branch, shared by the one-row and the batch statements:
/// the key's new columns for each `t.action`, given `t.lease_end` and `t.retention_end`
/// (computed by each statement from its own inputs) and the decision below. A new claim draws
/// its fencing token here, under the row's lock, so that it is greater than the token of
/// whoever held the key before, however long the statement waited for the lock; it records
/// the statement's ticket (`excluded.claim_ticket`), by which the statement recognises its
/// claim.
macro_rules! claim_assignments {
    () => {
        r#"
    (fingerprint, lease_token, claim_ticket, attempt, attempt_id, lease_expires_at, checkpoint,
     response, completed_at, retention_us, expires_at) =
    (SELECT
        CASE t.action WHEN 'fresh' THEN excluded.fingerprint ELSE k.fingerprint END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN nextval('lease_token_seq')
             ELSE k.lease_token END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.claim_ticket
             ELSE k.claim_ticket END,
        CASE t.action WHEN 'fresh' THEN 1 WHEN 'takeover' THEN k.attempt + 1
             ELSE k.attempt END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.attempt_id
             ELSE k.attempt_id END,
        CASE t.action
             WHEN 'reenter' THEN greatest(k.lease_expires_at, t.lease_end)
             WHEN 'none' THEN k.lease_expires_at
             ELSE t.lease_end END,
        CASE t.action WHEN 'fresh' THEN NULL ELSE k.checkpoint END,
        CASE t.action WHEN 'fresh' THEN NULL ELSE k.response END,
        CASE t.action WHEN 'fresh' THEN NULL ELSE k.completed_at END,
        CASE WHEN t.action IN ('fresh', 'takeover') THEN excluded.retention_us
             ELSE k.retention_us END,
        CASE t.action
             WHEN 'fresh' THEN t.retention_end
             WHEN 'takeover' THEN greatest(k.expires_at, t.retention_end)
             WHEN 'reenter' THEN greatest(k.expires_at, t.lease_end)
             ELSE k.expires_at END
"#
    };
}

/// The contract's TryStart order on the locked row `k`, by the clock read under the lock
/// (`locked.at`); the closing of the sub-selects that [`claim_assignments!`] opens.
macro_rules! claim_action {
    () => {
        r#"
        CASE
            WHEN k.expires_at <= locked.at THEN 'fresh'
            WHEN k.fingerprint <> excluded.fingerprint THEN 'none'
            WHEN k.completed_at IS NOT NULL THEN 'none'
            WHEN k.attempt_id = excluded.attempt_id THEN 'reenter'
            WHEN k.lease_expires_at > locked.at THEN 'none'
            ELSE 'takeover'
        END AS action) AS t)
"#
    };
}

/// TryStart as one statement. The proposed row always carries a freshly drawn token; on
/// conflict, `action` applies the contract's order to the existing row, as it stands once its
/// lock is held and by the clock read at that moment (`t.at`). It is the table of
/// `domain::claim_action` and `domain::claimed_record`, in SQL:
///
/// - `fresh`: the row's retention is over, so the key is absent: claim it anew (attempt 1).
/// - `none`: another fingerprint, a completed key, or a lease still running: change nothing.
/// - `reenter`: the holder's own attempt_id: same token, lease renewed to the later expiry.
/// - `takeover`: the lease ran out: new token, attempt + 1, checkpoint handed over.
///
/// The update always happens (even for `none`, as a no-op) so that RETURNING reports the row as
/// it stands under the lock, never a stale snapshot; the caller got a new claim exactly when the
/// row carries the ticket this statement drew (a fresh insert uses it as its token too: the
/// statement waits for no other row first).
const TRY_START: &str = concat!(
    r#"
WITH new_token AS (SELECT nextval('lease_token_seq') AS value),
     claimed AS (SELECT clock_timestamp() AS at)
INSERT INTO idempotency_keys AS k
    (namespace, key, fingerprint, lease_token, claim_ticket, attempt, attempt_id,
     lease_expires_at, checkpoint, response, completed_at, retention_us, expires_at)
SELECT $1, $2, $3, new_token.value, new_token.value, 1, $6,
       claimed.at + $4 * interval '1 microsecond',
       NULL, NULL, NULL, $5,
       claimed.at + greatest($4, $5) * interval '1 microsecond'
FROM new_token CROSS JOIN claimed
ON CONFLICT (namespace, key) DO UPDATE SET
"#,
    claim_assignments!(),
    r#"     FROM (SELECT clock_timestamp() AS at) AS locked
     CROSS JOIN LATERAL (SELECT
        locked.at AS at,
        locked.at + $4 * interval '1 microsecond' AS lease_end,
        locked.at + greatest($4, $5) * interval '1 microsecond' AS retention_end,
"#,
    claim_action!(),
    r#"
RETURNING coalesce(k.claim_ticket = (SELECT value FROM new_token), false) AS newly_claimed, "#,
    key_columns!("k.")
);

/// TryStart for many keys in one statement: the same table as [`TRY_START`], row by row. Each
/// call draws a ticket, by which the statement recognises its claims. The rows are then
/// inserted in key order (`COLLATE "C"`, the order every statement that locks several keys
/// takes them in), and each row draws its token and reads the clock only when its turn comes,
/// after the rows before it have been inserted or locked (PostgreSQL evaluates the volatile
/// columns above the sort, one row at a time). A row that conflicts is judged, and draws any
/// new token, under its lock. The input carries each call's lease and retention, which the
/// conflict branch looks up by key (keys are distinct within one statement).
const TRY_START_BATCH: &str = concat!(
    r#"
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bigint[], $5::bigint[],
                         $6::text[])
        AS i(namespace, key, fingerprint, lease_us, retention_us, attempt_id)
),
drawn AS MATERIALIZED (
    SELECT i.*, nextval('lease_token_seq') AS ticket FROM input AS i
)
INSERT INTO idempotency_keys AS k
    (namespace, key, fingerprint, lease_token, claim_ticket, attempt, attempt_id,
     lease_expires_at, checkpoint, response, completed_at, retention_us, expires_at)
SELECT r.namespace, r.key, r.fingerprint, r.token, r.ticket, 1, r.attempt_id,
       r.at + r.lease_us * interval '1 microsecond', NULL, NULL, NULL, r.retention_us,
       r.at + greatest(r.lease_us, r.retention_us) * interval '1 microsecond'
FROM (
    SELECT d.*, nextval('lease_token_seq') AS token, clock_timestamp() AS at
    FROM drawn AS d
    ORDER BY d.namespace COLLATE "C", d.key COLLATE "C"
) AS r
ON CONFLICT (namespace, key) DO UPDATE SET
"#,
    claim_assignments!(),
    r#"     FROM (SELECT d.lease_us, d.retention_us FROM drawn AS d
           WHERE d.namespace = excluded.namespace AND d.key = excluded.key) AS p
     CROSS JOIN (SELECT clock_timestamp() AS at) AS locked
     CROSS JOIN LATERAL (SELECT
        locked.at + p.lease_us * interval '1 microsecond' AS lease_end,
        locked.at + greatest(p.lease_us, p.retention_us) * interval '1 microsecond'
            AS retention_end,
"#,
    claim_action!(),
    r#"
RETURNING k.namespace, k.key,
          coalesce(k.claim_ticket = (SELECT d.ticket FROM drawn AS d
                                     WHERE d.namespace = k.namespace AND d.key = k.key),
                   false) AS newly_claimed, "#,
    key_columns!("k.")
);

/// Complete, for one key or many, in one statement that answers every call. The rows are
/// locked in key order before anything is judged; once all are held, the clock is read once
/// (`judged.at`), and each call's key is judged by it: the holder's own in-progress key is
/// completed (stamped with that instant, the checkpoint dropped), and for every other call the
/// row as it stood under the lock comes back, which says why it was refused
/// (`domain::classify_refusal`), so no second statement is needed to explain a refusal.
const COMPLETE: &str = r#"
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[], $5::bigint[])
        WITH ORDINALITY AS i(namespace, key, lease_token, response, retention_us, position)
),
locked AS MATERIALIZED (
    SELECT k.namespace, k.key, k.lease_token, k.completed_at, k.expires_at, k.retention_us,
           k.response
    FROM idempotency_keys AS k
    JOIN input AS i ON k.namespace = i.namespace AND k.key = i.key
    ORDER BY k.namespace COLLATE "C", k.key COLLATE "C"
    FOR UPDATE OF k
),
judged AS MATERIALIZED (
    SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM locked) AS every_lock_held
),
completed AS (
    UPDATE idempotency_keys AS k
    SET (response, completed_at, checkpoint, retention_us, expires_at) =
        (i.response, j.at, NULL::bytea, coalesce(i.retention_us, l.retention_us),
         j.at + coalesce(i.retention_us, l.retention_us) * interval '1 microsecond')
    FROM locked AS l
    JOIN input AS i ON i.namespace = l.namespace AND i.key = l.key
    CROSS JOIN judged AS j
    WHERE k.namespace = l.namespace AND k.key = l.key
      AND l.lease_token = i.lease_token AND l.completed_at IS NULL AND l.expires_at > j.at
    RETURNING k.namespace, k.key, k.completed_at, k.expires_at
)
SELECT c.completed_at AS applied_at,
       c.expires_at AS applied_expires_at,
       coalesce(l.expires_at > j.at, false) AS live,
       l.lease_token,
       l.completed_at,
       l.expires_at,
       coalesce(l.response = i.response, false) AS same_response
FROM input AS i
CROSS JOIN judged AS j
LEFT JOIN locked AS l ON l.namespace = i.namespace AND l.key = i.key
LEFT JOIN completed AS c ON c.namespace = i.namespace AND c.key = i.key
ORDER BY i.position
"#;

/// The key's row, locked before anything is judged. Release and ExtendLease decide on
/// the row this yields, by the clock read after the lock was granted. (A plain `UPDATE … WHERE
/// expires_at > clock_timestamp()` would judge the row while scanning, before waiting for the
/// lock, and keep that verdict when the lock holder leaves the row unchanged.)
macro_rules! locked_key {
    () => {
        r#"WITH locked AS MATERIALIZED (
    SELECT namespace, key, lease_token, completed_at, expires_at, retention_us
    FROM idempotency_keys
    WHERE namespace = $1 AND key = $2
    FOR UPDATE
)
"#
    };
}

/// Read after a guarded write (Release, ExtendLease) changed nothing, to say why. Tokens are
/// never reused and a completed key never returns to progress, so what this finds explains the
/// refusal. No response is offered, so a completed key is never "the same completion".
const GUARD_STATE: &str = r#"
SELECT lease_token, completed_at, expires_at, false AS same_response
FROM idempotency_keys
WHERE namespace = $1 AND key = $2 AND expires_at > now()
"#;

const RELEASE: &str = concat!(
    locked_key!(),
    r#"DELETE FROM idempotency_keys AS k
USING locked AS l
WHERE k.namespace = l.namespace AND k.key = l.key
  AND l.lease_token = $3 AND l.completed_at IS NULL AND l.expires_at > clock_timestamp()
RETURNING k.lease_token
"#
);

/// The lease becomes now + ttl (which may shorten it); retention stretches to cover it.
/// `$5` says whether a checkpoint was sent at all, so that an empty one still replaces.
const EXTEND_LEASE: &str = concat!(
    locked_key!(),
    r#"UPDATE idempotency_keys AS k
SET (lease_expires_at, expires_at, checkpoint) =
    (SELECT c.at + $4 * interval '1 microsecond',
            greatest(l.expires_at, c.at + $4 * interval '1 microsecond'),
            CASE WHEN $5 THEN $6::bytea ELSE k.checkpoint END
     FROM (SELECT clock_timestamp() AS at) AS c)
FROM locked AS l
WHERE k.namespace = l.namespace AND k.key = l.key
  AND l.lease_token = $3 AND l.completed_at IS NULL AND l.expires_at > clock_timestamp()
RETURNING k.lease_expires_at
"#
);

const LOOKUP: &str = concat!(
    "SELECT ",
    key_columns!(""),
    " FROM idempotency_keys WHERE namespace = $1 AND key = $2 AND expires_at > now()"
);

/// MarkProcessed as one statement, for one call or for many: row `i` of the input is event
/// `$2[i]` of consumer `$1[i]`, to be kept for `$3[i]`, and the rows come in call order. Each
/// distinct (consumer, id) is inserted once, with its first occurrence's retention, in sorted
/// order (so concurrent statements lock rows in the same order and do not deadlock); a live row
/// is kept as it is, an expired one is recorded anew. The update always happens so that
/// RETURNING reports every id with the row as it stands under its lock. `mark_batch` tells
/// rows this statement recorded from rows it found; within the statement, only an id's first
/// position counts as new, exactly as if the calls had come one after another.
///
/// Unlike the key statements, expiry is judged by `now()`: a row live at that instant is left
/// untouched and reported as processed, which was true then, so waiting for its lock changes
/// nothing that anyone could have observed in between.
const MARK_PROCESSED: &str = r#"
WITH batch AS (SELECT nextval('mark_batch_seq') AS id),
requested AS (
    SELECT r.consumer COLLATE "C" AS consumer, r.event_id COLLATE "C" AS event_id,
           r.retention_us, r.position
    FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY
        AS r(consumer, event_id, retention_us, position)
),
first_requests AS (
    SELECT DISTINCT ON (consumer, event_id) consumer, event_id, retention_us
    FROM requested
    ORDER BY consumer, event_id, position
),
recorded AS (
    INSERT INTO processed_events AS e (consumer, event_id, processed_at, expires_at, mark_batch)
    SELECT f.consumer, f.event_id, now(), now() + f.retention_us * interval '1 microsecond',
           batch.id
    FROM first_requests AS f CROSS JOIN batch
    ORDER BY f.consumer, f.event_id
    ON CONFLICT (consumer, event_id) DO UPDATE SET
        processed_at = CASE WHEN e.expires_at <= now() THEN excluded.processed_at
                            ELSE e.processed_at END,
        expires_at = CASE WHEN e.expires_at <= now() THEN excluded.expires_at
                          ELSE e.expires_at END,
        mark_batch = CASE WHEN e.expires_at <= now() THEN excluded.mark_batch
                          ELSE e.mark_batch END
    RETURNING e.consumer, e.event_id, e.processed_at,
              e.mark_batch = (SELECT id FROM batch) AS recorded_now
)
SELECT r.event_id,
       rec.processed_at,
       NOT (rec.recorded_now
            AND r.position = min(r.position) OVER (PARTITION BY r.consumer, r.event_id))
           AS already_processed
FROM requested AS r
JOIN recorded AS rec ON rec.consumer = r.consumer AND rec.event_id = r.event_id
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

/// A row of [`COMPLETE`], one per call in call order: the completion if it applied, and
/// otherwise the key as it stood under the lock (all `NULL` if there was no row).
#[derive(FromRow)]
struct CompleteRow {
    applied_at: Option<Instant>,
    applied_expires_at: Option<Instant>,
    live: bool,
    lease_token: Option<i64>,
    completed_at: Option<Instant>,
    expires_at: Option<Instant>,
    same_response: bool,
}

impl CompleteRow {
    /// The call's answer, as the one-key judgement of a guarded write would give it.
    fn answer(self, token: LeaseToken) -> Result<Result<Completion, Rejection>, StoreError> {
        if let (Some(completed_at), Some(expires_at)) = (self.applied_at, self.applied_expires_at) {
            return Ok(Ok(Completion {
                completed_at,
                expires_at,
            }));
        }
        let found = match (self.live, self.lease_token, self.expires_at) {
            (true, Some(lease_token), Some(expires_at)) => Some(GuardedKey {
                lease_token: LeaseToken::from_stored(lease_token),
                completion: self.completed_at.map(|completed_at| Completion {
                    completed_at,
                    expires_at,
                }),
                same_response: self.same_response,
            }),
            _ => None,
        };
        match classify_refusal(found, token) {
            Err(rejection) => Ok(Err(rejection)),
            Ok(Some(completion)) => Ok(Ok(completion)),
            Ok(None) => Err(StoreError::Inconsistent(
                "a Complete was refused to the holder of a live, open key",
            )),
        }
    }
}

#[derive(FromRow)]
struct MarkRow {
    event_id: String,
    processed_at: Instant,
    already_processed: bool,
}

/// How often a guarded write is tried when the read that explains its refusal finds the caller
/// to be the current holder of an in-progress key after all (the key changed in between).
const GUARD_ATTEMPTS: usize = 3;

impl PgStore {
    /// Runs `write` (a statement guarded on the caller's token that answers a row only when it
    /// applied: Release, ExtendLease) and answers that row, or, when it changed nothing, reads
    /// the key to say why. Tokens are never reused
    /// and completed keys never reopen, so what the read finds explains the refusal; should it
    /// find the caller holding an in-progress key after all (which only a token guessed before
    /// it was handed out can cause), the write is tried again.
    async fn guarded_write<T, F, Fut>(
        &self,
        namespace: &str,
        key: &str,
        token: LeaseToken,
        mut write: F,
    ) -> Result<Result<T, Rejection>, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, sqlx::Error>>,
    {
        for _ in 0..GUARD_ATTEMPTS {
            if let Some(applied) = write().await.map_err(classify)? {
                return Ok(Ok(applied));
            }
            let found: Option<GuardRow> = sqlx::query_as(GUARD_STATE)
                .bind(namespace)
                .bind(key)
                .fetch_optional(&self.pool)
                .await
                .map_err(classify)?;
            match classify_refusal(found.map(GuardedKey::from), token) {
                Err(rejection) => return Ok(Err(rejection)),
                // Without an offered response, a completed key is always ALREADY_COMPLETED.
                Ok(Some(_)) => return Ok(Err(Rejection::AlreadyCompleted)),
                Ok(None) => continue,
            }
        }
        Err(StoreError::Inconsistent(
            "a guarded write kept refusing the current holder of an in-progress key",
        ))
    }
}

/// One empty slot per command of a batch.
fn unanswered<T>(count: usize) -> Vec<Option<Result<T, StoreError>>> {
    (0..count).map(|_| None).collect()
}

/// Fills the slots, reporting `missing` for any left empty (a bug).
fn answered<T>(
    results: Vec<Option<Result<T, StoreError>>>,
    missing: &'static str,
) -> Vec<Result<T, StoreError>> {
    results
        .into_iter()
        .map(|result| result.unwrap_or(Err(StoreError::Inconsistent(missing))))
        .collect()
}

/// Answers every command of `members` with `error`.
fn answer_all<T, C>(
    results: &mut [Option<Result<T, StoreError>>],
    members: &[(usize, C)],
    error: StoreError,
) {
    for ((index, _), error) in members.iter().zip(error.for_each_of(members.len())) {
        results[*index] = Some(Err(error));
    }
}

impl Store for PgStore {
    async fn try_start(&self, command: TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        let row: TryStartRow = sqlx::query_as(TRY_START)
            .bind(command.namespace.as_str())
            .bind(command.key.as_str())
            .bind(command.fingerprint.as_bytes())
            .bind(command.lease_ttl.as_micros())
            .bind(command.retention.as_micros())
            .bind(command.attempt_id.as_ref().map(|a| a.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        Ok(TryStartOutcome::from_record(
            row.key.into(),
            row.newly_claimed,
            &command,
        ))
    }

    async fn complete(
        &self,
        command: CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        let mut results = self.complete_batch(vec![command]).await;
        results
            .pop()
            .unwrap_or(Err(StoreError::Inconsistent("a completion was not run")))
    }

    /// One statement per round of distinct keys; the coalescer sends one round at a time, so
    /// that it can check each call's deadline before its statement starts.
    async fn try_start_batch(
        &self,
        commands: Vec<TryStartCommand>,
    ) -> Vec<Result<TryStartOutcome, StoreError>> {
        if commands.len() == 1 {
            // A lone call takes the one-row statement, whose plan is simpler.
            let mut results = Vec::with_capacity(1);
            for command in commands {
                results.push(self.try_start(command).await);
            }
            return results;
        }
        let mut results = unanswered(commands.len());
        for round in rounds(commands, Coalescible::conflict_key) {
            let namespaces: Vec<&str> = round.iter().map(|(_, c)| c.namespace.as_str()).collect();
            let keys: Vec<&str> = round.iter().map(|(_, c)| c.key.as_str()).collect();
            let fingerprints: Vec<&[u8]> = round
                .iter()
                .map(|(_, c)| c.fingerprint.as_bytes())
                .collect();
            let leases: Vec<i64> = round.iter().map(|(_, c)| c.lease_ttl.as_micros()).collect();
            let retentions: Vec<i64> = round.iter().map(|(_, c)| c.retention.as_micros()).collect();
            let attempt_ids: Vec<Option<&str>> = round
                .iter()
                .map(|(_, c)| c.attempt_id.as_ref().map(|a| a.as_str()))
                .collect();
            let rows: Result<Vec<TryStartBatchRow>, StoreError> = sqlx::query_as(TRY_START_BATCH)
                .bind(&namespaces)
                .bind(&keys)
                .bind(&fingerprints)
                .bind(&leases)
                .bind(&retentions)
                .bind(&attempt_ids)
                .fetch_all(&self.pool)
                .await
                .map_err(classify);
            let rows = match rows {
                Ok(rows) => rows,
                Err(error) => {
                    answer_all(&mut results, &round, error);
                    continue;
                }
            };
            let mut by_key: HashMap<(String, String), TryStartBatchRow> = rows
                .into_iter()
                .map(|row| ((row.namespace.clone(), row.key_name.clone()), row))
                .collect();
            for (index, command) in round {
                results[index] = Some(
                    match by_key.remove(&key_id(&command.namespace, &command.key)) {
                        Some(row) => Ok(TryStartOutcome::from_record(
                            row.key.into(),
                            row.newly_claimed,
                            &command,
                        )),
                        None => Err(StoreError::Inconsistent("a batched claim returned no row")),
                    },
                );
            }
        }
        answered(results, "a batched claim was not run")
    }

    /// One statement per round of distinct keys, like [`Self::try_start_batch`], which answers
    /// every call of the round, refusals included.
    async fn complete_batch(
        &self,
        commands: Vec<CompleteCommand>,
    ) -> Vec<Result<Result<Completion, Rejection>, StoreError>> {
        let mut results = unanswered(commands.len());
        for round in rounds(commands, Coalescible::conflict_key) {
            let namespaces: Vec<&str> = round.iter().map(|(_, c)| c.namespace.as_str()).collect();
            let keys: Vec<&str> = round.iter().map(|(_, c)| c.key.as_str()).collect();
            let tokens: Vec<i64> = round.iter().map(|(_, c)| c.lease_token.get()).collect();
            let responses: Vec<&[u8]> = round.iter().map(|(_, c)| c.response.as_bytes()).collect();
            let retentions: Vec<Option<i64>> = round
                .iter()
                .map(|(_, c)| c.retention.map(|r| r.as_micros()))
                .collect();
            let rows: Result<Vec<CompleteRow>, StoreError> = sqlx::query_as(COMPLETE)
                .bind(&namespaces)
                .bind(&keys)
                .bind(&tokens)
                .bind(&responses)
                .bind(&retentions)
                .fetch_all(&self.pool)
                .await
                .map_err(classify);
            match rows {
                Ok(rows) if rows.len() == round.len() => {
                    for ((index, command), row) in round.into_iter().zip(rows) {
                        results[index] = Some(row.answer(command.lease_token));
                    }
                }
                Ok(_) => answer_all(
                    &mut results,
                    &round,
                    StoreError::Inconsistent(
                        "a Complete statement did not answer one row per call",
                    ),
                ),
                Err(error) => answer_all(&mut results, &round, error),
            }
        }
        answered(results, "a batched completion was not run")
    }

    async fn release(&self, command: ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        let outcome = self
            .guarded_write(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                || {
                    sqlx::query_as::<_, (i64,)>(RELEASE)
                        .bind(command.namespace.as_str())
                        .bind(command.key.as_str())
                        .bind(command.lease_token.get())
                        .fetch_optional(&self.pool)
                },
            )
            .await?;
        Ok(outcome.map(drop))
    }

    async fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        let checkpoint = command.checkpoint.as_ref().map(|c| c.as_bytes());
        let outcome = self
            .guarded_write(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                || {
                    sqlx::query_as::<_, (Instant,)>(EXTEND_LEASE)
                        .bind(command.namespace.as_str())
                        .bind(command.key.as_str())
                        .bind(command.lease_token.get())
                        .bind(command.lease_ttl.as_micros())
                        .bind(checkpoint.is_some())
                        .bind(checkpoint)
                        .fetch_optional(&self.pool)
                },
            )
            .await?;
        Ok(outcome.map(|(lease_expires_at,)| lease_expires_at))
    }

    async fn lookup(&self, query: LookupQuery) -> Result<KeyState, StoreError> {
        let row: Option<KeyRow> = sqlx::query_as(LOOKUP)
            .bind(query.namespace.as_str())
            .bind(query.key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(classify)?;
        Ok(KeyState::of(row.map(KeyRecord::from)))
    }

    async fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        let mut results = self.mark_processed_batch(vec![command]).await;
        results
            .pop()
            .unwrap_or(Err(StoreError::Inconsistent("a mark was not run")))
    }

    /// Every call in one statement: their ids in call order, so that an id two calls carry is
    /// new for the first and already processed for the second, exactly as one after another;
    /// the rows are then handed back call by call.
    async fn mark_processed_batch(
        &self,
        commands: Vec<MarkProcessedCommand>,
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        let total: usize = commands.iter().map(|c| c.event_ids.len()).sum();
        let mut consumers: Vec<&str> = Vec::with_capacity(total);
        let mut ids: Vec<&str> = Vec::with_capacity(total);
        let mut retentions: Vec<i64> = Vec::with_capacity(total);
        for command in &commands {
            for id in &command.event_ids {
                consumers.push(command.consumer.as_str());
                ids.push(id.as_str());
                retentions.push(command.retention.as_micros());
            }
        }
        let rows: Result<Vec<MarkRow>, StoreError> = sqlx::query_as(MARK_PROCESSED)
            .bind(&consumers)
            .bind(&ids)
            .bind(&retentions)
            .fetch_all(&self.pool)
            .await
            .map_err(classify);
        match rows {
            Ok(rows) if rows.len() == total => {
                let mut rows = rows.into_iter().map(|row| ProcessedEvent {
                    event_id: row.event_id,
                    already_processed: row.already_processed,
                    processed_at: row.processed_at,
                });
                commands
                    .iter()
                    .map(|command| Ok(rows.by_ref().take(command.event_ids.len()).collect()))
                    .collect()
            }
            Ok(_) => commands
                .iter()
                .map(|_| {
                    Err(StoreError::Inconsistent(
                        "a statement of marks returned a row count unlike its ids",
                    ))
                })
                .collect(),
            Err(error) => error
                .for_each_of(commands.len())
                .into_iter()
                .map(Err)
                .collect(),
        }
    }

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = sqlx::query_as(REAP_KEYS)
            .bind(i64::from(limit))
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
        Ok(deleted.unsigned_abs())
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = sqlx::query_as(REAP_EVENTS)
            .bind(i64::from(limit))
            .fetch_one(&self.pool)
            .await
            .map_err(classify)?;
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
        // A connection of its own, without the statement timeout: a migration may take long.
        let connection = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(PgConnectOptions::clone(&self.migration_options))
            .await
            .map_err(classify)?;
        let migrated = MIGRATOR.run(&connection).await;
        connection.close().await;
        migrated.map_err(|error| match error {
            sqlx::migrate::MigrateError::Execute(inner) => classify(inner),
            other => StoreError::Migration(other),
        })
    }

    async fn probe(&self) -> Result<(), StoreError> {
        let (version,): (i64,) = sqlx::query_as(SCHEMA_VERSION)
            .fetch_one(&self.probe_pool)
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
        self.probe_pool.close().await;
        self.pool.close().await;
    }
}
