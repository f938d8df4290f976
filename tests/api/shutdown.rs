//! Shutdown and hang-ups: calls in flight get their answers, and store work that has begun runs
//! to its end even when nobody waits for it any more.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::{
    TryStartRequest, lookup_response::State, try_start_response::Outcome,
};
use sqlx::{Connection, PgConnection};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::database::TestDatabase;
use crate::support::process::ServerProcess;
use crate::support::*;

/// Holds a row lock on `key` from outside the service, so that the service's statements on
/// that key wait: a deterministic way to keep calls in flight.
async fn lock_key(database_url: &str, key: &str) -> PgConnection {
    let mut connection = PgConnection::connect(database_url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut connection)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
        .bind(key)
        .execute(&mut connection)
        .await
        .expect("lock the key");
    connection
}

async fn unlock(mut connection: PgConnection) {
    sqlx::query("ROLLBACK")
        .execute(&mut connection)
        .await
        .expect("rollback");
}

/// Waits until `count` statements of the service are blocked on a lock.
async fn wait_for_blocked_statements(pool: &sqlx::PgPool, count: i64) {
    eventually(
        Duration::from_secs(10),
        "statements are blocked on the lock",
        || async {
            let (blocked,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name = 'idempotency-coordinator'
               AND wait_event_type = 'Lock'",
            )
            .fetch_one(pool)
            .await
            .expect("read pg_stat_activity");
            blocked >= count
        },
    )
    .await;
}

#[tokio::test]
async fn a_complete_whose_caller_hung_up_still_completes() {
    let app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("hang-up");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = lock_key(&app.database.url, &key).await;

    let mut caller = client.clone();
    let call = tokio::spawn({
        let key = key.clone();
        async move {
            caller
                .complete(complete(&key, started.lease_token, b"paid"))
                .await
        }
    });
    wait_for_blocked_statements(&app.pool, 1).await;
    call.abort(); // the caller gives up: its request future is dropped, the stream reset
    assert!(call.await.is_err(), "the call was cancelled");
    unlock(lock).await;

    eventually(
        Duration::from_secs(10),
        "the detached Complete committed",
        || async {
            let mut client = client.clone();
            matches!(
                state(
                    client
                        .lookup(lookup(&key))
                        .await
                        .expect("Lookup")
                        .into_inner()
                ),
                State::Completed(_)
            )
        },
    )
    .await;
}

#[tokio::test]
async fn a_try_start_whose_caller_hung_up_is_found_again_by_its_attempt_id() {
    let app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("retry-claim");
    let abandoned = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &mut client, &key).await;
    let lock = lock_key(&app.database.url, &key).await;

    let request = TryStartRequest {
        attempt_id: "retry-me".into(),
        ..try_start(&key)
    };
    let mut caller = client.clone();
    let call = tokio::spawn({
        let request = request.clone();
        async move { caller.try_start(request).await }
    });
    wait_for_blocked_statements(&app.pool, 1).await;
    call.abort();
    let _ = call.await;
    unlock(lock).await;

    // The takeover ran to its end with nobody waiting for it...
    let token_now = || async {
        let (token,): (i64,) =
            sqlx::query_as("SELECT lease_token FROM idempotency_keys WHERE key = $1")
                .bind(&key)
                .fetch_one(&app.pool)
                .await
                .expect("read the row");
        u64::try_from(token).expect("positive token")
    };
    eventually(
        Duration::from_secs(10),
        "the detached takeover committed",
        || async { token_now().await != abandoned.lease_token },
    )
    .await;
    // ...so the caller's retry with the same attempt_id gets that very claim back.
    let retried = claim(&mut client, request).await;
    assert_eq!(retried.lease_token, token_now().await);
    assert_eq!(retried.attempt, 2);
}

