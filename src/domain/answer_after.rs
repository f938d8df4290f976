//! A TryStart answered from the answer just given to an earlier call of its key in the same
//! batch, without a statement of its own: safe only where that answer decides it and it would
//! change nothing (the coalescer's `FollowsEarlier`).

use super::{AttemptId, TryStartCommand, TryStartOutcome};

/// What TryStart `later` is answered when `earlier`, a TryStart of the same key that had
/// queued with it, has just been answered `earlier_answer` by the store, if that answer alone
/// decides it: the key is then known as `earlier`'s statement left it, under its lock, and
/// `later` changes nothing in it. `None` when `later` would write (a re-entry by the holder's
/// own attempt) or when the answer does not tell enough of the key (the fingerprint a mismatch
/// met): `later` then runs its own statement.
///
/// `later` is linearized right after `earlier`: it was waiting before `earlier`'s statement
/// ran, nothing else can touch the key until that statement commits, and by the clock that
/// statement read under the lock the key was live and any lease it reports still running
/// (a lease it granted ends a positive TTL after that reading).
pub fn answer_after(
    earlier: &TryStartCommand,
    earlier_answer: &TryStartOutcome,
    later: &TryStartCommand,
) -> Option<TryStartOutcome> {
    let same_fingerprint = later.fingerprint.as_bytes() == earlier.fingerprint.as_bytes();
    match earlier_answer {
        // The key is live with a fingerprint other than `earlier`'s, in a state not told.
        TryStartOutcome::FingerprintMismatch => {
            same_fingerprint.then_some(TryStartOutcome::FingerprintMismatch)
        }
        // Otherwise the key holds `earlier`'s fingerprint.
        _ if !same_fingerprint => Some(TryStartOutcome::FingerprintMismatch),
        TryStartOutcome::Completed { .. } => Some(earlier_answer.clone()),
        // Held under a running lease: only the holder's own attempt re-enters.
        TryStartOutcome::InProgress {
            holder_attempt_id, ..
        } => (!later.is_attempt(holder_attempt_id.as_deref())).then(|| earlier_answer.clone()),
        // The claim leaves the key in progress, held by `earlier`'s attempt.
        TryStartOutcome::Started(claim) => {
            let holder = earlier.attempt_id.as_ref().map(AttemptId::as_str);
            (!later.is_attempt(holder)).then(|| TryStartOutcome::InProgress {
                lease_expires_at: claim.lease_expires_at,
                attempt: claim.attempt,
                holder_attempt_id: holder.map(str::to_owned),
            })
        }
    }
}
