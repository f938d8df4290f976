"""`run_once` against the real coordinator, on PostgreSQL and on SQLite."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from support import (
    Coordinator,
    LogWatch,
    RawService,
    ReplyDroppingProxy,
    StartCoordinator,
    await_condition,
    unique_key,
)

from idempotency_client import (
    FingerprintMismatch,
    IdempotencyClient,
    InProgress,
    InvalidArgument,
    Lease,
    LeaseLost,
    Outcome,
    fingerprint_of,
)

NAMESPACE = "orders"
ORDER = {"order_id": 42, "amount": {"currency": "EUR", "cents": 1999}}
SIGNAL_LIMIT = 10.0


class Counter:
    """Counts how often a work ran, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> int:
        with self._lock:
            self.value += 1
            return self.value


@pytest.fixture
def key() -> str:
    """A key of the test's own."""
    return unique_key()


@pytest.fixture
def runs() -> Counter:
    """How often the test's work ran."""
    return Counter()


def test_two_concurrent_callers_run_the_work_once(
    coordinator: Coordinator, watch_log: Callable[[str], LogWatch], key: str, runs: Counter
) -> None:
    holding = threading.Event()
    second_answered = threading.Event()
    try_starts = watch_log("claiming key")

    def charge(lease: Lease) -> dict[str, Any]:
        runs.add()
        holding.set()
        return {"charge": "ch_1", "attempt": lease.attempt}

    def slow_charge(lease: Lease) -> dict[str, Any]:
        value = charge(lease)
        # Finish only once the other caller has sent its TryStart, and while this holder
        # still holds, it is not answered: it waits on the service rather than polling.
        assert try_starts.reached(2, SIGNAL_LIMIT)
        assert not second_answered.wait(0.5)
        return value

    def second_caller(client: IdempotencyClient) -> Outcome[Any]:
        try:
            return client.run_once(NAMESPACE, key, charge, request=ORDER, wait=10)
        finally:
            second_answered.set()

    with (
        IdempotencyClient(coordinator.address) as first,
        IdempotencyClient(coordinator.address) as second,
        ThreadPoolExecutor(2) as pool,
    ):
        first_run = pool.submit(first.run_once, NAMESPACE, key, slow_charge, request=ORDER)
        assert holding.wait(SIGNAL_LIMIT)
        second_run = pool.submit(second_caller, second)
        first_outcome = first_run.result(30)
        finished_at = time.monotonic()
        second_outcome = second_run.result(30)
        answered_after = time.monotonic() - finished_at

    assert runs.value == 1
    assert first_outcome.value == second_outcome.value == {"charge": "ch_1", "attempt": 1}
    assert [first_outcome.replayed, second_outcome.replayed] == [False, True]
    # Woken by the holder's Complete, having sent exactly one TryStart (one per caller).
    assert answered_after < 3
    assert try_starts.count == 2


def test_work_that_raises_releases_the_key_and_the_next_call_runs_it_again(
    coordinator: Coordinator, raw: RawService, key: str, runs: Counter
) -> None:
    def flaky_charge(lease: Lease) -> str:
        if runs.add() == 1:
            raise ConnectionError("the payment provider hung up")
        return "ch_2"

    with IdempotencyClient(coordinator.address) as client:
        with pytest.raises(ConnectionError, match="hung up"):
            client.run_once(NAMESPACE, key, flaky_charge, request=ORDER)
        assert raw.state(NAMESPACE, key) == "absent"

        outcome = client.run_once(NAMESPACE, key, flaky_charge, request=ORDER)

    assert (outcome.value, outcome.replayed, runs.value) == ("ch_2", False, 2)
    assert raw.lookup(NAMESPACE, key).completed.response == b'"ch_2"'


def test_a_stored_final_error_is_replayed_instead_of_running_again(
    coordinator: Coordinator, key: str, runs: Counter
) -> None:
    class CardDeclined(Exception):
        pass

    def declined(lease: Lease) -> dict[str, Any]:
        runs.add()
        raise CardDeclined("insufficient funds")

    def as_http_answer(error: Exception) -> dict[str, Any] | None:
        # Like Stripe, a client error (4xx) is the operation's final answer; anything else is
        # released so that a retry runs again.
        if isinstance(error, CardDeclined):
            return {"status": 402, "error": str(error)}
        return None

    with IdempotencyClient(coordinator.address) as client:
        first = client.run_once(
            NAMESPACE, key, declined, request=ORDER, error_result=as_http_answer
        )
        again = client.run_once(
            NAMESPACE, key, declined, request=ORDER, error_result=as_http_answer
        )

    assert first.value == again.value == {"status": 402, "error": "insufficient funds"}
    assert (first.replayed, again.replayed, runs.value) == (False, True, 1)


