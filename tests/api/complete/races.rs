//! Writes at the same time: concurrent Completes store exactly one response, Complete racing
//! Release has one winner, and a write that waited while the key expired finds it absent.

use idempotency_coordinator::proto::idempotency::v1::{TryStartRequest, lookup_response::State};
use tonic::Code;

use crate::support::*;

async fn concurrent_completes_by_the_holder_store_exactly_one_response(backend: Backend) {
    let (_app, client) = app_and_client(backend).await;
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
    let mut refused = Vec::new();
    for result in futures::future::join_all(calls).await {
        let (response, answer) = result.expect("task");
        match answer {
            Ok(completion) => accepted.push((response, completion.into_inner())),
            Err(status) => {
                assert_error(&status, Code::FailedPrecondition, "ALREADY_COMPLETED");
                refused.push(response);
            }
        }
    }
    let stored = expect_completed(try_start_response(&setup, try_start(&key)).await);
    for (response, completion) in &accepted {
        assert_eq!(
            response, &stored.response,
            "only the stored response is accepted"
        );
        assert_eq!(completion.completed_at, stored.completed_at);
    }
    // Every refused call carried the other response: one with the stored response is a repeat,
    // which succeeds. So the ten of each response split exactly.
    for response in &refused {
        assert_ne!(
            response, &stored.response,
            "a repeat of the stored response was refused"
        );
    }
    assert_eq!((accepted.len(), refused.len()), (10, 10));
}

async fn complete_racing_release_has_exactly_one_winner(backend: Backend) {
    let (_app, client) = app_and_client(backend).await;
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
    // The calls wait while the keys' 2 s retention runs out: a longer operation timeout than
    // the default keeps that wait within their budget, and within the lock budget (a fifth).
    let (app, mut client) = app_and_client_with(backend, &["--operation-timeout", "20s"]).await;
    let mut claimed = Vec::new();
    for kind in ["Complete", "Release", "ExtendLease"] {
        let key = unique_key(kind);
        let started = claim(
            &mut client,
            TryStartRequest {
                retention: secs(2),
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
    // The calls are held up by the lock before any key expired: otherwise (a slow setup) they
    // would find the keys absent without having waited, and this test would prove nothing.
    let blocked_at = app.db_now().await;
    for key in &keys {
        let expires_at = app.database.key_expires_at(key).await;
        assert!(
            blocked_at < expires_at,
            "the setup took longer than the retention: {key} expired at {expires_at}, the \
             calls were seen waiting only at {blocked_at}"
        );
    }
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

for_each_backend!(
    concurrent_completes_by_the_holder_store_exactly_one_response,
    complete_racing_release_has_exactly_one_winner,
    a_write_that_waited_while_the_key_expired_is_key_not_found,
);
