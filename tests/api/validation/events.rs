//! MarkProcessed's batch: 1 to 1000 event ids, bad ones named by index, and the retention
//! bounds.

use idempotency_coordinator::proto::idempotency::v1::MarkProcessedRequest;

use crate::support::*;

use super::{DAY, dur};

async fn event_ids_are_1_to_1000_and_bad_elements_are_named_by_index(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let status = client
        .mark_processed(mark("c", &[]))
        .await
        .expect_err("no ids");
    assert_invalid(&status, &["event_ids"]);

    let too_many: Vec<String> = (0..1001).map(|i| format!("e{i}")).collect();
    let status = client
        .mark_processed(MarkProcessedRequest {
            consumer: "c".into(),
            event_ids: too_many,
            retention: None,
        })
        .await
        .expect_err("1001 ids");
    assert_invalid(&status, &["event_ids"]);

    let long = "e".repeat(256);
    let status = client
        .mark_processed(mark("c", &["fine", "", "also fine", &long, "bell\u{7}"]))
        .await
        .expect_err("bad elements");
    assert_invalid(&status, &["event_ids[1]", "event_ids[3]", "event_ids[4]"]);
    assert_eq!(
        app.total_rows().await,
        0,
        "one bad id refuses the whole batch"
    );

    let longest = "e".repeat(255);
    client
        .mark_processed(mark("c", &[&longest]))
        .await
        .expect("a 255-byte id");
}

async fn event_retention_is_1s_to_30d(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    for bad in [
        dur(0, 999_999_999),
        dur(30 * DAY as i64, 1),
        dur(0, 0),
        dur(-1, 0),
    ] {
        let status = client
            .mark_processed(MarkProcessedRequest {
                retention: bad,
                ..mark("c", &["e"])
            })
            .await
            .expect_err("bad retention");
        assert_invalid(&status, &["retention"]);
    }
    assert_eq!(app.total_rows().await, 0);
    for good in [dur(1, 0), dur(30 * DAY as i64, 0)] {
        client
            .mark_processed(MarkProcessedRequest {
                retention: good,
                ..mark("c", &["e"])
            })
            .await
            .expect("retention within bounds");
    }
}

for_each_backend!(
    event_ids_are_1_to_1000_and_bad_elements_are_named_by_index,
    event_retention_is_1s_to_30d,
);
