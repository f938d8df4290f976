//! What both backends do alike: the schema version they require and how they probe it, how a
//! failed migration is reported, and how stored numbers become domain values.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::migrate::{MigrateError, Migrator};

use super::StoreError;
use crate::domain::Instant;

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
