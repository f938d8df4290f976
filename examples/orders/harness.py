"""Runs the whole example as real processes for one scenario: a coordinator on its own fresh
PostgreSQL database, the orders and notifications databases, RabbitMQ names of its own, the
provider stub and every component, plus a client that places orders with retries, and the
counts the scenarios assert on."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import grpc
import psycopg
from idempotency_client._proto.idempotency.v1 import idempotency_pb2 as pb
from idempotency_client._rpc import Stub
from psycopg import sql

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BINARY = Path(
    os.environ.get(
        "IDEMPOTENCY_COORDINATOR_BIN", str(REPO / "target" / "debug" / "idempotency-coordinator")
    )
)
POSTGRES = os.environ.get("EXAMPLE_POSTGRES", "postgres://postgres@127.0.0.1:5432")
AMQP_URL = os.environ.get("EXAMPLE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
#: Orders per scenario: 60 keeps test.sh within its time budget; the README's manual run uses 500.
ORDER_COUNT = int(os.environ.get("EXAMPLE_ORDERS", "60"))
#: Orders placed per second, so that the faults land while orders are still coming in.
ORDER_RATE = float(os.environ.get("EXAMPLE_ORDER_RATE", "30"))

#: The counts of every scenario that ran in this session, for the report (conftest.py).
RESULTS: list[Counts] = []

COMPONENTS = {
    "api": "orders_example.api",
    "relay": "orders_example.relay",
    "payments": "orders_example.payments",
    "notifications": "orders_example.notifications",
    "provider": "orders_example.provider",
}


def await_condition(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Polls `condition` until it holds; raises after `limit` seconds."""
    give_up_at = time.monotonic() + limit
    while not condition():
        if time.monotonic() > give_up_at:
            raise AssertionError(f"timed out after {limit}s waiting for {what}")
        time.sleep(0.05)


class Process:
    """One process this harness started, with its log in the scenario's folder."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], folder: Path) -> None:
        self.name = name
        self.log_path = folder / f"{name}.log"
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, number: signal.Signals) -> None:
        self.popen.send_signal(number)

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def wait(self, limit: float = 30.0) -> int:
        return self.popen.wait(timeout=limit)

    def stopped_by_signal(self) -> bool:
        """True once the process is in state T (stopped), as SIGSTOP leaves it."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def terminate_and_wait(self, limit: float = 30.0) -> int:
        self.signal(signal.SIGTERM)
        return self.wait(limit)

    def kill(self) -> None:
        if not self.exited():
            self.popen.kill()
            self.popen.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def create_database(name: str) -> None:
    with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(name: str) -> None:
    with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as connection:
        connection.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


async def _delete_topology(prefix: str) -> None:
    async with await aio_pika.connect(AMQP_URL) as broker:
        channel = await broker.channel()
        for queue in (f"{prefix}.payments", f"{prefix}.notifications"):
            await channel.queue_delete(queue)
        await channel.exchange_delete(f"{prefix}.events")


class Coordinator:
    """The coordinator binary on a database of its own (it creates it), first on port 0; a
    restart keeps the address, as a restarted pod behind a service name would."""

    def __init__(self, database: str, folder: Path) -> None:
        if not BINARY.is_file():
            raise AssertionError(
                f"no coordinator binary at {BINARY}: build it or set IDEMPOTENCY_COORDINATOR_BIN"
            )
        self.database = database
        self.folder = folder
        self.address = "127.0.0.1:0"
        self.starts = 0
        self.process = self.start()

    def start(self) -> Process:
        self.starts += 1
        address_file = self.folder / f"coordinator-address-{self.starts}"
        process = Process(
            f"coordinator-{self.starts}",
            [
                str(BINARY),
                "serve",
                "--listen",
                self.address,
                "--address-file",
                str(address_file),
                "--database-url",
                f"{POSTGRES}/{self.database}",
                "--shutdown-grace",
                "5s",
            ],
            dict(os.environ),
            self.folder,
        )

        def listening() -> bool:
            if process.exited():
                raise AssertionError(f"the coordinator exited:\n{process.log()}")
            return address_file.exists()

        await_condition(listening, "the coordinator's address file")
        self.address = address_file.read_text().strip()
        self._await_serving()
        self.process = process
        return process

    def _await_serving(self) -> None:
        # The binary's own health check, as a container HEALTHCHECK runs it: exit status 0 once
        # the service answers SERVING for its API.
        def serving() -> bool:
            check = [str(BINARY), "healthcheck", "--addr", self.address, "--timeout", "1s"]
            return subprocess.run(check, capture_output=True, check=False).returncode == 0

        await_condition(serving, "the coordinator to be SERVING")


