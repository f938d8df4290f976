//! Bearer tokens and their scopes: a known token may call every RPC on its scopes and on no
//! other, a call without one is refused before it touches anything, the scope the door checks
//! is the one the handler serves, and health and reflection stay open.

use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::security::*;
use crate::support::*;

/// Claims `key` on `scope` and answers its lease token, or 1 (a token no key has) when the
/// claim is refused.
async fn token_of_a_claim(client: &mut AuthedClient, scope: &str, key: &str) -> u64 {
    match client
        .try_start(try_start(key).in_namespace(scope.into()))
        .await
    {
        Ok(answer) => match outcome(answer.into_inner()) {
            Outcome::Started(started) => started.lease_token,
            other => panic!("a fresh key is started: {other:?}"),
        },
        Err(_) => 1,
    }
}

/// Calls every RPC of the API on `scope` (keys and events alike) and answers each one's code.
async fn every_rpc(client: &mut AuthedClient, scope: &str) -> Vec<(&'static str, Code)> {
    let code = |result: Result<(), tonic::Status>| result.err().map_or(Code::Ok, |s| s.code());
    let on_scope = || scope.to_owned();
    let key = unique_key("any");
    let token = token_of_a_claim(client, scope, &key).await;
    let again = try_start(&key).in_namespace(on_scope());
    let tried = code(client.try_start(again).await.map(drop));
    let extension = extend(&key, token).in_namespace(on_scope());
    let extended = code(client.extend_lease(extension).await.map(drop));
    let looked = code(
        client
            .lookup(lookup(&key).in_namespace(on_scope()))
            .await
            .map(drop),
    );
    let completion = complete(&key, token, b"r").in_namespace(on_scope());
    let completed = code(client.complete(completion).await.map(drop));
    let other_key = unique_key("release");
    let other_token = token_of_a_claim(client, scope, &other_key).await;
    let releasing = release(&other_key, other_token).in_namespace(on_scope());
    let released = code(client.release(releasing).await.map(drop));
    let marked = code(client.mark_processed(mark(scope, &["evt"])).await.map(drop));
    vec![
        ("TryStart", tried),
        ("ExtendLease", extended),
        ("Lookup", looked),
        ("Complete", completed),
        ("Release", released),
        ("MarkProcessed", marked),
    ]
}

fn all(code: Code) -> Vec<(&'static str, Code)> {
    [
        "TryStart",
        "ExtendLease",
        "Lookup",
        "Complete",
        "Release",
        "MarkProcessed",
    ]
    .into_iter()
    .map(|rpc| (rpc, code))
    .collect()
}

async fn a_known_token_may_call_every_rpc_on_its_scopes(backend: Backend) {
    let (payments, line) = token("payments", "payments-*,billing");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let mut client = authed_client(app.endpoint(), Bearer::token(&payments)).await;
    for scope in ["payments-eu", "payments-", "billing"] {
        assert_eq!(
            every_rpc(&mut client, scope).await,
            all(Code::Ok),
            "on {scope}"
        );
    }
}

async fn calls_without_a_known_token_are_unauthenticated_and_change_nothing(backend: Backend) {
    let (_, line) = token("payments", "*");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let (stranger, _) = token("stranger", "*");
    for bearer in [
        Bearer::none(),
        Bearer::token(&stranger),
        Bearer::token("idc_"),
        Bearer::raw("Basic cGF5bWVudHM6c2VjcmV0"),
        Bearer::raw("Bearer "),
    ] {
        let mut client = authed_client(app.endpoint(), bearer).await;
        assert_eq!(
            every_rpc(&mut client, "payments").await,
            all(Code::Unauthenticated)
        );
    }
    assert_eq!(app.total_rows().await, 0, "nothing was written");
    let mut client = authed_client(app.endpoint(), Bearer::none()).await;
    let status = client.lookup(lookup("k")).await.expect_err("no token");
    assert_error(&status, Code::Unauthenticated, "UNAUTHENTICATED");
}

