//! TryStart with `wait`: a caller whose key is held waits for the holder instead of polling, and
//! gets what a TryStart would answer at that moment: `completed` after the holder's Complete,
//! `started` after a Release or once the lease has run out by the database clock, and
//! `in_progress` when the wait (or the caller's deadline) runs out first.

use std::time::{Duration, Instant};

use idempotency_coordinator::proto::idempotency::v1 as pb;
use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::proxy::TcpProxy;
use crate::support::*;

/// TryStart of `key` that may wait `wait` for the holder.
fn waiting(key: &str, wait: Duration) -> pb::TryStartRequest {
    try_start(key).with_wait(wait)
}

/// Starts a waiting TryStart in a task; answers its outcome and when it came.
fn spawn_waiter(
    client: &Client,
    request: pb::TryStartRequest,
) -> tokio::task::JoinHandle<(Result<pb::TryStartResponse, tonic::Status>, Instant)> {
    let mut client = client.clone();
    tokio::spawn(async move {
        let answer = client.try_start(request).await.map(|r| r.into_inner());
        (answer, Instant::now())
    })
}

async fn a_waiter_gets_the_holders_response_as_soon_as_it_completes(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("wait-complete");
    let held = claim(&mut client, try_start(&key)).await;
    let started = Instant::now();
    let waiter = spawn_waiter(&client, waiting(&key, Duration::from_secs(30)));
    app.wait_for_waiters(1).await;

    // The waiter may get its answer a moment before the holder gets the Complete's (both
    // follow the commit; with the replay cache the waiter reads the record from memory), so
    // it is compared with when the Complete was sent.
    let sent = Instant::now();
    complete_key(&client, &key, held.lease_token, b"the answer").await;
    let completed = Instant::now();
    let (answer, answered) = waiter.await.expect("waiter");
    let replay = expect_completed(answer.expect("TryStart"));
    assert_eq!(replay.response, b"the answer");
    assert!(answered >= sent, "answered after the Complete, not before");
    assert!(
        answered - started < Duration::from_secs(30),
        "woken by the Complete, not by the end of its wait"
    );
    println!(
        "waiter answered {:?} after the holder's Complete returned ({backend:?})",
        answered.saturating_duration_since(completed)
    );
    assert_eq!(app.waiting(), 0, "nobody waits any more");
}

async fn a_release_hands_the_key_to_a_waiter_with_a_higher_token(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("wait-release");
    let held = claim(&mut client, try_start(&key)).await;
    let waiter = spawn_waiter(&client, waiting(&key, Duration::from_secs(30)));
    app.wait_for_waiters(1).await;

    release_key(&client, &key, held.lease_token).await;
    let (answer, _) = waiter.await.expect("waiter");
    let taken = expect_started(answer.expect("TryStart"));
    assert!(taken.lease_token > held.lease_token);
    assert_eq!(taken.attempt, 1, "a released key starts fresh");
}

async fn a_waiter_takes_over_once_the_lease_has_run_out_and_not_before(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("wait-expiry");
    let held = claim(&mut client, try_start(&key).with_lease(millis(400))).await;
    let lease_ended = instant(&held.lease_expires_at);
    let taker = waiting(&key, Duration::from_secs(20)).with_lease(secs(30));
    let waiter = spawn_waiter(&client, taker);
    let (answer, _) = waiter.await.expect("waiter");
    let taken = expect_started(answer.expect("TryStart"));
    assert_eq!(taken.attempt, 2, "a takeover");
    assert!(taken.lease_token > held.lease_token);
    // The new lease began when the database judged the takeover: never before the old one
    // ended by the database clock.
    let taken_at = instant(&taken.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(
        taken_at >= lease_ended,
        "taken over at {taken_at}, before the lease ended at {lease_ended}"
    );
}

async fn the_wait_running_out_answers_in_progress(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("wait-out");
    let held = claim(&mut client, try_start(&key)).await;
    let started = Instant::now();
    let answer = try_start_response(&client, waiting(&key, Duration::from_millis(300))).await;
    let in_progress = expect_in_progress(answer);
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited");
    assert_eq!(in_progress.lease_expires_at, held.lease_expires_at);
}

async fn a_deadline_shorter_than_the_wait_gets_in_progress_before_it(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("wait-deadline");
    claim(&mut client, try_start(&key)).await;
    let mut request = tonic::Request::new(waiting(&key, Duration::from_secs(30)));
    request.set_timeout(Duration::from_millis(800));
    let started = Instant::now();
    let answer = client
        .try_start(request)
        .await
        .expect("an answer, not DEADLINE_EXCEEDED");
    expect_in_progress(answer.into_inner());
    assert!(started.elapsed() < Duration::from_millis(800));
}

async fn first_look_answers_are_given_at_once(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("wait-first-look");
    let started = Instant::now();
    let patient = waiting(&key, Duration::from_secs(30));
    let attempt = patient.clone().with_attempt("attempt-1");
    let held = claim(&mut client, attempt.clone()).await;
    let again = claim(&mut client, attempt).await;
    assert_eq!(
        again.lease_token, held.lease_token,
        "re-entry is not a wait"
    );
    let another = patient.clone().with_fingerprint(b"another request");
    expect_mismatch(try_start_response(&client, another).await);
    complete_key(&client, &key, held.lease_token, b"done").await;
    expect_completed(try_start_response(&client, patient).await);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "nothing waited"
    );
}

