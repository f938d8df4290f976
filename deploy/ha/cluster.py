"""The Patroni cluster as the suite sees it and hurts it.

test.sh built it (the bridge, the namespaces, etcd, three Patroni nodes, HAProxy) and describes
it in environment.json; this module reads that, asks the nodes what they are (Patroni's REST
API, pg_stat_replication), waits for the cluster to be healthy, and makes the faults: SIGKILL
of every process of a node's namespace, iptables rules inside a namespace, a switchover and a
change of Patroni's dynamic configuration through the REST API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg


class SuiteFailure(Exception):
    """An assertion or a bounded wait failed; the message says what, and which log to read."""


def tail(path: str, lines: int = 40) -> str:
    """The last lines of a log, indented, for a failure message."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError as error:
        return f"    ({path} cannot be read: {error})"
    return "\n".join(f"    {line}" for line in text)


def failure(message: str, *logs: str) -> SuiteFailure:
    """A failure that names its logs and shows their last lines."""
    parts = [message]
    for log in logs:
        parts.append(f"  the last lines of {log}:\n{tail(log)}")
    return SuiteFailure("\n".join(parts))


async def until(condition: Callable[[], bool], within: float, what: str, *logs: str) -> None:
    """Waits until `condition` holds, checked every 50 ms; a failure naming `logs` past
    `within` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise failure(f"{what}: not within {within:.0f} s", *logs)
        await asyncio.sleep(0.05)


async def until_async(
    condition: Callable[[], Awaitable[bool]], within: float, what: str, *logs: str
) -> None:
    """The same for a condition that has to ask something (checked every 100 ms)."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise failure(f"{what}: not within {within:.0f} s", *logs)
        await asyncio.sleep(0.1)


@dataclass(frozen=True)
class Node:
    name: str
    namespace: str
    ip: str
    config: str
    start: str
    log: str
    postgres_log: str

    @property
    def dsn(self) -> str:
        return f"host={self.ip} port=5432 user=postgres dbname=postgres connect_timeout=2"

    @property
    def api(self) -> str:
        return f"http://{self.ip}:8008"


@dataclass(frozen=True)
class Environment:
    """What test.sh set up (environment.json)."""

    work: str
    logs: str
    binary: str
    haproxy: str
    haproxy_stats: str
    host_ip: str
    etcd: str
    ttl: int
    loop_wait: int
    retry_timeout: int
    nodes: tuple[Node, ...]

    @classmethod
    def load(cls, path: str) -> Environment:
        data = json.loads(Path(path).read_text())
        patroni = data["patroni"]
        return cls(
            work=data["work"],
            logs=data["logs"],
            binary=data["binary"],
            haproxy=data["haproxy"],
            haproxy_stats=data["haproxy_stats"],
            host_ip=data["host_ip"],
            etcd=data["etcd"],
            ttl=int(patroni["ttl"]),
            loop_wait=int(patroni["loop_wait"]),
            retry_timeout=int(patroni["retry_timeout"]),
            nodes=tuple(Node(**node) for node in data["nodes"]),
        )

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)


async def run(*command: str, limit: float = 10.0, stdin: str | None = None) -> str:
    """Runs a command to its end within `limit` seconds; its output, or a SuiteFailure saying
    why not."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(
            process.communicate(stdin.encode() if stdin is not None else None), limit
        )
    except TimeoutError:
        process.kill()
        await process.wait()
        raise SuiteFailure(f"{' '.join(command)} did not end within {limit} s") from None
    text = output.decode(errors="replace")
    if process.returncode != 0:
        raise SuiteFailure(f"{' '.join(command)} failed ({process.returncode}): {text.strip()}")
    return text


def _http(method: str, url: str, body: object | None, limit: float) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=limit) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode(errors="replace")


async def http(
    method: str, url: str, body: object | None = None, limit: float = 1.0
) -> tuple[int, str]:
    """One HTTP request (urllib, in a thread), answered within `limit` seconds; raises OSError
    when nothing answers."""
    return await asyncio.to_thread(_http, method, url, body, limit)


# The rules of a partition, loaded whole with iptables-restore inside a node's namespace (which
# has no rules of its own), so a fault starts and heals at one instant. Loopback stays open:
# Patroni and its PostgreSQL talk over it, and the suite asks the cut-off node's REST API from
# inside its namespace whether it has demoted itself.
_OPEN = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
COMMIT
"""


