//! `serve`'s flags and the settings they make: the listener, the contract's defaults, the
//! reaper, shutdown, health checks, coalescing, waiting and the replay cache; the groups of
//! `security`, `connections` and `telemetry` are flattened in.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use idempotency_settings::{Bounds, SettingError, parse_duration};

use super::ConnectionSettings;
use super::store::MIGRATE_THROUGH_POOLER;
use super::{ConnectionArgs, DatabaseArgs, SecurityArgs, SecuritySettings, TelemetryArgs};
use crate::domain::{EventRetention, KeyRetention, LeaseTtl, Limits};
use crate::readiness::ReadinessSettings;
use crate::reaper::ReaperSettings;
use crate::store::{Pooler, StoreSettings};

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

    /// Run every TryStart, Complete and MarkProcessed on its own, instead of gathering
    /// concurrent ones into shared statements.
    #[arg(long, env = "IDEMPOTENCY_NO_COALESCE")]
    pub no_coalesce: bool,

    /// Shared statements (TryStart, Complete and MarkProcessed together) that may run at once.
    /// Fewer means bigger batches, fewer commits and more throughput. A key held by another
    /// transaction does not depend on it: its calls leave the shared statements after 20 ms.
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

    /// Bytes of completed records this replica keeps in memory to answer replays (TryStart and
    /// Lookup of a completed key) without the database, until their retention ends by the
    /// database clock (0-64 GiB; 0 turns the cache off). Default 24 MiB.
    #[arg(long, env = "IDEMPOTENCY_REPLAY_CACHE_BYTES",
          default_value_t = crate::service::replay_cache::DEFAULT_CAPACITY_BYTES,
          value_parser = clap::value_parser!(u64)
              .range(0..=crate::service::replay_cache::MAX_CAPACITY_BYTES))]
    pub replay_cache_bytes: u64,

    /// How long the audit trail keeps each admin action (1h-3650d), counted from the action;
    /// the reaper then deletes it.
    #[arg(long, env = "IDEMPOTENCY_AUDIT_RETENTION", default_value = "90d",
          value_parser = parse_duration)]
    pub audit_retention: Duration,

    #[command(flatten)]
    pub security: SecurityArgs,

    #[command(flatten)]
    pub connections: ConnectionArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
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
    /// How long the audit trail keeps an admin action.
    pub audit_retention: Duration,
}

/// The bounds of `serve`'s own duration flags (the contract's defaults are checked by the
/// domain's types, which hold the contract's bounds).
const HEALTH_CHECK_INTERVAL: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(60));
const REAPER_INTERVAL: Bounds = Bounds::new(Duration::from_millis(10), Duration::from_secs(3600));
const WAITER_RECHECK_INTERVAL: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(600));
/// An hour at least (a shorter trail would be gone before anyone reads it), ten years at most.
pub(super) const AUDIT_RETENTION: Bounds = Bounds::new(
    Duration::from_secs(3600),
    Duration::from_secs(3650 * 24 * 3600),
);

/// The fewest statements PostgreSQL must run at once for this replica for a held key to delay
/// only its own callers: one for the held keys' lane, one for the calls of failed shared
/// statements run again alone, and two for everyone else (docs/reliability.md §11).
pub const FEWEST_CONCURRENT_STATEMENTS: u32 = 4;

/// Refuses a PostgreSQL store that cannot run [`FEWEST_CONCURRENT_STATEMENTS`] at once, naming
/// the flag that limits it.
fn check_room_for_held_keys(store: &crate::store::StoreSettings) -> Result<(), SettingError> {
    let postgres = !matches!(store.location, crate::store::StoreLocation::Sqlite { .. });
    if !postgres || store.concurrent_statements >= FEWEST_CONCURRENT_STATEMENTS {
        return Ok(());
    }
    let limited_by_pooler = store.concurrent_statements < store.pool_size;
    let (flag, what) = if limited_by_pooler {
        ("pooler-server-connections", "server connections")
    } else {
        ("pool-size", "connections")
    };
    Err(SettingError::new(
        flag,
        format!(
            "{} {what} leave no room for held keys: a key another transaction holds keeps a \
             connection while its callers wait, and the other calls need theirs; PostgreSQL \
             needs at least {FEWEST_CONCURRENT_STATEMENTS} (docs/reliability.md §11)",
            store.concurrent_statements
        ),
    ))
}

impl ServeArgs {
    /// Every setting checked, alone and together.
    pub fn settings(&self) -> Result<Settings, SettingError> {
        let invalid = |flag: &'static str| {
            move |problem: crate::domain::Invalid| SettingError::new(flag, problem.0)
        };
        let store = self.database.store_settings()?;
        if store.pooler == Pooler::Transaction && !self.no_migrate {
            return Err(SettingError::new("pooler", MIGRATE_THROUGH_POOLER));
        }
        check_room_for_held_keys(&store)?;
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
                check_interval: HEALTH_CHECK_INTERVAL
                    .check_setting("health-check-interval", self.health_check_interval)?,
                check_timeout: operation_timeout,
            },
            reaper: ReaperSettings {
                interval: REAPER_INTERVAL.check_setting("reaper-interval", self.reaper_interval)?,
                batch_size: self.reaper_batch_size,
                batch_timeout: operation_timeout,
                measure_lag: self.telemetry.metrics_listen.is_some(),
            },
            shutdown_grace: self.shutdown_grace,
            operation_timeout,
            security: self.security.settings(self.listen)?,
            waiting: crate::service::waiting::WaitSettings {
                max_waiters: self.max_waiters as usize,
                recheck_interval: WAITER_RECHECK_INTERVAL
                    .check_setting("waiter-recheck-interval", self.waiter_recheck_interval)?,
            },
            coalescing: (!self.no_coalesce).then_some(crate::service::Coalescing {
                executors: self.coalesce_executors as usize,
                max_batch: self.coalesce_max_batch as usize,
            }),
            connections: self.connections.settings()?,
            metrics_listen: self.telemetry.metrics_listen,
            metrics_namespace_labels: self.telemetry.metrics_namespace_labels,
            replay_cache_bytes: self.replay_cache_bytes,
            audit_retention: AUDIT_RETENTION
                .check_setting("audit-retention", self.audit_retention)?,
        })
    }

    /// Where spans are exported (see [`TelemetryArgs::traces`]).
    pub fn traces(&self) -> Result<Option<crate::telemetry::TraceSettings>, SettingError> {
        self.telemetry.traces()
    }
}
