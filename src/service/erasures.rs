//! An erasure that every replica has honoured before it returns (docs/contract.md, "The admin
//! API"): once EraseKey, or EraseNamespace's last message, has answered, no replica serves
//! what it erased from its replay cache.
//!
//! Each replica applies the erasures the store announces to its own replay cache, in the order
//! they committed ([`follow_erasures`]). Two rules make that enough:
//!
//! 1. **A replay cache serves only while confirmed.** A replica's heartbeat, sent at instant
//!    `s`, is announced after every erasure that committed before it (`store/postgres/replicas.rs`);
//!    once the replica has applied those and hears the heartbeat, its cache may serve until
//!    `s + CONFIRMED_FOR`, by its own monotonic clock. Heartbeats go every quarter of that.
//! 2. **An eraser waits.** After its erasure committed, it asks every replica to acknowledge
//!    once it has applied what came before the request, and waits for every replica whose
//!    heartbeat the store's clock saw within [`SEEN_WITHIN`], or until [`CONFIRMED_FOR`] (and a
//!    margin) after the commit's answer, whichever comes first.
//!
//! A replica that did not acknowledge in time heard no heartbeat sent after the commit without
//! having applied the erasure first, so any confirmation it holds came from a heartbeat sent
//! before the commit, and has run out by the time the eraser returns: it serves nothing from
//! memory until a later heartbeat confirms it, and by then it has applied the erasure (or
//! forgotten everything, when its listener reconnected). A replica not seen within
//! [`SEEN_WITHIN`], longer than a confirmation lasts, sent its last heartbeat longer ago than
//! that. Only durations are compared across processes, never two clocks' readings, except the
//! store's clock against itself for [`SEEN_WITHIN`].

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::ReplayCache;
use crate::store::{AdminStore, AnyStore, BarrierRequest, Erasure, Replicas};

/// How long a heartbeat, heard back, confirms a replay cache after it was sent.
pub const CONFIRMED_FOR: Duration = Duration::from_secs(1);

/// A replica whose heartbeat the store's clock saw within this is live: an erasure waits for
/// it. Longer than [`CONFIRMED_FOR`], with room for the store's clock to be read late.
pub const SEEN_WITHIN: Duration = Duration::from_secs(3);

/// What an eraser waits beyond [`CONFIRMED_FOR`] for the replicas that did not acknowledge:
/// room for the rates of two machines' monotonic clocks to differ.
const MARGIN: Duration = Duration::from_millis(100);

/// Whether this replica's replay cache may serve now, for each part of the store (each cluster
/// of a clustered store confirms its own namespaces; one part otherwise). Cheap to clone (a
/// handle).
#[derive(Clone)]
pub struct Confirmation(Option<Arc<Confirmed>>);

/// Which part of the store serves a namespace.
pub type PartOf = Arc<dyn Fn(&str) -> usize + Send + Sync>;

struct Confirmed {
    anchor: Instant,
    /// Per part, nanoseconds after `anchor` until which it is confirmed (0: never yet).
    until: Box<[AtomicU64]>,
    part_of: PartOf,
}

impl Confirmation {
    /// For a store that one process serves (the embedded store): its cache forgets an
    /// erasure as it commits, and is always confirmed.
    pub fn always() -> Self {
        Self(None)
    }

    /// For a store that replicas share, in `parts` parts (`part_of` a namespace's):
    /// confirmed only by heartbeats heard back, each part by its own.
    pub fn by_heartbeats(parts: usize, part_of: PartOf) -> Self {
        Self(Some(Arc::new(Confirmed {
            anchor: Instant::now(),
            until: (0..parts.max(1)).map(|_| AtomicU64::new(0)).collect(),
            part_of,
        })))
    }

    /// Whether every part is confirmed.
    pub fn holds(&self) -> bool {
        match &self.0 {
            None => true,
            Some(confirmed) => (0..confirmed.until.len()).all(|part| confirmed.holds(part)),
        }
    }

    /// Whether the part that serves `namespace` is confirmed.
    pub fn holds_for(&self, namespace: &str) -> bool {
        match &self.0 {
            None => true,
            // One part (a single database): no need to ask which, on every replay.
            Some(confirmed) if confirmed.until.len() == 1 => confirmed.holds(0),
            Some(confirmed) => confirmed.holds((confirmed.part_of)(namespace)),
        }
    }

    /// Confirms nothing any more, whatever heartbeats say later.
    pub fn revoke(&self) {
        if let Some(confirmed) = &self.0 {
            for until in &confirmed.until {
                until.store(0, Ordering::Release);
            }
        }
    }

    /// A heartbeat sent at `sent` was heard back from `part` after every erasure it announced
    /// before was applied. One sent before this confirmation existed confirms nothing.
    pub fn renew(&self, part: usize, sent: Instant) {
        let Some(confirmed) = &self.0 else {
            return;
        };
        if let (Some(after), Some(until)) = (
            sent.checked_duration_since(confirmed.anchor),
            confirmed.until.get(part),
        ) {
            until.fetch_max(nanos(after + CONFIRMED_FOR), Ordering::AcqRel);
        }
    }
}

