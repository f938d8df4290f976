//! `/metrics` (`--metrics-listen`): after a known sequence of calls, a real HTTP GET scrapes
//! exactly the counts the calls make; the exposition passes `promtool check metrics`; the flag
//! is refused when it is not an address. And `healthcheck`, the real binary: 0 when SERVING,
//! 1 when not serving, nothing listening, or no answer within its timeout.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::*;

/// `GET /metrics` over a plain TCP connection; the status line and the body.
pub async fn http_get(address: SocketAddr, path: &str) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to the metrics port");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("the answer within 10 s")
        .expect("read the answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, body.to_owned())
}

pub(crate) async fn scrape(app: &TestApp) -> String {
    let (status, body) = http_get(app.metrics_addr.expect("metrics on"), "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    body
}

/// The samples of an exposition: `name{labels}` as written, to its value.
pub fn samples(exposition: &str) -> HashMap<String, f64> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// How many batches `coalescer` sent to the store that weighed more than one (calls, or ids for
/// MarkProcessed): `idempotency_coalesced_batch_size`'s count less its `le="1"` bucket.
pub(crate) fn batches_of_several(samples: &HashMap<String, f64>, coalescer: &str) -> f64 {
    let series = |suffix: String| {
        samples
            .get(&format!("idempotency_coalesced_batch_size{suffix}"))
            .copied()
            .unwrap_or(0.0)
    };
    series(format!("_count{{coalescer=\"{coalescer}\"}}"))
        - series(format!("_bucket{{coalescer=\"{coalescer}\",le=\"1\"}}"))
}

fn api(method: &str) -> String {
    format!(
        "grpc_type=\"unary\",grpc_service=\"idempotency.v1.IdempotencyService\",grpc_method=\"{method}\""
    )
}

fn value(samples: &HashMap<String, f64>, series: &str) -> f64 {
    samples
        .get(series)
        .copied()
        .unwrap_or_else(|| panic!("no sample {series} in the exposition"))
}

async fn a_known_sequence_of_calls_is_counted_exactly(backend: Backend) {
    let app = TestApp::spawn_with(backend, &["--metrics-listen", "127.0.0.1:0"]).await;
    let before = samples(&scrape(&app).await);
    for method in [
        "TryStart",
        "Complete",
        "Release",
        "ExtendLease",
        "Lookup",
        "MarkProcessed",
    ] {
        let series = format!("grpc_server_started_total{{{}}}", api(method));
        assert_eq!(value(&before, &series), 0.0, "{series} starts at zero");
    }

    let mut client = app.client().await;
    let key = unique_key("counted");
    let started = claim(&mut client, try_start(&key)).await;
    expect_in_progress(try_start_response(&client, try_start(&key)).await);
    client
        .complete(complete(&key, started.lease_token, b"done"))
        .await
        .expect("Complete");
    expect_completed(try_start_response(&client, try_start(&key)).await);
    let mismatch = pb::TryStartRequest {
        fingerprint: b"another".to_vec(),
        ..try_start(&key)
    };
    expect_mismatch(try_start_response(&client, mismatch).await);
    let refused = client
        .extend_lease(extend(&key, started.lease_token))
        .await
        .expect_err("a completed key's lease cannot be extended");
    assert_error(&refused, Code::FailedPrecondition, "ALREADY_COMPLETED");
    let stale = client
        .release(release(&key, started.lease_token + 1_000_000))
        .await
        .expect_err("another token");
    assert_error(&stale, Code::Aborted, "LEASE_LOST");
    client
        .mark_processed(mark("metrics-consumer", &["a", "b"]))
        .await
        .expect("MarkProcessed");
    client
        .mark_processed(mark("metrics-consumer", &["b", "c"]))
        .await
        .expect("MarkProcessed");
    let invalid = client
        .lookup(lookup(""))
        .await
        .expect_err("an empty key is invalid");
    assert_eq!(invalid.code(), Code::InvalidArgument);

    let exposition = scrape(&app).await;
    let after = samples(&exposition);
    let expected = [
        (
            format!("grpc_server_started_total{{{}}}", api("TryStart")),
            4.0,
        ),
        (
            format!(
                "grpc_server_handled_total{{{},grpc_code=\"OK\"}}",
                api("TryStart")
            ),
            4.0,
        ),
        (
            format!("grpc_server_msg_received_total{{{}}}", api("TryStart")),
            4.0,
        ),
        (
            format!("grpc_server_msg_sent_total{{{}}}", api("TryStart")),
            4.0,
        ),
        (
            format!("grpc_server_handling_seconds_count{{{}}}", api("TryStart")),
            4.0,
        ),
        (
            format!(
                "grpc_server_handled_total{{{},grpc_code=\"OK\"}}",
                api("Complete")
            ),
            1.0,
        ),
        (
            format!(
                "grpc_server_handled_total{{{},grpc_code=\"FailedPrecondition\"}}",
                api("ExtendLease")
            ),
            1.0,
        ),
        (
            format!(
                "grpc_server_handled_total{{{},grpc_code=\"Aborted\"}}",
                api("Release")
            ),
            1.0,
        ),
        (
            format!(
                "grpc_server_handled_total{{{},grpc_code=\"OK\"}}",
                api("MarkProcessed")
            ),
            2.0,
        ),
        (
            format!(
                "grpc_server_handled_total{{{},grpc_code=\"InvalidArgument\"}}",
                api("Lookup")
            ),
            1.0,
        ),
        (
            format!("grpc_server_started_total{{{}}}", api("Lookup")),
            1.0,
        ),
        (
            "idempotency_try_start_total{outcome=\"started\"}".into(),
            1.0,
        ),
        (
            "idempotency_try_start_total{outcome=\"in_progress\"}".into(),
            1.0,
        ),
        (
            "idempotency_try_start_total{outcome=\"completed\"}".into(),
            1.0,
        ),
        (
            "idempotency_try_start_total{outcome=\"fingerprint_mismatch\"}".into(),
            1.0,
        ),
        (
            "idempotency_refusals_total{rpc=\"ExtendLease\",reason=\"ALREADY_COMPLETED\"}".into(),
            1.0,
        ),
        (
            "idempotency_refusals_total{rpc=\"Release\",reason=\"LEASE_LOST\"}".into(),
            1.0,
        ),
        ("idempotency_events_total{result=\"new\"}".into(), 3.0),
        (
            "idempotency_events_total{result=\"already_processed\"}".into(),
            1.0,
        ),
        ("idempotency_health_status{status=\"SERVING\"}".into(), 1.0),
        (
            "idempotency_health_status{status=\"NOT_SERVING\"}".into(),
            0.0,
        ),
        ("idempotency_waiters".into(), 0.0),
        // Calls one after another: one batch each, of one call (or of its ids). The replay and
        // the mismatch came after the Complete, which the replay cache then held: they never
        // reached the store.
        (
            "idempotency_coalesced_batch_size_count{coalescer=\"TryStart\"}".into(),
            2.0,
        ),
        (
            "idempotency_coalesced_batch_size_sum{coalescer=\"TryStart\"}".into(),
            2.0,
        ),
        (
            "idempotency_replay_cache_lookups_total{operation=\"TryStart\",outcome=\"miss\"}"
                .into(),
            2.0,
        ),
        (
            "idempotency_replay_cache_lookups_total{operation=\"TryStart\",outcome=\"hit\"}".into(),
            2.0,
        ),
        (
            "idempotency_coalesced_batch_size_count{coalescer=\"Complete\"}".into(),
            1.0,
        ),
        // One statement per batch, and one per call for the others (the invalid Lookup never
        // reached the store).
        (
            "idempotency_store_seconds_count{operation=\"TryStart\"}".into(),
            2.0,
        ),
        (
            "idempotency_store_seconds_count{operation=\"Complete\"}".into(),
            1.0,
        ),
        (
            "idempotency_store_seconds_count{operation=\"ExtendLease\"}".into(),
            1.0,
        ),
        (
            "idempotency_store_seconds_count{operation=\"Release\"}".into(),
            1.0,
        ),
        (
            "idempotency_store_seconds_count{operation=\"MarkProcessed\"}".into(),
            2.0,
        ),
        (
            "idempotency_coalesced_batch_size_count{coalescer=\"MarkProcessed\"}".into(),
            2.0,
        ),
        (
            "idempotency_coalesced_batch_size_sum{coalescer=\"MarkProcessed\"}".into(),
            4.0,
        ),
        ("idempotency_tokens_loaded".into(), 0.0),
    ];
    for (series, wanted) in &expected {
        assert_eq!(value(&after, series), *wanted, "{series}");
    }
    // Calls that failed sent no message; no other code was counted for them.
    let release_sent = format!("grpc_server_msg_sent_total{{{}}}", api("Release"));
    assert_eq!(after.get(&release_sent).copied().unwrap_or(0.0), 0.0);
    let unknown = "grpc_service=\"unknown\"";
    assert!(
        !exposition.contains(unknown),
        "every call was to a known method"
    );
    assert!(!after.contains_key("idempotency_try_start_takeovers_total"));
    // Nothing a caller sent becomes a label.
    for secret in [key.as_str(), "another", "done", "metrics-consumer"] {
        assert!(
            !exposition.contains(secret),
            "{secret} leaked into the exposition"
        );
    }
}

/// promtool, from `PROMTOOL` or the PATH (`scripts/services` installs Debian's `prometheus`).
fn promtool() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("PROMTOOL") {
        return Some(path.into());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|folder| folder.join("promtool"))
            .find(|candidate| candidate.is_file())
    })
}

