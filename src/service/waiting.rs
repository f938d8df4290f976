//! TryStarts that wait for the key's holder instead of answering `in_progress` at once.
//!
//! A waiter registers its key (by [`KeyHash`]) before it first looks, so that no change between
//! its look and its sleep can be missed, then sleeps until one of these wakes it: a change to
//! its key (a Complete or Release committed by this replica or, through the store's
//! `LISTEN`, by another), a signal that changes may have been missed (the listener
//! reconnected), the moment its holder's lease ends by the database clock, a slow safety
//! re-check, the end of its wait or of its caller's deadline, or shutdown.
//!
//! On waking it reads the key once (`Store::watch`: a Lookup which, on PostgreSQL, also marks an
//! in-progress key watched, so that its next Complete or Release is announced; it decides
//! nothing) and judges it by TryStart's order (`KeyState::recheck`): a completion or a mismatch
//! is answered from the read, exactly as TryStart would answer it; a lease still held means
//! sleeping again; only a key that TryStart would claim, take over or re-enter is handed to
//! TryStart itself, by one waiter of the key at a time on this replica (the others sleep until
//! it has its answer), so a thousand waiters on one key never queue a thousand claims of that
//! key. The database, not this service's clock,
//! decides when a lease has ended. Waiting holds no connection and no place in a coalescer's
//! queue, and at most `max_waiters` calls wait at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::domain::{Instant as DbInstant, KeyHash};
use crate::store::KeyEvent;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitSettings {
    /// The most TryStarts that may wait at once on this replica; beyond it, a TryStart answers
    /// at once, as without `wait`. 0: nobody waits.
    pub max_waiters: usize,
    /// A waiter looks again at least this often, whatever else wakes it: the last resort
    /// should a change notification be lost without the listener noticing.
    pub recheck_interval: Duration,
}

/// How far the database clock is from this service's, as last measured, so that a waiter can
/// sleep until a lease ends by the database clock. Only wake-ups depend on it: a waiter woken
/// early finds the lease still running and sleeps again.
///
/// It also keeps the last reading itself with the monotonic instant its probe was sent, for
/// what must never be late: [`DatabaseClock::latest_possible_now`] bounds the database clock
/// from above by the monotonic time since that reading, and by this service's wall clock moved
/// by the measured offset when that is later, so that neither a skewed, a stepped nor a
/// suspended service clock makes the replay cache serve a record past its retention.
#[derive(Debug, Clone, Default)]
pub struct DatabaseClock {
    /// Database clock minus the service's clock, in microseconds.
    offset_micros: Arc<AtomicI64>,
    /// The last reading, once there is one.
    latest: Arc<Mutex<Option<ClockReading>>>,
}

/// One reading of the database clock: `read`, taken after `sent` (monotonic) at the latest.
#[derive(Debug, Clone, Copy)]
struct ClockReading {
    read: DbInstant,
    sent: Instant,
}

/// How much faster than this machine's monotonic clock the database clock may run, per
/// second since the last reading, in microseconds: 1000 ppm, ten times what NTP tolerates.
const DRIFT_MICROS_PER_SECOND: f64 = 1000.0;

/// A waiter whose holder's lease should have ended wakes this much after our estimate of it.
const LEASE_END_MARGIN: Duration = Duration::from_millis(1);

impl DatabaseClock {
    /// Records a reading of the database clock, `read`, taken between `before` and `after` by
    /// this service's clock.
    /// `sent` is when (by the monotonic clock) the reading was asked for.
    pub fn record(&self, before: DbInstant, read: DbInstant, after: DbInstant, sent: Instant) {
        let midpoint = before + (after - before) / 2;
        let offset = (read - midpoint).num_microseconds().unwrap_or(0);
        self.offset_micros.store(offset, Ordering::Relaxed);
        let mut latest = self
            .latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Readings may finish out of order only if probes overlap; keep the later request.
        if latest.is_none_or(|kept| kept.sent <= sent) {
            *latest = Some(ClockReading { read, sent });
        }
    }

