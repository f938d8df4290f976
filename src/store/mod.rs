//! Persistence. Every SQL statement lives under this folder, one module per backend; the rest of
//! the crate sees only the [`Store`] trait and domain types.

/// Calls the same method on whichever store this is. Defined before the modules, so that
/// `AnyStore`'s implementations in each of them may call it.
macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            AnyStore::Postgres($store) => $call.await,
            AnyStore::Clusters($store) => $call.await,
            AnyStore::Sqlite($store) => $call.await,
        }
    };
}

pub mod admin;
pub mod clusters;
mod error;
pub mod gate;
pub mod postgres;
mod replicas;
mod row;
mod schema;
pub mod sqlite;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::domain::batch::Round;
use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Instant, KeyHash, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome,
};

pub use admin::{
    AdminStore, AuditPage, EraseCursor, Erased, Erasure, KeyPage, NamespaceBatch, Page,
};
pub use clusters::ClusteredStore;
pub use error::StoreError;
pub use gate::{Gate, GateRow, GateState};
pub use postgres::PgStore;
pub use replicas::{BarrierRequest, Replicas};
pub use row::Row;
pub use sqlite::SqliteStore;

/// The age of the oldest expired row still stored, per table (see [`Store::expired_backlog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpiredBacklog {
    pub keys: Duration,
    pub events: Duration,
}

/// A change that may end a wait on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyEvent {
    /// The key was completed or released, by this replica or another, and committed.
    Changed(KeyHash),
    /// Changes may have been missed (the store's listener reconnected, or a subscriber fell
    /// behind): every waiter should look again.
    Missed,
}

