//! The rate limit per caller.

use std::num::NonZeroU32;
use std::time::Duration;

/// A rate per caller: `rate` requests a second, in bursts of up to `rate`. `governor`'s keyed
/// limiter (GCRA, lock-free) keeps one small state per caller name and says how long a refused
/// caller must wait; states of callers not seen for a while are dropped on each reload.
pub(super) struct RateLimiter {
    limiter: governor::DefaultKeyedRateLimiter<String>,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter").finish_non_exhaustive()
    }
}

impl RateLimiter {
    pub(super) fn new(rate: NonZeroU32) -> Self {
        Self {
            limiter: governor::RateLimiter::keyed(governor::Quota::per_second(rate)),
        }
    }

    /// `Ok` when `caller` may make a call now, else how long until it may.
    pub(super) fn admit(&self, caller: &str) -> Result<(), Duration> {
        use governor::clock::{Clock, DefaultClock};
        self.limiter
            .check_key(&caller.to_owned())
            .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
    }

    /// Forgets callers whose state is back to a full burst.
    pub(super) fn forget_idle(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}
