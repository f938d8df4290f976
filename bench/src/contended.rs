//! Contended keys: callers pile up on a few keys whose holder works for a while and then
//! completes. The waiting callers either wait on the server (TryStart's `wait`) or poll TryStart
//! every 50 ms, as a client without `wait` must. Reported for each: how long after the holder's
//! Complete returned the waiters got their answer, how many TryStarts each made, and how many
//! database transactions the whole run cost per waiter.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, TryStartRequest, try_start_response::Outcome,
};
use idempotency_testkit::Binary;
use idempotency_testkit::database::drop_postgres_database;
use sqlx::Connection;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, clap::Args)]
pub struct Settings {
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    pub postgres_server: String,
    /// Keys contended at once in each round.
    #[arg(long, default_value_t = 8)]
    pub keys: usize,
    /// Callers waiting on each key.
    #[arg(long, default_value_t = 16)]
    pub waiters_per_key: usize,
    /// How long each holder works before it completes.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    pub work: Duration,
    #[arg(long, default_value_t = 20)]
    pub rounds: usize,
}

/// How often a caller without `wait` asks again.
const POLL_EVERY: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Wait,
    Poll,
}

struct Figures {
    /// From the holder's Complete returning to each waiter's answer, in microseconds (a waiter
    /// answered before the holder's own answer came back counts as 0).
    after_complete: Histogram<u64>,
    try_starts: u64,
    waiters: u64,
    transactions: i64,
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let database = format!("idempotency_bench_contended_{}", std::process::id());
    let url = format!("{}/{database}", settings.postgres_server);
    let coordinator = crate::serving(&Binary::beside_current_exe()?, &url, &[]).await?;
    let channel = Endpoint::from_shared(coordinator.endpoint())?
        .tcp_nodelay(true)
        .connect()
        .await?;
    let mut stats = sqlx::PgConnection::connect(&url).await?;
    println!(
        "{} keys x {} waiters, holder works {}, {} rounds; PostgreSQL store",
        settings.keys,
        settings.waiters_per_key,
        humantime::format_duration(settings.work),
        settings.rounds
    );
    println!(
        "{:<22} {:>12} {:>12} {:>12} {:>16} {:>16}",
        "waiters", "p50 ms", "p99 ms", "max ms", "TryStarts/waiter", "transactions/waiter"
    );
    for mode in [Mode::Wait, Mode::Poll, Mode::Wait, Mode::Poll] {
        let before = transactions(&mut stats, &database).await?;
        let mut figures = drive(&channel, &settings, mode).await?;
        // Backends publish their transaction counts within a second of going idle.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        figures.transactions = transactions(&mut stats, &database).await? - before;
        let quantile = |q: f64| figures.after_complete.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "{:<22} {:>12.2} {:>12.2} {:>12.2} {:>16.2} {:>16.2}",
            match mode {
                Mode::Wait => "wait (server-side)",
                Mode::Poll => "poll every 50 ms",
            },
            quantile(0.5),
            quantile(0.99),
            figures.after_complete.max() as f64 / 1000.0,
            figures.try_starts as f64 / figures.waiters as f64,
            figures.transactions as f64 / figures.waiters as f64,
        );
    }
    coordinator.stop().await?;
    drop(stats);
    drop_postgres_database(&settings.postgres_server, &database).await?;
    Ok(())
}

/// Committed and rolled back transactions of the bench's database so far.
async fn transactions(stats: &mut sqlx::PgConnection, database: &str) -> anyhow::Result<i64> {
    // The statistics collector reports with a delay: ask it to flush what it has.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *stats)
        .await?;
    let (count,): (i64,) = sqlx::query_as(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1",
    )
    .bind(database)
    .fetch_one(&mut *stats)
    .await?;
    Ok(count)
}

fn request(key: &str, wait: Option<Duration>) -> TryStartRequest {
    TryStartRequest {
        namespace: "bench".into(),
        key: key.into(),
        fingerprint: b"contended".to_vec(),
        lease_ttl: None,
        retention: None,
        attempt_id: String::new(),
        wait: wait.map(|wait| prost_types::Duration {
            seconds: i64::try_from(wait.as_secs()).unwrap_or(60),
            nanos: 0,
        }),
    }
}

async fn drive(channel: &Channel, settings: &Settings, mode: Mode) -> anyhow::Result<Figures> {
    let mut after_complete = Histogram::new_with_bounds(1, 600_000_000, 3)?;
    let try_starts = Arc::new(AtomicU64::new(0));
    let mut waiters = 0;
    let run = crate::load::run_id();
    for round in 0..settings.rounds {
        let mut holders = Vec::new();
        let mut waiting = Vec::new();
        for key in 0..settings.keys {
            let key = format!("{run}:{round}:{key}");
            let mut client = IdempotencyServiceClient::new(channel.clone());
            let Some(Outcome::Started(claim)) = client
                .try_start(request(&key, None))
                .await?
                .into_inner()
                .outcome
            else {
                anyhow::bail!("a fresh key was not started");
            };
            for _ in 0..settings.waiters_per_key {
                waiters += 1;
                let (channel, key, try_starts) = (channel.clone(), key.clone(), try_starts.clone());
                waiting.push(tokio::spawn(async move {
                    let mut client = IdempotencyServiceClient::new(channel);
                    loop {
                        try_starts.fetch_add(1, Ordering::Relaxed);
                        let wait = (mode == Mode::Wait).then_some(Duration::from_secs(30));
                        let outcome = client.try_start(request(&key, wait)).await?.into_inner();
                        match outcome.outcome {
                            Some(Outcome::Completed(_)) => return anyhow::Ok(Instant::now()),
                            Some(Outcome::InProgress(_)) => tokio::time::sleep(POLL_EVERY).await,
                            other => anyhow::bail!("unexpected answer {other:?}"),
                        }
                    }
                }));
            }
            let channel = channel.clone();
            let work = settings.work;
            holders.push(tokio::spawn(async move {
                tokio::time::sleep(work).await;
                IdempotencyServiceClient::new(channel)
                    .complete(CompleteRequest {
                        namespace: "bench".into(),
                        key,
                        lease_token: claim.lease_token,
                        response: vec![b'r'; 256],
                        retention: None,
                    })
                    .await?;
                anyhow::Ok(Instant::now())
            }));
        }
        let mut completed_at = Vec::new();
        for holder in holders {
            completed_at.push(holder.await.context("holder")??);
        }
        for (index, waiter) in waiting.into_iter().enumerate() {
            let answered = waiter.await.context("waiter")??;
            let completed = completed_at[index / settings.waiters_per_key];
            let micros = answered.saturating_duration_since(completed).as_micros();
            after_complete.saturating_record(u64::try_from(micros).unwrap_or(u64::MAX).max(1));
        }
    }
    Ok(Figures {
        after_complete,
        try_starts: try_starts.load(Ordering::Relaxed),
        waiters,
        transactions: 0,
    })
}