async fn the_exposition_passes_promtool(backend: Backend) {
    let promtool = promtool().expect(
        "promtool is not installed: run scripts/services (Debian's prometheus), or set PROMTOOL",
    );
    let app = TestApp::spawn_with(
        backend,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-namespace-labels",
            "--reaper-interval",
            "100ms",
        ],
    )
    .await;
    let mut client = app.client().await;
    let key = unique_key("promtool");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .complete(complete(&key, started.lease_token, b"ok"))
        .await
        .expect("Complete");
    client
        .mark_processed(mark("c", &["x"]))
        .await
        .expect("MarkProcessed");
    // Every kind of series is there: the reaper's lag, once it has swept, too.
    series_reaches(&app, "idempotency_reaper_lag_seconds{table=\"keys\"}", 0.0).await;
    let exposition = scrape(&app).await;
    assert!(exposition.contains("idempotency_coalescer_queue_depth{coalescer=\"TryStart\"}"));
    assert!(exposition.contains("namespace=\"tests\""));

    let mut check = tokio::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run promtool");
    let mut stdin = check.stdin.take().expect("promtool's stdin");
    stdin
        .write_all(exposition.as_bytes())
        .await
        .expect("feed promtool");
    drop(stdin);
    let output = check.wait_with_output().await.expect("promtool ends");
    assert!(
        output.status.success(),
        "promtool refused the exposition: {}{}\n{exposition}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

async fn takeovers_and_reentries_are_counted_apart(backend: Backend) {
    let app = TestApp::spawn_with(backend, &["--metrics-listen", "127.0.0.1:0"]).await;
    let mut client = app.client().await;
    let with_attempt = |key: &str, attempt: &str| pb::TryStartRequest {
        attempt_id: attempt.into(),
        lease_ttl: millis(300),
        ..try_start(key)
    };
    // A fresh claim, then its holder's re-entry.
    let kept = unique_key("reentered");
    let first = claim(&mut client, with_attempt(&kept, "a")).await;
    let again = claim(&mut client, with_attempt(&kept, "a")).await;
    assert_eq!(
        again.lease_token, first.lease_token,
        "a re-entry keeps the claim"
    );
    // A claim whose lease runs out, taken over, then re-entered by the taker: a re-entry,
    // although its attempt is 2.
    let lapsed = unique_key("taken-over");
    claim(&mut client, with_attempt(&lapsed, "x")).await;
    wait_for_lease_expiry(&app, &client, &lapsed).await;
    let taken = claim(&mut client, with_attempt(&lapsed, "y")).await;
    assert_eq!(taken.attempt, 2);
    let reentered = claim(&mut client, with_attempt(&lapsed, "y")).await;
    assert_eq!(
        (reentered.attempt, reentered.lease_token),
        (2, taken.lease_token)
    );

    let after = samples(&scrape(&app).await);
    for (series, wanted) in [
        ("idempotency_try_start_total{outcome=\"started\"}", 5.0),
        ("idempotency_try_start_takeovers_total", 1.0),
        ("idempotency_try_start_reentries_total", 2.0),
    ] {
        assert_eq!(value(&after, series), wanted, "{series}");
    }
}

async fn namespaces_become_labels_with_the_flag(backend: Backend) {
    let labelled = TestApp::spawn_with(
        backend,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-namespace-labels",
        ],
    )
    .await;
    let mut client = labelled.client().await;
    let key = unique_key("labelled");
    let started = claim(&mut client, try_start(&key)).await;
    let other = pb::TryStartRequest {
        namespace: "billing".into(),
        ..try_start(&key)
    };
    claim(&mut client, other).await;
    let stale = client
        .release(release(&key, started.lease_token + 1_000_000))
        .await
        .expect_err("another token");
    assert_error(&stale, Code::Aborted, "LEASE_LOST");
    client
        .mark_processed(mark("labelled-consumer", &["a", "b"]))
        .await
        .expect("MarkProcessed");
    let exposition = scrape(&labelled).await;
    let after = samples(&exposition);
    for (series, wanted) in [
        (
            "idempotency_try_start_total{outcome=\"started\",namespace=\"tests\"}",
            1.0,
        ),
        (
            "idempotency_try_start_total{outcome=\"started\",namespace=\"billing\"}",
            1.0,
        ),
        (
            "idempotency_refusals_total{rpc=\"Release\",reason=\"LEASE_LOST\",namespace=\"tests\"}",
            1.0,
        ),
        (
            "idempotency_events_total{result=\"new\",namespace=\"labelled-consumer\"}",
            2.0,
        ),
    ] {
        assert_eq!(value(&after, series), wanted, "{series}");
    }
    // The gRPC server metrics never carry a namespace, nor does anything carry a key.
    assert!(
        exposition
            .lines()
            .filter(|line| line.starts_with("grpc_"))
            .all(|line| !line.contains("namespace=")),
        "{exposition}"
    );
    assert!(!exposition.contains(&key));
}

