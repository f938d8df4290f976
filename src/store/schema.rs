//! What both backends do alike: the schema version they require and how they probe it, how a
//! failed migration is reported, and how stored numbers and key rows become domain values.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::FromRow;
use sqlx::migrate::{MigrateError, Migrator};

use super::StoreError;
use crate::domain::{Instant, KeyRecord, LeaseToken};

/// The newest applied migration, from sqlx's own table (the same in both backends).
pub const SCHEMA_VERSION: &str =
    "SELECT coalesce(max(version), 0) FROM _sqlx_migrations WHERE success";

/// Fails with [`StoreError::NotMigrated`] unless `found` is at least the newest migration
/// `migrator` carries.
pub fn require_version(migrator: &Migrator, found: i64) -> Result<(), StoreError> {
    let required = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    if found < required {
        return Err(StoreError::NotMigrated(format!(
            "schema version {found}, this build needs {required}"
        )));
    }
    Ok(())
}

/// A failed migration: a statement the database refused is sorted like any other (`classify`),
/// anything else (a changed or missing migration) is a migration error.
pub fn migration_error(error: MigrateError, classify: fn(sqlx::Error) -> StoreError) -> StoreError {
    match error {
        MigrateError::Execute(inner) | MigrateError::ExecuteMigration(inner, _) => classify(inner),
        other => StoreError::Migration(other),
    }
}

/// Stored attempts start at 1 and grow by one per takeover.
pub fn attempt_number(stored: i64) -> u32 {
    u32::try_from(stored).unwrap_or(0)
}

/// A duration stored as whole microseconds.
pub fn stored_duration(micros: i64) -> Duration {
    Duration::from_micros(micros.unsigned_abs())
}

/// An instant as a store keeps it: PostgreSQL decodes its `timestamptz` columns as instants
/// already, SQLite keeps integer microseconds since the epoch. The rows both stores share are
/// generic over it, so that each decodes its own columns and the meaning is written once.
pub trait StoredInstant {
    fn into_instant(self) -> Instant;
}

impl StoredInstant for Instant {
    fn into_instant(self) -> Instant {
        self
    }
}

impl StoredInstant for i64 {
    /// Microseconds beyond what an instant can hold (never written by the store) read as the
    /// least instant rather than failing the whole row.
    fn into_instant(self) -> Instant {
        DateTime::from_timestamp_micros(self).unwrap_or(DateTime::<Utc>::MIN_UTC)
    }
}

/// A key's row, as every statement of either store that reads one returns it: `At` is how the
/// store keeps an instant ([`StoredInstant`]), `Attempt` its attempt column (PostgreSQL's is
/// `int4`, SQLite's an integer).
#[derive(FromRow)]
pub struct KeyRow<At, Attempt> {
    pub lease_token: i64,
    pub attempt: Attempt,
    pub attempt_id: Option<String>,
    pub lease_expires_at: At,
    pub fingerprint: Vec<u8>,
    pub checkpoint: Option<Vec<u8>>,
    pub response: Option<Vec<u8>>,
    pub completed_at: Option<At>,
    pub retention_us: i64,
    pub expires_at: At,
}

impl<At: StoredInstant, Attempt: Into<i64>> From<KeyRow<At, Attempt>> for KeyRecord {
    fn from(row: KeyRow<At, Attempt>) -> Self {
        Self {
            fingerprint: row.fingerprint,
            lease_token: LeaseToken::from_stored(row.lease_token),
            attempt: attempt_number(row.attempt.into()),
            attempt_id: row.attempt_id,
            lease_expires_at: row.lease_expires_at.into_instant(),
            checkpoint: row.checkpoint,
            response: row.response,
            completed_at: row.completed_at.map(StoredInstant::into_instant),
            retention: stored_duration(row.retention_us),
            expires_at: row.expires_at.into_instant(),
        }
    }
}
