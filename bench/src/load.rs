//! Workloads, concurrent callers, and what they measure.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, MarkProcessedRequest, TryStartRequest, try_start_response::Outcome,
};
use idempotency_testkit::load::{self, Tally};
use tonic::transport::{Channel, Endpoint};

use crate::cost::{Cost, CostProbe};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// TryStart of fresh keys.
    TryStart,
    /// TryStart then Complete of fresh keys (one operation).
    Lifecycle,
    /// TryStart of keys completed beforehand: the stored response is replayed.
    Replay,
    /// MarkProcessed of one fresh event id per call.
    #[value(name = "mark-processed-1")]
    MarkProcessed1,
    /// MarkProcessed of 100 fresh event ids per call.
    #[value(name = "mark-processed-100")]
    MarkProcessed100,
    /// A health check: the gRPC round trip alone, no store work, for reference.
    Health,
}

impl Workload {
    pub fn all() -> Vec<Self> {
        vec![
            Self::TryStart,
            Self::Lifecycle,
            Self::Replay,
            Self::MarkProcessed1,
            Self::MarkProcessed100,
        ]
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::TryStart => "try-start",
            Self::Lifecycle => "lifecycle",
            Self::Replay => "replay",
            Self::MarkProcessed1 => "mark-processed-1",
            Self::MarkProcessed100 => "mark-processed-100",
            Self::Health => "health",
        }
    }

    /// Events recorded per operation (MarkProcessed), or keys touched per operation.
    pub fn items_per_op(self) -> u64 {
        match self {
            Self::MarkProcessed100 => 100,
            _ => 1,
        }
    }
}

/// How many completed keys the replay workload cycles through.
pub const REPLAY_KEYS: usize = 1000;

/// What one workload measured, for the tables.
pub struct Report {
    workload: Workload,
    callers: usize,
    tally: Tally<()>,
    /// What the run cost the database, when it was measured.
    cost: Option<Cost>,
}

impl Report {
    pub fn new(workload: Workload, callers: usize, tally: Tally<()>, cost: Option<Cost>) -> Self {
        Self {
            workload,
            callers,
            tally,
            cost,
        }
    }

    /// The database's CPU per successful operation, in µs, when it was measured.
    pub fn database_cpu_micros(&self) -> Option<f64> {
        self.cost?.cpu_micros_per_operation(self.tally.successes())
    }

    /// Successful operations per second.
    pub fn ops_per_second(&self) -> f64 {
        self.tally.per_second()
    }

    pub fn header() -> String {
        format!(
            "{:<19} {:<20} {:>7} {:>10} {:>11} {:>9} {:>9} {:>9} {:>7}",
            "workload",
            "store",
            "callers",
            "ops/s",
            "items/s",
            "p50 ms",
            "p99 ms",
            "p99.9 ms",
            "errors"
        ) + &format!(" {}", Cost::header())
    }

    /// The latency at `fraction` (0.99 for p99), in milliseconds.
    pub fn percentile(&self, fraction: f64) -> f64 {
        self.tally.quantile_ms(fraction)
    }

    /// The mean latency, in milliseconds (what pgbench reports).
    pub fn mean_ms(&self) -> f64 {
        self.tally.latencies.mean() / 1000.0
    }

    pub fn row(&self, store: &str) -> String {
        let ops = self.ops_per_second();
        format!(
            "{:<19} {:<20} {:>7} {:>10.0} {:>11.0} {:>9.2} {:>9.2} {:>9.2} {:>7}",
            self.workload.name(),
            store,
            self.callers,
            ops,
            ops * self.workload.items_per_op() as f64,
            self.percentile(0.50),
            self.percentile(0.99),
            self.percentile(0.999),
            self.tally.failures.len(),
        ) + &self.cost.map_or_else(String::new, |cost| {
            format!(" {}", cost.per_operation(self.tally.successes()))
        })
    }
}

/// TryStart from `callers` callers for `duration`: what a benchmark of background work compares
/// its measure with.
pub async fn try_starts_for(
    target: &str,
    callers: usize,
    duration: Duration,
) -> anyhow::Result<Report> {
    drive(target, Workload::TryStart, callers, duration).await
}

