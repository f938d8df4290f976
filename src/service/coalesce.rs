//! Request coalescing: calls that arrive together share one statement and one commit.
//!
//! Callers queue their commands; a dispatcher takes the first one waiting, then waits for a free
//! executor (the store is busy while all of them run), and closes the batch with whatever else
//! queued meanwhile, up to a bound. A lone call on an idle store is therefore sent at once, on
//! its own: there is no timer; a call that finds nothing queued or running and an executor free
//! does not even wait for the dispatcher, and starts its batch of one itself. Under load, batches grow exactly as long as the store is busy,
//! which is when sharing a round trip and a commit pays.
//!
//! A batch runs in rounds, so that no statement carries two commands for the same key: the
//! first command for each key in the first round, the second in the next, and so on, which
//! resolves duplicates as if the calls had come one after another.
//!
//! Deadlines. Each command may start its statement only within its queue budget (a tenth of the
//! operation timeout) of being submitted; the store's own limits (`store::Budget`) then end that
//! statement, committed or not, within the rest of the operation timeout. Before each round,
//! commands past their queue budget are answered "timed out" without being run, so a caller told
//! UNAVAILABLE for a timeout finds nothing of its command applied. The one exception is the one
//! no service can avoid: a round whose store stops answering altogether is abandoned once
//! nobody waits for it any more, and then its outcome is unknown.
//!
//! A TryStart of a key whose earlier call in the same batch has just been answered by the store
//! is answered from that answer at once, without a statement of its own, when the answer decides
//! it and it would change nothing ([`FollowsEarlier`], `domain::answer_after`): behind a key
//! held (claimed in the batch, or found in progress) every attempt but the holder's own is told
//! in progress, and behind a completed key every call with its fingerprint gets the replay; the
//! holder's own attempt re-enters, and runs in its round. A follower runs nothing, so it is not
//! held to the queue budget below.
//!
//! The queue is bounded, by weight (calls, or event ids): when it is full, a call is refused at
//! once (UNAVAILABLE, nothing written) instead of joining a line that could not be served in
//! time.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use super::CoordinatorError;
use super::in_flight::{InFlight, InFlightGuard};
use crate::domain::batch::{Batchable, Round, round_numbers};
use crate::domain::{
    CompleteCommand, Completion, MarkProcessedCommand, ProcessedEvent, Rejection, TryStartCommand,
    TryStartOutcome,
};
use crate::store::StoreError;
use crate::supervise::Lifecycle;

struct Pending<C, R> {
    command: C,
    /// The command's statement may start only before then.
    run_before: Instant,
    /// Its caller stops waiting then.
    answer_by: Instant,
    reply: oneshot::Sender<Result<R, CoordinatorError>>,
    /// Held until the command is answered.
    held: Held,
    /// The caller's span (traces on; `Span::none()` otherwise), which its statement's span
    /// joins.
    span: Span,
}

/// What a command holds while it is queued or running: its place in the queue, and its count
/// among the calls in flight.
struct Held {
    _room: OwnedSemaphorePermit,
    _backlog: OwnedSemaphorePermit,
    _in_flight: InFlightGuard,
}

/// Runs a batch of one as a tracked task of its own, holding an executor's permit.
type RunAlone<C, R> = Arc<dyn Fn(Pending<C, R>, OwnedSemaphorePermit) + Send + Sync>;

/// The queue of one kind of command.
pub struct Coalescer<C, R> {
    queue: mpsc::UnboundedSender<Pending<C, R>>,
    /// The executors' permits, shared with the dispatcher: a call that finds the coalescer idle
    /// takes one itself and skips the dispatcher's hand-off.
    executors: Arc<Semaphore>,
    run_alone: RunAlone<C, R>,
    /// The weight that may still queue (see [`CoalescerSettings::queue_capacity`]).
    room: Arc<Semaphore>,
    queue_capacity: usize,
    /// The backlog all coalescers share, and how many of its places a unit of this kind's
    /// weight takes (see [`Backlog`]).
    backlog: Backlog,
    places_per_weight: usize,
    wait_budget: Duration,
    timeout: Duration,
    in_flight: InFlight,
}

