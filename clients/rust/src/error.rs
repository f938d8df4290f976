//! Typed errors: one variant per reason in the contract, the two outcomes that are not results
//! (`InProgress`, `FingerprintMismatch`), and the client's own failures.
//!
//! The service answers errors with a `google.rpc.Status` in the `grpc-status-details-bin`
//! trailer: an `ErrorInfo` (domain `idempotency.v1`) whose reason picks the variant, a
//! `BadRequest` whose field violations name the bad fields, and a `RetryInfo` when waiting
//! helps. Errors without it (the transport failed, a deadline passed, the gRPC layer refused a
//! message) are sorted by their status code alone.

use std::fmt;
use std::time::{Duration, SystemTime};

use tonic::{Code, Status};
use tonic_types::StatusExt;

/// The `ErrorInfo` domain of the coordinator's reasons.
pub const ERROR_DOMAIN: &str = "idempotency.v1";

/// One bad field of a request, as the service named it (`event_ids[3]` for an element).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: String,
    pub description: String,
}

/// A call the service refused, or that failed on its way: the status, decoded.
#[derive(Debug, Clone)]
pub struct CallError {
    /// The gRPC status code.
    pub code: Code,
    /// The contract's reason (`LEASE_LOST`, `STORE_UNAVAILABLE`, ...), or `None` when the
    /// service sent none (the transport failed, a deadline passed on this side).
    pub reason: Option<String>,
    /// The status message.
    pub message: String,
    /// Every bad field, for `INVALID_ARGUMENT`.
    pub field_violations: Vec<FieldViolation>,
    /// How long the service asked the caller to wait (`RetryInfo`).
    pub retry_after: Option<Duration>,
}

