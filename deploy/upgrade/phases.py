"""What the callers saw in each phase of the upgrade, from the failover suite's records
(deploy/ha/load.py's `Recorder`): calls, latency, failed tries (each one retried by the client),
what `run_once` raised; the replacements' and the migration's timings; what the suite asserts of
them; and the tables it prints.

A "call" here is one try of one RPC as the client sent it (TryStart, ExtendLease, Complete,
Release), timed from its sending to its answer, on a key that no other caller asked at the same
moment: a waiter's TryStart is held by the service until the other caller's Complete, by
design, and would measure the other caller's work, not the service.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster import SuiteFailure
from load import Execution, Recorder, Try

LATENCY_FACTOR = 1.5
LATENCY_SLACK = 0.020
"""The lock-wait check's tolerance: the p99 of calls while the migration waits for its lock may
exceed the steady p99 by 50 %, or by 20 ms when that is more. Two windows of the same steady
load on this 2-core machine (shared with builds) differ at p99 by up to ~1.8x, some 25 ms, which
the 20 ms absorbs at a p99 of 15-25 ms; a call that queues behind an ALTER TABLE waiting without
a lock timeout waits the service's whole second (README, "Why the latency check fails"), which
neither allowance hides."""


@dataclass
class Phase:
    name: str
    start: float
    end: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Replacement:
    """One replica replaced: SIGTERM to the old process, its exit, the new one SERVING, and the
    load's calls reaching it (the replica's own count of answered calls grew)."""

    slot: str
    old: str
    new: str
    signalled: float
    exited: float = 0.0
    exit_status: int | None = None
    serving: float = 0.0
    routed: float = 0.0

    @property
    def drain(self) -> float:
        return self.exited - self.signalled

    @property
    def start(self) -> float:
        return self.serving - self.exited

    @property
    def reached(self) -> float:
        return self.routed - self.serving

    @property
    def total(self) -> float:
        return self.routed - self.signalled


@dataclass
class LockWait:
    """The migration run while another transaction holds a lock on idempotency_keys."""

    version: int
    """The first migration the previous release does not have (the one that must wait)."""
    held: float = 0.0
    migrate_started: float = 0.0
    committed: float = 0.0
    migrate_exited: float | None = None
    """When migrate exited (None: it did not, within its bound)."""
    exit_status: int | None = None
    running_at_commit: bool = False
    applied_at_commit: bool = True
    applied_after: bool = False
    samples: int = 0
    """pg_stat_activity samples taken while the transaction was held."""
    waiting_samples: int = 0
    """Of them, those that saw the migration's ALTER TABLE waiting for a lock."""
    logged: list[str] = field(default_factory=list)
    """What migrate printed (its waits among it)."""


@dataclass(frozen=True)
class PhaseFigures:
    phase: Phase
    calls: int
    p50: float | None
    p99: float | None
    slowest: float | None
    failed_tries: collections.Counter[str]
    acks: int
    replays: int
    raised: collections.Counter[str]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0-100) of `values`; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def calls(recorder: Recorder, since: float, until: float, twins: set[str]) -> list[Try]:
    """The tries sent in [since, until) on keys no other caller asked at the same moment."""
    return [t for t in recorder.tries if since <= t.started < until and t.key not in twins]


def phase_figures(recorder: Recorder, phase: Phase, twins: set[str]) -> PhaseFigures:
    tries = calls(recorder, phase.start, phase.end, twins)
    latencies = [t.ended - t.started for t in tries]
    # Failed tries on every key, waiters' included: each one was retried by the client.
    failed = collections.Counter(
        f"{t.method} {t.label}"
        for t in recorder.tries
        if phase.start <= t.started < phase.end and t.code != "OK"
    )
    acks = [a for a in recorder.acks if phase.start <= a.at < phase.end]
    raised = collections.Counter(
        f.error for f in recorder.failures if phase.start <= f.at < phase.end
    )
    return PhaseFigures(
        phase=phase,
        calls=len(tries),
        p50=percentile(latencies, 50),
        p99=percentile(latencies, 99),
        slowest=max(latencies, default=None),
        failed_tries=failed,
        acks=len(acks),
        replays=sum(1 for a in acks if a.replayed),
        raised=raised,
    )


def latency_bound(steady_p99: float) -> float:
    return max(steady_p99 * LATENCY_FACTOR, steady_p99 + LATENCY_SLACK)


