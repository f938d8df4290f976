//! One fresh database per test, on either store, dropped when the test ends; and the few direct
//! looks at its rows that tests need (a clock, expiry times, rows to reap, a lock to hold).
//! These helpers panic on failure, as test helpers do.
//!
//! Here creating and dropping databases; in `inspect` the reads and writes of rows, in `hold`
//! the locks held on keys from outside the service.

mod hold;
mod inspect;

pub use hold::{KeyHold, Stall, signal};

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, SqlitePool};

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

    /// The PostgreSQL pool on this database, for PostgreSQL-only tests.
    pub fn postgres_pool(&self) -> &PgPool {
        match &self.inspector {
            Inspector::Postgres(pool) => pool,
            Inspector::Sqlite(_) => panic!("not a PostgreSQL database"),
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
