//! What the contract answers (a TryStart's outcome, a key's state for Lookup, an event's
//! processing), and how each is read off the key as the store left it.

use super::{Instant, KeyRecord, LeaseToken, TryStartCommand};

/// A claim the caller now holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub lease_token: LeaseToken,
    pub lease_expires_at: Instant,
    pub attempt: u32,
    pub checkpoint: Option<Vec<u8>>,
    /// How the caller came to hold the key (for metrics; callers are told only the attempt).
    pub kind: ClaimKind,
}

/// How a TryStart answered `started` came to hold its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimKind {
    /// The key was absent (or expired): attempt 1.
    Fresh,
    /// The lease had run out and this caller took the key over: a new token, attempt + 1.
    Takeover,
    /// The holder's own attempt_id came back: the same claim, its lease renewed.
    Reentry,
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
        /// The holder's attempt id (None: it gave none): never shown to callers; it tells
        /// whether a later call of the key would re-enter (`answer_after`).
        holder_attempt_id: Option<String>,
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

impl TryStartOutcome {
    /// Reads TryStart's answer off the key as TryStart left it. The store has already applied
    /// the contract's order (absent or expired, fingerprint, completed, attempt_id, running
    /// lease, takeover); this repeats the same order on the result, which is unambiguous because
    /// a new token is issued exactly when the caller got a new claim (`newly_claimed`).
    pub fn from_record(record: KeyRecord, newly_claimed: bool, command: &TryStartCommand) -> Self {
        let started = |record: KeyRecord, kind: ClaimKind| {
            Self::Started(Claim {
                lease_token: record.lease_token,
                lease_expires_at: record.lease_expires_at,
                attempt: record.attempt,
                checkpoint: record.checkpoint,
                kind,
            })
        };
        if newly_claimed {
            // A fresh claim is always attempt 1, a takeover always a later one.
            let kind = if record.attempt > 1 {
                ClaimKind::Takeover
            } else {
                ClaimKind::Fresh
            };
            return started(record, kind);
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
        if command.is_attempt(record.attempt_id.as_deref()) {
            return started(record, ClaimKind::Reentry);
        }
        Self::InProgress {
            lease_expires_at: record.lease_expires_at,
            attempt: record.attempt,
            holder_attempt_id: record.attempt_id,
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
        /// The holder's attempt id: never shown to callers, used to tell re-entry apart.
        attempt_id: Option<String>,
    },
    Completed {
        response: Vec<u8>,
        fingerprint: Vec<u8>,
        completion: Completion,
    },
}

impl KeyState {
    /// What Lookup reports for `record`, the key's row if it is live (expired rows are absent).
    pub fn of(record: Option<KeyRecord>) -> Self {
        match record {
            None => Self::Absent,
            Some(KeyRecord {
                fingerprint,
                response: Some(response),
                completed_at: Some(completed_at),
                expires_at,
                ..
            }) => Self::Completed {
                response,
                fingerprint,
                completion: Completion {
                    completed_at,
                    expires_at,
                },
            },
            Some(record) => Self::InProgress {
                lease_expires_at: record.lease_expires_at,
                attempt: record.attempt,
                fingerprint: record.fingerprint,
                attempt_id: record.attempt_id,
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessedEvent {
    pub event_id: String,
    pub already_processed: bool,
    pub processed_at: Instant,
}
