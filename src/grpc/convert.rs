//! Between protobuf messages and domain types. Requests are parsed into commands whose fields
//! are validated types; every bad field is reported at once, and nothing reaches the store.

use std::time::Duration;

use tonic::Status;

use super::status::invalid_argument;
use crate::domain::values::{Bounds, out_of_range};
use crate::domain::{
    AttemptId, Checkpoint, Claim, CompleteCommand, Completion, EventId, EventRetention,
    ExtendLeaseCommand, Fingerprint, Instant, Invalid, Key, KeyRetention, KeyState, LeaseToken,
    LeaseTtl, Limits, LookupQuery, MAX_EVENT_IDS, MarkProcessedCommand, ProcessedEvent,
    ReleaseCommand, ResponseBody, Scope, TryStartCommand, TryStartOutcome, WaitTime,
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

    /// The key a call names: its namespace and key, each checked.
    fn named_key(&mut self, namespace: String, key: String) -> Option<(Scope, Key)> {
        let namespace = self.check("namespace", Scope::parse(namespace));
        let key = self.check("key", Key::parse(key));
        Some((namespace?, key?))
    }

    /// The key a holder's call names, with the holder's lease token.
    fn held_key(
        &mut self,
        namespace: String,
        key: String,
        lease_token: u64,
    ) -> Option<(Scope, Key, LeaseToken)> {
        let named = self.named_key(namespace, key);
        let lease_token = self.check("lease_token", LeaseToken::parse(lease_token));
        let (namespace, key) = named?;
        Some((namespace, key, lease_token?))
    }

    /// What `build` makes of the checked fields when none was refused; else every refusal,
    /// at once. `build` answers `None` exactly when a field was refused.
    fn finish<T>(self, build: impl FnOnce() -> Option<T>) -> Result<T, Status> {
        match build() {
            Some(value) if self.0.is_empty() => Ok(value),
            _ => Err(self.into_status()),
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
        return Err(out_of_range(bounds));
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

/// A TryStart as the caller asked for it: the command, and how long it may wait for a holder.
#[derive(Debug, Clone)]
pub struct TryStartCall {
    pub command: TryStartCommand,
    pub wait: WaitTime,
}

pub fn try_start_call(
    request: pb::TryStartRequest,
    limits: &Limits,
) -> Result<TryStartCall, Status> {
    let mut v = Violations::default();
    let named = v.named_key(request.namespace, request.key);
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
    let wait = v.check(
        "wait",
        request.wait.map_or(WaitTime::parse(Duration::ZERO), |raw| {
            WaitTime::parse(std_duration(raw, WaitTime::BOUNDS)?)
        }),
    );
    v.finish(|| {
        let (namespace, key) = named?;
        Some(TryStartCall {
            command: TryStartCommand {
                namespace,
                key,
                fingerprint: fingerprint?,
                lease_ttl: lease_ttl?,
                retention: retention?,
                attempt_id: attempt_id?,
                holder: None,
            },
            wait: wait?,
        })
    })
}

pub fn complete_command(
    request: pb::CompleteRequest,
    limits: &Limits,
) -> Result<CompleteCommand, Status> {
    let mut v = Violations::default();
    let held = v.held_key(request.namespace, request.key, request.lease_token);
    let response = v.check(
        "response",
        ResponseBody::parse(request.response, limits.max_response_bytes),
    );
    let retention = v.check(
        "retention",
        request.retention.map(key_retention).transpose(),
    );
    v.finish(|| {
        let (namespace, key, lease_token) = held?;
        Some(CompleteCommand {
            namespace,
            key,
            lease_token,
            response: response?,
            retention: retention?,
        })
    })
}

pub fn release_command(request: pb::ReleaseRequest) -> Result<ReleaseCommand, Status> {
    let mut v = Violations::default();
    let held = v.held_key(request.namespace, request.key, request.lease_token);
    v.finish(|| {
        let (namespace, key, lease_token) = held?;
        Some(ReleaseCommand {
            namespace,
            key,
            lease_token,
        })
    })
}

pub fn extend_lease_command(
    request: pb::ExtendLeaseRequest,
    limits: &Limits,
) -> Result<ExtendLeaseCommand, Status> {
    let mut v = Violations::default();
    let held = v.held_key(request.namespace, request.key, request.lease_token);
    let lease_ttl = v.check(
        "lease_ttl",
        lease_ttl(request.lease_ttl, limits.default_lease_ttl),
    );
    let checkpoint = v.check(
        "checkpoint",
        request.checkpoint.map(Checkpoint::parse).transpose(),
    );
    v.finish(|| {
        let (namespace, key, lease_token) = held?;
        Some(ExtendLeaseCommand {
            namespace,
            key,
            lease_token,
            lease_ttl: lease_ttl?,
            checkpoint: checkpoint?,
        })
    })
}

pub fn lookup_query(request: pb::LookupRequest) -> Result<LookupQuery, Status> {
    let mut v = Violations::default();
    let named = v.named_key(request.namespace, request.key);
    v.finish(|| {
        let (namespace, key) = named?;
        Some(LookupQuery { namespace, key })
    })
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
    v.finish(|| {
        Some(MarkProcessedCommand {
            consumer: consumer?,
            event_ids: event_ids?,
            retention: retention?,
        })
    })
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
            ..
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
            ..
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

#[cfg(test)]
mod tests {
    //! Fuzzing the edge: arbitrary requests, biased towards every bound, against an oracle of
    //! the contract's limits written independently of the validated types. A request is accepted
    //! exactly when the oracle finds nothing wrong, and otherwise refused with one violation per
    //! field the oracle rejects, in field order.

    use proptest::prelude::*;
    use tonic_types::StatusExt;

    use super::*;

    const DAY: i64 = 24 * 3600;

    fn limits() -> Limits {
        Limits {
            default_lease_ttl: LeaseTtl::parse(Duration::from_secs(30)).expect("valid"),
            default_key_retention: KeyRetention::parse(Duration::from_secs(60)).expect("valid"),
            default_event_retention: EventRetention::parse(Duration::from_secs(60)).expect("valid"),
            max_response_bytes: 16,
        }
    }

    /// Characters that make a string interesting: the scope alphabet, punctuation outside it,
    /// multi-byte letters, and control characters at both ends of both Cc ranges.
    fn interesting_char() -> impl Strategy<Value = char> {
        prop_oneof![
            4 => prop::sample::select(vec!['a', 'Z', '0', '.', '_', '-', ':']),
            1 => prop::sample::select(vec![' ', '/', '*', 'é', '🚀', '\u{a0}', '\u{200b}']),
            1 => prop::sample::select(vec!['\u{0}', '\u{1f}', '\u{7f}', '\u{80}', '\u{9f}']),
        ]
    }

    /// Strings of about `len` characters, with lengths clustered around the bounds.
    fn text(bounds: &'static [usize]) -> impl Strategy<Value = String> {
        (prop::sample::select(bounds), -1i32..=1)
            .prop_flat_map(|(len, delta)| {
                let len = (len as i64 + i64::from(delta)).max(0) as usize;
                prop::collection::vec(interesting_char(), len..=len)
            })
            .prop_map(|chars| chars.into_iter().collect())
    }

    fn duration() -> impl Strategy<Value = Option<prost_types::Duration>> {
        let seconds = prop::sample::select(vec![
            -1,
            0,
            1,
            DAY - 1,
            DAY,
            DAY + 1,
            30 * DAY,
            30 * DAY + 1,
            1000 * 365 * DAY,
        ]);
        let nanos = prop::sample::select(vec![
            -1,
            0,
            1,
            99_999_999,
            100_000_000,
            999_999_999,
            1_000_000_000,
        ]);
        proptest::option::of(
            (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
        )
    }

    // The oracle: the contract's table, spelled out independently.
    fn scope_ok(s: &str) -> bool {
        let n = s.chars().count();
        (1..=64).contains(&n)
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-_:".contains(c))
    }
    fn cc(c: char) -> bool {
        ('\u{0}'..='\u{1f}').contains(&c) || ('\u{7f}'..='\u{9f}').contains(&c)
    }
    fn id_ok(s: &str, max_bytes: usize) -> bool {
        (1..=max_bytes).contains(&s.len()) && !s.chars().any(cc)
    }
    fn duration_ok(d: &Option<prost_types::Duration>, min_nanos: i128, max_nanos: i128) -> bool {
        let Some(d) = d else { return true };
        if d.seconds < 0 || d.nanos < 0 || d.nanos > 999_999_999 {
            return false;
        }
        let total = i128::from(d.seconds) * 1_000_000_000 + i128::from(d.nanos);
        (min_nanos..=max_nanos).contains(&total)
    }
    const LEASE: (i128, i128) = (100_000_000, 86_400 * 1_000_000_000);
    const RETENTION: (i128, i128) = (1_000_000_000, 30 * 86_400 * 1_000_000_000);
    const WAIT: (i128, i128) = (0, 60 * 1_000_000_000);

    /// Waits around TryStart's bounds (0 and 60 s), malformed ones included.
    fn wait_time() -> impl Strategy<Value = Option<prost_types::Duration>> {
        let seconds = prop::sample::select(vec![-1i64, 0, 1, 59, 60, 61, 1_000_000]);
        let nanos = prop::sample::select(vec![-1i32, 0, 1, 999_999_999, 1_000_000_000]);
        proptest::option::of(
            (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
        )
    }

    fn violations(status: &Status) -> Vec<String> {
        status
            .get_error_details()
            .bad_request()
            .map(|b| b.field_violations.iter().map(|v| v.field.clone()).collect())
            .unwrap_or_default()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn try_start_is_refused_exactly_for_the_fields_the_contract_rejects(
            namespace in text(&[0, 1, 64, 65]),
            key in text(&[0, 1, 127, 255, 256]),
            fingerprint in prop::collection::vec(any::<u8>(), 0..=66),
            lease_ttl in duration(),
            retention in duration(),
            attempt_id in text(&[0, 1, 64, 128, 129]),
            wait in wait_time(),
        ) {
            let mut expected = Vec::new();
            if !scope_ok(&namespace) { expected.push("namespace"); }
            if !id_ok(&key, 255) { expected.push("key"); }
            if fingerprint.len() > 64 { expected.push("fingerprint"); }
            if !duration_ok(&lease_ttl, LEASE.0, LEASE.1) { expected.push("lease_ttl"); }
            if !duration_ok(&retention, RETENTION.0, RETENTION.1) { expected.push("retention"); }
            if !attempt_id.is_empty() && !id_ok(&attempt_id, 128) { expected.push("attempt_id"); }
            if !duration_ok(&wait, WAIT.0, WAIT.1) { expected.push("wait"); }
            let request = pb::TryStartRequest {
                namespace, key, fingerprint, lease_ttl, retention, attempt_id, wait,
            };
            match try_start_call(request, &limits()) {
                Ok(_) => prop_assert!(expected.is_empty(), "accepted despite {expected:?}"),
                Err(status) => {
                    prop_assert_eq!(status.code(), tonic::Code::InvalidArgument);
                    prop_assert_eq!(violations(&status), expected);
                }
            }
        }

        #[test]
        fn complete_and_extend_lease_check_tokens_payloads_and_durations(
            token in prop::sample::select(vec![0, 1, i64::MAX as u64, i64::MAX as u64 + 1, u64::MAX]),
            response in prop::collection::vec(any::<u8>(), 15..=17),
            retention in duration(),
            lease_ttl in duration(),
            checkpoint in proptest::option::of(
                prop::sample::select(vec![0usize, 65_536, 65_537])
                    .prop_map(|n| vec![7u8; n]),
            ),
        ) {
            let token_ok = token != 0 && token <= i64::MAX as u64;
            let mut expected = Vec::new();
            if !token_ok { expected.push("lease_token"); }
            if response.len() > 16 { expected.push("response"); }
            if !duration_ok(&retention, RETENTION.0, RETENTION.1) { expected.push("retention"); }
            let request = pb::CompleteRequest {
                namespace: "ns".into(), key: "k".into(), lease_token: token, response, retention,
            };
            match complete_command(request, &limits()) {
                Ok(_) => prop_assert!(expected.is_empty(), "accepted despite {expected:?}"),
                Err(status) => prop_assert_eq!(violations(&status), expected),
            }

            let mut expected = Vec::new();
            if !token_ok { expected.push("lease_token"); }
            if !duration_ok(&lease_ttl, LEASE.0, LEASE.1) { expected.push("lease_ttl"); }
            if checkpoint.as_ref().is_some_and(|c| c.len() > 65_536) { expected.push("checkpoint"); }
            let request = pb::ExtendLeaseRequest {
                namespace: "ns".into(), key: "k".into(), lease_token: token, lease_ttl, checkpoint,
            };
            match extend_lease_command(request, &limits()) {
                Ok(_) => prop_assert!(expected.is_empty(), "accepted despite {expected:?}"),
                Err(status) => prop_assert_eq!(violations(&status), expected),
            }
        }

        #[test]
        fn mark_processed_names_each_bad_event_id(
            consumer in text(&[0, 1, 64, 65]),
            ids in prop::collection::vec(text(&[0, 1, 255, 256]), 0..8),
            extra in prop::sample::select(vec![0usize, 992, 993, 994]),
            retention in duration(),
        ) {
            let mut event_ids = ids;
            event_ids.extend((0..extra).map(|i| format!("filler-{i}")));
            let mut expected = Vec::new();
            if !scope_ok(&consumer) { expected.push("consumer".to_owned()); }
            if (1..=1000).contains(&event_ids.len()) {
                for (index, id) in event_ids.iter().enumerate() {
                    if !id_ok(id, 255) { expected.push(format!("event_ids[{index}]")); }
                }
            } else {
                expected.push("event_ids".to_owned());
            }
            if !duration_ok(&retention, RETENTION.0, RETENTION.1) { expected.push("retention".to_owned()); }
            let request = pb::MarkProcessedRequest { consumer, event_ids, retention };
            match mark_processed_command(request, &limits()) {
                Ok(command) => {
                    prop_assert!(expected.is_empty(), "accepted despite {expected:?}");
                    prop_assert!(!command.event_ids.is_empty() && command.event_ids.len() <= 1000);
                }
                Err(status) => prop_assert_eq!(violations(&status), expected),
            }
        }
    }
}