def _rules(lines: Sequence[str]) -> str:
    return _OPEN.replace("COMMIT\n", "".join(f"{line}\n" for line in lines) + "COMMIT\n")


def isolated() -> str:
    """The node cut off from everything: the other nodes, etcd, HAProxy, the coordinators."""
    return _rules(
        [
            "-A INPUT -i lo -j ACCEPT",
            "-A INPUT -j DROP",
            "-A OUTPUT -o lo -j ACCEPT",
            "-A OUTPUT -j DROP",
        ]
    )


def cut_from_dcs(host_ip: str, peers: Sequence[str]) -> str:
    """The node cut from etcd (on the host, port 2379) and from its peers' Patroni (REST API,
    port 8008), both ways; PostgreSQL's port stays open to everyone (HAProxy, the coordinators,
    the standbys' replication) and so does its own REST API to the host (HAProxy's check)."""
    lines = [
        "-A INPUT -i lo -j ACCEPT",
        f"-A INPUT -s {host_ip} -p tcp --sport 2379 -j DROP",
        f"-A OUTPUT -d {host_ip} -p tcp --dport 2379 -j DROP",
    ]
    for peer in peers:
        lines += [
            f"-A INPUT -s {peer} -p tcp --dport 8008 -j DROP",
            f"-A INPUT -s {peer} -p tcp --sport 8008 -j DROP",
            f"-A OUTPUT -d {peer} -p tcp --dport 8008 -j DROP",
            f"-A OUTPUT -d {peer} -p tcp --sport 8008 -j DROP",
        ]
    return _rules(lines)


@dataclass(frozen=True)
class Replication:
    """One row of pg_stat_replication on the primary."""

    name: str
    state: str
    sync_state: str


@dataclass(frozen=True)
class Member:
    """A member as Patroni's GET /cluster lists it."""

    name: str
    role: str
    state: str


@dataclass(frozen=True)
class ClusterState:
    primary: Node | None
    replication: tuple[Replication, ...]
    members: tuple[Member, ...]
    haproxy_up: tuple[str, ...]
    problem: str

    def describe(self) -> str:
        primary = self.primary.name if self.primary else "none"
        rows = ", ".join(f"{r.name} {r.state}/{r.sync_state}" for r in self.replication)
        members = ", ".join(f"{m.name} {m.role}/{m.state}" for m in self.members)
        return (
            f"primary {primary}; pg_stat_replication: {rows or 'empty'}; "
            f"Patroni: {members or 'unknown'}; "
            f"HAProxy routes to: {', '.join(self.haproxy_up) or 'nothing'}"
        )


