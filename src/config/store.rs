//! The store's flags (shared by `serve` and `migrate`): where it is, its pool, the operation
//! timeout, and what stands between the service and PostgreSQL.

use std::time::Duration;

use clap::Args;
use idempotency_settings::{Bounds, SettingError, parse_duration};

use crate::store::{Pooler, StoreLocation, StoreSettings};
use crate::telemetry::LogFormat;

#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// The store: postgres://user@host:5432/idempotency for PostgreSQL (shared by replicas; the
    /// database is created if missing and the role may), or sqlite://path for the embedded
    /// store. Without it, the embedded store at --sqlite-path. Several PostgreSQL hosts as
    /// libpq takes them, postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write
    /// (or primary): the service writes to whichever is writable and follows a failover.
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

    /// PostgreSQL only: report NOT_SERVING while no synchronous standby is attached (or commits
    /// do not wait for one), for deployments that prefer refusing calls to acknowledging keys
    /// a failover could lose. Needs a role that may read pg_stat_replication's sync_state
    /// (pg_monitor); see docs/operations.md, "Highly available PostgreSQL".
    #[arg(long, env = "IDEMPOTENCY_REQUIRE_SYNCHRONOUS_STANDBY")]
    pub require_synchronous_standby: bool,

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

/// The operation timeout's bounds: below 100 ms, its shares (10 ms of queue, 35 ms for a
/// connection) are shorter than a commit on a busy disk; above 10 minutes, a call could outlive
/// any orchestrator's patience, and a statement hold its row locks that long.
const OPERATION_TIMEOUT: Bounds = Bounds::new(Duration::from_millis(100), Duration::from_secs(600));

impl DatabaseArgs {
    pub fn store_settings(&self) -> Result<StoreSettings, SettingError> {
        let location = match &self.database_url {
            Some(url) => {
                let location = StoreLocation::from_url(url).map_err(|problem| SettingError {
                    flag: "database-url",
                    problem,
                })?;
                if let StoreLocation::Postgres { url } = &location {
                    check_postgres_url("database-url", url)?;
                }
                location
            }
            None => StoreLocation::Sqlite {
                path: self.sqlite_path.clone(),
            },
        };
        let notify_url = match (&self.notify_database_url, &location) {
            (None, _) => None,
            (Some(url), StoreLocation::Postgres { .. }) => match StoreLocation::from_url(url) {
                Ok(StoreLocation::Postgres { url }) => {
                    check_postgres_url("notify-database-url", &url)?;
                    Some(url)
                }
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
        if self.require_synchronous_standby && matches!(location, StoreLocation::Sqlite { .. }) {
            return Err(SettingError {
                flag: "require-synchronous-standby",
                problem: "applies to PostgreSQL only: the embedded store has no standby".into(),
            });
        }
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
            operation_timeout: OPERATION_TIMEOUT
                .check_setting("operation-timeout", self.operation_timeout)?,
            notify_url,
            pooler: self.pooler,
            require_synchronous_standby: self.require_synchronous_standby,
        })
    }
}

/// Refuses at start a PostgreSQL URL the store could not use: its hosts, ports and
/// `target_session_attrs` (`store::postgres::hosts`), and whatever else the driver reads.
fn check_postgres_url(flag: &'static str, url: &str) -> Result<(), SettingError> {
    crate::store::postgres::hosts::HostList::parse(url)
        .map(drop)
        .map_err(|problem| SettingError {
            flag,
            problem: problem.to_string(),
        })
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
pub(super) const MIGRATE_THROUGH_POOLER: &str = "transaction cannot migrate: migrations need a session \
    (an advisory lock, prepared statements) that a pooler in transaction mode does not keep; \
    run `idempotency-coordinator migrate` with --database-url pointing at PostgreSQL directly \
    (without --pooler), and serve with --no-migrate";
