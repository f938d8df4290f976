//! A cluster's trouble stays its own: paused, its namespaces get UNAVAILABLE while the other
//! clusters' callers see no failure and the service stays SERVING; down at start, it is migrated
//! and served once it comes; with every cluster down, the service is NOT_SERVING.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_types::StatusExt;

use super::*;
use crate::metrics::{samples, scrape};

/// How many callers each namespace's load has: enough that calls queue and share statements.
const CALLERS: usize = 8;

/// A call's queue budget with the test's `--operation-timeout 2s` (10% of it,
/// `domain::budget`). A call that shares a queue, an executor or a statement with the paused
/// cluster's calls waits longer than that (about 400 ms here, against 30-55 ms for a call that
/// shares nothing with them).
const QUEUE_BUDGET: Duration = Duration::from_millis(200);

/// Lifecycles of fresh keys in `namespace` by [`CALLERS`] callers, each one lifecycle after
/// another until `stop`: how many were answered, and the failures.
struct Load {
    done: Arc<AtomicUsize>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    /// The longest any one call took.
    slowest: Arc<std::sync::Mutex<Duration>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Waits until every caller has stopped; answers the failures and the slowest call.
    async fn stopped(self) -> (Vec<String>, Duration) {
        for task in self.tasks {
            task.await.expect("a caller's task");
        }
        let failures = self.failures.lock().expect("the failures").clone();
        let slowest = *self.slowest.lock().expect("the slowest call");
        (failures, slowest)
    }
}

fn steady_load(client: &Client, namespace: &'static str, stop: &CancellationToken) -> Load {
    let done = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let slowest = Arc::new(std::sync::Mutex::new(Duration::ZERO));
    let tasks = (0..CALLERS)
        .map(|_| {
            let (client, stop) = (client.clone(), stop.clone());
            let (done, failures, slowest) = (done.clone(), failures.clone(), slowest.clone());
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    match timed_lifecycle(&client, namespace, &slowest).await {
                        Ok(()) => {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(status) => failures
                            .lock()
                            .expect("the failures")
                            .push(format!("{namespace}: {status:?}")),
                    }
                }
            })
        })
        .collect();
    Load {
        done,
        failures,
        slowest,
        tasks,
    }
}

/// TryStart and Complete of a fresh key of `namespace`, each call's time kept in `slowest` when
/// it is the longest yet.
async fn timed_lifecycle(
    client: &Client,
    namespace: &str,
    slowest: &std::sync::Mutex<Duration>,
) -> Result<(), tonic::Status> {
    let timed = |sent: Instant| {
        let mut slowest = slowest.lock().expect("the slowest call");
        *slowest = (*slowest).max(sent.elapsed());
    };
    let key = unique_key(namespace);
    let sent = Instant::now();
    let started = client
        .clone()
        .try_start(try_start_in(namespace, &key))
        .await?
        .into_inner();
    timed(sent);
    let Some(pb::try_start_response::Outcome::Started(claim)) = started.outcome else {
        return Err(tonic::Status::internal(format!("not started: {started:?}")));
    };
    let request = complete(&key, claim.lease_token, b"ok").in_namespace(namespace.into());
    let sent = Instant::now();
    client.clone().complete(request).await?;
    timed(sent);
    Ok(())
}

/// Waits until every load has answered `more` lifecycles beyond what it had answered now.
async fn loads_answer_more(loads: &[Load], more: usize) {
    let from: Vec<usize> = loads
        .iter()
        .map(|load| load.done.load(Ordering::Relaxed))
        .collect();
    eventually(
        Duration::from_secs(30),
        "the other clusters' callers are answered",
        || async {
            loads
                .iter()
                .zip(&from)
                .all(|(load, from)| load.done.load(Ordering::Relaxed) >= from + more)
        },
    )
    .await;
}

/// Waits until `idempotency_cluster_ready{cluster}` reads `ready`.
async fn cluster_ready_reads(app: &TestApp, cluster: &str, ready: f64) {
    let series = format!("idempotency_cluster_ready{{cluster=\"{cluster}\"}}");
    eventually(
        Duration::from_secs(20),
        &format!("{series} reads {ready}"),
        || {
            let series = series.clone();
            async move { samples(&scrape(app).await).get(&series) == Some(&ready) }
        },
    )
    .await;
}

/// Deletes a key's row behind the service's back, on `node`.
async fn delete_key_by_hand(node: &Node, namespace: &str, key: &str) {
    let mut connection = node.connect(DATABASE).await;
    sqlx::query("DELETE FROM idempotency_keys WHERE namespace = $1 AND key = $2")
        .bind(namespace)
        .bind(key)
        .execute(&mut connection)
        .await
        .expect("delete the row by hand");
}

/// Whether a Lookup of `key` of `misc` answers it completed (its row deleted by hand: only the
/// replay cache can).
async fn replayed_from_memory(client: &Client, key: &str) -> bool {
    let answer = client
        .clone()
        .lookup(lookup(key).in_namespace("misc".into()))
        .await
        .expect("a Lookup of a's key");
    matches!(
        answer.into_inner().state,
        Some(pb::lookup_response::State::Completed(_))
    )
}

async fn health_now(app: &TestApp) -> ServingStatus {
    let mut health = app.health().await;
    let answer = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("a health answer");
    answer.into_inner().status()
}

