"""The two replicas behind the load, each in a slot that keeps its ports across replacements:
the client's channel has both addresses (round_robin over a static list), so a replica that
comes back is on the same address, and each replica serves its metrics on its slot's metrics
port, from which the suite learns that the load's calls reach it again."""

from __future__ import annotations

import json
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from cluster import SuiteFailure, http, until_async
from coordinators import Coordinator, Places
from phases import Replacement

SERVICE = "idempotency.v1.IdempotencyService"
REACHED_CALLS = 20
"""Calls of the load a new replica must have answered before the next one is stopped."""
REACH_WITHIN = 20.0

# The client's channel: round_robin over both replicas' addresses (the client passes its
# channel_options to grpc as they are), and a reconnect backoff bounded to half a second, so
# that the channel connects to a replaced replica within half a second of it listening again,
# rather than after grpc's default backoff, which grows to seconds (up to 120) while the replica
# is down and would keep the new replica out of the rotation long after it is SERVING.
#
# And an authority of its own: by default grpc sends the target's whole address list as the
# :authority of every call ("127.0.0.1:A,127.0.0.1:B"), which the service's HTTP/2 server
# refuses as malformed (RST_STREAM PROTOCOL_ERROR, which the client reports as INTERNAL and does
# not retry; after 1024 of them the server closes the connection, GOAWAY ENHANCE_YOUR_CALM).
CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
    ("grpc.default_authority", "localhost"),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now, below the kernel's ephemeral range: a replica gives its port
    up between its exit and its successor's start, and an outgoing connection (the coordinators'
    own to PostgreSQL) could otherwise be given it meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(max(1024, low - 8000), low))
    random.shuffle(candidates)
    found: list[int] = []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise SuiteFailure(f"fewer than {count} free loopback ports below {low}")


async def answered_calls(metrics_port: int) -> int:
    """The calls to the API a replica has answered (grpc_server_handled_total of the service,
    every method and code), from its metrics; -1 when it does not answer."""
    try:
        status, body = await http("GET", f"http://127.0.0.1:{metrics_port}/metrics", limit=1.0)
    except OSError:
        return -1
    if status != 200:
        return -1
    total = 0.0
    for line in body.splitlines():
        if line.startswith("grpc_server_handled_total{") and f'grpc_service="{SERVICE}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


BIND_ATTEMPTS = 3
"""How often a slot's first coordinator is started on fresh ports when its ports were taken."""


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class Release:
    name: str
    """"previous" or "new"."""
    binary: str
    extra: tuple[str, ...] = ()


class Slot:
    """One replica's place: its ports, and the coordinator serving there now."""

    def __init__(self, places: Places, name: str, url: str, port: int, metrics_port: int) -> None:
        self.places = places
        self.name = name
        self.url = url
        self.port = port
        self.metrics_port = metrics_port
        self.current: Coordinator | None = None
        self.release = ""
        self.history: list[Coordinator] = []
        """Every coordinator started here, in order."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _coordinator(self, release: Release) -> Coordinator:
        return Coordinator(
            self.places,
            f"{self.name}-{len(self.history) + 1}-{release.name}",
            self.url,
            ("--metrics-listen", f"127.0.0.1:{self.metrics_port}", *release.extra),
            binary=release.binary,
            listen=self.address,
        )

    async def start(self, release: Release) -> None:
        coordinator = self._coordinator(release)
        self.current = coordinator
        self.history.append(coordinator)
        self.release = release.name
        await coordinator.start()

    async def first_start(self, release: Release) -> None:
        """The slot's first coordinator: a port found free a moment ago may have been taken
        since by a process of the machine's (seen once in CI), so on "Address already in use"
        the slot moves to other free ports, a few times. Later starts keep the slot's ports."""
        for attempt in range(1, BIND_ATTEMPTS + 1):
            try:
                await self.start(release)
                return
            except SuiteFailure:
                log = self.current.log if self.current else ""
                if attempt == BIND_ATTEMPTS or "Address already in use" not in _read(log):
                    raise
                self.port, self.metrics_port = free_ports(2)
                self.history.clear()

    async def replace(self, release: Release) -> Replacement:
        """SIGTERM to the replica here, then the same release's successor `release` on the same
        ports once it has exited, SERVING, and the load's calls reaching it."""
        old = self.current
        assert old is not None
        replacement = Replacement(self.name, self.release, release.name, time.monotonic())
        await old.stop()
        replacement.exited = time.monotonic()
        replacement.exit_status = old.returncode
        await self.start(release)
        replacement.serving = time.monotonic()
        current = self.current
        assert current is not None

        async def reached() -> bool:
            return await answered_calls(self.metrics_port) >= REACHED_CALLS

        await until_async(
            reached,
            REACH_WITHIN,
            f"{REACHED_CALLS} of the load's calls answered by {current.name} at {self.address}",
            current.log,
        )
        replacement.routed = time.monotonic()
        return replacement

    async def stop(self, interrupted: bool) -> None:
        if self.current is not None:
            await self.current.stop(within=0 if interrupted else 40)
