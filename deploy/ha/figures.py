"""What each fault did to the callers, from the records: acknowledged results lost, work run
twice, token order, how long calls failed, the errors by code, the health transitions; what the
suite asserts of them; and the tables it prints."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cluster import SuiteFailure
from load import Execution, Recorder
from probes import Attempt, CoordinatorProbe, HealthWatch, NodeWriteProbe, Timeline

WRITES_TO_CALLS_LIMIT = 2.0
"""Issue 38, item 5: calls succeed again within 2 s of the new primary accepting writes."""
HEALTH_INTERVAL = 2.0
"""The coordinators' --health-check-interval (its default)."""
HEALTH_MARGIN = 1.0
"""What health may take beyond one interval to say SERVING once writes commit again: the check
that sees the writes is the one after the interval, plus its own write's commit and the
clock's reading (a few ms each), plus this machine's scheduling under load (two cores shared by
three PostgreSQL servers, Patroni, the coordinators and the load)."""


@dataclass
class FaultRun:
    """One fault as it happened: the instants (time.monotonic) the suite saw."""

    round: str
    fault: str
    label: str
    synchronous: bool
    expect_failover: bool
    old_primary: str
    t0: float
    resolved: float = 0.0
    """The suite saw the new primary take writes and calls succeed through every coordinator."""
    healed: float | None = None
    """The fault was undone (a node started again, a partition healed)."""
    end: float = 0.0
    """The cluster is healthy again: both standbys streaming, one synchronous."""
    new_primary: str = ""
    verified: int = 0
    lost: dict[str, str] = field(default_factory=dict)
    """Acknowledged keys that did not replay byte-identical, and what was found instead."""
    measured_only: bool = False
    """The asynchronous mode: lost, twice and tokens printed, not asserted."""
    notes: list[str] = field(default_factory=list)


@dataclass
class CoordinatorFigures:
    name: str
    first_failure: float | None
    """Seconds after the fault when the first probe call failed (None: none failed)."""
    recovered: float | None
    """Seconds after the fault when probe calls succeeded again for good."""
    writes_to_calls: float | None
    failures_after_resolution: int
    load_recovered: float | None
    """The same for the load's own tries, until the cluster is healthy again (these include the
    client's pauses between retries, and a later failure, while the node rejoins, counts)."""
    health: list[tuple[float, str]]
    health_after_writes: float | None
    """Seconds from writes accepted to health SERVING for good (None: it never left SERVING)."""
    health_at_end: str
    errors: collections.Counter[str]
    caller_errors: collections.Counter[str]


@dataclass
class FaultFigures:
    run: FaultRun
    writes_at: float | None
    """Seconds after the fault when the final primary committed writes again."""
    acked: int
    executions: int
    twice: list[str]
    token_problems: list[str]
    coordinators: list[CoordinatorFigures]


def _relative(instant: float | None, t0: float) -> float | None:
    return None if instant is None else instant - t0


def load_recovered(
    recorder: Recorder, coordinator: str, since: float, until: float
) -> float | None:
    """When the load's tries through `coordinator` succeeded again after their last failure in
    the window (as `Timeline.recovered_at`)."""
    timeline = Timeline(coordinator)
    for t in recorder.tries:
        if t.coordinator == coordinator:
            timeline.attempts.append(Attempt(t.started, t.ended, t.code == "OK", t.label))
    return timeline.recovered_at(since, until)


