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

mod error;
mod kept;
mod rows;
mod sql;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{MigrateDatabase, Migrator};
use sqlx::postgres::{PgArguments, PgConnectOptions, PgListener, PgPoolOptions, PgRow};
use sqlx::query::QueryAs;
use sqlx::{
    AssertSqlSafe, Connection, FromRow, PgConnection, PgPool, Postgres, SqlSafeStr, SqlStr,
};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use self::error::classify;
use self::kept::{KeptConnections, PING_WHEN_IDLE_FOR};
use self::rows::{
    CompleteRow, GuardRow, KeyRow, MarkRow, MarkedKeyRow, TryStartBatchRow, TryStartRow,
    WatchedKeyRow,
};
use self::sql::*;
use super::schema;
use super::{KeyEvent, Pooler, Store, StoreError};
use crate::domain::batch::Round;
use crate::domain::budget::TimeBudget;
use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, GuardedKey, Instant, KeyHash, KeyRecord,
    KeyState, LeaseToken, LookupQuery, MarkProcessedCommand, ProcessedEvent, Rejection,
    ReleaseCommand, TryStartCommand, TryStartOutcome, classify_refusal, key_id,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

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
}

#[derive(Clone)]
pub struct PgStore {
    /// Serves the RPCs and the reaper: the pool, and the connections the store keeps between
    /// statements.
    connections: Arc<KeptConnections>,
    /// One connection of its own for health probes, so that a pool busy with calls does not
    /// look like an unreachable database.
    probe_pool: PgPool,
    /// How the probe connects, to connect once by hand when the pool only says it timed out.
    probe_options: Arc<PgConnectOptions>,
    /// The operation's time, shared out: how long a statement may wait for a connection (and
    /// the probe's one attempt at connecting may take), how long PostgreSQL lets it run.
    budget: TimeBudget,
    /// For migrations, which run on a connection of their own without a statement timeout.
    migration_options: Arc<PgConnectOptions>,
    /// The one connection that `LISTEN`s for committed changes, held by [`Store::watch_keys`].
    listen_pool: PgPool,
    /// The listener's connection settings, to find out why it cannot connect.
    listen_options: Arc<PgConnectOptions>,
    events: broadcast::Sender<KeyEvent>,
    url: String,
    /// Behind a pooler in transaction mode: the statement that opens the transaction each
    /// statement runs in, with the settings a direct connection gets in its startup packet.
    begin: Option<SqlStr>,
}

/// The statement that opens a transaction whose statements may run for `statement_timeout_ms`;
/// `pooler`: with the settings that a direct connection gets in its startup packet, which a
/// pooler in transaction mode refuses.
fn begin_statement(budget: &TimeBudget, statement_timeout_ms: u128, pooler: bool) -> SqlStr {
    let settings = if pooler {
        "; SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off"
    } else {
        ""
    };
    let lock_timeout_ms = budget
        .lock
        .as_millis()
        .clamp(1, statement_timeout_ms.max(1));
    SqlSafeStr::into_sql_str(AssertSqlSafe(format!(
        "BEGIN; SET LOCAL statement_timeout = {statement_timeout_ms}; \
         SET LOCAL lock_timeout = {lock_timeout_ms}{settings}"
    )))
}

/// SQLSTATE lock_not_available: the statement met a key that another transaction held (its row
/// locked, or its insert not yet committed) for longer than the session's `lock_timeout`.
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

impl std::fmt::Debug for PgStore {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore").finish_non_exhaustive()
    }
}

impl PgStore {
    /// The calls' pool: connections in use, idle.
    pub fn pool_connections(&self) -> (u32, u32) {
        let pool = self.connections.pool();
        let size = pool.size();
        // A connection the store keeps between statements is idle too, although the pool
        // counts it in use.
        let idle = u32::try_from(pool.num_idle() + self.connections.unused())
            .unwrap_or(u32::MAX)
            .min(size);
        (size - idle, idle)
    }