/// A test of its own: the recorder is the process's, and would still hold the series a
/// labelled server made.
async fn namespaces_are_not_labels_by_default(backend: Backend) {
    let plain = TestApp::spawn_with(backend, &["--metrics-listen", "127.0.0.1:0"]).await;
    let mut client = plain.client().await;
    claim(&mut client, try_start(&unique_key("plain"))).await;
    client
        .mark_processed(mark("plain-consumer", &["a"]))
        .await
        .expect("MarkProcessed");
    let exposition = scrape(&plain).await;
    assert!(!exposition.contains("namespace="), "{exposition}");
    assert!(!exposition.contains("plain-consumer"), "{exposition}");
}

async fn a_full_queue_shows_in_its_depth_and_its_own_refusals(backend: Backend) {
    // One executor, batches of one: the TryStart coalescer takes 16 calls, queued or running.
    let app = TestApp::spawn_with(
        backend,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--coalesce-executors",
            "1",
            "--coalesce-max-batch",
            "1",
            "--operation-timeout",
            "30s",
        ],
    )
    .await;
    let client = app.client().await;
    let depth = "idempotency_coalescer_queue_depth{coalescer=\"TryStart\"}";
    let before = samples(&scrape(&app).await);
    assert_eq!(value(&before, depth), 0.0);
    assert_eq!(
        value(
            &before,
            "idempotency_coalescer_queue_capacity{coalescer=\"TryStart\"}"
        ),
        16.0
    );

    // The executor is kept busy by a claim of a key held from outside; 15 more calls queue.
    let held = unique_key("held");
    claim(&mut client.clone(), try_start(&held)).await;
    let hold = app.database.hold_key(&held).await;
    let mut calls = Vec::new();
    for index in 0..16 {
        let mut client = client.clone();
        let request = if index == 0 {
            try_start(&held)
        } else {
            try_start(&unique_key("queued"))
        };
        calls.push(tokio::spawn(async move { client.try_start(request).await }));
        if index == 0 {
            series_reaches(&app, depth, 1.0).await;
        }
    }
    series_reaches(&app, depth, 16.0).await;
    let refused = client
        .clone()
        .try_start(try_start(&unique_key("one-too-many")))
        .await
        .expect_err("the queue is full");
    assert_error(&refused, Code::Unavailable, "STORE_UNAVAILABLE");
    hold.release().await;
    for call in calls {
        call.await
            .expect("a queued call's task")
            .expect("a queued TryStart is answered once the store is free");
    }
    series_reaches(&app, depth, 0.0).await;
    let after = samples(&scrape(&app).await);
    for (series, wanted) in [
        (
            "idempotency_coalescer_refusals_total{coalescer=\"TryStart\"}",
            1.0,
        ),
        (
            "idempotency_refusals_total{rpc=\"TryStart\",reason=\"STORE_UNAVAILABLE\"}",
            1.0,
        ),
    ] {
        assert_eq!(value(&after, series), wanted, "{series}");
    }
}

