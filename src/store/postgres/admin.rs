//! The admin API on PostgreSQL ([`AdminStore`]). Reads are single statements on the calls'
//! pool; a change and its audit event commit in one transaction of their own, with the same
//! statement and lock timeouts as any statement.

use sqlx::Connection;

use super::PgStore;
use super::connect::begin_statement;
use super::error::classify;
use super::sql::{
    ANNOUNCE_ERASED, ERASE_EVENTS_BATCH, ERASE_KEY, ERASE_KEYS_BATCH, FORCE_RELEASE, GET_KEY,
    KEY_COMPLETED, LIST_AUDIT, LIST_COMPLETED_KEYS, LIST_HELD_KEYS, LIST_IN_PROGRESS_KEYS,
    LIST_KEYS_BY_KEY, LIST_RELEASED_KEYS, LIST_STUCK_KEYS, NAMESPACE_EVENTS, NAMESPACE_HAS_ROWS,
    NAMESPACE_STATS, REAP_AUDIT, RECORD_AUDIT, STUCK_KEYS,
};
use super::statements::Statement;
use crate::domain::admin::{
    AdminKeyState, AuditEntry, AuditEvent, ForceReleased, FullKey, KeySummary, ListOrder,
    NamespaceStats, PageCursor, StuckSummary,
};
use crate::domain::{Instant, Key, Scope};
use crate::store::admin::rows::{self, count, key_range, stuck_summary};
use crate::store::{
    AdminStore, AuditPage, Erased, Erasure, KeyPage, LockWait, NamespaceBatch, StoreError,
};

/// The admin rows as PostgreSQL decodes them: instants as `timestamptz`, the attempt `int4`.
type AdminKeyRow = rows::AdminKeyRow<Instant, i32>;
type FullKeyRow = rows::FullKeyRow<Instant, i32>;
type StatsRow = rows::StatsRow<Instant>;
type AuditRow = rows::AuditRow<Instant>;

fn summaries(rows: Vec<AdminKeyRow>) -> Result<Vec<KeySummary>, StoreError> {
    rows.into_iter().map(KeySummary::try_from).collect()
}

fn cursor_instant(cursor: Option<&PageCursor>) -> Option<Instant> {
    cursor.and_then(|c| chrono::DateTime::from_timestamp_micros(c.at_micros))
}

/// One side of a namespace's erasure batch (`ERASE_KEYS_BATCH`, `ERASE_EVENTS_BATCH`), after
/// `after` (`None`: from the start); it answers how many rows it deleted, how many it took (some
/// may have changed meanwhile), and the greatest id it took.
fn erase_batch<'q>(
    statement: &'static str,
    batch: NamespaceBatch<'q>,
    after: &'q Option<String>,
) -> Statement<'q, (i64, i64, Option<String>)> {
    // No key or event id is empty (1-255 bytes), and "" is the least text in "C" order.
    sqlx::query_as(statement)
        .bind(batch.namespace.as_str())
        .bind(i64::from(batch.size.get()))
        .bind(after.as_deref().unwrap_or(""))
}

/// `RECORD_AUDIT` bound to `audit`, with the record before as JSON.
macro_rules! record_audit {
    ($audit:expr, $before:expr) => {
        sqlx::query_as::<_, (i64,)>(RECORD_AUDIT)
            .bind($audit.actor.as_str())
            .bind($audit.action.name())
            .bind($audit.namespace.as_str())
            .bind($audit.key.as_ref().map(|k| k.as_str()))
            .bind($audit.reason.as_str())
            .bind($before)
            .bind($audit.outcome_json.as_deref())
            .bind(i64::try_from($audit.retention.as_micros()).unwrap_or(i64::MAX))
    };
}

impl PgStore {
    /// A transaction of its own on a connection of the calls' pool, with a statement's timeout
    /// and, as every call's statement, a brief wait for a row lock: a key another transaction
    /// holds is the held-key lane's to wait for (`service::held_keys`), where a limited store
    /// runs it with what is left of its deadline and the lock budget.
    async fn admin_transaction<T>(
        &self,
        work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        let (statement, lock) = match self.limits {
            None => (self.budget.statement, self.budget.brief_lock),
            Some((deadline, lock_wait)) => {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left < super::statements::MIN_STATEMENT_TIME {
                    return Err(classify(super::statements::not_sent()));
                }
                let lock = match lock_wait {
                    LockWait::Brief => self.budget.brief_lock,
                    LockWait::Patient => self.budget.lock,
                };
                (left.min(self.budget.statement), lock)
            }
        };
        let mut connection = self.lend().await.map_err(classify)?;
        let begin = begin_statement(statement.as_millis(), lock, self.begin.is_some());
        let mut transaction = connection.begin_with(begin).await.map_err(classify)?;
        let answer = work(&mut transaction).await.map_err(classify)?;
        transaction.commit().await.map_err(classify)?;
        connection.keep();
        Ok(answer)
    }

