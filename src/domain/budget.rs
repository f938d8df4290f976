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
//! Within the statement's share, 20% of the operation is the most a PostgreSQL statement waits
//! for one row lock (`lock_timeout`): a key that another transaction holds longer fails only its
//! own callers, and the other calls of a shared statement are run again without it.
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
    /// How long a statement may wait for a lock another transaction holds (PostgreSQL's
    /// `lock_timeout`), well within the statement's time.
    pub lock: Duration,
}

impl TimeBudget {
    pub fn of(operation: Duration) -> Self {
        Self {
            operation,
            queue_wait: operation / 10,
            connection_wait: operation * 7 / 20,
            statement: operation / 2,
            lock: operation / 5,
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
        assert!(budget.queue_wait + budget.connection_wait + budget.statement < budget.operation);
    }
}