def violations(
    recorder: Recorder, probe_tokens: Iterable[tuple[int, str, float]]
) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """Work run twice, and token problems, each with the instant it happened.

    Run twice: a run of the work that started after a result for its key had been
    acknowledged. Tokens: the runs of one key, in the order they started, carry increasing
    tokens; no token is given to two keys (the probes' claims included)."""
    acknowledged = recorder.acknowledged()
    twice = [
        (
            e.started,
            f"{e.key}: work started {e.started - acknowledged[e.key]:.3f} s after its result "
            "was acknowledged",
        )
        for e in recorder.executions
        if e.key in acknowledged and e.started > acknowledged[e.key]
    ]
    tokens: list[tuple[float, str]] = []
    by_key: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    for e in recorder.executions:
        by_key[e.key].append((e.started, e.token))
    for key, runs in by_key.items():
        runs.sort()
        for (_, before), (started, after) in itertools.pairwise(runs):
            if after <= before:
                tokens.append((started, f"{key}: token {after} claimed after token {before}"))
    owner: dict[int, tuple[str, float]] = {}
    claims = [(e.started, e.token, e.key) for e in recorder.executions]
    claims += [(at, token, key) for token, key, at in probe_tokens]
    for at, token, key in sorted(claims):
        if token in owner and owner[token][0] != key:
            tokens.append((at, f"token {token} given to {owner[token][0]} and to {key}"))
        owner.setdefault(token, (key, at))
    return twice, tokens


def check_the_checks() -> None:
    """The checks have teeth: planted records of each violation are found, and clean ones are
    not (run before the rounds, so that a check broken by a change cannot pass silently)."""
    clean = Recorder()
    clean.executions += [Execution("a", 1, 1.0, "x"), Execution("a", 3, 2.0, "x")]
    clean.completed["a"] = 2.5
    planted = Recorder()
    planted.executions += [
        Execution("twice", 5, 1.0, "x"),
        Execution("twice", 9, 11.0, "x"),  # started after the acknowledgement at 10.0
        Execution("order", 7, 2.0, "x"),
        Execution("order", 6, 3.0, "x"),  # a later claim with a smaller token
    ]
    planted.completed["twice"] = 10.0
    twice, tokens = violations(planted, [(5, "ha-probe/shared", 4.0)])  # token 5 twice
    found = [text for _, text in twice + tokens]
    expected = ["twice: work started", "order: token 6", "token 5 given to twice and to"]
    missing = [e for e in expected if not any(text.startswith(e) for text in found)]
    if missing or len(found) != len(expected) or any(violations(clean, [])):
        raise SuiteFailure(f"the checks do not find what was planted: found {found}")
    timeline = Timeline("t")
    timeline.attempts += [
        Attempt(0.0, 0.1, True, ""),
        Attempt(1.0, 3.0, False, "stuck"),  # started before the recovery, failed after it
        Attempt(2.0, 2.1, False, "refused"),
        Attempt(2.5, 2.6, True, ""),
    ]
    if timeline.recovered_at(0.0, 10.0) != 2.6 or timeline.recovered_at(2.7, 10.0) != 2.7:
        raise SuiteFailure("Timeline.recovered_at does not find the recovery it was given")


def figures(
    run: FaultRun,
    recorder: Recorder,
    nodes: dict[str, NodeWriteProbe],
    probes: Sequence[CoordinatorProbe],
    watches: dict[str, HealthWatch],
    twice: Sequence[str],
    tokens: Sequence[str],
) -> FaultFigures:
    """The figures of one fault; `twice` and `tokens` are the violations that belong to it."""
    t0, end = run.t0, run.end
    writes = nodes[run.new_primary].timeline.recovered_at(t0, run.resolved)
    coordinators = []
    for probe in probes:
        timeline = probe.timeline
        recovered = timeline.recovered_at(t0, run.resolved)
        first = timeline.first_failure(t0, run.resolved)
        watch = watches[probe.name]
        health = [(tr.at - t0, tr.status) for tr in watch.transitions if t0 <= tr.at <= end]
        left_serving = watch.status_at(t0) != "SERVING" or any(s != "SERVING" for _, s in health)
        health_after = None
        if left_serving and writes is not None:
            back = [at for at, status in health if status == "SERVING"]
            health_after = (t0 + back[-1] - writes) if back else float("inf")
        errors = collections.Counter(
            f"{t.method} {t.label}"
            for t in recorder.tries
            if t.coordinator == probe.name and t0 <= t.started <= end and t.code != "OK"
        )
        caller_errors = collections.Counter(
            f.error for f in recorder.failures if f.coordinator == probe.name and t0 <= f.at <= end
        )
        coordinators.append(
            CoordinatorFigures(
                name=probe.name,
                first_failure=_relative(first.started if first else None, t0),
                recovered=_relative(recovered, t0) if first else None,
                writes_to_calls=(recovered - writes)
                if (first and recovered is not None and writes is not None)
                else None,
                failures_after_resolution=sum(
                    1 for a in timeline.within(run.resolved, end) if not a.ok
                ),
                load_recovered=_relative(load_recovered(recorder, probe.name, t0, end), t0),
                health=health,
                health_after_writes=health_after,
                health_at_end=watch.status_at(end),
                errors=errors,
                caller_errors=caller_errors,
            )
        )
    return FaultFigures(
        run=run,
        writes_at=_relative(writes, t0),
        acked=sum(1 for a in recorder.acks if t0 <= a.at <= end),
        executions=sum(1 for e in recorder.executions if t0 <= e.started <= end),
        twice=list(twice),
        token_problems=list(tokens),
        coordinators=coordinators,
    )


