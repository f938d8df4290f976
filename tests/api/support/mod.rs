//! What the tests share: the server and its database, a cuttable proxy, requests as the tests
//! send them (`requests`), the steps many tests take on the way to what they check (`steps`),
//! assertions on answers and rich errors, and documentation's commands
//! read as written (`written`).

pub mod app;
pub mod cluster;
pub mod process;
pub mod raw;
pub mod requests;
pub mod security;
pub mod steps;
pub mod tls_cluster;
pub mod written;

pub use idempotency_testkit::health::{health_client, is_serving};
pub use idempotency_testkit::{database, proxy};

use std::time::Duration;

use chrono::{DateTime, Utc};
use idempotency_coordinator::domain;
use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use tonic::{Code, Status};
use tonic_types::StatusExt;

pub use app::{Client, TestApp};

/// A connected channel to the server at `endpoint`.
pub async fn channel_to(endpoint: String) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(endpoint)
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}
pub use database::{Backend, TestDatabase};
pub use requests::*;
pub use steps::*;

/// Runs each named test, an `async fn(Backend)`, once on each store: the conformance suite.
/// A test written but not listed is dead code, which the lints refuse.
macro_rules! for_each_backend {
    ($($test:ident),+ $(,)?) => {
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test(crate::support::Backend::Postgres).await
                }
            )+
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    super::$test(crate::support::Backend::Sqlite).await
                }
            )+
        }
    };
}
pub(crate) use for_each_backend;

pub const NAMESPACE: &str = "tests";
/// Every RPC of the service, in the order of its definition.
pub const RPCS: [&str; 6] = [
    "TryStart",
    "Complete",
    "Release",
    "ExtendLease",
    "Lookup",
    "MarkProcessed",
];
pub const FINGERPRINT: &[u8] = b"fingerprint-1";

pub fn instant(timestamp: &Option<prost_types::Timestamp>) -> DateTime<Utc> {
    let timestamp = timestamp.as_ref().expect("timestamp present");
    DateTime::from_timestamp(
        timestamp.seconds,
        u32::try_from(timestamp.nanos).expect("non-negative nanos"),
    )
    .expect("timestamp in range")
}

/// A unique key, so that tests never see each other's rows even on a shared database.
pub fn unique_key(label: &str) -> String {
    format!("{label}-{}", uuid::Uuid::new_v4().simple())
}

pub fn outcome(response: pb::TryStartResponse) -> Outcome {
    response.outcome.expect("TryStart answers an outcome")
}

pub fn expect_started(response: pb::TryStartResponse) -> pb::ClaimStarted {
    match outcome(response) {
        Outcome::Started(started) => started,
        other => panic!("expected started, got {other:?}"),
    }
}

pub fn expect_in_progress(response: pb::TryStartResponse) -> pb::ClaimInProgress {
    match outcome(response) {
        Outcome::InProgress(in_progress) => in_progress,
        other => panic!("expected in_progress, got {other:?}"),
    }
}

pub fn expect_completed(response: pb::TryStartResponse) -> pb::ClaimCompleted {
    match outcome(response) {
        Outcome::Completed(completed) => completed,
        other => panic!("expected completed, got {other:?}"),
    }
}

pub fn expect_mismatch(response: pb::TryStartResponse) {
    match outcome(response) {
        Outcome::FingerprintMismatch(_) => {}
        other => panic!("expected fingerprint_mismatch, got {other:?}"),
    }
}

pub fn state(response: pb::LookupResponse) -> State {
    response.state.expect("Lookup answers a state")
}

/// Looks `key` up and answers its state.
pub async fn key_state(client: &Client, key: &str) -> State {
    state(answered(client.clone().lookup(lookup(key)).await, "Lookup"))
}

/// Calls TryStart, which must answer.
pub async fn try_start_response(
    client: &Client,
    request: pb::TryStartRequest,
) -> pb::TryStartResponse {
    answered(client.clone().try_start(request).await, "TryStart")
}

/// Claims `key` and answers the claim.
pub async fn claim(client: &mut Client, request: pb::TryStartRequest) -> pb::ClaimStarted {
    expect_started(try_start_response(client, request).await)
}

/// Asserts a rich error: the code, and an ErrorInfo with the reason in our domain.
pub fn assert_error(status: &Status, code: Code, reason: &str) {
    assert_eq!(status.code(), code, "unexpected status: {status:?}");
    let details = status.get_error_details();
    let info = details.error_info().expect("an ErrorInfo detail");
    assert_eq!(info.reason, reason, "unexpected reason in {status:?}");
    assert_eq!(info.domain, "idempotency.v1");
}

/// Asserts that a call was refused with a rich error (see [`assert_error`]), and answers the
/// refusal.
pub fn assert_refused<T: std::fmt::Debug>(
    answer: Result<T, Status>,
    code: Code,
    reason: &str,
) -> Status {
    let status = answer.expect_err(&format!("refused with {reason}"));
    assert_error(&status, code, reason);
    status
}

