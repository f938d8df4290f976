//! The exposition itself: it passes `promtool check metrics`, other paths are not found,
//! metrics are off by default, and the flags are refused when they cannot work.

use super::*;

/// promtool, from `PROMTOOL` or the PATH (`scripts/services` installs Debian's `prometheus`).
fn promtool() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("PROMTOOL") {
        return Some(path.into());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|folder| folder.join("promtool"))
            .find(|candidate| candidate.is_file())
    })
}

async fn the_exposition_passes_promtool(backend: Backend) {
    let promtool = promtool().expect(
        "promtool is not installed: run scripts/services (Debian's prometheus), or set PROMTOOL",
    );
    let (app, mut client) = metered(
        backend,
        &["--metrics-namespace-labels", "--reaper-interval", "100ms"],
    )
    .await;
    claim_and_complete(&mut client, &unique_key("promtool"), b"ok").await;
    mark_results(&client, mark("c", &["x"])).await;
    // Every kind of series is there: the reaper's lag, once it has swept, too.
    series_reaches(&app, "idempotency_reaper_lag_seconds{table=\"keys\"}", 0.0).await;
    let exposition = scrape(&app).await;
    assert!(exposition.contains("idempotency_coalescer_queue_depth{coalescer=\"TryStart\"}"));
    assert!(exposition.contains("namespace=\"tests\""));

    let mut check = tokio::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run promtool");
    let mut stdin = check.stdin.take().expect("promtool's stdin");
    stdin
        .write_all(exposition.as_bytes())
        .await
        .expect("feed promtool");
    drop(stdin);
    let output = check.wait_with_output().await.expect("promtool ends");
    assert!(
        output.status.success(),
        "promtool refused the exposition: {}{}\n{exposition}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

for_each_backend!(the_exposition_passes_promtool);

#[tokio::test]
async fn namespace_labels_need_the_metrics() {
    let output = coordinator(&["--metrics-namespace-labels"]).await;
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--metrics-listen"));
}

#[tokio::test]
async fn other_paths_are_not_found_and_metrics_are_off_by_default() {
    let app = TestApp::spawn_with(Backend::Sqlite, &["--metrics-listen", "127.0.0.1:0"]).await;
    let (status, _) = http_get(app.metrics_addr.expect("metrics on"), "/other").await;
    assert_eq!(status, "HTTP/1.1 404 Not Found");

    let plain = TestApp::spawn(Backend::Sqlite).await;
    assert_eq!(plain.metrics_addr, None);
}

#[tokio::test]
async fn the_metrics_flag_must_be_an_address() {
    let output = coordinator(&["--metrics-listen", "not-an-address"]).await;
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--metrics-listen"));
}

#[tokio::test]
async fn a_metrics_port_in_use_stops_the_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address").to_string();
    let directory = tempfile::tempdir().expect("temporary folder");
    let database = format!("sqlite://{}/store.db", directory.path().display());
    let output = coordinator(&[
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &database,
        "--metrics-listen",
        &address,
    ])
    .await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains(&address),
        "{output:?}"
    );
}