def verdict(problems: Sequence[str], held: str) -> int:
    """The suite's last words and exit status: the assertions that failed (1), or, when none
    did, `held`, what every assertion showed (0)."""
    if problems:
        print(f"FAILED: {len(problems)} assertions", flush=True)
        for problem in problems:
            print(f"  - {problem}", flush=True)
        return 1
    print(held, flush=True)
    return 0


def problems(f: FaultFigures) -> list[str]:
    """What the suite asserts of a fault; each problem is one line."""
    run = f.run
    where = f"{run.round} / {run.label}"
    found = []
    if not run.measured_only:
        if run.lost:
            sample = "; ".join(f"{k}: {v}" for k, v in list(run.lost.items())[:5])
            found.append(f"{where}: {len(run.lost)} acknowledged results lost ({sample})")
        if f.twice:
            found.append(f"{where}: work run twice {len(f.twice)} times ({'; '.join(f.twice[:5])})")
        if f.token_problems:
            found.append(f"{where}: token order broken ({'; '.join(f.token_problems[:5])})")
    if run.expect_failover and run.new_primary == run.old_primary:
        found.append(f"{where}: no failover happened ({run.old_primary} is still the primary)")
    if not run.expect_failover and run.new_primary != run.old_primary:
        found.append(f"{where}: a failover happened ({run.old_primary} -> {run.new_primary})")
    if f.writes_at is None:
        found.append(f"{where}: the new primary {run.new_primary} never committed a write")
    for c in f.coordinators:
        if c.first_failure is not None and c.recovered is None:
            found.append(f"{where}: calls through {c.name} did not succeed again")
        if c.writes_to_calls is not None and c.writes_to_calls > WRITES_TO_CALLS_LIMIT:
            found.append(
                f"{where}: calls through {c.name} succeeded again {c.writes_to_calls:.2f} s after "
                f"the new primary accepted writes (limit {WRITES_TO_CALLS_LIMIT} s)"
            )
        bound = HEALTH_INTERVAL + HEALTH_MARGIN
        if c.health_after_writes is not None and c.health_after_writes > bound:
            found.append(
                f"{where}: {c.name}'s health was SERVING again {c.health_after_writes:.2f} s after "
                f"writes were accepted (bound: one interval, {HEALTH_INTERVAL} s, "
                f"+ {HEALTH_MARGIN} s)"
            )
        if c.health_at_end != "SERVING":
            found.append(
                f"{where}: {c.name}'s health is {c.health_at_end} once the cluster is healthy"
            )
    return found


def _seconds(value: float | None, none: str = "-") -> str:
    if value is None:
        return none
    return "never" if value == float("inf") else f"{value:.2f}"