impl CallError {
    /// Decodes a status and its rich details.
    pub fn from_status(status: &Status) -> Self {
        // A status with a source was made on this side by the transport (tonic keeps the
        // hyper or h2 error): the connection broke or closed before an answer came. Whatever
        // code tonic chose for it (`Unknown` for "transport error", `Cancelled` when the
        // connection went away before the request was sent), the service was not reached.
        let code = match status.code() {
            Code::Unknown | Code::Cancelled if std::error::Error::source(status).is_some() => {
                Code::Unavailable
            }
            code => code,
        };
        let details = status.get_error_details();
        let reason = details
            .error_info()
            .filter(|info| info.domain == ERROR_DOMAIN)
            .map(|info| info.reason.clone());
        let field_violations = details
            .bad_request()
            .map(|bad| {
                bad.field_violations
                    .iter()
                    .map(|v| FieldViolation {
                        field: v.field.clone(),
                        description: v.description.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let retry_after = details.retry_info().and_then(|info| info.retry_delay);
        Self {
            code,
            reason,
            message: status.message().to_owned(),
            field_violations,
            retry_after,
        }
    }

    /// An error made on this side of the wire (no status from the service).
    pub(crate) fn local(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: None,
            message: message.into(),
            field_violations: Vec::new(),
            retry_after: None,
        }
    }

    /// The names of the bad fields, in the service's order.
    pub fn fields(&self) -> Vec<&str> {
        self.field_violations
            .iter()
            .map(|v| v.field.as_str())
            .collect()
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.reason {
            Some(reason) => write!(f, "{reason}: {}", self.message),
            None => write!(f, "{:?}: {}", self.code, self.message),
        }
    }
}

impl std::error::Error for CallError {}

/// Everything the client itself can fail with. The work's own errors are not here: `run`
/// returns them as [`RunError::Work`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another caller holds the key and did not finish within `wait` (HTTP 409 with
    /// `Retry-After: retry_after`).
    #[error("the key is in progress elsewhere (attempt {attempt}); retry in {retry_after:?}")]
    InProgress {
        /// When the holder's lease runs out, by the service's clock.
        lease_expires_at: SystemTime,
        /// The holder's attempt.
        attempt: u32,
        /// Time until the holder's lease runs out, by this machine's clock (zero when it has:
        /// the next try may take the key over).
        retry_after: Duration,
    },
    /// The key was used for a different request (HTTP 422). Nothing changed.
    #[error("the key was used for a different request (fingerprint mismatch)")]
    FingerprintMismatch,
    /// This caller no longer holds the key: someone took it over after the lease ran out, or
    /// the key expired or was released under the work (the cause is then `KEY_NOT_FOUND`), or
    /// the heartbeat could not reach the service before the lease ran out (the cause is that
    /// failure). The new holder owns the result: stop, and do not report success.
    #[error("the lease was lost: another caller may hold the key now ({0})")]
    LeaseLost(CallError),
    /// `INVALID_ARGUMENT`: a field was missing, malformed or out of bounds; see
    /// [`CallError::field_violations`]. Nothing was written.
    #[error("invalid argument: {0}")]
    InvalidArgument(CallError),
    /// `NOT_FOUND` / `KEY_NOT_FOUND`: Complete, Release or ExtendLease on an absent or expired key.
    #[error("key not found: {0}")]
    KeyNotFound(CallError),
    /// `FAILED_PRECONDITION` / `ALREADY_COMPLETED`: the key holds another result.
    #[error("already completed: {0}")]
    AlreadyCompleted(CallError),
    /// `UNAVAILABLE` / `STORE_UNAVAILABLE`: the service's database is down or slow; nothing was
    /// written. Returned once retries ran out.
    #[error("store unavailable: {0}")]
    StoreUnavailable(CallError),
    /// `UNAVAILABLE` without a reason: the service could not be reached (after retries, for
    /// retried calls).
    #[error("coordinator unavailable: {0}")]
    Unavailable(CallError),
    /// A call did not answer within the client's call timeout (after retries, for retried calls).
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(CallError),
    /// `UNAUTHENTICATED`: no token, or one the service does not know.
    #[error("unauthenticated: {0}")]
    Unauthenticated(CallError),
    /// `PERMISSION_DENIED`: the token does not hold this namespace or consumer.
    #[error("permission denied: {0}")]
    PermissionDenied(CallError),
    /// `RESOURCE_EXHAUSTED` / `RATE_LIMITED`: the token is over its rate limit; returned once
    /// retries ran out.
    #[error("rate limited: {0}")]
    RateLimited(CallError),
    /// `RESOURCE_EXHAUSTED` / `OVERLOADED`: the service is short of room for responses not yet
    /// read and refused a call that wrote nothing; returned once retries ran out.
    #[error("coordinator overloaded: {0}")]
    Overloaded(CallError),
    /// `INTERNAL`: an unexpected failure inside the service, a bug to report.
    #[error("internal error in the coordinator: {0}")]
    Internal(CallError),
    /// Any other status (e.g. `OUT_OF_RANGE` for a message over the service's size limit).
    #[error("call failed: {0}")]
    Call(CallError),
    /// The work ran and returned a result, encoded here as `response`, but Complete could not
    /// store it: `source` says why (the service unreachable for the whole retry budget, or a
    /// refusal). The key stays claimed until its lease runs out, and a retry after that runs the
    /// work again: answer with the result (decode `response` with the run's codec) if the effect
    /// must not be repeated, knowing it is not recorded. A lost lease is `LeaseLost` instead.
    #[error("the work ran but its result was not stored: {source}")]
    ResultNotStored {
        /// The work's result, as the codec encoded it for Complete.
        response: Vec<u8>,
        /// Complete's failure.
        source: Box<Error>,
    },
    /// The request could not be turned into canonical JSON for the fingerprint (its
    /// [`crate::CanonicalJsonError::kind`] says why); nothing was sent.
    #[error("the request cannot be fingerprinted: {0}")]
    Fingerprint(#[source] crate::CanonicalJsonError),
    /// The work's result could not be encoded for storing; the key was released.
    #[error("the result cannot be encoded: {0}")]
    Encode(#[source] BoxError),
    /// A stored result could not be decoded into the expected type.
    #[error("the stored result cannot be decoded: {0}")]
    Decode(#[source] BoxError),
    /// The client's settings are unusable (an endpoint that is no URI, a token that is no
    /// header value, a zero heartbeat interval), or the first connection failed.
    #[error("client configuration: {message}")]
    Config {
        message: String,
        #[source]
        source: Option<BoxError>,
    },
}

/// A boxed error from a codec or the transport.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl Error {
    /// The typed error for a failed call's status.
    pub fn from_status(status: &Status) -> Self {
        Self::from_call(CallError::from_status(status))
    }

    pub(crate) fn from_call(call: CallError) -> Self {
        match call.reason.as_deref() {
            Some("INVALID_ARGUMENT") => Self::InvalidArgument(call),
            Some("LEASE_LOST") => Self::LeaseLost(call),
            Some("KEY_NOT_FOUND") => Self::KeyNotFound(call),
            Some("ALREADY_COMPLETED") => Self::AlreadyCompleted(call),
            Some("STORE_UNAVAILABLE") => Self::StoreUnavailable(call),
            Some("UNAUTHENTICATED") => Self::Unauthenticated(call),
            Some("PERMISSION_DENIED") => Self::PermissionDenied(call),
            Some("RATE_LIMITED") => Self::RateLimited(call),
            Some("OVERLOADED") => Self::Overloaded(call),
            Some("INTERNAL") => Self::Internal(call),
            _ => match call.code {
                Code::InvalidArgument => Self::InvalidArgument(call),
                Code::Aborted => Self::LeaseLost(call),
                Code::NotFound => Self::KeyNotFound(call),
                Code::FailedPrecondition => Self::AlreadyCompleted(call),
                Code::Unavailable => Self::Unavailable(call),
                Code::DeadlineExceeded => Self::DeadlineExceeded(call),
                Code::Unauthenticated => Self::Unauthenticated(call),
                Code::PermissionDenied => Self::PermissionDenied(call),
                // RESOURCE_EXHAUSTED without a reason is not the service's refusal (tonic answers
                // it for a message over its own limit, which no retry cures): `Call`.
                Code::Internal => Self::Internal(call),
                _ => Self::Call(call),
            },
        }
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        Self::Config {
            message: message.into(),
            source: None,
        }
    }

    /// The decoded status, for errors that came from a call.
    pub fn call(&self) -> Option<&CallError> {
        match self {
            Self::LeaseLost(call)
            | Self::InvalidArgument(call)
            | Self::KeyNotFound(call)
            | Self::AlreadyCompleted(call)
            | Self::StoreUnavailable(call)
            | Self::Unavailable(call)
            | Self::DeadlineExceeded(call)
            | Self::Unauthenticated(call)
            | Self::PermissionDenied(call)
            | Self::RateLimited(call)
            | Self::Overloaded(call)
            | Self::Internal(call)
            | Self::Call(call) => Some(call),
            Self::ResultNotStored { source, .. } => source.call(),
            _ => None,
        }
    }

    /// How long to wait before trying again, when the error says: the holder's remaining lease
    /// for `InProgress`, the service's `RetryInfo` otherwise.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after, .. } => Some(*retry_after),
            other => other.call().and_then(|call| call.retry_after),
        }
    }

    /// The bad fields' names, for `InvalidArgument` (empty otherwise).
    pub fn fields(&self) -> Vec<&str> {
        match self {
            Self::InvalidArgument(call) => call.fields(),
            _ => Vec::new(),
        }
    }

    /// The work's encoded result, for [`Error::ResultNotStored`].
    pub fn unstored_response(&self) -> Option<&[u8]> {
        match self {
            Self::ResultNotStored { response, .. } => Some(response),
            _ => None,
        }
    }

    /// A failure after which the same call may succeed: the service was unreachable
    /// (`UNAVAILABLE`), slow (`DEADLINE_EXCEEDED`) or refused it at the door. Retried for calls
    /// whose repetition is harmless.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::StoreUnavailable(_) | Self::DeadlineExceeded(_)
        ) || self.is_refused_at_the_door()
    }