/// The operations of the contract on one shared store. Each state change is atomic, and every
/// instant it computes comes from the store's own clock.
///
/// Implementations are cheap handles (a connection pool), cloned into the tasks that run each
/// operation to completion even when the caller has gone.
pub trait Store: Clone + Send + Sync + 'static {
    fn try_start(
        &self,
        command: &TryStartCommand,
    ) -> impl Future<Output = Result<TryStartOutcome, StoreError>> + Send;

    fn complete(
        &self,
        command: &CompleteCommand,
    ) -> impl Future<Output = Result<Result<Completion, Rejection>, StoreError>> + Send;

    /// TryStart for a round of callers (no two on one key), one result per command in order,
    /// each exactly what `try_start` would have answered had the calls come one after another:
    /// one statement (PostgreSQL) or one transaction (SQLite), to share round trips and commits.
    fn try_start_batch(
        &self,
        round: &Round<TryStartCommand>,
    ) -> impl Future<Output = Vec<Result<TryStartOutcome, StoreError>>> + Send;

    /// MarkProcessed for a round of callers, like [`Store::try_start_batch`]: an event id in
    /// two calls is new for the first and already processed for the second.
    fn mark_processed_batch(
        &self,
        round: &Round<MarkProcessedCommand>,
    ) -> impl Future<Output = Vec<Result<Vec<ProcessedEvent>, StoreError>>> + Send;

    /// Complete for a round of callers, like [`Store::try_start_batch`].
    #[allow(clippy::type_complexity)]
    fn complete_batch(
        &self,
        round: &Round<CompleteCommand>,
    ) -> impl Future<Output = Vec<Result<Result<Completion, Rejection>, StoreError>>> + Send;

    fn release(
        &self,
        command: &ReleaseCommand,
    ) -> impl Future<Output = Result<Result<(), Rejection>, StoreError>> + Send;

    /// This store for a call that runs on its own (`service::held_keys`): each statement waits
    /// for a row lock briefly, or with `LockWait::Patient` (a call whose own key another
    /// transaction holds) up to the lock budget; and each, its wait for a connection included,
    /// starts only with time to spare before `deadline` and is ended by the database by then,
    /// so that nothing it writes can land after its caller was told it timed out. A store
    /// without row locks or connections to wait for (SQLite, whose one writer ends its own
    /// transactions by their deadline) answers itself.
    fn limited(&self, deadline: std::time::Instant, lock_wait: LockWait) -> Self;

    /// Answers the lease's new expiry.
    fn extend_lease(
        &self,
        command: &ExtendLeaseCommand,
    ) -> impl Future<Output = Result<Result<Instant, Rejection>, StoreError>> + Send;

    fn lookup(
        &self,
        query: &LookupQuery,
    ) -> impl Future<Output = Result<KeyState, StoreError>> + Send;

    /// [`Store::lookup`] for a waiting TryStart: when the key answered is in progress, its next
    /// Complete or Release, by any replica, is announced on every replica's
    /// [`Store::key_events`], so the waiter may sleep until then.
    fn watch(
        &self,
        query: &LookupQuery,
    ) -> impl Future<Output = Result<KeyState, StoreError>> + Send;

    /// One result per requested id, in request order.
    fn mark_processed(
        &self,
        command: &MarkProcessedCommand,
    ) -> impl Future<Output = Result<Vec<ProcessedEvent>, StoreError>> + Send;

    /// Deletes at most `limit` expired keys and answers how many it deleted. Rows another
    /// replica's reaper (or a claim) holds are skipped, not waited for.
    fn reap_expired_keys(&self, limit: u32)
    -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes at most `limit` expired processed events, like [`Store::reap_expired_keys`].
    fn reap_expired_events(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// How long ago the oldest expired key and the oldest expired event that are still stored
    /// expired (zero when none is), by the database clock: the reaper's lag. One index-backed
    /// `min(expires_at)` per table, which waits for no lock.
    fn expired_backlog(&self) -> impl Future<Output = Result<ExpiredBacklog, StoreError>> + Send;

    /// Applies the schema migrations this build carries.
    fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Succeeds when the store is reachable and its schema is fully migrated.
    fn probe(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Closes the store's connections once the operations in flight have ended.
    fn close(&self) -> impl Future<Output = ()> + Send;

    /// The store's clock now (the one clock of leases and retention).
    fn clock(&self) -> impl Future<Output = Result<Instant, StoreError>> + Send;

    /// Changes to keys as they commit, from every replica sharing the store (see
    /// [`Store::watch_keys`]).
    fn key_events(&self) -> broadcast::Receiver<KeyEvent>;

    /// Runs until `shutdown`, feeding [`Store::key_events`] with what other processes commit
    /// (PostgreSQL: `LISTEN`, on one connection per replica, reconnected when it drops, with a
    /// [`KeyEvent::Missed`] each time). A store whose only writer is this process sends its
    /// events as it commits and has nothing to watch.
    fn watch_keys(&self, shutdown: CancellationToken) -> impl Future<Output = ()> + Send;

    /// For each of `rows`, whether another transaction holds it now (never waiting): asked when
    /// a shared statement met a held row, to say whose. A store without row locks (SQLite's one
    /// writer) answers none.
    fn rows_held(
        &self,
        rows: &[Row<'_>],
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send;
}

/// How long a [`Store::limited`] statement waits for a row lock another transaction holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// Briefly, as every statement does (`TimeBudget::brief_lock`).
    Brief,
    /// Up to the lock budget: the call's own key is held.
    Patient,
}

/// Where the data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A PostgreSQL database, shared by any number of replicas.
    Postgres { url: String },
    /// Several PostgreSQL databases (`--cluster`), each namespace on the one its placement
    /// names.
    Clusters {
        urls: Vec<(clusters::placement::ClusterName, String)>,
        placement: clusters::placement::Placement,
    },
    /// A SQLite file, for one instance.
    Sqlite { path: PathBuf },
}

impl StoreLocation {
    /// `postgres://` (or `postgresql://`) selects PostgreSQL and `sqlite://` SQLite; anything
    /// else is refused with a message saying what is accepted.
    pub fn from_url(url: &str) -> Result<Self, String> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Self::Postgres {
                url: url.to_owned(),
            });
        }
        if url.starts_with("sqlite://") {
            return SqliteStore::path_from_url(url).map(|path| Self::Sqlite { path });
        }
        Err("must start with postgres:// (PostgreSQL) or sqlite:// (the embedded store)".to_owned())
    }
}

#[derive(Debug, Clone)]
pub struct StoreSettings {
    pub location: StoreLocation,
    /// Connections in the pool (SQLite: readers; its writer is always one).
    pub pool_size: u32,
    /// How many statements the database runs for this replica at once: the pool, or behind a
    /// pooler in transaction mode the server connections it gives, if fewer.
    pub concurrent_statements: u32,
    /// The budget of one store operation.
    pub operation_timeout: Duration,
    /// PostgreSQL only: where to `LISTEN` for other replicas' changes, when not the database
    /// URL itself (a connection pooler in transaction mode cannot hold a `LISTEN`).
    pub notify_url: Option<String>,
    /// What stands between the service and PostgreSQL.
    pub pooler: Pooler,
    /// PostgreSQL only: report the store unready while no synchronous standby is attached.
    pub require_synchronous_standby: bool,
    /// PostgreSQL only: where the URL's login may come from besides the URL.
    pub credentials: postgres::CredentialFiles,
    /// PostgreSQL only: the same for `notify_url`.
    pub notify_credentials: postgres::CredentialFiles,
    /// PostgreSQL only: how long a migration waits for a lock before it is tried again.
    pub migration_lock_timeout: Duration,
}