    /// The latest instant the database clock can read now: the last reading plus the
    /// monotonic time since its probe was sent (the reading was taken after that, so this
    /// includes the whole round trip), plus a drift allowance; or, when it is later, this
    /// service's wall clock moved by the offset last measured. `None` before the first
    /// reading.
    ///
    /// The first alone would be late when the monotonic clock stops while the wall clock does
    /// not (a suspended or frozen machine: `CLOCK_MONOTONIC` does not count that time) or when
    /// this service's wall clock steps forward and is the database's (the embedded store reads
    /// this process's clock). The second covers both; taking the later of the two can only make
    /// a record expire sooner. What neither sees is a separate database server's clock stepping
    /// forward between two readings (at most `--health-check-interval` apart while the store
    /// answers); docs/operations.md says so.
    pub fn latest_possible_now(&self) -> Option<DbInstant> {
        let reading = (*self
            .latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))?;
        let since = reading.sent.elapsed();
        let drift = since.as_secs_f64() * DRIFT_MICROS_PER_SECOND;
        let since_micros = i64::try_from(since.as_micros()).ok()?;
        let by_monotonic =
            reading.read + chrono::Duration::microseconds(since_micros + drift.ceil() as i64);
        let by_wall_clock = Utc::now() + chrono::Duration::microseconds(self.offset_micros());
        Some(by_monotonic.max(by_wall_clock))
    }

    /// The offset last recorded, database minus service, in microseconds.
    pub fn offset_micros(&self) -> i64 {
        self.offset_micros.load(Ordering::Relaxed)
    }

    /// Whether the database clock has passed `at`, by our estimate of it.
    pub fn has_passed(&self, at: DbInstant) -> bool {
        Utc::now() + chrono::Duration::microseconds(self.offset_micros()) > at
    }

    /// When, by this process's monotonic clock, the database clock will read `at` (now, if it
    /// already has).
    pub fn local_instant(&self, at: DbInstant) -> Instant {
        let service_at = at - chrono::Duration::microseconds(self.offset_micros());
        let until = (service_at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
        Instant::now() + until + LEASE_END_MARGIN
    }
}

/// Who waits on which key.
#[derive(Clone)]
pub struct Waiters {
    inner: Arc<Inner>,
}

/// What the waiters of one key share.
struct KeyWaiters {
    /// Its value changes when the key does.
    changes: watch::Sender<u64>,
    /// Held by the one waiter of this replica that hands the key to TryStart.
    claiming: Arc<tokio::sync::Mutex<()>>,
}

struct Inner {
    /// The keys someone waits on.
    keys: Mutex<HashMap<KeyHash, KeyWaiters>>,
    /// Changes when every waiter should look again.
    everyone: watch::Sender<u64>,
    slots: Arc<Semaphore>,
    settings: WaitSettings,
}

impl Waiters {
    pub fn new(settings: WaitSettings) -> Self {
        Self {
            inner: Arc::new(Inner {
                keys: Mutex::new(HashMap::new()),
                everyone: watch::channel(0).0,
                slots: Arc::new(Semaphore::new(
                    settings.max_waiters.min(Semaphore::MAX_PERMITS),
                )),
                settings,
            }),
        }
    }

    pub fn settings(&self) -> WaitSettings {
        self.inner.settings
    }

    /// How many calls wait now.
    pub fn waiting(&self) -> usize {
        self.inner.settings.max_waiters - self.inner.slots.available_permits()
    }

    /// A place among the waiters of `key`, or `None` when all places are taken.
    pub fn register(&self, key: KeyHash) -> Option<Registration> {
        let slot = self.inner.slots.clone().try_acquire_owned().ok()?;
        let (own, claiming) = {
            let mut keys = self
                .inner
                .keys
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let shared = keys.entry(key.clone()).or_insert_with(|| KeyWaiters {
                changes: watch::channel(0).0,
                claiming: Arc::new(tokio::sync::Mutex::new(())),
            });
            (shared.changes.subscribe(), shared.claiming.clone())
        };
        Some(Registration {
            key,
            own,
            claiming,
            everyone: self.inner.everyone.subscribe(),
            inner: self.inner.clone(),
            _slot: slot,
        })
    }

