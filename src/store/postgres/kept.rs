//! The connections the store's statements run on, kept by the store between statements.
//!
//! The driver's pool pings every connection given back to it (a `Sync` round trip, in a task it
//! spawns for the purpose) and offers no way to turn that off: one more round trip per
//! statement, which costs PostgreSQL a wake-up and a reply, and this service a task and two
//! socket operations. So the store gives a connection back to the pool only when it has a
//! reason to, and otherwise keeps it for its next statement: a connection whose statement
//! answered in full is in a known state (the driver reads a statement's answer up to its
//! `ReadyForQuery`), which is all that ping establishes. One that may not be (its statement
//! failed, or was abandoned half-way and dropped) is never kept: it goes back through the
//! driver, which pings it and closes it if broken.
//!
//! Kept connections are reused most recently used first. One that sat unused for over
//! [`PING_WHEN_IDLE_FOR`] is pinged before it is lent (the server or a firewall may have
//! dropped it meanwhile), and the store hands the driver back what stays unused that long, and
//! every connection it has kept for [`KEEP_AT_MOST`], so that the pool's own upkeep (idle
//! timeout, maximum lifetime) still reaches every connection.
//!
//! A connection whose statement was abandoned half-way (its caller's time ran out while the
//! statement was in flight: a commit waiting for a synchronous standby, a host cut off) is
//! closed rather than given back: the driver's ping on its return would wait behind the
//! statement, holding one of the pool's places for as long as the statement (or the TCP
//! keepalives) take. When the store moves to another host (`primary/`), the connections it
//! kept from before the move are closed too.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use super::primary::Follower;

/// How long a connection may sit unused before it is pinged ahead of its next statement.
pub(super) const PING_WHEN_IDLE_FOR: Duration = Duration::from_secs(1);

/// How long the store keeps a connection before it gives it back to the pool once.
const KEEP_AT_MOST: Duration = Duration::from_secs(60);

/// The calls' pool, and the connections taken from it that the store keeps.
#[derive(Debug)]
pub(super) struct KeptConnections {
    pool: PgPool,
    /// The host the pool connects to, and when it last moved.
    follower: std::sync::Arc<Follower>,
    /// Most recently used last.
    kept: Mutex<Vec<Kept>>,
    /// How many statements are waiting for a connection from the pool (or about to).
    waiting_for_pool: AtomicUsize,
}

#[derive(Debug)]
struct Kept {
    connection: PoolConnection<Postgres>,
    /// When it was taken from the pool.
    taken_at: Instant,
    /// When its last statement ended.
    used_at: Instant,
}

/// A connection lent to one statement (or to the few of one operation: a waiter's look and
/// mark). Dropped, it goes back to the pool through the driver;
/// [`Lent::keep`] keeps it instead.
#[derive(Debug)]
pub(super) struct Lent<'a> {
    home: &'a KeptConnections,
    connection: Settling,
    taken_at: Instant,
}

/// A connection of a pool that goes back to it only once its statement has settled (the driver
/// read its whole answer, or the server refused it): dropped before, it is closed.
#[derive(Debug)]
pub(super) struct Settling {
    connection: Option<PoolConnection<Postgres>>,
    settled: bool,
}

impl Settling {
    pub(super) fn new(connection: PoolConnection<Postgres>) -> Self {
        Self {
            connection: Some(connection),
            settled: false,
        }
    }

    /// The statement settled: the connection may go back to the pool.
    pub(super) fn settle(&mut self) {
        self.settled = true;
    }

    fn into_inner(mut self) -> Option<PoolConnection<Postgres>> {
        self.connection.take()
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        if !self.settled
            && let Some(connection) = self.connection.take()
        {
            drop_at_once(connection);
        }
    }
}

/// Takes `connection` out of its pool (whose place frees at once) and drops its socket, without
/// the driver's goodbye: on a host that is cut off even that may wait (up to the driver's own
/// close timeout) while holding the pool's place. The server sees the connection end.
pub(super) fn drop_at_once(connection: PoolConnection<Postgres>) {
    drop(connection.detach());
}

impl Deref for Settling {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        // Present until `into_inner`, which consumes it.
        self.connection.as_deref().expect("a settling connection")
    }
}

impl DerefMut for Settling {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.connection
            .as_deref_mut()
            .expect("a settling connection")
    }
}

impl KeptConnections {
    pub(super) fn new(pool: PgPool, follower: std::sync::Arc<Follower>) -> Self {
        Self {
            pool,
            follower,
            kept: Mutex::new(Vec::new()),
            waiting_for_pool: AtomicUsize::new(0),
        }
    }