/// Cluster b paused (every process of it stopped where it stands) under steady load on all
/// three: b's calls are UNAVAILABLE with `outcome`, within the operation timeout; a's and c's
/// callers keep being answered, none fails; health stays SERVING; the cluster gauge says
/// which one is lost; no call on a or c waits anywhere near as long as b's calls do, and a's
/// replays are still served from memory (each cluster confirms its own); resumed,
/// b is served again. The operation timeout is 2 s (not 5), so that b's calls fail sooner.
#[tokio::test]
async fn a_paused_cluster_fails_only_its_own_namespaces() {
    let clusters = three_clusters().await;
    let app = serve_on(
        &clusters,
        &[
            "--operation-timeout",
            "1s",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    let client = app.client().await;
    for namespace in NAMESPACES {
        lifecycle(&client, namespace, &unique_key(namespace), b"warm").await;
    }
    cluster_ready_reads(&app, "b", 1.0).await;
    // A completed key of a whose row is then deleted by hand: only the replay cache can answer
    // it completed, and it does (its cluster's heartbeats confirm it).
    let remembered = unique_key("remembered");
    lifecycle(&client, "misc", &remembered, b"kept").await;
    delete_key_by_hand(&clusters.nodes[0], "misc", &remembered).await;
    eventually(
        Duration::from_secs(10),
        "a's key is replayed from memory",
        || async { replayed_from_memory(&client, &remembered).await },
    )
    .await;
    let stop = CancellationToken::new();
    let loads = [
        steady_load(&client, "misc", &stop),
        steady_load(&client, "billing", &stop),
    ];
    loads_answer_more(&loads, 20).await;

    // b's own callers keep calling through the pause, so that calls of every cluster queue
    // together.
    let stalled = steady_load(&client, "orders-eu", &stop);
    loads_answer_more(std::slice::from_ref(&stalled), 20).await;
    clusters.nodes[1].pause().await;
    let sent = Instant::now();
    // A call on the paused cluster fails.
    let stalled_call = try_start_in("orders-eu", &unique_key("stalled"));
    let refused = assert_refused(
        client.clone().try_start(stalled_call).await,
        Code::Unavailable,
        "STORE_UNAVAILABLE",
    );
    assert!(
        sent.elapsed() < Duration::from_secs(4),
        "answered within the operation timeout and its margin, took {:?}",
        sent.elapsed()
    );
    let details = refused.get_error_details();
    let outcome = details
        .error_info()
        .and_then(|info| info.metadata.get("outcome").cloned());
    assert!(
        outcome.is_some(),
        "UNAVAILABLE says its outcome: {refused:?}"
    );
    cluster_ready_reads(&app, "b", 0.0).await;
    assert_eq!(health_now(&app).await, ServingStatus::Serving);
    // b's callers call again and again through the pause (each call failing after the
    // operation timeout), their calls queued among a's and c's.
    eventually(
        Duration::from_secs(30),
        "the paused cluster's callers fail again and again",
        || async { stalled.failures.lock().expect("the failures").len() >= 6 * CALLERS },
    )
    .await;
    loads_answer_more(&loads, 50).await;
    // b silent for seconds, longer than a heartbeat confirms: a's replays are still served
    // from memory, confirmed by a's own heartbeats.
    assert!(
        replayed_from_memory(&client, &remembered).await,
        "a's replay went to the store while b was paused"
    );

    clusters.nodes[1].resume().await;
    cluster_ready_reads(&app, "b", 1.0).await;
    eventually(
        Duration::from_secs(20),
        "the resumed cluster serves its namespace",
        || async {
            let key = unique_key("resumed");
            client
                .clone()
                .try_start(try_start_in("orders-eu", &key))
                .await
                .is_ok()
        },
    )
    .await;
    stop.cancel();
    for load in loads {
        let (failures, slowest) = load.stopped().await;
        assert!(
            failures.is_empty(),
            "the other clusters' calls failed, held up by the paused cluster: {failures:?}"
        );
        assert!(
            slowest < QUEUE_BUDGET,
            "a call on another cluster waited {slowest:?}, held up by the paused cluster"
        );
    }
    let (stalled_failures, _) = stalled.stopped().await;
    assert!(
        !stalled_failures.is_empty(),
        "the paused cluster's callers saw failures"
    );
}

/// Cluster c down when the service starts: the service serves a's and b's namespaces, c's get
/// UNAVAILABLE; c started, it is migrated and served, without a restart. Then every cluster
/// down: NOT_SERVING; one back: SERVING.
#[tokio::test]
async fn a_cluster_down_at_start_is_migrated_and_served_when_it_comes() {
    let clusters = three_clusters().await;
    clusters.nodes[2].stop().await;
    let app = serve_on(&clusters, &[]).await;
    let client = app.client().await;
    lifecycle(&client, "misc", &unique_key("misc"), b"a").await;
    // The cluster that is down cannot serve.
    let early_call = try_start_in("billing", &unique_key("early"));
    assert_refused(
        client.clone().try_start(early_call).await,
        Code::Unavailable,
        "STORE_UNAVAILABLE",
    );

    clusters.nodes[2].start().await;
    eventually(
        Duration::from_secs(30),
        "the cluster that came is migrated and serves",
        || async {
            client
                .clone()
                .try_start(try_start_in("billing", &unique_key("late")))
                .await
                .is_ok()
        },
    )
    .await;
    lifecycle(&client, "billing", &unique_key("billing"), b"c").await;
    assert_eq!(keys_on(&clusters.nodes[2], "billing").await, 2);

    for node in &clusters.nodes {
        node.stop().await;
    }
    app.wait_for_status(ServingStatus::NotServing).await;
    clusters.nodes[0].start().await;
    app.wait_for_status(ServingStatus::Serving).await;
    lifecycle(&client, "misc", &unique_key("misc"), b"a again").await;
}
