//! The admin API on SQLite ([`AdminStore`]): reads on the readers' pool, changes in the one
//! writer's transaction (read, decide, write, and the audit event, all committed together).

use sqlx::query::QueryAs;
use sqlx::sqlite::SqliteArguments;
use sqlx::{FromRow, Sqlite};

use super::SqliteStore;
use super::error::classify;
use super::sql::{
    ERASE_EVENTS_BATCH, ERASE_KEYS_BATCH, GET_ANY_KEY, GET_KEY, LIST_AUDIT, LIST_COMPLETED_KEYS,
    LIST_HELD_KEYS, LIST_IN_PROGRESS_KEYS, LIST_KEYS_BY_KEY, LIST_RELEASED_KEYS, LIST_STUCK_KEYS,
    NAMESPACE_HAS_ROWS, NAMESPACE_STATS, REAP_AUDIT, RECORD_AUDIT, STUCK_KEYS,
};
use crate::domain::admin::{
    AdminKeyState, AuditEntry, AuditEvent, ForceReleased, FullKey, KeySummary, ListOrder,
    NamespaceStats, StuckSummary,
};
use crate::domain::{Key, Scope};
use crate::store::admin::rows::{self, key_range, stuck_summary};
use crate::store::{
    AdminStore, AuditPage, Erased, Erasure, KeyEvent, KeyPage, NamespaceBatch, StoreError,
};

/// The admin rows as SQLite keeps them: instants and attempts as integers.
type AdminKeyRow = rows::AdminKeyRow<i64, i64>;
type FullKeyRow = rows::FullKeyRow<i64, i64>;
type StatsRow = rows::StatsRow<i64>;
type AuditRow = rows::AuditRow<i64>;

#[derive(FromRow)]
struct AnyKeyRow {
    #[sqlx(flatten)]
    summary: AdminKeyRow,
    live: bool,
}

fn micros(instant: Option<crate::domain::Instant>) -> Option<i64> {
    instant.map(|at| at.timestamp_micros())
}

async fn record_in(
    connection: &mut sqlx::SqliteConnection,
    audit: &AuditEntry,
    before: Option<String>,
) -> Result<i64, sqlx::Error> {
    let (id,): (i64,) = sqlx::query_as(RECORD_AUDIT)
        .bind(audit.actor.as_str())
        .bind(audit.action.name())
        .bind(audit.namespace.as_str())
        .bind(audit.key.as_ref().map(|k| k.as_str()))
        .bind(audit.reason.as_str())
        .bind(before)
        .bind(audit.outcome_json.as_deref())
        .bind(i64::try_from(audit.retention.as_micros()).unwrap_or(i64::MAX))
        .fetch_one(connection)
        .await?;
    Ok(id)
}

/// One side of a namespace's erasure batch (`ERASE_KEYS_BATCH`, `ERASE_EVENTS_BATCH`), after
/// `after` (`None`: from the start); it answers the key or event ids it deleted.
fn erase_batch<'q>(
    statement: &'static str,
    batch: NamespaceBatch<'q>,
    after: &'q Option<String>,
) -> QueryAs<'q, Sqlite, (String,), SqliteArguments> {
    // No key or event id is empty (1-255 bytes), and "" is the least text in binary order.
    sqlx::query_as(statement)
        .bind(batch.namespace.as_str())
        .bind(i64::from(batch.size.get()))
        .bind(after.as_deref().unwrap_or(""))
}