impl<C, R> Clone for Coalescer<C, R> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            executors: self.executors.clone(),
            run_alone: self.run_alone.clone(),
            room: self.room.clone(),
            queue_capacity: self.queue_capacity,
            backlog: self.backlog.clone(),
            places_per_weight: self.places_per_weight,
            wait_budget: self.wait_budget,
            timeout: self.timeout,
            in_flight: self.in_flight.clone(),
        }
    }
}

/// The executors that run the shared statements, one set for all of a coordinator's coalescers:
/// at most this many batches, of any kind, run at once (each holds a store connection while it
/// runs). Shared, so that while TryStart's batch runs the Completes queue up behind it and go
/// in one statement, rather than in a smaller one of their own beside it: measured with
/// TryStart + Complete at 64 callers, a third fewer commits and less database CPU per operation
/// than one executor per kind, at the same throughput (BENCHMARKS.md). Permits are handed out
/// in the order they are asked for, so no kind waits behind another for more than its turn.
#[derive(Debug, Clone)]
pub struct Executors(Arc<Semaphore>);

impl Executors {
    pub fn new(count: usize) -> Self {
        Self(Arc::new(Semaphore::new(
            count.clamp(1, Semaphore::MAX_PERMITS),
        )))
    }
}

/// The work that all of a coordinator's coalescers may hold, queued or running, together. Each
/// kind's own queue is sized for what the executors can start within the queue budget, and the
/// executors are shared: without a common bound, an overload of every kind at once would queue
/// several times the work that can start in time, to be answered "timed out" later instead of
/// refused at once. Counted in places: a unit of a kind's weight takes
/// [`CoalescerSettings::places_per_weight`] of them, so that one kind alone can still fill its
/// own queue.
#[derive(Debug, Clone)]
pub struct Backlog {
    places: Arc<Semaphore>,
    capacity: usize,
}

impl Backlog {
    pub fn new(places: usize) -> Self {
        let capacity = places.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            places: Arc::new(Semaphore::new(capacity)),
            capacity,
        }
    }
}

/// How a coalescer runs.
#[derive(Debug, Clone, Copy)]
pub struct CoalescerSettings {
    /// The most weight (see [`Batchable::weight`]) in one batch; a heavier command still
    /// runs, alone.
    pub max_batch: usize,
    /// The most weight queued or running; more is refused at once.
    pub queue_capacity: usize,
    /// How many places of the shared [`Backlog`] a unit of weight takes.
    pub places_per_weight: usize,
    /// How long a command may wait before its statement starts; past it, it is answered
    /// "timed out" without being run.
    pub wait_budget: Duration,
    /// The operation timeout: reported with that answer, and how long a caller waits.
    pub timeout: Duration,
    /// The database, as the statements' spans name it.
    pub db_system: &'static str,
}

/// A command that may be answered from the answer the store gave, in the same batch, to an
/// earlier command of its key, without running itself.
pub trait FollowsEarlier<R> {
    /// Whether any command of this kind may follow (when not, no copy is kept to judge by).
    const FOLLOWS: bool = false;

    /// The answer, when `earlier_answer` decides it and this command would change nothing;
    /// `None` (the default) runs it in its round.
    fn answer_after(&self, _earlier: &Self, _earlier_answer: &R) -> Option<R> {
        None
    }
}

/// See [`crate::domain::answer_after`].
impl FollowsEarlier<TryStartOutcome> for TryStartCommand {
    const FOLLOWS: bool = true;

    fn answer_after(
        &self,
        earlier: &Self,
        earlier_answer: &TryStartOutcome,
    ) -> Option<TryStartOutcome> {
        crate::domain::answer_after(earlier, earlier_answer, self)
    }
}

/// A Complete always runs: a second one of a key is judged by the token it carries.
impl FollowsEarlier<Result<Completion, Rejection>> for CompleteCommand {}

/// Marks never conflict: every call's ids share one statement.
impl FollowsEarlier<Vec<ProcessedEvent>> for MarkProcessedCommand {}

