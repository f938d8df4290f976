//! One fresh PostgreSQL database per test, dropped when the test ends.

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

/// The server tests create their databases on. `TEST_DATABASE_ADMIN_URL` overrides it.
pub fn admin_url() -> String {
    std::env::var("TEST_DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn url_for(database: &str) -> String {
    let admin = admin_url();
    let base = admin
        .rsplit_once('/')
        .map(|(base, _)| base.to_owned())
        .unwrap_or(admin);
    format!("{base}/{database}")
}

/// Databases of earlier runs that a crashed test left behind are swept after this long.
const STALE_AFTER_SECS: u64 = 3600;

pub struct TestDatabase {
    pub name: String,
    pub url: String,
}

impl TestDatabase {
    /// A name that no other test uses: created-at seconds (for sweeping) and a random suffix.
    pub fn unique_name() -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        format!("idem_test_{now}_{}", &suffix[..12])
    }

    /// A database that does not exist yet (the service is expected to create it).
    pub fn planned() -> Self {
        let name = Self::unique_name();
        Self {
            url: url_for(&name),
            name,
        }
    }

    pub async fn create() -> Self {
        let database = Self::planned();
        let mut admin = PgConnection::connect(&admin_url())
            .await
            .expect("connect to the admin database (is PostgreSQL running?)");
        sweep_stale(&mut admin).await;
        sqlx::query(AssertSqlSafe(format!(
            r#"CREATE DATABASE "{}" TEMPLATE template0 ENCODING 'UTF8'"#,
            database.name
        )))
        .execute(&mut admin)
        .await
        .expect("create the test database");
        database
    }

    /// A small pool on this database, for looking at rows directly. It connects on first use,
    /// so it may be made before the service creates the database.
    pub async fn pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy(&self.url)
            .expect("a valid test database URL")
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

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
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
