//! Direct looks at a test database's rows: the store's clock, row counts, instants and columns
//! of keys and events, and the expired rows a reaper test starts from.

use chrono::{DateTime, Utc};
use sqlx::AssertSqlSafe;

use super::{Inspector, TestDatabase};

/// SQLite's clock as the embedded store reads it, in microseconds.
const SQLITE_NOW_US: &str = "CAST(round(unixepoch('subsec') * 1000) AS INTEGER) * 1000";

/// Runs a statement that changes rows, written once per store (each in its own SQL and
/// placeholder style), with the same arguments bound in the same order; panics with `$what`.
macro_rules! change_rows {
    ($inspector:expr, $what:literal, postgres: $postgres:expr, sqlite: $sqlite:expr,
     binding: ($($argument:expr),+)) => {
        match $inspector {
            Inspector::Postgres(pool) => {
                sqlx::query($postgres)$(.bind($argument))+.execute(pool).await.map(drop)
            }
            Inspector::Sqlite(pool) => {
                sqlx::query($sqlite)$(.bind($argument))+.execute(pool).await.map(drop)
            }
        }
        .expect($what)
    };
}

fn micros_to_instant(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(micros).expect("a stored instant in range")
}

impl TestDatabase {
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
            "admin_audit_events" => "SELECT count(*) FROM admin_audit_events",
            "idempotency_replicas" => "SELECT count(*) FROM idempotency_replicas",
            other => panic!("unknown table {other}"),
        };
        let (count,): (i64,) = match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query_as(sql).fetch_one(pool).await,
            Inspector::Sqlite(pool) => sqlx::query_as(sql).fetch_one(pool).await,
        }
        .expect("count rows");
        count
    }

    /// Runs one statement of the test's own (changing rows from outside the service).
    pub async fn execute(&self, statement: &'static str) {
        match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query(statement).execute(pool).await.map(drop),
            Inspector::Sqlite(pool) => sqlx::query(statement).execute(pool).await.map(drop),
        }
        .expect("run the statement");
    }

    /// Rows of both tables whose retention is over by the store's clock but that are still
    /// there (the reaper has not deleted them yet).
    pub async fn count_expired_rows(&self) -> i64 {
        let (count,): (i64,) = match &self.inspector {
            Inspector::Postgres(pool) => {
                sqlx::query_as(
                    "SELECT (SELECT count(*) FROM idempotency_keys WHERE expires_at <= now()) \
                          + (SELECT count(*) FROM processed_events WHERE expires_at <= now())",
                )
                .fetch_one(pool)
                .await
            }
            Inspector::Sqlite(pool) => {
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT (SELECT count(*) FROM idempotency_keys WHERE expires_at <= {SQLITE_NOW_US}) \
                          + (SELECT count(*) FROM processed_events WHERE expires_at <= {SQLITE_NOW_US})"
                )))
                .fetch_one(pool)
                .await
            }
        }
        .expect("count expired rows");
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
        let sql = |placeholder| {
            AssertSqlSafe(format!(
                "SELECT {column} FROM idempotency_keys WHERE key = {placeholder}"
            ))
        };
        let (value,): (T,) = match &self.inspector {
            Inspector::Postgres(pool) => sqlx::query_as(sql("$1")).bind(key).fetch_one(pool).await,
            Inspector::Sqlite(pool) => sqlx::query_as(sql("?1")).bind(key).fetch_one(pool).await,
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
        change_rows!(
            &self.inspector,
            "extend the event",
            postgres: "UPDATE processed_events SET expires_at = now() + interval '1 hour'
                     WHERE event_id = $1",
            sqlite: AssertSqlSafe(format!(
                "UPDATE processed_events SET expires_at = {SQLITE_NOW_US} + 3600000000
                     WHERE event_id = ?1"
            )),
            binding: (event_id)
        );
    }

    /// Inserts `count` keys (`<prefix>1` …) whose retention ended an hour ago.
    pub async fn insert_expired_keys(&self, prefix: &str, count: i64) {
        change_rows!(
            &self.inspector,
            "insert expired keys",
            postgres: "INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token,
                         attempt, lease_expires_at, retention_us, expires_at)
                     SELECT 'reap', $1 || n, '', nextval('lease_token_seq'), 1,
                            now() - interval '2 hours', 1000000, now() - interval '1 hour'
                     FROM generate_series(1, $2) AS n",
            sqlite: AssertSqlSafe(format!(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2)
                     INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token,
                         attempt, lease_expires_at, retention_us, expires_at)
                     SELECT 'reap', ?1 || i, x'', 1000000000 + i, 1,
                            {SQLITE_NOW_US} - 7200000000, 1000000, {SQLITE_NOW_US} - 3600000000
                     FROM n"
            )),
            binding: (prefix, count)
        );
    }

    /// Inserts `count` events (`evt-1` …, consumer `reap`) whose retention ended an hour ago.
    pub async fn insert_expired_events(&self, count: i64) {
        change_rows!(
            &self.inspector,
            "insert expired events",
            postgres: "INSERT INTO processed_events (consumer, event_id, processed_at, expires_at,
                         mark_batch)
                     SELECT 'reap', 'evt-' || n, now() - interval '2 hours',
                            now() - interval '1 hour', 0
                     FROM generate_series(1, $1) AS n",
            sqlite: AssertSqlSafe(format!(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                     INSERT INTO processed_events (consumer, event_id, processed_at, expires_at)
                     SELECT 'reap', 'evt-' || i, {SQLITE_NOW_US} - 7200000000,
                            {SQLITE_NOW_US} - 3600000000
                     FROM n"
            )),
            binding: (count)
        );
    }

    /// PostgreSQL only: how many sequential scans (reads of a whole table) the database has
    /// counted on the service's two tables. A backend publishes its counts when it exits, so
    /// read this once the sessions that matter have ended ([`Self::service_sessions`]).
    pub async fn sequential_scans(&self) -> i64 {
        self.postgres_count(
            "SELECT coalesce(sum(seq_scan), 0)::bigint FROM pg_stat_user_tables
             WHERE relname IN ('idempotency_keys', 'processed_events')",
        )
        .await
    }

    /// PostgreSQL only: the service's sessions connected to this database now (a backend
    /// publishes its statistics before it leaves `pg_stat_activity`).
    pub async fn service_sessions(&self) -> i64 {
        self.postgres_count(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name LIKE 'idempotency-coordinator%'",
        )
        .await
    }

    /// PostgreSQL only: the one number `sql` answers, read from the server's statistics.
    pub(super) async fn postgres_count(&self, sql: &'static str) -> i64 {
        let Inspector::Postgres(pool) = &self.inspector else {
            panic!("only PostgreSQL keeps these statistics: {sql}");
        };
        let (count,): (i64,) = sqlx::query_as(sql)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
        count
    }
}
