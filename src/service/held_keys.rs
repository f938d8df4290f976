//! Held keys: a call whose key another transaction holds (an operator's `SELECT … FOR UPDATE`,
//! an uncommitted insert, a stalled statement of another replica) waits for it on its own, and
//! nobody else waits with it.
//!
//! Every statement first waits only briefly for a row lock (`TimeBudget::brief_lock`, 20 ms).
//! When that is not enough ([`StoreError::KeyHeld`]), the statement wrote nothing, and:
//!
//! - a statement shared by several calls does not say whose key was held: each of its calls
//!   runs once more alone, at once, each in a task of its own and outside the coalescer's
//!   executors, which are free again for the calls queued behind;
//! - a call that met the held key alone is its key's own: it is remembered as held, and the
//!   call runs again in the *held-key lane*: a statement of its own that waits for the lock up
//!   to the lock budget (a fifth of the operation timeout), on one of at most a quarter of the
//!   pool's connections, so that held keys never take the connections the other calls need;
//! - a later call of a key remembered as held goes to the lane at once, without joining (and
//!   delaying) a shared statement; a key is forgotten when a call of it gets its lock, or a
//!   while after it was last found held.
//!
//! So a held key delays the calls that do not need it by at most one brief wait, and its own
//! callers get their answer once the hold ends, or UNAVAILABLE (STORE_UNAVAILABLE, nothing
//! written) at their lock budget.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, KeyState, LookupQuery, MarkProcessedCommand,
    ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand, TryStartOutcome,
};
use crate::store::{AnyStore, Store, StoreError};

/// A store future that borrows its command.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A command that can run on its own, and the rows it needs, as the registry of held keys names
/// them.
pub trait RunsAlone: Send + Sync + 'static {
    type Answer: Send + 'static;

    /// The names of the rows the command locks (hashes: a collision only sends a call to the
    /// lane that did not need it).
    fn rows(&self, names: &RowNames) -> Vec<u64>;

    /// The command alone, on `store`.
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer>;
}

impl RunsAlone for TryStartCommand {
    type Answer = TryStartOutcome;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.try_start(self))
    }
}

impl RunsAlone for CompleteCommand {
    type Answer = Result<Completion, Rejection>;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.complete(self))
    }
}

impl RunsAlone for ReleaseCommand {
    type Answer = Result<(), Rejection>;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.release(self))
    }
}

impl RunsAlone for ExtendLeaseCommand {
    type Answer = Result<crate::domain::Instant, Rejection>;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.extend_lease(self))
    }
}

impl RunsAlone for MarkProcessedCommand {
    type Answer = Vec<ProcessedEvent>;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        self.event_ids
            .iter()
            .map(|id| names.event(self.consumer.as_str(), id.as_str()))
            .collect()
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.mark_processed(self))
    }
}

/// A waiting TryStart's look at its key, which marks the row watched (an update, so it may meet
/// a held row like any write).
pub struct Watch(pub LookupQuery);

impl RunsAlone for Watch {
    type Answer = KeyState;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.0.namespace.as_str(), self.0.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.watch(&self.0))
    }
}

/// Names rows by a hash of their table and primary key.
#[derive(Debug, Clone, Default)]
pub struct RowNames(RandomState);

impl RowNames {
    fn key(&self, namespace: &str, key: &str) -> u64 {
        self.0.hash_one(("key", namespace, key))
    }

    fn event(&self, consumer: &str, id: &str) -> u64 {
        self.0.hash_one(("event", consumer, id))
    }

    #[cfg(test)]
    fn of(&self, name: impl std::hash::Hash) -> u64 {
        self.0.hash_one(name)
    }
}

/// The keys found held, and the lane their calls wait in. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct HeldKeys {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    names: RowNames,
    /// The statements that may wait for a held row at once.
    lane: Semaphore,
    /// Rows found held, each until when it is remembered.
    remembered: Mutex<HashMap<u64, Instant>>,
    /// How many rows are remembered: zero (nearly always) spares every call the lock.
    count: AtomicUsize,
    /// How long a row found held is remembered without being found held again.
    remember_for: Duration,
}

