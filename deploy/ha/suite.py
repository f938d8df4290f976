"""The failover suite's driver: test.sh has set up the cluster (three Patroni nodes in network
namespaces, etcd, HAProxy) and runs this with its description (environment.json).

Each round starts its coordinators (the binary under test), a load of 16 callers through them,
a write probe per coordinator and a health Watch per coordinator; then makes each fault once,
with the load running through it, the cluster checked healthy before each. After each fault it
reads back every result acknowledged since the fault before (through a coordinator of its own
without a replay cache), and prints the fault's figures; at the end, a markdown table of all of
them. It exits 1 when any assertion failed (each printed), 2 when the cluster or a coordinator
did not come to the state a step waits for (with the log to read).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cluster import (
    Cluster,
    Environment,
    Node,
    SuiteFailure,
    cut_from_dcs,
    failure,
    isolated,
    until,
    until_async,
)
from coordinators import Coordinator, haproxy_url, log_summary, multihost_url
from figures import (
    FaultFigures,
    FaultRun,
    check_the_checks,
    detail,
    figures,
    problems,
    table,
    verdict,
    violations,
)
from load import Load, Recorder, RecordingClient, Verifier, expected_responses
from probes import CoordinatorProbe, HealthWatch, NodeWriteProbe

CALLERS = 16
DATABASE = "idempotency"
STALL_SECONDS = 8.0
"""How long the synchronous standby is cut off (no failover is expected)."""
WARM_UP_ACKS = 100


@dataclass(frozen=True)
class RoundPlan:
    key: str
    title: str
    coordinators: tuple[tuple[str, str], ...]
    """(name, "haproxy" | "multihost") of each coordinator."""


ROUNDS = {
    "haproxy": RoundPlan("haproxy", "one coordinator through HAProxy", (("A", "haproxy"),)),
    "multihost": RoundPlan(
        "multihost", "one coordinator through a multi-host URL", (("B", "multihost"),)
    ),
    "replicas": RoundPlan(
        "replicas",
        "two coordinators, C1 through HAProxy and C2 through the multi-host URL",
        (("C1", "haproxy"), ("C2", "multihost")),
    ),
}


def now() -> float:
    return time.monotonic()


def say(text: str) -> None:
    print(text, flush=True)


class Round:
    """One round's coordinators, load, probes and watches."""

    def __init__(self, suite: Suite, plan: RoundPlan) -> None:
        self.suite = suite
        self.plan = plan
        self.recorder = Recorder()
        environment = suite.environment
        urls = {
            "haproxy": haproxy_url(environment, DATABASE),
            "multihost": multihost_url(environment, DATABASE),
        }
        self.coordinators = [
            Coordinator(environment, name, urls[kind]) for name, kind in plan.coordinators
        ]
        self.probes: list[CoordinatorProbe] = []
        self.watches: dict[str, HealthWatch] = {}
        self.clients: list[RecordingClient] = []
        self.load: Load | None = None
        self.runs: list[FaultRun] = []
        self.figures: list[FaultFigures] = []
        self._verified = 0
        self.synchronous_until = float("inf")
        """When the cluster left synchronous mode (the asynchronous measurement)."""

    @property
    def logs(self) -> list[str]:
        return [c.log for c in self.coordinators]

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.coordinators))
        for c in self.coordinators:
            probe = CoordinatorProbe(c.name, c.address)
            watch = HealthWatch(c.name, c.address)
            probe.start()
            watch.start()
            self.probes.append(probe)
            self.watches[c.name] = watch
            self.clients.append(RecordingClient(c.address, c.name, self.recorder))
        self.load = Load(f"ha-{self.plan.key}", self.clients, CALLERS, self.recorder)
        self.load.start()
        await until(
            lambda: len(self.recorder.acks) >= WARM_UP_ACKS,
            30,
            f"the load's first {WARM_UP_ACKS} lifecycles",
            *self.logs,
        )

    async def check_the_verifier(self) -> None:
        verifier = Verifier(self.suite.verifier.address, f"ha-{self.plan.key}")
        await verifier.check_the_read_back(self.recorder.acks[0])

    async def stop(self, interrupted: bool) -> None:
        """Stops the load (letting each caller finish, unless interrupted), the probes and the
        coordinators (drained, unless interrupted: test.sh's teardown kills what is left)."""
        try:
            if self.load is not None:
                await self.load.stop(within=0 if interrupted else 60)
        finally:
            for probe in self.probes:
                await probe.stop()
            for watch in self.watches.values():
                await watch.stop()
            for client in self.clients:
                await client.close()
            for c in self.coordinators:
                await c.stop(within=0 if interrupted else 40)

    async def verify_since_last(self, run: FaultRun) -> None:
        """Reads back every result acknowledged since the last check (a failover can only lose
        what its new primary had not received; what was read back before had reached every
        streaming standby long before this fault)."""
        acks = self.recorder.acks[: len(self.recorder.acks)]
        batch = acks[self._verified :]
        self._verified = len(acks)
        every = expected_responses((a.key, a.response) for a in acks)[0]
        keys = {a.key for a in batch}
        _, conflicts = expected_responses((a.key, a.response) for a in acks if a.key in keys)
        verifier = Verifier(self.suite.verifier.address, f"ha-{self.plan.key}")
        mismatches = await verifier.mismatches({k: every[k] for k in keys})
        mismatches.update(conflicts)
        run.verified = len(keys)
        if run.measured_only:
            # Keys acknowledged while commits still waited for a standby are asserted all the
            # same; only those acknowledged in asynchronous mode are measured.
            acknowledged_at = {a.key: a.at for a in reversed(acks)}
            for key, found in mismatches.items():
                if acknowledged_at[key] < self.synchronous_until:
                    self.suite.problems.append(
                        f"{self.plan.key}: {key}, acknowledged in synchronous mode, lost: {found}"
                    )
                else:
                    run.lost[key] = found
        else:
            run.lost.update(mismatches)

    async def verify_all(self) -> None:
        """At the end of the round: every acknowledged result, byte-identical."""
        acks = [(a.key, a.response, a.at) for a in self.recorder.acks]
        expected, conflicts = expected_responses((k, r) for k, r, _ in acks)
        verifier = Verifier(self.suite.verifier.address, f"ha-{self.plan.key}")
        mismatches = await verifier.mismatches(expected)
        mismatches.update(conflicts)
        first_at = {k: at for k, _, at in reversed(acks)}
        asserted = {k: v for k, v in mismatches.items() if first_at[k] < self.synchronous_until}
        say(
            f"ha: {self.plan.key}: all {len(expected)} acknowledged keys read back: "
            f"{len(mismatches)} do not replay byte-identical ({len(asserted)} of them acknowledged "
            "in synchronous mode)"
        )
        for key, found in list(asserted.items())[:10]:
            self.suite.problems.append(
                f"{self.plan.key}: {key} lost by the end of the round: {found}"
            )

    def analyse(self) -> None:
        probe_tokens = [t for probe in self.probes for t in probe.tokens]
        twice, tokens = violations(self.recorder, probe_tokens)
        for run in self.runs:
            # The asynchronous measurement owns everything from the mode change on: a key it
            # lost may be run again whenever a caller asks it later.
            if run.measured_only:
                start, until = self.synchronous_until, float("inf")
            else:
                start, until = run.t0, run.end
            run_twice = [(at, text) for at, text in twice if start <= at <= until]
            run_tokens = [(at, text) for at, text in tokens if start <= at <= until]
            f = figures(
                run,
                self.recorder,
                self.suite.node_probes,
                self.probes,
                self.watches,
                [text for _, text in run_twice],
                [text for _, text in run_tokens],
            )
            self.figures.append(f)
        windows = [
            (self.synchronous_until, float("inf")) if r.measured_only else (r.t0, r.end)
            for r in self.runs
        ]
        for at, text in twice + tokens:
            if not any(start <= at <= until for start, until in windows):
                self.suite.problems.append(f"{self.plan.key}, between faults: {text}")


