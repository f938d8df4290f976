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

/// The pause before the store is asked again while it is not ready, at first; it doubles up to
/// the check interval, so a database that comes back is served within a check interval, and one
/// that stays away is not hammered.
const FIRST_RETRY: Duration = Duration::from_millis(100);

pub async fn monitor<S: Store>(
    store: S,
    health: HealthState,
    clock: DatabaseClock,
    settings: ReadinessSettings,
    shutdown: CancellationToken,
) {
    let mut migrated = !settings.migrate;
    // The cause last reported while not serving: a store that never becomes ready (a refused
    // login, a pooler refusing the connection's settings) is reported with its cause at once,
    // and again whenever the cause changes, not at every retry.
    let mut reported: Option<String> = None;
    let mut retry = FIRST_RETRY;
    loop {
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return,
            attempt = check(&store, &mut migrated, settings.check_timeout) => attempt,
        };
        let ready = attempt.is_ok();
        if ready {
            measure_clock(&store, &clock, settings.check_timeout).await;
        }
        let previous = health.set_store_ready(ready);
        let pause = match attempt {
            Ok(()) => {
                if previous != ServingStatus::Serving && previous != ServingStatus::ShuttingDown {
                    tracing::info!("store ready; serving");
                }
                reported = None;
                retry = FIRST_RETRY;
                settings.check_interval
            }
            Err(cause) => {
                if previous == ServingStatus::Serving {
                    tracing::warn!(error = %cause, "store check failed; not serving");
                    reported = Some(cause);
                } else if reported.as_deref() == Some(cause.as_str()) {
                    tracing::debug!(error = %cause, ?retry, "store still not ready");
                } else {
                    tracing::warn!(error = %cause, ?retry, "store not ready; not serving");
                    reported = Some(cause);
                }
                let pause = retry;
                retry = (retry * 2).min(settings.check_interval);
                pause
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// Migrates the store if it is not yet, then probes it: the cause, in words, when it is not
/// ready. Migrations are not bounded by the check timeout (a long one must finish), only by
/// shutdown; each runs in its own transaction, so stopping one leaves nothing half-done.
async fn check<S: Store>(
    store: &S,
    migrated: &mut bool,
    check_timeout: Duration,
) -> Result<(), String> {
    if !*migrated {
        store
            .migrate()
            .await
            .map_err(|error| format!("applying migrations: {}", error_chain(&error)))?;
        tracing::info!("schema migrations applied");
        *migrated = true;
    }
    match tokio::time::timeout(check_timeout, store.probe()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error_chain(&error)),
        Err(_) => Err(format!(
            "the store check did not answer within {check_timeout:?}"
        )),
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
