//! The real server, started in-process on port 0 against its own database, and its clients.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use idempotency_coordinator::Application;
use idempotency_coordinator::config::{Cli, Command};
use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_coordinator::service::InFlight;
use idempotency_coordinator::service::waiting::Waiters;
use idempotency_coordinator::startup::StartupError;
use idempotency_coordinator::store::{AnyStore, LockWait, Store};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::database::{Backend, TestDatabase};

pub type Client = IdempotencyServiceClient<Channel>;

/// The pool of every test server unless a test says otherwise.
pub const TEST_POOL_SIZE: u32 = 8;
const TEST_POOL_SIZE_FLAG: &str = "8";

/// Settings every test server gets unless a test overrides them: a small pool, quick health
/// checks, and a reaper that stays out of the way (tests that need it set an interval).
const TEST_DEFAULTS: &[&str] = &[
    "--pool-size",
    TEST_POOL_SIZE_FLAG,
    "--health-check-interval",
    "100ms",
    "--reaper-interval",
    "1h",
    "--shutdown-grace",
    "10s",
];

pub struct TestApp {
    pub addr: SocketAddr,
    /// Where `/metrics` is served, with `--metrics-listen`.
    pub metrics_addr: Option<SocketAddr>,
    pub store: AnyStore,
    /// The calls in flight inside the server.
    in_flight: InFlight,
    waiters: Option<Waiters>,
    shutdown: CancellationToken,
    server: Option<JoinHandle<Result<(), StartupError>>>,
    // Dropped last: the database outlives the server and the pool.
    pub database: TestDatabase,
}

impl TestApp {
    /// A server on `backend` with the default test settings, serving.
    pub async fn spawn(backend: Backend) -> Self {
        Self::spawn_with(backend, &[]).await
    }

    /// A server on `backend` with extra flags (later flags win), serving.
    pub async fn spawn_with(backend: Backend, flags: &[&str]) -> Self {
        let database = TestDatabase::create(backend).await;
        let app = Self::start(database, &database_url_flag(None), flags).await;
        app.wait_for_status(ServingStatus::Serving).await;
        app
    }

    /// Starts a server on `database`, reaching it through `database_url` when given (a proxy),
    /// without waiting for it to become ready.
    pub async fn start_on(
        database: TestDatabase,
        database_url: Option<&str>,
        flags: &[&str],
    ) -> Self {
        Self::start(database, &database_url_flag(database_url), flags).await
    }

    async fn start(database: TestDatabase, url_override: &[String], flags: &[&str]) -> Self {
        let launched = launch(&database.url, url_override, flags).await;
        Self {
            addr: launched.addr,
            metrics_addr: launched.metrics_addr,
            store: launched.store,
            in_flight: launched.in_flight,
            waiters: launched.waiters,
            shutdown: launched.shutdown,
            server: Some(launched.server),
            database,
        }
    }

    /// Another replica of the service on this server's database (in this process), serving.
    /// It stops when dropped; the database stays this server's.
    pub async fn replica(&self, flags: &[&str]) -> Replica {
        let launched = launch(&self.database.url, &[], flags).await;
        let replica = Replica {
            addr: launched.addr,
            shutdown: launched.shutdown,
            _server: launched.server,
        };
        let health = super::health_client(format!("http://{}", replica.addr))
            .await
            .expect("connect to the replica");
        super::eventually(Duration::from_secs(20), "the replica serves", || {
            let mut health = health.clone();
            async move {
                health
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                    .is_ok_and(|answer| answer.into_inner().status() == ServingStatus::Serving)
            }
        })
        .await;
        replica
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn client(&self) -> Client {
        IdempotencyServiceClient::connect(self.endpoint())
            .await
            .expect("connect to the test server")
    }

    pub async fn health(&self) -> HealthClient<Channel> {
        super::health_client(self.endpoint())
            .await
            .expect("connect to the test server")
    }

    /// Waits, through a health Watch stream, until the server reports `wanted`.
    pub async fn wait_for_status(&self, wanted: ServingStatus) {
        let mut health = self.health().await;
        let mut stream = health
            .watch(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("watch health")
            .into_inner();
        let waited = tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(message) = stream.message().await.expect("health stream") {
                if message.status() == wanted {
                    return;
                }
            }
            panic!("health stream ended before {wanted:?}");
        })
        .await;
        assert!(waited.is_ok(), "server did not report {wanted:?} in time");
    }

    /// Starts the shutdown sequence without waiting for it.
    pub fn begin_shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Shuts the server down and answers how its run ended.
    pub async fn stop(&mut self) -> Result<(), StartupError> {
        self.shutdown.cancel();
        let server = self.server.take().expect("server still running");
        server.await.expect("server task did not panic")
    }

    /// The server's store as it runs a call whose key is held: patient, its statement waiting
    /// for a held row (a shared one on the service's path waits only briefly, then its calls
    /// run alone), for at most `budget`.
    pub fn patient_store(&self, budget: Duration) -> AnyStore {
        self.store
            .limited(std::time::Instant::now() + budget, LockWait::Patient)
    }