#[tokio::test]
async fn calls_in_flight_at_shutdown_get_their_answers() {
    let mut app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("drain");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = lock_key(&app.database.url, &key).await;

    let completing = tokio::spawn({
        let mut client = client.clone();
        let key = key.clone();
        async move {
            client
                .complete(complete(&key, started.lease_token, b"drained"))
                .await
        }
    });
    let claiming: Vec<_> = (0..4)
        .map(|_| {
            let mut client = client.clone();
            let key = key.clone();
            tokio::spawn(async move { client.try_start(try_start(&key)).await })
        })
        .collect();
    wait_for_blocked_statements(&app.pool, 5).await;

    app.begin_shutdown();
    eventually(
        Duration::from_secs(5),
        "new connections are refused",
        || async { health_client(app.endpoint()).await.is_err() },
    )
    .await;
    unlock(lock).await;

    completing
        .await
        .expect("task")
        .expect("Complete answered during the drain");
    for call in claiming {
        let answer = call
            .await
            .expect("task")
            .expect("TryStart answered during the drain");
        match outcome(answer.into_inner()) {
            Outcome::InProgress(_) | Outcome::Completed(_) => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    let stopped = tokio::time::timeout(Duration::from_secs(10), app.stop()).await;
    assert!(matches!(stopped, Ok(Ok(()))), "clean stop: {stopped:?}");
}

#[tokio::test]
async fn the_drain_ends_when_the_grace_period_does() {
    let mut app =
        TestApp::spawn_with(&["--shutdown-grace", "300ms", "--operation-timeout", "2s"]).await;
    let mut client = app.client().await;
    let key = unique_key("grace");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = lock_key(&app.database.url, &key).await;
    let stuck = tokio::spawn({
        let mut client = client.clone();
        let key = key.clone();
        async move {
            client
                .complete(complete(&key, started.lease_token, b"late"))
                .await
        }
    });
    wait_for_blocked_statements(&app.pool, 1).await;

    let began = tokio::time::Instant::now();
    let stopped = tokio::time::timeout(Duration::from_secs(10), app.stop()).await;
    assert!(matches!(stopped, Ok(Ok(()))), "stopped: {stopped:?}");
    // Grace (300 ms), then at most the operation timeout (2 s) for the detached statement.
    assert!(began.elapsed() < Duration::from_secs(5));
    assert!(
        stuck.await.expect("task").is_err(),
        "the stuck call was cut off"
    );
    unlock(lock).await;
}

#[tokio::test]
async fn sigterm_answers_every_call_in_flight_and_exits_zero() {
    let database = TestDatabase::create().await;
    let mut server = ServerProcess::start(&database.url, &[]).await;
    let mut client = idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient::connect(server.endpoint())
        .await
        .expect("connect");
    let health = health_client(server.endpoint()).await.expect("connect");
    eventually(Duration::from_secs(20), "the binary serves", || async {
        let mut health = health.clone();
        matches!(
            health.check(HealthCheckRequest { service: String::new() }).await,
            Ok(response) if response.get_ref().status() == ServingStatus::Serving
        )
    })
    .await;

    let key = unique_key("sigterm");
    let started = claim(&mut client, try_start(&key)).await;
    let pool = database.pool().await;
    let lock = lock_key(&database.url, &key).await;
    let completing = tokio::spawn({
        let mut client = client.clone();
        let key = key.clone();
        async move {
            client
                .complete(complete(&key, started.lease_token, b"charged once"))
                .await
        }
    });
    let replaying: Vec<_> = (0..8)
        .map(|_| {
            let mut client = client.clone();
            let key = key.clone();
            tokio::spawn(async move { client.try_start(try_start(&key)).await })
        })
        .collect();
    wait_for_blocked_statements(&pool, 9).await;

    server.signal("TERM");
    // From the first moment of shutdown, health is not SERVING for anyone who asks anew.
    eventually(Duration::from_secs(5), "health stops serving", || async {
        let mut health = health.clone();
        !matches!(
            health.check(HealthCheckRequest { service: String::new() }).await,
            Ok(response) if response.get_ref().status() == ServingStatus::Serving
        )
    })
    .await;
    unlock(lock).await;

    completing.await.expect("task").expect("Complete answered");
    for call in replaying {
        let answer = call.await.expect("task").expect("TryStart answered");
        match outcome(answer.into_inner()) {
            Outcome::InProgress(_) => {}
            Outcome::Completed(done) => assert_eq!(done.response, b"charged once"),
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(server.wait(Duration::from_secs(20)).await, Some(0));
    let (response,): (Vec<u8>,) =
        sqlx::query_as("SELECT response FROM idempotency_keys WHERE key = $1")
            .bind(&key)
            .fetch_one(&pool)
            .await
            .expect("read the row");
    assert_eq!(response, b"charged once");
}
