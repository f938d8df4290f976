"""The scenario vectors of clients/conformance/scenarios.json: `run_once` against the real
coordinator with `fault-proxy` between the client and the coordinator, every scenario once with
the sync client and once with the asyncio one.

One coordinator (SQLite) serves the module; each scenario gets a proxy of its own and a fresh
client whose target is the proxy. The steps run in an event loop for both clients: a run of the
sync client goes to a thread, one of the asyncio client is a task. The runner and a run's work
meet through `threading.Event`s, which the work of either client and the loop can wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
from support import Coordinator, RawService, workspace_binary
from test_conformance import load

from idempotency_client import (
    AsyncIdempotencyClient,
    AsyncLease,
    FingerprintMismatch,
    IdempotencyClient,
    IdempotencyError,
    InProgress,
    Lease,
    LeaseLost,
    Outcome,
    ResultNotStored,
    RetryPolicy,
    Unauthenticated,
    Unavailable,
    fingerprint_of,
)
from idempotency_client._core import RunOnceOptions

SCENARIOS: list[dict[str, Any]] = load("scenarios.json")["scenarios"]
NAMESPACE = "py-scenarios"
LIMIT = 20.0
"""Seconds the runner waits for anything that should come at once: a work to start or to pass
its gate, the proxy's call count, the client's cancellation."""
RUN_LIMIT = 60.0
"""Seconds a run may take to end: a run may wait 20 s for a holder, on top of its calls."""
POLL = 0.02

# The error kinds of the vectors that are a class of the client's (`work_failed` and `other` are
# judged apart).
ERROR_KINDS: dict[str, type[IdempotencyError]] = {
    "mismatch": FingerprintMismatch,
    "in_progress": InProgress,
    "lease_lost": LeaseLost,
    "result_not_stored": ResultNotStored,
    "unavailable": Unavailable,
    "unauthenticated": Unauthenticated,
}


def proxy_binary() -> str:
    return workspace_binary("FAULT_PROXY_BIN", "fault-proxy")


# The control port is on loopback: never through an HTTP proxy from the environment.
_CONTROL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class FaultProxy:
    """One fault-proxy process in front of `upstream`. It serves until `close` closes its stdin."""

    def __init__(self, upstream: str, folder: Path) -> None:
        self._log_path = folder / f"fault-proxy-{uuid.uuid4().hex[:8]}.log"
        with self._log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [proxy_binary(), "--upstream", upstream],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._process.wait(LIMIT)
            pytest.fail(
                f"fault-proxy exited with {self._process.returncode} before it printed its "
                f"addresses:\n{self.log()}"
            )
        addresses = json.loads(line)
        self.address: str = addresses["proxy"]
        self._control = f"http://{addresses['control']}"

    def post(self, route: str, body: object = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self._control + route,
            data=data,
            method="POST",
            headers={"content-type": "application/json"},
        )
        try:
            with _CONTROL.open(request, timeout=LIMIT) as answer:
                assert answer.status == 200, f"POST {route}: {answer.status}"
        except urllib.error.HTTPError as refused:
            pytest.fail(f"fault-proxy refused POST {route} {body!r}: {refused.read().decode()}")

    def refuse(self) -> None:
        self.post("/refuse")

    def calls(self) -> dict[str, list[float]]:
        with _CONTROL.open(self._control + "/calls", timeout=LIMIT) as answer:
            calls: dict[str, list[float]] = json.loads(answer.read())
            return calls

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")

    def close(self) -> None:
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()
        try:
            self._process.wait(LIMIT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            pytest.fail("fault-proxy did not exit when its stdin closed")


@dataclass
class Run:
    """One `run` of a scenario: its work's orders (the vector's `work`) and what the work saw."""

    work: dict[str, Any]
    started: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    ran: bool = False
    cancelled: bool = False
    attempt: int | None = None
    failure: Exception | None = None
    """The error the work raises (`fail`), to tell it apart from every other."""
    began: float = field(default_factory=time.monotonic)
    """When the runner was about to call run_once (`time.monotonic`)."""

    def __post_init__(self) -> None:
        unknown = set(self.work) - {
            "result",
            "fail",
            "gate",
            "until_cancelled",
            "duration_ms",
            "refuse_at_end",
        }
        assert not unknown, f"work orders this runner does not know: {sorted(unknown)}"
        assert ("result" in self.work) or ("fail" in self.work), (
            f"a work without an end: {self.work}"
        )
        duration_ms = self.work.get("duration_ms", 0)
        assert is_milliseconds(duration_ms), f"duration_ms is not a duration: {duration_ms!r}"
        if "fail" in self.work:
            self.failure = RuntimeError(self.work["fail"])

    def begin(self, attempt: int) -> None:
        self.ran = True
        self.attempt = attempt
        self.started.set()

    @property
    def duration(self) -> float | None:
        """Seconds the work works for (`duration_ms`), when it does."""
        duration_ms = self.work.get("duration_ms")
        return None if duration_ms is None else duration_ms / 1000

    def pass_gate(self) -> None:
        if not self.gate.wait(LIMIT):
            pytest.fail(f"the gate of a work was not opened within {LIMIT}s")

    def end(self) -> object:
        """What the work finishes with: its error raised, or its result returned."""
        if self.failure is not None:
            raise self.failure
        return copy.deepcopy(self.work["result"])


def sync_work(run: Run, proxy: FaultProxy) -> Callable[[Lease], object]:
    def work(lease: Lease) -> object:
        run.begin(lease.attempt)
        if run.work.get("gate"):
            run.pass_gate()
        if run.work.get("until_cancelled"):
            lease.cancelled.wait(LIMIT)
        if run.duration is not None and lease.cancelled.wait(run.duration):
            run.cancelled = True
            raise RuntimeError("the client cancelled the work before it was done")
        # A sync work cannot be interrupted: the client cancels it by setting `cancelled`.
        run.cancelled = lease.cancelled.is_set()
        if run.work.get("refuse_at_end"):
            proxy.refuse()
        return run.end()

    return work


def async_work(run: Run, proxy: FaultProxy) -> Callable[[AsyncLease], Awaitable[object]]:
    async def work(lease: AsyncLease) -> object:
        run.begin(lease.attempt)
        try:
            if run.work.get("gate"):
                await asyncio.to_thread(run.pass_gate)
            if run.work.get("until_cancelled"):
                await set_within(lease.cancelled, LIMIT)
            if run.duration is not None and await set_within(lease.cancelled, run.duration):
                # The client cancels the task as it sets `cancelled`: not reached unless it
                # stops doing so, and then the work must still not return its result.
                run.cancelled = True
                raise RuntimeError("the client cancelled the work before it was done")
        except asyncio.CancelledError:
            # The client cancels the work's task when the lease is lost (nothing else does).
            run.cancelled = True
            raise
        run.cancelled = lease.cancelled.is_set()
        if run.work.get("refuse_at_end"):
            await asyncio.to_thread(proxy.refuse)
        return run.end()

    return work


async def set_within(event: asyncio.Event, seconds: float) -> bool:
    """Waits at most `seconds` for `event`; whether it is set."""
    # Not wait_for, which (before 3.12) swallows a cancellation that comes as the event is set,
    # and the client sets `cancelled` just before it cancels the work's task.
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiting}, timeout=seconds)
    finally:
        waiting.cancel()
    return event.is_set()


def is_milliseconds(value: object) -> bool:
    """A duration of the vectors: a number of milliseconds, not negative (and not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


RunFuture = asyncio.Future[Outcome[Any]]


class Runs(Protocol):
    """Starts runs with one client, of one flavour."""

    def start(self, run: Run, key: str, options: RunOnceOptions) -> RunFuture: ...

    async def close(self) -> None: ...


class SyncRuns:
    def __init__(self, target: str, retry: RetryPolicy | None, proxy: FaultProxy) -> None:
        self._client = IdempotencyClient(target, retry=retry)
        self._proxy = proxy
        self._threads = ThreadPoolExecutor(8, thread_name_prefix="scenario-run")

    def start(self, run: Run, key: str, options: RunOnceOptions) -> RunFuture:
        call = functools.partial(
            self._client.run_once, NAMESPACE, key, sync_work(run, self._proxy), **options
        )
        return asyncio.get_running_loop().run_in_executor(self._threads, call)

    async def close(self) -> None:
        # Closing the channel ends the calls still under way, so the threads end too.
        self._client.close()
        await asyncio.to_thread(self._threads.shutdown)


class AsyncRuns:
    def __init__(self, target: str, retry: RetryPolicy | None, proxy: FaultProxy) -> None:
        self._client = AsyncIdempotencyClient(target, retry=retry)
        self._proxy = proxy
        self._tasks: list[RunFuture] = []

    def start(self, run: Run, key: str, options: RunOnceOptions) -> RunFuture:
        task = asyncio.ensure_future(
            self._client.run_once(NAMESPACE, key, async_work(run, self._proxy), **options)
        )
        self._tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.close()


FLAVOURS: dict[str, Callable[[str, RetryPolicy | None, FaultProxy], Runs]] = {
    "sync": SyncRuns,
    "asyncio": AsyncRuns,
}


def same_json(value: object, expected: object) -> bool:
    """Equal as JSON: unlike `==`, `true` is not `1`, nor `1` `1.0`."""
    return json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)