    /// Builds the pool without connecting, so the service can start (and report NOT_SERVING)
    /// while the database is still unreachable.
    pub fn connect_lazy(settings: &PgSettings) -> Result<Self, sqlx::Error> {
        let budget = TimeBudget::of(settings.operation_timeout);
        let migration_options: PgConnectOptions = settings
            .url
            .parse::<PgConnectOptions>()?
            .application_name("idempotency-coordinator");
        let statement_timeout_ms = budget.statement.as_millis().max(1);
        let lock_timeout_ms = budget.lock.as_millis().max(1).to_string();
        // A transaction this service abandons (its connection cut off between statements) is
        // ended by the server within a statement's time, and a session whose peer vanished is
        // found by TCP keepalives, so neither holds a key's row for long.
        let idle_in_transaction_ms = statement_timeout_ms.to_string();
        // Generic plans: every statement here is an index lookup or a walk over unnest()ed
        // arrays, whose best plan does not depend on the values, and re-planning the larger
        // statements for each call costs more than running them. A generic plan is kept for
        // the connection's life, so it must not depend on the tables' statistics either: made
        // while a table is small (a new deployment, a test), it would read the whole table by
        // a sequential scan, and keep doing so, once for every Complete, as the table grows
        // (a one-key Complete took 1.1 ms instead of 0.3–0.6 ms after a few thousand keys).
        // Without sequential scans every plan takes the indexes, whatever the table's size.
        let (options, begin) = match settings.pooler {
            Pooler::None => (
                migration_options.clone().options([
                    (
                        "statement_timeout",
                        statement_timeout_ms.to_string().as_str(),
                    ),
                    ("plan_cache_mode", "force_generic_plan"),
                    ("enable_seqscan", "off"),
                    ("lock_timeout", lock_timeout_ms.as_str()),
                    (
                        "idle_in_transaction_session_timeout",
                        idle_in_transaction_ms.as_str(),
                    ),
                    ("tcp_keepalives_idle", "10"),
                    ("tcp_keepalives_interval", "5"),
                    ("tcp_keepalives_count", "3"),
                ]),
                None,
            ),
            // A pooler in transaction mode refuses startup options (PgBouncer: "unsupported
            // startup parameter: options") and hands each transaction whichever server
            // connection is free: settings are made per transaction, and no statement is kept
            // prepared (each is unnamed, parsed again in the transaction that runs it).
            Pooler::Transaction => (
                migration_options.clone(),
                Some(begin_statement(&budget, statement_timeout_ms, true)),
            ),
        };
        let pool = PgPoolOptions::new()
            .max_connections(settings.pool_size)
            .acquire_timeout(budget.connection_wait)
            // The driver pings every connection it takes from the pool (a round trip before
            // each statement) and again when it is given back. A connection given back moments
            // ago has just answered that second ping, so only one that sat idle for a while,
            // and may have been dropped by the server or a firewall meanwhile, is pinged first.
            .test_before_acquire(false)
            .before_acquire(|connection, metadata| {
                Box::pin(async move {
                    if metadata.idle_for > PING_WHEN_IDLE_FOR {
                        connection.ping().await?;
                    }
                    Ok(true)
                })
            })
            .connect_lazy_with(options.clone());
        let probe_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(options.clone());
        let listen_options = match &settings.notify_url {
            Some(url) => url.parse::<PgConnectOptions>()?,
            None => migration_options.clone(),
        }
        .application_name("idempotency-coordinator listener");
        let listen_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(budget.connection_wait)
            .connect_lazy_with(listen_options.clone());
        Ok(Self {
            connections: Arc::new(KeptConnections::new(pool)),
            probe_pool,
            listen_pool,
            listen_options: Arc::new(listen_options),
            events: broadcast::channel(EVENTS_QUEUED).0,
            migration_options: Arc::new(migration_options),
            url: settings.url.clone(),
            begin,
            probe_options: Arc::new(options),
            budget,
        })
    }

    /// The pool, for tests and tools that inspect the database directly.
    pub fn pool(&self) -> &PgPool {
        self.connections.pool()
    }
}

/// A query of the store, answered by rows of type `O`.
type Statement<'q, O> = QueryAs<'q, Postgres, O, PgArguments>;

