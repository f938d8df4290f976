"""The outbox relay: PENDING -> PUBLISHING -> PUBLISHED, with publisher confirms.

Each batch: claim up to RELAY_BATCH_SIZE PENDING rows (FOR UPDATE SKIP LOCKED, so relays running
side by side never take the same row) and mark them PUBLISHING in one statement; publish them
and await the broker's confirms; mark them PUBLISHED. A relay that dies between publishing and
marking leaves its rows PUBLISHING: every relay, before each batch, puts rows PUBLISHING for
longer than RELAY_STUCK_AFTER back to PENDING, and they are published again. Publishing is thus
at least once; the consumers deduplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aio_pika
import psycopg
from aio_pika.abc import AbstractExchange

from . import schema
from .common import (
    Shutdown,
    Topology,
    amqp_url,
    announce_ready,
    fault_point,
    run_component,
    seconds,
    setting,
)

log = logging.getLogger("orders_example.relay")

RESET_STUCK = """
UPDATE outbox SET status = 'PENDING', locked_at = NULL
WHERE status = 'PUBLISHING' AND locked_at < now() - make_interval(secs => %s)
"""

CLAIM_BATCH = """
UPDATE outbox SET status = 'PUBLISHING', locked_at = now(), claims = claims + 1
WHERE id IN (
    SELECT id FROM outbox WHERE status = 'PENDING'
    ORDER BY created_at LIMIT %s
    FOR UPDATE SKIP LOCKED
)
RETURNING id, event_type, payload, created_at
"""

MARK_PUBLISHED = """
UPDATE outbox SET status = 'PUBLISHED', published_at = now(), locked_at = NULL
WHERE id = ANY(%s) AND status = 'PUBLISHING'
"""


class Relay:
    def __init__(
        self,
        connection: psycopg.AsyncConnection[Any],
        exchange: AbstractExchange,
        shutdown: Shutdown,
    ) -> None:
        self.connection = connection
        self.exchange = exchange
        self.shutdown = shutdown
        self.batch_size = int(setting("RELAY_BATCH_SIZE", "20"))
        self.stuck_after = seconds("RELAY_STUCK_AFTER", 30.0)
        self.idle_pause = seconds("RELAY_POLL_INTERVAL", 0.1)
        self.batch_timeout = seconds("RELAY_BATCH_TIMEOUT", 20.0)

    async def run(self) -> None:
        # SIGTERM only sets `shutdown.requested`; it is checked here, between batches, and never
        # interrupts one. A batch cut between publish and mark would be published again after
        # the stuck timeout: harmless, but exactly the duplicate graceful shutdown should avoid.
        # Each batch has its own timeout instead, so a hung database or broker cannot hold the
        # shutdown until the orchestrator's SIGKILL.
        while not self.shutdown.requested.is_set():
            try:
                published = await asyncio.wait_for(self.one_batch(), self.batch_timeout)
            except (
                psycopg.Error,
                aio_pika.exceptions.AMQPError,
                aio_pika.exceptions.ChannelInvalidStateError,
                TimeoutError,
            ):
                # The rows this batch claimed stay PUBLISHING and come back after the reset; the
                # robust connection reopens the channel if that was what failed.
                log.exception("batch failed; trying again")
                published = 0
            if published == 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.shutdown.requested.wait(), self.idle_pause)

    async def one_batch(self) -> int:
        reset = await self.connection.execute(RESET_STUCK, (self.stuck_after,))
        if reset.rowcount:
            log.warning("reset %d rows stuck in PUBLISHING to PENDING", reset.rowcount)
        rows = await (await self.connection.execute(CLAIM_BATCH, (self.batch_size,))).fetchall()
        if not rows:
            return 0
        rows.sort(key=lambda row: row[3])
        await fault_point("relay.after_claim", self.shutdown)
        # Publish the whole batch, then await every confirm: the broker confirms in a pipeline
        # instead of one round trip per event. A nack or an unroutable event raises, and the
        # batch stays PUBLISHING until the reset publishes it again.
        await asyncio.gather(
            *(
                self.exchange.publish(
                    aio_pika.Message(
                        json.dumps(payload).encode(),
                        message_id=str(event_id),
                        type=event_type,
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=event_type,
                    mandatory=True,
                )
                for event_id, event_type, payload, _ in rows
            )
        )
        await fault_point("relay.after_publish", self.shutdown)
        await self.connection.execute(MARK_PUBLISHED, ([row[0] for row in rows],))
        log.info("published %d events", len(rows))
        return len(rows)


async def serve() -> None:
    shutdown = Shutdown()
    shutdown.install()
    database_url = setting("ORDERS_DATABASE_URL")
    await asyncio.to_thread(schema.ensure, database_url, schema.ORDERS)
    topology = Topology.from_environment()
    async with (
        await psycopg.AsyncConnection.connect(database_url, autocommit=True) as connection,
        await aio_pika.connect_robust(amqp_url()) as broker,
    ):
        # Confirms on; an unroutable event raises rather than vanishing.
        channel = await broker.channel(publisher_confirms=True, on_return_raises=True)
        exchange, _ = await topology.declare(channel)
        log.info("relay started")
        announce_ready()
        await Relay(connection, exchange, shutdown).run()
    log.info("stopped")


def main() -> None:
    run_component("relay", serve)


if __name__ == "__main__":
    main()
