//! The audit trail filtered by key and by operator, through the real CLI (`audit --key`,
//! `--actor`) and the API (`ListAuditEventsRequest.key`, `.actor`): two operators release and
//! erase keys of one namespace, and each filter lists exactly its events, newest first, across
//! pages; bad filters are refused with their field (API) or before any call (CLI, exit 2).

use idempotency_coordinator::auth::AdminRight;
use serde_json::Value;

use super::cli::admin_with;
use super::*;
use crate::support::security::*;

/// `(actor, action, key)` of each event of an `audit --output json` answer.
fn events_of(trail: &Value) -> Vec<(String, String, String)> {
    trail["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            let text = |field: &str| e[field].as_str().unwrap_or_default().to_owned();
            (text("actor"), text("action"), text("key"))
        })
        .collect()
}

async fn the_audit_trail_is_filtered_by_key_and_by_operator(backend: Backend) {
    let (service, service_line) = token("orders", "*");
    let (oncall, oncall_line) = admin_token("oncall", "*", AdminRight::Write);
    let (night, night_line) = admin_token("night", "*", AdminRight::Write);
    let tokens = TokensFile::new(&[&service_line, &oncall_line, &night_line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let mut client = authed_client(app.endpoint(), Bearer::token(&service)).await;
    for key in ["a", "b"] {
        client
            .try_start(try_start(key).with_lease(secs(600)))
            .await
            .expect("claimed");
    }
    // oncall releases a, then b; night erases a.
    let as_oncall = authed_admin(app.endpoint(), Bearer::token(&oncall)).await;
    for key in ["a", "b"] {
        as_oncall
            .clone()
            .force_release(force_release(key, "hung"))
            .await
            .expect("released");
    }
    authed_admin(app.endpoint(), Bearer::token(&night))
        .await
        .erase_key(erase_key("a", "DPA-1"))
        .await
        .expect("erased");

    let folder = tempfile::tempdir().expect("a folder for the token");
    let token_file = folder.path().join("token");
    std::fs::write(&token_file, &oncall).expect("write the token");
    let token_file = token_file.display().to_string();
    let audit = |filters: &[&str]| {
        let mut args = vec!["audit", "--namespace", NAMESPACE, "--output", "json"];
        args.extend_from_slice(filters);
        let endpoint = app.endpoint();
        let token_file = token_file.clone();
        let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            admin_with(&endpoint, &["--token-file", &token_file], &args).await
        }
    };
    let triple = |actor: &str, action: &str, key: &str| {
        (actor.to_owned(), action.to_owned(), key.to_owned())
    };
    let a_by_night = triple("token:night", "erase_key", "a");
    let a_by_oncall = triple("token:oncall", "force_release", "a");
    let b_by_oncall = triple("token:oncall", "force_release", "b");
    for (filters, expected) in [
        (&["--key", "a"][..], vec![a_by_night, a_by_oncall.clone()]),
        (
            &["--actor", "token:oncall"],
            vec![b_by_oncall.clone(), a_by_oncall.clone()],
        ),
        (
            &["--actor", "token:oncall", "--key", "a"],
            vec![a_by_oncall.clone()],
        ),
        // An operator with no events has none.
        (&["--actor", "token:nobody"], vec![]),
    ] {
        let trail = audit(filters).await.json();
        assert_eq!(events_of(&trail), expected, "{filters:?}");
    }
    // Pages keep the filter: one event a page, then the next.
    let first = audit(&["--actor", "token:oncall", "--limit", "1"])
        .await
        .json();
    assert_eq!(events_of(&first), [b_by_oncall]);
    let next = first["next_page_token"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let second = audit(&[
        "--actor",
        "token:oncall",
        "--limit",
        "1",
        "--page-token",
        &next,
    ])
    .await
    .json();
    assert_eq!(events_of(&second), [a_by_oncall]);
    assert_eq!(second["next_page_token"], "");

    // Bad filters: an empty one before any call (exit 2), a key or an actor out of bounds by
    // the API (its field named).
    for (flag, said) in [
        (
            "--key",
            "error: a value is required for '--key <KEY>' but none was supplied",
        ),
        (
            "--actor",
            "error: a value is required for '--actor <ACTOR>' but none was supplied",
        ),
    ] {
        let run = audit(&[flag, ""]).await;
        assert_eq!(run.status, Some(2), "{flag}: {}", run.stderr);
        assert!(run.stderr.starts_with(said), "{flag}: {}", run.stderr);
    }
    let long_key = "k".repeat(256);
    let run = audit(&["--key", &long_key]).await;
    assert_eq!(run.status, Some(1), "{}", run.stderr);
    assert!(
        run.stderr
            .starts_with("error: Client specified an invalid argument")
            && run.stderr.contains("key"),
        "{}",
        run.stderr
    );
    let too_long = as_oncall
        .clone()
        .list_audit_events(pb::ListAuditEventsRequest {
            namespace: NAMESPACE.into(),
            actor: "x".repeat(1025),
            key: "\u{7}".into(),
            ..Default::default()
        })
        .await;
    assert_bad_fields(too_long, &["key", "actor"]);
}

for_each_backend!(the_audit_trail_is_filtered_by_key_and_by_operator,);
