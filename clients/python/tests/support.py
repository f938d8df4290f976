"""Starts the real coordinator binary for each test, on a fresh PostgreSQL database or a fresh
SQLite file, and gives tests a raw view of the service to check what the client did."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2
from psycopg import sql

from idempotency_client._proto.idempotency.v1 import idempotency_pb2 as pb
from idempotency_client._rpc import Stub

REPO = Path(__file__).resolve().parents[3]
POSTGRES_ADMIN_URL = os.environ.get(
    "IDEMPOTENCY_TEST_POSTGRES", "postgres://postgres@127.0.0.1:5432"
)
SERVICE = "idempotency.v1.IdempotencyService"


def workspace_binary(variable: str, name: str) -> str:
    """The binary the environment `variable` names, else the workspace's debug build of `name`;
    fails the test when there is none."""
    binary = Path(os.environ.get(variable, str(REPO / "target" / "debug" / name)))
    if not binary.is_file():
        pytest.fail(
            f"no {name} binary at {binary}: build it (cargo build) or point {variable} at one"
        )
    return str(binary)


def coordinator_binary() -> str:
    return workspace_binary("IDEMPOTENCY_COORDINATOR_BIN", "idempotency-coordinator")


STARTUP_LIMIT = 30.0


def await_condition(condition: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Polls `condition` until it holds; fails the test after `limit` seconds."""
    give_up_at = time.monotonic() + limit
    while not condition():
        if time.monotonic() > give_up_at:
            pytest.fail(f"timed out after {limit}s waiting for {what}")
        time.sleep(0.02)


class Coordinator:
    """One coordinator process; `stop` and `start` again keep its port and its store."""

    def __init__(
        self,
        store_args: Sequence[str],
        extra_args: Sequence[str],
        folder: Path,
        tls_roots: bytes | None = None,
        await_serving: bool = True,
    ) -> None:
        self._tls_roots = tls_roots
        self._await_serving_on_start = await_serving
        self._store_args = list(store_args)
        self._extra_args = list(extra_args)
        self._folder = folder
        self._log_path = folder / f"coordinator-{uuid.uuid4().hex[:8]}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.start("127.0.0.1:0")

    def start(self, listen: str | None = None) -> None:
        address_file = self._folder / f"address-{uuid.uuid4().hex}"
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    coordinator_binary(),
                    "serve",
                    "--listen",
                    listen or self.address,
                    "--address-file",
                    str(address_file),
                    "--shutdown-grace",
                    "5s",
                    *self._store_args,
                    *self._extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        process = self._process

        def listening() -> bool:
            if process.poll() is not None:
                pytest.fail(f"the coordinator exited with {process.returncode}:\n{self.log()}")
            return address_file.exists()

        await_condition(listening, "the coordinator's address file", STARTUP_LIMIT)
        self.address = address_file.read_text().strip()
        if self._await_serving_on_start:
            self._await_serving()

    def _await_serving(self) -> None:
        channel = (
            grpc.insecure_channel(self.address)
            if self._tls_roots is None
            else grpc.secure_channel(self.address, grpc.ssl_channel_credentials(self._tls_roots))
        )
        with channel:
            check = channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )

            def serving() -> bool:
                try:
                    answer = check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1)
                except grpc.RpcError:
                    return False
                return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

            await_condition(serving, "the coordinator to be SERVING", STARTUP_LIMIT)

    def stop(self) -> None:
        """SIGTERM, and the exit status the contract promises for it."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=15)
        assert status == 0, f"the coordinator exited with {status}:\n{self.log()}"

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")


@pytest.fixture(params=["postgres", "sqlite"])
def store_args(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """The store flags of a fresh store: a new PostgreSQL database (the service creates it; it is
    dropped afterwards) or a new SQLite file in the test's own folder."""
    if request.param == "sqlite":
        yield ["--sqlite-path", str(tmp_path / "coordinator.db")]
        return
    database = f"pyclient_{uuid.uuid4().hex}"
    yield ["--database-url", f"{POSTGRES_ADMIN_URL}/{database}"]
    with psycopg.connect(f"{POSTGRES_ADMIN_URL}/postgres", autocommit=True) as connection:
        connection.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
        )


StartCoordinator = Callable[..., Coordinator]


