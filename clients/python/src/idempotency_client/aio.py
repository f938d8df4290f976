"""The asyncio client (grpc.aio): the same protocol as `client.py`, with coroutines.

What the calls are and when they are retried is `_protocol`'s; this module carries its steps out
with asyncio: a call is awaited, a pause is `asyncio.sleep`, and the work and the heartbeat are
tasks. On a lost lease the work's task is cancelled as well as `lease.cancelled` set:
cancellation is how asyncio stops work, and the new holder owns the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import grpc.aio

from ._core import Duration, Outcome, RunSpec, Started, is_transient
from ._protocol import ClientBase, LeaseBase, Pause, RunWork, Send, Step, Steps, Walk
from ._rpc import Method
from .errors import error_from_status

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._core import RunOnceOptions

T = TypeVar("T")


def _now() -> float:
    return asyncio.get_running_loop().time()


class AsyncLease(LeaseBase["AsyncIdempotencyClient"]):
    """The claim that the work holds while it runs (see `idempotency_client.Lease`);
    `cancelled` is an `asyncio.Event`, and `save_checkpoint` a coroutine."""

    def __init__(
        self, client: AsyncIdempotencyClient, spec: RunSpec, started: Started, asked_at: float
    ) -> None:
        super().__init__(client, spec, started, asked_at)
        self.cancelled = asyncio.Event()
        self._work: asyncio.Future[Any] | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    async def save_checkpoint(self, checkpoint: bytes) -> None:
        """Saves progress (at most 64 KiB) and renews the lease; raises `LeaseLost` when the key
        is no longer this holder's."""
        await self._client._drive(self._client._calls.extend(self, checkpoint, retry=is_transient))

    def _tell_the_work(self) -> None:
        self.cancelled.set()
        if self._work is not None:
            self._work.cancel()

    async def _run(self, work: Callable[[AsyncLease], Awaitable[object]]) -> object:
        self._work = asyncio.ensure_future(_result_of(work, self))
        interval = self._spec.heartbeat_interval
        if interval is not None:
            self._heartbeat = asyncio.create_task(self._beat_every(interval))
        # When run_once itself is cancelled, awaiting the task cancels the work too.
        return await self._work

    async def _beat_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if not await self._client._drive(self._client._calls.beat(self)):
                return

    async def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat


class AsyncIdempotencyClient(ClientBase[grpc.aio.Channel]):
    """The asyncio variant of `IdempotencyClient`, with the same options. Create and use it
    inside one event loop; close it with `await client.close()` or `async with`."""

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
        **options: Unpack[RunOnceOptions],
    ) -> Outcome[T]:
        """Runs `work` at most once for `key` in `namespace`, or returns the result of the run
        that did (`Outcome.replayed`). See the README for every option and error."""
        _refuse_what_cannot_be_work(work)
        spec = RunSpec.build(namespace, key, **options)
        lease_for = functools.partial(AsyncLease, self)
        return cast(Outcome[T], await self._drive(self._calls.run_once(spec, work, lease_for)))

    async def process_once(
        self,
        consumer: str,
        event_id: str,
        work: Callable[[AsyncLease], Awaitable[T]],
        **options: Unpack[RunOnceOptions],
    ) -> Outcome[T]:
        """`run_once` with the consumer as namespace and the event id as key."""
        return await self.run_once(consumer, event_id, work, **options)

    async def mark_processed(
        self, consumer: str, event_ids: Iterable[str], *, retention: Duration | None = None
    ) -> list[str]:
        """Records that `consumer` handled the events and returns the ids that were new. Retried
        only when rate limited, for the reason `IdempotencyClient.mark_processed` gives."""
        return await self._drive(self._calls.mark_processed(consumer, event_ids, retention))

    @staticmethod
    def _open(
        target: str,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[tuple[str, Any]],
    ) -> grpc.aio.Channel:
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, credentials, options=options)

    def _bind(self, method: Method[Any, Any]) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
        return method.on_aio(self._channel)

    _clock = staticmethod(_now)

    async def _drive(self, steps: Steps[T]) -> T:
        """Carries the steps out, each once the one before has answered."""
        walk = Walk(steps)
        for step in walk:
            try:
                walk.answer(await self._carry_out(step))
            except BaseException as error:
                walk.fail(error)
        return walk.result

    async def _carry_out(self, step: Step) -> object:
        if isinstance(step, Send):
            call = self._methods[step.method]
            timeout = self.call_timeout + step.held_for
            try:
                return await call(step.request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as rpc_error:
                raise error_from_status(
                    rpc_error.code(), rpc_error.details() or "", rpc_error.trailing_metadata()
                ) from rpc_error
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, RunWork):
            return await step.lease._run(step.work)
        return await step.lease._stop_heartbeat()


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
