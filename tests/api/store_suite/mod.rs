//! The store conformance suite: the contract's rules checked on the `Store` trait itself, with
//! no gRPC in between, by tests generic over `S: Store` and instantiated once per backend
//! (`store_suite!`), beside the end-to-end suites that run both stores through the wire.

mod batches;
mod keys;
mod lifecycle;
mod postgres_only;

use std::time::Duration;

use idempotency_coordinator::domain::{
    AttemptId, Claim, CompleteCommand, Completion, EventId, EventRetention, ExtendLeaseCommand,
    Fingerprint, Key, KeyRetention, LeaseToken, LeaseTtl, LookupQuery, MarkProcessedCommand,
    Rejection, ReleaseCommand, ResponseBody, Scope, TryStartCommand, TryStartOutcome,
};
use idempotency_coordinator::store::Store;
use idempotency_coordinator::store::postgres::{PgSettings, PgStore};
use idempotency_coordinator::store::sqlite::{SqliteSettings, SqliteStore};
use idempotency_testkit::{Backend, TestDatabase};

/// Runs each named test, an `async fn<S: Store>(S, &TestDatabase)`, on a freshly migrated store
/// of each backend, called through the trait alone.
macro_rules! store_suite {
    ($($test:ident),+ $(,)?) => {
        mod postgres {
            $(
                #[tokio::test]
                async fn $test() {
                    let (store, database) = crate::store_suite::postgres().await;
                    super::$test(store, &database).await
                }
            )+
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $test() {
                    let (store, database) = crate::store_suite::sqlite().await;
                    super::$test(store, &database).await
                }
            )+
        }
    };
}
pub(crate) use store_suite;

const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// A migrated PostgreSQL store on a fresh database.
pub async fn postgres() -> (PgStore, TestDatabase) {
    let database = TestDatabase::create(Backend::Postgres).await;
    let store = postgres_store_on(&database, OPERATION_TIMEOUT);
    ready(store, database).await
}

/// A PostgreSQL store, not connected yet, on `database`, with `operation_timeout`.
pub fn postgres_store_on(database: &TestDatabase, operation_timeout: Duration) -> PgStore {
    postgres_store_with_pool(database, operation_timeout, 4)
}

/// [`postgres_store_on`] with a pool of `pool_size` connections.
pub fn postgres_store_with_pool(
    database: &TestDatabase,
    operation_timeout: Duration,
    pool_size: u32,
) -> PgStore {
    PgStore::connect_lazy(&PgSettings {
        url: database.url.clone(),
        notify_url: None,
        pool_size,
        pooler: Default::default(),
        operation_timeout,
        require_synchronous_standby: false,
        credentials: Default::default(),
        notify_credentials: Default::default(),
        migration_lock_timeout:
            idempotency_coordinator::store::postgres::DEFAULT_MIGRATION_LOCK_TIMEOUT,
    })
    .expect("a valid URL")
}

/// A migrated SQLite store in a fresh folder.
pub async fn sqlite() -> (SqliteStore, TestDatabase) {
    let database = TestDatabase::create(Backend::Sqlite).await;
    let store = SqliteStore::open_lazy(&SqliteSettings {
        path: database.sqlite_path().to_owned(),
        pool_size: 4,
        operation_timeout: OPERATION_TIMEOUT,
        serves: true,
    })
    .expect("the folder exists");
    ready(store, database).await
}

async fn ready<S: Store>(store: S, database: TestDatabase) -> (S, TestDatabase) {
    assert!(
        store.probe().await.is_err(),
        "a fresh database is not migrated yet"
    );
    store.migrate().await.expect("migrate");
    store.probe().await.expect("migrated and reachable");
    (store, database)
}

pub const NAMESPACE: &str = "suite";

fn scope(name: &str) -> Scope {
    Scope::parse(name.into()).expect("scope")
}

fn key(name: &str) -> Key {
    Key::parse(name.into()).expect("key")
}

/// TryStart of `name` with fingerprint `f1`, a 30 s lease, 1 h retention and no attempt id.
pub fn claim(name: &str) -> TryStartCommand {
    TryStartCommand {
        namespace: scope(NAMESPACE),
        key: key(name),
        fingerprint: Fingerprint::parse(b"f1".to_vec()).expect("fingerprint"),
        lease_ttl: LeaseTtl::parse(Duration::from_secs(30)).expect("lease"),
        retention: KeyRetention::parse(Duration::from_secs(3600)).expect("retention"),
        attempt_id: None,
        holder: None,
    }
}