impl PgStore {
    /// Runs `query` on `connection` and answers its rows: directly, or behind a pooler in
    /// transaction mode in a transaction of its own that first sets the statement's timeout.
    async fn fetch_all_with<O>(
        &self,
        connection: &mut PgConnection,
        query: Statement<'_, O>,
    ) -> Result<Vec<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        match &self.begin {
            None => query.fetch_all(connection).await,
            Some(begin) => {
                let mut transaction = connection.begin_with(begin.clone()).await?;
                // Unnamed: a named statement would stay on the server connection, which the
                // pooler hands to other clients, and collide with theirs.
                let rows = query.persistent(false).fetch_all(&mut *transaction).await?;
                transaction.commit().await?;
                Ok(rows)
            }
        }
    }

    /// The row `query` answers on `connection`, if any (it answers at most one), as
    /// [`Self::fetch_all_with`] runs it: directly, exactly the driver's own `fetch_optional`.
    async fn fetch_optional_with<O>(
        &self,
        connection: &mut PgConnection,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        match &self.begin {
            None => query.fetch_optional(connection).await,
            Some(_) => Ok(self
                .fetch_all_with(connection, query)
                .await?
                .into_iter()
                .next()),
        }
    }

    /// [`Self::fetch_optional_with`] for one of several statements that an operation, begun at
    /// `began`, runs on one connection, all of them within the store's share of the budget (a
    /// connection's wait and one statement's time). While no more than a connection's wait has
    /// been spent, the statement has its whole time (the session's timeout, as if it had waited
    /// for its connection only); after that, only what is left, set for a transaction of its
    /// own. With less than [`MIN_STATEMENT_TIME`] left it is not run, and the operation is
    /// answered "timed out": nothing was written by this statement.
    async fn fetch_optional_within<O>(
        &self,
        connection: &mut PgConnection,
        began: std::time::Instant,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, StoreError>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let spent = began.elapsed();
        if spent <= self.budget.connection_wait {
            return self
                .fetch_optional_with(connection, query)
                .await
                .map_err(classify);
        }
        let share = self.budget.connection_wait + self.budget.statement;
        let left = share.saturating_sub(spent);
        if left < MIN_STATEMENT_TIME {
            return Err(StoreError::TimedOut(share));
        }
        let begin = begin_statement(&self.budget, left.as_millis(), self.begin.is_some());
        let mut transaction = connection.begin_with(begin).await.map_err(classify)?;
        let row = query
            .persistent(self.begin.is_none())
            .fetch_optional(&mut *transaction)
            .await
            .map_err(classify)?;
        transaction.commit().await.map_err(classify)?;
        Ok(row)
    }

    /// [`Self::fetch_all_with`] on a connection of the calls' pool, kept for the next
    /// statement once this one has answered.
    async fn fetch_all<O>(&self, query: Statement<'_, O>) -> Result<Vec<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.connections.lend().await?;
        let rows = self.fetch_all_with(&mut connection, query).await?;
        connection.keep();
        Ok(rows)
    }

    /// [`Self::fetch_optional_with`] on a connection of the calls' pool, kept for the next
    /// statement once this one has answered.
    async fn fetch_optional<O>(&self, query: Statement<'_, O>) -> Result<Option<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.connections.lend().await?;
        let row = self.fetch_optional_with(&mut connection, query).await?;
        connection.keep();
        Ok(row)
    }

    /// The one row `query` answers.
    async fn fetch_one<O>(&self, query: Statement<'_, O>) -> Result<O, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        self.fetch_optional(query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }

    /// The one row `query` answers, on the health probe's own connection.
    async fn fetch_one_probing<O>(&self, query: Statement<'_, O>) -> Result<O, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.probe_pool.acquire().await?;
        self.fetch_optional_with(&mut connection, query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }
}

impl PgStore {
    /// Why the probe's pool could not open a connection. The pool retries failures it takes
    /// for passing (a refused connection, a database starting up) until its wait runs out and
    /// then says only "pool timed out"; one connection made by hand reports the cause (a
    /// refused connection, a wrong host), which is what an operator needs to read.
    async fn why_no_connection(&self) -> sqlx::Error {
        let attempt = tokio::time::timeout(
            self.budget.connection_wait,
            PgConnection::connect_with(&self.probe_options),
        )
        .await;
        match attempt {
            Ok(Err(cause)) => cause,
            Ok(Ok(connection)) => {
                let _ = connection.close().await;
                sqlx::Error::PoolTimedOut
            }
            Err(_) => sqlx::Error::PoolTimedOut,
        }
    }
}

/// How often a guarded write is tried when the read that explains its refusal finds the caller
/// to be the current holder of an in-progress key after all (the key changed in between).
const GUARD_ATTEMPTS: usize = 3;

impl PgStore {
    /// Runs `write` (a statement guarded on the caller's token that answers a row only when it
    /// applied: Release, ExtendLease) and answers that row, or, when it changed nothing, reads
    /// the key to say why. Tokens are never reused
    /// and completed keys never reopen, so what the read finds explains the refusal; should it
    /// find the caller holding an in-progress key after all (which only a token guessed before
    /// it was handed out can cause), the write is tried again.
    async fn guarded_write<'q, T, F>(
        &self,
        namespace: &str,
        key: &str,
        token: LeaseToken,
        mut write: F,
    ) -> Result<Result<T, Rejection>, StoreError>
    where
        F: FnMut() -> Statement<'q, T>,
        T: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        for _ in 0..GUARD_ATTEMPTS {
            if let Some(applied) = self.fetch_optional(write()).await.map_err(classify)? {
                return Ok(Ok(applied));
            }
            let found: Option<GuardRow> = self
                .fetch_optional(sqlx::query_as(GUARD_STATE).bind(namespace).bind(key))
                .await
                .map_err(classify)?;
            match classify_refusal(found.map(GuardedKey::from), token) {
                Err(rejection) => return Ok(Err(rejection)),
                // Without an offered response, a completed key is always ALREADY_COMPLETED.
                Ok(Some(_)) => return Ok(Err(Rejection::AlreadyCompleted)),
                Ok(None) => continue,
            }
        }
        Err(StoreError::Inconsistent(
            "a guarded write kept refusing the current holder of an in-progress key",
        ))
    }
}

