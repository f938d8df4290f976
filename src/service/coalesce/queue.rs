//! The queue and the backlog: what a command holds from the moment it is submitted until it is
//! answered, and the bounds that refuse it at once instead of queueing it past its budget.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Span;

use super::in_place::InPlace;
use super::{Coalescer, WhyAlone};
use crate::domain::batch::Batchable;
use crate::service::CoordinatorError;
use crate::service::in_flight::InFlightGuard;

/// A command on its way: queued, in a batch, or running.
pub(super) struct Pending<C, R> {
    pub(super) command: C,
    /// The command's statement may start only before then.
    pub(super) run_before: Instant,
    /// Its caller stops waiting then.
    pub(super) answer_by: Instant,
    pub(super) reply: oneshot::Sender<Result<R, CoordinatorError>>,
    /// Held until the command is answered.
    pub(super) held: Held,
    /// The caller's span (traces on; `Span::none()` otherwise), which its statement's span
    /// joins.
    pub(super) span: Span,
}

/// What a command holds while it is queued or running: its place in the queue, and its count
/// among the calls in flight.
pub(super) struct Held {
    _room: OwnedSemaphorePermit,
    _backlog: OwnedSemaphorePermit,
    _in_flight: InFlightGuard,
}

/// The executors that run the shared statements, one set for all of a coordinator's coalescers:
/// at most this many batches, of any kind, run at once (each holds a store connection while it
/// runs). Shared, so that while TryStart's batch runs the Completes queue up behind it and go
/// in one statement, rather than in a smaller one of their own beside it: measured with
/// TryStart + Complete at 64 callers, a third fewer commits and less database CPU per operation
/// than one executor per kind, at the same throughput (BENCHMARKS.md). Permits are handed out
/// in the order they are asked for, so no kind waits behind another for more than its turn.
#[derive(Debug, Clone)]
pub struct Executors {
    permits: Arc<Semaphore>,
    /// Places for batches beside the executors, taken by a batch that has waited
    /// [`STALLED_AFTER`] for an executor (the running statements are stalled: a disk that
    /// hangs, a commit that waits), so that the calls queued behind a stalled statement start
    /// their own; at most this many at once, beyond which they wait (the store is stalled for
    /// everyone).
    stalls: Arc<Semaphore>,
}

/// How long a formed batch waits for an executor before it takes a place beside them (see
/// [`Executors`]): a statement of the service takes milliseconds; executors busy this long are
/// running stalled statements, and the calls queued behind them should not wait for those.
pub const STALLED_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

/// How many stalled statements may run beside the executors.
const STALLED_STATEMENTS: usize = 4;

impl Executors {
    pub fn new(count: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(count.clamp(1, Semaphore::MAX_PERMITS))),
            stalls: Arc::new(Semaphore::new(STALLED_STATEMENTS)),
        }
    }

    /// These executors, with at most `count` stalled statements beside them (0: a stalled
    /// statement keeps its executor).
    pub fn with_stalled_statements(self, count: usize) -> Self {
        Self {
            stalls: Arc::new(Semaphore::new(count.min(Semaphore::MAX_PERMITS))),
            ..self
        }
    }

    pub(super) fn permits(&self) -> Arc<Semaphore> {
        self.permits.clone()
    }

    pub(super) fn stalls(&self) -> Arc<Semaphore> {
        self.stalls.clone()
    }
}

/// The work that all of a coordinator's coalescers may hold, queued or running, together. Each
/// kind's own queue is sized for what the executors can start within the queue budget, and the
/// executors are shared: without a common bound, an overload of every kind at once would queue
/// several times the work that can start in time, to be answered "timed out" later instead of
/// refused at once. Counted in places: a unit of a kind's weight takes
/// [`super::CoalescerSettings::places_per_weight`] of them, so that one kind alone can still
/// fill its own queue.
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

/// `count` permits of `semaphore` at once, or [`CoordinatorError::Busy`].
fn take(
    semaphore: &Arc<Semaphore>,
    count: usize,
) -> Result<OwnedSemaphorePermit, CoordinatorError> {
    u32::try_from(count)
        .ok()
        .and_then(|count| semaphore.clone().try_acquire_many_owned(count).ok())
        .ok_or(CoordinatorError::Busy)
}

impl<C: Batchable, R> Coalescer<C, R> {
    /// Queues `command` and waits for its own result. A command that finds the coalescer
    /// idle (nothing queued or running, an executor free) runs at once as a batch of its own,
    /// without waiting for the dispatcher to take it, and in the caller's own task: the same
    /// batch the dispatcher would have made, without a task spawned for it or a hand-off
    /// between tasks to answer it ([`InPlace`] spawns what is left of it should the caller stop
    /// waiting).
    pub async fn submit(&self, command: C) -> Result<R, CoordinatorError>
    where
        R: Send + 'static,
    {
        // A key known to be held runs on its own at once: a shared statement would only wait
        // for it, and every call queued behind that statement with it.
        if self.isolation.is_held(&command) {
            let in_flight = self.in_flight.enter();
            // Cancelled when this call stops waiting (its caller gone): the run leaves its
            // queue for a place in the lane then.
            let gone = CancellationToken::new();
            let _gone_when_dropped = gone.clone().drop_guard();
            let alone = self.isolation.alone(
                command,
                Instant::now() + self.timeout,
                WhyAlone::KnownHeld,
                gone,
            );
            return match self
                .tasks
                .spawn(async move {
                    let _in_flight = in_flight;
                    alone.await
                })
                .await
            {
                Ok(answer) => answer,
                Err(join_error) => Err(CoordinatorError::TaskFailed(join_error)),
            };
        }
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
            Some(permit) => {
                let weight = pending.command.weight();
                let run = (self.prepare_batch)(vec![pending], weight, permit);
                // Answers the command before it ends: the answer below is ready at once.
                InPlace::new(run, &self.tasks).await;
            }
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
