"""Typed errors: one class per reason in the contract, and the two outcomes that are not results.

The service answers errors with a `google.rpc.Status` in the `grpc-status-details-bin` trailer:
an `ErrorInfo` (domain `idempotency.v1`) whose reason picks the class here, a `BadRequest` whose
field violations name the bad fields, and a `RetryInfo` when waiting helps. Errors without that
trailer (the transport failed, a deadline passed, the gRPC layer refused a message) are sorted by
their status code alone.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "idempotency.v1"
_DETAILS_TRAILER = "grpc-status-details-bin"


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request, as the service named it (`event_ids[3]` for an element)."""

    field: str
    description: str


class IdempotencyError(Exception):
    """The base of every error this client raises."""


class CallError(IdempotencyError):
    """The service refused a call, or the call failed on its way.

    `code` is the gRPC status, `reason` the contract's reason (None when the service sent none,
    e.g. the transport failed), `retry_after` the seconds the service asked the caller to wait.
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode,
        reason: str | None = None,
        field_violations: Iterable[FieldViolation] = (),
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.field_violations = tuple(field_violations)
        self.retry_after = retry_after

    def __str__(self) -> str:
        label = self.reason or self.code.name
        return f"{label}: {self.message}"


class InvalidArgument(CallError):
    """A field was missing, malformed or out of bounds (`INVALID_ARGUMENT`). Nothing was written.

    `field_violations` names every bad field; `fields` lists just their names.
    """

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(violation.field for violation in self.field_violations)


class LeaseLost(CallError):
    """This caller no longer holds the key (`ABORTED` / `LEASE_LOST`): someone took it over after
    the lease ran out, so the new holder owns the result. Stop, and do not report success.

    `run_once` also raises it when the heartbeat found the lease gone, or when the key vanished
    under the holder (then the cause is a `KeyNotFound`)."""

    def __init__(
        self,
        message: str = "the lease was lost: another caller holds the key now",
        *,
        code: grpc.StatusCode = grpc.StatusCode.ABORTED,
        reason: str | None = "LEASE_LOST",
        field_violations: Iterable[FieldViolation] = (),
        retry_after: float | None = None,
    ) -> None:
        super().__init__(
            message,
            code=code,
            reason=reason,
            field_violations=field_violations,
            retry_after=retry_after,
        )


class KeyNotFound(CallError):
    """Complete, Release or ExtendLease on an absent or expired key (`NOT_FOUND`)."""


class AlreadyCompleted(CallError):
    """Complete with another response, or Release/ExtendLease of a completed key
    (`FAILED_PRECONDITION` / `ALREADY_COMPLETED`)."""


class Unavailable(CallError):
    """The service could not be reached (`UNAVAILABLE` without a reason). Retry later."""


class StoreUnavailable(Unavailable):
    """The service's store is unreachable, timed out or not migrated (`STORE_UNAVAILABLE`).
    Nothing was written; `retry_after` says when to try again."""


class DeadlineExceeded(CallError):
    """The call did not answer within the client's `call_timeout` (`DEADLINE_EXCEEDED`)."""


class Unauthenticated(CallError):
    """No token, or one the service does not know (`UNAUTHENTICATED`)."""


class PermissionDenied(CallError):
    """The token does not hold the namespace or consumer asked for (`PERMISSION_DENIED`)."""


class RateLimited(CallError):
    """The token is over its rate limit (`RESOURCE_EXHAUSTED` / `RATE_LIMITED`)."""


class Overloaded(CallError):
    """The service is short of room for responses not yet read (`RESOURCE_EXHAUSTED` /
    `OVERLOADED`); it refused a call that had written nothing. `retry_after` says when to try
    again."""


class InternalError(CallError):
    """An unexpected failure inside the service (`INTERNAL`): a bug to report."""


class ResultNotStored(CallError):
    """The work ran and returned `result`, but Complete could not store it (the service was
    unreachable for the whole retry budget, or refused it): `error` (also the `__cause__`) says
    why, and `code`, `reason` and `retry_after` are its. The key stays claimed until its lease
    runs out, and a retry after that runs the work again: answer with `result` if the effect
    must not be repeated, knowing it is not recorded. A lost lease is `LeaseLost` instead."""

    def __init__(self, result: Any, error: CallError) -> None:
        super().__init__(
            f"the work ran but its result was not stored: {error}",
            code=error.code,
            reason=error.reason,
            field_violations=error.field_violations,
            retry_after=error.retry_after,
        )
        self.result = result
        self.error = error


