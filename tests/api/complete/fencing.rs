//! Who may complete: only the current holder's token, even after its lease ran out unreplaced;
//! an absent key is KEY_NOT_FOUND, another or an earlier life's token LEASE_LOST.

use tonic::Code;

use crate::support::*;

async fn complete_of_an_absent_key_is_key_not_found(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let absent = client
        .complete(complete(&unique_key("never"), 1, b"x"))
        .await;
    assert_refused(absent, Code::NotFound, "KEY_NOT_FOUND");
    assert_eq!(
        app.total_rows().await,
        0,
        "a refused Complete writes nothing"
    );
}

async fn complete_with_a_token_that_is_not_the_holders_is_lease_lost(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("wrong-token");
    let started = claim(&mut client, try_start(&key)).await;
    let wrong_token = started.lease_token + 1000;
    let refused = client.complete(complete(&key, wrong_token, b"x")).await;
    assert_refused(refused, Code::Aborted, "LEASE_LOST");
    expect_held_by_another(&client, &key).await;
}

async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_complete(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("late-complete");
    let started = claim_and_let_lapse(&app, &mut client, try_start(&key)).await;
    complete_key(&client, &key, started.lease_token, b"late but fine").await;
    expect_replay(&client, &key, b"late but fine").await;
}

async fn a_token_from_an_expired_life_of_the_key_is_lease_lost(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("past-life");
    let old = claim_and_let_expire(&mut client, &key).await;
    let new = claim(&mut client, try_start(&key)).await;
    assert!(new.lease_token > old.lease_token);
    let stale = client
        .complete(complete(&key, old.lease_token, b"stale"))
        .await;
    assert_refused(stale, Code::Aborted, "LEASE_LOST");
}

for_each_backend!(
    complete_of_an_absent_key_is_key_not_found,
    complete_with_a_token_that_is_not_the_holders_is_lease_lost,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_complete,
    a_token_from_an_expired_life_of_the_key_is_lease_lost,
);
