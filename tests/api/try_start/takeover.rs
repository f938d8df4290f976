//! An expired lease is taken over: a new token and the last checkpoint for the taker, the
//! replaced holder fenced off, attempts counted; and an abandoned claim nobody took over.

use idempotency_coordinator::proto::idempotency::v1::{
    ExtendLeaseRequest, TryStartRequest, lookup_response::State,
};
use tonic::Code;

use crate::support::*;

async fn an_expired_lease_is_taken_over_with_a_new_token_and_the_last_checkpoint(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("takeover");
    let first = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(300),
            ..try_start(&key)
        },
    )
    .await;
    client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: millis(200),
            checkpoint: Some(b"step 3 of 5".to_vec()),
            ..extend(&key, first.lease_token)
        })
        .await
        .expect("ExtendLease");
    wait_for_lease_expiry(&app, &client, &key).await;

    let second = claim(&mut client, try_start(&key)).await;
    assert!(
        second.lease_token > first.lease_token,
        "tokens strictly increase"
    );
    assert_eq!(second.attempt, 2);
    assert_eq!(second.checkpoint.as_deref(), Some(&b"step 3 of 5"[..]));

    // The replaced holder is fenced off everywhere.
    let old = first.lease_token;
    let status = client
        .complete(complete(&key, old, b"late"))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    let status = client
        .extend_lease(extend(&key, old))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    let status = client
        .release(release(&key, old))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");

    // The new holder is unaffected by the refusals and completes.
    client
        .complete(complete(&key, second.lease_token, b"ok"))
        .await
        .expect("the new holder completes");
    // A stale token on a completed key is still LEASE_LOST: the token is checked first.
    let status = client
        .complete(complete(&key, old, b"ok"))
        .await
        .expect_err("stale token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
}

async fn a_takeover_counts_attempts_and_a_fresh_claim_after_release_restarts_them(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("attempts");
    let short = TryStartRequest {
        lease_ttl: millis(100),
        ..try_start(&key)
    };
    let mut token = 0;
    for expected_attempt in 1..=3 {
        let started = claim(&mut client, short.clone()).await;
        assert_eq!(started.attempt, expected_attempt);
        assert!(started.lease_token > token);
        token = started.lease_token;
        wait_for_lease_expiry(&app, &client, &key).await;
    }
    let restarted = claim(&mut client, short.clone()).await;
    client
        .release(release(&key, restarted.lease_token))
        .await
        .expect("Release");
    let fresh = claim(&mut client, short).await;
    assert_eq!(fresh.attempt, 1, "a released key starts over");
    assert!(
        fresh.lease_token > restarted.lease_token,
        "tokens are never reused"
    );
}

async fn an_abandoned_claim_stays_in_progress_and_keeps_refusing_other_fingerprints(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("abandoned");
    claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &key).await;

    let now = app.db_now().await;
    match key_state(&client, &key).await {
        State::InProgress(held) => assert!(instant(&held.lease_expires_at) < now),
        other => panic!("expected in_progress with a past lease, got {other:?}"),
    }
    let other = TryStartRequest {
        fingerprint: b"different".to_vec(),
        ..try_start(&key)
    };
    expect_mismatch(try_start_response(&client, other).await);
}

for_each_backend!(
    an_expired_lease_is_taken_over_with_a_new_token_and_the_last_checkpoint,
    a_takeover_counts_attempts_and_a_fresh_claim_after_release_restarts_them,
    an_abandoned_claim_stays_in_progress_and_keeps_refusing_other_fingerprints,
);
