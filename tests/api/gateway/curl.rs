//! End to end with curl, as a user's first session goes: a first call, its replay, a 409 while
//! another request with the key runs, and a 422 for a key reused on another body.

use std::process::Output;

use crate::support::{Backend, TestApp};

use super::{TestGateway, Upstream, key};

/// `curl -s -i` with the key and `body`; answers the status line, headers and body as text.
async fn curl(url: &str, key: &str, body: &str) -> String {
    let Output {
        status,
        stdout,
        stderr,
    } = tokio::process::Command::new("curl")
        .args(["-s", "-i", "-X", "POST", url])
        .args(["-H", &format!("Idempotency-Key: \"{key}\"")])
        .args(["-H", "Content-Type: application/json", "--data", body])
        .output()
        .await
        .expect("curl runs (scripts/services installs it)");
    assert!(
        status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&stderr)
    );
    String::from_utf8(stdout).expect("UTF-8")
}

fn status_of(answer: &str) -> &str {
    answer
        .lines()
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .unwrap_or_default()
}

#[tokio::test]
async fn curl_sees_first_call_replay_conflict_and_mismatch() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), &["--wait", "0s"]).await;
    let url = format!("{}/orders", gateway.url());
    let key = key("curl");

    let first = curl(&url, &key, r#"{"item":"book"}"#).await;
    assert_eq!(status_of(&first), "201", "{first}");
    assert!(first.ends_with(r#"{"order":1}"#), "{first}");
    assert!(
        !first.to_lowercase().contains("idempotent-replayed"),
        "{first}"
    );

    let replay = curl(&url, &key, r#"{"item":"book"}"#).await;
    assert_eq!(status_of(&replay), "201", "{replay}");
    assert!(
        replay.to_lowercase().contains("idempotent-replayed: true"),
        "{replay}"
    );
    assert!(replay.ends_with(r#"{"order":1}"#), "{replay}");

    let mismatch = curl(&url, &key, r#"{"item":"pen"}"#).await;
    assert_eq!(status_of(&mismatch), "422", "{mismatch}");
    assert!(mismatch.contains("application/problem+json"), "{mismatch}");
    assert!(
        mismatch.contains("urn:idempotency-gateway:problem:key-reused"),
        "{mismatch}"
    );

    let busy = super::key("curl-busy");
    upstream.hold();
    let running = {
        let (url, busy) = (url.clone(), busy.clone());
        tokio::spawn(async move { curl(&url, &busy, "{}").await })
    };
    upstream.wait_for_in_flight(1).await;
    let conflict = curl(&url, &busy, "{}").await;
    assert_eq!(status_of(&conflict), "409", "{conflict}");
    assert!(
        conflict.to_lowercase().contains("retry-after: "),
        "{conflict}"
    );
    assert!(
        conflict.contains("urn:idempotency-gateway:problem:in-progress"),
        "{conflict}"
    );
    upstream.open();
    assert_eq!(status_of(&running.await.expect("ran")), "201");
    assert_eq!(upstream.executions(), 2);
}
