//! An erasure under load: the admin API erases a namespace of a million keys (in bounded
//! batches, `admin keys erase --all`, the CLI as an operator runs it) while 64 callers keep
//! claiming fresh keys of another namespace; TryStart's throughput during the erasure is
//! compared with its throughput without one, measured before and after in the same run.

use std::time::Instant;

use anyhow::Context;

use idempotency_testkit::Binary;

use crate::load::{self, Report, Workload};
use crate::scratch::{Direct, ScratchStore, StoreArgs};

#[derive(Debug, clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub store: StoreArgs,
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

async fn insert_completed(store: &ScratchStore, rows: u64) -> anyhow::Result<()> {
    let rows = i64::try_from(rows)?;
    match store.connect().await? {
        Direct::Postgres(mut connection) => {
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
        Direct::Sqlite(mut connection) => {
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
    let store = ScratchStore::new(&settings.store, "erase");
    let binary = Binary::beside_current_exe()?;
    let coordinator = crate::serving(&binary, &store.url, &[]).await?;
    let loading = Instant::now();
    insert_completed(&store, settings.rows).await?;
    let loaded_in = loading.elapsed();

    let before =
        load::try_starts_for(&coordinator.endpoint(), settings.callers, settings.baseline).await?;

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
    let after =
        load::try_starts_for(&coordinator.endpoint(), settings.callers, settings.baseline).await?;

    coordinator.stop().await?;
    let label = store.label();
    store.remove().await?;

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
    println!("{}", before.row(&format!("{label}, before")));
    println!("{}", during.row(&format!("{label}, erasing")));
    println!("{}", after.row(&format!("{label}, after")));
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
