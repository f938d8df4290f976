//! Held keys: a call whose key another transaction holds (an operator's `SELECT … FOR UPDATE`,
//! an uncommitted insert, a stalled statement of another replica) waits for it on its own, and
//! nobody else waits with it.
//!
//! Every statement first waits only briefly for a row lock (`TimeBudget::brief_lock`, 20 ms).
//! When that is not enough ([`StoreError::KeyHeld`]), the statement wrote nothing, and:
//!
//! - a statement shared by several calls does not say whose key was held: each of its calls
//!   runs once more alone, at once, each in a task of its own and outside the coalescer's
//!   executors, which are free again for the calls queued behind; a call whose key another
//!   call has meanwhile found held skips that run;
//! - a call that met the held key alone is its key's own: the key is remembered as held, and
//!   the call runs again in the *held-key lane*: a statement of its own that waits for the lock
//!   up to the lock budget (a fifth of the operation timeout), on one of at most a quarter of
//!   the connections the database runs at once for this replica (each cluster its own lane, on
//!   a store of several), after the key's earlier calls in the lane (its *turn*: one held key
//!   takes one place, whatever its calls' kinds);
//! - a later call of a key remembered as held goes to the lane at once, without joining (and
//!   delaying) a shared statement; a key is forgotten when a call of it gets its lock, or a
//!   while after it was last found held (each key its own while, so that keys found held
//!   together are not looked for again together);
//! - a call whose caller has gone (cancelled, or past its deadline) leaves its queue at once:
//!   it takes no place, and starts no statement.
//!
//! So a held key delays the calls that do not need it by at most one brief wait, and its own
//! callers get their answer once the hold ends, or UNAVAILABLE (STORE_UNAVAILABLE, nothing
//! written) at their lock budget.

mod commands;
mod registry;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use commands::{EraseKey, ForceRelease, Row, RowNames, RunsAlone, StoreFuture, Watch};
use registry::{Remembered, Turn};

use crate::store::{AnyStore, LockWait, Store, StoreError};

/// The keys found held, and the lane their calls wait in. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct HeldKeys {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    names: RowNames,
    /// The places of each part of the store (each cluster of several, which has a pool of its
    /// own), at least one: keys held on one cluster never take another's places.
    places: Box<[Places]>,
    remembered: Mutex<Remembered>,
    /// How many rows are remembered: zero (nearly always) spares every call the lock.
    count: AtomicUsize,
    /// How long a row found held is remembered without being found held again, at most.
    remember_for: Duration,
}

/// One part's places: of its lane and of its reruns.
#[derive(Debug)]
struct Places {
    /// The statements that may wait for a held row at once (each holds a connection).
    lane: Semaphore,
    /// The calls of shared statements that met a held row, run again alone at once: each holds
    /// a connection too, so that a failed batch of hundreds does not take the whole pool.
    reruns: Semaphore,
}

