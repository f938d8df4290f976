//! Reaper under load: a backlog of expired keys is deleted in bounded batches while TryStart
//! keeps serving; TryStart's latency while the reaper works is compared with its latency
//! without a backlog, in one run.

use std::time::{Duration, Instant};

use idempotency_testkit::Binary;

use crate::load::{self, Report, Workload};
use crate::scratch::{Direct, ScratchStore, StoreArgs};

#[derive(Debug, clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub store: StoreArgs,
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

/// The backlog, loaded and watched as it shrinks through the direct connection.
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
    let store = ScratchStore::new(&settings.store, "reaper");
    let interval = humantime::format_duration(settings.interval).to_string();
    let batch = settings.batch_size.to_string();
    let coordinator = crate::serving(
        &Binary::beside_current_exe()?,
        &store.url,
        &[
            "--reaper-interval",
            &interval,
            "--reaper-batch-size",
            &batch,
        ],
    )
    .await?;
    let mut direct = store.connect().await?;

    let without =
        load::try_starts_for(&coordinator.endpoint(), settings.callers, settings.baseline).await?;

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
    let label = store.label();
    store.remove().await?;

    println!(
        "{} expired keys loaded in {:.1} s; reaper: batches of {}, every {}",
        settings.rows,
        loaded_in.as_secs_f64(),
        settings.batch_size,
        interval
    );
    println!("{}", Report::header());
    println!("{}", without.row(&format!("{label}, no backlog")));
    println!("{}", during.row(&format!("{label}, reaping")));
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
