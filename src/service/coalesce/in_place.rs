//! A batch run in its caller's task, and handed to a task of its own only if the caller stops
//! waiting before it is done.
//!
//! A lone call on an idle coalescer runs its batch of one where it is: spawning a task for it
//! and answering it through a channel costs a task, a wake-up and a hand-off between tasks per
//! call, the largest part of the coalescer's own cost on a lone call. But a caller may stop
//! waiting at any time (its RPC cancelled, its connection gone), and its future is then
//! dropped; store work that has begun must still run to its end (a Complete whose caller hung
//! up still completes), as it would in a task of its own. So a run dropped unfinished is
//! spawned, from where it stands, as a tracked task. And the run counts among the tracked
//! tasks from its first poll to its end, wherever it runs, so that shutdown waits for it as
//! for a batch the dispatcher spawned.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;

use super::BatchRun;

/// A batch's run, polled by its caller's task until it is done.
pub(super) struct InPlace {
    /// `None` once done.
    run: Option<BatchRun>,
    tasks: TaskTracker,
    /// Counts the run among the tracked tasks while it runs here. A field, so dropped after
    /// [`Drop::drop`] has spawned what is left: the count never falls to zero in between,
    /// which would let shutdown's wait end under the run.
    _tracked: TaskTrackerToken,
}

impl InPlace {
    pub(super) fn new(run: BatchRun, tasks: &TaskTracker) -> Self {
        Self {
            run: Some(run),
            tasks: tasks.clone(),
            _tracked: tasks.token(),
        }
    }
}

impl Future for InPlace {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<()> {
        let Some(run) = self.run.as_mut() else {
            return Poll::Ready(());
        };
        // A panic in the run ends the run, not the caller's RPC, as it would in a task of its
        // own: the run is dropped, which drops its callers' reply channels, and they are
        // answered "timed out" (the panic itself is reported by the panic hook).
        match catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(context))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) | Err(_) => {
                self.run = None;
                Poll::Ready(())
            }
        }
    }
}

impl Drop for InPlace {
    /// Dropped unfinished: its caller stopped waiting. The run continues as a task of its own.
    /// It stays where it is in memory (boxed, so pinned), so it resumes exactly where it was.
    fn drop(&mut self) {
        let Some(run) = self.run.take() else {
            return;
        };
        // A caller's task is dropped on a runtime thread, with the runtime's context set even
        // while the runtime shuts down (when the new task is dropped in turn, which answers its
        // callers "timed out"). Off any runtime there is nowhere to run it, and dropping it is
        // all that is left.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.tasks.spawn_on(run, &runtime);
        }
    }
}
