//! What only the PostgreSQL store has: plans that PostgreSQL keeps for a connection's life, a
//! lone TryStart's two statements, and the connections the store keeps between statements.

use std::time::Duration;

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::budget::TimeBudget;
use idempotency_coordinator::domain::{KeyState, TryStartOutcome};
use idempotency_coordinator::store::Store;
use sqlx::{Connection, PgConnection};

use super::*;

/// Waits until no session of the service is connected to `database`: a backend publishes its
/// statistics before it leaves `pg_stat_activity`.
async fn until_service_sessions_end(database: &TestDatabase) {
    crate::support::eventually(
        Duration::from_secs(10),
        "the service's sessions end",
        || async { database.service_sessions().await == 0 },
    )
    .await;
}

/// Every statement of the store, on a new and nearly empty database, where the planner would
/// read a whole table rather than an index (and a generic plan, kept for the connection's life,
/// would go on doing so as the table grows): none of them reads a whole table. PostgreSQL
/// counts each sequential scan per table; the count must not move.
#[tokio::test]
async fn no_statement_reads_a_whole_table_however_small_it_is() {
    let (migrated, database) = postgres().await;
    migrated.close().await;
    until_service_sessions_end(&database).await;
    let before = database.sequential_scans().await;

    let store = postgres_store_on(&database, OPERATION_TIMEOUT);
    let held = started(store.try_start(claim("a")).await.expect("claim a"));
    assert!(matches!(
        store.try_start(claim("a")).await.expect("a again"),
        TryStartOutcome::InProgress { .. }
    ));
    let round = Round::new(vec![claim("b"), claim("c")]).expect("distinct keys");
    let tokens: Vec<_> = store
        .try_start_batch(round)
        .await
        .into_iter()
        .map(|answer| started(answer.expect("claimed")).lease_token)
        .collect();
    store
        .extend_lease(extend("a", held.lease_token, Duration::from_secs(60)))
        .await
        .expect("extend")
        .expect("extended");
    store
        .complete(complete("a", held.lease_token, b"done"))
        .await
        .expect("complete")
        .expect("completed");
    let round = Round::new(vec![
        complete("b", tokens[0], b"b"),
        complete("c", tokens[1], b"c"),
    ])
    .expect("distinct keys");
    for answer in store.complete_batch(round).await {
        answer.expect("complete").expect("completed");
    }
    assert!(matches!(
        store.lookup(lookup("a")).await.expect("lookup"),
        KeyState::Completed { .. }
    ));
    let released = started(store.try_start(claim("d")).await.expect("claim d"));
    store
        .release(release("d", released.lease_token))
        .await
        .expect("release")
        .expect("released");
    assert!(
        store
            .release(release("a", held.lease_token))
            .await
            .expect("release")
            .is_err(),
        "a completed key is not released (the refusal is explained by a read)"
    );
    store
        .mark_processed(mark("billing", &["e1"]))
        .await
        .expect("mark");
    let round = Round::new(vec![
        mark("billing", &["e1", "e2"]),
        mark("shipping", &["e1"]),
    ])
    .expect("marks never conflict");
    for answer in store.mark_processed_batch(round).await {
        answer.expect("marked");
    }
    store.reap_expired_keys(10).await.expect("reap keys");
    store.reap_expired_events(10).await.expect("reap events");
    store.expired_backlog().await.expect("backlog");
    store.probe().await.expect("probe");
    store.clock().await.expect("clock");
    store.close().await;
    until_service_sessions_end(&database).await;

    assert_eq!(
        database.sequential_scans().await,
        before,
        "a statement of the store read a whole table"
    );
}

/// A lone TryStart first tries to insert its key, a statement that does nothing when the key
/// has a row, and then judges the row with a second one. When the first waited for another
/// transaction's insert of the key for longer than a connection may be waited for, the second
/// runs in a transaction of its own, with only what is left of the store's share of the budget;
/// its claim is committed like any other.
#[tokio::test]
async fn a_lone_try_start_that_waited_on_another_insert_still_claims_within_its_budget() {
    let operation_timeout = Duration::from_secs(4);
    let budget = TimeBudget::of(operation_timeout);
    let database = TestDatabase::create(Backend::Postgres).await;
    let store = postgres_store_on(&database, operation_timeout);
    let (store, database) = ready(store, database).await;

    // Another transaction inserts the key, its retention already over, and does not commit yet.
    let mut other = PgConnection::connect(&database.url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut other)
        .await
        .expect("begin");
    sqlx::query(
        "INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token, attempt,
                 lease_expires_at, retention_us, expires_at)
             VALUES ($1, 'slow', 'f0', nextval('lease_token_seq'), 1,
                     clock_timestamp() - interval '2 seconds', 1000000,
                     clock_timestamp() - interval '1 second')",
    )
    .bind(NAMESPACE)
    .execute(&mut other)
    .await
    .expect("insert the key");

    let claiming = {
        let store = store.clone();
        tokio::spawn(async move { store.try_start(claim("slow")).await })
    };
    crate::support::eventually(
        Duration::from_secs(10),
        "the TryStart waits for the other insert",
        || async { database.blocked_postgres_statements().await == 1 },
    )
    .await;
    // The subject of the test: the first statement waits longer than a connection's share
    // (but less than a statement may run), so the second gets what is left.
    tokio::time::sleep(budget.connection_wait + Duration::from_millis(200)).await;
    sqlx::query("COMMIT")
        .execute(&mut other)
        .await
        .expect("commit");

    let claim = started(
        claiming
            .await
            .expect("the task ran")
            .expect("answered within the budget"),
    );
    assert_eq!(claim.attempt, 1, "a key past its retention is claimed anew");
    assert_eq!(
        i64::try_from(database.key_lease_token("slow").await).expect("a token in range"),
        claim.lease_token.get(),
        "the claim was committed"
    );
    assert!(matches!(
        store.lookup(lookup("slow")).await.expect("lookup"),
        KeyState::InProgress { attempt: 1, .. }
    ));
}

/// The store keeps the connection a statement used for its next statement instead of giving it
/// back to the pool; a statement that waits for the pool meanwhile must still get it. With one
/// connection and many calls at once, every call is answered, none of them "timed out" waiting
/// for a connection that a finished statement kept.
#[tokio::test]
async fn a_statement_waiting_for_the_pool_gets_the_connection_another_kept() {
    let operation_timeout = Duration::from_secs(4);
    let database = TestDatabase::create(Backend::Postgres).await;
    let store = postgres_store_with_pool(&database, operation_timeout, 1);
    let (store, _database) = ready(store, database).await;
    started(store.try_start(claim("kept")).await.expect("claim"));

    let calls: Vec<_> = (0..40)
        .map(|index| {
            let store = store.clone();
            tokio::spawn(async move {
                if index % 2 == 0 {
                    store.lookup(lookup("kept")).await.map(drop)
                } else {
                    store
                        .mark_processed(mark("kept", &[&format!("event-{index}")]))
                        .await
                        .map(drop)
                }
            })
        })
        .collect();
    for call in calls {
        call.await
            .expect("the call ran")
            .expect("answered, not timed out waiting for the pool");
    }
    let (in_use, idle) = store.pool_connections();
    assert_eq!(
        (in_use, idle),
        (0, 1),
        "the one connection, kept between statements, counts as idle"
    );
}