def test_heartbeat_keeps_work_three_times_longer_than_its_lease_the_only_holder(
    coordinator: Coordinator, raw: RawService, key: str
) -> None:
    lease_ttl = 1.0
    answers_meanwhile: list[str | None] = []

    def long_work(lease: Lease) -> str:
        started = time.monotonic()
        while time.monotonic() - started < 3 * lease_ttl:
            time.sleep(lease_ttl / 2)  # the work's own duration, not a synchronisation
            # Another caller with the same request would take an expired lease over.
            answer = raw.try_start(NAMESPACE, key, fingerprint_of(ORDER), attempt_id="intruder")
            answers_meanwhile.append(answer.WhichOneof("outcome"))
        return "done"

    with IdempotencyClient(coordinator.address) as client:
        outcome = client.run_once(NAMESPACE, key, long_work, request=ORDER, lease_ttl=lease_ttl)

    assert (outcome.value, outcome.replayed) == ("done", False)
    assert len(answers_meanwhile) >= 6
    assert set(answers_meanwhile) == {"in_progress"}
    assert raw.lookup(NAMESPACE, key).completed.response == b'"done"'


def test_a_lost_lease_cancels_the_work_and_the_new_holders_result_stands(
    coordinator: Coordinator, raw: RawService, key: str
) -> None:
    holding = threading.Event()
    second_finished = threading.Event()
    cancellation_seen: list[bool] = []
    second_attempt: list[int] = []
    handed_over: list[bytes | None] = []

    def stalled_work(lease: Lease) -> str:
        lease.save_checkpoint(b"step-1")
        holding.set()
        assert second_finished.wait(SIGNAL_LIMIT)
        cancellation_seen.append(lease.cancelled.wait(SIGNAL_LIMIT))
        return "first"

    def takeover_work(lease: Lease) -> str:
        second_attempt.append(lease.attempt)
        handed_over.append(lease.checkpoint)
        return "second"

    with (
        IdempotencyClient(coordinator.address) as first,
        IdempotencyClient(coordinator.address) as second,
        ThreadPoolExecutor(1) as pool,
    ):
        # The first holder's heartbeat beats only after its 0.5 s lease has run out, the way a
        # stalled process would, so that the second caller can take the key over.
        first_run = pool.submit(
            first.run_once,
            NAMESPACE,
            key,
            stalled_work,
            request=ORDER,
            lease_ttl=0.5,
            heartbeat=2.0,
        )
        assert holding.wait(SIGNAL_LIMIT)
        taken_over = second.run_once(NAMESPACE, key, takeover_work, request=ORDER, wait=10)
        second_finished.set()
        with pytest.raises(LeaseLost):
            first_run.result(30)
        replay = second.run_once(NAMESPACE, key, takeover_work, request=ORDER)

    assert (taken_over.value, taken_over.replayed, second_attempt) == ("second", False, [2])
    assert cancellation_seen == [True]
    assert handed_over == [b"step-1"]
    assert raw.lookup(NAMESPACE, key).completed.response == b'"second"'
    assert (replay.value, replay.replayed) == ("second", True)


def test_try_start_is_retried_until_a_restarted_server_answers(
    coordinator: Coordinator,
    raw: RawService,
    watch_log: Callable[[str], LogWatch],
    key: str,
    runs: Counter,
) -> None:
    attempts: list[int] = []
    retrying = watch_log("TryStart failed")

    def charge(lease: Lease) -> str:
        runs.add()
        attempts.append(lease.attempt)
        return "ch_3"

    with IdempotencyClient(coordinator.address) as client, ThreadPoolExecutor(1) as pool:
        coordinator.stop()
        run = pool.submit(client.run_once, NAMESPACE, key, charge, request=ORDER)
        assert retrying.seen.wait(SIGNAL_LIMIT), "TryStart was not retried"
        coordinator.start()
        outcome = run.result(60)
        replay = client.run_once(NAMESPACE, key, charge, request=ORDER)

    assert (outcome.value, outcome.replayed) == ("ch_3", False)
    assert (runs.value, attempts) == (1, [1])
    assert (replay.value, replay.replayed) == ("ch_3", True)
    assert raw.lookup(NAMESPACE, key).completed.response == b'"ch_3"'