/// What stands between the service and PostgreSQL (`--pooler`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Pooler {
    /// A direct connection, or a pooler in session mode: settings go in the startup packet and
    /// statements are prepared once per connection.
    #[default]
    None,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`): nothing outlives a
    /// transaction, so every statement runs in one of its own that sets its timeout with
    /// `SET LOCAL`, statements are not kept prepared, and migrations are refused.
    Transaction,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("the database URL is not valid")]
    Postgres(#[source] sqlx::Error),
    #[error(transparent)]
    Cluster(#[from] clusters::ClusterUrlError),
    #[error(transparent)]
    Sqlite(#[from] sqlite::SqliteOpenError),
}

/// The store a deployment runs on, chosen by its settings.
#[derive(Debug, Clone)]
pub enum AnyStore {
    Postgres(PgStore),
    Clusters(ClusteredStore),
    Sqlite(SqliteStore),
}

impl AnyStore {
    /// Prepares the store that serves calls, without connecting to it (on SQLite, this
    /// process becomes the file's only server).
    pub fn open_lazy(settings: &StoreSettings) -> Result<Self, OpenError> {
        Self::open(settings, true)
    }

    /// Prepares the store for a one-shot tool (`migrate`), which may run beside the process
    /// that serves the file.
    pub fn open_lazy_for_tool(settings: &StoreSettings) -> Result<Self, OpenError> {
        Self::open(settings, false)
    }

    fn open(settings: &StoreSettings, serves: bool) -> Result<Self, OpenError> {
        let postgres = |url: &str| postgres::PgSettings {
            url: url.to_owned(),
            notify_url: settings.notify_url.clone(),
            pool_size: settings.pool_size,
            operation_timeout: settings.operation_timeout,
            pooler: settings.pooler,
            require_synchronous_standby: settings.require_synchronous_standby,
            credentials: settings.credentials.clone(),
            notify_credentials: settings.notify_credentials.clone(),
            migration_lock_timeout: settings.migration_lock_timeout,
        };
        match &settings.location {
            StoreLocation::Postgres { url } => PgStore::connect_lazy(&postgres(url))
                .map(Self::Postgres)
                .map_err(OpenError::Postgres),
            StoreLocation::Clusters { urls, placement } => {
                let shared = postgres("");
                Ok(Self::Clusters(ClusteredStore::connect_lazy(
                    urls,
                    placement.clone(),
                    &shared,
                )?))
            }
            StoreLocation::Sqlite { path } => SqliteStore::open_lazy(&sqlite::SqliteSettings {
                path: path.clone(),
                pool_size: settings.pool_size,
                operation_timeout: settings.operation_timeout,
                serves,
            })
            .map(Self::Sqlite)
            .map_err(OpenError::Sqlite),
        }
    }

    /// The parts that are served and reaped apart, each with its cluster's name: each cluster
    /// of a clustered store, else the store itself, without a name.
    pub fn parts(&self) -> Vec<(Option<String>, AnyStore)> {
        match self {
            Self::Clusters(store) => store
                .clusters()
                .iter()
                .map(|cluster| {
                    (
                        Some(cluster.name.to_string()),
                        Self::Postgres(cluster.store.clone()),
                    )
                })
                .collect(),
            other => vec![(None, other.clone())],
        }
    }

    /// The connections of the pool that serves calls, in use and idle (for SQLite, the
    /// writer's and the readers' together).
    pub fn pool_connections(&self) -> (u32, u32) {
        match self {
            Self::Postgres(store) => store.pool_connections(),
            Self::Clusters(store) => {
                store
                    .clusters()
                    .iter()
                    .fold((0, 0), |(in_use, idle), cluster| {
                        let (more_in_use, more_idle) = cluster.store.pool_connections();
                        (in_use + more_in_use, idle + more_idle)
                    })
            }
            Self::Sqlite(store) => store.pool_connections(),
        }
    }

    /// How many parts the store is served in, each with coalescers of its own (the clusters of
    /// a clustered store, else one).
    pub fn partitions(&self) -> usize {
        match self {
            Self::Clusters(store) => store.clusters().len(),
            Self::Postgres(_) | Self::Sqlite(_) => 1,
        }
    }

    /// The part (below [`AnyStore::partitions`]) that serves `scope`.
    pub fn partition_of(&self, scope: &str) -> usize {
        match self {
            Self::Clusters(store) => store.cluster_of(scope),
            Self::Postgres(_) | Self::Sqlite(_) => 0,
        }
    }

    /// `postgres` or `sqlite`, for logs.
    pub fn backend(&self) -> &'static str {
        match self {
            Self::Postgres(_) | Self::Clusters(_) => "postgres",
            Self::Sqlite(_) => "sqlite",
        }
    }

    /// `migrate`: applies the migrations; on PostgreSQL with `grant_to`, then grants that role
    /// the rights `serve` needs.
    pub async fn migrate_granting(&self, grant_to: Option<&str>) -> Result<(), StoreError> {
        match (self, grant_to) {
            (Self::Postgres(store), _) => store.migrate_granting(grant_to).await,
            (Self::Clusters(store), _) => store.migrate_granting(grant_to).await,
            (Self::Sqlite(store), _) => store.migrate().await,
        }
    }
}

/// The answer of a batch of one command.
fn only_answer<T>(mut answers: Vec<Result<T, StoreError>>) -> Result<T, StoreError> {
    match (answers.pop(), answers.is_empty()) {
        (Some(answer), true) => answer,
        _ => Err(StoreError::Inconsistent(
            "a batch of one command did not answer exactly once",
        )),
    }
}

impl Store for AnyStore {
    async fn try_start(&self, command: &TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        delegate!(self, store => store.try_start(command))
    }

    async fn complete(
        &self,
        command: &CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        delegate!(self, store => store.complete(command))
    }

    async fn try_start_batch(
        &self,
        round: &Round<TryStartCommand>,
    ) -> Vec<Result<TryStartOutcome, StoreError>> {
        delegate!(self, store => store.try_start_batch(round))
    }

    async fn complete_batch(
        &self,
        round: &Round<CompleteCommand>,
    ) -> Vec<Result<Result<Completion, Rejection>, StoreError>> {
        delegate!(self, store => store.complete_batch(round))
    }

    async fn mark_processed_batch(
        &self,
        round: &Round<MarkProcessedCommand>,
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        delegate!(self, store => store.mark_processed_batch(round))
    }

    async fn release(&self, command: &ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        delegate!(self, store => store.release(command))
    }

    fn limited(&self, deadline: std::time::Instant, lock_wait: LockWait) -> Self {
        match self {
            Self::Postgres(store) => Self::Postgres(store.limited(deadline, lock_wait)),
            Self::Clusters(store) => Self::Clusters(store.limited(deadline, lock_wait)),
            Self::Sqlite(store) => Self::Sqlite(store.limited(deadline, lock_wait)),
        }
    }

    async fn extend_lease(
        &self,
        command: &ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        delegate!(self, store => store.extend_lease(command))
    }

    async fn lookup(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        delegate!(self, store => store.lookup(query))
    }

    async fn watch(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        delegate!(self, store => store.watch(query))
    }

    async fn mark_processed(
        &self,
        command: &MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        delegate!(self, store => store.mark_processed(command))
    }

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        delegate!(self, store => store.reap_expired_keys(limit))
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        delegate!(self, store => store.reap_expired_events(limit))
    }

    async fn expired_backlog(&self) -> Result<ExpiredBacklog, StoreError> {
        delegate!(self, store => store.expired_backlog())
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        delegate!(self, store => store.migrate())
    }

    async fn probe(&self) -> Result<(), StoreError> {
        delegate!(self, store => store.probe())
    }

    async fn close(&self) {
        delegate!(self, store => store.close())
    }

    async fn clock(&self) -> Result<Instant, StoreError> {
        delegate!(self, store => store.clock())
    }

    fn key_events(&self) -> broadcast::Receiver<KeyEvent> {
        match self {
            Self::Postgres(store) => store.key_events(),
            Self::Clusters(store) => store.key_events(),
            Self::Sqlite(store) => store.key_events(),
        }
    }

    async fn watch_keys(&self, shutdown: CancellationToken) {
        delegate!(self, store => store.watch_keys(shutdown))
    }

    async fn rows_held(&self, rows: &[Row<'_>]) -> Result<Vec<bool>, StoreError> {
        delegate!(self, store => store.rows_held(rows))
    }
}