async fn series_reaches(app: &TestApp, series: &str, wanted: f64) {
    eventually(
        Duration::from_secs(10),
        &format!("{series} is {wanted}"),
        || async move { samples(&scrape(app).await).get(series).copied() == Some(wanted) },
    )
    .await;
}

async fn the_reapers_lag_is_the_age_of_what_it_could_not_delete(backend: Backend) {
    let app = TestApp::spawn_with(
        backend,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--reaper-interval",
            "100ms",
        ],
    )
    .await;
    let keys = "idempotency_reaper_lag_seconds{table=\"keys\"}";
    let events = "idempotency_reaper_lag_seconds{table=\"events\"}";
    // Nothing expired: no lag.
    series_reaches(&app, keys, 0.0).await;
    series_reaches(&app, events, 0.0).await;

    // Rows that expired an hour ago, one of them held from outside so that the reaper cannot
    // delete it (PostgreSQL skips the locked row; SQLite's whole write waits and gives up).
    app.database.insert_expired_keys("lagging", 3).await;
    app.database.insert_expired_events(2).await;
    let hold = app.database.hold_key("lagging1").await;
    let hour = 3600.0;
    eventually(
        Duration::from_secs(20),
        "the keys' lag shows the held row's age",
        || async {
            samples(&scrape(&app).await)
                .get(keys)
                .is_some_and(|lag| (hour..hour + 120.0).contains(lag))
        },
    )
    .await;
    let lag = samples(&scrape(&app).await);
    match backend {
        // Only the held key was left: its siblings and the events were deleted.
        Backend::Postgres => {
            assert_eq!(app.database.count_rows("idempotency_keys").await, 1);
            series_reaches(&app, events, 0.0).await;
        }
        // Every write waits for the held lock, so nothing was deleted.
        Backend::Sqlite => assert!(lag.get(events).is_some_and(|lag| *lag >= hour), "{lag:?}"),
    }

    hold.release().await;
    series_reaches(&app, keys, 0.0).await;
    series_reaches(&app, events, 0.0).await;
    assert_eq!(app.database.count_rows("idempotency_keys").await, 0);
}

