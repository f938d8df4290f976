//! The steps many tests take on the way to what they check, written once: a server and its
//! client, calls that must succeed, a claim whose lease or whole life has run out, a completed
//! key and its replay, and calls left waiting behind a held key.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idempotency_coordinator::proto::idempotency::v1::{self as pb, lookup_response::State};
use idempotency_testkit::load::Callers;
use tokio::task::JoinHandle;

use super::*;

/// A server on `backend` with the default test settings, and a client of it.
pub async fn app_and_client(backend: Backend) -> (TestApp, Client) {
    app_and_client_with(backend, &[]).await
}

/// A server on `backend` with extra flags, and a client of it.
pub async fn app_and_client_with(backend: Backend, flags: &[&str]) -> (TestApp, Client) {
    let app = TestApp::spawn_with(backend, flags).await;
    let client = app.client().await;
    (app, client)
}

/// The message of a call that must succeed.
pub fn answered<T>(answer: Result<tonic::Response<T>, tonic::Status>, rpc: &str) -> T {
    answer
        .unwrap_or_else(|status| panic!("{rpc} failed: {status:?}"))
        .into_inner()
}

/// Calls Complete, which must succeed, and answers the completion.
pub async fn complete_response(
    client: &Client,
    request: pb::CompleteRequest,
) -> pb::CompleteResponse {
    answered(client.clone().complete(request).await, "Complete")
}

/// Completes `key` as the holder of `token`, which must succeed, and answers the completion.
pub async fn complete_key(
    client: &Client,
    key: &str,
    token: u64,
    response: &[u8],
) -> pb::CompleteResponse {
    complete_response(client, complete(key, token, response)).await
}

/// Calls ExtendLease, which must succeed, and answers the new lease.
pub async fn extend_response(
    client: &Client,
    request: pb::ExtendLeaseRequest,
) -> pb::ExtendLeaseResponse {
    answered(client.clone().extend_lease(request).await, "ExtendLease")
}

/// Releases `key` as the holder of `token`, which must succeed.
pub async fn release_key(client: &Client, key: &str, token: u64) {
    answered(client.clone().release(release(key, token)).await, "Release");
}

/// Calls MarkProcessed, which must succeed, and answers its result per event.
pub async fn mark_results(
    client: &Client,
    request: pb::MarkProcessedRequest,
) -> Vec<pb::ProcessedEvent> {
    answered(
        client.clone().mark_processed(request).await,
        "MarkProcessed",
    )
    .results
}

/// Claims `key` and completes it with `response`; answers the claim and the completion.
pub async fn claim_and_complete(
    client: &mut Client,
    key: &str,
    response: &[u8],
) -> (pb::ClaimStarted, pb::CompleteResponse) {
    let started = claim(client, try_start(key)).await;
    let completion = complete_key(client, key, started.lease_token, response).await;
    (started, completion)
}

/// Asserts that a TryStart of `key` (by anybody: no attempt_id) replays `response`, and answers
/// the replay.
pub async fn expect_replay(client: &Client, key: &str, response: &[u8]) -> pb::ClaimCompleted {
    let replay = expect_completed(try_start_response(client, try_start(key)).await);
    assert_eq!(replay.response, response, "the replay of {key}");
    replay
}

/// Asserts that a TryStart of `key` finds it held by somebody else, and answers what it saw.
pub async fn expect_held_by_another(client: &Client, key: &str) -> pb::ClaimInProgress {
    expect_in_progress(try_start_response(client, try_start(key)).await)
}

/// Looks `key` up, which must be in progress, and answers the holder's state.
pub async fn looked_up_in_progress(client: &Client, key: &str) -> pb::KeyInProgress {
    match key_state(client, key).await {
        State::InProgress(held) => held,
        other => panic!("expected in_progress, got {other:?}"),
    }
}

/// Looks `key` up, which must be completed, and answers what is stored.
pub async fn looked_up_completed(client: &Client, key: &str) -> pb::KeyCompleted {
    match key_state(client, key).await {
        State::Completed(done) => done,
        other => panic!("expected completed, got {other:?}"),
    }
}

/// Asserts that Lookup finds `key` completed with `response` under the test fingerprint, with
/// the timestamps that its Complete answered.
pub async fn assert_stored(
    client: &Client,
    key: &str,
    response: &[u8],
    completion: &pb::CompleteResponse,
) {
    let done = looked_up_completed(client, key).await;
    assert_eq!(done.response, response);
    assert_eq!(done.fingerprint, FINGERPRINT);
    assert_eq!(done.completed_at, completion.completed_at);
    assert_eq!(done.expires_at, completion.expires_at);
}

/// Whether Lookup finds `key` absent.
pub async fn is_absent(client: &Client, key: &str) -> bool {
    matches!(key_state(client, key).await, State::Absent(_))
}

/// Waits until Lookup finds `key` completed: work the caller gave up on that still commits.
pub async fn wait_until_completed(client: &Client, key: &str, what: &str) {
    eventually(Duration::from_secs(10), what, || async {
        matches!(key_state(client, key).await, State::Completed(_))
    })
    .await;
}

