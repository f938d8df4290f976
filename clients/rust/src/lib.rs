//! A client of the idempotency coordinator that makes the protocol one call.
//!
//! ```no_run
//! # async fn charge(order: &serde_json::Value) -> Result<String, std::io::Error> { Ok("ch_1".into()) }
//! # async fn example(order: serde_json::Value) -> Result<(), Box<dyn std::error::Error>> {
//! use idempotency_client::{Client, Error, RunError};
//!
//! let coordinator = Client::builder("http://127.0.0.1:50051").build().await?;
//! let outcome = coordinator
//!     .run_once("payments", "order-42:charge")
//!     .request(&order)
//!     .wait(std::time::Duration::from_secs(5))
//!     .run(|_lease| async { charge(&order).await })
//!     .await;
//! match outcome {
//!     Ok(charged) => println!("{} (replayed: {})", charged.value, charged.replayed),
//!     Err(RunError::Coordinator(Error::InProgress { retry_after, .. })) => println!("409, {retry_after:?}"),
//!     Err(RunError::Coordinator(Error::FingerprintMismatch)) => println!("422"),
//!     Err(other) => return Err(other.into()),
//! }
//! # Ok(()) }
//! ```
//!
//! See the crate's README for every option and error.

mod canonical;
mod client;
mod codec;
mod error;
mod run;

/// The coordinator's API as generated from `proto/idempotency/v1/idempotency.proto` (client
/// only), for callers that need a message or the raw client.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("idempotency.v1");
}

use std::time::{Duration, SystemTime};

pub use canonical::{
    CanonicalJsonError, CanonicalJsonErrorKind, MAX_SAFE_INTEGER, canonical_json,
    canonical_json_text,
};
pub use client::{
    Client, ClientBuilder, DEFAULT_CALL_TIMEOUT, DEFAULT_LEASE_TTL, DEFAULT_WAIT,
    HEARTBEAT_DIVISOR, JITTER_LOW_FRACTION, MarkProcessed, RetryPolicy,
};
pub use codec::{Bytes, Codec, Json, fingerprint_of, fingerprint_of_bytes, fingerprint_of_json};
pub use error::{BoxError, CallError, ERROR_DOMAIN, Error, FieldViolation, RunError};
pub use run::{Lease, Outcome, RunOnce};
pub use tokio_util::sync::CancellationToken;
/// TLS settings for [`ClientBuilder::tls`].
pub use tonic::transport::{Certificate, ClientTlsConfig, Identity};

pub(crate) fn duration_message(duration: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(duration.as_secs()).unwrap_or(i64::MAX),
        // Below one billion, so it always fits.
        nanos: i32::try_from(duration.subsec_nanos()).unwrap_or(0),
    }
}

/// An instant from the service; the epoch when absent or out of range.
pub(crate) fn system_time(timestamp: Option<prost_types::Timestamp>) -> SystemTime {
    timestamp
        .and_then(|t| SystemTime::try_from(t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<F: std::future::Future + Send>(_: F) {}

    /// `run` can be awaited inside a spawned task or a web handler (its future is `Send`
    /// whenever the work's is).
    #[tokio::test]
    async fn run_once_futures_are_send() {
        let Ok(client) = Client::builder("http://127.0.0.1:1").build_lazy() else {
            panic!("a lazy client builds");
        };
        assert_send(
            client
                .run_once("payments", "k")
                .run(|lease| async move { Ok::<_, std::io::Error>(lease.token()) }),
        );
        assert_send(client.mark_processed("billing", ["e"]).send());
    }
}
