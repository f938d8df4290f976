"""The story end to end: each scenario runs the whole example as real processes on real
PostgreSQL and RabbitMQ, places orders with client retries, injects one of the write-up's faults
with a real signal, and then counts: one order per key, every order published, charged exactly
once by the provider's own count, and notified once after deduplication."""

from __future__ import annotations

import signal
from pathlib import Path

from harness import (
    ORDER_COUNT,
    RESULTS,
    Counts,
    Driver,
    Process,
    System,
    await_condition,
    running_system,
)

SHORT_LEASE = "2"  # seconds: how long a dead holder blocks its key in scenarios 1 and 4


def start_back_end(system: System, *skip: str) -> dict[str, Process]:
    """The relay, two payments consumers and the notifications consumer, less `skip`."""
    started: dict[str, Process] = {}
    for name, component in (
        ("relay", "relay"),
        ("payments-1", "payments"),
        ("payments-2", "payments"),
        ("notifications", "notifications"),
    ):
        if name not in skip:
            started[name] = system.start(component)
    return started


def place_orders(system: System) -> Driver:
    """Starts the client placing ORDER_COUNT orders with the API (which must be started)."""
    driver = Driver(system.run_id, system.api_address, ORDER_COUNT)
    driver.start()
    return driver


def start_with_faulty_relay(system: System, point: str, action: str) -> tuple[Process, Driver]:
    """Starts a relay whose fault hook acts (`action`) at `point` in its second batch, the rest
    of the example, and the client placing orders."""
    relay = system.start("relay", **system.fault(point, action, after=2))
    start_back_end(system, "relay")
    system.start("api")
    return relay, place_orders(system)


def publishing_rows(system: System) -> list[str]:
    """The outbox rows a relay has claimed and not yet marked published."""
    rows = system.orders_query("SELECT id::text FROM outbox WHERE status = 'PUBLISHING'")
    return [row[0] for row in rows]


def claims_of(system: System, event_ids: list[str]) -> dict[str, int]:
    """How many times a relay claimed each of the outbox rows."""
    query = "SELECT id::text, claims FROM outbox WHERE id::text = ANY(%s)"
    return dict(system.orders_query(query, event_ids))


def settle(system: System, driver: Driver) -> None:
    driver.join()
    system.await_settled(ORDER_COUNT)


def check(system: System, driver: Driver, repeated_provider_keys: int = 0) -> Counts:
    """The assertions every scenario shares; returns (and reports) the scenario's counts."""
    counts = system.counts(driver)
    RESULTS.append(counts)
    failed = {record.key: record.error for record in driver.records if record.error}
    assert not failed, f"orders the client could not place: {failed}"

    # Orders created = distinct keys sent, and every answer for a key names its one order.
    orders = dict(system.orders_query("SELECT idempotency_key, id::text FROM orders"))
    assert counts.orders_created == counts.keys_sent == ORDER_COUNT
    assert set(orders) == {record.key for record in driver.records}
    for index, record in enumerate(driver.records):
        assert {answer[1]["order_id"] for answer in record.answers} == {orders[record.key]}
        if index % 4 == 0:
            # Sent again after its answer: replayed from the coordinator, not run again.
            assert len(record.answers) == 2
            assert record.answers[1][2], f"{record.key}: the second answer was not a replay"

    # Nothing lost on the way out: one outbox row per order, every one PUBLISHED.
    outbox = system.orders_query("SELECT id::text, aggregate_id::text, status FROM outbox")
    assert sorted(row[1] for row in outbox) == sorted(orders.values())
    assert {row[2] for row in outbox} == {"PUBLISHED"}
    event_ids = {row[0] for row in outbox}

    # Charged exactly once per order, by the provider's own count: one key per order, derived
    # from the order (a key made per attempt would show up here as an extra charge).
    calls = system.provider_calls()
    assert set(calls) == {f"{order_id}:charge" for order_id in orders.values()}
    repeated = {key: count for key, count in calls.items() if count > 1}
    assert len(repeated) == repeated_provider_keys, f"repeated provider calls: {repeated}"

    # Notified once per event after deduplication: every event in the inbox, and exactly one
    # delivery of each that the coordinator saw for the first time.
    inbox = {row[0] for row in system.notifications_query("SELECT event_id FROM inbox")}
    assert inbox == event_ids
    first_deliveries = dict(
        system.notifications_query(
            "SELECT event_id, count(*) FROM delivery WHERE first_time GROUP BY event_id"
        )
    )
    assert first_deliveries == dict.fromkeys(event_ids, 1)
    return counts