/// Sends Complete, Release and ExtendLease of `key` with `token`: the writes the lease token
/// guards. Answers each RPC's name and how it ended.
pub async fn guarded_writes(
    client: &Client,
    key: &str,
    token: u64,
) -> [(&'static str, Result<(), Status>); 3] {
    let mut client = client.clone();
    [
        (
            "Complete",
            client.complete(complete(key, token, b"x")).await.map(drop),
        ),
        (
            "Release",
            client.release(release(key, token)).await.map(drop),
        ),
        (
            "ExtendLease",
            client.extend_lease(extend(key, token)).await.map(drop),
        ),
    ]
}

/// Sends Complete, Release and ExtendLease of `key` with `token`, and asserts that each is
/// refused with `code` and `reason`.
pub async fn assert_guarded_writes_refused(
    client: &Client,
    key: &str,
    token: u64,
    code: Code,
    reason: &str,
) {
    for (rpc, answer) in guarded_writes(client, key, token).await {
        let status = answer.expect_err(rpc);
        assert_error(&status, code, reason);
    }
}

/// Asserts INVALID_ARGUMENT with exactly one BadRequest violation per named field, in order.
pub fn assert_invalid(status: &Status, fields: &[&str]) {
    assert_error(status, Code::InvalidArgument, "INVALID_ARGUMENT");
    let details = status.get_error_details();
    let violations: Vec<&str> = details
        .bad_request()
        .expect("a BadRequest detail")
        .field_violations
        .iter()
        .map(|v| v.field.as_str())
        .collect();
    assert_eq!(violations, fields, "violations of {status:?}");
}

/// Polls `condition` every 20 ms until it holds, failing after `limit`. For conditions that
/// only the passage of real time brings (a lease or retention running out).
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (up to 10 s) until `table` of `database` holds `rows` rows: for rows that a task of
/// the service (the reaper, a heartbeat, a replica's departure) writes or deletes on its own.
pub async fn rows_become(database: &TestDatabase, table: &str, rows: i64) {
    eventually(
        Duration::from_secs(10),
        &format!("{table} holds {rows} rows"),
        || async { database.count_rows(table).await == rows },
    )
    .await;
}

/// Polls `look` every 20 ms until it finds something, and answers it; fails after `limit`.
pub async fn eventually_some<T, F, Fut>(limit: Duration, what: &str, mut look: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(found) = look().await {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the lease of `key` has run out by the database clock.
pub async fn wait_for_lease_expiry(app: &TestApp, client: &Client, key: &str) {
    let expires = match key_state(client, key).await {
        State::InProgress(in_progress) => instant(&in_progress.lease_expires_at),
        other => panic!("expected in_progress, got {other:?}"),
    };
    eventually(Duration::from_secs(10), "the lease ran out", || async {
        app.db_now().await > expires
    })
    .await;
}

/// Sends one already-encoded message to `path` (with an `authorization` header if given), for
/// requests the generated client cannot produce.
pub async fn raw_unary(
    endpoint: String,
    path: &'static str,
    message: Vec<u8>,
    authorization: Option<&str>,
) -> Result<Vec<u8>, tonic::Status> {
    use tonic::codegen::http::uri::PathAndQuery;

    #[derive(Clone, Default)]
    struct RawCodec;
    #[derive(Default)]
    struct RawEncoder;
    #[derive(Default)]
    struct RawDecoder;
    impl tonic::codec::Encoder for RawEncoder {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn encode(
            &mut self,
            item: Vec<u8>,
            dst: &mut tonic::codec::EncodeBuf<'_>,
        ) -> Result<(), tonic::Status> {
            use bytes::BufMut;
            dst.put_slice(&item);
            Ok(())
        }
    }
    impl tonic::codec::Decoder for RawDecoder {
        type Item = Vec<u8>;
        type Error = tonic::Status;
        fn decode(
            &mut self,
            src: &mut tonic::codec::DecodeBuf<'_>,
        ) -> Result<Option<Vec<u8>>, tonic::Status> {
            use bytes::Buf;
            let mut out = vec![0; src.remaining()];
            src.copy_to_slice(&mut out);
            Ok(Some(out))
        }
    }
    impl tonic::codec::Codec for RawCodec {
        type Encode = Vec<u8>;
        type Decode = Vec<u8>;
        type Encoder = RawEncoder;
        type Decoder = RawDecoder;
        fn encoder(&mut self) -> RawEncoder {
            RawEncoder
        }
        fn decoder(&mut self) -> RawDecoder {
            RawDecoder
        }
    }

    let mut grpc = tonic::client::Grpc::new(channel_to(endpoint).await);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(message);
    if let Some(value) = authorization {
        request
            .metadata_mut()
            .insert("authorization", value.parse().expect("ASCII"));
    }
    grpc.unary(request, PathAndQuery::from_static(path), RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// A TryStart as the store takes it: the test namespace and fingerprint, a 30 s lease, an hour
/// of retention, and `attempt_id`.
pub fn store_try_start(key: &str, attempt_id: &str) -> domain::TryStartCommand {
    domain::TryStartCommand {
        namespace: domain::Scope::parse(NAMESPACE.into()).expect("namespace"),
        key: domain::Key::parse(key.into()).expect("key"),
        fingerprint: domain::Fingerprint::parse(FINGERPRINT.to_vec()).expect("fingerprint"),
        lease_ttl: domain::LeaseTtl::parse(Duration::from_secs(30)).expect("lease"),
        retention: domain::KeyRetention::parse(Duration::from_secs(3600)).expect("retention"),
        attempt_id: Some(
            domain::AttemptId::parse(attempt_id.into())
                .expect("attempt id")
                .expect("non-empty"),
        ),
        holder: None,
    }
}
