"""Run an operation once per idempotency key, through the idempotency coordinator.

from idempotency_client import IdempotencyClient

with IdempotencyClient("127.0.0.1:50051") as client:
    outcome = client.run_once("payments", "order-42:charge", lambda lease: charge(order),
                              request=order)
    outcome.value, outcome.replayed
"""

from ._core import BytesCodec, Codec, JsonCodec, Outcome, RetryPolicy, TlsConfig, fingerprint_of
from .aio import AsyncIdempotencyClient, AsyncLease
from .client import IdempotencyClient, Lease
from .decorator import idempotent
from .errors import (
    AlreadyCompleted,
    CallError,
    DeadlineExceeded,
    FieldViolation,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    InternalError,
    InvalidArgument,
    KeyNotFound,
    LeaseLost,
    PermissionDenied,
    RateLimited,
    StoreUnavailable,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "AlreadyCompleted",
    "AsyncIdempotencyClient",
    "AsyncLease",
    "BytesCodec",
    "CallError",
    "Codec",
    "DeadlineExceeded",
    "FieldViolation",
    "FingerprintMismatch",
    "IdempotencyClient",
    "IdempotencyError",
    "InProgress",
    "InternalError",
    "InvalidArgument",
    "JsonCodec",
    "KeyNotFound",
    "Lease",
    "LeaseLost",
    "Outcome",
    "PermissionDenied",
    "RateLimited",
    "RetryPolicy",
    "StoreUnavailable",
    "TlsConfig",
    "Unauthenticated",
    "Unavailable",
    "fingerprint_of",
    "idempotent",
]
