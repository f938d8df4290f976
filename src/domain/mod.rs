//! The coordinator's model: validated values, the commands built from them, and the rules that
//! turn what the store found into the contract's outcomes. No I/O happens here.

pub mod values;

use chrono::{DateTime, Utc};

pub use values::{
    AttemptId, Checkpoint, EventId, EventRetention, Fingerprint, Invalid, Key, KeyRetention,
    LeaseToken, LeaseTtl, MAX_EVENT_IDS, ResponseBody, Scope,
};

/// An instant read from the database clock.
pub type Instant = DateTime<Utc>;

/// The server's defaults for fields a caller may leave out, and its response limit.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_lease_ttl: LeaseTtl,
    pub default_key_retention: KeyRetention,
    pub default_event_retention: EventRetention,
    pub max_response_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct TryStartCommand {
    pub namespace: Scope,
    pub key: Key,
    pub fingerprint: Fingerprint,
    pub lease_ttl: LeaseTtl,
    pub retention: KeyRetention,
    pub attempt_id: Option<AttemptId>,
}

#[derive(Debug, Clone)]
pub struct CompleteCommand {
    pub namespace: Scope,
    pub key: Key,
    pub lease_token: LeaseToken,
    pub response: ResponseBody,
    /// `None`: keep the key for the retention it was claimed with.
    pub retention: Option<KeyRetention>,
}

#[derive(Debug, Clone)]
pub struct ReleaseCommand {
    pub namespace: Scope,
    pub key: Key,
    pub lease_token: LeaseToken,
}

#[derive(Debug, Clone)]
pub struct ExtendLeaseCommand {
    pub namespace: Scope,
    pub key: Key,
    pub lease_token: LeaseToken,
    pub lease_ttl: LeaseTtl,
    /// `None` keeps the stored checkpoint; `Some`, even empty, replaces it.
    pub checkpoint: Option<Checkpoint>,
}

#[derive(Debug, Clone)]
pub struct LookupQuery {
    pub namespace: Scope,
    pub key: Key,
}

#[derive(Debug, Clone)]
pub struct MarkProcessedCommand {
    pub consumer: Scope,
    /// 1-1000 ids in request order, duplicates included.
    pub event_ids: Vec<EventId>,
    pub retention: EventRetention,
}

/// A claim the caller now holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub lease_token: LeaseToken,
    pub lease_expires_at: Instant,
    pub attempt: u32,
    pub checkpoint: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub completed_at: Instant,
    pub expires_at: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TryStartOutcome {
    Started(Claim),
    InProgress {
        lease_expires_at: Instant,
        attempt: u32,
    },
    Completed {
        response: Vec<u8>,
        completion: Completion,
    },
    FingerprintMismatch,
}

