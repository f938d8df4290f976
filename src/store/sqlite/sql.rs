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