/// TryStart from `callers` callers for as long as `command` (an operator's, `what` it does)
/// runs: the measure, and the command's output once it has succeeded.
pub async fn try_starts_while(
    target: &str,
    callers: usize,
    mut command: tokio::process::Command,
    what: &str,
) -> anyhow::Result<(Report, std::process::Output)> {
    let running = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let waiting = tokio::spawn(async move {
        let output = running.wait_with_output().await;
        let _ = sender.send(());
        output
    });
    let ended = async move {
        let _ = receiver.await;
    };
    let during = drive_until(target, Workload::TryStart, callers, ended, None).await?;
    let output = waiting.await??;
    anyhow::ensure!(
        output.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((during, output))
}

/// Runs `workload` with `callers` concurrent callers, each on its own connection, for
/// `duration`, and reports what they measured.
pub async fn drive(
    target: &str,
    workload: Workload,
    callers: usize,
    duration: Duration,
) -> anyhow::Result<Report> {
    drive_measured(target, workload, callers, duration, None).await
}

/// Like [`drive`], and with `probe`, what the run (not its preparation) cost the database.
pub async fn drive_measured(
    target: &str,
    workload: Workload,
    callers: usize,
    duration: Duration,
    probe: Option<&CostProbe>,
) -> anyhow::Result<Report> {
    // The clock starts when the callers do (the stop future is first polled then), not before
    // connecting and preparing: a `sleep` created here would count the preparation.
    let run_for = async move { tokio::time::sleep(duration).await };
    drive_until(target, workload, callers, run_for, probe).await
}

/// Like [`drive_measured`], until `stop` completes; `stop` is first polled once the callers
/// start.
pub async fn drive_until(
    target: &str,
    workload: Workload,
    callers: usize,
    stop: impl std::future::Future<Output = ()>,
    probe: Option<&CostProbe>,
) -> anyhow::Result<Report> {
    let probes: Vec<&CostProbe> = probe.into_iter().collect();
    let spread = drive_spread(target, workload, callers, &Namespaces::one(), stop, &probes).await?;
    Ok(spread.report)
}

/// The namespaces a run's callers spread over: caller `i` calls in the `i % count`-th, for
/// keys and, as the consumer, for events.
#[derive(Debug, Clone)]
pub struct Namespaces(Vec<String>);

impl Namespaces {
    /// The one namespace `bench`: every caller in it.
    pub fn one() -> Self {
        Self(vec!["bench".to_owned()])
    }

    /// `bench-0` … `bench-{count - 1}`.
    pub fn spread(count: usize) -> Self {
        Self((0..count.max(1)).map(|n| format!("bench-{n}")).collect())
    }

    pub fn names(&self) -> &[String] {
        &self.0
    }

    /// The index of caller `caller`'s namespace.
    fn index_of(&self, caller: usize) -> usize {
        caller % self.0.len().max(1)
    }
}

/// What a run spread over namespaces measured.
pub struct SpreadRun {
    /// Every caller's calls, with the first probe's cost.
    pub report: Report,
    /// Successful operations in each namespace, in the order of [`Namespaces::names`].
    pub successes: Vec<u64>,
    /// What the run cost each probe's database, in the order of the probes.
    pub costs: Vec<Cost>,
}

/// Runs `workload` from `callers` callers spread over `namespaces` until `stop` completes, and
/// with `probes`, what the run (not its preparation) cost each probe's database.
pub async fn drive_spread(
    target: &str,
    workload: Workload,
    callers: usize,
    namespaces: &Namespaces,
    stop: impl std::future::Future<Output = ()>,
    probes: &[&CostProbe],
) -> anyhow::Result<SpreadRun> {
    let run = run_id();
    let mut channels = Vec::with_capacity(callers);
    for _ in 0..callers {
        let channel = Endpoint::from_shared(target.to_owned())?
            .tcp_nodelay(true)
            .connect()
            .await
            .with_context(|| format!("connecting to {target}"))?;
        channels.push(channel);
    }
    let mut replay_keys = Vec::with_capacity(namespaces.names().len());
    for namespace in namespaces.names() {
        replay_keys.push(if workload == Workload::Replay {
            let first = channels.first().context("at least one caller")?;
            let mut client = IdempotencyServiceClient::new(first.clone());
            prepare_replay(&mut client, namespace, &run).await?
        } else {
            Vec::new()
        });
    }
    let channels = Arc::new(channels);
    let replay_keys = Arc::new(replay_keys);
    let counted: Arc<Vec<AtomicU64>> = Arc::new(
        namespaces
            .names()
            .iter()
            .map(|_| AtomicU64::new(0))
            .collect(),
    );
    let mut measuring = Vec::with_capacity(probes.len());
    for probe in probes {
        measuring.push(probe.start().await?);
    }
    let tally = {
        let (namespaces, counted) = (namespaces.clone(), counted.clone());
        load::run_until(callers, stop, move |caller, sequence| {
            let channel = channels[caller].clone();
            let run = run.clone();
            let (replay_keys, namespaces, counted) =
                (replay_keys.clone(), namespaces.clone(), counted.clone());
            async move {
                let index = namespaces.index_of(caller);
                let caller_of = Caller {
                    namespace: &namespaces.0[index],
                    caller,
                    run: &run,
                    replay_keys: &replay_keys[index],
                };
                let answered = call(channel, workload, &caller_of, sequence).await;
                if answered.is_ok() {
                    counted[index].fetch_add(1, Ordering::Relaxed);
                }
                answered
            }
        })
        .await?
    };
    let mut costs = Vec::with_capacity(probes.len());
    for (probe, measuring) in probes.iter().zip(measuring) {
        probe.end_idle_sessions_of(COORDINATOR_APPLICATION).await?;
        costs.push(measuring.finish().await?);
    }
    let successes = counted.iter().map(|n| n.load(Ordering::Relaxed)).collect();
    Ok(SpreadRun {
        report: Report::new(workload, callers, tally, costs.first().copied()),
        successes,
        costs,
    })
}

/// The `application_name` of the coordinator's store sessions (its listener's differs).
const COORDINATOR_APPLICATION: &str = "idempotency-coordinator";

/// A run id that keeps keys of different runs apart on a shared store.
pub fn run_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The outcome of a TryStart of `key`; `None` when the call failed.
async fn outcome(
    client: &mut IdempotencyServiceClient<Channel>,
    namespace: &str,
    key: String,
) -> Option<Outcome> {
    let answer = client.try_start(try_start(namespace, key)).await.ok()?;
    answer.into_inner().outcome
}

fn try_start(namespace: &str, key: String) -> TryStartRequest {
    TryStartRequest {
        namespace: namespace.to_owned(),
        key,
        fingerprint: b"bench-fingerprint".to_vec(),
        lease_ttl: None,
        retention: None,
        attempt_id: String::new(),
        wait: None,
    }
}

async fn prepare_replay(
    client: &mut IdempotencyServiceClient<Channel>,
    namespace: &str,
    run: &str,
) -> anyhow::Result<Vec<String>> {
    let mut keys = Vec::with_capacity(REPLAY_KEYS);
    for index in 0..REPLAY_KEYS {
        let key = format!("{run}:replay:{index}");
        let answer = client
            .try_start(try_start(namespace, key.clone()))
            .await?
            .into_inner();
        let Some(Outcome::Started(started)) = answer.outcome else {
            anyhow::bail!("preparing replay keys: {key} was not started");
        };
        client
            .complete(CompleteRequest {
                namespace: namespace.to_owned(),
                key: key.clone(),
                lease_token: started.lease_token,
                response: vec![b'r'; 256],
                retention: None,
            })
            .await?;
        keys.push(key);
    }
    Ok(keys)
}

/// Who makes a call: the caller, in its namespace, in its run.
struct Caller<'a> {
    namespace: &'a str,
    caller: usize,
    run: &'a str,
    /// The namespace's completed keys, for replays.
    replay_keys: &'a [String],
}

