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
use crate::store::{AnyStore, LockWait, Store, StoreError};

/// A store future that borrows its command.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A command that can run on its own, and the rows it needs, as the registry of held keys names
/// them.
pub trait RunsAlone: Send + Sync + 'static {
    type Answer: Send + 'static;

    /// The kind of call, which takes its turns in the lane apart from the other kinds (a
    /// holder's Release does not wait behind a TryStart of its key).
    const KIND: usize;

    /// The names of the rows the command locks (hashes: a collision only sends a call to the
    /// lane that did not need it).
    fn rows(&self, names: &RowNames) -> Vec<u64>;

    /// The command alone, on `store`.
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer>;
}

impl RunsAlone for TryStartCommand {
    type Answer = TryStartOutcome;
    const KIND: usize = 0;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.try_start(self))
    }
}

impl RunsAlone for CompleteCommand {
    type Answer = Result<Completion, Rejection>;
    const KIND: usize = 1;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.complete(self))
    }
}

impl RunsAlone for ReleaseCommand {
    type Answer = Result<(), Rejection>;
    const KIND: usize = 2;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.release(self))
    }
}

impl RunsAlone for ExtendLeaseCommand {
    type Answer = Result<crate::domain::Instant, Rejection>;
    const KIND: usize = 3;
    fn rows(&self, names: &RowNames) -> Vec<u64> {
        vec![names.key(self.namespace.as_str(), self.key.as_str())]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.extend_lease(self))
    }
}

impl RunsAlone for MarkProcessedCommand {
    type Answer = Vec<ProcessedEvent>;
    const KIND: usize = 4;
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
    const KIND: usize = 5;
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

/// How many rows the registry remembers at most: past it, a row found held is not remembered
/// (its calls still leave the shared path when they meet it, only later). A table-level lock
/// (a migration's `ALTER TABLE`) makes every row look held; this keeps that from growing a map
/// every call then searches.
const MAX_REMEMBERED: usize = 4096;

/// How often expired rows are swept from the registry, at most.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// The keys found held, and the lane their calls wait in. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct HeldKeys {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    names: RowNames,
    /// The statements that may wait for a held row at once (each holds a connection).
    lane: Semaphore,
    /// The calls of shared statements that met a held row, run again alone at once: each holds
    /// a connection too, so that a failed batch of hundreds does not take the whole pool.
    reruns: Semaphore,
    remembered: Mutex<Remembered>,
    /// How many rows are remembered: zero (nearly always) spares every call the lock.
    count: AtomicUsize,
    /// How long a row found held is remembered without being found held again.
    remember_for: Duration,
}

#[derive(Debug, Default)]
struct Remembered {
    rows: HashMap<u64, Held>,
    /// When expired rows are swept next.
    next_sweep: Option<Instant>,
}

/// How many kinds of call take turns apart ([`RunsAlone::KIND`]).
const KINDS: usize = 6;

/// A row found held: until when it is remembered, and each kind of call's turn in the lane (one
/// statement of a key and kind waits for its lock at a time: the key's other callers of that
/// kind wait for that one, not for the lane's other keys, so one key's callers never fill the
/// lane).
#[derive(Debug)]
struct Held {
    until: Instant,
    turns: [Arc<tokio::sync::Mutex<()>>; KINDS],
}

impl Remembered {
    /// Drops the rows whose time has passed, at most every [`SWEEP_EVERY`].
    fn sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|next| now < next) {
            return;
        }
        self.rows.retain(|_, held| held.until > now);
        self.next_sweep = Some(now + SWEEP_EVERY);
    }
}

