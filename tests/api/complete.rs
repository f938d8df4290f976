use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, TryStartRequest, lookup_response::State,
};
use tonic::Code;

use crate::support::*;

#[tokio::test]
async fn complete_stores_the_response_for_the_retention_the_key_was_claimed_with() {
    let app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("complete");
    let started = claim(
        &mut client,
        TryStartRequest {
            retention: secs(3600),
            ..try_start(&key)
        },
    )
    .await;
    let completion = client
        .complete(complete(&key, started.lease_token, b"receipt"))
        .await
        .expect("Complete")
        .into_inner();
    let completed_at = instant(&completion.completed_at);
    assert_eq!(
        instant(&completion.expires_at) - completed_at,
        chrono::Duration::seconds(3600),
        "retention is renewed at completion"
    );
    match state(
        client
            .lookup(lookup(&key))
            .await
            .expect("Lookup")
            .into_inner(),
    ) {
        State::Completed(done) => {
            assert_eq!(done.response, b"receipt");
            assert_eq!(done.fingerprint, FINGERPRINT);
            assert_eq!(done.completed_at, completion.completed_at);
            assert_eq!(done.expires_at, completion.expires_at);
        }
        other => panic!("expected completed, got {other:?}"),
    }
}

#[tokio::test]
async fn complete_with_its_own_retention_counts_it_from_completion() {
    let app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("complete-retention");
    let started = claim(&mut client, try_start(&key)).await;
    let completion = client
        .complete(CompleteRequest {
            retention: secs(7 * 24 * 3600),
            ..complete(&key, started.lease_token, b"r")
        })
        .await
        .expect("Complete")
        .into_inner();
    assert_eq!(
        instant(&completion.expires_at) - instant(&completion.completed_at),
        chrono::Duration::days(7)
    );
}

#[tokio::test]
async fn a_repeated_complete_with_the_same_response_succeeds_with_the_same_timestamps() {
    let app = TestApp::spawn().await;
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

#[tokio::test]
async fn complete_with_another_response_fails_already_completed_and_keeps_the_first() {
    let app = TestApp::spawn().await;
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
    let replay = expect_completed(
        client
            .try_start(try_start(&key))
            .await
            .expect("TryStart")
            .into_inner(),
    );
    assert_eq!(replay.response, b"first");
}

#[tokio::test]
async fn complete_of_an_absent_key_is_key_not_found() {
    let app = TestApp::spawn().await;
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

#[tokio::test]
async fn complete_with_a_token_that_is_not_the_holders_is_lease_lost() {
    let app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("wrong-token");
    let started = claim(&mut client, try_start(&key)).await;
    let status = client
        .complete(complete(&key, started.lease_token + 1000, b"x"))
        .await
        .expect_err("wrong token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");
    expect_in_progress(
        client
            .try_start(try_start(&key))
            .await
            .expect("TryStart")
            .into_inner(),
    );
}

#[tokio::test]
async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_complete() {
    let app = TestApp::spawn().await;
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
    wait_for_lease_expiry(&app, &mut client, &key).await;
    client
        .complete(complete(&key, started.lease_token, b"late but fine"))
        .await
        .expect("an expired, unreplaced holder completes");
    let replay = expect_completed(
        client
            .try_start(try_start(&key))
            .await
            .expect("TryStart")
            .into_inner(),
    );
    assert_eq!(replay.response, b"late but fine");
}

#[tokio::test]
async fn completion_drops_the_checkpoint() {
    let app = TestApp::spawn().await;
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
    let (checkpoint,): (Option<Vec<u8>>,) =
        sqlx::query_as("SELECT checkpoint FROM idempotency_keys WHERE key = $1")
            .bind(&key)
            .fetch_one(&app.pool)
            .await
            .expect("read the row");
    assert_eq!(checkpoint, None);
}

#[tokio::test]
async fn an_empty_response_is_a_response() {
    let app = TestApp::spawn().await;
    let mut client = app.client().await;
    let key = unique_key("empty-response");
    let started = claim(&mut client, try_start(&key)).await;
    client
        .complete(complete(&key, started.lease_token, b""))
        .await
        .expect("Complete");
    let replay = expect_completed(
        client
            .try_start(try_start(&key))
            .await
            .expect("TryStart")
            .into_inner(),
    );
    assert!(replay.response.is_empty());
    // And the same empty response may be repeated.
    client
        .complete(complete(&key, started.lease_token, b""))
        .await
        .expect("repeated empty Complete");
}