async fn waiting_beyond_the_waiter_limit_answers_at_once(backend: Backend) {
    let (app, mut client) = app_and_client_with(backend, &["--max-waiters", "1"]).await;
    let key = unique_key("wait-limit");
    let held = claim(&mut client, try_start(&key)).await;
    let first = spawn_waiter(&client, waiting(&key, Duration::from_secs(30)));
    app.wait_for_waiters(1).await;
    let started = Instant::now();
    let second = waiting(&key, Duration::from_secs(30));
    expect_in_progress(try_start_response(&client, second).await);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the second caller did not wait"
    );
    complete_key(&client, &key, held.lease_token, b"done").await;
    expect_completed(first.await.expect("waiter").0.expect("TryStart"));
}

async fn a_bad_wait_is_invalid_argument_and_writes_nothing(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    // (seconds, nanos): negative, over the 60 s limit, nanos out of range either way.
    let bad = [(-1, 0), (60, 1), (0, 1_000_000_000), (0, -5)];
    for (seconds, nanos) in bad {
        let key = unique_key("bad-wait");
        let request = pb::TryStartRequest {
            wait: Some(prost_types::Duration { seconds, nanos }),
            ..try_start(&key)
        };
        let status = client.try_start(request).await.expect_err("refused");
        assert_invalid(&status, &["wait"]);
        assert!(is_absent(&client, &key).await);
    }
    assert_eq!(app.total_rows().await, 0, "nothing was written");
    // 60 s is allowed.
    claim(
        &mut client,
        waiting(&unique_key("longest-wait"), Duration::from_secs(60)),
    )
    .await;
}

for_each_backend!(
    a_waiter_gets_the_holders_response_as_soon_as_it_completes,
    a_release_hands_the_key_to_a_waiter_with_a_higher_token,
    a_waiter_takes_over_once_the_lease_has_run_out_and_not_before,
    the_wait_running_out_answers_in_progress,
    a_deadline_shorter_than_the_wait_gets_in_progress_before_it,
    first_look_answers_are_given_at_once,
    waiting_beyond_the_waiter_limit_answers_at_once,
    a_bad_wait_is_invalid_argument_and_writes_nothing,
    shutdown_answers_every_waiter_at_once,
    one_complete_wakes_a_thousand_waiters,
);

/// PostgreSQL only: replicas share a database; a waiter on one is woken by a Complete on the
/// other, through LISTEN/NOTIFY.
#[tokio::test]
async fn a_complete_on_one_replica_wakes_a_waiter_on_another() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let flags = ["--waiter-recheck-interval", "10m"];
    let (one, other) = (
        ServerProcess::start(&database.url, &flags).await,
        ServerProcess::start(&database.url, &flags).await,
    );
    let (mut on_one, on_other) = (
        one.client_when_serving().await,
        other.client_when_serving().await,
    );
    let key = unique_key("replicas");
    let held = claim(&mut on_one, try_start(&key)).await;
    let started = Instant::now();
    let waiter = spawn_waiter(&on_other, waiting(&key, Duration::from_secs(30)));
    // The waiter is registered once a probe with a wait of zero still sees the key held.
    eventually(Duration::from_secs(10), "the waiter waits", || async {
        waiter_is_waiting(&waiter)
    })
    .await;
    complete_key(&on_one, &key, held.lease_token, b"from replica one").await;
    let (answer, _) = waiter.await.expect("waiter");
    assert_eq!(
        expect_completed(answer.expect("TryStart")).response,
        b"from replica one"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "woken by the other replica's Complete"
    );
}

/// Whether a spawned waiter is still waiting (not answered yet).
fn waiter_is_waiting<T>(waiter: &tokio::task::JoinHandle<T>) -> bool {
    !waiter.is_finished()
}