/// How many key events may wait for a slow subscriber before it is told it missed some.
const EVENTS_QUEUED: usize = 4096;

/// How long the listener waits before connecting again, at first and at most.
const LISTEN_RETRY: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

impl PgStore {
    /// Listens on [`KEY_CHANNEL`] until the connection drops (answered `Ok`) or shutdown.
    async fn listen_until_dropped(&self, shutdown: &CancellationToken) -> Result<(), sqlx::Error> {
        let mut listener = match PgListener::connect_with(&self.listen_pool).await {
            Ok(listener) => listener,
            // The pool says only that it timed out: one direct attempt tells why (the database
            // does not exist yet, authentication, the network).
            Err(sqlx::Error::PoolTimedOut) => {
                return Err(
                    match PgConnection::connect_with(&self.listen_options).await {
                        Ok(connection) => {
                            let _ = connection.close().await;
                            sqlx::Error::PoolTimedOut
                        }
                        Err(cause) => cause,
                    },
                );
            }
            Err(other) => return Err(other),
        };
        listener.listen(KEY_CHANNEL).await?;
        // Whatever committed while nobody listened is unknown: every waiter looks again.
        let _ = self.events.send(KeyEvent::Missed);
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                next = listener.try_recv() => next?,
            };
            match next {
                Some(notification) => match KeyHash::from_hex(notification.payload()) {
                    Some(hash) => {
                        let _ = self.events.send(KeyEvent::Changed(hash));
                    }
                    None => tracing::debug!("ignored a notification that names no key"),
                },
                None => return Ok(()),
            }
        }
    }
}

/// The least time worth giving a statement: below it, a call is answered "timed out" at once.
const MIN_STATEMENT_TIME: Duration = Duration::from_millis(10);

/// [`TRY_START`] with `command`'s values.
fn bind_try_start<'q, O>(command: &'q TryStartCommand) -> Statement<'q, O>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(TRY_START)
        .bind(command.namespace.as_str())
        .bind(command.key.as_str())
        .bind(command.fingerprint.as_bytes())
        .bind(command.lease_ttl.as_micros())
        .bind(command.retention.as_micros())
        .bind(command.attempt_id.as_ref().map(|a| a.as_str()))
}