async def outcome_of(future: RunFuture) -> Outcome[Any] | BaseException:
    """How a run ended: its outcome, or the error run_once raised."""
    done, _ = await asyncio.wait({future}, timeout=RUN_LIMIT)
    if not done:
        pytest.fail(f"a run did not end within {RUN_LIMIT}s")
    if future.cancelled():
        pytest.fail("a run was cancelled")
    error = future.exception()
    return error if error is not None else future.result()


def described(error: BaseException) -> str:
    cause = error.__cause__
    return f"{error!r}" + (f" (caused by {cause!r})" if cause is not None else "")


class Scenario:
    """One scenario of the vectors, played by one flavour of client."""

    def __init__(self, vector: dict[str, Any], flavour: str, upstream: str, folder: Path) -> None:
        self._vector = vector
        self._flavour = flavour
        self._upstream = upstream
        self._folder = folder
        # Keys unique to this run of the suite: every scenario uses "k" in the one namespace.
        self._prefix = f"py-{uuid.uuid4().hex[:12]}"
        self._runs: dict[str, tuple[Run, RunFuture]] = {}
        self._joined: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self._prefix}:{name}"

    def retry(self) -> RetryPolicy | None:
        client = self._vector.get("client", {})
        unknown = set(client) - {"retry_budget_ms"}
        assert not unknown, f"client options this runner does not know: {sorted(unknown)}"
        if "retry_budget_ms" not in client:
            return None
        return RetryPolicy(total=client["retry_budget_ms"] / 1000)

    async def play(self) -> None:
        async with contextlib.AsyncExitStack() as cleanup:
            proxy = FaultProxy(self._upstream, self._folder)
            cleanup.push_async_callback(asyncio.to_thread, proxy.close)
            raw = RawService(self._upstream)
            cleanup.callback(raw.close)
            # The client has no bare TryStart (only run_once): a `claim` goes through the proxy
            # on a channel of its own, counted in the proxy's call log like the client's calls.
            raw_through_proxy = RawService(proxy.address)
            cleanup.callback(raw_through_proxy.close)
            runs = FLAVOURS[self._flavour](proxy.address, self.retry(), proxy)
            cleanup.push_async_callback(runs.close)
            # After a failed step, no work may wait for its gate before the client closes.
            cleanup.callback(self._open_every_gate)
            for number, step in enumerate(self._vector["steps"], 1):
                try:
                    await self._step(step, runs, proxy, raw, raw_through_proxy)
                except (AssertionError, pytest.fail.Exception) as failed:
                    raise AssertionError(f"step {number} {json.dumps(step)}: {failed}") from failed
            not_joined = sorted(set(self._runs) - self._joined)
            assert not not_joined, f"runs started and never joined: {not_joined}"

    def _open_every_gate(self) -> None:
        for run, _ in self._runs.values():
            run.gate.set()

    async def _step(
        self,
        step: dict[str, Any],
        runs: Runs,
        proxy: FaultProxy,
        raw: RawService,
        raw_through_proxy: RawService,
    ) -> None:
        kinds = set(step) - {"expect"}
        assert len(kinds) == 1, f"a step of one kind: {step}"
        assert "expect" not in step or kinds <= {"run", "join"}, f"nothing to expect: {step}"
        if "run" in step:
            await self._run(step, runs)
        elif "await_started" in step:
            run, _ = self._runs[step["await_started"]]
            if not await asyncio.to_thread(run.started.wait, LIMIT):
                pytest.fail(f"the work of {step['await_started']} did not start within {LIMIT}s")
        elif "open_gate" in step:
            self._runs[step["open_gate"]][0].gate.set()
        elif "join" in step:
            name = step["join"]
            run, future = self._runs[name]
            self._joined.add(name)
            self._check(run, await outcome_of(future), step["expect"])
        elif "claim" in step:
            await self._claim(raw_through_proxy, **step["claim"])
        elif "pause_ms" in step:
            assert is_milliseconds(step["pause_ms"]), step
            # The scenario's own timing (a holder that keeps the key this long), not a wait for
            # something the runner could watch.
            await asyncio.sleep(step["pause_ms"] / 1000)
        elif "fault" in step:
            await asyncio.to_thread(proxy.post, "/faults", step["fault"])
        elif "refuse" in step or "restore" in step or "reset" in step:
            (route,) = step
            assert step[route] is True, step
            await asyncio.to_thread(proxy.post, f"/{route}")
        elif "await_calls" in step:
            await self._await_calls(proxy, **step["await_calls"])
        elif "expect_calls" in step:
            await self._expect_calls(proxy, **step["expect_calls"])
        elif "expect_key" in step:
            await self._expect_key(raw, **step["expect_key"])
        else:
            pytest.fail(f"a step this runner does not know: {step}")

    async def _run(self, step: dict[str, Any], runs: Runs) -> None:
        spec = dict(step["run"])
        name: str | None = spec.pop("as", None)
        assert (name is None) == ("expect" in step), "a run has `as` or `expect`, not both"
        assert set(step) <= {"run", "expect"}, step
        unknown = set(spec) - {"key", "request", "wait_ms", "lease_ttl_ms", "work"}
        assert not unknown, f"run fields this runner does not know: {sorted(unknown)}"
        options: RunOnceOptions = {"request": spec["request"]}
        if "wait_ms" in spec:
            options["wait"] = spec["wait_ms"] / 1000
        if "lease_ttl_ms" in spec:
            options["lease_ttl"] = spec["lease_ttl_ms"] / 1000
        run = Run(spec["work"])
        future = runs.start(run, self.key(spec["key"]), options)
        if name is None:
            self._check(run, await outcome_of(future), step["expect"])
        else:
            assert name not in self._runs, f"two runs named {name}"
            self._runs[name] = (run, future)

    def _check(
        self, run: Run, outcome: Outcome[Any] | BaseException, expect: dict[str, Any]
    ) -> None:
        unknown = set(expect) - {
            "result",
            "error",
            "carried_result",
            "work_ran",
            "work_cancelled",
            "attempt",
            "min_elapsed_ms",
        }
        assert not unknown, f"expectations this runner does not know: {sorted(unknown)}"
        assert ("result" in expect) != ("error" in expect), "expect a result or an error"
        if "result" in expect:
            got = described(outcome) if isinstance(outcome, BaseException) else repr(outcome)
            assert isinstance(outcome, Outcome), f"expected the result {expect['result']!r}: {got}"
            assert same_json(outcome.value, expect["result"]), (
                f"the result {outcome.value!r}, expected {expect['result']!r}"
            )
        else:
            assert isinstance(outcome, BaseException), (
                f"expected an error ({expect['error']}), got {outcome!r}"
            )
            self._check_error(run, outcome, expect["error"])
        if "carried_result" in expect:
            assert isinstance(outcome, ResultNotStored), f"expected ResultNotStored: {outcome!r}"
            assert same_json(outcome.result, expect["carried_result"]), (
                f"the carried result {outcome.result!r}, expected {expect['carried_result']!r}"
            )
        if "work_ran" in expect:
            assert run.ran is expect["work_ran"], f"work ran: {run.ran}"
        if "work_cancelled" in expect:
            assert run.cancelled is expect["work_cancelled"], f"work cancelled: {run.cancelled}"
        if "attempt" in expect:
            assert run.attempt == expect["attempt"], f"the work saw attempt {run.attempt}"
        if "min_elapsed_ms" in expect:
            elapsed_ms = (time.monotonic() - run.began) * 1000
            assert elapsed_ms >= expect["min_elapsed_ms"], (
                f"run_once took {elapsed_ms:.0f} ms, under {expect['min_elapsed_ms']} ms"
            )

    @staticmethod
    def _check_error(run: Run, error: BaseException, kind: str) -> None:
        if kind == "work_failed":
            assert run.failure is not None, "a work_failed error from a work that did not fail"
            assert error is run.failure, (
                f"expected the work's own error {run.failure!r} unchanged: {described(error)}"
            )
        elif kind == "other":
            message = f"expected an error of the client's of no named kind: {described(error)}"
            assert isinstance(error, IdempotencyError), message
            assert not isinstance(error, tuple(ERROR_KINDS.values())), message
        elif kind in ERROR_KINDS:
            assert isinstance(error, ERROR_KINDS[kind]), (
                f"expected {ERROR_KINDS[kind].__name__} ({kind}): {described(error)}"
            )
        else:
            pytest.fail(f"an error kind this runner does not know: {kind}")

    async def _claim(
        self, through_proxy: RawService, key: str, request: object, lease_ttl_ms: float
    ) -> None:
        """A holder that claims the key and then dies: one TryStart, no heartbeat, no Release."""
        assert is_milliseconds(lease_ttl_ms), f"lease_ttl_ms is not a duration: {lease_ttl_ms!r}"
        answer = await asyncio.to_thread(
            through_proxy.try_start,
            NAMESPACE,
            self.key(key),
            fingerprint_of(request),
            attempt_id=f"crashed-holder-{uuid.uuid4().hex}",
            lease_ttl=lease_ttl_ms / 1000,
        )
        assert answer.WhichOneof("outcome") == "started", f"the claim was answered {answer}"

    async def _await_calls(self, proxy: FaultProxy, method: str, count: int) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + LIMIT
        while True:
            calls = (await asyncio.to_thread(proxy.calls)).get(method, [])
            if len(calls) >= count:
                return
            if loop.time() > give_up_at:
                pytest.fail(f"{method} was called {len(calls)} times, not {count}, in {LIMIT}s")
            await asyncio.sleep(POLL)

    async def _expect_calls(
        self, proxy: FaultProxy, method: str, count: int, min_gap_ms: float | None = None
    ) -> None:
        calls = (await asyncio.to_thread(proxy.calls)).get(method, [])
        assert len(calls) == count, f"{method} was called {len(calls)} times: {calls}"
        if min_gap_ms is not None:
            assert calls[1] - calls[0] >= min_gap_ms, (
                f"the second {method} came {calls[1] - calls[0]:.1f} ms after the first"
            )

    async def _expect_key(
        self, raw: RawService, key: str, state: str, attempt: int | None = None
    ) -> None:
        found = await asyncio.to_thread(raw.lookup, NAMESPACE, self.key(key))
        assert found.WhichOneof("state") == state, f"the key is {found}"
        if attempt is not None:
            assert found.in_progress.attempt == attempt, f"the key is {found}"


@pytest.fixture(scope="module")
def scenario_coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    folder = tmp_path_factory.mktemp("scenarios")
    coordinator = Coordinator(["--sqlite-path", str(folder / "coordinator.db")], [], folder)
    yield coordinator
    coordinator.kill()


def test_scenario_names_are_unique() -> None:
    names = [scenario["name"] for scenario in SCENARIOS]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("flavour", list(FLAVOURS))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[scenario["name"] for scenario in SCENARIOS])
def test_scenario(
    scenario: dict[str, Any], flavour: str, scenario_coordinator: Coordinator, tmp_path: Path
) -> None:
    asyncio.run(Scenario(scenario, flavour, scenario_coordinator.address, tmp_path).play())