/// One operation of `workload`: `Ok` when it got the answer the workload expects.
async fn call(
    channel: Channel,
    workload: Workload,
    who: &Caller<'_>,
    sequence: u64,
) -> Result<(), ()> {
    let Caller {
        namespace,
        caller,
        run,
        replay_keys,
    } = *who;
    let mut client = IdempotencyServiceClient::new(channel.clone());
    let succeeded = match workload {
        Workload::TryStart => {
            let key = format!("{run}:{caller}:{sequence}");
            matches!(
                outcome(&mut client, namespace, key).await,
                Some(Outcome::Started(_))
            )
        }
        Workload::Lifecycle => {
            let key = format!("{run}:{caller}:{sequence}");
            match outcome(&mut client, namespace, key.clone()).await {
                Some(Outcome::Started(started)) => client
                    .complete(CompleteRequest {
                        namespace: namespace.to_owned(),
                        key,
                        lease_token: started.lease_token,
                        response: vec![b'r'; 256],
                        retention: None,
                    })
                    .await
                    .is_ok(),
                _ => false,
            }
        }
        Workload::Replay => {
            let key = replay_key(replay_keys, caller, sequence).to_owned();
            matches!(
                outcome(&mut client, namespace, key).await,
                Some(Outcome::Completed(_))
            )
        }
        Workload::Health => tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .is_ok(),
        Workload::MarkProcessed1 | Workload::MarkProcessed100 => {
            let event_ids = (0..workload.items_per_op())
                .map(|item| format!("{run}:{caller}:{sequence}:{item}"))
                .collect();
            client
                .mark_processed(MarkProcessedRequest {
                    consumer: namespace.to_owned(),
                    event_ids,
                    retention: None,
                })
                .await
                .is_ok()
        }
    };
    if succeeded { Ok(()) } else { Err(()) }
}

/// The completed key a replay caller asks for at `sequence`: callers spread over the keys.
pub fn replay_key(keys: &[String], caller: usize, sequence: u64) -> &str {
    let index =
        (caller as u64).wrapping_mul(7919).wrapping_add(sequence) % keys.len().max(1) as u64;
    keys.get(index as usize).map_or("", String::as_str)
}