def lock_wait_problems(
    wait: LockWait, steady: PhaseFigures, waiting: PhaseFigures, within: float
) -> list[str]:
    """What the suite asserts of the lock-wait check; each problem is one line.

    Why the latency part would fail without a lock_timeout on the migration's session: its
    ALTER TABLE would sit in the lock queue for the whole 10 s the transaction is held, and every
    statement on idempotency_keys queues behind a waiting ACCESS EXCLUSIVE request. The service
    gives up on such a statement after its own 20 ms lock wait and runs the call again alone, on a
    quarter of its pool, for up to a fifth of the operation timeout (1 s), then answers
    UNAVAILABLE; the client retries. So for 10 s every call would take its 1 s (or fail and be
    retried): the p99 of the window would be ~1 s against a steady p99 of tens of ms."""
    found = []
    if not wait.running_at_commit:
        exited = (
            f" {wait.migrate_exited - wait.migrate_started:.2f} s after it started"
            if wait.migrate_exited is not None
            else ""
        )
        found.append(
            f"lock-wait: migrate exited {wait.exit_status}{exited}, before the transaction "
            "holding idempotency_keys ended: it must wait for its lock until then"
        )
    if wait.applied_at_commit:
        found.append(
            f"lock-wait: migration {wait.version} was applied before the transaction holding "
            "idempotency_keys ended"
        )
    if wait.exit_status != 0:
        status = "did not exit" if wait.exit_status is None else f"exited {wait.exit_status}"
        found.append(f"lock-wait: migrate {status} (bound: {within:.0f} s after the transaction)")
    if not wait.applied_after:
        found.append(f"lock-wait: migration {wait.version} is not applied after migrate ended")
    if steady.p99 is None or waiting.p99 is None:
        found.append("lock-wait: no calls measured in the steady or the waiting window")
    elif waiting.p99 > latency_bound(steady.p99):
        found.append(
            f"lock-wait: calls' p99 while the migration waited was {ms(waiting.p99)} (slowest "
            f"{ms(waiting.slowest)}), over the bound {ms(latency_bound(steady.p99))} "
            f"(steady p99 {ms(steady.p99)} x {LATENCY_FACTOR} or + {ms(LATENCY_SLACK)})"
        )
    return found


def tokens_across_keys(recorder: Recorder) -> list[str]:
    """Tokens grow with time across keys too, whichever replica of whichever release granted
    them (one sequence): a claim sent after another claim's work had started carries a larger
    token. A claim's sending is taken as the first TryStart of its key since the key's previous
    run (or ever): earlier than the try that got the token (a retry, a waiter's take-over), which
    only makes the check ask less, never wrongly."""
    sends: dict[str, list[float]] = collections.defaultdict(list)
    for t in recorder.tries:
        if t.method == "TryStart":
            sends[t.key].append(t.started)
    runs: dict[str, list[Execution]] = collections.defaultdict(list)
    for e in recorder.executions:
        runs[e.key].append(e)
    claims: list[tuple[float, int, str]] = []
    for key, executions in runs.items():
        times = sorted(sends[key])
        previous = -math.inf
        for e in sorted(executions, key=lambda e: e.started):
            first = bisect.bisect_right(times, previous)
            if first < len(times) and times[first] <= e.started:
                claims.append((times[first], e.token, key))
            previous = e.started
    started = sorted((e.started, e.token, e.key) for e in recorder.executions)
    problems = []
    highest, holder, index = -1, "", 0
    for sent, token, key in sorted(claims):
        while index < len(started) and started[index][0] < sent:
            if started[index][1] > highest:
                highest, holder = started[index][1], started[index][2]
            index += 1
        if token <= highest:
            problems.append(f"{key}: token {token}, claimed after {holder}'s {highest} was in use")
    return problems


def check_the_token_check() -> None:
    """The check across keys has teeth: a claim sent after another key's run started, with a
    smaller token, is found; claims in order are not."""
    recorder = Recorder()
    recorder.tries += [_try(1.0, 0.01, "a"), _try(3.0, 0.01, "b"), _try(5.0, 0.01, "c")]
    recorder.executions += [
        Execution("a", 10, 2.0, "x"),
        Execution("b", 20, 4.0, "x"),
        Execution("c", 15, 6.0, "x"),  # sent at 5.0, after b's run (token 20) started at 4.0
    ]
    found = tokens_across_keys(recorder)
    recorder.executions[2] = Execution("c", 25, 6.0, "x")
    if len(found) != 1 or not found[0].startswith("c: token 15") or tokens_across_keys(recorder):
        raise SuiteFailure(f"the token check across keys does not find what was planted: {found}")


