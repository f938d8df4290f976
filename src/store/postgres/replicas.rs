//! The replicas serving one database, as that database sees them: each writes a heartbeat a
//! few times a second (its row in `idempotency_replicas`, and a notification on a channel only
//! it listens to), and acknowledges an eraser's request when it has applied every erasure
//! committed before it.
//!
//! Notifications reach a listener in the order their transactions committed (PostgreSQL's
//! `NOTIFY`), whichever connection sent them. So when this replica hears its own heartbeat, it
//! has heard every erasure that committed before the heartbeat did, and the heartbeat was sent
//! after the instant its payload names: that instant is what the replay cache's confirmation
//! is measured from ([`crate::store::Erasure::Caught`]). The same order makes an eraser's
//! request (`barrier`) a question "have you applied everything before this?", which each
//! replica answers after applying what came before it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::PgStore;
use super::error::classify;
use super::sql::{
    ACKNOWLEDGE, ASK_ACKNOWLEDGEMENTS, BEAT, DEPART, FORGET_DEPARTED, REPLICAS_CHANNEL, own_channel,
};
use crate::store::{BarrierRequest, Erasure, Replicas, StoreError};

/// How often a replica writes its heartbeat.
pub const BEAT_EVERY: Duration = Duration::from_millis(250);

/// How long one heartbeat may take before it is given up (and tried at the next beat).
const BEAT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a replica's row stays after its last heartbeat before a starting replica deletes
/// it (rows of replicas that stopped: each start draws a new id).
const DEPARTED_AFTER: Duration = Duration::from_secs(24 * 3600);

/// This replica, as the store announces it.
pub(super) struct Replica {
    /// Drawn when the store is opened (a UUID v4, as 32 hex digits): a restarted process is a
    /// new replica, whose replay cache starts empty.
    pub id: String,
    /// The channel on which this replica hears its own heartbeat.
    pub channel: String,
    /// The instant a heartbeat's payload counts from (nanoseconds after it).
    anchor: Instant,
    /// Requests this replica has applied, whose acknowledgements are still to be sent.
    acks: Mutex<Vec<u64>>,
    /// Wakes the heartbeat's task: acknowledgements to send, or a beat wanted at once.
    wake: tokio::sync::Notify,
    /// The listener has just started listening: a beat at once confirms the replica sooner.
    beat_now: AtomicBool,
    /// Held while a heartbeat is written, and while the replica's row is deleted as it
    /// leaves (then set): no heartbeat writes the row again after that.
    departed: tokio::sync::Mutex<bool>,
}

impl Replica {
    pub fn new() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Self {
            channel: own_channel(&id),
            id,
            anchor: Instant::now(),
            acks: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            beat_now: AtomicBool::new(false),
            departed: tokio::sync::Mutex::new(false),
        }
    }

    /// The announcement a notification on this replica's channel or [`REPLICAS_CHANNEL`] makes,
    /// if it is one.
    pub fn heard(&self, channel: &str, payload: &str) -> Option<Erasure> {
        if channel == self.channel {
            let nanos: u64 = payload.parse().ok()?;
            let sent = self.anchor + Duration::from_nanos(nanos);
            return Some(Erasure::Caught { sent, part: 0 });
        }
        if channel != REPLICAS_CHANNEL {
            return None;
        }
        let mut words = payload.split(' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("barrier"), Some(id), None, None) => id.parse().ok().map(Erasure::Barrier),
            (Some("ack"), Some(id), Some(replica), None) => Some(Erasure::Acknowledged {
                barrier: id.parse().ok()?,
                replica: replica.to_owned(),
            }),
            _ => None,
        }
    }

    /// The listener (re)started listening.
    pub fn listening(&self) {
        self.beat_now.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    pub fn acknowledge(&self, barrier: u64) {
        self.acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(barrier);
        self.wake.notify_one();
    }

    fn take_acks(&self) -> Vec<String> {
        let barriers =
            std::mem::take(&mut *self.acks.lock().unwrap_or_else(PoisonError::into_inner));
        barriers
            .into_iter()
            .map(|barrier| format!("ack {barrier} {}", self.id))
            .collect()
    }
}

