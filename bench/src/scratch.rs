//! The store a benchmark of the service's background work (the reaper, an erasure) loads and
//! then removes: a PostgreSQL database of its own, or a SQLite file in a folder of its own,
//! chosen by the same two flags in each, with a direct connection to load it.

use anyhow::Context;
use sqlx::Connection;

use idempotency_testkit::database::drop_postgres_database;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    Postgres,
    Sqlite,
}

/// Which store, and where PostgreSQL is.
#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    #[arg(long, value_enum, default_value = "postgres")]
    pub store: StoreKind,
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    pub postgres_server: String,
}

/// A direct connection to the benchmark's store, to load it (and watch it) beside the service.
pub enum Direct {
    Postgres(sqlx::PgConnection),
    Sqlite(sqlx::SqliteConnection),
}

/// A fresh store named after the benchmark and this process.
pub struct ScratchStore {
    kind: StoreKind,
    postgres_server: String,
    database: String,
    sqlite_dir: std::path::PathBuf,
    /// The service's `--database-url`.
    pub url: String,
}

impl ScratchStore {
    pub fn new(args: &StoreArgs, benchmark: &str) -> Self {
        let database = format!("idempotency_bench_{benchmark}_{}", std::process::id());
        let sqlite_dir = std::env::temp_dir().join(&database);
        let url = match args.store {
            StoreKind::Postgres => format!("{}/{database}", args.postgres_server),
            StoreKind::Sqlite => format!("sqlite://{}", sqlite_dir.join("bench.db").display()),
        };
        Self {
            kind: args.store,
            postgres_server: args.postgres_server.clone(),
            database,
            sqlite_dir,
            url,
        }
    }

    /// How the reports name the store: `postgres` or `sqlite`.
    pub fn label(&self) -> String {
        format!("{:?}", self.kind).to_lowercase()
    }

    /// A connection of its own (the service has created the store by now).
    pub async fn connect(&self) -> anyhow::Result<Direct> {
        Ok(match self.kind {
            StoreKind::Postgres => Direct::Postgres(sqlx::PgConnection::connect(&self.url).await?),
            StoreKind::Sqlite => Direct::Sqlite(
                sqlx::SqliteConnection::connect(&self.url)
                    .await
                    .context("opening the SQLite file")?,
            ),
        })
    }

    /// Drops the database, or removes the SQLite file's folder.
    pub async fn remove(self) -> anyhow::Result<()> {
        match self.kind {
            StoreKind::Postgres => {
                drop_postgres_database(&self.postgres_server, &self.database).await?;
            }
            StoreKind::Sqlite => std::fs::remove_dir_all(&self.sqlite_dir)?,
        }
        Ok(())
    }
}
