//! Request coalescing: calls that arrive together share one statement and one commit.
//!
//! Callers queue their commands; a dispatcher takes the first one waiting, then waits for a free
//! executor (the store is busy while all of them run), and closes the batch with whatever else
//! queued meanwhile, up to a bound. A lone call on an idle store is therefore sent at once, on
//! its own: there is no timer. Under load, batches grow exactly as long as the store is busy,
//! which is when sharing a round trip and a commit pays.
//!
//! A command that waited longer than its budget for an executor is answered "timed out" without
//! being run, so a caller that was told UNAVAILABLE never finds its command applied later.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::store::StoreError;

/// Counts the calls the store has yet to finish, whether or not their callers still wait.
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<AtomicUsize>);

/// One call in flight, until dropped.
#[derive(Debug)]
pub struct InFlightGuard(Arc<AtomicUsize>);

impl InFlight {
    pub fn enter(&self) -> InFlightGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(self.0.clone())
    }

    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Pending<C, R> {
    command: C,
    /// The command is run only if an executor takes it before then.
    run_before: Instant,
    reply: oneshot::Sender<Result<R, StoreError>>,
    _in_flight: InFlightGuard,
}

/// The queue of one kind of command.
pub struct Coalescer<C, R> {
    queue: mpsc::UnboundedSender<Pending<C, R>>,
    wait_budget: Duration,
    timeout: Duration,
    in_flight: InFlight,
}

impl<C, R> Clone for Coalescer<C, R> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            wait_budget: self.wait_budget,
            timeout: self.timeout,
            in_flight: self.in_flight.clone(),
        }
    }
}

/// How a coalescer runs.
#[derive(Debug, Clone, Copy)]
pub struct CoalescerSettings {
    /// Batches that may run at once (each holds a store connection while it runs).
    pub executors: usize,
    /// The most commands in one batch.
    pub max_batch: usize,
    /// How long a command may wait for an executor before it is answered "timed out".
    pub wait_budget: Duration,
    /// Reported with that answer: the operation timeout.
    pub timeout: Duration,
}

