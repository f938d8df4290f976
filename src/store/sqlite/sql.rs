//! Every statement of the SQLite store.

/// Now, from SQLite's clock, in whole microseconds (SQLite reads the clock to the millisecond;
/// `julianday` works on every SQLite version, unlike `unixepoch('subsec')`).
macro_rules! now_us {
    () => {
        "(CAST(round((julianday('now') - 2440587.5) * 86400000) AS INTEGER) * 1000)"
    };
}

macro_rules! select_key {
    () => {
        "SELECT fingerprint, lease_token, attempt, attempt_id, lease_expires_at, checkpoint,
                response, completed_at, retention_us, expires_at
         FROM idempotency_keys
         WHERE namespace = ?1 AND key = ?2"
    };
}

pub(super) const SELECT_KEY: &str = select_key!();

/// A key's row if it is live by SQLite's clock at the moment of the read.
pub(super) const LOOKUP_LIVE_KEY: &str = concat!(select_key!(), " AND expires_at > ", now_us!());

/// Writes a key's whole state, replacing whatever row (live or expired) the key had.
pub(super) const UPSERT_KEY: &str = "
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

/// A claim's record ([`UPSERT_KEY`]'s columns), with the claim's time `?13` and holder `?14`.
pub(super) const UPSERT_CLAIMED_KEY: &str = "
INSERT INTO idempotency_keys
    (namespace, key, fingerprint, lease_token, attempt, attempt_id, lease_expires_at,
     checkpoint, response, completed_at, retention_us, expires_at, claimed_at, holder)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)
ON CONFLICT (namespace, key) DO UPDATE SET
    fingerprint = excluded.fingerprint, lease_token = excluded.lease_token,
    attempt = excluded.attempt, attempt_id = excluded.attempt_id,
    lease_expires_at = excluded.lease_expires_at, checkpoint = excluded.checkpoint,
    response = excluded.response, completed_at = excluded.completed_at,
    retention_us = excluded.retention_us, expires_at = excluded.expires_at,
    claimed_at = excluded.claimed_at, holder = excluded.holder";

pub(super) const NEXT_TOKEN: &str = "UPDATE lease_token_seq SET last_value = last_value + 1 WHERE only_row = 1 RETURNING last_value";

pub(super) const REAP_KEYS: &str = concat!(
    "DELETE FROM idempotency_keys WHERE rowid IN (
         SELECT rowid FROM idempotency_keys WHERE expires_at <= ",
    now_us!(),
    " ORDER BY expires_at LIMIT ?1)"
);

pub(super) const REAP_EVENTS: &str = concat!(
    "DELETE FROM processed_events WHERE (consumer, event_id) IN (
         SELECT consumer, event_id FROM processed_events WHERE expires_at <= ",
    now_us!(),
    " ORDER BY expires_at LIMIT ?1)"
);

/// The event's row, to tell a live processing from an expired one.
pub(super) const SELECT_EVENT: &str = "SELECT processed_at, expires_at FROM processed_events
    WHERE consumer = ?1 AND event_id = ?2";

/// Records an event's processing, replacing an expired row.
pub(super) const UPSERT_EVENT: &str = "
INSERT INTO processed_events (consumer, event_id, processed_at, expires_at)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (consumer, event_id) DO UPDATE SET
    processed_at = excluded.processed_at,
    expires_at = excluded.expires_at";

pub(super) const DELETE_KEY: &str =
    "DELETE FROM idempotency_keys WHERE namespace = ?1 AND key = ?2";

/// SQLite's clock, in whole microseconds.
pub(super) const NOW: &str = concat!("SELECT ", now_us!());

/// The reaper's lag: how long ago the oldest expired row of each table expired, in
/// microseconds (0 when none is), from each table's `expires_at` index.
pub(super) const EXPIRED_BACKLOG: &str = concat!(
    "SELECT coalesce(",
    now_us!(),
    " - (SELECT min(expires_at) FROM idempotency_keys WHERE expires_at <= ",
    now_us!(),
    "), 0), coalesce(",
    now_us!(),
    " - (SELECT min(expires_at) FROM processed_events WHERE expires_at <= ",
    now_us!(),
    "), 0)"
);

// The admin API: the same statements as the PostgreSQL store's (see there), on the indexes of
// `migrations/sqlite/20261204000001_admin.sql`. Changes are read, decided and written in the
// writer's transaction, like the contract's operations.

/// A key's state code now, as PostgreSQL's `state_code!` (released: 4, before stuck).
macro_rules! state_code {
    () => {
        concat!(
            "CASE WHEN completed_at IS NOT NULL THEN 3 \
             WHEN released_token = lease_token THEN 4 WHEN lease_expires_at <= ",
            now_us!(),
            " THEN 2 ELSE 1 END"
        )
    };
}