/// [`COMPLETE_ONE`] with `command`'s values.
fn bind_complete<'q, O>(command: &'q CompleteCommand) -> Statement<'q, O>
where
    O: for<'r> FromRow<'r, PgRow>,
{
    sqlx::query_as(COMPLETE_ONE)
        .bind(command.namespace.as_str())
        .bind(command.key.as_str())
        .bind(command.lease_token.get())
        .bind(command.response.as_bytes())
        .bind(command.retention.map(|r| r.as_micros()))
}

/// `error` as the answer of each of `count` commands.
fn failed<T>(error: StoreError, count: usize) -> Vec<Result<T, StoreError>> {
    error.for_each_of(count).into_iter().map(Err).collect()
}

impl PgStore {
    /// The key for a waiter ([`Store::watch`]): [`LOOKUP_WATCHED`], and when the key is in
    /// progress and nobody watches it yet, [`WATCH_KEY`], whose answer is the row as that
    /// statement left it, marked: no Complete or Release of it can then commit unannounced.
    /// Should the key change between the two (another waiter marked it, or its row went), it is
    /// looked at again, all on one connection within the store's share of the budget.
    async fn watch_key(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        let began = std::time::Instant::now();
        let mut connection = self.connections.lend().await.map_err(classify)?;
        let (namespace, key) = (query.namespace.as_str(), query.key.as_str());
        loop {
            let looked: Option<WatchedKeyRow> = self
                .fetch_optional_within(
                    &mut connection,
                    began,
                    sqlx::query_as(LOOKUP_WATCHED).bind(namespace).bind(key),
                )
                .await?;
            let state = match looked {
                None => KeyState::Absent,
                Some(looked) if looked.watched || looked.key.completed_at.is_some() => {
                    KeyState::of(Some(looked.key.into()))
                }
                Some(_) => {
                    let marked: Option<MarkedKeyRow> = self
                        .fetch_optional_within(
                            &mut connection,
                            began,
                            sqlx::query_as(WATCH_KEY).bind(namespace).bind(key),
                        )
                        .await?;
                    match marked {
                        Some(marked) => KeyState::of(marked.live.then(|| marked.key.into())),
                        None => continue,
                    }
                }
            };
            connection.keep();
            return Ok(state);
        }
    }
}

impl PgStore {
    /// One statement alone on a connection of the calls' pool, within what is left of the
    /// store's share of an operation begun at `began` ([`Self::fetch_optional_within`]).
    async fn alone_within<O>(
        &self,
        began: std::time::Instant,
        query: Statement<'_, O>,
    ) -> Result<O, StoreError>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.connections.lend().await.map_err(classify)?;
        let row = self
            .fetch_optional_within(&mut connection, began, query)
            .await?;
        connection.keep();
        row.ok_or_else(|| classify(sqlx::Error::RowNotFound))
    }

    /// After a shared statement begun at `began` met a key held longer than the lock budget
    /// (`lock_timeout`; the statement wrote nothing): every call of it runs again alone, all at
    /// once, so a held key fails only its own callers (at their own lock timeout), and the
    /// others are answered without waiting for it. The answers come back in call order.
    async fn each_alone<C, T, F, Fut>(
        &self,
        commands: Vec<C>,
        began: std::time::Instant,
        run: F,
    ) -> Vec<Result<T, StoreError>>
    where
        C: Send + 'static,
        T: Send + 'static,
        F: Fn(Self, C, std::time::Instant) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let count = commands.len();
        let mut runs = tokio::task::JoinSet::new();
        for (position, command) in commands.into_iter().enumerate() {
            let run = run(self.clone(), command, began);
            runs.spawn(async move { (position, run.await) });
        }
        let mut answers: Vec<Option<Result<T, StoreError>>> = (0..count).map(|_| None).collect();
        while let Some(joined) = runs.join_next().await {
            if let Ok((position, answer)) = joined
                && let Some(slot) = answers.get_mut(position)
            {
                *slot = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or(Err(StoreError::Inconsistent(
                    "a call run again alone did not finish",
                )))
            })
            .collect()
    }
}

impl Store for PgStore {
    async fn try_start(&self, command: TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        // One call for a key with or without a row: one round trip, directly or behind a
        // pooler (where each statement is a transaction of its own).
        let row: TryStartRow = self
            .fetch_one(bind_try_start(&command))
            .await
            .map_err(classify)?;
        Ok(TryStartOutcome::from_record(
            row.key.into(),
            row.newly_claimed,
            &command,
        ))
    }

