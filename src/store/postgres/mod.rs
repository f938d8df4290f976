//! The PostgreSQL store. Each state change is one guarded statement (`INSERT … ON CONFLICT …
//! RETURNING`, `UPDATE … WHERE lease_token = $n RETURNING`), so no window opens between a read
//! and a write, and no transaction stays open while a caller works: leases, not row locks.
//!
//! Every instant comes from the database clock. A statement that changes a key locks the row
//! first and judges it, expiry included, by `clock_timestamp()` read once the lock is granted,
//! not by `now()` (the instant the statement began): a statement that waited for a row lock
//! must not act on the key as it was before the wait, or it could revive, or complete, a key
//! that expired, and that others saw absent, while it waited. Plain reads (Lookup) use `now()`,
//! the instant of their snapshot.
//!
//! The parts: `connect` opens the pools and sets each connection up, `statements` runs a
//! statement within the operation's budget, `listen` hears committed changes and watches keys
//! for waiters, `sql` holds every statement's text (the TryStart decision itself is a function
//! in `migrations/postgres/`), `rows` decodes their rows, `kept` keeps a connection between
//! statements, and `error` classifies the driver's errors. This file is the [`Store`]
//! implementation on top of them.

mod admin;
mod connect;
pub mod credentials;
mod durability;
mod error;
mod held;
pub mod hosts;
mod kept;
mod listen;
mod migrate;
mod moves;
mod opening;
mod primary;
mod privileges;
mod refusal;
mod replicas;
mod rows;
mod sql;
mod statements;
pub mod tls;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::Migrator;
use sqlx::{PgPool, SqlStr};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use self::connect::Shapes;
pub use self::credentials::CredentialFiles;
use self::durability::Durability;
use self::error::classify;
use self::kept::KeptConnections;
pub use self::moves::MoveSession;
use self::primary::Follower;
pub use self::refusal::ConnectFailure;
use self::rows::{CompleteRow, KeyRow, MarkRow, TryStartBatchRow, TryStartRow};
use self::sql::*;
use self::statements::{FromPgRow, Statement};
use super::schema;
use super::{KeyEvent, LockWait, Pooler, Store, StoreError};
use crate::domain::batch::Round;
use crate::domain::budget::TimeBudget;
use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Instant, KeyRecord, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome, key_id,
};

/// This build's migrations. Migrations this build does not know (a newer release's, after a
/// roll-back) are ignored: each release runs on the schema of the next (docs/operations.md,
/// "Upgrades").
static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations/postgres")
};

/// The admin API's statements that must read an index, never the table, by name: for the test
/// that EXPLAINs them on a table of a million rows (`tests/api/admin/scale.rs`). The erasure's
/// batches (`erase_keys`, `erase_events`) must also start their index scan after the last key
/// (event id) the batch before them erased.
pub fn indexed_admin_statements() -> [(&'static str, &'static str); 9] {
    [
        ("stuck", LIST_STUCK_KEYS),
        ("released", LIST_RELEASED_KEYS),
        ("in_progress", LIST_IN_PROGRESS_KEYS),
        ("held", LIST_HELD_KEYS),
        ("completed", LIST_COMPLETED_KEYS),
        ("by_key", LIST_KEYS_BY_KEY),
        ("stuck_gauges", STUCK_KEYS),
        ("erase_keys", ERASE_KEYS_BATCH),
        ("erase_events", ERASE_EVENTS_BATCH),
    ]
}

/// The statements that delete in bounded batches (the reaper's, the erasure's), by name: for
/// the test that EXPLAINs them on a table of a million rows (`tests/api/admin/scale.rs`). Each
/// must delete the rows it locked by their tuple ids, never by a join back to the table, whose
/// cost grows with the rows around the batch rather than with the batch.
pub fn batched_deletes() -> [(&'static str, &'static str); 5] {
    [
        ("reap_keys", REAP_KEYS),
        ("reap_events", REAP_EVENTS),
        ("reap_audit", REAP_AUDIT),
        ("erase_keys", ERASE_KEYS_BATCH),
        ("erase_events", ERASE_EVENTS_BATCH),
    ]
}

