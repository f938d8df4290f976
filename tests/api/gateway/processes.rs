//! The gateway as the real binary (`idempotency-coordinator gateway`, a child process): killed
//! with SIGKILL mid-request, and stopped with SIGTERM while a request runs.

use std::time::Duration;

use crate::support::process::coordinator;
use crate::support::{Backend, TestApp};

use super::{Answer, Http, ORDERS, TestGateway, Upstream, key};

pub(super) async fn gateway_process(
    upstream: &Upstream,
    app: &TestApp,
    flags: &[&str],
) -> idempotency_testkit::ServerProcess {
    let upstream_url = upstream.url();
    let endpoint = app.endpoint();
    let mut all = vec![
        "--upstream",
        upstream_url.as_str(),
        "--coordinator",
        endpoint.as_str(),
        "--namespace",
        ORDERS,
    ];
    all.extend_from_slice(flags);
    coordinator()
        .gateway(&all)
        .await
        .expect("the gateway binary starts")
}

/// Kills `gateway` (`kill -9`) while it holds a call's claim, and checks that the caller of that
/// call (`doomed`, posted to it) lost its connection: nothing answered it.
pub(super) async fn kill_holding(
    gateway: &mut idempotency_testkit::ServerProcess,
    doomed: tokio::task::JoinHandle<Option<Answer>>,
) {
    gateway.signal("KILL").expect("kill -9");
    assert_eq!(
        gateway.wait(Duration::from_secs(10)).await.expect("exits"),
        None
    );
    assert!(
        doomed.await.expect("ran").is_none(),
        "the holder's caller lost its connection"
    );
}

/// At most once while a lease holds: a gateway killed mid-request leaves its claim until the
/// lease runs out; a retry meanwhile gets 409, and a retry after it runs the upstream again,
/// with a higher fencing token that the upstream can use to refuse the first run's writes.
#[tokio::test]
async fn a_killed_gateways_claim_is_taken_over_with_a_higher_fencing_token() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let mut killed = gateway_process(&upstream, &app, &["--lease", "2s"]).await;
    let http = Http::new();
    let key = key("killed");
    upstream.hold();
    let doomed = http.spawn_post(&format!("http://{}/orders", killed.addr), &key, "{}");
    upstream.wait_for_in_flight(1).await;
    let first_token = upstream.seen()[0].lease_token();
    kill_holding(&mut killed, doomed).await;

    let replica = TestGateway::start(&upstream, &app.endpoint(), &["--wait", "0s"]).await;
    let url = format!("{}/orders", replica.url());
    http.post(&url, &key, "{}")
        .await
        .assert_problem(409, "in-progress");
    assert_eq!(
        upstream.executions(),
        1,
        "not run again while the lease holds"
    );

    upstream.open();
    let waiting = TestGateway::start(&upstream, &app.endpoint(), &["--wait", "10s"]).await;
    let retry = http
        .post(&format!("{}/orders", waiting.url()), &key, "{}")
        .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed(), "the retry ran the upstream again");
    assert_eq!(upstream.executions(), 2);
    let second_token = upstream.seen()[1].lease_token();
    assert!(
        second_token > first_token,
        "fencing: {second_token} > {first_token}"
    );
    let replay = http.post(&url, &key, "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, retry.body);
}

/// SIGTERM: the gateway stops accepting but lets the request in flight finish, and completes
/// its claim, so that another replica replays it.
#[tokio::test]
async fn sigterm_lets_the_request_in_flight_finish_and_complete() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let mut stopping = gateway_process(&upstream, &app, &[]).await;
    let http = Http::new();
    let key = key("sigterm");
    upstream.hold();
    let running = http.spawn_post(&format!("http://{}/orders", stopping.addr), &key, "{}");
    upstream.wait_for_in_flight(1).await;
    stopping.signal("TERM").expect("kill -TERM");
    crate::support::eventually(Duration::from_secs(10), "the gateway drains", || async {
        stopping.output_contains("finishing requests in flight")
    })
    .await;
    upstream.open();
    let answered = running.await.expect("ran").expect("an answer");
    assert_eq!(answered.status, 201);
    assert_eq!(
        stopping.wait(Duration::from_secs(20)).await.expect("exits"),
        Some(0)
    );
    let replica = TestGateway::start(&upstream, &app.endpoint(), &[]).await;
    let replay = http
        .post(&format!("{}/orders", replica.url()), &key, "{}")
        .await;
    assert!(replay.replayed(), "the claim was completed before the exit");
    assert_eq!(replay.body, answered.body);
    assert_eq!(upstream.executions(), 1);
}
