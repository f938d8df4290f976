//! The replay cache: completed records answered from memory, never past their retention by the
//! database clock, whatever this replica's own clock says.
//!
//! The proof deletes the completed row by hand once the cache holds it: from then on, only the
//! cache can answer `completed`, and the database answers `absent`. So every `completed` seen
//! comes from the cache, and each must have been given before the record's `expires_at` by the
//! database clock, read just before the call.
//!
//! These run on PostgreSQL only: on the embedded store the database clock is the coordinator
//! process's own clock (SQLite computes `now` in-process), so skewing the process's clock skews
//! the database's with it and there is nothing to tell apart.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::{
    lookup_response::State, try_start_response::Outcome,
};

use crate::support::process::{ServerProcess, coordinator};
use crate::support::*;

/// How long the test key is kept: long enough that the cache serves it for a while after the
/// margin, short enough for a test.
const RETENTION_SECS: u64 = 4;

/// Deletes `key`'s row behind the coordinator's back: from then on only its cache can answer
/// `completed`.
async fn delete_the_row_by_hand(database: &TestDatabase, key: &str) {
    sqlx::query("DELETE FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .execute(database.postgres_pool())
        .await
        .expect("delete the row by hand");
}

/// Claims and completes a key, replays it once (the store's answer fills the cache), deletes
/// its row by hand, then asks for it until the database clock is past its retention: every
/// `completed` must have been answered before then, and at least one must have been (the
/// cache did serve). Answers the number of cached replays seen.
async fn replayed_from_memory_only_within_retention(
    client: &mut Client,
    database: &TestDatabase,
    key: &str,
) -> usize {
    let short = try_start(key)
        .with_retention(secs(RETENTION_SECS))
        .with_lease(millis(500));
    let started = claim(client, short).await;
    let completed = complete_key(client, key, started.lease_token, b"the answer").await;
    let expires_at = instant(&completed.expires_at);
    // The first replay comes from the store and fills the cache. The health probe has read the
    // database clock by now (the process served health before the client connected).
    expect_completed(try_start_response(client, try_start(key)).await);
    delete_the_row_by_hand(database, key).await;

    let mut served = 0;
    loop {
        let before = database.now().await;
        // Lookup first: after a TryStart that claims afresh, the key is in progress.
        match key_state(client, key).await {
            State::Completed(looked_up) => {
                assert!(
                    before < expires_at,
                    "Lookup was answered from memory at {before} by the database clock, past \
                     the record's retention ({expires_at})"
                );
                assert_eq!(looked_up.response, b"the answer");
            }
            State::Absent(_) => {}
            other => panic!("unexpected Lookup: {other:?}"),
        }
        match outcome(try_start_response(client, try_start(key)).await) {
            Outcome::Completed(replayed) => {
                assert!(
                    before < expires_at,
                    "a replay was served at {before} by the database clock, past the record's \
                     retention ({expires_at})"
                );
                assert_eq!(replayed.response, b"the answer");
                assert_eq!(instant(&replayed.expires_at), expires_at);
                served += 1;
            }
            // Once the cache stops serving, the database decides: the row is gone, so the key
            // is claimed afresh.
            Outcome::Started(_) => break,
            other => panic!("unexpected TryStart: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            database.now().await < expires_at + chrono::Duration::seconds(5),
            "still served long past the retention"
        );
    }
    served
}

async fn with_the_clock_skewed_by(skew: &str) {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::from(
        coordinator()
            .serve_with_clock_skew(&database.url, &[], skew)
            .await
            .expect("start the coordinator under faketime"),
    );
    let mut client = server.client_when_serving().await;
    let served =
        replayed_from_memory_only_within_retention(&mut client, &database, &unique_key("skew"))
            .await;
    assert!(
        served > 0,
        "the cache never served the record (skew {skew})"
    );
}

#[tokio::test]
async fn postgres_a_replica_whose_clock_is_hours_behind_never_replays_past_retention() {
    with_the_clock_skewed_by("-2h").await;
}

#[tokio::test]
async fn postgres_a_replica_whose_clock_is_ahead_still_replays_from_memory() {
    with_the_clock_skewed_by("+90m").await;
}

#[tokio::test]
async fn postgres_with_the_cache_off_a_deleted_record_is_absent_at_once() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::start(&database.url, &["--replay-cache-bytes", "0"]).await;
    let mut client = server.client_when_serving().await;
    let key = unique_key("off");
    claim_and_complete(&mut client, &key, b"r").await;
    expect_completed(try_start_response(&client, try_start(&key)).await);
    delete_the_row_by_hand(&database, &key).await;
    assert!(is_absent(&client, &key).await);
}

/// A cached record answers a different fingerprint exactly as the store does.
async fn a_cached_record_answers_a_mismatch_like_the_store(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("mismatch");
    claim_and_complete(&mut client, &key, b"r").await;
    let another = try_start(&key).with_fingerprint(b"another request");
    for _ in 0..3 {
        // The first from the store, then from memory: the same answers.
        expect_completed(try_start_response(&client, try_start(&key)).await);
        expect_mismatch(try_start_response(&client, another.clone()).await);
    }
}

for_each_backend!(a_cached_record_answers_a_mismatch_like_the_store);