impl<C, R> Coalescer<C, R>
where
    C: Batchable + FollowsEarlier<R> + Clone + Send + 'static,
    R: Send + 'static,
{
    /// Starts the dispatcher, an essential task named `name` of `lifecycle` (it ends only once
    /// every handle is dropped, after shutdown). `execute` runs one round (no two
    /// commands share a conflict key) and answers one result per command, in order. Batches
    /// run as tasks of `tasks`, so that shutdown waits for them.
    pub fn start<F, Fut>(
        name: &'static str,
        lifecycle: &Lifecycle,
        settings: CoalescerSettings,
        (executors, backlog): (&Executors, &Backlog),
        tasks: TaskTracker,
        in_flight: InFlight,
        execute: F,
    ) -> Self
    where
        F: Fn(Round<C>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<Result<R, StoreError>>> + Send + 'static,
    {
        let (queue, mut waiting) = mpsc::unbounded_channel::<Pending<C, R>>();
        let queue_capacity = settings.queue_capacity.clamp(1, Semaphore::MAX_PERMITS);
        let executors = executors.0.clone();
        let execute = Arc::new(execute);
        let timeout = settings.timeout;
        let max_batch = settings.max_batch.max(1);
        let db_system = settings.db_system;
        // The metrics label: the operation, the last word of the name.
        let label = name.rsplit(' ').next().unwrap_or(name);
        let run_alone: RunAlone<C, R> = {
            let execute = execute.clone();
            let tasks = tasks.clone();
            Arc::new(
                move |pending: Pending<C, R>, permit: OwnedSemaphorePermit| {
                    metrics::histogram!("idempotency_coalesced_batch_size", "coalescer" => label)
                        .record(pending.command.weight() as f64);
                    let execute = execute.clone();
                    tasks.spawn(async move {
                        run_batch(vec![pending], execute.as_ref(), timeout, (label, db_system))
                            .await;
                        drop(permit);
                    });
                },
            )
        };
        let dispatcher_executors = executors.clone();
        lifecycle.spawn(name, async move {
            let executors = dispatcher_executors;
            // A command taken from the queue that did not fit the batch before it.
            let mut carried: Option<Pending<C, R>> = None;
            loop {
                let first = match carried.take() {
                    Some(pending) => pending,
                    None => match waiting.recv().await {
                        Some(pending) => pending,
                        None => return,
                    },
                };
                let Ok(permit) = executors.clone().acquire_owned().await else {
                    return;
                };
                let mut weight = first.command.weight();
                let mut batch = vec![first];
                while weight < max_batch {
                    let Ok(next) = waiting.try_recv() else {
                        break;
                    };
                    let next_weight = next.command.weight();
                    if weight + next_weight > max_batch {
                        carried = Some(next);
                        break;
                    }
                    weight += next_weight;
                    batch.push(next);
                }
                metrics::histogram!("idempotency_coalesced_batch_size", "coalescer" => label)
                    .record(weight as f64);
                let execute = execute.clone();
                tasks.spawn(async move {
                    run_batch(batch, execute.as_ref(), timeout, (label, db_system)).await;
                    drop(permit);
                });
            }
        });
        Self {
            queue,
            executors,
            run_alone,
            room: Arc::new(Semaphore::new(queue_capacity)),
            queue_capacity,
            backlog: backlog.clone(),
            places_per_weight: settings.places_per_weight.max(1),
            wait_budget: settings.wait_budget,
            timeout,
            in_flight,
        }
    }

    /// The weight queued or running now.
    pub fn queued(&self) -> usize {
        self.queue_capacity
            .saturating_sub(self.room.available_permits())
    }

    /// The most weight that may queue or run at once.
    pub fn capacity(&self) -> usize {
        self.queue_capacity
    }

    /// Queues `command` and waits for its own result. A command that finds the coalescer
    /// idle (nothing queued or running, an executor free) runs at once as a batch of its own,
    /// without waiting for the dispatcher to take it: the same batch the dispatcher would have
    /// made, one hand-off sooner.
    pub async fn submit(&self, command: C) -> Result<R, CoordinatorError> {
        // Nothing queued or running holds a place in the queue: idle. Checked before this
        // command takes its own place.
        let alone = if self.room.available_permits() == self.queue_capacity {
            self.executors.clone().try_acquire_owned().ok()
        } else {
            None
        };
        // A command heavier than the whole queue (or backlog) may still queue, alone.
        let weight = command.weight().clamp(1, self.queue_capacity);
        let places = weight
            .saturating_mul(self.places_per_weight)
            .min(self.backlog.capacity);
        let take = |semaphore: &Arc<Semaphore>, count: usize| {
            u32::try_from(count)
                .ok()
                .and_then(|count| semaphore.clone().try_acquire_many_owned(count).ok())
                .ok_or(CoordinatorError::Busy)
        };
        let room = take(&self.room, weight)?;
        let backlog = take(&self.backlog.places, places)?;
        let (reply, answer) = oneshot::channel();
        let submitted = Instant::now();
        let pending = Pending {
            command,
            run_before: submitted + self.wait_budget,
            answer_by: submitted + self.timeout,
            reply,
            held: Held {
                _room: room,
                _backlog: backlog,
                _in_flight: self.in_flight.enter(),
            },
            span: if crate::telemetry::traces_on() {
                Span::current()
            } else {
                Span::none()
            },
        };
        match alone {
            Some(permit) => (self.run_alone)(pending, permit),
            None => self
                .queue
                .send(pending)
                .map_err(|_| CoordinatorError::Inconsistent("the coalescer has stopped"))?,
        }
        answer
            .await
            .unwrap_or(Err(CoordinatorError::TimedOut(self.timeout)))
    }
}

/// Runs a batch round by round, answering each command as soon as its round is done, and each
/// command that its key's previous answer decides ([`FollowsEarlier`]) as soon as that answer
/// comes.
async fn run_batch<C, R, F, Fut>(
    batch: Vec<Pending<C, R>>,
    execute: &F,
    timeout: Duration,
    (label, db_system): (&'static str, &'static str),
) where
    C: Batchable + FollowsEarlier<R> + Clone,
    F: Fn(Round<C>) -> Fut,
    Fut: Future<Output = Vec<Result<R, StoreError>>>,
{
    let numbers = round_numbers(&batch, |pending| pending.command.conflict_key());
    let next_of_key = next_of_same_key(&batch, |pending| pending.command.conflict_key());
    let mut pending: Vec<Option<Pending<C, R>>> = batch.into_iter().map(Some).collect();
    let last_round = numbers.iter().copied().max().unwrap_or(0);
    for round in 0..=last_round {
        let now = Instant::now();
        let mut due = Vec::new();
        for (position, slot) in pending.iter_mut().enumerate() {
            if numbers.get(position) != Some(&round) {
                continue;
            }
            let Some(call) = slot.take() else { continue };
            if call.run_before < now {
                let _ = call.reply.send(Err(CoordinatorError::TimedOut(timeout)));
            } else {
                due.push((position, call));
            }
        }
        let Some(nobody_waits_after) = due.iter().map(|(_, call)| call.answer_by).max() else {
            continue;
        };
        let statement = round_span(label, db_system, due.iter().map(|(_, call)| call));
        let mut commands = Vec::with_capacity(due.len());
        let mut waiters = Vec::with_capacity(due.len());
        for (position, call) in due {
            // A copy for the calls of the same key after it to be judged by, if any may be.
            let earlier =
                (C::FOLLOWS && next_of_key[position].is_some()).then(|| call.command.clone());
            commands.push(call.command);
            waiters.push((position, earlier, call.reply, call.held));
        }
        let results = match Round::new(commands) {
            // Boxed: the store's future is large, and this one is moved whole into the task
            // that runs the batch; a pointer is cheaper to move than the state it points to.
            Ok(round) => match timed(label, nobody_waits_after, Box::pin(execute(round)))
                .instrument(statement)
                .await
            {
                Ok(results) => results
                    .into_iter()
                    .map(|result| result.map_err(CoordinatorError::Store))
                    .collect(),
                // The store's own limits end a statement before then, so only a store that
                // stopped answering gets here: the outcome is unknown, and the callers have
                // stopped waiting.
                Err(_elapsed) => (0..waiters.len())
                    .map(|_| Err(CoordinatorError::TimedOut(timeout)))
                    .collect(),
            },
            Err(_) => (0..waiters.len())
                .map(|_| Err(CoordinatorError::Inconsistent("a round held one key twice")))
                .collect::<Vec<_>>(),
        };
        let mut results = results.into_iter();
        for (position, earlier, reply, held) in waiters {
            let result = results.next().unwrap_or(Err(CoordinatorError::Inconsistent(
                "a batch answered fewer results than it had commands",
            )));
            // Only a store's answer is followed: after an error nobody knows how the key
            // stands, and the next call of the key runs in its round.
            if let (Some(earlier), Ok(answer)) = (&earlier, &result) {
                let mut later = next_of_key[position];
                while let Some(next) = later {
                    let Some(follows) = pending[next]
                        .as_ref()
                        .and_then(|call| call.command.answer_after(earlier, answer))
                    else {
                        break;
                    };
                    if let Some(call) = pending[next].take() {
                        metrics::counter!(
                            "idempotency_coalesced_followers_total",
                            "coalescer" => label
                        )
                        .increment(1);
                        let _ = call.reply.send(Ok(follows));
                    }
                    later = next_of_key[next];
                }
            }
            let _ = reply.send(result);
            drop(held);
        }
    }
}

/// For each of `items`, the position of the next item with the same key, if any.
fn next_of_same_key<T, K: Eq + std::hash::Hash>(
    items: &[T],
    key: impl Fn(&T) -> Option<K>,
) -> Vec<Option<usize>> {
    let mut next = vec![None; items.len()];
    let mut last_seen: HashMap<K, usize> = HashMap::new();
    for (position, item) in items.iter().enumerate().rev() {
        if let Some(key) = key(item)
            && let Some(following) = last_seen.insert(key, position)
        {
            next[position] = Some(following);
        }
    }
    next
}

/// The span of a round's one statement: the child of its first call's span, linked to the
/// span of every other call it carries (a span has one parent; the links lead from the shared
/// statement to each of the RPCs it served).
fn round_span<'a, C: 'a, R: 'a>(
    label: &'static str,
    db_system: &'static str,
    due: impl ExactSizeIterator<Item = &'a Pending<C, R>>,
) -> Span {
    let count = due.len();
    let mut due = due;
    let Some(first) = due.next() else {
        return Span::none();
    };
    let span = super::statement_span(label, db_system, &first.span, count);
    if !span.is_disabled() {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        for other in due {
            let context = other.span.context();
            let caller = context.span().span_context().clone();
            if caller.is_valid() {
                span.add_link(caller);
            }
        }
    }
    span
}

