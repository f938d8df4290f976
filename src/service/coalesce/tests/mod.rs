//! The coalescer on its own, with a recording executor instead of a store: which commands share
//! a round, in which order, and who is answered what. The tests are grouped by what they prove,
//! one file each; this file holds what they share: a test command, coalescers that record the
//! rounds they are given, and ways to wait for a point in a run instead of for a time, so that a
//! loaded machine does not change the order of events.

mod backlog;
mod batching;
mod deadlines;
mod duplicates;
mod held_keys;
mod in_place;
mod stalled_rounds;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

use super::*;
use crate::domain::batch::{Batchable, Round};
use crate::service::CoordinatorError;
use crate::service::in_flight::InFlight;
use crate::store::StoreError;
use crate::supervise::Lifecycle;

/// A test command: its key (if any), the value it answers doubled, and its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Command {
    key: Option<u32>,
    value: u32,
    weight: usize,
}

impl Command {
    fn keyed(key: u32) -> Self {
        Self {
            key: Some(key),
            value: key,
            weight: 1,
        }
    }
}

impl Batchable for Command {
    type Key = u32;
    fn conflict_key(&self) -> Option<u32> {
        self.key
    }
    fn weight(&self) -> usize {
        self.weight
    }
}

/// Commands worth 1000 or more are answered from their key's earlier answer, plus one.
impl FollowsEarlier<u32> for Command {
    const FOLLOWS: bool = true;

    fn answer_after(&self, _earlier: &Self, earlier_answer: &u32) -> Option<u32> {
        (self.value >= 1000).then_some(earlier_answer + 1)
    }
}

/// What the test coalescers do with a call whose key was held: its command, whether it came
/// from a shared statement, answered its value times three.
type SentAlone = Arc<Mutex<Vec<(Command, WhyAlone)>>>;

/// Keys from 950 on are known to be held (from 900 on, the store finds them held); a call sent
/// alone is recorded and answered its value × 3.
#[derive(Default)]
struct TestIsolation {
    sent: SentAlone,
}

impl TestIsolation {
    /// The values of the commands sent to run alone, in order, and why each was.
    fn sent_alone(&self) -> Vec<(u32, WhyAlone)> {
        let sent = self.sent.lock().expect("sent alone");
        sent.iter().map(|(c, why)| (c.value, *why)).collect()
    }
}

impl Isolate<Command, u32> for TestIsolation {
    fn is_held(&self, command: &Command) -> bool {
        command.key.is_some_and(|key| key >= 950)
    }

    fn find_held<'a>(
        &'a self,
        _commands: Vec<&'a Command>,
        _answer_by: tokio::time::Instant,
    ) -> super::FindHeldFuture<'a> {
        Box::pin(async {})
    }

    fn alone(
        &self,
        command: Command,
        _answer_by: tokio::time::Instant,
        why: WhyAlone,
        _gone: tokio_util::sync::CancellationToken,
    ) -> AloneFuture<u32> {
        self.sent.lock().expect("sent alone").push((command, why));
        Box::pin(async move { Ok(command.value * 3) })
    }
}

/// A key held by another transaction, as the store reports it.
fn key_held(shared: bool) -> StoreError {
    StoreError::KeyHeld {
        shared,
        cause: sqlx::Error::PoolTimedOut,
    }
}

/// One executor that a round keeps however long it runs (no stalled statement gives it back):
/// what waits and how long is then the test's order of events.
fn held_executor() -> Executors {
    Executors::new(1).with_stalled_statements(0)
}

fn settings(max_batch: usize, wait_budget: Duration) -> CoalescerSettings {
    CoalescerSettings {
        max_batch,
        queue_capacity: 1000,
        places_per_weight: 1,
        wait_budget,
        timeout: Duration::from_secs(5),
        db_system: "test",
    }
}

/// The rounds an executor was given, in order.
type Seen = Arc<Mutex<Vec<Vec<Command>>>>;

/// How long the recording executor takes over each round.
#[derive(Clone)]
enum Pace {
    Sleep(Duration),
    /// Until the test adds a permit: the order of events is the test's, not the clock's.
    Gate(Arc<Semaphore>),
}

/// A coalescer whose executor records each round it is given, then sleeps for `pause`.
fn recording(settings: CoalescerSettings, pause: Duration) -> (Coalescer<Command, u32>, Seen) {
    recording_paced(settings, Pace::Sleep(pause))
}

/// A coalescer whose executor records each round, then waits for a permit of the gate.
fn gated(settings: CoalescerSettings) -> (Coalescer<Command, u32>, Seen, Arc<Semaphore>) {
    gated_sharing(settings, &held_executor(), &Backlog::new(1_000_000))
}

