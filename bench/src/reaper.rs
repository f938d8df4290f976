//! Reaper under load: a backlog of expired keys is deleted in bounded batches while TryStart
//! keeps serving; TryStart's latency while the reaper works is compared with its latency
//! without a backlog, in one run.

use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::Connection;

use idempotency_testkit::Binary;
use idempotency_testkit::database::drop_postgres_database;

use crate::load::{self, Report, Workload};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    Postgres,
    Sqlite,
}

#[derive(Debug, clap::Args)]
pub struct Settings {
    #[arg(long, value_enum, default_value = "postgres")]
    pub store: StoreKind,
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    pub postgres_server: String,
    /// Expired keys in the backlog.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value_t = 16)]
    pub callers: usize,
    /// How long to measure TryStart without a backlog.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub baseline: Duration,
    #[arg(long, default_value_t = 1000)]
    pub batch_size: u32,
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
}

/// A direct connection to the benchmark's store, to load the backlog and watch it shrink.
enum Direct {
    Postgres(sqlx::PgConnection),
    Sqlite(sqlx::SqliteConnection),
}

impl Direct {
    async fn insert_expired(&mut self, rows: u64) -> anyhow::Result<()> {
        let rows = i64::try_from(rows)?;
        match self {
            Self::Postgres(connection) => {
                sqlx::query(
                    "INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token,
                         attempt, lease_expires_at, retention_us, expires_at)
                     SELECT 'reap', 'old-' || n, '', nextval('lease_token_seq'), 1,
                            now() - interval '2 hours', 1000000,
                            now() - interval '1 hour'
                     FROM generate_series(1, $1) AS n",
                )
                .bind(rows)
                .execute(connection)
                .await?;
            }
            Self::Sqlite(connection) => {
                sqlx::query(
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                     INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token,
                         attempt, lease_expires_at, retention_us, expires_at)
                     SELECT 'reap', 'old-' || i, x'', 2000000000 + i, 1, 0, 1000000, 1 FROM n",
                )
                .bind(rows)
                .execute(connection)
                .await?;
            }
        }
        Ok(())
    }

    /// Whether any expired key is left (through the `expires_at` index: cheap).
    async fn backlog_left(&mut self) -> anyhow::Result<bool> {
        let (left,): (bool,) = match self {
            Self::Postgres(connection) => {
                sqlx::query_as(
                    "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE expires_at <= now())",
                )
                .fetch_one(connection)
                .await?
            }
            Self::Sqlite(connection) => {
                sqlx::query_as(
                    "SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE expires_at <= 1)",
                )
                .fetch_one(connection)
                .await?
            }
        };
        Ok(left)
    }
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let database = format!("idempotency_bench_reaper_{}", std::process::id());
    let sqlite_dir = std::env::temp_dir().join(&database);
    let url = match settings.store {
        StoreKind::Postgres => format!("{}/{database}", settings.postgres_server),
        StoreKind::Sqlite => format!("sqlite://{}", sqlite_dir.join("bench.db").display()),
    };
    let interval = humantime::format_duration(settings.interval).to_string();
    let batch = settings.batch_size.to_string();
    let coordinator = crate::serving(
        &Binary::beside_current_exe()?,
        &url,
        &[
            "--reaper-interval",
            &interval,
            "--reaper-batch-size",
            &batch,
        ],
    )
    .await?;
    let mut direct = match settings.store {
        StoreKind::Postgres => Direct::Postgres(sqlx::PgConnection::connect(&url).await?),
        StoreKind::Sqlite => Direct::Sqlite(
            sqlx::SqliteConnection::connect(&url)
                .await
                .context("opening the SQLite file")?,
        ),
    };

    let without = load::drive(
        &coordinator.endpoint(),
        Workload::TryStart,
        settings.callers,
        settings.baseline,
    )
    .await?;

    let loading = Instant::now();
    direct.insert_expired(settings.rows).await?;
    let loaded_in = loading.elapsed();
    let reaping = Instant::now();
    let mut watcher = direct;
    let during = load::drive_until(
        &coordinator.endpoint(),
        Workload::TryStart,
        settings.callers,
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if !watcher.backlog_left().await.unwrap_or(true) {
                    return;
                }
            }
        },
        None,
    )
    .await?;
    let reaped_in = reaping.elapsed();

    coordinator.stop().await?;
    match settings.store {
        StoreKind::Postgres => {
            drop_postgres_database(&settings.postgres_server, &database).await?;
        }
        StoreKind::Sqlite => std::fs::remove_dir_all(&sqlite_dir)?,
    }

    let store = format!("{:?}", settings.store).to_lowercase();
    println!(
        "{} expired keys loaded in {:.1} s; reaper: batches of {}, every {}",
        settings.rows,
        loaded_in.as_secs_f64(),
        settings.batch_size,
        interval
    );
    println!("{}", Report::header());
    println!("{}", without.row(&format!("{store}, no backlog")));
    println!("{}", during.row(&format!("{store}, reaping")));
    println!(
        "reaped {} rows in {:.1} s ({:.0} rows/s) while serving; TryStart p99 {:.2} ms while \
         reaping vs {:.2} ms without (x{:.2})",
        settings.rows,
        reaped_in.as_secs_f64(),
        settings.rows as f64 / reaped_in.as_secs_f64(),
        during.percentile(0.99),
        without.percentile(0.99),
        during.percentile(0.99) / without.percentile(0.99)
    );
    Ok(())
}
