"""What the suite watches while the load runs: when writes commit on each node, when calls go
through each coordinator, and what each coordinator's health says.

The load's own calls cannot say when the service recovered: a client pauses between retries
(50 ms growing to 2 s, at least the service's RetryInfo of 1 s), so its first success after an
outage comes up to two seconds after the service could have answered. These probes ask every
50 ms without pausing, so that their first success is within a tick of the recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import psycopg
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from idempotency_client._proto.idempotency.v1 import idempotency_pb2 as pb
from idempotency_client._rpc import TRY_START

from cluster import Node

SERVICE = "idempotency.v1.IdempotencyService"
TICK = 0.05
"""Seconds between two probes of one node or one coordinator."""
PROBE_NAMESPACE = "ha-probe"


class Background:
    """A probe's loop, run as a task from start() until stop() cancels it."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Attempt:
    started: float
    ended: float
    ok: bool
    detail: str


@dataclass
class Timeline:
    """Every attempt of one probe, in the order they started."""

    name: str
    attempts: list[Attempt] = field(default_factory=list)

    def within(self, since: float, until: float) -> list[Attempt]:
        return [a for a in self.attempts if since <= a.started <= until]

    def last_failure(self, since: float, until: float) -> Attempt | None:
        failed = [a for a in self.within(since, until) if not a.ok]
        return max(failed, key=lambda a: a.started) if failed else None

    def first_failure(self, since: float, until: float) -> Attempt | None:
        failed = [a for a in self.within(since, until) if not a.ok]
        return min(failed, key=lambda a: a.started) if failed else None

    def recovered_at(self, since: float, until: float) -> float | None:
        """When attempts succeeded again for good after the last failure in the window: the end
        of the first success that started after the last failed attempt started (attempts
        that started before it may still have been stuck on what failed). `since` when nothing
        failed; None when nothing succeeded after the last failure."""
        last = self.last_failure(since, until)
        if last is None:
            return since
        after = [a.ended for a in self.attempts if a.ok and a.started > last.started]
        after = [ended for ended in after if ended <= until]
        return min(after) if after else None

    def successes_after(self, instant: float) -> int:
        return sum(1 for a in self.attempts if a.ok and a.started > instant)


class NodeWriteProbe(Background):
    """Commits a write directly on one node every tick (over the bridge, not through HAProxy or a
    coordinator): the instant a new primary accepts writes is the first success on it. The write
    is a transactional logical message, whose commit waits for a synchronous standby exactly as
    the service's writes do, so a primary without one does not count as accepting writes."""

    def __init__(self, node: Node) -> None:
        super().__init__()
        self.node = node
        self.timeline = Timeline(node.name)

    async def _run(self) -> None:
        connection: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        closing: set[asyncio.Task[None]] = set()
        while True:
            started = time.monotonic()
            try:
                if connection is None or connection.closed:
                    connection = await asyncio.wait_for(
                        psycopg.AsyncConnection.connect(self.node.dsn, autocommit=True), 1.0
                    )
                current = connection
                write = current.execute("SELECT pg_logical_emit_message(true, 'ha-probe', '')")
                await asyncio.wait_for(write, 1.0)
                self.timeline.attempts.append(Attempt(started, time.monotonic(), True, ""))
            except (TimeoutError, psycopg.Error, OSError) as error:
                detail = type(error).__name__ if isinstance(error, TimeoutError) else str(error)
                self.timeline.attempts.append(
                    Attempt(started, time.monotonic(), False, detail.splitlines()[0][:120])
                )
                # A connection that failed may be stuck on a host that is cut off: dropped,
                # without waiting for it to close, and a new one is made next tick.
                if connection is not None:
                    stale, connection = connection, None
                    task = asyncio.create_task(_close_quietly(stale))
                    closing.add(task)
                    task.add_done_callback(closing.discard)
            await asyncio.sleep(TICK)


async def _close_quietly(connection: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(connection.close(), 5.0)


class CoordinatorProbe(Background):
    """A TryStart of a fresh key through one coordinator every tick, each with a deadline of its
    own, without waiting for the one before (a call stuck on a lost connection does not hold the
    next ones back). Also records every token it is granted, for the token checks."""

    DEADLINE = 3.0

    def __init__(self, name: str, address: str) -> None:
        super().__init__()
        self.name = name
        self.address = address
        self.timeline = Timeline(name)
        self.tokens: list[tuple[int, str, float]] = []
        """(token, namespace/key, instant) of every claim granted."""
        self._channel: grpc.aio.Channel | None = None
        self._calls: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.address)
        super().start()

    async def stop(self) -> None:
        await super().stop()
        for call in list(self._calls):
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    async def _run(self) -> None:
        assert self._channel is not None
        try_start = TRY_START.on_aio(self._channel)
        while True:
            call = asyncio.create_task(self._once(try_start))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
            await asyncio.sleep(TICK)

    async def _once(
        self, try_start: grpc.aio.UnaryUnaryMultiCallable[pb.TryStartRequest, pb.TryStartResponse]
    ) -> None:
        key = uuid.uuid4().hex
        request = pb.TryStartRequest(
            namespace=PROBE_NAMESPACE,
            key=key,
            lease_ttl=duration_pb2.Duration(seconds=1),
            retention=duration_pb2.Duration(seconds=120),
        )
        started = time.monotonic()
        try:
            answer = await try_start(request, timeout=self.DEADLINE)
        except grpc.aio.AioRpcError as error:
            self.timeline.attempts.append(
                Attempt(started, time.monotonic(), False, error.code().name)
            )
            return
        ended = time.monotonic()
        ok = answer.WhichOneof("outcome") == "started"
        if ok:
            self.tokens.append((answer.started.lease_token, f"{PROBE_NAMESPACE}/{key}", ended))
        detail = "" if ok else f"answered {answer.WhichOneof('outcome')}"
        self.timeline.attempts.append(Attempt(started, ended, ok, detail))


@dataclass(frozen=True)
class Transition:
    at: float
    status: str


class HealthWatch(Background):
    """grpc.health.v1 Watch of the API's service on one coordinator: every status it sends,
    with the instant it arrived. A stream that ends is opened again (noted as a transition)."""

    def __init__(self, name: str, address: str) -> None:
        super().__init__()
        self.name = name
        self.address = address
        self.transitions: list[Transition] = []

    def status_at(self, instant: float) -> str:
        status = "UNKNOWN"
        for transition in self.transitions:
            if transition.at > instant:
                break
            status = transition.status
        return status

    async def _run(self) -> None:
        while True:
            async with grpc.aio.insecure_channel(self.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    stream = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
                    async for answer in stream:
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
                        self._note(str(status))
                    ended = "STREAM_ENDED"
                except grpc.aio.AioRpcError as error:
                    ended = f"STREAM_FAILED_{error.code().name}"
            self._note(ended)
            await asyncio.sleep(TICK)

    def _note(self, status: str) -> None:
        # Only changes: a stream opened again repeats the status it had.
        if not self.transitions or self.transitions[-1].status != status:
            self.transitions.append(Transition(time.monotonic(), status))
