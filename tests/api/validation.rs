//! Every bound of the contract's table, on both sides of the edge: the value just inside is
//! accepted, the value just outside is INVALID_ARGUMENT with one violation naming the field, and
//! a refused request writes nothing.

use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, ExtendLeaseRequest, LookupRequest, MarkProcessedRequest, ReleaseRequest,
    TryStartRequest,
};
use tonic::Code;

use crate::support::*;

const DAY: u64 = 24 * 3600;

fn dur(seconds: i64, nanos: i32) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos })
}

/// Sends a TryStart that must be refused for exactly `fields`, and checks nothing was written.
async fn refused_try_start(
    app: &TestApp,
    client: &mut Client,
    request: TryStartRequest,
    fields: &[&str],
) {
    let status = client
        .try_start(request)
        .await
        .expect_err("invalid request");
    assert_invalid(&status, fields);
    assert_eq!(
        app.total_rows().await,
        0,
        "a refused request writes nothing"
    );
}

async fn namespace_must_be_1_to_64_characters_of_its_alphabet(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    for bad in [
        "",
        &"n".repeat(65),
        "with space",
        "slash/ed",
        "ünïcode",
        "semi;colon",
        "star*",
    ] {
        let request = TryStartRequest {
            namespace: bad.into(),
            ..try_start("k")
        };
        refused_try_start(&app, &mut client, request, &["namespace"]).await;
    }
    for good in [&"n".repeat(64), "a", "Payments-v2.eu_west:1"] {
        claim(
            &mut client,
            TryStartRequest {
                namespace: good.to_string(),
                ..try_start("k")
            },
        )
        .await;
    }
}

async fn key_must_be_1_to_255_bytes_without_control_characters(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let too_long_multibyte = "é".repeat(128); // 256 bytes in 128 characters
    for bad in [
        "",
        &"k".repeat(256),
        &too_long_multibyte,
        "nul\u{0}",
        "tab\t",
        "del\u{7f}",
        "c1\u{85}",
        "c1\u{9f}",
    ] {
        refused_try_start(&app, &mut client, try_start(bad), &["key"]).await;
    }
    for good in [
        &"k".repeat(255),
        &"é".repeat(127),
        "emoji 🚀 and spaces",
        "nbsp\u{a0}",
    ] {
        claim(&mut client, try_start(good)).await;
    }
}

async fn fingerprint_is_at_most_64_bytes(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let request = TryStartRequest {
        fingerprint: vec![7; 65],
        ..try_start("k")
    };
    refused_try_start(&app, &mut client, request, &["fingerprint"]).await;
    claim(
        &mut client,
        TryStartRequest {
            fingerprint: vec![7; 64],
            ..try_start("k")
        },
    )
    .await;
}

async fn attempt_id_is_at_most_128_bytes_without_control_characters(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    for bad in ["a".repeat(129), "line\nbreak".into()] {
        let request = TryStartRequest {
            attempt_id: bad,
            ..try_start("k")
        };
        refused_try_start(&app, &mut client, request, &["attempt_id"]).await;
    }
    claim(
        &mut client,
        TryStartRequest {
            attempt_id: "a".repeat(128),
            ..try_start("k")
        },
    )
    .await;
}

async fn lease_ttl_is_100ms_to_24h(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let thousand_years = 1000 * 365 * DAY as i64;
    for bad in [
        dur(0, 99_999_999),
        dur(0, 0),
        dur(-1, 0),
        dur(0, -500_000_000),
        dur(DAY as i64, 1),
        dur(thousand_years, 0),
        dur(1, 1_000_000_000), // nanos must stay below one second
    ] {
        let request = TryStartRequest {
            lease_ttl: bad,
            ..try_start("k")
        };
        refused_try_start(&app, &mut client, request, &["lease_ttl"]).await;
    }
    for (index, good) in [dur(0, 100_000_000), dur(DAY as i64, 0)]
        .into_iter()
        .enumerate()
    {
        claim(
            &mut client,
            TryStartRequest {
                lease_ttl: good,
                ..try_start(&format!("k{index}"))
            },
        )
        .await;
    }
}

