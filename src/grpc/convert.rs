//! Between protobuf messages and domain types. Requests are parsed into commands whose fields
//! are validated types; every bad field is reported at once, and nothing reaches the store.

use std::time::Duration;

use tonic::Status;

use super::status::invalid_argument;
use crate::domain::values::Bounds;
use crate::domain::{
    AttemptId, Checkpoint, Claim, CompleteCommand, Completion, EventId, EventRetention,
    ExtendLeaseCommand, Fingerprint, Instant, Invalid, Key, KeyRetention, KeyState, LeaseToken,
    LeaseTtl, Limits, LookupQuery, MAX_EVENT_IDS, MarkProcessedCommand, ProcessedEvent,
    ReleaseCommand, ResponseBody, Scope, TryStartCommand, TryStartOutcome,
};
use crate::proto::idempotency::v1 as pb;

/// Collects field violations while a request is parsed.
#[derive(Default)]
struct Violations(Vec<(String, String)>);

impl Violations {
    fn check<T>(&mut self, field: impl Into<String>, parsed: Result<T, Invalid>) -> Option<T> {
        match parsed {
            Ok(value) => Some(value),
            Err(Invalid(description)) => {
                self.0.push((field.into(), description));
                None
            }
        }
    }

    fn into_status(self) -> Status {
        invalid_argument(self.0)
    }
}

/// A `google.protobuf.Duration` as a std duration, or why it is not one within `bounds`.
/// Negative and malformed durations (nanos out of range, mixed signs) are refused.
fn std_duration(raw: prost_types::Duration, bounds: Bounds) -> Result<Duration, Invalid> {
    if raw.seconds < 0 || raw.nanos < 0 {
        return Err(bounds.out_of_range());
    }
    let seconds = raw.seconds.unsigned_abs();
    let nanos = raw.nanos.unsigned_abs();
    if nanos > 999_999_999 {
        return Err(Invalid(
            "is not a valid duration (nanos must be below one second)".into(),
        ));
    }
    Ok(Duration::new(seconds, nanos))
}

fn lease_ttl(raw: Option<prost_types::Duration>, default: LeaseTtl) -> Result<LeaseTtl, Invalid> {
    raw.map_or(Ok(default), |raw| {
        LeaseTtl::parse(std_duration(raw, LeaseTtl::BOUNDS)?)
    })
}

fn key_retention(raw: prost_types::Duration) -> Result<KeyRetention, Invalid> {
    KeyRetention::parse(std_duration(raw, KeyRetention::BOUNDS)?)
}

fn event_retention(raw: prost_types::Duration) -> Result<EventRetention, Invalid> {
    EventRetention::parse(std_duration(raw, EventRetention::BOUNDS)?)
}

pub fn timestamp(instant: Instant) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: instant.timestamp(),
        // Always below 2e9 (a leap second may add 1e9), so it fits.
        nanos: i32::try_from(instant.timestamp_subsec_nanos()).unwrap_or(999_999_999),
    }
}

pub fn try_start_command(
    request: pb::TryStartRequest,
    limits: &Limits,
) -> Result<TryStartCommand, Status> {
    let mut v = Violations::default();
    let namespace = v.check("namespace", Scope::parse(request.namespace));
    let key = v.check("key", Key::parse(request.key));
    let fingerprint = v.check("fingerprint", Fingerprint::parse(request.fingerprint));
    let lease_ttl = v.check(
        "lease_ttl",
        lease_ttl(request.lease_ttl, limits.default_lease_ttl),
    );
    let retention = v.check(
        "retention",
        request
            .retention
            .map_or(Ok(limits.default_key_retention), key_retention),
    );
    let attempt_id = v.check("attempt_id", AttemptId::parse(request.attempt_id));
    match (
        namespace,
        key,
        fingerprint,
        lease_ttl,
        retention,
        attempt_id,
    ) {
        (
            Some(namespace),
            Some(key),
            Some(fingerprint),
            Some(lease_ttl),
            Some(retention),
            Some(attempt_id),
        ) => Ok(TryStartCommand {
            namespace,
            key,
            fingerprint,
            lease_ttl,
            retention,
            attempt_id,
        }),
        _ => Err(v.into_status()),
    }
}

pub fn complete_command(
    request: pb::CompleteRequest,
    limits: &Limits,
) -> Result<CompleteCommand, Status> {
    let mut v = Violations::default();
    let namespace = v.check("namespace", Scope::parse(request.namespace));
    let key = v.check("key", Key::parse(request.key));
    let lease_token = v.check("lease_token", LeaseToken::parse(request.lease_token));
    let response = v.check(
        "response",
        ResponseBody::parse(request.response, limits.max_response_bytes),
    );
    let retention = v.check(
        "retention",
        request.retention.map(key_retention).transpose(),
    );
    match (namespace, key, lease_token, response, retention) {
        (Some(namespace), Some(key), Some(lease_token), Some(response), Some(retention)) => {
            Ok(CompleteCommand {
                namespace,
                key,
                lease_token,
                response,
                retention,
            })
        }
        _ => Err(v.into_status()),
    }
}

pub fn release_command(request: pb::ReleaseRequest) -> Result<ReleaseCommand, Status> {
    let mut v = Violations::default();
    let namespace = v.check("namespace", Scope::parse(request.namespace));
    let key = v.check("key", Key::parse(request.key));
    let lease_token = v.check("lease_token", LeaseToken::parse(request.lease_token));
    match (namespace, key, lease_token) {
        (Some(namespace), Some(key), Some(lease_token)) => Ok(ReleaseCommand {
            namespace,
            key,
            lease_token,
        }),
        _ => Err(v.into_status()),
    }
}