/// How long a migration waits for a lock unless told (`--migration-lock-timeout`): longer than
/// a call's statement holds its locks on an ordinary day, short enough that the calls queued
/// behind a waiting migration barely notice.
pub const DEFAULT_MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_millis(20);

/// How the store connects.
#[derive(Debug, Clone)]
pub struct PgSettings {
    pub url: String,
    /// Where to `LISTEN` for changes, when not `url` (see `StoreSettings::notify_url`).
    pub notify_url: Option<String>,
    pub pool_size: u32,
    /// The budget of one operation, shared out by [`TimeBudget`]: PostgreSQL itself stops a
    /// statement that runs too long (`statement_timeout`), so a timeout it reports means that
    /// nothing was written.
    pub operation_timeout: Duration,
    /// What stands between the service and PostgreSQL.
    pub pooler: Pooler,
    /// The health probe fails while no synchronous standby is attached
    /// (`--require-synchronous-standby`).
    pub require_synchronous_standby: bool,
    /// Where `url`'s login may come from besides the URL (read again as it rotates).
    pub credentials: CredentialFiles,
    /// The same for `notify_url`.
    pub notify_credentials: CredentialFiles,
    /// How long a migration's statement waits for a table lock before the migration is rolled
    /// back and tried again (`--migration-lock-timeout`).
    pub migration_lock_timeout: Duration,
}

#[derive(Clone)]
pub struct PgStore {
    /// Serves the RPCs and the reaper: the pool, and the connections the store keeps between
    /// statements.
    connections: Arc<KeptConnections>,
    /// One connection of its own for health probes, so that a pool busy with calls does not
    /// look like an unreachable database.
    probe_pool: PgPool,
    /// The operation's time, shared out: how long a statement may wait for a connection (and
    /// the probe's one attempt at connecting may take), how long PostgreSQL lets it run.
    budget: TimeBudget,
    /// The one connection that `LISTEN`s for committed changes, held by [`Store::watch_keys`].
    listen_pool: PgPool,
    events: broadcast::Sender<KeyEvent>,
    /// Erasures heard on [`sql::ERASED_CHANNEL`], for every replica's replay cache, and what
    /// the replicas announce of them (`replicas.rs`).
    erasures: broadcast::Sender<super::Erasure>,
    /// This replica: its id, its heartbeat's channel, the acknowledgements it owes.
    replica: Arc<replicas::Replica>,
    /// The one connection that writes this replica's heartbeat and acknowledgements (on the
    /// listener's hosts: the announcements must reach the listeners).
    beat_pool: PgPool,
    /// The database URL's hosts and the one the calls' and the probe's pools connect to.
    follower: Arc<Follower>,
    /// The `LISTEN` connection's (the same as `follower` without `--notify-database-url`).
    listen_follower: Arc<Follower>,
    /// What each pool adds to a host's settings, to point it at another host or login.
    shapes: Arc<Shapes>,
    /// Behind a pooler in transaction mode: the statement that opens the transaction each
    /// statement runs in, with the settings a direct connection gets in its startup packet.
    begin: Option<SqlStr>,
    /// A limited store ([`Store::limited`]): each statement runs in a transaction of its own
    /// that ends by the deadline and waits for row locks as told.
    limits: Option<(std::time::Instant, LockWait)>,
    /// What the health probe last read of how commits are made durable.
    durability: Arc<std::sync::Mutex<Option<Durability>>>,
    /// The cluster's name, on a store of several clusters: its durability's log lines and
    /// gauges carry it.
    cluster: Option<Arc<str>>,
    /// Report the store unready while no synchronous standby is attached.
    require_synchronous_standby: bool,
    /// How long a migration's statement waits for a lock before it is tried again later.
    migration_lock_timeout: Duration,
    /// Whether the role was found to hold every right the service needs (checked by the health
    /// probe until it does).
    rights_checked: Arc<std::sync::atomic::AtomicBool>,
    /// Held while a refused connection is looked into (`opening.rs::after_refusal`): one at a
    /// time, so that a burst of refusals makes one round of login attempts, not one each.
    refusals: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for PgStore {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

/// [`TRY_START`] with `command`'s values.
fn bind_try_start<'q, O: FromPgRow>(command: &'q TryStartCommand) -> Statement<'q, O> {
    sqlx::query_as(TRY_START)
        .bind(command.namespace.as_str())
        .bind(command.key.as_str())
        .bind(command.fingerprint.as_bytes())
        .bind(command.lease_ttl.as_micros())
        .bind(command.retention.as_micros())
        .bind(command.attempt_id.as_ref().map(|a| a.as_str()))
        .bind(command.holder.as_ref().map(|h| h.as_str()))
}

