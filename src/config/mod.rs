//! Command line and environment. Every setting is a flag with an environment variable; values
//! are checked here, once, so the rest of the service works with settings it can trust.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::domain::Limits;
use crate::domain::{EventRetention, KeyRetention, LeaseTtl};
use crate::grpc::connections::ConnectionSettings;
use crate::readiness::ReadinessSettings;
use crate::reaper::ReaperSettings;
use crate::store::{Pooler, StoreLocation, StoreSettings};
use crate::telemetry::{LogFormat, TraceSettings};

#[derive(Debug, Parser)]
#[command(
    name = "idempotency-coordinator",
    version,
    about = "Claims idempotency keys, stores and replays results, and deduplicates events over gRPC.",
    args_conflicts_with_subcommands = true,
    args_override_self = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `serve`'s settings, for running without a subcommand.
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the gRPC API (the default).
    Serve(Box<ServeArgs>),
    /// Apply the schema migrations and exit.
    Migrate(MigrateArgs),
    /// Manage callers' bearer tokens.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Exit 0 when the service at --addr answers SERVING to a gRPC health check of
    /// idempotency.v1.IdempotencyService, 1 otherwise (for a container HEALTHCHECK).
    Healthcheck(HealthcheckArgs),
    /// Run the HTTP gateway: a reverse proxy that gives the HTTP API at --upstream
    /// Idempotency-Key semantics, deciding everything through the coordinator at
    /// --coordinator (see docs/gateway.md).
    #[command(args_override_self = true)]
    Gateway(Box<idempotency_gateway::Args>),
}

#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    /// The service's gRPC address (plaintext).
    #[arg(
        long,
        env = "IDEMPOTENCY_HEALTHCHECK_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    pub addr: SocketAddr,

    /// How long connecting and the check may take together (100ms-60s).
    #[arg(long, env = "IDEMPOTENCY_HEALTHCHECK_TIMEOUT", default_value = "5s",
          value_parser = parse_healthcheck_timeout)]
    pub timeout: Duration,
}

fn parse_healthcheck_timeout(text: &str) -> Result<Duration, String> {
    let value = parse_duration(text)?;
    if value < Duration::from_millis(100) || value > Duration::from_secs(60) {
        return Err("must be between 100ms and 60s".into());
    }
    Ok(value)
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a new token: prints the token (give it to the caller; it is shown only here) and
    /// the line to add to the tokens file (which holds only the token's hash).
    New {
        /// A name for the caller, shown in logs: [A-Za-z0-9._-]+.
        #[arg(long)]
        name: String,
        /// The namespaces and consumers it may use: exact names or prefixes ending in *,
        /// separated by commas (e.g. payments-*,billing), or * for all.
        #[arg(long)]
        scopes: String,
    },
}

impl Cli {
    /// The subcommand to run, `serve` when none was given.
    pub fn into_command(self) -> Command {
        self.command
            .unwrap_or_else(|| Command::Serve(Box::new(self.serve)))
    }
}

#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// The store: postgres://user@host:5432/idempotency for PostgreSQL (shared by replicas; the
    /// database is created if missing and the role may), or sqlite://path for the embedded
    /// store. Without it, the embedded store at --sqlite-path.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// The embedded store's file when no --database-url is given; it and its folder are
    /// created if missing. For one instance only.
    #[arg(long, env = "IDEMPOTENCY_SQLITE_PATH", default_value = crate::store::sqlite::DEFAULT_PATH)]
    pub sqlite_path: std::path::PathBuf,

    /// Connections in the pool (for SQLite, readers: it always writes through one).
    #[arg(long, env = "IDEMPOTENCY_POOL_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub pool_size: u32,

    /// Every call answers within it. 35% may go to waiting for a pooled connection, 50% to the
    /// statement (PostgreSQL's statement_timeout, SQLite's busy_timeout); past them a call
    /// fails with UNAVAILABLE / STORE_UNAVAILABLE, and nothing was written (100ms-10m).
    #[arg(long, env = "IDEMPOTENCY_OPERATION_TIMEOUT", default_value = "5s",
          value_parser = parse_duration)]
    pub operation_timeout: Duration,

    /// Log format.
    #[arg(long, env = "IDEMPOTENCY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// PostgreSQL only: where to LISTEN for other replicas' Completes and Releases (which wake
    /// waiting TryStarts), when not --database-url: a direct connection to the same database,
    /// for deployments whose --database-url goes through a pooler in transaction mode.
    #[arg(long, env = "IDEMPOTENCY_NOTIFY_DATABASE_URL", hide_env_values = true)]
    pub notify_database_url: Option<String>,

    /// PostgreSQL only: `transaction` when --database-url goes through a pooler in transaction
    /// mode (PgBouncer's pool_mode = transaction): no startup options, each statement in a
    /// transaction of its own with SET LOCAL statement_timeout, no kept prepared statements.
    /// Needs --notify-database-url and --no-migrate (migrate through a direct URL).
    #[arg(long, env = "IDEMPOTENCY_POOLER", value_enum, default_value_t = Pooler::None)]
    pub pooler: Pooler,
}

