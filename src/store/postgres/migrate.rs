//! Applying the schema's migrations without stalling the calls of the replicas that serve
//! meanwhile, and without rights a serving role does not need.
//!
//! - **Nothing to do, nothing asked.** When every migration of this build is applied (with the
//!   same checksum), no DDL runs and no lock is taken: a restricted role (`serve` without
//!   `CREATE`) starts on a migrated schema, and a release that runs on a newer schema (rolled
//!   back) starts too. Newer migrations this build does not know are ignored for the same
//!   reason (expand, then contract a release later: docs/operations.md, "Upgrades").
//! - **No stall behind a long transaction.** A migration's `ALTER TABLE` waits for every
//!   transaction that has touched the table, and every statement that arrives meanwhile queues
//!   behind the `ALTER`: one transaction left open would stall every call. So the migrating
//!   session waits at most `--migration-lock-timeout` for a lock; a migration that waited
//!   longer is rolled back whole, the sessions that held it up are logged, and it is tried
//!   again after a growing pause, until it is applied. Every migration must therefore run in
//!   its transaction: a `-- no-transaction` one (`CREATE INDEX CONCURRENTLY`) cut short by the
//!   lock timeout would leave its work half done (an invalid index) and be recorded as applied
//!   by the next try. None is; a new one needs its own retry written for it.

use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::MigrateError;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection};

use super::primary::Shape;
use super::{MIGRATOR, PgStore, connect, privileges};
use crate::store::{StoreError, schema};

/// The pause before a migration held up by a lock is tried again, at first and at most; each
/// pause is drawn between half and all of its step, so replicas do not retry in step.
const LOCK_RETRY: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(5));

impl PgStore {
    /// Applies the migrations this build carries that the database lacks; `grant_to`: then
    /// grants that role the rights `serve` needs (`migrate --grant-to`).
    pub(super) async fn migrate_schema(&self, grant_to: Option<&str>) -> Result<(), StoreError> {
        if let Some(problem) = self.follower.files_problem() {
            return Err(StoreError::Unreachable(problem));
        }
        self.locate().await.map_err(StoreError::Unreachable)?;
        let named: Shape = Arc::new(|options: PgConnectOptions| {
            options
                .application_name("idempotency-coordinator migrate")
                .disable_statement_logging()
        });
        let mut connection = match self.connect_directly(&named).await {
            // A database that does not exist yet is created, so a first start needs nothing by
            // hand; where the role may not create databases, that is what is reported.
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("3D000") => {
                let options = self.migration_options();
                connect::create_database(&options)
                    .await
                    .map_err(|error| self.describe_failure(&error))?;
                tracing::info!(
                    database = options.get_database().unwrap_or_default(),
                    "created the database"
                );
                self.connect_directly(&named)
                    .await
                    .map_err(|error| self.describe_failure(&error))?
            }
            connected => connected.map_err(|error| self.describe_failure(&error))?,
        };
        let migrated = self.migrate_on(&mut connection).await;
        let granted = match (&migrated, grant_to) {
            (Ok(()), Some(role)) => privileges::grant(&mut connection, role).await,
            _ => Ok(()),
        };
        let _ = connection.close().await;
        migrated?;
        granted
    }

    /// The migrations on `connection`, each waiting at most the lock timeout for a lock and
    /// tried again until applied.
    async fn migrate_on(&self, connection: &mut PgConnection) -> Result<(), StoreError> {
        let lock_timeout_ms = self.migration_lock_timeout.as_millis().max(1);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SET lock_timeout = {lock_timeout_ms}; SET statement_timeout = 0"
        )))
        .execute(&mut *connection)
        .await
        .map_err(super::error::classify)?;
        if up_to_date(connection).await? {
            tracing::debug!("the schema is up to date; no migration to apply");
            return Ok(());
        }
        let mut pause = LOCK_RETRY.0;
        let mut reported: Option<String> = None;
        loop {
            // `run_direct` is `run` on a connection rather than a pool or an `Acquire`, whose
            // future is not `Send` for every lifetime (sqlx's own workaround, public though
            // hidden from its docs).
            let run = MIGRATOR.run_direct(None, &mut *connection, false).await;
            let refused = match &run {
                // A statement of a migration (`ExecuteMigration`), or the migrator's own (its
                // session lock, its table: `Execute`).
                Err(
                    MigrateError::Execute(sqlx::Error::Database(db))
                    | MigrateError::ExecuteMigration(sqlx::Error::Database(db), _),
                ) => db
                    .code()
                    .map(|code| (code.into_owned(), db.message().to_owned())),
                _ => None,
            };
            match (run, refused) {
                (Ok(()), _) => return Ok(()),
                (Err(_), Some((code, _))) if code == "55P03" => {
                    // Rolled back; the migrator's session lock may still be held by this
                    // session, and is let go before the next try.
                    let _ = sqlx::query("SELECT pg_advisory_unlock_all()")
                        .execute(&mut *connection)
                        .await;
                    let holders = lock_holders(connection).await;
                    if reported.as_deref() == Some(holders.as_str()) {
                        tracing::debug!(%holders, "a migration still waits for a lock");
                    } else {
                        tracing::warn!(%holders, lock_timeout = ?self.migration_lock_timeout,
                            "a migration waited for a lock held by another session; it was \
                             rolled back and will be tried again (the calls do not wait behind \
                             it)");
                        reported = Some(holders);
                    }
                    tokio::time::sleep(jittered(pause)).await;
                    pause = (pause * 2).min(LOCK_RETRY.1);
                }
                (Err(_), Some((code, message))) if code == "42501" => {
                    return Err(StoreError::Unready(format!(
                        "the schema needs migrating and the role may not: {message} (run \
                         `idempotency-coordinator migrate` as the migrating role, then serve; \
                         docs/operations.md, \"Two roles\")"
                    )));
                }
                (Err(error), _) => {
                    return Err(schema::migration_error(error, super::error::classify));
                }
            }
        }
    }

    /// `error`, met connecting directly to the current host, as the store's failure.
    pub(super) fn describe_failure(&self, error: &sqlx::Error) -> StoreError {
        StoreError::Unreachable(self.follower.describe(self.follower.index(), error))
    }
}

