//! Replays from memory: a bounded cache, per replica, of completed records.
//!
//! A completed key's record never changes until its retention ends: no RPC reopens, rewrites
//! or deletes it early (a repeated Complete changes nothing; Release and ExtendLease are
//! refused; TryStart replays it), and the reaper deletes only expired rows. So a record read
//! from the store as completed may be answered from memory, to TryStart and Lookup, until its
//! `expires_at`, without asking the database again: the fingerprint is checked against the
//! cached one, exactly as the store would (a mismatch answers `fingerprint_mismatch`).
//!
//! Expiry is judged by the database clock, never this service's: an entry is served only while
//! the latest instant the database clock can read now ([`DatabaseClock::latest_possible_now`],
//! from the health probe's last reading and the monotonic time since, or this service's wall
//! clock moved by the measured offset when that is later) is a safety margin before
//! its `expires_at`. Before the first reading, nothing is served. The one thing the cache cannot
//! see is a record deleted by hand from the database: a replica may replay it until its
//! retention ends (docs/contract.md, Decisions).
//!
//! It fills from the store's answers: a TryStart or Lookup that found the key completed, and a
//! Complete of a claim this replica handed out (whose fingerprint it noted with the token).
//!
//! An erasure is the one other way a record goes early (the admin API). This replica's cache
//! forgets what any replica erased as the announcement arrives, serves only while its
//! heartbeat confirms that it has applied every erasure announced before
//! ([`Confirmation`], `service/erasures.rs`), and never keeps a record read before an erasure
//! it applied meanwhile ([`Ticket`]).
//!
//! The cache is bounded by bytes (`--replay-cache-bytes`): each entry weighs its key, response
//! and fingerprint plus a fixed overhead, and `quick_cache` evicts (CLOCK-Pro, scan resistant)
//! to stay within the bound.

use std::hash::{Hash, Hasher};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use quick_cache::sync::Cache;
use quick_cache::{Equivalent, Weighter};

use super::erasures::Confirmation;
use super::waiting::DatabaseClock;
use crate::domain::{Completion, Fingerprint, Key, KeyState, Scope, TryStartOutcome};

/// An entry is treated as expired this long before its `expires_at` by the database clock.
pub const EXPIRY_MARGIN: Duration = Duration::from_millis(500);

/// What an entry costs beyond its bytes: the key's and the record's headers, the `Arc`, the
/// cache's own slot (measured loosely; the bound is on the order of magnitude).
const ENTRY_OVERHEAD_BYTES: u64 = 160;

/// The default bound, chosen so that a loaded replica stays within 64 MiB of RSS (it peaks at
/// about 20–25 MiB without the cache, and the cache costs about 1.2 times its weight in
/// resident memory: a 32 MiB cache holding 29 MB made a loaded replica 56 MiB, too close).
pub const DEFAULT_CAPACITY_BYTES: u64 = 24 * 1024 * 1024;

/// The largest bound accepted (`--replay-cache-bytes`).
pub const MAX_CAPACITY_BYTES: u64 = 64 * 1024 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    namespace: Scope,
    key: Key,
}

/// A key borrowed from a command, hashed exactly as [`CacheKey`] (field by field, in order), so
/// that a look-up allocates nothing.
struct KeyRef<'a> {
    namespace: &'a Scope,
    key: &'a Key,
}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.namespace.hash(state);
        self.key.hash(state);
    }
}

impl Equivalent<CacheKey> for KeyRef<'_> {
    fn equivalent(&self, other: &CacheKey) -> bool {
        *self.namespace == other.namespace && *self.key == other.key
    }
}

/// A completed record as the store answered it.
#[derive(Debug)]
struct Record {
    fingerprint: Vec<u8>,
    response: Vec<u8>,
    completion: Completion,
}

#[derive(Debug, Clone, Copy)]
struct RecordWeight;

