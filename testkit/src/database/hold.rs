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
                self.hold_rows(
                    "SELECT 1 FROM idempotency_keys WHERE key = ANY($1) FOR UPDATE",
                    keys,
                )
                .await
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

    /// PostgreSQL only: holds processed events (by id, in any consumer) from outside the
    /// service, in one transaction, so that a MarkProcessed of any of them waits.
    pub async fn hold_events(&self, ids: &[&str]) -> KeyHold {
        let Place::Postgres { .. } = &self.place else {
            panic!("only PostgreSQL holds one event's row");
        };
        self.hold_rows(
            "SELECT 1 FROM processed_events WHERE event_id = ANY($1) FOR UPDATE",
            ids,
        )
        .await
    }

    /// PostgreSQL: the rows `lock` (a `SELECT … FOR UPDATE` of `names`, bound as `$1`) locks,
    /// held in a transaction of its own until the hold ends.
    async fn hold_rows(&self, lock: &'static str, names: &[&str]) -> KeyHold {
        let mut connection = PgConnection::connect(&self.url).await.expect("connect");
        sqlx::query("BEGIN")
            .execute(&mut connection)
            .await
            .expect("begin");
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        sqlx::query(lock)
            .bind(&names)
            .execute(&mut connection)
            .await
            .expect("lock the rows");
        KeyHold::Postgres(connection)
    }

    /// PostgreSQL only: how many sessions have been opened on this database so far.
    pub async fn sessions_opened(&self) -> i64 {
        self.postgres_count(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()",
        )
        .await
    }

    /// PostgreSQL only: the process id of a backend of the service's that has waited for a lock
    /// in this database for a while (100 ms: longer than the service's first, brief wait for a
    /// row, so that it is the statement that waits for the lock on its own, and will still be
    /// waiting when the caller acts on it), if one does.
    pub async fn waiting_service_backend(&self) -> Option<i32> {
        let Inspector::Postgres(pool) = &self.inspector else {
            panic!("only PostgreSQL shows its waiting backends");
        };
        sqlx::query_as::<_, (i32,)>(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name = 'idempotency-coordinator'
               AND wait_event_type = 'Lock'
               AND clock_timestamp() - query_start > interval '100 milliseconds'
             LIMIT 1",
        )
        .fetch_optional(pool)
        .await
        .expect("read pg_stat_activity")
        .map(|(pid,)| pid)
    }

    /// PostgreSQL statements of the service that are waiting for a lock.
    pub async fn blocked_postgres_statements(&self) -> i64 {
        self.postgres_count(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name = 'idempotency-coordinator'
               AND wait_event_type = 'Lock'",
        )
        .await
    }

    /// How many of the service's statements have waited for a row lock for longer than its
    /// first, brief wait (20 ms; here 200 ms): statements run patiently, in the held-key lane,
    /// which run to their end whether or not their caller stays.
    pub async fn patiently_blocked_postgres_statements(&self) -> i64 {
        self.postgres_count(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database()
               AND application_name = 'idempotency-coordinator'
               AND wait_event_type = 'Lock'
               AND clock_timestamp() - query_start > interval '200 milliseconds'",
        )
        .await
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
        Self::Postgres(connection).finish("COMMIT", None).await;
        u64::try_from(token).expect("tokens are positive")
    }

    /// SQLite only: within the held write transaction, claims `key` as another process would
    /// (a token drawn from the store's sequence), releases it again (the row deleted), and
    /// commits. Answers the token it drew.
    pub async fn claim_released_meanwhile_and_commit(self, key: &str) -> i64 {
        let Self::Sqlite(mut connection) = self else {
            panic!("only the SQLite hold claims through the write lock");
        };
        let (token,): (i64,) = sqlx::query_as(
            "UPDATE lease_token_seq SET last_value = last_value + 1 WHERE only_row = 1
             RETURNING last_value",
        )
        .fetch_one(&mut connection)
        .await
        .expect("draw a token");
        Self::Sqlite(connection).delete_and_commit(key).await;
        token
    }

    /// Ends the held transaction with `end`, deleting `delete` in it first if given.
    async fn finish(self, end: &'static str, delete: Option<&str>) {
        // The same statements on either store's connection type, the DELETE in its placeholder
        // style.
        macro_rules! finish_on {
            ($connection:ident, $delete_sql:literal) => {{
                if let Some(key) = delete {
                    sqlx::query($delete_sql)
                        .bind(key)
                        .execute(&mut $connection)
                        .await
                        .expect("delete the key");
                }
                sqlx::query(end)
                    .execute(&mut $connection)
                    .await
                    .expect("end the transaction");
            }};
        }
        match self {
            Self::Postgres(mut connection) => {
                finish_on!(connection, "DELETE FROM idempotency_keys WHERE key = $1")
            }
            Self::Sqlite(mut connection) => {
                finish_on!(connection, "DELETE FROM idempotency_keys WHERE key = ?1")
            }
        }
    }
}

impl TestDatabase {
    /// Stalls the service's writes without a lock the service could tell from a held key: on
    /// PostgreSQL its idle sessions on this database are stopped (SIGSTOP; idle, so that none is
    /// stopped inside a statement, holding a lock others would wait for), as a database that
    /// stops answering (a disk that hangs) would to the next statement sent on them; on SQLite the write lock is held,
    /// which stalls every write the same way. Until [`Stall::end`] (or the stall is dropped).
    /// The service must already have a connection open (any call made before does), or its
    /// next statement would open a new session, which nothing stops.
    pub async fn stall_writes(&self) -> Stall {
        match &self.inspector {
            Inspector::Postgres(pool) => {
                let pids: Vec<(i32,)> = sqlx::query_as(
                    "SELECT pid FROM pg_stat_activity
                     WHERE datname = current_database()
                       AND application_name LIKE 'idempotency-coordinator%'
                       AND state = 'idle'",
                )
                .fetch_all(pool)
                .await
                .expect("read pg_stat_activity");
                assert!(!pids.is_empty(), "the service has no session to stall");
                let stopped = pids
                    .into_iter()
                    .map(|(pid,)| {
                        assert!(signal("STOP", pid), "SIGSTOP to backend {pid}");
                        pid
                    })
                    .collect();
                Stall {
                    stopped,
                    held: None,
                }
            }
            Inspector::Sqlite(_) => Stall {
                stopped: Vec::new(),
                held: Some(self.hold_keys(&[]).await),
            },
        }
    }
}

/// The service's writes stalled from outside (see [`TestDatabase::stall_writes`]).
pub struct Stall {
    /// PostgreSQL: the stopped backends, continued when the stall ends or is dropped, whatever
    /// happens: a backend left stopped would keep the test's database from being dropped.
    stopped: Vec<i32>,
    /// SQLite: the write lock held.
    held: Option<KeyHold>,
}

impl Stall {
    /// Lets the stalled writes go on.
    pub async fn end(mut self) {
        if let Some(hold) = self.held.take() {
            hold.release().await;
        }
        // The stopped backends are continued as `self` is dropped.
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        for pid in self.stopped.drain(..) {
            if !signal("CONT", pid) {
                eprintln!("could not SIGCONT backend {pid}");
            }
        }
    }
}

/// Sends SIG`name` to `pid` (a backend runs as another user; the tests run as root).
pub fn signal(name: &str, pid: i32) -> bool {
    std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|status| status.success())
}
