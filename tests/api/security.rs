//! Tenants and transport security: nobody reaches a namespace they were not given.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::process::ServerProcess;
use crate::support::security::*;
use crate::support::*;
use tonic_types::StatusExt;

fn try_start_on(scope: &str, key: &str) -> pb::TryStartRequest {
    pb::TryStartRequest {
        namespace: scope.into(),
        ..try_start(key)
    }
}

/// Calls every RPC of the API on `scope` (keys and events alike) and answers each one's code.
async fn every_rpc(client: &mut AuthedClient, scope: &str) -> Vec<(&'static str, Code)> {
    let code = |result: Result<(), tonic::Status>| result.err().map_or(Code::Ok, |s| s.code());
    let key = unique_key("any");
    let token = match client.try_start(try_start_on(scope, &key)).await {
        Ok(answer) => match outcome(answer.into_inner()) {
            Outcome::Started(started) => started.lease_token,
            other => panic!("a fresh key is started: {other:?}"),
        },
        Err(_) => 1,
    };
    let tried = code(client.try_start(try_start_on(scope, &key)).await.map(drop));
    let extended = code(
        client
            .extend_lease(pb::ExtendLeaseRequest {
                namespace: scope.into(),
                ..extend(&key, token)
            })
            .await
            .map(drop),
    );
    let looked = code(
        client
            .lookup(pb::LookupRequest {
                namespace: scope.into(),
                key: key.clone(),
            })
            .await
            .map(drop),
    );
    let completed = code(
        client
            .complete(pb::CompleteRequest {
                namespace: scope.into(),
                ..complete(&key, token, b"r")
            })
            .await
            .map(drop),
    );
    let other_key = unique_key("release");
    let other_token = match client.try_start(try_start_on(scope, &other_key)).await {
        Ok(answer) => match outcome(answer.into_inner()) {
            Outcome::Started(started) => started.lease_token,
            other => panic!("a fresh key is started: {other:?}"),
        },
        Err(_) => 1,
    };
    let released = code(
        client
            .release(pb::ReleaseRequest {
                namespace: scope.into(),
                ..release(&other_key, other_token)
            })
            .await
            .map(drop),
    );
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
        .try_start(try_start_on("payments-eu", &key))
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
        .release(pb::ReleaseRequest {
            namespace: "payments-eu".into(),
            ..release(&key, held.lease_token)
        })
        .await
        .expect_err("not its namespace");
    assert_error(&status, Code::PermissionDenied, "PERMISSION_DENIED");
    assert_eq!(app.total_rows().await, rows, "nothing read or written");
    let answer = owner
        .lookup(pb::LookupRequest {
            namespace: "payments-eu".into(),
            key,
        })
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
        let answer = client
            .lookup(pb::LookupRequest {
                namespace: scope.into(),
                key: "k".into(),
            })
            .await;
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
    let channel = tonic::transport::Channel::from_shared(app.endpoint())
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
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

async fn the_rate_limit_answers_resource_exhausted_per_token(backend: Backend) {
    let (busy, busy_line) = token("busy", "*");
    let (quiet, quiet_line) = token("quiet", "*");
    let tokens = TokensFile::new(&[&busy_line, &quiet_line]);
    let app = TestApp::spawn_with(
        backend,
        &["--tokens-file", &tokens.flag(), "--rate-limit", "5"],
    )
    .await;
    let mut busy = authed_client(app.endpoint(), Bearer::token(&busy)).await;
    let mut codes = Vec::new();
    let mut waits = Vec::new();
    for _ in 0..20 {
        let answer = busy.lookup(lookup("k")).await;
        if let Err(status) = &answer
            && let Some(retry) = status.get_error_details().retry_info()
        {
            waits.push(retry.retry_delay.expect("a delay"));
        }
        codes.push(answer.err().map_or(Code::Ok, |s| s.code()));
    }
    // The refusal says how long until the next call is allowed: at 5/s, at most 200 ms.
    assert!(!waits.is_empty(), "refusals carry RetryInfo: {codes:?}");
    assert!(
        waits.iter().all(|wait| *wait > std::time::Duration::ZERO
            && *wait <= std::time::Duration::from_millis(200)),
        "{waits:?}"
    );
    assert!(
        codes[..5].iter().all(|c| *c == Code::Ok),
        "a burst of the rate: {codes:?}"
    );
    assert!(codes.contains(&Code::ResourceExhausted), "{codes:?}");
    assert!(
        codes
            .iter()
            .all(|c| matches!(c, Code::Ok | Code::ResourceExhausted))
    );
    let mut quiet = authed_client(app.endpoint(), Bearer::token(&quiet)).await;
    quiet
        .lookup(lookup("k"))
        .await
        .expect("another token has a budget of its own");
}

async fn tls_serves_clients_that_trust_its_certificate(backend: Backend) {
    let pki = Pki::new("server CA");
    let dir = tempfile::tempdir().expect("a temporary folder");
    let flags = server_tls_flags(dir.path(), &pki, None);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let app = TestApp::start_on(TestDatabase::create(backend).await, None, &flags).await;

    let channel = tls_channel(app.addr, &pki, None)
        .await
        .expect("a TLS handshake");
    let client = IdempotencyServiceClient::new(channel);
    eventually(Duration::from_secs(20), "Lookup over TLS", || async {
        client.clone().lookup(lookup("k")).await.is_ok()
    })
    .await;

    let plaintext = IdempotencyServiceClient::connect(app.endpoint()).await;
    let refused = match plaintext {
        Err(_) => true,
        Ok(mut client) => client.lookup(lookup("k")).await.is_err(),
    };
    assert!(refused, "plaintext is not served on a TLS port");
    let stranger = Pki::new("another CA");
    assert!(
        tls_channel(app.addr, &stranger, None).await.is_err(),
        "a client that does not trust the server's CA does not connect"
    );
}

async fn mutual_tls_requires_a_client_certificate_from_its_ca(backend: Backend) {
    let servers = Pki::new("server CA");
    let clients = Pki::new("client CA");
    let strangers = Pki::new("stranger CA");
    let dir = tempfile::tempdir().expect("a temporary folder");
    let flags = server_tls_flags(dir.path(), &servers, Some(&clients));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let app = TestApp::start_on(TestDatabase::create(backend).await, None, &flags).await;

    let admitted = clients.client("payments-service");
    let channel = tls_channel(app.addr, &servers, Some(&admitted))
        .await
        .expect("an mTLS handshake");
    let client = IdempotencyServiceClient::new(channel);
    eventually(
        Duration::from_secs(20),
        "Lookup with a client certificate",
        || async { client.clone().lookup(lookup("k")).await.is_ok() },
    )
    .await;

    let forged = strangers.client("payments-service");
    for identity in [None, Some(&forged)] {
        let answered = match tls_channel(app.addr, &servers, identity).await {
            Err(_) => false,
            Ok(channel) => IdempotencyServiceClient::new(channel)
                .lookup(lookup("k"))
                .await
                .is_ok(),
        };
        assert!(!answered, "no certificate from the client CA, no call");
    }
}

async fn a_connection_may_have_only_so_many_calls_open(backend: Backend) {
    let app = TestApp::spawn_with(backend, &["--max-concurrent-streams", "2"]).await;
    let mut client = app.client().await;
    let key = unique_key("streams");
    let started = claim(&mut client, try_start(&key)).await;
    let hold = app.database.hold_key(&key).await;
    // Five calls on one connection; the server lets two run.
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let mut client = client.clone();
            let key = key.clone();
            tokio::spawn(async move {
                client
                    .complete(complete(&key, started.lease_token, b"r"))
                    .await
            })
        })
        .collect();
    app.wait_for_blocked(2).await;
    // The others wait on the client side for the connection's streams; give them time to show
    // that they are not admitted (nothing to await: the absence of a third call).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        app.calls_in_flight(),
        2,
        "two calls at a time on one connection"
    );
    hold.release().await;
    for call in calls {
        call.await
            .expect("task")
            .expect("every call is answered in turn");
    }
}

