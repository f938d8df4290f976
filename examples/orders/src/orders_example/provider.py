"""A stand-in payment provider that honours Idempotency-Key, as real ones do, and counts.

`POST /charges` with an Idempotency-Key: the first call with a key charges (201, a new
charge id); a repeat with the same body returns that charge (200) without charging again; a
repeat with another body is refused (422). `GET /stats` reports the calls per key, which the
scenarios use to check that every order was charged exactly once and to find repeated calls.
State is in memory: the stub is never crashed by the scenarios.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from aiohttp import web

from .common import Shutdown, run_component, serve_http, setting

log = logging.getLogger("orders_example.provider")


@dataclass
class Charge:
    charge_id: str
    body: str
    calls: int


async def serve() -> None:
    shutdown = Shutdown()
    shutdown.install()
    charges: dict[str, Charge] = {}

    async def create_charge(request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key", "")
        if not key:
            return web.json_response({"error": "IDEMPOTENCY_KEY_REQUIRED"}, status=400)
        body = json.dumps(await request.json(), sort_keys=True)
        # No await between the lookup and the insert: one event loop, so this is atomic.
        charge = charges.get(key)
        if charge is None:
            charge = charges[key] = Charge(f"ch_{uuid.uuid4().hex[:16]}", body, 1)
            return web.json_response({"charge_id": charge.charge_id}, status=201)
        charge.calls += 1
        if charge.body != body:
            return web.json_response({"error": "IDEMPOTENCY_KEY_REUSED"}, status=422)
        log.info("repeated call for key %s (%d calls)", key, charge.calls)
        return web.json_response({"charge_id": charge.charge_id}, status=200)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"calls": {key: c.calls for key, c in charges.items()}})

    app = web.Application()
    app.router.add_post("/charges", create_charge)
    app.router.add_get("/stats", stats)
    listen = setting("PROVIDER_LISTEN", "127.0.0.1:8090")
    address_file = setting("PROVIDER_ADDRESS_FILE", "")
    await serve_http(web.AppRunner(app), listen, address_file, "payment provider", shutdown)


def main() -> None:
    run_component("provider", serve)


if __name__ == "__main__":
    main()