/// The whole of a fingerprint mismatch on a fresh server: while a claim holds a key, a TryStart
/// of it with `fingerprint` (and `attempt_id`) is a mismatch that changes nothing (Lookup still
/// shows the holder's fingerprint and lease); once the holder completed, still a mismatch.
pub async fn a_fingerprint_mismatch_changes_nothing(
    backend: Backend,
    fingerprint: &[u8],
    attempt_id: &str,
) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("mismatch");
    let started = claim(&mut client, try_start(&key)).await;
    let other = try_start(&key)
        .with_fingerprint(fingerprint)
        .with_attempt(attempt_id);
    expect_mismatch(try_start_response(&client, other.clone()).await);
    let held = looked_up_in_progress(&client, &key).await;
    assert_eq!(held.fingerprint, FINGERPRINT);
    assert_eq!(held.lease_expires_at, started.lease_expires_at);

    complete_key(&client, &key, started.lease_token, b"done").await;
    expect_mismatch(try_start_response(&client, other).await);
}

/// Claims `key` and holds its row from outside (see `TestDatabase::hold_key`), then starts
/// `count` Completes of it, each in a task of its own on `client`'s connection: calls that
/// wait in the store until the hold is released.
pub async fn completes_behind_a_held_row(
    app: &TestApp,
    client: &mut Client,
    key: &str,
    count: usize,
) -> (database::KeyHold, Vec<Spawned<pb::CompleteResponse>>) {
    let started = claim(client, try_start(key)).await;
    let hold = app.database.hold_key(key).await;
    let request = complete(key, started.lease_token, b"r");
    let calls = (0..count)
        .map(|_| spawn_complete(client, request.clone()))
        .collect();
    (hold, calls)
}

/// The lease of a claim that a test lets run out: short, so that waiting for it costs little.
pub const SHORT_LEASE_MS: u64 = 100;

/// Claims with `request`, but with a short lease, and waits until the lease has run out by the
/// database clock: a holder that went quiet, whose claim nobody has taken over yet (it may
/// still write, and anybody may take the key over). Answers the claim.
pub async fn claim_and_let_lapse(
    app: &TestApp,
    client: &mut Client,
    request: pb::TryStartRequest,
) -> pb::ClaimStarted {
    let key = request.key.clone();
    let started = claim(client, request.with_lease(millis(SHORT_LEASE_MS))).await;
    wait_for_lease_expiry(app, client, &key).await;
    started
}

/// Claims `key` with a short lease and a retention of one second, and waits until Lookup finds
/// the key absent: a key whose whole life has ended (its row may still be there for the
/// reaper). Answers the claim of that ended life.
pub async fn claim_and_let_expire(client: &mut Client, key: &str) -> pb::ClaimStarted {
    let started = claim(client, short_lived(key)).await;
    eventually(Duration::from_secs(5), "the key expired", || {
        is_absent(client, key)
    })
    .await;
    started
}

/// A TryStart of `key` whose claim runs out soon and whose key is gone a second later.
pub fn short_lived(key: &str) -> pb::TryStartRequest {
    try_start(key)
        .with_retention(secs(1))
        .with_lease(millis(SHORT_LEASE_MS))
}

/// Waits until the database clock, the one leases and retention are judged by, is past `instant`.
pub async fn wait_for_db_clock_past(app: &TestApp, instant: DateTime<Utc>, what: &str) {
    eventually(Duration::from_secs(10), what, || async {
        app.db_now().await > instant
    })
    .await;
}

/// A call running in a task of its own, so that the test may hold it up, abandon it or let
/// the server drain it.
pub type Spawned<T> = JoinHandle<Result<tonic::Response<T>, tonic::Status>>;

/// Runs `call` with a clone of `client` (the same connection) in a task of its own.
fn spawn_call<T, Call, Fut>(client: &Client, call: Call) -> Spawned<T>
where
    Call: FnOnce(Client) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(call(client.clone()))
}

/// Starts a TryStart in a task of its own, on `client`'s connection.
pub fn spawn_try_start(
    client: &Client,
    request: pb::TryStartRequest,
) -> Spawned<pb::TryStartResponse> {
    spawn_call(client, |mut client| async move {
        client.try_start(request).await
    })
}

/// Starts a Complete in a task of its own, on `client`'s connection.
pub fn spawn_complete(
    client: &Client,
    request: pb::CompleteRequest,
) -> Spawned<pb::CompleteResponse> {
    spawn_call(client, |mut client| async move {
        client.complete(request).await
    })
}

/// The answer of a spawned call, which must have succeeded.
pub async fn answer_of<T>(call: Spawned<T>) -> T {
    answered(
        call.await.expect("the call's task ends"),
        "the spawned call",
    )
}

/// Lifecycles (TryStart, then Complete) on fresh keys by `callers` callers, until stopped.
pub fn lifecycles(client: &Client, callers: usize, label: &str) -> Callers<tonic::Status> {
    let (client, label) = (client.clone(), label.to_owned());
    Callers::start(callers, move |caller, sequence| {
        let (mut client, key) = (client.clone(), format!("{label}-{caller}-{sequence}"));
        async move {
            let outcome = client
                .try_start(try_start(&key))
                .await?
                .into_inner()
                .outcome;
            let Some(pb::try_start_response::Outcome::Started(started)) = outcome else {
                return Err(tonic::Status::internal(format!("not started: {outcome:?}")));
            };
            client
                .complete(complete(&key, started.lease_token, b"done"))
                .await
                .map(drop)
        }
    })
}
