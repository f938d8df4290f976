//! Long upstream calls: the heartbeat keeps the lease past its TTL, a request that arrives
//! meanwhile waits or gets 409 with Retry-After, and another replica of the gateway (two
//! gateways, one coordinator) answers the retry from the stored response.

use std::time::Duration;

use crate::support::{Backend, TestApp, for_each_backend};

use super::{Http, TestGateway, Upstream, key};

for_each_backend!(a_heartbeat_keeps_a_slow_upstream_and_a_replica_replays_it);

async fn a_heartbeat_keeps_a_slow_upstream_and_a_replica_replays_it(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let upstream = Upstream::start().await;
    // A 600 ms lease, renewed every 200 ms; the upstream takes 2 s, over three leases.
    let flags = ["--lease", "600ms", "--wait", "0s"];
    let first = TestGateway::start(&upstream, &app.endpoint(), &flags).await;
    let replica = TestGateway::start(&upstream, &app.endpoint(), &flags).await;
    let http = Http::new();
    let key = key("slow");
    upstream.slow_down(Duration::from_secs(2));
    let running = http.spawn_post(&format!("{}/orders", first.url()), &key, "{}");
    upstream.wait_for_in_flight(1).await;
    // Well past the first lease: without the heartbeat the replica would take the key over.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let meanwhile = http
        .post(&format!("{}/orders", replica.url()), &key, "{}")
        .await;
    meanwhile.assert_problem(409, "in-progress");
    assert_eq!(
        meanwhile.retry_after(),
        1,
        "the rest of a 600 ms lease, rounded up"
    );
    let answered = running.await.expect("the call ran").expect("an answer");
    assert_eq!(answered.status, 201);
    assert!(!answered.replayed());
    let replayed = http
        .post(&format!("{}/orders", replica.url()), &key, "{}")
        .await;
    assert!(
        replayed.replayed(),
        "the replica answers from the stored response"
    );
    assert_eq!(replayed.body, answered.body);
    assert_eq!(upstream.executions(), 1);
}

/// A request that arrives while the first runs waits for it (--wait) and gets its response.
#[tokio::test]
async fn a_concurrent_request_waits_and_gets_the_stored_response() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), &["--wait", "20s"]).await;
    let http = Http::new();
    let url = format!("{}/orders", gateway.url());
    let key = key("wait");
    upstream.hold();
    let first = http.spawn_post(&url, &key, "{}");
    upstream.wait_for_in_flight(1).await;
    let second = http.spawn_post(&url, &key, "{}");
    app.wait_for_waiters(1).await;
    upstream.open();
    let first = first.await.expect("ran").expect("an answer");
    let second = second.await.expect("ran").expect("an answer");
    assert!(!first.replayed());
    assert!(second.replayed(), "the waiter got the stored response");
    assert_eq!(second.body, first.body);
    assert_eq!(upstream.executions(), 1);
}