    /// [`AdminStore::list_keys`] in key order.
    async fn list_keys_by_key(&self, page: KeyPage<'_>) -> Result<Vec<KeySummary>, StoreError> {
        let filter = page.filter;
        let (from, until) = key_range(filter);
        let rows: Vec<AdminKeyRow> = self
            .fetch_all(
                sqlx::query_as(LIST_KEYS_BY_KEY)
                    .bind(filter.namespace.as_str())
                    .bind(from)
                    .bind(page.after.map_or("", |c| c.key.as_str()))
                    .bind(until)
                    .bind(filter.state.map_or(0, AdminKeyState::code))
                    .bind(filter.completed_after)
                    .bind(filter.completed_before)
                    .bind(filter.claimed_after)
                    .bind(filter.claimed_before)
                    .bind(i64::from(page.limit)),
            )
            .await
            .map_err(classify)?;
        summaries(rows)
    }
}

impl AdminStore for PgStore {
    async fn list_keys(&self, page: KeyPage<'_>) -> Result<Vec<KeySummary>, StoreError> {
        let filter = page.filter;
        // The orders but the key's read an index on an instant: after the cursor's, within the
        // filter's window of that instant.
        let (statement, since, until) = match filter.order() {
            ListOrder::Key => return self.list_keys_by_key(page).await,
            ListOrder::Lease => {
                let statement = match filter.state {
                    Some(AdminKeyState::Stuck) => LIST_STUCK_KEYS,
                    Some(AdminKeyState::Released) => LIST_RELEASED_KEYS,
                    Some(AdminKeyState::InProgress) => LIST_IN_PROGRESS_KEYS,
                    _ => LIST_HELD_KEYS,
                };
                (statement, filter.claimed_after, filter.claimed_before)
            }
            ListOrder::Completion => (
                LIST_COMPLETED_KEYS,
                filter.completed_after,
                filter.completed_before,
            ),
        };
        let rows: Vec<AdminKeyRow> = self
            .fetch_all(
                sqlx::query_as(statement)
                    .bind(filter.namespace.as_str())
                    .bind(cursor_instant(page.after))
                    .bind(page.after.map(|c| c.key.as_str()))
                    .bind(since)
                    .bind(until)
                    .bind(i64::from(page.limit)),
            )
            .await
            .map_err(classify)?;
        summaries(rows)
    }

    async fn get_key(&self, namespace: &Scope, key: &Key) -> Result<Option<FullKey>, StoreError> {
        let row: Option<FullKeyRow> = self
            .fetch_optional(
                sqlx::query_as(GET_KEY)
                    .bind(namespace.as_str())
                    .bind(key.as_str()),
            )
            .await
            .map_err(classify)?;
        row.map(FullKey::try_from).transpose()
    }

    async fn namespace_stats(&self, namespace: &Scope) -> Result<NamespaceStats, StoreError> {
        let row: Option<StatsRow> = self
            .fetch_optional(sqlx::query_as(NAMESPACE_STATS).bind(namespace.as_str()))
            .await
            .map_err(classify)?;
        match row {
            Some(row) => Ok(row.into()),
            // No live key: the GROUP BY answers no row. The events and clock still count.
            None => {
                let (processed_events, read_at): (i64, Instant) = self
                    .fetch_one(sqlx::query_as(NAMESPACE_EVENTS).bind(namespace.as_str()))
                    .await
                    .map_err(classify)?;
                Ok(NamespaceStats {
                    in_progress: 0,
                    stuck: 0,
                    released: 0,
                    completed: 0,
                    processed_events: count(processed_events),
                    oldest_stuck: None,
                    stored_bytes: 0,
                    read_at,
                })
            }
        }
    }