for_each_backend!(
    a_known_sequence_of_calls_is_counted_exactly,
    the_exposition_passes_promtool,
    takeovers_and_reentries_are_counted_apart,
    namespaces_become_labels_with_the_flag,
    namespaces_are_not_labels_by_default,
    a_full_queue_shows_in_its_depth_and_its_own_refusals,
    the_reapers_lag_is_the_age_of_what_it_could_not_delete
);

#[tokio::test]
async fn namespace_labels_need_the_metrics() {
    let output = coordinator(&["--metrics-namespace-labels"]).await;
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--metrics-listen"));
}

#[tokio::test]
async fn tokens_and_refusals_at_the_door_are_counted_by_reason() {
    use crate::support::security::{Bearer, TokensFile, authed_client, token};
    let (payments, payments_line) = token("payments", "payments-*");
    let (_, other_line) = token("other", "*");
    let tokens = TokensFile::new(&[&payments_line, &other_line]);
    let app = TestApp::spawn_with(
        Backend::Sqlite,
        &[
            "--tokens-file",
            &tokens.flag(),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    let mut stranger = authed_client(app.endpoint(), Bearer::token("not-a-token")).await;
    let refused = stranger
        .lookup(lookup("k"))
        .await
        .expect_err("unknown token");
    assert_eq!(refused.code(), Code::Unauthenticated);
    let mut client = authed_client(app.endpoint(), Bearer::token(&payments)).await;
    let denied = client
        .lookup(lookup("k"))
        .await
        .expect_err("namespace tests is not the caller's");
    assert_eq!(denied.code(), Code::PermissionDenied);

    let exposition = scrape(&app).await;
    let after = samples(&exposition);
    assert_eq!(value(&after, "idempotency_tokens_loaded"), 2.0);
    for reason in ["unauthenticated", "permission_denied"] {
        let series = format!("idempotency_auth_refusals_total{{reason=\"{reason}\"}}");
        assert_eq!(value(&after, &series), 1.0, "{series}");
    }
    assert_eq!(
        value(
            &after,
            &format!(
                "grpc_server_handled_total{{{},grpc_code=\"Unauthenticated\"}}",
                api("Lookup")
            )
        ),
        1.0
    );
    assert!(!exposition.contains(&payments) && !exposition.contains("payments\""));
}

#[tokio::test]
async fn a_made_up_method_is_counted_under_one_unknown_label() {
    let app = TestApp::spawn_with(Backend::Sqlite, &["--metrics-listen", "127.0.0.1:0"]).await;
    for path in [
        "/idempotency.v1.IdempotencyService/MadeUp",
        "/some.Other/secret-key-1",
    ] {
        let refused = raw_unary(app.endpoint(), path, Vec::new(), None)
            .await
            .expect_err("no such method");
        assert_eq!(refused.code(), Code::Unimplemented);
    }
    let exposition = scrape(&app).await;
    let after = samples(&exposition);
    let unknown = "grpc_type=\"unary\",grpc_service=\"unknown\",grpc_method=\"unknown\"";
    assert_eq!(
        value(&after, &format!("grpc_server_started_total{{{unknown}}}")),
        2.0
    );
    assert_eq!(
        value(
            &after,
            &format!("grpc_server_handled_total{{{unknown},grpc_code=\"Unimplemented\"}}")
        ),
        2.0
    );
    assert!(!exposition.contains("MadeUp") && !exposition.contains("secret-key-1"));
}

#[tokio::test]
async fn other_paths_are_not_found_and_metrics_are_off_by_default() {
    let app = TestApp::spawn_with(Backend::Sqlite, &["--metrics-listen", "127.0.0.1:0"]).await;
    let (status, _) = http_get(app.metrics_addr.expect("metrics on"), "/other").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");

    let plain = TestApp::spawn(Backend::Sqlite).await;
    assert_eq!(plain.metrics_addr, None);
}

async fn coordinator(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .args(args)
        .env_remove("IDEMPOTENCY_METRICS_LISTEN")
        .env_remove("IDEMPOTENCY_METRICS_NAMESPACE_LABELS")
        .env_remove("IDEMPOTENCY_HEALTHCHECK_ADDR")
        .env_remove("IDEMPOTENCY_HEALTHCHECK_TIMEOUT")
        .output()
        .await
        .expect("run the binary")
}

#[tokio::test]
async fn the_metrics_flag_must_be_an_address() {
    let output = coordinator(&["--metrics-listen", "not-an-address"]).await;
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--metrics-listen"));
}

#[tokio::test]
async fn a_metrics_port_in_use_stops_the_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address").to_string();
    let directory = tempfile::tempdir().expect("temporary folder");
    let database = format!("sqlite://{}/store.db", directory.path().display());
    let output = coordinator(&[
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &database,
        "--metrics-listen",
        &address,
    ])
    .await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains(&address),
        "{output:?}"
    );
}

