//! Losing the database machine: a real primary and its real streaming standby (`initdb`,
//! `pg_basebackup`, `pg_ctl promote`; `support::cluster`), the service reaching them through a
//! multi-host URL as libpq takes it. It writes to whichever host is writable, listed first or
//! not; after the primary dies and the standby is promoted it follows without a restart; after
//! a switchover it leaves the demoted primary; health says whether writes go through (a commit
//! waiting for a missing synchronous standby turns it NOT_SERVING, and SERVING again when the
//! standby returns); and how commits are made durable is a metric, with
//! `--require-synchronous-standby` refusing to serve without one.
//!
//! PostgreSQL only: the embedded store has no standby.

use std::time::{Duration, Instant};

use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::metrics::{samples, scrape};
use crate::support::cluster::{ReplicatedPair, Replication};
use crate::support::proxy::TcpProxy;
use crate::support::*;

/// The database each test's pair serves (created by the service's first migration).
const DATABASE: &str = "idempotency";

/// A server on `url` (with the test defaults and `flags`), serving.
async fn serve_on(url: &str, flags: &[&str]) -> TestApp {
    let database = TestDatabase::create(Backend::Postgres).await;
    let app = TestApp::start_on(database, Some(url), flags).await;
    app.wait_for_status(ServingStatus::Serving).await;
    app
}

/// A server on `pair`'s two hosts, listed in `order`, asking for `attrs`
/// (`target_session_attrs`), with `flags`; serving, and a client of it.
async fn serve_on_pair(
    pair: &ReplicatedPair,
    order: [usize; 2],
    attrs: &str,
    flags: &[&str],
) -> (TestApp, Client) {
    let app = serve_on(&pair.url(order, DATABASE, attrs), flags).await;
    let client = app.client().await;
    (app, client)
}

/// Completes `count` fresh keys, each answered, and answers them.
async fn completed_keys(client: &mut Client, label: &str, count: usize) -> Vec<String> {
    let mut keys = Vec::new();
    for _ in 0..count {
        let key = unique_key(label);
        claim_and_complete(client, &key, key.as_bytes()).await;
        keys.push(key);
    }
    keys
}

