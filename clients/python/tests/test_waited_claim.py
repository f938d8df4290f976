"""A claim that waited (docs/contract.md, "Client defaults"): when the TryStart that claimed a key
took long, `run_once` renews the lease before the work starts and counts the lease from that
renewal, in both clients. The service holds the TryStart while a holder that claimed straight
from the coordinator keeps the key until its lease runs out; `fault-proxy` between the client
and the coordinator faults the renewal or the heartbeat after it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from support import Coordinator, LogWatch, RawService, unique_key
from test_scenarios import FaultProxy

from idempotency_client import (
    AsyncIdempotencyClient,
    IdempotencyClient,
    LeaseLost,
    Outcome,
    Unavailable,
    fingerprint_of,
)
from idempotency_client._core import RunOnceOptions

T = TypeVar("T")

NAMESPACE = "orders"
ORDER = {"order_id": 7, "amount": {"currency": "EUR", "cents": 500}}
LIMIT = 10.0
"""Seconds a run waits for the holder, and the work for what should come within a heartbeat."""

# The rule's own faults: the next ExtendLease answered without reaching the coordinator.
HEARTBEAT_UNREACHABLE = {
    "method": "ExtendLease",
    "action": "status",
    "code": "UNAVAILABLE",
    "times": 1,
}
EVERY_EXTEND_UNREACHABLE = {**HEARTBEAT_UNREACHABLE, "times": -1}
RENEWAL_REFUSALS = {
    "lease_lost": {"code": "ABORTED", "reason": "LEASE_LOST"},
    "key_not_found": {"code": "NOT_FOUND", "reason": "KEY_NOT_FOUND"},
}

# What the work does, written once for both clients: it is given a way to ask whether the client
# has cancelled it (the sync client's `threading.Event`; the asyncio client's `asyncio.Event`,
# read from the thread the asyncio work runs this in).
Body = Callable[[Callable[[], bool]], T]


def run_once(
    flavour: str, address: str, key: str, body: Body[T], *, lease_ttl: float
) -> Outcome[T]:
    """`run_once` of the sync or the asyncio client through `address`, waiting for a holder, with
    `body` as its work (in the asyncio client, on a thread of its own: the task that awaits it
    is cancelled on a lost lease)."""
    run_options: RunOnceOptions = {"request": ORDER, "lease_ttl": lease_ttl, "wait": LIMIT}
    if flavour == "sync":
        with IdempotencyClient(address) as client:
            return client.run_once(
                NAMESPACE, key, lambda lease: body(lease.cancelled.is_set), **run_options
            )

    async def run_async() -> Outcome[T]:
        async with AsyncIdempotencyClient(address) as client:
            return await client.run_once(
                NAMESPACE,
                key,
                lambda lease: asyncio.to_thread(body, lease.cancelled.is_set),
                **run_options,
            )

    return asyncio.run(run_async())


def claim_by_a_crashed_holder(raw: RawService, key: str, lease_ttl: float) -> None:
    """A holder that claims the key straight from the coordinator and dies: its lease runs out
    after `lease_ttl` seconds, and until then the service holds a waiting TryStart."""
    answer = raw.try_start(
        NAMESPACE, key, fingerprint_of(ORDER), attempt_id="crashed-holder", lease_ttl=lease_ttl
    )
    assert answer.WhichOneof("outcome") == "started", answer


@pytest.fixture
def proxy(coordinator: Coordinator, tmp_path: Path) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(coordinator.address, tmp_path)
    yield fault_proxy
    fault_proxy.close()


FLAVOURS = ["sync", "asyncio"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_heartbeat_that_fails_right_after_a_long_wait_does_not_cancel_the_work(
    flavour: str,
    proxy: FaultProxy,
    raw: RawService,
    watch_log: Callable[[str], LogWatch],
) -> None:
    # The wait (2 s) is longer than the lease (1.5 s): counted from the TryStart's sending, the
    # lease has run out before the work starts, and the first failed heartbeat (0.5 s in) would
    # cancel the work. Counted from the renewal's sending, 1 s of it is left then.
    key = unique_key()
    claim_by_a_crashed_holder(raw, key, lease_ttl=2.0)
    heartbeat_failed = watch_log("heartbeat failed, trying again")
    seen: dict[str, object] = {}

    def body(cancelled: Callable[[], bool]) -> str:
        seen["extends_before_the_work"] = len(proxy.calls().get("ExtendLease", []))
        proxy.post("/faults", HEARTBEAT_UNREACHABLE)
        seen["heartbeat_failed"] = heartbeat_failed.reached(1, LIMIT)
        seen["cancelled"] = cancelled()
        return "shipped"

    outcome = run_once(flavour, proxy.address, key, body, lease_ttl=1.5)

    assert (outcome.value, outcome.replayed) == ("shipped", False)
    # The renewal came before the work started, and the heartbeat after it failed while the
    # work ran, without cancelling it.
    assert seen == {"extends_before_the_work": 1, "heartbeat_failed": True, "cancelled": False}
    assert raw.lookup(NAMESPACE, key).completed.response == b'"shipped"'


@pytest.mark.parametrize("refusal", list(RENEWAL_REFUSALS))
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_renewal_refused_after_a_long_wait_is_a_lost_lease_and_the_work_does_not_run(
    flavour: str, refusal: str, proxy: FaultProxy, raw: RawService
) -> None:
    key = unique_key()
    claim_by_a_crashed_holder(raw, key, lease_ttl=0.5)
    proxy.post(
        "/faults",
        {"method": "ExtendLease", "action": "status", "times": 1, **RENEWAL_REFUSALS[refusal]},
    )
    ran: list[bool] = []

    with pytest.raises(LeaseLost):
        run_once(flavour, proxy.address, key, lambda cancelled: ran.append(True), lease_ttl=2.0)

    calls = proxy.calls()
    assert ran == []
    assert len(calls["ExtendLease"]) == 1, calls
    # Nothing released: the key is no longer this caller's to give up.
    assert "Release" not in calls, calls
    assert "Complete" not in calls, calls


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_renewal_that_cannot_get_through_is_retried_within_the_lease_then_releases_the_key(
    flavour: str, proxy: FaultProxy, raw: RawService
) -> None:
    # The wait (0.5 s) leaves 1.5 s of the 2 s lease for the renewal's retries, far less than
    # the retry budget (30 s): the lease, counted from the TryStart's sending, bounds them.
    key = unique_key()
    claim_by_a_crashed_holder(raw, key, lease_ttl=0.5)
    proxy.post("/faults", EVERY_EXTEND_UNREACHABLE)
    ran: list[bool] = []

    began = time.monotonic()
    with pytest.raises(Unavailable):
        run_once(flavour, proxy.address, key, lambda cancelled: ran.append(True), lease_ttl=2.0)
    elapsed = time.monotonic() - began

    calls = proxy.calls()
    assert ran == []
    assert len(calls["ExtendLease"]) >= 2, f"the renewal was not retried: {calls}"
    assert elapsed < 10, f"the renewal was retried past its lease: {elapsed:.1f}s"
    # Released, so that a retry need not wait for the lease to run out.
    assert len(calls["Release"]) == 1, calls
    assert raw.state(NAMESPACE, key) == "absent"
