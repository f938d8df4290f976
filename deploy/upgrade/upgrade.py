"""The rolling-upgrade suite's driver: test.sh has built the previous release and made the
names (a database of the suite's own on the PostgreSQL at 127.0.0.1:5432, a work folder, a
log folder) and runs this with them.

The previous release migrates the database and serves it from two replicas; a steady load of
callers (the failover suite's, deploy/ha/load.py: the project's Python client, asyncio
`run_once` with its default retries, waiters and replays) runs through both replicas for the
whole scenario. While a psql session holds a transaction on idempotency_keys, the new release's
migrate runs; the load's latency meanwhile is compared with the steady load's. Then each replica
is replaced by the new release, one at a time, and then each by the previous release again
(`--no-migrate`, on the new schema). At the end: no call failed after the client's retries, no
acknowledged result lost, tokens in order, every waiter answered. Exits 1 when an assertion
failed (each printed), 2 when a step did not reach the state it waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster import SuiteFailure, failure, until
from coordinators import Coordinator, log_summary
from figures import check_the_checks, verdict, violations
from load import Load, Recorder, RecordingClient, Verifier, expected_responses
from migration import (
    HOLD_SECONDS,
    MIGRATE_WITHIN,
    Database,
    HeldTransaction,
    Migrate,
    migration_versions,
)
from phases import (
    LockWait,
    Phase,
    PhaseFigures,
    Replacement,
    check_the_latency_check,
    check_the_token_check,
    lock_wait_detail,
    lock_wait_problems,
    phase_figures,
    replacements_table,
    table,
    tokens_across_keys,
)
from replicas import CHANNEL_OPTIONS, Release, Slot, free_ports

CALLERS = 8
"""Enough to keep both replicas busy with waiters among them, few enough that this 2-core
machine is not saturated: a saturated machine's p99 is its scheduler's, not the service's."""
NAMESPACE = "upgrade"
RELEASE_SHARE = 0.05
"""Keys whose first run fails (the client Releases them, the caller asks again later): keys that
run twice, under two tokens, across the releases, and Releases among the calls."""
WARM_UP_ACKS = 100
STEADY_SECONDS = 15.0
"""The window whose p99 the lock-wait window is compared with."""
SERVE_SECONDS = 8.0
"""The windows between the steps (each release serving alone, the mixed schema)."""


def now() -> float:
    return time.monotonic()


def say(text: str) -> None:
    print(text, flush=True)


@dataclass(frozen=True)
class Setup:
    """What test.sh made: the folders (`Places` for the coordinators), both binaries, the
    database."""

    work: str
    logs: str
    binary: str
    """The new release (the binary under test)."""
    previous: str
    url: str
    migrations: str
    """The new release's migrations folder (this checkout's)."""


