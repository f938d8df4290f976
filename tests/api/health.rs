use std::time::Duration;

use idempotency_coordinator::store::{AnyStore, Store, StoreLocation, StoreSettings};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::support::process::ServerProcess;
use crate::support::proxy::TcpProxy;
use crate::support::*;

const API: &str = "idempotency.v1.IdempotencyService";

async fn check(app: &TestApp, service: &str) -> Result<ServingStatus, tonic::Status> {
    let mut health = app.health().await;
    health
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|response| response.into_inner().status())
}

/// Asserts that Check answers `status` for the server as a whole ("") and for the API.
async fn assert_both_names_report(app: &TestApp, status: ServingStatus) {
    for service in ["", API] {
        assert_eq!(
            check(app, service).await.expect("Check"),
            status,
            "{service:?}"
        );
    }
}

async fn both_service_names_report_serving_once_the_store_is_ready(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    assert_both_names_report(&app, ServingStatus::Serving).await;
    let status = check(&app, "some.other.Service")
        .await
        .expect_err("unknown name");
    assert_eq!(status.code(), Code::NotFound);
}

async fn an_unmigrated_store_is_not_serving_until_migrate_runs_without_a_restart(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let app = TestApp::start_on(database, None, &["--no-migrate"]).await;

    // Give the monitor a few checks' time to prove it stays NOT_SERVING. Waiting on a state
    // that must not change has no condition to await.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_both_names_report(&app, ServingStatus::NotServing).await;
    let mut client = app.client().await;
    let status = client
        .try_start(try_start("k"))
        .await
        .expect_err("no schema yet");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
    assert!(
        !status.message().contains("relation"),
        "no SQL text: {status:?}"
    );

    // The real binary's `migrate` subcommand, as an operator would run it.
    let migrated = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .args(["migrate", "--database-url", &app.database.url])
        .output()
        .await
        .expect("run migrate");
    assert!(migrated.status.success(), "migrate failed: {migrated:?}");

    app.wait_for_status(ServingStatus::Serving).await;
    claim(&mut client, try_start("k")).await;
}

async fn the_service_creates_its_database_when_it_does_not_exist(backend: Backend) {
    let database = TestDatabase::planned(backend);
    let app = TestApp::start_on(database, None, &[]).await;
    app.wait_for_status(ServingStatus::Serving).await;
    let mut client = app.client().await;
    claim(&mut client, try_start("k")).await;
}

/// PostgreSQL only: a first start on a database that does not exist yet says nothing alarming.
/// It creates the database, and only then listens for other replicas' changes, instead of
/// warning that it cannot listen because the database does not exist.
#[tokio::test]
async fn a_first_start_on_a_new_postgres_database_warns_of_nothing() {
    let database = TestDatabase::planned(Backend::Postgres);
    let server = ServerProcess::start(&database.url, &[]).await;
    let mut client = server.client_when_serving().await;
    claim(&mut client, try_start("k")).await;
    let admin = sqlx::PgPool::connect(&database::admin_url())
        .await
        .expect("connect as the administrator");
    eventually(Duration::from_secs(20), "the service listens", || async {
        let (listening,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = $1 AND application_name = 'idempotency-coordinator listener'",
        )
        .bind(database.postgres_name())
        .fetch_one(&admin)
        .await
        .expect("read pg_stat_activity");
        listening == 1
    })
    .await;
    admin.close().await;
    let output = server.output();
    assert!(output.contains("created the database"), "{output}");
    assert!(
        !output.contains("WARN"),
        "a warning on a first start:\n{output}"
    );
}

/// PostgreSQL only, like the next test: the database is cut off by a proxy on its network
/// connection, which the embedded store, a file in the process, does not have.
#[tokio::test]
async fn losing_the_database_turns_health_not_serving_and_its_return_serving_again() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let url = proxy.database_url(database.postgres_name());
    let app = TestApp::start_on(database, Some(&url), &["--operation-timeout", "1s"]).await;
    app.wait_for_status(ServingStatus::Serving).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;

    proxy.cut();
    app.wait_for_status(ServingStatus::NotServing).await;
    assert_eq!(
        check(&app, API).await.expect("Check"),
        ServingStatus::NotServing
    );
    let status = client
        .complete(complete("k", started.lease_token, b"r"))
        .await
        .expect_err("store is gone");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");
    let details = tonic_types::StatusExt::get_error_details(&status);
    assert!(
        details.retry_info().is_some(),
        "UNAVAILABLE carries RetryInfo"
    );
    for leak in ["sqlx", "connection", "os error", "5432"] {
        assert!(
            !status.message().contains(leak),
            "driver text leaked: {status:?}"
        );
    }

    proxy.restore();
    app.wait_for_status(ServingStatus::Serving).await;
    client
        .complete(complete("k", started.lease_token, b"r"))
        .await
        .expect("Complete after the database returned");
}