/// The real binary: SIGHUP reloads the tokens file while other callers keep calling.
async fn sighup_reloads_tokens_without_dropping_calls(backend: Backend) {
    let (first, first_line) = token("first", "*");
    let (steady, steady_line) = token("steady", "*");
    let (later, later_line) = token("later", "*");
    let tokens = TokensFile::new(&[&first_line, &steady_line]);
    let database = TestDatabase::create(backend).await;
    let server = ServerProcess::start(&database.url, &["--tokens-file", &tokens.flag()]).await;
    let _ = server.client_when_serving().await;

    // Steady traffic with a token that stays valid across every reload.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut callers = Vec::new();
    for _ in 0..8 {
        let mut client = authed_client(server.endpoint(), Bearer::token(&steady)).await;
        let (stop, answered, failed) = (stop.clone(), answered.clone(), failed.clone());
        callers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match client.lookup(lookup("steady")).await {
                    Ok(_) => answered.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }

    let mut first_client = authed_client(server.endpoint(), Bearer::token(&first)).await;
    first_client
        .lookup(lookup("k"))
        .await
        .expect("first is known");
    let mut later_client = authed_client(server.endpoint(), Bearer::token(&later)).await;
    assert_eq!(
        later_client
            .lookup(lookup("k"))
            .await
            .expect_err("not yet")
            .code(),
        Code::Unauthenticated
    );

    tokens.write(&[&steady_line, &later_line]);
    server.signal("HUP");
    eventually(
        Duration::from_secs(10),
        "the reload took effect",
        || async {
            let mut later_client = later_client.clone();
            later_client.lookup(lookup("k")).await.is_ok()
        },
    )
    .await;
    let status = first_client.lookup(lookup("k")).await.expect_err("revoked");
    assert_eq!(status.code(), Code::Unauthenticated);

    // A broken file is refused, and the tokens in force stay.
    tokens.write(&["this is not a tokens line"]);
    server.signal("HUP");
    tokio::time::sleep(Duration::from_millis(300)).await;
    later_client
        .lookup(lookup("k"))
        .await
        .expect("still in force");

    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        caller.await.expect("caller");
    }
    assert!(answered.load(Ordering::Relaxed) > 0);
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "no call was dropped by a reload"
    );
    assert!(
        server.output_contains("tokens file not reloaded"),
        "the broken file was reported"
    );
}

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
    let denied_last = [
        string_field(1, "allowed"),
        string_field(2, "k"),
        string_field(1, "denied"),
    ]
    .concat();
    let status = raw_unary(app.endpoint(), lookup_path, denied_last, Some(&bearer))
        .await
        .expect_err("the scope that counts is 'denied'");
    assert_error(&status, Code::PermissionDenied, "PERMISSION_DENIED");
    let allowed_last = [
        string_field(1, "denied"),
        string_field(2, "k"),
        string_field(1, "allowed"),
    ]
    .concat();
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

