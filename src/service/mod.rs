//! The service layer: runs each operation of the contract against the store, detached from the
//! caller, gathers concurrent calls into shared statements (`coalesce`), counts the calls in
//! flight (`in_flight`), and holds each call to its share of the time budget
//! (`domain::budget`).
//!
//! tonic drops a handler's future when the client cancels or its deadline passes, and the
//! server stops polling handlers when the grace period ends. Store work that has begun must not
//! be cut off half-way by either, so every operation runs in its own task (tracked, so shutdown
//! can wait for it) and is bounded by its own timeout instead. The one exception is a lone call
//! on an idle coalescer, which runs its statement in the handler's task, counted among the
//! tracked tasks, and is moved to a task of its own only if the handler is dropped
//! (`coalesce/in_place.rs`).
//!
//! That timeout is enforced by the store itself (see `domain::budget`: a bounded wait for a
//! connection, then a statement the database ends), because only the database can stop a
//! statement without leaving its outcome in doubt: an UNAVAILABLE after such a timeout means
//! nothing was written. The task's own deadline, at the full operation timeout, is reached only
//! when the connection to the store stopped answering altogether, where the outcome of a write
//! cannot be known.

use std::future::Future;
use std::time::Duration;

use tracing::{Instrument, Span};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub mod admin;
pub mod coalesce;
mod coalescers;
pub mod erasures;
pub mod held_keys;
pub mod in_flight;
pub mod replay_cache;
mod wait_for_holder;
pub mod waiting;

use coalesce::{AloneFuture, FindHeldFuture, Isolate, WhyAlone};
use coalescers::{Coalescers, Dispatch};
use held_keys::{HeldKeys, RunsAlone, Watch};
pub use in_flight::InFlight;
pub use replay_cache::ReplayCache;
pub use wait_for_holder::Waiting;

use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Instant, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome,
};
use crate::store::{AnyStore, Store, StoreError};
use crate::supervise::Lifecycle;

/// Why an operation did not produce its answer.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Too many calls are already waiting for the store; this one was not queued.
    #[error("too many calls are waiting for the store")]
    Busy,
    /// The call did not get its answer within the operation timeout (or its statement could
    /// not start within its queue budget, in which case nothing was run).
    #[error("the store did not answer within {0:?}")]
    TimedOut(Duration),
    /// The service found itself in a state its own rules exclude: a bug.
    #[error("the service is in a state it does not expect: {0}")]
    Inconsistent(&'static str),
    /// The task running the operation panicked or was aborted: a bug, reported opaquely.
    #[error("the operation's task failed")]
    TaskFailed(#[source] tokio::task::JoinError),
}

/// How concurrent TryStarts, Completes and MarkProcesseds are gathered into shared statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalescing {
    /// Batches that may run at once, of all kinds together (see [`Executors`]).
    pub executors: usize,
    /// The most calls in one batch.
    pub max_batch: usize,
}

/// The span of one store statement (a coalesced round of `calls` commands is one), the child of
/// `parent` (the RPC's span), for traces. `Span::none()` when traces are off, so that nothing is
/// paid for it. Its attributes name the operation and the database, never a key or a value.
pub(crate) fn statement_span(
    operation: &'static str,
    system: &'static str,
    parent: &Span,
    calls: usize,
) -> Span {
    if !crate::telemetry::traces_on() {
        return Span::none();
    }
    tracing::debug_span!(
        parent: parent,
        "store",
        otel.name = format!("store {operation}"),
        otel.kind = "client",
        db.system.name = system,
        db.operation.name = operation,
        db.operation.batch.size = i64::try_from(calls).unwrap_or(i64::MAX),
    )
}

/// The database's name in OpenTelemetry's conventions (`db.system.name`).
fn db_system(store: &AnyStore) -> &'static str {
    match store {
        AnyStore::Postgres(_) | AnyStore::Clusters(_) => "postgresql",
        AnyStore::Sqlite(_) => "sqlite",
    }
}

/// How a call leaves the shared path when a key is held (see `held_keys`): the registry and
/// lane of held keys, on the coordinator's store, within the operation timeout.
#[derive(Clone)]
struct Isolation {
    held: HeldKeys,
    store: AnyStore,
    timeout: Duration,
}

