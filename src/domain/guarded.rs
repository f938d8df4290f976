//! Guarded writes (Complete, Release, ExtendLease), which apply only for the current holder's
//! token: when one changed nothing, why, in the contract's order.

use super::{Completion, Instant, KeyRecord, LeaseToken};

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

/// What a guarded write found when it changed nothing: the live key's current token, and its
/// completion if it is completed.
#[derive(Debug, Clone)]
pub struct GuardedKey {
    pub lease_token: LeaseToken,
    pub completion: Option<Completion>,
    /// For Complete: whether the stored response equals the one offered.
    pub same_response: bool,
}

impl GuardedKey {
    /// What a guarded write on `record` judges by, at `now`: nothing when the key has expired.
    /// `offered_response` is compared for Complete only.
    pub fn judge(
        record: Option<&KeyRecord>,
        now: Instant,
        offered_response: Option<&[u8]>,
    ) -> Option<Self> {
        let record = record.filter(|record| record.is_live(now))?;
        Some(Self {
            lease_token: record.lease_token,
            completion: record.completed_at.map(|completed_at| Completion {
                completed_at,
                expires_at: record.expires_at,
            }),
            same_response: offered_response.is_some()
                && record.response.as_deref() == offered_response,
        })
    }
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
