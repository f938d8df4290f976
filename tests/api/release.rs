use tonic::Code;

use crate::support::*;

async fn release_makes_the_key_absent_so_a_retry_starts_fresh(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("release");
    let started = claim(&mut client, try_start(&key)).await;
    release_key(&client, &key, started.lease_token).await;
    assert!(is_absent(&client, &key).await);
    // Absent means absent: even another fingerprint may claim it now.
    let again = claim(
        &mut client,
        try_start(&key).with_fingerprint(b"new request"),
    )
    .await;
    assert_eq!(again.attempt, 1);
    assert!(again.lease_token > started.lease_token);
    assert_eq!(again.checkpoint, None);
}

async fn release_with_a_token_that_is_not_the_holders_is_lease_lost_and_keeps_the_claim(
    backend: Backend,
) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("release-wrong");
    let started = claim(&mut client, try_start(&key)).await;
    let refused = client.release(release(&key, started.lease_token + 1)).await;
    assert_refused(refused, Code::Aborted, "LEASE_LOST");
    expect_held_by_another(&client, &key).await;
}

async fn release_of_a_completed_key_is_already_completed(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("release-completed");
    let (started, _) = claim_and_complete(&mut client, &key, b"kept").await;
    let completed = client.release(release(&key, started.lease_token)).await;
    assert_refused(completed, Code::FailedPrecondition, "ALREADY_COMPLETED");
    // With a wrong token, the token is what is wrong.
    let wrong_token = client.release(release(&key, started.lease_token + 1)).await;
    assert_refused(wrong_token, Code::Aborted, "LEASE_LOST");
    expect_replay(&client, &key, b"kept").await;
}

async fn release_of_an_absent_key_is_key_not_found(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let absent = client.release(release(&unique_key("nothing"), 5)).await;
    assert_refused(absent, Code::NotFound, "KEY_NOT_FOUND");
}

async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_release(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("late-release");
    let started = claim_and_let_lapse(&app, &mut client, try_start(&key)).await;
    release_key(&client, &key, started.lease_token).await;
    assert_eq!(app.count_rows("idempotency_keys").await, 0);
}

for_each_backend!(
    release_makes_the_key_absent_so_a_retry_starts_fresh,
    release_with_a_token_that_is_not_the_holders_is_lease_lost_and_keeps_the_claim,
    release_of_a_completed_key_is_already_completed,
    release_of_an_absent_key_is_key_not_found,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_release,
);