    /// The store's clock, the only clock leases and retention use.
    pub async fn db_now(&self) -> chrono::DateTime<chrono::Utc> {
        self.database.now().await
    }

    pub async fn count_rows(&self, table: &str) -> i64 {
        self.database.count_rows(table).await
    }

    /// Rows in both tables: the proof that a refused request wrote nothing.
    pub async fn total_rows(&self) -> i64 {
        self.count_rows("idempotency_keys").await + self.count_rows("processed_events").await
    }

    /// How many TryStarts wait for a key's holder now.
    pub fn waiting(&self) -> usize {
        self.waiters.as_ref().map_or(0, Waiters::waiting)
    }

    /// Waits until `count` TryStarts wait for a key's holder.
    pub async fn wait_for_waiters(&self, count: usize) {
        super::eventually(
            Duration::from_secs(10),
            "calls wait for the holder",
            || async { self.waiting() >= count },
        )
        .await;
    }

    /// How many calls the server has yet to finish (see `wait_for_blocked`).
    pub fn calls_in_flight(&self) -> usize {
        self.in_flight.count()
    }

    /// Waits until `count` calls are in flight in the server (in the store, or queued for it).
    pub async fn wait_for_blocked_calls(&self, count: usize) {
        super::eventually(Duration::from_secs(10), "calls are in flight", || async {
            self.calls_in_flight() >= count
        })
        .await;
    }

    /// Waits until `count` calls are in flight in the server, held up in the store by a lock
    /// taken from outside (see `TestDatabase::hold_key`). For PostgreSQL it also waits until
    /// the store shows a statement waiting for that lock.
    pub async fn wait_for_blocked(&self, count: usize) {
        self.wait_for_statements_waiting(count, false).await;
    }

    /// Like [`Self::wait_for_blocked`], until the statement waiting for the lock is one that
    /// runs to its end whoever waits for it (PostgreSQL: it has waited longer than the brief
    /// first wait, so it is the held-key lane's). A call whose caller goes before its statement
    /// starts starts none (reliability.md §11).
    pub async fn wait_for_work_begun(&self, count: usize) {
        self.wait_for_statements_waiting(count, true).await;
    }

    /// `count` calls in flight, and on PostgreSQL a statement waiting for a lock (`patiently`:
    /// for longer than the brief first wait).
    async fn wait_for_statements_waiting(&self, count: usize, patiently: bool) {
        super::eventually(
            Duration::from_secs(10),
            "calls wait for the lock",
            || async {
                self.calls_in_flight() >= count
                    && match self.database.backend {
                        Backend::Sqlite => true,
                        Backend::Postgres if patiently => {
                            self.database.patiently_blocked_postgres_statements().await >= 1
                        }
                        Backend::Postgres => self.database.blocked_postgres_statements().await >= 1,
                    }
            },
        )
        .await;
    }
}

/// A second server on a [`TestApp`]'s database.
pub struct Replica {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    _server: JoinHandle<Result<(), StartupError>>,
}

impl Replica {
    pub async fn client(&self) -> Client {
        IdempotencyServiceClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect to the replica")
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A running `Application`'s handles.
struct Launched {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    store: AnyStore,
    in_flight: InFlight,
    waiters: Option<Waiters>,
    shutdown: CancellationToken,
    server: JoinHandle<Result<(), StartupError>>,
}

/// Builds and runs an `Application` on `database_url` with the test defaults and `flags`.
async fn launch(database_url: &str, url_override: &[String], flags: &[&str]) -> Launched {
    let mut args: Vec<String> = vec![
        "idempotency-coordinator".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    // A server on several clusters is given them instead of one URL.
    if !flags.contains(&"--cluster") {
        args.extend(["--database-url".into(), database_url.to_owned()]);
    }
    args.extend(TEST_DEFAULTS.iter().map(|s| s.to_string()));
    args.extend(url_override.iter().cloned());
    args.extend(flags.iter().map(|s| s.to_string()));
    let Command::Serve(serve) = parse_command(args) else {
        panic!("tests start `serve`");
    };
    let settings = serve.settings().expect("valid settings");
    let app = Application::build(settings)
        .await
        .expect("application builds");
    let shutdown = CancellationToken::new();
    Launched {
        addr: app.local_addr(),
        metrics_addr: app.metrics_addr(),
        store: app.store().clone(),
        in_flight: app.calls_in_flight(),
        waiters: app.waiters(),
        shutdown: shutdown.clone(),
        server: tokio::spawn(app.run_until_stopped(shutdown)),
    }
}

/// A command line of the coordinator binary (its name first), parsed as the binary parses it.
pub fn parse_command(args: Vec<String>) -> Command {
    Cli::try_parse_from(args)
        .expect("valid flags")
        .into_command()
}

fn database_url_flag(url: Option<&str>) -> Vec<String> {
    url.map(|url| vec!["--database-url".to_owned(), url.to_owned()])
        .unwrap_or_default()
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
