//! Shutdown and hang-ups: calls in flight get their answers, and store work that has begun runs
//! to its end even when nobody waits for it any more.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;

use crate::support::process::ServerProcess;
use crate::support::*;

async fn a_complete_whose_caller_hung_up_still_completes(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("hang-up");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = app.database.hold_key(&key).await;

    let call = spawn_complete(&client, complete(&key, started.lease_token, b"paid"));
    app.wait_for_work_begun(1).await;
    call.abort(); // the caller gives up: its request future is dropped, the stream reset
    assert!(call.await.is_err(), "the call was cancelled");
    lock.release().await;

    wait_until_completed(&client, &key, "the detached Complete committed").await;
}

async fn a_try_start_whose_caller_hung_up_is_found_again_by_its_attempt_id(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("retry-claim");
    let abandoned = claim_and_let_lapse(&app, &mut client, try_start(&key)).await;
    let lock = app.database.hold_key(&key).await;

    let request = try_start(&key).with_attempt("retry-me");
    let call = spawn_try_start(&client, request.clone());
    app.wait_for_work_begun(1).await;
    call.abort();
    let _ = call.await;
    lock.release().await;

    // The takeover ran to its end with nobody waiting for it...
    let token_now = || app.database.key_lease_token(&key);
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

async fn calls_in_flight_at_shutdown_get_their_answers(backend: Backend) {
    let (mut app, mut client) = app_and_client(backend).await;
    let key = unique_key("drain");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = app.database.hold_key(&key).await;

    let completing = spawn_complete(&client, complete(&key, started.lease_token, b"drained"));
    let claiming = (0..4)
        .map(|_| spawn_try_start(&client, try_start(&key)))
        .collect::<Vec<_>>();
    app.wait_for_blocked(5).await;

    app.begin_shutdown();
    eventually(
        Duration::from_secs(5),
        "new connections are refused",
        || async { health_client(app.endpoint()).await.is_err() },
    )
    .await;
    lock.release().await;

    // Every call is answered during the drain.
    answer_of(completing).await;
    for call in claiming {
        match outcome(answer_of(call).await) {
            Outcome::InProgress(_) | Outcome::Completed(_) => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    let stopped = tokio::time::timeout(Duration::from_secs(10), app.stop()).await;
    assert!(matches!(stopped, Ok(Ok(()))), "clean stop: {stopped:?}");
}

async fn the_drain_ends_when_the_grace_period_does(backend: Backend) {
    let (mut app, mut client) = app_and_client_with(
        backend,
        &["--shutdown-grace", "300ms", "--operation-timeout", "2s"],
    )
    .await;
    let key = unique_key("grace");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = app.database.hold_key(&key).await;
    let stuck = spawn_complete(&client, complete(&key, started.lease_token, b"late"));
    app.wait_for_blocked(1).await;

    let began = tokio::time::Instant::now();
    let stopped = tokio::time::timeout(Duration::from_secs(10), app.stop()).await;
    assert!(matches!(stopped, Ok(Ok(()))), "stopped: {stopped:?}");
    // Grace (300 ms), then at most the operation timeout (2 s) for the detached statement.
    assert!(began.elapsed() < Duration::from_secs(5));
    assert!(
        stuck.await.expect("task").is_err(),
        "the stuck call was cut off"
    );
    lock.release().await;
}

/// PostgreSQL only: to send SIGTERM while calls are surely inside the store, the test must see
/// them waiting from outside the process, which PostgreSQL shows (pg_stat_activity) and SQLite
/// does not. The in-process drain tests above, which count the calls in flight, run on both.
#[tokio::test]
async fn sigterm_answers_every_call_in_flight_and_exits_zero() {
    let database = TestDatabase::create(Backend::Postgres).await;
    // From outside the process, calls are seen through their statements, so this test runs
    // each call as a statement of its own (coalescing would gather them into a few), and with a
    // pool whose held-key lane (a quarter of it) lets all nine wait in the store at once.
    let mut server =
        ServerProcess::start(&database.url, &["--no-coalesce", "--pool-size", "40"]).await;
    let mut client = idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient::connect(server.endpoint())
        .await
        .expect("connect");
    let health = health_client(server.endpoint()).await.expect("connect");
    eventually(Duration::from_secs(20), "the binary serves", || {
        is_serving(&health)
    })
    .await;

    let key = unique_key("sigterm");
    let started = claim(&mut client, try_start(&key)).await;
    // Eight other keys in progress, each asked for by a caller of its own: nine calls, each
    // waiting for its own held key in the store (a key's calls of one kind wait one at a time).
    let others: Vec<String> = (0..8).map(|n| format!("{key}-{n}")).collect();
    for other in &others {
        claim(&mut client, try_start(other)).await;
    }
    let held: Vec<&str> = std::iter::once(key.as_str())
        .chain(others.iter().map(String::as_str))
        .collect();
    let lock = database.hold_keys(&held).await;
    let completing = spawn_complete(
        &client,
        complete(&key, started.lease_token, b"charged once"),
    );
    let replaying = others
        .iter()
        .map(|other| spawn_try_start(&client, try_start(other).with_attempt("another")))
        .collect::<Vec<_>>();
    eventually(
        Duration::from_secs(10),
        "the calls wait in the store",
        || async { database.blocked_postgres_statements().await >= 9 },
    )
    .await;

    server.signal("TERM");
    // From the first moment of shutdown, health is not SERVING for anyone who asks anew.
    eventually(Duration::from_secs(5), "health stops serving", || async {
        !is_serving(&health).await
    })
    .await;
    lock.release().await;

    answer_of(completing).await;
    for call in replaying {
        match outcome(answer_of(call).await) {
            Outcome::InProgress(_) => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(server.wait(Duration::from_secs(20)).await, Some(0));
    let (response,): (Vec<u8>,) =
        sqlx::query_as("SELECT response FROM idempotency_keys WHERE key = $1")
            .bind(&key)
            .fetch_one(database.postgres_pool())
            .await
            .expect("read the row");
    assert_eq!(response, b"charged once");
}

async fn a_store_that_stops_answering_fails_the_call_within_the_operation_timeout(
    backend: Backend,
) {
    let (app, mut client) = app_and_client_with(backend, &["--operation-timeout", "500ms"]).await;
    let key = unique_key("stuck");
    let started = claim(&mut client, try_start(&key)).await;
    let lock = app.database.hold_key(&key).await;

    let began = tokio::time::Instant::now();
    let unanswered = client
        .complete(complete(&key, started.lease_token, b"r"))
        .await;
    assert_refused(unanswered, tonic::Code::Unavailable, "STORE_UNAVAILABLE");
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "bounded by the timeout"
    );
    lock.release().await;

    // The database stopped the statement, so the refused Complete did not commit later, once
    // the lock was gone: the key is still in progress, and its holder completes it now with
    // another response, which only succeeds if the first one never landed (a late commit of
    // "r" would make this ALREADY_COMPLETED), and is the one kept.
    expect_held_by_another(&client, &key).await;
    complete_key(&client, &key, started.lease_token, b"after the timeout").await;
    let done = looked_up_completed(&client, &key).await;
    assert_eq!(done.response, b"after the timeout");
}

async fn the_binary_reads_settings_from_the_environment_logs_json_and_stops_on_sigint(
    backend: Backend,
) {
    let database = TestDatabase::create(backend).await;
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"));
    match backend {
        Backend::Postgres => command.env("DATABASE_URL", &database.url),
        Backend::Sqlite => command
            .env_remove("DATABASE_URL")
            .env("IDEMPOTENCY_SQLITE_PATH", database.sqlite_path()),
    };
    let mut child = command
        .env("IDEMPOTENCY_LISTEN", "127.0.0.1:0")
        .env("IDEMPOTENCY_LOG_FORMAT", "json")
        .env("IDEMPOTENCY_DEFAULT_LEASE_TTL", "7s")
        .env("IDEMPOTENCY_HEALTH_CHECK_INTERVAL", "100ms")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the binary");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let address = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await.expect("read stdout") {
            let event: serde_json::Value =
                serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON: {line}"));
            if event["message"] == "listening" {
                return event["address"].as_str().expect("address field").to_owned();
            }
        }
        panic!("the binary exited without listening");
    })
    .await
    .expect("listening in time");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let endpoint = format!("http://{address}");
    let mut client = idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient::connect(endpoint.clone())
        .await
        .expect("connect");
    let health = health_client(endpoint).await.expect("connect");
    eventually(Duration::from_secs(20), "the binary serves", || {
        is_serving(&health)
    })
    .await;
    let started = claim(&mut client, try_start("env")).await;
    let lease_left = instant(&started.lease_expires_at) - database.now().await;
    let lease_secs = lease_left.num_milliseconds() as f64 / 1000.0;
    assert!(started.lease_token > 0);
    assert!(
        lease_secs > 5.0 && lease_secs <= 7.0,
        "default lease from the environment: {lease_secs}"
    );

    let pid = child.id().expect("running");
    let killed = std::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("exits in time")
        .expect("wait");
    assert_eq!(status.code(), Some(0));
}

for_each_backend!(
    a_complete_whose_caller_hung_up_still_completes,
    a_try_start_whose_caller_hung_up_is_found_again_by_its_attempt_id,
    calls_in_flight_at_shutdown_get_their_answers,
    the_drain_ends_when_the_grace_period_does,
    a_store_that_stops_answering_fails_the_call_within_the_operation_timeout,
    the_binary_reads_settings_from_the_environment_logs_json_and_stops_on_sigint,
);
