//! The tasks the service cannot live without (signal handling, the tokens reload, the health
//! monitor, the reaper, and any other registered by name) are supervised: if one ends before
//! shutdown began, or panics at any time, the service logs it, turns NOT_SERVING (the shutdown
//! token is cancelled, which flips health first), drains, and exits non-zero, so that an
//! orchestrator restarts it. Living on without, say, the signal handler would be a service that
//! reports SERVING and can no longer be stopped.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What the service's background tasks answer to: the supervisor that watches them and the
/// token that stops them.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    pub supervisor: Supervisor,
    pub shutdown: CancellationToken,
}

impl Lifecycle {
    /// Runs `task` as an essential task named `name` (see [`Supervisor::spawn`]).
    pub fn spawn<F>(&self, name: &'static str, task: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.supervisor.spawn(name, &self.shutdown, task)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The first essential task that failed, and how.
    failure: OnceLock<TaskFailure>,
    failed: CancellationToken,
}

/// An essential task that ended when it should not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the essential task \"{task}\" {how}")]
pub struct TaskFailure {
    pub task: &'static str,
    pub how: &'static str,
}

impl Supervisor {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `task` as an essential task named `name`. Its end is expected only once `shutdown`
    /// is cancelled (the token the task itself follows); ending before that, or panicking at
    /// any time, fails the service, and `shutdown` is cancelled so that it drains and stops.
    /// The handle completes when the task has ended, whichever way.
    pub fn spawn<F>(
        &self,
        name: &'static str,
        shutdown: &CancellationToken,
        task: F,
    ) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let running = tokio::spawn(task);
        let supervisor = self.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let how = match running.await {
                Ok(()) if shutdown.is_cancelled() => return,
                Ok(()) => "ended unexpectedly",
                Err(error) if error.is_panic() => "panicked",
                // Aborted: only the runtime does that, when the process is ending anyway.
                Err(_) => return,
            };
            supervisor.fail(TaskFailure { task: name, how });
            shutdown.cancel();
        })
    }

    fn fail(&self, failure: TaskFailure) {
        tracing::error!(
            task = failure.task,
            how = failure.how,
            "an essential task stopped; not serving, and exiting for a restart"
        );
        let _ = self.inner.failure.set(failure);
        self.inner.failed.cancel();
    }

    /// The first failure, if an essential task failed.
    pub fn failure(&self) -> Option<TaskFailure> {
        self.inner.failure.get().cloned()
    }

    /// Completes once an essential task has failed.
    pub async fn failed(&self) {
        self.inner.failed.cancelled().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_end_before_shutdown_fails_the_service_and_starts_the_shutdown() {
        let supervisor = Supervisor::new();
        let shutdown = CancellationToken::new();
        supervisor
            .spawn("quitter", &shutdown, async {})
            .await
            .expect("the watcher ends");
        assert_eq!(
            supervisor.failure(),
            Some(TaskFailure {
                task: "quitter",
                how: "ended unexpectedly"
            })
        );
        assert!(shutdown.is_cancelled());
    }

    #[tokio::test]
    async fn a_panic_fails_the_service_even_during_shutdown() {
        let supervisor = Supervisor::new();
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        supervisor
            .spawn("panicker", &shutdown, async { panic!("on purpose") })
            .await
            .expect("the watcher ends");
        assert_eq!(supervisor.failure().map(|f| f.how), Some("panicked"));
    }

    #[tokio::test]
    async fn an_end_after_shutdown_began_is_expected() {
        let supervisor = Supervisor::new();
        let shutdown = CancellationToken::new();
        let task = {
            let shutdown = shutdown.clone();
            async move { shutdown.cancelled().await }
        };
        let watcher = supervisor.spawn("follower", &shutdown, task);
        shutdown.cancel();
        watcher.await.expect("the watcher ends");
        assert_eq!(supervisor.failure(), None);
    }
}
