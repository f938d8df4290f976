//! TryStart's answers to one caller at a time: a fresh claim started with a lease from the
//! database clock, in_progress while it runs, the stored response replayed once completed, a
//! fingerprint mismatch for another request; tokens from one sequence, namespaces apart.

use std::collections::HashSet;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use crate::support::*;

async fn a_fresh_claim_starts_attempt_one_with_a_lease_from_the_database_clock(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("fresh");

    let before = app.db_now().await;
    let started = claim(&mut client, try_start(&key).with_lease(secs(10))).await;
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
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("busy");
    let started = claim(&mut client, try_start(&key)).await;

    let in_progress = expect_held_by_another(&client, &key).await;
    assert_eq!(in_progress.lease_expires_at, started.lease_expires_at);
    assert_eq!(in_progress.attempt, 1);
}

async fn the_default_lease_is_thirty_seconds(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let before = app.db_now().await;
    let started = claim(&mut client, try_start(&unique_key("default"))).await;
    let after = app.db_now().await;
    let lease_start = instant(&started.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(before <= lease_start && lease_start <= after);
}

async fn another_fingerprint_is_a_mismatch_and_changes_nothing(backend: Backend) {
    a_fingerprint_mismatch_changes_nothing(backend, b"another request", "attempt-a").await;
}

async fn an_empty_fingerprint_matches_only_an_empty_fingerprint(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("empty-fp");
    let empty = try_start(&key).with_fingerprint(b"");
    claim(&mut client, empty.clone()).await;
    expect_in_progress(try_start_response(&client, empty).await);
    expect_mismatch(try_start_response(&client, try_start(&key)).await);
}

async fn a_completed_key_replays_the_stored_response(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("replay");
    let request = try_start(&key).with_attempt("holder");
    let started = claim(&mut client, request.clone()).await;
    let charge = b"{\"charge\":\"ch_1\"}";
    let completion = complete_key(&client, &key, started.lease_token, charge).await;

    // Everybody gets the replay, the holder's own attempt_id included: completed comes before
    // attempt_id in TryStart's order.
    for replay_request in [request, try_start(&key)] {
        let replay = expect_completed(try_start_response(&client, replay_request).await);
        assert_eq!(replay.response, charge);
        assert_eq!(replay.completed_at, completion.completed_at);
        assert_eq!(replay.expires_at, completion.expires_at);
    }
}

async fn tokens_come_from_one_sequence_across_keys(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
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
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("shared-name");
    claim(&mut client, try_start(&key)).await;
    let elsewhere = pb::TryStartRequest {
        namespace: "other-service".into(),
        ..try_start(&key).with_fingerprint(b"unrelated")
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