/// How many keys named `key` the node's database holds (read on the node itself).
async fn rows_on(node: &crate::support::cluster::Node, key: &str) -> i64 {
    let mut connection = node.connect(DATABASE).await;
    let (count,): (i64,) = sqlx::query_as("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(&mut connection)
        .await
        .expect("count the key's rows");
    count
}

/// After the primary was lost (killed or cut off): health turns NOT_SERVING; `standby` is
/// promoted; calls succeed again at most 2 s later (asserted) and health follows; every key of
/// `acknowledged` replays; a fresh key (named after `label`) is written on the new primary.
/// Answers that key.
async fn recovers_on_the_promoted_standby(
    app: &TestApp,
    client: &mut Client,
    standby: &crate::support::cluster::Node,
    acknowledged: &[String],
    label: &str,
) -> String {
    app.wait_for_status(ServingStatus::NotServing).await;
    standby.promote().await;
    let recovered = time_until_calls_succeed(client, Duration::from_secs(10)).await;
    eprintln!("calls succeeded again {recovered:?} after the promotion");
    assert!(
        recovered <= Duration::from_secs(2),
        "calls succeeded {recovered:?} after the standby was promoted"
    );
    app.wait_for_status(ServingStatus::Serving).await;
    for key in acknowledged {
        expect_replay(client, key, key.as_bytes()).await;
    }
    let key = unique_key(label);
    claim_and_complete(client, &key, b"x").await;
    assert_eq!(
        rows_on(standby, &key).await,
        1,
        "written on the new primary"
    );
    key
}

/// Claims and completes a fresh key, retrying as a client does until it goes through (each try
/// with the same attempt_id), and answers how long that took.
async fn time_until_calls_succeed(client: &Client, limit: Duration) -> Duration {
    let began = Instant::now();
    let key = unique_key("after");
    let mut request = try_start(&key);
    request.attempt_id = "attempt-after".into();
    loop {
        assert!(began.elapsed() < limit, "calls still fail after {limit:?}");
        let Ok(answer) = client.clone().try_start(request.clone()).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let started = expect_started(answer.into_inner());
        loop {
            assert!(
                began.elapsed() < limit,
                "Complete still fails after {limit:?}"
            );
            match client
                .clone()
                .complete(complete(&key, started.lease_token, b"done"))
                .await
            {
                Ok(_) => return began.elapsed(),
                Err(status) => {
                    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
}

#[tokio::test]
async fn a_multi_host_url_writes_to_the_primary_listed_second() {
    let pair = ReplicatedPair::start(Replication::Synchronous).await;
    let [primary, standby] = &pair.nodes;
    let (_app, mut client) = serve_on_pair(&pair, [1, 0], "read-write", &[]).await;
    let keys = completed_keys(&mut client, "second", 3).await;
    for key in &keys {
        expect_replay(&client, key, key.as_bytes()).await;
        assert_eq!(rows_on(primary, key).await, 1, "written on the primary");
    }
    assert!(standby.in_recovery().await, "the standby stayed a standby");
}

#[tokio::test]
async fn the_service_follows_a_promoted_standby_without_a_restart() {
    let pair = ReplicatedPair::start(Replication::Synchronous).await;
    let [old_primary, standby] = &pair.nodes;
    // The standby is listed first: the service must skip it while it is one.
    let (app, mut client) = serve_on_pair(&pair, [1, 0], "primary", &[]).await;
    let acknowledged = completed_keys(&mut client, "before", 5).await;

    old_primary.kill().await;
    // Synchronous replication: every key acknowledged before the failover is still completed.
    recovers_on_the_promoted_standby(&app, &mut client, standby, &acknowledged, "after-failover")
        .await;
}

#[tokio::test]
async fn after_a_switchover_the_demoted_primary_is_left_for_the_new_one() {
    let pair = ReplicatedPair::start(Replication::Asynchronous).await;
    let [old_primary, standby] = &pair.nodes;
    // The old primary is listed first, and will answer again, as a standby.
    let flags = ["--health-check-interval", "200ms"];
    let (app, mut client) = serve_on_pair(&pair, [0, 1], "read-write", &flags).await;
    let before = completed_keys(&mut client, "before", 3).await;

    old_primary.stop().await;
    standby.promote().await;
    old_primary.rejoin_as_standby_of(standby).await;
    pair.wait_until_streaming(1).await;
    assert!(
        old_primary.in_recovery().await,
        "the old primary is a standby now"
    );

    time_until_calls_succeed(&client, Duration::from_secs(10)).await;
    app.wait_for_status(ServingStatus::Serving).await;
    for key in &before {
        expect_replay(&client, key, key.as_bytes()).await;
    }
    let after = completed_keys(&mut client, "after", 3).await;
    for key in &after {
        assert_eq!(rows_on(standby, key).await, 1, "written on the new primary");
    }
}

#[tokio::test]
async fn health_turns_not_serving_while_commits_wait_for_a_missing_synchronous_standby() {
    let pair = ReplicatedPair::start(Replication::Synchronous).await;
    let [primary, standby] = &pair.nodes;
    // The primary alone, by a plain URL: its reads answer throughout; only writes stall.
    let interval = Duration::from_millis(500);
    let app = serve_on(
        &primary.url(DATABASE),
        &[
            "--health-check-interval",
            "500ms",
            "--operation-timeout",
            "2s",
        ],
    )
    .await;
    let client = app.client().await;
    completed_keys(&mut client.clone(), "before", 1).await;

    standby.stop().await;
    let stopped = Instant::now();
    app.wait_for_status(ServingStatus::NotServing).await;
    // The next probe (within one interval) waits for its commit up to its bound, half the
    // operation timeout.
    let noticed = stopped.elapsed();
    assert!(
        noticed <= interval + Duration::from_secs(1) + Duration::from_millis(500),
        "health noticed the stalled writes only after {noticed:?}"
    );
    // A call's commit waits too, and is answered UNAVAILABLE at the operation timeout: its
    // write may still land, so the answer says so.
    let key = unique_key("stalled");
    let mut request = try_start(&key);
    request.attempt_id = "attempt-1".into();
    let status = client
        .clone()
        .try_start(request.clone())
        .await
        .expect_err("a commit that waits for a missing standby is not acknowledged");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
    assert_outcome_unknown(&status);

    standby.start().await;
    app.wait_for_status(ServingStatus::Serving).await;
    // The retry with the same attempt_id settles it: the same claim, whether or not the first
    // commit landed.
    let retried = claim(&mut client.clone(), request).await;
    assert_eq!(retried.attempt, 1, "one claim, not a takeover");
}

/// The ErrorInfo of an UNAVAILABLE answered while the write may still commit.
fn assert_outcome_unknown(status: &tonic::Status) {
    use tonic_types::StatusExt;
    let details = status.get_error_details();
    let info = details.error_info().expect("an ErrorInfo");
    assert_eq!(
        info.metadata.get("outcome").map(String::as_str),
        Some("unknown"),
        "{status:?}"
    );
}

/// The durability series of a scrape: whether commits wait, attached synchronous standbys.
async fn durability(app: &TestApp) -> Option<(f64, f64)> {
    let samples = samples(&scrape(app).await);
    let waits = samples
        .get("idempotency_store_commits_wait_for_standby")
        .copied()?;
    let attached = samples
        .get("idempotency_store_synchronous_standbys{state=\"attached\"}")
        .copied()?;
    Some((waits, attached))
}

/// The durability the probe reads, once it has read it.
async fn durability_read(app: &TestApp) -> (f64, f64) {
    eventually_some(
        Duration::from_secs(20),
        "the probe reads durability",
        || async move { durability(app).await },
    )
    .await
}

#[tokio::test]
async fn durability_is_a_metric_and_can_be_required() {
    let pair = ReplicatedPair::start(Replication::Synchronous).await;
    let [primary, standby] = &pair.nodes;
    let flags = [
        "--metrics-listen",
        "127.0.0.1:0",
        "--require-synchronous-standby",
        "--operation-timeout",
        "2s",
    ];
    let app = serve_on(&primary.url(DATABASE), &flags).await;
    assert_eq!(durability(&app).await, Some((1.0, 1.0)));

    standby.stop().await;
    app.wait_for_status(ServingStatus::NotServing).await;
    standby.start().await;
    app.wait_for_status(ServingStatus::Serving).await;
    assert_eq!(durability(&app).await, Some((1.0, 1.0)));
}

#[tokio::test]
async fn without_a_synchronous_standby_the_required_one_keeps_the_service_not_serving() {
    // The tests' own PostgreSQL replicates to nobody.
    let database = TestDatabase::create(Backend::Postgres).await;
    let app = TestApp::start_on(
        database,
        None,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--require-synchronous-standby",
        ],
    )
    .await;
    let read = durability_read(&app).await;
    assert_eq!(read, (0.0, 0.0), "asynchronous: commits wait for nobody");
    // The probe that read it refused to serve.
    let mut health = app.health().await;
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health answers")
        .into_inner()
        .status();
    assert_eq!(status, ServingStatus::NotServing);

    // Without the flag the same store serves, and says it is asynchronous.
    let app = TestApp::spawn_with(Backend::Postgres, &["--metrics-listen", "127.0.0.1:0"]).await;
    let read = durability_read(&app).await;
    assert_eq!(read, (0.0, 0.0));
}

/// A TryStart of `key` that waits up to `wait` for its holder.
fn waiting(
    key: &str,
    wait: Duration,
) -> idempotency_coordinator::proto::idempotency::v1::TryStartRequest {
    let mut request = try_start(key);
    request.wait = Some(prost_types::Duration {
        seconds: i64::try_from(wait.as_secs()).expect("seconds"),
        nanos: 0,
    });
    request
}

#[tokio::test]
async fn after_a_failover_a_complete_on_one_replica_still_wakes_a_waiter_on_another() {
    let pair = ReplicatedPair::start(Replication::Synchronous).await;
    let [old_primary, standby] = &pair.nodes;
    let url = pair.url([0, 1], DATABASE, "read-write");
    // Waiters look again on their own only after 10 minutes: a waiter answered sooner was woken
    // by the LISTEN connection, which must have followed the primary.
    let flags = ["--waiter-recheck-interval", "10m"];
    let one = serve_on(&url, &flags).await;
    let other = serve_on(&url, &flags).await;
    old_primary.kill().await;
    standby.promote().await;
    let (mut on_one, on_other) = (one.client().await, other.client().await);
    time_until_calls_succeed(&on_one, Duration::from_secs(10)).await;
    time_until_calls_succeed(&on_other, Duration::from_secs(10)).await;

    let key = unique_key("woken");
    let held = claim(&mut on_one, try_start(&key)).await;
    let began = Instant::now();
    let waiter = tokio::spawn({
        let on_other = on_other.clone();
        let request = waiting(&key, Duration::from_secs(30));
        async move { on_other.clone().try_start(request).await }
    });
    other.wait_for_waiters(1).await;
    complete_key(&on_one, &key, held.lease_token, b"after the failover").await;
    let answer = waiter.await.expect("the waiter's task").expect("TryStart");
    assert_eq!(
        expect_completed(answer.into_inner()).response,
        b"after the failover"
    );
    assert!(
        began.elapsed() < Duration::from_secs(30),
        "woken through the new primary's notifications"
    );
}

#[tokio::test]
async fn a_store_that_is_only_a_standby_is_not_served_and_nothing_is_written() {
    let pair = ReplicatedPair::start(Replication::Asynchronous).await;
    let [primary, standby] = &pair.nodes;
    // Migrated through the primary; the standby has the schema by replication.
    let migrated = serve_on(&primary.url(DATABASE), &[]).await;
    let mut on_primary = migrated.client().await;
    let replicated = completed_keys(&mut on_primary, "replicated", 1).await;

    // Straight at the standby, without target_session_attrs: the service connects, but no
    // call can write (nor its health probe, so it never turns SERVING).
    let database = TestDatabase::create(Backend::Postgres).await;
    let app = TestApp::start_on(database, Some(&standby.url(DATABASE)), &["--no-migrate"]).await;
    let client = app.client().await;
    let key = unique_key("on-standby");
    let status = client
        .clone()
        .try_start(try_start(&key))
        .await
        .expect_err("a standby refuses writes");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
    use tonic_types::StatusExt;
    assert_eq!(
        status
            .get_error_details()
            .error_info()
            .and_then(|info| info.metadata.get("outcome").cloned())
            .as_deref(),
        Some("not_written"),
        "{status:?}"
    );
    assert_eq!(rows_on(primary, &key).await, 0, "nothing written anywhere");

    // With target_session_attrs the standby is not even connected to for calls.
    let database = TestDatabase::create(Backend::Postgres).await;
    let checked = format!("{}?target_session_attrs=read-write", standby.url(DATABASE));
    let app = TestApp::start_on(database, Some(&checked), &["--no-migrate"]).await;
    let status = app
        .client()
        .await
        .try_start(try_start(&key))
        .await
        .expect_err("no writable host");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
    assert_eq!(rows_on(primary, &key).await, 0);
    // Not even a read is served from it (a standby may lag behind what was acknowledged): every
    // session the pools open there is refused.
    let status = app
        .client()
        .await
        .lookup(lookup(&replicated[0]))
        .await
        .expect_err("no session on a standby, for reads either");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
}

#[tokio::test]
async fn a_primary_cut_off_is_left_for_the_promoted_standby() {
    let pair = ReplicatedPair::start(Replication::Synchronous).await;
    let [primary, standby] = &pair.nodes;
    // The primary is reached through a proxy that can drop every packet, as a partition would;
    // the standby streams from it directly, so it has every acknowledged commit.
    let proxy = TcpProxy::start(
        format!("127.0.0.1:{}", primary.port)
            .parse()
            .expect("an address"),
    )
    .await;
    let url = format!(
        "postgres://postgres@{},{}/{DATABASE}?target_session_attrs=read-write",
        proxy.addr,
        standby.host()
    );
    let app = serve_on(&url, &["--operation-timeout", "2s"]).await;
    let mut client = app.client().await;
    let acknowledged = completed_keys(&mut client, "before", 5).await;

    proxy.blackhole();
    let key = recovers_on_the_promoted_standby(
        &app,
        &mut client,
        standby,
        &acknowledged,
        "after-partition",
    )
    .await;
    assert_eq!(rows_on(primary, &key).await, 0, "never on the one cut off");
}

/// Callers completing fresh keys until `stop`; answers the keys whose Complete was
/// acknowledged. A failed call abandons its key (its outcome is the store's to tell).
async fn lifecycles_until(
    client: &Client,
    callers: usize,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<String> {
    let mut tasks = tokio::task::JoinSet::new();
    for caller in 0..callers {
        let client = client.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            let mut acknowledged = Vec::new();
            while !stop.is_cancelled() {
                let key = unique_key(&format!("load-{caller}"));
                let Ok(answer) = client.clone().try_start(try_start(&key)).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let started = expect_started(answer.into_inner());
                let completed = client
                    .clone()
                    .complete(complete(&key, started.lease_token, key.as_bytes()))
                    .await;
                if completed.is_ok() {
                    acknowledged.push(key);
                }
            }
            acknowledged
        });
    }
    let mut acknowledged = Vec::new();
    while let Some(keys) = tasks.join_next().await {
        acknowledged.extend(keys.expect("a caller"));
    }
    acknowledged
}

/// Kills the primary under a load of lifecycles, promotes the standby, and answers how many
/// acknowledged Completes the new primary has lost, of how many.
async fn acknowledged_lost_in_a_kill(replication: Replication) -> (usize, usize) {
    let pair = ReplicatedPair::start(replication).await;
    let [primary, standby] = &pair.nodes;
    let (_app, client) = serve_on_pair(&pair, [0, 1], "read-write", &[]).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let load = tokio::spawn({
        let (client, stop) = (client.clone(), stop.clone());
        async move { lifecycles_until(&client, 8, stop).await }
    });
    // Some lifecycles first, so that the kill lands mid-load.
    eventually(Duration::from_secs(20), "the load runs", || async {
        let mut connection = primary.connect(DATABASE).await;
        let (keys,): (i64,) = sqlx::query_as("SELECT count(*) FROM idempotency_keys")
            .fetch_one(&mut connection)
            .await
            .expect("count the keys");
        keys >= 50
    })
    .await;
    primary.kill().await;
    standby.promote().await;
    time_until_calls_succeed(&client, Duration::from_secs(10)).await;
    stop.cancel();
    let acknowledged = load.await.expect("the load");
    let mut lost = 0;
    for key in &acknowledged {
        match client.clone().try_start(try_start(key)).await {
            Ok(answer) => match outcome(answer.into_inner()) {
                idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome::Completed(c)
                    if c.response == key.as_bytes() => {}
                _ => lost += 1,
            },
            Err(status) => panic!("a replay after the failover failed: {status:?}"),
        }
    }
    (lost, acknowledged.len())
}

#[tokio::test]
async fn with_synchronous_replication_a_kill_under_load_loses_no_acknowledged_complete() {
    let (lost, acknowledged) = acknowledged_lost_in_a_kill(Replication::Synchronous).await;
    eprintln!("synchronous: {lost} of {acknowledged} acknowledged Completes lost");
    assert!(acknowledged > 0, "the load completed keys");
    assert_eq!(lost, 0, "acknowledged Completes lost to the failover");
}

/// Measured, not asserted: with asynchronous replication a failover may lose what the primary
/// acknowledged but had not shipped yet (`cargo nextest run asynchronous --no-capture`).
#[tokio::test]
async fn with_asynchronous_replication_a_kill_under_load_is_measured() {
    let (lost, acknowledged) = acknowledged_lost_in_a_kill(Replication::Asynchronous).await;
    eprintln!("asynchronous: {lost} of {acknowledged} acknowledged Completes lost");
    assert!(acknowledged > 0, "the load completed keys");
}
