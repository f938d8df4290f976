//! The one place where failures become gRPC statuses: the contract's codes and reasons, with
//! `google.rpc` details (ErrorInfo always; BadRequest for field problems; RetryInfo when the
//! store is unavailable). Causes are logged here and never sent: no SQL or driver text reaches
//! a caller.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

use crate::auth::{Denial, Refusal};
use crate::domain::Rejection;
use crate::service::CoordinatorError;
use crate::telemetry::error_chain;

/// `ErrorInfo.domain` of every error this service returns.
pub const ERROR_DOMAIN: &str = "idempotency.v1";

/// How long a caller should wait before retrying after STORE_UNAVAILABLE.
const STORE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The ErrorInfo reason of a status; also the outcome recorded in the RPC's span.
pub fn reason(error: &CoordinatorError) -> &'static str {
    match error {
        CoordinatorError::Rejected(Rejection::KeyNotFound) => "KEY_NOT_FOUND",
        CoordinatorError::Rejected(Rejection::LeaseLost) => "LEASE_LOST",
        CoordinatorError::Rejected(Rejection::AlreadyCompleted) => "ALREADY_COMPLETED",
        transient if transient.is_transient() => "STORE_UNAVAILABLE",
        CoordinatorError::Store(_)
        | CoordinatorError::Busy
        | CoordinatorError::TimedOut(_)
        | CoordinatorError::TaskFailed(_)
        | CoordinatorError::Inconsistent(_) => "INTERNAL",
    }
}

/// Whether the call's write may still land although it is answered UNAVAILABLE: its answer did
/// not come within the operation timeout while its statement may have been running (a commit
/// waiting for a synchronous standby is not ended by `statement_timeout`), or the connection
/// was lost mid-statement. A caller learns it from the ErrorInfo's `outcome` (`unknown`, else
/// `not_written`), and retries with the same `attempt_id` (docs/contract.md, Errors).
fn may_have_written(error: &CoordinatorError) -> bool {
    match error {
        CoordinatorError::TimedOut(_) => true,
        CoordinatorError::Store(store) => store.may_have_written(),
        _ => false,
    }
}

fn error_info(reason: &str) -> ErrorDetails {
    ErrorDetails::with_error_info(reason, ERROR_DOMAIN, HashMap::new())
}

/// INVALID_ARGUMENT with one BadRequest violation per bad field, named as in the proto
/// (`event_ids[3]` for an element).
pub fn invalid_argument(violations: Vec<(String, String)>) -> Status {
    let message = violations
        .iter()
        .map(|(field, description)| format!("{field} {description}"))
        .collect::<Vec<_>>()
        .join("; ");
    let mut details = error_info("INVALID_ARGUMENT");
    details.set_bad_request(
        violations
            .into_iter()
            .map(|(field, description)| FieldViolation::new(field, description))
            .collect::<Vec<_>>(),
    );
    Status::with_error_details(Code::InvalidArgument, message, details)
}

/// A request message the protobuf decoder refused: the client's fault, so INVALID_ARGUMENT
/// (never INTERNAL, which means a bug here). There is no field to name in a BadRequest.
pub fn undecodable() -> Status {
    Status::with_error_details(
        Code::InvalidArgument,
        "the message could not be decoded",
        error_info("INVALID_ARGUMENT"),
    )
}

/// A response refused because too many response bytes already wait for their clients to take
/// them (see `connections`). Only calls that wrote nothing are refused this way.
pub fn responses_pending() -> Status {
    overloaded("too many responses are waiting for their clients to read them; retry later")
}

/// A health Watch refused because `--max-health-watchers` streams are already open.
pub fn too_many_watchers() -> Status {
    overloaded("too many health Watch streams are open; retry later, or use Check")
}

/// RESOURCE_EXHAUSTED for a server at one of its bounds, with `OVERLOADED` and a retry after a
/// second.
fn overloaded(message: &str) -> Status {
    let mut details = error_info("OVERLOADED");
    details.set_retry_info(Some(Duration::from_secs(1)));
    Status::with_error_details(Code::ResourceExhausted, message, details)
}

/// A call turned away at the door (see `auth_layer`), with an ErrorInfo like every other error
/// and RetryInfo when waiting helps.
pub fn refused(refusal: Refusal) -> Status {
    match refusal {
        Refusal::Unauthenticated => {
            tracing::debug!("call refused: no known token");
            Status::with_error_details(
                Code::Unauthenticated,
                "a valid bearer token is required",
                error_info("UNAUTHENTICATED"),
            )
        }
        Refusal::PermissionDenied { caller, denial } => {
            tracing::info!(caller, ?denial, "call refused: not granted to this token");
            denied(denial)
        }
        Refusal::RateLimited {
            caller,
            retry_after,
        } => {
            tracing::debug!(caller, ?retry_after, "call refused: over the rate limit");
            let mut details = error_info("RATE_LIMITED");
            details.set_retry_info(Some(retry_after));
            Status::with_error_details(
                Code::ResourceExhausted,
                "this token is over its request rate; retry later",
                details,
            )
        }
    }
}

