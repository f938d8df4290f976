//! Request coalescing: calls that arrive together share one statement and one commit.
//!
//! Callers queue their commands; a dispatcher takes the first one waiting, then waits for a free
//! executor (the store is busy while all of them run), and closes the batch with whatever else
//! queued meanwhile, up to a bound. A lone call on an idle store is therefore sent at once, on
//! its own: there is no timer; a call that finds nothing queued or running and an executor free
//! does not even wait for the dispatcher, and runs its batch of one itself, in its own task
//! (no task spawned, no hand-off between tasks; should its caller stop waiting, what is left of
//! the run is spawned then, so that store work that has begun still runs to its end). Under
//! load, batches grow exactly as long as the store is busy, which is when sharing a round trip
//! and a commit pays.
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
//!
//! The parts, in the order a command meets them:
//!
//! - `queue`: taking a place in the bounded queue and the shared [`Backlog`], or running at once
//!   on an idle coalescer ([`Coalescer::submit`]), in the caller's task (`in_place`);
//! - `forming`: the dispatcher, which closes a batch once an [`Executors`] permit is free;
//! - `run`: a batch's rounds, each one statement, within the commands' budgets;
//! - `answer`: each caller answered from its round, or from its key's earlier answer
//!   ([`FollowsEarlier`]).

mod answer;
mod forming;
mod in_place;
mod queue;
mod run;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use answer::FollowsEarlier;
pub use queue::{Backlog, Executors};

use super::CoordinatorError;
use super::in_flight::InFlight;
use crate::domain::batch::{Batchable, Round};
use crate::store::StoreError;
use crate::supervise::Lifecycle;
use queue::Pending;

/// A round's statement, as the store runs it: it borrows the round, whose commands the batch
/// keeps (a call whose key was held runs again alone with its own).
pub type RoundFuture<'a, R> = Pin<Box<dyn Future<Output = Vec<Result<R, StoreError>>> + Send + 'a>>;

/// [`Isolate::find_held`]'s work.
pub type FindHeldFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// A call's answer from a run of its own (see [`Isolate`]).
pub type AloneFuture<R> = Pin<Box<dyn Future<Output = Result<R, CoordinatorError>> + Send>>;

/// Why a call runs on its own (see [`Isolate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhyAlone {
    /// Its key is remembered as held: it goes to the held-key lane at once.
    KnownHeld,
    /// Its statement met a held key; `shared`: the statement carried other calls, so the held
    /// key may be theirs.
    MetHeld { shared: bool },
    /// A cluster's placement gate refused its statement while its namespace is between two
    /// clusters (a move's cut-over): it waits for the switch on its own, not in the round,
    /// whose other calls are answered meanwhile.
    Placed,
}

/// How a call leaves the shared path when a key is held (`service::held_keys`).
pub trait Isolate<C, R>: Send + Sync {
    /// Whether `command`'s key is known to be held: it then runs on its own at once, and no
    /// shared statement waits for it.
    fn is_held(&self, command: &C) -> bool;

    /// `command` on its own, answered by `answer_by`: once more briefly when its shared
    /// statement met a held key (maybe another call's), and patiently, in the held-key lane,
    /// when its own key is held. Once `gone` is cancelled (its caller stopped waiting), it
    /// leaves any queue it waits in and starts no statement.
    /// Learns which of `commands`' keys are held, their shared statement having met a held key
    /// without saying whose (before each runs on its own), by `answer_by`.
    fn find_held<'a>(&'a self, commands: Vec<&'a C>, answer_by: Instant) -> FindHeldFuture<'a>;

    fn alone(
        &self,
        command: C,
        answer_by: Instant,
        why: WhyAlone,
        gone: CancellationToken,
    ) -> AloneFuture<R>;
}

/// A formed batch's run, which holds an executor's permit until it is done. Boxed: it is built
/// in one place and run in another (a task of its own, or its caller's task), and a pointer is
/// cheaper to move than the run's state.
type BatchRun = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Forms a batch's run (and records the batch's size). The dispatcher spawns it as a tracked
/// task; a call that found the coalescer idle runs it in its own task.
type PrepareBatch<C, R> =
    Arc<dyn Fn(Vec<Pending<C, R>>, usize, OwnedSemaphorePermit) -> BatchRun + Send + Sync>;

