//! `run_once`: the protocol every caller would otherwise write by hand. TryStart with an
//! `attempt_id` (retried with the same id), replay, waiting for another holder, a heartbeat
//! while the work runs, Complete with the result, Release when the work fails.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::client::{Client, DEFAULT_LEASE_TTL, DEFAULT_WAIT, HEARTBEAT_DIVISOR, Retry};
use crate::codec::{Codec, fingerprint_of, fingerprint_of_bytes};
use crate::error::{CallError, Error, RunError};
use crate::proto::{
    CompleteRequest, ExtendLeaseRequest, LookupRequest, ReleaseRequest, TryStartRequest,
    lookup_response, try_start_response,
};
use crate::{Json, duration_message, system_time};

/// What `run` returns: the result, and whether it was replayed from an earlier run (`true`) or
/// produced by this call's own work (`false`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome<T> {
    pub value: T,
    pub replayed: bool,
}

/// Turns an error of the work into a final result to store, or `None` to release the key.
type ErrorResult<T, E> = Box<dyn Fn(&E) -> Option<T> + Send + Sync>;

/// A `run_once` being built; see [`Client::run_once`]. `T` is the work's result, `E` its error
/// and `C` the codec that stores the result (JSON unless [`RunOnce::codec`] says otherwise).
#[must_use = "nothing happens until `run` is awaited"]
pub struct RunOnce<'c, T, E, C> {
    client: &'c Client,
    namespace: String,
    key: String,
    fingerprint: Result<Vec<u8>, Error>,
    lease_ttl: Duration,
    retention: Option<Duration>,
    wait: Duration,
    heartbeat: Option<Duration>,
    heartbeat_auto: bool,
    cancel_grace: Duration,
    codec: C,
    error_result: Option<ErrorResult<T, E>>,
    _types: PhantomData<fn() -> (T, E)>,
}

impl<'c> RunOnce<'c, (), (), crate::Json> {
    pub(crate) fn new<T, E>(
        client: &'c Client,
        namespace: String,
        key: String,
    ) -> RunOnce<'c, T, E, crate::Json> {
        RunOnce {
            client,
            namespace,
            key,
            fingerprint: Ok(Vec::new()),
            lease_ttl: DEFAULT_LEASE_TTL,
            retention: None,
            wait: DEFAULT_WAIT,
            heartbeat: None,
            heartbeat_auto: true,
            cancel_grace: Duration::from_secs(5),
            codec: crate::Json,
            error_result: None,
            _types: PhantomData,
        }
    }
}

impl<'c, T, E, C> RunOnce<'c, T, E, C> {
    /// What the fingerprint is computed from: SHA-256 of its RFC 8785 canonical JSON, so that
    /// field order does not matter and other languages' clients agree. Without it (and without
    /// [`RunOnce::fingerprint`]) the fingerprint is empty, which matches only empty ones.
    pub fn request<R: serde::Serialize>(mut self, request: &R) -> Self {
        self.fingerprint = fingerprint_of(request);
        self
    }

    /// A request that is already bytes: the fingerprint is the SHA-256 of them as they are.
    pub fn request_bytes(mut self, request: &[u8]) -> Self {
        self.fingerprint = Ok(fingerprint_of_bytes(request));
        self
    }

    /// Your own fingerprint (at most 64 bytes), used instead of hashing a request.
    pub fn fingerprint(mut self, fingerprint: impl Into<Vec<u8>>) -> Self {
        self.fingerprint = Ok(fingerprint.into());
        self
    }

    /// How long the claim is held without a heartbeat (default 30 s; 100 ms – 24 h).
    pub fn lease_ttl(mut self, lease_ttl: Duration) -> Self {
        self.lease_ttl = lease_ttl;
        self
    }