async fn healthcheck(addr: &str, timeout: &str) -> std::process::Output {
    coordinator(&["healthcheck", "--addr", addr, "--timeout", timeout]).await
}

#[tokio::test]
async fn healthcheck_exits_zero_only_when_the_service_is_serving() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::start(&database.url, &[]).await;
    server.wait_until_serving().await.expect("serving");
    let endpoint = server.endpoint();
    let address = endpoint.trim_start_matches("http://");
    let serving = healthcheck(address, "5s").await;
    assert!(serving.status.success(), "{serving:?}");

    // A fresh database with migrations off stays NOT_SERVING.
    let unmigrated = TestDatabase::create(Backend::Postgres).await;
    let not_serving = ServerProcess::start(&unmigrated.url, &["--no-migrate"]).await;
    let endpoint = not_serving.endpoint();
    let output = healthcheck(endpoint.trim_start_matches("http://"), "5s").await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("NOT_SERVING"),
        "{output:?}"
    );
}

#[tokio::test]
async fn healthcheck_fails_when_nothing_listens_or_nothing_answers_in_time() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = closed.local_addr().expect("address").to_string();
    drop(closed);
    let output = healthcheck(&address, "5s").await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");

    // A listener that accepts and never answers: the timeout ends the check.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = silent.local_addr().expect("address").to_string();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let began = std::time::Instant::now();
    let output = healthcheck(&address, "500ms").await;
    let took = began.elapsed();
    holding.abort();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no answer within"),
        "{output:?}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[tokio::test]
async fn the_healthcheck_timeout_is_bounded() {
    for (timeout, accepted) in [
        ("99ms", false),
        ("100ms", true),
        ("60s", true),
        ("61s", false),
    ] {
        // Port 1: nothing listens, so an accepted timeout ends in 1 (unhealthy), a refused in 2.
        let output = healthcheck("127.0.0.1:1", timeout).await;
        let wanted = if accepted { 1 } else { 2 };
        assert_eq!(
            output.status.code(),
            Some(wanted),
            "--timeout {timeout}: {output:?}"
        );
    }
}
