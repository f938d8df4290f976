//! The response a completed key keeps: a repeat of the same response succeeds unchanged,
//! another one is ALREADY_COMPLETED, an empty response is a response, the checkpoint goes.

use idempotency_coordinator::proto::idempotency::v1::CompleteRequest;
use tonic::Code;

use crate::support::*;

async fn a_repeated_complete_with_the_same_response_succeeds_with_the_same_timestamps(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("complete-twice");
    let started = claim(&mut client, try_start(&key)).await;
    let first = client
        .complete(complete(&key, started.lease_token, b"same"))
        .await
        .expect("Complete")
        .into_inner();
    // A different retention on the repeat changes nothing either.
    let second = client
        .complete(CompleteRequest {
            retention: secs(60),
            ..complete(&key, started.lease_token, b"same")
        })
        .await
        .expect("repeated Complete")
        .into_inner();
    assert_eq!(first, second);
}

async fn complete_with_another_response_fails_already_completed_and_keeps_the_first(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("complete-other");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .complete(complete(&key, started.lease_token, b"first"))
        .await
        .expect("Complete");
    let status = client
        .complete(complete(&key, started.lease_token, b"second"))
        .await
        .expect_err("another response");
    assert_error(&status, Code::FailedPrecondition, "ALREADY_COMPLETED");
    let replay = expect_completed(try_start_response(&client, try_start(&key)).await);
    assert_eq!(replay.response, b"first");
}

async fn completion_drops_the_checkpoint(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("drop-checkpoint");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .extend_lease(
            idempotency_coordinator::proto::idempotency::v1::ExtendLeaseRequest {
                checkpoint: Some(b"progress".to_vec()),
                ..extend(&key, started.lease_token)
            },
        )
        .await
        .expect("ExtendLease");
    client
        .complete(complete(&key, started.lease_token, b"done"))
        .await
        .expect("Complete");
    assert_eq!(app.database.key_checkpoint(&key).await, None);
}

async fn an_empty_response_is_a_response(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("empty-response");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .complete(complete(&key, started.lease_token, b""))
        .await
        .expect("Complete");
    let replay = expect_completed(try_start_response(&client, try_start(&key)).await);
    assert!(replay.response.is_empty());
    // And the same empty response may be repeated.
    client
        .complete(complete(&key, started.lease_token, b""))
        .await
        .expect("repeated empty Complete");
}

for_each_backend!(
    a_repeated_complete_with_the_same_response_succeeds_with_the_same_timestamps,
    complete_with_another_response_fails_already_completed_and_keeps_the_first,
    completion_drops_the_checkpoint,
    an_empty_response_is_a_response,
);