impl Weighter<CacheKey, Arc<Record>> for RecordWeight {
    fn weight(&self, key: &CacheKey, record: &Arc<Record>) -> u64 {
        (key.namespace.as_str().len()
            + key.key.as_str().len()
            + record.fingerprint.len()
            + record.response.len()) as u64
            + ENTRY_OVERHEAD_BYTES
    }
}

/// A claim's key and fingerprint.
#[derive(Debug)]
struct CacheKeyAndFingerprint {
    key: CacheKey,
    fingerprint: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
struct ClaimWeight;

impl Weighter<i64, Arc<CacheKeyAndFingerprint>> for ClaimWeight {
    fn weight(&self, _token: &i64, claim: &Arc<CacheKeyAndFingerprint>) -> u64 {
        (claim.key.namespace.as_str().len()
            + claim.key.key.as_str().len()
            + claim.fingerprint.len()) as u64
            + ENTRY_OVERHEAD_BYTES
    }
}

/// The share of the cache's bound kept for claims awaiting their Complete.
const CLAIMS_SHARE: u64 = 8;

/// The replay cache of one replica. Cheap to clone (a handle).
#[derive(Clone)]
pub struct ReplayCache {
    records: Arc<Cache<CacheKey, Arc<Record>, RecordWeight>>,
    /// The claims this replica handed out, by token, with their fingerprint: a Complete with
    /// that token is then remembered too (its answer does not carry the fingerprint). Tokens
    /// are never reused and a key keeps its fingerprint for as long as it keeps its token
    /// (re-entry needs the same fingerprint; a takeover draws a new token), so the record a
    /// Complete with the token completed has this fingerprint.
    claims: Arc<Cache<i64, Arc<CacheKeyAndFingerprint>, ClaimWeight>>,
    clock: DatabaseClock,
    /// Whether the cache may serve now: one process's always may; a replica's only while its
    /// heartbeat confirms it.
    confirmation: Confirmation,
    /// How many times the cache has forgotten erased records: a record read from the store
    /// before one of them (whose [`Ticket`] is older) is not kept, since the erasure may
    /// have removed it after it was read. A forgetting holds it for writing while it counts
    /// and walks the cache; a record is checked and inserted under it held for reading, so
    /// that no erased record is ever in the cache, even for a moment, once it was forgotten.
    erasures_applied: Arc<RwLock<u64>>,
    meters: Arc<Meters>,
}

/// Taken before a record is read from the store, and shown when it is remembered: a record
/// read before an erasure this cache applied since is not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Ticket(u64);

/// The cache's metrics, registered once (no label hashing per call).
struct Meters {
    try_start: Outcomes,
    lookup: Outcomes,
    bytes: metrics::Gauge,
}

struct Outcomes {
    hit: metrics::Counter,
    miss: metrics::Counter,
    /// Not looked at: the cache was not confirmed (its heartbeat not heard lately).
    unconfirmed: metrics::Counter,
}

impl Outcomes {
    fn of(operation: &'static str) -> Self {
        let counter = |outcome: &'static str| {
            metrics::counter!("idempotency_replay_cache_lookups_total",
                "operation" => operation, "outcome" => outcome)
        };
        Self {
            hit: counter("hit"),
            miss: counter("miss"),
            unconfirmed: counter("unconfirmed"),
        }
    }
}

