//! How long a completed key is kept: the retention it was claimed with (the taker's, after a
//! takeover), Complete's own, or the 24-hour default, counted from completion.

use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, TryStartRequest, lookup_response::State,
};

use crate::support::*;

async fn complete_stores_the_response_for_the_retention_the_key_was_claimed_with(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("complete");
    let started = claim(
        &mut client,
        TryStartRequest {
            retention: secs(3600),
            ..try_start(&key)
        },
    )
    .await;
    let completion = client
        .complete(complete(&key, started.lease_token, b"receipt"))
        .await
        .expect("Complete")
        .into_inner();
    let completed_at = instant(&completion.completed_at);
    assert_eq!(
        instant(&completion.expires_at) - completed_at,
        chrono::Duration::seconds(3600),
        "retention is renewed at completion"
    );
    match key_state(&client, &key).await {
        State::Completed(done) => {
            assert_eq!(done.response, b"receipt");
            assert_eq!(done.fingerprint, FINGERPRINT);
            assert_eq!(done.completed_at, completion.completed_at);
            assert_eq!(done.expires_at, completion.expires_at);
        }
        other => panic!("expected completed, got {other:?}"),
    }
}

async fn complete_with_its_own_retention_counts_it_from_completion(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("complete-retention");
    let started = claim(&mut client, try_start(&key)).await;
    let completion = client
        .complete(CompleteRequest {
            retention: secs(7 * 24 * 3600),
            ..complete(&key, started.lease_token, b"r")
        })
        .await
        .expect("Complete")
        .into_inner();
    assert_eq!(
        instant(&completion.expires_at) - instant(&completion.completed_at),
        chrono::Duration::days(7)
    );
}

async fn the_default_key_retention_is_24_hours(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("default-retention");
    let started = claim(&mut client, try_start(&key)).await;
    let completion = client
        .complete(complete(&key, started.lease_token, b"r"))
        .await
        .expect("Complete")
        .into_inner();
    assert_eq!(
        instant(&completion.expires_at) - instant(&completion.completed_at),
        chrono::Duration::hours(24)
    );
}

async fn complete_without_retention_after_a_takeover_keeps_the_takers_retention(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("taker-retention");
    claim(
        &mut client,
        TryStartRequest {
            retention: secs(7200),
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &key).await;
    let taker = claim(
        &mut client,
        TryStartRequest {
            retention: secs(600),
            ..try_start(&key)
        },
    )
    .await;
    let completion = client
        .complete(complete(&key, taker.lease_token, b"r"))
        .await
        .expect("Complete")
        .into_inner();
    assert_eq!(
        instant(&completion.expires_at) - instant(&completion.completed_at),
        chrono::Duration::seconds(600)
    );
}

for_each_backend!(
    complete_stores_the_response_for_the_retention_the_key_was_claimed_with,
    complete_with_its_own_retention_counts_it_from_completion,
    the_default_key_retention_is_24_hours,
    complete_without_retention_after_a_takeover_keeps_the_takers_retention,
);