/// A known caller's call refused for what its token lacks, each cause with its own reason and
/// words (docs/contract.md, Errors): the scope asked for (`PERMISSION_DENIED`, as always), no
/// admin right (`ADMIN_RIGHT_REQUIRED`), or a change asked with the right `read`
/// (`ADMIN_WRITE_REQUIRED`). The metadata names only what the caller sent or holds itself.
fn denied(denial: Denial) -> Status {
    let (reason, message, metadata) = match denial {
        Denial::Scope { scope } => (
            "PERMISSION_DENIED",
            format!("this token's scopes do not cover namespace or consumer {scope:?}"),
            [("scope".to_owned(), scope)].into(),
        ),
        Denial::NoAdminRight => (
            "ADMIN_RIGHT_REQUIRED",
            "this token has no admin right (token new --admin read|write)".to_owned(),
            HashMap::new(),
        ),
        Denial::ReadOnly { method } => (
            "ADMIN_WRITE_REQUIRED",
            format!("this token's admin right is read; {method} needs write"),
            [
                ("method".to_owned(), method),
                ("admin_right".to_owned(), "read".to_owned()),
            ]
            .into(),
        ),
    };
    Status::with_error_details(
        Code::PermissionDenied,
        message,
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
}

/// An admin call from beyond the loopback interface of a server without a tokens file.
pub fn admin_loopback_only() -> Status {
    Status::with_error_details(
        Code::PermissionDenied,
        "without a tokens file the admin API answers callers on the loopback interface only",
        error_info("PERMISSION_DENIED"),
    )
}

/// The status of a failed call of `rpc` in `scope` (a namespace or consumer), its cause logged
/// (a warning when the store is unavailable, an error when the service failed; a caller's
/// rejection is not logged). The line names the RPC and the scope itself: without traces the
/// RPC's span exists only at DEBUG (see `service::rpc_span`), so at the default level a line
/// carries no span.
pub fn failed(error: CoordinatorError, rpc: &'static str, scope: &str) -> Status {
    let reason = reason(&error);
    match error {
        CoordinatorError::Rejected(rejection) => {
            let code = match rejection {
                Rejection::KeyNotFound => Code::NotFound,
                Rejection::LeaseLost => Code::Aborted,
                Rejection::AlreadyCompleted => Code::FailedPrecondition,
            };
            Status::with_error_details(code, rejection.to_string(), error_info(reason))
        }
        transient if transient.is_transient() => {
            let outcome = if may_have_written(&transient) {
                "unknown"
            } else {
                "not_written"
            };
            tracing::warn!(rpc, namespace = scope, error = %error_chain(&transient), outcome,
                    "store unavailable");
            let mut details = ErrorDetails::with_error_info(
                reason,
                ERROR_DOMAIN,
                HashMap::from([("outcome".to_owned(), outcome.to_owned())]),
            );
            details.set_retry_info(Some(STORE_RETRY_DELAY));
            Status::with_error_details(
                Code::Unavailable,
                "the store is unavailable; retry later",
                details,
            )
        }
        other => {
            tracing::error!(rpc, namespace = scope, error = %error_chain(&other),
                    "internal error");
            Status::with_error_details(Code::Internal, "internal error", error_info(reason))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;

    fn outcome(error: CoordinatorError) -> Option<String> {
        let status = failed(error, "TryStart", "tests");
        assert_eq!(status.code(), Code::Unavailable);
        status
            .get_error_details()
            .error_info()
            .and_then(|info| info.metadata.get("outcome").cloned())
    }

    fn io() -> sqlx::Error {
        sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
    }

    #[test]
    fn unavailable_says_whether_the_write_may_still_land() {
        let unknown = Some("unknown".to_owned());
        let not_written = Some("not_written".to_owned());
        // Answered at the time limit, or the connection lost: the commit may still land.
        assert_eq!(
            outcome(CoordinatorError::TimedOut(Duration::from_secs(5))),
            unknown
        );
        assert_eq!(
            outcome(CoordinatorError::Store(StoreError::Unavailable(io()))),
            unknown
        );
        assert_eq!(
            outcome(CoordinatorError::Store(
                StoreError::Unavailable(io()).for_each_of(2).remove(0)
            )),
            unknown
        );
        // Refused before anything ran, or ended by the store itself: nothing was written.
        assert_eq!(outcome(CoordinatorError::Busy), not_written);
        assert_eq!(
            outcome(CoordinatorError::Store(StoreError::Unavailable(
                sqlx::Error::PoolTimedOut
            ))),
            not_written
        );
        assert_eq!(
            outcome(CoordinatorError::Store(StoreError::TimedOut(
                Duration::from_secs(1)
            ))),
            not_written
        );
    }
}