impl Confirmed {
    fn holds(&self, part: usize) -> bool {
        let now = nanos(self.anchor.elapsed());
        self.until
            .get(part)
            .is_some_and(|until| now < until.load(Ordering::Acquire))
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// Applies what the store announces, in order, until shutdown: each erasure to this replica's
/// replay cache (if it has one), each heartbeat heard back to its confirmation, and each
/// eraser's request by an acknowledgement (sent even without a cache, so that erasers need not
/// wait for this replica). The receiver is taken before serving begins, so that none is missed.
/// Meanwhile `idempotency_replay_cache_confirmed` says whether the cache may serve. At
/// shutdown the cache stops serving first, and then the replica tells the others not to wait
/// for it: the calls it still answers while it drains go to the store.
pub async fn follow_erasures(
    store: AnyStore,
    mut erasures: broadcast::Receiver<Erasure>,
    replays: Option<ReplayCache>,
    shutdown: CancellationToken,
) {
    let confirmed = replays
        .as_ref()
        .map(|_| metrics::gauge!("idempotency_replay_cache_confirmed"));
    let mut look = tokio::time::interval(CONFIRMED_FOR / 8);
    look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => {
                if let Some(replays) = &replays {
                    replays.stop_serving();
                }
                store.depart().await;
                return;
            }
            _ = look.tick() => {
                if let (Some(replays), Some(confirmed)) = (&replays, &confirmed) {
                    confirmed.set(f64::from(u8::from(replays.confirmed())));
                }
                continue;
            }
            next = erasures.recv() => next,
        };
        match (next, &replays) {
            (Err(broadcast::error::RecvError::Closed), _) => return,
            (Ok(Erasure::Barrier(barrier)), _) => store.acknowledge(barrier),
            (Ok(Erasure::Acknowledged { .. }), _) | (_, None) => {}
            (Ok(Erasure::Key { namespace, key }), Some(replays)) => {
                replays.forget_key(&namespace, &key);
            }
            (Ok(Erasure::Namespace(namespace)), Some(replays)) => {
                replays.forget_namespace(&namespace);
            }
            (Ok(Erasure::Caught { sent, part }), Some(replays)) => {
                replays.confirm(part, sent);
                if let Some(confirmed) = &confirmed {
                    confirmed.set(f64::from(u8::from(replays.confirmed())));
                }
            }
            (Ok(Erasure::Missed) | Err(broadcast::error::RecvError::Lagged(_)), Some(replays)) => {
                replays.forget_everything();
            }
        }
    }
}

/// How an erasure came to be honoured everywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Honoured {
    /// Every live replica acknowledged it (or the store has no other replicas).
    Acknowledged,
    /// These replicas did not acknowledge in time: their confirmations ran out meanwhile.
    OutlastedBy(Vec<String>),
    /// The replicas could not be asked (the store failed): every confirmation ran out.
    Unasked,
}

/// Waits until every replica has honoured the erasures whose commits had been answered at
/// `committed` (see the module's rules): every live replica acknowledged, or
/// [`CONFIRMED_FOR`] and the margin passed.
pub async fn every_replica_honoured(
    store: &AnyStore,
    committed: Instant,
    namespace: &str,
) -> Honoured {
    if !store.has_replicas() {
        return Honoured::Acknowledged;
    }
    let deadline = tokio::time::Instant::from_std(committed + CONFIRMED_FOR + MARGIN);
    // Subscribed before the request, so that no acknowledgement goes unheard.
    let mut heard = store.erasures();
    let barrier = uuid::Uuid::new_v4().as_u64_pair().0;
    let asked = store.ask_acknowledgements(BarrierRequest {
        barrier,
        scope: namespace,
        seen_within: SEEN_WITHIN,
    });
    let mut waiting: HashSet<String> = match tokio::time::timeout_at(deadline, asked).await {
        Ok(Ok(live)) => live.into_iter().collect(),
        Ok(Err(error)) => {
            tracing::warn!(error = %crate::telemetry::error_chain(&error),
                    "could not ask the replicas to acknowledge an erasure; waiting until their \
                     replay caches' confirmations have run out");
            tokio::time::sleep_until(deadline).await;
            return Honoured::Unasked;
        }
        Err(_) => return Honoured::Unasked,
    };
    let mut acknowledged = HashSet::new();
    loop {
        waiting.retain(|replica| !acknowledged.contains(replica));
        if waiting.is_empty() {
            return Honoured::Acknowledged;
        }
        let next = tokio::select! {
            () = tokio::time::sleep_until(deadline) => return outlasted_by(waiting),
            next = heard.recv() => next,
        };
        match next {
            Ok(Erasure::Acknowledged {
                barrier: answered,
                replica,
            }) if answered == barrier => {
                acknowledged.insert(replica);
            }
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => {
                tokio::time::sleep_until(deadline).await;
                return outlasted_by(waiting);
            }
        }
    }
}

fn outlasted_by(silent: HashSet<String>) -> Honoured {
    let mut silent: Vec<String> = silent.into_iter().collect();
    silent.sort();
    Honoured::OutlastedBy(silent)
}
