//! Answering the callers: each from its round's result, and a later command of the same key
//! from the answer its earlier command just got, when that answer decides it
//! ([`FollowsEarlier`]).

use std::collections::HashMap;

use tokio::sync::oneshot;

use super::queue::{Held, Pending};
use crate::domain::{
    CompleteCommand, Completion, MarkProcessedCommand, ProcessedEvent, Rejection, TryStartCommand,
    TryStartOutcome,
};
use crate::service::CoordinatorError;

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

/// A command of a round, waiting for the round's result.
pub(super) struct Waiter<C, R> {
    /// Its place in the batch.
    pub(super) position: usize,
    /// A copy of the command, kept only when a later command of its key may follow it.
    pub(super) earlier: Option<C>,
    /// When its caller stops waiting.
    pub(super) answer_by: tokio::time::Instant,
    pub(super) reply: oneshot::Sender<Result<R, CoordinatorError>>,
    pub(super) held: Held,
}

/// Answers each of a round's `waiters` with its result (in order), and then every later
/// command of its key that the answer decides, which is taken out of `pending` and so runs in
/// no round of its own.
pub(super) fn answer_round<C, R>(
    waiters: Vec<Waiter<C, R>>,
    results: Vec<Result<R, CoordinatorError>>,
    pending: &mut [Option<Pending<C, R>>],
    next_of_key: &[Option<usize>],
    label: &'static str,
) where
    C: FollowsEarlier<R>,
{
    let mut results = results.into_iter();
    for waiter in waiters {
        let result = results.next().unwrap_or(Err(CoordinatorError::Inconsistent(
            "a batch answered fewer results than it had commands",
        )));
        // Only a store's answer is followed: after an error nobody knows how the key
        // stands, and the next call of the key runs in its round.
        if let (Some(earlier), Ok(answer)) = (&waiter.earlier, &result) {
            let mut later = next_of_key[waiter.position];
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
        let _ = waiter.reply.send(result);
        drop(waiter.held);
    }
}

/// For each of `items`, the position of the next item with the same key, if any.
pub(super) fn next_of_same_key<T, K: Eq + std::hash::Hash>(
    items: &[T],
    key: impl Fn(&T) -> Option<K>,
) -> Vec<Option<usize>> {
    let mut next = vec![None; items.len()];
    // A lone item has no other of its key: no key to make, no map to fill.
    if items.len() < 2 {
        return next;
    }
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
