//! Namespaces placed on several PostgreSQL clusters (`--cluster`, `--place`; docs/scaling.md):
//! three real clusters made by `initdb`, each on a free port of its own
//! (`support::cluster::Clusters`), the service on all three, called through its gRPC API. Each
//! call's rows land on its namespace's cluster and nowhere else, and what spans clusters (a
//! coalesced round, waiting across replicas, an erasure honoured by every replica) works as on
//! one (`placement`), as docs/scaling.md shows it (`guide`); each cluster's series in `/metrics`
//! carry its name (`metrics`); keys held on one cluster take no place of another's lane
//! (`held`); one cluster paused or down fails only its own namespaces while the
//! others are served, and a cluster that comes late is migrated and served (`trouble`).
//!
//! PostgreSQL only: the embedded store is one file.

mod guide;
mod held;
mod metrics;
mod moves;
mod placement;
mod trouble;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use crate::support::cluster::{Clusters, Node};
use crate::support::*;

/// The database each cluster serves (created by the service's first migration on it; the
/// guide's own, too).
const DATABASE: &str = "idempotency";

/// Where the tests' namespaces go: `orders-*` on b, `billing` on c, the rest on a (the first).
const PLACEMENT: &[&str] = &["--place", "orders-*=b", "--place", "billing=c"];

/// A namespace of each cluster, in the clusters' order.
const NAMESPACES: [&str; 3] = ["misc", "orders-eu", "billing"];

/// Three clusters named a, b and c.
async fn three_clusters() -> Clusters {
    Clusters::start(&["a", "b", "c"]).await
}

/// The flags of a server on `clusters` with [`PLACEMENT`] and `flags`.
fn cluster_flags(clusters: &Clusters, flags: &[&str]) -> Vec<String> {
    let mut all = clusters.flags(DATABASE);
    all.extend(PLACEMENT.iter().chain(flags).map(|flag| flag.to_string()));
    all
}

/// A server on `clusters` with [`PLACEMENT`] and `flags`, serving.
async fn serve_on(clusters: &Clusters, flags: &[&str]) -> TestApp {
    let all = cluster_flags(clusters, flags);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    TestApp::spawn_with(Backend::Postgres, &all).await
}

/// How many keys of `namespace` `node`'s database holds, read on the node itself.
async fn keys_on(node: &Node, namespace: &str) -> i64 {
    rows_on(node, "idempotency_keys", "namespace", namespace).await
}

/// How many processed events of `consumer` `node`'s database holds.
async fn events_on(node: &Node, consumer: &str) -> i64 {
    rows_on(node, "processed_events", "consumer", consumer).await
}

/// How many rows of `table` whose `column` is `scope` `node`'s database holds.
async fn rows_on(node: &Node, table: &str, column: &str, scope: &str) -> i64 {
    let query = format!("SELECT count(*) FROM {table} WHERE {column} = $1");
    count_on(node, sqlx::AssertSqlSafe(query), scope).await
}

/// How many statements on `node`'s database have waited for a lock for `at_least` or more.
async fn waiting_for_locks(node: &Node, at_least: std::time::Duration) -> i64 {
    let query = "SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'
           AND now() - query_start >= make_interval(secs => $1)";
    count_on(node, query, at_least.as_secs_f64()).await
}

/// The count that `query`, with `value` for its `$1`, reads on `node`'s database.
async fn count_on<'q, V>(node: &Node, query: impl sqlx::SqlSafeStr, value: V) -> i64
where
    V: 'q + sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    let mut connection = node.connect(DATABASE).await;
    let (count,): (i64,) = sqlx::query_as(query)
        .bind(value)
        .fetch_one(&mut connection)
        .await
        .unwrap_or_else(|error| panic!("a count on {}: {error}", node.name));
    count
}

fn try_start_in(namespace: &str, key: &str) -> pb::TryStartRequest {
    try_start(key).in_namespace(namespace.into())
}

/// Claims `key` in `namespace`, completes it with `response`, and checks that it replays.
async fn lifecycle(client: &Client, namespace: &str, key: &str, response: &[u8]) {
    let started = claim(&mut client.clone(), try_start_in(namespace, key)).await;
    answered(
        client
            .clone()
            .complete(complete(key, started.lease_token, response).in_namespace(namespace.into()))
            .await,
        "Complete",
    );
    let replay = expect_completed(try_start_response(client, try_start_in(namespace, key)).await);
    assert_eq!(replay.response, response, "the replay of {namespace}/{key}");
}