async fn key_retention_is_1s_to_30d(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    for bad in [
        dur(0, 999_999_999),
        dur(0, 0),
        dur(-5, 0),
        dur(30 * DAY as i64, 1),
    ] {
        let request = TryStartRequest {
            retention: bad,
            ..try_start("k")
        };
        refused_try_start(&app, &mut client, request, &["retention"]).await;
    }
    for (index, good) in [dur(1, 0), dur(30 * DAY as i64, 0)].into_iter().enumerate() {
        claim(
            &mut client,
            TryStartRequest {
                retention: good,
                ..try_start(&format!("k{index}"))
            },
        )
        .await;
    }

    // Complete's own retention has the same bounds.
    let started = claim(&mut client, try_start("to-complete")).await;
    for bad in [dur(0, 999_999_999), dur(30 * DAY as i64 + 1, 0)] {
        let status = client
            .complete(CompleteRequest {
                retention: bad,
                ..complete("to-complete", started.lease_token, b"r")
            })
            .await
            .expect_err("invalid retention");
        assert_invalid(&status, &["retention"]);
    }
    expect_in_progress(try_start_response(&client, try_start("to-complete")).await);
    client
        .complete(CompleteRequest {
            retention: dur(30 * DAY as i64, 0),
            ..complete("to-complete", started.lease_token, b"r")
        })
        .await
        .expect("30 days is allowed");
}

async fn every_bad_field_gets_its_own_violation_in_field_order(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let request = TryStartRequest {
        namespace: String::new(),
        key: String::new(),
        fingerprint: vec![0; 100],
        lease_ttl: dur(0, 1),
        retention: dur(0, 1),
        attempt_id: "x".repeat(200),
        wait: dur(61, 0),
    };
    refused_try_start(
        &app,
        &mut client,
        request,
        &[
            "namespace",
            "key",
            "fingerprint",
            "lease_ttl",
            "retention",
            "attempt_id",
            "wait",
        ],
    )
    .await;
}

async fn lease_token_zero_is_missing_and_must_fit_the_token_range(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    for token in [0, u64::MAX, (i64::MAX as u64) + 1] {
        let status = client
            .complete(complete("k", token, b"r"))
            .await
            .expect_err("bad token");
        assert_invalid(&status, &["lease_token"]);
        let status = client
            .release(release("k", token))
            .await
            .expect_err("bad token");
        assert_invalid(&status, &["lease_token"]);
        let status = client
            .extend_lease(extend("k", token))
            .await
            .expect_err("bad token");
        assert_invalid(&status, &["lease_token"]);
    }
    // The largest token is well-formed: it is simply not anybody's.
    let status = client
        .complete(complete("k", i64::MAX as u64, b"r"))
        .await
        .expect_err("absent key");
    assert_error(&status, Code::NotFound, "KEY_NOT_FOUND");
    assert_eq!(app.total_rows().await, 0);
}

async fn response_is_at_most_the_configured_limit(backend: Backend) {
    let app = TestApp::spawn_with(backend, &["--max-response-bytes", "262144"]).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    let status = client
        .complete(complete("k", started.lease_token, &vec![1; 262_145]))
        .await
        .expect_err("response too large");
    assert_invalid(&status, &["response"]);
    expect_in_progress(try_start_response(&client, try_start("k")).await);
    client
        .complete(complete("k", started.lease_token, &vec![1; 262_144]))
        .await
        .expect("a response at the limit");
}

async fn the_default_response_limit_is_one_mebibyte(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    let status = client
        .complete(complete(
            "k",
            started.lease_token,
            &vec![1; 1024 * 1024 + 1],
        ))
        .await
        .expect_err("response too large");
    assert_invalid(&status, &["response"]);
    client
        .complete(complete("k", started.lease_token, &vec![1; 1024 * 1024]))
        .await
        .expect("a response of exactly 1 MiB");
}

async fn a_message_beyond_the_decoding_limit_is_refused_and_the_server_is_unharmed(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    // 1 MiB + 64 KiB is the decoding limit; this message is well past it.
    let status = client
        .complete(complete(
            "k",
            started.lease_token,
            &vec![1; 1024 * 1024 + 65 * 1024],
        ))
        .await
        .expect_err("message too large");
    assert!(
        status.code() == Code::OutOfRange,
        "refused by the gRPC layer: {status:?}"
    );
    expect_in_progress(try_start_response(&client, try_start("k")).await);
    client
        .complete(complete("k", started.lease_token, b"fine"))
        .await
        .expect("the same connection still works");
}

