use std::time::Duration;

use idempotency_coordinator::store::Store;
use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::*;

async fn expires_at(app: &TestApp, key: &str) -> chrono::DateTime<chrono::Utc> {
    app.database.key_expires_at(key).await
}

async fn an_expired_key_is_absent_for_every_rpc_before_the_reaper_runs(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("expired");
    let started = claim(&mut client, short_lived(&key).with_lease(millis(200))).await;
    let old_life = extend(&key, started.lease_token)
        .with_lease(millis(200))
        .with_checkpoint(Some(b"old life"));
    extend_response(&client, old_life).await;
    let expiry = expires_at(&app, &key).await;
    wait_for_db_clock_past(&app, expiry, "the key's retention ran out").await;
    assert_eq!(
        app.count_rows("idempotency_keys").await,
        1,
        "the row is still there"
    );

    assert!(is_absent(&client, &key).await);
    let token = started.lease_token;
    assert_guarded_writes_refused(&client, &key, token, Code::NotFound, "KEY_NOT_FOUND").await;

    // TryStart claims it afresh, even with another fingerprint, with nothing of its old life.
    let fresh = claim(
        &mut client,
        try_start(&key).with_fingerprint(b"a new request"),
    )
    .await;
    assert_eq!(fresh.attempt, 1);
    assert_eq!(fresh.checkpoint, None);
    assert!(fresh.lease_token > token);
}

async fn a_completed_key_expires_after_its_retention(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("completed-expiry");
    let started = claim(&mut client, try_start(&key)).await;
    let short = complete(&key, started.lease_token, b"short-lived").with_retention(secs(1));
    let completion = complete_response(&client, short).await;
    let expiry = instant(&completion.expires_at);
    wait_for_db_clock_past(&app, expiry, "the completed key expired").await;
    let fresh = claim(&mut client, try_start(&key)).await;
    assert_eq!(
        fresh.attempt, 1,
        "the replay is gone and the key is claimable"
    );
}

async fn retention_is_stretched_to_cover_the_lease(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("stretch");
    let long_lease = try_start(&key)
        .with_retention(secs(1))
        .with_lease(secs(120));
    let started = claim(&mut client, long_lease).await;
    assert_eq!(
        expires_at(&app, &key).await,
        instant(&started.lease_expires_at)
    );
}

async fn a_takeover_keeps_the_later_of_the_old_expiry_and_its_own_retention(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("takeover-retention");
    let with_retention = |retention| {
        try_start(&key)
            .with_retention(secs(retention))
            .with_lease(millis(SHORT_LEASE_MS))
    };
    claim(&mut client, with_retention(3600)).await;
    let original = expires_at(&app, &key).await;
    wait_for_lease_expiry(&app, &client, &key).await;
    claim(&mut client, with_retention(60)).await;
    assert_eq!(
        expires_at(&app, &key).await,
        original,
        "a shorter retention keeps the old expiry"
    );

    wait_for_lease_expiry(&app, &client, &key).await;
    let before = app.db_now().await;
    claim(&mut client, with_retention(7200)).await;
    assert!(expires_at(&app, &key).await >= before + chrono::Duration::seconds(7200));
}

async fn an_expired_event_is_new_again(backend: Backend) {
    let (app, client) = app_and_client(backend).await;
    let first = mark_results(&client, mark("billing", &["evt"]).with_retention(secs(1))).await;
    let expiry = app.database.event_expires_at("evt").await;
    wait_for_db_clock_past(&app, expiry, "the event's retention ran out").await;
    let again = mark_results(&client, mark("billing", &["evt"])).await;
    assert!(!again[0].already_processed);
    assert!(instant(&again[0].processed_at) > instant(&first[0].processed_at));
}

async fn the_reaper_deletes_expired_rows_in_bounded_batches_and_spares_live_ones(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    app.database.insert_expired_keys("old-", 25).await;
    let live = unique_key("live");
    claim(&mut client, try_start(&live)).await;

    let batches = [
        app.store.reap_expired_keys(10).await.expect("reap"),
        app.store.reap_expired_keys(10).await.expect("reap"),
        app.store.reap_expired_keys(10).await.expect("reap"),
        app.store.reap_expired_keys(10).await.expect("reap"),
    ];
    assert_eq!(batches, [10, 10, 5, 0]);
    assert_eq!(app.count_rows("idempotency_keys").await, 1);
    expect_held_by_another(&client, &live).await;
}

