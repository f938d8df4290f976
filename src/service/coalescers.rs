//! The coordinator's coalescers (`coalesce`): one for each kind of command that shares
//! statements (TryStart, Complete, MarkProcessed), with their executors and backlog. A store on
//! several clusters gets one set per cluster (`AnyStore::partitions`), each with executors of its
//! own: a round never spans two clusters, and a cluster that stalls holds its own executors and
//! rounds, never another's.

use std::time::Duration;

use tokio_util::task::TaskTracker;

use super::coalesce::{
    Backlog, Coalescer, CoalescerSettings, Executors, FollowsEarlier, RoundFuture,
};
use super::held_keys::RunsAlone;
use super::{Coalescing, InFlight, Isolation, db_system};
use crate::domain::batch::{Batchable, Round};
use crate::domain::budget::TimeBudget;
use crate::domain::{
    CompleteCommand, Completion, MarkProcessedCommand, ProcessedEvent, Rejection, TryStartCommand,
    TryStartOutcome,
};
use crate::store::{AnyStore, Store};
use crate::supervise::Lifecycle;

#[derive(Clone)]
pub(super) struct Coalescers {
    pub(super) try_start: Coalescer<TryStartCommand, TryStartOutcome>,
    pub(super) complete: Coalescer<CompleteCommand, Result<Completion, Rejection>>,
    pub(super) mark_processed: Coalescer<MarkProcessedCommand, Vec<ProcessedEvent>>,
}

/// What every coalescer of a coordinator is started with.
pub(super) struct Dispatch<'a> {
    pub(super) lifecycle: &'a Lifecycle,
    pub(super) tasks: &'a TaskTracker,
    pub(super) in_flight: &'a InFlight,
    pub(super) store: &'a AnyStore,
    pub(super) isolation: &'a Isolation,
}

/// A MarkProcessed batch is bounded by its ids, this many per call of a TryStart batch (4096
/// ids by default): a call carries up to 1000.
const MARK_IDS_PER_BATCH_SLOT: usize = 16;

/// How many full batches may be queued or running, per executor: of one kind, and of all kinds
/// together (the coalescers share their executors, and `coalesce::Backlog`). Past that, the
/// wait would outlast the queue budget anyway: refusing at once is kinder.
const QUEUED_BATCHES: usize = 16;

impl Dispatch<'_> {
    /// One set of coalescers, sharing executors and a backlog of their own.
    pub(super) fn coalescers(
        &self,
        coalescing: Coalescing,
        operation_timeout: Duration,
    ) -> Coalescers {
        let queue_capacity = coalescing
            .executors
            .max(1)
            .saturating_mul(coalescing.max_batch.max(1))
            .saturating_mul(QUEUED_BATCHES);
        let executors = Executors::new(coalescing.executors);
        // As much as one kind's queue holds: a call of TryStart or Complete takes as many
        // places as a MarkProcessed of MARK_IDS_PER_BATCH_SLOT ids.
        let backlog = Backlog::new(queue_capacity.saturating_mul(MARK_IDS_PER_BATCH_SLOT));
        let shared = (&executors, &backlog);
        let settings = CoalescerSettings {
            max_batch: coalescing.max_batch,
            queue_capacity,
            places_per_weight: MARK_IDS_PER_BATCH_SLOT,
            wait_budget: TimeBudget::of(operation_timeout).queue_wait,
            timeout: operation_timeout,
            db_system: db_system(self.store),
        };
        let mark_settings = CoalescerSettings {
            max_batch: coalescing.max_batch.saturating_mul(MARK_IDS_PER_BATCH_SLOT),
            queue_capacity: queue_capacity.saturating_mul(MARK_IDS_PER_BATCH_SLOT),
            places_per_weight: 1,
            ..settings
        };
        Coalescers {
            try_start: self.start(
                "coalescer dispatcher: TryStart",
                (settings, shared),
                |store, round| Box::pin(async move { store.try_start_batch(round).await }),
            ),
            complete: self.start(
                "coalescer dispatcher: Complete",
                (settings, shared),
                |store, round| Box::pin(async move { store.complete_batch(round).await }),
            ),
            mark_processed: self.start(
                "coalescer dispatcher: MarkProcessed",
                (mark_settings, shared),
                |store, round| Box::pin(async move { store.mark_processed_batch(round).await }),
            ),
        }
    }

    /// The coalescer of one kind of command, whose rounds `run` sends to the store.
    fn start<C>(
        &self,
        name: &'static str,
        (settings, shared): (CoalescerSettings, (&Executors, &Backlog)),
        run: for<'r> fn(AnyStore, &'r Round<C>) -> RoundFuture<'r, C::Answer>,
    ) -> Coalescer<C, C::Answer>
    where
        C: Batchable + FollowsEarlier<C::Answer> + RunsAlone + Clone,
    {
        let store = self.store.clone();
        Coalescer::start(
            name,
            self.lifecycle,
            settings,
            shared,
            self.tasks.clone(),
            self.in_flight.clone(),
            std::sync::Arc::new(self.isolation.clone()),
            move |round| run(store.clone(), round),
        )
    }
}

/// Each kind's queue, for the metrics: its name, the weight queued or running in it (summed
/// over the sets), and the most it takes.
pub(super) fn queues(sets: &[Coalescers]) -> Vec<(&'static str, usize, usize)> {
    let mut queues = vec![
        ("TryStart", 0, 0),
        ("Complete", 0, 0),
        ("MarkProcessed", 0, 0),
    ];
    for set in sets {
        add(&mut queues[0], &set.try_start);
        add(&mut queues[1], &set.complete);
        add(&mut queues[2], &set.mark_processed);
    }
    queues
}

fn add<C, R>(queue: &mut (&'static str, usize, usize), coalescer: &Coalescer<C, R>)
where
    C: Batchable + FollowsEarlier<R> + Clone + Send + Sync + 'static,
    R: Send + 'static,
{
    queue.1 += coalescer.queued();
    queue.2 += coalescer.capacity();
}
