//! What the calls count: a known sequence counted exactly, takeovers apart from re-entries,
//! namespaces as labels only with the flag, and refusals at the door by reason.

use super::*;

async fn a_known_sequence_of_calls_is_counted_exactly(backend: Backend) {
    let (app, mut client) = metered(backend, &[]).await;
    // A replica's replay cache serves once its first heartbeat is heard back (PostgreSQL), a
    // moment after it serves: the replays below are counted as hits from then on.
    series_reaches(&app, "idempotency_replay_cache_confirmed", 1.0).await;
    let before = samples(&scrape(&app).await);
    for method in RPCS {
        let series = format!("grpc_server_started_total{{{}}}", api(method));
        assert_eq!(value(&before, &series), 0.0, "{series} starts at zero");
    }

    let key = unique_key("counted");
    let started = claim(&mut client, try_start(&key)).await;
    expect_held_by_another(&client, &key).await;
    complete_key(&client, &key, started.lease_token, b"done").await;
    expect_completed(try_start_response(&client, try_start(&key)).await);
    let mismatch = try_start(&key).with_fingerprint(b"another");
    expect_mismatch(try_start_response(&client, mismatch).await);
    // A completed key's lease cannot be extended.
    let completed = client.extend_lease(extend(&key, started.lease_token)).await;
    assert_refused(completed, Code::FailedPrecondition, "ALREADY_COMPLETED");
    refuse_a_release_with_another_token(&client, &key, started.lease_token).await;
    mark_results(&client, mark("metrics-consumer", &["a", "b"])).await;
    mark_results(&client, mark("metrics-consumer", &["b", "c"])).await;
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
    assert_values(&after, &expected);
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

/// A Release of `key` with a token that is not its holder's, refused: one refusal to count.
async fn refuse_a_release_with_another_token(client: &Client, key: &str, token: u64) {
    let stale = client
        .clone()
        .release(release(key, token + 1_000_000))
        .await;
    assert_refused(stale, Code::Aborted, "LEASE_LOST");
}

async fn takeovers_and_reentries_are_counted_apart(backend: Backend) {
    let (app, mut client) = metered(backend, &[]).await;
    let with_attempt =
        |key: &str, attempt: &str| try_start(key).with_attempt(attempt).with_lease(millis(300));
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
    assert_values(
        &after,
        &[
            ("idempotency_try_start_total{outcome=\"started\"}", 5.0),
            ("idempotency_try_start_takeovers_total", 1.0),
            ("idempotency_try_start_reentries_total", 2.0),
        ],
    );
}

async fn namespaces_become_labels_with_the_flag(backend: Backend) {
    let (labelled, mut client) = metered(backend, &["--metrics-namespace-labels"]).await;
    let key = unique_key("labelled");
    let started = claim(&mut client, try_start(&key)).await;
    let other = pb::TryStartRequest {
        namespace: "billing".into(),
        ..try_start(&key)
    };
    claim(&mut client, other).await;
    refuse_a_release_with_another_token(&client, &key, started.lease_token).await;
    mark_results(&client, mark("labelled-consumer", &["a", "b"])).await;
    let exposition = scrape(&labelled).await;
    let after = samples(&exposition);
    let expected = [
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
    ];
    assert_values(&after, &expected);
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
    let (plain, mut client) = metered(backend, &[]).await;
    claim(&mut client, try_start(&unique_key("plain"))).await;
    mark_results(&client, mark("plain-consumer", &["a"])).await;
    let exposition = scrape(&plain).await;
    assert!(!exposition.contains("namespace="), "{exposition}");
    assert!(!exposition.contains("plain-consumer"), "{exposition}");
}

for_each_backend!(
    a_known_sequence_of_calls_is_counted_exactly,
    takeovers_and_reentries_are_counted_apart,
    namespaces_become_labels_with_the_flag,
    namespaces_are_not_labels_by_default
);

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
