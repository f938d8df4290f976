//! Scenario 5: callers that give up; a client deadline in the middle of Complete and of
//! TryStart leaves a consistent store, and the retry gets the claim back.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;
use tonic::Code;

use crate::support::*;

/// Scenario 5, on both stores: a client deadline in the middle of Complete and of TryStart.
async fn a_caller_deadline_mid_call_leaves_a_consistent_store_and_a_recoverable_claim(
    backend: Backend,
) {
    let (app, mut client) = app_and_client(backend).await;

    let done = unique_key("deadline-complete");
    let held = claim(&mut client, try_start(&done)).await;
    let abandoned = unique_key("deadline-claim");
    let first = claim_and_let_lapse(&app, &mut client, try_start(&abandoned)).await;
    let retry = try_start(&abandoned).with_attempt("give-up-then-retry");

    let hold = app.database.hold_keys(&[&done, &abandoned]).await;
    let mut complete_request =
        tonic::Request::new(complete(&done, held.lease_token, b"finished anyway"));
    complete_request.set_timeout(Duration::from_millis(300));
    let mut claim_request = tonic::Request::new(retry.clone());
    claim_request.set_timeout(Duration::from_millis(300));
    let (mut a, mut b) = (client.clone(), client.clone());
    let (completed, claimed) =
        tokio::join!(a.complete(complete_request), b.try_start(claim_request));
    for status in [
        completed.expect_err("deadline"),
        claimed.expect_err("deadline"),
    ] {
        assert!(
            matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
            "the caller's deadline ended the call: {status:?}"
        );
    }
    app.wait_for_blocked(2).await;
    hold.release().await;

    // The work the callers gave up on ran to its end: the key is completed...
    wait_until_completed(&client, &done, "the Complete committed").await;
    // ...and the claim was taken over (a new token, above the abandoned claim's); the retry
    // with the same attempt_id gets it back.
    let token = || app.database.key_lease_token(&abandoned);
    eventually(Duration::from_secs(10), "the claim committed", || async {
        token().await > first.lease_token && {
            matches!(key_state(&client, &abandoned).await, State::InProgress(held) if held.attempt == 2)
        }
    })
    .await;
    let recovered = claim(&mut client, retry).await;
    assert_eq!(recovered.lease_token, token().await);
    assert_eq!(recovered.attempt, 2);
}

for_each_backend!(a_caller_deadline_mid_call_leaves_a_consistent_store_and_a_recoverable_claim,);
