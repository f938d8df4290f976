"""Refusals and outages surface as the contract's typed errors, after the retries they allow."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from support import (
    Coordinator,
    LogWatch,
    RawService,
    StartCoordinator,
    await_condition,
    unique_key,
)
from test_auth import new_token

from idempotency_client import (
    AlreadyCompleted,
    CallError,
    IdempotencyClient,
    InternalError,
    KeyNotFound,
    Lease,
    LeaseLost,
    RateLimited,
    RetryPolicy,
    StoreUnavailable,
    Unavailable,
)
from idempotency_client.errors import error_from_status


def test_a_rate_limited_complete_is_retried_and_a_caller_without_retries_sees_rate_limited(
    start_coordinator: StartCoordinator, tmp_path: Path, watch_log: Callable[[str], LogWatch]
) -> None:
    tokens_file = tmp_path / "tokens"
    token = new_token("orders", tokens_file)
    # One request a second: TryStart takes it, so Complete must wait for the next.
    coordinator = start_coordinator("--tokens-file", str(tokens_file), "--rate-limit", "1")
    complete_retried = watch_log("Complete failed (RATE_LIMITED")

    with IdempotencyClient(coordinator.address, token=token) as client:
        outcome = client.run_once("orders", unique_key(), lambda lease: "paid")
    no_retries = RetryPolicy(total=0)
    with (
        IdempotencyClient(coordinator.address, token=token, retry=no_retries) as impatient,
        pytest.raises(RateLimited) as limited,
    ):
        impatient.run_once("orders", unique_key(), lambda lease: "never")

    assert (outcome.value, outcome.replayed) == ("paid", False)
    assert complete_retried.seen.is_set()
    # The service says how long until the token's next call is allowed: at 1/s, at most 1 s.
    retry_after = limited.value.retry_after
    assert retry_after is not None
    assert 0.0 < retry_after <= 1.0


@pytest.fixture
def coordinator_without_its_database(tmp_path: Path) -> Iterator[Coordinator]:
    # Nothing listens on port 1: the service starts, stays NOT_SERVING, and answers every call
    # with STORE_UNAVAILABLE.
    coordinator = Coordinator(
        ["--database-url", "postgres://postgres@127.0.0.1:1/unreachable"],
        ["--operation-timeout", "1s"],
        tmp_path,
        await_serving=False,
    )
    yield coordinator
    coordinator.kill()


def test_an_unreachable_store_is_retried_then_raised_as_store_unavailable(
    coordinator_without_its_database: Coordinator, watch_log: Callable[[str], LogWatch]
) -> None:
    ran: list[str] = []
    retried = watch_log("TryStart failed (STORE_UNAVAILABLE")
    retry_briefly = RetryPolicy(total=1.5)

    with (
        IdempotencyClient(coordinator_without_its_database.address, retry=retry_briefly) as client,
        pytest.raises(StoreUnavailable) as unavailable,
    ):
        client.run_once("orders", unique_key(), lambda lease: ran.append("ran"))

    assert isinstance(unavailable.value, Unavailable)
    assert unavailable.value.retry_after == 1.0
    assert retried.seen.is_set()
    assert ran == []


def test_a_key_that_expired_under_its_work_is_a_lost_lease(
    coordinator: Coordinator, raw: RawService
) -> None:
    key = unique_key()

    def outlives_its_key(lease: Lease) -> str:
        # Without a heartbeat, the 0.2 s lease and the 1 s retention both run out.
        await_condition(lambda: raw.state("orders", key) == "absent", "the key to expire")
        return "too late"

    with IdempotencyClient(coordinator.address) as client, pytest.raises(LeaseLost) as lost:
        client.run_once(
            "orders", key, outlives_its_key, lease_ttl=0.2, retention=1, heartbeat=False
        )

    assert isinstance(lost.value.__cause__, KeyNotFound)
    assert raw.state("orders", key) == "absent"


def rich_status(
    code: int, reason: str, retry_after: float | None = None
) -> list[tuple[str, bytes]]:
    """The trailer the service sends with an error, as its status module builds it."""
    error_info = any_pb2.Any()
    error_info.Pack(error_details_pb2.ErrorInfo(domain="idempotency.v1", reason=reason))
    details = [error_info]
    if retry_after is not None:
        retry_info = any_pb2.Any()
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(retry_after * 1000))
        retry_info.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry_info)
    status = status_pb2.Status(code=code, message="refused", details=details)
    return [("grpc-status-details-bin", status.SerializeToString())]


@pytest.mark.parametrize(
    ("code", "grpc_code", "reason", "expected"),
    [
        (code_pb2.NOT_FOUND, grpc.StatusCode.NOT_FOUND, "KEY_NOT_FOUND", KeyNotFound),
        (
            code_pb2.FAILED_PRECONDITION,
            grpc.StatusCode.FAILED_PRECONDITION,
            "ALREADY_COMPLETED",
            AlreadyCompleted,
        ),
        (code_pb2.INTERNAL, grpc.StatusCode.INTERNAL, "INTERNAL", InternalError),
        (code_pb2.ABORTED, grpc.StatusCode.ABORTED, "LEASE_LOST", LeaseLost),
    ],
)
def test_reasons_the_client_cannot_provoke_through_run_once_decode_to_their_types(
    code: int, grpc_code: grpc.StatusCode, reason: str, expected: type[CallError]
) -> None:
    error = error_from_status(grpc_code, "refused", rich_status(code, reason))

    assert type(error) is expected
    assert (error.code, error.reason, error.message) == (grpc_code, reason, "refused")


def test_an_error_without_details_is_typed_by_its_code() -> None:
    error = error_from_status(grpc.StatusCode.OUT_OF_RANGE, "message too large", None)

    assert type(error) is CallError
    assert (error.reason, error.field_violations, error.retry_after) == (None, (), None)
