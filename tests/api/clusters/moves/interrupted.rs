//! A move interrupted after its fence, by the service killed or by a transaction that does not
//! end: the namespace is served by exactly one cluster (by neither while fenced, its calls
//! refused UNAVAILABLE with nothing written), and the move is resumed or rolled back.

use std::time::{Duration, Instant};

use sqlx::Connection;
use tonic::Code;
use tonic_types::StatusExt;

use super::*;
use crate::support::process::{ServerProcess, coordinator};

/// The coordinator binary serving the three clusters with the tests' placement, and a client of
/// it once it serves.
async fn serve_process(clusters: &Clusters) -> (ServerProcess, Client) {
    let mut command = coordinator().command();
    command
        .arg("serve")
        .args(cluster_flags(clusters, FLAGS))
        .env("RUST_LOG", "info");
    let server = ServerProcess::spawn(command, &[]).await;
    let client = server.client_when_serving().await;
    (server, client)
}

/// A TryStart of `namespace` while it is fenced: refused UNAVAILABLE, nothing written, after
/// waiting at most about half the operation timeout for the cut-over.
async fn refused_while_fenced(client: &Client, namespace: &str) {
    let sent = Instant::now();
    let status = client
        .clone()
        .try_start(try_start_in(namespace, &unique_key("fenced")))
        .await
        .expect_err("no cluster serves a fenced namespace");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
    let outcome = status
        .get_error_details()
        .error_info()
        .and_then(|info| info.metadata.get("outcome").cloned());
    assert_eq!(outcome.as_deref(), Some("not_written"), "{status:?}");
    assert!(
        sent.elapsed() < Duration::from_millis(1900),
        "{:?}",
        sent.elapsed()
    );
}

/// What callers of one namespace saw: calls answered, failures, the slowest answered call.
#[derive(Debug, Default)]
struct Calls {
    answered: usize,
    failed: Vec<tonic::Status>,
    slowest: Duration,
}

/// Claims of fresh keys of `namespace` by four callers for `duration`.
async fn calls_for(client: &Client, namespace: &'static str, duration: Duration) -> Calls {
    let until = Instant::now() + duration;
    let callers = (0..4).map(|_| {
        let client = client.clone();
        async move {
            let mut calls = Calls::default();
            while Instant::now() < until {
                let request = try_start_in(namespace, &unique_key(namespace));
                let sent = Instant::now();
                match client.clone().try_start(request).await {
                    Ok(_) => {
                        calls.answered += 1;
                        calls.slowest = calls.slowest.max(sent.elapsed());
                    }
                    Err(status) => calls.failed.push(status),
                }
            }
            calls
        }
    });
    let mut all = Calls::default();
    for calls in futures::future::join_all(callers).await {
        all.answered += calls.answered;
        all.failed.extend(calls.failed);
        all.slowest = all.slowest.max(calls.slowest);
    }
    all
}

async fn replays(client: &Client, namespace: &str, keys: &[String]) {
    for key in keys {
        let replay =
            expect_completed(try_start_response(client, try_start_in(namespace, key)).await);
        assert_eq!(replay.response, key.as_bytes(), "{key}");
    }
}

