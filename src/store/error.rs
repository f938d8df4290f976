use std::time::Duration;

/// A store failure. Callers see only whether it is worth retrying; the cause goes to the log.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached, refused the work for now (too many connections, shutting
    /// down, a deadlock it broke), or cancelled it at its own timeout.
    #[error("the store is unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// The store's own share of the time budget ran out before the statement could commit,
    /// and nothing was written (SQLite's deadline before commit).
    #[error("the store did not finish within {0:?}")]
    TimedOut(Duration),
    /// The health probe's write did not commit within its bound (a commit waiting for a
    /// synchronous standby that is gone, a host that stopped answering).
    #[error("a write did not commit within {0:?}")]
    WritesStalled(Duration),
    /// The store answers but is not fit to serve as configured (no synchronous standby with
    /// `--require-synchronous-standby`).
    #[error("{0}")]
    Unready(String),
    /// No connection to the database could be opened: which host, and why (refused, an unknown
    /// host, TLS, the password, `pg_hba.conf`), in an operator's words.
    #[error("{0}")]
    Unreachable(crate::store::postgres::ConnectFailure),
    /// The schema is missing or older than this build.
    #[error("the store's schema is not migrated: {0}")]
    NotMigrated(String),
    /// Migrations could not be applied.
    #[error("migrating the store failed")]
    Migration(#[source] sqlx::migrate::MigrateError),
    /// Anything else the driver reports: a bug, or a store this build does not expect.
    #[error("unexpected store failure")]
    Internal(#[source] sqlx::Error),
    /// The store answered something the contract rules out.
    #[error("the store is in a state this build does not expect: {0}")]
    Inconsistent(&'static str),
    /// A row the statement needed was locked by another transaction for longer than the
    /// statement's lock budget, and the statement wrote nothing. `shared`: the statement carried
    /// other calls too, so the held row may be another call's, not this one's.
    #[error("a key the statement needed is held by another transaction")]
    KeyHeld {
        shared: bool,
        #[source]
        cause: sqlx::Error,
    },
    /// The cluster asked does not serve the namespace (a move's gate): nothing was read or
    /// written, and the gate names the cluster to ask.
    #[error("{0}")]
    Placed(crate::store::Gate),
    /// One failure shared by every command of a batch.
    #[error(transparent)]
    Shared(std::sync::Arc<StoreError>),
}

impl StoreError {
    /// Whether a caller may expect the same call to succeed later.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unavailable(_)
            | Self::TimedOut(_)
            | Self::WritesStalled(_)
            | Self::Unready(_)
            | Self::Unreachable(_)
            | Self::NotMigrated(_)
            | Self::Placed(_)
            | Self::KeyHeld { .. } => true,
            Self::Shared(inner) => inner.is_transient(),
            _ => false,
        }
    }

    /// Whether the statement may have been sent and may still commit (or have committed)
    /// although the caller gets a failure: the connection was lost mid-statement, or the server
    /// ended the session while the commit waited (for a synchronous standby, say). A failure
    /// the server reported before committing (its own statement or lock timeout, a read-only
    /// session, a broken deadlock), a connection never obtained, or a deadline checked before
    /// commit wrote nothing.
    pub fn may_have_written(&self) -> bool {
        match self {
            Self::Unavailable(cause) | Self::Internal(cause) => match cause {
                sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
                sqlx::Error::Database(db) => {
                    let code = db.code().unwrap_or_default();
                    code.starts_with("08") || code.starts_with("57P")
                }
                _ => false,
            },
            Self::Shared(inner) => inner.may_have_written(),
            _ => false,
        }
    }

    /// `Some(shared)` when the statement met a held key (see [`Self::KeyHeld`]).
    pub fn key_held(&self) -> Option<bool> {
        match self {
            Self::KeyHeld { shared, .. } => Some(*shared),
            Self::Shared(inner) => inner.key_held(),
            _ => None,
        }
    }

    /// The gate that refused the statement, if one did.
    pub fn placed(&self) -> Option<&crate::store::Gate> {
        match self {
            Self::Placed(gate) => Some(gate),
            Self::Shared(inner) => inner.placed(),
            _ => None,
        }
    }

    /// This failure, for each of `count` commands of a batch.
    pub fn for_each_of(self, count: usize) -> Vec<StoreError> {
        let shared = std::sync::Arc::new(self);
        (0..count).map(|_| Self::Shared(shared.clone())).collect()
    }
}