@dataclass
class OrderRecord:
    """What the client saw for one idempotency key."""

    key: str
    body: dict[str, Any]
    attempts: int = 0
    failed_attempts: list[str] = field(default_factory=list)
    answers: list[tuple[int, dict[str, Any], bool]] = field(
        default_factory=list
    )  # status, body, replayed
    error: str | None = None


class Driver:
    """The API's client: places ORDER_COUNT orders at ORDER_RATE per second from 8 threads,
    each under a key of its own, retrying a failed attempt (connection refused or cut, 409,
    5xx) with the same key and body until it is answered, as a client that does not know
    whether its request landed must. Every fourth order, once answered, is sent again, as a
    client whose answer was lost would, and must be answered from the stored result."""

    def __init__(self, run_id: str, api_address: Callable[[], str], count: int) -> None:
        self.records = [
            OrderRecord(
                key=f"{run_id}-order-{index}",
                body={"customer_id": f"customer-{index % 7}", "amount_cents": 1000 + index},
            )
            for index in range(count)
        ]
        self.api_address = api_address
        self.answered = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, limit: float = 120.0) -> None:
        self._thread.join(limit)
        if self._thread.is_alive():
            raise AssertionError("the client did not finish placing its orders")

    def _run(self) -> None:
        began = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            for index, record in enumerate(self.records):
                pool.submit(self._place, record, began + index / ORDER_RATE)

    def _place(self, record: OrderRecord, not_before: float) -> None:
        delay = not_before - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the load, not synchronisation
        try:
            self._send_until_answered(record)
            if int(record.key.rsplit("-", 1)[1]) % 4 == 0:
                self._send_until_answered(record)
        except Exception as error:  # recorded, and asserted on by the scenario
            record.error = repr(error)
        with self._lock:
            self.answered += 1

    def _send_until_answered(self, record: OrderRecord) -> None:
        pause = 0.05
        give_up_at = time.monotonic() + 60
        while True:
            record.attempts += 1
            outcome = self._send(record)
            if isinstance(outcome, tuple):
                status, body, _ = outcome
                if status in (200, 201):
                    record.answers.append(outcome)
                    return
                if status not in (409, 502, 503, 504):
                    raise AssertionError(f"{record.key}: answered {status} {body}")
                record.failed_attempts.append(str(status))
            else:
                record.failed_attempts.append(outcome)
            if time.monotonic() > give_up_at:
                raise AssertionError(f"{record.key}: no answer after 60 s")
            time.sleep(pause)  # the client's backoff between retries
            pause = min(pause * 2, 1.0)

    def _send(self, record: OrderRecord) -> tuple[int, dict[str, Any], bool] | str:
        host, _, port = self.api_address().rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request(
                "POST",
                "/orders",
                json.dumps(record.body),
                {"Content-Type": "application/json", "Idempotency-Key": record.key},
            )
            response = connection.getresponse()
            body = json.loads(response.read() or b"{}")
            replayed = response.getheader("Idempotent-Replayed") == "true"
            return response.status, body, replayed
        except (OSError, http.client.HTTPException) as error:
            return type(error).__name__
        finally:
            connection.close()


@dataclass
class Counts:
    """One row of the report."""

    scenario: str
    keys_sent: int = 0
    http_attempts: int = 0
    orders_created: int = 0
    events_published: int = 0
    events_republished: int = 0
    provider_keys_charged: int = 0
    provider_calls: int = 0
    provider_repeated_calls: int = 0
    events_notified: int = 0
    notification_deliveries: int = 0
    redeliveries_skipped: int = 0


