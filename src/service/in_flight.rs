//! The count of calls the store has yet to finish, whether or not their callers still wait:
//! shutdown and tests read it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts the calls the store has yet to finish, whether or not their callers still wait.
#[derive(Debug, Clone, Default)]
pub struct InFlight(Arc<AtomicUsize>);

/// One call in flight, until dropped.
#[derive(Debug)]
pub struct InFlightGuard(Arc<AtomicUsize>);

impl InFlight {
    pub fn enter(&self) -> InFlightGuard {
        self.0.fetch_add(1, Ordering::SeqCst);
        InFlightGuard(self.0.clone())
    }

    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