@dataclass
class Scenario:
    setup: Setup
    recorder: Recorder = field(default_factory=Recorder)
    phases: list[Phase] = field(default_factory=list)
    replacements: list[Replacement] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    extra: list[Coordinator] = field(default_factory=list)
    """Coordinators outside the load's rotation (the verifier, the rollback observation)."""
    load: Load | None = None
    clients: list[RecordingClient] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.database = Database(self.setup.url)
        self.previous = Release("previous", self.setup.previous)
        self.new = Release("new", self.setup.binary)
        # The way back: the previous release's migrator refuses a schema with a migration it
        # does not know, and without --no-migrate its replicas would try it again at every
        # health check (see rollback_without_no_migrate and the README's findings).
        self.rollback = Release("previous", self.setup.previous, ("--no-migrate",))

    def migrate(self, binary: str, name: str) -> Migrate:
        return Migrate(
            binary,
            self.setup.url,
            f"{self.setup.logs}/migrate-{name}.log",
            f"{self.setup.work}/pids/migrate-{name}.pid",
        )

    async def run(self) -> int:
        started = now()
        check_the_checks()
        check_the_latency_check()
        check_the_token_check()
        try:
            version = await self.schema_of_the_previous_release()
            await self.serve_the_previous_release()
            steady = await self.window("steady: previous release", STEADY_SECONDS)
            await self.lock_wait(version, steady)
            await self.window("previous release on the new schema", SERVE_SECONDS)
            for slot in self.slots:
                await self.replace(slot, self.new, "upgrade")
            await self.window("new release", SERVE_SECONDS)
            await self.rollback_without_no_migrate()
            for slot in self.slots:
                await self.replace(slot, self.rollback, "rollback")
            await self.window("previous release again (--no-migrate), new schema", SERVE_SECONDS)
            await self.finish()
        except BaseException:
            await self.stop(interrupted=True)
            raise
        await self.stop(interrupted=False)
        self.report(now() - started)
        return verdict(
            self.problems,
            "every assertion held: no call failed after the client's retries, no acknowledged\n"
            "result lost, tokens in order, every waiter answered, calls kept their latency while\n"
            "the migration waited for its lock",
        )

    # -----------------------------------------------------------------------------------------
    # The steps.

    async def schema_of_the_previous_release(self) -> int:
        """The previous release's migrate creates the database and its schema; the first
        migration of the new release beyond it (the one the lock-wait check makes wait)."""
        migrate = self.migrate(self.setup.previous, "previous")
        status = await migrate.run()
        if status != 0:
            raise failure(f"the previous release's migrate exited {status}", migrate.log)
        newest = await self.database.newest_migration()
        pending = [v for v in migration_versions(Path(self.setup.migrations)) if v > newest]
        if not pending:
            raise SuiteFailure(
                f"the new release has no migration beyond the previous release's ({newest}): "
                "the lock-wait check needs one that alters idempotency_keys (see "
                "deploy/upgrade/PREVIOUS_RELEASE)"
            )
        say(f"upgrade: the previous release migrated the database to {newest}; the new release "
            f"adds {', '.join(map(str, pending))}")  # fmt: skip
        return pending[0]

    async def serve_the_previous_release(self) -> None:
        # One draw for every port, so that no two of them are the same.
        ports = free_ports(4)
        for index in range(2):
            self.slots.append(
                Slot(
                    self.setup,
                    f"r{index + 1}",
                    self.setup.url,
                    ports[index],
                    ports[2 + index],
                )
            )
        await asyncio.gather(*(slot.first_start(self.previous) for slot in self.slots))
        target = "ipv4:" + ",".join(slot.address for slot in self.slots)
        # Two clients on the same two replicas: the load asks a waiter's key through the other
        # client than its first caller's, so waiter and holder are as often on two replicas as
        # on one.
        self.clients = [
            RecordingClient(target, f"client{n}", self.recorder, CHANNEL_OPTIONS) for n in (1, 2)
        ]
        self.load = Load(NAMESPACE, self.clients, CALLERS, self.recorder, RELEASE_SHARE)
        self.load.start()
        await until(
            lambda: len(self.recorder.acks) >= WARM_UP_ACKS,
            30,
            f"the load's first {WARM_UP_ACKS} lifecycles through {target}",
            *(slot.current.log for slot in self.slots if slot.current),
        )
        say(f"upgrade: two replicas of the previous release at {target}, {CALLERS} callers")

    async def window(self, name: str, seconds: float) -> Phase:
        """A phase in which nothing is done but the load: `seconds` long (its length, not a
        synchronisation), watching that no caller crashed."""
        phase = Phase(name, now())
        while now() < phase.start + seconds:
            self._check_callers()
            await asyncio.sleep(min(0.5, phase.start + seconds - now()))
        phase.end = now()
        self.phases.append(phase)
        return phase

    def _check_callers(self) -> None:
        crashed = self.load.crashed() if self.load else None
        if crashed is not None:
            raise SuiteFailure(f"a caller crashed: {crashed!r}")

    async def lock_wait(self, version: int, steady: Phase) -> None:
        """A psql session holds ACCESS SHARE on idempotency_keys for HOLD_SECONDS while the new
        release's migrate runs: its ALTER TABLE must wait without holding the load's calls up,
        and finish once the transaction ends."""
        wait = LockWait(version)
        held = HeldTransaction(self.setup.url, f"{self.setup.logs}/psql.log")
        migrate = self.migrate(self.setup.binary, "new")
        try:
            await held.open()
            wait.held = now()
            if not await self.database.holds_access_share(held.pid):
                raise SuiteFailure(
                    "the psql session does not hold ACCESS SHARE on idempotency_keys"
                )
            phase = Phase("lock wait: transaction held, migration waiting", now())
            wait.migrate_started = phase.start
            await migrate.start()
            while now() < wait.held + HOLD_SECONDS:
                wait.samples += 1
                wait.waiting_samples += await self.database.alter_waiting()
                self._check_callers()
                # The sampling interval of pg_stat_activity; the hold ends at its own time.
                await asyncio.sleep(0.1)
            wait.running_at_commit = migrate.running
            wait.applied_at_commit = await self.database.applied(version)
            phase.end = now()
            await held.commit()
            wait.committed = now()
            wait.exit_status = await migrate.wait(MIGRATE_WITHIN)
            wait.migrate_exited = migrate.exited_at
        finally:
            await held.abandon()
            migrate.kill()
        wait.applied_after = await self.database.applied(version)
        wait.logged = migrate.said()
        self.phases.append(phase)
        if wait.migrate_exited is not None and wait.migrate_exited > wait.committed:
            self.phases.append(Phase("migration finishing", wait.committed, wait.migrate_exited))
        twins = self.recorder.twins()
        steady_figures = phase_figures(self.recorder, steady, twins)
        waiting_figures = phase_figures(self.recorder, phase, twins)
        say(lock_wait_detail(wait, steady_figures, waiting_figures))
        self.problems += lock_wait_problems(wait, steady_figures, waiting_figures, MIGRATE_WITHIN)

    async def replace(self, slot: Slot, release: Release, step: str) -> None:
        phase = Phase(f"{step} {slot.name}: {slot.release} -> {release.name}", now())
        replacement = await slot.replace(release)
        phase.end = now()
        self.phases.append(phase)
        self.replacements.append(replacement)
        if replacement.exit_status != 0:
            self.problems.append(
                f"{step} {slot.name}: the replaced replica exited {replacement.exit_status} "
                "after SIGTERM (a drained replica exits 0)"
            )
        say(f"upgrade: {phase.name}: drained {replacement.drain:.2f} s, SERVING "
            f"{replacement.start:.2f} s later, the load's calls reached it "
            f"{replacement.reached:.2f} s after that")  # fmt: skip

    async def rollback_without_no_migrate(self) -> None:
        """What the previous release does on the newer schema without --no-migrate, printed (not
        asserted: it is a property of the release pinned, and the reason the rollback passes
        --no-migrate): its `migrate` fails (sqlx's VersionMissing), and its `serve` retries the
        migration at every health check, on a replica outside the load's rotation."""
        migrate = self.migrate(self.setup.previous, "previous-on-new-schema")
        status = await migrate.run()
        said = [line for line in migrate.said() if "ERROR" in line][-1:]
        self.observations.append(
            f"`migrate` of the previous release on the new schema exited {status}"
            + (f": {said[0].split('ERROR', 1)[1].strip()}" if said else "")
        )
        port, metrics = free_ports(2)
        probe = Slot(self.setup, "without-no-migrate", self.setup.url, port, metrics)
        started = now()
        try:
            await probe.start(self.previous)
        except SuiteFailure as error:
            self.observations.append(
                "`serve` of the previous release on the new schema without --no-migrate did not "
                f"serve: {str(error).splitlines()[0]}"
            )
            return
        finally:
            self.extra += probe.history
        assert probe.current is not None
        log = probe.current.log

        def failed_migrations() -> int:
            with open(log, errors="replace") as text:
                return text.read().count("applying migrations failed")

        await until(lambda: failed_migrations() >= 2, 15, "two failed migration retries", log)
        serving = await probe.current.health()
        await probe.stop(interrupted=False)
        self.observations.append(
            f"`serve` of the previous release on the new schema without --no-migrate: health "
            f"{serving} {now() - started:.1f} s after its start, and its migration failed "
            f"{failed_migrations()} times meanwhile (a WARN 'applying migrations failed; will "
            "retry' at every health check, for as long as it runs)"
        )

    async def finish(self) -> None:
        """Stops the load (each caller finishes its lifecycle), then reads every acknowledged
        result back through a coordinator of the release now serving, without a replay cache,
        so that every answer comes from the database."""
        assert self.load is not None
        await self.load.stop(within=60)
        verifier = Coordinator(
            self.setup,
            "verifier",
            self.setup.url,
            ("--no-migrate", "--replay-cache-bytes", "0"),
            binary=self.setup.previous,
        )
        self.extra.append(verifier)
        await verifier.start()
        reader = Verifier(verifier.address, NAMESPACE)
        await reader.check_the_read_back(self.recorder.acks[0])
        expected, conflicts = expected_responses((a.key, a.response) for a in self.recorder.acks)
        read_started = now()
        lost = await reader.mismatches(expected, within=180)
        lost.update(conflicts)
        say(f"upgrade: {len(expected)} acknowledged keys read back in {now() - read_started:.1f} s"
            f": {len(lost)} do not replay byte-identical")  # fmt: skip
        if lost:
            sample = "; ".join(f"{k}: {v}" for k, v in list(lost.items())[:5])
            self.problems.append(f"{len(lost)} acknowledged results lost ({sample})")
        twice, tokens = violations(self.recorder, [])
        if tokens:
            sample = "; ".join(text for _, text in tokens[:5])
            self.problems.append(f"token order broken {len(tokens)} times ({sample})")
        across = tokens_across_keys(self.recorder)
        if across:
            sample = "; ".join(across[:5])
            self.problems.append(f"tokens out of order across keys {len(across)} times ({sample})")
        if twice:
            sample = "; ".join(text for _, text in twice[:5])
            self.problems.append(f"work run again after its result was acknowledged ({sample})")
        if self.recorder.failures:
            errors = collections.Counter(f.error for f in self.recorder.failures)
            self.problems.append(
                f"{len(self.recorder.failures)} calls failed after the client's retries: "
                + ", ".join(f"{e} x{n}" for e, n in sorted(errors.items()))
            )
        # A waiter is answered by the other caller's result, or by its own run of the work once
        # the other caller released the key (which may itself fail on purpose).
        answered = sum(1 for a in self.recorder.acks if a.twin) + self.recorder.twin_released
        if answered != self.recorder.twin_asks:
            self.problems.append(
                f"{self.recorder.twin_asks} asks of keys asked twice at once, {answered} answered"
            )

    async def stop(self, interrupted: bool) -> None:
        """Stops the load (unless it stopped), the clients and every coordinator (drained, each
        exit status checked, unless interrupted: test.sh's teardown kills what is left)."""
        try:
            if self.load is not None and interrupted:
                await self.load.stop(within=0)
        finally:
            for client in self.clients:
                await client.close()
            for slot in self.slots:
                with contextlib.suppress(SuiteFailure):
                    await slot.stop(interrupted)
                current = slot.current
                if not interrupted and current is not None and current.returncode != 0:
                    self.problems.append(
                        f"{current.name} exited {current.returncode} after SIGTERM"
                    )
            for coordinator in self.extra:
                with contextlib.suppress(SuiteFailure):
                    await coordinator.stop(within=0 if interrupted else 40)
            await self.database.close()

    # -----------------------------------------------------------------------------------------
    # The figures.

    def report(self, seconds: float) -> None:
        twins = self.recorder.twins()
        figures: list[PhaseFigures] = [
            phase_figures(self.recorder, phase, twins)
            for phase in sorted(self.phases, key=lambda p: p.start)
        ]
        tries = self.recorder.tries
        failed = sum(1 for t in tries if t.code != "OK")
        replayed_twins = sum(1 for a in self.recorder.acks if a.twin and a.replayed)
        runs = [e.key for e in self.recorder.executions]
        say("")
        say(f"== summary ({seconds:.0f} s)")
        say(table(figures))
        say("")
        say(replacements_table(self.replacements))
        say("")
        say(f"lifecycles acknowledged {len(self.recorder.acks)} "
            f"({sum(1 for a in self.recorder.acks if a.replayed)} replays), keys "
            f"{len({a.key for a in self.recorder.acks})}, calls (tries) {len(tries)}, failed "
            f"tries retried {failed}, raised to callers {len(self.recorder.failures)}; "
            f"waiters: {self.recorder.twin_asks} asks of keys asked twice at once, "
            f"{replayed_twins} answered with the other caller's result; runs failed on purpose "
            f"(key Released, asked again) {self.recorder.released}, keys run more than once "
            f"{len(runs) - len(set(runs))}")  # fmt: skip
        for observation in self.observations:
            say(f"observed: {observation}")
        for coordinator in [c for slot in self.slots for c in slot.history] + self.extra:
            say(f"upgrade: {coordinator.name}'s log: {log_summary(coordinator.log)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", required=True)
    parser.add_argument("--logs", required=True)
    parser.add_argument("--binary", required=True, help="the new release")
    parser.add_argument("--previous", required=True, help="the previous release")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--migrations", required=True)
    args = parser.parse_args()
    os.makedirs(f"{args.work}/pids", exist_ok=True)
    setup = Setup(
        work=args.work,
        logs=args.logs,
        binary=args.binary,
        previous=args.previous,
        url=args.database_url,
        migrations=args.migrations,
    )
    try:
        return asyncio.run(Scenario(setup).run())
    except SuiteFailure as error:
        say(f"FAILED: {error}")
        return 2
    except KeyboardInterrupt:
        say("interrupted; test.sh tears down what is left")
        return 130


if __name__ == "__main__":
    sys.exit(main())
