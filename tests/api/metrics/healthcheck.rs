//! `healthcheck`, the real binary: 0 when SERVING, 1 when not serving, nothing listening, or
//! no answer within its timeout.

use super::*;

async fn healthcheck(addr: &str, timeout: &str) -> std::process::Output {
    coordinator(&["healthcheck", "--addr", addr, "--timeout", timeout]).await
}

#[tokio::test]
async fn healthcheck_exits_zero_only_when_the_service_is_serving() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::start(&database.url, &[]).await;
    server.wait_until_serving().await.expect("serving");
    let endpoint = server.endpoint();
    let address = endpoint.trim_start_matches("http://");
    let serving = healthcheck(address, "5s").await;
    assert!(serving.status.success(), "{serving:?}");

    // A fresh database with migrations off stays NOT_SERVING.
    let unmigrated = TestDatabase::create(Backend::Postgres).await;
    let not_serving = ServerProcess::start(&unmigrated.url, &["--no-migrate"]).await;
    let endpoint = not_serving.endpoint();
    let output = healthcheck(endpoint.trim_start_matches("http://"), "5s").await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("NOT_SERVING"),
        "{output:?}"
    );
}

#[tokio::test]
async fn healthcheck_fails_when_nothing_listens_or_nothing_answers_in_time() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = closed.local_addr().expect("address").to_string();
    drop(closed);
    let output = healthcheck(&address, "5s").await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");

    // A listener that accepts and never answers: the timeout ends the check.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = silent.local_addr().expect("address").to_string();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let began = std::time::Instant::now();
    let output = healthcheck(&address, "500ms").await;
    let took = began.elapsed();
    holding.abort();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("no answer within"),
        "{output:?}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[tokio::test]
async fn the_healthcheck_timeout_is_bounded() {
    for (timeout, accepted) in [
        ("99ms", false),
        ("100ms", true),
        ("60s", true),
        ("61s", false),
    ] {
        // Port 1: nothing listens, so an accepted timeout ends in 1 (unhealthy), a refused in 2.
        let output = healthcheck("127.0.0.1:1", timeout).await;
        let wanted = if accepted { 1 } else { 2 };
        assert_eq!(
            output.status.code(),
            Some(wanted),
            "--timeout {timeout}: {output:?}"
        );
    }
}
