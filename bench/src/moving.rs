//! A namespace moved between two PostgreSQL clusters under load (`admin placement move`, the
//! CLI as an operator runs it): a namespace of `--rows` completed keys on cluster a moves to
//! cluster b while callers keep claiming fresh keys in it, and others claim fresh keys of
//! another namespace on a. Reports the move's time and its frozen time (fence to switch), the
//! latency of the moving namespace's calls during the move (p50, p99, max, failures), and the
//! other namespace's TryStart throughput during the move against without it, measured before
//! and after in the same run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::transport::Endpoint;

use idempotency_coordinator::proto::idempotency::v1::TryStartRequest;
use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_testkit::Binary;
use idempotency_testkit::database::drop_postgres_database;

use crate::completed;
use crate::load::{self, Report};

#[derive(Debug, clap::Args)]
pub struct Settings {
    /// The PostgreSQL server of cluster a, where the namespace starts (no database: the
    /// benchmark makes its own).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    pub source_server: String,
    /// The PostgreSQL server of cluster b, where it moves to (another cluster: `initdb` one).
    #[arg(long)]
    pub target_server: String,
    /// Completed keys in the namespace to move.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Callers on each namespace.
    #[arg(long, default_value_t = 16)]
    pub callers: usize,
    /// How long to measure the other namespace without a move, before it and after it.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub baseline: Duration,
}

/// What the moving namespace's callers saw while the move ran.
#[derive(Default)]
struct Seen {
    latencies: Vec<Duration>,
    failures: Vec<String>,
}

impl Seen {
    fn percentile(&self, fraction: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let at = ((sorted.len() as f64 * fraction).ceil() as usize).saturating_sub(1);
        sorted.get(at).copied().unwrap_or_default()
    }
}

/// Claims of fresh keys of `tenant` by `callers` callers until `stop`, each call timed.
async fn tenant_load(
    target: String,
    callers: usize,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Seen> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let channel = Endpoint::from_shared(target.clone())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        let (stop, seen) = (stop.clone(), seen.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = IdempotencyServiceClient::new(channel);
            let mut sequence = 0u64;
            while !stop.load(Ordering::Relaxed) {
                sequence += 1;
                let request = TryStartRequest {
                    namespace: "tenant".into(),
                    key: format!("moving:{caller}:{sequence}"),
                    fingerprint: b"bench-fingerprint".to_vec(),
                    ..Default::default()
                };
                let sent = Instant::now();
                let answer = client.try_start(request).await;
                let took = sent.elapsed();
                let mut seen = seen
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                seen.latencies.push(took);
                if let Err(status) = answer {
                    seen.failures.push(format!("{:?}", status.code()));
                }
            }
        }));
    }
    for task in tasks {
        task.await?;
    }
    let seen = std::mem::take(
        &mut *seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    Ok(seen)
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let database = format!("idempotency_bench_move_{}", std::process::id());
    let source_url = format!("{}/{database}", settings.source_server);
    let target_url = format!("{}/{database}", settings.target_server);
    let binary = Binary::beside_current_exe()?;
    let clusters = [
        "--cluster".to_owned(),
        format!("a={source_url}"),
        "--cluster".to_owned(),
        format!("b={target_url}"),
    ];
    let coordinator = crate::serving_with(&binary, &clusters).await?;
    let endpoint = coordinator.endpoint();
    let loading = Instant::now();
    completed::insert_postgres(&source_url, settings.rows).await?;
    let loaded_in = loading.elapsed();

    let before = load::try_starts_for(&endpoint, settings.callers, settings.baseline).await?;

    let mut mover = binary.command();
    mover
        .args(["admin", "--coordinator", &endpoint, "--output", "json"])
        .args(["--timeout", "3600s"])
        .args(["placement", "move", "--namespace", "tenant", "--to", "b"])
        .args(["--reason", "benchmark"]);
    let moving_since = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let tenant = tokio::spawn(tenant_load(
        endpoint.clone(),
        settings.callers,
        stop.clone(),
    ));
    let (during, moved) =
        load::try_starts_while(&endpoint, settings.callers, mover, "the move").await?;
    let moved_in = moving_since.elapsed();
    stop.store(true, Ordering::Relaxed);
    let tenant = tenant.await??;
    let after = load::try_starts_for(&endpoint, settings.callers, settings.baseline).await?;
    coordinator.stop().await?;
    drop_postgres_database(&settings.source_server, &database).await?;
    drop_postgres_database(&settings.target_server, &database).await?;

    println!(
        "{} completed keys loaded in {:.1} s; moved from a to b in {:.2} s by `admin placement \
         move` while serving: {}",
        settings.rows,
        loaded_in.as_secs_f64(),
        moved_in.as_secs_f64(),
        String::from_utf8_lossy(&moved.stdout).replace('\n', " ")
    );
    println!(
        "the moving namespace's TryStarts during the move: {} calls, p50 {:.1} ms, p99 {:.1} \
         ms, max {:.1} ms, {} failed {:?}",
        tenant.latencies.len(),
        tenant.percentile(0.5).as_secs_f64() * 1000.0,
        tenant.percentile(0.99).as_secs_f64() * 1000.0,
        tenant.percentile(1.0).as_secs_f64() * 1000.0,
        tenant.failures.len(),
        tenant.failures.iter().take(3).collect::<Vec<_>>()
    );
    println!("{}", Report::header());
    println!("{}", before.row("another namespace on a, before"));
    println!("{}", during.row("another namespace on a, moving"));
    println!("{}", after.row("another namespace on a, after"));
    let without = (before.ops_per_second() + after.ops_per_second()) / 2.0;
    println!(
        "the other namespace's TryStart throughput while moving: {:.0} ops/s, {:.0}% of {:.0} \
         ops/s without (the mean of before and after)",
        during.ops_per_second(),
        100.0 * during.ops_per_second() / without,
        without
    );
    Ok(())
}
