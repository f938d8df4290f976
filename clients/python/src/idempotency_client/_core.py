"""What the sync and asyncio clients share: options, encodings, and reading the service's answers.

Nothing here does I/O, so both clients make the same decisions from the same answers; the calls
that carry those decisions out are written once too, in `_protocol`.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypedDict, TypeVar

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from ._canonical import fingerprint_of
from ._proto.idempotency.v1 import idempotency_pb2 as pb
from .errors import (
    CallError,
    DeadlineExceeded,
    FingerprintMismatch,
    Overloaded,
    RateLimited,
    Unavailable,
)

T = TypeVar("T")

#: A duration: seconds as a number, or a timedelta.
Duration = float | dt.timedelta


# The defaults every client shares: clients/conformance/defaults.json, which a test compares
# with these.
DEFAULT_CALL_TIMEOUT = 10.0
"""Seconds: the deadline of one call (a waiting TryStart gets its wait on top)."""
DEFAULT_LEASE_TTL = 30.0
"""Seconds: the lease `run_once` asks for."""
HEARTBEAT_DIVISOR = 3
"""`run_once` renews the lease every `lease_ttl / HEARTBEAT_DIVISOR`."""
DEFAULT_WAIT = 0.0
"""Seconds `run_once` waits for another holder (0: `InProgress` at once)."""
JITTER_LOW_FRACTION = 0.5
"""Each pause between tries is drawn between this fraction of its step and the whole step."""


def seconds(duration: Duration) -> float:
    return duration.total_seconds() if isinstance(duration, dt.timedelta) else float(duration)


def duration_message(duration: Duration) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromTimedelta(dt.timedelta(seconds=seconds(duration)))
    return message


def instant(timestamp: timestamp_pb2.Timestamp) -> dt.datetime:
    return timestamp.ToDatetime(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class RetryPolicy:
    """How calls that failed with `UNAVAILABLE`, a deadline or a rate limit are retried:
    exponential backoff with jitter, from `initial_delay` up to `max_delay` between tries, for
    at most `total` seconds in all. A `RetryInfo` from the service lengthens a pause, never
    shortens it."""

    initial_delay: float = 0.05
    max_delay: float = 2.0
    multiplier: float = 2.0
    total: float = 30.0

    def delays(self) -> Iterator[float]:
        """Pauses between tries, each drawn between half and all of the exponential step, so that
        callers that failed together do not retry together."""
        step = self.initial_delay
        while True:
            yield random.uniform(step * JITTER_LOW_FRACTION, step)
            step = min(self.max_delay, step * self.multiplier)


#: Says whether a failed call may be sent again as it was.
RetryWhen = Callable[[CallError], bool]


def is_transient(error: CallError) -> bool:
    """A failure after which the same call may succeed: the service was unreachable
    (`UNAVAILABLE`), slow (`DEADLINE_EXCEEDED`), or refused it at the door (`RATE_LIMITED`,
    `OVERLOADED`). For calls whose repetition is harmless (TryStart with its attempt_id,
    Complete with the same response, Release, ExtendLease, Lookup)."""
    return isinstance(error, Unavailable | DeadlineExceeded) or refused_at_the_door(error)


def refused_at_the_door(error: CallError) -> bool:
    """Refused before anything ran (`RESOURCE_EXHAUSTED` with reason `RATE_LIMITED` or
    `OVERLOADED`), so that even a call whose repetition is not harmless (MarkProcessed) may be
    sent again."""
    return isinstance(error, RateLimited | Overloaded)


@dataclass(frozen=True)
class TlsConfig:
    """TLS for the channel. All fields are PEM bytes; None for `root_certificates` means the
    system's roots. Give `private_key` and `certificate_chain` for mutual TLS."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The bearer token as call metadata. Sent per call rather than as call credentials, which
    gRPC refuses on plaintext channels (loopback, or behind a mesh)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class Codec(Protocol):
    """Turns a work's result into the stored response and back."""

    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class JsonCodec:
    """Results as compact UTF-8 JSON (the default): readable by clients in other languages."""

    def encode(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def decode(self, data: bytes) -> Any:
        return json.loads(data)


class BytesCodec:
    """Results that are already bytes, stored as they are."""

    def encode(self, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"BytesCodec stores bytes, not {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes) -> Any:
        return data


JSON = JsonCodec()


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What `run_once` returns: the result, and whether it was replayed from an earlier run
    (True) or produced by this call's own work (False)."""

    value: T
    replayed: bool


#: Turns an error raised by the work into a final result to store, or None to release the key.
ErrorResult = Callable[[Exception], Any]


class RunOptions(TypedDict, total=False):
    """How a run holds its key and stores its result: the options `@idempotent` shares with
    `run_once` (the README says what each means; `RunSpec.build` holds their defaults)."""

    lease_ttl: Duration
    retention: Duration | None
    wait: Duration
    heartbeat: bool | Duration
    codec: Codec
    error_result: ErrorResult | None


class RunOnceOptions(RunOptions, total=False):
    """The keyword arguments of `run_once` and `process_once`, in both clients."""

    request: object
    fingerprint: bytes | None


@dataclass(frozen=True)
class RunSpec:
    """One `run_once`, its options checked once and in the units the calls need."""

    namespace: str
    key: str
    fingerprint: bytes
    lease_ttl: float
    retention: float | None
    wait: float
    heartbeat_interval: float | None
    codec: Codec
    error_result: ErrorResult | None

    @classmethod
    def build(
        cls,
        namespace: str,
        key: str,
        *,
        request: object = None,
        fingerprint: bytes | None = None,
        lease_ttl: Duration = DEFAULT_LEASE_TTL,
        retention: Duration | None = None,
        wait: Duration = DEFAULT_WAIT,
        heartbeat: bool | Duration = True,
        codec: Codec = JSON,
        error_result: ErrorResult | None = None,
    ) -> RunSpec:
        # Only what the service cannot judge is checked here; it refuses bad names, keys and
        # bounds itself, naming the field, and a second copy of its rules would drift.
        ttl = seconds(lease_ttl)
        waiting = seconds(wait)
        if waiting < 0:
            raise ValueError(f"wait must not be negative (got {waiting}s)")
        if heartbeat is True:
            interval: float | None = ttl / HEARTBEAT_DIVISOR
        elif heartbeat is False:
            interval = None
        else:
            interval = seconds(heartbeat)
            if interval <= 0:
                raise ValueError(f"heartbeat must be positive (got {interval}s)")
        if fingerprint is None:
            fingerprint = b"" if request is None else fingerprint_of(request)
        return cls(
            namespace=namespace,
            key=key,
            fingerprint=fingerprint,
            lease_ttl=ttl,
            retention=None if retention is None else seconds(retention),
            wait=waiting,
            heartbeat_interval=interval,
            codec=codec,
            error_result=error_result,
        )

    def try_start_request(self, attempt_id: str, wait: float = 0.0) -> pb.TryStartRequest:
        request = pb.TryStartRequest(
            namespace=self.namespace,
            key=self.key,
            fingerprint=self.fingerprint,
            lease_ttl=duration_message(self.lease_ttl),
            attempt_id=attempt_id,
        )
        if self.retention is not None:
            request.retention.CopyFrom(duration_message(self.retention))
        if wait > 0:
            request.wait.CopyFrom(duration_message(wait))
        return request

    def complete_request(self, token: int, response: bytes) -> pb.CompleteRequest:
        # The retention given to TryStart already covers the completion: Complete without one
        # keeps the key as long as it was claimed for.
        return pb.CompleteRequest(
            namespace=self.namespace, key=self.key, lease_token=token, response=response
        )

    def release_request(self, token: int) -> pb.ReleaseRequest:
        return pb.ReleaseRequest(namespace=self.namespace, key=self.key, lease_token=token)

    def extend_request(self, token: int, checkpoint: bytes | None) -> pb.ExtendLeaseRequest:
        request = pb.ExtendLeaseRequest(
            namespace=self.namespace,
            key=self.key,
            lease_token=token,
            lease_ttl=duration_message(self.lease_ttl),
        )
        if checkpoint is not None:
            request.checkpoint = checkpoint
        return request


@dataclass(frozen=True)
class Started:
    token: int
    attempt: int
    checkpoint: bytes | None
    lease_expires_at: dt.datetime


@dataclass(frozen=True)
class Replay:
    response: bytes


@dataclass(frozen=True)
class HeldElsewhere:
    lease_expires_at: dt.datetime
    attempt: int


def read_claim(spec: RunSpec, answer: pb.TryStartResponse) -> Started | Replay | HeldElsewhere:
    """Sorts a TryStart answer; a fingerprint mismatch is final, so it is raised here."""
    outcome = answer.WhichOneof("outcome")
    if outcome == "started":
        started = answer.started
        return Started(
            token=started.lease_token,
            attempt=started.attempt,
            checkpoint=started.checkpoint if started.HasField("checkpoint") else None,
            lease_expires_at=instant(started.lease_expires_at),
        )
    if outcome == "completed":
        return Replay(answer.completed.response)
    if outcome == "in_progress":
        return HeldElsewhere(
            lease_expires_at=instant(answer.in_progress.lease_expires_at),
            attempt=answer.in_progress.attempt,
        )
    if outcome == "fingerprint_mismatch":
        raise FingerprintMismatch(spec.namespace, spec.key)
    raise CallError(
        f"TryStart answered an outcome this client does not know: {outcome}",
        code=grpc.StatusCode.UNKNOWN,
    )


MAX_SERVER_WAIT = 60.0
"""The longest wait one TryStart may ask the service for (the contract's bound)."""

WAIT_SLACK = 0.02
"""What is left of the caller's limit when a waiting TryStart comes back that is too little to
ask again for: the service waited until about the limit."""


def server_wait(wait_until: float, now: float) -> float:
    """What a TryStart sent now asks the service to wait: what is left of the caller's limit, at
    most 60 s, in whole milliseconds."""
    return max(0.0, min(MAX_SERVER_WAIT, round(wait_until - now, 3)))


def answered_early(asked_at: float, asked_wait: float, now: float) -> bool:
    """Whether the service answered `in_progress` clearly before the wait it was asked for (it is
    at its waiter limit), so that the next TryStart should come after a pause."""
    return now - asked_at < asked_wait / 2


def holder_poll_delays() -> Iterator[float]:
    """Pauses between TryStarts while the service answers `in_progress` without waiting (it is
    at its waiter limit): quick at first, then at most one a second."""
    return RetryPolicy(initial_delay=0.05, max_delay=1.0, multiplier=1.5).delays()


def new_ids(answer: pb.MarkProcessedResponse) -> list[str]:
    return [result.event_id for result in answer.results if not result.already_processed]
