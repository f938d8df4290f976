//! One fresh database per test, on either store, dropped when the test ends; and the few direct
//! looks at its rows that tests need (a clock, expiry times, rows to reap, a lock to hold).
//! These helpers panic on failure, as test helpers do.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, SqliteConnection, SqlitePool};

/// The stores every conformance test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// The server tests create their PostgreSQL databases on. `TEST_DATABASE_ADMIN_URL` overrides it.
pub fn admin_url() -> String {
    std::env::var("TEST_DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn postgres_url_for(database: &str) -> String {
    let admin = admin_url();
    let base = admin
        .rsplit_once('/')
        .map(|(base, _)| base.to_owned())
        .unwrap_or(admin);
    format!("{base}/{database}")
}

/// PostgreSQL databases of earlier runs that a crashed test left behind are swept after this.
const STALE_AFTER_SECS: u64 = 3600;

/// SQLite's clock as the embedded store reads it, in microseconds.
const SQLITE_NOW_US: &str = "CAST(round(unixepoch('subsec') * 1000) AS INTEGER) * 1000";

enum Inspector {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

enum Place {
    Postgres {
        name: String,
    },
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
}

pub struct TestDatabase {
    pub backend: Backend,
    /// The URL to give the service.
    pub url: String,
    // Declared before `place`, so that its connections close before the SQLite folder goes.
    inspector: Inspector,
    place: Place,
}

fn micros_to_instant(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros).expect("a stored instant in range")
}

impl TestDatabase {
    /// A name no other test uses: created-at seconds (for sweeping) and a random suffix.
    fn unique_name() -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        format!("idem_test_{now}_{}", &suffix[..12])
    }

    /// A database that does not exist yet (the service is expected to create it: PostgreSQL's
    /// database, or SQLite's file and its folder).
    pub fn planned(backend: Backend) -> Self {
        match backend {
            Backend::Postgres => {
                let name = Self::unique_name();
                let url = postgres_url_for(&name);
                let pool = PgPoolOptions::new()
                    .max_connections(4)
                    .connect_lazy(&url)
                    .expect("a valid test database URL");
                Self {
                    backend,
                    url,
                    place: Place::Postgres { name },
                    inspector: Inspector::Postgres(pool),
                }
            }
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("a temporary folder");
                Self::sqlite_at(dir.path().join("not/yet/there/coordinator.db"), dir)
            }
        }
    }

    fn sqlite_at(path: PathBuf, dir: tempfile::TempDir) -> Self {
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(options);
        Self {
            backend: Backend::Sqlite,
            url: format!("sqlite://{}", path.display()),
            place: Place::Sqlite { _dir: dir, path },
            inspector: Inspector::Sqlite(pool),
        }
    }

    /// An empty database: PostgreSQL's created, SQLite's folder ready (the file is the
    /// service's to create).
    pub async fn create(backend: Backend) -> Self {
        match backend {
            Backend::Postgres => {
                let database = Self::planned(backend);
                let Place::Postgres { name } = &database.place else {
                    unreachable!("a PostgreSQL place");
                };
                let mut admin = PgConnection::connect(&admin_url())
                    .await
                    .expect("connect to the admin database (is PostgreSQL running?)");
                sweep_stale(&mut admin).await;
                sqlx::query(AssertSqlSafe(format!(
                    r#"CREATE DATABASE "{name}" TEMPLATE template0 ENCODING 'UTF8'"#
                )))
                .execute(&mut admin)
                .await
                .expect("create the test database");
                database
            }
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("a temporary folder");
                let path = dir.path().join("coordinator.db");
                Self::sqlite_at(path, dir)
            }
        }
    }

    /// PostgreSQL's database name (PostgreSQL only).
    pub fn postgres_name(&self) -> &str {
        match &self.place {
            Place::Postgres { name } => name,
            Place::Sqlite { .. } => panic!("a SQLite database has no PostgreSQL name"),
        }
    }

    /// SQLite's file (SQLite only).
    pub fn sqlite_path(&self) -> &std::path::Path {
        match &self.place {
            Place::Sqlite { path, .. } => path,
            Place::Postgres { .. } => panic!("a PostgreSQL database has no file"),
        }
    }

    /// The store's clock, the only clock leases and retention use.
    pub async fn now(&self) -> DateTime<Utc> {
        match &self.inspector {
            Inspector::Postgres(pool) => {
                let (now,): (DateTime<Utc>,) = sqlx::query_as("SELECT now()")
                    .fetch_one(pool)
                    .await
                    .expect("read the clock");
                now
            }
            Inspector::Sqlite(pool) => {
                let (now,): (i64,) =
                    sqlx::query_as(AssertSqlSafe(format!("SELECT {SQLITE_NOW_US}")))
                        .fetch_one(pool)
                        .await
                        .expect("read the clock");
                micros_to_instant(now)
            }
        }
    }

    pub async fn count_rows(&self, table: &str) -> i64 {
        let sql = match table {
            "idempotency_keys" => "SELECT count(*) FROM idempotency_keys",
            "processed_events" => "SELECT count(*) FROM processed_events",
            other => panic!("unknown table {other}"),
        };
        let (count,): (i64,) = match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query_as(sql).fetch_one(pool).await,
            Inspector::Sqlite(pool) => sqlx::query_as(sql).fetch_one(pool).await,
        }
        .expect("count rows");
        count
    }

    /// An instant column of one row, or of an aggregate, read from either store.
    async fn instant(
        &self,
        postgres_sql: &'static str,
        sqlite_sql: &'static str,
        arg: &str,
    ) -> DateTime<Utc> {
        match &self.inspector {
            Inspector::Postgres(pool) => {
                let (at,): (DateTime<Utc>,) = sqlx::query_as(postgres_sql)
                    .bind(arg)
                    .fetch_one(pool)
                    .await
                    .expect("read an instant");
                at
            }
            Inspector::Sqlite(pool) => {
                let (at,): (i64,) = sqlx::query_as(sqlite_sql)
                    .bind(arg)
                    .fetch_one(pool)
                    .await
                    .expect("read an instant");
                micros_to_instant(at)
            }
        }
    }

    pub async fn key_expires_at(&self, key: &str) -> DateTime<Utc> {
        self.instant(
            "SELECT expires_at FROM idempotency_keys WHERE key = $1",
            "SELECT expires_at FROM idempotency_keys WHERE key = ?1",
            key,
        )
        .await
    }

    /// The latest expiry of any key.
    pub async fn latest_key_expiry(&self) -> DateTime<Utc> {
        self.instant(
            "SELECT max(expires_at) FROM idempotency_keys WHERE $1 = $1",
            "SELECT max(expires_at) FROM idempotency_keys WHERE ?1 = ?1",
            "",
        )
        .await
    }

    /// The latest lease expiry of any key.
    pub async fn latest_lease_expiry(&self) -> DateTime<Utc> {
        self.instant(
            "SELECT max(lease_expires_at) FROM idempotency_keys WHERE $1 = $1",
            "SELECT max(lease_expires_at) FROM idempotency_keys WHERE ?1 = ?1",
            "",
        )
        .await
    }

    pub async fn event_processed_at(&self, event_id: &str) -> DateTime<Utc> {
        self.instant(
            "SELECT processed_at FROM processed_events WHERE event_id = $1",
            "SELECT processed_at FROM processed_events WHERE event_id = ?1",
            event_id,
        )
        .await
    }

    pub async fn event_expires_at(&self, event_id: &str) -> DateTime<Utc> {
        self.instant(
            "SELECT expires_at FROM processed_events WHERE event_id = $1",
            "SELECT expires_at FROM processed_events WHERE event_id = ?1",
            event_id,
        )
        .await
    }

    /// One column of one key's row, the same query in each store's placeholder style.
    async fn key_column<T>(&self, column: &str, key: &str) -> T
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres>
            + sqlx::Type<sqlx::Postgres>
            + for<'r> sqlx::Decode<'r, sqlx::Sqlite>
            + sqlx::Type<sqlx::Sqlite>
            + Send
            + Unpin,
    {
        let (value,): (T,) = match &self.inspector {
            Inspector::Postgres(pool) => {
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT {column} FROM idempotency_keys WHERE key = $1"
                )))
                .bind(key)
                .fetch_one(pool)
                .await
            }
            Inspector::Sqlite(pool) => {
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT {column} FROM idempotency_keys WHERE key = ?1"
                )))
                .bind(key)
                .fetch_one(pool)
                .await
            }
        }
        .unwrap_or_else(|error| panic!("read {column} of {key}: {error}"));
        value
    }

    pub async fn key_lease_token(&self, key: &str) -> u64 {
        let token: i64 = self.key_column("lease_token", key).await;
        u64::try_from(token).expect("positive token")
    }

    pub async fn key_checkpoint(&self, key: &str) -> Option<Vec<u8>> {
        self.key_column("checkpoint", key).await
    }

    /// The keys of `namespace` that are completed, in the store as it is (expired or not).
    pub async fn completed_keys(&self, namespace: &str) -> std::collections::BTreeSet<String> {
        let rows: Vec<(String,)> = match &self.inspector {
            Inspector::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT key FROM idempotency_keys
                     WHERE namespace = $1 AND completed_at IS NOT NULL",
                )
                .bind(namespace)
                .fetch_all(pool)
                .await
            }
            Inspector::Sqlite(pool) => {
                sqlx::query_as(
                    "SELECT key FROM idempotency_keys
                     WHERE namespace = ?1 AND completed_at IS NOT NULL",
                )
                .bind(namespace)
                .fetch_all(pool)
                .await
            }
        }
        .expect("read completed keys");
        rows.into_iter().map(|(key,)| key).collect()
    }

    /// Keeps `event_id` for another hour from now.
    pub async fn keep_event_for_an_hour(&self, event_id: &str) {
        match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query(
                "UPDATE processed_events SET expires_at = now() + interval '1 hour'
                     WHERE event_id = $1",
            )
            .bind(event_id)
            .execute(pool)
            .await
            .map(drop),
            Inspector::Sqlite(pool) => sqlx::query(AssertSqlSafe(format!(
                "UPDATE processed_events SET expires_at = {SQLITE_NOW_US} + 3600000000
                     WHERE event_id = ?1"
            )))
            .bind(event_id)
            .execute(pool)
            .await
            .map(drop),
        }
        .expect("extend the event");
    }

    /// Inserts `count` keys (`<prefix>1` …) whose retention ended an hour ago.
    pub async fn insert_expired_keys(&self, prefix: &str, count: i64) {
        match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query(
                "INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token,
                         attempt, lease_expires_at, retention_us, expires_at)
                     SELECT 'reap', $1 || n, '', nextval('lease_token_seq'), 1,
                            now() - interval '2 hours', 1000000, now() - interval '1 hour'
                     FROM generate_series(1, $2) AS n",
            )
            .bind(prefix)
            .bind(count)
            .execute(pool)
            .await
            .map(drop),
            Inspector::Sqlite(pool) => sqlx::query(AssertSqlSafe(format!(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2)
                     INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token,
                         attempt, lease_expires_at, retention_us, expires_at)
                     SELECT 'reap', ?1 || i, x'', 1000000000 + i, 1,
                            {SQLITE_NOW_US} - 7200000000, 1000000, {SQLITE_NOW_US} - 3600000000
                     FROM n"
            )))
            .bind(prefix)
            .bind(count)
            .execute(pool)
            .await
            .map(drop),
        }
        .expect("insert expired keys");
    }

    /// Inserts `count` events (`evt-1` …, consumer `reap`) whose retention ended an hour ago.
    pub async fn insert_expired_events(&self, count: i64) {
        match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query(
                "INSERT INTO processed_events (consumer, event_id, processed_at, expires_at,
                         mark_batch)
                     SELECT 'reap', 'evt-' || n, now() - interval '2 hours',
                            now() - interval '1 hour', 0
                     FROM generate_series(1, $1) AS n",
            )
            .bind(count)
            .execute(pool)
            .await
            .map(drop),
            Inspector::Sqlite(pool) => sqlx::query(AssertSqlSafe(format!(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                     INSERT INTO processed_events (consumer, event_id, processed_at, expires_at)
                     SELECT 'reap', 'evt-' || i, {SQLITE_NOW_US} - 7200000000,
                            {SQLITE_NOW_US} - 3600000000
                     FROM n"
            )))
            .bind(count)
            .execute(pool)
            .await
            .map(drop),
        }
        .expect("insert expired events");
    }

    /// Holds `key` from outside the service so that the service's writes to it wait: a
    /// PostgreSQL row lock, or SQLite's write lock (which holds every write, SQLite having one
    /// writer).
    pub async fn hold_key(&self, key: &str) -> KeyHold {
        self.hold_keys(&[key]).await
    }

    /// Holds several keys at once, in one transaction (see [`Self::hold_key`]).
    pub async fn hold_keys(&self, keys: &[&str]) -> KeyHold {
        match &self.place {
            Place::Postgres { .. } => {
                let mut connection = PgConnection::connect(&self.url).await.expect("connect");
                sqlx::query("BEGIN")
                    .execute(&mut connection)
                    .await
                    .expect("begin");
                let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
                sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = ANY($1) FOR UPDATE")
                    .bind(&keys)
                    .execute(&mut connection)
                    .await
                    .expect("lock the keys");
                KeyHold::Postgres(connection)
            }
            Place::Sqlite { path, .. } => {
                let options = SqliteConnectOptions::new()
                    .filename(path)
                    .busy_timeout(Duration::from_secs(10));
                let mut connection = SqliteConnection::connect_with(&options)
                    .await
                    .expect("open the file");
                sqlx::query("BEGIN IMMEDIATE")
                    .execute(&mut connection)
                    .await
                    .expect("take the write lock");
                KeyHold::Sqlite(connection)
            }
        }
    }

    /// PostgreSQL statements of the service that are waiting for a lock.
    pub async fn blocked_postgres_statements(&self) -> i64 {
        let Inspector::Postgres(pool) = &self.inspector else {
            panic!("only PostgreSQL shows its waiting statements");
        };
        let (blocked,): (i64,) = sqlx::query_as(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name = 'idempotency-coordinator'
               AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .expect("read pg_stat_activity");
        blocked
    }

    /// The PostgreSQL pool on this database, for PostgreSQL-only tests.
    pub fn postgres_pool(&self) -> &PgPool {
        match &self.inspector {
            Inspector::Postgres(pool) => pool,
            Inspector::Sqlite(_) => panic!("not a PostgreSQL database"),
        }
    }
}

