//! Running a batch: round by round, so that no statement carries two commands for the same
//! key, each round one statement within the time its callers still wait.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use super::answer::{self, Waiter};
use super::queue::Pending;
use super::{FollowsEarlier, Isolate, RoundFuture, WhyAlone};
use crate::domain::batch::{Batchable, Round, round_numbers};
use crate::service::CoordinatorError;
use crate::store::StoreError;

/// Where the calls of a round whose key was held go: each to a run of its own, in a tracked
/// task, so that the batch (and the executor it holds) does not wait for them.
pub(super) struct Alone<C, R> {
    pub(super) isolation: Arc<dyn Isolate<C, R>>,
    pub(super) tasks: TaskTracker,
}

impl<C, R> Clone for Alone<C, R> {
    fn clone(&self) -> Self {
        Self {
            isolation: self.isolation.clone(),
            tasks: self.tasks.clone(),
        }
    }
}

impl<C: Send + Sync + 'static, R: Send + 'static> Alone<C, R> {
    /// Sends each of a round's calls that met a held key to a run of its own. When the round
    /// carried other calls too (`shared`), the store is first asked which keys are held, in one
    /// statement, so that only their calls wait for them, and the others run again at once.
    fn send_all(&self, left: Vec<(Waiter<C, R>, C, bool)>) {
        if !left.iter().any(|(_, _, shared)| *shared) {
            for (waiter, command, shared) in left {
                self.send(waiter, command, shared);
            }
            return;
        }
        let alone = self.clone();
        self.tasks.spawn(async move {
            let answer_by = left.iter().map(|(waiter, _, _)| waiter.answer_by).min();
            if let Some(answer_by) = answer_by {
                let commands = left.iter().map(|(_, command, _)| command).collect();
                alone.isolation.find_held(commands, answer_by).await;
            }
            for (waiter, command, shared) in left {
                alone.send(waiter, command, shared);
            }
        });
    }

    fn send(&self, waiter: Waiter<C, R>, command: C, shared: bool) {
        self.send_because(waiter, command, WhyAlone::MetHeld { shared });
    }

    fn send_because(&self, waiter: Waiter<C, R>, command: C, why: WhyAlone) {
        let gone = CancellationToken::new();
        let run = self
            .isolation
            .alone(command, waiter.answer_by, why, gone.clone());
        let (mut reply, held) = (waiter.reply, waiter.held);
        self.tasks.spawn(async move {
            tokio::pin!(run);
            let answer = tokio::select! {
                answer = &mut run => answer,
                // Its caller stopped waiting: the run leaves any queue it is in, and a
                // statement it started ends as it would have.
                () = reply.closed() => {
                    gone.cancel();
                    run.await
                }
            };
            let _ = reply.send(answer);
            drop(held);
        });
    }
}

/// Runs a batch round by round, answering each command as soon as its round is done, and each
/// command that its key's previous answer decides ([`FollowsEarlier`]) as soon as that answer
/// comes. A command whose round met a held key is answered by a run of its own ([`Alone`]).
pub(super) async fn run_batch<C, R, F>(
    batch: Vec<Pending<C, R>>,
    execute: &F,
    alone: &Alone<C, R>,
    timeout: Duration,
    (label, db_system): (&'static str, &'static str),
) where
    C: Batchable + FollowsEarlier<R> + Clone + Send + Sync + 'static,
    R: Send + 'static,
    F: for<'a> Fn(&'a Round<C>) -> RoundFuture<'a, R>,
{
    let numbers = round_numbers(&batch, |pending| pending.command.conflict_key());
    let next_of_key = answer::next_of_same_key(&batch, |pending| pending.command.conflict_key());
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
        let mut waiters: Vec<Waiter<C, R>> = Vec::with_capacity(due.len());
        for (position, call) in due {
            // A copy for the calls of the same key after it to be judged by, if any may be.
            let earlier =
                (C::FOLLOWS && next_of_key[position].is_some()).then(|| call.command.clone());
            commands.push(call.command);
            waiters.push(Waiter {
                position,
                earlier,
                answer_by: call.answer_by,
                reply: call.reply,
                held: call.held,
            });
        }
        let results = match Round::new(commands) {
            // Boxed (`RoundFuture`): the store's future is large, and this one is moved whole
            // into the box that holds the batch's run (`BatchRun`); a pointer is cheaper to
            // move than the state it points to.
            Ok(round) => match timed(label, nobody_waits_after, execute(&round))
                .instrument(statement)
                .await
            {
                Ok(results) => {
                    let (kept, answers) = leave_if_held(waiters, round, results, alone);
                    waiters = kept;
                    answers
                }
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
        answer::answer_round(waiters, results, &mut pending, &next_of_key, label);
    }
}

/// The round's `waiters` that keep their place, with their answers from `results`: each call
/// whose key was held, or whose namespace is in a move's cut-over (its statement wrote nothing),
/// leaves for a run of its own, with its command, and is answered from there.
#[allow(clippy::type_complexity)]
fn leave_if_held<C: Send + Sync + 'static, R: Send + 'static>(
    waiters: Vec<Waiter<C, R>>,
    round: Round<C>,
    results: Vec<Result<R, StoreError>>,
    alone: &Alone<C, R>,
) -> (Vec<Waiter<C, R>>, Vec<Result<R, CoordinatorError>>) {
    let mut kept = Vec::with_capacity(waiters.len());
    let mut answers = Vec::with_capacity(waiters.len());
    let mut left = Vec::new();
    let mut results = results.into_iter();
    for (waiter, command) in waiters.into_iter().zip(round) {
        let result = results.next().unwrap_or(Err(StoreError::Inconsistent(
            "a batch answered fewer results than it had commands",
        )));
        if result.as_ref().err().and_then(StoreError::placed).is_some() {
            alone.send_because(waiter, command, WhyAlone::Placed);
            continue;
        }
        match result.as_ref().err().and_then(StoreError::key_held) {
            Some(shared) => left.push((waiter, command, shared)),
            None => {
                kept.push(waiter);
                answers.push(result.map_err(CoordinatorError::Store));
            }
        }
    }
    if !left.is_empty() {
        alone.send_all(left);
    }
    (kept, answers)
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
    let span = crate::service::statement_span(label, db_system, &first.span, count);
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
