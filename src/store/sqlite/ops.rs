//! The read-decide-write steps of each change, run inside the writer's transaction: read the
//! key, decide with the domain's own functions, write the outcome.

use std::collections::HashMap;

use sqlx::SqliteConnection;

use super::error::classify;
use super::rows::{EventRow, KeyRow, duration_micros, instant, micros};
use super::sql::*;
use crate::domain::{
    ClaimAction, CompleteCommand, Completion, ExtendLeaseCommand, GuardedKey, Instant, KeyRecord,
    LeaseToken, MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome, claim_action, claimed_record, classify_refusal, plus,
};
use crate::store::StoreError;

pub(super) async fn now(connection: &mut SqliteConnection) -> Result<Instant, StoreError> {
    let (now,): (i64,) = sqlx::query_as(NOW)
        .fetch_one(connection)
        .await
        .map_err(classify)?;
    Ok(instant(now))
}

async fn select_key(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
) -> Result<Option<KeyRecord>, StoreError> {
    let row: Option<KeyRow> = sqlx::query_as(SELECT_KEY)
        .bind(namespace)
        .bind(key)
        .fetch_optional(connection)
        .await
        .map_err(classify)?;
    Ok(row.map(KeyRecord::from))
}

async fn write_key(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
    record: &KeyRecord,
) -> Result<(), StoreError> {
    write_record(connection, namespace, key, record, None).await
}

/// A claim's record (a fresh claim or a takeover), with the claim's time and holder, which the
/// key's other writes leave as they are.
async fn write_claim(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
    record: &KeyRecord,
    claimed_at: Instant,
    command: &TryStartCommand,
) -> Result<(), StoreError> {
    let claim = (claimed_at, command.holder.as_ref().map(|h| h.as_str()));
    write_record(connection, namespace, key, record, Some(claim)).await
}

async fn write_record(
    connection: &mut SqliteConnection,
    namespace: &str,
    key: &str,
    record: &KeyRecord,
    claim: Option<(Instant, Option<&str>)>,
) -> Result<(), StoreError> {
    let statement = if claim.is_some() {
        UPSERT_CLAIMED_KEY
    } else {
        UPSERT_KEY
    };
    let mut query = sqlx::query(statement)
        .bind(namespace)
        .bind(key)
        .bind(&record.fingerprint)
        .bind(record.lease_token.get())
        .bind(i64::from(record.attempt))
        .bind(record.attempt_id.as_deref())
        .bind(micros(record.lease_expires_at))
        .bind(record.checkpoint.as_deref())
        .bind(record.response.as_deref())
        .bind(record.completed_at.map(micros))
        .bind(duration_micros(record.retention))
        .bind(micros(record.expires_at));
    if let Some((claimed_at, holder)) = claim {
        query = query.bind(micros(claimed_at)).bind(holder);
    }
    query.execute(connection).await.map_err(classify)?;
    Ok(())
}

/// The key's record and the verdict of a guarded write on it, inside a write transaction.
struct Guard {
    now: Instant,
    record: Option<KeyRecord>,
    /// `Ok(None)`: the caller holds the in-progress key, the write applies.
    verdict: Result<Option<Completion>, Rejection>,
}

async fn judge(
    connection: &mut SqliteConnection,
    now: Instant,
    namespace: &str,
    key: &str,
    token: LeaseToken,
    offered_response: Option<&[u8]>,
) -> Result<Guard, StoreError> {
    let record = select_key(&mut *connection, namespace, key).await?;
    let verdict = classify_refusal(
        GuardedKey::judge(record.as_ref(), now, offered_response),
        token,
    );
    Ok(Guard {
        now,
        record,
        verdict,
    })
}

/// TryStart inside a write transaction, at `now`.
pub(super) async fn claim_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &TryStartCommand,
) -> Result<TryStartOutcome, StoreError> {
    let namespace = command.namespace.as_str();
    let key = command.key.as_str();
    let existing = select_key(tx, namespace, key).await?;
    let action = claim_action(existing.as_ref(), now, command);
    let newly_claimed = matches!(action, ClaimAction::Fresh | ClaimAction::Takeover);
    let record = match (action, existing) {
        (ClaimAction::Answer, Some(unchanged)) => unchanged,
        (ClaimAction::Reenter, Some(held)) => {
            let token = held.lease_token;
            let renewed = claimed_record(Some(held), action, now, command, token)
                .ok_or(StoreError::Inconsistent("re-entry produced no key"))?;
            write_key(tx, namespace, key, &renewed).await?;
            renewed
        }
        (_, existing) => {
            let (token,): (i64,) = sqlx::query_as(NEXT_TOKEN)
                .fetch_one(&mut *tx)
                .await
                .map_err(classify)?;
            let claimed = claimed_record(
                existing,
                action,
                now,
                command,
                LeaseToken::from_stored(token),
            )
            .ok_or(StoreError::Inconsistent("a claim produced no key"))?;
            write_claim(tx, namespace, key, &claimed, now, command).await?;
            claimed
        }
    };
    Ok(TryStartOutcome::from_record(record, newly_claimed, command))
}

