//! The lease a running work holds: its heartbeat, its cancellation when the lease is lost, and
//! the Complete or Release that ends it.

use super::*;

/// The claim the work holds while it runs.
///
/// `token` and `attempt` identify the claim (`attempt` > 1 after a takeover), `checkpoint` is
/// what a previous holder saved, and the cancellation token fires when the lease is lost: the
/// work should stop then, since another caller owns the key.
#[derive(Clone)]
pub struct Lease {
    pub(super) shared: Arc<Shared>,
    pub(super) attempt: u32,
    pub(super) checkpoint: Option<Vec<u8>>,
}

pub(super) struct Shared {
    pub(super) client: Client,
    pub(super) spec: Spec,
    pub(super) token: u64,
    pub(super) state: Mutex<LeaseState>,
    pub(super) cancelled: CancellationToken,
}

pub(super) struct LeaseState {
    pub(super) expires_at: SystemTime,
    /// When the lease runs out at the latest by this machine's clock.
    pub(super) runs_out_at: Instant,
    /// Why the lease is lost, once it is.
    pub(super) lost: Option<CallError>,
}

impl Shared {
    pub(super) fn lost(&self) -> Option<CallError> {
        self.state.lock().ok().and_then(|state| state.lost.clone())
    }

    fn runs_out_at(&self) -> Option<Instant> {
        self.state.lock().ok().map(|state| state.runs_out_at)
    }

    fn lose(&self, because: CallError) {
        if let Ok(mut state) = self.state.lock() {
            state.lost.get_or_insert(because);
        }
        self.cancelled.cancel();
    }

    fn extend_request(&self, checkpoint: Option<Vec<u8>>) -> ExtendLeaseRequest {
        ExtendLeaseRequest {
            namespace: self.spec.namespace.clone(),
            key: self.spec.key.clone(),
            lease_token: self.token,
            lease_ttl: Some(duration_message(self.spec.lease_ttl)),
            checkpoint,
        }
    }

    /// ExtendLease (with a checkpoint, if given), retried as `retry` allows within the retry
    /// budget; a refusal that means the key is no longer this holder's loses the lease.
    async fn extend(&self, checkpoint: Option<Vec<u8>>, retry: Retry) -> Result<(), Error> {
        let give_up_at = Instant::now() + self.client.retry.total;
        self.extend_until(checkpoint, retry, give_up_at).await
    }

    /// [`Shared::extend`] with no retry started after `give_up_at`. The lease is counted from
    /// the sending of the try that got through: the service renews it when it handles that try,
    /// never before it was sent (an earlier try whose answer was lost renewed it no later).
    async fn extend_until(
        &self,
        checkpoint: Option<Vec<u8>>,
        retry: Retry,
        give_up_at: Instant,
    ) -> Result<(), Error> {
        let request = self.extend_request(checkpoint);
        let last_sent_at = Mutex::new(Instant::now());
        let answer = self
            .client
            .call_until(
                "ExtendLease",
                || {
                    if let Ok(mut sent_at) = last_sent_at.lock() {
                        *sent_at = Instant::now();
                    }
                    (request.clone(), Duration::ZERO)
                },
                retry,
                give_up_at,
                |mut grpc, r| async move { grpc.extend_lease(r).await },
            )
            .await;
        let sent_at = *last_sent_at.lock().unwrap_or_else(|p| p.into_inner());
        match answer {
            Ok(answer) => {
                if let Ok(mut state) = self.state.lock() {
                    state.expires_at = system_time(answer.lease_expires_at);
                    state.runs_out_at = sent_at + self.spec.lease_ttl;
                }
                Ok(())
            }
            Err(
                Error::LeaseLost(cause)
                | Error::KeyNotFound(cause)
                | Error::AlreadyCompleted(cause),
            ) => {
                self.lose(cause.clone());
                Err(Error::LeaseLost(cause))
            }
            Err(other) => Err(other),
        }
    }
}

impl Lease {
    pub fn namespace(&self) -> &str {
        &self.shared.spec.namespace
    }