/// [`COMPLETE_ONE`] with `command`'s values.
fn bind_complete<'q, O: FromPgRow>(command: &'q CompleteCommand) -> Statement<'q, O> {
    sqlx::query_as(COMPLETE_ONE)
        .bind(command.namespace.as_str())
        .bind(command.key.as_str())
        .bind(command.lease_token.get())
        .bind(command.response.as_bytes())
        .bind(command.retention.map(|r| r.as_micros()))
}

/// Each call of `round` run through `run`, one after another: for a round of one call, which
/// the one-key statements serve with less set-up than the shared ones.
async fn one_by_one<'r, C, T, Fut>(round: &'r Round<C>, run: impl Fn(&'r C) -> Fut) -> Vec<T>
where
    Fut: std::future::Future<Output = T>,
{
    let mut answers = Vec::with_capacity(round.len());
    for command in round.iter() {
        answers.push(run(command).await);
    }
    answers
}

/// The failure of a statement shared by several calls: one that met a held key says so, since
/// the key may be any of theirs (each call then runs again alone, `service::held_keys`).
fn shared_failure(error: sqlx::Error) -> StoreError {
    match classify(error) {
        StoreError::KeyHeld { cause, .. } => StoreError::KeyHeld {
            shared: true,
            cause,
        },
        other => other,
    }
}

/// `error` as the answer of each of `count` commands.
fn failed<T>(error: StoreError, count: usize) -> Vec<Result<T, StoreError>> {
    error.for_each_of(count).into_iter().map(Err).collect()
}

impl Store for PgStore {
    async fn try_start(&self, command: &TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        // One call for a key with or without a row: one round trip, directly or behind a
        // pooler (where each statement is a transaction of its own).
        let row: TryStartRow = self
            .fetch_one(bind_try_start(command))
            .await
            .map_err(classify)?;
        Ok(row.outcome(command))
    }

    async fn complete(
        &self,
        command: &CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        let row: CompleteRow = self
            .fetch_one(bind_complete(command))
            .await
            .map_err(classify)?;
        row.answer(command.lease_token)
    }

    /// One statement for the whole round (its keys are distinct).
    async fn try_start_batch(
        &self,
        round: &Round<TryStartCommand>,
    ) -> Vec<Result<TryStartOutcome, StoreError>> {
        if round.len() == 1 {
            // A lone call takes the one-row statement, whose plan is simpler.
            return one_by_one(round, |command| self.try_start(command)).await;
        }
        let namespaces: Vec<&str> = round.iter().map(|c| c.namespace.as_str()).collect();
        let keys: Vec<&str> = round.iter().map(|c| c.key.as_str()).collect();
        let fingerprints: Vec<&[u8]> = round.iter().map(|c| c.fingerprint.as_bytes()).collect();
        let leases: Vec<i64> = round.iter().map(|c| c.lease_ttl.as_micros()).collect();
        let retentions: Vec<i64> = round.iter().map(|c| c.retention.as_micros()).collect();
        let attempt_ids: Vec<Option<&str>> = round
            .iter()
            .map(|c| c.attempt_id.as_ref().map(|a| a.as_str()))
            .collect();
        let holders: Vec<Option<&str>> = round
            .iter()
            .map(|c| c.holder.as_ref().map(|h| h.as_str()))
            .collect();
        let fetched: Result<Vec<TryStartBatchRow>, _> = self
            .fetch_all(
                sqlx::query_as(TRY_START_BATCH)
                    .bind(&namespaces)
                    .bind(&keys)
                    .bind(&fingerprints)
                    .bind(&leases)
                    .bind(&retentions)
                    .bind(&attempt_ids)
                    .bind(&holders),
            )
            .await;
        let rows = match fetched {
            Ok(rows) => rows,
            Err(error) => return failed(shared_failure(error), round.len()),
        };
        let mut by_key: HashMap<(String, String), TryStartBatchRow> = rows
            .into_iter()
            .map(|row| ((row.namespace.clone(), row.key_name.clone()), row))
            .collect();
        round
            .iter()
            .map(
                |command| match by_key.remove(&key_id(&command.namespace, &command.key)) {
                    Some(row) => Ok(row.claim.outcome(command)),
                    None => Err(StoreError::Inconsistent("a batched claim returned no row")),
                },
            )
            .collect()
    }

    /// One statement for the whole round, like [`Self::try_start_batch`], which answers every
    /// call of the round, refusals included.
    async fn complete_batch(
        &self,
        round: &Round<CompleteCommand>,
    ) -> Vec<Result<Result<Completion, Rejection>, StoreError>> {
        if round.len() == 1 {
            // A lone call takes the one-key statement, which sets up less.
            return one_by_one(round, |command| self.complete(command)).await;
        }
        let namespaces: Vec<&str> = round.iter().map(|c| c.namespace.as_str()).collect();
        let keys: Vec<&str> = round.iter().map(|c| c.key.as_str()).collect();
        let tokens: Vec<i64> = round.iter().map(|c| c.lease_token.get()).collect();
        let responses: Vec<&[u8]> = round.iter().map(|c| c.response.as_bytes()).collect();
        let retentions: Vec<Option<i64>> = round
            .iter()
            .map(|c| c.retention.map(|r| r.as_micros()))
            .collect();
        let fetched: Result<Vec<CompleteRow>, _> = self
            .fetch_all(
                sqlx::query_as(COMPLETE)
                    .bind(&namespaces)
                    .bind(&keys)
                    .bind(&tokens)
                    .bind(&responses)
                    .bind(&retentions),
            )
            .await;
        let rows = match fetched {
            Ok(rows) => rows,
            Err(error) => return failed(shared_failure(error), round.len()),
        };
        if rows.len() != round.len() {
            return failed(
                StoreError::Inconsistent("a Complete statement did not answer one row per call"),
                round.len(),
            );
        }
        round
            .iter()
            .zip(rows)
            .map(|(command, row)| row.answer(command.lease_token))
            .collect()
    }

    fn limited(&self, deadline: std::time::Instant, lock_wait: LockWait) -> Self {
        Self {
            limits: Some((deadline, lock_wait)),
            ..self.clone()
        }
    }

    async fn release(&self, command: &ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        let outcome: Result<(i64,), Rejection> = self
            .guarded_write(
                RELEASE,
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                |release| release,
            )
            .await?;
        Ok(outcome.map(drop))
    }

    async fn extend_lease(
        &self,
        command: &ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        let checkpoint = command.checkpoint.as_ref().map(|c| c.as_bytes());
        let outcome: Result<(Instant,), Rejection> = self
            .guarded_write(
                EXTEND_LEASE,
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                |extend| {
                    extend
                        .bind(command.lease_ttl.as_micros())
                        .bind(checkpoint.is_some())
                        .bind(checkpoint)
                },
            )
            .await?;
        Ok(outcome.map(|(lease_expires_at,)| lease_expires_at))
    }

    async fn lookup(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        let row: Option<KeyRow> = self
            .fetch_optional(
                sqlx::query_as(LOOKUP)
                    .bind(query.namespace.as_str())
                    .bind(query.key.as_str()),
            )
            .await
            .map_err(classify)?;
        Ok(KeyState::of(row.map(KeyRecord::from)))
    }

    async fn watch(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        self.watch_key(query).await
    }

    async fn mark_processed(
        &self,
        command: &MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        super::only_answer(self.mark_all(std::slice::from_ref(command)).await)
    }

    /// Every call in one statement: their ids in call order, so that an id two calls carry is
    /// new for the first and already processed for the second, exactly as one after another;
    /// the rows are then handed back call by call.
    async fn mark_processed_batch(
        &self,
        round: &Round<MarkProcessedCommand>,
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        self.mark_all(round.as_slice()).await
    }

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        self.reap(REAP_KEYS, limit).await
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        self.reap(REAP_EVENTS, limit).await
    }

    async fn expired_backlog(&self) -> Result<super::ExpiredBacklog, StoreError> {
        let (keys, events): (i64, i64) = self
            .fetch_one(sqlx::query_as(EXPIRED_BACKLOG))
            .await
            .map_err(classify)?;
        Ok(super::ExpiredBacklog {
            keys: schema::stored_duration(keys),
            events: schema::stored_duration(events),
        })
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        self.migrate_schema(None).await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.probe_store().await
    }

    async fn close(&self) {
        self.listen_pool.close().await;
        self.beat_pool.close().await;
        self.probe_pool.close().await;
        self.connections.close().await;
    }

    async fn clock(&self) -> Result<Instant, StoreError> {
        let (now,): (Instant,) = self
            .fetch_one_probing(sqlx::query_as(CLOCK))
            .await
            .map_err(classify)?;
        Ok(now)
    }

    fn key_events(&self) -> broadcast::Receiver<KeyEvent> {
        self.events.subscribe()
    }

    async fn watch_keys(&self, shutdown: CancellationToken) {
        tokio::join!(
            self.listen_with_retries(shutdown.clone()),
            self.beat_until(&shutdown)
        );
    }

    async fn rows_held(&self, rows: &[crate::store::Row<'_>]) -> Result<Vec<bool>, StoreError> {
        self.held_rows_now(rows).await
    }
}

impl PgStore {
    /// MarkProcessed for `commands` in one statement: their ids in call order, so that an id two
    /// calls carry is new for the first and already processed for the second, exactly as one
    /// after another; the rows are then handed back call by call.
    async fn mark_all(
        &self,
        commands: &[MarkProcessedCommand],
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        if let [command] = commands
            && let [id] = command.event_ids.as_slice()
        {
            // A lone call of one id takes the one-row statement, which sets up less.
            let row: Result<MarkRow, StoreError> = self
                .fetch_one(
                    sqlx::query_as(MARK_PROCESSED_ONE)
                        .bind(command.consumer.as_str())
                        .bind(id.as_str())
                        .bind(command.retention.as_micros()),
                )
                .await
                .map_err(classify);
            return vec![row.map(|row| vec![row.into()])];
        }
        let total: usize = commands.iter().map(|c| c.event_ids.len()).sum();
        let mut consumers: Vec<&str> = Vec::with_capacity(total);
        let mut ids: Vec<&str> = Vec::with_capacity(total);
        let mut retentions: Vec<i64> = Vec::with_capacity(total);
        for command in commands {
            for id in &command.event_ids {
                consumers.push(command.consumer.as_str());
                ids.push(id.as_str());
                retentions.push(command.retention.as_micros());
            }
        }
        let rows: Result<Vec<MarkRow>, StoreError> = self
            .fetch_all(
                sqlx::query_as(MARK_PROCESSED)
                    .bind(&consumers)
                    .bind(&ids)
                    .bind(&retentions),
            )
            .await
            .map_err(|error| {
                if commands.len() > 1 {
                    shared_failure(error)
                } else {
                    classify(error)
                }
            });
        match rows {
            Ok(rows) if rows.len() == total => {
                let mut rows = rows.into_iter().map(ProcessedEvent::from);
                commands
                    .iter()
                    .map(|command| Ok(rows.by_ref().take(command.event_ids.len()).collect()))
                    .collect()
            }
            Ok(_) => commands
                .iter()
                .map(|_| {
                    Err(StoreError::Inconsistent(
                        "a statement of marks returned a row count unlike its ids",
                    ))
                })
                .collect(),
            Err(error) => failed(error, commands.len()),
        }
    }
}
