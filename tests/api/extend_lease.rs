use idempotency_coordinator::proto::idempotency::v1::{ExtendLeaseRequest, TryStartRequest};
use tonic::Code;

use crate::support::*;

async fn extend_lease_sets_the_lease_to_now_plus_ttl_even_when_that_is_shorter(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("extend");
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(60),
            ..try_start(&key)
        },
    )
    .await;

    let before = app.db_now().await;
    let extended = client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: secs(2),
            ..extend(&key, started.lease_token)
        })
        .await
        .expect("ExtendLease")
        .into_inner();
    let after = app.db_now().await;
    let expires = instant(&extended.lease_expires_at);
    assert!(
        expires < instant(&started.lease_expires_at),
        "ExtendLease may shorten"
    );
    let start = expires - chrono::Duration::seconds(2);
    assert!(before <= start && start <= after);

    // The holder's claim is visible with the new expiry.
    let in_progress = expect_in_progress(try_start_response(&client, try_start(&key)).await);
    assert_eq!(in_progress.lease_expires_at, extended.lease_expires_at);
}

async fn extend_lease_without_a_ttl_uses_thirty_seconds(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("extend-default");
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(1),
            ..try_start(&key)
        },
    )
    .await;
    let before = app.db_now().await;
    let extended = client
        .extend_lease(extend(&key, started.lease_token))
        .await
        .expect("ExtendLease")
        .into_inner();
    let after = app.db_now().await;
    let start = instant(&extended.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(before <= start && start <= after);
}

/// The checkpoint is observed the way a successor sees it: handed over on takeover.
async fn take_over(app: &TestApp, client: &mut Client, key: &str) -> (u64, Option<Vec<u8>>) {
    wait_for_lease_expiry(app, client, key).await;
    let started = claim(
        client,
        TryStartRequest {
            lease_ttl: millis(150),
            ..try_start(key)
        },
    )
    .await;
    (started.lease_token, started.checkpoint)
}

async fn a_checkpoint_is_replaced_when_sent_kept_when_absent_and_emptied_when_empty(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("checkpoint");
    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: millis(150),
            ..try_start(&key)
        },
    )
    .await;
    client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: millis(150),
            checkpoint: Some(b"page 2".to_vec()),
            ..extend(&key, started.lease_token)
        })
        .await
        .expect("ExtendLease with a checkpoint");
    let (token, checkpoint) = take_over(&app, &mut client, &key).await;
    assert_eq!(checkpoint.as_deref(), Some(&b"page 2"[..]));

    client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: millis(150),
            checkpoint: None,
            ..extend(&key, token)
        })
        .await
        .expect("ExtendLease without a checkpoint");
    let (token, checkpoint) = take_over(&app, &mut client, &key).await;
    assert_eq!(checkpoint.as_deref(), Some(&b"page 2"[..]), "absent keeps");

    client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: millis(150),
            checkpoint: Some(Vec::new()),
            ..extend(&key, token)
        })
        .await
        .expect("ExtendLease with an empty checkpoint");
    let (_, checkpoint) = take_over(&app, &mut client, &key).await;
    assert_eq!(
        checkpoint.as_deref(),
        Some(&b""[..]),
        "present but empty replaces"
    );
}

async fn extend_lease_stretches_retention_to_cover_the_lease(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("extend-retention");
    let started = claim(
        &mut client,
        TryStartRequest {
            retention: secs(1),
            lease_ttl: millis(500),
            ..try_start(&key)
        },
    )
    .await;
    let extended = client
        .extend_lease(ExtendLeaseRequest {
            lease_ttl: secs(3600),
            ..extend(&key, started.lease_token)
        })
        .await
        .expect("ExtendLease")
        .into_inner();
    let expires_at = app.database.key_expires_at(&key).await;
    assert!(expires_at >= instant(&extended.lease_expires_at));
}

async fn extend_lease_refusals_follow_the_contract_order(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let status = client
        .extend_lease(extend(&unique_key("absent"), 3))
        .await
        .expect_err("absent key");
    assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");

    let key = unique_key("extend-refusals");
    let started = claim(&mut client, try_start(&key)).await;
    let status = client
        .extend_lease(extend(&key, started.lease_token + 1))
        .await
        .expect_err("wrong token");
    assert_error(&status, Code::Aborted, "LEASE_LOST");

    client
        .complete(complete(&key, started.lease_token, b"done"))
        .await
        .expect("Complete");
    let status = client
        .extend_lease(extend(&key, started.lease_token))
        .await
        .expect_err("completed key");
    assert_error(&status, Code::FailedPrecondition, "ALREADY_COMPLETED");
}

async fn a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_extend(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("late-extend");
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
        .extend_lease(extend(&key, started.lease_token))
        .await
        .expect("an expired, unreplaced holder extends");
    // The lease runs again, so nobody can take over.
    expect_in_progress(try_start_response(&client, try_start(&key)).await);
}

for_each_backend!(
    extend_lease_sets_the_lease_to_now_plus_ttl_even_when_that_is_shorter,
    extend_lease_without_a_ttl_uses_thirty_seconds,
    a_checkpoint_is_replaced_when_sent_kept_when_absent_and_emptied_when_empty,
    extend_lease_stretches_retention_to_cover_the_lease,
    extend_lease_refusals_follow_the_contract_order,
    a_holder_whose_lease_ran_out_but_was_not_replaced_may_still_extend,
);
