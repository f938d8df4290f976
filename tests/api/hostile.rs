//! Hostile input against the real binary: a message far over the size limit is refused from its
//! length prefix without the server buffering it, and a barrage of malformed requests leaves the
//! server unharmed and the store untouched. (Field by field bounds are in `validation.rs`; the
//! edge's validation is fuzzed in `src/grpc/convert.rs`.)

use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::*;

/// A Complete carrying 256 MiB, against a 1 MiB limit.
const HUGE: usize = 256 * 1024 * 1024;

async fn a_huge_message_is_refused_before_it_is_buffered(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let server = ServerProcess::start(&database.url, &[]).await;
    let mut client = server.client_when_serving().await;
    let started = claim(&mut client, try_start("k")).await;
    let before = server.peak_rss_kib();

    let status = client
        .complete(complete("k", started.lease_token, &vec![b'x'; HUGE]))
        .await
        .expect_err("far over the limit");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    let grown_mib = server.peak_rss_kib().saturating_sub(before) / 1024;
    assert!(
        grown_mib < 32,
        "the server's peak memory grew by {grown_mib} MiB for a {} MiB message",
        HUGE / (1024 * 1024)
    );
    // Unharmed: the same claim completes normally afterwards.
    complete_key(&client, "k", started.lease_token, b"fine").await;
    println!(
        "hostile input ({backend:?}): a {} MiB message refused OUT_OF_RANGE; server peak memory \
         grew {grown_mib} MiB",
        HUGE / (1024 * 1024)
    );
}

async fn a_barrage_of_malformed_requests_writes_nothing_and_harms_nothing(backend: Backend) {
    use idempotency_coordinator::proto::idempotency::v1 as pb;
    let (app, mut client) = app_and_client(backend).await;
    let absurd = [
        prost_types::Duration {
            seconds: -5,
            nanos: 0,
        },
        prost_types::Duration {
            seconds: 0,
            nanos: 0,
        },
        prost_types::Duration {
            seconds: 1000 * 365 * 24 * 3600,
            nanos: 0,
        },
        prost_types::Duration {
            seconds: 1,
            nanos: -1,
        },
        prost_types::Duration {
            seconds: i64::MAX,
            nanos: 999_999_999,
        },
    ];
    let mut refused = 0;
    for duration in absurd {
        for key in ["", "nul\u{0}", &"k".repeat(10_000)] {
            let status = client
                .try_start(pb::TryStartRequest {
                    key: key.into(),
                    lease_ttl: Some(duration),
                    retention: Some(duration),
                    ..try_start("ignored")
                })
                .await
                .expect_err("malformed");
            assert_eq!(status.code(), Code::InvalidArgument);
            refused += 1;
        }
    }
    let too_many: Vec<String> = (0..1001).map(|i| format!("e{i}")).collect();
    let status = client
        .mark_processed(pb::MarkProcessedRequest {
            consumer: "c".into(),
            event_ids: too_many,
            retention: Some(absurd[0]),
        })
        .await
        .expect_err("1001 ids");
    assert_invalid(&status, &["event_ids", "retention"]);
    refused += 1;
    assert_eq!(app.total_rows().await, 0, "nothing written");
    claim(&mut client, try_start("still-fine")).await;
    println!("hostile input ({backend:?}): {refused} malformed requests refused, 0 rows written");
}

for_each_backend!(
    a_huge_message_is_refused_before_it_is_buffered,
    a_barrage_of_malformed_requests_writes_nothing_and_harms_nothing,
);
