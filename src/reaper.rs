//! Deletes expired keys, events and audit events in bounded batches. Expired rows are already ABSENT for every
//! RPC; the reaper only reclaims their space. Each batch is one statement that skips rows held
//! by others (`FOR UPDATE SKIP LOCKED`), so several replicas can reap side by side. A full batch
//! is followed at once by the next; a partial one means the backlog is cleared until the next
//! interval. Shutdown is checked between batches, never inside one.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use metrics::Label;

use crate::store::{AdminStore, AnyStore, StoreError};
use crate::telemetry::error_chain;

#[derive(Debug, Clone)]
pub struct ReaperSettings {
    pub interval: Duration,
    pub batch_size: u32,
    /// Bounds each batch, like any other store operation.
    pub batch_timeout: Duration,
    /// After each sweep, read the lag (`idempotency_reaper_lag_seconds`) and the stuck keys
    /// (`idempotency_stuck_keys`, `idempotency_oldest_stuck_key_seconds`): with metrics on.
    pub measure_lag: bool,
}

#[derive(Debug, Clone, Copy)]
enum Table {
    Keys,
    Events,
    /// The admin API's audit trail (`--audit-retention`).
    Audit,
}

impl Table {
    /// The table's label in metrics.
    fn label(self) -> &'static str {
        match self {
            Self::Keys => "keys",
            Self::Events => "events",
            Self::Audit => "audit",
        }
    }
}

/// One reaper for each part of the store (each cluster of a clustered store), side by side: a
/// cluster that is slow or down delays only its own sweeps. Each part's metrics carry its
/// cluster's name (`cluster`), when it has one.
pub async fn run_each(
    parts: Vec<(Option<String>, AnyStore)>,
    settings: ReaperSettings,
    shutdown: CancellationToken,
) {
    futures::future::join_all(parts.into_iter().map(|(cluster, store)| {
        let part = Part {
            store,
            cluster: cluster.map(|name| Label::new("cluster", name)),
        };
        run(part, settings.clone(), shutdown.clone())
    }))
    .await;
}

/// A part of the store and the label of its cluster.
struct Part<S> {
    store: S,
    cluster: Option<Label>,
}

impl<S> Part<S> {
    /// `labels` and the cluster's, when the part has one.
    fn labels(&self, labels: &[(&'static str, &'static str)]) -> Vec<Label> {
        labels
            .iter()
            .map(|&(key, value)| Label::new(key, value))
            .chain(self.cluster.clone())
            .collect()
    }
}

async fn run<S: AdminStore>(part: Part<S>, settings: ReaperSettings, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(settings.interval) => {}
        }
        for table in [Table::Keys, Table::Events, Table::Audit] {
            if sweep(&part, table, &settings, &shutdown).await == Sweep::Stopped {
                return;
            }
        }
        if settings.measure_lag {
            measure_lag(&part, &settings).await;
            measure_stuck_keys(&part, &settings).await;
        }
    }
}

/// Sets `idempotency_stuck_keys` and `idempotency_oldest_stuck_key_seconds`: keys in progress
/// whose lease ran out, across all namespaces, read from the in-progress keys' index (never the
/// table). When the read fails, the gauges keep their last values (the failure is in the logs).
async fn measure_stuck_keys<S: AdminStore>(part: &Part<S>, settings: &ReaperSettings) {
    match tokio::time::timeout(settings.batch_timeout, part.store.stuck_keys()).await {
        Ok(Ok(stuck)) => {
            metrics::gauge!("idempotency_stuck_keys", part.labels(&[])).set(stuck.count as f64);
            metrics::gauge!("idempotency_oldest_stuck_key_seconds", part.labels(&[]))
                .set(stuck.oldest.as_secs_f64());
        }
        Ok(Err(StoreError::NotMigrated(_))) => {}
        Ok(Err(error)) => {
            tracing::debug!(error = %error_chain(&error), "reading the stuck keys failed");
        }
        Err(_) => tracing::debug!("reading the stuck keys timed out"),
    }
}

/// Sets `idempotency_reaper_lag_seconds` from what the sweep left: whatever it could not
/// delete (rows held by others, a sweep cut short by a failure) and what expired since. When
/// the read fails, the gauges keep their last values (the failure is in the logs).
async fn measure_lag<S: AdminStore>(part: &Part<S>, settings: &ReaperSettings) {
    match tokio::time::timeout(settings.batch_timeout, part.store.expired_backlog()).await {
        Ok(Ok(backlog)) => {
            for (table, age) in [(Table::Keys, backlog.keys), (Table::Events, backlog.events)] {
                let labels = part.labels(&[("table", table.label())]);
                metrics::gauge!("idempotency_reaper_lag_seconds", labels).set(age.as_secs_f64());
            }
        }
        Ok(Err(StoreError::NotMigrated(_))) => {}
        Ok(Err(error)) => {
            tracing::debug!(error = %error_chain(&error), "reading the reaper's lag failed");
        }
        Err(_) => tracing::debug!("reading the reaper's lag timed out"),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Sweep {
    Done,
    Stopped,
}

async fn sweep<S: AdminStore>(
    part: &Part<S>,
    table: Table,
    settings: &ReaperSettings,
    shutdown: &CancellationToken,
) -> Sweep {
    let mut deleted_total = 0u64;
    loop {
        if shutdown.is_cancelled() {
            return Sweep::Stopped;
        }
        let batch = async {
            match table {
                Table::Keys => part.store.reap_expired_keys(settings.batch_size).await,
                Table::Events => part.store.reap_expired_events(settings.batch_size).await,
                Table::Audit => part.store.reap_expired_audit(settings.batch_size).await,
            }
        };
        let deleted = match tokio::time::timeout(settings.batch_timeout, batch).await {
            Ok(Ok(deleted)) => deleted,
            Ok(Err(StoreError::NotMigrated(_))) => {
                tracing::debug!(?table, "nothing to reap before the schema is migrated");
                return Sweep::Done;
            }
            Ok(Err(error)) => {
                tracing::warn!(?table, cluster = part.cluster.as_ref().map(Label::value),
                    error = %error_chain(&error), "reaping failed; will retry");
                return Sweep::Done;
            }
            Err(_) => {
                tracing::warn!(?table, cluster = part.cluster.as_ref().map(Label::value),
                    timeout = ?settings.batch_timeout, "reaping timed out; will retry");
                return Sweep::Done;
            }
        };
        deleted_total += deleted;
        // One line per statement (at debug), which is how the batch bound is seen from outside.
        tracing::debug!(table = table.label(), deleted, "reaped one batch");
        let labels = part.labels(&[("table", table.label())]);
        metrics::counter!("idempotency_reaped_rows_total", labels).increment(deleted);
        if deleted < u64::from(settings.batch_size) {
            if deleted_total > 0 {
                tracing::info!(?table, deleted = deleted_total, "reaped expired rows");
            }
            return Sweep::Done;
        }
    }
}
