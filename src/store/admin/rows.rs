//! The admin API's rows, as both stores' statements return them (the same columns under the
//! same names), and what they mean in the domain: decoded once here. Each store names its own
//! column types: `At`, how it keeps an instant ([`StoredInstant`]), and `Attempt`, its attempt
//! column (PostgreSQL's is `int4`, SQLite's an integer).

use sqlx::FromRow;

use crate::domain::LeaseToken;
use crate::domain::admin::{
    AdminKeyState, AuditEvent, FullKey, KeyFilter, KeySummary, NamespaceStats, StuckSummary,
};
use crate::store::StoreError;
use crate::store::schema::{StoredInstant, attempt_number, stored_duration};

/// Greater than every key (at most 255 bytes of UTF-8): 64 times the greatest character.
fn beyond_every_key() -> String {
    "\u{10FFFF}".repeat(64)
}

/// The keys a listing in key order reads, from (inclusive) and until (exclusive): the
/// prefix's part of the index, or the whole of it without a prefix.
pub(in crate::store) fn key_range(filter: &KeyFilter) -> (&str, String) {
    let from = filter.key_prefix.as_ref().map_or("", |p| p.as_str());
    let until = filter
        .key_prefix
        .as_ref()
        .and_then(|p| p.upper_bound())
        .unwrap_or_else(beyond_every_key);
    (from, until)
}

/// A count the database answers as a (never negative) bigint.
pub(in crate::store) fn count(value: i64) -> u64 {
    value.unsigned_abs()
}

/// The stuck keys' gauges from `STUCK_KEYS`: how many, and the oldest's age in microseconds.
pub(in crate::store) fn stuck_summary((stuck, oldest_us): (i64, i64)) -> StuckSummary {
    StuckSummary {
        count: count(stuck),
        oldest: stored_duration(oldest_us),
    }
}

/// A key as the listings, the forced release and the erasure return it.
#[derive(FromRow)]
pub(in crate::store) struct AdminKeyRow<At, Attempt> {
    key: String,
    state_code: i64,
    attempt: Attempt,
    lease_token: i64,
    attempt_id: Option<String>,
    lease_expires_at: At,
    completed_at: Option<At>,
    expires_at: At,
    retention_us: i64,
    fingerprint: Vec<u8>,
    response_bytes: i64,
    checkpoint_bytes: Option<i64>,
    claimed_at: Option<At>,
    holder: Option<String>,
    released_by: Option<String>,
    released_at: Option<At>,
}

impl<At: StoredInstant, Attempt: Into<i64>> TryFrom<AdminKeyRow<At, Attempt>> for KeySummary {
    type Error = StoreError;

    fn try_from(row: AdminKeyRow<At, Attempt>) -> Result<Self, StoreError> {
        let state = AdminKeyState::from_code(row.state_code)
            .ok_or(StoreError::Inconsistent("a key's state code is unknown"))?;
        // Who released it says something only while the key is released: once claimed again,
        // the columns describe an earlier claim.
        let released = match state {
            AdminKeyState::Released => row
                .released_by
                .zip(row.released_at.map(StoredInstant::into_instant)),
            _ => None,
        };
        Ok(Self {
            key: row.key,
            state,
            attempt: attempt_number(row.attempt.into()),
            lease_token: LeaseToken::from_stored(row.lease_token),
            attempt_id: row.attempt_id,
            lease_expires_at: row.lease_expires_at.into_instant(),
            completed_at: row.completed_at.map(StoredInstant::into_instant),
            expires_at: row.expires_at.into_instant(),
            retention: stored_duration(row.retention_us),
            fingerprint: row.fingerprint,
            response_bytes: count(row.response_bytes),
            checkpoint_bytes: row.checkpoint_bytes.map(count),
            claimed_at: row.claimed_at.map(StoredInstant::into_instant),
            holder: row.holder,
            released,
        })
    }
}

/// A key with its stored response and checkpoint (`GET_KEY`).
#[derive(FromRow)]
pub(in crate::store) struct FullKeyRow<At, Attempt> {
    #[sqlx(flatten)]
    summary: AdminKeyRow<At, Attempt>,
    response: Option<Vec<u8>>,
    checkpoint: Option<Vec<u8>>,
}

impl<At: StoredInstant, Attempt: Into<i64>> TryFrom<FullKeyRow<At, Attempt>> for FullKey {
    type Error = StoreError;

    fn try_from(row: FullKeyRow<At, Attempt>) -> Result<Self, StoreError> {
        Ok(Self {
            summary: row.summary.try_into()?,
            response: row.response,
            checkpoint: row.checkpoint,
        })
    }
}

/// A namespace's numbers (`NAMESPACE_STATS`).
#[derive(FromRow)]
pub(in crate::store) struct StatsRow<At> {
    in_progress: i64,
    stuck: i64,
    released: i64,
    completed: i64,
    stored_bytes: i64,
    processed_events: i64,
    oldest_stuck_key: Option<String>,
    oldest_stuck_at: Option<At>,
    read_at: At,
}

impl<At: StoredInstant> From<StatsRow<At>> for NamespaceStats {
    fn from(row: StatsRow<At>) -> Self {
        Self {
            in_progress: count(row.in_progress),
            stuck: count(row.stuck),
            released: count(row.released),
            completed: count(row.completed),
            processed_events: count(row.processed_events),
            oldest_stuck: row
                .oldest_stuck_key
                .zip(row.oldest_stuck_at.map(StoredInstant::into_instant)),
            stored_bytes: count(row.stored_bytes),
            read_at: row.read_at.into_instant(),
        }
    }
}

/// An audit event (`LIST_AUDIT`).
#[derive(FromRow)]
pub(in crate::store) struct AuditRow<At> {
    id: i64,
    at: At,
    actor: String,
    action: String,
    namespace: String,
    key: Option<String>,
    reason: String,
    record_before: Option<String>,
    outcome: Option<String>,
}

impl<At: StoredInstant> From<AuditRow<At>> for AuditEvent {
    fn from(row: AuditRow<At>) -> Self {
        Self {
            id: row.id,
            at: row.at.into_instant(),
            actor: row.actor,
            action: row.action,
            namespace: row.namespace,
            key: row.key,
            reason: row.reason,
            record_before_json: row.record_before,
            outcome_json: row.outcome,
        }
    }
}
