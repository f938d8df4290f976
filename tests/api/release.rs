use idempotency_coordinator::proto::idempotency::v1::{TryStartRequest, lookup_response::State};
use tonic::Code;

use crate::support::*;

async fn release_makes_the_key_absent_so_a_retry_starts_fresh(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("release");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .release(release(&key, started.lease_token))
        .await
        .expect("Release");
    assert!(matches!(key_state(&client, &key).await, State::Absent(_)));
    // Absent means absent: even another fingerprint may claim it now.
    let again = claim(
        &mut client,
        TryStartRequest {
            fingerprint: b"new request".to_vec(),
            ..try_start(&key)
        },
    )
    .await;
    assert_eq!(again.attempt, 1);
    assert!(again.lease_token > started.lease_token);
    assert_eq!(again.checkpoint, None);
}

async fn release_with_a_token_that_is_not_the_holders_is_lease_lost_and_keeps_the_claim(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("release-wrong");
    let started = claim(&mut client, try_start(&key)).await;
    let status = client
        .release(release(&key, started.lease_token + 1))
        .await
        .expect_err("wrong token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    expect_in_progress(try_start_response(&client, try_start(&key)).await);
}

async fn release_of_a_completed_key_is_already_completed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("release-completed");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .complete(complete(&key, started.lease_token, b"kept"))
        .await
        .expect("Complete");
    let status = client
        .release(release(&key, started.lease_token))
        .await
        .expect_err("completed key");
    assert_error(&status, Code::FailedPrecondition, "ALREADY_COMPLETED");
    // With a wrong token, the token is what is wrong.
    let status = client
        .release(release(&key, started.lease_token + 1))
        .await
        .expect_err("wrong token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    let replay = expect_completed(try_start_response(&client, try_start(&key)).await);
    assert_eq!(replay.response, b"kept");
}

async fn release_of_an_absent_key_is_key_not_found(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let status = client
        .release(release(&unique_key("nothing"), 5))
        .await
        .expect_err("absent key");
    assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");
}

async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_release(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("late-release");
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &key).await;
    client
        .release(release(&key, started.lease_token))
        .await
        .expect("an expired, unreplaced holder releases");
    assert_eq!(app.count_rows("idempotency_keys").await, 0);
}

for_each_backend!(
    release_makes_the_key_absent_so_a_retry_starts_fresh,
    release_with_a_token_that_is_not_the_holders_is_lease_lost_and_keeps_the_claim,
    release_of_a_completed_key_is_already_completed,
    release_of_an_absent_key_is_key_not_found,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_release,
);