impl HeldKeys {
    /// `lane`: how many statements may wait for held rows at once, and `reruns` how many calls
    /// of failed shared statements may run again at once (each holds a connection);
    /// `remember_for`: how long a row found held sends its calls to the lane unasked.
    pub fn new(lane: usize, reruns: usize, remember_for: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                names: RowNames::default(),
                lane: Semaphore::new(lane.clamp(1, Semaphore::MAX_PERMITS)),
                reruns: Semaphore::new(reruns.clamp(1, Semaphore::MAX_PERMITS)),
                remembered: Mutex::new(Remembered::default()),
                count: AtomicUsize::new(0),
                remember_for,
            }),
        }
    }

    /// For a pool of `pool_size` connections: a lane of a quarter of them and reruns of half,
    /// at least one each, so that a quarter stays for the shared statements whatever happens.
    pub fn for_pool(pool_size: u32, remember_for: Duration) -> Self {
        let share = |divisor: u32| usize::try_from(pool_size / divisor).unwrap_or(1).max(1);
        Self::new(share(4), share(2), remember_for)
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
        let Ok(mut remembered) = self.inner.remembered.lock() else {
            return false;
        };
        remembered.sweep(now);
        self.inner
            .count
            .store(remembered.rows.len(), Ordering::Relaxed);
        rows.iter().any(|row| {
            remembered
                .rows
                .get(row)
                .is_some_and(|held| held.until > now)
        })
    }

    /// How many rows are remembered as held now.
    pub fn remembered(&self) -> usize {
        let Ok(mut remembered) = self.inner.remembered.lock() else {
            return 0;
        };
        remembered.sweep(Instant::now());
        let count = remembered.rows.len();
        self.inner.count.store(count, Ordering::Relaxed);
        count
    }

    /// Remembers `rows` as held (a statement of theirs just found one of them held), for
    /// another `remember_for`.
    fn remember(&self, rows: &[u64]) {
        let now = Instant::now();
        let until = now + self.inner.remember_for;
        let Ok(mut remembered) = self.inner.remembered.lock() else {
            return;
        };
        remembered.sweep(now);
        for row in rows {
            if let Some(held) = remembered.rows.get_mut(row) {
                held.until = until;
            } else if remembered.rows.len() < MAX_REMEMBERED {
                remembered.rows.insert(
                    *row,
                    Held {
                        until,
                        turns: Default::default(),
                    },
                );
            }
        }
        self.inner
            .count
            .store(remembered.rows.len(), Ordering::Relaxed);
    }

    /// Forgets `rows`: a statement of theirs got its locks.
    fn forget(&self, rows: &[u64]) {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Ok(mut remembered) = self.inner.remembered.lock() {
            for row in rows {
                remembered.rows.remove(row);
            }
            self.inner
                .count
                .store(remembered.rows.len(), Ordering::Relaxed);
        }
    }

    /// The lane turn of `row` for calls of `kind`, when the row is remembered.
    fn turn(&self, row: Option<&u64>, kind: usize) -> Option<Arc<tokio::sync::Mutex<()>>> {
        let row = row?;
        let remembered = self.inner.remembered.lock().ok()?;
        remembered
            .rows
            .get(row)
            .and_then(|held| held.turns.get(kind).cloned())
    }

    /// Runs `command` on its own after one of its statements met a held row: once more briefly
    /// first when `after_shared` (the statement carried other calls, and the held row may be
    /// theirs), then, its own row being held, in the lane. Everything it runs, its waits for
    /// a connection included, ends by `deadline`, with nothing written past it.
    pub async fn after_held<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        after_shared: bool,
        deadline: Instant,
    ) -> Result<C::Answer, StoreError> {
        if after_shared {
            metrics::counter!("idempotency_held_key_reruns_total").increment(1);
            let Ok(Ok(_rerun)) =
                tokio::time::timeout_at(deadline, self.inner.reruns.acquire()).await
            else {
                return Err(StoreError::TimedOut(self.inner.remember_for));
            };
            let alone = store.limited(deadline.into_std(), LockWait::Brief);
            match command.run_alone(&alone).await {
                Err(error) if error.key_held().is_some() => {}
                answered => return answered,
            }
        }
        self.remember(&command.rows(&self.inner.names));
        self.in_lane(store, command, deadline).await
    }

    /// Runs `command`, whose row is held, in the lane: after the key's earlier calls in the lane
    /// (its turn), on one of the lane's connections, waiting for the row up to the lock budget.
    /// The row is forgotten once a statement got its lock, and remembered again should it find
    /// the row still held.
    pub async fn in_lane<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        deadline: Instant,
    ) -> Result<C::Answer, StoreError> {
        metrics::counter!("idempotency_held_key_calls_total").increment(1);
        let rows = command.rows(&self.inner.names);
        let timed_out = || StoreError::TimedOut(self.inner.remember_for);
        let _turn = match self.turn(rows.first(), C::KIND) {
            Some(turn) => Some(
                tokio::time::timeout_at(deadline, turn.lock_owned())
                    .await
                    .map_err(|_| timed_out())?,
            ),
            None => None,
        };
        let Ok(Ok(_permit)) = tokio::time::timeout_at(deadline, self.inner.lane.acquire()).await
        else {
            return Err(timed_out());
        };
        let patient = store.limited(deadline.into_std(), LockWait::Patient);
        let answer = command.run_alone(&patient).await;
        match &answer {
            // Got its locks: the key is not held any more (a refusal was judged under them too).
            Ok(_) => self.forget(&rows),
            Err(error) if error.key_held().is_some() => self.remember(&rows),
            // Cut short by its deadline, or the store failed: nothing learnt about the row.
            Err(_) => {}
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_is_a_quarter_of_the_pool_and_never_empty() {
        let held = HeldKeys::for_pool(16, Duration::from_secs(1));
        assert_eq!(held.inner.lane.available_permits(), 4);
        assert_eq!(held.inner.reruns.available_permits(), 8);
        let tiny = HeldKeys::for_pool(1, Duration::from_secs(1));
        assert_eq!(tiny.inner.lane.available_permits(), 1);
        assert_eq!(tiny.inner.reruns.available_permits(), 1);
    }

    #[test]
    fn rows_are_remembered_until_forgotten() {
        let held = HeldKeys::new(1, 1, Duration::from_secs(60));
        let row = held.names().of("a row");
        held.remember(&[row]);
        assert_eq!(held.remembered(), 1);
        held.forget(&[row]);
        assert_eq!(held.remembered(), 0);
    }

    #[test]
    fn a_row_not_found_held_again_is_forgotten_by_itself() {
        let held = HeldKeys::new(1, 1, Duration::from_millis(50));
        let command = MarkProcessedCommand {
            consumer: crate::domain::Scope::parse("c".into()).expect("scope"),
            event_ids: vec![crate::domain::EventId::parse("e".into()).expect("id")],
            retention: crate::domain::EventRetention::parse(Duration::from_secs(60))
                .expect("retention"),
        };
        held.remember(&command.rows(held.names()));
        assert!(held.any_held(&command));
        // A short real time: past the row's time and the next sweep.
        std::thread::sleep(SWEEP_EVERY + Duration::from_millis(60));
        // Past its time: not held, and the count (which spares the hot path the lock) is back
        // to zero without anything else remembered or forgotten.
        assert!(!held.any_held(&command));
        assert_eq!(held.inner.count.load(Ordering::Relaxed), 0);
        assert_eq!(held.remembered(), 0);
    }

    #[test]
    fn the_registry_is_bounded() {
        let held = HeldKeys::new(1, 1, Duration::from_secs(60));
        let rows: Vec<u64> = (0..MAX_REMEMBERED + 10)
            .map(|n| held.names().of(n))
            .collect();
        held.remember(&rows);
        assert_eq!(held.remembered(), MAX_REMEMBERED);
    }
}
