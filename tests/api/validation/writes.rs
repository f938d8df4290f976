//! The holder's writes and every RPC's address: lease tokens, responses, checkpoints and
//! ExtendLease's lease_ttl at their bounds, and the scope and key validated on every RPC.

use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, ExtendLeaseRequest, LookupRequest, MarkProcessedRequest, ReleaseRequest,
};
use tonic::Code;

use crate::support::*;

use super::{DAY, dur};

async fn lease_token_zero_is_missing_and_must_fit_the_token_range(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    for token in [0, u64::MAX, (i64::MAX as u64) + 1] {
        let status = client
            .complete(complete("k", token, b"r"))
            .await
            .expect_err("bad token");
        assert_invalid(&status, &["lease_token"]);
        let status = client
            .release(release("k", token))
            .await
            .expect_err("bad token");
        assert_invalid(&status, &["lease_token"]);
        let status = client
            .extend_lease(extend("k", token))
            .await
            .expect_err("bad token");
        assert_invalid(&status, &["lease_token"]);
    }
    // The largest token is well-formed: it is simply not anybody's.
    let status = client
        .complete(complete("k", i64::MAX as u64, b"r"))
        .await
        .expect_err("absent key");
    assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");
    assert_eq!(app.total_rows().await, 0);
}

async fn response_is_at_most_the_configured_limit(backend: Backend) {
    let app = TestApp::spawn_with(backend, &["--max-response-bytes", "262144"]).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    let status = client
        .complete(complete("k", started.lease_token, &vec![1; 262_145]))
        .await
        .expect_err("response too large");
    assert_invalid(&status, &["response"]);
    expect_in_progress(try_start_response(&client, try_start("k")).await);
    client
        .complete(complete("k", started.lease_token, &vec![1; 262_144]))
        .await
        .expect("a response at the limit");
}

async fn the_default_response_limit_is_one_mebibyte(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    let status = client
        .complete(complete(
            "k",
            started.lease_token,
            &vec![1; 1024 * 1024 + 1],
        ))
        .await
        .expect_err("response too large");
    assert_invalid(&status, &["response"]);
    client
        .complete(complete("k", started.lease_token, &vec![1; 1024 * 1024]))
        .await
        .expect("a response of exactly 1 MiB");
}

async fn checkpoint_is_at_most_64_kib(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    let status = client
        .extend_lease(ExtendLeaseRequest {
            checkpoint: Some(vec![0; 64 * 1024 + 1]),
            ..extend("k", started.lease_token)
        })
        .await
        .expect_err("checkpoint too large");
    assert_invalid(&status, &["checkpoint"]);
    client
        .extend_lease(ExtendLeaseRequest {
            checkpoint: Some(vec![0; 64 * 1024]),
            ..extend("k", started.lease_token)
        })
        .await
        .expect("a checkpoint of exactly 64 KiB");
}

async fn extend_lease_ttl_has_the_lease_bounds(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    for bad in [
        dur(0, 0),
        dur(0, 99_999_999),
        dur(DAY as i64 + 1, 0),
        dur(-1, 0),
    ] {
        let status = client
            .extend_lease(ExtendLeaseRequest {
                lease_ttl: bad,
                ..extend("k", started.lease_token)
            })
            .await
            .expect_err("bad ttl");
        assert_invalid(&status, &["lease_ttl"]);
    }
}

async fn every_rpc_validates_its_scope_and_key(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let status = client
        .complete(CompleteRequest {
            namespace: "bad scope".into(),
            key: String::new(),
            ..complete("k", 1, b"r")
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["namespace", "key"]);
    let status = client
        .release(ReleaseRequest {
            namespace: String::new(),
            key: "k\u{1}".into(),
            lease_token: 0,
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["namespace", "key", "lease_token"]);
    let status = client
        .extend_lease(ExtendLeaseRequest {
            namespace: "x".repeat(65),
            ..extend("k", 1)
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["namespace"]);
    let status = client
        .lookup(LookupRequest {
            namespace: "ok".into(),
            key: "k".repeat(256),
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["key"]);
    let status = client
        .mark_processed(MarkProcessedRequest {
            consumer: "no spaces allowed".into(),
            ..mark("c", &["e"])
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["consumer"]);
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
