//! TryStart's answers to one caller at a time: a fresh claim started with a lease from the
//! database clock, in_progress while it runs, the stored response replayed once completed, a
//! fingerprint mismatch for another request; tokens from one sequence, namespaces apart.

use std::collections::HashSet;

use idempotency_coordinator::proto::idempotency::v1::{TryStartRequest, lookup_response::State};

use crate::support::*;

async fn a_fresh_claim_starts_attempt_one_with_a_lease_from_the_database_clock(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("fresh");

    let before = app.db_now().await;
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(10),
            ..try_start(&key)
        },
    )
    .await;
    let after = app.db_now().await;

    assert!(started.lease_token > 0);
    assert_eq!(started.attempt, 1);
    assert_eq!(started.checkpoint, None, "a fresh claim has no checkpoint");
    let lease_start = instant(&started.lease_expires_at) - chrono::Duration::seconds(10);
    assert!(
        before <= lease_start && lease_start <= after,
        "lease must be the database's now + lease_ttl"
    );
}

async fn a_running_lease_answers_in_progress_with_the_holders_expiry(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("busy");
    let started = claim(&mut client, try_start(&key)).await;

    let second = client.try_start(try_start(&key)).await.expect("TryStart");
    let in_progress = expect_in_progress(second.into_inner());
    assert_eq!(in_progress.lease_expires_at, started.lease_expires_at);
    assert_eq!(in_progress.attempt, 1);
}

async fn the_default_lease_is_thirty_seconds(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let before = app.db_now().await;
    let started = claim(&mut client, try_start(&unique_key("default"))).await;
    let after = app.db_now().await;
    let lease_start = instant(&started.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(before <= lease_start && lease_start <= after);
}

async fn another_fingerprint_is_a_mismatch_and_changes_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("mismatch");
    let started = claim(&mut client, try_start(&key)).await;

    let other = TryStartRequest {
        fingerprint: b"another request".to_vec(),
        attempt_id: "attempt-a".into(),
        ..try_start(&key)
    };
    expect_mismatch(try_start_response(&client, other.clone()).await);
    match key_state(&client, &key).await {
        State::InProgress(held) => {
            assert_eq!(held.fingerprint, FINGERPRINT);
            assert_eq!(held.lease_expires_at, started.lease_expires_at);
        }
        other => panic!("expected in_progress, got {other:?}"),
    }

    client
        .complete(complete(&key, started.lease_token, b"done"))
        .await
        .expect("Complete");
    expect_mismatch(try_start_response(&client, other).await);
}

async fn an_empty_fingerprint_matches_only_an_empty_fingerprint(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("empty-fp");
    let empty = TryStartRequest {
        fingerprint: Vec::new(),
        ..try_start(&key)
    };
    claim(&mut client, empty.clone()).await;
    expect_in_progress(try_start_response(&client, empty).await);
    expect_mismatch(try_start_response(&client, try_start(&key)).await);
}

async fn a_completed_key_replays_the_stored_response(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("replay");
    let request = TryStartRequest {
        attempt_id: "holder".into(),
        ..try_start(&key)
    };
    let started = claim(&mut client, request.clone()).await;
    let completion = client
        .complete(complete(
            &key,
            started.lease_token,
            b"{\"charge\":\"ch_1\"}",
        ))
        .await
        .expect("Complete")
        .into_inner();

    // Everybody gets the replay, the holder's own attempt_id included: completed comes before
    // attempt_id in TryStart's order.
    for replay_request in [request, try_start(&key)] {
        let replay = expect_completed(try_start_response(&client, replay_request).await);
        assert_eq!(replay.response, b"{\"charge\":\"ch_1\"}");
        assert_eq!(replay.completed_at, completion.completed_at);
        assert_eq!(replay.expires_at, completion.expires_at);
    }
}

async fn tokens_come_from_one_sequence_across_keys(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let mut seen = HashSet::new();
    let mut last = 0;
    for index in 0..20 {
        let started = claim(&mut client, try_start(&format!("key-{index}"))).await;
        assert!(started.lease_token > last);
        assert!(seen.insert(started.lease_token));
        last = started.lease_token;
    }
}

async fn namespaces_are_separate(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("shared-name");
    claim(&mut client, try_start(&key)).await;
    let elsewhere = TryStartRequest {
        namespace: "other-service".into(),
        fingerprint: b"unrelated".to_vec(),
        ..try_start(&key)
    };
    let started = claim(&mut client, elsewhere).await;
    assert_eq!(started.attempt, 1);
}

for_each_backend!(
    a_fresh_claim_starts_attempt_one_with_a_lease_from_the_database_clock,
    a_running_lease_answers_in_progress_with_the_holders_expiry,
    the_default_lease_is_thirty_seconds,
    another_fingerprint_is_a_mismatch_and_changes_nothing,
    an_empty_fingerprint_matches_only_an_empty_fingerprint,
    a_completed_key_replays_the_stored_response,
    tokens_come_from_one_sequence_across_keys,
    namespaces_are_separate,
);