async fn checkpoint_is_at_most_64_kib(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    let status = client
        .extend_lease(ExtendLeaseRequest {
            checkpoint: Some(vec![0; 64 * 1024 + 1]),
            ..extend("k", started.lease_token)
        })
        .await
        .expect_err("checkpoint too large");
    assert_invalid(&status, &["checkpoint"]);
    client
        .extend_lease(ExtendLeaseRequest {
            checkpoint: Some(vec![0; 64 * 1024]),
            ..extend("k", started.lease_token)
        })
        .await
        .expect("a checkpoint of exactly 64 KiB");
}

async fn extend_lease_ttl_has_the_lease_bounds(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let started = claim(&mut client, try_start("k")).await;
    for bad in [
        dur(0, 0),
        dur(0, 99_999_999),
        dur(DAY as i64 + 1, 0),
        dur(-1, 0),
    ] {
        let status = client
            .extend_lease(ExtendLeaseRequest {
                lease_ttl: bad,
                ..extend("k", started.lease_token)
            })
            .await
            .expect_err("bad ttl");
        assert_invalid(&status, &["lease_ttl"]);
    }
}

async fn every_rpc_validates_its_scope_and_key(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let status = client
        .complete(CompleteRequest {
            namespace: "bad scope".into(),
            key: String::new(),
            ..complete("k", 1, b"r")
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["namespace", "key"]);
    let status = client
        .release(ReleaseRequest {
            namespace: String::new(),
            key: "k\u{1}".into(),
            lease_token: 0,
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["namespace", "key", "lease_token"]);
    let status = client
        .extend_lease(ExtendLeaseRequest {
            namespace: "x".repeat(65),
            ..extend("k", 1)
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["namespace"]);
    let status = client
        .lookup(LookupRequest {
            namespace: "ok".into(),
            key: "k".repeat(256),
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["key"]);
    let status = client
        .mark_processed(MarkProcessedRequest {
            consumer: "no spaces allowed".into(),
            ..mark("c", &["e"])
        })
        .await
        .expect_err("invalid");
    assert_invalid(&status, &["consumer"]);
    assert_eq!(app.total_rows().await, 0);
}

async fn event_ids_are_1_to_1000_and_bad_elements_are_named_by_index(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
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
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
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

async fn invalid_utf8_in_a_string_field_is_refused_by_the_decoder_and_writes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    // A TryStartRequest encoded by hand: field 1 (namespace) = "ns", field 2 (key) = 0xFF 0xFE,
    // which is not UTF-8. The generated client cannot produce it, so it goes out as raw bytes.
    let message: Vec<u8> = vec![0x0a, 0x02, b'n', b's', 0x12, 0x02, 0xff, 0xfe];
    let answer = raw_unary(
        app.endpoint(),
        "/idempotency.v1.IdempotencyService/TryStart",
        message,
        None,
    )
    .await;
    assert!(answer.is_err(), "{answer:?}");
    assert_eq!(app.total_rows().await, 0);
    let mut client = app.client().await;
    claim(&mut client, try_start("still-serving")).await;
}

for_each_backend!(
    a_message_beyond_the_decoding_limit_is_refused_and_the_server_is_unharmed,
    invalid_utf8_in_a_string_field_is_refused_by_the_decoder_and_writes_nothing,
    namespace_must_be_1_to_64_characters_of_its_alphabet,
    key_must_be_1_to_255_bytes_without_control_characters,
    fingerprint_is_at_most_64_bytes,
    attempt_id_is_at_most_128_bytes_without_control_characters,
    lease_ttl_is_100ms_to_24h,
    key_retention_is_1s_to_30d,
    every_bad_field_gets_its_own_violation_in_field_order,
    lease_token_zero_is_missing_and_must_fit_the_token_range,
    response_is_at_most_the_configured_limit,
    the_default_response_limit_is_one_mebibyte,
    checkpoint_is_at_most_64_kib,
    extend_lease_ttl_has_the_lease_bounds,
    every_rpc_validates_its_scope_and_key,
    event_ids_are_1_to_1000_and_bad_elements_are_named_by_index,
    event_retention_is_1s_to_30d,
);
