"""The protocol, written once for both clients: run_once, the retries of its calls and a lease's
renewals, as generators that yield the I/O they need (`Step`s) and are sent what came of it.

The sync client carries the steps out with blocking calls and a heartbeat thread, the asyncio
client with coroutines and a heartbeat task (each through a `Walk`): each holds nothing but its
own I/O, so the two cannot come to decide differently. The decisions themselves, from the
service's answers, are `_core`'s.
"""

from __future__ import annotations

import abc
import functools
import logging
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from ._core import (
    DEFAULT_CALL_TIMEOUT,
    WAIT_SLACK,
    Duration,
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
    is_transient,
    new_ids,
    read_claim,
    refused_at_the_door,
    server_wait,
)
from ._proto.idempotency.v1 import idempotency_pb2 as pb
from ._rpc import (
    COMPLETE,
    EXTEND_LEASE,
    LOOKUP,
    MARK_PROCESSED,
    METHODS,
    RELEASE,
    TRY_START,
    Method,
)
from .errors import (
    AlreadyCompleted,
    CallError,
    InProgress,
    KeyNotFound,
    LeaseLost,
    ResultNotStored,
)

T = TypeVar("T")
Client = TypeVar("Client")
Channel = TypeVar("Channel", grpc.Channel, grpc.aio.Channel)
Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)

log = logging.getLogger("idempotency_client")

RENEW_AFTER_WAITING_FRACTION = 0.1
"""A TryStart that claimed a key after longer than this fraction of the lease is followed at
once by a renewal, before the work starts (docs/contract.md, "A claim that waited"): past it the
first heartbeat would have less than two thirds of its margin left."""

Clock = Callable[[], float]
"""A client's monotonic clock, in seconds."""


@dataclass(frozen=True)
class Send:
    """One try of a call: answered with the response, or with the call's `CallError` thrown in."""

    method: Method[Any, Any]
    request: Message
    held_for: float = 0.0
    """How long beyond the call timeout the service may hold the call (a TryStart's wait)."""


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class RunWork:
    """Runs the work under the lease, with a heartbeat renewing it: answered with the work's
    result, or with its error thrown in. The heartbeat runs on until `StopHeartbeat`."""

    lease: LeaseBase[Any]
    work: Callable[[Any], Any]


@dataclass(frozen=True)
class StopHeartbeat:
    lease: LeaseBase[Any]


Step = Send | Pause | RunWork | StopHeartbeat
Steps = Generator[Step, Any, T]


