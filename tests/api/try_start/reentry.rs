//! Re-entry: the holder's retry with its own attempt_id gets its claim back (token, attempt,
//! checkpoint), renewing the lease; any other attempt_id, or none, is somebody else.

use crate::support::*;

async fn the_same_attempt_id_gets_the_same_claim_back(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("reentry");
    let request = try_start(&key)
        .with_attempt("request-7f3a")
        .with_lease(secs(5));
    let first = claim(&mut client, request.clone()).await;
    let again = claim(&mut client, request.clone().with_lease(secs(20))).await;
    assert_eq!(again.lease_token, first.lease_token);
    assert_eq!(again.attempt, first.attempt);
    assert!(
        instant(&again.lease_expires_at) > instant(&first.lease_expires_at),
        "re-entry renews the lease to now + lease_ttl when that is later"
    );

    // A shorter lease on re-entry keeps the later expiry.
    let shorter = claim(&mut client, request.clone().with_lease(millis(100))).await;
    assert_eq!(shorter.lease_expires_at, again.lease_expires_at);

    // Another attempt_id, or none, is somebody else.
    let other = request.with_attempt("request-other");
    expect_in_progress(try_start_response(&client, other).await);
    expect_held_by_another(&client, &key).await;
}

async fn re_entry_keeps_the_checkpoint_and_works_after_the_lease_ran_out(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("reentry-late");
    let request = try_start(&key)
        .with_attempt("attempt-1")
        .with_lease(millis(200));
    let first = claim(&mut client, request.clone()).await;
    let halfway = extend(&key, first.lease_token)
        .with_lease(millis(150))
        .with_checkpoint(Some(b"halfway"));
    extend_response(&client, halfway).await;
    wait_for_lease_expiry(&app, &client, &key).await;

    // Nobody took over, so the holder's own retry still gets its claim, not a takeover.
    let before = app.db_now().await;
    let again = claim(&mut client, request).await;
    assert_eq!(again.lease_token, first.lease_token);
    assert_eq!(again.attempt, 1);
    assert_eq!(again.checkpoint.as_deref(), Some(&b"halfway"[..]));
    assert!(instant(&again.lease_expires_at) >= before + chrono::Duration::milliseconds(200));
}

async fn an_empty_attempt_id_never_matches(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("no-attempt");
    claim(&mut client, try_start(&key)).await;
    expect_held_by_another(&client, &key).await;
}

async fn the_holders_own_attempt_id_with_another_fingerprint_is_a_mismatch(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("attempt-mismatch");
    let request = try_start(&key).with_attempt("same-attempt");
    claim(&mut client, request.clone()).await;
    let other = request.with_fingerprint(b"another body");
    expect_mismatch(try_start_response(&client, other).await);
}

async fn after_a_takeover_the_old_attempt_id_is_somebody_else(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("attempt-takeover");
    let old = try_start(&key)
        .with_attempt("old-attempt")
        .with_lease(millis(SHORT_LEASE_MS));
    claim_and_let_lapse(&app, &mut client, old.clone()).await;
    let new = try_start(&key)
        .with_attempt("new-attempt")
        .with_lease(secs(30));
    let taken = claim(&mut client, new.clone()).await;
    assert_eq!(taken.attempt, 2);

    let old_retry = try_start_response(&client, old).await;
    assert_eq!(expect_in_progress(old_retry).attempt, 2);
    let new_retry = claim(&mut client, new).await;
    assert_eq!(new_retry.lease_token, taken.lease_token);
}

async fn re_entry_stretches_retention_to_cover_the_renewed_lease(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("reentry-retention");
    let request = try_start(&key)
        .with_attempt("a")
        .with_retention(secs(1))
        .with_lease(millis(500));
    let first = claim(&mut client, request.clone()).await;
    let again = claim(&mut client, request.with_lease(secs(3600))).await;
    // A re-entry (the same claim), not a fresh claim after a slow setup let the 1 s retention
    // run out: only then is the retention's stretching what is checked below.
    assert_eq!(
        (again.lease_token, again.attempt),
        (first.lease_token, first.attempt),
        "the second TryStart re-entered the claim"
    );
    assert!(instant(&again.lease_expires_at) > instant(&first.lease_expires_at));
    let expires_at = app.database.key_expires_at(&key).await;
    assert!(expires_at >= instant(&again.lease_expires_at));
}

for_each_backend!(
    the_same_attempt_id_gets_the_same_claim_back,
    re_entry_keeps_the_checkpoint_and_works_after_the_lease_ran_out,
    an_empty_attempt_id_never_matches,
    the_holders_own_attempt_id_with_another_fingerprint_is_a_mismatch,
    after_a_takeover_the_old_attempt_id_is_somebody_else,
    re_entry_stretches_retention_to_cover_the_renewed_lease,
);