impl HeldKeys {
    /// For each of `parts` parts of the store, `lane`: how many statements may wait for held
    /// rows at once, and `reruns` how many calls of failed shared statements may run again at
    /// once (each holds a connection of that part); `remember_for`: how long a row found held
    /// sends its calls to the lane unasked, at most.
    pub fn new(parts: usize, lane: usize, reruns: usize, remember_for: Duration) -> Self {
        let places = (0..parts.max(1))
            .map(|_| Places {
                lane: Semaphore::new(lane.clamp(1, Semaphore::MAX_PERMITS)),
                reruns: Semaphore::new(reruns.clamp(1, Semaphore::MAX_PERMITS)),
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                names: RowNames::default(),
                places,
                remembered: Mutex::new(Remembered::default()),
                count: AtomicUsize::new(0),
                remember_for,
            }),
        }
    }

    /// For a store of `parts` parts (clusters), each of which runs `concurrent` statements at
    /// once for this replica (its pool, or fewer behind a pooler): for each, a lane of a quarter
    /// of them and reruns of another quarter, at least one each, so that half stays for the
    /// shared statements whatever happens.
    pub fn for_capacity(parts: usize, concurrent: u32, operation_timeout: Duration) -> Self {
        let quarter = usize::try_from(concurrent / 4).unwrap_or(1).max(1);
        Self::new(parts, quarter, quarter, operation_timeout)
    }

    /// The places of the part of `store` that serves `rows` (the rows of one call, or of one
    /// shared statement: of one part either way).
    fn places(&self, store: &AnyStore, rows: &[Row<'_>]) -> &Places {
        let part = rows
            .first()
            .map_or(0, |row| store.partition_of(row.scope()));
        let places = &self.inner.places;
        // `places` has one entry per part, and at least one.
        &places[part.min(places.len().saturating_sub(1))]
    }

    pub fn names(&self) -> &RowNames {
        &self.inner.names
    }

    /// Whether any of `command`'s rows is remembered as held. Costs nothing while no row is.
    pub fn any_held<C: RunsAlone>(&self, command: &C) -> bool {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let rows = self.inner.names.of_command(command);
        let now = Instant::now();
        let Ok(mut remembered) = self.inner.remembered.lock() else {
            return false;
        };
        remembered.sweep(now);
        self.inner.count.store(remembered.len(), Ordering::Relaxed);
        rows.iter().any(|row| remembered.is_held(*row, now))
    }

    /// How many rows are remembered as held now.
    pub fn remembered(&self) -> usize {
        let Ok(mut remembered) = self.inner.remembered.lock() else {
            return 0;
        };
        remembered.sweep(Instant::now());
        let count = remembered.len();
        self.inner.count.store(count, Ordering::Relaxed);
        count
    }

    /// Remembers `rows` as held (a statement of theirs just found one of them held).
    fn remember(&self, rows: &[u64]) {
        let now = Instant::now();
        let Ok(mut remembered) = self.inner.remembered.lock() else {
            return;
        };
        remembered.sweep(now);
        remembered.remember(rows, &self.inner.names, now, self.inner.remember_for);
        self.inner.count.store(remembered.len(), Ordering::Relaxed);
    }

    /// Forgets `rows`: a statement of theirs got its locks.
    fn forget(&self, rows: &[u64]) {
        if self.inner.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        if let Ok(mut remembered) = self.inner.remembered.lock() {
            remembered.forget(rows);
            self.inner.count.store(remembered.len(), Ordering::Relaxed);
        }
    }

    /// Remembers the rows of `command` that are held, its statement having just met one: the
    /// one row of a call on a key; of a call on several (MarkProcessed's ids), those the store
    /// finds held now, or all of them when it finds none (an insert in flight is not seen).
    async fn remember_held<C: RunsAlone>(&self, store: &AnyStore, command: &C, deadline: Instant) {
        let rows = command.rows();
        if rows.len() > 1 {
            let found = self.held_now(store, &rows, deadline).await;
            if !found.is_empty() {
                self.remember(&found);
                return;
            }
        }
        self.remember(&self.inner.names.of_command(command));
    }

    /// The names of those of `rows` the store finds held now; none if it cannot say. On a
    /// place of the reruns, whose connections it shares.
    async fn held_now(&self, store: &AnyStore, rows: &[Row<'_>], deadline: Instant) -> Vec<u64> {
        let Ok(_rerun) = self
            .wait(
                self.places(store, rows).reruns.acquire(),
                deadline,
                &CancellationToken::new(),
            )
            .await
        else {
            return Vec::new();
        };
        let brief = store.limited(deadline.into_std(), LockWait::Brief);
        match brief.rows_held(rows).await {
            Ok(held) => rows
                .iter()
                .zip(held)
                .filter(|(_, held)| *held)
                .map(|(row, _)| self.inner.names.of(row))
                .collect(),
            Err(error) => {
                tracing::debug!(error = %crate::telemetry::error_chain(&error), "which rows are held: not known");
                Vec::new()
            }
        }
    }

    /// Remembers which of `commands`' rows are held, one statement of theirs having met a held
    /// row without saying whose: the calls of those rows then go to the lane at once, and the
    /// others run again without waiting behind them.
    pub async fn find_held<C: RunsAlone>(
        &self,
        store: &AnyStore,
        commands: &[&C],
        deadline: Instant,
    ) {
        let rows: Vec<Row<'_>> = commands.iter().flat_map(|command| command.rows()).collect();
        let found = self.held_now(store, &rows, deadline).await;
        self.remember(&found);
    }

    fn turn(&self, rows: &[u64]) -> Option<Arc<Turn>> {
        self.inner.remembered.lock().ok()?.turn(rows)
    }

    /// `command` on its own, outside any shared statement: in the lane at once when its key is
    /// remembered as held, else briefly, and in the lane when its statement finds it held.
    pub async fn run<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        deadline: Instant,
        gone: &CancellationToken,
    ) -> Result<C::Answer, StoreError> {
        self.run_from(store, command, deadline, gone, false).await
    }

    /// [`Self::run`] for an operator's change to a key (the admin API's ForceRelease, EraseKey):
    /// its first statement too runs on a place of the reruns, so that a burst of them (an
    /// incident's scripted releases of held keys, each waiting its brief first wait) never takes
    /// more than the reruns' share of the connections. Awaited in its caller's own task, so a
    /// caller that goes drops every wait with it.
    pub async fn run_as_operator<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        deadline: Instant,
    ) -> Result<C::Answer, StoreError> {
        let stays = CancellationToken::new();
        self.run_from(store, command, deadline, &stays, true).await
    }

    /// [`Self::run`], its first statement on a place of the reruns when `first_on_a_rerun_place`.
    async fn run_from<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        deadline: Instant,
        gone: &CancellationToken,
        first_on_a_rerun_place: bool,
    ) -> Result<C::Answer, StoreError> {
        if self.any_held(command) {
            return self.in_lane(store, command, deadline, gone).await;
        }
        let first = if first_on_a_rerun_place {
            let rows = command.rows();
            let _rerun = self
                .wait(self.places(store, &rows).reruns.acquire(), deadline, gone)
                .await?;
            command
                .run_alone(&store.limited(deadline.into_std(), LockWait::Brief))
                .await
        } else {
            command.run_alone(store).await
        };
        match first {
            Err(error) => match error.key_held() {
                Some(shared) => {
                    self.after_held(store, command, shared, deadline, gone)
                        .await
                }
                None => Err(error),
            },
            answered => answered,
        }
    }

    /// Runs `command` on its own after one of its statements met a held row: once more briefly
    /// first when `after_shared` (the statement carried other calls, and the held row may be
    /// theirs) unless another call has found its key held meanwhile, then, its own row being
    /// held, in the lane. Everything it runs, its waits for a connection included, ends by
    /// `deadline`, with nothing written past it.
    pub async fn after_held<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        after_shared: bool,
        deadline: Instant,
        gone: &CancellationToken,
    ) -> Result<C::Answer, StoreError> {
        if after_shared && !self.any_held(command) {
            metrics::counter!("idempotency_held_key_reruns_total").increment(1);
            let rows = command.rows();
            let _rerun = self
                .wait(self.places(store, &rows).reruns.acquire(), deadline, gone)
                .await?;
            let alone = store.limited(deadline.into_std(), LockWait::Brief);
            match command.run_alone(&alone).await {
                Err(error) if error.key_held().is_some() => {}
                answered => return answered,
            }
        }
        self.remember_held(store, command, deadline).await;
        self.in_lane(store, command, deadline, gone).await
    }

    /// Runs `command`, whose row is held, in the lane: after the key's earlier calls in the lane
    /// (its turn), on one of the lane's connections, waiting for the row up to the lock budget.
    /// The row is forgotten once a statement got its lock, and remembered again should it find
    /// the row still held.
    ///
    /// A call of the key's holder (Complete, Release, ExtendLease) whose turn is taken first
    /// tries once briefly beside it, on a place of the reruns: the claims in the lane may be
    /// waiting for exactly what it does, and a claim whose statement has stalled (its backend
    /// paused) must not keep the holder from releasing a row that is free again.
    pub async fn in_lane<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        deadline: Instant,
        gone: &CancellationToken,
    ) -> Result<C::Answer, StoreError> {
        metrics::counter!("idempotency_held_key_calls_total").increment(1);
        let rows = self.inner.names.of_command(command);
        let turn = self.turn(&rows);
        let _turn = match &turn {
            None => None,
            Some(turn) => match turn.try_lock() {
                Ok(free) => Some(free),
                Err(_taken) => {
                    if C::FROM_HOLDER
                        && let Some(answer) =
                            self.beside(store, command, &rows, deadline, gone).await?
                    {
                        return Ok(answer);
                    }
                    Some(self.wait(take_turn(turn), deadline, gone).await?)
                }
            },
        };
        let places = self.places(store, &command.rows());
        let _place = self.wait(places.lane.acquire(), deadline, gone).await?;
        let patient = store.limited(deadline.into_std(), LockWait::Patient);
        let answer = command.run_alone(&patient).await;
        match &answer {
            // Got its locks: the key is not held any more (a refusal was judged under them too).
            Ok(_) => self.forget(&rows),
            Err(error) if error.key_held().is_some() => {
                self.remember_held(store, command, deadline).await;
            }
            // Cut short by its deadline, or the store failed: nothing learnt about the row.
            Err(_) => {}
        }
        answer
    }

    /// `command` once, briefly, on a place of the reruns: its answer, or none when its row is
    /// still held.
    async fn beside<C: RunsAlone>(
        &self,
        store: &AnyStore,
        command: &C,
        rows: &[u64],
        deadline: Instant,
        gone: &CancellationToken,
    ) -> Result<Option<C::Answer>, StoreError> {
        let places = self.places(store, &command.rows());
        let _rerun = self.wait(places.reruns.acquire(), deadline, gone).await?;
        let brief = store.limited(deadline.into_std(), LockWait::Brief);
        match command.run_alone(&brief).await {
            Ok(answer) => {
                self.forget(rows);
                Ok(Some(answer))
            }
            Err(error) if error.key_held().is_some() => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// `place` (a permit of the lane or the reruns, a key's turn) unless `deadline` passes or
    /// the caller goes first.
    async fn wait<T, E>(
        &self,
        place: impl Future<Output = Result<T, E>>,
        deadline: Instant,
        gone: &CancellationToken,
    ) -> Result<T, StoreError> {
        tokio::select! {
            permit = place => permit.map_err(|_| self.timed_out()),
            () = tokio::time::sleep_until(deadline) => Err(self.timed_out()),
            () = gone.cancelled() => Err(self.timed_out()),
        }
    }

    /// A call that could not take its place in time (or whose caller went): nothing written.
    fn timed_out(&self) -> StoreError {
        StoreError::TimedOut(self.inner.remember_for)
    }
}

/// A key's turn, as [`HeldKeys::wait`] takes a place.
async fn take_turn(
    turn: &Turn,
) -> Result<tokio::sync::MutexGuard<'_, ()>, std::convert::Infallible> {
    Ok(turn.lock().await)
}
