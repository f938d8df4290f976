//! Requests as the tests send them: builders with the test namespace and fingerprint and every
//! optional field unset, and `with_…` adjusters for the one or two fields a test sets apart, so
//! that a request reads as what makes it different (`try_start(&key).with_lease(millis(100))`).

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use super::{FINGERPRINT, NAMESPACE};

pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).expect("test durations fit"),
        nanos: i32::try_from(d.subsec_nanos()).expect("nanos fit"),
    }
}

pub fn millis(ms: u64) -> Option<prost_types::Duration> {
    Some(duration(Duration::from_millis(ms)))
}

pub fn secs(s: u64) -> Option<prost_types::Duration> {
    Some(duration(Duration::from_secs(s)))
}

pub fn try_start(key: &str) -> pb::TryStartRequest {
    pb::TryStartRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
        fingerprint: FINGERPRINT.to_vec(),
        lease_ttl: None,
        retention: None,
        attempt_id: String::new(),
        wait: None,
    }
}

pub fn complete(key: &str, token: u64, response: &[u8]) -> pb::CompleteRequest {
    pb::CompleteRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
        lease_token: token,
        response: response.to_vec(),
        retention: None,
    }
}

pub fn release(key: &str, token: u64) -> pb::ReleaseRequest {
    pb::ReleaseRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
        lease_token: token,
    }
}

pub fn extend(key: &str, token: u64) -> pb::ExtendLeaseRequest {
    pb::ExtendLeaseRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
        lease_token: token,
        lease_ttl: None,
        checkpoint: None,
    }
}

pub fn lookup(key: &str) -> pb::LookupRequest {
    pb::LookupRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
    }
}

pub fn mark(consumer: &str, ids: &[&str]) -> pb::MarkProcessedRequest {
    pb::MarkProcessedRequest {
        consumer: consumer.into(),
        event_ids: ids.iter().map(|id| id.to_string()).collect(),
        retention: None,
    }
}

/// Implements an adjuster trait, whose one method sets one field, for each request type named.
macro_rules! adjuster {
    ($trait:ident::$method:ident($field:ident: $type:ty) for $($request:ty),+) => {
        $(
            impl $trait for $request {
                fn $method(self, $field: $type) -> Self {
                    Self { $field, ..self }
                }
            }
        )+
    };
}

/// A request with a lease of its own: TryStart's for a claim, ExtendLease's for a renewal.
pub trait WithLease {
    fn with_lease(self, ttl: Option<prost_types::Duration>) -> Self;
}

adjuster!(WithLease::with_lease(lease_ttl: Option<prost_types::Duration>) for pb::TryStartRequest, pb::ExtendLeaseRequest);

/// A request that says how long what it writes is kept.
pub trait WithRetention {
    fn with_retention(self, retention: Option<prost_types::Duration>) -> Self;
}

adjuster!(WithRetention::with_retention(retention: Option<prost_types::Duration>) for pb::TryStartRequest, pb::CompleteRequest, pb::MarkProcessedRequest);

/// A request in a namespace of its own rather than the tests' one.
pub trait InNamespace {
    fn in_namespace(self, namespace: String) -> Self;
}

adjuster!(InNamespace::in_namespace(namespace: String) for pb::TryStartRequest, pb::CompleteRequest, pb::ReleaseRequest, pb::ExtendLeaseRequest, pb::LookupRequest);

/// The fields of a TryStart that say who asks and for what.
pub trait TryStartWith {
    /// The caller's attempt, which re-enters its own claim.
    fn with_attempt(self, attempt_id: &str) -> Self;
    /// Another request under the same key (or, empty, a request without a fingerprint).
    fn with_fingerprint(self, fingerprint: &[u8]) -> Self;
    /// How long the call may wait for the key's holder.
    fn with_wait(self, wait: Duration) -> Self;
}

impl TryStartWith for pb::TryStartRequest {
    fn with_attempt(self, attempt_id: &str) -> Self {
        Self {
            attempt_id: attempt_id.into(),
            ..self
        }
    }

    fn with_fingerprint(self, fingerprint: &[u8]) -> Self {
        Self {
            fingerprint: fingerprint.to_vec(),
            ..self
        }
    }

    fn with_wait(self, wait: Duration) -> Self {
        Self {
            wait: Some(duration(wait)),
            ..self
        }
    }
}

/// An ExtendLease that saves the holder's progress for whoever takes the key over.
pub trait WithCheckpoint {
    /// `Some` replaces the saved checkpoint (an empty one empties it), `None` keeps it.
    fn with_checkpoint(self, checkpoint: Option<&[u8]>) -> Self;
}

impl WithCheckpoint for pb::ExtendLeaseRequest {
    fn with_checkpoint(self, checkpoint: Option<&[u8]>) -> Self {
        Self {
            checkpoint: checkpoint.map(<[u8]>::to_vec),
            ..self
        }
    }
}
