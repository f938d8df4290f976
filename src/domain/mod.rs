//! The coordinator's model: validated values, the commands built from them, and the rules that
//! turn what the store found into the contract's outcomes. No I/O happens here.

pub mod admin;
pub mod batch;
pub mod budget;
pub mod values;

use std::time::Duration;

use chrono::{DateTime, Utc};

pub use values::{
    AttemptId, Checkpoint, EventId, EventRetention, Fingerprint, Invalid, Key, KeyRetention,
    LeaseToken, LeaseTtl, MAX_EVENT_IDS, ResponseBody, Scope, WaitTime,
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
    /// Who calls, recorded with a claim for the admin API; `None` for an anonymous caller.
    pub holder: Option<Holder>,
}

/// Who made a claim or an admin change, as the admin API and the audit trail show it:
/// `token:<name>` for a caller with a token, `cert:<subject>` for one known by its client
/// certificate, `loopback` for an anonymous admin caller on loopback. At most
/// [`Holder::MAX_BYTES`] (a longer name is cut at a character boundary): a certificate's
/// subject is the client's to choose. Cheap to clone: every call of a caller shares one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder(std::sync::Arc<str>);

impl Holder {
    pub const MAX_BYTES: usize = 512;

    pub fn token(name: &str) -> Self {
        Self::named("token:", name)
    }

    pub fn certificate(subject: &str) -> Self {
        Self::named("cert:", subject)
    }

    pub fn loopback() -> Self {
        Self::named("loopback", "")
    }

    fn named(kind: &str, name: &str) -> Self {
        let mut whole = String::with_capacity(kind.len() + name.len());
        whole.push_str(kind);
        for character in name.chars() {
            if whole.len() + character.len_utf8() > Self::MAX_BYTES {
                break;
            }
            // A subject may carry anything; a log or a table must not get control characters.
            whole.push(if character.is_control() {
                '?'
            } else {
                character
            });
        }
        Self(whole.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryStartCommand {
    /// Whether this call is the attempt `holder_attempt_id` names, which re-enters its claim. An
    /// absent attempt_id (the empty one) never matches, not even another absent one.
    pub fn is_attempt(&self, holder_attempt_id: Option<&str>) -> bool {
        matches!(
            (&self.attempt_id, holder_attempt_id),
            (Some(asked), Some(holder)) if asked.as_str() == holder
        )
    }
}

/// A key's identity as change notifications carry it: the SHA-256 of namespace, U+001F and key,
/// in lowercase hex (the PostgreSQL store computes the same in SQL). It names the key without
/// revealing it to whoever can read notifications.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyHash(String);

impl KeyHash {
    pub fn of(namespace: &Scope, key: &Key) -> Self {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        hasher.update(namespace.as_str().as_bytes());
        hasher.update([0x1f]);
        hasher.update(key.as_str().as_bytes());
        Self(hex::encode(hasher.finalize()))
    }

    /// A hash received from elsewhere (a notification), if it is one.
    pub fn from_hex(text: &str) -> Option<Self> {
        let is_hash = text.len() == 64
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        is_hash.then(|| Self(text.to_owned()))
    }
}

/// A key's identity across namespaces, owned: what batches compare and look keys up by.
pub fn key_id(namespace: &Scope, key: &Key) -> (String, String) {
    (namespace.as_str().to_owned(), key.as_str().to_owned())
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

fn later(a: Instant, b: Instant) -> Instant {
    a.max(b)
}

/// `instant` + `duration`, saturating at the latest representable instant.
pub fn plus(instant: Instant, duration: Duration) -> Instant {
    chrono::Duration::from_std(duration)
        .ok()
        .and_then(|d| instant.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
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

#[cfg(test)]
mod tests;