@pytest.fixture
def start_coordinator(store_args: list[str], tmp_path: Path) -> Iterator[StartCoordinator]:
    """Starts coordinators on the test's store, with extra flags; all are stopped afterwards."""
    started: list[Coordinator] = []

    def start(*extra_args: str, tls_roots: bytes | None = None) -> Coordinator:
        coordinator = Coordinator(store_args, extra_args, tmp_path, tls_roots)
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.kill()


@pytest.fixture
def coordinator(start_coordinator: StartCoordinator) -> Coordinator:
    return start_coordinator()


class RawService:
    """The service through its bare RPCs, to set up and inspect keys apart from the client."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self._channel = grpc.insecure_channel(address)
        self.stub = Stub(self._channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def lookup(self, namespace: str, key: str) -> pb.LookupResponse:
        return self.stub.lookup(
            pb.LookupRequest(namespace=namespace, key=key), timeout=10, metadata=self.metadata
        )

    def state(self, namespace: str, key: str) -> str | None:
        state: str | None = self.lookup(namespace, key).WhichOneof("state")
        return state

    def try_start(
        self,
        namespace: str,
        key: str,
        fingerprint: bytes,
        attempt_id: str,
        lease_ttl: float | None = None,
    ) -> pb.TryStartResponse:
        """A bare TryStart: a holder that claims without a client, with the service's default
        lease unless `lease_ttl` (seconds) is given."""
        request = pb.TryStartRequest(
            namespace=namespace, key=key, fingerprint=fingerprint, attempt_id=attempt_id
        )
        if lease_ttl is not None:
            request.lease_ttl.FromTimedelta(dt.timedelta(seconds=lease_ttl))
        return self.stub.try_start(request, timeout=10, metadata=self.metadata)

    def close(self) -> None:
        self._channel.close()


@pytest.fixture
def raw(coordinator: Coordinator) -> Iterator[RawService]:
    service = RawService(coordinator.address)
    yield service
    service.close()


class LogWatch(logging.Handler):
    """Sets `seen` once the client logs a message containing `fragment`, from any thread, and
    counts such messages in `count`."""

    def __init__(self, fragment: str) -> None:
        super().__init__(logging.DEBUG)
        self.fragment = fragment
        self.seen = threading.Event()
        self.count = 0
        self._counted = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if self.fragment in record.getMessage():
            with self._counted:
                self.count += 1
                self._counted.notify_all()
            self.seen.set()

    def reached(self, count: int, limit: float = 10.0) -> bool:
        """Waits until `count` such messages were logged; `False` if they were not in `limit`."""
        with self._counted:
            return self._counted.wait_for(lambda: self.count >= count, limit)


@pytest.fixture
def watch_log() -> Iterator[Callable[[str], LogWatch]]:
    logger = logging.getLogger("idempotency_client")
    previous_level = logger.level
    logger.setLevel(logging.DEBUG)
    watches: list[LogWatch] = []

    def watch(fragment: str) -> LogWatch:
        handler = LogWatch(fragment)
        logger.addHandler(handler)
        watches.append(handler)
        return handler

    yield watch
    for handler in watches:
        logger.removeHandler(handler)
    logger.setLevel(previous_level)


def unique_key() -> str:
    return f"order-{uuid.uuid4().hex[:12]}"


class ReplyDroppingProxy:
    """A TCP proxy in front of the coordinator. Between `drop_replies` and `heal` it forwards
    requests but throws the replies away: a call is carried out by the service, and its answer
    is lost. (gRPC sends calls only on a connection whose setup it has seen answered, so the
    proxy forwards everything until told to drop.)"""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._dropping = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_replies(self) -> None:
        self._dropping.set()

    def heal(self) -> None:
        """Forwards replies from now on, and cuts the connections that lost some, so that the
        client reconnects instead of waiting on a stream whose answer never comes."""
        self._dropping.clear()
        self._cut_all()

    def close(self) -> None:
        self._listener.close()
        self._cut_all()

    def _cut_all(self) -> None:
        with self._lock:
            connections, self._open = self._open, []
        for connection in connections:
            # shutdown wakes the pump threads blocked in recv; close alone would not.
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream)
            with self._lock:
                self._open += [client, upstream]
            for source, sink, is_reply in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(
                    target=self._pump, args=(source, sink, is_reply), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, is_reply: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not (is_reply and self._dropping.is_set()):
                    sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)