    /// How long the key is kept (the service's default is 24 h; 1 s – 30 d).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// How long to wait for another holder before failing with [`Error::InProgress`] (default
    /// zero: answer at once). The service holds the TryStart until the holder finishes, gives
    /// up or its lease runs out (at most 60 s per TryStart; longer limits ask again). A claim
    /// granted after the service held its TryStart longer than a tenth of the lease is renewed
    /// (ExtendLease) before the work starts, so that the work has its whole lease.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// `true` (the default): ExtendLease every third of the lease while the work runs; `false`:
    /// none (only for work well within its lease).
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat_auto = on;
        self.heartbeat = None;
        self
    }

    /// ExtendLease at this interval instead of every third of the lease.
    pub fn heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_auto = false;
        self.heartbeat = Some(interval);
        self
    }

    /// Once the lease is lost, how long the work may take to notice its cancellation and
    /// return before it is dropped (default 5 s).
    pub fn cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    /// Which errors of the work are final results to store (a card declined, a 4xx) rather
    /// than failures to release: `Some(result)` is Completed and returned like the work's own
    /// value; `None` releases the key and returns the error.
    pub fn error_result(mut self, map: impl Fn(&E) -> Option<T> + Send + Sync + 'static) -> Self {
        self.error_result = Some(Box::new(map));
        self
    }

    /// How results are stored (default [`crate::Json`]; [`crate::Bytes`] for `Vec<u8>`).
    pub fn codec<D>(self, codec: D) -> RunOnce<'c, T, E, D> {
        RunOnce {
            client: self.client,
            namespace: self.namespace,
            key: self.key,
            fingerprint: self.fingerprint,
            lease_ttl: self.lease_ttl,
            retention: self.retention,
            wait: self.wait,
            heartbeat: self.heartbeat,
            heartbeat_auto: self.heartbeat_auto,
            cancel_grace: self.cancel_grace,
            codec,
            error_result: self.error_result,
            _types: PhantomData,
        }
    }

    fn heartbeat_interval_checked(&self) -> Result<Option<Duration>, Error> {
        match (self.heartbeat_auto, self.heartbeat) {
            (true, _) => Ok(Some(self.lease_ttl / HEARTBEAT_DIVISOR)),
            (false, None) => Ok(None),
            (false, Some(interval)) if interval.is_zero() => {
                Err(Error::config("the heartbeat interval must be positive"))
            }
            (false, Some(interval)) => Ok(Some(interval)),
        }
    }
}

impl<T, E, C: Codec<T>> RunOnce<'_, T, E, C> {
    /// Runs `work` at most once for the key, or returns the result of the run that did.
    ///
    /// `work` gets the [`Lease`] and returns the result to store. A completed key is replayed
    /// (`replayed: true`) without running it; a key held elsewhere is waited for up to `wait`.
    pub async fn run<F, Fut>(self, work: F) -> Result<Outcome<T>, RunError<E>>
    where
        F: FnOnce(Lease) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let heartbeat = self.heartbeat_interval_checked()?;
        let spec = Spec {
            namespace: self.namespace,
            key: self.key,
            lease_ttl: self.lease_ttl,
        };
        let fingerprint = self.fingerprint?;
        let started =
            match claim(self.client, &spec, fingerprint, self.retention, self.wait).await? {
                Claim::Replay(response) => {
                    let value = self.codec.decode(&response).map_err(Error::Decode)?;
                    return Ok(Outcome {
                        value,
                        replayed: true,
                    });
                }
                Claim::Started(started) => started,
            };
        let lease = Lease {
            shared: Arc::new(Shared {
                client: self.client.clone(),
                spec,
                token: started.token,
                state: Mutex::new(LeaseState {
                    expires_at: started.expires_at,
                    runs_out_at: started.runs_out_at,
                    lost: None,
                }),
                cancelled: CancellationToken::new(),
            }),
            attempt: started.attempt,
            checkpoint: started.checkpoint,
        };
        let shared = lease.shared.clone();

        let mut abandoned = ReleaseIfAbandoned(Some(shared.clone()));
        if started.took > shared.spec.lease_ttl / RENEW_AFTER_WAIT_DIVISOR {
            // The lease may have begun anywhere within that wait: renewed now, the work gets
            // all of it (docs/contract.md, "A claim that waited").
            if let Err(error) = renew_before_work(&shared, started.answered_at).await {
                abandoned.0 = None;
                return Err(error.into());
            }
        }
        let result = run_with_heartbeat(&shared, work(lease), heartbeat, self.cancel_grace).await;
        abandoned.0 = None;
        let (Some(result), None) = (result, shared.lost()) else {
            let cause = shared.lost().unwrap_or_else(|| {
                CallError::local(
                    tonic::Code::Aborted,
                    "the lease was lost while the work ran",
                )
            });
            return Err(Error::LeaseLost(cause).into());
        };
        let value = match result {
            Ok(value) => value,
            Err(error) => match self.error_result.as_ref().and_then(|map| map(&error)) {
                Some(final_result) => final_result,
                None => {
                    release(&shared).await;
                    return Err(RunError::Work(error));
                }
            },
        };
        let response = match self.codec.encode(&value) {
            Ok(response) => response,
            Err(error) => {
                release(&shared).await;
                return Err(Error::Encode(error).into());
            }
        };
        match complete(&shared, response.clone()).await {
            Ok(()) => {}
            Err(lost @ Error::LeaseLost(_)) => return Err(lost.into()),
            // The work ran: its result goes to the caller with the news that it is not stored,
            // unlike a failure before the work, after which nothing happened.
            Err(error) => {
                return Err(Error::ResultNotStored {
                    response,
                    source: Box::new(error),
                }
                .into());
            }
        }
        Ok(Outcome {
            value,
            replayed: false,
        })
    }
}

