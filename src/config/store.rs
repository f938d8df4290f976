//! The store's flags (shared by `serve` and `migrate`): where it is, its pool, the operation
//! timeout, and what stands between the service and PostgreSQL.

use std::time::Duration;

use clap::Args;
use idempotency_settings::{Bounds, SettingError, parse_duration};

use crate::store::postgres::CredentialFiles;
use crate::store::{Pooler, StoreLocation, StoreSettings};
use crate::telemetry::LogFormat;

#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// The store: postgres://user@host:5432/idempotency for PostgreSQL (shared by replicas; the
    /// database is created if missing and the role may), or sqlite://path for the embedded
    /// store. Without it, the embedded store at --sqlite-path. Several PostgreSQL hosts as
    /// libpq takes them, postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write
    /// (or primary): the service writes to whichever is writable and follows a failover.
    ///
    /// TLS as libpq takes it: sslmode (disable, allow, prefer: the default, require,
    /// verify-ca, verify-full), sslrootcert (a CA file, or system for the operating system's
    /// roots), sslcert and sslkey (a client certificate), e.g.
    /// postgres://app@db.example:5432/idempotency?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        conflicts_with = "database_url_file"
    )]
    pub database_url: Option<String>,

    /// Like --database-url, from a file (a mounted secret): read at start, and again as it
    /// changes for its user and password, which new connections then use (a rotation needs no
    /// restart; other changes do).
    #[arg(long, env = "IDEMPOTENCY_DATABASE_URL_FILE")]
    pub database_url_file: Option<std::path::PathBuf>,

    /// PostgreSQL only: a file holding the password (its whole content less a final line
    /// break), for a URL without one: a Kubernetes secret, an IAM token a sidecar rewrites, a
    /// Vault agent's file. Read again as it changes; new connections use the new password.
    /// Without it, libpq's passfile applies (passfile= in the URL, PGPASSFILE, ~/.pgpass).
    #[arg(long, env = "IDEMPOTENCY_DATABASE_PASSWORD_FILE")]
    pub database_password_file: Option<std::path::PathBuf>,

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
    #[arg(
        long,
        env = "IDEMPOTENCY_NOTIFY_DATABASE_URL",
        hide_env_values = true,
        conflicts_with = "notify_database_url_file"
    )]
    pub notify_database_url: Option<String>,

    /// Like --notify-database-url, from a file (see --database-url-file).
    #[arg(long, env = "IDEMPOTENCY_NOTIFY_DATABASE_URL_FILE")]
    pub notify_database_url_file: Option<std::path::PathBuf>,

    /// The password of --notify-database-url, from a file (see --database-password-file).
    #[arg(long, env = "IDEMPOTENCY_NOTIFY_DATABASE_PASSWORD_FILE")]
    pub notify_database_password_file: Option<std::path::PathBuf>,

    /// PostgreSQL only: how long a migration waits for a table lock (a long transaction of
    /// another session on the table) before it is rolled back and tried again later, so that
    /// the calls of replicas serving meanwhile never queue behind it for longer (1ms-1m).
    #[arg(long, env = "IDEMPOTENCY_MIGRATION_LOCK_TIMEOUT", default_value = "20ms",
          value_parser = parse_duration)]
    pub migration_lock_timeout: Duration,

    /// PostgreSQL only: `transaction` when --database-url goes through a pooler in transaction
    /// mode (PgBouncer's pool_mode = transaction): no startup options, each statement in a
    /// transaction of its own with SET LOCAL statement_timeout, no kept prepared statements.
    /// Needs --notify-database-url and --no-migrate (migrate through a direct URL).
    #[arg(long, env = "IDEMPOTENCY_POOLER", value_enum, default_value_t = Pooler::None)]
    pub pooler: Pooler,

    /// With --pooler transaction: the server connections the pooler gives this replica (its
    /// pool for this database and user, e.g. PgBouncer's default_pool_size, divided among the
    /// replicas that share it). A statement waiting for a held key keeps one of them, so the
    /// held-key lane is sized from the smaller of this and --pool-size (1-10000; by default 20,
    /// PgBouncer's own default_pool_size).
    #[arg(long, env = "IDEMPOTENCY_POOLER_SERVER_CONNECTIONS",
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub pooler_server_connections: Option<u32>,

    #[command(flatten)]
    pub clusters: super::clusters::ClusterArgs,
}

/// The server connections assumed behind a pooler in transaction mode when
/// --pooler-server-connections is not given: PgBouncer's own default_pool_size.
pub const DEFAULT_POOLER_SERVER_CONNECTIONS: u32 = 20;

#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// PostgreSQL only: once migrated, grant this role exactly the rights `serve` needs (no
    /// DDL, no ownership), so the service can run as it; run as the role that owns the schema
    /// (docs/operations.md, "Two roles").
    #[arg(long, env = "IDEMPOTENCY_GRANT_TO", value_parser = role_name)]
    pub grant_to: Option<String>,
}

/// A role name for --grant-to: PostgreSQL's identifier length, no control characters.
fn role_name(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 63 {
        return Err("a role name of 1 to 63 bytes".into());
    }
    if text.chars().any(char::is_control) {
        return Err("a role name without control characters".into());
    }
    Ok(text.to_owned())
}

/// The operation timeout's bounds: below 100 ms, its shares (10 ms of queue, 35 ms for a
/// connection) are shorter than a commit on a busy disk; above 10 minutes, a call could outlive
/// any orchestrator's patience, and a statement hold its row locks that long.
const OPERATION_TIMEOUT: Bounds = Bounds::new(Duration::from_millis(100), Duration::from_secs(600));