/// Complete inside a write transaction: judged, then written if the caller holds the key.
pub(super) async fn complete_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &CompleteCommand,
) -> Result<Result<Completion, Rejection>, StoreError> {
    let namespace = command.namespace.as_str();
    let key = command.key.as_str();
    let guard = judge(
        tx,
        now,
        namespace,
        key,
        command.lease_token,
        Some(command.response.as_bytes()),
    )
    .await?;
    let held = match (guard.verdict, guard.record) {
        (Err(rejection), _) => return Ok(Err(rejection)),
        // Repeated by the holder with the same response: the same completion again.
        (Ok(Some(earlier)), _) => return Ok(Ok(earlier)),
        (Ok(None), Some(held)) => held,
        (Ok(None), None) => return Err(StoreError::Inconsistent("a guard passed on no key")),
    };
    let retention = command.retention.map_or(held.retention, |r| r.get());
    let completion = Completion {
        completed_at: guard.now,
        expires_at: plus(guard.now, retention),
    };
    let completed = KeyRecord {
        response: Some(command.response.as_bytes().to_vec()),
        completed_at: Some(completion.completed_at),
        checkpoint: None,
        retention,
        expires_at: completion.expires_at,
        ..held
    };
    write_key(tx, namespace, key, &completed).await?;
    Ok(Ok(completion))
}

/// MarkProcessed inside a write transaction, at `now`.
pub(super) async fn mark_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &MarkProcessedCommand,
) -> Result<Vec<ProcessedEvent>, StoreError> {
    let consumer = command.consumer.as_str();
    let expires_at = micros(plus(now, command.retention.get()));
    // The first processing of each id, as this call finds or records it.
    let mut first: HashMap<&str, Instant> = HashMap::new();
    let mut results = Vec::with_capacity(command.event_ids.len());
    for event_id in &command.event_ids {
        let id = event_id.as_str();
        if let Some(processed_at) = first.get(id) {
            results.push(ProcessedEvent {
                event_id: id.to_owned(),
                already_processed: true,
                processed_at: *processed_at,
            });
            continue;
        }
        let existing: Option<EventRow> = sqlx::query_as(SELECT_EVENT)
            .bind(consumer)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(classify)?;
        let live = existing.filter(|row| instant(row.expires_at) > now);
        let (already_processed, processed_at) = match live {
            Some(row) => (true, instant(row.processed_at)),
            None => {
                sqlx::query(UPSERT_EVENT)
                    .bind(consumer)
                    .bind(id)
                    .bind(micros(now))
                    .bind(expires_at)
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                (false, now)
            }
        };
        first.insert(id, processed_at);
        results.push(ProcessedEvent {
            event_id: id.to_owned(),
            already_processed,
            processed_at,
        });
    }
    Ok(results)
}

/// Release inside a write transaction: judged, then the key deleted if the caller holds it.
pub(super) async fn release_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &ReleaseCommand,
) -> Result<Result<(), Rejection>, StoreError> {
    let namespace = command.namespace.as_str();
    let key = command.key.as_str();
    let guard = judge(tx, now, namespace, key, command.lease_token, None).await?;
    match guard.verdict {
        Err(rejection) => Ok(Err(rejection)),
        // Without an offered response, a completed key is always ALREADY_COMPLETED.
        Ok(Some(_)) => Ok(Err(Rejection::AlreadyCompleted)),
        Ok(None) => {
            sqlx::query(DELETE_KEY)
                .bind(namespace)
                .bind(key)
                .execute(&mut *tx)
                .await
                .map_err(classify)?;
            Ok(Ok(()))
        }
    }
}

/// ExtendLease inside a write transaction: judged, then the lease set to now + ttl (retention
/// stretched to cover it) if the caller holds the key.
pub(super) async fn extend_in(
    tx: &mut SqliteConnection,
    now: Instant,
    command: &ExtendLeaseCommand,
) -> Result<Result<Instant, Rejection>, StoreError> {
    let namespace = command.namespace.as_str();
    let key = command.key.as_str();
    let guard = judge(tx, now, namespace, key, command.lease_token, None).await?;
    let held = match (guard.verdict, guard.record) {
        (Err(rejection), _) => return Ok(Err(rejection)),
        (Ok(Some(_)), _) => return Ok(Err(Rejection::AlreadyCompleted)),
        (Ok(None), Some(held)) => held,
        (Ok(None), None) => return Err(StoreError::Inconsistent("a guard passed on no key")),
    };
    let lease_expires_at = plus(now, command.lease_ttl.get());
    let extended = KeyRecord {
        lease_expires_at,
        expires_at: held.expires_at.max(lease_expires_at),
        checkpoint: match &command.checkpoint {
            Some(checkpoint) => Some(checkpoint.as_bytes().to_vec()),
            None => held.checkpoint.clone(),
        },
        ..held
    };
    write_key(tx, namespace, key, &extended).await?;
    Ok(Ok(lease_expires_at))
}
