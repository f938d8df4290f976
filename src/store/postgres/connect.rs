//! Connection handling: the pools the store opens (calls, health probe, listener), the settings
//! each connection starts with, and how the transaction of a statement is opened behind a
//! pooler in transaction mode.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgPool, SqlSafeStr, SqlStr};
use tokio::sync::broadcast;

use super::credentials::login_of_url;
use super::hosts::HostList;
use super::kept::{KeptConnections, PING_WHEN_IDLE_FOR};
use super::listen::EVENTS_QUEUED;
use super::primary::{Follower, Shape};
use super::{PgSettings, PgStore};
use crate::domain::budget::TimeBudget;
use crate::store::{Pooler, StoreError};

/// The statement that opens a transaction whose statements may run for `statement_timeout_ms`
/// and wait for a row lock for `lock`; `pooler`: with the settings that a direct connection gets
/// in its startup packet, which a pooler in transaction mode refuses.
pub(super) fn begin_statement(statement_timeout_ms: u128, lock: Duration, pooler: bool) -> SqlStr {
    let settings = if pooler {
        "; SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off"
    } else {
        ""
    };
    let statement_timeout_ms = statement_timeout_ms.max(1);
    let lock_timeout_ms = lock.as_millis().clamp(1, statement_timeout_ms);
    SqlSafeStr::into_sql_str(AssertSqlSafe(format!(
        "BEGIN; SET LOCAL statement_timeout = {statement_timeout_ms}; \
         SET LOCAL lock_timeout = {lock_timeout_ms}{settings}"
    )))
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
        let follower = Arc::new(followed_url(&settings.url, &settings.credentials)?);
        let listen_follower = match &settings.notify_url {
            Some(url) => Arc::new(followed_url(url, &settings.notify_credentials)?),
            None => follower.clone(),
        };
        let named = |options: PgConnectOptions| options.application_name("idempotency-coordinator");
        let statement_timeout_ms = budget.statement.as_millis().max(1);
        // Every statement first waits only briefly for a row lock (see `TimeBudget::brief_lock`);
        // a call whose own key is held runs again with the whole lock budget (`Store::patient`).
        let lock_timeout_ms = budget.brief_lock.as_millis().max(1).to_string();
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
        let pooler = settings.pooler;
        let startup = move |options: PgConnectOptions| match pooler {
            Pooler::None => named(options).options([
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
            // A pooler in transaction mode refuses startup options (PgBouncer: "unsupported
            // startup parameter: options") and hands each transaction whichever server
            // connection is free: settings are made per transaction, and no statement is kept
            // prepared (each is unnamed, parsed again in the transaction that runs it).
            Pooler::Transaction => named(options),
        };
        let begin = match settings.pooler {
            Pooler::None => None,
            Pooler::Transaction => Some(begin_statement(
                statement_timeout_ms,
                budget.brief_lock,
                true,
            )),
        };
        let startup: Shape = Arc::new(startup);
        let shapes = Shapes {
            calls: startup.clone(),
            probe: startup,
            listen: Arc::new(|options: PgConnectOptions| {
                options.application_name("idempotency-coordinator listener")
            }),
            heartbeat: Arc::new(|options: PgConnectOptions| {
                options.application_name("idempotency-coordinator heartbeat")
            }),
        };
        let calls_follower = follower.clone();
        let pool = followed_pool(&follower, settings.pool_size, budget.connection_wait)
            // The driver pings every connection it takes from the pool (a round trip before
            // each statement) and again when it is given back. A connection given back moments
            // ago has just answered that second ping, so only one that sat idle for a while,
            // and may have been dropped by the server or a firewall meanwhile, is pinged first.
            .test_before_acquire(false)
            .before_acquire(move |connection, metadata| {
                let follower = calls_follower.clone();
                Box::pin(async move {
                    if follower.predates_move(metadata.age)
                        || follower.idle_since_trouble(metadata.idle_for)
                    {
                        return Ok(false);
                    }
                    if metadata.idle_for > PING_WHEN_IDLE_FOR {
                        connection.ping().await?;
                    }
                    Ok(true)
                })
            })
            .connect_lazy_with(follower.current_options(&shapes.calls));
        let probe_pool = single_connection(&follower, budget.connection_wait)
            .connect_lazy_with(follower.current_options(&shapes.probe));
        // Two places for the one connection that listens: the one it leaves on a host the store
        // moved away from may wait for the TCP keepalives to give up before the pool gets its
        // place back (the driver unlistens on it first), and must not keep the listener from the
        // new host meanwhile.
        let listen_pool = followed_pool(&listen_follower, 2, budget.connection_wait)
            .connect_lazy_with(listen_follower.current_options(&shapes.listen));
        let beat_pool = single_connection(&listen_follower, budget.connection_wait)
            .connect_lazy_with(listen_follower.current_options(&shapes.heartbeat));
        Ok(Self {
            connections: Arc::new(KeptConnections::new(pool, follower.clone())),
            probe_pool,
            listen_pool,
            events: broadcast::channel(EVENTS_QUEUED).0,
            erasures: broadcast::channel(EVENTS_QUEUED).0,
            replica: Arc::new(super::replicas::Replica::new()),
            beat_pool,
            follower,
            listen_follower,
            shapes: Arc::new(shapes),
            begin,
            budget,
            limits: None,
            durability: Arc::default(),
            cluster: None,
            require_synchronous_standby: settings.require_synchronous_standby,
            migration_lock_timeout: settings.migration_lock_timeout,
            rights_checked: Arc::default(),
            refusals: Arc::default(),
        })
    }

    /// The same store, named as one cluster of several: its durability's log lines and gauges
    /// carry the name.
    #[must_use]
    pub fn in_cluster(mut self, name: &str) -> Self {
        self.cluster = Some(name.into());
        self
    }

    /// How migrations connect: to the host the calls go to now, without a statement timeout.
    pub(super) fn migration_options(&self) -> PgConnectOptions {
        let named: Shape = Arc::new(|options: PgConnectOptions| {
            options.application_name("idempotency-coordinator")
        });
        self.follower.current_options(&named)
    }

    /// Applies the migrations, then grants `grant_to` the rights `serve` needs.
    pub async fn migrate_granting(&self, grant_to: Option<&str>) -> Result<(), StoreError> {
        self.migrate_schema(grant_to).await
    }

    /// The pool, for tests and tools that inspect the database directly.
    pub fn pool(&self) -> &PgPool {
        self.connections.pool()
    }
}

/// What each pool adds to a host's connection settings (the same hosts for every pool).
pub(super) struct Shapes {
    pub calls: Shape,
    pub probe: Shape,
    pub listen: Shape,
    pub heartbeat: Shape,
}

/// The hosts of `url` and the credentials that log in to them.
fn followed_url(
    url: &str,
    files: &super::credentials::CredentialFiles,
) -> Result<Follower, sqlx::Error> {
    let list = HostList::parse(url).map_err(invalid_url)?;
    // With the whole URL in a file, what it says besides the login is noted, so that a change
    // of it (which takes a restart) is reported.
    let rest = match files.url_file {
        Some(_) => login_of_url(url).ok().map(|(_, rest)| rest),
        None => None,
    };
    Ok(Follower::new(list, files.clone(), rest))
}

/// A pool of at most `size` connections that follows `follower`'s host: when the URL asks for
/// a writable session, every new connection is checked and refused if its host cannot write.
fn followed_pool(
    follower: &Arc<Follower>,
    size: u32,
    connection_wait: std::time::Duration,
) -> PgPoolOptions {
    let options = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(connection_wait);
    if !follower.attrs().checked() {
        return options;
    }
    let follower = follower.clone();
    options.after_connect(move |connection, _| {
        let follower = follower.clone();
        Box::pin(async move { follower.check(connection).await })
    })
}

/// A pool of one connection of its own (the health probe's, the heartbeat's) that follows
/// `follower`'s host, and never lends a connection opened before the store moved to another
/// host, or one idle since trouble was seen.
fn single_connection(
    follower: &Arc<Follower>,
    connection_wait: std::time::Duration,
) -> PgPoolOptions {
    let moves = follower.clone();
    followed_pool(follower, 1, connection_wait).before_acquire(move |_, metadata| {
        let moved =
            moves.predates_move(metadata.age) || moves.idle_since_trouble(metadata.idle_for);
        Box::pin(async move { Ok(!moved) })
    })
}

/// A URL the store cannot use, as the driver's error (the settings checked it at start, so this
/// is reached only by tools that open a store directly).
fn invalid_url(problem: super::hosts::UrlProblem) -> sqlx::Error {
    sqlx::Error::Configuration(Box::new(problem))
}

/// Creates the database `options` names, through the maintenance database `postgres` (as
/// `sqlx::migrate::MigrateDatabase` does), without sqlx's warning about a slow statement: on a
/// first start, on a busy or slow disk, creating a database may well take more than its
/// one-second threshold, and an operator should not be warned of what is expected.
pub(super) async fn create_database(options: &PgConnectOptions) -> Result<(), sqlx::Error> {
    let database = options
        .get_database()
        .unwrap_or_default()
        .replace('"', "\"\"");
    let mut connection = options
        .clone()
        .database("postgres")
        .disable_statement_logging()
        .connect()
        .await?;
    let created = sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE \"{database}\"")))
        .execute(&mut connection)
        .await;
    let _ = connection.close().await;
    created.map(drop)
}
