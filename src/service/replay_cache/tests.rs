//! The replay cache alone: what it serves, by the database clock, while confirmed.

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
    let cache = ReplayCache::new(1 << 20, clock_reading(database_now), Confirmation::always())
        .expect("a cache");
    let completion = completion_expiring(database_now + chrono::Duration::seconds(10));
    cache.remember(
        cache.ticket(),
        &scope(),
        &key("k"),
        b"fp",
        b"answer",
        &completion,
    );
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
    let (cache, completion) = a_cache_and_a_completion_for_an_hour();
    cache.claimed(&scope(), &key("mine"), &fingerprint(b"fp"), 41);
    // A token this replica did not hand out: nothing to remember it by.
    cache.completed(
        cache.ticket(),
        &scope(),
        &key("theirs"),
        42,
        b"r",
        &completion,
    );
    assert_eq!(cache.lookup(&scope(), &key("theirs")), None);
    cache.completed(
        cache.ticket(),
        &scope(),
        &key("mine"),
        41,
        b"r",
        &completion,
    );
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
    let cache = ReplayCache::new(1 << 20, clock_reading(database_now), Confirmation::always())
        .expect("a cache");
    let margin = chrono::Duration::from_std(EXPIRY_MARGIN).expect("margin");
    let almost = completion_expiring(database_now + margin);
    cache.remember(
        cache.ticket(),
        &scope(),
        &key("almost"),
        b"fp",
        b"r",
        &almost,
    );
    assert_eq!(cache.weight(), 0, "not even kept");
    assert_eq!(cache.lookup(&scope(), &key("almost")), None);
}

#[test]
fn nothing_is_served_before_the_first_clock_reading() {
    let cache = ReplayCache::new(1 << 20, DatabaseClock::default(), Confirmation::always())
        .expect("a cache");
    let far = completion_expiring(chrono::Utc::now() + chrono::Duration::days(300));
    cache.remember(cache.ticket(), &scope(), &key("k"), b"fp", b"r", &far);
    assert_eq!(cache.lookup(&scope(), &key("k")), None);
}

#[test]
fn zero_bytes_is_no_cache_and_the_bound_holds() {
    assert!(ReplayCache::new(0, DatabaseClock::default(), Confirmation::always()).is_none());
    let database_now = chrono::Utc::now();
    let capacity = 64 * 1024;
    let cache = ReplayCache::new(
        capacity,
        clock_reading(database_now),
        Confirmation::always(),
    )
    .expect("a cache");
    let completion = completion_expiring(database_now + chrono::Duration::hours(1));
    for index in 0..1000 {
        cache.remember(
            cache.ticket(),
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

/// A cache of one process (always confirmed) whose clock read the database just now, and a
/// completion that expires an hour from then.
fn a_cache_and_a_completion_for_an_hour() -> (ReplayCache, Completion) {
    let database_now = chrono::Utc::now();
    let cache = ReplayCache::new(1 << 20, clock_reading(database_now), Confirmation::always())
        .expect("a cache");
    (
        cache,
        completion_expiring(database_now + chrono::Duration::hours(1)),
    )
}

/// Remembers key `k` (fingerprint `fp`, response `r`), read with `ticket`.
fn remember_k(cache: &ReplayCache, ticket: Ticket, completion: &Completion) {
    cache.remember(ticket, &scope(), &key("k"), b"fp", b"r", completion);
}

#[test]
fn a_record_read_before_an_erasure_applied_since_is_not_kept() {
    let (cache, completion) = a_cache_and_a_completion_for_an_hour();
    let before_erasure = cache.ticket();
    cache.forget_key("ns", "k");
    remember_k(&cache, before_erasure, &completion);
    assert_eq!(cache.lookup(&scope(), &key("k")), None);
    assert_eq!(cache.weight(), 0, "not even kept");
    // Read after it: kept.
    remember_k(&cache, cache.ticket(), &completion);
    assert!(cache.lookup(&scope(), &key("k")).is_some());
}

#[test]
fn a_replica_serves_only_while_a_heartbeat_confirms_it() {
    let database_now = chrono::Utc::now();
    let confirmation = Confirmation::by_heartbeats(1, Arc::new(|_: &str| 0));
    let cache = ReplayCache::new(1 << 20, clock_reading(database_now), confirmation.clone())
        .expect("a cache");
    let completion = completion_expiring(database_now + chrono::Duration::hours(1));
    remember_k(&cache, cache.ticket(), &completion);
    assert_eq!(cache.lookup(&scope(), &key("k")), None, "not confirmed yet");
    cache.confirm(0, std::time::Instant::now());
    assert!(cache.lookup(&scope(), &key("k")).is_some());
    // A heartbeat sent before the confirmation existed confirms nothing.
    let old = std::time::Instant::now();
    std::thread::sleep(Duration::from_millis(5));
    let later = Confirmation::by_heartbeats(1, Arc::new(|_: &str| 0));
    later.renew(0, old);
    assert!(!later.holds());
}

#[test]
fn each_part_of_the_store_confirms_its_own_namespaces() {
    let database_now = chrono::Utc::now();
    // Two parts: "ns" on part 0, every other namespace on part 1.
    let part_of = |namespace: &str| usize::from(namespace != "ns");
    let confirmation = Confirmation::by_heartbeats(2, Arc::new(part_of));
    let cache =
        ReplayCache::new(1 << 20, clock_reading(database_now), confirmation).expect("a cache");
    let completion = completion_expiring(database_now + chrono::Duration::hours(1));
    let other = Scope::parse("other".into()).expect("scope");
    remember_k(&cache, cache.ticket(), &completion);
    cache.remember(cache.ticket(), &other, &key("k"), b"fp", b"r", &completion);
    cache.confirm(1, std::time::Instant::now());
    assert!(cache.lookup(&other, &key("k")).is_some(), "part 1 heard");
    assert_eq!(cache.lookup(&scope(), &key("k")), None, "part 0 not heard");
    assert!(!cache.confirmed(), "not every part is confirmed");
    cache.confirm(0, std::time::Instant::now());
    assert!(cache.lookup(&scope(), &key("k")).is_some());
    assert!(cache.confirmed());
    // A part the store does not have confirms nothing.
    cache.stop_serving();
    cache.confirm(7, std::time::Instant::now());
    assert!(!cache.confirmed());
}
