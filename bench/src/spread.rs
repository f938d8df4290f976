//! Calls spread over namespaces on three PostgreSQL clusters against the same calls on one
//! (`spread-over-clusters`): what each cluster's database spends per call it serves (CPU of its
//! processes, commits, WAL), the coordinator's CPU per call, and the throughput, side by side,
//! alternating, in one run.
//!
//! Both coordinators run throughout, each on databases of its own: one with `--database-url`
//! on the first server (every namespace there, as a deployment of one cluster is), one with a
//! `--cluster` on each server and namespace `bench-i` placed on cluster `i % servers`. The
//! callers are spread over the namespaces the same way on both sides, so a flat cost per call
//! means each cluster's calls cost it what they cost one cluster holding everything.

use std::time::Duration;

use anyhow::Context;
use idempotency_testkit::database::drop_postgres_database;
use idempotency_testkit::{Binary, ServerProcess};

use crate::cost::CostProbe;
use crate::load::{self, Namespaces, Report, SpreadRun, Workload};

#[derive(Debug, clap::Args)]
pub struct Settings {
    /// The PostgreSQL servers of the clusters (no database: the benchmark makes its own on
    /// each); the first also holds everything on the one-cluster side. Make the others with
    /// `initdb` on ports of their own.
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = [
            "postgres://postgres@127.0.0.1:5432".to_owned(),
            "postgres://postgres@127.0.0.1:5442".to_owned(),
            "postgres://postgres@127.0.0.1:5443".to_owned(),
        ]
    )]
    pub servers: Vec<String>,
    /// Namespaces the callers spread over (`bench-0` …), placed round-robin on the clusters.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub namespaces: u16,
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Workload::TryStart, Workload::Lifecycle])]
    pub workload: Vec<Workload>,
    #[arg(long, default_value_t = 64)]
    pub callers: usize,
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Rounds of both sides, alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
}

/// The cluster names of the placed side: `a`, `b`, `c`, …
fn cluster_name(index: usize) -> String {
    let letter = u8::try_from(index % 26).unwrap_or(0);
    let suffix = if index < 26 {
        String::new()
    } else {
        (index / 26).to_string()
    };
    format!("{}{suffix}", char::from(b'a' + letter))
}

/// One side: a coordinator, and a probe on each database it writes.
struct Side {
    label: &'static str,
    coordinator: ServerProcess,
    probes: Vec<CostProbe>,
    /// The probe (by index) that serves each namespace.
    serving: Vec<usize>,
}

impl Side {
    async fn start(
        label: &'static str,
        flags: Vec<String>,
        urls: &[String],
        serving: Vec<usize>,
    ) -> anyhow::Result<Self> {
        let coordinator = crate::serving_with(&Binary::beside_current_exe()?, &flags).await?;
        let mut probes = Vec::with_capacity(urls.len());
        for (index, url) in urls.iter().enumerate() {
            let probe = CostProbe::connect(url)
                .await
                .with_context(|| format!("probing {url}"))?;
            // The coordinator's CPU is read once, with the first cluster's counters.
            probes.push(if index == 0 {
                probe.with_service(coordinator.pid()?)
            } else {
                probe
            });
        }
        Ok(Self {
            label,
            coordinator,
            probes,
            serving,
        })
    }

    async fn drive(
        &self,
        settings: &Settings,
        callers: usize,
        namespaces: &Namespaces,
        workload: Workload,
    ) -> anyhow::Result<SpreadRun> {
        let probes: Vec<&CostProbe> = self.probes.iter().collect();
        let duration = settings.duration;
        load::drive_spread(
            &self.coordinator.endpoint(),
            workload,
            callers,
            namespaces,
            async move { tokio::time::sleep(duration).await },
            &probes,
        )
        .await
        .with_context(|| format!("driving the {} side", self.label))
    }

