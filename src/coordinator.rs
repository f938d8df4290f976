//! Runs each operation of the contract against the store, detached from the caller.
//!
//! tonic drops a handler's future when the client cancels or its deadline passes, and the
//! server stops polling handlers when the grace period ends. Store work that has begun must not
//! be cut off half-way by either, so every operation runs in its own task (tracked, so shutdown
//! can wait for it) and is bounded by its own timeout instead.
//!
//! That timeout is enforced by the store itself (see `store::Budget`: a bounded wait for a
//! connection, then a statement the database ends), because only the database can stop a
//! statement without leaving its outcome in doubt: an UNAVAILABLE after such a timeout means
//! nothing was written. The task's own deadline, at the full operation timeout, is reached only
//! when the connection to the store stopped answering altogether, where the outcome of a write
//! cannot be known.

use std::future::Future;
use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Instant, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome,
};
use crate::store::{Store, StoreError};

/// Why an operation did not produce its answer.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error(transparent)]
    Rejected(#[from] Rejection),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The task running the operation panicked or was aborted: a bug, reported opaquely.
    #[error("the operation's task failed")]
    TaskFailed(#[source] tokio::task::JoinError),
}

#[derive(Clone)]
pub struct Coordinator<S> {
    store: S,
    tasks: TaskTracker,
    operation_timeout: Duration,
}

impl<S: Store> Coordinator<S> {
    /// `tasks` tracks every operation in flight so that shutdown can wait for them.
    pub fn new(store: S, tasks: TaskTracker, operation_timeout: Duration) -> Self {
        Self {
            store,
            tasks,
            operation_timeout,
        }
    }

    pub async fn try_start(
        &self,
        command: TryStartCommand,
    ) -> Result<TryStartOutcome, CoordinatorError> {
        self.run(|store| async move { store.try_start(command).await })
            .await
    }

    pub async fn complete(&self, command: CompleteCommand) -> Result<Completion, CoordinatorError> {
        Ok(self
            .run(|store| async move { store.complete(command).await })
            .await??)
    }

    pub async fn release(&self, command: ReleaseCommand) -> Result<(), CoordinatorError> {
        Ok(self
            .run(|store| async move { store.release(command).await })
            .await??)
    }

    /// Answers the lease's new expiry.
    pub async fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> Result<Instant, CoordinatorError> {
        Ok(self
            .run(|store| async move { store.extend_lease(command).await })
            .await??)
    }

    pub async fn lookup(&self, query: LookupQuery) -> Result<KeyState, CoordinatorError> {
        self.run(|store| async move { store.lookup(query).await })
            .await
    }

    pub async fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, CoordinatorError> {
        self.run(|store| async move { store.mark_processed(command).await })
            .await
    }

    /// Spawns `operation` as a tracked task and awaits it. If the caller goes away, only this
    /// await is dropped: the task runs on to its end.
    async fn run<T, F, Fut>(&self, operation: F) -> Result<T, CoordinatorError>
    where
        F: FnOnce(S) -> Fut,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'static,
        T: Send + 'static,
    {
        let timeout = self.operation_timeout;
        let work = operation(self.store.clone());
        let task = self.tasks.spawn(async move {
            match tokio::time::timeout(timeout, work).await {
                Ok(result) => result,
                Err(_elapsed) => Err(StoreError::TimedOut(timeout)),
            }
        });
        match task.await {
            Ok(result) => Ok(result?),
            Err(join_error) => Err(CoordinatorError::TaskFailed(join_error)),
        }
    }
}