/// A lock held on a key from outside the service.
pub enum KeyHold {
    Postgres(PgConnection),
    Sqlite(SqliteConnection),
}

impl KeyHold {
    /// Lets the service's waiting writes go ahead, changing nothing.
    pub async fn release(self) {
        self.finish("ROLLBACK", None).await;
    }

    /// Deletes `key` while holding it and commits, as a reaper would.
    pub async fn delete_and_commit(self, key: &str) {
        self.finish("COMMIT", Some(key)).await;
    }

    /// PostgreSQL only: claims `key` anew inside the held transaction, as another replica's
    /// TryStart would (a token drawn now, the attempt counted), with a lease that has already
    /// run out, and commits. Answers the token it drew.
    pub async fn claim_with_expired_lease_and_commit(self, key: &str) -> u64 {
        let Self::Postgres(mut connection) = self else {
            panic!("only PostgreSQL lets another transaction claim a key meanwhile");
        };
        let (token,): (i64,) = sqlx::query_as(
            "UPDATE idempotency_keys
             SET lease_token = nextval('lease_token_seq'), attempt = attempt + 1,
                 attempt_id = 'another-replica', lease_expires_at = clock_timestamp()
             WHERE key = $1
             RETURNING lease_token",
        )
        .bind(key)
        .fetch_one(&mut connection)
        .await
        .expect("claim the key");
        sqlx::query("COMMIT")
            .execute(&mut connection)
            .await
            .expect("commit");
        u64::try_from(token).expect("tokens are positive")
    }

