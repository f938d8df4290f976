"""The payments consumer: charges each order once, through the payment provider.

For each OrderCreated event it calls the provider under `process_once(consumer="payments",
event_id)`, with an Idempotency-Key derived from the order (the same on every attempt, in every
process), and acks after. The coordinator makes sure only one holder at a time runs the charge
for an event and replays the result to redeliveries; a holder that died after the call but
before Complete is taken over once its lease runs out, and the new holder calls the provider
again with the same key, which the provider recognises. That last step is why the key is passed
on: the coordinator gives at most one effect per lease, the provider's key makes the charge
exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aio_pika.abc import AbstractIncomingMessage
from idempotency_client import AsyncIdempotencyClient, AsyncLease, IdempotencyError

from .common import fault_point, run_component, seconds, setting
from .consumer import consume

log = logging.getLogger("orders_example.payments")

CONSUMER = "payments"


class ProviderError(Exception):
    pass


async def run() -> None:
    lease_ttl = seconds("LEASE_TTL", 30.0)
    # A redelivery waits this long for the current holder: past its lease, it takes over.
    wait = seconds("IN_PROGRESS_WAIT", 2 * lease_ttl + 5.0)
    provider_url = setting("PROVIDER_URL", "http://127.0.0.1:8090")
    async with (
        AsyncIdempotencyClient(setting("COORDINATOR_ADDRESS", "127.0.0.1:50051")) as coordinator,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
    ):

        async def charge(event: dict[str, object]) -> str:
            # Derived from the order, never made per attempt: a retry must be recognised.
            key = f"{event['order_id']}:charge"
            async with http.post(
                f"{provider_url}/charges",
                json={"order_id": event["order_id"], "amount_cents": event["amount_cents"]},
                headers={"Idempotency-Key": key},
            ) as response:
                if response.status not in (200, 201):
                    raise ProviderError(f"provider answered {response.status}")
                answer = await response.json()
            charge_id = str(answer["charge_id"])
            await fault_point("payments.after_provider_call")
            return charge_id

        async def handle(message: AbstractIncomingMessage) -> None:
            event = json.loads(message.body)

            async def work(lease: AsyncLease) -> str:
                if lease.attempt > 1:
                    log.warning(
                        "event %s taken over from a holder whose lease ran out (attempt %d)",
                        event["event_id"],
                        lease.attempt,
                    )
                return await charge(event)

            try:
                outcome = await coordinator.process_once(
                    CONSUMER,
                    event["event_id"],
                    work,
                    request={"order_id": event["order_id"], "amount_cents": event["amount_cents"]},
                    lease_ttl=lease_ttl,
                    wait=wait,
                )
            except (IdempotencyError, ProviderError, aiohttp.ClientError, TimeoutError):
                # Nothing was completed (a failed work releases its key): hand the event back.
                log.exception("event %s not handled; requeued", event["event_id"])
                await asyncio.sleep(0.2)  # back off before the broker hands it out again
                await message.nack(requeue=True)
                return
            await message.ack()
            log.info(
                "order %s charged as %s%s",
                event["order_id"],
                outcome.value,
                " (replayed)" if outcome.replayed else "",
            )

        await consume(lambda topology: topology.payments_queue, 1, handle)


def main() -> None:
    run_component("payments", run)


if __name__ == "__main__":
    main()
