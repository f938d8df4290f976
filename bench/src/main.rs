//! `idempotency-bench`: drives a coordinator over gRPC with concurrent callers and reports
//! throughput and latency.
//!
//! - `run` drives a coordinator that is already running.
//! - `compare-stores` starts the coordinator binary twice, on the embedded SQLite store and on
//!   PostgreSQL, and runs the same workloads against each in one run, side by side.
//! - `compare-flags` runs coordinators that differ only by flags (metrics, traces, PgBouncer)
//!   side by side, in rotating rounds.
//! - `reaper-under-load` measures TryStart while the reaper clears a backlog of expired keys,
//!   against TryStart without a backlog.
//! - `move-under-load` measures a namespace's move between two PostgreSQL clusters under load.
//! - `spread-over-clusters` measures calls spread over three PostgreSQL clusters against the
//!   same calls on one: each cluster's cost per call it serves.
//! - `gateway` measures the HTTP gateway with wrk against the upstream alone.

mod completed;
mod contended;
mod cost;
mod direct;
mod erase;
mod flags;
mod gateway;
mod load;
mod moving;
mod pgbench;
mod reaper;
mod scratch;
mod spread;

use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use idempotency_testkit::database::drop_postgres_database;
use idempotency_testkit::{Binary, ServerProcess};
use load::{Report, Workload};

