//! The embedded default, as a newcomer meets it: no database server, no settings.

use std::time::Duration;

use crate::support::process::{ServerProcess, assert_refused_saying};
use crate::support::*;

/// SQLite only: with no store configured, the binary keeps its data in ./data/coordinator.db
/// of its working directory; PostgreSQL is never the default.
#[tokio::test]
async fn with_no_settings_the_data_lives_in_a_local_file_and_survives_a_restart() {
    let directory = tempfile::tempdir().expect("a temporary folder");
    let key = unique_key("survivor");

    let mut first = ServerProcess::start_embedded_in(directory.path()).await;
    let mut client = first.client_when_serving().await;
    let started = claim(&mut client, try_start(&key)).await;
    complete_key(&client, &key, started.lease_token, b"kept across restarts").await;
    mark_results(&client, mark("billing", &["evt-1"])).await;
    first.signal("TERM");
    assert_eq!(first.wait(Duration::from_secs(20)).await, Some(0));
    assert!(
        directory.path().join("data/coordinator.db").is_file(),
        "the file and its folder were created"
    );

    let second = ServerProcess::start_embedded_in(directory.path()).await;
    let mut client = second.client_when_serving().await;
    expect_replay(&client, &key, b"kept across restarts").await;
    let marked = mark_results(&client, mark("billing", &["evt-1"])).await;
    assert!(marked[0].already_processed);
    // Tokens keep growing across restarts: the counter lives in the file too.
    let next = claim(&mut client, try_start(&unique_key("after-restart"))).await;
    assert!(next.lease_token > started.lease_token);
}

#[tokio::test]
async fn a_database_url_of_another_kind_is_refused_at_start() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--database-url",
            "mysql://root@localhost/x",
        ])
        .output()
        .await
        .expect("run the binary");
    assert_refused_saying(
        &output,
        &["--database-url", "postgres://", "sqlite://"],
        "the error names the flag and what it accepts",
    );
}

/// SQLite only: a second process on a file that one already serves is refused at start, with
/// the reason, and the first one goes on serving; once the first one is gone (even killed), the
/// file can be served again.
#[tokio::test]
async fn a_second_process_on_the_same_file_is_refused_and_the_first_serves_on() {
    let directory = tempfile::tempdir().expect("a temporary folder");
    let mut first = ServerProcess::start_embedded_in(directory.path()).await;
    let mut client = first.client_when_serving().await;
    let key = unique_key("one-process");
    let started = claim(&mut client, try_start(&key)).await;

    let second = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .args(["--listen", "127.0.0.1:0"])
        .current_dir(directory.path())
        .output();
    let second = tokio::time::timeout(Duration::from_secs(20), second)
        .await
        .expect("the second process stops by itself")
        .expect("run the binary");
    assert_refused_saying(
        &second,
        &[
            "another process already serves the SQLite file",
            "coordinator.db.lock",
            "PostgreSQL",
        ],
        "the refusal says why and what to do",
    );

    // The first process serves on.
    complete_key(&client, &key, started.lease_token, b"still served").await;
    first.signal("KILL");
    first.wait(Duration::from_secs(20)).await;
    let third = ServerProcess::start_embedded_in(directory.path()).await;
    let client = third.client_when_serving().await;
    expect_replay(&client, &key, b"still served").await;
}
