"""The orders API: `POST /orders` with an Idempotency-Key header.

One request = one transaction in the orders database that writes the order and its outbox row
(PENDING). The request runs under the coordinator's `run_once`, so a retry of a request that was
answered gets the stored answer, a retry while the first is still running waits for it (or gets
409), and a retry with the same key and another body gets 422.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import psycopg
from aiohttp import web
from idempotency_client import (
    AsyncIdempotencyClient,
    AsyncLease,
    FingerprintMismatch,
    IdempotencyError,
    InProgress,
    LeaseLost,
)
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from . import schema
from .common import Shutdown, fault_point, run_component, seconds, serve_http, setting

log = logging.getLogger("orders_example.api")

NAMESPACE = "orders"


class OrdersApi:
    def __init__(
        self, pool: AsyncConnectionPool, coordinator: AsyncIdempotencyClient, shutdown: Shutdown
    ) -> None:
        self.pool = pool
        self.coordinator = coordinator
        self.shutdown = shutdown
        # How long a claim is held without a heartbeat: after a crash, a retry waits this long.
        self.lease_ttl = seconds("LEASE_TTL", 30.0)
        # How long a retry waits for another holder of its key before answering 409.
        self.wait = seconds("IN_PROGRESS_WAIT", self.lease_ttl + 5.0)

    async def create_order(self, request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key", "")
        if not key:
            return error(400, "IDEMPOTENCY_KEY_REQUIRED", "send an Idempotency-Key header")
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error(400, "INVALID_JSON", "the body must be JSON")
        if not (
            isinstance(body, dict)
            and isinstance(body.get("customer_id"), str)
            and isinstance(body.get("amount_cents"), int)
            and body["amount_cents"] > 0
        ):
            return error(400, "INVALID_ORDER", "need customer_id (string), amount_cents (> 0)")
        customer_id: str = body["customer_id"]
        amount_cents: int = body["amount_cents"]

        async def work(lease: AsyncLease) -> dict[str, Any]:
            return await self._write_order(key, customer_id, amount_cents)

        try:
            outcome = await self.coordinator.run_once(
                NAMESPACE,
                key,
                work,
                request={"customer_id": customer_id, "amount_cents": amount_cents},
                lease_ttl=self.lease_ttl,
                wait=self.wait,
            )
        except InProgress as busy:
            response = error(409, "IN_PROGRESS", "a request with this key is still running")
            response.headers["Retry-After"] = str(max(1, round(busy.retry_after or 1)))
            return response
        except LeaseLost:
            # This request's claim ran out and another request with the key took it over; that
            # one's answer is the answer, and a retry gets it.
            response = error(409, "IN_PROGRESS", "a request with this key is still running")
            response.headers["Retry-After"] = "1"
            return response
        except FingerprintMismatch:
            return error(422, "IDEMPOTENCY_KEY_REUSED", "this key was used for another request")
        except IdempotencyError:
            # The coordinator could not be reached or failed: nothing is known to be done, so
            # the client must retry with the same key.
            return error(503, "COORDINATOR_UNAVAILABLE", "try again with the same key")
        except psycopg.Error:
            # The work failed, so run_once released the key: a retry starts afresh.
            log.exception("order not written")
            return error(503, "DATABASE_UNAVAILABLE", "try again with the same key")
        answer = outcome.value
        response = web.json_response(answer["body"], status=answer["status"])
        response.headers["Idempotent-Replayed"] = "true" if outcome.replayed else "false"
        return response

    async def _write_order(self, key: str, customer_id: str, amount_cents: int) -> dict[str, Any]:
        order_id = uuid.uuid4()
        event_id = uuid.uuid4()
        async with self.pool.connection() as connection, connection.transaction():
            inserted = await (
                await connection.execute(
                    "INSERT INTO orders (id, idempotency_key, customer_id, amount_cents)"
                    " VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT (idempotency_key) DO NOTHING RETURNING id",
                    (order_id, key, customer_id, amount_cents),
                )
            ).fetchone()
            if inserted is None:
                # An earlier holder of this key committed the order and died before it could
                # Complete; its order is the answer, and it already has its outbox row.
                row = await (
                    await connection.execute(
                        "SELECT id FROM orders WHERE idempotency_key = %s", (key,)
                    )
                ).fetchone()
                assert row is not None
                order_id = row[0]
                log.info("order for a taken-over key was already committed: %s", order_id)
            else:
                payload = {
                    "event_id": str(event_id),
                    "order_id": str(order_id),
                    "customer_id": customer_id,
                    "amount_cents": amount_cents,
                }
                await connection.execute(
                    "INSERT INTO outbox (id, aggregate_id, event_type, payload)"
                    " VALUES (%s, %s, 'OrderCreated', %s)",
                    (event_id, order_id, Jsonb(payload)),
                )
        await fault_point("api.after_commit", self.shutdown)
        return {
            "status": 201,
            "body": {
                "order_id": str(order_id),
                "customer_id": customer_id,
                "amount_cents": amount_cents,
            },
        }


def error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": code, "message": message}, status=status)


async def serve() -> None:
    shutdown = Shutdown()
    shutdown.install()
    database_url = setting("ORDERS_DATABASE_URL")
    await asyncio.to_thread(schema.ensure, database_url, schema.ORDERS)
    async with (
        AsyncConnectionPool(database_url, min_size=1, max_size=8, open=False) as pool,
        AsyncIdempotencyClient(setting("COORDINATOR_ADDRESS", "127.0.0.1:50051")) as coordinator,
    ):
        api = OrdersApi(pool, coordinator, shutdown)
        app = web.Application()
        app.router.add_post("/orders", api.create_order)
        # On shutdown the runner stops accepting, then gives requests in flight this long.
        runner = web.AppRunner(app, shutdown_timeout=seconds("SHUTDOWN_GRACE", 20.0))
        listen = setting("API_LISTEN", "127.0.0.1:8080")
        address_file = setting("API_ADDRESS_FILE", "")
        await serve_http(runner, listen, address_file, "orders API", shutdown)
    log.info("stopped")


def main() -> None:
    run_component("api", serve)


if __name__ == "__main__":
    main()