impl HeldKeys {
    /// `lane`: how many statements may wait for held rows at once (each holds a connection);
    /// `remember_for`: how long a row found held sends its calls to the lane unasked.
    pub fn new(lane: usize, remember_for: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                names: RowNames::default(),
                lane: Semaphore::new(lane.clamp(1, Semaphore::MAX_PERMITS)),
                remembered: Mutex::new(HashMap::new()),
                count: AtomicUsize::new(0),
                remember_for,
            }),
        }
    }

    /// The lane's width for a pool of `pool_size` connections: a quarter of them, at least one.
    pub fn lane_for_pool(pool_size: u32) -> usize {
        usize::try_from(pool_size / 4).unwrap_or(1).max(1)
    }

    pub fn names(&self) -> &RowNames {
        &self.inner.names
    }

    /// Whether any of `command`'s rows is remembered as held. Costs nothing while no row is.
    pub fn any_held<C: RunsAlone>(&self, command: &C) -> bool {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let rows = command.rows(&self.inner.names);
        let now = Instant::now();
        let Ok(remembered) = self.inner.remembered.lock() else {
            return false;
        };
        rows.iter()
            .any(|row| remembered.get(row).is_some_and(|until| *until > now))
    }

    /// How many rows are remembered as held now.
    pub fn remembered(&self) -> usize {
        self.inner.count.load(Ordering::Relaxed)
    }

    fn remember(&self, rows: &[u64]) {
        let until = Instant::now() + self.inner.remember_for;
        if let Ok(mut remembered) = self.inner.remembered.lock() {
            let now = Instant::now();
            remembered.retain(|_, until| *until > now);
            for row in rows {
                remembered.insert(*row, until);
            }
            self.inner.count.store(remembered.len(), Ordering::Relaxed);
        }
    }

    fn forget(&self, rows: &[u64]) {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Ok(mut remembered) = self.inner.remembered.lock() {
            for row in rows {
                remembered.remove(row);
            }
            self.inner.count.store(remembered.len(), Ordering::Relaxed);
        }
    }

    /// Runs `command` on its own: once more briefly first when `after_shared` (a shared
    /// statement met a held row that may not be this command's), then, if its own row is held,
    /// in the lane. Everything ends by `deadline` (the store's share of the operation): the
    /// lane's statement is ended by the database then, with nothing written.
    pub async fn run_alone<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        after_shared: bool,
        deadline: Instant,
    ) -> Result<C::Answer, StoreError> {
        if after_shared {
            metrics::counter!("idempotency_held_key_reruns_total").increment(1);
            match command.run_alone(store).await {
                Err(error) if error.key_held().is_some() => {}
                answered => return answered,
            }
        }
        self.in_lane(store, command, deadline).await
    }

    /// Runs `command`, whose row is held, in the lane: remembered as held while it waits, and
    /// forgotten once it got its lock (or failed for another reason).
    pub async fn in_lane<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        deadline: Instant,
    ) -> Result<C::Answer, StoreError> {
        let rows = command.rows(&self.inner.names);
        self.remember(&rows);
        metrics::counter!("idempotency_held_key_calls_total").increment(1);
        let Ok(Ok(_permit)) = tokio::time::timeout_at(deadline, self.inner.lane.acquire()).await
        else {
            return Err(StoreError::TimedOut(
                deadline.saturating_duration_since(Instant::now()),
            ));
        };
        let patient = store.patient(deadline.into_std());
        let answer = command.run_alone(&patient).await;
        match &answer {
            Err(error) if error.key_held().is_some() => self.remember(&rows),
            _ => self.forget(&rows),
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_is_a_quarter_of_the_pool_and_never_empty() {
        assert_eq!(HeldKeys::lane_for_pool(16), 4);
        assert_eq!(HeldKeys::lane_for_pool(3), 1);
        assert_eq!(HeldKeys::lane_for_pool(1), 1);
    }

    #[test]
    fn rows_are_remembered_until_forgotten_or_past_their_time() {
        let held = HeldKeys::new(1, Duration::from_secs(60));
        let row = held.names().of("a row");
        held.remember(&[row]);
        assert_eq!(held.remembered(), 1);
        held.forget(&[row]);
        assert_eq!(held.remembered(), 0);

        let brief = HeldKeys::new(1, Duration::ZERO);
        brief.remember(&[row]);
        let other = brief.names().of("another row");
        // Remembering another row drops the one whose time has passed.
        brief.remember(&[other]);
        assert_eq!(brief.remembered(), 1);
    }
}
