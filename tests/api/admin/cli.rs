//! The CLI in the same binary (`idempotency-coordinator admin …`), run as a real process against
//! the server: an operator finds the stuck keys of a namespace, reads one key's story, releases
//! it with a reason and sees that in the audit trail, and erases a namespace while traffic on
//! another keeps flowing; tables for people, `--output json` for scripts, exit statuses.

use idempotency_coordinator::auth::AdminRight;
use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client as pb_client;
use serde_json::Value;

use super::*;
use crate::support::security::*;

/// The binary's answer: exit status, standard output, standard error.
pub(super) struct Run {
    pub(super) status: Option<i32>,
    pub(super) stdout: String,
    pub(super) stderr: String,
}

impl Run {
    /// Asserts that the run exited with `status` and said `said` on standard error.
    pub(super) fn assert_refused(&self, status: i32, said: &str) {
        assert_eq!(self.status, Some(status), "{}", self.stderr);
        assert!(self.stderr.contains(said), "{}", self.stderr);
    }

    /// Asserts that the run printed each of `texts` on standard output.
    pub(super) fn assert_printed(&self, texts: &[&str]) {
        for text in texts {
            assert!(self.stdout.contains(text), "{text:?} in {}", self.stdout);
        }
    }

    pub(super) fn json(&self) -> Value {
        assert_eq!(self.status, Some(0), "failed: {}", self.stderr);
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {}", self.stdout))
    }
}

pub(super) async fn admin(app: &TestApp, args: &[&str]) -> Run {
    admin_with(&app.endpoint(), &[], args).await
}

/// The binary's answer to `args` with `--output json`, which must succeed.
pub(super) async fn admin_json(app: &TestApp, args: &[&str]) -> Value {
    let args: Vec<&str> = args.iter().copied().chain(["--output", "json"]).collect();
    admin(app, &args).await.json()
}

/// `keys release` of `key` in the namespace, for `reason`.
pub(super) fn release<'a>(key: &'a str, reason: &'a str) -> [&'a str; 8] {
    [
        "keys",
        "release",
        "--namespace",
        NAMESPACE,
        "--key",
        key,
        "--reason",
        reason,
    ]
}

/// A command line's words, as an operator types them (no word holds a space).
pub(super) fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// `keys erase --all` of `namespace`, for `reason`: the erasure the CLI guards.
pub(super) fn erase_all<'a>(namespace: &'a str, reason: &'a str) -> Vec<&'a str> {
    vec![
        "keys",
        "erase",
        "--namespace",
        namespace,
        "--all",
        "--reason",
        reason,
    ]
}

/// `keys list` in the namespace, filtered by `flag` `value`.
pub(super) fn list_with<'a>(flag: &'a str, value: &'a str) -> Vec<&'a str> {
    vec!["keys", "list", "--namespace", NAMESPACE, flag, value]
}