class System:
    """Everything one scenario runs, on names of its own; `close` kills what is left and drops
    the databases and the broker's queues."""

    def __init__(self, scenario: str, folder: Path) -> None:
        self.scenario = scenario
        self.run_id = uuid.uuid4().hex[:10]
        self.folder = folder
        self.orders_database = f"example_orders_{self.run_id}"
        self.notifications_database = f"example_notifications_{self.run_id}"
        self.coordinator_database = f"example_coordinator_{self.run_id}"
        self.broker_prefix = f"orders-example.{self.run_id}"
        self.processes: list[Process] = []
        self.started = Counter[str]()
        self.coordinator: Coordinator | None = None
        self.api_listen = "127.0.0.1:0"  # the first API picks a port; restarts keep it
        self.provider_address = ""
        try:
            create_database(self.orders_database)
            create_database(self.notifications_database)
            self.coordinator = Coordinator(self.coordinator_database, folder)
            self.provider_address = self._start_listening("provider", {})[1]
        except BaseException:
            self.close()
            raise

    @property
    def coordinator_address(self) -> str:
        assert self.coordinator is not None
        return self.coordinator.address

    # --- components ---

    def _environment(self, extra: dict[str, str]) -> dict[str, str]:
        environment = {
            key: value for key, value in os.environ.items() if not key.startswith("EXAMPLE_FAULT")
        }
        environment.update(
            COORDINATOR_ADDRESS=self.coordinator_address,
            ORDERS_DATABASE_URL=f"{POSTGRES}/{self.orders_database}",
            NOTIFICATIONS_DATABASE_URL=f"{POSTGRES}/{self.notifications_database}",
            AMQP_URL=AMQP_URL,
            BROKER_PREFIX=self.broker_prefix,
            PROVIDER_URL=f"http://{self.provider_address}",
            LEASE_TTL="10",
            RELAY_STUCK_AFTER="2",
        )
        environment.update(extra)
        return environment

    def start(self, component: str, **extra: str) -> Process:
        """Starts a component (EXAMPLE_FAULT* in `extra` arms its fault hook) and waits until
        it announces that it is ready."""
        return self._start_listening(component, extra)[0]

    def _start_listening(self, component: str, extra: dict[str, str]) -> tuple[Process, str]:
        self.started[component] += 1
        name = f"{component}-{self.started[component]}"
        ready = self.folder / f"{name}.ready"
        address_file = self.folder / f"{name}.address"
        extra = {
            "READY_FILE": str(ready),
            "API_ADDRESS_FILE": str(address_file),
            "API_LISTEN": self.api_listen,
            "PROVIDER_ADDRESS_FILE": str(address_file),
            "PROVIDER_LISTEN": "127.0.0.1:0",
            **extra,
        }
        process = Process(
            name,
            [sys.executable, "-m", COMPONENTS[component]],
            self._environment(extra),
            self.folder,
        )
        self.processes.append(process)

        def is_ready() -> bool:
            if process.exited():
                raise AssertionError(
                    f"{name} exited with {process.popen.returncode}:\n{process.log()}"
                )
            return ready.exists()

        await_condition(is_ready, f"{name} to be ready")
        address = address_file.read_text().strip() if address_file.exists() else ""
        if component == "api":
            # Restarts listen where the first one did, so the client's retries find them.
            self.api_listen = address
        return process, address

    def api_address(self) -> str:
        return self.api_listen

    def fault(
        self, point: str, action: str, after: int, marker: Path | None = None
    ) -> dict[str, str]:
        arm = {
            "EXAMPLE_FAULT": point,
            "EXAMPLE_FAULT_ACTION": action,
            "EXAMPLE_FAULT_AFTER": str(after),
        }
        if marker is not None:
            arm["EXAMPLE_FAULT_MARKER"] = str(marker)
        return arm

    # --- observing ---

    def orders_query(self, query: str, *params: object) -> list[tuple[Any, ...]]:
        with psycopg.connect(f"{POSTGRES}/{self.orders_database}") as connection:
            return connection.execute(query.encode(), params).fetchall()

    def notifications_query(self, query: str, *params: object) -> list[tuple[Any, ...]]:
        with psycopg.connect(f"{POSTGRES}/{self.notifications_database}") as connection:
            return connection.execute(query.encode(), params).fetchall()

    def provider_calls(self) -> dict[str, int]:
        host, _, port = self.provider_address.rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            connection.request("GET", "/stats")
            calls: dict[str, int] = json.loads(connection.getresponse().read())["calls"]
            return calls
        finally:
            connection.close()

    def await_settled(self, orders: int, limit: float = 60.0) -> None:
        """Waits until every order is published, its charge is completed in the coordinator (so
        a charge whose holder died is waited for until its takeover finished) and the
        notifications consumer has recorded its event."""
        charged: set[str] = set()

        def settled() -> bool:
            published = self.orders_query("SELECT id::text FROM outbox WHERE status = 'PUBLISHED'")
            if len(published) < orders:
                return False
            # The service's own view, through the client's raw stub (an observer's read; the
            # client has no public Lookup).
            with grpc.insecure_channel(self.coordinator_address) as channel:
                stub = Stub(channel)
                for (event_id,) in published:
                    if event_id in charged:
                        continue
                    state = stub.lookup(
                        pb.LookupRequest(namespace="payments", key=event_id), timeout=10
                    )
                    if state.WhichOneof("state") != "completed":
                        return False
                    charged.add(event_id)
            notified = self.notifications_query(
                "SELECT count(DISTINCT event_id) FROM delivery WHERE first_time"
            )
            return bool(notified[0][0] >= orders)

        await_condition(settled, "every order to be published, charged and notified", limit)

    def counts(self, driver: Driver) -> Counts:
        calls = self.provider_calls()
        return Counts(
            scenario=self.scenario,
            keys_sent=len({record.key for record in driver.records}),
            http_attempts=sum(record.attempts for record in driver.records),
            orders_created=self.orders_query("SELECT count(*) FROM orders")[0][0],
            events_published=self.orders_query(
                "SELECT count(*) FROM outbox WHERE status = 'PUBLISHED'"
            )[0][0],
            events_republished=self.orders_query("SELECT count(*) FROM outbox WHERE claims > 1")[0][
                0
            ],
            provider_keys_charged=len(calls),
            provider_calls=sum(calls.values()),
            provider_repeated_calls=sum(count - 1 for count in calls.values()),
            events_notified=self.notifications_query("SELECT count(*) FROM inbox")[0][0],
            notification_deliveries=self.notifications_query("SELECT count(*) FROM delivery")[0][0],
            redeliveries_skipped=self.notifications_query(
                "SELECT count(*) FROM delivery WHERE NOT first_time"
            )[0][0],
        )

    def close(self) -> None:
        coordinator = [] if self.coordinator is None else [self.coordinator.process]
        for process in [*self.processes, *coordinator]:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                if not process.exited() and process.stopped_by_signal():
                    process.signal(signal.SIGCONT)
            process.kill()
        # Each clean-up on its own, so that one failing (PostgreSQL restarted by somebody else
        # on a shared machine, say) neither skips the others nor hides the scenario's own
        # failure; what is left is named.
        cleanups: list[tuple[str, Callable[[], None]]] = [
            (f"database {name}", functools.partial(drop_database, name))
            for name in (
                self.orders_database,
                self.notifications_database,
                self.coordinator_database,
            )
        ]
        cleanups.append(
            (
                f"RabbitMQ names {self.broker_prefix}.*",
                lambda: asyncio.run(_delete_topology(self.broker_prefix)),
            )
        )
        for what, cleanup in cleanups:
            try:
                cleanup()
            except Exception as error:
                print(f"could not remove {what}: {error!r}", file=sys.stderr)


@contextlib.contextmanager
def running_system(scenario: str, folder: Path) -> Iterator[System]:
    system = System(scenario, folder)
    try:
        yield system
    finally:
        system.close()