impl ReplayCache {
    /// A cache of at most `capacity_bytes` (see [`ENTRY_OVERHEAD_BYTES`]), judging expiry by
    /// `clock`, serving while `confirmation` holds; `None` for 0 (no cache).
    pub fn new(
        capacity_bytes: u64,
        clock: DatabaseClock,
        confirmation: Confirmation,
    ) -> Option<Self> {
        if capacity_bytes == 0 {
            return None;
        }
        // An estimate of how many entries fit, for the table's initial size: records of a
        // few hundred bytes.
        let estimated_items = usize::try_from(capacity_bytes / 512).unwrap_or(usize::MAX);
        let claims_bytes = (capacity_bytes / CLAIMS_SHARE).max(1);
        Some(Self {
            records: Arc::new(Cache::with_weighter(
                estimated_items.clamp(16, 1 << 20),
                capacity_bytes - claims_bytes.min(capacity_bytes - 1),
                RecordWeight,
            )),
            claims: Arc::new(Cache::with_weighter(
                usize::try_from(claims_bytes / 256)
                    .unwrap_or(usize::MAX)
                    .clamp(16, 1 << 18),
                claims_bytes,
                ClaimWeight,
            )),
            clock,
            confirmation,
            erasures_applied: Arc::new(RwLock::new(0)),
            meters: Arc::new(Meters {
                try_start: Outcomes::of("TryStart"),
                lookup: Outcomes::of("Lookup"),
                bytes: metrics::gauge!("idempotency_replay_cache_bytes"),
            }),
        })
    }

    /// What TryStart answers for this key, if the cache knows it is completed and live: the
    /// replay, or `fingerprint_mismatch`.
    pub fn try_start(
        &self,
        namespace: &Scope,
        key: &Key,
        fingerprint: &Fingerprint,
    ) -> Option<TryStartOutcome> {
        let record = self.live(namespace, key, &self.meters.try_start)?;
        Some(if record.fingerprint == fingerprint.as_bytes() {
            TryStartOutcome::Completed {
                response: record.response.clone(),
                completion: record.completion.clone(),
            }
        } else {
            TryStartOutcome::FingerprintMismatch
        })
    }

    /// What Lookup answers for this key, if the cache knows it is completed and live.
    pub fn lookup(&self, namespace: &Scope, key: &Key) -> Option<KeyState> {
        let record = self.live(namespace, key, &self.meters.lookup)?;
        Some(KeyState::Completed {
            response: record.response.clone(),
            fingerprint: record.fingerprint.clone(),
            completion: record.completion.clone(),
        })
    }