def check_the_latency_check() -> None:
    """The latency comparison has teeth: a window where a few calls in a hundred stall behind a
    lock is caught, and one like the steady window is not (run before the scenario, so that a
    change that blunts it cannot pass silently)."""
    recorder = Recorder()
    for i in range(1000):  # steady: 5 ms, a few at 12 ms
        recorder.tries.append(_try(i * 0.01, 0.012 if i % 50 == 0 else 0.005))
    for i in range(1000):  # waiting: the same, but 3 % of the calls stall 300 ms
        recorder.tries.append(_try(20 + i * 0.01, 0.3 if i % 33 == 0 else 0.005))
    for i in range(1000):  # a second steady window
        recorder.tries.append(_try(40 + i * 0.01, 0.012 if i % 50 == 0 else 0.006))
    steady = phase_figures(recorder, Phase("steady", 0, 10), set())
    stalled = phase_figures(recorder, Phase("stalled", 20, 30), set())
    calm = phase_figures(recorder, Phase("calm", 40, 50), set())
    wait = LockWait(1, running_at_commit=True, applied_at_commit=False, exit_status=0)
    wait.applied_after = True
    caught = lock_wait_problems(wait, steady, stalled, 60)
    passed = lock_wait_problems(wait, steady, calm, 60)
    early = LockWait(1, running_at_commit=False, applied_at_commit=True, exit_status=0)
    early.applied_after = True
    if len(caught) != 1 or passed or len(lock_wait_problems(early, steady, calm, 60)) != 2:
        raise SuiteFailure(
            f"the lock-wait check does not find what was planted: {caught}, {passed}"
        )


def _try(started: float, seconds: float, key: str = "k") -> Try:
    return Try("x", "TryStart", started, started + seconds, "OK", None, None, key)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _errors(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{label} x{n}" for label, n in sorted(counter.items())) or "none"


def table(figures: Sequence[PhaseFigures]) -> str:
    """Per phase, as a markdown table that can be pasted into the README."""
    rows = [
        "| phase | seconds | calls | p50 | p99 | slowest | lifecycles acked (replays) | "
        "failed tries, retried | raised to callers |",
        "|" + " --- |" * 9,
    ]
    for f in figures:
        p = f.phase
        rows.append(
            f"| {p.name} | {p.end - p.start:.1f} | {f.calls} | {ms(f.p50)} | {ms(f.p99)} | "
            f"{ms(f.slowest)} | {f.acks} ({f.replays}) | {_errors(f.failed_tries)} | "
            f"{_errors(f.raised)} |"
        )
    return "\n".join(rows)


def replacements_table(replacements: Sequence[Replacement]) -> str:
    rows = [
        "| replica | from -> to | drain (SIGTERM -> exit) | start (-> SERVING) | "
        "SERVING -> load's calls reach it | total | exit status |",
        "|" + " --- |" * 7,
    ]
    for r in replacements:
        rows.append(
            f"| {r.slot} | {r.old} -> {r.new} | {r.drain:.2f} s | {r.start:.2f} s | "
            f"{r.reached:.2f} s | {r.total:.2f} s | {r.exit_status} |"
        )
    return "\n".join(rows)


def lock_wait_detail(wait: LockWait, steady: PhaseFigures, waiting: PhaseFigures) -> str:
    exited = (
        "did not exit"
        if wait.migrate_exited is None
        else f"exited {wait.migrate_exited - wait.committed:+.2f} s after the commit"
    )
    lines = [
        f"== lock-wait: migration {wait.version} while a transaction holds idempotency_keys",
        f"   transaction held {wait.committed - wait.held:.1f} s; migrate started "
        f"+{wait.migrate_started - wait.held:.2f} s after it, {exited} with status "
        f"{wait.exit_status}",
        f"   at the commit: migrate running {wait.running_at_commit}, migration applied "
        f"{wait.applied_at_commit}; applied afterwards {wait.applied_after}",
        f"   the ALTER TABLE seen waiting for its lock in {wait.waiting_samples} of "
        f"{wait.samples} samples of pg_stat_activity",
        f"   calls: steady p99 {ms(steady.p99)} ({steady.calls} calls), while waiting p99 "
        f"{ms(waiting.p99)} ({waiting.calls} calls, slowest {ms(waiting.slowest)}, "
        f"{sum(waiting.failed_tries.values())} failed tries); bound "
        f"{ms(latency_bound(steady.p99)) if steady.p99 is not None else '-'}",
    ]
    if wait.logged:
        lines.append("   migrate said:")
        lines += [f"     {line}" for line in wait.logged[-20:]]
    return "\n".join(lines)
