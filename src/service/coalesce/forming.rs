//! Forming a batch: the dispatcher takes the first command waiting, waits for a free executor
//! (the store is busy while all of them run), and closes the batch with whatever else queued
//! meanwhile, up to the batch's weight. No timer: a batch grows only while the store is busy.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::task::TaskTracker;

use super::PrepareBatch;
use super::queue::{Pending, STALLED_AFTER};
use crate::domain::batch::Batchable;

/// The dispatcher's loop: each batch it forms runs as a task of `tasks`. It ends when every
/// handle of the coalescer is gone (the queue is closed and empty) or the executors are
/// closed.
pub(super) async fn dispatch<C: Batchable, R>(
    mut waiting: mpsc::UnboundedReceiver<Pending<C, R>>,
    (executors, stalls): (Arc<Semaphore>, Arc<Semaphore>),
    max_batch: usize,
    (prepare_batch, tasks): (PrepareBatch<C, R>, TaskTracker),
) {
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
        let Some(permit) = executor_or_stalled(&executors, &stalls).await else {
            return;
        };
        let (batch, weight) = close_batch(first, &mut waiting, max_batch, &mut carried);
        tasks.spawn(prepare_batch(batch, weight, permit));
    }
}

/// The batch that starts with `first`: it takes what is queued now, in order, while the
/// weight stays within `max_batch`. The first command that does not fit is `carried` to the
/// next batch, so that the order of the queue is kept.
fn close_batch<C: Batchable, R>(
    first: Pending<C, R>,
    waiting: &mut mpsc::UnboundedReceiver<Pending<C, R>>,
    max_batch: usize,
    carried: &mut Option<Pending<C, R>>,
) -> (Vec<Pending<C, R>>, usize) {
    let mut weight = first.command.weight();
    let mut batch = vec![first];
    while weight < max_batch {
        let Ok(next) = waiting.try_recv() else {
            break;
        };
        let next_weight = next.command.weight();
        if weight + next_weight > max_batch {
            *carried = Some(next);
            break;
        }
        weight += next_weight;
        batch.push(next);
    }
    (batch, weight)
}

/// A permit to run a batch: an executor's, or, once the executors have all been busy for
/// [`STALLED_AFTER`] (a statement of the service takes milliseconds: the running ones are
/// stalled, by a disk that hangs or a commit that waits), one of the few places for batches
/// beside them, so that the calls queued behind a stalled statement do not wait for it. `None`
/// once the executors are closed.
async fn executor_or_stalled(
    executors: &Arc<Semaphore>,
    stalls: &Arc<Semaphore>,
) -> Option<OwnedSemaphorePermit> {
    match tokio::time::timeout(STALLED_AFTER, executors.clone().acquire_owned()).await {
        Ok(permit) => permit.ok(),
        Err(_stalled) => {
            tokio::select! {
                permit = executors.clone().acquire_owned() => permit.ok(),
                Ok(stalled) = stalls.clone().acquire_owned() => {
                    metrics::counter!("idempotency_stalled_statements_total").increment(1);
                    Some(stalled)
                }
            }
        }
    }
}
