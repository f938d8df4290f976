//! TryStart's fields: namespace, key, fingerprint, attempt_id, lease_ttl and retention at
//! their bounds, and every bad field named in one refusal, in field order.

use idempotency_coordinator::proto::idempotency::v1::{CompleteRequest, TryStartRequest};

use crate::support::*;

use super::{DAY, dur};

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

for_each_backend!(
    namespace_must_be_1_to_64_characters_of_its_alphabet,
    key_must_be_1_to_255_bytes_without_control_characters,
    fingerprint_is_at_most_64_bytes,
    attempt_id_is_at_most_128_bytes_without_control_characters,
    lease_ttl_is_100ms_to_24h,
    key_retention_is_1s_to_30d,
    every_bad_field_gets_its_own_violation_in_field_order,
);
