"""The vectors and defaults in clients/conformance, which every client passes: fingerprints of
JSON texts, the defaults table, and a result that could not be stored."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2
from support import REPO, Coordinator, RawService, unique_key
from test_failures import rich_status

from idempotency_client import (
    AsyncIdempotencyClient,
    AsyncLease,
    CallError,
    CanonicalJsonError,
    IdempotencyClient,
    Lease,
    Overloaded,
    RateLimited,
    ResultNotStored,
    RetryPolicy,
    Unavailable,
    canonical_json,
    canonical_json_text,
    fingerprint_of,
    fingerprint_of_json,
)
from idempotency_client._core import (
    DEFAULT_LEASE_TTL,
    DEFAULT_WAIT,
    HEARTBEAT_DIVISOR,
    JITTER_LOW_FRACTION,
    RunSpec,
    is_transient,
    refused_at_the_door,
)
from idempotency_client.errors import error_from_status

CONFORMANCE = REPO / "clients" / "conformance"


def load(name: str) -> Any:
    return json.loads((CONFORMANCE / name).read_text(encoding="utf-8"))


VECTORS: list[dict[str, str]] = load("fingerprints.json")["cases"]


@pytest.mark.parametrize("case", VECTORS, ids=[case["name"] for case in VECTORS])
def test_fingerprint_vectors(case: dict[str, str]) -> None:
    text = case["input"]
    if "error" in case:
        with pytest.raises(CanonicalJsonError) as refused:
            fingerprint_of_json(text)
        assert refused.value.reason == case["error"], refused.value
        # The same text as UTF-8 bytes (a request body as it arrived) is refused alike.
        with pytest.raises(CanonicalJsonError):
            canonical_json_text(text.encode("utf-8"))
        return
    canonical = case["canonical"].encode("utf-8")
    assert canonical_json_text(text) == canonical
    assert canonical_json_text(text.encode("utf-8")) == canonical
    assert fingerprint_of_json(text).hex() == case["sha256"]
    # The value the text holds, as json.loads reads it, has the same fingerprint.
    assert fingerprint_of(json.loads(text)).hex() == case["sha256"]


def test_nfc_and_nfd_spellings_have_different_fingerprints() -> None:
    assert fingerprint_of("\u00e9") != fingerprint_of("e\u0301")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (2**53, "unsafe_integer"),
        (-(2**53), "unsafe_integer"),
        ({"amount": 10**20}, "unsafe_integer"),
        (math.nan, "number_out_of_range"),
        ([math.inf], "number_out_of_range"),
        ("\ud800", "lone_surrogate"),
        ({"\udc00": 1}, "lone_surrogate"),
        ({1: "a"}, "not_json"),
        ({1, 2}, "not_json"),
    ],
)
def test_values_json_cannot_carry_exactly_are_refused(value: object, reason: str) -> None:
    with pytest.raises(CanonicalJsonError) as refused:
        fingerprint_of(value)
    assert refused.value.reason == reason
    # A ValueError too, as the rfc8785 errors it replaces were.
    assert isinstance(refused.value, ValueError)


def test_integers_within_the_safe_range_and_doubles_are_accepted() -> None:
    assert canonical_json([2**53 - 1, -(2**53 - 1)]) == b"[9007199254740991,-9007199254740991]"
    # A float is a double already: it is written as ECMAScript writes it, not refused.
    assert canonical_json(float(2**53)) == b"9007199254740992"
    assert canonical_json(1e21) == b"1e+21"


def test_the_defaults_are_the_conformance_table() -> None:
    defaults = load("defaults.json")
    policy = RetryPolicy()
    spec = RunSpec.build("orders", "k")
    client = IdempotencyClient("127.0.0.1:1")
    try:
        call_timeout = client.call_timeout
    finally:
        client.close()

    assert call_timeout * 1000 == defaults["call_timeout_ms"]
    retry = defaults["retry"]
    assert policy.total * 1000 == retry["budget_ms"]
    assert policy.initial_delay * 1000 == retry["initial_backoff_ms"]
    assert policy.max_delay * 1000 == retry["max_backoff_ms"]
    assert policy.multiplier == retry["multiplier"]
    assert retry["jitter_low_fraction"] == JITTER_LOW_FRACTION
    assert DEFAULT_LEASE_TTL * 1000 == spec.lease_ttl * 1000 == defaults["lease_ttl_ms"]
    assert defaults["heartbeat_divisor"] == HEARTBEAT_DIVISOR
    assert spec.heartbeat_interval == spec.lease_ttl / defaults["heartbeat_divisor"]
    assert DEFAULT_WAIT * 1000 == spec.wait * 1000 == defaults["wait_ms"]
    # The pauses: each between the low fraction of its step and the whole step, the steps
    # growing by the multiplier up to the largest.
    step = retry["initial_backoff_ms"] / 1000
    pauses = policy.delays()
    for _ in range(8):
        pause = next(pauses)
        assert step * retry["jitter_low_fraction"] <= pause <= step
        step = min(retry["max_backoff_ms"] / 1000, step * retry["multiplier"])


def test_a_result_the_coordinator_could_not_store_is_raised_with_the_result(
    coordinator: Coordinator,
) -> None:
    key = unique_key()
    result = {"charge": "ch_1", "amount": 1999}

    def charge_then_lose_the_coordinator(lease: Lease) -> dict[str, Any]:
        coordinator.kill()
        return result

    with (
        IdempotencyClient(coordinator.address, retry=RetryPolicy(total=1.0)) as client,
        pytest.raises(ResultNotStored) as not_stored,
    ):
        client.run_once(NAMESPACE, key, charge_then_lose_the_coordinator, heartbeat=False)

    assert not_stored.value.result == result
    assert isinstance(not_stored.value.error, Unavailable)
    assert not_stored.value.__cause__ is not_stored.value.error
    assert not_stored.value.code == grpc.StatusCode.UNAVAILABLE
    # Only the result was lost: the claim is still held, and nothing is stored.
    coordinator.start()
    raw = RawService(coordinator.address)
    try:
        assert raw.state(NAMESPACE, key) == "in_progress"
    finally:
        raw.close()


def test_async_a_result_the_coordinator_could_not_store_is_raised_with_the_result(
    coordinator: Coordinator,
) -> None:
    key = unique_key()

    async def charge_then_lose_the_coordinator(lease: AsyncLease) -> str:
        coordinator.kill()
        return "ch_2"

    async def run() -> None:
        async with AsyncIdempotencyClient(
            coordinator.address, retry=RetryPolicy(total=1.0)
        ) as client:
            await client.run_once(NAMESPACE, key, charge_then_lose_the_coordinator)

    with pytest.raises(ResultNotStored) as not_stored:
        asyncio.run(run())

    assert not_stored.value.result == "ch_2"
    assert isinstance(not_stored.value.error, Unavailable)


NAMESPACE = "orders"


def test_refusals_at_the_door_are_retried_and_a_bare_resource_exhausted_is_not() -> None:
    for reason in ("RATE_LIMITED", "OVERLOADED"):
        error = error_from_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "refused",
            rich_status(code_pb2.RESOURCE_EXHAUSTED, reason, retry_after=0.3),
        )
        assert isinstance(error, RateLimited | Overloaded)
        assert is_transient(error)
        assert refused_at_the_door(error)
        assert error.retry_after == 0.3
    bare = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "message too large", None)
    assert type(bare) is CallError
    assert not is_transient(bare)
    assert not refused_at_the_door(bare)
    unreachable = error_from_status(grpc.StatusCode.UNAVAILABLE, "down", None)
    assert is_transient(unreachable)
    assert not refused_at_the_door(unreachable)
