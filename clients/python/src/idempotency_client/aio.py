"""The asyncio client (grpc.aio): the same protocol as `client.py`, with coroutines.

On a lost lease the work's task is cancelled as well as `lease.cancelled` set: cancellation is
how asyncio stops work, and the new holder owns the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

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
from ._rpc import AsyncStub
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


def _now() -> float:
    return asyncio.get_running_loop().time()


class AsyncLease:
    """The claim that the work holds while it runs (see `idempotency_client.Lease`);
    `cancelled` is an `asyncio.Event`, and `save_checkpoint` a coroutine."""

    def __init__(
        self, client: AsyncIdempotencyClient, spec: RunSpec, started: Started, asked_at: float
    ) -> None:
        self.namespace = spec.namespace
        self.key = spec.key
        self.token = started.token
        self.attempt = started.attempt
        self.checkpoint = started.checkpoint
        self.expires_at = started.lease_expires_at
        self.cancelled = asyncio.Event()
        self._client = client
        self._spec = spec
        self._lost_because: CallError | None = None
        self._runs_out_at = asked_at + spec.lease_ttl
        self._work: asyncio.Future[Any] | None = None

    @property
    def lost(self) -> bool:
        return self._lost_because is not None

    async def save_checkpoint(self, checkpoint: bytes) -> None:
        """Saves progress (at most 64 KiB) and renews the lease; raises `LeaseLost` when the key
        is no longer this holder's."""
        await self._extend(checkpoint, retry=is_transient)

    def raise_if_cancelled(self) -> None:
        if self._lost_because is not None:
            raise LeaseLost() from self._lost_because

    async def _extend(self, checkpoint: bytes | None, *, retry: RetryWhen | None) -> None:
        sent_at = _now()
        try:
            answer = await self._client._call(
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
        if self._work is not None:
            self._work.cancel()


async def _heartbeat(lease: AsyncLease, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await lease._extend(None, retry=None)
        except LeaseLost:
            log.warning("lease lost in namespace %s; cancelling the work", lease.namespace)
            return
        except CallError as error:
            # A missed beat is harmless while the lease still runs; once it may have run out,
            # another caller may hold the key, so the work must stop.
            if _now() >= lease._runs_out_at:
                log.warning("lease ran out while the service was unreachable: %s", error)
                lease._lose(error)
                return
            log.info("heartbeat failed, trying again at the next beat: %s", error)


async def _stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class AsyncIdempotencyClient:
    """The asyncio variant of `IdempotencyClient`, with the same options. Create and use it
    inside one event loop; close it with `await client.close()` or `async with`."""

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
            self._channel = grpc.aio.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.aio.secure_channel(
                target, tls.credentials(), options=channel_options
            )
        self._stub = AsyncStub(self._channel)
        self._metadata = call_metadata(token)
        self.call_timeout = call_timeout
        self._retry = retry or RetryPolicy()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncIdempotencyClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def run_once(
        self,
        namespace: str,
        key: str,
        work: Callable[[AsyncLease], Awaitable[T]],
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
        _refuse_what_cannot_be_work(work)
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
        claim, asked_at = await self._claim(spec)
        if isinstance(claim, Replay):
            return Outcome(cast(T, spec.codec.decode(claim.response)), replayed=True)
        return await self._run_holding(spec, AsyncLease(self, spec, claim, asked_at), work)

    async def process_once(
        self,
        consumer: str,
        event_id: str,
        work: Callable[[AsyncLease], Awaitable[T]],
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
        """`run_once` with the consumer as namespace and the event id as key."""
        return await self.run_once(
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

    async def mark_processed(
        self, consumer: str, event_ids: Iterable[str], *, retention: Duration | None = None
    ) -> list[str]:
        """Records that `consumer` handled the events and returns the ids that were new. Retried
        only when rate limited, for the reason `IdempotencyClient.mark_processed` gives."""
        request = pb.MarkProcessedRequest(consumer=consumer, event_ids=list(event_ids))
        if retention is not None:
            request.retention.CopyFrom(duration_message(retention))
        answer = await self._call(
            self._stub.mark_processed, request, "MarkProcessed", retry=is_rate_limited
        )
        return new_ids(answer)

    async def _claim(self, spec: RunSpec) -> tuple[Started | Replay, float]:
        # One attempt_id for the whole logical attempt, as in the sync client.
        attempt_id = uuid.uuid4().hex
        wait_until = _now() + spec.wait
        pauses = holder_poll_delays()
        while True:
            # The one place that waits for a holder: the service holds each TryStart for what is
            # left of the caller's limit (at most 60 s), and the call's deadline covers that wait.
            asked_at = _now()
            asked_wait = server_wait(wait_until, asked_at)

            def fresh() -> tuple[pb.TryStartRequest, float]:
                # Recomputed for every try, so that a retry never waits past the limit.
                wait = server_wait(wait_until, _now())
                return spec.try_start_request(attempt_id, wait), wait

            log.debug("claiming key in namespace %s (wait %.3fs)", spec.namespace, asked_wait)
            answer = await self._call(
                self._stub.try_start,
                spec.try_start_request(attempt_id),
                "TryStart",
                retry=is_transient,
                fresh=fresh,
            )
            claim = read_claim(spec, answer)
            if not isinstance(claim, HeldElsewhere):
                return claim, asked_at
            remaining = wait_until - _now()
            if remaining < WAIT_SLACK:
                raise InProgress(
                    spec.namespace,
                    spec.key,
                    lease_expires_at=claim.lease_expires_at,
                    attempt=claim.attempt,
                )
            if answered_early(asked_at, asked_wait, _now()):
                # The service is at its waiter limit: pause so that it is not hammered.
                log.debug("the service did not wait for key in namespace %s", spec.namespace)
                await asyncio.sleep(min(next(pauses), remaining))

    async def _run_holding(
        self, spec: RunSpec, lease: AsyncLease, work: Callable[[AsyncLease], Awaitable[T]]
    ) -> Outcome[T]:
        work_task: asyncio.Future[T] = asyncio.ensure_future(_result_of(work, lease))
        lease._work = work_task
        interval = spec.heartbeat_interval
        heartbeat = (
            asyncio.create_task(_heartbeat(lease, interval)) if interval is not None else None
        )
        try:
            try:
                # When run_once itself is cancelled, awaiting the task cancels the work too.
                value: Any = await work_task
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
            await _stop(heartbeat)
            await self._release(spec, lease)
            if lease.lost:
                raise LeaseLost() from error
            raise
        await _stop(heartbeat)
        await self._complete(spec, lease, response)
        return Outcome(cast(T, value), replayed=False)

    async def _release(self, spec: RunSpec, lease: AsyncLease) -> None:
        try:
            await self._call(
                self._stub.release, spec.release_request(lease.token), "Release", retry=is_transient
            )
        except KeyNotFound:
            pass  # Already absent: an earlier try of this Release worked, or the key expired.
        except LeaseLost as error:
            lease._lost_because = error
            lease.cancelled.set()
        except CallError as error:
            log.warning("could not release a claim; it frees when its lease runs out: %s", error)

    async def _complete(self, spec: RunSpec, lease: AsyncLease, response: bytes) -> None:
        try:
            await self._call(
                self._stub.complete,
                spec.complete_request(lease.token, response),
                "Complete",
                retry=is_transient,
            )
        except KeyNotFound as error:
            raise LeaseLost("the key expired or was released while the work ran") from error
        except AlreadyCompleted:
            state = await self._call(
                self._stub.lookup,
                pb.LookupRequest(namespace=spec.namespace, key=spec.key),
                "Lookup",
                retry=is_transient,
            )
            if state.WhichOneof("state") == "completed" and state.completed.response == response:
                return
            raise

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Request, Response],
        request: Request,
        name: str,
        *,
        retry: RetryWhen | None,
        fresh: Callable[[], tuple[Request, float]] | None = None,
    ) -> Response:
        """One call, sent again while `retry` says so, within the retry policy's total time."""
        pauses = self._retry.delays()
        give_up_at = _now() + self._retry.total
        while True:
            # `fresh` makes the request anew for each try, with how long beyond the normal call
            # timeout the service may hold it (a TryStart's wait).
            held_for = 0.0
            if fresh is not None:
                request, held_for = fresh()
            timeout = self.call_timeout + held_for
            try:
                return await method(request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as rpc_error:
                error = error_from_status(
                    rpc_error.code(), rpc_error.details() or "", rpc_error.trailing_metadata()
                )
                pause = max(next(pauses), error.retry_after or 0.0)
                if retry is None or not retry(error) or _now() + pause > give_up_at:
                    raise error from rpc_error
            log.info("%s failed (%s); retrying in %.2fs", name, error, pause)
            await asyncio.sleep(pause)


def _refuse_what_cannot_be_work(work: object) -> None:
    """Refuses, before anything is claimed, a `work` that can never give a result: not callable,
    or a generator function of either kind. A plain function is accepted: it may return an
    awaitable (`lambda lease: charge(order)`), which cannot be told before it is called."""
    if not callable(work) or inspect.isgeneratorfunction(work) or inspect.isasyncgenfunction(work):
        raise TypeError(
            "work must be a coroutine function, or a function that returns an awaitable or "
            f"the result, taking the lease: got {work!r}"
        )


async def _result_of(work: Callable[[AsyncLease], Awaitable[T]], lease: AsyncLease) -> T:
    """The work's result: what its awaitable gives, or, when a plain function (typed wrongly, or
    untyped) returned a value instead, that value: the work has run already, so releasing the
    key would allow a second effect."""
    produced: object = work(lease)
    if inspect.isawaitable(produced):
        return cast(T, await produced)
    return cast(T, produced)
