"""The synchronous client: `run_once`, `process_once` and `mark_processed` over a grpc channel."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import grpc

from ._core import (
    JSON,
    WAIT_SLACK,
    Codec,
    Duration,
    ErrorResult,
    HeldElsewhere,
    Outcome,
    Replay,
    RetryPolicy,
    RetryWhen,
    RunSpec,
    Started,
    TlsConfig,
    answered_early,
    call_metadata,
    duration_message,
    holder_poll_delays,
    instant,
    is_rate_limited,
    is_transient,
    new_ids,
    read_claim,
    server_wait,
)
from ._proto.idempotency.v1 import idempotency_pb2 as pb
from ._rpc import Stub
from .errors import (
    AlreadyCompleted,
    CallError,
    InProgress,
    KeyNotFound,
    LeaseLost,
    error_from_status,
)

T = TypeVar("T")
Request = TypeVar("Request")
Response = TypeVar("Response")

log = logging.getLogger("idempotency_client")


def _typed_error(rpc_error: grpc.RpcError) -> CallError:
    # A failed unary call raises an error that is also its grpc.Call (code, details, trailers).
    if isinstance(rpc_error, grpc.Call):
        return error_from_status(
            rpc_error.code(), rpc_error.details() or "", rpc_error.trailing_metadata()
        )
    return CallError(str(rpc_error), code=grpc.StatusCode.UNKNOWN)


class Lease:
    """The claim that the work holds while it runs.

    `token` and `attempt` identify the claim (`attempt` > 1 after a takeover), `checkpoint` is
    what a previous holder saved (None when none was), and `cancelled` is set when the lease is
    lost: the work should stop then, since another caller owns the key."""

    def __init__(
        self, client: IdempotencyClient, spec: RunSpec, started: Started, asked_at: float
    ) -> None:
        self.namespace = spec.namespace
        self.key = spec.key
        self.token = started.token
        self.attempt = started.attempt
        self.checkpoint = started.checkpoint
        self.expires_at = started.lease_expires_at
        self.cancelled = threading.Event()
        self._client = client
        self._spec = spec
        self._lost_because: CallError | None = None
        # Counted from before TryStart was sent, so never later than the service's expiry.
        self._runs_out_at = asked_at + spec.lease_ttl

    @property
    def lost(self) -> bool:
        return self._lost_because is not None

    def save_checkpoint(self, checkpoint: bytes) -> None:
        """Saves progress (at most 64 KiB) and renews the lease. If this holder dies, the caller
        that takes the key over finds it in `lease.checkpoint`. Raises `LeaseLost` when the key
        is no longer this holder's."""
        self._extend(checkpoint, retry=is_transient)

    def raise_if_cancelled(self) -> None:
        """Raises `LeaseLost` once the lease is lost; for work that checks between steps."""
        if self._lost_because is not None:
            raise LeaseLost() from self._lost_because

    def _extend(self, checkpoint: bytes | None, *, retry: RetryWhen | None) -> None:
        sent_at = time.monotonic()
        try:
            answer = self._client._call(
                self._client._stub.extend_lease,
                self._spec.extend_request(self.token, checkpoint),
                "ExtendLease",
                retry=retry,
            )
        except (LeaseLost, KeyNotFound, AlreadyCompleted) as error:
            self._lose(error)
            raise LeaseLost() from error
        self.expires_at = instant(answer.lease_expires_at)
        self._runs_out_at = sent_at + self._spec.lease_ttl

    def _lose(self, because: CallError) -> None:
        self._lost_because = because
        self.cancelled.set()


class _Heartbeat:
    """Renews a lease every `interval` seconds on a thread of its own while the work runs."""

    def __init__(self, lease: Lease, interval: float) -> None:
        self._lease = lease
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="idempotency-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._lease._extend(None, retry=None)
            except LeaseLost:
                log.warning(
                    "lease lost in namespace %s; cancelling the work", self._lease.namespace
                )
                return
            except CallError as error:
                # A missed beat is harmless while the lease still runs; once it may have run
                # out, another caller may hold the key, so the work must stop.
                if time.monotonic() >= self._lease._runs_out_at:
                    log.warning("lease ran out while the service was unreachable: %s", error)
                    self._lease._lose(error)
                    return
                log.info("heartbeat failed, trying again at the next beat: %s", error)


