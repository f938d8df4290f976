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
//! The cache is bounded by bytes (`--replay-cache-bytes`): each entry weighs its key, response
//! and fingerprint plus a fixed overhead, and `quick_cache` evicts (CLOCK-Pro, scan resistant)
//! to stay within the bound.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use quick_cache::{Equivalent, Weighter};

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
    meters: Arc<Meters>,
}

/// The cache's metrics, registered once (no label hashing per call).
struct Meters {
    try_start: Outcomes,
    lookup: Outcomes,
    bytes: metrics::Gauge,
}

struct Outcomes {
    hit: metrics::Counter,
    miss: metrics::Counter,
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
        }
    }
}

impl ReplayCache {
    /// A cache of at most `capacity_bytes` (see [`ENTRY_OVERHEAD_BYTES`]), judging expiry by
    /// `clock`; `None` for 0 (no cache).
    pub fn new(capacity_bytes: u64, clock: DatabaseClock) -> Option<Self> {
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

    /// Remembers a completed record the store answered. A record that is already past (or
    /// within the margin of) its retention is not kept.
    pub fn remember(
        &self,
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
        self.records.insert(
            CacheKey {
                namespace: namespace.clone(),
                key: key.clone(),
            },
            record,
        );
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
    /// claim (otherwise the first replay fills the cache).
    pub fn completed(
        &self,
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
            self.remember(namespace, key, &claim.fingerprint, response, completion);
        }
    }

    /// Forgets whatever is cached of `key` (an operator erased it).
    pub fn forget_key(&self, namespace: &str, key: &str) {
        self.records.retain(|cached, _| {
            !(cached.namespace.as_str() == namespace && cached.key.as_str() == key)
        });
        self.meters.bytes.set(self.weight() as f64);
    }

    /// Forgets every record of `namespace` (an operator erased it). A walk over the cache:
    /// erasures are rare, and the cache is bounded.
    pub fn forget_namespace(&self, namespace: &str) {
        self.records
            .retain(|cached, _| cached.namespace.as_str() != namespace);
        self.meters.bytes.set(self.weight() as f64);
    }

    /// Forgets everything (erasures may have been missed).
    pub fn forget_everything(&self) {
        self.records.clear();
        self.meters.bytes.set(self.weight() as f64);
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

    /// The cached record of this key, if it is live; an expired one is dropped.
    fn live(&self, namespace: &Scope, key: &Key, outcomes: &Outcomes) -> Option<Arc<Record>> {
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
mod tests {
    use super::*;

    fn scope() -> Scope {
        Scope::parse("ns".into()).expect("scope")
    }

    fn key(name: &str) -> Key {
        Key::parse(name.into()).expect("key")
    }

    fn fingerprint(bytes: &[u8]) -> Fingerprint {
        Fingerprint::parse(bytes.to_vec()).expect("fingerprint")
    }

    /// A clock whose last reading of the database said `database_now`, just now.
    fn clock_reading(database_now: chrono::DateTime<chrono::Utc>) -> DatabaseClock {
        let clock = DatabaseClock::default();
        let now = chrono::Utc::now();
        clock.record(now, database_now, now, tokio::time::Instant::now());
        clock
    }

    fn completion_expiring(at: chrono::DateTime<chrono::Utc>) -> Completion {
        Completion {
            completed_at: at - chrono::Duration::hours(1),
            expires_at: at,
        }
    }

    #[test]
    fn a_live_record_replays_and_checks_the_fingerprint() {
        let database_now = chrono::Utc::now() - chrono::Duration::hours(5);
        let cache = ReplayCache::new(1 << 20, clock_reading(database_now)).expect("a cache");
        let completion = completion_expiring(database_now + chrono::Duration::seconds(10));
        cache.remember(&scope(), &key("k"), b"fp", b"answer", &completion);
        assert_eq!(
            cache.try_start(&scope(), &key("k"), &fingerprint(b"fp")),
            Some(TryStartOutcome::Completed {
                response: b"answer".to_vec(),
                completion: completion.clone(),
            })
        );
        assert_eq!(
            cache.try_start(&scope(), &key("k"), &fingerprint(b"other")),
            Some(TryStartOutcome::FingerprintMismatch)
        );
        assert_eq!(
            cache.lookup(&scope(), &key("k")),
            Some(KeyState::Completed {
                response: b"answer".to_vec(),
                fingerprint: b"fp".to_vec(),
                completion,
            })
        );
        assert_eq!(cache.lookup(&scope(), &key("unknown")), None);
    }

    #[test]
    fn a_complete_of_a_claim_handed_out_here_is_remembered_with_its_fingerprint() {
        let database_now = chrono::Utc::now();
        let cache = ReplayCache::new(1 << 20, clock_reading(database_now)).expect("a cache");
        let completion = completion_expiring(database_now + chrono::Duration::hours(1));
        cache.claimed(&scope(), &key("mine"), &fingerprint(b"fp"), 41);
        // A token this replica did not hand out: nothing to remember it by.
        cache.completed(&scope(), &key("theirs"), 42, b"r", &completion);
        assert_eq!(cache.lookup(&scope(), &key("theirs")), None);
        cache.completed(&scope(), &key("mine"), 41, b"r", &completion);
        assert_eq!(
            cache.try_start(&scope(), &key("mine"), &fingerprint(b"fp")),
            Some(TryStartOutcome::Completed {
                response: b"r".to_vec(),
                completion,
            })
        );
    }

    #[test]
    fn a_record_within_the_margin_of_its_retention_is_not_served() {
        // The service's own clock is far off the database's: only the database's counts.
        let database_now = chrono::Utc::now() + chrono::Duration::hours(3);
        let cache = ReplayCache::new(1 << 20, clock_reading(database_now)).expect("a cache");
        let margin = chrono::Duration::from_std(EXPIRY_MARGIN).expect("margin");
        let almost = completion_expiring(database_now + margin);
        cache.remember(&scope(), &key("almost"), b"fp", b"r", &almost);
        assert_eq!(cache.weight(), 0, "not even kept");
        assert_eq!(cache.lookup(&scope(), &key("almost")), None);
    }

    #[test]
    fn nothing_is_served_before_the_first_clock_reading() {
        let cache = ReplayCache::new(1 << 20, DatabaseClock::default()).expect("a cache");
        let far = completion_expiring(chrono::Utc::now() + chrono::Duration::days(300));
        cache.remember(&scope(), &key("k"), b"fp", b"r", &far);
        assert_eq!(cache.lookup(&scope(), &key("k")), None);
    }

    #[test]
    fn zero_bytes_is_no_cache_and_the_bound_holds() {
        assert!(ReplayCache::new(0, DatabaseClock::default()).is_none());
        let database_now = chrono::Utc::now();
        let capacity = 64 * 1024;
        let cache = ReplayCache::new(capacity, clock_reading(database_now)).expect("a cache");
        let completion = completion_expiring(database_now + chrono::Duration::hours(1));
        for index in 0..1000 {
            cache.remember(
                &scope(),
                &key(&format!("key-{index}")),
                b"fp",
                &[b'r'; 1000],
                &completion,
            );
            assert!(
                cache.weight() <= capacity,
                "{} > {capacity}",
                cache.weight()
            );
        }
        assert!(cache.weight() > capacity / 2, "it does fill up");
    }
}
