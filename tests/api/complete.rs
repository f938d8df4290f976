use idempotency_coordinator::domain::batch::{Batchable, Round, rounds};
use idempotency_coordinator::domain::{
    CompleteCommand, Key, LeaseToken, Rejection, ResponseBody, Scope,
};
use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, TryStartRequest, lookup_response::State,
};
use idempotency_coordinator::store::Store;
use tonic::Code;

use crate::support::*;

async fn complete_stores_the_response_for_the_retention_the_key_was_claimed_with(backend: Backend) {
    let app = TestApp::spawn(backend).await;
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
    match key_state(&client, &key).await {
        State::Completed(done) => {
            assert_eq!(done.response, b"receipt");
            assert_eq!(done.fingerprint, FINGERPRINT);
            assert_eq!(done.completed_at, completion.completed_at);
            assert_eq!(done.expires_at, completion.expires_at);
        }
        other => panic!("expected completed, got {other:?}"),
    }
}

async fn complete_with_its_own_retention_counts_it_from_completion(backend: Backend) {
    let app = TestApp::spawn(backend).await;
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

async fn the_default_key_retention_is_24_hours(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("default-retention");
    let started = claim(&mut client, try_start(&key)).await;
    let completion = client
        .complete(complete(&key, started.lease_token, b"r"))
        .await
        .expect("Complete")
        .into_inner();
    assert_eq!(
        instant(&completion.expires_at) - instant(&completion.completed_at),
        chrono::Duration::hours(24)
    );
}

async fn complete_without_retention_after_a_takeover_keeps_the_takers_retention(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("taker-retention");
    claim(
        &mut client,
        TryStartRequest {
            retention: secs(7200),
            lease_ttl: millis(100),
            ..try_start(&key)
        },
    )
    .await;
    wait_for_lease_expiry(&app, &client, &key).await;
    let taker = claim(
        &mut client,
        TryStartRequest {
            retention: secs(600),
            ..try_start(&key)
        },
    )
    .await;
    let completion = client
        .complete(complete(&key, taker.lease_token, b"r"))
        .await
        .expect("Complete")
        .into_inner();
    assert_eq!(
        instant(&completion.expires_at) - instant(&completion.completed_at),
        chrono::Duration::seconds(600)
    );
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

async fn concurrent_completes_by_the_holder_store_exactly_one_response(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = app.client().await;
    let mut setup = client.clone();
    let key = unique_key("complete-race");
    let started = claim(&mut setup, try_start(&key)).await;

    // Twenty Completes, two different responses, all at once.
    let calls = (0..20).map(|index| {
        let mut client = client.clone();
        let key = key.clone();
        let response = if index % 2 == 0 {
            b"even".to_vec()
        } else {
            b"odd".to_vec()
        };
        tokio::spawn(async move {
            let answer = client
                .complete(complete(&key, started.lease_token, &response))
                .await;
            (response, answer)
        })
    });
    let mut accepted = Vec::new();
    for result in futures::future::join_all(calls).await {
        let (response, answer) = result.expect("task");
        match answer {
            Ok(completion) => accepted.push((response, completion.into_inner())),
            Err(status) => assert_error(&status, Code::FailedPrecondition, "ALREADY_COMPLETED"),
        }
    }
    let stored = expect_completed(try_start_response(&setup, try_start(&key)).await);
    assert!(!accepted.is_empty());
    for (response, completion) in &accepted {
        assert_eq!(
            response, &stored.response,
            "only the stored response is accepted"
        );
        assert_eq!(completion.completed_at, stored.completed_at);
    }
}

async fn complete_racing_release_has_exactly_one_winner(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = app.client().await;
    for round in 0..10 {
        let key = unique_key(&format!("complete-release-{round}"));
        let mut setup = client.clone();
        let started = claim(&mut setup, try_start(&key)).await;
        let (mut a, mut b) = (client.clone(), client.clone());
        let (completed, released) = tokio::join!(
            a.complete(complete(&key, started.lease_token, b"r")),
            b.release(release(&key, started.lease_token)),
        );
        let state = key_state(&setup, &key).await;
        match (completed, released) {
            (Ok(_), Err(status)) => {
                assert_error(&status, Code::FailedPrecondition, "ALREADY_COMPLETED");
                assert!(matches!(state, State::Completed(_)));
            }
            (Err(status), Ok(_)) => {
                assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");
                assert!(matches!(state, State::Absent(_)));
            }
            other => panic!("exactly one of Complete and Release wins: {other:?}"),
        }
    }
}

/// The holder's call of each kind, as a boxed future, so that the three can wait side by side.
type Call = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tonic::Status>> + Send>>;

fn holders_call(kind: &str, client: &Client, key: &str, token: u64) -> Call {
    let mut client = client.clone();
    let key = key.to_owned();
    match kind {
        "Complete" => Box::pin(async move {
            client
                .complete(complete(&key, token, b"too late"))
                .await
                .map(drop)
        }),
        "Release" => Box::pin(async move { client.release(release(&key, token)).await.map(drop) }),
        _ => Box::pin(async move { client.extend_lease(extend(&key, token)).await.map(drop) }),
    }
}

async fn a_write_that_waited_while_the_key_expired_is_key_not_found(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let mut claimed = Vec::new();
    for kind in ["Complete", "Release", "ExtendLease"] {
        let key = unique_key(kind);
        let started = claim(
            &mut client,
            TryStartRequest {
                retention: secs(1),
                lease_ttl: millis(200),
                ..try_start(&key)
            },
        )
        .await;
        claimed.push((kind, key, started.lease_token));
    }
    let keys: Vec<&str> = claimed.iter().map(|(_, key, _)| key.as_str()).collect();
    let hold = app.database.hold_keys(&keys).await;
    let waiting: Vec<_> = claimed
        .iter()
        .map(|(kind, key, token)| {
            let call = holders_call(kind, &client, key, *token);
            (*kind, key.clone(), tokio::spawn(call))
        })
        .collect();
    app.wait_for_blocked(3).await;
    let latest_expiry = app.database.latest_key_expiry().await;
    eventually(
        std::time::Duration::from_secs(5),
        "the keys expired",
        || async { app.db_now().await > latest_expiry },
    )
    .await;
    hold.release().await;

    // Each call waited for its row while the key expired; it must judge the key as it is once
    // it holds the row (absent), not as it was when the call began.
    for (kind, key, call) in waiting {
        let status = call.await.expect("task").expect_err(kind);
        assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");
        assert!(matches!(key_state(&client, &key).await, State::Absent(_)));
    }
}

/// Completes sharing one batch, most of them refused for different reasons: each gets the
/// answer it would have got alone, and only the holder's own completion is written.
async fn a_shared_batch_of_completes_answers_each_as_if_alone(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let [open, done, other] = ["open", "done", "other"].map(unique_key);
    let open_claim = claim(&mut client, try_start(&open)).await;
    let done_claim = claim(&mut client, try_start(&done)).await;
    client
        .complete(complete(&done, done_claim.lease_token, b"first"))
        .await
        .expect("Complete");
    let other_claim = claim(&mut client, try_start(&other)).await;

    let command = |key: &str, token: u64, response: &[u8]| CompleteCommand {
        namespace: Scope::parse(NAMESPACE.into()).expect("namespace"),
        key: Key::parse(key.into()).expect("key"),
        lease_token: LeaseToken::parse(token).expect("token"),
        response: ResponseBody::parse(response.to_vec(), 1 << 20).expect("response"),
        retention: None,
    };
    // The coalescer would run the repeated key in a second round: so does the test.
    let commands = vec![
        command(&open, open_claim.lease_token + 1000, b"not mine"),
        command(&done, done_claim.lease_token, b"first"),
        command(&done, done_claim.lease_token, b"second"),
        command("never-claimed", 1, b"none"),
        command(&other, other_claim.lease_token, b"mine"),
    ];
    let mut answers: Vec<_> = (0..commands.len()).map(|_| None).collect();
    for round in rounds(commands, Batchable::conflict_key) {
        let (positions, round): (Vec<usize>, Vec<_>) = round.into_iter().unzip();
        let round = Round::new(round).expect("a round holds each key once");
        for (position, answer) in positions
            .into_iter()
            .zip(app.store.complete_batch(round).await)
        {
            answers[position] = Some(answer);
        }
    }
    let answers = answers.into_iter().map(|answer| answer.expect("answered"));
    let verdicts: Vec<Result<(), Rejection>> = answers
        .into_iter()
        .map(|answer| answer.expect("the store answered").map(drop))
        .collect();
    assert_eq!(
        verdicts,
        vec![
            Err(Rejection::LeaseLost),
            Ok(()),
            Err(Rejection::AlreadyCompleted),
            Err(Rejection::KeyNotFound),
            Ok(()),
        ]
    );
    assert_eq!(
        app.database.completed_keys(NAMESPACE).await,
        [done, other].into_iter().collect(),
        "the key held by another token stays open"
    );
}

for_each_backend!(
    a_shared_batch_of_completes_answers_each_as_if_alone,
    complete_stores_the_response_for_the_retention_the_key_was_claimed_with,
    complete_with_its_own_retention_counts_it_from_completion,
    a_repeated_complete_with_the_same_response_succeeds_with_the_same_timestamps,
    complete_with_another_response_fails_already_completed_and_keeps_the_first,
    complete_of_an_absent_key_is_key_not_found,
    complete_with_a_token_that_is_not_the_holders_is_lease_lost,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_complete,
    completion_drops_the_checkpoint,
    an_empty_response_is_a_response,
    the_default_key_retention_is_24_hours,
    complete_without_retention_after_a_takeover_keeps_the_takers_retention,
    a_token_from_an_expired_life_of_the_key_is_lease_lost,
    concurrent_completes_by_the_holder_store_exactly_one_response,
    complete_racing_release_has_exactly_one_winner,
    a_write_that_waited_while_the_key_expired_is_key_not_found,
);