/// SIGHUP never ends the process, with or without a tokens file (systemctl reload, log
/// rotation hooks). Store-independent: the embedded store serves.
#[tokio::test]
async fn sighup_without_a_tokens_file_leaves_the_service_running() {
    let directory = tempfile::tempdir().expect("a temporary folder");
    let mut server = ServerProcess::start_embedded_in(directory.path()).await;
    let health = health_client(server.endpoint()).await.expect("connect");
    eventually(Duration::from_secs(20), "serving", || is_serving(&health)).await;
    server.signal("HUP");
    eventually(Duration::from_secs(5), "the SIGHUP was handled", || async {
        server.output_contains("no tokens file to reload")
    })
    .await;
    assert!(is_serving(&health).await, "still serving after SIGHUP");
    server.signal("TERM");
    assert_eq!(server.wait(Duration::from_secs(20)).await, Some(0));
}

/// The real binary refuses a non-loopback address without tokens or mTLS, naming the flag.
#[tokio::test]
async fn the_binary_refuses_to_serve_the_network_unauthenticated() {
    let directory = tempfile::tempdir().expect("a temporary folder");
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .current_dir(directory.path())
        .env_remove("DATABASE_URL")
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .await
        .expect("run the binary");
    assert!(!output.status.success());
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(printed.contains("--allow-unauthenticated"), "{printed}");

    let mut allowed = ServerProcess::start_embedded_in_with(
        directory.path(),
        &["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
    )
    .await;
    allowed.signal("TERM");
    assert_eq!(allowed.wait(Duration::from_secs(20)).await, Some(0));
}

for_each_backend!(
    a_known_token_may_call_every_rpc_on_its_scopes,
    calls_without_a_known_token_are_unauthenticated_and_change_nothing,
    a_token_is_refused_every_scope_it_was_not_given,
    prefix_patterns_match_only_their_prefix,
    health_and_reflection_stay_open_without_a_token,
    the_rate_limit_answers_resource_exhausted_per_token,
    tls_serves_clients_that_trust_its_certificate,
    mutual_tls_requires_a_client_certificate_from_its_ca,
    a_connection_may_have_only_so_many_calls_open,
    sighup_reloads_tokens_without_dropping_calls,
    logs_never_show_tokens_responses_or_fingerprints,
    the_door_and_the_handler_read_the_same_scope,
);