class Cluster:
    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self.nodes = environment.nodes

    async def is_primary(self, node: Node) -> bool:
        """Patroni's own answer (its REST API's /primary, which HAProxy routes by)."""
        try:
            status, _ = await http("OPTIONS", f"{node.api}/primary", limit=0.5)
        except OSError:
            return False
        return status == 200

    async def primaries(self) -> list[Node]:
        answers = await asyncio.gather(*(self.is_primary(node) for node in self.nodes))
        return [node for node, primary in zip(self.nodes, answers, strict=True) if primary]

    async def primary(self) -> Node | None:
        found = await self.primaries()
        return found[0] if len(found) == 1 else None

    async def says_primary_from_inside(self, node: Node) -> bool | None:
        """Whether the node's Patroni calls it the primary, asked from inside its namespace (so
        that a partition does not hide the answer); None when it does not answer at all."""
        try:
            output = await run(
                "ip", "netns", "exec", node.namespace, "curl", "-s", "-o", "/dev/null",
                "-w", "%{http_code}", "-X", "OPTIONS", "--max-time", "1", f"{node.api}/primary",
                limit=5,
            )  # fmt: skip
        except SuiteFailure:
            return None
        code = output.strip()
        return None if code in ("", "000") else code == "200"

    async def replication(self, primary: Node) -> tuple[Replication, ...]:
        async with await psycopg.AsyncConnection.connect(primary.dsn, autocommit=True) as conn:
            cursor = await conn.execute(
                "SELECT application_name, state, sync_state FROM pg_stat_replication"
                " ORDER BY application_name"
            )
            rows = await cursor.fetchall()
        return tuple(Replication(str(name), str(state), str(sync)) for name, state, sync in rows)

    async def setting(self, node: Node, name: str) -> str:
        async with await psycopg.AsyncConnection.connect(node.dsn, autocommit=True) as conn:
            cursor = await conn.execute("SELECT current_setting(%s)", (name,))
            row = await cursor.fetchone()
        return "" if row is None else str(row[0])

    async def write_commits(self, node: Node, limit: float = 1.0) -> bool:
        """A committed write on the node within `limit` seconds (a transactional logical message:
        its commit waits for a synchronous standby exactly as the service's writes do)."""

        async def commit() -> None:
            async with await psycopg.AsyncConnection.connect(node.dsn, autocommit=True) as conn:
                await conn.execute("SELECT pg_logical_emit_message(true, 'ha-check', '')")

        try:
            await asyncio.wait_for(commit(), limit)
        except (TimeoutError, psycopg.Error, OSError):
            return False
        return True

    async def members(self, node: Node) -> tuple[Member, ...]:
        """The members as Patroni's DCS has them (GET /cluster): a `sync_standby` role means the
        DCS's /sync key names the node, which alone makes it a candidate for promotion."""
        try:
            status, body = await http("GET", f"{node.api}/cluster", limit=1.0)
        except OSError:
            return ()
        if status != 200:
            return ()
        members = json.loads(body).get("members", [])
        return tuple(
            Member(str(m["name"]), str(m.get("role")), str(m.get("state"))) for m in members
        )

    async def haproxy_up(self) -> tuple[str, ...]:
        try:
            _, body = await http("GET", self.environment.haproxy_stats, limit=1.0)
        except OSError:
            return ()
        up = []
        for line in body.splitlines():
            fields = line.split(",")
            # pxname, svname, ..., status (the 18th field): the backend's servers that are UP.
            server = fields[1] if len(fields) > 17 and fields[0] == "postgres" else "BACKEND"
            if server not in ("FRONTEND", "BACKEND") and fields[17] == "UP":
                up.append(server)
        return tuple(up)

    async def state(self, synchronous: bool) -> ClusterState:
        """The cluster as it is now, and what keeps it from being healthy ('' when healthy): one
        primary, both standbys streaming from it (pg_stat_replication: Patroni 3.0.2 may report
        lag 0 for a node that does not stream), one of them synchronous in synchronous mode,
        every Patroni member running, HAProxy routing to the primary alone, and a write on the
        primary committing."""
        primaries = await self.primaries()
        haproxy = await self.haproxy_up()
        if len(primaries) != 1:
            names = ", ".join(node.name for node in primaries) or "none"
            return ClusterState(None, (), (), haproxy, f"primaries by Patroni: {names}")
        primary = primaries[0]
        members = await self.members(primary)
        try:
            replication = await asyncio.wait_for(self.replication(primary), 2.0)
        except (TimeoutError, psycopg.Error, OSError) as error:
            return ClusterState(primary, (), members, haproxy, f"pg_stat_replication: {error}")
        streaming = {r.name for r in replication if r.state == "streaming"}
        standbys = {node.name for node in self.nodes if node != primary}
        problems = []
        if not standbys <= streaming:
            problems.append(f"not streaming: {', '.join(sorted(standbys - streaming))}")
        synchronous_now = [r.name for r in replication if r.sync_state == "sync"]
        # Patroni promotes only the standby its DCS's /sync key names: PostgreSQL may already
        # wait for a new synchronous standby a loop before Patroni has recorded it there, and a
        # primary lost in between leaves no candidate at all (strict mode refuses to guess).
        synchronous_by_patroni = [m.name for m in members if m.role == "sync_standby"]
        if synchronous and len(synchronous_now) != 1:
            problems.append("no synchronous standby attached")
        if synchronous and synchronous_by_patroni != synchronous_now:
            problems.append(
                f"Patroni's synchronous standby {synchronous_by_patroni} is not PostgreSQL's "
                f"{synchronous_now}"
            )
        if not synchronous and (synchronous_now or synchronous_by_patroni):
            problems.append(f"a synchronous standby in asynchronous mode: {synchronous_now}")
        if sum(1 for m in members if m.state == "running") != len(self.nodes):
            problems.append("not every Patroni member is running")
        if haproxy != (primary.name,):
            problems.append("HAProxy does not route to the primary alone")
        if not problems and not await self.write_commits(primary):
            problems.append("a write on the primary did not commit within 1 s")
        return ClusterState(primary, replication, members, haproxy, "; ".join(problems))

    async def wait_healthy(self, synchronous: bool, within: float, why: str) -> Node:
        """Waits until the cluster is healthy (see `state`); its primary."""
        deadline = time.monotonic() + within
        while True:
            state = await self.state(synchronous)
            if not state.problem and state.primary is not None:
                return state.primary
            if time.monotonic() > deadline:
                logs = [node.log for node in self.nodes]
                raise failure(
                    f"the cluster was not healthy within {within:.0f} s {why}: {state.problem}\n"
                    f"  {state.describe()}",
                    *logs,
                )
            await asyncio.sleep(0.2)

    async def kill(self, node: Node) -> None:
        """The machine dies: SIGKILL to every process in the node's namespace (Patroni, the
        postmaster, its backends) at once, again until none is left (a dying Patroni may fork)."""
        for _ in range(50):
            pids = (await run("ip", "netns", "pids", node.namespace)).split()
            if not pids:
                return
            with contextlib.suppress(SuiteFailure):
                await run("kill", "-9", *pids)
            await asyncio.sleep(0.05)
        raise SuiteFailure(f"processes in namespace {node.namespace} survived SIGKILL")

    async def start(self, node: Node) -> None:
        """Starts the node's Patroni again (the script test.sh wrote), which brings its
        PostgreSQL back as a standby of whoever holds the leader key (rewound if need be)."""
        process = await asyncio.create_subprocess_exec(
            node.start, stdin=subprocess.DEVNULL, start_new_session=True
        )
        # The script execs Patroni; it runs until the teardown. Its exit status is never read.
        del process

    async def firewall(self, node: Node, rules: str) -> None:
        await run("ip", "netns", "exec", node.namespace, "iptables-restore", stdin=rules)

    async def heal(self, node: Node) -> None:
        await self.firewall(node, _OPEN)

    async def switchover(self, leader: Node, candidate: Node | None) -> str:
        """Patroni's switchover through the REST API; its answer (it waits for the result)."""
        body: dict[str, str] = {"leader": leader.name}
        if candidate is not None:
            body["candidate"] = candidate.name
        status, text = await http("POST", f"{leader.api}/switchover", body, limit=30.0)
        if status != 200:
            raise SuiteFailure(f"switchover from {leader.name} refused ({status}): {text}")
        return text

    async def configure(self, primary: Node, patch: dict[str, object]) -> None:
        """Changes Patroni's dynamic configuration (PATCH /config, as patronictl edit-config)."""
        status, text = await http("PATCH", f"{primary.api}/config", patch, limit=5.0)
        if status != 200:
            raise SuiteFailure(f"PATCH /config {patch} refused ({status}): {text}")
