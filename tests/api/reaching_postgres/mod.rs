//! Reaching the PostgreSQL that teams run: TLS with libpq's parameters (`tls`), the refusals
//! that name their cause (`tls_refusals`), credentials kept outside the URL and rotated
//! (`credentials`), the start-up that names why the database cannot be reached (`start_up`),
//! the least-privileged role (`roles`), and the operations guide's commands for them, run as
//! written (`guide`). Each test starts a PostgreSQL cluster of its own
//! (`support::tls_cluster`) and the real binary, and asserts through the gRPC API and the
//! process's own words.

mod credentials;
mod guide;
mod roles;
mod start_up;
mod tls;
mod tls_refusals;

use std::time::Duration;

use crate::support::eventually;

use crate::support::process::ServerProcess;
use crate::support::tls_cluster::{Cluster, SAYS_WITHIN};
use crate::support::{claim_and_complete, expect_replay, unique_key};

/// A cluster that takes TLS (see [`Cluster::tls`]) with `database`, owned by `owner`.
pub async fn tls_cluster_with_database(database: &str, owner: &str) -> Cluster {
    let cluster = Cluster::tls().await;
    cluster
        .admin(&format!("CREATE DATABASE {database} OWNER {owner}"))
        .await;
    cluster
}

/// Runs the binary with `args` to its end: its exit status and all it printed.
pub async fn run_to_end(args: &[&str]) -> (Option<i32>, String) {
    let output = crate::support::process::coordinator()
        .command()
        .args(args)
        .output()
        .await
        .expect("run the binary");
    let said = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.code(), said)
}

/// `migrate` on `url` with `flags`, which must succeed.
pub async fn migrate(url: &str, flags: &[&str]) {
    let args: Vec<&str> = ["migrate", "--database-url", url]
        .into_iter()
        .chain(flags.iter().copied())
        .collect();
    let (status, said) = run_to_end(&args).await;
    assert_eq!(status, Some(0), "migrate: {said}");
}

/// `serve` on `url` with `environment` set (`SSL_CERT_FILE`, say).
pub async fn serve_with_environment(url: &str, environment: &[(&str, &str)]) -> ServerProcess {
    let mut command = crate::support::process::coordinator().command();
    command
        .args(["serve", "--database-url", url])
        .env("RUST_LOG", "info");
    for (name, value) in environment {
        command.env(name, value);
    }
    ServerProcess::spawn(command, &[]).await
}

/// Waits until the process has said `text`, and answers the line that says it.
pub async fn says(server: &ServerProcess, text: &str) -> String {
    let deadline = tokio::time::Instant::now() + SAYS_WITHIN;
    loop {
        if let Some(line) = server.output().lines().find(|line| line.contains(text)) {
            return line.to_owned();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the service did not say {text:?} within {SAYS_WITHIN:?}; it said:\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asserts that `server` serves (a claim, its Complete and a replay through the gRPC API) and
/// that every session it holds on `database` of `cluster` is encrypted (`pg_stat_ssl`), the
/// listener's included.
pub async fn serves_encrypted(server: &ServerProcess, cluster: &Cluster, database: &str) {
    let mut client = server.client_when_serving().await;
    let key = unique_key("tls");
    claim_and_complete(&mut client, &key, b"over TLS").await;
    expect_replay(&client, &key, b"over TLS").await;
    // The listener connects on its own, beside the calls' pool: awaited, not assumed.
    eventually(
        Duration::from_secs(20),
        "the listener holds a session",
        || async {
            cluster
                .service_sessions(database)
                .await
                .iter()
                .any(|(name, _)| name == "idempotency-coordinator listener")
        },
    )
    .await;
    let sessions = cluster.service_sessions(database).await;
    assert!(
        sessions.iter().all(|(_, ssl)| *ssl),
        "every session of the service is encrypted: {sessions:?}"
    );
}

/// Asserts that `server` does not serve (grpc.health.v1 NOT_SERVING) for a moment.
pub async fn not_serving(server: &ServerProcess) {
    let health = crate::support::health_client(server.endpoint())
        .await
        .expect("the health service answers");
    for _ in 0..3 {
        assert!(
            !crate::support::is_serving(&health).await,
            "the service must not serve: {}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
