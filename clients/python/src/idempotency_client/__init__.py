"""Run an operation once per idempotency key, through the idempotency coordinator.

from idempotency_client import IdempotencyClient

with IdempotencyClient("127.0.0.1:50051") as client:
    outcome = client.run_once("payments", "order-42:charge", lambda lease: charge(order),
                              request=order)
    outcome.value, outcome.replayed
"""

from ._canonical import canonical_json, canonical_json_text, fingerprint_of, fingerprint_of_json
from ._core import BytesCodec, Codec, JsonCodec, Outcome, RetryPolicy, TlsConfig
from .aio import AsyncIdempotencyClient, AsyncLease
from .client import IdempotencyClient, Lease
from .decorator import idempotent
from .errors import (
    AlreadyCompleted,
    CallError,
    CanonicalJsonError,
    DeadlineExceeded,
    FieldViolation,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    InternalError,
    InvalidArgument,
    KeyNotFound,
    LeaseLost,
    Overloaded,
    PermissionDenied,
    RateLimited,
    ResultNotStored,
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
    "CanonicalJsonError",
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
    "Overloaded",
    "PermissionDenied",
    "RateLimited",
    "ResultNotStored",
    "RetryPolicy",
    "StoreUnavailable",
    "TlsConfig",
    "Unauthenticated",
    "Unavailable",
    "canonical_json",
    "canonical_json_text",
    "fingerprint_of",
    "fingerprint_of_json",
    "idempotent",
]
