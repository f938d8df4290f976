"""The notifications consumer: puts one message per order in the customer's inbox.

Its handling is harmless to repeat (the inbox row is keyed by the event id), so it needs no
claim before the work: it commits the inbox row in its own database, then records the event with
`mark_processed`, the coordinator's `processed_event`. Recording after the commit means a crash
between the two repeats the handling, never loses it; recording first would lose the event if
the process died before its commit. The answer says whether this delivery was the first; a
redelivery is recorded as such and acked without sending anything more.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aio_pika.abc import AbstractIncomingMessage
from idempotency_client import AsyncIdempotencyClient, IdempotencyError
from psycopg_pool import AsyncConnectionPool

from . import schema
from .common import fault_point, run_component, setting
from .consumer import consume

log = logging.getLogger("orders_example.notifications")

CONSUMER = "notifications"


async def run() -> None:
    database_url = setting("NOTIFICATIONS_DATABASE_URL")
    await asyncio.to_thread(schema.ensure, database_url, schema.NOTIFICATIONS)
    async with (
        AsyncConnectionPool(database_url, min_size=1, max_size=4, open=False) as pool,
        AsyncIdempotencyClient(setting("COORDINATOR_ADDRESS", "127.0.0.1:50051")) as coordinator,
    ):

        async def handle(message: AbstractIncomingMessage) -> None:
            event = json.loads(message.body)
            event_id: str = event["event_id"]
            async with pool.connection() as connection:
                await connection.execute(
                    "INSERT INTO inbox (event_id, order_id, message) VALUES (%s, %s, %s)"
                    " ON CONFLICT (event_id) DO NOTHING",
                    (event_id, event["order_id"], f"Order {event['order_id']} received"),
                )
            await fault_point("notifications.after_commit")
            try:
                first_time = bool(await coordinator.mark_processed(CONSUMER, [event_id]))
            except IdempotencyError:
                # Not recorded (or not known to be): the redelivery repeats the harmless handling.
                log.exception("event %s not recorded; requeued", event_id)
                await asyncio.sleep(0.2)
                await message.nack(requeue=True)
                return
            async with pool.connection() as connection:
                await connection.execute(
                    "INSERT INTO delivery (event_id, first_time) VALUES (%s, %s)",
                    (event_id, first_time),
                )
            await message.ack()
            if not first_time:
                log.info("event %s was a redelivery: skipped", event_id)

        # One message at a time. The delivery row (the example's report of redeliveries) is
        # written after mark_processed; with several messages in hand, a crash at the hook
        # point could fall between another message's mark and its delivery row, and the report
        # would lose that row (the notification itself is safe either way).
        await consume(lambda topology: topology.notifications_queue, 1, handle)


def main() -> None:
    run_component("notifications", run)


if __name__ == "__main__":
    main()