/// The columns of an admin key row: a key's summary (sizes, not bytes) and its state now.
macro_rules! summary_columns {
    () => {
        concat!(
            "key, ",
            state_code!(),
            " AS state_code, attempt, lease_token, attempt_id, \
             lease_expires_at, completed_at, expires_at, retention_us, fingerprint, \
             coalesce(length(response), 0) AS response_bytes, \
             length(checkpoint) AS checkpoint_bytes, claimed_at, holder, released_by, \
             released_at"
        )
    };
}

/// Not released by an operator since its last claim.
macro_rules! not_released {
    () => {
        " AND released_token IS NOT lease_token"
    };
}

pub(super) const LIST_KEYS_BY_KEY: &str = concat!(
    "SELECT ",
    summary_columns!(),
    " FROM idempotency_keys
WHERE namespace = ?1 AND key >= ?2 AND key > ?3 AND key < ?4 AND expires_at > ",
    now_us!(),
    " AND (?5 = 0 OR ?5 = ",
    state_code!(),
    ")
  AND (?6 IS NULL OR completed_at >= ?6) AND (?7 IS NULL OR completed_at < ?7)
  AND (?8 IS NULL OR (completed_at IS NULL AND claimed_at >= ?8))
  AND (?9 IS NULL OR (completed_at IS NULL AND claimed_at < ?9))
ORDER BY key
LIMIT ?10"
);

/// Claimed at or after `?4`, before `?5` (NULL: unbounded).
macro_rules! claimed_between {
    () => {
        " AND (?4 IS NULL OR claimed_at >= ?4) AND (?5 IS NULL OR claimed_at < ?5)"
    };
}

/// Keys of namespace ?1 in progress and live, whose lease `$lease` selects (a condition and
/// its ` AND `, or nothing) and that `$which` selects (appended to the `WHERE`), after (?2, ?3)
/// in (lease_expires_at, key) order, claimed between ?4 and ?5; at most ?6.
macro_rules! held_keys {
    ($lease:expr, $which:expr) => {
        concat!(
            "SELECT ",
            summary_columns!(),
            " FROM idempotency_keys
WHERE namespace = ?1 AND completed_at IS NULL AND (lease_expires_at, key) > (?2, ?3)
  AND ",
            $lease,
            "expires_at > ",
            now_us!(),
            $which,
            claimed_between!(),
            " ORDER BY lease_expires_at, key LIMIT ?6"
        )
    };
}

/// [`held_keys!`] of the keys whose lease has run out.
macro_rules! run_out_keys {
    ($which:expr) => {
        held_keys!(concat!("lease_expires_at <= ", now_us!(), " AND "), $which)
    };
}

/// Stuck: not released by an operator.
pub(super) const LIST_STUCK_KEYS: &str = run_out_keys!(not_released!());

/// Released by an operator and not claimed since.
pub(super) const LIST_RELEASED_KEYS: &str = run_out_keys!(" AND released_token = lease_token");

/// Every key in progress, stuck and live.
pub(super) const LIST_HELD_KEYS: &str = held_keys!("", "");

pub(super) const LIST_IN_PROGRESS_KEYS: &str =
    held_keys!(concat!("lease_expires_at > ", now_us!(), " AND "), "");

pub(super) const LIST_COMPLETED_KEYS: &str = concat!(
    "SELECT ",
    summary_columns!(),
    " FROM idempotency_keys
WHERE namespace = ?1 AND completed_at IS NOT NULL AND (completed_at, key) > (?2, ?3)
  AND completed_at >= ?4 AND completed_at < ?5 AND expires_at > ",
    now_us!(),
    " ORDER BY completed_at, key LIMIT ?6"
);

pub(super) const GET_KEY: &str = concat!(
    "SELECT ",
    summary_columns!(),
    ", response, checkpoint FROM idempotency_keys WHERE namespace = ?1 AND key = ?2 \
     AND expires_at > ",
    now_us!()
);

/// A key's row in whatever state (expired included), with `live`.
pub(super) const GET_ANY_KEY: &str = concat!(
    "SELECT ",
    summary_columns!(),
    ", expires_at > ",
    now_us!(),
    " AS live FROM idempotency_keys WHERE namespace = ?1 AND key = ?2"
);

