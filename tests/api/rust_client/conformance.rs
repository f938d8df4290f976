//! The vectors and defaults in `clients/conformance`, which every client passes: the canonical
//! form and fingerprint of JSON texts, the defaults table, and a result the coordinator could
//! not store.

use std::time::Duration;

use idempotency_client::{
    CanonicalJsonErrorKind, Codec, DEFAULT_CALL_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_WAIT, Error,
    HEARTBEAT_DIVISOR, JITTER_LOW_FRACTION, Json, RetryPolicy, RunError, canonical_json,
    canonical_json_text, fingerprint_of, fingerprint_of_json,
};
use serde::Deserialize;

use super::{PAYMENTS, PaymentError, Runs, client_retrying_for};
use crate::support::process::ServerProcess;
use crate::support::*;

const CONFORMANCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/conformance");

fn load(name: &str) -> String {
    std::fs::read_to_string(format!("{CONFORMANCE}/{name}")).expect("a conformance file")
}

#[derive(Deserialize)]
struct Vectors {
    cases: Vec<Vector>,
}

#[derive(Deserialize)]
struct Vector {
    name: String,
    input: String,
    canonical: Option<String>,
    sha256: Option<String>,
    error: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_fingerprint_vector_holds() {
    let vectors: Vectors = serde_json::from_str(&load("fingerprints.json")).expect("vectors");
    assert!(!vectors.cases.is_empty());
    let mut failures = Vec::new();
    for case in &vectors.cases {
        let fingerprint = fingerprint_of_json(&case.input);
        match (&case.error, &case.canonical, &case.sha256) {
            (Some(expected), _, _) => match fingerprint {
                Err(Error::Fingerprint(error)) if error.kind().as_str() == expected => {}
                other => {
                    failures.push(format!("{}: expected {expected}, got {other:?}", case.name))
                }
            },
            (None, Some(canonical), Some(sha256)) => {
                let written = canonical_json_text(&case.input).map(String::from_utf8);
                if !matches!(&written, Ok(Ok(text)) if text == canonical) {
                    failures.push(format!(
                        "{}: wrote {written:?}, not {canonical:?}",
                        case.name
                    ));
                }
                match fingerprint {
                    Ok(digest) if hex(&digest) == *sha256 => {}
                    other => failures.push(format!("{}: fingerprint {other:?}", case.name)),
                }
                // The value serde_json reads from the text (where it can: it stops at 128 levels)
                // has the same fingerprint.
                if let Ok(value) = serde_json::from_str::<serde_json::Value>(&case.input) {
                    match fingerprint_of(&value) {
                        Ok(digest) if hex(&digest) == *sha256 => {}
                        other => failures.push(format!("{}: as a value {other:?}", case.name)),
                    }
                }
            }
            _ => failures.push(format!(
                "{}: neither canonical and sha256 nor error",
                case.name
            )),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn values_json_cannot_carry_exactly_are_refused() {
    fn kind<T: serde::Serialize + ?Sized>(value: &T) -> Option<CanonicalJsonErrorKind> {
        canonical_json(value).err().map(|error| error.kind())
    }
    let unsafe_integer = Some(CanonicalJsonErrorKind::UnsafeInteger);
    assert_eq!(kind(&(1_u64 << 53)), unsafe_integer);
    assert_eq!(kind(&-(1_i64 << 53)), unsafe_integer);
    assert_eq!(kind(&u64::MAX), unsafe_integer);
    assert_eq!(kind(&(1_i128 << 70)), unsafe_integer);
    assert_eq!(kind(&[1_u128 << 64]), unsafe_integer);
    assert_eq!(
        kind(&[f64::NAN]),
        Some(CanonicalJsonErrorKind::NumberOutOfRange)
    );
    assert_eq!(
        kind(&f64::INFINITY),
        Some(CanonicalJsonErrorKind::NumberOutOfRange)
    );
    // Within ±(2^53−1) every width is a number, and a double is written as ECMAScript does.
    assert_eq!(
        canonical_json(&(
            (1_u64 << 53) - 1,
            -((1_i128 << 53) - 1),
            1e21,
            -0.0,
            0.1_f32
        ))
        .expect("canonical"),
        b"[9007199254740991,-9007199254740991,1e+21,0,0.1]"
    );
    assert_eq!(
        canonical_json(&9_007_199_254_740_992.0_f64).expect("a double is accepted"),
        b"9007199254740992"
    );
    assert_ne!(
        fingerprint_of("\u{e9}").expect("NFC"),
        fingerprint_of("e\u{301}").expect("NFD")
    );
    let refused = fingerprint_of(&u64::MAX);
    assert!(
        matches!(&refused, Err(Error::Fingerprint(error)) if error.to_string().contains("as a string")),
        "{refused:?}"
    );
}

#[test]
fn the_defaults_are_the_conformance_table() {
    let defaults: serde_json::Value = serde_json::from_str(&load("defaults.json")).expect("JSON");
    let ms = |duration: Duration| {
        serde_json::json!(
            u64::try_from(duration.as_millis()).expect("a few seconds in milliseconds")
        )
    };
    let policy = RetryPolicy::default();
    assert_eq!(
        defaults["retry"]["multiplier"].as_f64(),
        Some(policy.multiplier)
    );
    assert_eq!(
        defaults,
        serde_json::json!({
            "call_timeout_ms": ms(DEFAULT_CALL_TIMEOUT),
            "retry": {
                "budget_ms": ms(policy.total),
                "initial_backoff_ms": ms(policy.initial_delay),
                "max_backoff_ms": ms(policy.max_delay),
                // A number, compared as one below (the file writes 2, serde_json's f64 2.0).
                "multiplier": defaults["retry"]["multiplier"],
                "jitter_low_fraction": JITTER_LOW_FRACTION,
            },
            "lease_ttl_ms": ms(DEFAULT_LEASE_TTL),
            "heartbeat_divisor": HEARTBEAT_DIVISOR,
            "wait_ms": ms(DEFAULT_WAIT),
        })
    );
}

async fn a_result_the_coordinator_could_not_store_is_returned_with_the_result(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let mut server = ServerProcess::start(&database.url, &[]).await;
    server.wait_until_serving().await.expect("serving");
    let client = client_retrying_for(server.endpoint(), Duration::from_secs(1)).await;
    let key = unique_key("charge");
    let runs = Runs::default();

    let outcome = client
        .run_once(PAYMENTS, &key)
        .heartbeat(false)
        .run(|_lease| async {
            runs.record();
            // The charge is made; the coordinator is gone before Complete.
            server.signal("KILL");
            Ok::<_, PaymentError>(("ch_1".to_owned(), 1999))
        })
        .await;

    let Err(RunError::Coordinator(error @ Error::ResultNotStored { .. })) = outcome else {
        panic!("expected ResultNotStored, got {outcome:?}");
    };
    let Error::ResultNotStored { response, source } = &error else {
        unreachable!()
    };
    let result: (String, u32) = Json.decode(response).expect("the encoded result");
    assert_eq!(result, ("ch_1".to_owned(), 1999));
    assert_eq!(error.unstored_response(), Some(response.as_slice()));
    assert!(
        matches!(**source, Error::Unavailable(_)),
        "Complete's failure: {source:?}"
    );
    assert_eq!(
        error.call().map(|call| call.code),
        Some(tonic::Code::Unavailable)
    );
    assert_eq!(runs.count(), 1);
    server.wait(Duration::from_secs(10)).await;
    // Only the result was lost: the claim is still there, and nothing is completed.
    assert_eq!(database.count_rows("idempotency_keys").await, 1);
    assert!(database.completed_keys(PAYMENTS).await.is_empty());
}

for_each_backend!(a_result_the_coordinator_could_not_store_is_returned_with_the_result);
