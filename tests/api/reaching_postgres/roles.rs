//! Two roles, as docs/operations.md ("Two roles") sets them up: the migrating role owns the
//! database and its schema, and `migrate --grant-to` gives the serving role exactly the rights
//! the statements need; `serve` as that role passes the contract (the scenario vectors every
//! client runs, the admin API, the reaper, waiting across replicas) and says which right is
//! missing when one is.

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use super::{migrate, not_serving, says};
use crate::admin::{erase_key, erase_namespace, force_release};
use crate::rust_client::scenarios::every_scenario_holds_at;
use crate::support::process::ServerProcess;
use crate::support::tls_cluster::Cluster;
use crate::support::*;

const DB: &str = "idempotency";

/// The commands of docs/operations.md, "Two roles", run as the database's administrator.
const ROLES: &str = "CREATE ROLE idempotency_migrator LOGIN PASSWORD 'migrator-pw'; \
    CREATE ROLE idempotency_service LOGIN PASSWORD 'service-pw'; \
    CREATE DATABASE idempotency OWNER idempotency_migrator";

/// Whether `key`'s row in the service's database is marked watched (read as the cluster's
/// administrator), or `None` when the key has no row.
async fn row_watched(cluster: &Cluster, key: &str) -> Option<bool> {
    let mut connection = cluster.connect(DB).await;
    let row: Option<(bool,)> =
        sqlx::query_as("SELECT watched FROM idempotency_keys WHERE key = $1")
            .bind(key)
            .fetch_optional(&mut connection)
            .await
            .expect("the key's row");
    row.map(|(watched,)| watched)
}

/// A cluster with the two roles, migrated by the migrating role, which granted the service's
/// rights; answers it and the service role's URL.
async fn migrated_with_two_roles() -> (Cluster, String) {
    let cluster = Cluster::tls().await;
    for statement in ROLES.split("; ") {
        cluster.admin(statement).await;
    }
    let verify = format!(
        "sslmode=verify-full&sslrootcert={}",
        cluster.certificates.ca.display()
    );
    let migrator = cluster.url("idempotency_migrator:migrator-pw", "localhost", DB, &verify);
    migrate(&migrator, &["--grant-to", "idempotency_service"]).await;
    let service = cluster.url("idempotency_service:service-pw", "localhost", DB, &verify);
    (cluster, service)
}

/// What the serving role may do on the schema, from the catalogue: it owns nothing and may
/// create nothing.
async fn owns_and_may_create(cluster: &Cluster) -> (i64, bool) {
    let mut connection = cluster.connect(DB).await;
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner \
                 WHERE r.rolname = 'idempotency_service'), \
                has_schema_privilege('idempotency_service', 'public', 'CREATE')",
    )
    .fetch_one(&mut connection)
    .await
    .expect("the catalogue")
}

#[tokio::test]
async fn the_serving_role_passes_the_contract_with_only_the_rights_it_was_granted() {
    let (cluster, service_url) = migrated_with_two_roles().await;
    assert_eq!(
        owns_and_may_create(&cluster).await,
        (0, false),
        "the serving role owns nothing and may not create"
    );
    // Default settings (migrations at start included: with nothing to apply, none is asked
    // of the role), and a second replica so that waiting crosses replicas through LISTEN.
    let server = ServerProcess::start(&service_url, &[]).await;
    let replica = ServerProcess::start(&service_url, &[]).await;
    let mut client = server.client_when_serving().await;
    let other = replica.client_when_serving().await;
    every_scenario_holds_at(server.addr).await;

    // A waiter on the replica is woken by a Complete through the first (NOTIFY, LISTEN).
    let key = unique_key("waited");
    let started = claim(&mut client, try_start(&key)).await;
    let mut waiting = other.clone();
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            waiting
                .try_start(try_start(&key).with_wait(Duration::from_secs(10)))
                .await
        }
    });
    // The waiter's look marks the key watched before it sleeps: its Complete is announced.
    eventually(
        Duration::from_secs(10),
        "the waiter watches the key",
        || async { row_watched(&cluster, &key).await == Some(true) },
    )
    .await;
    complete_key(&client, &key, started.lease_token, b"woken").await;
    let woken = waiter
        .await
        .expect("the waiter")
        .expect("its answer")
        .into_inner();
    assert_eq!(expect_completed(woken).response, b"woken");

    // MarkProcessed, and the reaper deleting what expired (a replica of its own, so that the
    // scenarios above ran with the service's defaults).
    let events = mark_results(&client, mark("consumer", &["e-1"])).await;
    assert_eq!(events.len(), 1);
    let _reaper = ServerProcess::start(&service_url, &["--reaper-interval", "100ms"]).await;
    let short = unique_key("short");
    let claimed = claim(&mut client, try_start(&short).with_retention(secs(1))).await;
    complete_key(&client, &short, claimed.lease_token, b"brief").await;
    eventually(
        Duration::from_secs(10),
        "the reaper deletes the expired key",
        || async { row_watched(&cluster, &short).await.is_none() },
    )
    .await;

    // The admin API: a force-release, an erasure, a namespace erased, all audited.
    let admin = pb::admin_service_client::AdminServiceClient::connect(server.endpoint())
        .await
        .expect("the admin API");
    let held = unique_key("held");
    claim(&mut client, try_start(&held)).await;
    admin
        .clone()
        .force_release(force_release(&held, "stuck"))
        .await
        .expect("ForceRelease");
    admin
        .clone()
        .erase_key(erase_key(&key, "asked to forget"))
        .await
        .expect("EraseKey");
    let erased = erase_namespace(&admin, NAMESPACE, 100).await;
    assert!(erased.last().is_some_and(|last| last.done), "{erased:?}");
    assert!(!server.output().contains("lacks rights"));
}

#[tokio::test]
async fn a_missing_right_is_named_at_start_and_a_grant_is_taken_up_without_a_restart() {
    let (cluster, service_url) = migrated_with_two_roles().await;
    cluster
        .run_in(
            DB,
            "REVOKE DELETE ON idempotency_keys FROM idempotency_service",
        )
        .await;
    cluster
        .run_in(
            DB,
            "REVOKE USAGE ON SEQUENCE lease_token_seq FROM idempotency_service",
        )
        .await;
    let server = ServerProcess::start(&service_url, &[]).await;
    let line = says(&server, "lacks rights the service needs").await;
    assert!(
        line.contains(
            "role \"idempotency_service\" lacks rights the service needs: DELETE on \
             idempotency_keys, USAGE on lease_token_seq"
        ) && line.contains("migrate --grant-to idempotency_service"),
        "{line}"
    );
    not_serving(&server).await;
    cluster
        .run_in(
            DB,
            "GRANT DELETE ON idempotency_keys TO idempotency_service; \
             GRANT USAGE ON SEQUENCE lease_token_seq TO idempotency_service",
        )
        .await;
    let mut client = server.client_when_serving().await;
    claim_and_complete(&mut client, &unique_key("granted"), b"ok").await;
}

#[tokio::test]
async fn a_serving_role_that_may_not_migrate_says_so() {
    let cluster = Cluster::tls().await;
    for statement in ROLES.split("; ") {
        cluster.admin(statement).await;
    }
    let url = cluster.url(
        "idempotency_service:service-pw",
        "localhost",
        DB,
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            cluster.certificates.ca.display()
        ),
    );
    let server = ServerProcess::start(&url, &[]).await;
    let line = says(&server, "the schema needs migrating and the role may not").await;
    assert!(
        line.contains("permission denied for schema public")
            && line.contains("idempotency-coordinator migrate"),
        "{line}"
    );
    not_serving(&server).await;
}
