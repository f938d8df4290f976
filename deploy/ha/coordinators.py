"""The coordinator processes: the binary under test, with its default settings except what the
suite needs (the database URL, a loopback port written to an address file). The rolling-upgrade
suite (deploy/upgrade) runs them too, from two binaries, on ports of its choosing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Protocol

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Environment, SuiteFailure, failure
from probes import SERVICE


class Places(Protocol):
    """Where a suite keeps its coordinators' files (`work`: pid and address files, `logs`), and
    the binary it runs unless told another; the failover suite's `Environment` is one."""

    @property
    def work(self) -> str: ...

    @property
    def logs(self) -> str: ...

    @property
    def binary(self) -> str: ...


def default_settings() -> dict[str, str]:
    """The environment for the binary: this one without what it reads as a setting, so that it
    runs with its defaults and the flags it is given."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("IDEMPOTENCY_") and name != "DATABASE_URL"
    }


def haproxy_url(environment: Environment, database: str) -> str:
    return f"postgres://postgres@{environment.haproxy}/{database}"


def multihost_url(environment: Environment, database: str) -> str:
    hosts = ",".join(f"{node.ip}:5432" for node in environment.nodes)
    return f"postgres://postgres@{hosts}/{database}?target_session_attrs=read-write"


class Coordinator:
    """One `serve` process: `binary` (else the places' own), listening on `listen` (port 0: a
    free one), with `extra` flags."""

    def __init__(
        self,
        environment: Places,
        name: str,
        url: str,
        extra: tuple[str, ...] = (),
        *,
        binary: str | None = None,
        listen: str = "127.0.0.1:0",
    ) -> None:
        self.environment = environment
        self.name = name
        self.url = url
        self.extra = extra
        self.binary = binary or environment.binary
        self.listen = listen
        self.log = f"{environment.logs}/coordinator-{name}.log"
        self._address_file = f"{environment.work}/coordinator-{name}.address"
        self._pid_file = f"{environment.work}/pids/coordinator-{name}.pid"
        self._process: asyncio.subprocess.Process | None = None
        self.address = ""

    async def start(self, within: float = 60.0) -> None:
        """Starts it and waits until it listens and says SERVING (it migrates the database, and
        creates it, the first time)."""
        Path(self._address_file).unlink(missing_ok=True)
        command = [
            self.binary, "serve",
            "--database-url", self.url,
            "--listen", self.listen,
            "--address-file", self._address_file,
            *self.extra,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                *command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=default_settings(),
                start_new_session=True,
            )
        # test.sh's teardown kills it by this file should the suite die before stopping it; the
        # second line is what its command line must contain for it to be this process.
        Path(self._pid_file).write_text(f"{self._process.pid}\n{self._address_file}\n")
        deadline = time.monotonic() + within
        while not Path(self._address_file).exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise failure(
                    f"coordinator {self.name} did not listen within {within:.0f} s", self.log
                )
            await asyncio.sleep(0.05)
        self.address = Path(self._address_file).read_text().strip()
        while await self.health() != "SERVING":
            self._check_alive()
            if time.monotonic() > deadline:
                raise failure(
                    f"coordinator {self.name} ({self.url}) was not SERVING within {within:.0f} s",
                    self.log,
                )
            await asyncio.sleep(0.1)

    @property
    def returncode(self) -> int | None:
        """Its exit status once it has exited (None while it runs, or before it started)."""
        return None if self._process is None else self._process.returncode

    def _check_alive(self) -> None:
        if self._process is not None and self._process.returncode is not None:
            raise failure(
                f"coordinator {self.name} exited with status {self._process.returncode}", self.log
            )

    async def health(self) -> str:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                answer = await stub.Check(
                    health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0
                )
            except grpc.aio.AioRpcError as error:
                return error.code().name
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))

    async def stop(self, within: float = 40.0) -> None:
        """SIGTERM (it drains within --shutdown-grace, 25 s by default), SIGKILL past `within`
        (at once when `within` is 0: the suite was interrupted)."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        if not within:
            process.kill()
            await process.wait()
            Path(self._pid_file).unlink(missing_ok=True)
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), within)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise SuiteFailure(
                f"coordinator {self.name} did not stop within {within:.0f} s of SIGTERM; "
                f"see {self.log}"
            ) from None
        finally:
            Path(self._pid_file).unlink(missing_ok=True)


def log_summary(path: str) -> str:
    """Counts of a coordinator's WARN and ERROR lines, and its distinct ERROR messages (an
    internal error or a panic during a fault or an upgrade is something to look at, even when
    every assertion held)."""
    warnings = errors = 0
    distinct: list[str] = []
    with open(path, errors="replace") as log:
        for line in log:
            if " WARN " in line:
                warnings += 1
            elif " ERROR " in line or "panicked" in line:
                errors += 1
                message = line.split(" ERROR ", 1)[-1].strip()[:160]
                if message not in distinct:
                    distinct.append(message)
    summary = f"{warnings} WARN lines, {errors} ERROR lines"
    return summary + "".join(f"\n      ERROR {m}" for m in distinct[:5])