class Walk(Generic[T]):
    """Takes a client through a step generator: iterating gives the steps, and the client reports
    how each went (`answer` or `fail`) before it asks for the next; `result` is what the generator
    returned. An error the generator does not handle comes out of the iteration."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._resume: Callable[[], Step] = steps.__next__
        self.result: T

    def __iter__(self) -> Iterator[Step]:
        while True:
            try:
                step = self._resume()
            except StopIteration as finished:
                self.result = finished.value
                return
            yield step

    def answer(self, reply: object) -> None:
        self._resume = functools.partial(self._steps.send, reply)

    def fail(self, error: BaseException) -> None:
        self._resume = functools.partial(self._steps.throw, error)


class LeaseBase(abc.ABC, Generic[Client]):
    """A lease as both clients hold it. `Lease` and `AsyncLease` add the event that tells the work
    it was lost, and run the work and its heartbeat in their own way."""

    def __init__(self, client: Client, spec: RunSpec, started: Started, asked_at: float) -> None:
        self.namespace = spec.namespace
        self.key = spec.key
        self.token = started.token
        self.attempt = started.attempt
        self.checkpoint = started.checkpoint
        self.expires_at = started.lease_expires_at
        self._client = client
        self._spec = spec
        self._lost_because: CallError | None = None
        # Counted from the TryStart's (first) sending, never from its answer: the service may
        # have started the lease any time in between, so this is never later than its expiry.
        self._runs_out_at = asked_at + spec.lease_ttl

    @property
    def lost(self) -> bool:
        return self._lost_because is not None

    def raise_if_cancelled(self) -> None:
        """Raises `LeaseLost` once the lease is lost; for work that checks between steps."""
        if self._lost_because is not None:
            raise LeaseLost() from self._lost_because

    def _lose(self, because: CallError) -> None:
        self._lost_because = because
        self._tell_the_work()

    @abc.abstractmethod
    def _tell_the_work(self) -> None:
        """Lets the work know that its lease is lost (sets `cancelled`)."""

    @abc.abstractmethod
    def _run(self, work: Callable[[Any], Any]) -> Any:
        """Starts the heartbeat and runs the work (`RunWork`)."""

    @abc.abstractmethod
    def _stop_heartbeat(self) -> Any:
        """Stops the heartbeat and waits until it has (`StopHeartbeat`)."""


L = TypeVar("L", bound="LeaseBase[Any]")


class Calls:
    """The client's side of the protocol, as step generators for a client to carry out.

    `retry` paces and bounds the retries of calls; `clock` is the client's monotonic clock."""

    def __init__(self, retry: RetryPolicy, clock: Clock) -> None:
        self._retry = retry
        self._clock = clock

    def call(
        self,
        method: Method[Request, Response],
        request: Request,
        *,
        retry: RetryWhen | None,
        fresh: Callable[[], tuple[Request, float]] | None = None,
        until: float | None = None,
    ) -> Steps[Response]:
        """One call, sent again while `retry` says so (the same request, so a TryStart keeps its
        attempt_id), within the retry policy's total time, and when `until` is given, not after
        that instant of the clock."""
        pauses = self._retry.delays()
        give_up_at = self._clock() + self._retry.total
        if until is not None:
            give_up_at = min(give_up_at, until)
        while True:
            # `fresh` makes the request anew for each try, with how long beyond the normal call
            # timeout the service may hold it (a TryStart's wait).
            held_for = 0.0
            if fresh is not None:
                request, held_for = fresh()
            try:
                response: Response = yield Send(method, request, held_for)
                return response
            except CallError as error:
                pause = max(next(pauses), error.retry_after or 0.0)
                if retry is None or not retry(error) or self._clock() + pause > give_up_at:
                    raise
                log.info("%s failed (%s); retrying in %.2fs", method.name, error, pause)
            yield Pause(pause)

    def run_once(
        self,
        spec: RunSpec,
        work: Callable[[L], object],
        lease_for: Callable[[RunSpec, Started, float], L],
    ) -> Steps[Outcome[Any]]:
        """Claims the key and runs the work under a lease made by `lease_for`, then Completes
        with its result or Releases the key; or replays the stored result."""
        claim, asked_at = yield from self.claim(spec)
        if isinstance(claim, Replay):
            return Outcome(spec.codec.decode(claim.response), replayed=True)
        lease = lease_for(spec, claim, asked_at)
        # A TryStart that took long (the service held it while another holder had the key) may
        # have left little of the lease as this client counts it: renewed, the work gets it all.
        if self._clock() - asked_at > spec.lease_ttl * RENEW_AFTER_WAITING_FRACTION:
            yield from self.renew_after_waiting(lease)
        try:
            try:
                value = yield RunWork(lease, work)
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
            yield StopHeartbeat(lease)
            if lease.lost:
                # The work failed after its lease was lost (the asyncio work is cancelled then):
                # nothing is released, since the claim is no longer this holder's or its lease
                # may have run out, and whoever takes the key over gets its checkpoint.
                raise LeaseLost() from error
            yield from self.release(lease)
            if lease.lost:
                raise LeaseLost() from error
            raise
        yield StopHeartbeat(lease)
        if lease.lost:
            # The heartbeat lost the lease while the work ran (it may have run out while the
            # service was unreachable): another caller may own the key, so the result is not
            # the key's to report.
            raise LeaseLost() from lease._lost_because
        try:
            yield from self.complete(lease, response)
        except LeaseLost:
            raise
        except CallError as error:
            # The work ran: its result goes to the caller with the news that it is not stored,
            # unlike a failure before the work, after which nothing happened.
            raise ResultNotStored(value, error) from error
        return Outcome(value, replayed=False)

    def claim(self, spec: RunSpec) -> Steps[tuple[Started | Replay, float]]:
        """Claims the key, or finds its result; returns also when the winning TryStart was
        first sent, from which the lease's expiry is counted."""
        # One attempt_id for the whole logical attempt: a TryStart whose answer was lost is
        # retried with it and gets its own claim back instead of `in_progress`.
        attempt_id = uuid.uuid4().hex
        wait_until = self._clock() + spec.wait
        pauses = holder_poll_delays()
        while True:
            # The one place that waits for a holder: the service holds each TryStart for what is
            # left of the caller's limit (at most 60 s), and the call's deadline covers that wait.
            asked_at = self._clock()
            asked_wait = server_wait(wait_until, asked_at)

            def fresh() -> tuple[pb.TryStartRequest, float]:
                # Recomputed for every try, so that a retry never waits past the limit.
                wait = server_wait(wait_until, self._clock())
                return spec.try_start_request(attempt_id, wait), wait

            log.debug("claiming key in namespace %s (wait %.3fs)", spec.namespace, asked_wait)
            answer = yield from self.call(
                TRY_START, spec.try_start_request(attempt_id), retry=is_transient, fresh=fresh
            )
            claim = read_claim(spec, answer)
            if not isinstance(claim, HeldElsewhere):
                return claim, asked_at
            remaining = wait_until - self._clock()
            if remaining < WAIT_SLACK:
                raise InProgress(
                    spec.namespace,
                    spec.key,
                    lease_expires_at=claim.lease_expires_at,
                    attempt=claim.attempt,
                )
            if answered_early(asked_at, asked_wait, self._clock()):
                # The service is at its waiter limit: pause so that it is not hammered.
                log.debug("the service did not wait for key in namespace %s", spec.namespace)
                yield Pause(min(next(pauses), remaining))

    def renew_after_waiting(self, lease: LeaseBase[Any]) -> Steps[None]:
        """Renews, before the work starts, a lease whose TryStart took long (docs/contract.md, "A
        claim that waited"): the service started it when it granted the claim, at an instant
        this client cannot read off its clock, so the lease is counted from the TryStart's
        sending and may be nearly over, or over, by the time the answer came. Counted from this
        renewal's sending instead, the work gets its whole lease.

        Retried until the lease counted from the TryStart's sending runs out (or the retry
        budget does). Refused, it raises `LeaseLost`; when it cannot get through, the key is
        released with one try (best effort), so that a retry need not wait for the lease to run
        out, and its error is raised. Either way the work does not run."""
        log.debug(
            "the claim in namespace %s took long; renewing its lease before the work starts",
            lease.namespace,
        )
        try:
            yield from self.extend(lease, None, retry=is_transient, until=lease._runs_out_at)
        except LeaseLost:
            raise
        except BaseException:
            # One try: the coordinator has just been unreachable for the renewal's whole window.
            yield from self.release(lease, retry=None)
            raise

    def release(
        self, lease: LeaseBase[Any], *, retry: RetryWhen | None = is_transient
    ) -> Steps[None]:
        """Gives the claim up so that a retry starts fresh, retried while `retry` says so. A
        failure here only delays that retry until the lease runs out, so it is logged, not raised
        over the work's own error."""
        request = lease._spec.release_request(lease.token)
        try:
            yield from self.call(RELEASE, request, retry=retry)
        except KeyNotFound:
            pass  # Already absent: an earlier try of this Release worked, or the key expired.
        except LeaseLost as error:
            lease._lose(error)
        except CallError as error:
            log.warning("could not release a claim; it frees when its lease runs out: %s", error)

    def complete(self, lease: LeaseBase[Any], response: bytes) -> Steps[None]:
        """Stores the result; a key that is gone is a lost lease (`LeaseLost`)."""
        spec = lease._spec
        try:
            yield from self.call(
                COMPLETE, spec.complete_request(lease.token, response), retry=is_transient
            )
        except KeyNotFound as error:
            raise LeaseLost("the key expired or was released while the work ran") from error
        except AlreadyCompleted as refused:
            # The contract answers a repeated Complete with the same response as a success; if
            # the key holds exactly this response anyway, the outcome is the same.
            lookup = pb.LookupRequest(namespace=spec.namespace, key=spec.key)
            state = yield from self.call(LOOKUP, lookup, retry=is_transient)
            if state.WhichOneof("state") == "completed" and state.completed.response == response:
                return
            raise refused

    def extend(
        self,
        lease: LeaseBase[Any],
        checkpoint: bytes | None,
        *,
        retry: RetryWhen | None,
        until: float | None = None,
    ) -> Steps[None]:
        """Renews the lease (saving `checkpoint` when given), retried while `retry` says so but
        not after `until`; a key that is no longer the lease's loses it, and raises
        `LeaseLost`."""
        # Before the first try: never later than whichever try renewed the lease.
        sent_at = self._clock()
        request = lease._spec.extend_request(lease.token, checkpoint)
        try:
            answer = yield from self.call(EXTEND_LEASE, request, retry=retry, until=until)
        except (LeaseLost, KeyNotFound, AlreadyCompleted) as error:
            lease._lose(error)
            raise LeaseLost() from error
        lease.expires_at = instant(answer.lease_expires_at)
        lease._runs_out_at = sent_at + lease._spec.lease_ttl

    def beat(self, lease: LeaseBase[Any]) -> Steps[bool]:
        """One heartbeat, not retried (the next beat is the retry); returns whether to go on."""
        try:
            yield from self.extend(lease, None, retry=None)
        except LeaseLost:
            log.warning("lease lost in namespace %s; cancelling the work", lease.namespace)
            return False
        except CallError as error:
            # A missed beat is harmless while the lease still runs; once it may have run out,
            # another caller may hold the key, so the work must stop.
            if self._clock() >= lease._runs_out_at:
                log.warning("lease ran out while the service was unreachable: %s", error)
                lease._lose(error)
                return False
            log.info("heartbeat failed, trying again at the next beat: %s", error)
        return True

    def mark_processed(
        self, consumer: str, event_ids: Iterable[str], retention: Duration | None
    ) -> Steps[list[str]]:
        """Retried only when refused at the door (rate limited or overloaded, before it ran): a
        retry after a lost answer would report the events as seen before, and the caller would
        skip them."""
        request = pb.MarkProcessedRequest(consumer=consumer, event_ids=list(event_ids))
        if retention is not None:
            request.retention.CopyFrom(duration_message(retention))
        answer = yield from self.call(MARK_PROCESSED, request, retry=refused_at_the_door)
        return new_ids(answer)


class ClientBase(abc.ABC, Generic[Channel]):
    """What both clients are made of: a channel with the six methods bound to it, the token, the
    call timeout and the protocol's steps. A subclass opens its kind of channel and carries the
    steps out."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        retry: RetryPolicy | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        credentials = None if tls is None else tls.credentials()
        self._channel: Channel = self._open(target, credentials, channel_options)
        self._methods = {method: self._bind(method) for method in METHODS}
        self._metadata = call_metadata(token)
        self.call_timeout = call_timeout
        self._calls = Calls(retry or RetryPolicy(), self._clock)

    @staticmethod
    @abc.abstractmethod
    def _open(
        target: str,
        credentials: grpc.ChannelCredentials | None,
        options: Sequence[tuple[str, Any]],
    ) -> Channel:
        """Opens a channel to `target`: plaintext without credentials, TLS with them."""

    @abc.abstractmethod
    def _bind(self, method: Method[Any, Any]) -> Callable[..., Any]:
        """`method` on the channel: called with a request, a timeout and the metadata."""

    @staticmethod
    @abc.abstractmethod
    def _clock() -> float:
        """The monotonic clock that paces retries and times leases."""