    /// To be taken before reading from the store what [`Self::remember`] or
    /// [`Self::completed`] will be given.
    pub fn ticket(&self) -> Ticket {
        Ticket(
            *self
                .erasures_applied
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// A heartbeat sent at `sent` was heard back from the store's part `part` after every
    /// erasure that part announced before it was applied.
    pub fn confirm(&self, part: usize, sent: std::time::Instant) {
        self.confirmation.renew(part, sent);
    }

    /// Whether the cache may serve now, every part of the store.
    pub fn confirmed(&self) -> bool {
        self.confirmation.holds()
    }

    /// Remembers a completed record the store answered after `ticket` was taken. A record
    /// that is already past (or within the margin of) its retention is not kept, nor one read
    /// before an erasure this cache has applied since.
    pub fn remember(
        &self,
        ticket: Ticket,
        namespace: &Scope,
        key: &Key,
        fingerprint: &[u8],
        response: &[u8],
        completion: &Completion,
    ) {
        if !self.is_live(completion) {
            return;
        }
        let record = Arc::new(Record {
            fingerprint: fingerprint.to_vec(),
            response: response.to_vec(),
            completion: completion.clone(),
        });
        {
            let applied = self
                .erasures_applied
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            if *applied != ticket.0 {
                return;
            }
            self.records.insert(
                CacheKey {
                    namespace: namespace.clone(),
                    key: key.clone(),
                },
                record,
            );
        }
        self.meters.bytes.set(self.weight() as f64);
    }

    /// Notes a claim this replica handed out, so that its Complete can be remembered.
    pub fn claimed(&self, namespace: &Scope, key: &Key, fingerprint: &Fingerprint, token: i64) {
        self.claims.insert(
            token,
            Arc::new(CacheKeyAndFingerprint {
                key: CacheKey {
                    namespace: namespace.clone(),
                    key: key.clone(),
                },
                fingerprint: fingerprint.as_bytes().to_vec(),
            }),
        );
    }

    /// Whether this replica handed out the claim of `token` and waits for its Complete.
    pub fn awaits_completion(&self, token: i64) -> bool {
        self.claims.contains_key(&token)
    }

    /// Remembers the record a Complete with `token` completed, if this replica handed out the
    /// claim (otherwise the first replay fills the cache), as [`Self::remember`] does.
    pub fn completed(
        &self,
        ticket: Ticket,
        namespace: &Scope,
        key: &Key,
        token: i64,
        response: &[u8],
        completion: &Completion,
    ) {
        let Some((_, claim)) = self.claims.remove(&token) else {
            return;
        };
        // Tokens are unique across keys; the check costs nothing and keeps it obvious.
        if claim.key.namespace == *namespace && claim.key.key == *key {
            self.remember(
                ticket,
                namespace,
                key,
                &claim.fingerprint,
                response,
                completion,
            );
        }
    }

    /// Forgets whatever is cached of `key` (an operator erased it).
    pub fn forget_key(&self, namespace: &str, key: &str) {
        let mut applied = self.forgetting();
        *applied += 1;
        self.records.retain(|cached, _| {
            !(cached.namespace.as_str() == namespace && cached.key.as_str() == key)
        });
        self.meters.bytes.set(self.weight() as f64);
    }

    /// Forgets every record of `namespace` (an operator erased it). A walk over the cache:
    /// erasures are rare, and the cache is bounded.
    pub fn forget_namespace(&self, namespace: &str) {
        let mut applied = self.forgetting();
        *applied += 1;
        self.records
            .retain(|cached, _| cached.namespace.as_str() != namespace);
        self.meters.bytes.set(self.weight() as f64);
    }

    /// Forgets everything (erasures may have been missed).
    pub fn forget_everything(&self) {
        let mut applied = self.forgetting();
        *applied += 1;
        self.records.clear();
        self.meters.bytes.set(self.weight() as f64);
    }

    /// The count of erasures applied, held for writing while one is (see `erasures_applied`).
    fn forgetting(&self) -> std::sync::RwLockWriteGuard<'_, u64> {
        self.erasures_applied
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops serving at once, for good (this replica is shutting down and about to tell the
    /// others not to wait for it).
    pub fn stop_serving(&self) {
        self.confirmation.revoke();
    }

    /// The bytes the cache holds now, by its weights (claims awaiting their Complete
    /// included).
    pub fn weight(&self) -> u64 {
        self.records.weight() + self.claims.weight()
    }

    /// The bound on [`ReplayCache::weight`].
    pub fn capacity(&self) -> u64 {
        self.records.capacity() + self.claims.capacity()
    }

    /// The cached record of this key, if it is live and the cache confirmed; an expired one is
    /// dropped.
    fn live(&self, namespace: &Scope, key: &Key, outcomes: &Outcomes) -> Option<Arc<Record>> {
        if !self.confirmation.holds_for(namespace.as_str()) {
            outcomes.unconfirmed.increment(1);
            return None;
        }
        let wanted = KeyRef { namespace, key };
        let found = self.records.get(&wanted);
        let live = match found {
            Some(record) if self.is_live(&record.completion) => Some(record),
            Some(expired) => {
                // Only this entry: a record of the key's next life, cached meanwhile, stays.
                self.records
                    .remove_if(&wanted, |current| Arc::ptr_eq(current, &expired));
                None
            }
            None => None,
        };
        match live {
            Some(_) => outcomes.hit.increment(1),
            None => outcomes.miss.increment(1),
        }
        live
    }

    /// Whether the database clock surely reads less than `expires_at` minus the margin.
    fn is_live(&self, completion: &Completion) -> bool {
        let Some(latest_now) = self.clock.latest_possible_now() else {
            return false;
        };
        let margin = chrono::Duration::from_std(EXPIRY_MARGIN).unwrap_or(chrono::Duration::MAX);
        latest_now + margin < completion.expires_at
    }
}

#[cfg(test)]
mod tests;
