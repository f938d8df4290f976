//! How long a completed key is kept: the retention it was claimed with (the taker's, after a
//! takeover), Complete's own, or the 24-hour default, counted from completion.

use idempotency_coordinator::proto::idempotency::v1::CompleteResponse;

use crate::support::*;

/// How long a completion keeps its key: from its completion to its expiry.
fn kept_for(completion: &CompleteResponse) -> chrono::Duration {
    instant(&completion.expires_at) - instant(&completion.completed_at)
}

async fn complete_stores_the_response_for_the_retention_the_key_was_claimed_with(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("complete");
    let hour = try_start(&key).with_retention(secs(3600));
    let started = claim(&mut client, hour).await;
    let completion = complete_key(&client, &key, started.lease_token, b"receipt").await;
    assert_eq!(
        kept_for(&completion),
        chrono::Duration::seconds(3600),
        "retention is renewed at completion"
    );
    assert_stored(&client, &key, b"receipt", &completion).await;
}

async fn complete_with_its_own_retention_counts_it_from_completion(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("complete-retention");
    let started = claim(&mut client, try_start(&key)).await;
    let week = complete(&key, started.lease_token, b"r").with_retention(secs(7 * 24 * 3600));
    let completion = complete_response(&client, week).await;
    assert_eq!(kept_for(&completion), chrono::Duration::days(7));
}

async fn the_default_key_retention_is_24_hours(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let (_, completion) = claim_and_complete(&mut client, &unique_key("default"), b"r").await;
    assert_eq!(kept_for(&completion), chrono::Duration::hours(24));
}

async fn complete_without_retention_after_a_takeover_keeps_the_takers_retention(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("taker-retention");
    let two_hours = try_start(&key).with_retention(secs(7200));
    claim_and_let_lapse(&app, &mut client, two_hours).await;
    let taker = claim(&mut client, try_start(&key).with_retention(secs(600))).await;
    let completion = complete_key(&client, &key, taker.lease_token, b"r").await;
    assert_eq!(kept_for(&completion), chrono::Duration::seconds(600));
}

for_each_backend!(
    complete_stores_the_response_for_the_retention_the_key_was_claimed_with,
    complete_with_its_own_retention_counts_it_from_completion,
    the_default_key_retention_is_24_hours,
    complete_without_retention_after_a_takeover_keeps_the_takers_retention,
);