def test_1_api_killed_after_commit_before_answering(tmp_path: Path) -> None:
    with running_system("1 API kill -9 after commit", tmp_path) as system:
        start_back_end(system)
        api = system.start(
            "api",
            LEASE_TTL=SHORT_LEASE,
            **system.fault("api.after_commit", "kill", after=ORDER_COUNT // 3),
        )
        driver = place_orders(system)
        assert api.wait(60) == -signal.SIGKILL
        restarted = system.start("api", LEASE_TTL=SHORT_LEASE)
        settle(system, driver)

        # Some request was cut off by the crash, and its retry was answered (check() asserts
        # that the answer names the one order of its key).
        assert [record for record in driver.records if record.failed_attempts]
        # The request killed after its commit left its key in progress; its retry took the key
        # over after the lease and found the committed order instead of making a second one.
        assert "order for a taken-over key was already committed" in restarted.log()
        check(system, driver)


def test_2_relay_killed_after_publishing_before_marking(tmp_path: Path) -> None:
    with running_system("2 relay kill -9 after publish", tmp_path) as system:
        relay, driver = start_with_faulty_relay(system, "relay.after_publish", "kill")
        assert relay.wait(60) == -signal.SIGKILL
        stranded = publishing_rows(system)
        assert stranded, "the killed relay's batch should be left PUBLISHING"
        system.start("relay")
        settle(system, driver)

        # The replacement reset the stranded batch after the stuck timeout and published it a
        # second time: claimed twice, and delivered twice to the notifications consumer.
        assert claims_of(system, stranded) == dict.fromkeys(stranded, 2)
        await_delivered_twice(system, stranded)
        counts = check(system, driver)
        assert counts.events_republished == len(stranded)
        assert counts.redeliveries_skipped >= len(stranded)


def await_delivered_twice(system: System, event_ids: list[str]) -> None:
    def delivered_twice() -> bool:
        deliveries = dict(
            system.notifications_query(
                "SELECT event_id, count(*) FROM delivery WHERE event_id = ANY(%s)"
                " GROUP BY event_id",
                event_ids,
            )
        )
        return len(deliveries) == len(event_ids) and min(deliveries.values()) >= 2

    await_condition(delivered_twice, "the republished events to reach notifications twice")


def test_3_relay_stuck_holding_publishing_rows(tmp_path: Path) -> None:
    with running_system("3 relay SIGSTOP holding rows", tmp_path) as system:
        stuck_relay, driver = start_with_faulty_relay(system, "relay.after_claim", "stop")
        await_condition(stuck_relay.stopped_by_signal, "the relay to stop itself")
        held = publishing_rows(system)
        assert held, "the stopped relay should hold its batch PUBLISHING"
        other_relay = system.start("relay")
        settle(system, driver)

        # The other relay reset the held rows once they were stuck, and published them.
        assert claims_of(system, held) == dict.fromkeys(held, 2)

        # Woken, the stuck relay publishes its stale batch too: a second copy of each event,
        # which the consumers deduplicate; then both relays stop cleanly.
        stuck_relay.signal(signal.SIGCONT)
        await_delivered_twice(system, held)
        assert stuck_relay.terminate_and_wait() == 0
        assert other_relay.terminate_and_wait() == 0
        counts = check(system, driver)
        assert counts.events_republished == len(held)


def test_4_payments_killed_after_the_provider_call(tmp_path: Path) -> None:
    with running_system("4 payments kill -9 after charge", tmp_path) as system:
        doomed = system.start(
            "payments",
            LEASE_TTL=SHORT_LEASE,
            **system.fault("payments.after_provider_call", "kill", after=ORDER_COUNT // 3),
        )
        survivor = system.start("payments", LEASE_TTL=SHORT_LEASE)
        start_back_end(system, "payments-1", "payments-2")
        system.start("api")
        driver = place_orders(system)
        assert doomed.wait(60) == -signal.SIGKILL
        replacement = system.start("payments", LEASE_TTL=SHORT_LEASE)
        settle(system, driver)

        # The killed holder's event was redelivered; its next holder waited out the lease, took
        # the event over and called the provider again with the same key: one key called twice,
        # and still one charge for it.
        check(system, driver, repeated_provider_keys=1)
        assert sorted(system.provider_calls().values())[-1] == 2
        takeovers = survivor.log().count("taken over") + replacement.log().count("taken over")
        assert takeovers == 1


def test_5_sigterm_to_every_component_under_load(tmp_path: Path) -> None:
    with running_system("5 SIGTERM everything, restart", tmp_path) as system:
        relay_in_batch = tmp_path / "relay-in-batch"
        components = {
            "relay": system.start(
                "relay", **system.fault("relay.after_claim", "hold", after=3, marker=relay_in_batch)
            ),
            **start_back_end(system, "relay"),
            "api": system.start("api"),
        }
        driver = place_orders(system)
        # The relay holds a claimed batch until it is told to stop: SIGTERM lands mid-batch.
        await_condition(relay_in_batch.exists, "the relay to be in the middle of a batch")
        held = publishing_rows(system)
        assert held, "the relay should be holding a claimed batch"
        answered_before = driver.answered
        for process in components.values():
            process.signal(signal.SIGTERM)
        for name, process in components.items():
            assert process.wait(30) == 0, f"{name} did not stop cleanly:\n{process.log()}"
        assert answered_before < ORDER_COUNT, "the signal should land under load"

        # The relay finished the batch it was in rather than abandoning it half way: published
        # and marked by this relay, once, not left PUBLISHING for a reset to publish again.
        assert system.orders_query("SELECT count(*) FROM outbox WHERE status = 'PUBLISHING'") == [
            (0,)
        ]
        batch = system.orders_query(
            "SELECT DISTINCT status, claims FROM outbox WHERE id::text = ANY(%s)", held
        )
        assert batch == [("PUBLISHED", 1)]
        for component in ("relay", "payments", "payments", "notifications", "api"):
            system.start(component)
        settle(system, driver)
        check(system, driver)


def test_6_coordinator_restarted_under_load(tmp_path: Path) -> None:
    with running_system("6 coordinator restart", tmp_path) as system:
        start_back_end(system)
        system.start("api")
        driver = place_orders(system)
        await_condition(lambda: driver.answered >= ORDER_COUNT // 3, "a third of the orders")
        coordinator = system.coordinator
        assert coordinator is not None
        assert coordinator.process.terminate_and_wait() == 0
        answered_before = driver.answered
        coordinator.start()
        assert answered_before < ORDER_COUNT, "the restart should land under load"
        settle(system, driver)
        check(system, driver)


def test_7_notifications_killed_between_its_commit_and_the_record(tmp_path: Path) -> None:
    with running_system("7 notifications kill -9 before mark", tmp_path) as system:
        doomed = system.start(
            "notifications",
            **system.fault("notifications.after_commit", "kill", after=ORDER_COUNT // 3),
        )
        start_back_end(system, "notifications")
        system.start("api")
        driver = place_orders(system)
        assert doomed.wait(60) == -signal.SIGKILL
        system.start("notifications")
        settle(system, driver)

        # The killed delivery had committed its inbox row but was never recorded: redelivered,
        # its handling ran again (the inbox row is still one) and the record says first time.
        # Recording before the commit would have lost the event here; the shared checks would
        # then find it missing from the inbox.
        counts = check(system, driver)
        assert counts.redeliveries_skipped == 0
