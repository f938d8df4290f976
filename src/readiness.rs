//! Follows the store: applies migrations (unless told not to), then checks at an interval that
//! the store is reachable and migrated, and reports it through [`HealthState`]. The service
//! starts and answers health checks even while the database is down; it turns SERVING when the
//! store is ready and back to NOT_SERVING when it is lost, without a restart.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::health::{HealthState, ServingStatus};
use crate::service::waiting::DatabaseClock;
use crate::store::Store;
use crate::telemetry::error_chain;

#[derive(Debug, Clone)]
pub struct ReadinessSettings {
    /// Apply migrations before reporting ready.
    pub migrate: bool,
    pub check_interval: Duration,
    /// Bounds each check, so a database that stops answering turns the service NOT_SERVING.
    pub check_timeout: Duration,
}

pub async fn monitor<S: Store>(
    store: S,
    health: HealthState,
    clock: DatabaseClock,
    settings: ReadinessSettings,
    shutdown: CancellationToken,
) {
    let mut migrated = !settings.migrate;
    // The cause last reported while not serving: a store that never becomes ready (a refused
    // login, a pooler refusing the connection's settings) is reported with its cause once, and
    // again whenever the cause changes, not at every check.
    let mut reported: Option<String> = None;
    loop {
        if !migrated {
            // Migrations are not bounded by the check timeout (a long one must finish), only by
            // shutdown; each runs in its own transaction, so stopping one leaves nothing half-done.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                result = store.migrate() => match result {
                    Ok(()) => {
                        tracing::info!("schema migrations applied");
                        migrated = true;
                    }
                    Err(error) => {
                        tracing::warn!(error = %error_chain(&error), "applying migrations failed; will retry");
                    }
                },
            }
        }

        let checked = tokio::time::timeout(settings.check_timeout, store.probe()).await;
        let ready = matches!(checked, Ok(Ok(())));
        if ready {
            measure_clock(&store, &clock, settings.check_timeout).await;
        }
        let previous = health.set_store_ready(ready);
        match (previous, checked) {
            (ServingStatus::Serving, _) | (ServingStatus::ShuttingDown, _) if ready => {}
            (_, Ok(Ok(()))) => {
                reported = None;
                tracing::info!("store ready; serving");
            }
            (ServingStatus::Serving, Ok(Err(error))) => {
                let cause = error_chain(&error);
                tracing::warn!(error = %cause, "store check failed; not serving");
                reported = Some(cause);
            }
            (ServingStatus::Serving, Err(_)) => {
                tracing::warn!(timeout = ?settings.check_timeout, "store check timed out; not serving");
            }
            (_, Ok(Err(error))) => {
                let cause = error_chain(&error);
                if reported.as_deref() == Some(cause.as_str()) {
                    tracing::debug!(error = %cause, "store still not ready");
                } else {
                    tracing::warn!(error = %cause, "store not ready; not serving");
                    reported = Some(cause);
                }
            }
            (_, Err(_)) => tracing::debug!("store check still timing out"),
        }

        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(settings.check_interval) => {}
        }
    }
}

/// Reads the database clock and records how far it is from the service's, for waiters that
/// sleep until a lease ends by the database clock. A failed reading keeps the last estimate.
async fn measure_clock<S: Store>(store: &S, clock: &DatabaseClock, timeout: Duration) {
    let sent = tokio::time::Instant::now();
    let before = chrono::Utc::now();
    if let Ok(Ok(read)) = tokio::time::timeout(timeout, store.clock()).await {
        clock.record(before, read, chrono::Utc::now(), sent);
    }
}