impl<C, R> Coalescer<C, R>
where
    C: Send + 'static,
    R: Send + 'static,
{
    /// Starts the dispatcher. `execute` runs one batch and answers one result per command, in
    /// order. Batches run as tasks of `tasks`, so that shutdown waits for them.
    pub fn start<F, Fut>(
        settings: CoalescerSettings,
        tasks: TaskTracker,
        in_flight: InFlight,
        execute: F,
    ) -> Self
    where
        F: Fn(Vec<C>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<R, StoreError>>> + Send + 'static,
    {
        let (queue, mut waiting) = mpsc::unbounded_channel::<Pending<C, R>>();
        let executors = Arc::new(Semaphore::new(settings.executors.max(1)));
        let execute = Arc::new(execute);
        let timeout = settings.timeout;
        let max_batch = settings.max_batch.max(1);
        tokio::spawn(async move {
            while let Some(first) = waiting.recv().await {
                let Ok(permit) = executors.clone().acquire_owned().await else {
                    return;
                };
                let mut batch = vec![first];
                while batch.len() < max_batch {
                    match waiting.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                let execute = execute.clone();
                tasks.spawn(async move {
                    let now = Instant::now();
                    let (late, due): (Vec<_>, Vec<_>) =
                        batch.into_iter().partition(|p| p.run_before < now);
                    for pending in late {
                        let _ = pending.reply.send(Err(StoreError::TimedOut(timeout)));
                    }
                    if due.is_empty() {
                        return;
                    }
                    let (commands, waiting): (Vec<_>, Vec<_>) = due
                        .into_iter()
                        .map(|p| (p.command, (p.reply, p._in_flight)))
                        .unzip();
                    let results = execute(commands).await;
                    let mut results = results.into_iter();
                    for (reply, in_flight) in waiting {
                        let result = results.next().unwrap_or(Err(StoreError::Inconsistent(
                            "a batch answered fewer results than it had commands",
                        )));
                        let _ = reply.send(result);
                        drop(in_flight);
                    }
                    drop(permit);
                });
            }
        });
        Self {
            queue,
            wait_budget: settings.wait_budget,
            timeout,
            in_flight,
        }
    }

    /// Queues `command` and waits for its own result.
    pub async fn submit(&self, command: C) -> Result<R, StoreError> {
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            command,
            run_before: Instant::now() + self.wait_budget,
            reply,
            _in_flight: self.in_flight.enter(),
        };
        self.queue
            .send(pending)
            .map_err(|_| StoreError::Inconsistent("the coalescer has stopped"))?;
        answer
            .await
            .unwrap_or(Err(StoreError::TimedOut(self.timeout)))
    }
}

/// Splits `items` into rounds in which no two share a key, keeping their order: the first
/// occurrence of every key in the first round, the second in the next, and so on. Running the
/// rounds one after another resolves duplicates as if the calls had come one after another.
pub fn rounds<T, K: Eq + std::hash::Hash>(
    items: Vec<T>,
    key: impl Fn(&T) -> K,
) -> Vec<Vec<(usize, T)>> {
    let mut seen: std::collections::HashMap<K, usize> = std::collections::HashMap::new();
    let mut rounds: Vec<Vec<(usize, T)>> = Vec::new();
    for (index, item) in items.into_iter().enumerate() {
        let occurrence = seen.entry(key(&item)).or_insert(0);
        if rounds.len() <= *occurrence {
            rounds.push(Vec::new());
        }
        rounds[*occurrence].push((index, item));
        *occurrence += 1;
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_keep_order_and_separate_duplicates() {
        let split = rounds(vec!["a", "b", "a", "c", "a", "b"], |k| *k);
        let keys: Vec<Vec<(usize, &str)>> = split;
        assert_eq!(
            keys,
            vec![
                vec![(0, "a"), (1, "b"), (3, "c")],
                vec![(2, "a"), (5, "b")],
                vec![(4, "a")],
            ]
        );
    }

    #[tokio::test]
    async fn a_lone_command_runs_at_once_and_a_crowd_shares_batches() {
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let recorded = sizes.clone();
        let coalescer = Coalescer::start(
            CoalescerSettings {
                executors: 1,
                max_batch: 100,
                wait_budget: Duration::from_secs(5),
                timeout: Duration::from_secs(5),
            },
            TaskTracker::new(),
            InFlight::default(),
            move |commands: Vec<u32>| {
                let recorded = recorded.clone();
                async move {
                    recorded.lock().expect("sizes").push(commands.len());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    commands.into_iter().map(|c| Ok(c * 2)).collect()
                }
            },
        );
        assert_eq!(coalescer.submit(21).await.expect("answered"), 42);
        assert_eq!(
            *sizes.lock().expect("sizes"),
            vec![1],
            "a lone command is not held back"
        );

        let answers = futures_join(&coalescer, 50).await;
        assert_eq!(
            answers,
            (0..50).map(|c| c * 2).collect::<Vec<_>>(),
            "each gets its own"
        );
        let batches = sizes.lock().expect("sizes").clone();
        assert!(
            batches.len() < 10,
            "fifty commands shared batches: {batches:?}"
        );
    }

    async fn futures_join(coalescer: &Coalescer<u32, u32>, count: u32) -> Vec<u32> {
        let handles: Vec<_> = (0..count)
            .map(|c| {
                let coalescer = coalescer.clone();
                tokio::spawn(async move { coalescer.submit(c).await.expect("answered") })
            })
            .collect();
        let mut answers = Vec::new();
        for handle in handles {
            answers.push(handle.await.expect("task"));
        }
        answers
    }

    #[tokio::test]
    async fn a_command_that_waited_past_its_budget_is_not_run() {
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = ran.clone();
        let coalescer = Coalescer::start(
            CoalescerSettings {
                executors: 1,
                max_batch: 1,
                wait_budget: Duration::from_millis(50),
                timeout: Duration::from_secs(1),
            },
            TaskTracker::new(),
            InFlight::default(),
            move |commands: Vec<u32>| {
                let counted = counted.clone();
                async move {
                    counted.fetch_add(commands.len(), std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    commands.into_iter().map(Ok).collect()
                }
            },
        );
        let first = tokio::spawn({
            let coalescer = coalescer.clone();
            async move { coalescer.submit(1).await }
        });
        while ran.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let second = coalescer.submit(2).await;
        assert!(matches!(second, Err(StoreError::TimedOut(_))), "{second:?}");
        assert_eq!(first.await.expect("task").expect("ran"), 1);
        assert_eq!(
            ran.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the late one never ran"
        );
    }
}
