"""The schema side of the upgrade: the suite's database as it asks it (which migrations are
applied, whether the migration's ALTER TABLE waits for a lock), a `migrate` run of either
release, and the psql session that holds a lock on idempotency_keys while the new release's
migrate runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg

from cluster import failure
from coordinators import default_settings

HOLD_SECONDS = 10.0
"""How long the psql session holds its transaction open while migrate runs."""
MIGRATE_WITHIN = 60.0
"""How long migrate may take once nothing holds it up (it applies a few statements)."""


class Database:
    """The suite's own database, asked through the suite's own connections (psycopg), never
    through a coordinator."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._connection: psycopg.AsyncConnection[tuple[Any, ...]] | None = None

    async def _one(self, query: str, *params: object) -> Any:
        """One row's first column, on one connection kept for all the suite's questions (the
        lock-wait check asks ten times a second, and a connection each time would cost the
        machine more than the question)."""
        if self._connection is None or self._connection.closed:
            self._connection = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, connect_timeout=5
            )
        cursor = await asyncio.wait_for(self._connection.execute(query, params or None), 5.0)
        row = await cursor.fetchone()
        return None if row is None else row[0]

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._connection.close(), 5.0)
            self._connection = None

    async def newest_migration(self) -> int:
        """The newest migration applied (sqlx's table)."""
        return int(
            await self._one("SELECT coalesce(max(version), 0) FROM _sqlx_migrations WHERE success")
        )

    async def applied(self, version: int) -> bool:
        return bool(
            await self._one(
                "SELECT count(*) > 0 FROM _sqlx_migrations WHERE version = %s AND success",
                version,
            )
        )

    async def alter_waiting(self) -> bool:
        """Whether a session of this database runs an ALTER TABLE of idempotency_keys that waits
        for a lock (the migration's, queued behind the held transaction)."""
        return bool(
            await self._one(
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query ILIKE %s",
                "%ALTER TABLE idempotency_keys%",
            )
        )

    async def holds_access_share(self, pid: int) -> bool:
        """Whether backend `pid` holds ACCESS SHARE on idempotency_keys (granted)."""
        return bool(
            await self._one(
                "SELECT count(*) > 0 FROM pg_locks WHERE pid = %s AND granted"
                " AND mode = 'AccessShareLock' AND relation = 'idempotency_keys'::regclass",
                pid,
            )
        )


def migration_versions(folder: Path) -> list[int]:
    """The versions of the migrations in a folder (the numbers their file names start with)."""
    return sorted(int(path.name.split("_", 1)[0]) for path in folder.glob("*.sql"))


class Migrate:
    """`binary migrate --database-url …`, its output appended to `log`; recorded in `pid_file`
    for test.sh's teardown while it runs."""

    def __init__(self, binary: str, url: str, log: str, pid_file: str) -> None:
        self.binary = binary
        self.url = url
        self.log = log
        self.pid_file = pid_file
        self._process: asyncio.subprocess.Process | None = None
        self._exit: asyncio.Task[int] | None = None
        self._log_offset = 0
        self.started_at = 0.0
        self.exited_at: float | None = None
        """When it exited (time.monotonic), noted as it happens."""

    async def start(self) -> None:
        self._log_offset = Path(self.log).stat().st_size if Path(self.log).exists() else 0
        with open(self.log, "ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                self.binary, "migrate", "--database-url", self.url,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=default_settings(),
                start_new_session=True,
            )  # fmt: skip
        Path(self.pid_file).write_text(f"{self._process.pid}\n{self.binary} migrate\n")
        self.started_at = time.monotonic()
        self._exit = asyncio.create_task(self._exited(self._process))

    async def _exited(self, process: asyncio.subprocess.Process) -> int:
        status = await process.wait()
        self.exited_at = time.monotonic()
        return status

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def wait(self, within: float) -> int | None:
        """Its exit status; None if it did not exit within `within` seconds (it is then
        killed)."""
        assert self._exit is not None
        try:
            return await asyncio.wait_for(asyncio.shield(self._exit), within)
        except TimeoutError:
            return None
        finally:
            self.kill()

    def kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
        Path(self.pid_file).unlink(missing_ok=True)

    def said(self) -> list[str]:
        """What this run printed."""
        with open(self.log, "rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace").splitlines()

    async def run(self, within: float = MIGRATE_WITHIN) -> int | None:
        await self.start()
        return await self.wait(within)


class HeldTransaction:
    """A psql session, as an operator's would be, that opens a transaction reading
    idempotency_keys (ACCESS SHARE, which an ALTER TABLE's ACCESS EXCLUSIVE must wait for) and
    keeps it open until `commit`."""

    def __init__(self, url: str, log: str) -> None:
        self.url = url
        self.log = log
        self.pid = 0
        """The session's backend."""
        self._process: asyncio.subprocess.Process | None = None

    async def open(self, within: float = 10.0) -> None:
        self._process = await asyncio.create_subprocess_exec(
            "psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", self.url,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PGCONNECT_TIMEOUT": "5"},
        )  # fmt: skip
        lines = await self._say(
            "BEGIN;\nSELECT pg_backend_pid();\nSELECT 1 FROM idempotency_keys LIMIT 1;\n"
            "\\echo held\n",
            "held",
            within,
        )
        self.pid = int(lines[0])

    async def commit(self, within: float = 10.0) -> None:
        assert self._process is not None and self._process.stdin is not None
        await self._say("COMMIT;\n\\echo committed\n", "committed", within)
        self._process.stdin.close()
        await asyncio.wait_for(self._process.wait(), within)

    async def _say(self, text: str, until: str, within: float) -> list[str]:
        """Sends `text` and reads psql's answer up to the line `until`."""
        process = self._process
        assert process is not None and process.stdin is not None and process.stdout is not None
        process.stdin.write(text.encode())
        await process.stdin.drain()
        lines: list[str] = []
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            try:
                line = await asyncio.wait_for(process.stdout.readline(), max(left, 0.01))
            except TimeoutError:
                line = b""
            text_line = line.decode(errors="replace").strip()
            with open(self.log, "a") as log:
                log.write(line.decode(errors="replace"))
            if text_line == until:
                return lines
            if not line:
                raise failure(f"psql did not answer '{until}' within {within:.0f} s", self.log)
            if text_line:
                lines.append(text_line)

    async def abandon(self) -> None:
        """Ends the session at once (its transaction rolls back), when the suite is stopped."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            with contextlib.suppress(ProcessLookupError):
                await self._process.wait()
