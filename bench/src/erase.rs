//! An erasure under load: the admin API erases a namespace of a million keys (in bounded
//! batches, `admin keys erase --all`, the CLI as an operator runs it) while 64 callers keep
//! claiming fresh keys of another namespace; TryStart's throughput during the erasure is
//! compared with its throughput without one, measured before and after in the same run.

use std::time::Instant;

use anyhow::Context;
use sqlx::Connection;

use idempotency_testkit::Binary;
use idempotency_testkit::database::drop_postgres_database;

use crate::load::{self, Report, Workload};
use crate::reaper::StoreKind;

#[derive(Debug, clap::Args)]
pub struct Settings {
    #[arg(long, value_enum, default_value = "postgres")]
    pub store: StoreKind,
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    pub postgres_server: String,
    /// Completed keys in the namespace to erase.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value_t = 64)]
    pub callers: usize,
    /// How long to measure TryStart without an erasure, before it and after it.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub baseline: std::time::Duration,
    /// The erasure's batch size (`--batch-size`; 0: the server's 1000).
    #[arg(long, default_value_t = 0)]
    pub batch_size: u32,
}

async fn insert_completed(url: &str, store: StoreKind, rows: u64) -> anyhow::Result<()> {
    let rows = i64::try_from(rows)?;
    match store {
        StoreKind::Postgres => {
            let mut connection = sqlx::PgConnection::connect(url).await?;
            sqlx::query(
                "INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token, attempt,
                     lease_expires_at, response, completed_at, retention_us, expires_at)
                 SELECT 'tenant', 'order-' || n, '\\x00'::bytea, nextval('lease_token_seq'), 1,
                        now(), '\\x7b7d'::bytea, now(), 86400000000, now() + interval '1 day'
                 FROM generate_series(1, $1) AS n",
            )
            .bind(rows)
            .execute(&mut connection)
            .await?;
            sqlx::query("VACUUM ANALYZE idempotency_keys")
                .execute(&mut connection)
                .await?;
        }
        StoreKind::Sqlite => {
            let mut connection = sqlx::SqliteConnection::connect(url)
                .await
                .context("opening the SQLite file")?;
            sqlx::query(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                 INSERT INTO idempotency_keys (namespace, key, fingerprint, lease_token, attempt,
                     lease_expires_at, response, completed_at, retention_us, expires_at)
                 SELECT 'tenant', 'order-' || i, x'00', 3000000000 + i, 1, 0, x'7b7d', 0,
                        86400000000, 9000000000000000 FROM n",
            )
            .bind(rows)
            .execute(&mut connection)
            .await?;
        }
    }
    Ok(())
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let database = format!("idempotency_bench_erase_{}", std::process::id());
    let sqlite_dir = std::env::temp_dir().join(&database);
    let url = match settings.store {
        StoreKind::Postgres => format!("{}/{database}", settings.postgres_server),
        StoreKind::Sqlite => format!("sqlite://{}", sqlite_dir.join("bench.db").display()),
    };
    let binary = Binary::beside_current_exe()?;
    let coordinator = crate::serving(&binary, &url, &[]).await?;
    let loading = Instant::now();
    insert_completed(&url, settings.store, settings.rows).await?;
    let loaded_in = loading.elapsed();

    let before = load::drive(
        &coordinator.endpoint(),
        Workload::TryStart,
        settings.callers,
        settings.baseline,
    )
    .await?;

    let erasing = Instant::now();
    let batch = settings.batch_size.to_string();
    let mut eraser = binary.command();
    eraser
        .args([
            "admin",
            "--coordinator",
            &coordinator.endpoint(),
            "--output",
            "json",
        ])
        .args(["keys", "erase", "--namespace", "tenant", "--all"])
        .args(["--reason", "benchmark", "--batch-size", &batch])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let erasure = eraser.spawn().context("starting the erasure")?;
    let (during, erased) = {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        let waiting = tokio::spawn(async move {
            let output = erasure.wait_with_output().await;
            let _ = sender.send(());
            output
        });
        let during = load::drive_until(
            &coordinator.endpoint(),
            Workload::TryStart,
            settings.callers,
            async move {
                let _ = receiver.await;
            },
            None,
        )
        .await?;
        (during, waiting.await??)
    };
    let erased_in = erasing.elapsed();
    anyhow::ensure!(
        erased.status.success(),
        "the erasure failed: {}",
        String::from_utf8_lossy(&erased.stderr)
    );
    let after = load::drive(
        &coordinator.endpoint(),
        Workload::TryStart,
        settings.callers,
        settings.baseline,
    )
    .await?;

    coordinator.stop().await?;
    match settings.store {
        StoreKind::Postgres => drop_postgres_database(&settings.postgres_server, &database).await?,
        StoreKind::Sqlite => std::fs::remove_dir_all(&sqlite_dir)?,
    }

    let store = format!("{:?}", settings.store).to_lowercase();
    println!(
        "{} completed keys loaded in {:.1} s; erased in {:.1} s ({:.0} keys/s) by `admin keys \
         erase --all` while serving: {}",
        settings.rows,
        loaded_in.as_secs_f64(),
        erased_in.as_secs_f64(),
        settings.rows as f64 / erased_in.as_secs_f64(),
        String::from_utf8_lossy(&erased.stdout).replace('\n', " ")
    );
    println!("{}", Report::header());
    println!("{}", before.row(&format!("{store}, before")));
    println!("{}", during.row(&format!("{store}, erasing")));
    println!("{}", after.row(&format!("{store}, after")));
    let without = (before.ops_per_second() + after.ops_per_second()) / 2.0;
    println!(
        "TryStart throughput while erasing: {:.0} ops/s, {:.0}% of {:.0} ops/s without (the \
         mean of before and after)",
        during.ops_per_second(),
        100.0 * during.ops_per_second() / without,
        without
    );
    Ok(())
}
