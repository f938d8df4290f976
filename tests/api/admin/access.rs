//! Who may call the admin API: a token needs the admin right the call needs (`read` for
//! listings and records, `write` for changes) besides its scopes, and no admin call reads or
//! changes a namespace outside them; a plain token is refused everything; SIGHUP reloads
//! admin rights; without a tokens file, only loopback callers are answered. Each refusal names
//! its cause with a reason of its own: no admin right, a read right asked to write, a scope.

use std::time::Duration;

use idempotency_coordinator::auth::AdminRight;
use idempotency_coordinator::proto::idempotency::v1::{self as pb};
use tonic::Code;

use super::*;
use crate::support::security::*;

/// Every admin RPC on `namespace` (for key `key`), and how each ended.
async fn every_admin_rpc(
    admin: &AuthedAdmin,
    namespace: &str,
    key: &str,
) -> Vec<(&'static str, Result<(), tonic::Status>)> {
    let mut admin = admin.clone();
    let ns = || namespace.to_owned();
    let (other_key, reason) = (format!("{key}-other"), || "test".to_owned());
    let list_keys = pb::ListKeysRequest {
        namespace: ns(),
        ..Default::default()
    };
    let get_key = pb::GetKeyRequest {
        namespace: ns(),
        key: key.into(),
    };
    let stats = pb::NamespaceStatsRequest { namespace: ns() };
    let audit = audit_of(namespace);
    let release = pb::ForceReleaseRequest {
        namespace: ns(),
        key: key.into(),
        reason: reason(),
    };
    let erase_key = pb::EraseKeyRequest {
        namespace: ns(),
        key: other_key,
        reason: reason(),
    };
    let erase_namespace = pb::EraseNamespaceRequest {
        namespace: ns(),
        reason: reason(),
        batch_size: 0,
    };
    let move_placement = pb::MovePlacementRequest {
        namespace: ns(),
        to: "b".into(),
        rollback: false,
        reason: reason(),
    };
    let get_placement = pb::GetPlacementRequest { namespace: ns() };
    vec![
        ("ListKeys", admin.list_keys(list_keys).await.map(drop)),
        ("GetKey", admin.get_key(get_key).await.map(drop)),
        (
            "NamespaceStats",
            admin.namespace_stats(stats).await.map(drop),
        ),
        (
            "ListAuditEvents",
            admin.list_audit_events(audit).await.map(drop),
        ),
        ("ForceRelease", admin.force_release(release).await.map(drop)),
        ("EraseKey", admin.erase_key(erase_key).await.map(drop)),
        (
            "EraseNamespace",
            match admin.erase_namespace(erase_namespace).await {
                // The stream to its end: the erasure is over before the next check.
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    while stream.message().await.expect("progress").is_some() {}
                    Ok(())
                }
                Err(status) => Err(status),
            },
        ),
        (
            "GetPlacement",
            on_one_database(admin.get_placement(get_placement).await.map(drop)),
        ),
        (
            "MovePlacement",
            on_one_database(admin.move_placement(move_placement).await.map(drop)),
        ),
    ]
}

/// A placement call admitted to its handler, which answers that these tests' service runs on
/// one database (`FAILED_PRECONDITION` naming `--cluster`), counts as answered: what the tests
/// here judge is who is let in.
fn on_one_database(outcome: Result<(), tonic::Status>) -> Result<(), tonic::Status> {
    match outcome {
        Err(status)
            if status.code() == Code::FailedPrecondition
                && status.message().contains("--cluster") =>
        {
            Ok(())
        }
        outcome => outcome,
    }
}