#[derive(Debug, Parser)]
#[command(
    name = "idempotency-bench",
    about = "Load generator for the idempotency coordinator"
)]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Drive a running coordinator, or, with --direct, PostgreSQL by hand.
    Run {
        #[arg(long, default_value = "http://127.0.0.1:50051")]
        target: String,
        /// Instead of the coordinator, perform the same operations by hand on this PostgreSQL
        /// database (one statement per operation, one connection per caller): the baseline.
        #[arg(long)]
        direct: Option<String>,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = Workload::all())]
        workload: Vec<Workload>,
        #[arg(long, default_value_t = 16)]
        callers: usize,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
    /// Start the coordinator on SQLite and on PostgreSQL and run the same workloads on both.
    CompareStores {
        /// A PostgreSQL server the benchmark may create (and drop) a database on.
        #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
        postgres_server: String,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = Workload::all())]
        workload: Vec<Workload>,
        #[arg(long, default_value_t = 16)]
        callers: usize,
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        duration: Duration,
    },
    /// The coordinator against the same operations written by hand straight on PostgreSQL
    /// (one statement per operation, one connection per caller), alternating, in one run.
    VersusDirect {
        #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
        postgres_server: String,
        #[arg(long, value_enum, value_delimiter = ',', default_values_t = Workload::all())]
        workload: Vec<Workload>,
        /// Caller counts to run, e.g. 1,64.
        #[arg(long, value_delimiter = ',', default_values_t = vec![1, 64])]
        callers: Vec<usize>,
        #[arg(long, default_value = "8s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Extra flags for the coordinator, e.g. "--pool-size 8".
        #[arg(long, allow_hyphen_values = true, default_value = "")]
        coordinator_flags: String,
        /// Also run each workload with PostgreSQL's own load generator, this `pgbench`
        /// (e.g. /usr/bin/pgbench), as a third side.
        #[arg(long)]
        pgbench: Option<String>,
    },
    /// TryStart latency while the reaper clears a backlog of expired keys, against without.
    ReaperUnderLoad(reaper::Settings),
    /// TryStart throughput while the admin API erases a namespace of a million keys, against
    /// without (before and after).
    EraseUnderLoad(erase::Settings),
    /// A namespace of a million keys moved to another PostgreSQL cluster under load: its
    /// frozen time, its calls' latency, and another namespace's throughput against without.
    MoveUnderLoad(moving::Settings),
    /// Calls spread over namespaces on several PostgreSQL clusters against the same calls on
    /// one: each cluster's database cost per call it serves, the coordinator's CPU, throughput.
    SpreadOverClusters(spread::Settings),
    /// Callers piled up on a few keys whose holder works, then completes: waiting on the server
    /// (TryStart's `wait`) against polling every 50 ms.
    Contended(contended::Settings),
    /// Coordinators that differ only by their flags (metrics, traces, a pooler), side by side
    /// in rotating rounds: throughput ratios, their spread, p50 differences.
    CompareFlags(flags::Settings),
    /// The HTTP gateway with wrk: the upstream alone against through the gateway (fresh keys,
    /// replays, passed through), at 1 caller and at --callers, alternating, in one run.
    Gateway(gateway::Settings),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        BenchCommand::Run {
            target,
            direct,
            workload,
            callers,
            duration,
        } => {
            if let Some(url) = &direct {
                direct::prepare(url).await?;
            }
            println!("{}", Report::header());
            for workload in workload {
                let report = match &direct {
                    Some(url) => {
                        let run = direct::DirectRun {
                            url,
                            workload,
                            callers,
                            duration,
                            probe: None,
                        };
                        direct::drive(&run)
                            .await
                            .context("driving PostgreSQL directly")?
                    }
                    None => load::drive(&target, workload, callers, duration)
                        .await
                        .with_context(|| format!("driving {target}"))?,
                };
                println!(
                    "{}",
                    report.row(if direct.is_some() { "direct" } else { "target" })
                );
            }
        }
        BenchCommand::CompareStores {
            postgres_server,
            workload,
            callers,
            duration,
        } => {
            let database = format!("idempotency_bench_{}", std::process::id());
            let sqlite_dir = std::env::temp_dir().join(&database);
            let sqlite_url = format!("sqlite://{}", sqlite_dir.join("bench.db").display());
            let postgres_url = format!("{postgres_server}/{database}");
            let binary = Binary::beside_current_exe()?;
            let sqlite = serving(&binary, &sqlite_url, &[]).await?;
            let postgres = serving(&binary, &postgres_url, &[]).await?;
            println!(
                "callers {callers}, {} per workload and store, stores alternating",
                humantime::format_duration(duration)
            );
            println!("{}", Report::header());
            for workload in workload {
                for (name, coordinator) in [("sqlite", &sqlite), ("postgres", &postgres)] {
                    let report = load::drive(&coordinator.endpoint(), workload, callers, duration)
                        .await
                        .with_context(|| format!("driving the {name} coordinator"))?;
                    println!("{}", report.row(name));
                }
            }
            sqlite.stop().await?;
            postgres.stop().await?;
            drop_postgres_database(&postgres_server, &database).await?;
            std::fs::remove_dir_all(&sqlite_dir).context("removing the SQLite folder")?;
        }
        BenchCommand::VersusDirect {
            postgres_server,
            workload,
            callers,
            duration,
            coordinator_flags,
            pgbench,
        } => {
            let database = format!("idempotency_bench_direct_{}", std::process::id());
            let url = format!("{postgres_server}/{database}");
            let flags: Vec<&str> = coordinator_flags.split_whitespace().collect();
            let coordinator = serving(&Binary::beside_current_exe()?, &url, &flags).await?;
            let idle_kib = coordinator.memory_kib("VmRSS")?;
            direct::prepare(&url).await?;
            let probe = cost::CostProbe::connect(&url)
                .await?
                .with_service(coordinator.pid()?);
            println!(
                "{} per run; coordinator and direct alternate; PostgreSQL at {postgres_server}",
                humantime::format_duration(duration)
            );
            println!(
                "(database cost per operation: CPU of all PostgreSQL processes, commits of the \
                 bench database, WAL bytes and syncs of the server)"
            );
            println!("{}   ratio   CPU ratio", Report::header());
            for &count in &callers {
                for &workload in &workload {
                    let ours = load::drive_measured(
                        &coordinator.endpoint(),
                        workload,
                        count,
                        duration,
                        Some(&probe),
                    )
                    .await
                    .context("driving the coordinator")?;
                    let direct_run = direct::DirectRun {
                        url: &url,
                        workload,
                        callers: count,
                        duration,
                        probe: Some(&probe),
                    };
                    let theirs = direct::drive(&direct_run)
                        .await
                        .context("driving PostgreSQL directly")?;
                    println!("{}", ours.row("coordinator"));
                    let cpu_ratio = ratio(ours.database_cpu_micros(), theirs.database_cpu_micros());
                    println!(
                        "{}   {:.2}x   {cpu_ratio}",
                        theirs.row("direct"),
                        ours.ops_per_second() / theirs.ops_per_second()
                    );
                    if count == 1 {
                        println!(
                            "{:<19} p50 coordinator - direct: {:+.3} ms",
                            "",
                            ours.percentile(0.5) - theirs.percentile(0.5)
                        );
                    }
                    let Some(pgbench) = &pgbench else { continue };
                    let Some(theirs) = pgbench::drive(pgbench, &direct_run)
                        .await
                        .context("driving PostgreSQL with pgbench")?
                    else {
                        continue;
                    };
                    println!(
                        "{}   {:.2}x   {}",
                        theirs.row(),
                        ours.ops_per_second() / theirs.ops_per_second(),
                        ratio(ours.database_cpu_micros(), theirs.database_cpu_micros())
                    );
                    if count == 1 {
                        println!(
                            "{:<19} mean coordinator - pgbench: {:+.3} ms",
                            "",
                            ours.mean_ms() - theirs.mean_latency_ms()
                        );
                    }
                }
            }
            let peak_kib = coordinator.memory_kib("VmHWM")?;
            println!(
                "coordinator memory: {:.1} MiB idle, {:.1} MiB peak (RSS)",
                idle_kib as f64 / 1024.0,
                peak_kib as f64 / 1024.0
            );
            coordinator.stop().await?;
            drop(probe);
            drop_postgres_database(&postgres_server, &database).await?;
        }
        BenchCommand::ReaperUnderLoad(settings) => reaper::run(settings).await?,
        BenchCommand::EraseUnderLoad(settings) => erase::run(settings).await?,
        BenchCommand::MoveUnderLoad(settings) => moving::run(settings).await?,
        BenchCommand::SpreadOverClusters(settings) => spread::run(settings).await?,
        BenchCommand::Contended(settings) => contended::run(settings).await?,
        BenchCommand::CompareFlags(settings) => flags::run(settings).await?,
        BenchCommand::Gateway(settings) => gateway::run(settings).await?,
    }
    Ok(())
}

