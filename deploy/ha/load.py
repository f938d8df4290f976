"""The load: callers running lifecycles through the project's Python client (asyncio variant,
`run_once` with its default retry budget), as a service behind an idempotency key would, and a
record of everything they saw.

Each caller takes a fresh key, or a key another caller is asking at the same moment (so that
one of them waits for the other's Complete, through the other coordinator when there are two),
or a key asked before (a replay, or a retry after an error, as a client retries later). The
work records its execution (key, fencing token, instant) and sleeps 20 ms; its result names the
key, the token and the run, so that two runs never store the same bytes. Optionally a share of
keys fail their first run (the client Releases the key, and the caller asks it again later), so
that keys run more than once, each run under a new token.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc.aio
from google.rpc import error_details_pb2, status_pb2
from idempotency_client import (
    AsyncIdempotencyClient,
    AsyncLease,
    BytesCodec,
    CallError,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
)
from idempotency_client._proto.idempotency.v1 import idempotency_pb2 as pb
from idempotency_client._protocol import Send, Step
from idempotency_client._rpc import COMPLETE, LOOKUP

from cluster import SuiteFailure

WORK_SECONDS = 0.02
WAIT_SECONDS = 15.0
"""How long a caller lets the service hold its TryStart while another caller has the key."""
TWIN_SHARE = 0.2
"""The share of fresh keys that a second caller asks at the same moment."""
LATER_SHARE = 0.1
"""The share of acknowledged keys asked again a few seconds later (a replay)."""
_DETAILS_TRAILER = "grpc-status-details-bin"


@dataclass(frozen=True)
class Execution:
    """One run of the work: the claim's key and token, when the work started."""

    key: str
    token: int
    started: float
    coordinator: str


@dataclass(frozen=True)
class Ack:
    """An outcome `run_once` returned to its caller: the result is the key's for good."""

    key: str
    response: bytes
    replayed: bool
    at: float
    coordinator: str
    twin: bool = False
    """The ask was one of two asks of the key at the same moment (one of them waits)."""


@dataclass(frozen=True)
class Try:
    """One try of one RPC, as the client sent it (retries are tries of their own)."""

    coordinator: str
    method: str
    started: float
    ended: float
    code: str
    reason: str | None
    outcome: str | None
    key: str = ""

    @property
    def label(self) -> str:
        return " ".join(part for part in (self.code, self.reason, self.outcome) if part)


@dataclass(frozen=True)
class Failure:
    """An error `run_once` raised to its caller (after the client's retries)."""

    key: str
    at: float
    error: str
    coordinator: str
    twin: bool = False


@dataclass
class Recorder:
    executions: list[Execution] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    tries: list[Try] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    completed: dict[str, float] = field(default_factory=dict)
    """Key -> when the first Complete of it was acknowledged (its answer arrived)."""
    twin_asks: int = 0
    """Asks of a key that two callers asked at the same moment (each of the two counts)."""
    released: int = 0
    """Runs of the work that failed on purpose (`Load`'s `release_share`)."""
    twin_released: int = 0
    """Of them, those of an ask of a key asked twice at once (its answer was its own failure)."""

    def acknowledged(self) -> dict[str, float]:
        """Key -> when its result was first acknowledged to anyone: its Complete's answer, or a
        replay of it, whichever came first."""
        first = dict(self.completed)
        for ack in self.acks:
            if ack.key not in first or ack.at < first[ack.key]:
                first[ack.key] = ack.at
        return first

    def twins(self) -> set[str]:
        """The keys two callers asked at the same moment (one of them waited for the other)."""
        return {a.key for a in self.acks if a.twin} | {f.key for f in self.failures if f.twin}


def expected_responses(
    acks: Iterable[tuple[str, bytes]],
) -> tuple[dict[str, bytes], dict[str, str]]:
    """The response each key must replay (its first acknowledged one), and the keys
    acknowledged with two different responses."""
    first: dict[str, bytes] = {}
    conflicts: dict[str, str] = {}
    for key, response in acks:
        if first.setdefault(key, response) != response:
            conflicts[key] = "acknowledged with two different responses"
    return first, conflicts


