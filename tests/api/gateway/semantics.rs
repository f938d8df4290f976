//! The draft's semantics, one case at a time: replay byte for byte, 422 on a reused key, the
//! key header's syntax and bounds, what the upstream receives, final and non-final statuses,
//! responses too large to store, and identity scoping.

use crate::support::{Backend, TestApp, for_each_backend};

use super::{Http, TestGateway, Upstream, key};

for_each_backend!(
    a_completed_key_is_replayed_byte_for_byte_without_the_upstream,
    same_key_different_request_is_422,
    key_header_syntax_and_bounds,
    missing_keys_are_refused_only_where_required,
    bodies_over_the_limit_are_413,
    the_upstream_gets_the_key_and_the_fencing_token,
    final_4xx_are_stored_and_retryable_ones_released,
    a_response_too_large_to_store_runs_once_and_says_so,
    identities_scope_keys,
);

async fn setup(backend: Backend, flags: &[&str]) -> (TestApp, Upstream, TestGateway, Http) {
    let app = TestApp::spawn(backend).await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), flags).await;
    (app, upstream, gateway, Http::new())
}

async fn a_completed_key_is_replayed_byte_for_byte_without_the_upstream(backend: Backend) {
    let (_app, upstream, gateway, http) = setup(backend, &[]).await;
    let url = format!("{}/orders?source=web", gateway.url());
    let key = key("replay");
    let first = http.post(&url, &key, r#"{"item":"book"}"#).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    let again = http.post(&url, &key, r#"{"item":"book"}"#).await;
    assert_eq!(
        upstream.executions(),
        1,
        "the replay did not reach the upstream"
    );
    assert!(again.replayed());
    assert_eq!(again.status, first.status);
    assert_eq!(again.body, first.body);
    for name in ["content-type", "x-execution", "date", "content-length"] {
        assert_eq!(again.header(name), first.header(name), "{name}");
    }
    let cookies: Vec<_> = again.headers.get_all("set-cookie").iter().collect();
    assert_eq!(
        cookies,
        ["a=1", "b=2"],
        "repeated headers are replayed in order"
    );
    // A bare (unquoted) key is the same key.
    let bare = http
        .send(
            "POST",
            &url,
            &[
                ("idempotency-key", &key),
                ("content-type", "application/json"),
            ],
            r#"{"item":"book"}"#,
        )
        .await;
    assert!(bare.replayed());
    assert_eq!(upstream.executions(), 1);
    // Unguarded methods pass through, key or not.
    let (get, get_again) = http
        .send_twice("GET", &url, &[("idempotency-key", "\"g\"")], "")
        .await;
    assert!(!get.replayed() && !get_again.replayed());
    assert_eq!(upstream.executions(), 3);
}

async fn same_key_different_request_is_422(backend: Backend) {
    let (_app, upstream, gateway, http) = setup(backend, &[]).await;
    let url = format!("{}/orders", gateway.url());
    let key = key("mismatch");
    assert_eq!(
        http.post(&url, &key, r#"{"item":"book"}"#).await.status,
        201
    );
    http.post(&url, &key, r#"{"item":"pen"}"#)
        .await
        .assert_problem(422, "key-reused");
    // Another path, method or content type is another request too.
    http.post(&format!("{url}/2"), &key, r#"{"item":"book"}"#)
        .await
        .assert_problem(422, "key-reused");
    let quoted = format!("\"{key}\"");
    for (method, content_type) in [("PATCH", "application/json"), ("POST", "text/plain")] {
        let headers = [
            ("idempotency-key", quoted.as_str()),
            ("content-type", content_type),
        ];
        http.send(method, &url, &headers, r#"{"item":"book"}"#)
            .await
            .assert_problem(422, "key-reused");
    }
    assert_eq!(upstream.executions(), 1);
}

async fn key_header_syntax_and_bounds(backend: Backend) {
    let (app, upstream, gateway, http) = setup(backend, &["--max-key-length", "16"]).await;
    let url = format!("{}/orders", gateway.url());
    let two = http
        .send(
            "POST",
            &url,
            &[("idempotency-key", "\"a\""), ("idempotency-key", "\"b\"")],
            "{}",
        )
        .await;
    two.assert_problem(400, "key-repeated");
    for bad in [
        "\"\"",
        "\"unterminated",
        "a b",
        "\"a\", \"b\"",
        "\"0123456789abcdefg\"",
    ] {
        http.send("POST", &url, &[("idempotency-key", bad)], "{}")
            .await
            .assert_problem(400, "key-malformed");
    }
    assert_eq!(
        upstream.executions(),
        0,
        "refused requests never reach the upstream"
    );
    assert_eq!(app.total_rows().await, 0, "and write nothing");
    let longest = http
        .send(
            "POST",
            &url,
            &[("idempotency-key", "\"0123456789abcdef\"")],
            "{}",
        )
        .await;
    assert_eq!(longest.status, 201, "{longest:?}");
    // The header name is a setting.
    let custom =
        TestGateway::start(&upstream, &app.endpoint(), &["--header", "X-Request-Key"]).await;
    let url = format!("{}/orders", custom.url());
    let (first, second) = http
        .send_twice("POST", &url, &[("x-request-key", "\"c\"")], "{}")
        .await;
    assert!(!first.replayed() && second.replayed());
}

async fn missing_keys_are_refused_only_where_required(backend: Backend) {
    let (_app, upstream, gateway, http) =
        setup(backend, &["--require-key", "/orders,/payments"]).await;
    for path in ["/orders", "/orders/7/items", "/payments"] {
        let url = format!("{}{path}", gateway.url());
        http.send("POST", &url, &[], "{}")
            .await
            .assert_problem(400, "key-missing");
    }
    assert_eq!(upstream.executions(), 0);
    let elsewhere = http
        .send("POST", &format!("{}/search", gateway.url()), &[], "{}")
        .await;
    assert_eq!(elsewhere.status, 201, "no key needed outside the prefixes");
    let get = http
        .send("GET", &format!("{}/orders", gateway.url()), &[], "")
        .await;
    assert_eq!(get.status, 201, "unguarded methods need no key");
    assert_eq!(upstream.executions(), 2);
}

async fn bodies_over_the_limit_are_413(backend: Backend) {
    let (app, upstream, gateway, http) = setup(backend, &["--max-request-bytes", "1024"]).await;
    let url = format!("{}/orders", gateway.url());
    let at_limit = "x".repeat(1024);
    assert_eq!(http.post(&url, &key("fits"), &at_limit).await.status, 201);
    let over = "x".repeat(1025);
    http.post(&url, &key("over"), &over)
        .await
        .assert_problem(413, "request-too-large");
    assert_eq!(upstream.executions(), 1);
    assert_eq!(app.count_rows("idempotency_keys").await, 1);
}

async fn the_upstream_gets_the_key_and_the_fencing_token(backend: Backend) {
    let (_app, upstream, gateway, http) = setup(backend, &[]).await;
    let url = format!("{}/orders?x=1", gateway.url());
    let quoted = format!("\"{}\"", key("token"));
    let answer = http
        .send(
            "POST",
            &url,
            &[
                ("idempotency-key", &quoted),
                ("content-type", "application/json"),
                // A client cannot pass its own fencing token.
                ("idempotency-lease-token", "999999"),
                ("connection", "keep-alive, x-hop"),
                ("x-hop", "dropped"),
            ],
            "{\"a\":1}",
        )
        .await;
    assert_eq!(answer.status, 201);
    let seen = upstream.seen();
    let request = seen.first().expect("the upstream saw the request");
    assert_eq!(request.method, "POST");
    assert_eq!(request.path, "/orders?x=1");
    assert_eq!(&request.body[..], b"{\"a\":1}");
    assert_eq!(request.header("idempotency-key"), Some(quoted.as_str()));
    assert_ne!(request.lease_token(), 999_999);
    assert!(request.lease_token() > 0);
    assert_eq!(
        request
            .headers
            .get_all("idempotency-lease-token")
            .iter()
            .count(),
        1
    );
    assert!(
        request.header("x-hop").is_none(),
        "hop-by-hop headers are removed"
    );
    // Passed-through requests get no token, and lose the client's.
    http.send("GET", &url, &[("idempotency-lease-token", "5")], "")
        .await;
    let seen = upstream.seen();
    assert!(
        seen.last()
            .expect("seen")
            .header("idempotency-lease-token")
            .is_none()
    );
}

async fn final_4xx_are_stored_and_retryable_ones_released(backend: Backend) {
    let (_app, upstream, gateway, http) = setup(backend, &[]).await;
    let url = format!("{}/orders", gateway.url());
    upstream.script(&[(404, "{\"error\":\"no such product\"}")]);
    let key_404 = key("404");
    assert_eq!(http.post(&url, &key_404, "{}").await.status, 404);
    let again = http.post(&url, &key_404, "{}").await;
    assert_eq!(again.status, 404);
    assert!(again.replayed(), "a 404 is final: stored and replayed");
    assert_eq!(upstream.executions(), 1);
    for status in [408, 409, 425, 429, 503] {
        upstream.script(&[(status, "{\"error\":\"later\"}")]);
        let key = key("retryable");
        let first = http.post(&url, &key, "{}").await;
        assert_eq!(first.status.as_u16(), status);
        assert!(!first.replayed());
        let before = upstream.executions();
        let retry = http.post(&url, &key, "{}").await;
        assert_eq!(retry.status, 201, "{status} was released: the retry ran");
        assert_eq!(upstream.executions(), before + 1);
    }
}

async fn a_response_too_large_to_store_runs_once_and_says_so(backend: Backend) {
    let (_app, upstream, gateway, http) =
        setup(backend, &["--max-stored-response-bytes", "4096"]).await;
    let url = format!("{}/orders", gateway.url());
    let key = key("large");
    upstream.script_large(10_000);
    let first = http.post(&url, &key, "{}").await;
    assert_eq!(first.status, 200);
    assert_eq!(
        first.body.len(),
        10_000,
        "the first caller gets the whole response"
    );
    assert_eq!(first.header("idempotency-warning"), Some("not-replayable"));
    let retry = http.post(&url, &key, "{}").await;
    retry.assert_problem(500, "response-not-replayable");
    assert!(retry.replayed());
    let problem: serde_json::Value = serde_json::from_slice(&retry.body).expect("JSON");
    assert_eq!(problem["original_status"], 200);
    assert_eq!(upstream.executions(), 1, "never run twice");
}

async fn identities_scope_keys(backend: Backend) {
    let (app, upstream, gateway, http) = setup(backend, &["--identity-header", "X-Api-Key"]).await;
    let url = format!("{}/orders", gateway.url());
    let quoted = format!("\"{}\"", key("shared"));
    let call = |identity: &'static str| {
        let (http, url, quoted) = (http.clone(), url.clone(), quoted.clone());
        async move {
            http.send(
                "POST",
                &url,
                &[("idempotency-key", &quoted), ("x-api-key", identity)],
                "{}",
            )
            .await
        }
    };
    let alice = call("alice-secret").await;
    let bob = call("bob-secret").await;
    assert!(
        !alice.replayed() && !bob.replayed(),
        "two callers, two records"
    );
    assert_ne!(alice.body, bob.body);
    assert_eq!(upstream.executions(), 2);
    let alice_again = call("alice-secret").await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(app.count_rows("idempotency_keys").await, 2);
    let keys = app.database.completed_keys(super::ORDERS).await;
    assert!(
        keys.iter()
            .all(|k| !k.contains("alice") && !k.contains("bob")),
        "identities are not stored in clear: {keys:?}"
    );
    http.send("POST", &url, &[("idempotency-key", &quoted)], "{}")
        .await
        .assert_problem(400, "identity-missing");
}
