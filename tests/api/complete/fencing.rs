//! Who may complete: only the current holder's token, even after its lease ran out unreplaced;
//! an absent key is KEY_NOT_FOUND, another or an earlier life's token LEASE_LOST.

use idempotency_coordinator::proto::idempotency::v1::{TryStartRequest, lookup_response::State};
use tonic::Code;

use crate::support::*;

async fn complete_of_an_absent_key_is_key_not_found(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let status = client
        .complete(complete(&unique_key("never"), 1, b"x"))
        .await
        .expect_err("absent key");
    assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");
    assert_eq!(
        app.total_rows().await,
        0,
        "a refused Complete writes nothing"
    );
}

async fn complete_with_a_token_that_is_not_the_holders_is_lease_lost(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("wrong-token");
    let started = claim(&mut client, try_start(&key)).await;
    let status = client
        .complete(complete(&key, started.lease_token + 1000, b"x"))
        .await
        .expect_err("wrong token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    expect_in_progress(try_start_response(&client, try_start(&key)).await);
}

async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_complete(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("late-complete");
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
        .complete(complete(&key, started.lease_token, b"late but fine"))
        .await
        .expect("an expired, unreplaced holder completes");
    let replay = expect_completed(try_start_response(&client, try_start(&key)).await);
    assert_eq!(replay.response, b"late but fine");
}

async fn a_token_from_an_expired_life_of_the_key_is_lease_lost(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("past-life");
    let old = claim(
        &mut client,
        TryStartRequest {
            retention: secs(1),
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    eventually(
        std::time::Duration::from_secs(5),
        "the key expired",
        || async { matches!(key_state(&client, &key).await, State::Absent(_)) },
    )
    .await;
    let new = claim(&mut client, try_start(&key)).await;
    assert!(new.lease_token > old.lease_token);
    let status = client
        .complete(complete(&key, old.lease_token, b"stale"))
        .await
        .expect_err("a token of the key's earlier life");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
}

for_each_backend!(
    complete_of_an_absent_key_is_key_not_found,
    complete_with_a_token_that_is_not_the_holders_is_lease_lost,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_complete,
    a_token_from_an_expired_life_of_the_key_is_lease_lost,
);
