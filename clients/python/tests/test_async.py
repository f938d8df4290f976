"""The asyncio client against the real coordinator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from support import Coordinator, LogWatch, RawService, unique_key

from idempotency_client import AsyncIdempotencyClient, AsyncLease, FingerprintMismatch, LeaseLost

ORDER = {"order_id": 7}


def test_async_concurrent_callers_run_the_work_once(
    coordinator: Coordinator, watch_log: Callable[[str], LogWatch]
) -> None:
    key = unique_key()
    runs: list[int] = []
    try_starts = watch_log("claiming key")

    async def main() -> None:
        holding = asyncio.Event()

        async def charge(lease: AsyncLease) -> dict[str, str]:
            runs.append(lease.attempt)
            holding.set()
            # Finish only once the other caller has sent its TryStart, and while this holder
            # still holds, it is not answered: it waits on the service rather than polling.
            assert await asyncio.to_thread(try_starts.reached, 2)
            done, _ = await asyncio.wait([second_run], timeout=0.5)
            assert not done
            return {"charge": "ch_async"}

        async with (
            AsyncIdempotencyClient(coordinator.address) as first,
            AsyncIdempotencyClient(coordinator.address) as second,
        ):
            first_run = asyncio.create_task(first.run_once("orders", key, charge, request=ORDER))
            await asyncio.wait_for(holding.wait(), 10)
            second_run = asyncio.create_task(
                second.run_once("orders", key, charge, request=ORDER, wait=10)
            )
            outcomes = await asyncio.wait_for(asyncio.gather(first_run, second_run), 30)
            assert try_starts.count == 2  # one per caller: the second waited on the service
            with pytest.raises(FingerprintMismatch):
                await second.run_once("orders", key, charge, request={"order_id": 8})

        assert outcomes[0].value == outcomes[1].value == {"charge": "ch_async"}
        assert [outcome.replayed for outcome in outcomes] == [False, True]

    asyncio.run(main())
    assert runs == [1]


def test_async_lost_lease_cancels_the_work_task(coordinator: Coordinator, raw: RawService) -> None:
    key = unique_key()
    work_was_cancelled: list[bool] = []

    async def main() -> None:
        holding = asyncio.Event()

        async def stalled(lease: AsyncLease) -> str:
            holding.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                work_was_cancelled.append(lease.cancelled.is_set())
                raise
            return "first"

        async def takeover(lease: AsyncLease) -> str:
            return "second"

        async with AsyncIdempotencyClient(coordinator.address) as client:
            first_run = asyncio.create_task(
                client.run_once("orders", key, stalled, request=ORDER, lease_ttl=0.5, heartbeat=2)
            )
            await asyncio.wait_for(holding.wait(), 10)
            second = await client.run_once("orders", key, takeover, request=ORDER, wait=10)
            assert (second.value, second.replayed) == ("second", False)
            with pytest.raises(LeaseLost):
                await asyncio.wait_for(first_run, 10)

    asyncio.run(main())
    assert work_was_cancelled == [True]
    assert raw.lookup("orders", key).completed.response == b'"second"'


def test_async_a_plain_function_s_value_is_the_result_and_the_key_completes(
    coordinator: Coordinator, raw: RawService
) -> None:
    key = unique_key()
    runs: list[int] = []

    def charge(lease: AsyncLease) -> dict[str, str]:
        runs.append(lease.attempt)
        return {"charge": "ch_sync"}

    async def main() -> None:
        async with AsyncIdempotencyClient(coordinator.address) as client:
            # Typed for coroutine functions; a plain function, passed by untyped code, is still
            # run once and its value completed.
            untyped: Any = charge
            first = await client.run_once("orders", key, untyped, request=ORDER)
            again = await client.run_once("orders", key, untyped, request=ORDER)
        assert first.value == again.value == {"charge": "ch_sync"}
        assert (first.replayed, again.replayed) == (False, True)

    asyncio.run(main())
    assert runs == [1]
    assert raw.state("orders", key) == "completed"


def test_async_work_that_can_never_give_a_result_is_refused_before_claiming(
    coordinator: Coordinator, raw: RawService
) -> None:
    key = unique_key()

    async def generator(lease: AsyncLease) -> AsyncIterator[int]:
        yield lease.attempt

    async def main() -> None:
        async with AsyncIdempotencyClient(coordinator.address) as client:
            for work in (generator, "not callable"):
                with pytest.raises(TypeError, match="work must be a coroutine function"):
                    await client.run_once("orders", key, work, request=ORDER)  # type: ignore[arg-type]

    asyncio.run(main())
    assert raw.state("orders", key) == "absent"
