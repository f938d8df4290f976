//! The coalescer on its own, with a recording executor instead of a store: which commands share
//! a round, in which order, and who is answered what.

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

impl Isolate<Command, u32> for TestIsolation {
    fn is_held(&self, command: &Command) -> bool {
        command.key.is_some_and(|key| key >= 950)
    }

    fn alone(
        &self,
        command: Command,
        _answer_by: tokio::time::Instant,
        why: WhyAlone,
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
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_shared(
        settings,
        Pace::Gate(gate.clone()),
        (executors, backlog),
        TaskTracker::new(),
    );
    (coalescer, seen, gate)
}

/// [`gated`], its batches tracked by `tasks`.
fn gated_tracked(
    settings: CoalescerSettings,
    tasks: &TaskTracker,
) -> (Coalescer<Command, u32>, Seen, Arc<Semaphore>) {
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_shared(
        settings,
        Pace::Gate(gate.clone()),
        (&held_executor(), &Backlog::new(1_000_000)),
        tasks.clone(),
    );
    (coalescer, seen, gate)
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
        &Lifecycle {
            supervisor: crate::supervise::Supervisor::new(),
            shutdown: tokio_util::sync::CancellationToken::new(),
        },
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

fn spawn_submit(
    coalescer: &Coalescer<Command, u32>,
    command: Command,
) -> tokio::task::JoinHandle<Result<u32, CoordinatorError>> {
    let coalescer = coalescer.clone();
    tokio::spawn(async move { coalescer.submit(command).await })
}

#[tokio::test]
async fn a_lone_command_runs_at_once_and_a_crowd_shares_batches() {
    let (coalescer, seen) = recording(
        settings(100, Duration::from_secs(5)),
        Duration::from_millis(20),
    );
    assert_eq!(
        coalescer
            .submit(Command::keyed(21))
            .await
            .expect("answered"),
        42
    );
    assert_eq!(
        seen.lock().expect("rounds").len(),
        1,
        "a lone command is not held back"
    );

    let handles: Vec<_> = (0..50)
        .map(|c| spawn_submit(&coalescer, Command::keyed(c)))
        .collect();
    for (c, handle) in (0..50).zip(handles) {
        assert_eq!(handle.await.expect("task").expect("answered"), c * 2);
    }
    let rounds = seen.lock().expect("rounds").len();
    assert!(rounds < 10, "fifty commands shared rounds: {rounds}");
}

#[tokio::test]
async fn a_lone_command_runs_in_its_callers_task() {
    // The executor notes the task each round runs in.
    let ran_in = Arc::new(Mutex::new(Vec::new()));
    let noted = ran_in.clone();
    let coalescer = Coalescer::start(
        "test dispatcher",
        &Lifecycle {
            supervisor: crate::supervise::Supervisor::new(),
            shutdown: tokio_util::sync::CancellationToken::new(),
        },
        settings(100, Duration::from_secs(5)),
        (&Executors::new(1), &Backlog::new(1000)),
        TaskTracker::new(),
        InFlight::default(),
        Arc::new(TestIsolation::default()),
        move |round: &Round<Command>| {
            noted.lock().expect("tasks").push(tokio::task::try_id());
            let commands: Vec<Command> = round.iter().copied().collect();
            Box::pin(async move { commands.into_iter().map(|c| Ok(c.value)).collect() })
        },
    );
    let caller = tokio::spawn(async move {
        let answer = coalescer.submit(Command::keyed(5)).await;
        (tokio::task::id(), answer)
    });
    let (caller_task, answer) = caller.await.expect("task");
    assert_eq!(answer.expect("answered"), 5);
    assert_eq!(*ran_in.lock().expect("tasks"), vec![Some(caller_task)]);
}

#[tokio::test]
async fn a_lone_command_whose_caller_stops_waiting_still_runs_to_its_end() {
    use futures::FutureExt;

    let tasks = TaskTracker::new();
    let (coalescer, seen, gate) = gated_tracked(settings(100, Duration::from_secs(5)), &tasks);
    let caller = spawn_submit(&coalescer, Command::keyed(7));
    // Its round has begun, in the caller's task, and waits at the gate; it counts among the
    // tracked tasks, so that a shutdown would wait for it.
    until_rounds(&seen, 1).await;
    assert_eq!(tasks.len(), 1, "the run in place is tracked");
    tasks.close();
    caller.abort();
    assert!(caller.await.is_err_and(|error| error.is_cancelled()));
    // The run goes on without its caller, still tracked: the command keeps its place until
    // it is answered, and the wait for the tracked tasks does not end under it.
    assert_eq!(coalescer.queued(), 1, "the run was dropped with its caller");
    assert_eq!(tasks.len(), 1, "the run on its own is tracked");
    assert!(
        tasks.wait().now_or_never().is_none(),
        "shutdown waits for it"
    );
    gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the run, on its own, got to its end");
    assert_eq!(coalescer.queued(), 0, "and answered its command");
    assert_eq!(seen.lock().expect("rounds").len(), 1, "it ran once");
}

#[tokio::test]
async fn a_lone_command_whose_run_panics_is_answered_and_its_caller_goes_on() {
    let (coalescer, _seen) = recording(settings(100, Duration::from_secs(5)), Duration::ZERO);
    // Were the panic to reach the caller, this test's own task would fail with it.
    let answer = coalescer.submit(Command::keyed(666)).await;
    assert!(
        matches!(answer, Err(CoordinatorError::TimedOut(_))),
        "{answer:?}"
    );
    assert_eq!(coalescer.submit(Command::keyed(4)).await.expect("ran"), 8);
}

#[tokio::test]
async fn duplicates_of_a_key_run_in_successive_rounds() {
    let (coalescer, seen) = recording(
        settings(100, Duration::from_secs(5)),
        Duration::from_millis(50),
    );
    // The first keeps the executor busy while the rest queue into one batch.
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    while seen.lock().expect("rounds").is_empty() {
        tokio::task::yield_now().await;
    }
    let handles: Vec<_> = [1, 2, 1, 1, 3]
        .into_iter()
        .map(|key| spawn_submit(&coalescer, Command::keyed(key)))
        .collect();
    for handle in handles {
        handle.await.expect("task").expect("answered");
    }
    blocker.await.expect("task").expect("answered");
    let keys: Vec<Vec<Option<u32>>> = seen
        .lock()
        .expect("rounds")
        .iter()
        .map(|round| round.iter().map(|c| c.key).collect())
        .collect();
    assert_eq!(
        keys,
        vec![
            vec![Some(99)],
            vec![Some(1), Some(2), Some(3)],
            vec![Some(1)],
            vec![Some(1)]
        ]
    );
}

/// Commands of key 1 worth `values`, queued into one batch behind a blocker: each one's
/// answer (None for an error), and the values of every round the executor was given.
async fn one_batch_of_key_one(values: &[u32]) -> (Vec<Option<u32>>, Vec<Vec<u32>>) {
    let (coalescer, seen, gate) = gated(settings(100, Duration::from_secs(5)));
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    until_rounds(&seen, 1).await;
    let handles: Vec<_> = values
        .iter()
        .map(|&value| {
            let command = Command {
                key: Some(1),
                value,
                weight: 1,
            };
            spawn_submit(&coalescer, command)
        })
        .collect();
    until_holding(&coalescer, values.len() + 1).await;
    gate.add_permits(100);
    blocker.await.expect("task").expect("answered");
    let mut answers = Vec::new();
    for handle in handles {
        answers.push(handle.await.expect("task").ok());
    }
    let ran = seen
        .lock()
        .expect("rounds")
        .iter()
        .map(|round| round.iter().map(|c| c.value).collect())
        .collect();
    (answers, ran)
}

#[tokio::test]
async fn a_duplicate_its_earlier_answer_decides_runs_no_round_of_its_own() {
    // A command that runs, two that follow its answer, one that runs again, and one that
    // follows the second answer.
    let (answers, ran) = one_batch_of_key_one(&[1, 1000, 1001, 3, 1002]).await;
    assert_eq!(answers, [2, 3, 3, 6, 7].map(Some));
    assert_eq!(
        ran,
        vec![vec![99], vec![1], vec![3]],
        "followers ran nothing"
    );
}

#[tokio::test]
async fn after_a_store_failure_the_next_command_of_the_key_runs_itself() {
    // The first fails: nobody knows how the key stands, so the would-be follower runs, and
    // the one after it follows that one's answer.
    let (answers, ran) = one_batch_of_key_one(&[777, 1000, 1001]).await;
    assert_eq!(answers, vec![None, Some(2000), Some(2001)]);
    assert_eq!(ran, vec![vec![99], vec![777], vec![1000]]);
}

#[tokio::test]
async fn a_command_that_waited_past_its_budget_is_not_run() {
    let budget = Duration::from_millis(50);
    let (coalescer, seen, gate) = gated(settings(1, budget));
    let first = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    let second = spawn_submit(&coalescer, Command::keyed(2));
    until_holding(&coalescer, 2).await;
    // The second has queued; the first holds the executor past its budget.
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(100);
    let second = second.await.expect("task");
    assert!(
        matches!(second, Err(CoordinatorError::TimedOut(_))),
        "{second:?}"
    );
    assert_eq!(first.await.expect("task").expect("ran"), 2);
    assert_eq!(
        seen.lock().expect("rounds").len(),
        1,
        "the late one never ran"
    );
}

#[tokio::test]
async fn a_later_round_runs_only_commands_still_within_their_budget() {
    // The executor is held by a gate, so that what waits and how long is the test's order
    // of events, not a guess about how fast a loaded machine spawns tasks.
    let budget = Duration::from_millis(100);
    let (coalescer, seen, gate) = gated(settings(100, budget));
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    until_rounds(&seen, 1).await;
    let once = spawn_submit(&coalescer, Command::keyed(1));
    let twice = spawn_submit(&coalescer, Command::keyed(1));
    until_holding(&coalescer, 3).await;
    // Both have queued; the blocker holds the executor past their budget: neither runs.
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(1);
    blocker.await.expect("task").expect("answered");
    assert!(matches!(
        once.await.expect("task"),
        Err(CoordinatorError::TimedOut(_))
    ));
    assert!(matches!(
        twice.await.expect("task"),
        Err(CoordinatorError::TimedOut(_))
    ));

    // Two commands of one key: the first's round holds the executor past the budget of
    // the second, whose round (the next) must then not start.
    let first = spawn_submit(&coalescer, Command::keyed(7));
    until_rounds(&seen, 2).await;
    let second = spawn_submit(&coalescer, Command::keyed(7));
    until_holding(&coalescer, 2).await;
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(1);
    assert_eq!(first.await.expect("task").expect("ran"), 14);
    let second = second.await.expect("task");
    assert!(
        matches!(second, Err(CoordinatorError::TimedOut(_))),
        "the duplicate's round would start after its budget: {second:?}"
    );
    let ran: Vec<Vec<Option<u32>>> = seen
        .lock()
        .expect("rounds")
        .iter()
        .map(|round| round.iter().map(|c| c.key).collect())
        .collect();
    assert_eq!(ran, vec![vec![Some(99)], vec![Some(7)]]);
}

#[tokio::test]
async fn batches_close_at_their_weight_and_a_heavy_command_runs_alone() {
    let (coalescer, seen, gate) = gated(settings(10, Duration::from_secs(5)));
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    until_rounds(&seen, 1).await;
    let weights = [4, 4, 4, 30, 1];
    let mut handles = Vec::new();
    for (value, &weight) in weights.iter().enumerate() {
        let command = Command {
            key: None,
            value: value as u32,
            weight,
        };
        handles.push(spawn_submit(&coalescer, command));
        // Queued in this order, all while the blocker holds the executor.
        let queued: usize = weights[..=value].iter().sum();
        until_holding(&coalescer, 1 + queued).await;
    }
    gate.add_permits(100);
    for (value, handle) in handles.into_iter().enumerate() {
        assert_eq!(handle.await.expect("task").expect("ran"), value as u32 * 2);
    }
    blocker.await.expect("task").expect("answered");
    let batches: Vec<Vec<usize>> = seen
        .lock()
        .expect("rounds")
        .iter()
        .skip(1)
        .map(|round| round.iter().map(|c| c.weight).collect())
        .collect();
    assert_eq!(batches, vec![vec![4, 4], vec![4], vec![30], vec![1]]);
}

#[tokio::test]
async fn a_full_queue_refuses_at_once_without_running() {
    let (coalescer, seen, gate) = gated(CoalescerSettings {
        queue_capacity: 2,
        ..settings(1, Duration::from_secs(5))
    });
    let running = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    // The running command holds one place until it is answered: one more fits, and the
    // other three are refused at once, all while the executor is held.
    let queued: Vec<_> = (2..6)
        .map(|key| spawn_submit(&coalescer, Command::keyed(key)))
        .collect();
    while queued.iter().filter(|handle| handle.is_finished()).count() < 3 {
        tokio::task::yield_now().await;
    }
    until_holding(&coalescer, 2).await;
    gate.add_permits(100);
    let mut refused = 0;
    let mut answered = 0;
    for handle in queued {
        match handle.await.expect("task") {
            Err(CoordinatorError::Busy) => refused += 1,
            Ok(_) => answered += 1,
            Err(other) => panic!("unexpected: {other:?}"),
        }
    }
    running.await.expect("task").expect("ran");
    assert_eq!((answered, refused), (1, 3));
    let overflow = coalescer.submit(Command::keyed(9)).await;
    assert_eq!(overflow.expect("an empty queue takes it again"), 18);
    let ran = seen.lock().expect("rounds").len();
    assert_eq!(ran, 1 + answered + 1, "refused commands never ran");
}

/// Two kinds share the executor and a backlog of 4 places, the second kind's calls taking
/// two places each: while the first kind holds 3, a call of the second is refused at once
/// although its own queue is empty, and the first kind may still take the last place; once
/// the work is answered, the second kind is served.
#[tokio::test]
async fn kinds_sharing_the_executors_share_one_backlog() {
    let (executors, backlog) = (Executors::new(1), Backlog::new(4));
    let (first, first_seen, first_gate) =
        gated_sharing(settings(1, Duration::from_secs(5)), &executors, &backlog);
    let (second, _, second_gate) = gated_sharing(
        CoalescerSettings {
            places_per_weight: 2,
            ..settings(1, Duration::from_secs(5))
        },
        &executors,
        &backlog,
    );
    let mut first_calls = vec![spawn_submit(&first, Command::keyed(1))];
    until_rounds(&first_seen, 1).await;
    first_calls.extend((2..4).map(|key| spawn_submit(&first, Command::keyed(key))));
    until_holding(&first, 3).await;
    assert!(
        matches!(
            second.submit(Command::keyed(10)).await,
            Err(CoordinatorError::Busy)
        ),
        "the backlog has one place left, the call needs two"
    );
    first_calls.push(spawn_submit(&first, Command::keyed(4)));
    until_holding(&first, 4).await;
    first_gate.add_permits(100);
    second_gate.add_permits(100);
    for call in first_calls {
        call.await.expect("task").expect("answered");
    }
    assert_eq!(second.submit(Command::keyed(10)).await.expect("served"), 20);
}

#[tokio::test]
async fn the_calls_of_a_statement_that_met_a_held_key_leave_it_and_run_alone() {
    let isolation = Arc::new(TestIsolation::default());
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_isolated(
        settings(100, Duration::from_secs(5)),
        Pace::Gate(gate.clone()),
        (&Executors::new(1), &Backlog::new(1_000_000)),
        TaskTracker::new(),
        isolation.clone(),
    );
    // The first call runs alone and holds the executor at the gate; the next three queue and
    // form one batch, in which key 900 is held.
    let first = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    let queued: Vec<_> = [2, 900, 3]
        .into_iter()
        .map(|key| spawn_submit(&coalescer, Command::keyed(key)))
        .collect();
    until_holding(&coalescer, 4).await;
    gate.add_permits(2);
    assert_eq!(first.await.expect("task").expect("answered"), 2);
    let answers: Vec<u32> = futures::future::join_all(queued)
        .await
        .into_iter()
        .map(|joined| joined.expect("task").expect("answered"))
        .collect();
    // Each call of the failed statement was answered by its run alone (value × 3), told that
    // its statement was shared.
    assert_eq!(answers, vec![6, 2700, 9]);
    let sent = isolation.sent.lock().expect("sent alone").clone();
    assert_eq!(
        sent.iter()
            .map(|(c, shared)| (c.value, *shared))
            .collect::<Vec<_>>(),
        vec![
            (2, WhyAlone::MetHeld { shared: true }),
            (900, WhyAlone::MetHeld { shared: true }),
            (3, WhyAlone::MetHeld { shared: true })
        ]
    );
}

#[tokio::test]
async fn a_lone_call_of_a_held_key_runs_alone_as_its_own() {
    let isolation = Arc::new(TestIsolation::default());
    let (coalescer, seen) = recording_isolated(
        settings(100, Duration::from_secs(5)),
        Pace::Sleep(Duration::ZERO),
        (&Executors::new(1), &Backlog::new(1_000_000)),
        TaskTracker::new(),
        isolation.clone(),
    );
    assert_eq!(
        coalescer
            .submit(Command::keyed(901))
            .await
            .expect("answered"),
        2703
    );
    // A key known to be held does not even reach the executor.
    assert_eq!(
        coalescer
            .submit(Command::keyed(950))
            .await
            .expect("answered"),
        2850
    );
    assert_eq!(seen.lock().expect("rounds").len(), 1);
    let sent = isolation.sent.lock().expect("sent alone").clone();
    assert_eq!(
        sent.iter()
            .map(|(c, shared)| (c.value, *shared))
            .collect::<Vec<_>>(),
        vec![
            (901, WhyAlone::MetHeld { shared: false }),
            (950, WhyAlone::KnownHeld)
        ]
    );
}

#[tokio::test]
async fn the_calls_behind_a_stalled_round_run_beside_it() {
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_shared(
        settings(100, Duration::from_secs(5)),
        Pace::Gate(gate.clone()),
        (
            &Executors::new(1).with_stalled_statements(1),
            &Backlog::new(1_000_000),
        ),
        TaskTracker::new(),
    );
    // The first round stalls at the gate, holding the executor; the call queued behind it waits
    // STALLED_AFTER for the executor, then runs in a round of its own beside it.
    let stalled = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    let behind = spawn_submit(&coalescer, Command::keyed(2));
    until_rounds(&seen, 2).await;
    assert!(!stalled.is_finished(), "the first round still stalls");
    // Only one place beside the executor: a third call waits for either.
    let third = spawn_submit(&coalescer, Command::keyed(3));
    until_holding(&coalescer, 3).await;
    tokio::time::sleep(super::queue::STALLED_AFTER * 3).await;
    assert_eq!(seen.lock().expect("rounds").len(), 2, "no third round yet");
    gate.add_permits(3);
    assert_eq!(stalled.await.expect("task").expect("answered"), 2);
    assert_eq!(behind.await.expect("task").expect("answered"), 4);
    assert_eq!(third.await.expect("task").expect("answered"), 6);
}
