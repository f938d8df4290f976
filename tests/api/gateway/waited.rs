//! A request whose claim came only after a wait longer than its own lease, because another
//! request held the key (and released it, or its gateway died): the gateway's client renews the
//! lease before the upstream call (docs/contract.md, "A claim that waited"), so the request
//! runs the upstream once with its whole lease, its response is stored, and a retry replays it
//! identically.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::{Backend, TestApp, for_each_backend};

use super::processes::{gateway_process, kill_holding};
use super::{Answer, Http, TestGateway, Upstream, key};

/// The waiting request's gateway: a 2 s lease, and a wait far longer than it.
const WAITER_FLAGS: [&str; 4] = ["--lease", "2s", "--wait", "10s"];
const WAITER_LEASE: Duration = Duration::from_secs(2);
/// How long each upstream call takes once it runs: most of the waiter's lease, so that a
/// gateway counting that lease from before its wait would find it lost while the call ran.
const UPSTREAM_TAKES: Duration = Duration::from_millis(1500);

for_each_backend!(a_request_that_waited_for_a_released_key_runs_once_and_is_replayed);

async fn a_request_that_waited_for_a_released_key_runs_once_and_is_replayed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), &WAITER_FLAGS).await;
    let http = Http::new();
    let url = format!("{}/orders", gateway.url());
    let key = key("waited-released");
    upstream.slow_down(UPSTREAM_TAKES);
    // The holder's upstream answers 503, which is not final: its claim is released.
    upstream.script(&[(503, r#"{"retry":"later"}"#)]);
    upstream.hold();
    let holder = http.spawn_post(&url, &key, "{}");
    upstream.wait_for_in_flight(1).await;
    let waiter_sent = Instant::now();
    let waiter = http.spawn_post(&url, &key, "{}");
    app.wait_for_waiters(1).await;
    // The holder keeps the key this much longer, then its upstream call takes its own time:
    // the waiter waits 1.5 of its leases in all before the holder releases.
    let held_for = WAITER_LEASE.mul_f64(1.5) - UPSTREAM_TAKES;
    tokio::time::sleep(held_for).await;
    upstream.open();

    let holder = holder.await.expect("ran").expect("an answer");
    assert_eq!(holder.status, 503, "{holder:?}");
    let waited = waiter.await.expect("ran").expect("an answer");
    let took = waiter_sent.elapsed();
    assert_ran_its_own_call(&waited);
    assert!(
        took >= WAITER_LEASE.mul_f64(1.5) + UPSTREAM_TAKES,
        "the waiter waited 1.5 leases, then ran its call, in {took:?}"
    );
    assert_eq!(
        upstream.executions(),
        2,
        "one call for the holder, one for the waiter"
    );
    let seen = upstream.seen();
    assert_ne!(seen[1].lease_token(), seen[0].lease_token());

    assert_replays(&http.post(&url, &key, "{}").await, &waited);
    assert_eq!(
        upstream.executions(),
        2,
        "the replay did not reach the upstream"
    );
}

/// The holder's gateway is killed (SIGKILL) mid-request: the waiter's claim comes when the dead
/// holder's lease runs out, later than a lease of its own after it asked.
#[tokio::test]
async fn a_request_that_waited_out_a_killed_gateways_lease_runs_once_and_is_replayed() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let holder_lease = Duration::from_secs(4);
    let mut killed = gateway_process(&upstream, &app, &["--lease", "4s"]).await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), &WAITER_FLAGS).await;
    let http = Http::new();
    let key = key("waited-killed");
    upstream.hold();
    let holder_sent = Instant::now();
    let doomed = http.spawn_post(&format!("http://{}/orders", killed.addr), &key, "{}");
    upstream.wait_for_in_flight(1).await;
    kill_holding(&mut killed, doomed).await;
    // The dead holder's upstream call ends unheard; the waiter's runs as slowly.
    upstream.slow_down(UPSTREAM_TAKES);
    upstream.open();

    let url = format!("{}/orders", gateway.url());
    let waiter_sent = Instant::now();
    let waited = http.post(&url, &key, "{}").await;
    assert_ran_its_own_call(&waited);
    // The dead holder's lease began after its request was sent and the waiter's call ran after
    // it ran out; the waiter itself waited longer than its own lease.
    assert!(
        holder_sent.elapsed() >= holder_lease + UPSTREAM_TAKES,
        "the waiter ran only once the dead holder's lease ran out"
    );
    assert!(
        waiter_sent.elapsed() >= WAITER_LEASE + UPSTREAM_TAKES,
        "the waiter waited {:?}, longer than its lease, then ran its call",
        waiter_sent.elapsed()
    );
    assert_eq!(
        upstream.executions(),
        2,
        "one call for the dead holder, one for the waiter"
    );
    let seen = upstream.seen();
    assert!(
        seen[1].lease_token() > seen[0].lease_token(),
        "the waiter took the key over"
    );

    assert_replays(&http.post(&url, &key, "{}").await, &waited);
    assert_eq!(
        upstream.executions(),
        2,
        "the replay did not reach the upstream"
    );
}

/// The replay is the stored response as the first caller got it: status, every header (repeated
/// ones in order) and body, marked replayed.
/// The waiter's request ran with its whole lease: its own upstream call (the second), answered
/// as made, not replayed.
fn assert_ran_its_own_call(waited: &Answer) {
    assert_eq!(
        waited.status, 201,
        "the waiter ran with its whole lease: {waited:?}"
    );
    assert!(!waited.replayed());
    assert_eq!(
        waited.text(),
        r#"{"order":2}"#,
        "the waiter's own upstream call"
    );
}

fn assert_replays(replay: &Answer, first: &Answer) {
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body);
    let mut replayed_headers = replay.headers.clone();
    replayed_headers.remove(idempotency_gateway::REPLAYED_HEADER);
    assert_eq!(replayed_headers, first.headers, "the replayed headers");
}