pub(super) async fn admin_with(endpoint: &str, connection: &[&str], args: &[&str]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .arg("admin")
        .args(["--coordinator", endpoint])
        .args(connection)
        .args(args)
        .env_remove("IDEMPOTENCY_ADMIN_TOKEN_FILE")
        .env_remove("IDEMPOTENCY_ADMIN_COORDINATOR")
        .output()
        .await
        .expect("run the binary");
    Run {
        status: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

async fn an_operator_finds_reads_releases_and_erases_from_the_cli_alone(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let crashed = claim_and_let_lapse(&app, &mut client, try_start("payment-17")).await;
    claim_and_complete(&mut client, "payment-18", b"{\"paid\":true}").await;

    // Find the stuck keys.
    let stuck = admin_json(
        &app,
        &["keys", "list", "--namespace", NAMESPACE, "--state", "stuck"],
    )
    .await;
    let keys = stuck["keys"].as_array().expect("keys");
    assert_eq!(keys.len(), 1, "{stuck}");
    assert_eq!(keys[0]["key"], "payment-17");
    assert_eq!(keys[0]["state"], "stuck");
    assert_eq!(keys[0]["lease_token"], crashed.lease_token);
    let table = admin(&app, &["keys", "list", "--namespace", NAMESPACE]).await;
    assert_eq!(table.status, Some(0), "{}", table.stderr);
    assert!(table.stdout.starts_with("KEY"), "{}", table.stdout);
    assert!(table.stdout.contains("payment-17") && table.stdout.contains("stuck"));
    table.assert_printed(&["2 keys"]);
    assert!(
        table.stdout.contains("CLAIMED") && table.stdout.contains("HOLDER"),
        "{}",
        table.stdout
    );
    // The table fits 100 columns; --wide has every column, each time to the millisecond.
    assert!(
        table.stdout.lines().all(|line| line.chars().count() <= 100),
        "{}",
        table.stdout
    );
    assert!(!table.stdout.contains("TOKEN"), "{}", table.stdout);
    let lease_end = keys[0]["lease_expires_at"].as_str().expect("a lease end");
    let to_the_second = format!("{}Z", &lease_end[..19]);
    table.assert_printed(&[&to_the_second]);
    let wide = admin(&app, &["keys", "list", "--namespace", NAMESPACE, "--wide"]).await;
    assert_eq!(wide.status, Some(0), "{}", wide.stderr);
    let header = wide.stdout.lines().next().unwrap_or_default();
    for column in [
        "TOKEN",
        "LEASE EXPIRES",
        "COMPLETED",
        "EXPIRES",
        "RESPONSE BYTES",
        "RELEASED BY",
    ] {
        assert!(header.contains(column), "{column}: {header}");
    }
    wide.assert_printed(&[lease_end]);
    // Keys held since before a moment: the stuck one, not the completed one.
    let an_hour_ahead = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let held = admin_json(
        &app,
        &[
            "keys",
            "list",
            "--namespace",
            NAMESPACE,
            "--claimed-before",
            &an_hour_ahead,
        ],
    )
    .await;
    let held = held["keys"].as_array().expect("keys");
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0]["key"], "payment-17");
    assert!(held[0]["claimed_at"].is_string(), "{held:?}");
    // Callers without tokens or certificates hold keys as nobody.
    assert_eq!(held[0]["holder"], "");

    // Read one key's story.
    let show = [
        "keys",
        "show",
        "--namespace",
        NAMESPACE,
        "--key",
        "payment-18",
    ];
    let story = admin_json(&app, &show).await;
    assert_eq!(story["state"], "completed");
    assert_eq!(story["response_hex"], hex::encode(b"{\"paid\":true}"));
    let shown = admin(&app, &show).await;
    shown.assert_printed(&["{\"paid\":true}"]);

    // Release it with a reason, and see that in the audit trail.
    let released = admin(&app, &release("payment-17", "worker pod crashed (INC-42)")).await;
    assert_eq!(released.status, Some(0), "{}", released.stderr);
    assert!(
        released.stdout.starts_with("released payment-17"),
        "{}",
        released.stdout
    );
    let next = claim(&mut client, try_start("payment-17")).await;
    assert!(next.lease_token > crashed.lease_token);
    let trail = admin_json(&app, &["audit", "--namespace", NAMESPACE]).await;
    let event = &trail["events"][0];
    assert_eq!(event["action"], "force_release");
    assert_eq!(event["key"], "payment-17");
    assert_eq!(event["reason"], "worker pod crashed (INC-42)");
    assert_eq!(event["actor"], "loopback");
    assert_eq!(event["record_before"]["lease_token"], crashed.lease_token);
    // The record before writes times and durations as the listings do (RFC 3339 with `Z`,
    // whole seconds), not `+00:00` and `86400.0`.
    for field in [
        "lease_expires_at",
        "expires_at",
        "claimed_at",
        "retention_seconds",
    ] {
        assert_eq!(
            event["record_before"][field], held[0][field],
            "{field}: {event} / {}",
            held[0]
        );
    }
    assert!(
        event["record_before"]["retention_seconds"].is_u64(),
        "{event}"
    );
    assert!(
        event["at"].as_str().is_some_and(|at| at.ends_with('Z')),
        "{event}"
    );

    // A completed key cannot be released: exit 1 with the refusal.
    let refused = admin(&app, &release("payment-18", "x")).await;
    refused.assert_refused(1, "completed");
}

async fn a_namespace_is_erased_from_the_cli_while_traffic_keeps_flowing(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    for index in 0..300 {
        claim_and_complete(&mut client, &format!("tenant-key-{index}"), b"r").await;
    }
    // Callers of another namespace keep calling through the erasure.
    let traffic = Traffic::start(&client, 4);
    let erase = [
        &erase_all(NAMESPACE, "tenant left")[..],
        &words("--batch-size 50 --yes"),
    ]
    .concat();
    let erased = admin(&app, &erase).await;
    let (answered_calls, failed_calls) = traffic.stop().await;
    assert_eq!(erased.status, Some(0), "{}", erased.stderr);
    // The summary.
    erased.assert_printed(&["300 keys"]);
    // The progress, on standard error (a line per second at most, and the last).
    assert!(
        erased.stderr.contains("erasing tests:"),
        "{}",
        erased.stderr
    );
    assert!(
        erased.stderr.trim_end().ends_with("done"),
        "{}",
        erased.stderr
    );
    assert!(answered_calls > 0);
    assert_eq!(failed_calls, 0, "no call failed");
    let stats = admin_json(&app, &["stats", "--namespace", NAMESPACE]).await;
    assert_eq!(stats["completed_keys"], 0);
}