/// PostgreSQL only: the listening connection is cut while a call waits, and the holder
/// completes meanwhile (the notification is lost). Once the listener is back, every waiter
/// looks again, so the waiter gets the response long before its safety re-check.
#[tokio::test]
async fn a_waiter_is_answered_after_the_listener_reconnects() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let notify_url = proxy.database_url(database.postgres_name());
    let app = TestApp::start_on(
        database,
        None,
        &[
            "--notify-database-url",
            &notify_url,
            "--waiter-recheck-interval",
            "10m",
        ],
    )
    .await;
    app.wait_for_status(tonic_health::pb::health_check_response::ServingStatus::Serving)
        .await;
    let mut client = app.client().await;
    let key = unique_key("listener-cut");
    let held = claim(&mut client, try_start(&key)).await;
    let waiter = spawn_waiter(&client, waiting(&key, Duration::from_secs(40)));
    app.wait_for_waiters(1).await;

    proxy.cut();
    complete_key(&client, &key, held.lease_token, b"while nobody listened").await;
    let restored = Instant::now();
    proxy.restore();
    let (answer, answered) = waiter.await.expect("waiter");
    assert_eq!(
        expect_completed(answer.expect("TryStart")).response,
        b"while nobody listened"
    );
    assert!(
        answered - restored < Duration::from_secs(30),
        "answered after the reconnection, not at the end of the wait or a re-check"
    );
}

/// SIGTERM answers every waiter at once with the key as it stands, and the process exits 0.
async fn shutdown_answers_every_waiter_at_once(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let mut server = ServerProcess::start(&database.url, &["--shutdown-grace", "20s"]).await;
    let mut client = server.client_when_serving().await;
    let key = unique_key("wait-shutdown");
    claim(&mut client, try_start(&key)).await;
    let waiters: Vec<_> = (0..20)
        .map(|_| spawn_waiter(&client, waiting(&key, Duration::from_secs(50))))
        .collect();
    eventually(Duration::from_secs(10), "the waiters wait", || async {
        // A fresh waiter with no time to wait answers at once; the others are parked.
        waiters.iter().all(waiter_is_waiting)
    })
    .await;
    let signalled = Instant::now();
    server.signal("TERM");
    for waiter in waiters {
        let (answer, _) = waiter.await.expect("waiter");
        expect_in_progress(answer.expect("answered, not cut off"));
    }
    assert!(
        signalled.elapsed() < Duration::from_secs(15),
        "waiting never delays the drain"
    );
    assert_eq!(server.wait(Duration::from_secs(25)).await, Some(0));
}

/// A thousand callers wait on one key; one Complete wakes them all with the same response.
/// Reports the memory each waiter costs: this process's resident memory holds the server and
/// the thousand client calls, so the figure is an upper bound of the server's share.
async fn one_complete_wakes_a_thousand_waiters(backend: Backend) {
    const WAITERS: usize = 1000;
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("thousand");
    let held = claim(&mut client, try_start(&key)).await;
    // One connection carries at most 256 calls at once: spread the waiters over eight.
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(app.client().await);
    }
    let rss_before = own_rss_kib();
    let waiters: Vec<_> = (0..WAITERS)
        .map(|n| {
            spawn_waiter(
                &clients[n % clients.len()],
                waiting(&key, Duration::from_secs(50)),
            )
        })
        .collect();
    app.wait_for_waiters(WAITERS).await;
    let rss_waiting = own_rss_kib();
    let completed = Instant::now();
    complete_key(&client, &key, held.lease_token, b"for everyone").await;
    let mut slowest = Duration::ZERO;
    for waiter in waiters {
        let (answer, answered) = waiter.await.expect("waiter");
        assert_eq!(
            expect_completed(answer.expect("TryStart")).response,
            b"for everyone"
        );
        slowest = slowest.max(answered.saturating_duration_since(completed));
    }
    println!(
        "{WAITERS} waiters ({backend:?}): all answered within {slowest:?} of the Complete; RSS \
         {rss_before} KiB before, {rss_waiting} KiB while waiting: at most {:.1} KiB per waiter \
         (server and client together)",
        rss_waiting.saturating_sub(rss_before) as f64 / WAITERS as f64
    );
}

/// This process's resident memory, in KiB.
fn own_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .expect("proc status")
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[tokio::test]
async fn a_waiting_call_outside_its_scope_is_refused_at_once() {
    use crate::support::security::*;
    let (token, line) = token("orders", "orders-*");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(Backend::Sqlite, &["--tokens-file", &tokens.flag()]).await;
    let mut client = authed_client(app.endpoint(), Bearer::token(&token)).await;
    let status = client
        .try_start(waiting("k", Duration::from_secs(30)))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::PermissionDenied);
    assert_eq!(app.waiting(), 0);
}
