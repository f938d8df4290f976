//! An erasure under load: the admin API erases a namespace of a million keys (in bounded
//! batches, `admin keys erase --all`, the CLI as an operator runs it) while 64 callers keep
//! claiming fresh keys of another namespace; TryStart's throughput during the erasure is
//! compared with its throughput without one, measured before and after in the same run.

use std::time::Instant;

use idempotency_testkit::Binary;

use crate::completed;
use crate::load::{self, Report};
use crate::scratch::{ScratchStore, StoreArgs};

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
    /// The erasure's batch size (`--batch-size`, 1-10000).
    #[arg(long, default_value_t = 1000)]
    pub batch_size: u32,
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let store = ScratchStore::new(&settings.store, "erase");
    let binary = Binary::beside_current_exe()?;
    let coordinator = crate::serving(&binary, &store.url, &[]).await?;
    let loading = Instant::now();
    completed::insert(&store, settings.rows).await?;
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
        .args(["keys", "erase", "--namespace", "tenant", "--all", "--yes"])
        .args(["--reason", "benchmark", "--batch-size", &batch]);
    let (during, erased) = load::try_starts_while(
        &coordinator.endpoint(),
        settings.callers,
        eraser,
        "the erasure",
    )
    .await?;
    let erased_in = erasing.elapsed();
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