/// Every call refused `PERMISSION_DENIED` with `reason`, its message saying `cause`.
fn assert_all_denied(
    outcomes: Vec<(&'static str, Result<(), tonic::Status>)>,
    reason: &str,
    cause: &str,
) {
    for (rpc, outcome) in outcomes {
        assert_denied(&outcome.expect_err(rpc), reason, cause);
    }
}

fn assert_denied(status: &tonic::Status, reason: &str, cause: &str) {
    assert_error(status, Code::PermissionDenied, reason);
    assert!(status.message().contains(cause), "{status:?}");
}

/// Claims `key` of `namespace` through `client` for ten minutes; answers the lease token.
/// A server that admits the tokens of `lines`, and its tokens file (which must outlive it).
async fn app_admitting(backend: Backend, lines: &[&str]) -> (TestApp, TokensFile) {
    let tokens = TokensFile::new(lines);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    (app, tokens)
}

async fn held_key(client: &mut AuthedClient, namespace: &str, key: &str) -> u64 {
    let started = client
        .try_start(
            try_start(key)
                .in_namespace(namespace.into())
                .with_lease(secs(600)),
        )
        .await
        .expect("claimed")
        .into_inner();
    match outcome(started) {
        pb::try_start_response::Outcome::Started(started) => started.lease_token,
        other => panic!("a fresh key is started: {other:?}"),
    }
}

/// Whether the claim of `token` still holds `key` of `namespace`: its ExtendLease applies only
/// then (a released, revoked or erased claim is refused).
async fn still_held(client: &AuthedClient, namespace: &str, key: &str, token: u64) -> bool {
    client
        .clone()
        .extend_lease(pb::ExtendLeaseRequest {
            namespace: namespace.into(),
            ..extend(key, token).with_lease(secs(600))
        })
        .await
        .is_ok()
}

/// A server that admits a service's token (`orders`, every namespace, no admin right) and
/// `other_line`'s; a client of it with the service's token, which holds key `held` of the test
/// namespace.
struct HeldByAService {
    app: TestApp,
    _tokens: TokensFile,
    /// The service's token.
    service: String,
    client: AuthedClient,
    /// The lease token of key `held`.
    token: u64,
}

impl HeldByAService {
    async fn start(backend: Backend, other_line: &str) -> Self {
        let (service, service_line) = token("orders", "*");
        let (app, _tokens) = app_admitting(backend, &[&service_line, other_line]).await;
        let mut client = authed_client(app.endpoint(), Bearer::token(&service)).await;
        let token = held_key(&mut client, NAMESPACE, "held").await;
        Self {
            app,
            _tokens,
            service,
            client,
            token,
        }
    }
}

async fn a_service_token_may_make_no_admin_call(backend: Backend) {
    let (operator, operator_line) = admin_token("oncall", "*", AdminRight::Write);
    let HeldByAService {
        app,
        _tokens,
        service: plain,
        client,
        token,
    } = HeldByAService::start(backend, &operator_line).await;

    let admin = authed_admin(app.endpoint(), Bearer::token(&plain)).await;
    assert_all_denied(
        every_admin_rpc(&admin, NAMESPACE, "held").await,
        "ADMIN_RIGHT_REQUIRED",
        "this token has no admin right",
    );
    let anonymous = authed_admin(app.endpoint(), Bearer::none()).await;
    for (rpc, outcome) in every_admin_rpc(&anonymous, NAMESPACE, "held").await {
        assert_error(
            &outcome.expect_err(rpc),
            Code::Unauthenticated,
            "UNAUTHENTICATED",
        );
    }

    // Nothing changed, nothing recorded.
    assert!(still_held(&client, NAMESPACE, "held", token).await);
    let operator = authed_admin(app.endpoint(), Bearer::token(&operator)).await;
    let listed = operator
        .clone()
        .list_keys(list(pb::AdminKeyState::Unspecified))
        .await
        .expect("an operator lists")
        .into_inner();
    assert_eq!(names(&listed.keys), ["held"]);
    assert_eq!(listed.keys[0].lease_token, token);
    let audit = operator
        .clone()
        .list_audit_events(audit_of(NAMESPACE))
        .await
        .expect("an operator reads the trail")
        .into_inner();
    assert!(audit.events.is_empty());
}

async fn a_read_right_reads_and_changes_nothing(backend: Backend) {
    let (reader, reader_line) = admin_token("dashboards", "*", AdminRight::Read);
    let held = HeldByAService::start(backend, &reader_line).await;
    let (app, client, token) = (&held.app, &held.client, held.token);

    let admin = authed_admin(app.endpoint(), Bearer::token(&reader)).await;
    for (rpc, outcome) in every_admin_rpc(&admin, NAMESPACE, "held").await {
        match rpc {
            "ListKeys" | "GetKey" | "NamespaceStats" | "ListAuditEvents" | "GetPlacement" => {
                outcome.unwrap_or_else(|status| panic!("{rpc} is a read: {status:?}"));
            }
            _ => assert_denied(
                &outcome.expect_err(rpc),
                "ADMIN_WRITE_REQUIRED",
                &format!("this token's admin right is read; {rpc} needs write"),
            ),
        }
    }
    assert!(still_held(client, NAMESPACE, "held", token).await);
}

async fn no_admin_call_reaches_beyond_the_tokens_scopes(backend: Backend) {
    let (service, service_line) = token("orders", "*");
    let (operator, operator_line) = admin_token("team-a-oncall", "team-a*", AdminRight::Write);
    let (app, _tokens) = app_admitting(backend, &[&service_line, &operator_line]).await;
    let mut client = authed_client(app.endpoint(), Bearer::token(&service)).await;
    let theirs = held_key(&mut client, "team-b", "theirs").await;
    let ours = held_key(&mut client, "team-a-payments", "ours").await;
    let admin = authed_admin(app.endpoint(), Bearer::token(&operator)).await;

    assert_all_denied(
        every_admin_rpc(&admin, "team-b", "theirs").await,
        "PERMISSION_DENIED",
        "this token's scopes do not cover namespace or consumer \"team-b\"",
    );
    assert!(still_held(&client, "team-b", "theirs", theirs).await);
    assert!(still_held(&client, "team-a-payments", "ours", ours).await);

    // Within its scopes, everything works, and the trail names the token.
    for (rpc, outcome) in every_admin_rpc(&admin, "team-a-payments", "ours").await {
        outcome.unwrap_or_else(|status| panic!("{rpc} within the scopes: {status:?}"));
    }
    let audit = admin
        .clone()
        .list_audit_events(audit_of("team-a-payments"))
        .await
        .expect("the trail")
        .into_inner();
    assert!(!audit.events.is_empty());
    assert!(
        audit
            .events
            .iter()
            .all(|event| event.actor == "token:team-a-oncall"),
        "{audit:?}"
    );
}

/// The real binary: SIGHUP grants and withdraws admin rights like scopes.
async fn sighup_reloads_admin_rights(backend: Backend) {
    let (service, service_line) = token("orders", "*");
    let (operator, plain_line) = token("oncall", "*");
    let tokens = TokensFile::new(&[&service_line, &plain_line]);
    let database = TestDatabase::create(backend).await;
    let server = tokens.serve_binary(&database).await;
    let mut client = authed_client(server.endpoint(), Bearer::token(&service)).await;
    let token = held_key(&mut client, NAMESPACE, "held").await;
    let admin = authed_admin(server.endpoint(), Bearer::token(&operator)).await;
    let stats = || {
        let mut admin = admin.clone();
        async move {
            admin
                .namespace_stats(pb::NamespaceStatsRequest {
                    namespace: NAMESPACE.into(),
                })
                .await
        }
    };
    assert_eq!(
        stats().await.expect_err("no right yet").code(),
        Code::PermissionDenied
    );

    // The same token, now with the write right.
    let granted = plain_line.clone() + " admin=write";
    tokens.write(&[&service_line, &granted]);
    server.signal("HUP");
    eventually(Duration::from_secs(10), "the right was granted", || async {
        stats().await.is_ok()
    })
    .await;
    admin
        .clone()
        .force_release(pb::ForceReleaseRequest {
            namespace: NAMESPACE.into(),
            key: "held".into(),
            reason: "granted".into(),
        })
        .await
        .expect("a write right writes");
    assert!(!still_held(&client, NAMESPACE, "held", token).await);

    // And withdrawn.
    tokens.write(&[&service_line, &plain_line]);
    server.signal("HUP");
    eventually(
        Duration::from_secs(10),
        "the right was withdrawn",
        || async {
            stats()
                .await
                .is_err_and(|status| status.code() == Code::PermissionDenied)
        },
    )
    .await;
}

/// Without a tokens file, the admin API answers loopback callers only: a caller reaching the
/// same server through a non-loopback address of this machine is refused, while the
/// contract's API answers it.
async fn without_tokens_the_admin_api_answers_loopback_only(backend: Backend) {
    let app = TestApp::spawn_with(
        backend,
        &["--listen", "0.0.0.0:0", "--allow-unauthenticated"],
    )
    .await;
    let outward = non_loopback_address();
    let remote = format!("http://{outward}:{}", app.addr.port());
    let admin = authed_admin(remote.clone(), Bearer::none()).await;
    assert_all_denied(
        every_admin_rpc(&admin, NAMESPACE, "k").await,
        "PERMISSION_DENIED",
        "without a tokens file the admin API answers callers on the loopback interface only",
    );
    let mut client = authed_client(remote, Bearer::none()).await;
    held_key(&mut client, NAMESPACE, "k").await;

    let local = authed_admin(
        format!("http://127.0.0.1:{}", app.addr.port()),
        Bearer::none(),
    )
    .await;
    for (rpc, outcome) in every_admin_rpc(&local, NAMESPACE, "k").await {
        outcome.unwrap_or_else(|status| panic!("{rpc} from loopback: {status:?}"));
    }
}

/// An address of this machine that is not loopback: the one its route to the outside starts
/// from (a UDP socket's connect sends nothing).
fn non_loopback_address() -> std::net::IpAddr {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").expect("a UDP socket");
    socket
        .connect("192.0.2.1:9")
        .or_else(|_| socket.connect("10.255.255.255:9"))
        .expect("this machine has a route off loopback (the test needs a second address)");
    let address = socket.local_addr().expect("the local address").ip();
    assert!(!address.is_loopback(), "{address} is loopback");
    address
}

for_each_backend!(
    a_service_token_may_make_no_admin_call,
    a_read_right_reads_and_changes_nothing,
    no_admin_call_reaches_beyond_the_tokens_scopes,
    sighup_reloads_admin_rights,
    without_tokens_the_admin_api_answers_loopback_only,
);
