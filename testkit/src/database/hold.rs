//! Keys held from outside the service, so that its writes to them wait: a row lock on
//! PostgreSQL, the write lock on SQLite; and what the held transaction may do before it ends.

use std::time::Duration;

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Connection, PgConnection, SqliteConnection};

use super::{Inspector, Place, TestDatabase};

impl TestDatabase {
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
