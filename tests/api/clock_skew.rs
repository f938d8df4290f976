//! "The database clock is the only clock": shown with the service's own clock two hours behind
//! the database's (libfaketime, `Binary::serve_with_clock_skew`). Leases, retention, completion
//! and processing instants are the database's, expiry is judged by it, and a TryStart that
//! waits for a holder is woken when the holder's lease ends by the database clock.
//!
//! PostgreSQL only: the embedded SQLite store reads its clock inside the service's process, so
//! there the service's clock is the database clock and cannot be skewed apart from it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, TryStartRequest, lookup_response::State, try_start_response::Outcome,
};

use crate::support::process::ServerProcess;
use crate::support::*;

/// Asserts that `at` is `offset` after an instant of the database clock in `[before, after]`.
fn within(
    what: &str,
    at: DateTime<Utc>,
    before: DateTime<Utc>,
    after: DateTime<Utc>,
    offset: chrono::Duration,
) {
    assert!(
        before + offset <= at && at <= after + offset,
        "{what} {at} is not by the database clock: expected within [{}, {}]",
        before + offset,
        after + offset
    );
}

#[tokio::test]
async fn leases_and_retention_follow_the_database_clock_when_the_service_clock_is_skewed() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::start_with_clock_skew(&database.url, &[], "-2h").await;
    let mut client = server.client_when_serving().await;
    let skewed = server.output();
    // The process's clock really is skewed: its log timestamps are two hours behind.
    let db_now = database.now().await;
    let behind = (db_now - chrono::Duration::hours(2))
        .format("%Y-%m-%dT%H")
        .to_string();
    let behind_earlier = (db_now - chrono::Duration::minutes(121))
        .format("%Y-%m-%dT%H")
        .to_string();
    assert!(
        skewed.contains(&behind) || skewed.contains(&behind_earlier),
        "the service's log carries its skewed clock ({behind}…): {skewed}"
    );

    // A claim: its lease and its retention counted from the database clock.
    let key = unique_key("skewed");
    let before = database.now().await;
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(300),
            retention: secs(1),
            ..try_start(&key)
        },
    )
    .await;
    let after = database.now().await;
    let lease_end = instant(&started.lease_expires_at);
    within(
        "lease_expires_at",
        lease_end,
        before,
        after,
        chrono::Duration::milliseconds(300),
    );
    within(
        "expires_at",
        database.key_expires_at(&key).await,
        before,
        after,
        chrono::Duration::seconds(1),
    );

    // A waiter is woken when the holder's lease ends by the database clock (by the service's
    // own clock it would run for two more hours): it takes the key over long before its wait,
    // and the safety re-check (5 s), are over.
    let waited = client
        .try_start(TryStartRequest {
            lease_ttl: secs(30),
            retention: secs(1),
            wait: secs(4),
            ..try_start(&key)
        })
        .await
        .expect("TryStart")
        .into_inner();
    let taken = match waited.outcome {
        Some(Outcome::Started(taken)) => taken,
        other => panic!("the waiter should take over once the lease ended: {other:?}"),
    };
    assert_eq!(taken.attempt, 2);
    assert!(database.now().await > lease_end);

    // Completion and its retention, by the database clock.
    let before = database.now().await;
    let done = client
        .complete(CompleteRequest {
            retention: secs(1),
            ..complete(&key, taken.lease_token, b"done")
        })
        .await
        .expect("Complete")
        .into_inner();
    let after = database.now().await;
    within(
        "completed_at",
        instant(&done.completed_at),
        before,
        after,
        chrono::Duration::zero(),
    );
    within(
        "expires_at",
        instant(&done.expires_at),
        before,
        after,
        chrono::Duration::seconds(1),
    );

    // Expiry judged by the database clock: absent once it passes expires_at (by the service's
    // clock the key would live two more hours).
    let expiry = instant(&done.expires_at);
    eventually(Duration::from_secs(5), "the key expired", || async {
        database.now().await > expiry
    })
    .await;
    assert!(matches!(key_state(&client, &key).await, State::Absent(_)));

    // An event's processing instant is the database's too.
    let before = database.now().await;
    let results = mark_results(&client, mark("skewed", &["evt"])).await;
    let after = database.now().await;
    within(
        "processed_at",
        instant(&results[0].processed_at),
        before,
        after,
        chrono::Duration::zero(),
    );
}
