//! docs/scaling.md run as written: the block it marks as run here, read from the page itself,
//! each command run by `bash` in order, with the hosts it names pointing at three clusters of
//! the test's own, each with the two roles of docs/operations.md ("Two roles"); `serve` is
//! started as written (plus a free port and an address file) and must serve each namespace
//! from the cluster its rule names.

use idempotency_coordinator::proto::idempotency::v1::admin_service_client::AdminServiceClient;

use crate::support::process::{
    ServerProcess, both_outputs, guide_shell, run_as_written, serve_as_written,
};
use crate::support::written::commands_marked;

use super::*;

const MARK: &str = "<!-- run as written by tests/api/clusters/guide.rs -->";

/// The move, run once the replicas serve.
const MOVE_MARK: &str =
    "<!-- run as written by tests/api/clusters/guide.rs, once the replicas serve -->";

/// The rollback, run once a move back to main was interrupted after its fence.
const ROLLBACK_MARK: &str =
    "<!-- run as written by tests/api/clusters/guide.rs, after a move is interrupted -->";

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

/// What `admin placement show --namespace misc` says, as JSON.
async fn placement_shown(environment: &[(&str, String)]) -> serde_json::Value {
    let output = guide_shell(
        "idempotency-coordinator admin --output json placement show --namespace misc",
        environment,
    )
    .output()
    .await
    .expect("bash");
    assert!(output.status.success(), "{}", both_outputs(&output));
    serde_json::from_slice(&output.stdout).expect("JSON")
}

#[tokio::test]
async fn the_scaling_guide_works_as_written() {
    let commands = commands_marked("docs/scaling.md", MARK);
    assert_eq!(commands.len(), 2, "migrate, serve: {commands:#?}");
    let moving = commands_marked("docs/scaling.md", MOVE_MARK);
    assert_eq!(moving.len(), 3, "move, show, stats: {moving:#?}");
    let rolling_back = commands_marked("docs/scaling.md", ROLLBACK_MARK);
    assert_eq!(rolling_back.len(), 2, "show, rollback: {rolling_back:#?}");
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

    // The move, as the serving role: misc goes from main to orders.
    let kept = unique_key("kept");
    lifecycle(&client, "misc", &kept, b"kept").await;
    let with_admin = |server: &ServerProcess| {
        let mut environment = environment.to_vec();
        environment.push(("IDEMPOTENCY_ADMIN_COORDINATOR", server.endpoint()));
        environment
    };
    run_as_written(&moving, &with_admin(&server)).await;
    let shown = placement_shown(&with_admin(&server)).await;
    assert_eq!(
        (
            shown["served_by"].as_str(),
            shown["placed_by_rules"].as_str()
        ),
        (Some("orders"), Some("main")),
        "{shown}"
    );
    assert_eq!(shown["gates"][0]["state"], "left", "{shown}");
    assert_eq!(
        (
            keys_on(&clusters.nodes[0], "misc").await,
            keys_on(&clusters.nodes[1], "misc").await
        ),
        (0, 2)
    );
    let replay = expect_completed(try_start_response(&client, try_start_in("misc", &kept)).await);
    assert_eq!(replay.response, b"kept");

    // A move back to main, its replica killed while the drain waits for a transaction on
    // orders; the replica started again as written; the rollback as written.
    let mut old = clusters.nodes[1].connect(DATABASE).await;
    sqlx::raw_sql("BEGIN; SELECT txid_current()")
        .execute(&mut old)
        .await
        .expect("an open transaction");
    let call = {
        let endpoint = server.endpoint();
        tokio::spawn(async move {
            AdminServiceClient::connect(endpoint)
                .await
                .expect("the admin API")
                .move_placement(pb::MovePlacementRequest {
                    namespace: "misc".into(),
                    to: "main".into(),
                    rollback: false,
                    reason: "back".into(),
                })
                .await
        })
    };
    eventually(
        std::time::Duration::from_secs(20),
        "orders is fenced",
        || async {
            let mut connection = clusters.nodes[1].connect(DATABASE).await;
            let state: Option<(String,)> = sqlx::query_as(
                "SELECT state FROM idempotency_placement_gates WHERE scope = 'misc'",
            )
            .fetch_optional(&mut connection)
            .await
            .expect("the gates");
            state.is_some_and(|(state,)| state == "leaving")
        },
    )
    .await;
    server.signal("KILL");
    assert!(call.await.expect("the move's call").is_err());
    sqlx::Connection::close(old)
        .await
        .expect("the transaction ends");
    let server = serve_as_written(serve, &environment).await;
    let client = server.client_when_serving().await;
    let fenced = placement_shown(&with_admin(&server)).await;
    assert_eq!(
        (
            fenced["served_by"].as_str(),
            fenced["moving_from"].as_str(),
            fenced["moving_to"].as_str()
        ),
        (Some(""), Some("orders"), Some("main")),
        "{fenced}"
    );
    run_as_written(&rolling_back, &with_admin(&server)).await;
    let replay = expect_completed(try_start_response(&client, try_start_in("misc", &kept)).await);
    assert_eq!(replay.response, b"kept");
    assert_eq!(
        (
            keys_on(&clusters.nodes[0], "misc").await,
            keys_on(&clusters.nodes[1], "misc").await
        ),
        (0, 2)
    );
}
