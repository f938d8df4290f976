//! Concurrent callers, each looping over one call until told to stop, with every successful
//! call's latency kept in a histogram (constant memory however long the run) and every failure
//! kept for the caller to judge. The bench's workloads and the fault tests' load are both this
//! loop with a different call.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;

/// Latencies are kept in microseconds, from 1 µs to 10 minutes, to three significant digits.
const LONGEST_MICROS: u64 = 600_000_000;

fn new_histogram() -> anyhow::Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, LONGEST_MICROS, 3).context("a latency histogram")
}

/// What the callers measured together.
pub struct Tally<E> {
    /// The time from the first call to the stop.
    pub elapsed: Duration,
    /// The latency of every successful call, in microseconds.
    pub latencies: Histogram<u64>,
    /// Every failed call's error, in no particular order.
    pub failures: Vec<E>,
}

impl<E> Tally<E> {
    /// Successful calls.
    pub fn successes(&self) -> u64 {
        self.latencies.len()
    }

    /// Successful calls per second.
    pub fn per_second(&self) -> f64 {
        self.successes() as f64 / self.elapsed.as_secs_f64()
    }

    /// The latency at `quantile` (0.99 for p99), in milliseconds; NaN when nothing succeeded.
    pub fn quantile_ms(&self, quantile: f64) -> f64 {
        if self.latencies.is_empty() {
            return f64::NAN;
        }
        self.latencies.value_at_quantile(quantile) as f64 / 1000.0
    }

    /// The slowest successful call.
    pub fn slowest(&self) -> Duration {
        Duration::from_micros(self.latencies.max())
    }
}

/// What one caller measured: its latencies and its failures.
type CallerTally<E> = anyhow::Result<(Histogram<u64>, Vec<E>)>;

/// Callers running until [`Callers::finish`].
pub struct Callers<E> {
    stop: Arc<AtomicBool>,
    /// Successful calls so far, for tests that wait until calls flow.
    successes: Arc<AtomicU64>,
    started: Instant,
    tasks: Vec<tokio::task::JoinHandle<CallerTally<E>>>,
}

impl<E: Send + 'static> Callers<E> {
    /// Starts `callers` tasks, each calling `call(caller, sequence)` again and again (sequence
    /// 1, 2, ...) until [`Callers::finish`]. A call's time counts only when it succeeds.
    pub fn start<F, Fut>(callers: usize, call: F) -> Self
    where
        F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let successes = Arc::new(AtomicU64::new(0));
        let call = Arc::new(call);
        let tasks = (0..callers)
            .map(|caller| {
                let (stop, call, successes) = (stop.clone(), call.clone(), successes.clone());
                tokio::spawn(async move {
                    let mut latencies = new_histogram()?;
                    let mut failures = Vec::new();
                    let mut sequence = 0;
                    while !stop.load(Ordering::Relaxed) {
                        sequence += 1;
                        let began = Instant::now();
                        match call(caller, sequence).await {
                            Ok(()) => {
                                let micros = u64::try_from(began.elapsed().as_micros())
                                    .unwrap_or(LONGEST_MICROS);
                                latencies.saturating_record(micros.max(1));
                                successes.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(error) => failures.push(error),
                        }
                    }
                    Ok((latencies, failures))
                })
            })
            .collect();
        Self {
            stop,
            successes,
            started: Instant::now(),
            tasks,
        }
    }

    /// How many calls have succeeded so far, while the callers run.
    pub fn successes_so_far(&self) -> u64 {
        self.successes.load(Ordering::Relaxed)
    }

    /// Tells every caller to stop after its current call, waits for them, and answers what
    /// they measured.
    pub async fn finish(self) -> anyhow::Result<Tally<E>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut latencies = new_histogram()?;
        let mut failures = Vec::new();
        for task in self.tasks {
            let (caller_latencies, caller_failures) = task.await.context("a caller's task")??;
            latencies
                .add(&caller_latencies)
                .context("merging latencies")?;
            failures.extend(caller_failures);
        }
        Ok(Tally {
            // Calls in flight at the stop finish and count, so the window ends when they do.
            elapsed: self.started.elapsed(),
            latencies,
            failures,
        })
    }
}

/// Runs `callers` for as long as `stop` takes to complete (it is first polled once the callers
/// have started), then answers what they measured.
pub async fn run_until<E, F, Fut>(
    callers: usize,
    stop: impl Future<Output = ()>,
    call: F,
) -> anyhow::Result<Tally<E>>
where
    E: Send + 'static,
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send,
{
    let running = Callers::start(callers, call);
    stop.await;
    running.finish().await
}
