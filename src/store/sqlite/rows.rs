//! Rows as the SQLite store keeps them (instants as integer microseconds since the epoch), and
//! what they mean in the domain.

use sqlx::FromRow;

use crate::domain::{Instant, KeyRecord, LeaseToken};
use crate::store::schema::{StoredInstant, attempt_number, stored_duration};

pub(super) fn instant(micros: i64) -> Instant {
    micros.into_instant()
}

pub(super) fn micros(instant: Instant) -> i64 {
    instant.timestamp_micros()
}

pub(super) fn duration_micros(duration: std::time::Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

#[derive(FromRow)]
pub(super) struct KeyRow {
    pub(super) fingerprint: Vec<u8>,
    pub(super) lease_token: i64,
    pub(super) attempt: i64,
    pub(super) attempt_id: Option<String>,
    pub(super) lease_expires_at: i64,
    pub(super) checkpoint: Option<Vec<u8>>,
    pub(super) response: Option<Vec<u8>>,
    pub(super) completed_at: Option<i64>,
    pub(super) retention_us: i64,
    pub(super) expires_at: i64,
}

impl From<KeyRow> for KeyRecord {
    fn from(row: KeyRow) -> Self {
        Self {
            fingerprint: row.fingerprint,
            lease_token: LeaseToken::from_stored(row.lease_token),
            attempt: attempt_number(row.attempt),
            attempt_id: row.attempt_id,
            lease_expires_at: instant(row.lease_expires_at),
            checkpoint: row.checkpoint,
            response: row.response,
            completed_at: row.completed_at.map(instant),
            retention: stored_duration(row.retention_us),
            expires_at: instant(row.expires_at),
        }
    }
}

#[derive(FromRow)]
pub(super) struct EventRow {
    pub(super) processed_at: i64,
    pub(super) expires_at: i64,
}
