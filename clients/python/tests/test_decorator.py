"""`@idempotent` against the real coordinator."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import Coordinator, RawService, unique_key

from idempotency_client import (
    AsyncIdempotencyClient,
    FingerprintMismatch,
    IdempotencyClient,
    idempotent,
)


def test_a_decorated_function_runs_once_per_key(coordinator: Coordinator, raw: RawService) -> None:
    order_id = unique_key()
    charged: list[dict[str, Any]] = []

    with IdempotencyClient(coordinator.address) as client:

        @idempotent(
            client,
            namespace="payments",
            key=lambda order: f"{order['id']}:charge",
            fingerprint=lambda order: {"amount": order["amount"]},
        )
        def charge(order: dict[str, Any]) -> dict[str, Any]:
            charged.append(order)
            return {"charge": f"ch_{len(charged)}", "amount": order["amount"]}

        first = charge({"id": order_id, "amount": 1999, "trace": "a"})
        # Another trace id is outside the fingerprint: the same request, so it is replayed.
        second = charge({"id": order_id, "amount": 1999, "trace": "b"})
        with pytest.raises(FingerprintMismatch):
            charge({"id": order_id, "amount": 2500, "trace": "c"})

    assert first == second == {"charge": "ch_1", "amount": 1999}
    assert len(charged) == 1
    assert raw.state("payments", f"{order_id}:charge") == "completed"


def test_a_decorated_coroutine_runs_once_per_key(coordinator: Coordinator) -> None:
    order_id = unique_key()
    charged: list[str] = []

    async def main() -> tuple[str, str]:
        async with AsyncIdempotencyClient(coordinator.address) as client:

            @idempotent(client, namespace="payments", key=lambda order_id, amount: order_id)
            async def charge(order_id: str, amount: int) -> str:
                charged.append(order_id)
                return f"charged {amount}"

            return await charge(order_id, 500), await charge(order_id, 500)

    assert asyncio.run(main()) == ("charged 500", "charged 500")
    assert charged == [order_id]