/// PostgreSQL only: several replicas reap one database side by side, which needs row locks that
/// a reaper skips. The embedded store has one instance and one writer, so no reaper meets
/// another's rows.
#[tokio::test]
async fn the_reaper_skips_rows_another_transaction_holds() {
    let app = TestApp::spawn(Backend::Postgres).await;
    app.database.insert_expired_keys("old-", 10).await;
    let mut holder = raw::transaction(&app.database.url).await;
    raw::lock_key(&mut holder, "old-1").await;
    raw::lock_key(&mut holder, "old-2").await;

    // Another replica's reaper does not wait for the locked rows; it takes the rest.
    let deleted = tokio::time::timeout(Duration::from_secs(5), app.store.reap_expired_keys(100))
        .await
        .expect("the reaper does not block on locked rows")
        .expect("reap");
    assert_eq!(deleted, 8);
    raw::run(&mut holder, "ROLLBACK").await;
    assert_eq!(app.store.reap_expired_keys(100).await.expect("reap"), 2);
}

async fn the_background_reaper_clears_expired_keys_and_events(backend: Backend) {
    let (app, mut client) = app_and_client_with(
        backend,
        &["--reaper-interval", "50ms", "--reaper-batch-size", "7"],
    )
    .await;
    app.database.insert_expired_keys("old-", 30).await;
    app.database.insert_expired_events(30).await;
    let live = unique_key("live");
    claim(&mut client, try_start(&live)).await;
    mark_results(&client, mark("billing", &["kept"])).await;

    eventually(
        Duration::from_secs(10),
        "the reaper cleared the backlog",
        || async { app.total_rows().await == 2 },
    )
    .await;
    expect_held_by_another(&client, &live).await;
}

/// The background reaper (the binary's, as configured) deletes at most `--reaper-batch-size`
/// rows per statement, in keys and in events, and follows a full batch at once with the next:
/// read from its log line per statement.
async fn the_background_reaper_deletes_at_most_its_batch_size_per_statement(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let server = ServerProcess::start_with_log_level(
        &database.url,
        &["--reaper-interval", "50ms", "--reaper-batch-size", "7"],
        "info,idempotency_coordinator::reaper=debug",
    )
    .await;
    let _ = server.client_when_serving().await;
    database.insert_expired_keys("old-", 30).await;
    database.insert_expired_events(30).await;
    // The rows each statement deleted, by its log line (written once its statement committed).
    let batches = |table: &str| -> Vec<u64> {
        server
            .output()
            .lines()
            .filter(|line| {
                line.contains("reaped one batch") && line.contains(&format!("table=\"{table}\""))
            })
            .filter_map(|line| {
                line.split("deleted=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .filter(|deleted| *deleted > 0)
            .collect()
    };
    // Read the log once every deleted row is in it: the last line follows its commit, so the
    // table can be empty a moment before the line is written.
    eventually(
        Duration::from_secs(10),
        "the reaper cleared the backlog and logged every batch",
        || async {
            database.count_rows("idempotency_keys").await
                + database.count_rows("processed_events").await
                == 0
                && ["keys", "events"]
                    .iter()
                    .all(|table| batches(table).iter().sum::<u64>() >= 30)
        },
    )
    .await;
    for table in ["keys", "events"] {
        assert_eq!(
            batches(table),
            [7, 7, 7, 7, 2],
            "{table}: the rows each statement deleted"
        );
    }
}

async fn the_reaper_stops_between_batches_at_shutdown(backend: Backend) {
    let mut app = TestApp::spawn_with(
        backend,
        &["--reaper-interval", "10ms", "--reaper-batch-size", "1"],
    )
    .await;
    app.database.insert_expired_keys("old-", 3000).await;
    eventually(Duration::from_secs(10), "the reaper started", || async {
        app.count_rows("idempotency_keys").await < 3000
    })
    .await;
    let stopped = tokio::time::timeout(Duration::from_secs(5), app.stop()).await;
    assert!(
        matches!(stopped, Ok(Ok(()))),
        "the service stops promptly: {stopped:?}"
    );
    let left = app.count_rows("idempotency_keys").await;
    assert!(
        left > 0,
        "the reaper stopped instead of finishing its backlog"
    );
    // And it stopped for good: nothing more disappears.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(app.count_rows("idempotency_keys").await, left);
}

for_each_backend!(
    an_expired_key_is_absent_for_every_rpc_before_the_reaper_runs,
    a_completed_key_expires_after_its_retention,
    retention_is_stretched_to_cover_the_lease,
    a_takeover_keeps_the_later_of_the_old_expiry_and_its_own_retention,
    an_expired_event_is_new_again,
    the_reaper_deletes_expired_rows_in_bounded_batches_and_spares_live_ones,
    the_background_reaper_clears_expired_keys_and_events,
    the_background_reaper_deletes_at_most_its_batch_size_per_statement,
    the_reaper_stops_between_batches_at_shutdown,
);
