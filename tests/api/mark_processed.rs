use std::collections::HashMap;

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{EventId, EventRetention, MarkProcessedCommand, Scope};
use idempotency_coordinator::proto::idempotency::v1::MarkProcessedRequest;
use idempotency_coordinator::store::Store;

use crate::support::*;

async fn new_events_are_recorded_and_repeats_report_the_first_processing(backend: Backend) {
    let (_app, client) = app_and_client(backend).await;
    let first = mark_results(&client, mark("billing", &["evt-1", "evt-2"])).await;
    assert_eq!(first.len(), 2);
    assert!(first.iter().all(|r| !r.already_processed));

    let second = mark_results(&client, mark("billing", &["evt-3", "evt-2", "evt-1"])).await;
    let ids: Vec<&str> = second.iter().map(|r| r.event_id.as_str()).collect();
    assert_eq!(
        ids,
        ["evt-3", "evt-2", "evt-1"],
        "results keep request order"
    );
    let already: Vec<bool> = second.iter().map(|r| r.already_processed).collect();
    assert_eq!(already, [false, true, true]);
    assert_eq!(second[1].processed_at, first[1].processed_at);
    assert_eq!(second[2].processed_at, first[0].processed_at);
}

async fn an_id_twice_in_one_request_is_new_the_first_time_only(backend: Backend) {
    let (app, client) = app_and_client(backend).await;
    let results = mark_results(&client, mark("billing", &["a", "b", "a", "a", "b"])).await;
    let already: Vec<bool> = results.iter().map(|r| r.already_processed).collect();
    assert_eq!(already, [false, false, true, true, true]);
    assert_eq!(results[0].processed_at, results[2].processed_at);
    assert_eq!(results[1].processed_at, results[4].processed_at);
    assert_eq!(app.count_rows("processed_events").await, 2);
}

async fn consumers_are_separate_scopes(backend: Backend) {
    let (_app, client) = app_and_client(backend).await;
    mark_results(&client, mark("billing", &["evt"])).await;
    let other = mark_results(&client, mark("shipping", &["evt"])).await;
    assert!(!other[0].already_processed);
}

async fn a_full_batch_of_a_thousand_ids_is_recorded_at_once(backend: Backend) {
    let (_app, client) = app_and_client(backend).await;
    let ids: Vec<String> = (0..1000).map(|i| format!("event-{i:04}")).collect();
    let request = MarkProcessedRequest {
        consumer: "bulk".into(),
        event_ids: ids.clone(),
        retention: None,
    };
    let results = mark_results(&client, request.clone()).await;
    assert_eq!(results.len(), 1000);
    assert!(
        results
            .iter()
            .zip(&ids)
            .all(|(r, id)| &r.event_id == id && !r.already_processed)
    );
    let again = mark_results(&client, request).await;
    assert!(again.iter().all(|r| r.already_processed));
}

async fn concurrent_overlapping_batches_record_each_event_exactly_once(backend: Backend) {
    let (_app, client) = app_and_client(backend).await;
    // Eight callers mark the same 200 ids, each in its own order.
    let calls = (0..8u64).map(|caller| {
        let client = client.clone();
        tokio::spawn(async move {
            let mut ids: Vec<String> = (0..200).map(|i| format!("evt-{i}")).collect();
            ids.rotate_left(usize::try_from(caller * 25).expect("small"));
            if caller % 2 == 1 {
                ids.reverse();
            }
            mark_results(
                &client,
                MarkProcessedRequest {
                    consumer: "race".into(),
                    event_ids: ids,
                    retention: None,
                },
            )
            .await
        })
    });
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    let mut processed_at = HashMap::new();
    for results in futures::future::join_all(calls).await {
        for result in results.expect("task") {
            if !result.already_processed {
                *first_seen.entry(result.event_id.clone()).or_default() += 1;
            }
            let at = processed_at
                .entry(result.event_id.clone())
                .or_insert(result.processed_at);
            assert_eq!(
                *at, result.processed_at,
                "everyone sees the first processing"
            );
        }
    }
    assert_eq!(first_seen.len(), 200, "every event was new to someone");
    assert!(
        first_seen.values().all(|&n| n == 1),
        "and to exactly one caller"
    );
}