    /// The report's rows: the calls, then each cluster's cost per call it served.
    fn print(&self, run: &SpreadRun) {
        let total: u64 = run.successes.iter().sum();
        let service = run
            .costs
            .first()
            .and_then(|cost| cost.service_cpu_micros_per_operation(total))
            .map_or_else(|| "-".to_owned(), |micros| format!("{micros:.1}"));
        println!(
            "{}   service CPU µs/op {service}",
            run.report.row(self.label)
        );
        let mut database_seconds = 0.0;
        for (cluster, cost) in run.costs.iter().enumerate() {
            let served: u64 = run
                .successes
                .iter()
                .zip(&self.serving)
                .filter(|(_, serving)| **serving == cluster)
                .map(|(calls, _)| calls)
                .sum();
            database_seconds += cost.cpu().map_or(0.0, |cpu| cpu.as_secs_f64());
            println!(
                "{:<19} cluster {:<4} {:>9} ops served {}",
                "",
                cluster_name(cluster),
                served,
                cost.without_service().per_operation(served)
            );
        }
        println!(
            "{:<19} every cluster's database CPU per op: {:.1} µs",
            "",
            database_seconds * 1e6 / total.max(1) as f64
        );
    }
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    anyhow::ensure!(
        (2..=64).contains(&settings.servers.len()),
        "--servers takes 2 to 64 PostgreSQL servers, not {}",
        settings.servers.len()
    );
    let first = settings.servers[0].clone();
    let database = format!("idempotency_bench_spread_{}", std::process::id());
    let one_database = format!("{database}_one");
    let namespaces = Namespaces::spread(usize::from(settings.namespaces));
    let clusters = settings.servers.len();

    let one_url = format!("{first}/{one_database}");
    let one = Side::start(
        "one cluster",
        vec!["--database-url".to_owned(), one_url.clone()],
        &[one_url],
        vec![0; namespaces.names().len()],
    )
    .await?;

    let urls: Vec<String> = settings
        .servers
        .iter()
        .map(|server| format!("{server}/{database}"))
        .collect();
    let mut flags = Vec::new();
    for (index, url) in urls.iter().enumerate() {
        flags.push("--cluster".to_owned());
        flags.push(format!("{}={url}", cluster_name(index)));
    }
    for (index, namespace) in namespaces.names().iter().enumerate() {
        flags.push("--place".to_owned());
        flags.push(format!("{namespace}={}", cluster_name(index % clusters)));
    }
    let serving = (0..namespaces.names().len())
        .map(|index| index % clusters)
        .collect();
    let placed = Side::start("placed on clusters", flags, &urls, serving).await?;

    println!(
        "{} callers over {} namespaces, {} per run, one cluster and {clusters} alternating, {} \
         rounds (database cost per op: of the calls each cluster served; CPU of all its \
         PostgreSQL processes, commits of the bench database, WAL bytes and syncs of its server)",
        settings.callers,
        namespaces.names().len(),
        humantime::format_duration(settings.duration),
        settings.rounds,
    );
    // A cluster's cost per call depends on its own load (the coalescer shares a statement
    // and a commit among the calls that arrive together), so beside the same callers on each
    // side come the like-for-like ones: one cluster with the callers each placed cluster
    // serves, and the placed clusters with the callers one cluster serves, each.
    let per_cluster = settings.callers.div_ceil(clusters);
    let every_cluster = settings.callers * clusters;
    println!("{}", Report::header());
    for round in 1..=settings.rounds {
        for &workload in &settings.workload {
            for (side, callers) in [
                (&one, settings.callers),
                (&one, per_cluster),
                (&placed, settings.callers),
                (&placed, every_cluster),
            ] {
                let run = side
                    .drive(&settings, callers, &namespaces, workload)
                    .await?;
                side.print(&run);
            }
        }
        println!("(round {round} done)");
    }

    for side in [one, placed] {
        drop(side.probes);
        side.coordinator.stop().await?;
    }
    drop_postgres_database(&first, &one_database).await?;
    for server in &settings.servers {
        drop_postgres_database(server, &database).await?;
    }
    Ok(())
}
