//! A database that cannot be reached is named within 2 s of start, with its host and cause
//! (refused, unknown host, TLS, the password), and again only when the cause changes; the
//! service retries with a growing pause, reports NOT_SERVING meanwhile, and serves as soon as
//! the database is back, with or without migrations at start; `migrate` exits non-zero with the
//! same cause.

use std::time::{Duration, Instant};

use super::{migrate, not_serving, run_to_end, says, tls_cluster_with_database};
use crate::support::eventually;
use crate::support::process::ServerProcess;
use crate::support::tls_cluster::Cluster;

const DB: &str = "idempotency";

/// The most a start-up may take to name the cause: the bound. Measured from before the
/// process was spawned, so the process's own start counts too.
const NAMED_WITHIN: Duration = Duration::from_secs(2);

fn count(output: &str, text: &str) -> usize {
    output.lines().filter(|line| line.contains(text)).count()
}

#[tokio::test]
async fn a_refused_connection_is_named_at_once_then_each_change_of_cause_once() {
    let cluster = tls_cluster_with_database(DB, "app").await;
    cluster.stop_server().await;
    let password_file = cluster.folder().join("password");
    std::fs::write(&password_file, "not-the-password").expect("password file");
    let url = cluster.url(
        "app",
        "localhost",
        DB,
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            cluster.certificates.ca.display()
        ),
    );
    let file = password_file.display().to_string();
    let began = Instant::now();
    // The service's own check interval (the test kit's is 100 ms): the pauses grow up to it.
    let server = ServerProcess::start_with_log_level(
        &url,
        &[
            "--database-password-file",
            &file,
            "--health-check-interval",
            "2s",
        ],
        "idempotency_coordinator=debug",
    )
    .await;
    let refused = format!(
        "cannot connect to PostgreSQL at localhost:{}: connection refused",
        cluster.port
    );
    let line = says(&server, &refused).await;
    assert!(
        began.elapsed() < NAMED_WITHIN,
        "named after {:?}: {line}",
        began.elapsed()
    );
    not_serving(&server).await;
    // Retries, each after a longer pause (100 ms, 200 ms, 400 ms…), logged once.
    eventually(Duration::from_secs(10), "three retries", || async {
        count(&server.output(), "store still not ready") >= 3
    })
    .await;
    let output = server.output();
    assert_eq!(
        count(&output, "store not ready; not serving"),
        1,
        "{output}"
    );
    for pause in ["retry=100ms", "retry=200ms", "retry=400ms"] {
        assert!(output.contains(pause), "a pause of {pause}: {output}");
    }
    // The database comes back with another cause: that is named, once.
    cluster.start_server().await;
    says(&server, "refused the password of user \"app\"").await;
    eventually(
        Duration::from_secs(10),
        "a retry with the new cause",
        || async {
            server
                .output()
                .lines()
                .filter(|line| line.contains("store still not ready"))
                .any(|line| line.contains("refused the password"))
        },
    )
    .await;
    assert_eq!(
        count(&server.output(), "store not ready; not serving"),
        2,
        "{}",
        server.output()
    );
    // Fixed: serving, without a restart.
    std::fs::write(&password_file, "pw-first-7f3a").expect("password file");
    server.client_when_serving().await;
    says(&server, "store ready; serving").await;
}

#[tokio::test]
async fn without_migrations_at_start_the_cause_is_named_and_serving_follows_the_database() {
    let cluster = Cluster::tls().await;
    let url = cluster.url(
        "postgres",
        "localhost",
        DB,
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            cluster.certificates.ca.display()
        ),
    );
    migrate(&url, &[]).await;
    cluster.stop_server().await;
    let began = Instant::now();
    let server = ServerProcess::start(&url, &["--no-migrate"]).await;
    let line = says(&server, "connection refused").await;
    assert!(
        began.elapsed() < NAMED_WITHIN,
        "named after {:?}",
        began.elapsed()
    );
    assert!(
        line.contains(&format!("localhost:{}", cluster.port)),
        "{line}"
    );
    not_serving(&server).await;
    cluster.start_server().await;
    server.client_when_serving().await;
}

#[tokio::test]
async fn an_unknown_host_is_named_and_migrate_exits_with_the_same_cause() {
    let url = format!("postgres://postgres@no-such-host.invalid:5432/{DB}");
    let began = Instant::now();
    let server = ServerProcess::start(&url, &[]).await;
    let cause = "cannot connect to PostgreSQL at no-such-host.invalid:5432: unknown host";
    says(&server, cause).await;
    assert!(
        began.elapsed() < NAMED_WITHIN,
        "named after {:?}",
        began.elapsed()
    );
    not_serving(&server).await;
    let (status, said) = run_to_end(&["migrate", "--database-url", &url]).await;
    assert_eq!(status, Some(1), "{said}");
    assert!(said.contains(cause), "{said}");
}

#[tokio::test]
async fn with_several_hosts_each_host_is_named_with_its_own_cause() {
    let plain = Cluster::plain().await;
    let dead = crate::support::cluster::free_port();
    let url = format!(
        "postgres://postgres@127.0.0.1:{dead},localhost:{}/{DB}?target_session_attrs=read-write\
         &sslmode=require",
        plain.port
    );
    let server = ServerProcess::start(&url, &[]).await;
    let line = says(&server, "no host is writable").await;
    assert!(
        line.contains(&format!("127.0.0.1:{dead}: connection refused"))
            && line.contains(&format!(
                "localhost:{}: the server does not accept TLS",
                plain.port
            )),
        "{line}"
    );
    not_serving(&server).await;
}
