"""What every component of the example shares: settings from the environment, the test-only
fault hook, graceful-shutdown wiring, serving HTTP, the broker's topology and the address file."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue
from aiohttp import web

log = logging.getLogger("orders_example")


def setting(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        sys.exit(f"the environment variable {name} must be set")
    return value


def seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, str(default)))


def configure_logging(component: str) -> None:
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {component}[{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def run_component(component: str, serve: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """A component's entry point: its logging, then `serve` until it returns."""
    configure_logging(component)
    asyncio.run(serve())


# --- The fault hook (test-only) -------------------------------------------------------------
#
# The scenarios in test_orders.py must crash a component at one exact point ("after the commit,
# before answering"), which a signal sent from outside at a random moment cannot do. So each
# component calls `fault_point(name)` at the points the write-up names; when EXAMPLE_FAULT names
# that point, the process acts there. Unset (the default, and in any real deployment), it does
# nothing.
#
#   EXAMPLE_FAULT         the point, e.g. api.after_commit
#   EXAMPLE_FAULT_AFTER   act the k-th time the point is reached (default 1), so that the fault
#                         lands under load rather than on the first request
#   EXAMPLE_FAULT_ACTION  kill: SIGKILL itself (a crash: no cleanup, no answer, nothing flushed)
#                         stop: SIGSTOP itself (a hung process holding what it claimed)
#                         hold: wait until shutdown is requested (SIGTERM), then carry on, so a
#                               test can deliver SIGTERM in the middle of the work
#   EXAMPLE_FAULT_MARKER  a file created when the point acts, so a test can await it


@dataclass
class _Fault:
    point: str
    after: int
    action: str
    marker: Path | None
    reached: int = 0


def _fault_from_environment() -> _Fault | None:
    point = os.environ.get("EXAMPLE_FAULT")
    if not point:
        return None
    action = os.environ.get("EXAMPLE_FAULT_ACTION", "kill")
    if action not in ("kill", "stop", "hold"):
        sys.exit(f"EXAMPLE_FAULT_ACTION must be kill, stop or hold, not {action!r}")
    marker = os.environ.get("EXAMPLE_FAULT_MARKER")
    return _Fault(
        point=point,
        after=int(os.environ.get("EXAMPLE_FAULT_AFTER", "1")),
        action=action,
        marker=Path(marker) if marker else None,
    )


_fault = _fault_from_environment()


async def fault_point(point: str, shutdown: Shutdown | None = None) -> None:
    """Acts as EXAMPLE_FAULT says if it names `point` and this is its k-th arrival."""
    if _fault is None or _fault.point != point:
        return
    _fault.reached += 1
    if _fault.reached != _fault.after:
        return
    log.warning("fault hook: %s at %s (arrival %d)", _fault.action, point, _fault.reached)
    if _fault.marker is not None:
        _fault.marker.touch()
    if _fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif _fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif shutdown is not None:
        await shutdown.requested.wait()
        log.warning("fault hook: shutdown requested; carrying on at %s", point)


# --- Graceful shutdown ----------------------------------------------------------------------


class Shutdown:
    """SIGTERM and SIGINT set `requested`; they never cancel work. Each component checks it
    between units of work (a request accepted, a batch, a message) and finishes the unit it is
    in: a signal must not cut a batch between publishing and marking it."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, self._request, number)

    def _request(self, number: int) -> None:
        log.info(
            "%s received: finishing the work in hand, then stopping", signal.Signals(number).name
        )
        self.requested.set()


def announce_ready() -> None:
    """Creates the file READY_FILE names, if any, once the component is doing its job, so that
    a supervisor or a test can await readiness instead of guessing how long a start takes."""
    ready_file = os.environ.get("READY_FILE")
    if ready_file:
        Path(ready_file).touch()


async def serve_http(
    runner: web.AppRunner, listen: str, address_file: str, what: str, shutdown: Shutdown
) -> None:
    """Serves `runner`'s app on `listen` (host:port; port 0 picks one) until shutdown is
    requested: writes the bound address to `address_file`, if named, and announces readiness
    once it listens. The runner's cleanup stops accepting, then lets requests in flight finish."""
    host, _, port = listen.rpartition(":")
    await runner.setup()
    await web.TCPSite(runner, host, int(port)).start()
    bound_host, bound_port = runner.addresses[0][:2]
    write_address_file(address_file, bound_host, bound_port)
    log.info("%s listening on %s:%d", what, bound_host, bound_port)
    announce_ready()
    await shutdown.requested.wait()
    await runner.cleanup()


def write_address_file(path: str | None, host: str, port: int) -> None:
    """Writes host:port aside and renames it into place, so a reader never sees half of it."""
    if not path:
        return
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(f"{host}:{port}\n")
    partial.replace(target)


# --- The broker's topology ------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """One exchange that the relay publishes every event to, and a durable queue per consumer
    bound to it. Every component declares all of it (declaring is idempotent), so none has to
    start first and no event is published before the queues that must receive it exist."""

    exchange: str
    payments_queue: str
    notifications_queue: str

    @staticmethod
    def from_environment() -> Topology:
        prefix = setting("BROKER_PREFIX", "orders")
        return Topology(f"{prefix}.events", f"{prefix}.payments", f"{prefix}.notifications")

    async def declare(
        self, channel: AbstractChannel
    ) -> tuple[AbstractExchange, dict[str, AbstractQueue]]:
        exchange = await channel.declare_exchange(
            self.exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        queues: dict[str, AbstractQueue] = {}
        for name in (self.payments_queue, self.notifications_queue):
            queue = await channel.declare_queue(name, durable=True)
            await queue.bind(exchange)
            queues[name] = queue
        return exchange, queues


def amqp_url() -> str:
    return setting("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