    /// Wakes the waiters of `key`.
    pub fn changed(&self, key: &KeyHash) {
        let keys = self
            .inner
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(shared) = keys.get(key) {
            shared
                .changes
                .send_modify(|generation| *generation = generation.wrapping_add(1));
        }
    }

    /// Wakes every waiter.
    pub fn wake_all(&self) {
        self.inner
            .everyone
            .send_modify(|generation| *generation = generation.wrapping_add(1));
    }

    /// Wakes waiters as the store reports changes, until shutdown. A subscriber that fell
    /// behind has missed changes, so everyone looks again.
    pub async fn follow(
        self,
        mut events: broadcast::Receiver<KeyEvent>,
        shutdown: CancellationToken,
    ) {
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.recv() => event,
            };
            match event {
                Ok(KeyEvent::Changed(key)) => self.changed(&key),
                Ok(KeyEvent::Missed) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.wake_all();
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

/// One waiting call's place: its key's channel and the everyone channel.
pub struct Registration {
    key: KeyHash,
    own: watch::Receiver<u64>,
    everyone: watch::Receiver<u64>,
    claiming: Arc<tokio::sync::Mutex<()>>,
    inner: Arc<Inner>,
    _slot: OwnedSemaphorePermit,
}

impl Registration {
    /// Marks every change so far as seen: call it before looking at the key, so that a change
    /// after the look wakes [`Registration::changed`].
    pub fn mark_seen(&mut self) {
        self.own.borrow_and_update();
        self.everyone.borrow_and_update();
    }

    /// The right to hand the key to TryStart, if no other waiter of this replica has it now.
    /// The other waiters of the key are woken when it is given up, whatever came of it (even
    /// when the waiter holding it is dropped half-way): they may have looked at the key last
    /// while it had no row, and so watch none, and must look again.
    pub fn try_claim(&self) -> Option<Claiming<'_>> {
        let lock = self.claiming.clone().try_lock_owned().ok()?;
        Some(Claiming {
            registration: self,
            lock: Some(lock),
        })
    }

    /// Wakes the other waiters of this key.
    fn tell_others(&self) {
        let keys = self
            .inner
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(shared) = keys.get(&self.key) {
            shared
                .changes
                .send_modify(|generation| *generation = generation.wrapping_add(1));
        }
    }

    /// Resolves at the first change not yet seen.
    pub async fn changed(&mut self) {
        // The senders live as long as this registration (the map keeps the key's while it has
        // a receiver, `Inner` keeps everyone's), so neither wait ends on a closed channel.
        tokio::select! {
            _ = self.own.changed() => {}
            _ = self.everyone.changed() => {}
        }
    }
}

/// A waiter's turn to hand its key to TryStart (see [`Registration::try_claim`]).
pub struct Claiming<'a> {
    registration: &'a Registration,
    lock: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        // Released first, so that a woken waiter may take the turn at once.
        drop(self.lock.take());
        self.registration.tell_others();
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut keys = self
            .inner
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // This registration's receiver is still alive here: it is the last one when it counts 1.
        if keys
            .get(&self.key)
            .is_some_and(|shared| shared.changes.receiver_count() <= 1)
        {
            keys.remove(&self.key);
        }
    }
}

/// When a waiting call must answer: at the end of its wait, and a little before its caller's
/// deadline (so that the caller gets an answer, not DEADLINE_EXCEEDED). `None` when there is no
/// time to wait at all.
pub fn answer_by(wait: Duration, deadline: Option<Instant>) -> Option<Instant> {
    if wait.is_zero() {
        return None;
    }
    let now = Instant::now();
    let mut by = now + wait;
    if let Some(deadline) = deadline {
        let remaining = deadline.saturating_duration_since(now);
        let margin = (remaining / 10).max(DEADLINE_MARGIN);
        by = by.min(now + remaining.saturating_sub(margin));
    }
    (by > now).then_some(by)
}