#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Address to listen on. Port 0 picks a free port (the log says which).
    #[arg(long, env = "IDEMPOTENCY_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,

    /// Do not apply migrations at start; stay NOT_SERVING until someone runs `migrate`.
    #[arg(long, env = "IDEMPOTENCY_NO_MIGRATE")]
    pub no_migrate: bool,

    /// Lease when TryStart or ExtendLease gives none (100ms-24h).
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_LEASE_TTL", default_value = "30s",
          value_parser = parse_duration)]
    pub default_lease_ttl: Duration,

    /// Key retention when TryStart gives none (1s-30d).
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_KEY_RETENTION", default_value = "24h",
          value_parser = parse_duration)]
    pub default_key_retention: Duration,

    /// Event retention when MarkProcessed gives none (1s-30d).
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_EVENT_RETENTION", default_value = "7d",
          value_parser = parse_duration)]
    pub default_event_retention: Duration,

    /// Largest response Complete accepts, in bytes (256 KiB-64 MiB). Requests may be this plus
    /// 64 KiB; the floor keeps the largest MarkProcessed batch within that.
    #[arg(long, env = "IDEMPOTENCY_MAX_RESPONSE_BYTES", default_value_t = 1024 * 1024,
          value_parser = clap::value_parser!(u32).range(256 * 1024..=64 * 1024 * 1024))]
    pub max_response_bytes: u32,

    /// Pause between reaper sweeps (10ms-1h).
    #[arg(long, env = "IDEMPOTENCY_REAPER_INTERVAL", default_value = "30s",
          value_parser = parse_duration)]
    pub reaper_interval: Duration,

    /// Rows the reaper deletes per statement.
    #[arg(long, env = "IDEMPOTENCY_REAPER_BATCH_SIZE", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub reaper_batch_size: u32,

    /// How long calls in flight may take to finish after SIGTERM/SIGINT.
    #[arg(long, env = "IDEMPOTENCY_SHUTDOWN_GRACE", default_value = "25s",
          value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Callers of the API must present a bearer token listed in this file (one
    /// `name sha256:<hex> scope,scope*` per line; `token new` makes one). Reloaded on SIGHUP.
    #[arg(long, env = "IDEMPOTENCY_TOKENS_FILE")]
    pub tokens_file: Option<std::path::PathBuf>,

    /// Requests per second one token may make (bursts of as many); off when absent.
    #[arg(long, env = "IDEMPOTENCY_RATE_LIMIT",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_limit: Option<u32>,

    /// Serve TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "IDEMPOTENCY_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "IDEMPOTENCY_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,

    /// Require client certificates signed by this CA (PEM): mutual TLS. Needs --tls-cert.
    #[arg(long, env = "IDEMPOTENCY_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<std::path::PathBuf>,

    /// Serve a non-loopback address with neither tokens nor mTLS, on purpose (e.g. behind a
    /// mesh that authenticates callers). Without it such a start is refused.
    #[arg(long, env = "IDEMPOTENCY_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,

    /// Concurrent calls one connection may have open.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONCURRENT_STREAMS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_concurrent_streams: u32,

    /// Run every TryStart, Complete and MarkProcessed on its own, instead of gathering
    /// concurrent ones into shared statements.
    #[arg(long, env = "IDEMPOTENCY_NO_COALESCE")]
    pub no_coalesce: bool,

    /// Shared statements (TryStart, Complete and MarkProcessed together) that may run at once.
    /// Fewer means bigger batches, fewer commits and more throughput; more means a key held by
    /// a slow transaction delays fewer calls.
    #[arg(long, env = "IDEMPOTENCY_COALESCE_EXECUTORS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub coalesce_executors: u32,

    /// The most calls one shared statement carries (for MarkProcessed, sixteen times as many
    /// event ids).
    #[arg(long, env = "IDEMPOTENCY_COALESCE_MAX_BATCH", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub coalesce_max_batch: u32,

    /// Pause between store checks that drive the health status (100ms-1m); also how old the
    /// replay cache's reading of the database clock may get.
    #[arg(long, env = "IDEMPOTENCY_HEALTH_CHECK_INTERVAL", default_value = "2s",
          value_parser = parse_duration)]
    pub health_check_interval: Duration,

    /// Once listening, write the bound address (e.g. 127.0.0.1:50051) to this file, so that a
    /// supervisor or a test that asked for port 0 learns the port without reading logs. The
    /// file is written aside and renamed into place: a reader never sees half an address.
    #[arg(long, env = "IDEMPOTENCY_ADDRESS_FILE")]
    pub address_file: Option<std::path::PathBuf>,

    /// The most TryStarts that may wait for a key's holder at once (their `wait`); beyond it a
    /// TryStart answers at once, as without `wait`. 0 turns waiting off.
    #[arg(long, env = "IDEMPOTENCY_MAX_WAITERS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub max_waiters: u32,

    /// A waiting TryStart looks at its key again at least this often (100ms-10m), whatever
    /// else wakes it: the last resort should a change notification be lost unnoticed.
    #[arg(long, env = "IDEMPOTENCY_WAITER_RECHECK_INTERVAL", default_value = "5s",
          value_parser = parse_duration)]
    pub waiter_recheck_interval: Duration,

    /// How long a new connection may take to send the HTTP/2 preface (100ms-5m); one that
    /// stays silent longer is closed. (TLS handshakes have their own 10 s bound.)
    #[arg(long, env = "IDEMPOTENCY_CONNECTION_HANDSHAKE_TIMEOUT", default_value = "10s",
          value_parser = parse_duration)]
    pub connection_handshake_timeout: Duration,

    /// A connection with no call open for this long is closed (1s-24h).
    #[arg(long, env = "IDEMPOTENCY_CONNECTION_IDLE_TIMEOUT", default_value = "5m",
          value_parser = parse_duration)]
    pub connection_idle_timeout: Duration,

    /// The most connections open at once (1-1000000); more wait in the kernel's backlog until
    /// one closes. No cap when absent.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONNECTIONS",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: Option<u32>,

    /// A response its client has not taken (read) within this is given up, and its connection
    /// closed (1s-1h).
    #[arg(long, env = "IDEMPOTENCY_RESPONSE_SEND_TIMEOUT", default_value = "30s",
          value_parser = parse_duration)]
    pub response_send_timeout: Duration,

    /// Response bytes produced and not yet taken by their clients, server-wide (1 MiB-64 GiB).
    /// Beyond it, calls that wrote nothing are refused RESOURCE_EXHAUSTED / OVERLOADED.
    #[arg(long, env = "IDEMPOTENCY_MAX_PENDING_RESPONSE_BYTES", default_value_t = 256 * MIB,
          value_parser = clap::value_parser!(u64).range(MIB..=64 * 1024 * MIB))]
    pub max_pending_response_bytes: u64,

    /// The same, per connection (1 MiB-64 GiB, at most --max-pending-response-bytes).
    #[arg(long, env = "IDEMPOTENCY_MAX_CONNECTION_PENDING_RESPONSE_BYTES",
          default_value_t = 32 * MIB,
          value_parser = clap::value_parser!(u64).range(MIB..=64 * 1024 * MIB))]
    pub max_connection_pending_response_bytes: u64,

    /// Health Watch streams open at once, server-wide (1-100000); more are refused
    /// RESOURCE_EXHAUSTED. Health is open to callers without a token, so it is bounded.
    #[arg(long, env = "IDEMPOTENCY_MAX_HEALTH_WATCHERS", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_health_watchers: u32,

    /// Serve Prometheus metrics at GET /metrics on this address (e.g. 127.0.0.1:9464), a port
    /// of its own. Off unless set. Port 0 picks a free port (the log says which).
    #[arg(long, env = "IDEMPOTENCY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Label the service's own per-RPC counters (TryStart outcomes, refusals, events) with the
    /// namespace (the consumer for MarkProcessed). Off by default: each namespace is a series
    /// of its own, and how many there are is the operator's to bound.
    #[arg(
        long,
        env = "IDEMPOTENCY_METRICS_NAMESPACE_LABELS",
        requires = "metrics_listen"
    )]
    pub metrics_namespace_labels: bool,

    /// Export traces over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317 (https:// is
    /// verified against the system's roots). Off unless set; OTEL_EXPORTER_OTLP_ENDPOINT is
    /// used when this is not.
    #[arg(long, env = "IDEMPOTENCY_OTLP_ENDPOINT", value_parser = parse_otlp_endpoint)]
    pub otlp_endpoint: Option<String>,

    /// Bytes of completed records this replica keeps in memory to answer replays (TryStart and
    /// Lookup of a completed key) without the database, until their retention ends by the
    /// database clock (0-64 GiB; 0 turns the cache off). Default 24 MiB.
    #[arg(long, env = "IDEMPOTENCY_REPLAY_CACHE_BYTES",
          default_value_t = crate::service::replay_cache::DEFAULT_CAPACITY_BYTES,
          value_parser = clap::value_parser!(u64)
              .range(0..=crate::service::replay_cache::MAX_CAPACITY_BYTES))]
    pub replay_cache_bytes: u64,
}