def outcome_of(error: CallError) -> str | None:
    """ErrorInfo's metadata["outcome"] of a failed call (`unknown`: the write may still land;
    `not_written`), read from the status details the client decoded its error from."""
    cause = error.__cause__
    if not isinstance(cause, grpc.aio.AioRpcError):
        return None
    for name, value in cause.trailing_metadata() or ():
        if name != _DETAILS_TRAILER or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                outcome = info.metadata.get("outcome")
                return None if outcome is None else str(outcome)
    return None


class RecordingClient(AsyncIdempotencyClient):
    """The client as it is, recording each try of each call with its answer. The client has no
    hook for watching its own retries; `_carry_out` is the one place every try passes (the
    asyncio client's step runner), so the suite wraps it without changing what it does."""

    def __init__(
        self,
        target: str,
        coordinator: str,
        recorder: Recorder,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        super().__init__(target, channel_options=channel_options)
        self.coordinator = coordinator
        self._recorder = recorder

    async def _carry_out(self, step: Step) -> object:
        if not isinstance(step, Send):
            return await super()._carry_out(step)
        started = time.monotonic()
        key = str(getattr(step.request, "key", ""))  # every request but MarkProcessed has one
        try:
            answer = await super()._carry_out(step)
        except CallError as error:
            self._recorder.tries.append(
                Try(
                    self.coordinator,
                    step.method.name,
                    started,
                    time.monotonic(),
                    error.code.name,
                    error.reason,
                    outcome_of(error),
                    key,
                )
            )
            raise
        ended = time.monotonic()
        self._recorder.tries.append(
            Try(self.coordinator, step.method.name, started, ended, "OK", None, None, key)
        )
        if step.method is COMPLETE:
            self._recorder.completed.setdefault(key, ended)
        return answer


class WorkFailed(Exception):
    """The work's failure on purpose: `run_once` Releases the key and raises it again."""


class Load:
    """`callers` tasks, split evenly across the clients (one per coordinator), running
    lifecycles in `namespace` until stopped; the first run of `release_share` of the keys
    fails."""

    def __init__(
        self,
        namespace: str,
        clients: list[RecordingClient],
        callers: int,
        recorder: Recorder,
        release_share: float = 0.0,
    ) -> None:
        self.namespace = namespace
        self.clients = clients
        self.recorder = recorder
        self._callers = callers
        self._release_share = release_share
        self._failed_once: set[str] = set()
        self._fresh = 0
        self._twins: dict[str, collections.deque[str]] = {
            client.coordinator: collections.deque() for client in clients
        }
        self._later: list[tuple[float, str]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for index in range(self._callers):
            client = self.clients[index % len(self.clients)]
            self._tasks.append(asyncio.create_task(self._caller(index, client)))

    async def stop(self, within: float = 60.0) -> None:
        """Lets every caller finish its lifecycle (its retries included), then stops; `within`
        0 stops them where they are (the suite was interrupted)."""
        self._stop.set()
        done, pending = (
            await asyncio.wait(self._tasks, timeout=within) if within else (set(), set(self._tasks))
        )
        for task in pending:
            task.cancel()
        if pending:
            # The cancelled callers end before their clients are closed under them.
            await asyncio.wait(pending, timeout=5)
        for task in done:
            error = task.exception()
            if error is not None:
                raise SuiteFailure(f"a caller crashed: {error!r}") from error
        if pending and within:
            raise SuiteFailure(f"{len(pending)} callers did not finish within {within:.0f} s")

    def crashed(self) -> BaseException | None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    def _next(self, client: RecordingClient, rng: random.Random) -> tuple[str, bool]:
        """The key to ask next, and whether another caller asks it at the same moment."""
        twins = self._twins[client.coordinator]
        if twins:
            return twins.popleft(), True
        now = time.monotonic()
        if self._later and self._later[0][0] <= now:
            return heapq.heappop(self._later)[1], False
        self._fresh += 1
        key = f"k{self._fresh}"
        if rng.random() < TWIN_SHARE:
            # Asked at once by another caller, through the other coordinator when there are two,
            # so that the waiter is woken by a Complete made through another replica.
            others = [c for c in self.clients if c is not client] or [client]
            self._twins[rng.choice(others).coordinator].append(key)
            return key, True
        return key, False

    def _ask_later(self, key: str, rng: random.Random) -> None:
        heapq.heappush(self._later, (time.monotonic() + rng.uniform(1.0, 4.0), key))

    async def _caller(self, index: int, client: RecordingClient) -> None:
        rng = random.Random(index)
        codec = BytesCodec()
        while not self._stop.is_set():
            key, twin = self._next(client, rng)
            if twin:
                self.recorder.twin_asks += 1

            async def work(lease: AsyncLease, key: str = key) -> bytes:
                self.recorder.executions.append(
                    Execution(key, lease.token, time.monotonic(), client.coordinator)
                )
                fail = key not in self._failed_once and rng.random() < self._release_share
                if fail:
                    self._failed_once.add(key)
                await asyncio.sleep(WORK_SECONDS)
                if fail:
                    raise WorkFailed(key)
                return f"{key} token {lease.token} run {uuid.uuid4().hex}".encode()

            try:
                outcome = await client.run_once(
                    self.namespace, key, work, request={"key": key}, codec=codec, wait=WAIT_SECONDS
                )
            except WorkFailed:
                self.recorder.released += 1
                self.recorder.twin_released += twin
                self._ask_later(key, rng)
                continue
            except IdempotencyError as error:
                self.recorder.failures.append(
                    Failure(key, time.monotonic(), _describe(error), client.coordinator, twin)
                )
                # A client retries later what failed, as a service's caller would (a mismatch
                # cannot happen here: every ask of a key sends the same request).
                if not isinstance(error, FingerprintMismatch):
                    self._ask_later(key, rng)
                continue
            self.recorder.acks.append(
                Ack(
                    key,
                    bytes(outcome.value),
                    outcome.replayed,
                    time.monotonic(),
                    client.coordinator,
                    twin,
                )
            )
            if rng.random() < LATER_SHARE:
                self._ask_later(key, rng)


def _describe(error: IdempotencyError) -> str:
    if isinstance(error, CallError):
        return f"{type(error).__name__} ({error.code.name} {error.reason or ''})".replace(" )", ")")
    if isinstance(error, InProgress):
        return "InProgress"
    return type(error).__name__


class Verifier:
    """Reads keys back through a coordinator of its own started with --replay-cache-bytes 0, so
    that every answer comes from the database (a replica's replay cache could answer a key the
    database lost)."""

    CONCURRENCY = 32

    def __init__(self, address: str, namespace: str) -> None:
        self.address = address
        self.namespace = namespace

    async def check_the_read_back(self, ack: Ack) -> None:
        """The read-back has teeth: a key never acknowledged and an acknowledged key (`ack`)
        expected with other bytes are both reported, and the same key with its own bytes is not."""
        planted = {"never-acknowledged": b"x", ack.key: ack.response + b"!"}
        found = await self.mismatches(planted)
        clean = await self.mismatches({ack.key: ack.response})
        if set(found) != set(planted) or clean:
            raise SuiteFailure(
                f"the read-back does not find what was planted ({found}) or finds a key that "
                f"replays ({clean})"
            )

    async def mismatches(self, expected: dict[str, bytes], within: float = 60.0) -> dict[str, str]:
        """Key -> what Lookup found instead of the expected response, for every key that does not
        replay byte-identical."""
        found: dict[str, str] = {}
        semaphore = asyncio.Semaphore(self.CONCURRENCY)
        deadline = time.monotonic() + within
        async with grpc.aio.insecure_channel(self.address) as channel:
            lookup = LOOKUP.on_aio(channel)

            async def check(key: str, response: bytes) -> None:
                async with semaphore:
                    answer = await _look(lookup, self.namespace, key, deadline)
                state = answer.WhichOneof("state")
                if state != "completed":
                    found[key] = str(state)
                elif answer.completed.response != response:
                    found[key] = f"another response: {answer.completed.response[:60]!r}"

            await asyncio.gather(*(check(key, value) for key, value in expected.items()))
        return found


async def _look(
    lookup: grpc.aio.UnaryUnaryMultiCallable[pb.LookupRequest, pb.LookupResponse],
    namespace: str,
    key: str,
    deadline: float,
) -> pb.LookupResponse:
    """A Lookup, asked again while the verifier cannot reach the store, until `deadline`."""
    while True:
        try:
            return await lookup(pb.LookupRequest(namespace=namespace, key=key), timeout=5.0)
        except grpc.aio.AioRpcError as error:
            retriable = error.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            if not retriable or time.monotonic() > deadline:
                raise SuiteFailure(
                    f"Lookup of {namespace}/{key} failed: {error.code().name}"
                ) from error
        await asyncio.sleep(0.1)
