//! The coordinator's model: validated values, the commands built from them, and the rules that
//! turn what the store found into the contract's outcomes. No I/O happens here.
//!
//! - `values`: each field checked against the contract's bounds;
//! - `commands`: what each RPC asks, and who asks it ([`Holder`]);
//! - `key_identity`: a key named for batches and for change notifications;
//! - [`KeyRecord`] (here): a key as the store holds it;
//! - `claim`: what TryStart does to a record; `outcomes`: what it and Lookup answer from it;
//! - `guarded`: why a Complete, Release or ExtendLease changed nothing;
//! - `recheck` and `answer_after`: a TryStart answered without a statement of its own, from a
//!   read of its key or from the answer just given to an earlier call of it;
//! - `batch`, `budget`, `admin`: what batching, the operation timeout and the admin API need.

pub mod admin;
mod answer_after;
pub mod batch;
pub mod budget;
mod claim;
mod commands;
mod guarded;
mod key_identity;
mod outcomes;
mod recheck;
pub mod values;

use std::time::Duration;

use chrono::{DateTime, Utc};

pub use answer_after::answer_after;
pub use claim::{ClaimAction, claim_action, claimed_record};
pub use commands::{
    CompleteCommand, ExtendLeaseCommand, Holder, Limits, LookupQuery, MarkProcessedCommand,
    ReleaseCommand, TryStartCommand,
};
pub use guarded::{GuardedKey, Rejection, classify_refusal};
pub use key_identity::{KeyHash, key_id};
pub use outcomes::{Claim, ClaimKind, Completion, KeyState, ProcessedEvent, TryStartOutcome};
pub use recheck::Recheck;
pub use values::{
    AttemptId, Checkpoint, EventId, EventRetention, Fingerprint, Invalid, Key, KeyRetention,
    LeaseToken, LeaseTtl, MAX_EVENT_IDS, ResponseBody, Scope, WaitTime,
};

/// An instant read from the database clock.
pub type Instant = DateTime<Utc>;

/// `instant` + `duration`, saturating at the latest representable instant.
pub fn plus(instant: Instant, duration: Duration) -> Instant {
    chrono::Duration::from_std(duration)
        .ok()
        .and_then(|d| instant.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// A key as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub fingerprint: Vec<u8>,
    pub lease_token: LeaseToken,
    pub attempt: u32,
    pub attempt_id: Option<String>,
    pub lease_expires_at: Instant,
    pub checkpoint: Option<Vec<u8>>,
    pub response: Option<Vec<u8>>,
    pub completed_at: Option<Instant>,
    /// The retention the current claim asked for: a Complete without its own keeps the key this
    /// long after completion.
    pub retention: Duration,
    pub expires_at: Instant,
}

impl KeyRecord {
    /// Whether the key still exists at `now`: past its retention it is absent for every RPC.
    pub fn is_live(&self, now: Instant) -> bool {
        self.expires_at > now
    }
}

#[cfg(test)]
mod tests;
