//! Rows as the SQLite store keeps them (instants as integer microseconds since the epoch), and
//! what they mean in the domain.

use sqlx::FromRow;

use crate::domain::Instant;
use crate::store::schema::{self, StoredInstant};

pub(super) fn instant(micros: i64) -> Instant {
    micros.into_instant()
}

pub(super) fn micros(instant: Instant) -> i64 {
    instant.timestamp_micros()
}

pub(super) fn duration_micros(duration: std::time::Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// A key's row as SQLite keeps it: instants and attempts as integers.
pub(super) type KeyRow = schema::KeyRow<i64, i64>;

#[derive(FromRow)]
pub(super) struct EventRow {
    pub(super) processed_at: i64,
    pub(super) expires_at: i64,
}