pub(super) const NAMESPACE_STATS: &str = concat!(
    "SELECT
    coalesce(sum(completed_at IS NULL AND lease_expires_at > ",
    now_us!(),
    not_released!(),
    "), 0) AS in_progress,
    coalesce(sum(completed_at IS NULL AND lease_expires_at <= ",
    now_us!(),
    not_released!(),
    "), 0) AS stuck,
    coalesce(sum(completed_at IS NULL AND released_token = lease_token), 0) AS released,
    coalesce(sum(completed_at IS NOT NULL), 0) AS completed,
    coalesce(sum(length(CAST(key AS BLOB)) + length(fingerprint) + coalesce(length(response), 0)
                 + coalesce(length(checkpoint), 0)), 0) AS stored_bytes,
    (SELECT count(*) FROM processed_events WHERE consumer = ?1 AND expires_at > ",
    now_us!(),
    ") AS processed_events,
    (SELECT key FROM idempotency_keys AS s WHERE s.namespace = ?1 AND s.completed_at IS NULL
       AND s.lease_expires_at <= ",
    now_us!(),
    " AND s.expires_at > ",
    now_us!(),
    " AND s.released_token IS NOT s.lease_token ORDER BY s.lease_expires_at, s.key LIMIT 1) AS oldest_stuck_key,
    (SELECT lease_expires_at FROM idempotency_keys AS s WHERE s.namespace = ?1
       AND s.completed_at IS NULL AND s.lease_expires_at <= ",
    now_us!(),
    " AND s.expires_at > ",
    now_us!(),
    " AND s.released_token IS NOT s.lease_token ORDER BY s.lease_expires_at, s.key LIMIT 1) AS oldest_stuck_at,
    ",
    now_us!(),
    " AS read_at
FROM idempotency_keys WHERE namespace = ?1 AND expires_at > ",
    now_us!()
);

pub(super) const STUCK_KEYS: &str = concat!(
    "SELECT count(*), coalesce(",
    now_us!(),
    " - min(lease_expires_at), 0) FROM idempotency_keys
WHERE completed_at IS NULL AND lease_expires_at <= ",
    now_us!(),
    " AND expires_at > ",
    now_us!(),
    not_released!()
);

/// At most `?2` keys of namespace `?1` after key `?3` (`''`: from the start), in key order, like
/// PostgreSQL's batch; answers the keys it deleted.
pub(super) const ERASE_KEYS_BATCH: &str = "DELETE FROM idempotency_keys WHERE rowid IN (
    SELECT rowid FROM idempotency_keys WHERE namespace = ?1 AND key > ?3 ORDER BY key LIMIT ?2)
RETURNING key";

pub(super) const ERASE_EVENTS_BATCH: &str = "DELETE FROM processed_events
WHERE consumer = ?1 AND event_id IN (
    SELECT event_id FROM processed_events WHERE consumer = ?1 AND event_id > ?3
    ORDER BY event_id LIMIT ?2)
RETURNING event_id";

pub(super) const NAMESPACE_HAS_ROWS: &str = "SELECT
    EXISTS (SELECT 1 FROM idempotency_keys WHERE namespace = ?1)
    OR EXISTS (SELECT 1 FROM processed_events WHERE consumer = ?1)";

pub(super) const RECORD_AUDIT: &str = concat!(
    "INSERT INTO admin_audit_events
    (at, actor, action, namespace, key, reason, record_before, outcome, expires_at)
VALUES (",
    now_us!(),
    ", ?1, ?2, ?3, ?4, ?5, ?6, ?7, ",
    now_us!(),
    " + ?8) RETURNING id"
);

pub(super) const LIST_AUDIT: &str = concat!(
    "SELECT id, at, actor, action, namespace, key, reason, record_before, outcome
FROM admin_audit_events
WHERE namespace = ?1 AND id < ?2 AND (?4 IS NULL OR key = ?4) AND (?5 IS NULL OR actor = ?5)
  AND expires_at > ",
    now_us!(),
    " ORDER BY id DESC LIMIT ?3"
);

pub(super) const REAP_AUDIT: &str = concat!(
    "DELETE FROM admin_audit_events WHERE id IN (
         SELECT id FROM admin_audit_events WHERE expires_at <= ",
    now_us!(),
    " ORDER BY expires_at LIMIT ?1)"
);

/// ForceRelease (see the PostgreSQL store's): key `?1`, `?2` gets token `?3`, which nobody
/// holds, no attempt_id, and its lease ended by `?4` at the latest; released by `?5` at `?4`.
pub(super) const REVOKE_LEASE: &str = "UPDATE idempotency_keys
SET lease_token = ?3, attempt_id = NULL, lease_expires_at = min(lease_expires_at, ?4),
    holder = NULL, released_token = ?3, released_by = ?5, released_at = ?4
WHERE namespace = ?1 AND key = ?2";
