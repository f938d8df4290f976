//! An expired lease is taken over: a new token and the last checkpoint for the taker, the
//! replaced holder fenced off, attempts counted; and an abandoned claim nobody took over.

use tonic::Code;

use crate::support::*;

async fn an_expired_lease_is_taken_over_with_a_new_token_and_the_last_checkpoint(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("takeover");
    let first = claim(&mut client, try_start(&key).with_lease(millis(300))).await;
    let checkpoint = extend(&key, first.lease_token)
        .with_lease(millis(200))
        .with_checkpoint(Some(b"step 3 of 5"));
    extend_response(&client, checkpoint).await;
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
    assert_guarded_writes_refused(&client, &key, old, Code::Aborted, "LEASE_LOST").await;

    // The new holder is unaffected by the refusals and completes.
    complete_key(&client, &key, second.lease_token, b"ok").await;
    // A stale token on a completed key is still LEASE_LOST: the token is checked first.
    let stale = client.complete(complete(&key, old, b"ok")).await;
    assert_refused(stale, Code::Aborted, "LEASE_LOST");
}

async fn a_takeover_counts_attempts_and_a_fresh_claim_after_release_restarts_them(
    backend: Backend,
) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("attempts");
    let mut token = 0;
    for expected_attempt in 1..=3 {
        let started = claim_and_let_lapse(&app, &mut client, try_start(&key)).await;
        assert_eq!(started.attempt, expected_attempt);
        assert!(started.lease_token > token);
        token = started.lease_token;
    }
    let short = try_start(&key).with_lease(millis(SHORT_LEASE_MS));
    let restarted = claim(&mut client, short.clone()).await;
    release_key(&client, &key, restarted.lease_token).await;
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
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("abandoned");
    claim_and_let_lapse(&app, &mut client, try_start(&key)).await;

    let now = app.db_now().await;
    let held = looked_up_in_progress(&client, &key).await;
    assert!(
        instant(&held.lease_expires_at) < now,
        "in progress with a past lease"
    );
    let other = try_start(&key).with_fingerprint(b"different");
    expect_mismatch(try_start_response(&client, other).await);
}

for_each_backend!(
    an_expired_lease_is_taken_over_with_a_new_token_and_the_last_checkpoint,
    a_takeover_counts_attempts_and_a_fresh_claim_after_release_restarts_them,
    an_abandoned_claim_stays_in_progress_and_keeps_refusing_other_fingerprints,
);
