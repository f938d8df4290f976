//! Failures on either side: an upstream that fails or cannot be reached is released (the retry
//! runs again); a coordinator that cannot be reached fails closed (503 with Retry-After) or,
//! with --fail-open, forwards.

use crate::support::{Backend, TestApp, for_each_backend};

use super::{Http, TestGateway, Upstream, dead_endpoint, key};

for_each_backend!(an_upstream_500_is_released_and_the_retrys_201_replayed);

async fn an_upstream_500_is_released_and_the_retrys_201_replayed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), &[]).await;
    let http = Http::new();
    let url = format!("{}/orders", gateway.url());
    let key = key("500");
    upstream.script(&[(500, "{\"error\":\"database down\"}")]);
    let failed = http.post(&url, &key, "{}").await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        failed.text(),
        "{\"error\":\"database down\"}",
        "forwarded as it is"
    );
    assert!(!failed.replayed());
    let retry = http.post(&url, &key, "{}").await;
    assert_eq!(retry.status, 201, "the claim was released: the retry ran");
    assert_eq!(upstream.executions(), 2);
    let replay = http.post(&url, &key, "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, retry.body);
    assert_eq!(upstream.executions(), 2);
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_released() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    // A gateway whose upstream closes every connection (the later flag wins).
    let closed = dead_endpoint().await;
    let gateway =
        TestGateway::start(&upstream, &app.endpoint(), &["--upstream", &closed.url]).await;
    let http = Http::new();
    let key = key("unreachable");
    http.post(&format!("{}/orders", gateway.url()), &key, "{}")
        .await
        .assert_problem(502, "upstream-unreachable");
    // The key was released: a gateway with a working upstream runs it.
    let working = TestGateway::start(&upstream, &app.endpoint(), &[]).await;
    let ran = http
        .post(&format!("{}/orders", working.url()), &key, "{}")
        .await;
    assert_eq!(ran.status, 201);
    assert!(!ran.replayed());
    assert_eq!(upstream.executions(), 1);
}

#[tokio::test]
async fn a_slow_upstream_times_out_as_504_and_is_released() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let gateway =
        TestGateway::start(&upstream, &app.endpoint(), &["--upstream-timeout", "300ms"]).await;
    let http = Http::new();
    let url = format!("{}/orders", gateway.url());
    let key = key("timeout");
    upstream.slow_down(std::time::Duration::from_secs(2));
    http.post(&url, &key, "{}")
        .await
        .assert_problem(504, "upstream-timeout");
    upstream.slow_down(std::time::Duration::ZERO);
    let retry = http.post(&url, &key, "{}").await;
    assert_eq!(retry.status, 201, "released: the retry runs");
    assert!(!retry.replayed());
}

#[tokio::test]
async fn a_coordinator_that_is_down_fails_closed_with_retry_after() {
    let upstream = Upstream::start().await;
    let dead = dead_endpoint().await;
    let gateway = TestGateway::start(&upstream, &dead.url, &[]).await;
    let http = Http::new();
    let answer = http
        .post(&format!("{}/orders", gateway.url()), &key("down"), "{}")
        .await;
    answer.assert_problem(503, "coordinator-unavailable");
    assert_eq!(
        answer.retry_after(),
        1,
        "no RetryInfo from a coordinator that is down"
    );
    assert_eq!(upstream.executions(), 0, "fail closed: nothing forwarded");
    // Requests that need no idempotency still pass.
    let get = http
        .send("GET", &format!("{}/orders", gateway.url()), &[], "")
        .await;
    assert_eq!(get.status, 201);
}

#[tokio::test]
async fn a_coordinator_that_is_down_fails_open_when_asked() {
    let upstream = Upstream::start().await;
    let dead = dead_endpoint().await;
    let gateway = TestGateway::start(&upstream, &dead.url, &["--fail-open"]).await;
    let http = Http::new();
    let url = format!("{}/orders", gateway.url());
    let key = key("open");
    let answer = http.post(&url, &key, "{}").await;
    assert_eq!(answer.status, 201, "forwarded");
    assert_eq!(
        answer.header("idempotency-warning"),
        Some("not-deduplicated")
    );
    let seen = upstream.seen();
    let request = seen.first().expect("the upstream ran");
    assert!(
        request.header("idempotency-lease-token").is_none(),
        "no claim, no token"
    );
    http.post(&url, &key, "{}").await;
    assert_eq!(
        upstream.executions(),
        2,
        "without the coordinator nothing is deduplicated"
    );
}
