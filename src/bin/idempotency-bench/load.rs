//! Workloads, concurrent callers, and what they measure.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use idempotency_coordinator::proto::idempotency::v1::idempotency_service_client::IdempotencyServiceClient;
use idempotency_coordinator::proto::idempotency::v1::{
    CompleteRequest, MarkProcessedRequest, TryStartRequest, try_start_response::Outcome,
};
use tonic::transport::{Channel, Endpoint};

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

pub struct Report {
    workload: Workload,
    callers: usize,
    elapsed: Duration,
    /// Latency of every successful operation, in microseconds.
    latencies: Vec<u64>,
    errors: u64,
}

impl Report {
    /// Waits for every caller's task, each answering its latencies and its error count, and
    /// reports them together over the time since `started`.
    pub async fn gather(
        workload: Workload,
        started: Instant,
        tasks: Vec<tokio::task::JoinHandle<(Vec<u64>, u64)>>,
    ) -> anyhow::Result<Self> {
        let callers = tasks.len();
        let mut latencies = Vec::new();
        let mut errors = 0;
        for task in tasks {
            let (caller_latencies, caller_errors) = task.await?;
            latencies.extend(caller_latencies);
            errors += caller_errors;
        }
        Ok(Self {
            workload,
            callers,
            elapsed: started.elapsed(),
            latencies,
            errors,
        })
    }

    /// Successful operations per second.
    pub fn ops_per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
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
        )
    }

    fn percentile_ms(&self, sorted: &[u64], fraction: f64) -> f64 {
        if sorted.is_empty() {
            return f64::NAN;
        }
        let rank = ((sorted.len() as f64) * fraction).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
    }

    /// The latency at `fraction` (0.99 for p99), in milliseconds.
    pub fn percentile(&self, fraction: f64) -> f64 {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        self.percentile_ms(&sorted, fraction)
    }

    pub fn row(&self, store: &str) -> String {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        let ops = sorted.len() as f64 / self.elapsed.as_secs_f64();
        format!(
            "{:<19} {:<20} {:>7} {:>10.0} {:>11.0} {:>9.2} {:>9.2} {:>9.2} {:>7}",
            self.workload.name(),
            store,
            self.callers,
            ops,
            ops * self.workload.items_per_op() as f64,
            self.percentile_ms(&sorted, 0.50),
            self.percentile_ms(&sorted, 0.99),
            self.percentile_ms(&sorted, 0.999),
            self.errors,
        )
    }
}

/// Runs `workload` with `callers` concurrent callers, each on its own connection, for
/// `duration`, and reports what they measured.
pub async fn drive(
    target: &str,
    workload: Workload,
    callers: usize,
    duration: Duration,
) -> anyhow::Result<Report> {
    // The clock starts when the callers do (the stop future is first polled then), not before
    // connecting and preparing: a `sleep` created here would count the preparation.
    let run_for = async move { tokio::time::sleep(duration).await };
    drive_until(target, workload, callers, run_for).await
}

/// Like [`drive`], until `stop` completes; `stop` is first polled once the callers start.
pub async fn drive_until(
    target: &str,
    workload: Workload,
    callers: usize,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Report> {
    let run = uuid_like();
    let mut clients = Vec::with_capacity(callers);
    for _ in 0..callers {
        let channel = Endpoint::from_shared(target.to_owned())?
            .tcp_nodelay(true)
            .connect()
            .await
            .with_context(|| format!("connecting to {target}"))?;
        clients.push(channel);
    }
    let replay_keys = if workload == Workload::Replay {
        prepare_replay(&mut IdempotencyServiceClient::new(clients[0].clone()), &run).await?
    } else {
        Vec::new()
    };

    let started = Instant::now();
    let stopped = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(caller, client)| {
            let run = run.clone();
            let replay_keys = replay_keys.clone();
            let stopped = stopped.clone();
            tokio::spawn(async move {
                caller_loop(client, workload, caller, &run, &replay_keys, &stopped).await
            })
        })
        .collect();
    stop.await;
    stopped.store(true, Ordering::Relaxed);
    Report::gather(workload, started, tasks).await
}

/// A run id that keeps keys of different runs apart on a shared store.
pub fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos:x}-{}", std::process::id())
}

fn try_start(key: String) -> TryStartRequest {
    TryStartRequest {
        namespace: "bench".into(),
        key,
        fingerprint: b"bench-fingerprint".to_vec(),
        lease_ttl: None,
        retention: None,
        attempt_id: String::new(),
    }
}

async fn prepare_replay(
    client: &mut IdempotencyServiceClient<Channel>,
    run: &str,
) -> anyhow::Result<Vec<String>> {
    let mut keys = Vec::with_capacity(REPLAY_KEYS);
    for index in 0..REPLAY_KEYS {
        let key = format!("{run}:replay:{index}");
        let answer = client.try_start(try_start(key.clone())).await?.into_inner();
        let Some(Outcome::Started(started)) = answer.outcome else {
            anyhow::bail!("preparing replay keys: {key} was not started");
        };
        client
            .complete(CompleteRequest {
                namespace: "bench".into(),
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

async fn caller_loop(
    channel: Channel,
    workload: Workload,
    caller: usize,
    run: &str,
    replay_keys: &[String],
    stopped: &AtomicBool,
) -> (Vec<u64>, u64) {
    let mut client = IdempotencyServiceClient::new(channel.clone());
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let mut latencies = Vec::new();
    let mut errors = 0;
    let mut sequence: usize = 0;
    while !stopped.load(Ordering::Relaxed) {
        sequence += 1;
        let began = Instant::now();
        let succeeded = match workload {
            Workload::TryStart => {
                let key = format!("{run}:{caller}:{sequence}");
                matches!(
                    client
                        .try_start(try_start(key))
                        .await
                        .map(|a| a.into_inner().outcome),
                    Ok(Some(Outcome::Started(_)))
                )
            }
            Workload::Lifecycle => {
                let key = format!("{run}:{caller}:{sequence}");
                match client
                    .try_start(try_start(key.clone()))
                    .await
                    .map(|a| a.into_inner().outcome)
                {
                    Ok(Some(Outcome::Started(started))) => client
                        .complete(CompleteRequest {
                            namespace: "bench".into(),
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
                let key = replay_keys[(caller * 7919 + sequence) % replay_keys.len()].clone();
                matches!(
                    client
                        .try_start(try_start(key))
                        .await
                        .map(|a| a.into_inner().outcome),
                    Ok(Some(Outcome::Completed(_)))
                )
            }
            Workload::Health => health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .is_ok(),
            Workload::MarkProcessed1 | Workload::MarkProcessed100 => {
                let batch = workload.items_per_op() as usize;
                let event_ids = (0..batch)
                    .map(|item| format!("{run}:{caller}:{sequence}:{item}"))
                    .collect();
                client
                    .mark_processed(MarkProcessedRequest {
                        consumer: "bench".into(),
                        event_ids,
                        retention: None,
                    })
                    .await
                    .is_ok()
            }
        };
        if succeeded {
            latencies.push(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX));
        } else {
            errors += 1;
        }
    }
    (latencies, errors)
}