async fn marking_again_does_not_renew_retention(backend: Backend) {
    let (app, client) = app_and_client(backend).await;
    mark_results(&client, mark("billing", &["evt"]).with_retention(secs(60))).await;
    let before = app.database.event_expires_at("evt").await;
    mark_results(
        &client,
        mark("billing", &["evt"]).with_retention(secs(3600)),
    )
    .await;
    assert_eq!(app.database.event_expires_at("evt").await, before);
}

async fn the_default_event_retention_is_seven_days(backend: Backend) {
    let (app, client) = app_and_client(backend).await;
    mark_results(&client, mark("billing", &["evt"])).await;
    let retained =
        app.database.event_expires_at("evt").await - app.database.event_processed_at("evt").await;
    assert_eq!(retained, chrono::Duration::days(7));
}

async fn duplicates_of_a_live_id_are_all_already_processed_and_of_an_expired_id_new_once(
    backend: Backend,
) {
    let (app, client) = app_and_client(backend).await;
    mark_results(
        &client,
        mark("billing", &["live", "expiring"]).with_retention(secs(1)),
    )
    .await;
    app.database.keep_event_for_an_hour("live").await;
    let expiry = app.database.event_expires_at("expiring").await;
    wait_for_db_clock_past(&app, expiry, "one event expired").await;

    let results = mark_results(
        &client,
        mark("billing", &["live", "expiring", "live", "expiring"]),
    )
    .await;
    let already: Vec<bool> = results.iter().map(|r| r.already_processed).collect();
    assert_eq!(already, [true, false, true, true]);
    assert_eq!(results[1].processed_at, results[3].processed_at);
}

/// Calls of several consumers and retentions sharing one batch: each call's ids are judged as
/// if the calls came one after another, and each id is kept for the retention of the call that
/// recorded it.
async fn a_shared_batch_of_marks_answers_each_call_as_if_alone(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let hour = std::time::Duration::from_secs(3600);
    let command =
        |consumer: &str, ids: &[&str], retention: std::time::Duration| MarkProcessedCommand {
            consumer: Scope::parse(consumer.into()).expect("consumer"),
            event_ids: ids
                .iter()
                .map(|id| EventId::parse((*id).into()).expect("event id"))
                .collect(),
            retention: EventRetention::parse(retention).expect("retention"),
        };
    let answers = app
        .store
        .mark_processed_batch(
            &Round::new(vec![
                command("billing", &["x", "y"], hour),
                command("shipping", &["w", "x"], 2 * hour),
                command("billing", &["y", "z", "z"], 3 * hour),
            ])
            .expect("marks never conflict"),
        )
        .await;
    let seen: Vec<Vec<(String, bool)>> = answers
        .into_iter()
        .map(|answer| {
            answer
                .expect("marked")
                .into_iter()
                .map(|event| (event.event_id, event.already_processed))
                .collect()
        })
        .collect();
    let expected = |pairs: &[(&str, bool)]| -> Vec<(String, bool)> {
        pairs
            .iter()
            .map(|(id, seen)| ((*id).to_owned(), *seen))
            .collect()
    };
    assert_eq!(
        seen,
        vec![
            expected(&[("x", false), ("y", false)]),
            expected(&[("w", false), ("x", false)]),
            expected(&[("y", true), ("z", false), ("z", true)]),
        ]
    );
    for (id, retention) in [("y", hour), ("w", 2 * hour), ("z", 3 * hour)] {
        let kept =
            app.database.event_expires_at(id).await - app.database.event_processed_at(id).await;
        assert_eq!(
            kept.to_std().expect("positive"),
            retention,
            "{id} is kept for the retention of the call that recorded it"
        );
    }
}

for_each_backend!(
    a_shared_batch_of_marks_answers_each_call_as_if_alone,
    new_events_are_recorded_and_repeats_report_the_first_processing,
    an_id_twice_in_one_request_is_new_the_first_time_only,
    consumers_are_separate_scopes,
    a_full_batch_of_a_thousand_ids_is_recorded_at_once,
    concurrent_overlapping_batches_record_each_event_exactly_once,
    marking_again_does_not_renew_retention,
    the_default_event_retention_is_seven_days,
    duplicates_of_a_live_id_are_all_already_processed_and_of_an_expired_id_new_once,
);
