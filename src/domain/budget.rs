//! How one operation's time, the operation timeout, is shared out. This is the one place that
//! says it; the coalescer, both stores and the coordinator read their share from here.
//!
//! - up to 10% waiting in a coalescer's queue before the statement starts (past it, a call is
//!   answered "timed out" without being run);
//! - at most 35% waiting for a connection;
//! - at most 50% for the statement, which the database ends itself (PostgreSQL's
//!   `statement_timeout`, SQLite's `busy_timeout` and a deadline checked before commit);
//! - the last 5% for the answer to come back before the coordinator's own deadline at 100%.
//!
//! Row locks. Every PostgreSQL statement first waits at most [`BRIEF_LOCK`] (20 ms) for a row
//! lock (`lock_timeout`): longer, and the key is taken for held by another transaction (an
//! operator's session, a stalled statement of another replica), the statement wrote nothing,
//! and the call leaves the shared path (`service::held_keys`) to wait for its own key alone,
//! patiently: up to 20% of the operation, within the statement's share. So a held key delays
//! the calls that do not need it by at most one brief wait, whatever holds it and for how long.
//!
//! That last deadline then only fires when the connection itself has stopped answering; every
//! other timeout is reported by the database, with nothing written.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeBudget {
    /// The whole operation: the coordinator's own deadline.
    pub operation: Duration,
    /// How long a queued call may wait before its statement starts.
    pub queue_wait: Duration,
    /// How long a statement may wait for a connection.
    pub connection_wait: Duration,
    /// How long the database lets a statement run.
    pub statement: Duration,
    /// How long the statement of a call whose own key is held waits for its lock (PostgreSQL's
    /// `lock_timeout`, set for that statement), well within the statement's time.
    pub lock: Duration,
    /// How long any statement first waits for a row lock (the session's `lock_timeout`): past
    /// it, the key is treated as held by someone else, and only the calls that need it wait
    /// longer, on their own.
    pub brief_lock: Duration,
}

/// The first wait of every statement for a row lock. A row is locked by another of this
/// service's statements for as long as that statement runs (a few milliseconds, a shared one
/// under load a few more): a wait longer than this is a key held by something else, and waiting
/// it out on the shared path would delay every call queued behind it. Short enough that the
/// calls behind a held key are answered within tens of milliseconds (the held-key tests ask
/// 100 ms), long enough that the service's own statements rarely exceed it.
pub const BRIEF_LOCK: Duration = Duration::from_millis(20);

impl TimeBudget {
    pub fn of(operation: Duration) -> Self {
        Self {
            operation,
            queue_wait: operation / 10,
            connection_wait: operation * 7 / 20,
            statement: operation / 2,
            lock: operation / 5,
            brief_lock: BRIEF_LOCK.min(operation / 5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shares_leave_room_for_the_answer() {
        let budget = TimeBudget::of(Duration::from_secs(5));
        assert_eq!(budget.queue_wait, Duration::from_millis(500));
        assert_eq!(budget.connection_wait, Duration::from_millis(1750));
        assert_eq!(budget.statement, Duration::from_millis(2500));
        assert_eq!(budget.lock, Duration::from_millis(1000));
        assert!(budget.lock < budget.statement);
        assert_eq!(budget.brief_lock, BRIEF_LOCK);
        assert!(TimeBudget::of(Duration::from_millis(50)).brief_lock <= Duration::from_millis(10));
        assert!(budget.queue_wait + budget.connection_wait + budget.statement < budget.operation);
    }
}
