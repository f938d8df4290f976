use tonic::Code;

use crate::support::*;

async fn extend_lease_sets_the_lease_to_now_plus_ttl_even_when_that_is_shorter(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("extend");
    let started = claim(&mut client, try_start(&key).with_lease(secs(60))).await;

    let before = app.db_now().await;
    let shorter = extend(&key, started.lease_token).with_lease(secs(2));
    let extended = extend_response(&client, shorter).await;
    let after = app.db_now().await;
    let expires = instant(&extended.lease_expires_at);
    assert!(
        expires < instant(&started.lease_expires_at),
        "ExtendLease may shorten"
    );
    let start = expires - chrono::Duration::seconds(2);
    assert!(before <= start && start <= after);

    // The holder's claim is visible with the new expiry.
    let in_progress = expect_held_by_another(&client, &key).await;
    assert_eq!(in_progress.lease_expires_at, extended.lease_expires_at);
}

async fn extend_lease_without_a_ttl_uses_thirty_seconds(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("extend-default");
    let started = claim(&mut client, try_start(&key).with_lease(secs(1))).await;
    let before = app.db_now().await;
    let extended = extend_response(&client, extend(&key, started.lease_token)).await;
    let after = app.db_now().await;
    let start = instant(&extended.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(before <= start && start <= after);
}

/// The lease of the claims and renewals whose checkpoint a successor takes over.
const CHECKPOINT_LEASE_MS: u64 = 150;

/// Saves `checkpoint` (or keeps the last, for `None`) as the holder of `token`, then answers the
/// checkpoint the way a successor sees it: handed over on takeover, with the taker's token.
async fn checkpoint_then_take_over(
    app: &TestApp,
    client: &mut Client,
    key: &str,
    token: u64,
    checkpoint: Option<&[u8]>,
) -> (u64, Option<Vec<u8>>) {
    let renewal = extend(key, token)
        .with_lease(millis(CHECKPOINT_LEASE_MS))
        .with_checkpoint(checkpoint);
    extend_response(client, renewal).await;
    wait_for_lease_expiry(app, client, key).await;
    let taker = try_start(key).with_lease(millis(CHECKPOINT_LEASE_MS));
    let started = claim(client, taker).await;
    (started.lease_token, started.checkpoint)
}

async fn a_checkpoint_is_replaced_when_sent_kept_when_absent_and_emptied_when_empty(
    backend: Backend,
) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("checkpoint");
    let first = try_start(&key).with_lease(millis(CHECKPOINT_LEASE_MS));
    let started = claim(&mut client, first).await;
    let (token, checkpoint) = checkpoint_then_take_over(
        &app,
        &mut client,
        &key,
        started.lease_token,
        Some(b"page 2"),
    )
    .await;
    assert_eq!(checkpoint.as_deref(), Some(&b"page 2"[..]));

    let (token, checkpoint) = checkpoint_then_take_over(&app, &mut client, &key, token, None).await;
    assert_eq!(checkpoint.as_deref(), Some(&b"page 2"[..]), "absent keeps");

    let (_, checkpoint) =
        checkpoint_then_take_over(&app, &mut client, &key, token, Some(b"")).await;
    assert_eq!(
        checkpoint.as_deref(),
        Some(&b""[..]),
        "present but empty replaces"
    );
}

async fn extend_lease_stretches_retention_to_cover_the_lease(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("extend-retention");
    let short = try_start(&key)
        .with_retention(secs(1))
        .with_lease(millis(500));
    let started = claim(&mut client, short).await;
    let longer = extend(&key, started.lease_token).with_lease(secs(3600));
    let extended = extend_response(&client, longer).await;
    let expires_at = app.database.key_expires_at(&key).await;
    assert!(expires_at >= instant(&extended.lease_expires_at));
}

async fn extend_lease_refusals_follow_the_contract_order(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let absent = client.extend_lease(extend(&unique_key("absent"), 3)).await;
    assert_refused(absent, Code::NotFound, "KEY_NOT_FOUND");

    let key = unique_key("extend-refusals");
    let started = claim(&mut client, try_start(&key)).await;
    let wrong_token = client
        .extend_lease(extend(&key, started.lease_token + 1))
        .await;
    assert_refused(wrong_token, Code::Aborted, "LEASE_LOST");

    complete_key(&client, &key, started.lease_token, b"done").await;
    let completed = client.extend_lease(extend(&key, started.lease_token)).await;
    assert_refused(completed, Code::FailedPrecondition, "ALREADY_COMPLETED");
}

async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_extend(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("late-extend");
    let started = claim_and_let_lapse(&app, &mut client, try_start(&key)).await;
    extend_response(&client, extend(&key, started.lease_token)).await;
    // The lease runs again, so nobody can take over.
    expect_held_by_another(&client, &key).await;
}

for_each_backend!(
    extend_lease_sets_the_lease_to_now_plus_ttl_even_when_that_is_shorter,
    extend_lease_without_a_ttl_uses_thirty_seconds,
    a_checkpoint_is_replaced_when_sent_kept_when_absent_and_emptied_when_empty,
    extend_lease_stretches_retention_to_cover_the_lease,
    extend_lease_refusals_follow_the_contract_order,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_extend,
);
