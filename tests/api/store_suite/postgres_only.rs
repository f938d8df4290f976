//! What only the PostgreSQL store has: plans that PostgreSQL keeps for a connection's life, a
//! lone TryStart's two statements, the connections the store keeps between statements, and
//! announcements (`pg_notify`) only of the keys that waiters watch.

use std::time::Duration;

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{KeyHash, KeyState, TryStartOutcome};
use idempotency_coordinator::store::{KeyEvent, LockWait, Store};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

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
    let held = claimed(&store, claim("a")).await;
    assert!(matches!(
        store.try_start(&claim("a")).await.expect("a again"),
        TryStartOutcome::InProgress { .. }
    ));
    // A waiter's look: marks the key watched, then finds it marked.
    for _ in 0..2 {
        store.watch(&lookup("a")).await.expect("watch a");
    }
    let round = Round::new(vec![claim("b"), claim("c")]).expect("distinct keys");
    let tokens: Vec<_> = store
        .try_start_batch(&round)
        .await
        .into_iter()
        .map(|answer| started(answer.expect("claimed")).lease_token)
        .collect();
    extended(
        &store,
        extend("a", held.lease_token, Duration::from_secs(60)),
    )
    .await;
    completed(&store, complete("a", held.lease_token, b"done")).await;
    let round = Round::new(vec![
        complete("b", tokens[0], b"b"),
        complete("c", tokens[1], b"c"),
    ])
    .expect("distinct keys");
    for answer in store.complete_batch(&round).await {
        answer.expect("complete").expect("completed");
    }
    assert!(matches!(
        store.lookup(&lookup("a")).await.expect("lookup"),
        KeyState::Completed { .. }
    ));
    let to_release = claimed(&store, claim("d")).await;
    released(&store, release("d", to_release.lease_token)).await;
    assert!(
        store
            .release(&release("a", held.lease_token))
            .await
            .expect("release")
            .is_err(),
        "a completed key is not released (the refusal is explained by a read)"
    );
    store
        .mark_processed(&mark("billing", &["e1"]))
        .await
        .expect("mark");
    let round = Round::new(vec![
        mark("billing", &["e1", "e2"]),
        mark("shipping", &["e1"]),
    ])
    .expect("marks never conflict");
    for answer in store.mark_processed_batch(&round).await {
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

#[tokio::test]
async fn a_statement_waiting_for_the_pool_gets_the_connection_another_kept() {
    let operation_timeout = Duration::from_secs(4);
    let database = TestDatabase::create(Backend::Postgres).await;
    let store = postgres_store_with_pool(&database, operation_timeout, 1);
    let (store, _database) = ready(store, database).await;
    claimed(&store, claim("kept")).await;

    let calls: Vec<_> = (0..40)
        .map(|index| {
            let store = store.clone();
            tokio::spawn(async move {
                if index % 2 == 0 {
                    store.lookup(&lookup("kept")).await.map(drop)
                } else {
                    store
                        .mark_processed(&mark("kept", &[&format!("event-{index}")]))
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

/// The next key event, within a generous bound.
async fn next_event(events: &mut broadcast::Receiver<KeyEvent>) -> KeyEvent {
    tokio::time::timeout(Duration::from_secs(10), events.recv())
        .await
        .expect("an event within 10 s")
        .expect("an event, none missed")
}

/// A Complete or Release announces its key only when a waiter watches it (an announcement costs
/// PostgreSQL a queue entry at commit and every replica's listener a wake-up). Keys nobody
/// watches are completed and released first, then a watched one: the first announcement heard
/// is the watched key's, since notifications are delivered in commit order. A Release of a
/// watched key is announced too.
#[tokio::test]
async fn only_the_keys_a_waiter_watches_are_announced() {
    let (store, _database) = postgres().await;
    let mut events = store.key_events();
    let shutdown = CancellationToken::new();
    let listening = tokio::spawn({
        let (store, shutdown) = (store.clone(), shutdown.clone());
        async move { store.watch_keys(shutdown).await }
    });
    assert_eq!(
        next_event(&mut events).await,
        KeyEvent::Missed,
        "the listener listens"
    );
    let announced = |name: &str| KeyEvent::Changed(KeyHash::of(&scope(NAMESPACE), &key(name)));

    let unwatched = claimed(&store, claim("unwatched")).await;
    let to_release = claimed(&store, claim("released")).await;
    let watched = claimed(&store, claim("watched")).await;
    for look in ["watch", "watch again (marked already)"] {
        assert!(
            matches!(
                store.watch(&lookup("watched")).await.expect(look),
                KeyState::InProgress { .. }
            ),
            "{look}: the key is in progress"
        );
    }
    completed(&store, complete("unwatched", unwatched.lease_token, b"u")).await;
    released(&store, release("released", to_release.lease_token)).await;
    completed(&store, complete("watched", watched.lease_token, b"w")).await;
    assert_eq!(
        next_event(&mut events).await,
        announced("watched"),
        "the first announcement is the watched key's: the others were not announced"
    );

    let held = claimed(&store, claim("watched-release")).await;
    store
        .watch(&lookup("watched-release"))
        .await
        .expect("watch");
    released(&store, release("watched-release", held.lease_token)).await;
    assert_eq!(next_event(&mut events).await, announced("watched-release"));

    shutdown.cancel();
    listening.await.expect("the listener ends");
}

/// A waiter's look marks the key watched with a statement that may wait for the row's lock;
/// what it answers is the key as that wait left it, never the row it saw before: a key deleted
/// meanwhile (by a Release or the reaper, whose announcement the waiter could not have asked
/// for) is absent, and a key completed meanwhile is completed.
#[tokio::test]
async fn a_watch_answers_the_key_as_the_lock_it_waited_for_left_it() {
    let (store, database) = postgres().await;
    for name in ["deleted", "completed"] {
        claimed(&store, claim(name)).await;
        let hold = database.hold_key(name).await;
        let watching = {
            // Patient, as a waiter's look at a held key runs (`service::held_keys`).
            let store = store.limited(
                std::time::Instant::now() + OPERATION_TIMEOUT,
                LockWait::Patient,
            );
            tokio::spawn(async move { store.watch(&lookup(name)).await })
        };
        crate::support::eventually(
            Duration::from_secs(10),
            "the watch waits for the row's lock",
            || async { database.blocked_postgres_statements().await == 1 },
        )
        .await;
        let state = if name == "deleted" {
            hold.delete_and_commit(name).await;
            watching.await.expect("the watch ran").expect("watched")
        } else {
            let idempotency_testkit::database::KeyHold::Postgres(mut connection) = hold else {
                unreachable!("a PostgreSQL hold");
            };
            for statement in [
                "UPDATE idempotency_keys SET response = 'r', completed_at = clock_timestamp()
                 WHERE key = 'completed'",
                "COMMIT",
            ] {
                sqlx::query(statement)
                    .execute(&mut connection)
                    .await
                    .expect("complete while holding");
            }
            watching.await.expect("the watch ran").expect("watched")
        };
        match (name, state) {
            ("deleted", KeyState::Absent) | ("completed", KeyState::Completed { .. }) => {}
            (name, other) => panic!("{name}: the watch answered {other:?}"),
        }
    }
}