class Suite:
    def __init__(self, environment: Environment, rounds: list[str], measure_async: bool) -> None:
        self.environment = environment
        self.cluster = Cluster(environment)
        self.rounds = rounds
        self.measure_async = measure_async
        self.node_probes = {node.name: NodeWriteProbe(node) for node in environment.nodes}
        self.verifier = Coordinator(
            environment,
            "verifier",
            multihost_url(environment, DATABASE),
            ("--replay-cache-bytes", "0"),
        )
        self.figures: list[FaultFigures] = []
        self.problems: list[str] = []

    async def run(self) -> int:
        started = now()
        check_the_checks()
        for probe in self.node_probes.values():
            probe.start()
        try:
            # The verifier creates and migrates the database before any round starts.
            await self.verifier.start()
            for index, key in enumerate(self.rounds):
                last = index == len(self.rounds) - 1
                await self.round(ROUNDS[key], with_async=last and self.measure_async)
        except BaseException:
            # Failed or interrupted: the teardown kills what is left; nothing is drained.
            await self._stop(quick=True)
            raise
        await self._stop(quick=False)
        say("")
        say(f"== summary ({now() - started:.0f} s)")
        say(table(self.figures))
        say("")
        return verdict(
            self.problems,
            "every assertion held: no acknowledged result lost, no work run twice, tokens in\n"
            "order, calls through every coordinator within 2 s of the new primary taking writes",
        )

    async def _stop(self, quick: bool) -> None:
        with contextlib.suppress(SuiteFailure):
            await self.verifier.stop(within=0 if quick else 40)
        for probe in self.node_probes.values():
            await probe.stop()

    async def round(self, plan: RoundPlan, with_async: bool) -> None:
        say(f"\n== round {plan.key}: {plan.title}")
        started = now()
        current = Round(self, plan)
        try:
            await current.start()
            await current.check_the_verifier()
            faults: list[Callable[[Round], Awaitable[FaultRun]]] = [
                self.kill,
                self.switchover,
                self.partition,
                self.dcs_partition,
                self.stalled_standby,
            ]
            if with_async:
                faults.append(self.asynchronous_kill)
            for fault in faults:
                load = current.load
                assert load is not None
                crashed = load.crashed()
                if crashed is not None:
                    raise SuiteFailure(f"a caller crashed: {crashed!r}")
                run = await fault(current)
                await current.verify_since_last(run)
                current.runs.append(run)
                say(
                    f"ha: {plan.key} / {run.label}: {run.old_primary} -> {run.new_primary}, "
                    f"resolved +{run.resolved - run.t0:.1f} s, healthy +{run.end - run.t0:.1f} s, "
                    f"{run.verified} keys read back, {len(run.lost)} lost"
                )
        except BaseException:
            # Failed or interrupted: nothing more is measured, so nothing is waited for (the
            # teardown kills what is left), and the error that stopped the round is reported.
            await current.stop(interrupted=True)
            raise
        await current.stop(interrupted=False)
        await current.verify_all()
        for c in current.coordinators:
            say(f"ha: {plan.key}: {c.name}'s log: {log_summary(c.log)}")
        current.analyse()
        for f in current.figures:
            say(detail(f))
            self.problems.extend(problems(f))
        self.figures.extend(current.figures)
        say(f"== round {plan.key} took {now() - started:.0f} s")

    # -----------------------------------------------------------------------------------------
    # The faults. Each starts on a healthy cluster, makes its fault, waits until the cluster has
    # a primary taking writes and calls succeed through every coordinator ("resolved"), undoes
    # the fault, and waits until the cluster is healthy again.

    async def healthy(self, current: Round, synchronous: bool, why: str) -> Node:
        primary = await self.cluster.wait_healthy(synchronous, 120, why)
        for c in current.coordinators:
            await until_async(
                functools.partial(_is_serving, c), 30, f"coordinator {c.name} SERVING {why}", c.log
            )
        return primary

    def fault_run(
        self, current: Round, fault: str, label: str, old: Node, failover: bool
    ) -> FaultRun:
        run = FaultRun(
            round=current.plan.key,
            fault=fault,
            label=label,
            synchronous=True,
            expect_failover=failover,
            old_primary=old.name,
            t0=now(),
        )
        run.notes.append(f"load average at the fault: {os.getloadavg()[0]:.1f}")
        return run

    async def resolved(self, current: Round, run: FaultRun, within: float) -> None:
        """Waits until a primary (another one, when the fault should fail over) commits writes
        again, settled (5 probe writes in a row), and calls succeed through every coordinator
        (10 probe calls in a row, all sent after the writes were accepted)."""
        deadline = now() + within
        while True:
            primary = await self.cluster.primary()
            if primary is not None and (not run.expect_failover or primary.name != run.old_primary):
                timeline = self.node_probes[primary.name].timeline
                instant = now()
                writes = timeline.recovered_at(run.t0, instant)
                last = timeline.last_failure(run.t0, instant)
                settled = (
                    writes is not None
                    and timeline.successes_after(last.started if last else run.t0) >= 5
                )
                if (
                    settled
                    and writes is not None
                    and all(_calls_recovered(probe, run.t0, writes) for probe in current.probes)
                ):
                    run.resolved = now()
                    run.new_primary = primary.name
                    return
            if now() > deadline:
                state = await self.cluster.state(run.synchronous)
                raise failure(
                    f"{current.plan.key} / {run.label}: no primary took writes with calls "
                    f"succeeding through every coordinator within {within:.0f} s "
                    f"({state.describe()})",
                    *[node.log for node in self.environment.nodes],
                    *current.logs,
                )
            await asyncio.sleep(0.1)

    async def kill_until_resolved(
        self, current: Round, run: FaultRun, old: Node, *, synchronous: bool
    ) -> None:
        """Kills every process on `old`'s machine, waits for the fault to resolve, then starts
        it again and waits until the cluster is healthy (in the replication mode given)."""
        await self.cluster.kill(old)
        await self.resolved(current, run, 60)
        run.healed = now()
        await self.cluster.start(old)
        await self.cluster.wait_healthy(synchronous, 120, f"after {old.name} was started again")
        run.end = now()

    async def kill(self, current: Round) -> FaultRun:
        old = await self.healthy(current, True, "before kill -9 of the primary")
        run = self.fault_run(current, "kill", "kill -9 of the primary", old, failover=True)
        await self.kill_until_resolved(current, run, old, synchronous=True)
        return run

    async def switchover(self, current: Round) -> FaultRun:
        old = await self.healthy(current, True, "before the switchover")
        run = self.fault_run(current, "switchover", "switchover", old, failover=True)
        # No candidate: in synchronous mode Patroni switches over to the synchronous standby.
        answer = await self.cluster.switchover(old, None)
        run.notes.append(f"Patroni: {answer.strip()}")
        await self.resolved(current, run, 60)
        await self.cluster.wait_healthy(True, 120, "after the switchover")
        run.end = now()
        return run

    async def partition(self, current: Round) -> FaultRun:
        old = await self.healthy(current, True, "before the partition of the primary")
        run = self.fault_run(current, "partition", "partition of the primary", old, failover=True)
        await self.cluster.firewall(old, isolated())
        await self._hold_until_settled(current, run, old)
        return run

    async def dcs_partition(self, current: Round) -> FaultRun:
        old = await self.healthy(current, True, "before cutting the primary from the DCS")
        run = self.fault_run(
            current, "dcs", "primary cut from etcd and its peers only", old, failover=True
        )
        peers = [node.ip for node in self.environment.nodes if node != old]
        await self.cluster.firewall(old, cut_from_dcs(self.environment.host_ip, peers))
        await self._hold_until_settled(current, run, old)
        return run

    async def _hold_until_settled(self, current: Round, run: FaultRun, old: Node) -> None:
        """Keeps a partition until the cluster has failed over, calls succeed through every
        coordinator, and the cut-off primary has demoted itself (asked from inside its
        namespace); then heals it and waits for the node to stream again. Past that point a
        longer partition changes nothing: the cut-off node is a read-only standby that cannot
        reach the DCS, and nothing is routed to it."""
        await self.resolved(current, run, 90)
        await until_async(
            lambda: _is_false(self.cluster.says_primary_from_inside(old)),
            60,
            f"{old.name}, cut off, demoting itself",
            old.log,
        )
        run.healed = now()
        await self.cluster.heal(old)
        run.notes.append(f"partition held {run.healed - run.t0:.1f} s")
        await self.cluster.wait_healthy(True, 120, f"after the partition of {old.name} healed")
        run.end = now()

    async def stalled_standby(self, current: Round) -> FaultRun:
        primary = await self.healthy(current, True, "before stalling the synchronous standby")
        replication = await self.cluster.replication(primary)
        standby = self.environment.node(next(r.name for r in replication if r.sync_state == "sync"))
        run = self.fault_run(
            current,
            "stall",
            f"synchronous standby cut off {STALL_SECONDS:.0f} s",
            primary,
            failover=False,
        )
        await self.cluster.firewall(standby, isolated())
        # The fault's length, not a synchronisation: the standby stays cut off this long.
        await asyncio.sleep(STALL_SECONDS)
        run.healed = now()
        await self.cluster.heal(standby)
        await self.resolved(current, run, 60)
        await self.cluster.wait_healthy(True, 120, f"after {standby.name} was reconnected")
        run.end = now()
        after = await self.cluster.replication(primary)
        synchronous_after = next((r.name for r in after if r.sync_state == "sync"), "none")
        run.notes.append(
            f"cut off: {standby.name}; synchronous standby afterwards: {synchronous_after}"
        )
        return run

    async def asynchronous_kill(self, current: Round) -> FaultRun:
        primary = await self.healthy(current, True, "before leaving synchronous mode")
        await self.cluster.configure(
            primary, {"synchronous_mode": False, "synchronous_mode_strict": False}
        )

        async def asynchronous() -> bool:
            try:
                names = await self.cluster.setting(primary, "synchronous_standby_names")
            except Exception:
                return False
            return names == ""

        await until_async(asynchronous, 30, "synchronous_standby_names emptied", primary.log)
        old = await self.healthy(current, False, "in asynchronous mode")
        current.synchronous_until = now()
        acks = len(current.recorder.acks)
        await until(
            lambda: len(current.recorder.acks) >= acks + WARM_UP_ACKS,
            30,
            "lifecycles in asynchronous mode",
            *current.logs,
        )
        run = self.fault_run(
            current, "async", "kill -9 of the primary, asynchronous replication", old, failover=True
        )
        run.synchronous = False
        run.measured_only = True
        await self.kill_until_resolved(current, run, old, synchronous=False)
        for c in current.coordinators:
            with open(c.log, errors="replace") as log:
                warned = "commits do not wait for a synchronous standby" in log.read()
            run.notes.append(
                f"{c.name} logged that commits do not wait for a standby: "
                + ("yes" if warned else "NO")
            )
        return run


