"""The synchronous client: `run_once`, `process_once` and `mark_processed` over a grpc channel.

What the calls are and when they are retried is `_protocol`'s; this module carries its steps out
with blocking I/O: a call waits for its answer, a pause sleeps, and the heartbeat is a thread.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc

from ._core import Duration, Outcome, RunSpec, Started, is_transient
from ._protocol import ClientBase, LeaseBase, Pause, RunWork, Send, Step, Steps, Walk
from ._rpc import Method
from .errors import CallError, error_from_status

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._core import RunOnceOptions

T = TypeVar("T")


def _typed_error(rpc_error: grpc.RpcError) -> CallError:
    # A failed unary call raises an error that is also its grpc.Call (code, details, trailers).
    if isinstance(rpc_error, grpc.Call):
        return error_from_status(
            rpc_error.code(), rpc_error.details() or "", rpc_error.trailing_metadata()
        )
    return CallError(str(rpc_error), code=grpc.StatusCode.UNKNOWN)


class Lease(LeaseBase["IdempotencyClient"]):
    """The claim that the work holds while it runs.

    `token` and `attempt` identify the claim (`attempt` > 1 after a takeover), `checkpoint` is
    what a previous holder saved (None when none was), and `cancelled` is set when the lease is
    lost: the work should stop then, since another caller owns the key."""

    def __init__(
        self, client: IdempotencyClient, spec: RunSpec, started: Started, asked_at: float
    ) -> None:
        super().__init__(client, spec, started, asked_at)
        self.cancelled = threading.Event()
        self._heartbeat: _Heartbeat | None = None

    def save_checkpoint(self, checkpoint: bytes) -> None:
        """Saves progress (at most 64 KiB) and renews the lease. If this holder dies, the caller
        that takes the key over finds it in `lease.checkpoint`. Raises `LeaseLost` when the key
        is no longer this holder's."""
        self._client._drive(self._client._calls.extend(self, checkpoint, retry=is_transient))

    def _beat(self) -> bool:
        return self._client._drive(self._client._calls.beat(self))

    def _tell_the_work(self) -> None:
        self.cancelled.set()

    def _run(self, work: Callable[[Lease], object]) -> object:
        interval = self._spec.heartbeat_interval
        if interval is not None:
            self._heartbeat = _Heartbeat(self, interval)
        return work(self)

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()


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
            if not self._lease._beat():
                return


class IdempotencyClient(ClientBase[grpc.Channel]):
    """A client of the idempotency coordinator.

    `target` is the service's address; `token` is sent as `authorization: Bearer <token>`;
    `tls` turns TLS on (`TlsConfig()` trusts the system's roots); `call_timeout` bounds each
    call in seconds; `retry` says how calls that failed with `UNAVAILABLE`, a deadline or a
    rate limit are retried; `channel_options` go to grpc as they are. Thread-safe; close it
    when done (or use it as a context manager)."""

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
        **options: Unpack[RunOnceOptions],
    ) -> Outcome[T]:
        """Runs `work` at most once for `key` in `namespace`, or returns the result of the run
        that did (`Outcome.replayed`). See the README for every option and error."""
        spec = RunSpec.build(namespace, key, **options)
        lease_for = functools.partial(Lease, self)
        return cast(Outcome[T], self._drive(self._calls.run_once(spec, work, lease_for)))

    def process_once(
        self,
        consumer: str,
        event_id: str,
        work: Callable[[Lease], T],
        **options: Unpack[RunOnceOptions],
    ) -> Outcome[T]:
        """Handles an event at most once: `run_once` with the consumer as namespace and the
        event id as key. For effects that must happen once (a charge, an email)."""
        return self.run_once(consumer, event_id, work, **options)

    def mark_processed(
        self, consumer: str, event_ids: Iterable[str], *, retention: Duration | None = None
    ) -> list[str]:
        """Records that `consumer` handled the events (1-1000, atomically) and returns the ids
        that were new, in request order. Retried only when rate limited (refused before it ran):
        a retry after a lost answer would report the events as seen before, and the caller
        would skip them."""
        return self._drive(self._calls.mark_processed(consumer, event_ids, retention))

    @staticmethod
    def _open(
        target: str,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[tuple[str, Any]],
    ) -> grpc.Channel:
        if credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, credentials, options=options)

    def _bind(self, method: Method[Any, Any]) -> grpc.UnaryUnaryMultiCallable[Any, Any]:
        return method.on(self._channel)

    _clock = staticmethod(time.monotonic)

    def _drive(self, steps: Steps[T]) -> T:
        """Carries the steps out, each as soon as the one before has answered."""
        walk = Walk(steps)
        for step in walk:
            try:
                walk.answer(self._carry_out(step))
            except BaseException as error:
                walk.fail(error)
        return walk.result

    def _carry_out(self, step: Step) -> object:
        if isinstance(step, Send):
            try:
                return self._methods[step.method](
                    step.request,
                    timeout=self.call_timeout + step.held_for,
                    metadata=self._metadata,
                )
            except grpc.RpcError as rpc_error:
                raise _typed_error(rpc_error) from rpc_error
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        if isinstance(step, RunWork):
            return step.lease._run(step.work)
        return step.lease._stop_heartbeat()
