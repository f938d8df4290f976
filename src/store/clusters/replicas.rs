//! The replicas of a clustered store: each replica has a heartbeat and an id on every cluster
//! (`postgres/replicas.rs`). An erasure commits on its namespace's cluster, and is announced
//! only there; so its eraser asks the replicas on that cluster, and waits for their ids there.
//! A barrier arrives through that cluster's stream, after the erasures before it, so a
//! replica's acknowledgement (sent on every cluster: it need not know which one asked) is
//! sent only once it has applied them.

use futures::future::join_all;

use super::ClusteredStore;
use crate::store::{BarrierRequest, Replicas, StoreError};

impl Replicas for ClusteredStore {
    fn has_replicas(&self) -> bool {
        true
    }

    async fn ask_acknowledgements(
        &self,
        request: BarrierRequest<'_>,
    ) -> Result<Vec<String>, StoreError> {
        self.usable(self.cluster_of(request.scope))?
            .ask_acknowledgements(request)
            .await
    }

    fn acknowledge(&self, barrier: u64) {
        for cluster in self.clusters.iter() {
            cluster.store.acknowledge(barrier);
        }
    }

    async fn depart(&self) {
        join_all(self.clusters.iter().map(|cluster| cluster.store.depart())).await;
    }
}