impl Isolation {
    /// When the store's work for a call answered by `answer_by` must end: the last twentieth of
    /// the operation is left for the answer to come back (as `domain::budget` shares it out).
    fn store_deadline(&self, answer_by: tokio::time::Instant) -> tokio::time::Instant {
        answer_by - self.timeout / 20
    }
}

impl<C: RunsAlone> Isolate<C, C::Answer> for Isolation {
    fn is_held(&self, command: &C) -> bool {
        self.held.any_held(command)
    }

    fn find_held<'a>(
        &'a self,
        commands: Vec<&'a C>,
        answer_by: tokio::time::Instant,
    ) -> FindHeldFuture<'a> {
        let deadline = self.store_deadline(answer_by);
        Box::pin(async move {
            self.held.find_held(&self.store, &commands, deadline).await;
        })
    }

    fn alone(
        &self,
        command: C,
        answer_by: tokio::time::Instant,
        why: WhyAlone,
        gone: CancellationToken,
    ) -> AloneFuture<C::Answer> {
        let (held, store, timeout) = (self.held.clone(), self.store.clone(), self.timeout);
        let deadline = self.store_deadline(answer_by);
        Box::pin(async move {
            let alone = async {
                match why {
                    WhyAlone::KnownHeld => held.in_lane(&store, &command, deadline, &gone).await,
                    WhyAlone::MetHeld { shared } => {
                        held.after_held(&store, &command, shared, deadline, &gone)
                            .await
                    }
                    // The store follows the gate and waits for the cut-over (`store::clusters`);
                    // a call refused only for sharing its statement with one in a cut-over
                    // then runs as any call on its own: should its key be held, it waits for
                    // it in the held-key lane.
                    WhyAlone::Placed => held.run(&store, &command, deadline, &gone).await,
                }
            };
            match tokio::time::timeout_at(answer_by, alone).await {
                Ok(answer) => answer.map_err(CoordinatorError::Store),
                Err(_elapsed) => Err(CoordinatorError::TimedOut(timeout)),
            }
        })
    }
}

impl CoordinatorError {
    /// Whether a caller may expect the same call to succeed later.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Busy | Self::TimedOut(_) => true,
            Self::Store(store) => store.is_transient(),
            Self::Rejected(_) | Self::TaskFailed(_) | Self::Inconsistent(_) => false,
        }
    }
}

#[derive(Clone)]
pub struct Coordinator {
    store: AnyStore,
    waiting: Option<Waiting>,
    tasks: TaskTracker,
    operation_timeout: Duration,
    /// One set per part of the store (each cluster its own: a stalled cluster's rounds hold
    /// up none of another's), unless coalescing is off.
    coalescers: Option<std::sync::Arc<[Coalescers]>>,
    in_flight: InFlight,
    /// Completed records answered from memory (see `replay_cache`), unless it is off.
    replays: Option<ReplayCache>,
    /// Held keys, and how their calls run on their own (see `held_keys`).
    isolation: Isolation,
}