/// The queue of one kind of command.
pub struct Coalescer<C, R> {
    queue: mpsc::UnboundedSender<Pending<C, R>>,
    /// The executors' permits, shared with the dispatcher: a call that finds the coalescer idle
    /// takes one itself and skips the dispatcher's hand-off.
    executors: Arc<Semaphore>,
    prepare_batch: PrepareBatch<C, R>,
    /// Where batch runs are tracked, so that shutdown waits for them: the dispatcher's, and a
    /// run in place whose caller stopped waiting.
    tasks: TaskTracker,
    /// The weight that may still queue (see [`CoalescerSettings::queue_capacity`]).
    room: Arc<Semaphore>,
    /// Where a call whose key is held goes.
    isolation: Arc<dyn Isolate<C, R>>,
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
            prepare_batch: self.prepare_batch.clone(),
            tasks: self.tasks.clone(),
            room: self.room.clone(),
            isolation: self.isolation.clone(),
            queue_capacity: self.queue_capacity,
            backlog: self.backlog.clone(),
            places_per_weight: self.places_per_weight,
            wait_budget: self.wait_budget,
            timeout: self.timeout,
            in_flight: self.in_flight.clone(),
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

impl<C, R> Coalescer<C, R>
where
    C: Batchable + FollowsEarlier<R> + Clone + Send + Sync + 'static,
    R: Send + 'static,
{
    /// Starts the dispatcher, an essential task named `name` of `lifecycle` (it ends only once
    /// every handle is dropped, after shutdown). `execute` runs one round (no two
    /// commands share a conflict key) and answers one result per command, in order. Batches
    /// run as tasks of `tasks`, so that shutdown waits for them. A call whose key is held runs
    /// on its own through `isolation`.
    #[allow(clippy::too_many_arguments)]
    pub fn start<F>(
        name: &'static str,
        lifecycle: &Lifecycle,
        settings: CoalescerSettings,
        (executors, backlog): (&Executors, &Backlog),
        tasks: TaskTracker,
        in_flight: InFlight,
        isolation: Arc<dyn Isolate<C, R>>,
        execute: F,
    ) -> Self
    where
        F: for<'a> Fn(&'a Round<C>) -> RoundFuture<'a, R> + Send + Sync + 'static,
    {
        let (queue, waiting) = mpsc::unbounded_channel::<Pending<C, R>>();
        let queue_capacity = settings.queue_capacity.clamp(1, Semaphore::MAX_PERMITS);
        let stalls = executors.stalls();
        let executors = executors.permits();
        let execute = Arc::new(execute);
        let timeout = settings.timeout;
        let db_system = settings.db_system;
        // The metrics label: the operation, the last word of the name.
        let label = name.rsplit(' ').next().unwrap_or(name);
        let alone = run::Alone {
            isolation: isolation.clone(),
            tasks: tasks.clone(),
        };
        let prepare_batch: PrepareBatch<C, R> = Arc::new(
            move |batch: Vec<Pending<C, R>>, weight: usize, permit: OwnedSemaphorePermit| {
                metrics::histogram!("idempotency_coalesced_batch_size", "coalescer" => label)
                    .record(weight as f64);
                let execute = execute.clone();
                let alone = alone.clone();
                Box::pin(async move {
                    run::run_batch(batch, execute.as_ref(), &alone, timeout, (label, db_system))
                        .await;
                    drop(permit);
                })
            },
        );
        lifecycle.spawn(
            name,
            forming::dispatch(
                waiting,
                (executors.clone(), stalls),
                settings.max_batch.max(1),
                (prepare_batch.clone(), tasks.clone()),
            ),
        );
        Self {
            queue,
            executors,
            prepare_batch,
            tasks,
            room: Arc::new(Semaphore::new(queue_capacity)),
            isolation,
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
}