    async fn complete(
        &self,
        command: CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        let row: CompleteRow = self
            .fetch_one(bind_complete(&command))
            .await
            .map_err(classify)?;
        row.answer(command.lease_token)
    }

    /// One statement for the whole round (its keys are distinct).
    async fn try_start_batch(
        &self,
        round: Round<TryStartCommand>,
    ) -> Vec<Result<TryStartOutcome, StoreError>> {
        if round.len() == 1 {
            // A lone call takes the one-row statement, whose plan is simpler.
            let mut results = Vec::with_capacity(1);
            for command in round {
                results.push(self.try_start(command).await);
            }
            return results;
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
        let began = std::time::Instant::now();
        let rows: Vec<TryStartBatchRow> = match self
            .fetch_all(
                sqlx::query_as(TRY_START_BATCH)
                    .bind(&namespaces)
                    .bind(&keys)
                    .bind(&fingerprints)
                    .bind(&leases)
                    .bind(&retentions)
                    .bind(&attempt_ids),
            )
            .await
        {
            Ok(rows) => rows,
            Err(error) if is_lock_timeout(&error) => {
                return self
                    .each_alone(
                        round.into_commands(),
                        began,
                        |store, command, began| async move {
                            let row: TryStartRow =
                                store.alone_within(began, bind_try_start(&command)).await?;
                            Ok(TryStartOutcome::from_record(
                                row.key.into(),
                                row.newly_claimed,
                                &command,
                            ))
                        },
                    )
                    .await;
            }
            Err(error) => return failed(classify(error), round.len()),
        };
        let mut by_key: HashMap<(String, String), TryStartBatchRow> = rows
            .into_iter()
            .map(|row| ((row.namespace.clone(), row.key_name.clone()), row))
            .collect();
        round
            .into_iter()
            .map(
                |command| match by_key.remove(&key_id(&command.namespace, &command.key)) {
                    Some(row) => Ok(TryStartOutcome::from_record(
                        row.key.into(),
                        row.newly_claimed,
                        &command,
                    )),
                    None => Err(StoreError::Inconsistent("a batched claim returned no row")),
                },
            )
            .collect()
    }

    /// One statement for the whole round, like [`Self::try_start_batch`], which answers every
    /// call of the round, refusals included.
    async fn complete_batch(
        &self,
        round: Round<CompleteCommand>,
    ) -> Vec<Result<Result<Completion, Rejection>, StoreError>> {
        if round.len() == 1 {
            // A lone call takes the one-key statement, which sets up less.
            let mut results = Vec::with_capacity(1);
            for command in round {
                results.push(self.complete(command).await);
            }
            return results;
        }
        let namespaces: Vec<&str> = round.iter().map(|c| c.namespace.as_str()).collect();
        let keys: Vec<&str> = round.iter().map(|c| c.key.as_str()).collect();
        let tokens: Vec<i64> = round.iter().map(|c| c.lease_token.get()).collect();
        let responses: Vec<&[u8]> = round.iter().map(|c| c.response.as_bytes()).collect();
        let retentions: Vec<Option<i64>> = round
            .iter()
            .map(|c| c.retention.map(|r| r.as_micros()))
            .collect();
        let began = std::time::Instant::now();
        let rows: Vec<CompleteRow> = match self
            .fetch_all(
                sqlx::query_as(COMPLETE)
                    .bind(&namespaces)
                    .bind(&keys)
                    .bind(&tokens)
                    .bind(&responses)
                    .bind(&retentions),
            )
            .await
        {
            Ok(rows) => rows,
            Err(error) if is_lock_timeout(&error) => {
                return self
                    .each_alone(
                        round.into_commands(),
                        began,
                        |store, command, began| async move {
                            let row: CompleteRow =
                                store.alone_within(began, bind_complete(&command)).await?;
                            row.answer(command.lease_token)
                        },
                    )
                    .await;
            }
            Err(error) => return failed(classify(error), round.len()),
        };
        if rows.len() != round.len() {
            return failed(
                StoreError::Inconsistent("a Complete statement did not answer one row per call"),
                round.len(),
            );
        }
        round
            .into_iter()
            .zip(rows)
            .map(|(command, row)| row.answer(command.lease_token))
            .collect()
    }

    async fn release(&self, command: ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        let outcome = self
            .guarded_write(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                || {
                    sqlx::query_as::<_, (i64,)>(RELEASE)
                        .bind(command.namespace.as_str())
                        .bind(command.key.as_str())
                        .bind(command.lease_token.get())
                },
            )
            .await?;
        Ok(outcome.map(drop))
    }

    async fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        let checkpoint = command.checkpoint.as_ref().map(|c| c.as_bytes());
        let outcome = self
            .guarded_write(
                command.namespace.as_str(),
                command.key.as_str(),
                command.lease_token,
                || {
                    sqlx::query_as::<_, (Instant,)>(EXTEND_LEASE)
                        .bind(command.namespace.as_str())
                        .bind(command.key.as_str())
                        .bind(command.lease_token.get())
                        .bind(command.lease_ttl.as_micros())
                        .bind(checkpoint.is_some())
                        .bind(checkpoint)
                },
            )
            .await?;
        Ok(outcome.map(|(lease_expires_at,)| lease_expires_at))
    }

