//! The guards of `admin keys erase`, through the real binary: `--all` asks for the namespace
//! to be typed again on a terminal (a pseudo-terminal, `script`) and erases nothing when it is
//! mistyped, needs `--yes` without a terminal (exit 2, before anything is erased), `--dry-run`
//! says what would go and erases nothing, and a namespace that holds nothing is said to hold
//! nothing, and left without an audit event.

use idempotency_coordinator::proto::idempotency::v1 as pb;

use super::cli::{Run, admin, erase_all, words};
use super::*;

async fn stats(app: &TestApp, namespace: &str) -> pb::NamespaceStatsResponse {
    answered(
        admin_client(app)
            .await
            .namespace_stats(pb::NamespaceStatsRequest {
                namespace: namespace.into(),
            })
            .await,
        "NamespaceStats",
    )
}

/// `admin … args` on a pseudo-terminal, `typed` its input.
async fn on_a_terminal(app: &TestApp, args: &[&str], typed: &str) -> Run {
    let command = [
        env!("CARGO_BIN_EXE_idempotency-coordinator"),
        "admin",
        "--coordinator",
        &app.endpoint(),
    ]
    .iter()
    .chain(args)
    .map(|word| format!("'{}'", word.replace('\'', "'\\''")))
    .collect::<Vec<_>>()
    .join(" ");
    let output = tokio::process::Command::new("bash")
        .args([
            "-c",
            "printf '%s\\n' \"$TYPED\" | script -qec \"$COMMAND\" /dev/null",
        ])
        .env("TYPED", typed)
        .env("COMMAND", command)
        .env("SHELL", "/bin/bash")
        .output()
        .await
        .expect("bash");
    Run {
        status: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).replace('\r', ""),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

async fn erasing_a_namespace_is_guarded(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let (started, _) = claim_and_complete(&mut client, "k1", b"r").await;
    claim_and_complete(&mut client, "k2", b"r").await;
    let erase_tests = erase_all(NAMESPACE, "r");

    // No terminal, no --yes: refused as a flag problem, nothing erased.
    let refused = admin(&app, &erase_tests).await;
    assert_eq!(refused.status, Some(2), "{}", refused.stderr);
    assert_eq!(
        refused.stderr.trim_end(),
        "error: --all erases namespace tests (2 keys, 0 processed events) for good: on a \
         terminal it asks for the namespace to be typed again; without one, add --yes"
    );
    assert_eq!(stats(&app, NAMESPACE).await.completed_keys, 2);

    // On a terminal, a mistyped namespace erases nothing.
    let mistyped = on_a_terminal(&app, &erase_tests, "test").await;
    assert_eq!(mistyped.status, Some(1), "{}", mistyped.stdout);
    assert!(
        mistyped.stdout.contains(
            "This erases namespace tests for good: 2 keys, 0 processed events.\n\
             Type the namespace to erase it: "
        ) && mistyped
            .stdout
            .contains("error: \"test\" is not \"tests\": nothing erased"),
        "{}",
        mistyped.stdout
    );
    assert_eq!(stats(&app, NAMESPACE).await.completed_keys, 2);
    assert!(audit_events(&admin_client(&app).await).await.is_empty());

    // Dry runs, of a key, an absent key and the namespace: nothing erased.
    let key = admin(
        &app,
        &words("keys erase --namespace tests --key k1 --dry-run"),
    )
    .await;
    assert_eq!(key.status, Some(0), "{}", key.stderr);
    assert_eq!(
        key.stdout.trim_end(),
        format!(
            "would erase k1 of tests (completed, attempt 1, token {}); nothing erased",
            started.lease_token
        )
    );
    let absent = admin(
        &app,
        &words("keys erase --namespace tests --key nope --dry-run"),
    )
    .await;
    assert_eq!(
        absent.stdout.trim_end(),
        "nope is absent from tests: nothing to erase; nothing erased"
    );
    let all = admin(
        &app,
        &words("keys erase --namespace tests --all --dry-run --output json"),
    )
    .await
    .json();
    assert_eq!(all["dry_run"], true);
    assert_eq!(all["keys"], 2, "{all}");
    assert_eq!(all["erased"], false);
    assert_eq!(stats(&app, NAMESPACE).await.completed_keys, 2);
    assert!(audit_events(&admin_client(&app).await).await.is_empty());

    // Typed right, it erases.
    let erased = on_a_terminal(&app, &erase_tests, NAMESPACE).await;
    assert_eq!(erased.status, Some(0), "{}", erased.stdout);
    assert!(
        erased
            .stdout
            .contains("erased namespace tests: 2 keys, 0 processed events; audit event"),
        "{}",
        erased.stdout
    );
    assert_eq!(stats(&app, NAMESPACE).await.completed_keys, 0);

    // A namespace that holds nothing: said so, nothing recorded, even with --yes.
    let empty = admin(&app, &[&erase_all("tets", "r")[..], &["--yes"]].concat()).await;
    assert_eq!(empty.status, Some(0), "{}", empty.stderr);
    assert_eq!(
        empty.stdout.trim_end(),
        "namespace tets holds no keys and no processed events: nothing erased (is the name \
         right?)"
    );
    let trail = answered(
        admin_client(&app)
            .await
            .list_audit_events(audit_of("tets"))
            .await,
        "ListAuditEvents",
    );
    assert!(trail.events.is_empty(), "{trail:?}");
}

for_each_backend!(erasing_a_namespace_is_guarded,);
