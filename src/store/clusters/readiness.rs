//! Each cluster's own readiness: migrated when first reached, probed on its own, within a bound
//! of its own, so that one cluster stalled or down neither holds up the others' probe nor makes
//! the service unready. The service is ready while any cluster is (a cluster's namespaces get
//! UNAVAILABLE while it is not); `idempotency_cluster_ready{cluster}` says which are.

use std::sync::atomic::Ordering;

use futures::future::join_all;

use super::{Cluster, ClusteredStore, in_cluster};
use crate::store::{Store, StoreError};
use crate::telemetry::error_chain;

impl ClusteredStore {
    /// Migrates every cluster it reaches; a cluster it cannot reach is migrated when its probe
    /// first reaches it. Fails only when no cluster could be migrated.
    pub(super) async fn migrate_reachable(&self) -> Result<(), StoreError> {
        self.migrates.store(true, Ordering::Release);
        let answers = join_all(self.clusters.iter().map(|cluster| async move {
            let migrated = cluster.store.migrate().await;
            match &migrated {
                Ok(()) => {
                    cluster.state.schema_seen.store(true, Ordering::Release);
                    tracing::info!(cluster = %cluster.name, "cluster migrated");
                }
                Err(error) => tracing::warn!(cluster = %cluster.name,
                    error = %error_chain(error),
                    "could not migrate the cluster; its namespaces are unavailable until its \
                     probe reaches it and migrates it"),
            }
            migrated.map_err(|error| in_cluster(&cluster.name, &error))
        }))
        .await;
        first_success(answers)
    }

    /// Probes every cluster at once, each within its own bound; ready while any cluster is.
    pub(super) async fn probe_each(&self) -> Result<(), StoreError> {
        let answers = join_all(self.clusters.iter().map(|cluster| self.probe_one(cluster))).await;
        first_success(answers)
    }

    async fn probe_one(&self, cluster: &Cluster) -> Result<(), StoreError> {
        let migrates = self.migrates.load(Ordering::Acquire);
        let checked = tokio::time::timeout(self.probe_bound, async {
            if migrates && !cluster.state.schema_seen.load(Ordering::Acquire) {
                cluster.store.migrate().await?;
                tracing::info!(cluster = %cluster.name, "cluster migrated");
            }
            cluster.store.probe().await
        })
        .await
        .unwrap_or(Err(StoreError::Unready(format!(
            "no answer within {:?}",
            self.probe_bound
        ))));
        let ready = checked.is_ok();
        if ready {
            cluster.state.schema_seen.store(true, Ordering::Release);
        }
        let was_ready = cluster.state.ready.swap(ready, Ordering::AcqRel);
        metrics::gauge!("idempotency_cluster_ready", "cluster" => cluster.name.to_string())
            .set(f64::from(u8::from(ready)));
        let mut reported = cluster
            .state
            .reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &checked {
            Ok(()) => {
                if !was_ready {
                    tracing::info!(cluster = %cluster.name, "cluster ready");
                }
                *reported = None;
            }
            Err(error) => {
                let cause = error_chain(error);
                if reported.as_deref() != Some(cause.as_str()) {
                    tracing::warn!(cluster = %cluster.name, error = %cause,
                        "cluster lost; its namespaces are unavailable, the others' are served");
                    *reported = Some(cause);
                }
            }
        }
        drop(reported);
        checked.map_err(|error| in_cluster(&cluster.name, &error))
    }
}

/// Success when any answer succeeded; else every cluster's failure, in one message.
fn first_success(answers: Vec<Result<(), StoreError>>) -> Result<(), StoreError> {
    if answers.iter().any(Result::is_ok) {
        return Ok(());
    }
    let causes: Vec<String> = answers
        .into_iter()
        .filter_map(Result::err)
        .map(|error| error_chain(&error))
        .collect();
    Err(StoreError::Unready(format!(
        "no cluster is ready: {}",
        causes.join("; ")
    )))
}