/// The least a waiter keeps between its answer and its caller's deadline.
const DEADLINE_MARGIN: Duration = Duration::from_millis(20);

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(name: &str) -> KeyHash {
        use crate::domain::{Key, Scope};
        KeyHash::of(
            &Scope::parse("ns".into()).expect("scope"),
            &Key::parse(name.into()).expect("key"),
        )
    }

    fn settings(max_waiters: usize) -> WaitSettings {
        WaitSettings {
            max_waiters,
            recheck_interval: Duration::from_secs(5),
        }
    }

    #[test]
    fn the_latest_possible_now_keeps_up_with_the_wall_clock_when_the_monotonic_one_stops() {
        let clock = DatabaseClock::default();
        assert_eq!(
            clock.latest_possible_now(),
            None,
            "nothing before a reading"
        );
        let read = Utc::now();
        // A reading whose monotonic instant has not been reached yet: for this clock, no
        // monotonic time passes after it, as on a machine suspended right after its probe.
        clock.record(read, read, read, Instant::now() + Duration::from_secs(3600));
        std::thread::sleep(Duration::from_millis(30));
        let floor = Utc::now();
        let latest = clock.latest_possible_now().expect("a reading");
        assert!(
            latest >= floor,
            "{latest} is before the wall clock's {floor}: a stopped monotonic clock made it late"
        );
    }

    #[tokio::test]
    async fn a_change_wakes_only_that_keys_waiters_and_the_map_empties() {
        let waiters = Waiters::new(settings(10));
        let mut a = waiters.register(hash("a")).expect("a place");
        let mut b = waiters.register(hash("b")).expect("a place");
        a.mark_seen();
        b.mark_seen();
        waiters.changed(&hash("a"));
        tokio::time::timeout(Duration::from_secs(1), a.changed())
            .await
            .expect("a is woken");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), b.changed())
                .await
                .is_err(),
            "b is not"
        );
        waiters.wake_all();
        tokio::time::timeout(Duration::from_secs(1), b.changed())
            .await
            .expect("everyone is woken");
        assert_eq!(waiters.waiting(), 2);
        drop((a, b));
        assert_eq!(waiters.waiting(), 0);
        assert!(waiters.inner.keys.lock().expect("keys").is_empty());
    }

    #[tokio::test]
    async fn a_change_before_the_sleep_is_not_missed() {
        let waiters = Waiters::new(settings(10));
        let mut a = waiters.register(hash("a")).expect("a place");
        a.mark_seen();
        // The change lands between the waiter's look and its sleep.
        waiters.changed(&hash("a"));
        tokio::time::timeout(Duration::from_secs(1), a.changed())
            .await
            .expect("woken at once");
    }

    /// A waiter's turn at TryStart, given up in any way (here: dropped, as when its caller
    /// hangs up half-way), wakes the key's other waiters, and the turn is free again.
    #[tokio::test]
    async fn a_turn_given_up_wakes_the_other_waiters_of_the_key() {
        let waiters = Waiters::new(settings(10));
        let claimer = waiters.register(hash("a")).expect("a place");
        let mut other = waiters.register(hash("a")).expect("a place");
        other.mark_seen();
        let turn = claimer.try_claim().expect("the turn is free");
        assert!(other.try_claim().is_none(), "one turn at a time");
        drop(turn);
        tokio::time::timeout(Duration::from_secs(1), other.changed())
            .await
            .expect("woken when the turn was given up");
        assert!(other.try_claim().is_some(), "the turn is free again");
    }

    #[test]
    fn places_are_bounded() {
        let waiters = Waiters::new(settings(1));
        let first = waiters.register(hash("a"));
        assert!(first.is_some());
        assert!(
            waiters.register(hash("b")).is_none(),
            "the one place is taken"
        );
        drop(first);
        assert!(waiters.register(hash("b")).is_some());
    }

    #[test]
    fn the_answer_comes_before_the_deadline() {
        let now = Instant::now();
        assert_eq!(answer_by(Duration::ZERO, None), None);
        let by = answer_by(Duration::from_secs(10), Some(now + Duration::from_secs(1)))
            .expect("time to wait");
        assert!(by <= now + Duration::from_millis(900) + Duration::from_millis(5));
        assert_eq!(
            answer_by(
                Duration::from_secs(10),
                Some(now + Duration::from_millis(10))
            ),
            None,
            "no time left to wait"
        );
    }
}