async fn a_token_is_refused_every_scope_it_was_not_given(backend: Backend) {
    let (owner, owner_line) = token("payments", "payments-*");
    let (intruder, intruder_line) = token("shipping", "shipping,shipping-*");
    let tokens = TokensFile::new(&[&owner_line, &intruder_line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let mut owner = authed_client(app.endpoint(), Bearer::token(&owner)).await;
    let mut intruder = authed_client(app.endpoint(), Bearer::token(&intruder)).await;

    let key = unique_key("owned");
    let answer = owner
        .try_start(try_start(&key).in_namespace("payments-eu".into()))
        .await
        .expect("TryStart");
    let held = expect_started(answer.into_inner());
    let rows = app.total_rows().await;

    assert_eq!(
        every_rpc(&mut intruder, "payments-eu").await,
        all(Code::PermissionDenied)
    );
    // Aimed at the owner's very key and token: still nothing.
    let status = intruder
        .release(release(&key, held.lease_token).in_namespace("payments-eu".into()))
        .await
        .expect_err("not its namespace");
    assert_error(&status, Code::PermissionDenied, "PERMISSION_DENIED");
    assert_eq!(app.total_rows().await, rows, "nothing read or written");
    let answer = owner
        .lookup(lookup(&key).in_namespace("payments-eu".into()))
        .await
        .expect("Lookup");
    match state(answer.into_inner()) {
        State::InProgress(still) => assert_eq!(still.lease_expires_at, held.lease_expires_at),
        other => panic!("the owner's claim was touched: {other:?}"),
    }
    // And the intruder keeps its own scopes.
    assert_eq!(every_rpc(&mut intruder, "shipping").await, all(Code::Ok));
}

async fn prefix_patterns_match_only_their_prefix(backend: Backend) {
    let (payments, line) = token("payments", "payments-*,billing");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let mut client = authed_client(app.endpoint(), Bearer::token(&payments)).await;
    for (scope, expected) in [
        ("payments-eu", Code::Ok),
        ("payments-eu:refunds", Code::Ok),
        ("payments", Code::PermissionDenied),
        ("paymentsx", Code::PermissionDenied),
        ("xpayments-eu", Code::PermissionDenied),
        ("billing", Code::Ok),
        ("billing-eu", Code::PermissionDenied),
    ] {
        let answer = client.lookup(lookup("k").in_namespace(scope.into())).await;
        let code = answer.err().map_or(Code::Ok, |s| s.code());
        assert_eq!(code, expected, "{scope}");
    }
}

async fn health_and_reflection_stay_open_without_a_token(backend: Backend) {
    let (_, line) = token("payments", "*");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let health = health_client(app.endpoint()).await.expect("connect");
    assert!(is_serving(&health).await, "health answers without a token");
    app.wait_for_status(ServingStatus::Serving).await;
    // Reflection, as grpcurl uses it, without a token.
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest,
    };
    let channel = crate::support::channel_to(app.endpoint()).await;
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection without a token")
        .into_inner();
    assert!(answers.message().await.expect("an answer").is_some());
}

/// Encodes a string field the protobuf way (tag, length, bytes).
fn string_field(number: u8, value: &str) -> Vec<u8> {
    let mut out = vec![number << 3 | 2, u8::try_from(value.len()).expect("short")];
    out.extend_from_slice(value.as_bytes());
    out
}

async fn the_door_and_the_handler_read_the_same_scope(backend: Backend) {
    let (secret, line) = token("payments", "allowed");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let bearer = format!("Bearer {secret}");
    let lookup_path = "/idempotency.v1.IdempotencyService/Lookup";
    // A scope given twice: protobuf's last value wins, for the door as for the handler.
    let lookup_of_k_in = |first: &str, last: &str| {
        [
            string_field(1, first),
            string_field(2, "k"),
            string_field(1, last),
        ]
        .concat()
    };
    let denied_last = lookup_of_k_in("allowed", "denied");
    let status = raw_unary(app.endpoint(), lookup_path, denied_last, Some(&bearer))
        .await
        .expect_err("the scope that counts is 'denied'");
    assert_error(&status, Code::PermissionDenied, "PERMISSION_DENIED");
    let allowed_last = lookup_of_k_in("denied", "allowed");
    let answer = raw_unary(app.endpoint(), lookup_path, allowed_last, Some(&bearer))
        .await
        .expect("the scope that counts is 'allowed'");
    let decoded =
        <pb::LookupResponse as prost::Message>::decode(answer.as_slice()).expect("decodes");
    assert!(matches!(decoded.state, Some(State::Absent(_))));
    // A scope field of the wrong wire type is not a scope.
    let wrong_type = vec![1 << 3, 7, 2 << 3 | 2, 1, b'k'];
    let status = raw_unary(app.endpoint(), lookup_path, wrong_type, Some(&bearer))
        .await
        .expect_err("no string scope");
    assert!(
        matches!(
            status.code(),
            Code::InvalidArgument | Code::PermissionDenied
        ),
        "{status:?}"
    );
    assert_eq!(app.total_rows().await, 0);
}

for_each_backend!(
    a_known_token_may_call_every_rpc_on_its_scopes,
    calls_without_a_known_token_are_unauthenticated_and_change_nothing,
    a_token_is_refused_every_scope_it_was_not_given,
    prefix_patterns_match_only_their_prefix,
    health_and_reflection_stay_open_without_a_token,
    the_door_and_the_handler_read_the_same_scope,
);
