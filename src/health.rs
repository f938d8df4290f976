//! The service's serving status, shared by the readiness monitor (which follows the store), the
//! shutdown sequence (which ends serving for good) and the gRPC health service (which reports it).

use std::sync::Arc;

use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServingStatus {
    /// The store is reachable and migrated.
    Serving,
    /// The store is unreachable, not migrated yet, or not checked yet.
    NotServing,
    /// Shutdown has begun: not serving, for good. Health watchers are told and then let go.
    ShuttingDown,
}

#[derive(Debug, Clone)]
pub struct HealthState {
    status: Arc<watch::Sender<ServingStatus>>,
}

impl Default for HealthState {
    fn default() -> Self {
        Self::new()
    }
}

impl HealthState {
    /// Starts NOT_SERVING: nothing is known about the store yet.
    pub fn new() -> Self {
        let (status, _) = watch::channel(ServingStatus::NotServing);
        Self {
            status: Arc::new(status),
        }
    }

    /// Records the outcome of a store check. Ignored once shutdown has begun. Answers the
    /// status it replaced, so the caller can log transitions.
    pub fn set_store_ready(&self, ready: bool) -> ServingStatus {
        let mut previous = ServingStatus::ShuttingDown;
        self.status.send_if_modified(|status| {
            previous = *status;
            let next = match (*status, ready) {
                (ServingStatus::ShuttingDown, _) => return false,
                (_, true) => ServingStatus::Serving,
                (_, false) => ServingStatus::NotServing,
            };
            let changed = *status != next;
            *status = next;
            changed
        });
        previous
    }

    pub fn begin_shutdown(&self) {
        self.status.send_replace(ServingStatus::ShuttingDown);
    }

    pub fn current(&self) -> ServingStatus {
        *self.status.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<ServingStatus> {
        self.status.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shutdown_is_final() {
        let health = HealthState::new();
        assert_eq!(health.current(), ServingStatus::NotServing);
        health.set_store_ready(true);
        assert_eq!(health.current(), ServingStatus::Serving);
        health.begin_shutdown();
        health.set_store_ready(true);
        assert_eq!(health.current(), ServingStatus::ShuttingDown);
    }
}