    pub fn key(&self) -> &str {
        &self.shared.spec.key
    }

    /// The fencing token of this claim.
    pub fn token(&self) -> u64 {
        self.shared.token
    }

    /// 1 for a fresh claim, one more for every takeover.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// What a previous holder saved with [`Lease::save_checkpoint`], handed over on takeover.
    pub fn checkpoint(&self) -> Option<&[u8]> {
        self.checkpoint.as_deref()
    }

    /// When the lease runs out, by the service's clock, as last renewed.
    pub fn expires_at(&self) -> SystemTime {
        self.shared
            .state
            .lock()
            .map(|state| state.expires_at)
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// The signal that the lease is lost: select on `cancelled()` or check `is_cancelled()`.
    pub fn cancellation(&self) -> CancellationToken {
        self.shared.cancelled.clone()
    }

    /// Completes when the lease is lost.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.shared.cancelled.cancelled()
    }

    pub fn is_cancelled(&self) -> bool {
        self.shared.cancelled.is_cancelled()
    }

    /// Saves progress (at most 64 KiB) for whoever takes the key over if this holder dies, and
    /// renews the lease. Fails with [`Error::LeaseLost`] when the key is no longer this
    /// holder's (and the cancellation fires).
    pub async fn save_checkpoint(&self, checkpoint: impl Into<Vec<u8>>) -> Result<(), Error> {
        self.shared
            .extend(Some(checkpoint.into()), Retry::Transient)
            .await
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("namespace", &self.shared.spec.namespace)
            .field("token", &self.shared.token)
            .field("attempt", &self.attempt)
            .field("cancelled", &self.is_cancelled())
            .finish_non_exhaustive()
    }
}

/// Polls the work while the heartbeat renews its lease. Once the lease is lost, the work's
/// cancellation fires and it has `grace` to return; after that it is dropped.
pub(super) async fn run_with_heartbeat<Fut: Future>(
    shared: &Shared,
    work: Fut,
    heartbeat: Option<Duration>,
    grace: Duration,
) -> Option<Fut::Output> {
    tokio::pin!(work);
    let beating = async {
        match heartbeat {
            Some(interval) => beat(shared, interval).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        output = &mut work => return Some(output),
        () = beating => {}
    }
    // The lease is lost (and the cancellation fired): the work's outcome no longer counts, but
    // it may finish what it must undo.
    tokio::time::timeout(grace, &mut work).await.ok()
}

/// The heartbeat: returns once the lease is lost.
pub(super) async fn beat(shared: &Shared, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        match shared.extend(None, Retry::Never).await {
            Ok(()) => {}
            Err(Error::LeaseLost(_)) => {
                tracing::warn!(namespace = %shared.spec.namespace, "lease lost; cancelling the work");
                return;
            }
            Err(error) => {
                // A missed beat is harmless while the lease still runs; once it may have run
                // out, another caller may hold the key, so the work must stop.
                let ran_out = shared
                    .runs_out_at()
                    .is_none_or(|runs_out_at| Instant::now() >= runs_out_at);
                if ran_out {
                    tracing::warn!(%error, "the lease ran out while the service was unreachable");
                    let cause = error.call().cloned().unwrap_or_else(|| {
                        CallError::local(tonic::Code::Unavailable, error.to_string())
                    });
                    shared.lose(cause);
                    return;
                }
                tracing::info!(%error, "heartbeat failed; trying again at the next beat");
            }
        }
    }
}

/// Releases the claim in the background when `run` is dropped while its work runs (the caller
/// was cancelled, or timed out), so that a retry starts fresh instead of waiting for the lease
/// to run out: the same as a work that failed.
pub(super) struct ReleaseIfAbandoned(pub(super) Option<Arc<Shared>>);

impl Drop for ReleaseIfAbandoned {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            shared.cancelled.cancel();
            runtime.spawn(async move { release(&shared).await });
        }
    }
}