/// The migration lock timeout's bounds: under a millisecond a migration could not take a lock
/// even on an idle table; over a minute the calls it holds up would have failed long before.
const MIGRATION_LOCK_TIMEOUT: Bounds =
    Bounds::new(Duration::from_millis(1), Duration::from_secs(60));

impl DatabaseArgs {
    pub fn store_settings(&self) -> Result<StoreSettings, SettingError> {
        let database_url = url_from_file(
            "database-url-file",
            self.database_url_file.as_deref(),
            &self.database_url,
        )?;
        let notify_database_url = url_from_file(
            "notify-database-url-file",
            self.notify_database_url_file.as_deref(),
            &self.notify_database_url,
        )?;
        let clustered = self.clusters.location(&super::clusters::SingleUrlFlags {
            notify_url: notify_database_url.is_some(),
            transaction_pooler: self.pooler == Pooler::Transaction,
            password_file: self.database_password_file.is_some()
                || self.notify_database_password_file.is_some(),
        })?;
        let location = match (clustered, &database_url) {
            (Some(clusters), _) => clusters,
            (None, Some(url)) => {
                let location = StoreLocation::from_url(url).map_err(|problem| SettingError {
                    flag: "database-url",
                    problem,
                })?;
                if let StoreLocation::Postgres { url } = &location {
                    check_postgres_url("database-url", url)?;
                }
                location
            }
            (None, None) => StoreLocation::Sqlite {
                path: self.sqlite_path.clone(),
            },
        };
        let notify_url = match (&notify_database_url, &location) {
            (None, _) => None,
            (Some(url), StoreLocation::Postgres { .. } | StoreLocation::Clusters { .. }) => {
                match StoreLocation::from_url(url) {
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
                }
            }
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
        if self.pooler != Pooler::Transaction && self.pooler_server_connections.is_some() {
            return Err(SettingError {
                flag: "pooler-server-connections",
                problem: "applies with --pooler transaction only: without a pooler, the \
                          statements run at once are --pool-size's"
                    .into(),
            });
        }
        let postgres = !matches!(location, StoreLocation::Sqlite { .. });
        let credentials = credential_files(
            postgres,
            (
                "database-password-file",
                self.database_password_file.as_ref(),
            ),
            self.database_url_file.as_ref(),
            database_url.as_deref(),
        )?;
        let notify_credentials = credential_files(
            postgres,
            (
                "notify-database-password-file",
                self.notify_database_password_file.as_ref(),
            ),
            self.notify_database_url_file.as_ref(),
            notify_url.as_deref(),
        )?;
        Ok(StoreSettings {
            location,
            credentials,
            notify_credentials,
            migration_lock_timeout: MIGRATION_LOCK_TIMEOUT
                .check_setting("migration-lock-timeout", self.migration_lock_timeout)?,
            pool_size: self.pool_size,
            concurrent_statements: match self.pooler {
                Pooler::None => self.pool_size,
                Pooler::Transaction => self.pool_size.min(
                    self.pooler_server_connections
                        .unwrap_or(DEFAULT_POOLER_SERVER_CONNECTIONS),
                ),
            },
            operation_timeout: OPERATION_TIMEOUT
                .check_setting("operation-timeout", self.operation_timeout)?,
            notify_url,
            pooler: self.pooler,
            require_synchronous_standby: self.require_synchronous_standby,
        })
    }
}

/// The URL of `flag`'s file when one is named (read now: the store needs its hosts to start),
/// else `url`.
fn url_from_file(
    flag: &'static str,
    file: Option<&std::path::Path>,
    url: &Option<String>,
) -> Result<Option<String>, SettingError> {
    match file {
        None => Ok(url.clone()),
        Some(path) => crate::store::postgres::credentials::read_secret(path, &format!("--{flag}"))
            .map(Some)
            .map_err(|problem| SettingError { flag, problem }),
    }
}

/// Where a PostgreSQL URL's login may come from besides the URL: its password file, or the URL
/// file itself. A password in both the URL and a password file is refused (which one wins
/// would be a guess); either file with the embedded store too.
fn credential_files(
    postgres: bool,
    (flag, password_file): (&'static str, Option<&std::path::PathBuf>),
    url_file: Option<&std::path::PathBuf>,
    url: Option<&str>,
) -> Result<CredentialFiles, SettingError> {
    if password_file.is_none() {
        return Ok(CredentialFiles {
            url_file: url_file.cloned(),
            password_file: None,
        });
    }
    if !postgres {
        return Err(SettingError {
            flag,
            problem: "applies to PostgreSQL only".into(),
        });
    }
    let url_has_password = url
        .and_then(|url| crate::store::postgres::credentials::login_of_url(url).ok())
        .is_some_and(|(login, _)| login.password.is_some());
    if url_has_password {
        return Err(SettingError {
            flag,
            problem: "the URL gives a password already; keep the password in one place (take it                       out of the URL)"
                .into(),
        });
    }
    Ok(CredentialFiles {
        url_file: url_file.cloned(),
        password_file: password_file.cloned(),
    })
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
        let settings = self.database.store_settings()?;
        if self.grant_to.is_some() && matches!(settings.location, StoreLocation::Sqlite { .. }) {
            return Err(SettingError {
                flag: "grant-to",
                problem: "applies to PostgreSQL only: the embedded store has no roles".into(),
            });
        }
        Ok(settings)
    }
}

/// Why migrations are refused with `--pooler transaction`.
pub(super) const MIGRATE_THROUGH_POOLER: &str = "transaction cannot migrate: migrations need a session \
    (an advisory lock, prepared statements) that a pooler in transaction mode does not keep; \
    run `idempotency-coordinator migrate` with --database-url pointing at PostgreSQL directly \
    (without --pooler), and serve with --no-migrate";