/// The key, as the calls of one `run_once` name it.
struct Spec {
    namespace: String,
    key: String,
    lease_ttl: Duration,
}

struct Started {
    token: u64,
    attempt: u32,
    checkpoint: Option<Vec<u8>>,
    expires_at: SystemTime,
    runs_out_at: Instant,
    /// When the claiming TryStart was answered.
    answered_at: Instant,
    /// How long the service held the claiming TryStart before it answered.
    took: Duration,
}

enum Claim {
    Started(Started),
    Replay(Vec<u8>),
}

/// Claims the key: TryStart with one `attempt_id` for this whole logical attempt, so that a try
/// whose answer was lost is recognised by the service when it is sent again (the client's
/// retries) and a TryStart after `in_progress` finds this caller's own claim if it had one.
///
/// The one place that waits for a holder: each TryStart asks the service to wait for it (the
/// request's `wait`, what is left of the caller's limit, at most 60 s) and is given that long on
/// top of the normal call timeout. A service that answers `in_progress` clearly before the wait
/// it was asked for (it is at its waiter limit) is asked again after a short pause, so that a
/// full service is not hammered.
async fn claim(
    client: &Client,
    spec: &Spec,
    fingerprint: Vec<u8>,
    retention: Option<Duration>,
    wait: Duration,
) -> Result<Claim, Error> {
    let request = TryStartRequest {
        namespace: spec.namespace.clone(),
        key: spec.key.clone(),
        fingerprint,
        lease_ttl: Some(duration_message(spec.lease_ttl)),
        retention: retention.map(duration_message),
        attempt_id: uuid::Uuid::new_v4().simple().to_string(),
        wait: None,
    };
    let wait_until = Instant::now() + wait;
    let mut pauses = holder_poll_delays();
    loop {
        let asked_at = Instant::now();
        let asked_wait = server_wait(wait_until);
        tracing::debug!(namespace = %spec.namespace, wait = ?asked_wait, "claiming the key");
        let answer = client
            .call_until(
                "TryStart",
                || {
                    // Recomputed for every try, so that a retry never waits past the limit.
                    let wait = server_wait(wait_until);
                    let mut request = request.clone();
                    request.wait = (!wait.is_zero()).then(|| duration_message(wait));
                    (request, wait)
                },
                Retry::Transient,
                client.retry_deadline(),
                |mut grpc, r| async move { grpc.try_start(r).await },
            )
            .await?;
        match answer.outcome {
            Some(try_start_response::Outcome::Started(started)) => {
                let answered_at = Instant::now();
                return Ok(Claim::Started(Started {
                    token: started.lease_token,
                    attempt: started.attempt,
                    checkpoint: started.checkpoint,
                    expires_at: system_time(started.lease_expires_at),
                    // Counted from before TryStart was sent: never later than the service's.
                    runs_out_at: asked_at + spec.lease_ttl,
                    answered_at,
                    took: answered_at - asked_at,
                }));
            }
            Some(try_start_response::Outcome::Completed(completed)) => {
                return Ok(Claim::Replay(completed.response));
            }
            Some(try_start_response::Outcome::FingerprintMismatch(_)) => {
                return Err(Error::FingerprintMismatch);
            }
            Some(try_start_response::Outcome::InProgress(held)) => {
                let remaining = wait_until.saturating_duration_since(Instant::now());
                // A service that waited until (about) the limit has answered for all of it.
                if remaining < WAIT_SLACK {
                    let lease_expires_at = system_time(held.lease_expires_at);
                    return Err(Error::InProgress {
                        lease_expires_at,
                        attempt: held.attempt,
                        retry_after: lease_expires_at
                            .duration_since(SystemTime::now())
                            .unwrap_or_default(),
                    });
                }
                // The service held the call for (about) the wait it was asked for: ask again at
                // once. It answered clearly sooner (at its waiter limit): pause first.
                if asked_at.elapsed() < asked_wait / 2 {
                    tracing::debug!(namespace = %spec.namespace, "the service did not wait; pausing");
                    let pause = pauses.next().unwrap_or(Duration::from_secs(1));
                    tokio::time::sleep(pause.min(remaining)).await;
                }
            }
            None => {
                return Err(Error::Call(CallError::local(
                    tonic::Code::Unknown,
                    "TryStart answered an outcome this client does not know",
                )));
            }
        }
    }
}