#[tokio::test]
async fn a_service_started_while_the_database_is_down_serves_once_it_is_up() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().expect("address")).await;
    proxy.cut();
    let url = proxy.database_url(database.postgres_name());
    let app = TestApp::start_on(database, Some(&url), &["--operation-timeout", "1s"]).await;
    assert_eq!(
        check(&app, "").await.expect("Check"),
        ServingStatus::NotServing
    );

    proxy.restore();
    app.wait_for_status(ServingStatus::Serving).await;
    let mut client = app.client().await;
    claim(&mut client, try_start("k")).await;
}

async fn shutdown_tells_watchers_not_serving_ends_their_streams_and_refuses_new_calls(
    backend: Backend,
) {
    let mut app = TestApp::spawn(backend).await;
    let mut health = app.health().await;
    let mut watch = health
        .watch(HealthCheckRequest {
            service: API.into(),
        })
        .await
        .expect("Watch")
        .into_inner();
    let first = watch
        .message()
        .await
        .expect("stream")
        .expect("a first status");
    assert_eq!(first.status(), ServingStatus::Serving);

    app.begin_shutdown();
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("told promptly")
        .expect("stream")
        .expect("a status before the end");
    assert_eq!(next.status(), ServingStatus::NotServing);
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("ended promptly");
    assert!(matches!(end, Ok(None)), "the stream ends: {end:?}");

    // The drain does not wait for the grace period (10 s in tests) because of the watcher.
    let stopped = tokio::time::timeout(Duration::from_secs(5), app.stop()).await;
    assert!(
        matches!(stopped, Ok(Ok(()))),
        "stopped promptly: {stopped:?}"
    );
    let refused = health_client(app.endpoint()).await;
    assert!(
        refused.is_err(),
        "new connections are refused after shutdown"
    );
}

async fn store_probe_requires_the_full_schema(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let location = StoreLocation::from_url(&database.url).expect("a store URL");
    let store = AnyStore::open_lazy(&StoreSettings {
        notify_url: None,
        pooler: Default::default(),
        location,
        pool_size: 2,
        concurrent_statements: 2,
        operation_timeout: Duration::from_secs(5),
        require_synchronous_standby: false,
        credentials: Default::default(),
        notify_credentials: Default::default(),
        migration_lock_timeout:
            idempotency_coordinator::store::postgres::DEFAULT_MIGRATION_LOCK_TIMEOUT,
    })
    .expect("store");
    assert!(store.probe().await.is_err(), "no schema yet");
    store.migrate().await.expect("migrate");
    store.probe().await.expect("migrated");
    store.migrate().await.expect("migrating twice is harmless");
}

async fn watching_an_unknown_service_answers_service_unknown_until_shutdown(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut health = app.health().await;
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect("Watch")
        .into_inner();
    let first = watch.message().await.expect("stream").expect("a status");
    assert_eq!(first.status(), ServingStatus::ServiceUnknown);
    app.begin_shutdown();
    let end = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("ended promptly");
    assert!(
        matches!(end, Ok(None)),
        "the stream ends at shutdown: {end:?}"
    );
}

async fn a_busy_pool_does_not_make_the_service_look_unhealthy(backend: Backend) {
    // The smallest pool each store accepts (PostgreSQL's leaves room for held keys: 4), its
    // calls waiting on a row lock: the health probe has a connection of its own, so health
    // stays SERVING.
    let pool_size = match backend {
        Backend::Postgres => "4",
        Backend::Sqlite => "1",
    };
    let (app, mut client) = app_and_client_with(
        backend,
        &["--pool-size", pool_size, "--operation-timeout", "4s"],
    )
    .await;
    let (lock, calls) =
        completes_behind_a_held_row(&app, &mut client, &unique_key("busy"), 3).await;
    app.wait_for_blocked(1).await;
    // Fifteen health checks over 1.5 s, against probes every 100 ms whose pool would be
    // exhausted for longer than their connection wait if they shared it.
    for _ in 0..15 {
        assert_eq!(
            check(&app, "").await.expect("Check"),
            ServingStatus::Serving
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lock.release().await;
    for call in calls {
        let _ = call.await.expect("task");
    }
}

for_each_backend!(
    both_service_names_report_serving_once_the_store_is_ready,
    an_unmigrated_store_is_not_serving_until_migrate_runs_without_a_restart,
    the_service_creates_its_database_when_it_does_not_exist,
    shutdown_tells_watchers_not_serving_ends_their_streams_and_refuses_new_calls,
    store_probe_requires_the_full_schema,
    watching_an_unknown_service_answers_service_unknown_until_shutdown,
    a_busy_pool_does_not_make_the_service_look_unhealthy,
);