/// Whether every migration of this build is applied, with the same checksum (read without a
/// lock or DDL: `_sqlx_migrations` may not exist yet).
async fn up_to_date(connection: &mut PgConnection) -> Result<bool, StoreError> {
    let exists: (bool,) = sqlx::query_as("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *connection)
        .await
        .map_err(super::error::classify)?;
    if !exists.0 {
        return Ok(false);
    }
    let applied: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations WHERE success")
            .fetch_all(&mut *connection)
            .await
            .map_err(super::error::classify)?;
    Ok(MIGRATOR
        .iter()
        .filter(|migration| !migration.migration_type.is_down_migration())
        .all(|migration| {
            applied.iter().any(|(version, checksum)| {
                *version == migration.version && checksum.as_slice() == &*migration.checksum
            })
        }))
}

/// The sessions in a transaction open for over a second that hold a lock on one of the schema's
/// tables, oldest first, for the log: `pid 4242 (psql, idle in transaction for 8s)`. Another role's session shows
/// only its pid unless this role may read all statistics (`pg_read_all_stats`).
async fn lock_holders(connection: &mut PgConnection) -> String {
    let holders: Result<Vec<LockHolder>, _> = sqlx::query_as(
        "SELECT a.pid, nullif(a.application_name, ''), a.state, \
                    extract(epoch FROM now() - a.xact_start)::float8 \
             FROM pg_stat_activity AS a \
             WHERE a.pid <> pg_backend_pid() \
               AND a.xact_start < clock_timestamp() - interval '1 second' AND EXISTS ( \
                 SELECT 1 FROM pg_locks AS l JOIN pg_class AS c ON c.oid = l.relation \
                 WHERE l.pid = a.pid AND l.granted \
                   AND c.relnamespace = current_schema()::regnamespace) \
             ORDER BY a.xact_start NULLS LAST LIMIT 3",
    )
    .fetch_all(&mut *connection)
    .await;
    match holders {
        Ok(holders) if !holders.is_empty() => holders
            .into_iter()
            .map(|(pid, application, state, age)| {
                let mut about = Vec::new();
                if let Some(application) = application {
                    about.push(application);
                }
                match (state, age) {
                    (Some(state), Some(age)) => about.push(format!("{state} for {age:.0}s")),
                    (Some(state), None) => about.push(state),
                    _ => {}
                }
                if about.is_empty() {
                    format!("pid {pid}")
                } else {
                    format!("pid {pid} ({})", about.join(", "))
                }
            })
            .collect::<Vec<_>>()
            .join("; "),
        // The calls of the replicas serving meanwhile hold their locks for milliseconds: only
        // a transaction open for over a second is named.
        Ok(_) => "short transactions only (the calls of the replicas serving now)".to_owned(),
        Err(error) => format!("unknown ({error})"),
    }
}

/// A session holding a lock: its pid, application, state and transaction's age in seconds.
type LockHolder = (i32, Option<String>, Option<String>, Option<f64>);

/// `step`, less a random share of up to half of it.
fn jittered(step: Duration) -> Duration {
    let mut byte = [0u8; 1];
    let share = match getrandom::fill(&mut byte) {
        Ok(()) => f64::from(byte[0]) / 255.0,
        Err(_) => 0.5,
    };
    step.mul_f64(1.0 - share / 2.0)
}