/// `ours ÷ theirs` for the table, or n/a when either was not measured.
fn ratio(ours: Option<f64>, theirs: Option<f64>) -> String {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) if theirs > 0.0 => format!("{:.2}x", ours / theirs),
        _ => "n/a".to_owned(),
    }
}

/// Starts the coordinator on `database_url` with `flags`, quiet but for warnings, and waits
/// until its health says it serves.
pub async fn serving(
    binary: &Binary,
    database_url: &str,
    flags: &[&str],
) -> anyhow::Result<ServerProcess> {
    let coordinator = binary
        .serve_logging(database_url, flags, "warn")
        .await
        .with_context(|| format!("starting {}", binary.path().display()))?;
    coordinator.wait_until_serving().await?;
    Ok(coordinator)
}

/// Starts the coordinator with `args` after `serve` (its store among them: the `--cluster`s
/// of a store on several clusters), quiet but for warnings, and waits until its health says it
/// serves.
pub async fn serving_with(binary: &Binary, args: &[String]) -> anyhow::Result<ServerProcess> {
    let mut command = binary.command();
    command.arg("serve").args(args).env("RUST_LOG", "warn");
    let coordinator = ServerProcess::spawn(command, &[])
        .await
        .with_context(|| format!("starting {}", binary.path().display()))?;
    coordinator.wait_until_serving().await?;
    Ok(coordinator)
}
