//! TryStart's fields: namespace, key, fingerprint, attempt_id, lease_ttl and retention at
//! their bounds, and every bad field named in one refusal, in field order.

use idempotency_coordinator::proto::idempotency::v1::TryStartRequest;

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

/// The two sides of one field's bounds: each request of `refused` is refused naming `field`
/// alone and writes nothing; then each of `accepted` claims its key.
async fn assert_bounds(
    app: &TestApp,
    client: &mut Client,
    field: &str,
    refused: impl IntoIterator<Item = TryStartRequest>,
    accepted: impl IntoIterator<Item = TryStartRequest>,
) {
    for request in refused {
        refused_try_start(app, client, request, &[field]).await;
    }
    for request in accepted {
        claim(client, request).await;
    }
}

/// A duration as a request carries it: absent, or any seconds and nanos.
type WireDuration = Option<prost_types::Duration>;

/// [`assert_bounds`] for a duration that `set` puts in a TryStart: each of `refused` on key `k`,
/// each of `accepted` on keys of its own (`k0`, `k1`…), so that each is a fresh claim.
async fn assert_duration_bounds(
    app: &TestApp,
    client: &mut Client,
    field: &str,
    set: fn(TryStartRequest, WireDuration) -> TryStartRequest,
    refused: &[WireDuration],
    accepted: &[WireDuration],
) {
    let refused = refused.iter().map(|bad| set(try_start("k"), *bad));
    let accepted = (accepted.iter().enumerate())
        .map(|(index, good)| set(try_start(&format!("k{index}")), *good));
    assert_bounds(app, client, field, refused, accepted).await;
}

async fn namespace_must_be_1_to_64_characters_of_its_alphabet(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let in_namespace = |namespace: &str| TryStartRequest {
        namespace: namespace.into(),
        ..try_start("k")
    };
    let bad = [
        "",
        &"n".repeat(65),
        "with space",
        "slash/ed",
        "ünïcode",
        "semi;colon",
        "star*",
    ];
    let good = [&"n".repeat(64), "a", "Payments-v2.eu_west:1"];
    assert_bounds(
        &app,
        &mut client,
        "namespace",
        bad.map(in_namespace),
        good.map(in_namespace),
    )
    .await;
}

async fn key_must_be_1_to_255_bytes_without_control_characters(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let too_long_multibyte = "é".repeat(128); // 256 bytes in 128 characters
    let bad = [
        "",
        &"k".repeat(256),
        &too_long_multibyte,
        "nul\u{0}",
        "tab\t",
        "del\u{7f}",
        "c1\u{85}",
        "c1\u{9f}",
    ];
    let good = [
        &"k".repeat(255),
        &"é".repeat(127),
        "emoji 🚀 and spaces",
        "nbsp\u{a0}",
    ];
    assert_bounds(
        &app,
        &mut client,
        "key",
        bad.map(try_start),
        good.map(try_start),
    )
    .await;
}

async fn fingerprint_is_at_most_64_bytes(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let with_fingerprint = |size| try_start("k").with_fingerprint(&vec![7; size]);
    let (bad, good) = ([65].map(with_fingerprint), [64].map(with_fingerprint));
    assert_bounds(&app, &mut client, "fingerprint", bad, good).await;
}

async fn attempt_id_is_at_most_128_bytes_without_control_characters(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let with_attempt = |attempt: &str| try_start("k").with_attempt(attempt);
    let bad = [&"a".repeat(129), "line\nbreak"].map(with_attempt);
    let good = [&"a".repeat(128)].map(|attempt| with_attempt(attempt));
    assert_bounds(&app, &mut client, "attempt_id", bad, good).await;
}

async fn lease_ttl_is_100ms_to_24h(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let thousand_years = 1000 * 365 * DAY as i64;
    let bad = [
        dur(0, 99_999_999),
        dur(0, 0),
        dur(-1, 0),
        dur(0, -500_000_000),
        dur(DAY as i64, 1),
        dur(thousand_years, 0),
        dur(1, 1_000_000_000), // nanos must stay below one second
    ];
    let good = [dur(0, 100_000_000), dur(DAY as i64, 0)];
    let lease = WithLease::with_lease;
    assert_duration_bounds(&app, &mut client, "lease_ttl", lease, &bad, &good).await;
}

async fn key_retention_is_1s_to_30d(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let bad = [
        dur(0, 999_999_999),
        dur(0, 0),
        dur(-5, 0),
        dur(30 * DAY as i64, 1),
    ];
    let good = [dur(1, 0), dur(30 * DAY as i64, 0)];
    let retention = WithRetention::with_retention;
    assert_duration_bounds(&app, &mut client, "retention", retention, &bad, &good).await;

    // Complete's own retention has the same bounds.
    let started = claim(&mut client, try_start("to-complete")).await;
    let completing =
        |retention| complete("to-complete", started.lease_token, b"r").with_retention(retention);
    for bad in [dur(0, 999_999_999), dur(30 * DAY as i64 + 1, 0)] {
        let refused = client.complete(completing(bad)).await;
        assert_invalid(&refused.expect_err("invalid retention"), &["retention"]);
    }
    expect_held_by_another(&client, "to-complete").await;
    // 30 days is allowed.
    complete_response(&client, completing(dur(30 * DAY as i64, 0))).await;
}

async fn every_bad_field_gets_its_own_violation_in_field_order(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
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