impl Coordinator {
    /// `tasks` tracks every operation in flight so that shutdown can wait for them. With
    /// `coalescing`, concurrent TryStarts, Completes and MarkProcesseds share statements (see
    /// `coalesce`).
    /// `in_flight` counts the calls the store has yet to finish, whether or not their callers
    /// still wait. With `replays`, TryStart and Lookup of a completed key the cache knows are
    /// answered without the store.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: AnyStore,
        tasks: TaskTracker,
        in_flight: InFlight,
        operation_timeout: Duration,
        coalescing: Option<Coalescing>,
        waiting: Option<Waiting>,
        replays: Option<ReplayCache>,
        held: HeldKeys,
        lifecycle: &Lifecycle,
    ) -> Self {
        let isolation = Isolation {
            held,
            store: store.clone(),
            timeout: operation_timeout,
        };
        let coalescers = coalescing.map(|coalescing| {
            let dispatch = Dispatch {
                lifecycle,
                tasks: &tasks,
                in_flight: &in_flight,
                store: &store,
                isolation: &isolation,
            };
            (0..store.partitions())
                .map(|_| dispatch.coalescers(coalescing, operation_timeout))
                .collect()
        });
        Self {
            store,
            waiting,
            tasks,
            operation_timeout,
            coalescers,
            in_flight,
            replays,
            isolation,
        }
    }

    /// How many keys (or event ids) are remembered as held by another transaction now.
    pub fn held_keys(&self) -> usize {
        self.isolation.held.remembered()
    }

    /// Each coalescer's queue, for the metrics: its name, the weight queued or running in it,
    /// and the most it takes. Empty without coalescing.
    pub fn coalescer_queues(&self) -> Vec<(&'static str, usize, usize)> {
        let Some(coalescers) = &self.coalescers else {
            return Vec::new();
        };
        coalescers::queues(coalescers)
    }

    /// The coalescers of the part of the store that serves `scope`.
    fn coalescers_of(&self, scope: &str) -> Option<&Coalescers> {
        let coalescers = self.coalescers.as_ref()?;
        coalescers.get(self.store.partition_of(scope))
    }

    pub async fn try_start(
        &self,
        command: TryStartCommand,
    ) -> Result<TryStartOutcome, CoordinatorError> {
        let Some(replays) = &self.replays else {
            return self.try_start_in_store(command).await;
        };
        if let Some(replay) =
            replays.try_start(&command.namespace, &command.key, &command.fingerprint)
        {
            return Ok(replay);
        }
        let (namespace, key, fingerprint) = (
            command.namespace.clone(),
            command.key.clone(),
            command.fingerprint.clone(),
        );
        let ticket = replays.ticket();
        let outcome = self.try_start_in_store(command).await?;
        match &outcome {
            // A replay matched the caller's fingerprint: it is the record's.
            TryStartOutcome::Completed {
                response,
                completion,
            } => replays.remember(
                ticket,
                &namespace,
                &key,
                fingerprint.as_bytes(),
                response,
                completion,
            ),
            TryStartOutcome::Started(claim) => {
                replays.claimed(&namespace, &key, &fingerprint, claim.lease_token.get());
            }
            TryStartOutcome::InProgress { .. } | TryStartOutcome::FingerprintMismatch => {}
        }
        Ok(outcome)
    }

    async fn try_start_in_store(
        &self,
        command: TryStartCommand,
    ) -> Result<TryStartOutcome, CoordinatorError> {
        match self.coalescers_of(command.namespace.as_str()) {
            Some(coalescers) => self.queued(coalescers.try_start.submit(command)).await,
            None => self.isolated("TryStart", command).await,
        }
    }

    pub async fn complete(&self, command: CompleteCommand) -> Result<Completion, CoordinatorError> {
        let Some(replays) = &self.replays else {
            return self.complete_in_store(command).await;
        };
        let (namespace, key, token) = (
            command.namespace.clone(),
            command.key.clone(),
            command.lease_token.get(),
        );
        // The response is copied only for a claim this replica handed out: only that one is
        // remembered.
        let response = replays
            .awaits_completion(token)
            .then(|| command.response.clone());
        let ticket = replays.ticket();
        let completion = self.complete_in_store(command).await?;
        if let Some(response) = response {
            replays.completed(
                ticket,
                &namespace,
                &key,
                token,
                response.as_bytes(),
                &completion,
            );
        }
        Ok(completion)
    }

    async fn complete_in_store(
        &self,
        command: CompleteCommand,
    ) -> Result<Completion, CoordinatorError> {
        Ok(match self.coalescers_of(command.namespace.as_str()) {
            Some(coalescers) => self.queued(coalescers.complete.submit(command)).await?,
            None => self.isolated("Complete", command).await?,
        }?)
    }

    /// Awaits a queued command under the operation timeout. The batch that runs it is a task
    /// of its own, or runs here and becomes one if this caller leaves: a caller that leaves
    /// only stops waiting.
    async fn queued<T>(
        &self,
        answer: impl Future<Output = Result<T, CoordinatorError>>,
    ) -> Result<T, CoordinatorError> {
        match tokio::time::timeout(self.operation_timeout, answer).await {
            Ok(result) => result,
            Err(_elapsed) => Err(CoordinatorError::TimedOut(self.operation_timeout)),
        }
    }

    pub async fn release(&self, command: ReleaseCommand) -> Result<(), CoordinatorError> {
        Ok(self.isolated("Release", command).await??)
    }

    /// Answers the lease's new expiry.
    pub async fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> Result<Instant, CoordinatorError> {
        Ok(self.isolated("ExtendLease", command).await??)
    }

    pub async fn lookup(&self, query: LookupQuery) -> Result<KeyState, CoordinatorError> {
        self.look(query, false).await
    }

    /// Lookup of a waiter's key, or, `watching`, the store's [`Store::watch`], which also has
    /// the key's next Complete or Release announced. A completed key the replay cache knows
    /// needs neither.
    async fn look(&self, query: LookupQuery, watching: bool) -> Result<KeyState, CoordinatorError> {
        let in_store = async |query: LookupQuery| {
            if watching {
                self.isolated("Watch", Watch(query)).await
            } else {
                self.run(
                    "Lookup",
                    move |store| async move { store.lookup(&query).await },
                )
                .await
            }
        };
        let Some(replays) = &self.replays else {
            return in_store(query).await;
        };
        if let Some(state) = replays.lookup(&query.namespace, &query.key) {
            return Ok(state);
        }
        let (namespace, key) = (query.namespace.clone(), query.key.clone());
        let ticket = replays.ticket();
        let state = in_store(query).await?;
        if let KeyState::Completed {
            response,
            fingerprint,
            completion,
        } = &state
        {
            replays.remember(ticket, &namespace, &key, fingerprint, response, completion);
        }
        Ok(state)
    }

    pub async fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, CoordinatorError> {
        match self.coalescers_of(command.consumer.as_str()) {
            Some(coalescers) => self.queued(coalescers.mark_processed.submit(command)).await,
            None => self.isolated("MarkProcessed", command).await,
        }
    }

    /// `command` on its own, as a tracked task ([`Self::run`]): a key known to be held goes to
    /// the held-key lane at once, and so does one that its statement finds held (see
    /// `held_keys`).
    async fn isolated<C: RunsAlone>(
        &self,
        name: &'static str,
        command: C,
    ) -> Result<C::Answer, CoordinatorError> {
        let held = self.isolation.held.clone();
        let deadline = self
            .isolation
            .store_deadline(tokio::time::Instant::now() + self.operation_timeout);
        // Cancelled when this call stops waiting (its caller gone): a run waiting for a place
        // in the held-key lane then leaves its queue.
        let gone = CancellationToken::new();
        let _gone_when_dropped = gone.clone().drop_guard();
        self.run(name, move |store| async move {
            held.run(&store, &command, deadline, &gone).await
        })
        .await
    }

    /// Spawns `operation` as a tracked task and awaits it. If the caller goes away, only this
    /// await is dropped: the task runs on to its end.
    /// `name` labels the store's time in `idempotency_store_seconds`.
    async fn run<T, F, Fut>(&self, name: &'static str, operation: F) -> Result<T, CoordinatorError>
    where
        F: FnOnce(AnyStore) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
        T: Send + 'static,
    {
        let timeout = self.operation_timeout;
        let work = Box::pin(operation(self.store.clone()));
        let in_flight = self.in_flight.enter();
        let statement = statement_span(name, db_system(&self.store), &Span::current(), 1);
        let task = self.tasks.spawn(
            async move {
                let _in_flight = in_flight;
                let began = tokio::time::Instant::now();
                let finished = tokio::time::timeout(timeout, work).await;
                metrics::histogram!("idempotency_store_seconds", "operation" => name)
                    .record(began.elapsed().as_secs_f64());
                match finished {
                    Ok(result) => result.map_err(CoordinatorError::Store),
                    Err(_elapsed) => Err(CoordinatorError::TimedOut(timeout)),
                }
            }
            .instrument(statement),
        );
        match task.await {
            Ok(result) => result,
            Err(join_error) => Err(CoordinatorError::TaskFailed(join_error)),
        }
    }
}