/// A claim whose TryStart took longer than this part of the lease (`lease_ttl / 10`) is renewed
/// before the work starts. Below it, counting the lease from the TryStart's sending costs the
/// work less than a tenth of its lease and the heartbeat (every third) keeps most of its margin;
/// past it, a long wait would leave the work little of its lease, or none.
const RENEW_AFTER_WAIT_DIVISOR: u32 = 10;

/// What is left of the caller's limit when a waiting TryStart comes back that is too little to
/// ask again for.
const WAIT_SLACK: Duration = Duration::from_millis(20);

/// The longest wait one TryStart may ask the service for.
const MAX_SERVER_WAIT: Duration = Duration::from_secs(60);

/// What a TryStart sent now asks the service to wait: what is left of the caller's limit, at
/// most 60 s, in whole milliseconds.
fn server_wait(wait_until: Instant) -> Duration {
    let left = wait_until.saturating_duration_since(Instant::now());
    let millis = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(millis).min(MAX_SERVER_WAIT)
}

/// Pauses between TryStarts while the service answers `in_progress` without waiting (it is at
/// its waiter limit): quick at first, then at most one a second.
fn holder_poll_delays() -> crate::client::Backoff {
    crate::RetryPolicy {
        initial_delay: Duration::from_millis(50),
        max_delay: Duration::from_secs(1),
        multiplier: 1.5,
        total: Duration::MAX,
    }
    .delays()
}

/// The run's entry points on [`Client`]: they live with the run, so that the client's module
/// does not depend on this one (which depends on it).
impl Client {
    /// Runs an operation at most once for `key` in `namespace`: set the options on the builder,
    /// then [`RunOnce::run`] the work.
    pub fn run_once<T, E>(
        &self,
        namespace: impl Into<String>,
        key: impl Into<String>,
    ) -> RunOnce<'_, T, E, Json> {
        RunOnce::new(self, namespace.into(), key.into())
    }

    /// [`Client::run_once`] with the consumer as namespace and the event id as key: handles an
    /// event's effect exactly once.
    pub fn process_once<T, E>(
        &self,
        consumer: impl Into<String>,
        event_id: impl Into<String>,
    ) -> RunOnce<'_, T, E, Json> {
        self.run_once(consumer, event_id)
    }
}

mod lease;
pub use lease::Lease;
use lease::{
    LeaseState, ReleaseIfAbandoned, Shared, complete, release, renew_before_work,
    run_with_heartbeat,
};
