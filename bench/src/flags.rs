//! `compare-flags`: the same workloads against coordinators that differ only by their flags
//! (metrics on or off, traces on or off, PgBouncer or not), all running at once on one
//! PostgreSQL server, a database each, in rounds that rotate which variant goes first. Reports,
//! per variant against the first, the median throughput ratio with the spread of the per-round
//! ratios, and the median p50 difference: on a shared machine, the spread says how far the
//! ratio can be trusted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

use crate::load::{self, Workload};
use idempotency_testkit::Binary;
use idempotency_testkit::database::drop_postgres_database;

#[derive(Debug, clap::Args)]
pub struct Settings {
    /// A PostgreSQL server the benchmark may create (and drop) databases on.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    postgres_server: String,
    /// A variant: `name=flags` (flags for the coordinator, space-separated; `{otlp}` stands for
    /// the address of a trace collector the bench runs, which receives and drops the spans;
    /// `{database}` for the variant's database name), or `name?query=flags` to give the
    /// variant's database URL a query (`tls?sslmode=require=`). The first is the baseline.
    #[arg(long = "variant", required = true)]
    variants: Vec<String>,
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![Workload::Health, Workload::TryStart])]
    workload: Vec<Workload>,
    /// Caller counts to run, e.g. 1,16.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 16])]
    callers: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    rounds: usize,
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    duration: Duration,
}

struct Variant {
    name: String,
    flags: Vec<String>,
    /// The query of its database URL (`?sslmode=require`), or nothing.
    query: String,
}

/// Receives spans and drops them, counting them.
#[derive(Clone, Default)]
struct Sink(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn start_sink() -> anyhow::Result<(String, Sink)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let sink = Sink::default();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(sink.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(server);
    Ok((format!("http://{address}"), sink))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let (otlp, sink) = start_sink().await?;
    let run = std::process::id();
    let mut variants = Vec::new();
    for (index, text) in settings.variants.iter().enumerate() {
        let (name, flags) = match text.split_once('?') {
            Some((name, rest)) => match rest.rsplit_once('=') {
                Some((query, flags)) if flags.is_empty() || !flags.contains('=') => {
                    (format!("{name}?{query}"), flags)
                }
                _ => bail!("a variant with a query is name?query=flags, got {text}"),
            },
            None => match text.split_once('=') {
                Some((name, flags)) => (name.to_owned(), flags),
                None => bail!("a variant is name=flags, got {text}"),
            },
        };
        let (name, query) = match name.split_once('?') {
            Some((name, query)) => (name.to_owned(), format!("?{query}")),
            None => (name, String::new()),
        };
        let database = format!("idempotency_bench_flags_{run}_{index}");
        let flags = flags
            .replace("{otlp}", &otlp)
            .replace("{database}", &database)
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        variants.push((Variant { name, flags, query }, database));
    }
    let binary = Binary::beside_current_exe()?;
    let mut coordinators = Vec::new();
    for (variant, database) in &variants {
        let url = format!("{}/{database}{}", settings.postgres_server, variant.query);
        // Migrated directly, so that a variant behind a pooler may run with --no-migrate.
        let migrated = binary
            .command()
            .args(["migrate", "--database-url", &url])
            .env("RUST_LOG", "warn")
            .status()
            .await
            .context("running migrate")?;
        if !migrated.success() {
            bail!("migrating {database} failed");
        }
        let flags: Vec<&str> = variant.flags.iter().map(String::as_str).collect();
        coordinators.push(
            crate::serving(&binary, &url, &flags)
                .await
                .with_context(|| format!("starting the {} coordinator", variant.name))?,
        );
    }
    println!(
        "{} rounds of {} per variant, workload and caller count; variants rotate within each round",
        settings.rounds,
        humantime::format_duration(settings.duration)
    );
    for (variant, _) in &variants {
        println!("  {}: {}", variant.name, variant.flags.join(" "));
    }
    println!(
        "{:<18} {:>7} {:<10} {:>10} {:>9} {:>9} {:>9}  per-round ratios",
        "workload", "callers", "variant", "ops/s", "ratio", "p50 ms", "Δp50 ms"
    );
    for &callers in &settings.callers {
        for &workload in &settings.workload {
            // ops[variant][round], p50[variant][round]
            let mut ops = vec![Vec::new(); coordinators.len()];
            let mut p50 = vec![Vec::new(); coordinators.len()];
            for round in 0..settings.rounds {
                for turn in 0..coordinators.len() {
                    let index = (turn + round) % coordinators.len();
                    let report = load::drive(
                        &coordinators[index].endpoint(),
                        workload,
                        callers,
                        settings.duration,
                    )
                    .await
                    .with_context(|| format!("driving {}", variants[index].0.name))?;
                    ops[index].push(report.ops_per_second());
                    p50[index].push(report.percentile(0.5));
                }
            }
            let base_ops = median(&mut ops[0].clone());
            let base_p50 = median(&mut p50[0].clone());
            for (index, (variant, _)) in variants.iter().enumerate() {
                let ratios: Vec<f64> = ops[index]
                    .iter()
                    .zip(&ops[0])
                    .map(|(ours, base)| ours / base)
                    .collect();
                let ops_median = median(&mut ops[index].clone());
                let p50_median = median(&mut p50[index].clone());
                let mut sorted = ratios.clone();
                let ratio = median(&mut sorted);
                println!(
                    "{:<18} {:>7} {:<10} {:>10.0} {:>9.3} {:>9.3} {:>+9.3}  {} (min {:.2}, max {:.2}; pooled ratio {:.3})",
                    workload.name(),
                    callers,
                    variant.name,
                    ops_median,
                    ratio,
                    p50_median,
                    p50_median - base_p50,
                    ratios
                        .iter()
                        .map(|r| format!("{r:.2}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                    sorted.first().copied().unwrap_or(f64::NAN),
                    sorted.last().copied().unwrap_or(f64::NAN),
                    ops_median / base_ops,
                );
            }
        }
    }
    println!(
        "spans received by the bench's collector: {}",
        sink.0.load(Ordering::Relaxed)
    );
    for coordinator in coordinators {
        coordinator.stop().await?;
    }
    for (_, database) in &variants {
        drop_postgres_database(&settings.postgres_server, database).await?;
    }
    Ok(())
}
