"""Consuming with manual acks and a graceful stop, shared by both consumers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from .common import Shutdown, Topology, amqp_url, announce_ready

log = logging.getLogger("orders_example.consumer")

Handler = Callable[[AbstractIncomingMessage], Awaitable[None]]


async def consume(queue_of: Callable[[Topology], str], prefetch: int, handle: Handler) -> None:
    """Consumes the queue until SIGTERM; then stops taking messages, lets the ones in hand finish
    and be acked, and closes the connection, which hands any unacked message back to the broker
    for redelivery. `handle` acks (or nacks) each message itself."""
    shutdown = Shutdown()
    shutdown.install()
    topology = Topology.from_environment()
    in_hand: set[asyncio.Task[None]] = set()

    async def on_message(message: AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        assert task is not None
        in_hand.add(task)
        try:
            await handle(message)
        except Exception:
            # Unexpected (the consumer's own database down, say): hand the message back rather
            # than hold it unacked, which with a prefetch of one would stall the consumer.
            log.exception("message %s not handled; requeued", message.message_id)
            with contextlib.suppress(Exception):
                await message.nack(requeue=True)
        finally:
            in_hand.discard(task)

    # Robust: reconnects and resumes consuming if the broker connection drops; the messages
    # that were in hand when it dropped are redelivered by the broker.
    async with await aio_pika.connect_robust(amqp_url()) as broker:
        channel = await broker.channel()
        await channel.set_qos(prefetch_count=prefetch)
        _, queues = await topology.declare(channel)
        queue = queues[queue_of(topology)]
        tag = await queue.consume(on_message)
        log.info("consuming %s", queue.name)
        announce_ready()
        await shutdown.requested.wait()
        await queue.cancel(tag)
        if in_hand:
            log.info("finishing %d messages in hand", len(in_hand))
            await asyncio.gather(*in_hand, return_exceptions=True)
    log.info("stopped")
