//! docs/scaling.md run as written: the block it marks as run here, read from the page itself,
//! each command run by `bash` in order, with the hosts it names pointing at three clusters of
//! the test's own, each with the two roles of docs/operations.md ("Two roles"); `serve` is
//! started as written (plus a free port and an address file) and must serve each namespace
//! from the cluster its rule names.

use crate::support::process::{run_as_written, serve_as_written};
use crate::support::written::commands_marked;

use super::*;

const MARK: &str = "<!-- run as written by tests/api/clusters/guide.rs -->";

/// The two roles and the database the guide expects, on `node`.
async fn roles_and_database(node: &Node) {
    let mut connection = node.connect("postgres").await;
    for statement in [
        "CREATE ROLE idempotency_migrator LOGIN".to_owned(),
        "CREATE ROLE idempotency_service LOGIN".to_owned(),
        format!("CREATE DATABASE {DATABASE} OWNER idempotency_migrator"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
            .execute(&mut connection)
            .await
            .unwrap_or_else(|error| panic!("{statement} on {}: {error}", node.name));
    }
}

#[tokio::test]
async fn the_scaling_guide_works_as_written() {
    let commands = commands_marked("docs/scaling.md", MARK);
    assert_eq!(commands.len(), 2, "migrate, serve: {commands:#?}");
    let clusters = Clusters::start(&["main", "orders", "billing"]).await;
    for node in &clusters.nodes {
        roles_and_database(node).await;
    }
    let environment = [
        ("MAIN_HOST", clusters.nodes[0].host()),
        ("ORDERS_HOST", clusters.nodes[1].host()),
        ("BILLING_HOST", clusters.nodes[2].host()),
    ];
    let (serve, setup) = commands.split_last().expect("commands");
    run_as_written(setup, &environment).await;
    let server = serve_as_written(serve, &environment).await;
    let client = server.client_when_serving().await;
    let placed = [("misc", 0), ("orders-eu", 1), ("billing", 2)];
    for (namespace, _) in placed {
        lifecycle(&client, namespace, &unique_key(namespace), b"placed").await;
    }
    for (namespace, at) in placed {
        for (node_at, node) in clusters.nodes.iter().enumerate() {
            let expected = i64::from(node_at == at);
            assert_eq!(
                keys_on(node, namespace).await,
                expected,
                "{namespace} on {}",
                node.name
            );
        }
    }
}