    /// Refused before anything ran (`RESOURCE_EXHAUSTED` with reason `RATE_LIMITED` or
    /// `OVERLOADED`): even a call whose repetition is not harmless may be sent again.
    pub(crate) fn is_refused_at_the_door(&self) -> bool {
        matches!(self, Self::RateLimited(_) | Self::Overloaded(_))
    }
}

/// What [`crate::RunOnce::run`] fails with: the work's own error (after the key was released,
/// so that a retry starts fresh), or the client's.
#[derive(Debug)]
pub enum RunError<E> {
    /// The work returned this error, and `error_result` did not turn it into a result; the key
    /// was released.
    Work(E),
    /// The coordinator refused, or could not be reached, or the lease was lost.
    Coordinator(Error),
}

impl<E> RunError<E> {
    /// The client's error, if that is what this is.
    pub fn coordinator(&self) -> Option<&Error> {
        match self {
            Self::Coordinator(error) => Some(error),
            Self::Work(_) => None,
        }
    }

    /// The work's error, if that is what this is.
    pub fn work(&self) -> Option<&E> {
        match self {
            Self::Work(error) => Some(error),
            Self::Coordinator(_) => None,
        }
    }

    /// Converts the work's error, e.g. into `anyhow::Error`.
    pub fn map_work<F, G: FnOnce(E) -> F>(self, f: G) -> RunError<F> {
        match self {
            Self::Work(error) => RunError::Work(f(error)),
            Self::Coordinator(error) => RunError::Coordinator(error),
        }
    }
}