class IdempotencyClient:
    """A client of the idempotency coordinator.

    `target` is the service's address; `token` is sent as `authorization: Bearer <token>`;
    `tls` turns TLS on (`TlsConfig()` trusts the system's roots); `call_timeout` bounds each
    call in seconds; `retry` says how calls that failed with `UNAVAILABLE`, a deadline or a
    rate limit are retried; `channel_options` go to grpc as they are. Thread-safe; close it
    when done (or use it as a context manager)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        call_timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.secure_channel(target, tls.credentials(), options=channel_options)
        self._stub = Stub(self._channel)
        self._metadata = call_metadata(token)
        self.call_timeout = call_timeout
        self._retry = retry or RetryPolicy()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> IdempotencyClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def run_once(
        self,
        namespace: str,
        key: str,
        work: Callable[[Lease], T],
        *,
        request: object = None,
        fingerprint: bytes | None = None,
        lease_ttl: Duration = 30.0,
        retention: Duration | None = None,
        wait: Duration = 0.0,
        heartbeat: bool | Duration = True,
        codec: Codec = JSON,
        error_result: ErrorResult | None = None,
    ) -> Outcome[T]:
        """Runs `work` at most once for `key` in `namespace`, or returns the result of the run
        that did (`Outcome.replayed`). See the README for every parameter and error."""
        spec = RunSpec.build(
            namespace,
            key,
            request=request,
            fingerprint=fingerprint,
            lease_ttl=lease_ttl,
            retention=retention,
            wait=wait,
            heartbeat=heartbeat,
            codec=codec,
            error_result=error_result,
        )
        claim, asked_at = self._claim(spec)
        if isinstance(claim, Replay):
            return Outcome(cast(T, spec.codec.decode(claim.response)), replayed=True)
        return self._run_holding(spec, Lease(self, spec, claim, asked_at), work)

    def process_once(
        self,
        consumer: str,
        event_id: str,
        work: Callable[[Lease], T],
        *,
        request: object = None,
        fingerprint: bytes | None = None,
        lease_ttl: Duration = 30.0,
        retention: Duration | None = None,
        wait: Duration = 0.0,
        heartbeat: bool | Duration = True,
        codec: Codec = JSON,
        error_result: ErrorResult | None = None,
    ) -> Outcome[T]:
        """Handles an event at most once: `run_once` with the consumer as namespace and the
        event id as key. For effects that must happen once (a charge, an email)."""
        return self.run_once(
            consumer,
            event_id,
            work,
            request=request,
            fingerprint=fingerprint,
            lease_ttl=lease_ttl,
            retention=retention,
            wait=wait,
            heartbeat=heartbeat,
            codec=codec,
            error_result=error_result,
        )

    def mark_processed(
        self, consumer: str, event_ids: Iterable[str], *, retention: Duration | None = None
    ) -> list[str]:
        """Records that `consumer` handled the events (1-1000, atomically) and returns the ids
        that were new, in request order. Retried only when rate limited (refused before it ran):
        a retry after a lost answer would report the events as seen before, and the caller
        would skip them."""
        request = pb.MarkProcessedRequest(consumer=consumer, event_ids=list(event_ids))
        if retention is not None:
            request.retention.CopyFrom(duration_message(retention))
        answer = self._call(
            self._stub.mark_processed, request, "MarkProcessed", retry=is_rate_limited
        )
        return new_ids(answer)

    def _claim(self, spec: RunSpec) -> tuple[Started | Replay, float]:
        """Claims the key, or finds its result; returns also when the winning TryStart was
        first sent, from which the lease's expiry is counted."""
        # One attempt_id for the whole logical attempt: a TryStart whose answer was lost is
        # retried with it and gets its own claim back instead of `in_progress`.
        attempt_id = uuid.uuid4().hex
        wait_until = time.monotonic() + spec.wait
        pauses = holder_poll_delays()
        while True:
            # The one place that waits for a holder: the service holds each TryStart for what is
            # left of the caller's limit (at most 60 s), and the call's deadline covers that wait.
            asked_at = time.monotonic()
            asked_wait = server_wait(wait_until, asked_at)

            def fresh() -> tuple[pb.TryStartRequest, float]:
                # Recomputed for every try, so that a retry never waits past the limit.
                wait = server_wait(wait_until, time.monotonic())
                return spec.try_start_request(attempt_id, wait), wait

            log.debug("claiming key in namespace %s (wait %.3fs)", spec.namespace, asked_wait)
            answer = self._call(
                self._stub.try_start,
                spec.try_start_request(attempt_id),
                "TryStart",
                retry=is_transient,
                fresh=fresh,
            )
            claim = read_claim(spec, answer)
            if not isinstance(claim, HeldElsewhere):
                return claim, asked_at
            remaining = wait_until - time.monotonic()
            if remaining < WAIT_SLACK:
                raise InProgress(
                    spec.namespace,
                    spec.key,
                    lease_expires_at=claim.lease_expires_at,
                    attempt=claim.attempt,
                )
            if answered_early(asked_at, asked_wait, time.monotonic()):
                # The service is at its waiter limit: pause so that it is not hammered.
                log.debug("the service did not wait for key in namespace %s", spec.namespace)
                time.sleep(min(next(pauses), remaining))

    def _run_holding(self, spec: RunSpec, lease: Lease, work: Callable[[Lease], T]) -> Outcome[T]:
        interval = spec.heartbeat_interval
        heartbeat = _Heartbeat(lease, interval) if interval is not None else None
        try:
            try:
                value: Any = work(lease)
            except Exception as error:
                # A lost lease is never a result to store: the new holder owns the key.
                if spec.error_result is None or lease.lost:
                    raise
                final = spec.error_result(error)
                if final is None:
                    raise
                value = final
            response = spec.codec.encode(value)
        except BaseException as error:
            if heartbeat is not None:
                heartbeat.stop()
            self._release(spec, lease)
            if lease.lost:
                raise LeaseLost() from error
            raise
        if heartbeat is not None:
            heartbeat.stop()
        self._complete(spec, lease, response)
        return Outcome(cast(T, value), replayed=False)

    def _release(self, spec: RunSpec, lease: Lease) -> None:
        """Gives the claim up so that a retry starts fresh. A failure here only delays that retry
        until the lease runs out, so it is logged, not raised over the work's own error."""
        try:
            self._call(
                self._stub.release, spec.release_request(lease.token), "Release", retry=is_transient
            )
        except KeyNotFound:
            pass  # Already absent: an earlier try of this Release worked, or the key expired.
        except LeaseLost as error:
            lease._lose(error)
        except CallError as error:
            log.warning("could not release a claim; it frees when its lease runs out: %s", error)

    def _complete(self, spec: RunSpec, lease: Lease, response: bytes) -> None:
        try:
            self._call(
                self._stub.complete,
                spec.complete_request(lease.token, response),
                "Complete",
                retry=is_transient,
            )
        except KeyNotFound as error:
            raise LeaseLost("the key expired or was released while the work ran") from error
        except AlreadyCompleted:
            # The contract answers a repeated Complete with the same response as a success; if
            # the key holds exactly this response anyway, the outcome is the same.
            state = self._call(
                self._stub.lookup,
                pb.LookupRequest(namespace=spec.namespace, key=spec.key),
                "Lookup",
                retry=is_transient,
            )
            if state.WhichOneof("state") == "completed" and state.completed.response == response:
                return
            raise

    def _call(
        self,
        method: grpc.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        name: str,
        *,
        retry: RetryWhen | None,
        fresh: Callable[[], tuple[Request, float]] | None = None,
    ) -> Response:
        """One call, sent again while `retry` says so (the same request, so a TryStart keeps its
        attempt_id), within the retry policy's total time."""
        pauses = self._retry.delays()
        give_up_at = time.monotonic() + self._retry.total
        while True:
            # `fresh` makes the request anew for each try, with how long beyond the normal call
            # timeout the service may hold it (a TryStart's wait).
            held_for = 0.0
            if fresh is not None:
                request, held_for = fresh()
            timeout = self.call_timeout + held_for
            try:
                return method(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as rpc_error:
                error = _typed_error(rpc_error)
                pause = max(next(pauses), error.retry_after or 0.0)
                if retry is None or not retry(error) or time.monotonic() + pause > give_up_at:
                    raise error from rpc_error
            log.info("%s failed (%s); retrying in %.2fs", name, error, pause)
            time.sleep(pause)