/// The claim `outcome` carries; any other answer fails the test.
pub fn started(outcome: TryStartOutcome) -> Claim {
    match outcome {
        TryStartOutcome::Started(claim) => claim,
        other => panic!("expected started, got {other:?}"),
    }
}

/// Claims with `command` through the trait; the store must start a claim, which is answered.
pub async fn claimed<S: Store>(store: &S, command: TryStartCommand) -> Claim {
    started(
        store
            .try_start(&command)
            .await
            .expect("TryStart reaches the store"),
    )
}

/// Completes with `command`, which the store must accept; answers the completion.
/// The store's answer to a Complete of `key` with `token` and `response`, whatever it is.
pub async fn complete_answer<S: Store>(
    store: &S,
    key: &str,
    token: LeaseToken,
    response: &[u8],
) -> Result<Completion, Rejection> {
    store
        .complete(&complete(key, token, response))
        .await
        .expect("store")
}

pub async fn completed<S: Store>(store: &S, command: CompleteCommand) -> Completion {
    store
        .complete(&command)
        .await
        .expect("Complete reaches the store")
        .expect("completed")
}

/// Releases with `command`, which the store must accept.
pub async fn released<S: Store>(store: &S, command: ReleaseCommand) {
    store
        .release(&command)
        .await
        .expect("Release reaches the store")
        .expect("released");
}

/// Extends with `command`, which the store must accept; answers the new lease's end.
pub async fn extended<S: Store>(
    store: &S,
    command: ExtendLeaseCommand,
) -> chrono::DateTime<chrono::Utc> {
    store
        .extend_lease(&command)
        .await
        .expect("ExtendLease reaches the store")
        .expect("extended")
}

pub fn with_fingerprint(mut command: TryStartCommand, fingerprint: &[u8]) -> TryStartCommand {
    command.fingerprint = Fingerprint::parse(fingerprint.to_vec()).expect("fingerprint");
    command
}

pub fn with_attempt(mut command: TryStartCommand, attempt: &str) -> TryStartCommand {
    command.attempt_id = AttemptId::parse(attempt.into()).expect("attempt id");
    command
}

pub fn with_lease(mut command: TryStartCommand, lease: Duration) -> TryStartCommand {
    command.lease_ttl = LeaseTtl::parse(lease).expect("lease");
    command
}

pub fn token(value: i64) -> LeaseToken {
    LeaseToken::parse(u64::try_from(value).expect("positive")).expect("token")
}

pub fn complete(name: &str, lease_token: LeaseToken, response: &[u8]) -> CompleteCommand {
    CompleteCommand {
        namespace: scope(NAMESPACE),
        key: key(name),
        lease_token,
        response: ResponseBody::parse(response.to_vec(), 1 << 20).expect("response"),
        retention: None,
    }
}

pub fn release(name: &str, lease_token: LeaseToken) -> ReleaseCommand {
    ReleaseCommand {
        namespace: scope(NAMESPACE),
        key: key(name),
        lease_token,
    }
}

pub fn extend(name: &str, lease_token: LeaseToken, lease: Duration) -> ExtendLeaseCommand {
    ExtendLeaseCommand {
        namespace: scope(NAMESPACE),
        key: key(name),
        lease_token,
        lease_ttl: LeaseTtl::parse(lease).expect("lease"),
        checkpoint: None,
    }
}

pub fn lookup(name: &str) -> LookupQuery {
    LookupQuery {
        namespace: scope(NAMESPACE),
        key: key(name),
    }
}

pub fn mark(consumer: &str, ids: &[&str]) -> MarkProcessedCommand {
    MarkProcessedCommand {
        consumer: scope(consumer),
        event_ids: ids
            .iter()
            .map(|id| EventId::parse((*id).into()).expect("event id"))
            .collect(),
        retention: EventRetention::parse(Duration::from_secs(3600)).expect("retention"),
    }
}

/// Waits until the database clock has passed `instant`.
pub async fn until_database_clock_passes(
    database: &TestDatabase,
    instant: chrono::DateTime<chrono::Utc>,
) {
    crate::support::eventually(
        Duration::from_secs(10),
        "the database clock passes",
        || async { database.now().await > instant },
    )
    .await;
}
