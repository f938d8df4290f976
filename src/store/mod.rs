//! Persistence. Every SQL statement lives under this folder, one module per backend; the rest of
//! the crate sees only the [`Store`] trait and domain types.

mod error;
pub mod postgres;

use std::future::Future;

use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Instant, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome,
};

pub use error::StoreError;
pub use postgres::PgStore;

/// The operations of the contract on one shared store. Each state change is atomic, and every
/// instant it computes comes from the store's own clock.
///
/// Implementations are cheap handles (a connection pool), cloned into the tasks that run each
/// operation to completion even when the caller has gone.
pub trait Store: Clone + Send + Sync + 'static {
    fn try_start(
        &self,
        command: TryStartCommand,
    ) -> impl Future<Output = Result<TryStartOutcome, StoreError>> + Send;

    fn complete(
        &self,
        command: CompleteCommand,
    ) -> impl Future<Output = Result<Result<Completion, Rejection>, StoreError>> + Send;

    fn release(
        &self,
        command: ReleaseCommand,
    ) -> impl Future<Output = Result<Result<(), Rejection>, StoreError>> + Send;

    /// Answers the lease's new expiry.
    fn extend_lease(
        &self,
        command: ExtendLeaseCommand,
    ) -> impl Future<Output = Result<Result<Instant, Rejection>, StoreError>> + Send;

    fn lookup(
        &self,
        query: LookupQuery,
    ) -> impl Future<Output = Result<KeyState, StoreError>> + Send;

    /// One result per requested id, in request order.
    fn mark_processed(
        &self,
        command: MarkProcessedCommand,
    ) -> impl Future<Output = Result<Vec<ProcessedEvent>, StoreError>> + Send;

    /// Deletes at most `limit` expired keys and answers how many it deleted. Rows another
    /// replica's reaper (or a claim) holds are skipped, not waited for.
    fn reap_expired_keys(&self, limit: u32)
    -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes at most `limit` expired processed events, like [`Store::reap_expired_keys`].
    fn reap_expired_events(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Applies the schema migrations this build carries.
    fn migrate(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Succeeds when the store is reachable and its schema is fully migrated.
    fn probe(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Closes the store's connections once the operations in flight have ended.
    fn close(&self) -> impl Future<Output = ()> + Send;
}