def detail(f: FaultFigures) -> str:
    """A fault's figures, in full, as the suite prints them after it."""
    run = f.run
    lines = [
        f"== {run.round} / {run.label}: primary {run.old_primary} -> {run.new_primary}",
        f"   writes accepted on {run.new_primary} at +{_seconds(f.writes_at)} s; resolved at "
        f"+{run.resolved - run.t0:.2f} s; "
        + (f"healed at +{run.healed - run.t0:.2f} s; " if run.healed is not None else "")
        + f"cluster healthy at +{run.end - run.t0:.2f} s",
        f"   lifecycles acknowledged {f.acked}, work runs {f.executions}; lost {len(run.lost)} "
        f"(of {run.verified} verified), run twice {len(f.twice)}, token problems "
        f"{len(f.token_problems)}" + ("  [measured, not asserted]" if run.measured_only else ""),
    ]
    for c in f.coordinators:
        lines.append(
            f"   {c.name}: calls failing from +{_seconds(c.first_failure)} s, succeeding again at "
            f"+{_seconds(c.recovered)} s ({_seconds(c.writes_to_calls)} s after writes); the "
            f"load's calls at +{_seconds(c.load_recovered)} s; probe failures after resolution: "
            f"{c.failures_after_resolution}"
        )
        health = ", ".join(f"+{at:.2f} {status}" for at, status in c.health) or "no change"
        lines.append(
            f"      health: {health} (SERVING {_seconds(c.health_after_writes, 'throughout')}"
            + (" s after writes)" if c.health_after_writes is not None else ")")
        )
        errors = ", ".join(f"{label} x{n}" for label, n in sorted(c.errors.items())) or "none"
        lines.append(f"      errors seen by the client (each try): {errors}")
        callers = ", ".join(f"{e} x{n}" for e, n in sorted(c.caller_errors.items())) or "none"
        lines.append(f"      errors raised to callers (after retries): {callers}")
    for note in run.notes:
        lines.append(f"   note: {note}")
    for text in (f.twice + f.token_problems)[:10]:
        lines.append(f"   ! {text}")
    for key, found in list(run.lost.items())[:10]:
        lines.append(f"   ! lost {key}: {found}")
    return "\n".join(lines)


def _per_coordinator(f: FaultFigures, value: str) -> str:
    cells = []
    for c in f.coordinators:
        cell = {
            "recovered": _seconds(c.recovered, "no failure"),
            "writes": _seconds(c.writes_to_calls),
            "health": _seconds(c.health_after_writes, "stayed SERVING"),
            "errors": _short_errors(c.errors),
        }[value]
        cells.append(cell if len(f.coordinators) == 1 else f"{c.name}: {cell}")
    return "<br>".join(cells)


def _short_errors(errors: collections.Counter[str]) -> str:
    by_code: collections.Counter[str] = collections.Counter()
    for label, n in errors.items():
        by_code[label.split(" ", 1)[1]] += n
    return ", ".join(f"{label} x{n}" for label, n in sorted(by_code.items())) or "none"


def table(all_figures: Sequence[FaultFigures]) -> str:
    """The summary, as a markdown table that can be pasted into the docs."""
    header = (
        "| round | fault | acked | lost | run twice | token order | writes accepted (s) | "
        "calls succeed again (s) | writes -> calls (s) | health SERVING after writes (s) | "
        "errors seen by the client |"
    )
    rows = [header, "|" + " --- |" * 11]
    for f in all_figures:
        run = f.run
        measured = " (measured)" if run.measured_only else ""
        tokens = "ok" if not f.token_problems else f"{len(f.token_problems)} problems"
        rows.append(
            f"| {run.round} | {run.label} | {f.acked} | {len(run.lost)}{measured} | "
            f"{len(f.twice)}{measured} | {tokens}{measured} | {_seconds(f.writes_at)} | "
            f"{_per_coordinator(f, 'recovered')} | {_per_coordinator(f, 'writes')} | "
            f"{_per_coordinator(f, 'health')} | {_per_coordinator(f, 'errors')} |"
        )
    return "\n".join(rows)
