//! PostgreSQL's failures, sorted by SQLSTATE into what a caller can act on.

use crate::store::StoreError;

/// Sorts a driver error into what a caller can act on, by SQLSTATE, never by message text.
///
/// A statement that waited for a row past its `lock_timeout` is [`StoreError::KeyHeld`]: the
/// service runs its call again alone, patiently (`service::held_keys`).
///
/// A statement PostgreSQL aborted (a deadlock it broke, its `statement_timeout`) wrote nothing
/// and is reported as such (UNAVAILABLE). No statement is tried again: a second one would need
/// a second budget and could commit after the caller was told it timed out. Every statement
/// that locks several rows locks them in one order, so deadlocks do not arise between them.
pub(super) fn classify(error: sqlx::Error) -> StoreError {
    let unavailable = match &error {
        // The server (or a proxy before it, HAProxy with no healthy node) closed the connection
        // before answering the TLS request that sslmode's negotiation sends first: the driver
        // reads the missing answer as a byte it does not expect.
        sqlx::Error::Protocol(_) if tls_request_unanswered(&error) => true,
        sqlx::Error::Configuration(_) if super::statements::is_not_sent(&error) => true,
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // lock_not_available: a row was held past the statement's lock budget.
        sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03") => {
            return StoreError::KeyHeld {
                shared: false,
                cause: error,
            };
        }
        // The placement gate: this cluster does not serve the namespace (a move's).
        sqlx::Error::Database(db) if db.code().as_deref() == Some("IDM01") => {
            let detail = db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|pg| pg.detail())
                .and_then(crate::store::Gate::from_detail);
            return match detail {
                Some(gate) => StoreError::Placed(gate),
                None => StoreError::Internal(error),
            };
        }
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            match code.as_ref() {
                // undefined_table, undefined_column, undefined_object, undefined_function,
                // invalid_schema_name: the schema is not (fully) migrated yet.
                "42P01" | "42703" | "42704" | "42883" | "3F000" => {
                    return StoreError::NotMigrated(db.message().to_owned());
                }
                // read_only_sql_transaction: a standby, or a primary demoted under the session
                // (nothing was written; the store looks for the writable host).
                "25006" => true,
                // query_canceled (our statement_timeout), serialization_failure,
                // deadlock_detected, invalid_catalog_name (the database is not created yet),
                // authentication failures.
                "57014" | "40001" | "40P01" | "3D000" | "28000" | "28P01" => true,
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

/// Whether `error` is the driver's report that the server's answer to the TLS request (the
/// first thing a connection sends under sslmode prefer and up) was not `S` or `N`: a connection
/// closed before it could answer (read as 0x00), or a server that failed before the start-up.
pub(super) fn tls_request_unanswered(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Protocol(text) if text.starts_with("unexpected response from SSLRequest"))
}