async fn the_cli_uses_a_token_file_and_refuses_bad_flags(backend: Backend) {
    let (operator, operator_line) = admin_token("oncall", "*", AdminRight::Read);
    let (plain, plain_line) = token("orders", "*");
    let (scoped, scoped_line) = admin_token("team-a", "team-a-*", AdminRight::Write);
    let tokens = TokensFile::new(&[&operator_line, &plain_line, &scoped_line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let folder = tempfile::tempdir().expect("a folder");
    let token_file = |name: &str, token: &str| {
        let path = folder.path().join(name);
        std::fs::write(&path, format!("{token}\n")).expect("write the token");
        path.display().to_string()
    };
    let operator_file = token_file("operator", &operator);
    let plain_file = token_file("plain", &plain);
    let scoped_file = token_file("scoped", &scoped);
    let stats = ["stats", "--namespace", NAMESPACE];

    let allowed = admin_with(&app.endpoint(), &["--token-file", &operator_file], &stats).await;
    assert_eq!(allowed.status, Some(0), "{}", allowed.stderr);
    // Each denial names its cause, with the API's reason.
    let denied = admin_with(&app.endpoint(), &["--token-file", &plain_file], &stats).await;
    denied.assert_refused(1, "[ADMIN_RIGHT_REQUIRED]: this token has no admin right");
    let read_only = admin_with(
        &app.endpoint(),
        &["--token-file", &operator_file],
        &release("k", "r"),
    )
    .await;
    read_only.assert_refused(
        1,
        "[ADMIN_WRITE_REQUIRED]: this token's admin right is read; ForceRelease needs write",
    );
    let elsewhere = admin_with(
        &app.endpoint(),
        &["--token-file", &scoped_file],
        &["stats", "--namespace", "payments"],
    )
    .await;
    elsewhere.assert_refused(
        1,
        "[PERMISSION_DENIED]: this token's scopes do not cover namespace or consumer \"payments\"",
    );
    let anonymous = admin(&app, &stats).await;
    assert_eq!(anonymous.status, Some(1));

    // Bad flags: exit 2, before any call.
    for (connection, args) in [
        (vec!["--coordinator", "localhost"], stats.to_vec()),
        (vec!["--coordinator", "https://127.0.0.1:1"], stats.to_vec()),
        (vec!["--timeout", "1h1s"], stats.to_vec()),
        (
            vec![],
            vec!["keys", "erase", "--namespace", NAMESPACE, "--reason", "r"],
        ),
        (vec![], list_with("--completed-after", "yesterday")),
        (vec![], list_with("--claimed-before", "an hour ago")),
    ] {
        let run = admin_with(&app.endpoint(), &connection, &args).await;
        assert_eq!(
            run.status,
            Some(2),
            "{connection:?} {args:?}: {}",
            run.stderr
        );
    }
    // A documented bound is the CLI's own: exit 2 naming the flag, before any call.
    let too_many = admin_with(
        &app.endpoint(),
        &["--token-file", &operator_file],
        &["keys", "list", "--namespace", NAMESPACE, "--limit", "1001"],
    )
    .await;
    too_many.assert_refused(2, "'--limit <LIMIT>'");
}

/// Under mutual TLS the CLI shows the operator's client certificate (`--client-cert`), and the
/// audit trail names the operator by its subject; a worker's key names the worker's.
async fn the_cli_shows_a_client_certificate_under_mutual_tls(backend: Backend) {
    let mtls = MutualTls::start(backend, "payments-worker").await;
    let mut worker_client = pb_client::IdempotencyServiceClient::new(mtls.channel.clone());
    claim(&mut worker_client, try_start("held").with_lease(secs(600))).await;

    let operator = mtls.clients.client("oncall-laptop");
    let pems = ClientPemFiles::write(mtls.pem_files.path(), &mtls.servers, "operator", &operator);
    let endpoint = format!("https://localhost:{}", mtls.app.addr.port());
    let mtls_flags = pems.flags();
    let listed = admin_with(
        &endpoint,
        &mtls_flags,
        &["keys", "list", "--namespace", NAMESPACE, "--output", "json"],
    )
    .await
    .json();
    assert_eq!(listed["keys"][0]["holder"], "cert:CN=payments-worker");

    let released = admin_with(
        &endpoint,
        &mtls_flags,
        &release("held", "rotating the worker"),
    )
    .await;
    assert_eq!(released.status, Some(0), "{}", released.stderr);
    let audit = admin_with(
        &endpoint,
        &mtls_flags,
        &["audit", "--namespace", NAMESPACE, "--output", "json"],
    )
    .await
    .json();
    assert_eq!(audit["events"][0]["actor"], "cert:CN=oncall-laptop");

    // Without the certificate the server refuses the connection; without TLS the flag is
    // refused before any call.
    let refused = admin_with(
        &endpoint,
        &["--coordinator-ca", pems.ca.as_str()],
        &["stats", "--namespace", NAMESPACE],
    )
    .await;
    assert_eq!(refused.status, Some(1), "{}", refused.stderr);
    let plain = admin_with(
        &format!("http://127.0.0.1:{}", mtls.app.addr.port()),
        &pems.certificate_flags(),
        &["stats", "--namespace", NAMESPACE],
    )
    .await;
    plain.assert_refused(2, "client-cert");
}

for_each_backend!(
    an_operator_finds_reads_releases_and_erases_from_the_cli_alone,
    the_cli_shows_a_client_certificate_under_mutual_tls,
    a_namespace_is_erased_from_the_cli_while_traffic_keeps_flowing,
    the_cli_uses_a_token_file_and_refuses_bad_flags,
);