async def _is_serving(coordinator: Coordinator) -> bool:
    return await coordinator.health() == "SERVING"


async def _is_false(answer: Awaitable[bool | None]) -> bool:
    return await answer is False


def _calls_recovered(probe: CoordinatorProbe, t0: float, writes: float) -> bool:
    timeline = probe.timeline
    last = timeline.last_failure(t0, now())
    since = max(last.started if last else t0, writes)
    return timeline.successes_after(since) >= 10


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--environment", required=True)
    parser.add_argument("--rounds", default="haproxy,multihost,replicas")
    parser.add_argument("--async-measurement", default="1", choices=("0", "1"))
    args = parser.parse_args()
    rounds = [r for r in args.rounds.split(",") if r]
    unknown = [r for r in rounds if r not in ROUNDS]
    if unknown or not rounds:
        parser.error(f"--rounds: one or more of {', '.join(ROUNDS)}")
    # psycopg reports at WARNING when a probe's timed-out write could not be cancelled on a node
    # that is cut off; the probe records the failure itself, and the lines would only interleave
    # with the figures.
    logging.getLogger("psycopg").setLevel(logging.ERROR)
    environment = Environment.load(args.environment)
    suite = Suite(environment, rounds, args.async_measurement == "1")
    try:
        return asyncio.run(suite.run())
    except SuiteFailure as error:
        say(f"FAILED: {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
