//! Rows as PostgreSQL's statements return them, and what they mean in the domain.

use sqlx::FromRow;

use crate::domain::{
    Completion, GuardedKey, Instant, LeaseToken, ProcessedEvent, Rejection, TryStartCommand,
    TryStartOutcome, classify_refusal,
};
use crate::store::StoreError;
use crate::store::schema;

/// A key's row as PostgreSQL decodes it: instants as `timestamptz`, the attempt `int4`.
pub(super) type KeyRow = schema::KeyRow<Instant, i32>;

/// A row of [`super::sql::LOOKUP_WATCHED`]: the key, and whether a waiter watches it already.
#[derive(FromRow)]
pub(super) struct WatchedKeyRow {
    #[sqlx(flatten)]
    pub(super) key: KeyRow,
    pub(super) watched: bool,
}

/// A row of [`super::sql::WATCH_KEY`]: the key as it stands once marked, and whether it is
/// still live.
#[derive(FromRow)]
pub(super) struct MarkedKeyRow {
    #[sqlx(flatten)]
    pub(super) key: KeyRow,
    pub(super) live: bool,
}

/// The key as TryStart left it, and whether this call claimed it.
#[derive(FromRow)]
pub(super) struct TryStartRow {
    newly_claimed: bool,
    #[sqlx(flatten)]
    key: KeyRow,
}

impl TryStartRow {
    /// What `command`'s TryStart answers.
    pub(super) fn outcome(self, command: &TryStartCommand) -> TryStartOutcome {
        TryStartOutcome::from_record(self.key.into(), self.newly_claimed, command)
    }
}

/// A row of [`super::sql::TRY_START_BATCH`]: which key it is, and the key as TryStart left it.
#[derive(FromRow)]
pub(super) struct TryStartBatchRow {
    pub(super) namespace: String,
    #[sqlx(rename = "key")]
    pub(super) key_name: String,
    #[sqlx(flatten)]
    pub(super) claim: TryStartRow,
}

#[derive(FromRow)]
pub(super) struct GuardRow {
    pub(super) lease_token: i64,
    pub(super) completed_at: Option<Instant>,
    pub(super) expires_at: Instant,
    pub(super) same_response: bool,
}

impl From<GuardRow> for GuardedKey {
    fn from(row: GuardRow) -> Self {
        Self {
            lease_token: LeaseToken::from_stored(row.lease_token),
            completion: row.completed_at.map(|completed_at| Completion {
                completed_at,
                expires_at: row.expires_at,
            }),
            same_response: row.same_response,
        }
    }
}

/// A row of [`super::sql::COMPLETE`] (one per call, in call order) or of
/// [`super::sql::COMPLETE_ONE`]: the completion if it applied, and otherwise the key as it stood
/// under the lock (all `NULL` if there was no row).
#[derive(FromRow)]
pub(super) struct CompleteRow {
    pub(super) applied_at: Option<Instant>,
    pub(super) applied_expires_at: Option<Instant>,
    pub(super) live: bool,
    pub(super) lease_token: Option<i64>,
    pub(super) completed_at: Option<Instant>,
    pub(super) expires_at: Option<Instant>,
    pub(super) same_response: bool,
}

impl CompleteRow {
    /// The call's answer, as the one-key judgement of a guarded write would give it.
    pub(super) fn answer(
        self,
        token: LeaseToken,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        if let (Some(completed_at), Some(expires_at)) = (self.applied_at, self.applied_expires_at) {
            return Ok(Ok(Completion {
                completed_at,
                expires_at,
            }));
        }
        let found = match (self.live, self.lease_token, self.expires_at) {
            (true, Some(lease_token), Some(expires_at)) => Some(GuardedKey {
                lease_token: LeaseToken::from_stored(lease_token),
                completion: self.completed_at.map(|completed_at| Completion {
                    completed_at,
                    expires_at,
                }),
                same_response: self.same_response,
            }),
            _ => None,
        };
        match classify_refusal(found, token) {
            Err(rejection) => Ok(Err(rejection)),
            Ok(Some(completion)) => Ok(Ok(completion)),
            Ok(None) => Err(StoreError::Inconsistent(
                "a Complete was refused to the holder of a live, open key",
            )),
        }
    }
}

#[derive(FromRow)]
pub(super) struct MarkRow {
    pub(super) event_id: String,
    pub(super) processed_at: Instant,
    pub(super) already_processed: bool,
}

impl From<MarkRow> for ProcessedEvent {
    fn from(row: MarkRow) -> Self {
        Self {
            event_id: row.event_id,
            already_processed: row.already_processed,
            processed_at: row.processed_at,
        }
    }
}