impl SqliteStore {
    /// Key `key` of `audit`'s namespace in whatever state, read in the writer's transaction.
    async fn any_key_in(
        connection: &mut sqlx::SqliteConnection,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<Option<(KeySummary, bool)>, StoreError> {
        let row: Option<AnyKeyRow> = sqlx::query_as(GET_ANY_KEY)
            .bind(audit.namespace.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut *connection)
            .await
            .map_err(classify)?;
        row.map(|row| Ok((KeySummary::try_from(row.summary)?, row.live)))
            .transpose()
    }

    async fn delete_key_in(
        connection: &mut sqlx::SqliteConnection,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<(), StoreError> {
        sqlx::query(super::sql::DELETE_KEY)
            .bind(audit.namespace.as_str())
            .bind(key.as_str())
            .execute(&mut *connection)
            .await
            .map_err(classify)?;
        Ok(())
    }
}

impl AdminStore for SqliteStore {
    async fn list_keys(&self, page: KeyPage<'_>) -> Result<Vec<KeySummary>, StoreError> {
        self.ensure_schema().await?;
        let filter = page.filter;
        let namespace = filter.namespace.as_str();
        let limit = i64::from(page.limit);
        let after_key = page.after.map_or("", |c| c.key.as_str());
        let after_at = page.after.map_or(i64::MIN, |c| c.at_micros);
        let query = match filter.order() {
            ListOrder::Key => {
                let (from, until) = key_range(filter);
                sqlx::query_as(LIST_KEYS_BY_KEY)
                    .bind(namespace)
                    .bind(from.to_owned())
                    .bind(after_key)
                    .bind(until)
                    .bind(filter.state.map_or(0, AdminKeyState::code))
                    .bind(micros(filter.completed_after))
                    .bind(micros(filter.completed_before))
                    .bind(micros(filter.claimed_after))
                    .bind(micros(filter.claimed_before))
                    .bind(limit)
            }
            ListOrder::Lease => {
                let statement = match filter.state {
                    Some(AdminKeyState::Stuck) => LIST_STUCK_KEYS,
                    Some(AdminKeyState::Released) => LIST_RELEASED_KEYS,
                    Some(AdminKeyState::InProgress) => LIST_IN_PROGRESS_KEYS,
                    _ => LIST_HELD_KEYS,
                };
                sqlx::query_as(statement)
                    .bind(namespace)
                    .bind(after_at)
                    .bind(after_key)
                    .bind(micros(filter.claimed_after))
                    .bind(micros(filter.claimed_before))
                    .bind(limit)
            }
            ListOrder::Completion => sqlx::query_as(LIST_COMPLETED_KEYS)
                .bind(namespace)
                .bind(after_at)
                .bind(after_key)
                .bind(micros(filter.completed_after).unwrap_or(i64::MIN))
                .bind(micros(filter.completed_before).unwrap_or(i64::MAX))
                .bind(limit),
        };
        let rows: Vec<AdminKeyRow> = query.fetch_all(&self.readers).await.map_err(classify)?;
        rows.into_iter().map(KeySummary::try_from).collect()
    }

    async fn get_key(&self, namespace: &Scope, key: &Key) -> Result<Option<FullKey>, StoreError> {
        self.ensure_schema().await?;
        let row: Option<FullKeyRow> = sqlx::query_as(GET_KEY)
            .bind(namespace.as_str())
            .bind(key.as_str())
            .fetch_optional(&self.readers)
            .await
            .map_err(classify)?;
        row.map(FullKey::try_from).transpose()
    }

    async fn namespace_stats(&self, namespace: &Scope) -> Result<NamespaceStats, StoreError> {
        self.ensure_schema().await?;
        let row: StatsRow = sqlx::query_as(NAMESPACE_STATS)
            .bind(namespace.as_str())
            .fetch_one(&self.readers)
            .await
            .map_err(classify)?;
        Ok(row.into())
    }

    async fn force_release(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<ForceReleased, StoreError> {
        let mut write = self.begin_write().await?;
        let found = Self::any_key_in(&mut write.tx, audit, key).await?;
        let answer = match found {
            Some((before, true)) if before.completed_at.is_none() => {
                let (token,): (i64,) = sqlx::query_as(super::sql::NEXT_TOKEN)
                    .fetch_one(&mut *write.tx)
                    .await
                    .map_err(classify)?;
                let now = super::ops::now(&mut write.tx).await?;
                sqlx::query(super::sql::REVOKE_LEASE)
                    .bind(audit.namespace.as_str())
                    .bind(key.as_str())
                    .bind(token)
                    .bind(now.timestamp_micros())
                    .bind(audit.actor.as_str())
                    .execute(&mut *write.tx)
                    .await
                    .map_err(classify)?;
                let audit_id = record_in(&mut write.tx, audit, Some(before.to_json()))
                    .await
                    .map_err(classify)?;
                ForceReleased::Released {
                    before: Box::new(before),
                    audit_id,
                }
            }
            Some((_, true)) => ForceReleased::Completed,
            _ => ForceReleased::Absent,
        };
        write.commit().await?;
        if matches!(answer, ForceReleased::Released { .. }) {
            let _ = self
                .events
                .send(KeyEvent::Changed(crate::domain::KeyHash::of(
                    &audit.namespace,
                    key,
                )));
        }
        Ok(answer)
    }

    async fn erase_key(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<(Option<KeySummary>, i64), StoreError> {
        let mut write = self.begin_write().await?;
        let found = Self::any_key_in(&mut write.tx, audit, key).await?;
        if found.is_some() {
            Self::delete_key_in(&mut write.tx, audit, key).await?;
        }
        let before = found.and_then(|(summary, live)| live.then_some(summary));
        let audit_id = record_in(
            &mut write.tx,
            audit,
            before.as_ref().map(KeySummary::to_json),
        )
        .await
        .map_err(classify)?;
        write.commit().await?;
        let _ = self.erasures.send(Erasure::Key {
            namespace: audit.namespace.as_str().to_owned(),
            key: key.as_str().to_owned(),
        });
        let _ = self
            .events
            .send(KeyEvent::Changed(crate::domain::KeyHash::of(
                &audit.namespace,
                key,
            )));
        Ok((before, audit_id))
    }

    async fn erase_namespace_batch(&self, batch: NamespaceBatch<'_>) -> Result<Erased, StoreError> {
        let mut write = self.begin_write().await?;
        let keys = erase_batch(ERASE_KEYS_BATCH, batch, &batch.from.after_key)
            .fetch_all(&mut *write.tx)
            .await
            .map_err(classify)?;
        let events = erase_batch(ERASE_EVENTS_BATCH, batch, &batch.from.after_event)
            .fetch_all(&mut *write.tx)
            .await
            .map_err(classify)?;
        write.commit().await?;
        // One writer: every row a batch finds, it deletes.
        let short = |rows: usize| rows < batch.size.get() as usize;
        let erased = Erased {
            pass_over: short(keys.len()) && short(events.len()),
            keys: keys.len() as u64,
            events: events.len() as u64,
            // RETURNING's order is unspecified: the greatest, not the last.
            last_key: keys.into_iter().map(|(key,)| key).max(),
            last_event: events.into_iter().map(|(event,)| event).max(),
        };
        if erased.keys > 0 {
            let _ = self
                .erasures
                .send(Erasure::Namespace(batch.namespace.as_str().to_owned()));
            let _ = self.events.send(KeyEvent::Missed);
        }
        Ok(erased)
    }

    async fn namespace_has_rows(&self, namespace: &Scope) -> Result<bool, StoreError> {
        self.ensure_schema().await?;
        let (has,): (bool,) = sqlx::query_as(NAMESPACE_HAS_ROWS)
            .bind(namespace.as_str())
            .fetch_one(&self.readers)
            .await
            .map_err(classify)?;
        Ok(has)
    }

    async fn record_audit(&self, audit: &AuditEntry) -> Result<i64, StoreError> {
        let mut write = self.begin_write().await?;
        let id = record_in(&mut write.tx, audit, None)
            .await
            .map_err(classify)?;
        write.commit().await?;
        Ok(id)
    }

    async fn list_audit(&self, page: AuditPage<'_>) -> Result<Vec<AuditEvent>, StoreError> {
        self.ensure_schema().await?;
        let rows: Vec<AuditRow> = sqlx::query_as(LIST_AUDIT)
            .bind(page.filter.namespace.as_str())
            .bind(page.after.unwrap_or(i64::MAX))
            .bind(i64::from(page.limit))
            .bind(page.filter.key.as_ref().map(Key::as_str))
            .bind(page.filter.actor.as_deref())
            .fetch_all(&self.readers)
            .await
            .map_err(classify)?;
        Ok(rows.into_iter().map(AuditEvent::from).collect())
    }

    async fn reap_expired_audit(&self, limit: u32) -> Result<u64, StoreError> {
        self.reap(REAP_AUDIT, limit).await
    }

    async fn stuck_keys(&self) -> Result<StuckSummary, StoreError> {
        self.ensure_schema().await?;
        let stuck = sqlx::query_as(STUCK_KEYS)
            .fetch_one(&self.readers)
            .await
            .map_err(classify)?;
        Ok(stuck_summary(stuck))
    }

    fn erasures(&self) -> tokio::sync::broadcast::Receiver<Erasure> {
        self.erasures.subscribe()
    }
}