#[tokio::test]
async fn a_move_killed_after_its_fence_is_resumed_and_another_rolled_back() {
    let clusters = three_clusters().await;
    let (a, b, c) = (&clusters.nodes[0], &clusters.nodes[1], &clusters.nodes[2]);
    let (first, client) = serve_process(&clusters).await;
    let keys: Vec<String> = (0..10)
        .map(|n| format!("kept-{n}-{}", unique_key("k")))
        .collect();
    for key in &keys {
        lifecycle(&client, "misc", key, key.as_bytes()).await;
    }

    // a has handed out many more tokens than b (an older, busier cluster).
    let mut on_a = a.connect(DATABASE).await;
    sqlx::query("SELECT setval('lease_token_seq', 1000000)")
        .execute(&mut on_a)
        .await
        .expect("a's tokens");
    on_a.close().await.expect("close");

    // Killed while its drain waits: fenced, served by neither.
    let old = old_transaction(a).await;
    let call = fenced_move(&admin_of(first.endpoint()).await, a, "misc", "b").await;
    first.signal("KILL");
    assert!(
        call.await.expect("the move's call").is_err(),
        "the killed server answered"
    );
    old.close().await.expect("the old transaction ends");
    assert_eq!(
        gate_on(b, "misc").await,
        Some(("arriving".into(), "a".into()))
    );
    let (second, client) = serve_process(&clusters).await;
    refused_while_fenced(&client, "misc").await;
    assert_eq!(
        (keys_on(a, "misc").await, keys_on(b, "misc").await),
        (10, 0)
    );
    let admin = admin_of(second.endpoint()).await;
    assert_eq!(
        standing(&admin, "misc").await,
        "rules a, served by -, moving a>b, gates a:leaving:b b:arriving:a c::",
        "fenced, served by neither"
    );

    // Resumed: the namespace is on b, whole.
    let report = moved(&admin, move_request("misc", "b")).await;
    assert_eq!((report.outcome.as_str(), report.keys_copied), ("moved", 10));
    replays(&client, "misc", &keys).await;
    // The first token b hands out for misc is above every one of a's.
    let fresh = claim(
        &mut client.clone(),
        try_start_in("misc", &unique_key("fresh")),
    )
    .await;
    assert!(i64::try_from(fresh.lease_token).expect("a token") > last_token_on(a).await);
    assert_eq!(
        (keys_on(a, "misc").await, keys_on(b, "misc").await),
        (0, 11)
    );
    assert_eq!(gate_on(a, "misc").await, Some(("left".into(), "b".into())));
    assert_eq!(
        standing(&admin, "misc").await,
        "rules a, served by b, moving -, gates a:left:b b:: c::",
        "moved to b"
    );

    // Another move, to c, killed the same way, then rolled back: b serves it again, and c
    // keeps a gate that sends a stale replica back to b.
    let old = old_transaction(b).await;
    let call = fenced_move(&admin, b, "misc", "c").await;
    second.signal("KILL");
    assert!(call.await.expect("the move's call").is_err());
    old.close().await.expect("the old transaction ends");
    let (third, client) = serve_process(&clusters).await;
    refused_while_fenced(&client, "misc").await;
    let admin = admin_of(third.endpoint()).await;
    let report = moved(&admin, rollback_request("misc")).await;
    assert_eq!(
        (
            report.outcome.as_str(),
            report.from.as_str(),
            report.to.as_str()
        ),
        ("rolled_back", "b", "c")
    );
    assert_eq!(gate_on(b, "misc").await, None);
    assert_eq!(gate_on(c, "misc").await, Some(("left".into(), "b".into())));
    assert_eq!(
        standing(&admin, "misc").await,
        "rules a, served by b, moving -, gates a:left:b b:: c:left:b",
        "rolled back: b serves it"
    );
    assert_eq!(keys_on(c, "misc").await, 0);
    replays(&client, "misc", &keys).await;
    lifecycle(&client, "misc", &unique_key("after"), b"after").await;
    assert_eq!(keys_on(b, "misc").await, 12);
    let actions = audit_actions(&admin, "misc").await;
    assert_eq!(
        actions.iter().filter(|a| *a == "move_placement").count(),
        2,
        "{actions:?}"
    );
}

/// A transaction on the source that outlives the drain's bound (twice the operation timeout
/// and a second) stops the move, naming its session; the namespace stays fenced until the move
/// is rolled back, and is then served by its source as before.
#[tokio::test]
async fn a_move_whose_drain_outlasts_its_bound_stops_naming_the_session_and_rolls_back() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, FLAGS).await;
    let client = app.client().await;
    let admin = admin_of(app.endpoint()).await;
    let key = unique_key("kept");
    lifecycle(&client, "misc", &key, key.as_bytes()).await;
    let mut old = old_transaction(&clusters.nodes[0]).await;
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut old)
        .await
        .expect("its pid");
    let call = fenced_move(&admin, &clusters.nodes[0], "misc", "b").await;
    // One move of a namespace at a time, wherever the other would go.
    let busy = admin
        .clone()
        .move_placement(move_request("misc", "c"))
        .await
        .expect_err("another move of misc runs");
    assert_eq!(busy.code(), Code::FailedPrecondition, "{busy:?}");
    assert!(
        busy.message()
            .contains("another move of namespace misc is running")
    );
    // While fenced, calls on misc and on another namespace of a come together, and share
    // rounds: misc's are refused, not_written; the other's are answered, none held with them.
    let (fenced, other) = tokio::join!(
        calls_for(&client, "misc", Duration::from_millis(1500)),
        calls_for(&client, "elsewhere", Duration::from_millis(1500)),
    );
    assert!(
        fenced.answered == 0 && !fenced.failed.is_empty(),
        "misc was served while fenced: {fenced:?}"
    );
    for status in &fenced.failed {
        assert_error(status, Code::Unavailable, "STORE_UNAVAILABLE");
    }
    // Held with misc's, a call would wait out misc's cut-over wait: a second.
    assert!(other.answered > 0 && other.failed.is_empty(), "{other:?}");
    assert!(other.slowest < Duration::from_millis(800), "{other:?}");
    let status = call
        .await
        .expect("the move's call")
        .expect_err("the drain's bound passes");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains(&format!("pid {pid} ")),
        "{}",
        status.message()
    );
    refused_while_fenced(&client, "misc").await;
    let report = moved(&admin, rollback_request("misc")).await;
    assert_eq!(report.outcome, "rolled_back");
    replays(&client, "misc", std::slice::from_ref(&key)).await;
    old.close().await.expect("the old transaction ends");
}

