//! The admin API on a clustered store: everything about a namespace (its keys, numbers,
//! erasures and audit trail) goes to the cluster it is placed on; what spans all namespaces
//! (the stuck keys, the audit trail's reaping) asks every cluster.

use super::routes::on_home;
use super::{ClusteredStore, combined, sum_of};
use crate::domain::admin::{
    AuditEntry, AuditEvent, ForceReleased, FullKey, KeySummary, NamespaceStats, StuckSummary,
};
use crate::domain::{Key, Scope};
use crate::store::{AdminStore, AuditPage, Erased, Erasure, KeyPage, NamespaceBatch, StoreError};

impl AdminStore for ClusteredStore {
    async fn list_keys(&self, page: KeyPage<'_>) -> Result<Vec<KeySummary>, StoreError> {
        on_home!(self, page.filter.namespace.as_str(), list_keys(page))
    }

    async fn get_key(&self, namespace: &Scope, key: &Key) -> Result<Option<FullKey>, StoreError> {
        on_home!(self, namespace.as_str(), get_key(namespace, key))
    }

    async fn namespace_stats(&self, namespace: &Scope) -> Result<NamespaceStats, StoreError> {
        on_home!(self, namespace.as_str(), namespace_stats(namespace))
    }

    async fn force_release(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<ForceReleased, StoreError> {
        on_home!(self, audit.namespace.as_str(), force_release(audit, key))
    }

    async fn erase_key(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<(Option<KeySummary>, i64), StoreError> {
        on_home!(self, audit.namespace.as_str(), erase_key(audit, key))
    }

    async fn erase_namespace_batch(&self, batch: NamespaceBatch<'_>) -> Result<Erased, StoreError> {
        on_home!(self, batch.namespace.as_str(), erase_namespace_batch(batch))
    }

    async fn namespace_has_rows(&self, namespace: &Scope) -> Result<bool, StoreError> {
        on_home!(self, namespace.as_str(), namespace_has_rows(namespace))
    }

    async fn record_audit(&self, audit: &AuditEntry) -> Result<i64, StoreError> {
        on_home!(self, audit.namespace.as_str(), record_audit(audit))
    }

    async fn list_audit(&self, page: AuditPage<'_>) -> Result<Vec<AuditEvent>, StoreError> {
        on_home!(self, page.filter.namespace.as_str(), list_audit(page))
    }

    async fn reap_expired_audit(&self, limit: u32) -> Result<u64, StoreError> {
        sum_of(
            self.on_each(|store| async move { store.reap_expired_audit(limit).await })
                .await,
        )
    }

    /// The stuck keys of every cluster that answers: their count, and the oldest.
    async fn stuck_keys(&self) -> Result<StuckSummary, StoreError> {
        let answers = self
            .on_each(|store| async move { store.stuck_keys().await })
            .await;
        combined(answers, |total, stuck| {
            total.count += stuck.count;
            total.oldest = total.oldest.max(stuck.oldest);
        })
    }

    fn erasures(&self) -> tokio::sync::broadcast::Receiver<Erasure> {
        self.erasures.subscribe()
    }
}