/// Renews, before the work starts, a lease that the service granted only after holding the
/// claiming TryStart (docs/contract.md, "A claim that waited"): the client cannot tell when
/// during that call the lease began, so it counts it from the call's sending, which may leave
/// little or nothing of it; the renewal gives the work a whole lease, counted from its own
/// sending. It is retried while the lease counted from the TryStart's sending, and the retry
/// budget, last (the first try is always sent). When it cannot get through, the claim is
/// released, best effort, so that a retry need not wait for the lease to run out.
pub(super) async fn renew_before_work(shared: &Shared, claimed_at: Instant) -> Result<(), Error> {
    let budget_ends = Instant::now() + shared.client.retry.total;
    let give_up_at = shared
        .runs_out_at()
        .map_or(budget_ends, |runs_out_at| runs_out_at.min(budget_ends));
    tracing::debug!(namespace = %shared.spec.namespace, "the claim waited; renewing its lease");
    match shared
        .extend_until(None, Retry::Transient, give_up_at)
        .await
    {
        Ok(()) => Ok(()),
        Err(lost @ Error::LeaseLost(_)) => Err(lost),
        Err(error) => {
            // The service granted the lease no later than it answered the TryStart, so the key
            // may be held until a lease after that: releasing is worth trying until then.
            let may_hold_until = (claimed_at + shared.spec.lease_ttl).min(budget_ends);
            release_until(shared, may_hold_until).await;
            Err(error)
        }
    }
}

/// Gives the claim up so that a retry starts fresh. Failing to is not the caller's error: the
/// claim frees itself when its lease runs out.
pub(super) async fn release(shared: &Shared) {
    release_until(shared, Instant::now() + shared.client.retry.total).await;
}

/// [`release`] with no retry started after `give_up_at`.
async fn release_until(shared: &Shared, give_up_at: Instant) {
    let request = ReleaseRequest {
        namespace: shared.spec.namespace.clone(),
        key: shared.spec.key.clone(),
        lease_token: shared.token,
    };
    let released = shared
        .client
        .call_until(
            "Release",
            || (request.clone(), Duration::ZERO),
            Retry::Transient,
            give_up_at,
            |mut grpc, r| async move { grpc.release(r).await },
        )
        .await;
    match released {
        // Already absent: an earlier try of this Release worked, or the key expired.
        Ok(_) | Err(Error::KeyNotFound(_)) => {}
        Err(Error::LeaseLost(cause)) => shared.lose(cause),
        Err(error) => {
            tracing::warn!(%error, "could not release a claim; it frees when its lease runs out");
        }
    }
}

/// Stores the result. A Complete that finds this very result already stored (an earlier try
/// whose answer was lost) counts as success.
pub(super) async fn complete(shared: &Shared, response: Vec<u8>) -> Result<(), Error> {
    let request = CompleteRequest {
        namespace: shared.spec.namespace.clone(),
        key: shared.spec.key.clone(),
        lease_token: shared.token,
        response,
        // The retention given to TryStart already covers the completion.
        retention: None,
    };
    let completed = shared
        .client
        .call(
            "Complete",
            &request,
            Retry::Transient,
            |mut grpc, r| async move { grpc.complete(r).await },
        )
        .await;
    match completed {
        Ok(_) => Ok(()),
        Err(Error::KeyNotFound(cause)) => Err(Error::LeaseLost(cause)),
        Err(Error::AlreadyCompleted(cause)) => {
            let lookup = LookupRequest {
                namespace: shared.spec.namespace.clone(),
                key: shared.spec.key.clone(),
            };
            let state = shared
                .client
                .call(
                    "Lookup",
                    &lookup,
                    Retry::Transient,
                    |mut grpc, r| async move { grpc.lookup(r).await },
                )
                .await?;
            match state.state {
                Some(lookup_response::State::Completed(stored))
                    if stored.response == request.response =>
                {
                    Ok(())
                }
                _ => Err(Error::AlreadyCompleted(cause)),
            }
        }
        Err(error) => Err(error),
    }
}
