//! TryStart's decision table in code: what it does to a key, and the key it leaves. The SQLite
//! store decides with these; the PostgreSQL store applies the same table inside its one
//! statement (`TRY_START`), so the two must agree.

use super::{Instant, KeyRecord, LeaseToken, TryStartCommand, plus};

/// What TryStart does to a key, in the contract's order. The PostgreSQL store applies the same
/// table inside its one statement (`TRY_START`); stores that decide in code call [`claim_action`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimAction {
    /// Absent or expired: a fresh claim, attempt 1.
    Fresh,
    /// Another fingerprint, a completed key, or a lease still running: change nothing, answer.
    Answer,
    /// The holder's own attempt_id: the same claim, its lease renewed to the later expiry.
    Reenter,
    /// The lease ran out and nobody re-entered: a new token, attempt + 1, checkpoint kept.
    Takeover,
}

/// Decides TryStart for the key as it stands at `now`.
pub fn claim_action(
    existing: Option<&KeyRecord>,
    now: Instant,
    command: &TryStartCommand,
) -> ClaimAction {
    let Some(key) = existing.filter(|key| key.is_live(now)) else {
        return ClaimAction::Fresh;
    };
    if key.fingerprint != command.fingerprint.as_bytes() || key.completed_at.is_some() {
        return ClaimAction::Answer;
    }
    if command.is_attempt(key.attempt_id.as_deref()) {
        ClaimAction::Reenter
    } else if key.lease_expires_at > now {
        ClaimAction::Answer
    } else {
        ClaimAction::Takeover
    }
}

fn later(a: Instant, b: Instant) -> Instant {
    a.max(b)
}

/// The key after TryStart applied `action` at `now`. `new_token` is used by a fresh claim and a
/// takeover; an answer leaves the key as it was.
pub fn claimed_record(
    existing: Option<KeyRecord>,
    action: ClaimAction,
    now: Instant,
    command: &TryStartCommand,
    new_token: LeaseToken,
) -> Option<KeyRecord> {
    let lease_end = plus(now, command.lease_ttl.get());
    // Retention is stretched, not refused, to cover the lease.
    let retention_end = plus(now, command.retention.get().max(command.lease_ttl.get()));
    let attempt_id = command.attempt_id.as_ref().map(|a| a.as_str().to_owned());
    match (action, existing) {
        (ClaimAction::Fresh, _) => Some(KeyRecord {
            fingerprint: command.fingerprint.as_bytes().to_vec(),
            lease_token: new_token,
            attempt: 1,
            attempt_id,
            lease_expires_at: lease_end,
            checkpoint: None,
            response: None,
            completed_at: None,
            retention: command.retention.get(),
            expires_at: retention_end,
        }),
        (ClaimAction::Takeover, Some(old)) => Some(KeyRecord {
            lease_token: new_token,
            attempt: old.attempt.saturating_add(1),
            attempt_id,
            lease_expires_at: lease_end,
            retention: command.retention.get(),
            expires_at: later(old.expires_at, retention_end),
            ..old
        }),
        (ClaimAction::Reenter, Some(old)) => {
            let lease_expires_at = later(old.lease_expires_at, lease_end);
            Some(KeyRecord {
                lease_expires_at,
                expires_at: later(old.expires_at, lease_expires_at),
                ..old
            })
        }
        (_, existing) => existing,
    }
}