    async fn lookup(&self, query: LookupQuery) -> Result<KeyState, StoreError> {
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

    async fn watch(&self, query: LookupQuery) -> Result<KeyState, StoreError> {
        self.watch_key(&query).await
    }

    async fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        let mut results = self.mark_processed_batch(Round::one(command)).await;
        results
            .pop()
            .unwrap_or(Err(StoreError::Inconsistent("a mark was not run")))
    }

    /// Every call in one statement: their ids in call order, so that an id two calls carry is
    /// new for the first and already processed for the second, exactly as one after another;
    /// the rows are then handed back call by call.
    async fn mark_processed_batch(
        &self,
        round: Round<MarkProcessedCommand>,
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        let commands = round.into_commands();
        if let [command] = commands.as_slice()
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
        for command in &commands {
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
            .map_err(classify);
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

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = self
            .fetch_one(sqlx::query_as(REAP_KEYS).bind(i64::from(limit)))
            .await
            .map_err(classify)?;
        Ok(deleted.unsigned_abs())
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = self
            .fetch_one(sqlx::query_as(REAP_EVENTS).bind(i64::from(limit)))
            .await
            .map_err(classify)?;
        Ok(deleted.unsigned_abs())
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
        // A database that does not exist yet is created, so a first start needs nothing by
        // hand; where the role may not create databases, the original error is reported.
        if let Ok(false) = Postgres::database_exists(&self.url).await {
            if let Err(error) = Postgres::create_database(&self.url).await {
                tracing::warn!(error = %error, "could not create the database");
            } else {
                tracing::info!("created the database");
            }
        }
        // A connection of its own, without the statement timeout: a migration may take long.
        let connection = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(PgConnectOptions::clone(&self.migration_options))
            .await
            .map_err(classify)?;
        let migrated = MIGRATOR.run(&connection).await;
        connection.close().await;
        migrated.map_err(|error| schema::migration_error(error, classify))
    }

    async fn probe(&self) -> Result<(), StoreError> {
        let probed = self
            .fetch_one_probing(sqlx::query_as(schema::SCHEMA_VERSION))
            .await;
        let probed = match probed {
            Err(sqlx::Error::PoolTimedOut) => Err(self.why_no_connection().await),
            other => other,
        };
        let (version,): (i64,) = probed.map_err(classify)?;
        schema::require_version(&MIGRATOR, version)
    }

    async fn close(&self) {
        self.listen_pool.close().await;
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
        let mut retry = LISTEN_RETRY.0;
        while !shutdown.is_cancelled() {
            match self.listen_until_dropped(&shutdown).await {
                Ok(()) => {
                    retry = LISTEN_RETRY.0;
                    if !shutdown.is_cancelled() {
                        tracing::warn!("the listening connection dropped; reconnecting");
                    }
                }
                Err(error) => {
                    tracing::warn!(error = %crate::telemetry::error_chain(&error),
                        ?retry, "cannot listen for other replicas' changes; retrying");
                    retry = (retry * 2).min(LISTEN_RETRY.1);
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(retry) => {}
            }
        }
    }
}
