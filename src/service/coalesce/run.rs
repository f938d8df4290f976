//! Running a batch: round by round, so that no statement carries two commands for the same
//! key, each round one statement within the time its callers still wait.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::FollowsEarlier;
use super::answer::{self, Waiter};
use super::queue::Pending;
use crate::domain::batch::{Batchable, Round, round_numbers};
use crate::service::CoordinatorError;
use crate::store::StoreError;

/// Runs a batch round by round, answering each command as soon as its round is done, and each
/// command that its key's previous answer decides ([`FollowsEarlier`]) as soon as that answer
/// comes.
pub(super) async fn run_batch<C, R, F, Fut>(
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
        let mut waiters = Vec::with_capacity(due.len());
        for (position, call) in due {
            // A copy for the calls of the same key after it to be judged by, if any may be.
            let earlier =
                (C::FOLLOWS && next_of_key[position].is_some()).then(|| call.command.clone());
            commands.push(call.command);
            waiters.push(Waiter {
                position,
                earlier,
                reply: call.reply,
                held: call.held,
            });
        }
        let results = match Round::new(commands) {
            // Boxed: the store's future is large, and this one is moved whole into the box
            // that holds the batch's run (`BatchRun`); a pointer is cheaper to move than the
            // state it points to.
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
        answer::answer_round(waiters, results, &mut pending, &next_of_key, label);
    }
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