/// [`gated`], sharing `executors` and `backlog` with other coalescers.
fn gated_sharing(
    settings: CoalescerSettings,
    executors: &Executors,
    backlog: &Backlog,
) -> (Coalescer<Command, u32>, Seen, Arc<Semaphore>) {
    gated_on(settings, (executors, backlog), TaskTracker::new())
}

/// [`gated`], its batches tracked by `tasks`.
fn gated_tracked(
    settings: CoalescerSettings,
    tasks: &TaskTracker,
) -> (Coalescer<Command, u32>, Seen, Arc<Semaphore>) {
    let shared = (&held_executor(), &Backlog::new(1_000_000));
    gated_on(settings, shared, tasks.clone())
}

fn gated_on(
    settings: CoalescerSettings,
    shared: (&Executors, &Backlog),
    tasks: TaskTracker,
) -> (Coalescer<Command, u32>, Seen, Arc<Semaphore>) {
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_shared(settings, Pace::Gate(gate.clone()), shared, tasks);
    (coalescer, seen, gate)
}

/// A fresh supervisor and shutdown token, for a coalescer under test.
fn lifecycle() -> Lifecycle {
    Lifecycle {
        supervisor: crate::supervise::Supervisor::new(),
        shutdown: tokio_util::sync::CancellationToken::new(),
    }
}

fn recording_paced(settings: CoalescerSettings, pace: Pace) -> (Coalescer<Command, u32>, Seen) {
    recording_shared(
        settings,
        pace,
        (&Executors::new(1), &Backlog::new(1_000_000)),
        TaskTracker::new(),
    )
}

fn recording_shared(
    settings: CoalescerSettings,
    pace: Pace,
    shared: (&Executors, &Backlog),
    tasks: TaskTracker,
) -> (Coalescer<Command, u32>, Seen) {
    recording_isolated(settings, pace, shared, tasks, Arc::default())
}

fn recording_isolated(
    settings: CoalescerSettings,
    pace: Pace,
    shared: (&Executors, &Backlog),
    tasks: TaskTracker,
    isolation: Arc<TestIsolation>,
) -> (Coalescer<Command, u32>, Seen) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = seen.clone();
    let coalescer = Coalescer::start(
        "test dispatcher",
        &lifecycle(),
        settings,
        shared,
        tasks,
        InFlight::default(),
        isolation,
        move |round: &Round<Command>| {
            let recorded = recorded.clone();
            let pace = pace.clone();
            let commands: Vec<Command> = round.iter().copied().collect();
            let shared = commands.len() > 1;
            Box::pin(async move {
                recorded.lock().expect("rounds").push(commands.clone());
                match pace {
                    Pace::Sleep(pause) => tokio::time::sleep(pause).await,
                    Pace::Gate(gate) => gate.acquire().await.expect("the gate opens").forget(),
                }
                // A key from 900 on is held by another transaction: the whole statement fails.
                if commands.iter().any(|c| c.key.is_some_and(|key| key >= 900)) {
                    return commands.iter().map(|_| Err(key_held(shared))).collect();
                }
                commands
                    .into_iter()
                    .map(|c| match c.value {
                        // A store failure, for the command worth 777.
                        777 => Err(StoreError::TimedOut(Duration::from_millis(1))),
                        // A defect, for the command worth 666.
                        666 => panic!("the executor fails on purpose"),
                        value => Ok(value * 2),
                    })
                    .collect()
            })
        },
    );
    (coalescer, seen)
}

/// Waits until the commands submitted and not yet answered weigh `weight` in all (each
/// holds its weight of the queue's room until it is answered).
async fn until_holding(coalescer: &Coalescer<Command, u32>, weight: usize) {
    while coalescer.queue_capacity - coalescer.room.available_permits() < weight {
        tokio::task::yield_now().await;
    }
}

/// Waits until the executor has been given `count` rounds.
async fn until_rounds(seen: &Seen, count: usize) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while seen.lock().expect("rounds").len() < count {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the rounds came");
}

/// One field of each command of each round the executor was given, round by round.
fn rounds_of<T>(seen: &Seen, field: impl Fn(&Command) -> T) -> Vec<Vec<T>> {
    let rounds = seen.lock().expect("rounds");
    rounds
        .iter()
        .map(|round| round.iter().map(&field).collect())
        .collect()
}

/// A submitted command's call, running in a task of its own.
type Submitted = tokio::task::JoinHandle<Result<u32, CoordinatorError>>;

fn spawn_submit(coalescer: &Coalescer<Command, u32>, command: Command) -> Submitted {
    let coalescer = coalescer.clone();
    tokio::spawn(async move { coalescer.submit(command).await })
}
