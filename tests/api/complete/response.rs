//! The response a completed key keeps: a repeat of the same response succeeds unchanged,
//! another one is ALREADY_COMPLETED, an empty response is a response, the checkpoint goes.

use tonic::Code;

use crate::support::*;

async fn a_repeated_complete_with_the_same_response_succeeds_with_the_same_timestamps(
    backend: Backend,
) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("complete-twice");
    let (started, first) = claim_and_complete(&mut client, &key, b"same").await;
    // A different retention on the repeat changes nothing either.
    let repeat = complete(&key, started.lease_token, b"same").with_retention(secs(60));
    let second = complete_response(&client, repeat).await;
    assert_eq!(first, second);
}

async fn complete_with_another_response_fails_already_completed_and_keeps_the_first(
    backend: Backend,
) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("complete-other");
    let (started, _) = claim_and_complete(&mut client, &key, b"first").await;
    let another = client
        .complete(complete(&key, started.lease_token, b"second"))
        .await;
    assert_refused(another, Code::FailedPrecondition, "ALREADY_COMPLETED");
    expect_replay(&client, &key, b"first").await;
}

async fn completion_drops_the_checkpoint(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("drop-checkpoint");
    let started = claim(&mut client, try_start(&key)).await;
    let progress = extend(&key, started.lease_token).with_checkpoint(Some(b"progress"));
    extend_response(&client, progress).await;
    complete_key(&client, &key, started.lease_token, b"done").await;
    assert_eq!(app.database.key_checkpoint(&key).await, None);
}

async fn an_empty_response_is_a_response(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let key = unique_key("empty-response");
    let (started, _) = claim_and_complete(&mut client, &key, b"").await;
    expect_replay(&client, &key, b"").await;
    // And the same empty response may be repeated.
    complete_key(&client, &key, started.lease_token, b"").await;
}

for_each_backend!(
    a_repeated_complete_with_the_same_response_succeeds_with_the_same_timestamps,
    complete_with_another_response_fails_already_completed_and_keeps_the_first,
    completion_drops_the_checkpoint,
    an_empty_response_is_a_response,
);