/// A move back to the namespace's own rule's cluster, its replica killed after the switch and
/// before the source recorded the departure (held up by a lock on the source's gate): the
/// rule's cluster serves it at once, `GetPlacement` shows the unfinished move, and the same
/// command finishes it: the source records where the namespace went and deletes its rows.
#[tokio::test]
async fn a_move_home_killed_after_its_switch_is_finished_by_running_it_again() {
    let clusters = three_clusters().await;
    let (a, b) = (&clusters.nodes[0], &clusters.nodes[1]);
    let (first, client) = serve_process(&clusters).await;
    let keys: Vec<String> = (0..5).map(|n| unique_key(&format!("home-{n}"))).collect();
    for key in &keys {
        lifecycle(&client, "misc", key, key.as_bytes()).await;
    }
    let admin = admin_of(first.endpoint()).await;
    moved(&admin, move_request("misc", "b")).await;

    // Back to a (misc's rule's cluster): fenced, then the departure's record held up on b.
    let old = old_transaction(b).await;
    let call = fenced_move(&admin, b, "misc", "a").await;
    let mut gate_lock = b.connect(DATABASE).await;
    sqlx::raw_sql(
        "BEGIN; SELECT 1 FROM idempotency_placement_gates WHERE scope = 'misc' FOR UPDATE",
    )
    .execute(&mut gate_lock)
    .await
    .expect("lock b's gate");
    old.close().await.expect("the old transaction ends");
    eventually(Duration::from_secs(20), "a has switched", || async {
        gate_on(a, "misc").await.is_none()
    })
    .await;
    // Killed only once the departure's statement waits on b: a switch seen on a does not yet
    // mean the replica has sent it (on a loaded machine it once had not, and nothing waited).
    eventually(
        Duration::from_secs(20),
        "the departure's statement waits for b's gate",
        || async { waiting_for_locks(b, Duration::ZERO).await == 1 },
    )
    .await;
    first.signal("KILL");
    assert!(call.await.expect("the move's call").is_err());
    // The killed replica's statement still waits for the lock on b (a backend waiting for a
    // lock does not notice its client has gone): ended first, as a server that checks its
    // clients' connections would, so that it cannot record the departure after all.
    let (ended,): (i64,) = sqlx::query_as(
        "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&mut gate_lock)
    .await
    .expect("end the killed replica's waiting statement");
    assert_eq!(ended, 1, "the departure's statement waited for b's gate");
    gate_lock.close().await.expect("the lock ends");
    assert_eq!(
        gate_on(b, "misc").await,
        Some(("leaving".into(), "a".into()))
    );

    let (second, client) = serve_process(&clusters).await;
    let admin = admin_of(second.endpoint()).await;
    assert_eq!(
        standing(&admin, "misc").await,
        "rules a, served by a, moving b>a, gates a:: b:leaving:a c::",
        "switched, not recorded"
    );
    replays(&client, "misc", &keys).await;

    let report = moved(&admin, move_request("misc", "a")).await;
    assert_eq!(
        (
            report.outcome.as_str(),
            report.keys_copied,
            report.rows_deleted
        ),
        // The five keys, and the first move's audit event, recorded on b (copied to a).
        ("moved", 0, 6)
    );
    let actions = audit_actions(&admin, "misc").await;
    assert_eq!(
        actions.iter().filter(|a| *a == "move_placement").count(),
        2,
        "the first move's and the finished one's: {actions:?}"
    );
    assert_eq!(gate_on(b, "misc").await, Some(("left".into(), "a".into())));
    assert_eq!((keys_on(a, "misc").await, keys_on(b, "misc").await), (5, 0));
    assert_eq!(
        standing(&admin, "misc").await,
        "rules a, served by a, moving -, gates a:: b:left:a c::",
        "moved home"
    );
}