    async fn force_release(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<ForceReleased, StoreError> {
        let namespace = audit.namespace.as_str();
        let found = self
            .admin_transaction(async |connection| {
                // Behind a pooler in transaction mode, unnamed: a named statement would stay on the
                // server connection, which the pooler hands to other clients.
                let prepared = self.begin.is_none();
                let released: Option<AdminKeyRow> = sqlx::query_as(FORCE_RELEASE)
                    .bind(namespace)
                    .bind(key.as_str())
                    .bind(audit.actor.as_str())
                    .persistent(prepared)
                    .fetch_optional(&mut *connection)
                    .await?;
                let Some(released) = released else {
                    let completed: Option<(bool,)> = sqlx::query_as(KEY_COMPLETED)
                        .bind(namespace)
                        .bind(key.as_str())
                        .persistent(prepared)
                        .fetch_optional(&mut *connection)
                        .await?;
                    return Ok(Err(completed.is_some_and(|(completed,)| completed)));
                };
                let before = KeySummary::try_from(released);
                let json = before.as_ref().ok().map(KeySummary::to_json);
                let (id,) = record_audit!(audit, json)
                    .persistent(prepared)
                    .fetch_one(&mut *connection)
                    .await?;
                Ok(Ok((before, id)))
            })
            .await?;
        Ok(match found {
            Ok((before, audit_id)) => ForceReleased::Released {
                before: Box::new(before?),
                audit_id,
            },
            Err(true) => ForceReleased::Completed,
            Err(false) => ForceReleased::Absent,
        })
    }

    async fn erase_key(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<(Option<KeySummary>, i64), StoreError> {
        // Behind a pooler in transaction mode, unnamed: a named statement would stay on the
        // server connection, which the pooler hands to other clients.
        let prepared = self.begin.is_none();
        let payload = Erasure::Key {
            namespace: audit.namespace.as_str().to_owned(),
            key: key.as_str().to_owned(),
        }
        .payload();
        let (before, id) = self
            .admin_transaction(async |connection| {
                let erased: Option<AdminKeyRow> = sqlx::query_as(ERASE_KEY)
                    .bind(audit.namespace.as_str())
                    .bind(key.as_str())
                    .persistent(prepared)
                    .fetch_optional(&mut *connection)
                    .await?;
                sqlx::query(ANNOUNCE_ERASED)
                    .bind(&payload)
                    .persistent(prepared)
                    .execute(&mut *connection)
                    .await?;
                let before = erased.map(KeySummary::try_from).transpose();
                let json = before
                    .as_ref()
                    .ok()
                    .and_then(Option::as_ref)
                    .map(KeySummary::to_json);
                let (id,) = record_audit!(audit, json)
                    .persistent(prepared)
                    .fetch_one(&mut *connection)
                    .await?;
                Ok((before, id))
            })
            .await?;
        Ok((before?, id))
    }

    async fn erase_namespace_batch(&self, batch: NamespaceBatch<'_>) -> Result<Erased, StoreError> {
        let ((keys, locked_keys, last_key), (events, locked_events, last_event)) = self
            .admin_transaction(async |connection| {
                // Behind a pooler in transaction mode, unnamed: a named statement would stay on the
                // server connection, which the pooler hands to other clients.
                let prepared = self.begin.is_none();
                let keys = erase_batch(ERASE_KEYS_BATCH, batch, &batch.from.after_key)
                    .persistent(prepared)
                    .fetch_one(&mut *connection)
                    .await?;
                let events = erase_batch(ERASE_EVENTS_BATCH, batch, &batch.from.after_event)
                    .persistent(prepared)
                    .fetch_one(&mut *connection)
                    .await?;
                if keys.0 > 0 {
                    sqlx::query(ANNOUNCE_ERASED)
                        .bind(batch.namespace.as_str())
                        .persistent(prepared)
                        .execute(&mut *connection)
                        .await?;
                }
                Ok((keys, events))
            })
            .await?;
        let limit = i64::from(batch.size.get());
        Ok(Erased {
            keys: count(keys),
            events: count(events),
            last_key,
            last_event,
            pass_over: locked_keys < limit && locked_events < limit,
        })
    }

    async fn namespace_has_rows(&self, namespace: &Scope) -> Result<bool, StoreError> {
        let (has,): (bool,) = self
            .fetch_one(sqlx::query_as(NAMESPACE_HAS_ROWS).bind(namespace.as_str()))
            .await
            .map_err(classify)?;
        Ok(has)
    }

    async fn record_audit(&self, audit: &AuditEntry) -> Result<i64, StoreError> {
        let (id,) = self
            .fetch_one(record_audit!(audit, None::<String>))
            .await
            .map_err(classify)?;
        Ok(id)
    }

    async fn list_audit(&self, page: AuditPage<'_>) -> Result<Vec<AuditEvent>, StoreError> {
        let rows: Vec<AuditRow> = self
            .fetch_all(
                sqlx::query_as(LIST_AUDIT)
                    .bind(page.filter.namespace.as_str())
                    .bind(page.after)
                    .bind(i64::from(page.limit))
                    .bind(page.filter.key.as_ref().map(Key::as_str))
                    .bind(page.filter.actor.as_deref()),
            )
            .await
            .map_err(classify)?;
        Ok(rows.into_iter().map(AuditEvent::from).collect())
    }

    async fn reap_expired_audit(&self, limit: u32) -> Result<u64, StoreError> {
        self.reap(REAP_AUDIT, limit).await
    }

    async fn stuck_keys(&self) -> Result<StuckSummary, StoreError> {
        let stuck = self
            .fetch_one(sqlx::query_as(STUCK_KEYS))
            .await
            .map_err(classify)?;
        Ok(stuck_summary(stuck))
    }

    fn erasures(&self) -> tokio::sync::broadcast::Receiver<Erasure> {
        self.erasures.subscribe()
    }
}