pub fn extend_lease_command(
    request: pb::ExtendLeaseRequest,
    limits: &Limits,
) -> Result<ExtendLeaseCommand, Status> {
    let mut v = Violations::default();
    let namespace = v.check("namespace", Scope::parse(request.namespace));
    let key = v.check("key", Key::parse(request.key));
    let lease_token = v.check("lease_token", LeaseToken::parse(request.lease_token));
    let lease_ttl = v.check(
        "lease_ttl",
        lease_ttl(request.lease_ttl, limits.default_lease_ttl),
    );
    let checkpoint = v.check(
        "checkpoint",
        request.checkpoint.map(Checkpoint::parse).transpose(),
    );
    match (namespace, key, lease_token, lease_ttl, checkpoint) {
        (Some(namespace), Some(key), Some(lease_token), Some(lease_ttl), Some(checkpoint)) => {
            Ok(ExtendLeaseCommand {
                namespace,
                key,
                lease_token,
                lease_ttl,
                checkpoint,
            })
        }
        _ => Err(v.into_status()),
    }
}

pub fn lookup_query(request: pb::LookupRequest) -> Result<LookupQuery, Status> {
    let mut v = Violations::default();
    let namespace = v.check("namespace", Scope::parse(request.namespace));
    let key = v.check("key", Key::parse(request.key));
    match (namespace, key) {
        (Some(namespace), Some(key)) => Ok(LookupQuery { namespace, key }),
        _ => Err(v.into_status()),
    }
}

pub fn mark_processed_command(
    request: pb::MarkProcessedRequest,
    limits: &Limits,
) -> Result<MarkProcessedCommand, Status> {
    let mut v = Violations::default();
    let consumer = v.check("consumer", Scope::parse(request.consumer));
    let count = request.event_ids.len();
    let event_ids = if (1..=MAX_EVENT_IDS).contains(&count) {
        let parsed: Vec<Option<EventId>> = request
            .event_ids
            .into_iter()
            .enumerate()
            .map(|(index, id)| v.check(format!("event_ids[{index}]"), EventId::parse(id)))
            .collect();
        parsed.into_iter().collect::<Option<Vec<EventId>>>()
    } else {
        // One violation for the field; its elements are not worth reporting one by one.
        v.check(
            "event_ids",
            Err(Invalid(format!(
                "must hold 1-{MAX_EVENT_IDS} event ids (got {count})"
            ))),
        )
    };
    let retention = v.check(
        "retention",
        request
            .retention
            .map_or(Ok(limits.default_event_retention), event_retention),
    );
    match (consumer, event_ids, retention) {
        (Some(consumer), Some(event_ids), Some(retention)) => Ok(MarkProcessedCommand {
            consumer,
            event_ids,
            retention,
        }),
        _ => Err(v.into_status()),
    }
}

fn started(claim: Claim) -> pb::ClaimStarted {
    pb::ClaimStarted {
        lease_token: claim.lease_token.as_u64(),
        lease_expires_at: Some(timestamp(claim.lease_expires_at)),
        attempt: claim.attempt,
        checkpoint: claim.checkpoint,
    }
}

pub fn try_start_response(outcome: TryStartOutcome) -> pb::TryStartResponse {
    use pb::try_start_response::Outcome;
    let outcome = match outcome {
        TryStartOutcome::Started(claim) => Outcome::Started(started(claim)),
        TryStartOutcome::InProgress {
            lease_expires_at,
            attempt,
        } => Outcome::InProgress(pb::ClaimInProgress {
            lease_expires_at: Some(timestamp(lease_expires_at)),
            attempt,
        }),
        TryStartOutcome::Completed {
            response,
            completion,
        } => Outcome::Completed(pb::ClaimCompleted {
            response,
            completed_at: Some(timestamp(completion.completed_at)),
            expires_at: Some(timestamp(completion.expires_at)),
        }),
        TryStartOutcome::FingerprintMismatch => {
            Outcome::FingerprintMismatch(pb::FingerprintMismatch {})
        }
    };
    pb::TryStartResponse {
        outcome: Some(outcome),
    }
}

pub fn complete_response(completion: Completion) -> pb::CompleteResponse {
    pb::CompleteResponse {
        completed_at: Some(timestamp(completion.completed_at)),
        expires_at: Some(timestamp(completion.expires_at)),
    }
}

pub fn lookup_response(state: KeyState) -> pb::LookupResponse {
    use pb::lookup_response::State;
    let state = match state {
        KeyState::Absent => State::Absent(pb::KeyAbsent {}),
        KeyState::InProgress {
            lease_expires_at,
            attempt,
            fingerprint,
        } => State::InProgress(pb::KeyInProgress {
            lease_expires_at: Some(timestamp(lease_expires_at)),
            attempt,
            fingerprint,
        }),
        KeyState::Completed {
            response,
            fingerprint,
            completion,
        } => State::Completed(pb::KeyCompleted {
            response,
            fingerprint,
            completed_at: Some(timestamp(completion.completed_at)),
            expires_at: Some(timestamp(completion.expires_at)),
        }),
    };
    pb::LookupResponse { state: Some(state) }
}

pub fn mark_processed_response(results: Vec<ProcessedEvent>) -> pb::MarkProcessedResponse {
    pb::MarkProcessedResponse {
        results: results
            .into_iter()
            .map(|event| pb::ProcessedEvent {
                event_id: event.event_id,
                already_processed: event.already_processed,
                processed_at: Some(timestamp(event.processed_at)),
            })
            .collect(),
    }
}
