//! What a TryStart waiting for its key should do, judged from a read of the key and without
//! writing: answer now, keep waiting for the holder, or run TryStart itself.

use super::{Instant, KeyState, TryStartCommand, TryStartOutcome};

/// What a waiting TryStart should do about its key, judged from a read of it (see
/// [`KeyState::recheck`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recheck {
    /// TryStart would answer this now, without changing anything.
    Answer(TryStartOutcome),
    /// Another caller's lease holds the key until then, unless it has run out by now.
    Held {
        lease_expires_at: Instant,
        attempt: u32,
        holder_attempt_id: Option<String>,
    },
    /// TryStart would claim, take over or re-enter the key: only TryStart itself may decide.
    Claimable,
}

impl Recheck {
    /// Whether `outcome` is an `in_progress` of the holding this found: the same lease end
    /// and attempt (a takeover or a new claim since would change at least one).
    pub fn is_held_as(&self, outcome: &TryStartOutcome) -> bool {
        match (self, outcome) {
            (
                Self::Held {
                    lease_expires_at,
                    attempt,
                    ..
                },
                TryStartOutcome::InProgress {
                    lease_expires_at: answered_lease,
                    attempt: answered_attempt,
                    ..
                },
            ) => lease_expires_at == answered_lease && attempt == answered_attempt,
            _ => false,
        }
    }
}

impl KeyState {
    /// Judges the key for a waiting `command` by TryStart's order, without writing: what only
    /// answers (a mismatch, a completion) is answered; whatever would change the key is left
    /// to TryStart.
    pub fn recheck(&self, command: &TryStartCommand) -> Recheck {
        match self {
            Self::Absent => Recheck::Claimable,
            Self::Completed { fingerprint, .. } | Self::InProgress { fingerprint, .. }
                if fingerprint.as_slice() != command.fingerprint.as_bytes() =>
            {
                Recheck::Answer(TryStartOutcome::FingerprintMismatch)
            }
            Self::Completed {
                response,
                completion,
                ..
            } => Recheck::Answer(TryStartOutcome::Completed {
                response: response.clone(),
                completion: completion.clone(),
            }),
            Self::InProgress { attempt_id, .. } if command.is_attempt(attempt_id.as_deref()) => {
                Recheck::Claimable
            }
            Self::InProgress {
                lease_expires_at,
                attempt,
                attempt_id,
                ..
            } => Recheck::Held {
                lease_expires_at: *lease_expires_at,
                attempt: *attempt,
                holder_attempt_id: attempt_id.clone(),
            },
        }
    }
}