impl PgStore {
    /// Writes this replica's heartbeat every [`BEAT_EVERY`] (and at once when the listener has
    /// just started listening), and sends the acknowledgements of the requests it has applied,
    /// until shutdown. A failure is logged and tried again at the next beat: meanwhile this
    /// replica's replay cache stops serving once its confirmation runs out, which is all the
    /// safety an erasure needs.
    pub(super) async fn beat_until(&self, shutdown: &CancellationToken) {
        if let Err(error) = sqlx::query(FORGET_DEPARTED)
            .bind(DEPARTED_AFTER.as_secs_f64())
            .execute(&self.beat_pool)
            .await
        {
            tracing::debug!(%error, "could not forget the replicas gone for a day");
        }
        let mut every = tokio::time::interval(BEAT_EVERY);
        every.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            let beat = tokio::select! {
                () = shutdown.cancelled() => return,
                _ = every.tick() => true,
                () = self.replica.wake.notified() => self.replica.beat_now.swap(false, Ordering::SeqCst),
            };
            let acks = self.replica.take_acks();
            let mut sent = Ok(());
            if !acks.is_empty() {
                sent = self.send(sqlx::query(ACKNOWLEDGE).bind(acks)).await;
            }
            if beat && sent.is_ok() {
                let departed = self.replica.departed.lock().await;
                if *departed {
                    return;
                }
                let payload = self.replica.anchor.elapsed().as_nanos().to_string();
                sent = self
                    .send(
                        sqlx::query(BEAT)
                            .bind(&self.replica.id)
                            .bind(&self.replica.channel)
                            .bind(payload),
                    )
                    .await;
            }
            match sent {
                Ok(()) => failing = false,
                Err(error) if !failing => {
                    failing = true;
                    tracing::warn!(%error, "this replica's heartbeat failed; until one succeeds, \
                        its replay cache serves nothing once its confirmation runs out");
                }
                Err(error) => tracing::debug!(%error, "the heartbeat still fails"),
            }
        }
    }

    /// Runs `statement` on the heartbeat's connection within [`BEAT_TIMEOUT`].
    async fn send(
        &self,
        statement: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<(), String> {
        match tokio::time::timeout(BEAT_TIMEOUT, statement.execute(&self.beat_pool)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!("no answer within {BEAT_TIMEOUT:?}")),
        }
    }
}

impl Replicas for PgStore {
    fn has_replicas(&self) -> bool {
        true
    }

    fn acknowledge(&self, barrier: u64) {
        self.replica.acknowledge(barrier);
    }

    /// Deletes this replica's row, so that erasures stop waiting for it (its replay cache has
    /// stopped serving: the caller's promise).
    async fn depart(&self) {
        // After any heartbeat being written, and before any other: none writes the row again.
        let mut departed = self.replica.departed.lock().await;
        *departed = true;
        if let Err(error) = self.send(sqlx::query(DEPART).bind(&self.replica.id)).await {
            tracing::debug!(%error, "could not delete this replica's row; it is forgotten \
                in a few seconds anyway");
        }
    }

    /// Asks every replica listening to acknowledge once it has applied every erasure that
    /// committed before this request, and answers the replicas whose heartbeat the database
    /// clock saw within `seen_within`: one statement, on the heartbeat's own connection (on the
    /// listeners' hosts), never on the calls' pool. Erasures that end together (an operator's
    /// batch) would otherwise take the calls' connections while each waits its turn to
    /// announce, and the calls on other keys would wait for them (a stall of 200–500 ms was
    /// measured behind sixteen erasures at once).
    async fn ask_acknowledgements(
        &self,
        request: BarrierRequest<'_>,
    ) -> Result<Vec<String>, StoreError> {
        let asked = sqlx::query_as(ASK_ACKNOWLEDGEMENTS)
            .bind(format!("barrier {}", request.barrier))
            .bind(request.seen_within.as_secs_f64())
            .fetch_one(&self.beat_pool);
        match tokio::time::timeout(BEAT_TIMEOUT, asked).await {
            Ok(Ok((live,))) => Ok(live),
            Ok(Err(error)) => Err(classify(error)),
            Err(_) => Err(StoreError::TimedOut(BEAT_TIMEOUT)),
        }
    }
}