impl TryStartOutcome {
    /// A short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Started(_) => "started",
            Self::InProgress { .. } => "in_progress",
            Self::Completed { .. } => "completed",
            Self::FingerprintMismatch => "fingerprint_mismatch",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    Absent,
    InProgress {
        lease_expires_at: Instant,
        attempt: u32,
        fingerprint: Vec<u8>,
    },
    Completed {
        response: Vec<u8>,
        fingerprint: Vec<u8>,
        completion: Completion,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessedEvent {
    pub event_id: String,
    pub already_processed: bool,
    pub processed_at: Instant,
}

/// Why Complete, Release or ExtendLease was refused. The variants are listed in the order the
/// contract checks them: the first that applies wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("the key does not exist or has expired")]
    KeyNotFound,
    #[error("the lease token is not the current holder's")]
    LeaseLost,
    #[error("the key is already completed")]
    AlreadyCompleted,
}

/// A live key as it stands after TryStart's statement ran, plus whether that statement handed
/// out a new token (a fresh claim or a takeover).
#[derive(Debug, Clone)]
pub struct ClaimedRecord {
    pub newly_claimed: bool,
    pub lease_token: LeaseToken,
    pub attempt: u32,
    pub attempt_id: Option<String>,
    pub lease_expires_at: Instant,
    pub fingerprint: Vec<u8>,
    pub checkpoint: Option<Vec<u8>>,
    pub response: Option<Vec<u8>>,
    pub completed_at: Option<Instant>,
    pub expires_at: Instant,
}

impl TryStartOutcome {
    /// Reads TryStart's answer off the row its one statement left behind. The statement has
    /// already applied the contract's order (absent or expired, fingerprint, completed,
    /// attempt_id, running lease, takeover); this repeats the same order on the result, which is
    /// unambiguous because a new token is issued exactly when the caller got a new claim.
    pub fn from_record(record: ClaimedRecord, command: &TryStartCommand) -> Self {
        let started = |record: ClaimedRecord| {
            Self::Started(Claim {
                lease_token: record.lease_token,
                lease_expires_at: record.lease_expires_at,
                attempt: record.attempt,
                checkpoint: record.checkpoint,
            })
        };
        if record.newly_claimed {
            return started(record);
        }
        if record.fingerprint != command.fingerprint.as_bytes() {
            return Self::FingerprintMismatch;
        }
        if let (Some(response), Some(completed_at)) = (record.response.clone(), record.completed_at)
        {
            return Self::Completed {
                response,
                completion: Completion {
                    completed_at,
                    expires_at: record.expires_at,
                },
            };
        }
        let same_attempt = matches!(
            (&command.attempt_id, &record.attempt_id),
            (Some(requested), Some(held)) if requested.as_str() == held
        );
        if same_attempt {
            return started(record);
        }
        Self::InProgress {
            lease_expires_at: record.lease_expires_at,
            attempt: record.attempt,
        }
    }
}

/// What a guarded write found when it changed nothing: the live key's current token, and its
/// completion if it is completed.
#[derive(Debug, Clone)]
pub struct GuardedKey {
    pub lease_token: LeaseToken,
    pub completion: Option<Completion>,
    /// For Complete: whether the stored response equals the one offered.
    pub same_response: bool,
}

/// Why a Complete, Release or ExtendLease guarded on `token` did not apply, in the contract's
/// order: absent or expired, then a token that is not the current one, then completed.
/// `Ok(completion)` is the one case that is not a refusal: Complete repeated by the current
/// holder with the same response succeeds again with the same timestamps.
pub fn classify_refusal(
    found: Option<GuardedKey>,
    token: LeaseToken,
) -> Result<Option<Completion>, Rejection> {
    let Some(found) = found else {
        return Err(Rejection::KeyNotFound);
    };
    if found.lease_token != token {
        return Err(Rejection::LeaseLost);
    }
    match found.completion {
        Some(completion) if found.same_response => Ok(Some(completion)),
        Some(_) => Err(Rejection::AlreadyCompleted),
        // The current holder of an in-progress key: the write should have applied.
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(fingerprint: &[u8], attempt_id: Option<&str>) -> TryStartCommand {
        TryStartCommand {
            namespace: Scope::parse("ns".into()).expect("valid scope"),
            key: Key::parse("k".into()).expect("valid key"),
            fingerprint: Fingerprint::parse(fingerprint.to_vec()).expect("valid fingerprint"),
            lease_ttl: LeaseTtl::parse(std::time::Duration::from_secs(30)).expect("valid ttl"),
            retention: KeyRetention::parse(std::time::Duration::from_secs(60))
                .expect("valid retention"),
            attempt_id: attempt_id.map(|a| {
                AttemptId::parse(a.into())
                    .expect("valid attempt id")
                    .expect("non-empty")
            }),
        }
    }

    fn record(newly_claimed: bool, attempt_id: Option<&str>, completed: bool) -> ClaimedRecord {
        let now = Utc::now();
        ClaimedRecord {
            newly_claimed,
            lease_token: LeaseToken::from_stored(9),
            attempt: 2,
            attempt_id: attempt_id.map(str::to_owned),
            lease_expires_at: now,
            fingerprint: b"fp".to_vec(),
            checkpoint: Some(b"cp".to_vec()),
            response: completed.then(|| b"resp".to_vec()),
            completed_at: completed.then_some(now),
            expires_at: now,
        }
    }

    #[test]
    fn fingerprint_mismatch_wins_over_attempt_id() {
        let outcome = TryStartOutcome::from_record(
            record(false, Some("a"), false),
            &command(b"other", Some("a")),
        );
        assert_eq!(outcome, TryStartOutcome::FingerprintMismatch);
    }

    #[test]
    fn completed_wins_over_attempt_id() {
        let outcome = TryStartOutcome::from_record(
            record(false, Some("a"), true),
            &command(b"fp", Some("a")),
        );
        assert_eq!(outcome.name(), "completed");
    }

    #[test]
    fn same_attempt_id_is_started_with_the_same_token() {
        let outcome = TryStartOutcome::from_record(
            record(false, Some("a"), false),
            &command(b"fp", Some("a")),
        );
        match outcome {
            TryStartOutcome::Started(claim) => assert_eq!(claim.lease_token.get(), 9),
            other => panic!("expected started, got {other:?}"),
        }
    }

    #[test]
    fn other_attempt_ids_and_none_are_in_progress() {
        for attempt_id in [Some("b"), None] {
            let outcome = TryStartOutcome::from_record(
                record(false, Some("a"), false),
                &command(b"fp", attempt_id),
            );
            assert_eq!(outcome.name(), "in_progress");
        }
        let outcome =
            TryStartOutcome::from_record(record(false, None, false), &command(b"fp", None));
        assert_eq!(outcome.name(), "in_progress");
    }

    #[test]
    fn refusals_follow_the_contract_order() {
        let token = LeaseToken::from_stored(5);
        let completion = Completion {
            completed_at: Utc::now(),
            expires_at: Utc::now(),
        };
        assert_eq!(classify_refusal(None, token), Err(Rejection::KeyNotFound));
        let completed_by_other = GuardedKey {
            lease_token: LeaseToken::from_stored(6),
            completion: Some(completion.clone()),
            same_response: false,
        };
        assert_eq!(
            classify_refusal(Some(completed_by_other), token),
            Err(Rejection::LeaseLost)
        );
        let completed_other_response = GuardedKey {
            lease_token: token,
            completion: Some(completion.clone()),
            same_response: false,
        };
        assert_eq!(
            classify_refusal(Some(completed_other_response), token),
            Err(Rejection::AlreadyCompleted)
        );
        let completed_same_response = GuardedKey {
            lease_token: token,
            completion: Some(completion.clone()),
            same_response: true,
        };
        assert_eq!(
            classify_refusal(Some(completed_same_response), token),
            Ok(Some(completion))
        );
    }
}
