//! SQLite's failures, sorted by result code into what a caller can act on.

use crate::store::StoreError;

/// Sorts a driver error by SQLite's result code (never by message text).
pub(super) fn classify(error: sqlx::Error) -> StoreError {
    let unavailable = match &error {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => {
            let code: i32 = db.code().and_then(|c| c.parse().ok()).unwrap_or(0);
            // The primary code is the low byte of an extended one. BUSY, LOCKED, NOMEM,
            // READONLY, IOERR, FULL, CANTOPEN, PROTOCOL: the file is busy or unreachable.
            matches!(code & 0xff, 5 | 6 | 7 | 8 | 10 | 13 | 14 | 15)
        }
        _ => false,
    };
    if unavailable {
        StoreError::Unavailable(error)
    } else {
        StoreError::Internal(error)
    }
}