/// `statement` within `deadline`, its time recorded in `idempotency_store_seconds`.
async fn timed<T>(
    label: &'static str,
    deadline: Instant,
    statement: impl Future<Output = T>,
) -> Result<T, tokio::time::error::Elapsed> {
    let began = Instant::now();
    let executed = tokio::time::timeout_at(deadline, statement).await;
    metrics::histogram!("idempotency_store_seconds", "operation" => label)
        .record(began.elapsed().as_secs_f64());
    executed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

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
        gated_sharing(settings, &Executors::new(1), &Backlog::new(1_000_000))
    }

    /// [`gated`], sharing `executors` and `backlog` with other coalescers.
    fn gated_sharing(
        settings: CoalescerSettings,
        executors: &Executors,
        backlog: &Backlog,
    ) -> (Coalescer<Command, u32>, Seen, Arc<Semaphore>) {
        let gate = Arc::new(Semaphore::new(0));
        let (coalescer, seen) =
            recording_shared(settings, Pace::Gate(gate.clone()), (executors, backlog));
        (coalescer, seen, gate)
    }

    fn recording_paced(settings: CoalescerSettings, pace: Pace) -> (Coalescer<Command, u32>, Seen) {
        recording_shared(
            settings,
            pace,
            (&Executors::new(1), &Backlog::new(1_000_000)),
        )
    }

    fn recording_shared(
        settings: CoalescerSettings,
        pace: Pace,
        shared: (&Executors, &Backlog),
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
            TaskTracker::new(),
            InFlight::default(),
            move |round: Round<Command>| {
                let recorded = recorded.clone();
                let pace = pace.clone();
                let commands = round.into_commands();
                async move {
                    recorded.lock().expect("rounds").push(commands.clone());
                    match pace {
                        Pace::Sleep(pause) => tokio::time::sleep(pause).await,
                        Pace::Gate(gate) => gate.acquire().await.expect("the gate opens").forget(),
                    }
                    commands
                        .into_iter()
                        .map(|c| match c.value {
                            // A store failure, for the command worth 777.
                            777 => Err(StoreError::TimedOut(Duration::from_millis(1))),
                            value => Ok(value * 2),
                        })
                        .collect()
                }
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
        while seen.lock().expect("rounds").len() < count {
            tokio::task::yield_now().await;
        }
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
}
