//! What a store that several replicas share tells each of them of the others (PostgreSQL: the
//! heartbeat, an eraser's request and its acknowledgements, `postgres/replicas.rs`), for the
//! erasure that every replica honours before it answers (`service/erasures.rs`). A store that
//! one process serves (the embedded store) keeps the defaults: nobody else to ask or wait for,
//! and its replay cache forgets an erasure as it commits.

use std::future::Future;
use std::time::Duration;

use super::{AnyStore, StoreError};

/// An eraser's request that every replica acknowledge `store::Erasure::Barrier` `barrier` once
/// it has applied every erasure that committed before, on the store that serves `scope` (the
/// erased namespace: with several clusters, the one its erasure committed on); answered by the
/// replicas whose heartbeat that store's clock saw within `seen_within`.
#[derive(Debug, Clone, Copy)]
pub struct BarrierRequest<'a> {
    pub barrier: u64,
    pub scope: &'a str,
    pub seen_within: Duration,
}

pub trait Replicas {
    /// Whether other processes may serve this store: an erasure then waits for their
    /// acknowledgements, and this replica's replay cache serves only while its heartbeat
    /// confirms it (`store::Erasure::Caught`).
    fn has_replicas(&self) -> bool {
        false
    }

    /// Asks every replica to acknowledge `request`'s barrier, and answers those asked (see
    /// [`BarrierRequest`]). One statement.
    fn ask_acknowledgements(
        &self,
        _request: BarrierRequest<'_>,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        async { Ok(Vec::new()) }
    }

    /// Sends this replica's acknowledgement of `barrier` (soon, without waiting).
    fn acknowledge(&self, _barrier: u64) {}

    /// This replica leaves (it shuts down, and its replay cache has stopped serving): erasures
    /// need not wait for it any more.
    fn depart(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

impl Replicas for super::SqliteStore {}

impl Replicas for AnyStore {
    fn has_replicas(&self) -> bool {
        match self {
            Self::Postgres(store) => store.has_replicas(),
            Self::Clusters(store) => store.has_replicas(),
            Self::Sqlite(store) => store.has_replicas(),
        }
    }

    async fn ask_acknowledgements(
        &self,
        request: BarrierRequest<'_>,
    ) -> Result<Vec<String>, StoreError> {
        delegate!(self, store => store.ask_acknowledgements(request))
    }

    fn acknowledge(&self, barrier: u64) {
        match self {
            Self::Postgres(store) => store.acknowledge(barrier),
            Self::Clusters(store) => store.acknowledge(barrier),
            Self::Sqlite(store) => store.acknowledge(barrier),
        }
    }

    async fn depart(&self) {
        delegate!(self, store => store.depart())
    }
}