/// An OTLP/gRPC endpoint: `http://` or `https://`, a host, a port if not the scheme's, no path.
fn parse_otlp_endpoint(text: &str) -> Result<String, String> {
    let uri: hyper::Uri = text
        .parse()
        .map_err(|error| format!("not a URL ({error}); e.g. http://127.0.0.1:4317"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err("must start with http:// or https://, e.g. http://127.0.0.1:4317".into()),
    }
    match uri.authority() {
        Some(authority) if !authority.host().is_empty() => {}
        _ => return Err("names no host, e.g. http://127.0.0.1:4317".into()),
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err("takes no path: OTLP/gRPC has its own, e.g. http://127.0.0.1:4317".into());
    }
    Ok(text.trim_end_matches('/').to_owned())
}

const MIB: u64 = 1024 * 1024;

/// The operation timeout's bounds: below 100 ms, its shares (10 ms of queue, 35 ms for a
/// connection) are shorter than a commit on a busy disk; above 10 minutes, a call could outlive
/// any orchestrator's patience, and a statement hold its row locks that long.
const MIN_OPERATION_TIMEOUT: Duration = Duration::from_millis(100);
const MAX_OPERATION_TIMEOUT: Duration = Duration::from_secs(600);

/// A duration setting within `[min, max]`, named by its flag when it is not.
fn within(
    flag: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<Duration, SettingError> {
    if value < min || value > max {
        return Err(SettingError {
            flag,
            problem: format!(
                "must be between {} and {} (got {})",
                humantime::format_duration(min),
                humantime::format_duration(max),
                humantime::format_duration(value)
            ),
        });
    }
    Ok(value)
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (examples: 100ms, 30s, 24h, 7d)"))
}

/// A setting that is out of bounds, named by its flag.
#[derive(Debug, thiserror::Error)]
#[error("--{flag}: {problem}")]
pub struct SettingError {
    pub flag: &'static str,
    pub problem: String,
}

/// Files for TLS, checked to come in the combinations that make sense.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub certificate: std::path::PathBuf,
    pub private_key: std::path::PathBuf,
    pub client_ca: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecuritySettings {
    pub tokens_file: Option<std::path::PathBuf>,
    pub rate_limit: Option<u32>,
    pub tls: Option<TlsFiles>,
    pub max_concurrent_streams: u32,
}

/// Everything `serve` needs, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub store: StoreSettings,
    pub limits: Limits,
    pub readiness: ReadinessSettings,
    pub reaper: ReaperSettings,
    pub shutdown_grace: Duration,
    pub operation_timeout: Duration,
    pub security: SecuritySettings,
    /// `None`: every call runs on its own.
    pub coalescing: Option<crate::service::Coalescing>,
    pub waiting: crate::service::waiting::WaitSettings,
    pub connections: ConnectionSettings,
    /// Where `/metrics` is served, when it is.
    pub metrics_listen: Option<SocketAddr>,
    /// Whether the service's own per-RPC counters carry a `namespace` label.
    pub metrics_namespace_labels: bool,
    /// The replay cache's bound in bytes; 0: no cache.
    pub replay_cache_bytes: u64,
}

impl DatabaseArgs {
    pub fn store_settings(&self) -> Result<StoreSettings, SettingError> {
        let location = match &self.database_url {
            Some(url) => StoreLocation::from_url(url).map_err(|problem| SettingError {
                flag: "database-url",
                problem,
            })?,
            None => StoreLocation::Sqlite {
                path: self.sqlite_path.clone(),
            },
        };
        let notify_url = match (&self.notify_database_url, &location) {
            (None, _) => None,
            (Some(url), StoreLocation::Postgres { .. }) => match StoreLocation::from_url(url) {
                Ok(StoreLocation::Postgres { url }) => Some(url),
                _ => {
                    return Err(SettingError {
                        flag: "notify-database-url",
                        problem: "must be a postgres:// URL".into(),
                    });
                }
            },
            (Some(_), StoreLocation::Sqlite { .. }) => {
                return Err(SettingError {
                    flag: "notify-database-url",
                    problem: "applies to PostgreSQL only: the embedded store has one writer, \
                              which wakes its own waiters"
                        .into(),
                });
            }
        };
        if self.pooler == Pooler::Transaction {
            if let StoreLocation::Sqlite { .. } = location {
                return Err(SettingError {
                    flag: "pooler",
                    problem: "applies to PostgreSQL only".into(),
                });
            }
            if notify_url.is_none() {
                return Err(SettingError {
                    flag: "pooler",
                    problem: "transaction needs --notify-database-url: a direct connection to \
                              PostgreSQL on which to LISTEN, which a pooler in transaction mode \
                              cannot hold"
                        .into(),
                });
            }
        }
        Ok(StoreSettings {
            location,
            pool_size: self.pool_size,
            operation_timeout: within(
                "operation-timeout",
                self.operation_timeout,
                MIN_OPERATION_TIMEOUT,
                MAX_OPERATION_TIMEOUT,
            )?,
            notify_url,
            pooler: self.pooler,
        })
    }
}

impl MigrateArgs {
    /// The store to migrate: never through a pooler in transaction mode, whose pooled
    /// connections cannot hold the migrator's session lock or its prepared statements.
    pub fn store_settings(&self) -> Result<StoreSettings, SettingError> {
        if self.database.pooler == Pooler::Transaction {
            return Err(SettingError {
                flag: "pooler",
                problem: MIGRATE_THROUGH_POOLER.into(),
            });
        }
        self.database.store_settings()
    }
}

/// Why migrations are refused with `--pooler transaction`.
const MIGRATE_THROUGH_POOLER: &str = "transaction cannot migrate: migrations need a session \
    (an advisory lock, prepared statements) that a pooler in transaction mode does not keep; \
    run `idempotency-coordinator migrate` with --database-url pointing at PostgreSQL directly \
    (without --pooler), and serve with --no-migrate";

impl ServeArgs {
    fn security(&self) -> Result<SecuritySettings, SettingError> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(certificate), Some(private_key)) => Some(TlsFiles {
                certificate: certificate.clone(),
                private_key: private_key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            (None, None) if self.tls_client_ca.is_some() => {
                return Err(SettingError {
                    flag: "tls-client-ca",
                    problem: "needs --tls-cert and --tls-key: client certificates are checked \
                              in a TLS handshake"
                        .into(),
                });
            }
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(SettingError {
                    flag: "tls-cert",
                    problem: "--tls-cert and --tls-key go together".into(),
                });
            }
        };
        if self.rate_limit.is_some() && self.tokens_file.is_none() {
            return Err(SettingError {
                flag: "rate-limit",
                problem: "needs --tokens-file: the limit is per token".into(),
            });
        }
        let authenticated = self.tokens_file.is_some() || self.tls_client_ca.is_some();
        if !self.listen.ip().is_loopback() && !authenticated && !self.allow_unauthenticated {
            return Err(SettingError {
                flag: "allow-unauthenticated",
                problem: format!(
                    "listening on {} (not loopback) with neither --tokens-file nor \
                     --tls-client-ca would let anyone who can connect read and release other \
                     services' keys; configure one, or pass --allow-unauthenticated if something \
                     in front (a mesh) authenticates callers",
                    self.listen
                ),
            });
        }
        Ok(SecuritySettings {
            tokens_file: self.tokens_file.clone(),
            rate_limit: self.rate_limit,
            tls,
            max_concurrent_streams: self.max_concurrent_streams,
        })
    }

    pub fn settings(&self) -> Result<Settings, SettingError> {
        let invalid = |flag: &'static str| {
            move |problem: crate::domain::Invalid| SettingError {
                flag,
                problem: problem.0,
            }
        };
        let store = self.database.store_settings()?;
        if store.pooler == Pooler::Transaction && !self.no_migrate {
            return Err(SettingError {
                flag: "pooler",
                problem: MIGRATE_THROUGH_POOLER.into(),
            });
        }
        let operation_timeout = store.operation_timeout;
        let limits = Limits {
            default_lease_ttl: LeaseTtl::parse(self.default_lease_ttl)
                .map_err(invalid("default-lease-ttl"))?,
            default_key_retention: KeyRetention::parse(self.default_key_retention)
                .map_err(invalid("default-key-retention"))?,
            default_event_retention: EventRetention::parse(self.default_event_retention)
                .map_err(invalid("default-event-retention"))?,
            max_response_bytes: usize::try_from(self.max_response_bytes).unwrap_or(usize::MAX),
        };
        Ok(Settings {
            listen: self.listen,
            store,
            limits,
            readiness: ReadinessSettings {
                migrate: !self.no_migrate,
                check_interval: within(
                    "health-check-interval",
                    self.health_check_interval,
                    Duration::from_millis(100),
                    Duration::from_secs(60),
                )?,
                check_timeout: operation_timeout,
            },
            reaper: ReaperSettings {
                interval: within(
                    "reaper-interval",
                    self.reaper_interval,
                    Duration::from_millis(10),
                    Duration::from_secs(3600),
                )?,
                batch_size: self.reaper_batch_size,
                batch_timeout: operation_timeout,
                measure_lag: self.metrics_listen.is_some(),
            },
            shutdown_grace: self.shutdown_grace,
            operation_timeout,
            security: self.security()?,
            waiting: crate::service::waiting::WaitSettings {
                max_waiters: self.max_waiters as usize,
                recheck_interval: within(
                    "waiter-recheck-interval",
                    self.waiter_recheck_interval,
                    Duration::from_millis(100),
                    Duration::from_secs(600),
                )?,
            },
            coalescing: (!self.no_coalesce).then_some(crate::service::Coalescing {
                executors: self.coalesce_executors as usize,
                max_batch: self.coalesce_max_batch as usize,
            }),
            connections: self.connections()?,
            metrics_listen: self.metrics_listen,
            metrics_namespace_labels: self.metrics_namespace_labels,
            replay_cache_bytes: self.replay_cache_bytes,
        })
    }

    /// Where spans are exported: `--otlp-endpoint`, else `OTEL_EXPORTER_OTLP_ENDPOINT` (checked
    /// alike), else nowhere.
    pub fn traces(&self) -> Result<Option<TraceSettings>, SettingError> {
        let endpoint = match &self.otlp_endpoint {
            Some(endpoint) => Some(endpoint.clone()),
            None => match std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT") {
                Ok(text) if !text.trim().is_empty() => Some(
                    parse_otlp_endpoint(text.trim()).map_err(|problem| SettingError {
                        flag: "otlp-endpoint",
                        problem: format!("OTEL_EXPORTER_OTLP_ENDPOINT {problem}"),
                    })?,
                ),
                _ => None,
            },
        };
        Ok(endpoint.map(|endpoint| TraceSettings { endpoint }))
    }

    fn connections(&self) -> Result<ConnectionSettings, SettingError> {
        let seconds = Duration::from_secs;
        if self.max_connection_pending_response_bytes > self.max_pending_response_bytes {
            return Err(SettingError {
                flag: "max-connection-pending-response-bytes",
                problem: format!(
                    "must not exceed --max-pending-response-bytes ({})",
                    self.max_pending_response_bytes
                ),
            });
        }
        Ok(ConnectionSettings {
            handshake_timeout: within(
                "connection-handshake-timeout",
                self.connection_handshake_timeout,
                Duration::from_millis(100),
                seconds(5 * 60),
            )?,
            idle_timeout: within(
                "connection-idle-timeout",
                self.connection_idle_timeout,
                seconds(1),
                seconds(24 * 3600),
            )?,
            max_connections: self.max_connections,
            response_send_timeout: within(
                "response-send-timeout",
                self.response_send_timeout,
                seconds(1),
                seconds(3600),
            )?,
            max_pending_response_bytes: self.max_pending_response_bytes,
            max_connection_pending_response_bytes: self.max_connection_pending_response_bytes,
            max_health_watchers: self.max_health_watchers,
        })
    }
}

#[cfg(test)]
mod tests;