impl<E> From<Error> for RunError<E> {
    fn from(error: Error) -> Self {
        Self::Coordinator(error)
    }
}

impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Work(error) => write!(f, "the work failed: {error}"),
            Self::Coordinator(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RunError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Work(error) => Some(error),
            Self::Coordinator(error) => Some(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic_types::{ErrorDetails, StatusExt};

    use super::*;

    fn status(code: Code, details: ErrorDetails) -> Status {
        Status::with_error_details(code, "refused", details)
    }

    #[test]
    fn the_reason_picks_the_variant_and_details_are_decoded() {
        let mut details = ErrorDetails::with_error_info("INVALID_ARGUMENT", ERROR_DOMAIN, []);
        details.add_bad_request_violation("namespace", "1-64 characters");
        details.add_bad_request_violation("event_ids[3]", "too long");
        let error = Error::from_status(&status(Code::InvalidArgument, details));
        assert!(matches!(error, Error::InvalidArgument(_)), "{error:?}");
        assert_eq!(error.fields(), ["namespace", "event_ids[3]"]);

        let mut details = ErrorDetails::with_error_info("STORE_UNAVAILABLE", ERROR_DOMAIN, []);
        details.set_retry_info(Some(Duration::from_secs(1)));
        let error = Error::from_status(&status(Code::Unavailable, details));
        assert!(matches!(error, Error::StoreUnavailable(_)), "{error:?}");
        assert_eq!(error.retry_after(), Some(Duration::from_secs(1)));
        assert!(error.is_transient());

        let lost = ErrorDetails::with_error_info("LEASE_LOST", ERROR_DOMAIN, []);
        let error = Error::from_status(&status(Code::Aborted, lost));
        assert!(
            matches!(error, Error::LeaseLost(ref call) if call.reason.as_deref() == Some("LEASE_LOST"))
        );
        assert!(!error.is_transient());
    }

    #[test]
    fn another_domain_or_no_details_falls_back_to_the_code() {
        let foreign = ErrorDetails::with_error_info("KEY_NOT_FOUND", "example.com", []);
        let error = Error::from_status(&status(Code::PermissionDenied, foreign));
        assert!(matches!(error, Error::PermissionDenied(ref call) if call.reason.is_none()));
        let error = Error::from_status(&Status::out_of_range("too big"));
        assert!(matches!(error, Error::Call(ref call) if call.code == Code::OutOfRange));
        let error = Error::from_status(&Status::deadline_exceeded("slow"));
        assert!(error.is_transient());
    }

    /// What is retried (the contract's "Client defaults"): a reason of the door is retried even
    /// for MarkProcessed; RESOURCE_EXHAUSTED without one is tonic's own limit, never retried.
    #[test]
    fn refusals_at_the_door_are_retried_and_a_bare_resource_exhausted_is_not() {
        for reason in ["RATE_LIMITED", "OVERLOADED"] {
            let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, []);
            details.set_retry_info(Some(Duration::from_millis(300)));
            let error = Error::from_status(&status(Code::ResourceExhausted, details));
            assert!(
                error.is_transient() && error.is_refused_at_the_door(),
                "{error:?}"
            );
            assert_eq!(error.retry_after(), Some(Duration::from_millis(300)));
        }
        let error = Error::from_status(&Status::resource_exhausted("message too large"));
        assert!(matches!(error, Error::Call(_)), "{error:?}");
        assert!(!error.is_transient() && !error.is_refused_at_the_door());
        let error = Error::from_status(&Status::unavailable("down"));
        assert!(error.is_transient() && !error.is_refused_at_the_door());
    }

    #[test]
    fn a_broken_transport_is_unavailable() {
        let broken = Status::from_error(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert_eq!(broken.code(), Code::Unknown);
        let error = Error::from_status(&broken);
        assert!(matches!(error, Error::Unavailable(_)), "{error:?}");
        // The same code from the service itself (no source) is not the transport's.
        let error = Error::from_status(&Status::unknown("odd"));
        assert!(matches!(error, Error::Call(_)), "{error:?}");
    }
}