class CanonicalJsonError(IdempotencyError, ValueError):
    """A request cannot be written as canonical JSON (RFC 8785), so it has no fingerprint.

    `reason` says why: `invalid_json` (a text that is not JSON), `not_json` (a value of another
    type, or a key that is not a str), `duplicate_key`, `lone_surrogate`, `unsafe_integer` (an
    integer beyond ±(2^53-1): send it as a string) or `number_out_of_range` (NaN, an infinity,
    or a literal beyond the largest double)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class InProgress(IdempotencyError):
    """Another caller holds the key and did not finish within the caller's `wait` (HTTP 409).

    `retry_after` is the seconds until the holder's lease runs out by this machine's clock (0 when
    it has already run out: the next attempt may take the key over); `lease_expires_at` is the
    service's instant."""

    def __init__(
        self, namespace: str, key: str, *, lease_expires_at: dt.datetime, attempt: int
    ) -> None:
        now = dt.datetime.now(dt.timezone.utc)
        self.namespace = namespace
        self.key = key
        self.lease_expires_at = lease_expires_at
        self.attempt = attempt
        self.retry_after = max(0.0, (lease_expires_at - now).total_seconds())
        super().__init__(
            f"the key is in progress elsewhere (attempt {attempt}); "
            f"retry in {self.retry_after:.1f}s"
        )


class FingerprintMismatch(IdempotencyError):
    """The key was claimed for a different request (HTTP 422). Nothing changed."""

    def __init__(self, namespace: str, key: str) -> None:
        self.namespace = namespace
        self.key = key
        super().__init__("the key was used for a different request (fingerprint mismatch)")


_BY_REASON: dict[str, type[CallError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "LEASE_LOST": LeaseLost,
    "KEY_NOT_FOUND": KeyNotFound,
    "ALREADY_COMPLETED": AlreadyCompleted,
    "STORE_UNAVAILABLE": StoreUnavailable,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "RATE_LIMITED": RateLimited,
    "OVERLOADED": Overloaded,
    "INTERNAL": InternalError,
}

_BY_CODE: dict[grpc.StatusCode, type[CallError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ABORTED: LeaseLost,
    grpc.StatusCode.NOT_FOUND: KeyNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: AlreadyCompleted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    # RESOURCE_EXHAUSTED without a reason is not the service's refusal (grpc answers it for a
    # message over its own limit, which no retry cures): a plain CallError, never retried.
    grpc.StatusCode.INTERNAL: InternalError,
}


def error_from_status(
    code: grpc.StatusCode,
    message: str,
    trailing_metadata: Iterable[tuple[str, str | bytes]] | None,
) -> CallError:
    """Builds the typed error for a failed call from its code, message and trailers.

    Shared by the sync and asyncio clients, whose failed calls expose these three alike.
    grpcio-status's `from_call` would do the decoding for sync calls only, and raises when the
    status message differs from the trailer's; reading the one trailer here serves both."""
    reason: str | None = None
    violations: list[FieldViolation] = []
    retry_after: float | None = None
    for name, value in trailing_metadata or ():
        if name != _DETAILS_TRAILER or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        message = status.message or message
        for detail in status.details:
            error_info = error_details_pb2.ErrorInfo()
            bad_request = error_details_pb2.BadRequest()
            retry_info = error_details_pb2.RetryInfo()
            if detail.Unpack(error_info) and error_info.domain == ERROR_DOMAIN:
                reason = error_info.reason
            elif detail.Unpack(bad_request):
                violations.extend(
                    FieldViolation(v.field, v.description) for v in bad_request.field_violations
                )
            elif detail.Unpack(retry_info):
                retry_after = retry_info.retry_delay.ToTimedelta().total_seconds()
    error_class = _BY_REASON.get(reason or "") or _BY_CODE.get(code, CallError)
    return error_class(
        message, code=code, reason=reason, field_violations=violations, retry_after=retry_after
    )