    pub(super) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// How many connections the store keeps unused right now (the pool counts them in use).
    pub(super) fn unused(&self) -> usize {
        self.lock().len()
    }

    /// A connection for a statement: the one used last, if the store keeps any, else one from
    /// the pool (which waits up to its acquire timeout).
    pub(super) async fn lend(&self) -> Result<Lent<'_>, sqlx::Error> {
        if let Some(lent) = self.lend_kept().await {
            return Ok(lent);
        }
        // Counted before looking once more, and a keeper looks at the count after it has kept
        // its connection: either this look finds that connection, or the keeper sees this
        // statement waiting and gives the connection to the pool.
        self.waiting_for_pool.fetch_add(1, Ordering::SeqCst);
        let lent = match self.lend_kept().await {
            Some(lent) => Ok(lent),
            // Boxed, as the ping below: the driver's futures for these rarer paths are several
            // kilobytes, and every statement's future would otherwise carry (and move) them.
            None => Box::pin(self.pool.acquire()).await.map(|connection| Lent {
                home: self,
                connection: Settling::new(connection),
                taken_at: Instant::now(),
            }),
        };
        self.waiting_for_pool.fetch_sub(1, Ordering::SeqCst);
        lent
    }

    /// The kept connection used last, if there is one that answers.
    async fn lend_kept(&self) -> Option<Lent<'_>> {
        loop {
            let mut kept = self.lock().pop()?;
            if self.follower.taken_before_move(kept.taken_at)
                || self.follower.idle_since_trouble(kept.used_at.elapsed())
            {
                // Maybe to the host the store moved away from, or unused since trouble began:
                // closed, never pinged (a host cut off would hold the ping until the TCP
                // keepalives give up).
                drop_at_once(kept.connection);
                continue;
            }
            // A broken connection is dropped here: the driver's own ping on its return fails,
            // and it is closed.
            if kept.used_at.elapsed() <= PING_WHEN_IDLE_FOR
                || Box::pin(kept.connection.ping()).await.is_ok()
            {
                return Some(Lent {
                    home: self,
                    connection: Settling::new(kept.connection),
                    taken_at: kept.taken_at,
                });
            }
        }
    }

    /// Closes the pool: marks it closed, gives it every kept connection back (it waits for each
    /// one it lent), and waits until all are closed. A statement that ends meanwhile sees the
    /// mark under the same lock as this hand-back, so it never keeps a connection after it.
    pub(super) async fn close(&self) {
        let closing = self.pool.close();
        let kept = std::mem::take(&mut *self.lock());
        drop(kept);
        closing.await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Kept>> {
        // The vector is never left half-changed by a panic (only push, pop, drain), so a
        // poisoned lock still guards a sound list.
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Lent<'_> {
    /// The statement settled (its answer read in full, or refused by the server): dropped, the
    /// connection goes back to the pool rather than being closed.
    pub(super) fn settle(&mut self) {
        self.connection.settle();
    }

    /// Keeps the connection for the next statement; call it only once the statement answered
    /// in full. The pool gets it back instead when it has been kept long enough, when the pool
    /// is closing, or when a statement waits for the pool. Connections kept but unused for a
    /// while go back to the pool too.
    pub(super) fn keep(mut self) {
        self.connection.settle();
        let now = Instant::now();
        if now.duration_since(self.taken_at) > KEEP_AT_MOST {
            return;
        }
        let home = self.home;
        let Some(connection) = self.connection.into_inner() else {
            return;
        };
        let given_back = {
            let mut kept = home.lock();
            // Read under the lock that closing takes to hand the kept connections back.
            if home.pool.is_closed() {
                return;
            }
            let stale_count = kept
                .iter()
                .take_while(|k| now.duration_since(k.used_at) > PING_WHEN_IDLE_FOR)
                .count();
            let mut given_back: Vec<Kept> = kept.drain(..stale_count).collect();
            kept.push(Kept {
                connection,
                taken_at: self.taken_at,
                used_at: now,
            });
            if home.waiting_for_pool.load(Ordering::SeqCst) > 0 {
                given_back.extend(kept.pop());
            }
            given_back
        };
        // Dropped outside the lock: each drop spawns the driver's return to the pool.
        drop(given_back);
    }
}

impl Deref for Lent<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.connection
    }
}

impl DerefMut for Lent<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.connection
    }
}
