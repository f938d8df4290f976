//! Secrets stay out of the logs: tokens, responses and fingerprints never show, even at debug.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use crate::support::process::ServerProcess;
use crate::support::security::*;
use crate::support::*;

/// The real binary with debug logs: tokens, responses and fingerprints never show.
async fn logs_never_show_tokens_responses_or_fingerprints(backend: Backend) {
    let (secret, line) = token("payments", "*");
    let tokens = TokensFile::new(&[&line]);
    let database = TestDatabase::create(backend).await;
    let mut server = ServerProcess::start_with_log_level(
        &database.url,
        &["--tokens-file", &tokens.flag()],
        "debug",
    )
    .await;
    let _ = server.client_when_serving().await;
    let mut client = authed_client(server.endpoint(), Bearer::token(&secret)).await;
    let fingerprint = b"FINGERPRINT-7d1f0c";
    let response = b"RESPONSE-card-4242-4242";
    let answer = client
        .try_start(pb::TryStartRequest {
            fingerprint: fingerprint.to_vec(),
            ..try_start("k")
        })
        .await
        .expect("TryStart");
    let started = expect_started(answer.into_inner());
    client
        .complete(complete("k", started.lease_token, response))
        .await
        .expect("Complete");
    let (wrong, _) = token("wrong", "*");
    let mut stranger = authed_client(server.endpoint(), Bearer::token(&wrong)).await;
    let _ = stranger.lookup(lookup("k")).await;
    server.signal("TERM");
    assert_eq!(server.wait(Duration::from_secs(20)).await, Some(0));

    let logs = server.output();
    assert!(logs.contains("rpc"), "debug logs were written");
    for secret in [
        secret.as_str(),
        wrong.as_str(),
        std::str::from_utf8(fingerprint).expect("ASCII"),
        std::str::from_utf8(response).expect("ASCII"),
    ] {
        assert!(!logs.contains(secret), "{secret:?} appears in the logs");
    }
}

for_each_backend!(logs_never_show_tokens_responses_or_fingerprints,);
