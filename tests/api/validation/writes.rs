//! The holder's writes and every RPC's address: lease tokens, responses, checkpoints and
//! ExtendLease's lease_ttl at their bounds, and the scope and key validated on every RPC.

use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, ExtendLeaseRequest, LookupRequest, MarkProcessedRequest, ReleaseRequest,
};
use tonic::Code;

use crate::support::*;

use super::{DAY, dur};

async fn lease_token_zero_is_missing_and_must_fit_the_token_range(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    for token in [0, u64::MAX, (i64::MAX as u64) + 1] {
        for (rpc, answer) in guarded_writes(&client, "k", token).await {
            assert_invalid(&answer.expect_err(rpc), &["lease_token"]);
        }
    }
    // The largest token is well-formed: it is simply not anybody's.
    let absent = client.complete(complete("k", i64::MAX as u64, b"r")).await;
    assert_refused(absent, Code::NotFound, "KEY_NOT_FOUND");
    assert_eq!(app.total_rows().await, 0);
}

/// Asserts that the holder of key `k` may not complete it with a response of `limit` + 1 bytes,
/// the response being invalid, then completes it with one of exactly `limit` bytes.
async fn assert_the_response_limit_is(client: &Client, token: u64, limit: usize) {
    let over = client
        .clone()
        .complete(complete("k", token, &vec![1; limit + 1]))
        .await;
    assert_invalid(&over.expect_err("response too large"), &["response"]);
    // Until the response at the limit, the claim is still in progress.
    expect_held_by_another(client, "k").await;
    complete_key(client, "k", token, &vec![1; limit]).await;
}

async fn response_is_at_most_the_configured_limit(backend: Backend) {
    let (_app, mut client) =
        app_and_client_with(backend, &["--max-response-bytes", "262144"]).await;
    let started = claim(&mut client, try_start("k")).await;
    assert_the_response_limit_is(&client, started.lease_token, 262_144).await;
}

async fn the_default_response_limit_is_one_mebibyte(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let started = claim(&mut client, try_start("k")).await;
    assert_the_response_limit_is(&client, started.lease_token, 1024 * 1024).await;
}

async fn checkpoint_is_at_most_64_kib(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let started = claim(&mut client, try_start("k")).await;
    let limit = 64 * 1024;
    let with_checkpoint_of =
        |size: usize| extend("k", started.lease_token).with_checkpoint(Some(&vec![0; size]));
    let over = client.extend_lease(with_checkpoint_of(limit + 1)).await;
    assert_invalid(&over.expect_err("checkpoint too large"), &["checkpoint"]);
    // A checkpoint of exactly 64 KiB.
    extend_response(&client, with_checkpoint_of(limit)).await;
}

async fn extend_lease_ttl_has_the_lease_bounds(backend: Backend) {
    let (_app, mut client) = app_and_client(backend).await;
    let started = claim(&mut client, try_start("k")).await;
    for bad in [
        dur(0, 0),
        dur(0, 99_999_999),
        dur(DAY as i64 + 1, 0),
        dur(-1, 0),
    ] {
        let refused = client
            .extend_lease(extend("k", started.lease_token).with_lease(bad))
            .await;
        assert_invalid(&refused.expect_err("bad ttl"), &["lease_ttl"]);
    }
}

async fn every_rpc_validates_its_scope_and_key(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    // Each RPC's answer, and the fields it must name as invalid, in order.
    let refusals: [(Result<(), tonic::Status>, &[&str]); 5] = [
        (
            client
                .complete(CompleteRequest {
                    namespace: "bad scope".into(),
                    key: String::new(),
                    ..complete("k", 1, b"r")
                })
                .await
                .map(drop),
            &["namespace", "key"],
        ),
        (
            client
                .release(ReleaseRequest {
                    namespace: String::new(),
                    key: "k\u{1}".into(),
                    lease_token: 0,
                })
                .await
                .map(drop),
            &["namespace", "key", "lease_token"],
        ),
        (
            client
                .extend_lease(ExtendLeaseRequest {
                    namespace: "x".repeat(65),
                    ..extend("k", 1)
                })
                .await
                .map(drop),
            &["namespace"],
        ),
        (
            client
                .lookup(LookupRequest {
                    namespace: "ok".into(),
                    key: "k".repeat(256),
                })
                .await
                .map(drop),
            &["key"],
        ),
        (
            client
                .mark_processed(MarkProcessedRequest {
                    consumer: "no spaces allowed".into(),
                    ..mark("c", &["e"])
                })
                .await
                .map(drop),
            &["consumer"],
        ),
    ];
    for (answer, fields) in refusals {
        assert_invalid(&answer.expect_err("invalid"), fields);
    }
    assert_eq!(app.total_rows().await, 0);
}

for_each_backend!(
    lease_token_zero_is_missing_and_must_fit_the_token_range,
    response_is_at_most_the_configured_limit,
    the_default_response_limit_is_one_mebibyte,
    checkpoint_is_at_most_64_kib,
    extend_lease_ttl_has_the_lease_bounds,
    every_rpc_validates_its_scope_and_key,
);
