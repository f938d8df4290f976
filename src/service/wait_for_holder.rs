//! TryStart that waits for a holder: the waiter watches the key, wakes when it changes or the
//! holder's lease should have ended, and answers what a TryStart would answer then. One waiter
//! per key and replica asks the store at a time; the others wait for its answer.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::waiting::{DatabaseClock, Waiters, answer_by};
use super::{Coordinator, CoordinatorError};
use crate::domain::{KeyHash, LookupQuery, Recheck, TryStartCommand, TryStartOutcome, WaitTime};

/// What TryStarts that wait need: who waits, the database clock, and the signal to stop
/// waiting.
#[derive(Clone)]
pub struct Waiting {
    pub waiters: Waiters,
    pub clock: DatabaseClock,
    pub shutdown: CancellationToken,
}

/// A waiter whose holder's lease the database still calls running, although it should have
/// ended by our estimate of the database clock, looks again after this, then twice as long.
const LEASE_RECHECK: Duration = Duration::from_millis(5);

impl Coordinator {
    /// TryStart that, when another caller's running lease holds the key, waits up to `wait`
    /// (and a little less than the caller's `deadline`) for the holder to complete, release or
    /// let its lease run out, and answers what a TryStart would answer at that moment (see
    /// `waiting`). Beyond the replica's waiter limit, or without time to wait, it answers at
    /// once.
    pub async fn try_start_waiting(
        &self,
        command: TryStartCommand,
        wait: WaitTime,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<TryStartOutcome, CoordinatorError> {
        let (Some(waiting), Some(answer_at)) = (&self.waiting, answer_by(wait.get(), deadline))
        else {
            return self.try_start(command).await;
        };
        let Some(mut registration) = waiting
            .waiters
            .register(KeyHash::of(&command.namespace, &command.key))
        else {
            return self.try_start(command).await;
        };
        let recheck_interval = waiting.waiters.settings().recheck_interval;
        let query = LookupQuery {
            namespace: command.namespace.clone(),
            key: command.key.clone(),
        };
        // The last `in_progress` seen, answered when the wait runs out.
        let mut last: Option<TryStartOutcome> = None;
        let mut seen_lease_end = None;
        let mut lease_recheck = LEASE_RECHECK;
        loop {
            let mut look_now = false;
            registration.mark_seen();
            // Watched: the key's next Complete or Release wakes this waiter, on any replica.
            let held = match self.look(query.clone(), true).await?.recheck(&command) {
                Recheck::Answer(outcome) => return Ok(outcome),
                Recheck::Held {
                    lease_expires_at,
                    attempt,
                    holder_attempt_id,
                } if !waiting.clock.has_passed(lease_expires_at) => {
                    Some(TryStartOutcome::InProgress {
                        lease_expires_at,
                        attempt,
                        holder_attempt_id,
                    })
                }
                looked @ (Recheck::Held { .. } | Recheck::Claimable) => {
                    match registration.try_claim() {
                        // One waiter of this replica at a time asks TryStart, which decides;
                        // the others sleep until it has its answer (its turn given up wakes
                        // them), then look again.
                        Some(_claiming) => match self.try_start(command.clone()).await? {
                            held @ TryStartOutcome::InProgress { .. } => {
                                // Another caller claimed the key since the look, perhaps as a
                                // new row that nobody watches yet: look (and watch) again
                                // before sleeping.
                                look_now = !looked.is_held_as(&held);
                                Some(held)
                            }
                            answer => return Ok(answer),
                        },
                        None => None,
                    }
                }
            };
            if held.is_some() {
                last = held;
            }
            let now = tokio::time::Instant::now();
            let mut look_again = now + recheck_interval;
            if let Some(TryStartOutcome::InProgress {
                lease_expires_at, ..
            }) = &last
            {
                let lease_ends = waiting.clock.local_instant(*lease_expires_at);
                if seen_lease_end == Some(*lease_expires_at) && lease_ends <= now {
                    // The database still calls the lease running although our estimate of
                    // its clock says it has ended: back off rather than ask again at once.
                    look_again = look_again.min(now + lease_recheck);
                    lease_recheck = (lease_recheck * 2).min(recheck_interval);
                } else {
                    look_again = look_again.min(lease_ends);
                    lease_recheck = LEASE_RECHECK;
                }
                seen_lease_end = Some(*lease_expires_at);
            }
            if now >= answer_at || waiting.shutdown.is_cancelled() {
                return self.answer_now(command, last).await;
            }
            if look_now {
                continue;
            }
            tokio::select! {
                () = registration.changed() => {}
                () = tokio::time::sleep_until(look_again) => {}
                () = tokio::time::sleep_until(answer_at) => return self.answer_now(command, last).await,
                // Shutdown answers every waiter at once, with the key as it stands.
                () = waiting.shutdown.cancelled() => return self.try_start(command).await,
            }
        }
    }

    /// The answer of a wait that ends: the last `in_progress` seen, or, if the waiter never saw
    /// one, what TryStart answers now.
    async fn answer_now(
        &self,
        command: TryStartCommand,
        last: Option<TryStartOutcome>,
    ) -> Result<TryStartOutcome, CoordinatorError> {
        match last {
            Some(outcome) => Ok(outcome),
            None => self.try_start(command).await,
        }
    }
}
