//! The coalescers' queues (depth and their own refusals) and the reaper's lag.

use super::*;

async fn a_full_queue_shows_in_its_depth_and_its_own_refusals(backend: Backend) {
    // One executor, batches of one: the TryStart coalescer takes 16 calls, queued or running.
    let (app, client) = metered(
        backend,
        &[
            "--coalesce-executors",
            "1",
            "--coalesce-max-batch",
            "1",
            "--operation-timeout",
            "30s",
        ],
    )
    .await;
    let depth = "idempotency_coalescer_queue_depth{coalescer=\"TryStart\"}";
    let before = samples(&scrape(&app).await);
    assert_eq!(value(&before, depth), 0.0);
    assert_eq!(
        value(
            &before,
            "idempotency_coalescer_queue_capacity{coalescer=\"TryStart\"}"
        ),
        16.0
    );

    // The executor is kept busy by a claim whose statement the database does not answer (a
    // key held from outside would not do: its claim leaves the shared path after 20 ms, see
    // `held_keys`); 15 more calls queue.
    claim(&mut client.clone(), try_start(&unique_key("warm"))).await;
    let stall = app.database.stall_writes().await;
    let mut calls = vec![spawn_try_start(&client, try_start(&unique_key("stalled")))];
    series_reaches(&app, depth, 1.0).await;
    for _ in 1..16 {
        calls.push(spawn_try_start(&client, try_start(&unique_key("queued"))));
    }
    series_reaches(&app, depth, 16.0).await;
    let one_too_many = client
        .clone()
        .try_start(try_start(&unique_key("one-too-many")))
        .await;
    assert_refused(one_too_many, Code::Unavailable, "STORE_UNAVAILABLE");
    stall.end().await;
    // A queued TryStart is answered once the store is free.
    for call in calls {
        answer_of(call).await;
    }
    series_reaches(&app, depth, 0.0).await;
    let after = samples(&scrape(&app).await);
    assert_values(
        &after,
        &[
            (
                "idempotency_coalescer_refusals_total{coalescer=\"TryStart\"}",
                1.0,
            ),
            (
                "idempotency_refusals_total{rpc=\"TryStart\",reason=\"STORE_UNAVAILABLE\"}",
                1.0,
            ),
        ],
    );
}

async fn the_reapers_lag_is_the_age_of_what_it_could_not_delete(backend: Backend) {
    let (app, _client) = metered(backend, &["--reaper-interval", "100ms"]).await;
    let keys = "idempotency_reaper_lag_seconds{table=\"keys\"}";
    let events = "idempotency_reaper_lag_seconds{table=\"events\"}";
    // Nothing expired: no lag.
    series_reaches(&app, keys, 0.0).await;
    series_reaches(&app, events, 0.0).await;

    // Rows that expired an hour ago, one of them held from outside so that the reaper cannot
    // delete it (PostgreSQL skips the locked row; SQLite's whole write waits and gives up).
    app.database.insert_expired_keys("lagging", 3).await;
    app.database.insert_expired_events(2).await;
    let hold = app.database.hold_key("lagging1").await;
    let hour = 3600.0;
    eventually(
        Duration::from_secs(20),
        "the keys' lag shows the held row's age",
        || async {
            samples(&scrape(&app).await)
                .get(keys)
                .is_some_and(|lag| (hour..hour + 120.0).contains(lag))
        },
    )
    .await;
    let lag = samples(&scrape(&app).await);
    match backend {
        // Only the held key was left: its siblings and the events were deleted.
        // (The lag can show before the pass that deletes them: a pass reads the backlog after
        // its deletes, and rows inserted in between are its backlog, the next pass's work.)
        Backend::Postgres => {
            eventually(
                Duration::from_secs(20),
                "only the held key is left",
                || async { app.database.count_rows("idempotency_keys").await == 1 },
            )
            .await;
            series_reaches(&app, events, 0.0).await;
        }
        // Every write waits for the held lock, so nothing was deleted.
        Backend::Sqlite => assert!(lag.get(events).is_some_and(|lag| *lag >= hour), "{lag:?}"),
    }

    hold.release().await;
    series_reaches(&app, keys, 0.0).await;
    series_reaches(&app, events, 0.0).await;
    assert_eq!(app.database.count_rows("idempotency_keys").await, 0);
}

for_each_backend!(
    a_full_queue_shows_in_its_depth_and_its_own_refusals,
    the_reapers_lag_is_the_age_of_what_it_could_not_delete
);