def test_a_try_start_whose_answer_was_lost_is_retried_into_the_same_claim(
    coordinator: Coordinator, raw: RawService, key: str, runs: Counter
) -> None:
    attempts: list[int] = []

    def charge(lease: Lease) -> str:
        runs.add()
        attempts.append(lease.attempt)
        return "ch_4"

    proxy = ReplyDroppingProxy(coordinator.address)
    try:
        with (
            IdempotencyClient(proxy.address, call_timeout=1.0) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            # A call that sets the connection up, then the answers go missing.
            assert client.mark_processed("proxy-warmup", [key]) == [key]
            proxy.drop_replies()
            # The lease (30 s) outlives the test: a retry with a new attempt_id would find the
            # key in progress and, with no wait, fail with InProgress instead of running.
            run = pool.submit(client.run_once, NAMESPACE, key, charge, request=ORDER)
            await_condition(
                lambda: raw.state(NAMESPACE, key) == "in_progress", "the first TryStart's claim"
            )
            assert runs.value == 0
            proxy.heal()
            outcome = run.result(30)
    finally:
        proxy.close()

    assert (outcome.value, outcome.replayed) == ("ch_4", False)
    assert (runs.value, attempts) == (1, [1])
    assert raw.lookup(NAMESPACE, key).completed.response == b'"ch_4"'


def test_a_key_reused_for_another_request_is_a_fingerprint_mismatch(
    coordinator: Coordinator, key: str, runs: Counter
) -> None:
    def charge(lease: Lease) -> int:
        return runs.add()

    same_order_reordered = {"amount": {"cents": 1999, "currency": "EUR"}, "order_id": 42}
    with IdempotencyClient(coordinator.address) as client:
        client.run_once(NAMESPACE, key, charge, request=ORDER)
        replay = client.run_once(NAMESPACE, key, charge, request=same_order_reordered)
        with pytest.raises(FingerprintMismatch):
            client.run_once(NAMESPACE, key, charge, request={**ORDER, "order_id": 43})

    assert (replay.value, replay.replayed, runs.value) == (1, True, 1)


def test_a_key_held_past_the_callers_wait_is_in_progress_with_a_retry_time(
    coordinator: Coordinator, raw: RawService, watch_log: Callable[[str], LogWatch], key: str
) -> None:
    held = raw.try_start(NAMESPACE, key, fingerprint_of(ORDER), attempt_id="holder")
    assert held.WhichOneof("outcome") == "started"

    try_starts = watch_log("claiming key")
    with IdempotencyClient(coordinator.address) as client:
        waited_from = time.monotonic()
        with pytest.raises(InProgress) as caught:
            client.run_once(NAMESPACE, key, lambda lease: "never", request=ORDER, wait=1.5)
        waited = time.monotonic() - waited_from

    assert caught.value.attempt == 1
    assert 20 < caught.value.retry_after <= 30  # the holder's default 30 s lease
    # The service held the one TryStart for the caller's limit, then answered.
    assert 1.2 <= waited < 4
    assert try_starts.count == 1


def test_a_service_at_its_waiter_limit_is_asked_again_after_pauses_not_hammered(
    start_coordinator: StartCoordinator, watch_log: Callable[[str], LogWatch], key: str
) -> None:
    # With no waiter slots, every TryStart is answered at once, as without `wait`.
    coordinator = start_coordinator("--max-waiters", "0")
    raw = RawService(coordinator.address)
    try:
        held = raw.try_start(NAMESPACE, key, fingerprint_of(ORDER), attempt_id="holder")
    finally:
        raw.close()
    assert held.WhichOneof("outcome") == "started"

    try_starts = watch_log("claiming key")
    with IdempotencyClient(coordinator.address) as client:
        waited_from = time.monotonic()
        with pytest.raises(InProgress):
            client.run_once(NAMESPACE, key, lambda lease: "never", request=ORDER, wait=1.5)
        waited = time.monotonic() - waited_from

    assert waited >= 1.4
    # Asked again while the limit lasted, but after pauses (50 ms growing to 1 s): a handful of
    # TryStarts, not one per round trip.
    assert 3 <= try_starts.count <= 20


def test_bad_input_is_refused_by_the_service_naming_each_field(
    coordinator: Coordinator, runs: Counter
) -> None:
    with IdempotencyClient(coordinator.address) as client, pytest.raises(InvalidArgument) as caught:
        client.run_once("pay ments", "", lambda lease: runs.add(), lease_ttl=0.01)

    assert set(caught.value.fields) == {"namespace", "key", "lease_ttl"}
    assert caught.value.reason == "INVALID_ARGUMENT"
    assert runs.value == 0


def test_events_are_marked_once_and_processed_once(coordinator: Coordinator, runs: Counter) -> None:
    consumer = "billing"
    first_event, second_event = unique_key(), unique_key()
    with IdempotencyClient(coordinator.address) as client:
        assert client.mark_processed(consumer, [first_event, second_event, first_event]) == [
            first_event,
            second_event,
        ]
        assert client.mark_processed(consumer, [second_event]) == []
        with pytest.raises(InvalidArgument) as refused:
            client.mark_processed(consumer, ["evt-fine", "evt-\nbroken"])
        assert refused.value.fields == ("event_ids[1]",)
        assert client.mark_processed(consumer, ["evt-fine"]) == ["evt-fine"]

        handled = client.process_once(consumer, "evt-email-1", lambda lease: runs.add())
        redelivered = client.process_once(consumer, "evt-email-1", lambda lease: runs.add())

    assert (handled.value, handled.replayed) == (1, False)
    assert (redelivered.value, redelivered.replayed, runs.value) == (1, True, 1)
