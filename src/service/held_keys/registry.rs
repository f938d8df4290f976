//! The rows found held, remembered for a while, each with its key's turn in the lane.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::commands::RowNames;

/// How many rows the registry remembers at most: past it, a row found held is not remembered
/// (its calls still leave the shared path when they meet it, only later). A table-level lock
/// (a migration's `ALTER TABLE`) makes every row look held; this keeps that from growing a map
/// every call then searches.
pub(super) const MAX_REMEMBERED: usize = 4096;

/// How often expired rows are swept from the registry, at most.
pub(super) const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// A held row's turn in the lane: one statement of the row's calls waits for its lock at a
/// time, whatever their kind, so that one held key takes at most one of the lane's places; the
/// key's other calls wait for that one, not for the lane's other keys.
pub(super) type Turn = tokio::sync::Mutex<()>;

/// A row found held: until when it is remembered, and its turn.
#[derive(Debug)]
struct Held {
    until: Instant,
    turn: Arc<Turn>,
}

#[derive(Debug, Default)]
pub(super) struct Remembered {
    rows: HashMap<u64, Held>,
    /// When expired rows are swept next.
    next_sweep: Option<Instant>,
}

impl Remembered {
    /// Drops the rows whose time has passed, at most every [`SWEEP_EVERY`].
    pub(super) fn sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|next| now < next) {
            return;
        }
        self.rows.retain(|_, held| held.until > now);
        self.next_sweep = Some(now + SWEEP_EVERY);
    }

    pub(super) fn len(&self) -> usize {
        self.rows.len()
    }

    pub(super) fn is_held(&self, row: u64, now: Instant) -> bool {
        self.rows.get(&row).is_some_and(|held| held.until > now)
    }

    /// Remembers `rows` for between half of `remember_for` and all of it, each its own time:
    /// keys found held together are not all forgotten (and looked for again) in one instant.
    pub(super) fn remember(
        &mut self,
        rows: &[u64],
        names: &RowNames,
        now: Instant,
        remember_for: Duration,
    ) {
        let half = remember_for / 2;
        let spread = u64::try_from(half.as_micros()).unwrap_or(u64::MAX);
        for row in rows {
            let until = now + half + Duration::from_micros(names.spread(*row, now, spread));
            if let Some(held) = self.rows.get_mut(row) {
                held.until = held.until.max(until);
            } else if self.rows.len() < MAX_REMEMBERED {
                self.rows.insert(
                    *row,
                    Held {
                        until,
                        turn: Arc::default(),
                    },
                );
            }
        }
    }

    pub(super) fn forget(&mut self, rows: &[u64]) {
        for row in rows {
            self.rows.remove(row);
        }
    }

    /// The turn of the first of `rows` that is remembered.
    pub(super) fn turn(&self, rows: &[u64]) -> Option<Arc<Turn>> {
        rows.iter()
            .find_map(|row| self.rows.get(row))
            .map(|held| held.turn.clone())
    }
}