    async fn finish(self, end: &'static str, delete: Option<&str>) {
        match self {
            Self::Postgres(mut connection) => {
                if let Some(key) = delete {
                    sqlx::query("DELETE FROM idempotency_keys WHERE key = $1")
                        .bind(key)
                        .execute(&mut connection)
                        .await
                        .expect("delete the key");
                }
                sqlx::query(end)
                    .execute(&mut connection)
                    .await
                    .expect("end the transaction");
            }
            Self::Sqlite(mut connection) => {
                if let Some(key) = delete {
                    sqlx::query("DELETE FROM idempotency_keys WHERE key = ?1")
                        .bind(key)
                        .execute(&mut connection)
                        .await
                        .expect("delete the key");
                }
                sqlx::query(end)
                    .execute(&mut connection)
                    .await
                    .expect("end the transaction");
            }
        }
    }
}

async fn sweep_stale(admin: &mut PgConnection) {
    let names: Vec<(String,)> =
        sqlx::query_as("SELECT datname FROM pg_database WHERE datname LIKE 'idem_test_%'")
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    for (name,) in names {
        let created: Option<u64> = name
            .strip_prefix("idem_test_")
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse().ok());
        if created.is_some_and(|created| now.saturating_sub(created) > STALE_AFTER_SECS) {
            let _ = sqlx::query(AssertSqlSafe(format!(
                r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
            )))
            .execute(&mut *admin)
            .await;
        }
    }
}

/// Drops a PostgreSQL database on the server of `server_url` (a URL without a database name,
/// e.g. `postgres://postgres@127.0.0.1:5432`), for tools that made one of their own.
pub async fn drop_postgres_database(server_url: &str, database: &str) -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(&format!("{server_url}/postgres")).await?;
    sqlx::query(AssertSqlSafe(format!(
        r#"DROP DATABASE IF EXISTS "{database}" WITH (FORCE)"#
    )))
    .execute(&mut admin)
    .await?;
    Ok(())
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Place::Postgres { name } = &self.place else {
            return; // the temporary folder removes itself
        };
        let name = name.clone();
        // Drop runs inside the test's runtime, which cannot be blocked on; a thread with its own
        // small runtime does the work and is joined.
        let dropper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for dropping the test database");
            runtime.block_on(async move {
                if let Ok(mut admin) = PgConnection::connect(&admin_url()).await {
                    let _ = sqlx::query(AssertSqlSafe(format!(
                        r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#
                    )))
                    .execute(&mut admin)
                    .await;
                }
            });
        });
        let _ = dropper.join();
    }
}
